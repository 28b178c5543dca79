"""Where session records live: the ``SessionStore`` protocol (get / put / conditional
put / delete / list, plus the per-session turn lock), ``InMemorySessionStore`` (this
process), ``RedisSessionStore`` (one record per session, Lua compare-and-set on its
etag) and ``FallbackSessionStore`` (this process's memory behind Redis, with per-call
timeouts and a circuit breaker).

Sessions keep their own Redis client (``redis.asyncio``, their own timeouts, Lua
scripts, cluster hash tags) and their own breaker (``kvserve.common.breaker.CircuitBreaker``,
the class the KV tier uses, another instance): a session write is a small
compare-and-set the turn waits for, a KV block a large best-effort value written in the
background, so they fail, time out and recover separately. They share the URL, the TLS
files and the key prefix (``--redis-url``, ``--redis-tls-*``, ``--redis-key-prefix``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol
from urllib.parse import quote


from kvserve.common.breaker import CircuitBreaker

from .records import (
    SessionRecord,
    SessionRecordError,
    SessionStoreUnavailable,
    decode_record,
    encode_record,
)

if TYPE_CHECKING:
    from .journal import SessionJournal

log = logging.getLogger(__name__)


# Outcomes of a conditional write (``put_if``).
WRITTEN = "written"  # the store held an expected version (or nothing, where that was expected)
RESTORED = "restored"  # the store had lost the record (restart, FLUSHALL, eviction): ours was written back
REPLACED = "replaced"  # the store held another incarnation that no turn had completed yet: overwritten
CONFLICT = "conflict"  # the store holds a version this writer did not expect: nothing written
UNKNOWN = "unknown"  # the store could not be asked (down, hung): written to this replica's copy only
DELETED = "deleted"  # the session was deleted (its tombstone is there) and the write was no creation: nothing written
HEALED = "healed"  # the store held an unreadable value (corrupt, truncated, another session's, a key of another type): replaced
LIMIT = "limit"  # a creation found the owner at its session limit (``limit``): nothing written (or the write undone)

# What a deleted session's key holds in Redis instead of its record (then the unix time of
# the delete); a record starts with b"KVSS" (records.encode_record), so the two never mix.
TOMBSTONE_PREFIX = b"KVSDEL1:"
# Etags of incarnations a stale writer must not replace (new_etag(kept=True)); the first
# turn of such a session that does not complete leaves the tombstone back (delete_if).
KEPT_ETAG_PREFIX = "d-"


@dataclass(frozen=True, slots=True)
class Expect:
    """What a conditional write expects the store to hold: a version whose etag is one
    of ``etags``, or (``absent_ok``) no record. Any other version is a conflict.
    ``unreadable``: the fingerprint (``fingerprint``) of an unreadable value the read
    found there, which counts as no record: a write may replace exactly that value."""

    etags: frozenset[str] = frozenset()
    absent_ok: bool = False
    after_delete: bool = False  # (a read's answer) there is no record because the session was deleted
    unreadable: str = ""

    def plus(self, etag: str) -> Expect:
        return Expect(self.etags | {etag}, self.absent_ok, unreadable=self.unreadable)

    def merge(self, other: Expect) -> Expect:
        """What either may find (a write that may land late is also ours)."""
        return Expect(self.etags | other.etags, self.absent_ok or other.absent_ok,
                      unreadable=self.unreadable or other.unreadable)  # fmt: skip

    @staticmethod
    def of(rec: SessionRecord | None) -> Expect:
        return Expect(frozenset({rec.etag}), False) if rec is not None else Expect(frozenset(), True)


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a store's ``flush`` (the drain) could not save where it promises to: sessions
    whose last change is only in this process's memory (``sessions``, with ``turns``
    acknowledged turns among them), and those kept in the journal instead of Redis
    (``journaled``, ``journaled_turns``: replayed at the next start). ``why`` says what
    failed, ``where`` where the changes were meant to go."""

    sessions: int = 0
    turns: int = 0
    journaled: int = 0
    journaled_turns: int = 0
    written: int = 0  # changes the flush itself got through
    restored: int = 0  # records the primary store had lost since it confirmed them, written back
    waited_s: float = 0.0
    where: str = ""
    why: str = ""

    @property
    def lost(self) -> bool:
        return self.sessions > 0


def new_etag(*, kept: bool = False) -> str:
    """A version id. ``kept``: the version is a new incarnation that no writer of an
    older one may replace while it has no completed turn (``replace_uncommitted``): a
    session created again after a delete, a fork."""
    return (KEPT_ETAG_PREFIX if kept else "") + uuid.uuid4().hex[:16]


def fingerprint(value: bytes | None = None, *, key_type: str = "") -> str:
    """What names an unreadable stored value exactly (the Redis scripts compute the same):
    the SHA-1 of its bytes, or ``type:<name>`` for a key that is not a string."""
    return f"type:{key_type}" if key_type else hashlib.sha1(value or b"").hexdigest()


def _response_error() -> type[Exception]:
    """redis-py's ResponseError, imported when first needed: a server with no Redis
    configured never loads redis (~0.1-0.25 s of its start)."""
    from redis.exceptions import ResponseError

    return ResponseError


def is_key_error(exc: BaseException) -> bool:
    """Redis answered, about one key: the key holds another type (WRONGTYPE), or a script
    failed on what it read. Such an error is that session's, not the store's: it never
    counts against the circuit breaker (see ``FallbackSessionStore``)."""
    if "redis" not in sys.modules or not isinstance(exc, _response_error()):  # no redis loaded: no Redis error
        return False
    text = str(exc)  # server states (OOM, READONLY, LOADING, MASTERDOWN, ...) are the store's
    return text.startswith("WRONGTYPE") or (
        text.startswith("ERR") and ("user_script" in text or "Error running script" in text)
    )


def tombstone() -> bytes:
    return TOMBSTONE_PREFIX + repr(time.time()).encode()


