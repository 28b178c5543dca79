"""Session records: the ids, the errors (defined in ``service/errors.py``), ``SessionRecord`` (with its turn boundaries,
``TurnInfo``) and its compact binary codec (``encode_record``: magic, version, JSON
metadata, token ids as little-endian uint32, the turn boundaries, CRC-32), which the
Redis store writes and the fuzz tests hammer.

Turn boundaries
---------------
``SessionRecord.turn_log`` says where each completed turn starts and ends in the
transcript: per turn its input tokens, output tokens, finish reason and times. The
transcript is ``untracked prefix + (input_1 + output_1) + (input_2 + output_2) + ...``:
the log covers the *last* ``len(turn_log)`` turns. A record written before turn
boundaries existed (codec version 1) loads with an empty log, so all its turns are
untracked (``untracked_turns``, ``untracked_tokens``): they can be kept, continued and
forked after, but not rewound, regenerated or edited one by one.

Recall
------
``SessionRecord.recall`` keeps the answers the session dropped (the turn a regenerate or an
edit replaced, the turns a rewind or a resent history's rewind dropped), each after the
last ``RECALL_CONTEXT`` tokens of its prompt, the most recent last, at most
``MAX_RECALL`` of them and ``MAX_RECALL_TOKENS`` tokens in all: a later turn of the session
drafts from them (``GenerationRequest.recall``, engine/draft_pool.py), on any replica and
after a restart, so a regenerate drafts from the answer it replaces even where the
replica's draft pool never held it. They ride in the metadata (``"recall"``: base64 of
little-endian uint32 ids, only when there are some), so a record without them, written
before they existed, loads with none, and a replica that predates them reads a record
that has them (it ignores the key)."""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from ..errors import (  # noqa: F401 - the session errors are the domain's (service/errors.py), named here too
    SESSION_ID_RE,
    BadTurnCount,
    InvalidSessionId,
    SessionBusy,
    SessionConflict,
    SessionDeleted,
    SessionError,
    SessionExists,
    SessionLimit,
    SessionNotFound,
    SessionStoreUnavailable,
    TurnUnavailable,
    TurnsChanged,
)

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class SessionRecordError(ValueError):
    """A stored session record failed to decode (bad magic, version, length or checksum)."""


def check_session_id(session_id: str, what: str = "session_id") -> None:
    if not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidSessionId(f"{what} must be 1 to 128 characters of [A-Za-z0-9._:-], got {session_id[:140]!r}")


FINISH_REASONS = ("stop", "length")  # a completed turn's finish reason (FinishReason values)
MAX_TURN_LOG = 1 << 20  # turns a record may describe (the codec refuses more)


@dataclass(frozen=True, slots=True)
class TurnInfo:
    """One completed turn's place in the transcript: ``input_tokens`` new input tokens
    (the chat template's framing included) followed by ``output_tokens`` generated ones."""

    input_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" or "length"
    started_at: float  # unix seconds: the turn began
    ended_at: float  # unix seconds: the turn was committed

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


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
    turn_log: list[TurnInfo] = field(default_factory=list)  # boundaries of the last len(turn_log) turns
    # The session this one was forked from ("" if none): deleting this one leaves the KV
    # blocks of the transcript prefix it still has in common with that one.
    forked_from: str = ""
    # A front's own state for the session, written with its turns and ops (the
    # Conversations API's items and metadata, as JSON; "" for a plain session).
    attachment: str = ""
    # answers the session dropped (regenerate, edit, rewind), each after the last tokens
    # of its prompt, most recent last (module docstring, Recall)
    recall: list[list[int]] = field(default_factory=list)

    @property
    def untracked_turns(self) -> int:
        """Leading turns without recorded boundaries (written before the log existed)."""
        return self.turns - len(self.turn_log)

    @property
    def untracked_tokens(self) -> int:
        """Leading transcript tokens those turns cover."""
        return len(self.token_ids) - sum(t.tokens for t in self.turn_log)

    def turn_end(self, turns: int) -> int:
        """Transcript length after the first ``turns`` completed turns; ValueError if
        that point falls inside the untracked prefix (except at its end) or past the end."""
        if not self.untracked_turns <= turns <= self.turns:
            raise ValueError(f"turn {turns} is outside the tracked turns {self.untracked_turns}..{self.turns}")
        return self.untracked_tokens + sum(t.tokens for t in self.turn_log[: turns - self.untracked_turns])


