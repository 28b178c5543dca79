"""``RedisSessionStore``: one record per session in Redis, shared by every replica using the
same key prefix; conditional writes are Lua compare-and-set scripts on the record's etag."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any
from urllib.parse import quote

from ..records import (
    SessionRecord,
    SessionRecordError,
    decode_record,
    encode_record,
)
from .protocol import CONFLICT, DELETED, LIMIT, Expect, FlushReport, fingerprint

log = logging.getLogger(__name__)

# What a deleted session's key holds in Redis instead of its record (then the unix time of
# the delete); a record starts with b"KVSS" (records.encode_record), so the two never mix.
TOMBSTONE_PREFIX = b"KVSDEL1:"


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