def cas_outcome(
    stored: SessionRecord | None, expect: Expect, replace_uncommitted: bool, *, deleted: bool = False,
    create: bool = False,
) -> str:
    """The rule of ``put_if`` (the Redis store runs the same rule in Lua). ``deleted``:
    the store holds the session's tombstone (it was deleted) instead of a record; only a
    creation (``create``) may write then. (An unreadable stored value counts as no
    record; the Redis store answers HEALED when it replaces one.)"""
    if deleted:
        if not create:
            return DELETED
        stored = None
    if stored is None:
        return WRITTEN if expect.absent_ok else RESTORED
    if stored.etag in expect.etags:
        return WRITTEN
    if replace_uncommitted and stored.turns == 0 and not stored.etag.startswith(KEPT_ETAG_PREFIX):
        return REPLACED
    return CONFLICT


class SessionStore(Protocol):
    """Where session records live. All methods are coroutines.

    Contract: ``get`` returns None when the session does not exist (or its record is
    unreadable: corrupt, truncated, another session's, a key of another type; that is
    counted and logged once); ``read`` also returns what a conditional write of the
    next version should expect (an unreadable value it found is named there, so the
    next write replaces it: HEALED); ``put_if`` writes unless the store holds a version
    ``expect`` does not name (see ``cas_outcome``; ``replace_uncommitted`` lets it
    overwrite another incarnation with no completed turn) and returns the outcome;
    a creation (``create``) with ``limit`` > 0 is written only if the owner then holds
    at most ``limit`` sessions, decided atomically with the other creations (LIMIT
    otherwise: nothing is left written);
    a store that keeps tombstones (Redis: ``delete`` leaves one) answers DELETED to any
    write of a deleted session except a creation (``create``: a first turn or a fork
    that found no record), which writes and so clears the tombstone;
    ``delete_if`` removes the record only if it is one of ``etags`` (True if removed);
    ``delete`` returns whether it existed; ``list`` pages through one owner's sessions
    ordered by session id, ``page_token`` being the ``next_page_token`` of the previous
    page ("" at the end). The lock is a lease: ``try_lock`` takes it for ``ttl_s``
    seconds unless another holder has it (a holder whose id starts with
    ``takeover_prefix`` counts as free: the caller knows that holder is gone),
    ``refresh_lock`` extends it (False if it was lost), ``unlock`` releases it if
    ``holder`` still has it. ``count`` is how many sessions the owner holds; ``expire``
    removes the sessions whose TTL has passed and returns them (a store whose backend
    expires records by itself returns what it knows of, possibly nothing). ``flush``
    (the drain, before ``close``) saves what the store holds only in memory where it
    promises to keep it, within ``timeout_s``, and reports what it could not
    (``FlushReport``). A store that cannot save a change raises ``SessionStoreUnavailable``
    rather than answer it (the session as it was).
    """

    async def get(self, owner: str, session_id: str) -> SessionRecord | None: ...
    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]: ...
    async def put(self, rec: SessionRecord) -> None: ...
    async def put_if(
        self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False, create: bool = False,
        limit: int = 0,
    ) -> str: ...
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
    async def flush(self, timeout_s: float) -> FlushReport: ...
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

    def held(self) -> list[SessionRecord]:
        """Every live record (copies), for a drain's check against the primary store."""
        now = self._clock()
        return [self._copy(r) for k, r in self._records.items() if not self._expired(k, r, now)]

    def adopt(self, rec: SessionRecord) -> None:
        """Hold ``rec`` as it is (a record recovered at startup: a file, the journal)."""
        self._records[(rec.owner, rec.session_id)] = rec

    async def put_if(
        self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False, create: bool = False,
        limit: int = 0,
    ) -> str:
        # No tombstones here: this process's own deletes cannot race its turns (the
        # table refuses a delete while one of its turns is in flight). No await between
        # the check and the write, so the limit is exact.
        key = (rec.owner, rec.session_id)
        outcome = cas_outcome(await self.get(*key), expect, replace_uncommitted)
        if outcome == CONFLICT:
            return outcome
        if create and limit and self.would_exceed(key, limit):
            return LIMIT
        self._records[key] = self._copy(rec)
        return outcome

    def would_exceed(self, key: tuple[str, str], limit: int) -> bool:
        """Whether one more session (``key``, if it is not there) passes ``limit``."""
        now = self._clock()
        live = {k for k, rec in self._records.items() if k[0] == key[0] and not self._expired(k, rec, now)}
        return key not in live and len(live) >= limit

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

    async def flush(self, timeout_s: float) -> FlushReport:
        return FlushReport()  # this process's memory is all it promises

    async def close(self) -> None:
        pass


def copy_record(rec: SessionRecord, **changes: Any) -> SessionRecord:
    out = SessionRecord(
        rec.session_id, rec.owner, list(rec.token_ids), rec.created_at, rec.last_used_at, rec.turns,
        rec.cache_salt, rec.etag, list(rec.turn_log), rec.forked_from,
    )  # fmt: skip
    for name, value in changes.items():
        setattr(out, name, value)
    return out