def copy_record(rec: SessionRecord, **changes: Any) -> SessionRecord:
    """A deep enough copy of ``rec`` (its own token and turn lists), with ``changes`` set on it."""
    out = SessionRecord(
        rec.session_id, rec.owner, list(rec.token_ids), rec.created_at, rec.last_used_at, rec.turns,
        rec.cache_salt, rec.etag, list(rec.turn_log), rec.forked_from, rec.attachment, [list(t) for t in rec.recall],
    )  # fmt: skip
    for name, value in changes.items():
        setattr(out, name, value)
    return out


RECALL_CONTEXT = 32  # prompt tokens kept before a dropped answer (draft_pool.CONTEXT)
MAX_RECALL = 4  # dropped answers a record keeps
MAX_RECALL_TOKENS = 4096  # their tokens at most, contexts included


def dropped_answers(rec: SessionRecord, turns: int) -> list[list[int]]:
    """The answers of the last ``turns`` tracked turns of ``rec`` (fewer where fewer are
    tracked), each after the last RECALL_CONTEXT tokens of its prompt, oldest first."""
    out: list[list[int]] = []
    end = len(rec.token_ids)
    for info in reversed(rec.turn_log[len(rec.turn_log) - min(turns, len(rec.turn_log)) :]):
        start = end - info.output_tokens
        if info.output_tokens:
            out.append(rec.token_ids[max(start - RECALL_CONTEXT, 0) : end])
        end = start - info.input_tokens
    return out[::-1]


def with_recall(recall: list[list[int]], dropped: list[list[int]]) -> list[list[int]]:
    """``recall`` with ``dropped`` after it, the oldest let go past MAX_RECALL entries or
    MAX_RECALL_TOKENS tokens (an answer longer than that keeps its first tokens)."""
    out: list[list[int]] = []
    left = MAX_RECALL_TOKENS
    for text in reversed([*recall, *dropped]):
        if len(out) == MAX_RECALL or left <= 0:
            break
        out.append(list(text[:left]))
        left -= len(out[-1])
    return out[::-1]


# ----------------------------------------------------------------------------- record codec

_MAGIC = b"KVSS"
_VERSION = 2  # 2: the turn boundaries after the tokens (1 had none; still read)
_HEAD = struct.Struct("<4sHI")  # magic, version, metadata length
_COUNT = struct.Struct("<I")
_TURN = struct.Struct("<IIBdd")  # input tokens, output tokens, finish reason (index + 1), started, ended
_CRC = struct.Struct("<I")
_MAX_META = 1 << 24  # a conversation's items ride in the metadata (``attachment``)


def encode_record(rec: SessionRecord) -> bytes:
    """``magic | u16 version | u32 n | n bytes JSON meta | u32 t | t * u32le tokens |
    u32 k | k * (u32 input, u32 output, u8 finish, f64 started, f64 ended) | u32 crc32``."""
    meta = json.dumps(
        {
            "session_id": rec.session_id,
            "owner": rec.owner,
            "created_at": rec.created_at,
            "last_used_at": rec.last_used_at,
            "turns": rec.turns,
            "cache_salt": rec.cache_salt,
            "etag": rec.etag,
            "forked_from": rec.forked_from,
            **({"attachment": rec.attachment} if rec.attachment else {}),
            **({"recall": [_pack_ids(t) for t in rec.recall]} if rec.recall else {}),
        },
        separators=(",", ":"),
    ).encode()
    tokens = struct.pack(f"<{len(rec.token_ids)}I", *rec.token_ids)
    log = b"".join(
        _TURN.pack(t.input_tokens, t.output_tokens, FINISH_REASONS.index(t.finish_reason) + 1, t.started_at, t.ended_at)
        for t in rec.turn_log
    )
    body = (
        _HEAD.pack(_MAGIC, _VERSION, len(meta)) + meta + _COUNT.pack(len(rec.token_ids)) + tokens
        + _COUNT.pack(len(rec.turn_log)) + log
    )  # fmt: skip
    return body + _CRC.pack(zlib.crc32(body))


