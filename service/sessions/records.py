"""Session records: the ids, the errors, ``SessionRecord`` and its compact binary codec
(``encode_record``: magic, version, JSON metadata, token ids as little-endian uint32,
CRC-32), which the Redis store writes and the fuzz tests hammer."""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from dataclasses import dataclass, field


SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class SessionError(Exception):
    """Base of the session table's errors; the servicer maps each to a status."""


class SessionNotFound(SessionError):
    """No such session for this owner (NOT_FOUND)."""


class SessionBusy(SessionError):
    """The session has a turn in flight (FAILED_PRECONDITION)."""


class InvalidSessionId(SessionError):
    """The id is not 1-128 characters of [A-Za-z0-9._:-] (INVALID_ARGUMENT)."""


class SessionConflict(SessionError):
    """Another replica wrote the session while this turn ran; the turn is not recorded
    (FAILED_PRECONDITION)."""


class SessionLimit(SessionError):
    """The owner already holds ``max_sessions_per_owner`` sessions (RESOURCE_EXHAUSTED)."""


class SessionRecordError(ValueError):
    """A stored session record failed to decode (bad magic, version, length or checksum)."""


def check_session_id(session_id: str) -> None:
    if not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidSessionId(
            f"session_id must be 1 to 128 characters of [A-Za-z0-9._:-], got {session_id[:140]!r}"
        )


@dataclass(slots=True)
class SessionRecord:
    """What is stored per session."""

    session_id: str
    owner: str = ""  # the tenant ("" when auth is off)
    token_ids: list[int] = field(default_factory=list)  # the transcript
    created_at: float = 0.0  # unix seconds
    last_used_at: float = 0.0  # unix seconds: last turn started or finished
    turns: int = 0  # completed turns
    cache_salt: str = ""  # the request cache_salt of the last completed turn (where its KV lives)
    etag: str = ""  # id of the write that stored this version (conditional writes compare it)


# ----------------------------------------------------------------------------- record codec

_MAGIC = b"KVSS"
_VERSION = 1
_HEAD = struct.Struct("<4sHI")  # magic, version, metadata length
_COUNT = struct.Struct("<I")
_CRC = struct.Struct("<I")
_MAX_META = 1 << 16


def encode_record(rec: SessionRecord) -> bytes:
    """``magic | u16 version | u32 n | n bytes JSON meta | u32 t | t * u32le tokens | u32 crc32``."""
    meta = json.dumps(
        {
            "session_id": rec.session_id,
            "owner": rec.owner,
            "created_at": rec.created_at,
            "last_used_at": rec.last_used_at,
            "turns": rec.turns,
            "cache_salt": rec.cache_salt,
            "etag": rec.etag,
        },
        separators=(",", ":"),
    ).encode()
    tokens = struct.pack(f"<{len(rec.token_ids)}I", *rec.token_ids)
    body = _HEAD.pack(_MAGIC, _VERSION, len(meta)) + meta + _COUNT.pack(len(rec.token_ids)) + tokens
    return body + _CRC.pack(zlib.crc32(body))


def decode_record(data: bytes) -> SessionRecord:
    """Inverse of ``encode_record``; raises SessionRecordError on any inconsistency."""
    if len(data) < _HEAD.size + _COUNT.size + _CRC.size:
        raise SessionRecordError(f"record too short ({len(data)} bytes)")
    body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
    magic, version, meta_len = _HEAD.unpack_from(body)
    if magic != _MAGIC:
        raise SessionRecordError(f"bad magic {magic!r}")
    if version != _VERSION:
        raise SessionRecordError(f"unsupported record version {version}")
    if zlib.crc32(body) != crc:
        raise SessionRecordError("checksum mismatch")
    if meta_len > _MAX_META or _HEAD.size + meta_len + _COUNT.size > len(body):
        raise SessionRecordError(f"bad metadata length {meta_len}")
    pos = _HEAD.size + meta_len
    (n_tokens,) = _COUNT.unpack_from(body, pos)
    pos += _COUNT.size
    if pos + 4 * n_tokens != len(body):
        raise SessionRecordError(f"token count {n_tokens} does not match the record length")
    try:
        meta = json.loads(body[_HEAD.size : _HEAD.size + meta_len])
        if not isinstance(meta, dict):
            raise TypeError(f"metadata is a {type(meta).__name__}, not an object")
        rec = SessionRecord(
            session_id=_meta_str(meta, "session_id"),
            owner=_meta_str(meta, "owner"),
            token_ids=list(struct.unpack_from(f"<{n_tokens}I", body, pos)),
            created_at=_meta_time(meta, "created_at"),
            last_used_at=_meta_time(meta, "last_used_at"),
            turns=_meta_int(meta, "turns"),
            cache_salt=_meta_str(meta, "cache_salt", default=""),
            etag=_meta_str(meta, "etag", default=""),
        )
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SessionRecordError(f"bad metadata: {type(e).__name__}: {e}"[:300]) from None
    if not SESSION_ID_RE.fullmatch(rec.session_id):
        raise SessionRecordError(f"bad session id {rec.session_id[:140]!r}")
    return rec


def _meta_str(meta: dict, name: str, default: str | None = None) -> str:
    value = meta.get(name, default)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _meta_time(meta: dict, name: str) -> float:
    value = meta[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {str(value)[:40]}")
    return float(value)


def _meta_int(meta: dict, name: str) -> int:
    value = meta[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
        raise ValueError(f"{name} must be an integer in [0, 2^32), got {str(value)[:40]}")
    return value
