"""Server-side sessions: the exact token transcript of each conversation.

A session is a token transcript plus bookkeeping (owner, timestamps, completed turns).
The next turn's prompt is ``transcript + new input tokens``: the exact tokens the
model saw and generated, never a re-tokenization of decoded text, so every earlier
block of the conversation hashes the same and is found in the cache.

Turns and the transcript
------------------------
* One turn at a time: ``SessionManager.begin_turn`` takes the session's lock (held in
  this replica's memory and as a lease in the store, renewed while the turn runs); a
  second turn gets ``SessionBusy``. Record writes are compare-and-set on the version the
  turn started from, so whatever Redis loses (restart, FLUSHALL) no acknowledged turn is
  overwritten (see ``SessionManager``).
* A session is created by its first turn and stored right away (empty transcript), so
  it is visible (busy) while that turn runs; if that first turn does not complete
  (bad input, cancelled, failed) the session is removed again.
* A turn that completes (finish reason stop or length) commits
  ``prompt + generated tokens`` as the new transcript and counts one turn.
* **A cancelled or failed turn leaves the transcript as it was before the turn**: the
  new input and any tokens generated before the cancel are dropped. The KV blocks the
  turn computed stay in the cache (they are keyed by content), so retrying the same
  input finds the old transcript's blocks and, for full blocks of the new input, its
  own. Only ``last_used_at`` changes.

How input is appended (see ``continuation_tokens``)
----------------------------------------------------
* Token ids: appended as given.
* Text: the first turn is encoded with BOS; later turns are encoded standalone
  without BOS and appended.
* Chat messages: the first turn renders the messages with the chat template and a
  generation prompt. Later turns render **only the new messages, as a continuation**:
  the template is applied to a fixed placeholder exchange (user, assistant) with and
  without the new messages, and the text the new messages add is taken as the
  difference. What the template writes after an assistant message (its end-of-turn
  marker) is added first unless the transcript already ends with an end-of-sequence
  token (the usual case: the model emitted it and it is in the transcript). The
  transcript therefore stays a strict prefix of the conversation, turn after turn.

Storage
-------
``SessionStore`` is the small async protocol behind the table (get / put / delete /
list, plus the per-session turn lock). ``InMemorySessionStore`` keeps records in the
process; ``RedisSessionStore`` keeps one compact binary record per session
(``encode_record``: magic, version, JSON metadata, token ids as little-endian
uint32, CRC-32) with an optional TTL, so sessions survive restarts and move between
replicas. Each record carries an ``etag`` (the id of the write that stored it): writes
are conditional on it (``put_if``). ``FallbackSessionStore`` puts this process's memory
behind Redis, with per-call timeouts and a circuit breaker, so a hung Redis stalls no
turn. Sessions are keyed by ``(owner, session_id)``: another owner's session id is
simply not found.

Expiry and limits
-----------------
With ``ttl_s`` a session unused for that long is gone: Redis expires its record (the
TTL is renewed by every write, i.e. every turn), the in-memory store drops it when it
is next looked at or swept by ``SessionManager.reap`` (which also returns the expired
records, so the server can drop their KV blocks). ``max_sessions_per_owner`` caps how
many sessions one tenant holds; creating one more raises ``SessionLimit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import struct
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence
from urllib.parse import quote

log = logging.getLogger(__name__)

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


# ----------------------------------------------------------------------------- stores

# Outcomes of a conditional write (``put_if``).
WRITTEN = "written"  # the store held an expected version (or nothing, where that was expected)
RESTORED = "restored"  # the store had lost the record (restart, FLUSHALL, eviction): ours was written back
REPLACED = "replaced"  # the store held another incarnation that no turn had completed yet: overwritten
CONFLICT = "conflict"  # the store holds a version this writer did not expect: nothing written
UNKNOWN = "unknown"  # the store could not be asked (down, hung): written to this replica's copy only


@dataclass(frozen=True, slots=True)
class Expect:
    """What a conditional write expects the store to hold: a version whose etag is one
    of ``etags``, or (``absent_ok``) no record. Any other version is a conflict."""

    etags: frozenset[str] = frozenset()
    absent_ok: bool = False

    def plus(self, etag: str) -> Expect:
        return Expect(self.etags | {etag}, self.absent_ok)

    @staticmethod
    def of(rec: SessionRecord | None) -> Expect:
        return Expect(frozenset({rec.etag}), False) if rec is not None else Expect(frozenset(), True)


def new_etag() -> str:
    return uuid.uuid4().hex[:16]


def cas_outcome(stored: SessionRecord | None, expect: Expect, replace_uncommitted: bool) -> str:
    """The rule of ``put_if`` (the Redis store runs the same rule in Lua)."""
    if stored is None:
        return WRITTEN if expect.absent_ok else RESTORED
    if stored.etag in expect.etags:
        return WRITTEN
    if replace_uncommitted and stored.turns == 0:
        return REPLACED
    return CONFLICT


class SessionStore(Protocol):
    """Where session records live. All methods are coroutines.

    Contract: ``get`` returns None when the session does not exist (or its record is
    unreadable: that is logged); ``read`` also returns what a conditional write of the
    next version should expect; ``put_if`` writes unless the store holds a version
    ``expect`` does not name (see ``cas_outcome``; ``replace_uncommitted`` lets it
    overwrite another incarnation with no completed turn) and returns the outcome;
    ``delete_if`` removes the record only if it is one of ``etags`` (True if removed);
    ``delete`` returns whether it existed; ``list`` pages through one owner's sessions
    ordered by session id, ``page_token`` being the ``next_page_token`` of the previous
    page ("" at the end). The lock is a lease: ``try_lock`` takes it for ``ttl_s``
    seconds unless another holder has it (a holder whose id starts with
    ``takeover_prefix`` counts as free: the caller knows that holder is gone),
    ``refresh_lock`` extends it (False if it was lost), ``unlock`` releases it if
    ``holder`` still has it. ``count`` is how many sessions the owner holds; ``expire``
    removes the sessions whose TTL has passed and returns them (a store whose backend
    expires records by itself returns what it knows of, possibly nothing).
    """

    async def get(self, owner: str, session_id: str) -> SessionRecord | None: ...
    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]: ...
    async def put(self, rec: SessionRecord) -> None: ...
    async def put_if(self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False) -> str: ...
    async def delete(self, owner: str, session_id: str) -> bool: ...
    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool: ...
    async def list(
        self, owner: str, page_size: int, page_token: str = ""
    ) -> tuple[list[SessionRecord], str]: ...
    async def try_lock(
        self, owner: str, session_id: str, holder: str, ttl_s: float, *, takeover_prefix: str = ""
    ) -> bool: ...
    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool: ...
    async def unlock(self, owner: str, session_id: str, holder: str) -> None: ...
    async def is_locked(self, owner: str, session_id: str) -> bool: ...
    async def count(self, owner: str) -> int: ...
    async def expire(self) -> list[SessionRecord]: ...
    async def close(self) -> None: ...


class InMemorySessionStore:
    """Session records in a dict of this process (lost on restart).

    ``ttl_s``: a record whose ``last_used_at`` is older than that (by ``clock``, unix
    seconds) and that is not locked is expired: invisible at once, removed by ``expire``.
    """

    def __init__(self, *, ttl_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self._records: dict[tuple[str, str], SessionRecord] = {}
        self._locks: dict[tuple[str, str], tuple[str, float]] = {}  # key -> (holder, expiry)
        self._ttl_s = ttl_s or None
        self._clock = clock

    @staticmethod
    def _copy(rec: SessionRecord) -> SessionRecord:
        return copy_record(rec)

    def _expired(self, key: tuple[str, str], rec: SessionRecord, now: float) -> bool:
        return (
            self._ttl_s is not None
            and rec.last_used_at + self._ttl_s <= now
            and self._live_holder(key) is None
        )

    async def get(self, owner: str, session_id: str) -> SessionRecord | None:
        key = (owner, session_id)
        rec = self._records.get(key)
        if rec is None or self._expired(key, rec, self._clock()):
            return None
        return self._copy(rec)

    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]:
        rec = await self.get(owner, session_id)
        return rec, Expect.of(rec)

    async def put(self, rec: SessionRecord) -> None:
        self._records[(rec.owner, rec.session_id)] = self._copy(rec)

    async def put_if(self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False) -> str:
        outcome = cas_outcome(await self.get(rec.owner, rec.session_id), expect, replace_uncommitted)
        if outcome != CONFLICT:
            await self.put(rec)
        return outcome

    async def delete(self, owner: str, session_id: str) -> bool:
        return self._records.pop((owner, session_id), None) is not None

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        rec = self._records.get((owner, session_id))
        if rec is None or rec.etag not in etags:
            return False
        return await self.delete(owner, session_id)

    async def list(
        self, owner: str, page_size: int, page_token: str = ""
    ) -> tuple[list[SessionRecord], str]:
        now = self._clock()
        ids = sorted(
            sid
            for (o, sid), rec in self._records.items()
            if o == owner and sid > page_token and not self._expired((o, sid), rec, now)
        )
        page = ids[:page_size]
        next_token = page[-1] if len(ids) > page_size else ""
        return [self._copy(self._records[(owner, sid)]) for sid in page], next_token

    def _live_holder(self, key: tuple[str, str]) -> str | None:
        held = self._locks.get(key)
        if held is None or held[1] <= time.monotonic():
            return None
        return held[0]

    async def try_lock(
        self, owner: str, session_id: str, holder: str, ttl_s: float, *, takeover_prefix: str = ""
    ) -> bool:
        key = (owner, session_id)
        live = self._live_holder(key)
        if live is not None and not (takeover_prefix and live.startswith(takeover_prefix)):
            return False
        self._locks[key] = (holder, time.monotonic() + ttl_s)
        return True

    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        key = (owner, session_id)
        if self._live_holder(key) != holder:
            return False
        self._locks[key] = (holder, time.monotonic() + ttl_s)
        return True

    async def unlock(self, owner: str, session_id: str, holder: str) -> None:
        key = (owner, session_id)
        if self._live_holder(key) == holder:
            del self._locks[key]

    async def is_locked(self, owner: str, session_id: str) -> bool:
        return self._live_holder((owner, session_id)) is not None

    async def count(self, owner: str) -> int:
        now = self._clock()
        return sum(1 for (o, sid), rec in self._records.items() if o == owner and not self._expired((o, sid), rec, now))

    async def expire(self) -> list[SessionRecord]:
        now = self._clock()
        gone = [k for k, rec in self._records.items() if self._expired(k, rec, now)]
        out = [self._records.pop(k) for k in gone]
        # Locks are leases: forget the ones that ran out (their holder crashed or is slow).
        for k in [k for k, (_, exp) in self._locks.items() if exp <= time.monotonic()]:
            del self._locks[k]
        return out

    async def close(self) -> None:
        pass


def copy_record(rec: SessionRecord, **changes: Any) -> SessionRecord:
    out = SessionRecord(
        rec.session_id, rec.owner, list(rec.token_ids), rec.created_at, rec.last_used_at, rec.turns,
        rec.cache_salt, rec.etag,
    )  # fmt: skip
    for name, value in changes.items():
        setattr(out, name, value)
    return out


_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# Take the lock if it is free or held by a holder whose id starts with ARGV[3] (a turn of
# this replica that has ended: its unlock missed Redis, or a lock write was applied late).
_LOCK_LUA = """
local h = redis.call('GET', KEYS[1])
if h and (ARGV[3] == '' or string.sub(h, 1, #ARGV[3]) ~= ARGV[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# The stored record's metadata (encode_record: magic, u16 version, u32 n, n bytes JSON),
# nil when there is none or it cannot be read (an unreadable record counts as absent).
_META_LUA = """
local function stored_meta(v)
  if not v then return nil end
  local ok, meta = pcall(function()
    local n = struct.unpack('<I4', string.sub(v, 7, 10))
    return cjson.decode(string.sub(v, 11, 10 + n))
  end)
  if ok and type(meta) == 'table' then return meta end
  return nil
end
local function etag_of(meta)
  if type(meta['etag']) == 'string' then return meta['etag'] end
  return ''
end
"""
# put_if: ARGV = value, px (0: none), absent_ok, replace_uncommitted, etags...
# (the rule of cas_outcome).
_PUT_IF_LUA = _META_LUA + """
local meta = stored_meta(redis.call('GET', KEYS[1]))
local outcome
if meta == nil then
  if ARGV[3] == '1' then outcome = 'written' else outcome = 'restored' end
else
  local etag = etag_of(meta)
  outcome = 'conflict'
  for i = 5, #ARGV do
    if ARGV[i] == etag then outcome = 'written' end
  end
  if outcome == 'conflict' and ARGV[4] == '1' and meta['turns'] == 0 then outcome = 'replaced' end
end
if outcome ~= 'conflict' then
  if ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1])
  else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
end
return outcome
"""
# delete_if: ARGV = etags...; 1 deleted, 0 absent, -1 another version (kept).
_DELETE_IF_LUA = _META_LUA + """
local meta = stored_meta(redis.call('GET', KEYS[1]))
if meta == nil then return 0 end
local etag = etag_of(meta)
for i = 1, #ARGV do
  if ARGV[i] == etag then redis.call('DEL', KEYS[1]) return 1 end
end
return -1
"""


class RedisSessionStore:
    """Session records in Redis, shared by every replica using the same key prefix.

    Keys (``owner`` is percent-encoded so it cannot contain ``:``)::

        {prefix}sess:{owner}:{session_id}       the record (encode_record), TTL ttl_s
        {prefix}sess-lock:{owner}:{session_id}  the turn lock (holder id), PX lease
        {prefix}sess-ids:{owner}                sorted set of the owner's ids (score 0,
                                                so ZRANGEBYLEX pages them in id order)

    Conditional writes (``put_if``, ``delete_if``) are Lua scripts that read the stored
    record's etag and write or delete in one step. An expired record leaves its id in
    the index until a ``list`` finds it gone and removes it. ``client`` is a
    ``redis.asyncio`` client (or cluster client) with ``decode_responses=False``; the
    store does not own it unless built by ``from_url``.
    """

    def __init__(
        self, client: Any, *, key_prefix: str = "kvserve:", ttl_s: float | None = None, owns_client: bool = False
    ) -> None:
        self._r = client
        self._prefix = key_prefix
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._owns_client = owns_client
        self._unlock = client.register_script(_UNLOCK_LUA)
        self._refresh = client.register_script(_REFRESH_LUA)
        self._lock = client.register_script(_LOCK_LUA)
        self._put_if = client.register_script(_PUT_IF_LUA)
        self._delete_if = client.register_script(_DELETE_IF_LUA)

    @classmethod
    def from_url(cls, url: str, *, key_prefix: str = "kvserve:", ttl_s: float | None = None,
                 socket_timeout_s: float = 2.0, cluster: bool = False) -> RedisSessionStore:  # fmt: skip
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # One immediate retry covers a pooled connection that died with a Redis restart;
        # past that the caller falls back (FallbackSessionStore) instead of waiting.
        kwargs = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 1),
        }
        if cluster:
            client = aioredis.RedisCluster.from_url(url, **kwargs)
        else:
            client = aioredis.Redis.from_url(url, **kwargs)
        return cls(client, key_prefix=key_prefix, ttl_s=ttl_s, owns_client=True)

    def _key(self, kind: str, owner: str, session_id: str = "") -> str:
        base = f"{self._prefix}{kind}:{quote(owner, safe='')}"
        return f"{base}:{session_id}" if session_id else base

    async def get(self, owner: str, session_id: str) -> SessionRecord | None:
        data = await self._r.get(self._key("sess", owner, session_id))
        if data is None:
            return None
        try:
            rec = decode_record(data)
        except SessionRecordError as e:
            log.error("session %r of owner %r has an unreadable record: %s", session_id, owner, e)
            return None
        if rec.session_id != session_id or rec.owner != owner:
            log.error("session record %r/%r names another session; ignored", owner, session_id)
            return None
        return rec

    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]:
        rec = await self.get(owner, session_id)
        return rec, Expect.of(rec)

    async def put(self, rec: SessionRecord) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._key("sess", rec.owner, rec.session_id), encode_record(rec), px=self._ttl_ms)
        pipe.zadd(self._key("sess-ids", rec.owner), {rec.session_id: 0})
        await pipe.execute()

    async def put_if(self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False) -> str:
        args = [encode_record(rec), self._ttl_ms or 0, int(expect.absent_ok), int(replace_uncommitted),
                *sorted(expect.etags)]  # fmt: skip
        outcome = await self._put_if(keys=[self._key("sess", rec.owner, rec.session_id)], args=args)
        outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if outcome != CONFLICT:
            await self._r.zadd(self._key("sess-ids", rec.owner), {rec.session_id: 0})
        return outcome

    async def delete(self, owner: str, session_id: str) -> bool:
        pipe = self._r.pipeline(transaction=False)
        pipe.delete(self._key("sess", owner, session_id))
        pipe.zrem(self._key("sess-ids", owner), session_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        if not etags:
            return False
        gone = int(await self._delete_if(keys=[self._key("sess", owner, session_id)], args=sorted(etags)))
        if gone >= 0:
            await self._r.zrem(self._key("sess-ids", owner), session_id)
        return gone == 1

    async def list(
        self, owner: str, page_size: int, page_token: str = ""
    ) -> tuple[list[SessionRecord], str]:
        index = self._key("sess-ids", owner)
        out: list[SessionRecord] = []
        cursor = page_token
        while len(out) < page_size:
            want = page_size - len(out) + 1  # one more tells whether a next page exists
            lo = f"({cursor}" if cursor else "-"
            ids = [i.decode() for i in await self._r.zrangebylex(index, lo, "+", start=0, num=want)]
            if not ids:
                return out, ""
            recs = await asyncio.gather(*(self.get(owner, sid) for sid in ids))
            gone = [sid for sid, rec in zip(ids, recs) if rec is None]
            if gone:
                await self._r.zrem(index, *gone)
            for rec in recs:
                if rec is None:
                    continue
                if len(out) == page_size:
                    return out, out[-1].session_id
                out.append(rec)
            if len(ids) < want:
                return out, ""
            cursor = ids[-1]
        # the page is full; is there anything after it?
        more = await self._r.zrangebylex(index, f"({out[-1].session_id}", "+", start=0, num=1)
        return out, (out[-1].session_id if more else "")

    async def try_lock(
        self, owner: str, session_id: str, holder: str, ttl_s: float, *, takeover_prefix: str = ""
    ) -> bool:
        key = self._key("sess-lock", owner, session_id)
        px = max(1, int(ttl_s * 1000))
        if not takeover_prefix:
            return bool(await self._r.set(key, holder, nx=True, px=px))
        return bool(await self._lock(keys=[key], args=[holder, px, takeover_prefix]))

    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        key = self._key("sess-lock", owner, session_id)
        return bool(await self._refresh(keys=[key], args=[holder, max(1, int(ttl_s * 1000))]))

    async def unlock(self, owner: str, session_id: str, holder: str) -> None:
        await self._unlock(keys=[self._key("sess-lock", owner, session_id)], args=[holder])

    async def is_locked(self, owner: str, session_id: str) -> bool:
        return bool(await self._r.exists(self._key("sess-lock", owner, session_id)))

    async def count(self, owner: str, *, prune_at: int | None = None) -> int:
        """The owner's sessions. The index may still list expired ones; when the count
        reaches ``prune_at`` the index is checked against the records and pruned first."""
        index = self._key("sess-ids", owner)
        n = int(await self._r.zcard(index))
        if prune_at is None or n < prune_at:
            return n
        ids = [i.decode() for i in await self._r.zrange(index, 0, -1)]
        pipe = self._r.pipeline(transaction=False)
        for sid in ids:
            pipe.exists(self._key("sess", owner, sid))
        gone = [sid for sid, found in zip(ids, await pipe.execute()) if not found]
        if gone:
            await self._r.zrem(index, *gone)
        return len(ids) - len(gone)

    async def expire(self) -> list[SessionRecord]:
        return []  # Redis expires records itself (PX); the index is pruned lazily

    async def close(self) -> None:
        if self._owns_client:
            await self._r.aclose()




class FallbackSessionStore:
    """Redis as the source of truth, this process's memory as the fallback.

    Every write goes to both; reads and locks go to Redis and fall back to memory when
    Redis fails. Each Redis call is bounded by ``timeout_s`` and goes through a circuit
    breaker (``cachestore.breaker``): after ``breaker.failure_threshold`` consecutive
    failures or timeouts Redis is not asked at all (every call answers from this
    replica's copy at once) until a probe after ``breaker.reset_timeout_s`` succeeds. So
    a Redis that is down or hung (SIGSTOP, a partition) costs a turn at most a few
    timeouts, never the socket timeout of every call.

    Reads also prefer this replica's record when Redis holds an older version of it
    (same incarnation, fewer turns: a write that missed Redis). A write that could not
    reach Redis is remembered and written back (conditionally, so never over a newer
    version) once Redis answers again. What cannot be had while Redis is down:
    sessions only another replica served.
    """

    def __init__(
        self,
        primary: SessionStore,
        local: InMemorySessionStore | None = None,
        *,
        timeout_s: float = 0.3,
        breaker: Any = None,  # cachestore.breaker.CircuitBreaker
        unlock_retry_s: float = 0.5,
        sync_every_s: float = 1.0,
    ) -> None:
        from cachestore.breaker import CircuitBreaker

        self.primary = primary
        self.local = local or InMemorySessionStore()
        self.timeout_s = timeout_s
        self.breaker = breaker if breaker is not None else CircuitBreaker(failure_threshold=2, reset_timeout_s=2.0)
        self.primary_errors = 0  # Redis calls that failed or timed out
        self.primary_skipped = 0  # Redis calls not made: the breaker was open
        self.written_back = 0  # records written back to Redis after it missed them
        self._unlock_retry_s = unlock_retry_s
        self._sync_every_s = sync_every_s
        self._retries: set[asyncio.Task] = set()  # unlocks that missed Redis, tried again
        self._unsynced: dict[tuple[str, str], Expect] = {}  # records Redis may lack, what it may hold
        self._sync_task: asyncio.Task | None = None
        self._failing = False  # the last Redis call failed (log once per outage)
        self._closed = False
        self._writing: dict[tuple[str, str], list] = {}  # key -> [lock, users]: one write at a time

    @contextlib.asynccontextmanager
    async def _one_writer(self, key: tuple[str, str]):
        """Conditional writes of one session run one at a time here (a turn's and the
        background write-back's), so each sees the outcome of the one before."""
        entry = self._writing.get(key)
        if entry is None:
            entry = self._writing[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._writing.pop(key, None)

    @property
    def unsynced(self) -> int:
        """Session records whose last write may not have reached Redis."""
        return len(self._unsynced)

    async def _try(self, what: str, call, timeout_s: float | None = None):
        if not self.breaker.allow():
            self.primary_skipped += 1
            return False, None
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancellation that arrives as the call completes (a turn's lock renewal
            # then outlived its turn)
            async with asyncio.timeout(timeout_s or self.timeout_s):
                result = await call()
        except Exception as e:  # noqa: BLE001 - any backend failure falls back
            self.primary_errors += 1
            self.breaker.record_failure()
            why = f"timed out after {timeout_s or self.timeout_s:g} s" if isinstance(e, asyncio.TimeoutError) else repr(e)
            if not self._failing:
                log.warning("session store: Redis %s failed (%s); using this replica's copy", what, why)
            else:
                log.debug("session store: Redis %s failed (%s)", what, why)
            self._failing = True
            return False, None
        self.breaker.record_success()
        if self._failing:
            log.info("session store: Redis answers again")
            self._failing = False
        return True, result

    async def get(self, owner: str, session_id: str) -> SessionRecord | None:
        return (await self.read(owner, session_id))[0]

    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]:
        ok, rec = await self._try("get", lambda: self.primary.get(owner, session_id))
        local = await self.local.get(owner, session_id)
        pending = self._unsynced.get((owner, session_id))
        if not ok or rec is None:
            # Redis is away, or lost it (eviction, restart): ours is still good.
            expect = Expect.of(local) if pending is None or local is None else pending.plus(local.etag)
            if ok and local is not None:
                expect = Expect(expect.etags, False)  # Redis has nothing: writing is restoring
            return local, expect
        if local is not None and local.created_at == rec.created_at and local.turns > rec.turns:
            # A write of ours missed Redis (a timeout, a blip) and it kept an older
            # version: using it would drop turns from the transcript. The next write repairs it.
            log.warning("session %r: Redis has %d turns, this replica %d; using this replica's record",
                        session_id, rec.turns, local.turns)  # fmt: skip
            return local, Expect(frozenset({rec.etag, local.etag}), False)
        return rec, Expect.of(rec)

    async def put(self, rec: SessionRecord) -> None:
        await self.local.put(rec)
        await self._try("put", lambda: self.primary.put(rec))

    async def put_if(self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False) -> str:
        async with self._one_writer((rec.owner, rec.session_id)):
            return await self._put_if(rec, expect, replace_uncommitted)

    async def _put_if(self, rec: SessionRecord, expect: Expect, replace_uncommitted: bool) -> str:
        key = (rec.owner, rec.session_id)
        pending = self._unsynced.get(key)
        if pending is not None:  # an earlier write may land (or have landed) late: it is ours too
            expect = Expect(expect.etags | pending.etags, expect.absent_ok or pending.absent_ok)
        ok, outcome = await self._try(
            "write", lambda: self.primary.put_if(rec, expect, replace_uncommitted=replace_uncommitted)
        )
        if not ok:
            await self.local.put(rec)
            self._unsynced[key] = expect.plus(rec.etag)
            self._start_sync()
            return UNKNOWN
        self._unsynced.pop(key, None)
        if outcome == CONFLICT:
            await self.local.delete(*key)  # Redis has another replica's version: ours is stale
        else:
            await self.local.put(rec)
        return outcome

    def _start_sync(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.create_task(self._sync_loop(), name="kvserve-session-sync")

    async def _sync_loop(self) -> None:
        while self._unsynced and not self._closed:
            await asyncio.sleep(self._sync_every_s)
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - tried again next round
                log.warning("writing session records back to Redis failed", exc_info=True)

    async def sync(self) -> int:
        """Write back the records whose last write may have missed Redis, each only over
        a version this replica wrote or expected; returns how many reached Redis."""
        done = 0
        for key in list(self._unsynced):
            async with self._one_writer(key):
                expect = self._unsynced.get(key)
                rec = await self.local.get(*key)
                if expect is None or rec is None:
                    self._unsynced.pop(key, None)
                    continue
                ok, outcome = await self._try("write-back", lambda r=rec, e=expect: self.primary.put_if(r, e))
                if not ok:
                    return done  # still away; the breaker paces the next try
                self._unsynced.pop(key, None)
                if outcome == CONFLICT:
                    log.warning("session %r: another replica wrote it while Redis missed this replica's version; "
                                "keeping theirs", key[1])  # fmt: skip
                    await self.local.delete(*key)
                else:
                    done += 1
                    self.written_back += 1
                    if outcome == RESTORED:
                        log.warning("session %r: Redis had lost its record; wrote back this replica's copy", key[1])
        return done

    async def delete(self, owner: str, session_id: str) -> bool:
        self._unsynced.pop((owner, session_id), None)
        here = await self.local.delete(owner, session_id)
        ok, there = await self._try("delete", lambda: self.primary.delete(owner, session_id))
        return bool(there) or here

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        pending = self._unsynced.pop((owner, session_id), None)
        if pending is not None:
            etags = etags | pending.etags
        here = await self.local.delete_if(owner, session_id, etags)
        ok, there = await self._try("delete", lambda: self.primary.delete_if(owner, session_id, etags))
        return bool(there) or here

    async def list(self, owner: str, page_size: int, page_token: str = "") -> tuple[list[SessionRecord], str]:
        ok, page = await self._try(
            "list", lambda: self.primary.list(owner, page_size, page_token), timeout_s=self.timeout_s * 10
        )
        return page if ok else await self.local.list(owner, page_size, page_token)

    async def try_lock(
        self, owner: str, session_id: str, holder: str, ttl_s: float, *, takeover_prefix: str = ""
    ) -> bool:
        ok, got = await self._try(
            "lock",
            lambda: self.primary.try_lock(owner, session_id, holder, ttl_s, takeover_prefix=takeover_prefix),
        )
        if ok:
            if got:  # mirror it here, so a lock check while Redis is away still sees it
                await self.local.try_lock(owner, session_id, holder, ttl_s, takeover_prefix=takeover_prefix)
            return bool(got)
        return await self.local.try_lock(owner, session_id, holder, ttl_s, takeover_prefix=takeover_prefix)

    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        await self.local.refresh_lock(owner, session_id, holder, ttl_s)
        ok, got = await self._try("lock refresh", lambda: self.primary.refresh_lock(owner, session_id, holder, ttl_s))
        return bool(got) if ok else True  # Redis away: the lease is this replica's to keep

    async def unlock(self, owner: str, session_id: str, holder: str) -> None:
        """An unlock that misses Redis is tried again in the background until Redis
        answers, so a blip or a hang does not leave the session busy for other replicas
        until the lease runs out (on this replica a leftover lock of its own never
        blocks: see ``try_lock``)."""
        await self.local.unlock(owner, session_id, holder)
        ok, _ = await self._try("unlock", lambda: self.primary.unlock(owner, session_id, holder))
        if not ok and len(self._retries) < 10_000:
            task = asyncio.create_task(self._retry_unlock(owner, session_id, holder))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    async def _retry_unlock(self, owner: str, session_id: str, holder: str) -> None:
        """Until Redis answers (a minute at most): a lock write it applies late, after a
        hang, is then removed before other replicas wait out its lease."""
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            await asyncio.sleep(self._unlock_retry_s)
            if self._closed:
                return
            if self.breaker.state == "open":
                continue  # not a call: the breaker would refuse it
            ok, _ = await self._try("unlock", lambda: self.primary.unlock(owner, session_id, holder))
            if ok:
                return

    async def is_locked(self, owner: str, session_id: str) -> bool:
        ok, got = await self._try("lock check", lambda: self.primary.is_locked(owner, session_id))
        return bool(got) if ok else await self.local.is_locked(owner, session_id)

    async def count(self, owner: str, *, prune_at: int | None = None) -> int:
        primary = self.primary
        if isinstance(primary, RedisSessionStore):
            call = lambda: primary.count(owner, prune_at=prune_at)  # noqa: E731
        else:
            call = lambda: primary.count(owner)  # noqa: E731
        ok, n = await self._try("count", call, timeout_s=self.timeout_s * 10)
        return int(n) if ok else await self.local.count(owner)

    async def expire(self) -> list[SessionRecord]:
        """Expire this replica's copies; report those whose Redis record is gone (or
        unreachable) or as old, not the ones another replica has used since."""
        out = []
        for rec in await self.local.expire():
            self._unsynced.pop((rec.owner, rec.session_id), None)
            ok, there = await self._try("get", lambda r=rec: self.primary.get(r.owner, r.session_id))
            if ok and there is not None and there.last_used_at > rec.last_used_at:
                continue  # still alive elsewhere
            out.append(rec)
        ok, more = await self._try("expire", self.primary.expire)
        return out + (list(more) if ok and more else [])

    async def close(self) -> None:
        self._closed = True
        tasks = [*self._retries, *([self._sync_task] if self._sync_task else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.primary.close()
        await self.local.close()


# ----------------------------------------------------------------------------- the table


@dataclass(slots=True)
class Turn:
    """One turn in flight: the record as it was at the start, the lock lease, and what a
    conditional write of the session may find in the store (its version at the start
    and every version this turn wrote)."""

    record: SessionRecord
    holder: str
    created: bool  # this turn created the session
    expect: Expect = field(default_factory=Expect)
    _renewal: asyncio.Task | None = None
    committed: bool = False
    ended: bool = False


class SessionManager:
    """The session table used by the servicer: one turn at a time per session.

    One turn at a time, whatever the store lost:

    * This replica's own turns in flight are held here (``_inflight``), consulted before
      the store: a second turn of a session in flight on this replica is refused even
      when Redis restarted, was flushed or hangs.
    * Across replicas the store's lock (a lease of ``lock_ttl_s``, renewed every
      ``min(lock_ttl_s / 3, renew_every_s)`` while the turn runs) keeps a second turn
      out. A renewal that finds the lock gone (Redis restarted or flushed) takes it
      again and writes the turn's record back.
    * Every write of a record is conditional on the version the turn started from
      (``put_if``), so a commit never silently overwrites a newer record: when another
      replica wrote the session meanwhile (possible only while the lock was lost) the
      commit raises ``SessionConflict`` and the turn fails instead of an acknowledged
      turn vanishing. When Redis lost the record mid-turn, the commit writes this
      replica's copy back (logged, counted in ``records_lost``).
    * Lock holders are ``{replica_id}:{uuid}``: a lock left in Redis by an ended turn of
      this replica (an unlock that missed a hung Redis, a lock write applied late) is
      taken over by this replica's next turn instead of blocking it until its lease ends.

    ``max_sessions_per_owner`` (0 = none) caps the sessions one owner holds; creations
    are serialized in this process, so the cap is exact for one replica and may be
    passed by a few when several replicas create sessions of one owner at once.
    """

    def __init__(
        self,
        store: SessionStore,
        *,
        lock_ttl_s: float = 30.0,
        max_sessions_per_owner: int = 0,
        clock: Callable[[], float] = time.time,
        renew_every_s: float = 1.0,
    ) -> None:
        self.store = store
        self._lock_ttl_s = lock_ttl_s
        self._renew_every_s = min(lock_ttl_s / 3, renew_every_s)
        self.max_sessions_per_owner = max_sessions_per_owner
        self._clock = clock
        self._create_lock = asyncio.Lock()
        self.replica_id = uuid.uuid4().hex[:12]
        self._inflight: dict[tuple[str, str], str] = {}  # this replica's turns in flight -> holder
        self.records_lost = 0  # records the store had lost mid-session, written back from here
        self.conflicts = 0  # turns refused because another replica wrote the session meanwhile
        self.unconfirmed_writes = 0  # writes the store could not confirm (kept on this replica)

    @property
    def turns_in_flight(self) -> int:
        return len(self._inflight)

    def in_flight_here(self, owner: str, session_id: str) -> bool:
        return (owner, session_id) in self._inflight

    def _busy(self, session_id: str) -> SessionBusy:
        return SessionBusy(f"session {session_id!r} already has a turn in flight; retry when it finishes")

    async def begin_turn(self, owner: str, session_id: str, *, require_existing: bool = False) -> Turn:
        """Lock the session (creating it if new, unless ``require_existing``) and return
        its record as of now.

        Raises InvalidSessionId, SessionBusy, or SessionNotFound (``require_existing``).
        """
        check_session_id(session_id)
        key = (owner, session_id)
        if key in self._inflight:
            raise self._busy(session_id)
        holder = f"{self.replica_id}:{uuid.uuid4().hex}"
        self._inflight[key] = holder  # reserved before the first await
        try:
            if not await self.store.try_lock(
                owner, session_id, holder, self._lock_ttl_s, takeover_prefix=f"{self.replica_id}:"
            ):
                raise self._busy(session_id)
            try:
                rec, expect = await self.store.read(owner, session_id)
                created = rec is None
                if rec is None:
                    if require_existing:
                        raise SessionNotFound(
                            f"session {session_id!r} not found (require_existing_session is set): it expired, "
                            f"was deleted, or the server lost it"
                        )
                    async with self._create_lock:
                        await self._check_room(owner)
                        rec = SessionRecord(session_id=session_id, owner=owner, created_at=self._clock())
                rec.last_used_at = self._clock() if not created else rec.created_at
                rec.etag = new_etag()
                outcome = await self.store.put_if(rec, expect)
                self._note(outcome, rec, "at the start of a turn")
                if outcome == CONFLICT:
                    raise SessionBusy(
                        f"session {session_id!r} was just written by another replica; retry when its turn finishes"
                    )
            except BaseException:
                await self.store.unlock(owner, session_id, holder)
                raise
        except BaseException:
            if self._inflight.get(key) == holder:
                del self._inflight[key]
            raise
        turn = Turn(record=rec, holder=holder, created=created, expect=expect.plus(rec.etag))
        turn._renewal = asyncio.create_task(self._renew(turn), name=f"session-lock-{session_id}")
        return turn

    def _note(self, outcome: str, rec: SessionRecord, when: str) -> None:
        if outcome in (RESTORED, REPLACED):
            self.records_lost += 1
            log.warning(
                "session %r: the session store had lost its record %s (%s); wrote back this replica's copy "
                "(%d turns, %d tokens)",
                rec.session_id, when,
                "Redis restarted, was flushed or evicted it" if outcome == RESTORED
                else "another replica started it over while Redis had lost it",
                rec.turns, len(rec.token_ids),
            )  # fmt: skip
        elif outcome == UNKNOWN:
            self.unconfirmed_writes += 1

    async def _check_room(self, owner: str) -> None:
        limit = self.max_sessions_per_owner
        if not limit:
            return
        count = self.store.count
        n = await (count(owner, prune_at=limit) if _takes_prune_at(self.store) else count(owner))
        if n >= limit:
            raise SessionLimit(
                f"this tenant already has {n} sessions; the limit is {limit} per tenant "
                f"(max_sessions_per_tenant): delete one (DeleteSession) or let one expire"
            )

    async def commit_turn(
        self,
        turn: Turn,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        *,
        cache_salt: str = "",
    ) -> SessionRecord:
        """The turn completed: the transcript becomes prompt + output, one more turn.
        ``cache_salt`` is the turn's request salt (where its KV blocks are keyed).

        Raises SessionConflict (nothing written) when the store holds a version of the
        session this turn did not start from (another replica wrote it meanwhile)."""
        rec = turn.record
        if list(prompt_token_ids[: len(rec.token_ids)]) != rec.token_ids:
            raise RuntimeError("turn prompt does not extend the session transcript")
        new = copy_record(
            rec, token_ids=list(prompt_token_ids) + list(output_token_ids), cache_salt=cache_salt,
            turns=rec.turns + 1, last_used_at=self._clock(), etag=new_etag(),
        )  # fmt: skip
        outcome = await self.store.put_if(new, turn.expect, replace_uncommitted=True)
        self._note(outcome, new, "while a turn ran")
        if outcome == CONFLICT:
            self.conflicts += 1
            log.warning(
                "session %r: another replica wrote it while this turn ran (the turn lock was lost: Redis "
                "restarted or was flushed); this turn is not recorded", rec.session_id,
            )  # fmt: skip
            raise SessionConflict(
                f"session {rec.session_id!r} was changed by another replica while this turn ran (the session "
                f"store lost its turn lock); this turn was not recorded: read the session and retry"
            )
        turn.record = new
        turn.expect = Expect(frozenset({new.etag}))
        turn.committed = True
        return new

    async def end_turn(self, turn: Turn) -> None:
        """Release the lock. Without a commit the transcript stays as before the turn
        (a session whose first turn did not complete is removed again, unless another
        replica has written it since)."""
        turn.ended = True  # the renewal stops even if its cancellation were lost
        if turn._renewal is not None:
            turn._renewal.cancel()
        rec = turn.record
        key = (rec.owner, rec.session_id)
        try:
            if turn.created and not turn.committed:
                await self.store.delete_if(rec.owner, rec.session_id, turn.expect.etags)
        finally:
            try:
                await self.store.unlock(rec.owner, rec.session_id, turn.holder)
            finally:
                if self._inflight.get(key) == turn.holder:
                    del self._inflight[key]

    async def _renew(self, turn: Turn) -> None:
        rec = turn.record
        while not turn.ended:
            await asyncio.sleep(self._renew_every_s)
            if turn.ended:
                return
            try:
                if await self.store.refresh_lock(rec.owner, rec.session_id, turn.holder, self._lock_ttl_s):
                    continue
                if turn.ended:
                    return
                # The lock is gone from the store (Redis restarted or was flushed, or the
                # lease ran out): take it again and put the record back, so no other
                # replica starts this session over while the turn runs.
                retaken = await self.store.try_lock(
                    rec.owner, rec.session_id, turn.holder, self._lock_ttl_s, takeover_prefix=f"{self.replica_id}:"
                )
                log.warning("session %r: its turn lock was gone from the session store; %s", rec.session_id,
                            "taken again" if retaken else "another replica holds it now")  # fmt: skip
                if not turn.committed:
                    back = copy_record(turn.record, etag=new_etag())
                    outcome = await self.store.put_if(back, turn.expect, replace_uncommitted=True)
                    self._note(outcome, back, "while a turn ran")
                    if outcome != CONFLICT:
                        turn.expect = turn.expect.plus(back.etag)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store may be briefly unreachable; the lease covers it
                log.warning("could not renew the turn lock of session %r", rec.session_id, exc_info=True)

    async def get(self, owner: str, session_id: str) -> tuple[SessionRecord, bool]:
        """The record and whether a turn is in flight. Raises SessionNotFound."""
        check_session_id(session_id)
        rec = await self.store.get(owner, session_id)
        if rec is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return rec, self.in_flight_here(owner, session_id) or await self.store.is_locked(owner, session_id)

    async def delete(self, owner: str, session_id: str) -> SessionRecord:
        """Remove the session and return its last record. Raises SessionNotFound, or
        SessionBusy while a turn runs."""
        check_session_id(session_id)
        if self.in_flight_here(owner, session_id) or await self.store.is_locked(owner, session_id):
            raise SessionBusy(f"session {session_id!r} has a turn in flight; cancel it first")
        rec = await self.store.get(owner, session_id)
        if not await self.store.delete(owner, session_id) or rec is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return rec

    async def reap(self) -> list[SessionRecord]:
        """Remove sessions whose TTL passed; returns their last records."""
        return await self.store.expire()

    async def list(self, owner: str, page_size: int, page_token: str) -> tuple[list[tuple[SessionRecord, bool]], str]:
        """One page of the owner's sessions (with their busy flags), ordered by id."""
        if page_size < 0 or page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be in 0..{MAX_PAGE_SIZE}, got {page_size}")
        if page_token:
            check_session_id(page_token)
        recs, next_token = await self.store.list(owner, page_size or DEFAULT_PAGE_SIZE, page_token)
        busy = await asyncio.gather(*(self.store.is_locked(owner, r.session_id) for r in recs))
        return [(r, b or self.in_flight_here(owner, r.session_id)) for r, b in zip(recs, busy)], next_token


def _takes_prune_at(store: SessionStore) -> bool:
    return isinstance(store, (RedisSessionStore, FallbackSessionStore))


# ----------------------------------------------------------------------------- turn input


class TurnInputError(ValueError):
    """The new input cannot be turned into tokens (INVALID_ARGUMENT)."""


_PLACEHOLDER_USER = "kvserve placeholder user message"
_PLACEHOLDER_ASSISTANT = "kvserve placeholder assistant message"


def text_tokens(tokenizer: Any, transcript: Sequence[int], text: str) -> list[int]:
    """Tokens of a text turn: with BOS on an empty transcript, standalone without BOS after."""
    return list(tokenizer.encode(text, add_bos=not transcript))


def chat_tokens(tokenizer: Any, transcript: Sequence[int], messages: list[dict[str, str]]) -> list[int]:
    """Tokens of a chat turn, as described in the module docstring.

    With an empty transcript the messages are the whole conversation so far; otherwise
    they are only the new messages and are rendered as a continuation of it.
    """
    try:
        if not transcript:
            return list(tokenizer.encode_chat(messages, add_generation_prompt=True))
        before = [
            {"role": "user", "content": _PLACEHOLDER_USER},
            {"role": "assistant", "content": _PLACEHOLDER_ASSISTANT},
        ]
        base = tokenizer.apply_chat_template(before, add_generation_prompt=False)
        full = tokenizer.apply_chat_template(before + messages, add_generation_prompt=True)
    except Exception as e:  # a template may reject a message order (e.g. roles must alternate)
        raise TurnInputError(f"the chat template cannot render these messages: {e}") from None
    if not full.startswith(base) or _PLACEHOLDER_ASSISTANT not in base:
        raise TurnInputError("the chat template cannot render these messages as a continuation of the session")
    # what the template writes after an assistant message's content: its end-of-turn marker
    closing = base[base.rindex(_PLACEHOLDER_ASSISTANT) + len(_PLACEHOLDER_ASSISTANT) :]
    eos_token = getattr(tokenizer, "eos_token", None)
    eos_ids = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
    if eos_token and eos_ids and transcript[-1] in eos_ids and closing.startswith(eos_token):
        closing = closing[len(eos_token) :]  # the model already wrote the eos; keep what follows it
    # Special token strings (eos, bos, added tokens) in the text encode to their ids.
    return list(tokenizer.encode(closing + full[len(base) :], add_bos=False))