# A key's value when it is a string; a key of another type (a HASH where a record or a
# lock belongs) is not ours: it reads as an unreadable value, never as a Redis error
# (which the caller would take for a failing Redis).
_LOAD_LUA = """
local function load(key)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then return false, nil end
  if t ~= 'string' then return false, 'type:' .. t end
  return redis.call('GET', key), nil
end
"""
_UNLOCK_LUA = _LOAD_LUA + """
if load(KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH_LUA = _LOAD_LUA + """
if load(KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# Take the lock if it is free or held by a holder whose id starts with ARGV[3] (a turn of
# this replica that has ended: its unlock missed Redis, or a lock write was applied late).
# A key of another type holds no lock: it is replaced.
_LOCK_LUA = _LOAD_LUA + """
local h = load(KEYS[1])
if h and (ARGV[3] == '' or string.sub(h, 1, #ARGV[3]) ~= ARGV[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# The stored record's metadata (encode_record: magic, u16 version, u32 n, n bytes JSON),
# nil when there is none or it cannot be read (an unreadable record counts as absent).
_META_LUA = _LOAD_LUA + """
local function stored_meta(v)
  if not v or string.sub(v, 1, 4) ~= 'KVSS' then return nil end
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
# put_if: ARGV = value, px (0: none), absent_ok, replace_uncommitted, create, unreadable,
# etags... (the rule of cas_outcome). A tombstone (TOMBSTONE_PREFIX) in the key stops
# every write but a creation, which replaces it. An unreadable value counts as no record
# and is replaced ('healed'): a key of another type, metadata that does not parse, or
# the exact value the writer's read found unreadable (ARGV[6], its SHA-1: the checksum
# and the rest are checked in Python).
_PUT_IF_LUA = _META_LUA + """
local v, odd = load(KEYS[1])
if v and string.sub(v, 1, 8) == 'KVSDEL1:' then
  if ARGV[5] ~= '1' then return 'deleted' end
  v = false
end
local meta = nil
if v and not (ARGV[6] ~= '' and redis.sha1hex(v) == ARGV[6]) then meta = stored_meta(v) end
local outcome
if meta == nil then
  if v or odd then outcome = 'healed'
  elseif ARGV[3] == '1' then outcome = 'written' else outcome = 'restored' end
else
  local etag = etag_of(meta)
  outcome = 'conflict'
  for i = 7, #ARGV do
    if ARGV[i] == etag then outcome = 'written' end
  end
  if outcome == 'conflict' and ARGV[4] == '1' and meta['turns'] == 0 and string.sub(etag, 1, 2) ~= 'd-' then
    outcome = 'replaced'
  end
end
if outcome ~= 'conflict' then
  if ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1])
  else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
end
return outcome
"""
# delete: ARGV = tombstone, px (0: none); the record (or an unreadable value, a key of
# another type) becomes the tombstone. 1 deleted, 0 there was none (or only a tombstone).
_DELETE_LUA = _LOAD_LUA + """
local v, odd = load(KEYS[1])
if not odd and (not v or string.sub(v, 1, 8) == 'KVSDEL1:') then return 0 end
if ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1])
else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
return 1
"""
# delete_if: ARGV = tombstone, px (0: none), etags...; 1 deleted, 0 absent, -1 another
# version (kept). For a first turn that did not complete: the key is removed, or for a
# session created again after a delete ('d-' etag) holds the tombstone again.
_DELETE_IF_LUA = _META_LUA + """
local meta = stored_meta(load(KEYS[1]))
if meta == nil then return 0 end
local etag = etag_of(meta)
for i = 3, #ARGV do
  if ARGV[i] == etag then
    if string.sub(etag, 1, 2) ~= 'd-' then redis.call('DEL', KEYS[1])
    elseif ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1])
    else redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) end
    return 1
  end
end
return -1
"""
# The owner's index (sorted set of session ids): add ARGV[1] unless ARGV[2] > 0 and the
# index already holds that many other ids. One script, so concurrent creations on any
# replica cannot pass the limit together. 1 added (or there), 0 full. An index key of
# another type is not ours: it is replaced (the sessions re-enter it with their next write).
_INDEX_ADD_LUA = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t ~= 'zset' and t ~= 'none' then redis.call('DEL', KEYS[1]) end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
local limit = tonumber(ARGV[2])
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
redis.call('ZADD', KEYS[1], 0, ARGV[1])
return 1
"""


class RedisSessionStore:
    """Session records in Redis, shared by every replica using the same key prefix.

    Keys (``owner`` is percent-encoded so it cannot contain ``:``)::

        {prefix}sess:{owner}:{session_id}       the record (encode_record), TTL ttl_s;
                                                after a delete its tombstone
                                                (TOMBSTONE_PREFIX + unix time), TTL ttl_s
        {prefix}sess-lock:{owner}:{session_id}  the turn lock (holder id), PX lease
        {prefix}sess-ids:{owner}                sorted set of the owner's ids (score 0,
                                                so ZRANGEBYLEX pages them in id order)
        {prefix}sess-mark                       "1", no TTL: gone means Redis lost its
                                                data (``mark``)

    Conditional writes (``put_if``, ``delete_if``) are Lua scripts that read the stored
    record's etag and write or delete in one step. ``delete`` leaves a tombstone in the
    record's key (one key, so the scripts stay single-key for Redis Cluster), kept as
    long as a record would be (``ttl_s``: every replica's own copy of the session has
    expired by then; no TTL when records have none): a turn, a renewal or a write-back
    that finds it writes nothing (DELETED); only a creation replaces it. An expired record leaves its id in
    the index until a ``list`` finds it gone and removes it.

    Unreadable values are that session's alone: a record that fails to decode or verify
    (``decode_record``: magic, version, lengths, CRC-32; or one naming another session)
    and a record or lock key of another Redis type (not ours to trust) read as no record
    (counted in ``unreadable_records`` and logged once per value), and the next write of
    the session replaces it (HEALED). No Redis error comes of them, so the caller's
    circuit breaker never sees one.

    The session limit (``put_if(..., create=True, limit=n)``): the record is written,
    then its id enters the owner's index by a script that refuses it when the index holds
    ``n`` other ids; a refused creation is undone (``delete_if``) and answers LIMIT. The
    index may list expired records (Redis expired them): when it is full it is pruned of
    ids whose record is gone (and that no turn holds) and the script is tried again.
    ``client`` is a
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
        self._delete = client.register_script(_DELETE_LUA)
        self._index_add = client.register_script(_INDEX_ADD_LUA)
        self.unreadable_records = 0  # distinct unreadable values read (corrupt, another session's, wrong type)
        self._unreadable_seen: set[tuple[str, str, str]] = set()  # (owner, session_id, fingerprint) logged

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
        return (await self.get_state(owner, session_id))[0]

    async def get_state(self, owner: str, session_id: str) -> tuple[SessionRecord | None, bool]:
        """The record (None if there is none) and whether the session was deleted (its
        tombstone is there)."""
        rec, expect = await self.read(owner, session_id)
        return rec, expect.after_delete

    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]:
        """The record and what the next write should expect: its etag; or no record, after
        a delete (``after_delete``) or where an unreadable value is (``unreadable``)."""
        key = self._key("sess", owner, session_id)
        try:
            data = await self._r.get(key)
        except _response_error() as e:
            if not is_key_error(e):
                raise
            key_type = (await self._r.type(key)).decode()
            if key_type == "string":  # replaced by a record meanwhile: read that (once)
                data = await self._r.get(key)
            else:
                self._unreadable(owner, session_id, fingerprint(key_type=key_type), f"the key is a Redis {key_type}")
                return None, Expect(absent_ok=True, unreadable=fingerprint(key_type=key_type))
        return self._decode(owner, session_id, data)

    def _decode(self, owner: str, session_id: str, data: bytes | None) -> tuple[SessionRecord | None, Expect]:
        """``read``'s answer for the value ``data`` of the session's record key."""
        if data is None:
            return None, Expect(absent_ok=True)
        if data.startswith(TOMBSTONE_PREFIX):
            return None, Expect(absent_ok=True, after_delete=True)
        try:
            rec = decode_record(data)
            if rec.session_id != session_id or rec.owner != owner:
                raise SessionRecordError(f"it is the record of session {rec.session_id!r} of owner {rec.owner!r}")
        except SessionRecordError as e:
            self._unreadable(owner, session_id, fingerprint(data), str(e))
            return None, Expect(absent_ok=True, unreadable=fingerprint(data))
        return rec, Expect.of(rec)

    async def _get_many(self, owner: str, session_ids: list[str]) -> list[SessionRecord | None]:
        """``get`` of each, in one pipeline (one round trip, one connection: a page of a
        thousand is not a thousand connections at once); a key that answers with an error
        (of another type) is read alone, as ``read`` does."""
        pipe = self._r.pipeline(transaction=False)
        for sid in session_ids:  # one key per command (Redis Cluster)
            pipe.get(self._key("sess", owner, sid))
        values = await pipe.execute(raise_on_error=False)
        out = []
        for sid, value in zip(session_ids, values):
            if isinstance(value, Exception):
                if not is_key_error(value):
                    raise value
                out.append(await self.get(owner, sid))
            else:
                out.append(self._decode(owner, sid, value)[0])
        return out

    def _unreadable(self, owner: str, session_id: str, fp: str, why: str) -> None:
        """Count and log an unreadable value once (per session and value)."""
        seen = (owner, session_id, fp)
        if seen in self._unreadable_seen:
            return
        if len(self._unreadable_seen) >= 10_000:
            self._unreadable_seen.clear()
        self._unreadable_seen.add(seen)
        self.unreadable_records += 1
        log.error("session %r of owner %r has an unreadable record (%s); it counts as absent (NOT_FOUND, the "
                  "next turn starts it over) and its next write replaces it", session_id, owner, why[:300])  # fmt: skip

    async def put(self, rec: SessionRecord) -> None:
        await self._r.set(self._key("sess", rec.owner, rec.session_id), encode_record(rec), px=self._ttl_ms)
        await self._index(rec.owner, rec.session_id)

    async def _index(self, owner: str, session_id: str, limit: int = 0) -> bool:
        """Add the id to the owner's index; False if ``limit`` > 0 and it is full."""
        index = self._key("sess-ids", owner)
        return bool(int(await self._index_add(keys=[index], args=[session_id, limit])))

    async def _unindex(self, owner: str, *session_ids: str) -> None:
        """Remove ids from the owner's index; an index key of another type (the next
        ``_index`` replaces it) is no error of the delete that asked."""
        try:
            await self._r.zrem(self._key("sess-ids", owner), *session_ids)
        except _response_error() as e:
            if not is_key_error(e):
                raise

    async def put_if(
        self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False, create: bool = False,
        limit: int = 0,
    ) -> str:
        args = [encode_record(rec), self._ttl_ms or 0, int(expect.absent_ok), int(replace_uncommitted),
                int(create), expect.unreadable, *sorted(expect.etags)]  # fmt: skip
        outcome = await self._put_if(keys=[self._key("sess", rec.owner, rec.session_id)], args=args)
        outcome = outcome.decode() if isinstance(outcome, bytes) else str(outcome)
        if outcome in (CONFLICT, DELETED):
            return outcome
        limit = limit if create else 0
        if await self._index(rec.owner, rec.session_id, limit):
            return outcome
        await self.count(rec.owner, prune_at=limit)  # the index may list expired sessions
        if await self._index(rec.owner, rec.session_id, limit):
            return outcome
        await self.delete_if(rec.owner, rec.session_id, frozenset({rec.etag}))  # as it was: absent (or deleted)
        return LIMIT

    async def delete(self, owner: str, session_id: str) -> bool:
        """Replace the record with a tombstone; True if there was a record."""
        args = [tombstone(), self._ttl_ms or 0]
        deleted = int(await self._delete(keys=[self._key("sess", owner, session_id)], args=args))
        await self._unindex(owner, session_id)
        return deleted == 1

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        if not etags:
            return False
        args = [tombstone(), self._ttl_ms or 0, *sorted(etags)]
        gone = int(await self._delete_if(keys=[self._key("sess", owner, session_id)], args=args))
        if gone >= 0:
            await self._unindex(owner, session_id)
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
            recs = await self._get_many(owner, ids)
            gone = [sid for sid, rec in zip(ids, recs) if rec is None]
            if gone:
                await self._unindex(owner, *gone)
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
        return await self._r.type(self._key("sess-lock", owner, session_id)) == b"string"  # another type is no lock

    async def count(self, owner: str, *, prune_at: int | None = None, creating: str = "") -> int:
        """The owner's sessions. The index may still list expired ones; when the count
        reaches ``prune_at`` the index is checked against the records and pruned first
        (of ids whose record is gone and whose lock is free: a creation holds the lock
        from before its record is written until after its id is indexed), and the id
        ``creating`` (a session about to be created: its place is its own) is not counted."""
        index = self._key("sess-ids", owner)
        n = int(await self._r.zcard(index))
        if prune_at is None or n < prune_at:
            return n
        ids = [i.decode() for i in await self._r.zrange(index, 0, -1) if i.decode() != creating]
        pipe = self._r.pipeline(transaction=False)
        for sid in ids:  # one key per command (Redis Cluster)
            pipe.exists(self._key("sess", owner, sid))
            pipe.exists(self._key("sess-lock", owner, sid))
        found = await pipe.execute()
        gone = [sid for i, sid in enumerate(ids) if not found[2 * i] and not found[2 * i + 1]]
        if gone:
            await self._unindex(owner, *gone)
        return len(ids) - len(gone)

    async def expire(self) -> list[SessionRecord]:
        return []  # Redis expires records itself (PX); the index is pruned lazily

    async def flush(self, timeout_s: float) -> FlushReport:
        return FlushReport()  # every write was confirmed by Redis or failed

    async def mark(self) -> bool:
        """Set the store's mark (``{prefix}sess-mark``, no TTL) unless it is there; True if
        it was not: Redis lost its data since the last mark (a restart without persistence,
        FLUSHALL; or the mark alone was evicted), or this is the first."""
        return bool(await self._r.set(f"{self._prefix}sess-mark", b"1", nx=True))

    async def missing(self, keys: list[tuple[str, str]], batch: int = 1000) -> list[tuple[str, str]]:
        """The sessions of ``keys`` whose record key Redis does not have at all (no record,
        no tombstone, nothing unreadable): what it lost (a restart, FLUSHALL, eviction)."""
        out = []
        for i in range(0, len(keys), batch):
            chunk = keys[i : i + batch]
            pipe = self._r.pipeline(transaction=False)
            for owner, session_id in chunk:  # one key per command (Redis Cluster)
                pipe.exists(self._key("sess", owner, session_id))
            found = await pipe.execute()
            out += [key for key, n in zip(chunk, found) if not n]
        return out

    async def close(self) -> None:
        if self._owns_client:
            await self._r.aclose()