def decode_record(data: bytes) -> SessionRecord:
    """Inverse of ``encode_record`` (and reads version 1, which has no turn boundaries);
    raises SessionRecordError on any inconsistency."""
    if len(data) < _HEAD.size + _COUNT.size + _CRC.size:
        raise SessionRecordError(f"record too short ({len(data)} bytes)")
    body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
    magic, version, meta_len = _HEAD.unpack_from(body)
    if magic != _MAGIC:
        raise SessionRecordError(f"bad magic {magic!r}")
    if version not in (1, _VERSION):
        raise SessionRecordError(f"unsupported record version {version}")
    if zlib.crc32(body) != crc:
        raise SessionRecordError("checksum mismatch")
    if meta_len > _MAX_META or _HEAD.size + meta_len + _COUNT.size > len(body):
        raise SessionRecordError(f"bad metadata length {meta_len}")
    pos = _HEAD.size + meta_len
    (n_tokens,) = _COUNT.unpack_from(body, pos)
    pos += _COUNT.size
    end_tokens = pos + 4 * n_tokens
    turn_log: list[TurnInfo] = []
    if version == 1:
        if end_tokens != len(body):
            raise SessionRecordError(f"token count {n_tokens} does not match the record length")
    else:
        if end_tokens + _COUNT.size > len(body):
            raise SessionRecordError(f"token count {n_tokens} does not match the record length")
        (n_turns,) = _COUNT.unpack_from(body, end_tokens)
        if n_turns > MAX_TURN_LOG or end_tokens + _COUNT.size + n_turns * _TURN.size != len(body):
            raise SessionRecordError(f"turn count {n_turns} does not match the record length")
        for i in range(n_turns):
            n_in, n_out, reason, started, ended = _TURN.unpack_from(body, end_tokens + _COUNT.size + i * _TURN.size)
            if not 1 <= reason <= len(FINISH_REASONS) or not (math.isfinite(started) and math.isfinite(ended)):
                raise SessionRecordError(f"bad turn {i} (finish reason {reason}, times {started}, {ended})")
            turn_log.append(TurnInfo(n_in, n_out, FINISH_REASONS[reason - 1], started, ended))
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
            turn_log=turn_log,
            forked_from=_meta_str(meta, "forked_from", default=""),
            attachment=_meta_str(meta, "attachment", default=""),
            recall=_meta_recall(meta),
        )
    except (ValueError, KeyError, TypeError, RecursionError, binascii.Error) as e:
        raise SessionRecordError(f"bad metadata: {type(e).__name__}: {e}"[:300]) from None
    if not SESSION_ID_RE.fullmatch(rec.session_id):
        raise SessionRecordError(f"bad session id {rec.session_id[:140]!r}")
    if rec.untracked_turns < 0 or rec.untracked_tokens < 0:
        raise SessionRecordError(
            f"{len(turn_log)} turn boundaries do not fit {rec.turns} turns of {n_tokens} tokens"
        )
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


def _pack_ids(ids: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode("ascii")


def _meta_recall(meta: dict) -> list[list[int]]:
    """The metadata's ``recall`` (absent in records written before it: none)."""
    value = meta.get("recall", [])
    if not isinstance(value, list) or len(value) > MAX_TURN_LOG:
        raise TypeError(f"recall must be a list, got {type(value).__name__}")
    out = []
    for item in value:
        raw = base64.b64decode(_meta_str({"recall": item}, "recall"), validate=True)
        if len(raw) % 4:
            raise ValueError(f"a recall entry of {len(raw)} bytes is not uint32 token ids")
        out.append(list(struct.unpack(f"<{len(raw) // 4}I", raw)))
    return out