class FallbackSessionStore:
    """Redis as the source of truth, this process's memory as the fallback.

    Every write goes to both; reads and locks go to Redis and fall back to memory when
    Redis fails. Each Redis call is bounded by ``timeout_s`` and goes through a circuit
    breaker (``kvserve.common.breaker``): after ``breaker.failure_threshold`` consecutive
    failures or timeouts Redis is not asked at all (every call answers from this
    replica's copy at once) until a probe after ``breaker.reset_timeout_s`` succeeds. So
    a Redis that is down or hung (SIGSTOP, a partition) costs a turn at most a few
    timeouts, never the socket timeout of every call. Only failures of Redis itself
    count against the breaker (connection errors, timeouts, server states such as
    OOM or READONLY): an error about one key (``is_key_error``: a key of another type, a
    script that failed on what it read) fails that call alone (``key_errors``), and an
    unreadable record is no error at all (``RedisSessionStore``: it reads as absent).

    Reads also prefer this replica's record when Redis holds an older version of it
    (same incarnation, fewer turns: a write that missed Redis). A write that could not
    reach Redis is remembered and written back (conditionally, so never over a newer
    version) once Redis answers again. What cannot be had while Redis is down:
    sessions only another replica served.

    A deleted session stays deleted: a read that finds its tombstone in Redis drops this
    replica's copy (it is not written back), a write of it that finds the tombstone
    (a turn's commit, a write-back) writes nothing and drops the copy (DELETED), and a
    delete that missed Redis is retried in the background (meanwhile this replica
    answers for the session from its own copy, which the delete removed). A session
    created on this replica while Redis was away is written back as a creation: it
    replaces a tombstone it finds (the id was free for a new session).

    Durable acknowledgement: what Redis has not confirmed lives in this process's memory,
    and with a ``journal`` (``journal.SessionJournal``, in the disk directory) also in a
    file: a write or delete that misses Redis is appended there before it is answered (a
    journal that cannot be written fails the call: ``SessionStoreUnavailable``, the
    session as it was), is marked done when Redis has it, and is replayed at the next
    start (into this replica's copy, then written back to Redis by the same conditional
    write-back, so never over a newer version or a tombstone). Records Redis confirmed and
    then lost (a restart without persistence, FLUSHALL: its mark is gone, checked every
    ``sync_every_s``) are written back from this replica's copies at once (``restored``),
    not at each session's next turn. ``flush`` (the drain)
    writes back until Redis has everything or ``timeout_s`` has passed (a directory that
    does not outlive the process, e.g. a Kubernetes emptyDir on a pod's replacement,
    keeps nothing); what is left is in its report (sessions and acknowledged turns).
    """

    def __init__(
        self,
        primary: SessionStore,
        local: InMemorySessionStore | None = None,
        *,
        timeout_s: float = 0.3,
        breaker: CircuitBreaker | None = None,
        unlock_retry_s: float = 0.5,
        sync_every_s: float = 1.0,
        journal: SessionJournal | None = None,
    ) -> None:
        self.primary = primary
        self.local = local or InMemorySessionStore()
        self.timeout_s = timeout_s
        self.breaker = breaker if breaker is not None else CircuitBreaker(failure_threshold=2, reset_timeout_s=2.0)
        self.primary_errors = 0  # Redis calls that failed or timed out
        self.primary_skipped = 0  # Redis calls not made: the breaker was open
        self.written_back = 0  # records written back to Redis after it missed them
        self.key_errors = 0  # Redis calls that failed for their key alone (never the breaker's)
        self._unlock_retry_s = unlock_retry_s
        self._sync_every_s = sync_every_s
        self._retries: set[asyncio.Task] = set()  # unlocks that missed Redis, tried again
        self._unsynced: dict[tuple[str, str], Expect] = {}  # records Redis may lack, what it may hold
        self._deletes: set[tuple[str, str]] = set()  # deletes that missed Redis, tried again
        self._creates: set[tuple[str, str]] = set()  # creations whose write has not reached Redis
        self._sync_task: asyncio.Task | None = None
        self._failing = False  # the last Redis call failed (log once per outage)
        self._closed = False
        self._writing: dict[tuple[str, str], list] = {}  # key -> [lock, users]: one write at a time
        self._base_turns: dict[tuple[str, str], int] = {}  # unsynced session -> turns Redis was known to hold
        self._journal_failing = 0  # journal appends failed since the last that went through
        self._watch_task: asyncio.Task | None = None
        self._lost_pending = False  # Redis lost its data and not every held record was checked since
        self.restored = 0  # records Redis lost after confirming them, written back from this replica's copies
        self.journal = journal
        if journal is not None:
            self._replay(journal)

    def _replay(self, journal: SessionJournal) -> None:
        """Take back what the journal says Redis may lack (a previous run of this server),
        to be written back when Redis answers."""
        for key, p in journal.pending.items():
            if p.delete:
                self._deletes.add(key)
            if p.record is not None:
                self.local.adopt(p.record)
                self._unsynced[key] = p.expect
                self._base_turns[key] = p.base_turns
                if p.create:
                    self._creates.add(key)
        if journal.pending:
            log.warning("session store: %d session(s) from the journal %s that Redis may lack (%d acknowledged "
                        "turn(s), %d delete(s)); written back to Redis when it answers",
                        len(journal.pending), journal.path, sum(p.turns for p in journal.pending.values()),
                        sum(p.delete for p in journal.pending.values()))  # fmt: skip
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop yet: the first write (or flush) starts the write-back
                return
            self._start_sync()

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
        """Session records whose last write (or delete) may not have reached Redis."""
        return len(self._unsynced) + len(self._deletes)

    @property
    def unreadable_records(self) -> int:
        """Distinct unreadable records Redis answered with (treated as absent)."""
        return getattr(self.primary, "unreadable_records", 0)

    @property
    def write_errors(self) -> int:
        """Journal appends that failed (each failed the call it journaled)."""
        return self.journal.write_errors if self.journal is not None else 0

    @property
    def journaled(self) -> int:
        """Sessions whose last change Redis may lack, kept in the journal (0 without one)."""
        return self.journal.sessions if self.journal is not None else 0

    async def _unsaved_turns(self) -> int:
        """Acknowledged turns Redis may lack (past the turns it was known to hold)."""
        n = 0
        for key in list(self._unsynced):
            rec = await self.local.get(*key)
            if rec is not None:
                n += max(0, rec.turns - self._base_turns.get(key, rec.turns))
        return n

    async def _journal(self, key: tuple[str, str]) -> None:
        """Tell the journal what Redis may lack of ``key`` now. Raises OSError."""
        if self.journal is None:
            return
        from .journal import Pending

        expect = self._unsynced.get(key)
        rec = await self.local.get(*key) if expect is not None else None
        pending = None
        if rec is not None or key in self._deletes:
            pending = Pending(rec, expect or Expect(), key in self._creates, self._base_turns.get(key, 0),
                              key in self._deletes)  # fmt: skip
        self.journal.put(key, pending)

    def _journal_failed(self, key: tuple[str, str], e: OSError, what: str) -> None:
        """A journal append failed (its call fails): logged once per run of failures."""
        self._journal_failing += 1
        level = logging.ERROR if self._journal_failing == 1 else logging.DEBUG
        log.log(level, "session %r: Redis did not confirm its %s and the session journal could not take it (%r); "
                "the call fails, and so does every change Redis does not confirm until the journal writes again",
                key[1], what, e)  # fmt: skip

    async def _journal_quietly(self, key: tuple[str, str]) -> None:
        """``_journal`` where a failure costs nothing: the journal may then replay a change
        Redis already has, whose write-back the compare-and-set refuses or repeats."""
        try:
            await self._journal(key)
        except OSError as e:
            log.warning("session journal: could not note that Redis has session %r (%r)", key[1], e)

    async def _settled(self, key: tuple[str, str]) -> None:
        """Redis has the last write of ``key``, or it no longer matters."""
        self._unsynced.pop(key, None)
        self._creates.discard(key)
        self._base_turns.pop(key, None)
        await self._journal_quietly(key)

    async def _forget(self, key: tuple[str, str]) -> None:
        """The session was deleted in Redis: this replica's copy must not come back."""
        await self.local.delete(*key)
        await self._settled(key)

    async def _flush_delete(self, key: tuple[str, str]) -> bool:
        """Retry a delete that missed Redis; True once Redis has it (or it was not pending)."""
        if key not in self._deletes:
            return True
        ok, _ = await self._try("delete", lambda: self.primary.delete(*key))
        if ok:
            self._deletes.discard(key)
            await self._journal_quietly(key)
        return ok

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
            if is_key_error(e):  # Redis answered: this key's problem, not the store's
                self.breaker.record_success()
                self.key_errors += 1
                log.warning("session store: Redis %s failed for its key alone (%r); using this replica's copy "
                            "for that call", what, e)  # fmt: skip
                return False, None
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
        key = (owner, session_id)
        if not await self._flush_delete(key):  # deleted here, Redis not told yet: only our copy counts
            local = await self.local.get(owner, session_id)
            pending = self._unsynced.get(key)
            return local, (Expect.of(local) if pending is None or local is None else pending.plus(local.etag))
        ok, state = await self._try("get", lambda: self.primary.read(owner, session_id))
        rec, there = state if ok else (None, Expect())
        if there.after_delete:
            await self._forget(key)
            return None, Expect(frozenset(), True, after_delete=True)
        local = await self.local.get(owner, session_id)
        pending = self._unsynced.get(key)
        if not ok or rec is None:
            # Redis is away, or lost it (eviction, restart), or holds an unreadable value
            # (``there.unreadable``, which the next write replaces): ours is still good.
            expect = Expect.of(local) if pending is None or local is None else pending.plus(local.etag)
            if ok and local is not None:
                expect = Expect(expect.etags, False)  # Redis has nothing: writing is restoring
            if there.unreadable:
                expect = Expect(expect.etags, expect.absent_ok, unreadable=there.unreadable)
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

    async def put_if(
        self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False, create: bool = False,
        limit: int = 0,
    ) -> str:
        self._start_watch()
        async with self._one_writer((rec.owner, rec.session_id)):
            return await self._put_if(rec, expect, replace_uncommitted, create, limit)

    async def _put_if(
        self, rec: SessionRecord, expect: Expect, replace_uncommitted: bool, create: bool, limit: int
    ) -> str:
        key = (rec.owner, rec.session_id)
        pending = self._unsynced.get(key)
        if pending is not None:  # an earlier write may land (or have landed) late: it is ours too
            expect = expect.merge(pending)
        limit = limit if create else 0  # a limit binds creations only
        create = create or key in self._creates  # a creation not yet in Redis: its next writes create too
        ok, outcome = False, None
        if await self._flush_delete(key):  # else this replica's delete has not reached Redis: nothing after it may
            ok, outcome = await self._try(
                "write", lambda: self.primary.put_if(
                    rec, expect, replace_uncommitted=replace_uncommitted, create=create, limit=limit
                ),
            )  # fmt: skip
        if ok and outcome == LIMIT:
            return LIMIT
        if not ok:
            if limit and self.local.would_exceed(key, limit):  # Redis away: this replica's sessions decide
                return LIMIT
            return await self._keep_here(key, rec, expect, create)
        if outcome == DELETED:
            await self._forget(key)
        elif outcome == CONFLICT:
            await self.local.delete(*key)  # Redis has another replica's version: ours is stale
            await self._settled(key)
        else:
            await self.local.put(rec)
            await self._settled(key)
        return outcome

    async def _keep_here(self, key: tuple[str, str], rec: SessionRecord, expect: Expect, create: bool) -> str:
        """A write Redis did not confirm: this replica's copy (and the journal) hold it until
        the write-back. If the journal cannot take it, the write fails and the copy stays
        as it was (SessionStoreUnavailable); Redis may still apply it late (its etag stays
        expected, so the write-back of the old copy goes over it)."""
        before = await self.local.get(*key)
        state = (self._unsynced.get(key), key in self._creates, self._base_turns.get(key))
        if state[0] is None:  # Redis had everything of it until now
            self._base_turns[key] = min(before.turns if before is not None else rec.turns, rec.turns)
        if create:
            self._creates.add(key)
        await self.local.put(rec)
        self._unsynced[key] = expect.plus(rec.etag)
        try:
            await self._journal(key)
        except OSError as e:
            self._journal_failed(key, e, "write")
            if before is None:
                await self.local.delete(*key)
                self._unsynced.pop(key, None)
                self._creates.discard(key)
                self._base_turns.pop(key, None)
            else:
                await self.local.put(before)
                self._unsynced[key] = (state[0] or Expect.of(before)).plus(rec.etag)
                if not state[1]:
                    self._creates.discard(key)
                if state[2] is not None:
                    self._base_turns[key] = state[2]
            raise SessionStoreUnavailable(
                f"session {key[1]!r}: the session store could not save this change (Redis did not answer and "
                f"the server's journal failed to write); nothing was recorded: retry"
            ) from None
        if self._journal_failing and self.journal is not None:
            log.info("session journal: written again (%d append(s) failed meanwhile)", self._journal_failing)
            self._journal_failing = 0
        self._start_sync()
        return UNKNOWN

    def _start_sync(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.create_task(self._sync_loop(), name="kvserve-session-sync")

    def _start_watch(self) -> None:
        if (self._watch_task is None or self._watch_task.done()) and not self._closed:
            self._watch_task = asyncio.create_task(self._watch_loop(), name="kvserve-session-watch")

    async def _watch_loop(self) -> None:
        """Every ``sync_every_s``: has Redis lost its data (``RedisSessionStore.mark``)? Then
        the records this replica holds that it no longer has are written back at once, not
        at each session's next turn (a replica lost meanwhile would take them with it)."""
        primary = self.primary
        if not isinstance(primary, RedisSessionStore):
            return
        while not self._closed:
            try:
                if self.breaker.state == "closed":  # an open breaker's probes are the turns' and the sync's
                    ok, lost = await self._try("mark", primary.mark)
                    self._lost_pending |= bool(ok and lost)
                    if self._lost_pending:  # until one pass got through them all
                        _, complete = await self._restore_lost(time.monotonic() + 30.0)
                        self._lost_pending = not complete
            except Exception:  # noqa: BLE001 - tried again next round
                log.warning("checking Redis for lost session records failed", exc_info=True)
            await asyncio.sleep(self._sync_every_s)

    async def _sync_loop(self) -> None:
        while (self._unsynced or self._deletes) and not self._closed:
            await asyncio.sleep(self._sync_every_s)
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - tried again next round
                log.warning("writing session records back to Redis failed", exc_info=True)

    async def sync(self) -> int:
        """Send Redis the deletes that missed it, then write back the records whose last
        write may have missed Redis, each only over a version this replica wrote or
        expected and never over a tombstone (unless this replica created the session
        while Redis was away); returns how many records reached Redis."""
        done = 0
        for key in list(self._deletes):
            async with self._one_writer(key):
                if not await self._flush_delete(key):
                    return done
        for key in list(self._unsynced):
            async with self._one_writer(key):
                expect = self._unsynced.get(key)
                rec = await self.local.get(*key)
                if expect is None or rec is None:
                    await self._settled(key)
                    continue
                create = key in self._creates
                ok, outcome = await self._try(
                    "write-back", lambda r=rec, e=expect, c=create: self.primary.put_if(r, e, create=c)
                )
                if not ok:
                    return done  # still away; the breaker paces the next try
                if outcome == DELETED:
                    log.warning("session %r was deleted while Redis missed this replica's last write of it; "
                                "not written back", key[1])  # fmt: skip
                    await self._forget(key)
                elif outcome == CONFLICT:
                    log.warning("session %r: another replica wrote it while Redis missed this replica's version; "
                                "keeping theirs (%d turn(s) acknowledged here are not in it)", key[1],
                                max(0, rec.turns - self._base_turns.get(key, rec.turns)))  # fmt: skip
                    await self.local.delete(*key)
                    await self._settled(key)
                else:
                    await self._settled(key)
                    done += 1
                    self.written_back += 1
                    if outcome == RESTORED:
                        log.warning("session %r: Redis had lost its record; wrote back this replica's copy", key[1])
        return done

    async def delete(self, owner: str, session_id: str) -> bool:
        key = (owner, session_id)
        async with self._one_writer(key):
            before = await self.local.get(owner, session_id)
            state = (self._unsynced.pop(key, None), key in self._creates, self._base_turns.pop(key, None))
            self._creates.discard(key)
            here = await self.local.delete(owner, session_id)
            ok, there = await self._try("delete", lambda: self.primary.delete(owner, session_id))
            if ok:
                self._deletes.discard(key)
                await self._journal_quietly(key)
            elif here and len(self._deletes) < 100_000:  # Redis keeps the record until it hears of the delete
                self._deletes.add(key)
                try:
                    await self._journal(key)
                except OSError as e:  # as it was: the delete is refused
                    self._journal_failed(key, e, "delete")
                    self._deletes.discard(key)
                    if before is not None:
                        await self.local.put(before)
                    if state[0] is not None:
                        self._unsynced[key] = state[0]
                    if state[1]:
                        self._creates.add(key)
                    if state[2] is not None:
                        self._base_turns[key] = state[2]
                    raise SessionStoreUnavailable(
                        f"session {session_id!r}: the delete could not be saved (Redis did not answer and the "
                        f"server's journal failed to write); the session is as it was: retry"
                    ) from None
                self._start_sync()
            else:
                await self._journal_quietly(key)
            return bool(there) or here

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        key = (owner, session_id)
        pending = self._unsynced.get(key)
        if pending is not None:
            etags = etags | pending.etags
        here = await self.local.delete_if(owner, session_id, etags)
        await self._settled(key)
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

    async def count(self, owner: str, *, prune_at: int | None = None, creating: str = "") -> int:
        primary = self.primary
        if isinstance(primary, RedisSessionStore):
            call = lambda: primary.count(owner, prune_at=prune_at, creating=creating)  # noqa: E731
        else:
            call = lambda: primary.count(owner)  # noqa: E731
        ok, n = await self._try("count", call, timeout_s=self.timeout_s * 10)
        return int(n) if ok else await self.local.count(owner)

    async def expire(self) -> list[SessionRecord]:
        """Expire this replica's copies; report those whose Redis record is gone (or
        unreachable) or as old, not the ones another replica has used since."""
        out = []
        for rec in await self.local.expire():
            await self._settled((rec.owner, rec.session_id))
            ok, there = await self._try("get", lambda r=rec: self.primary.get(r.owner, r.session_id))
            if ok and there is not None and there.last_used_at > rec.last_used_at:
                continue  # still alive elsewhere
            out.append(rec)
        ok, more = await self._try("expire", self.primary.expire)
        return out + (list(more) if ok and more else [])

    async def flush(self, timeout_s: float) -> FlushReport:
        """Write back what Redis lacks (the drain), until Redis has everything or
        ``timeout_s`` has passed. What is left is reported: kept in the journal (for the
        next start on this directory), or, without one, lost with the process."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        before = self.unsynced
        why = ""
        while self.unsynced:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    await self.sync()
            except TimeoutError:
                why = f"Redis did not take them within {timeout_s:.1f} s"
                break
            if not self.unsynced:
                break
            if time.monotonic() >= deadline:
                why = f"Redis did not take them within {timeout_s:.1f} s"
                break
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        left = set(self._unsynced) | self._deletes
        turns = await self._unsaved_turns()
        if left and not why:
            why = "Redis did not answer" if self.breaker.state != "closed" else "Redis did not take them"
        restored = 0 if left else (await self._restore_lost(deadline))[0]
        waited = time.monotonic() - t0
        written = max(0, before - self.unsynced)
        if self.journal is not None:  # every change Redis lacks is in the journal
            return FlushReport(journaled=len(left), journaled_turns=turns, written=written, restored=restored,
                               waited_s=waited, where="Redis", why=why)  # fmt: skip
        return FlushReport(sessions=len(left), turns=turns, written=written, restored=restored, waited_s=waited,
                           where="Redis", why=why)  # fmt: skip

    async def _restore_lost(self, deadline: float) -> tuple[int, bool]:
        """Write back the records this replica holds that Redis lost after confirming them
        (a restart without persistence, FLUSHALL, eviction): they would otherwise live on
        only in this process, until the session's next turn. Each is a conditional write
        that finds nothing there (RESTORED), never over another version or a tombstone.
        Best effort, within ``deadline``; returns how many were written back and whether
        every held record was dealt with (else the caller tries again)."""
        primary = self.primary
        if not isinstance(primary, RedisSessionStore):
            return 0, True
        held = {key: r for r in self.local.held() if (key := (r.owner, r.session_id)) not in self._unsynced}
        if not held:  # (what Redis has not confirmed is the write-back's: ``sync``)
            return 0, True
        budget = max(deadline - time.monotonic(), self.timeout_s)
        ok, lost = await self._try("check", lambda: primary.missing(list(held)), timeout_s=budget)
        complete = ok
        n = 0
        for key in lost if ok else []:
            rec = held[key]
            if time.monotonic() >= deadline:
                complete = False
                break
            async with self._one_writer(key):
                ok, outcome = await self._try("write-back", lambda r=rec: primary.put_if(r, Expect.of(r)))
            if not ok:
                complete = False
                break
            if outcome == RESTORED:
                n += 1
                self.written_back += 1
                self.restored += 1
        if n:
            log.warning("session store: %d record(s) Redis had lost (restarted without persistence, flushed or "
                        "evicted) written back from this replica's copies%s", n,
                        "" if complete else "; the rest on the next pass")  # fmt: skip
        return n, complete

    async def close(self) -> None:
        self._closed = True
        tasks = [*self._retries, *(t for t in (self._sync_task, self._watch_task) if t is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.primary.close()
        await self.local.close()
        if self.journal is not None:
            self.journal.close()
