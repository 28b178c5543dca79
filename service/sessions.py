"""Server-side sessions: the exact token transcript of each conversation.

A session is a token transcript plus bookkeeping (owner, timestamps, completed turns).
The next turn's prompt is ``transcript + new input tokens``: the exact tokens the
model saw and generated, never a re-tokenization of decoded text, so every earlier
block of the conversation hashes the same and is found in the cache.

Turns and the transcript
------------------------
* One turn at a time: ``SessionManager.begin_turn`` takes the session's lock (a lease
  in the store, renewed while the turn runs); a second turn gets ``SessionBusy``.
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
replicas. Sessions are keyed by ``(owner, session_id)``: another owner's session id is
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


class SessionStore(Protocol):
    """Where session records live. All methods are coroutines.

    Contract: ``get`` returns None when the session does not exist (or its record is
    unreadable: that is logged); ``delete`` returns whether it existed; ``list`` pages
    through one owner's sessions ordered by session id, ``page_token`` being the
    ``next_page_token`` of the previous page ("" at the end). The lock is a lease:
    ``try_lock`` takes it for ``ttl_s`` seconds unless another holder has it,
    ``refresh_lock`` extends it (False if it was lost), ``unlock`` releases it if
    ``holder`` still has it. ``count`` is how many sessions the owner holds;
    ``expire`` removes the sessions whose TTL has passed and returns them (a store whose
    backend expires records by itself returns what it knows of, possibly nothing).
    """

    async def get(self, owner: str, session_id: str) -> SessionRecord | None: ...
    async def put(self, rec: SessionRecord) -> None: ...
    async def delete(self, owner: str, session_id: str) -> bool: ...
    async def list(
        self, owner: str, page_size: int, page_token: str = ""
    ) -> tuple[list[SessionRecord], str]: ...
    async def try_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool: ...
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
        return SessionRecord(
            rec.session_id, rec.owner, list(rec.token_ids), rec.created_at, rec.last_used_at, rec.turns,
            rec.cache_salt,
        )  # fmt: skip

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

    async def put(self, rec: SessionRecord) -> None:
        self._records[(rec.owner, rec.session_id)] = self._copy(rec)

    async def delete(self, owner: str, session_id: str) -> bool:
        return self._records.pop((owner, session_id), None) is not None

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

    async def try_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        key = (owner, session_id)
        if self._live_holder(key) is not None:
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


_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_REFRESH_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class RedisSessionStore:
    """Session records in Redis, shared by every replica using the same key prefix.

    Keys (``owner`` is percent-encoded so it cannot contain ``:``)::

        {prefix}sess:{owner}:{session_id}       the record (encode_record), TTL ttl_s
        {prefix}sess-lock:{owner}:{session_id}  the turn lock (holder id), PX lease
        {prefix}sess-ids:{owner}                sorted set of the owner's ids (score 0,
                                                so ZRANGEBYLEX pages them in id order)

    An expired record leaves its id in the index until a ``list`` finds it gone and
    removes it. ``client`` is a ``redis.asyncio`` client (or cluster client) with
    ``decode_responses=False``; the store does not own it unless built by ``from_url``.
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

    async def put(self, rec: SessionRecord) -> None:
        pipe = self._r.pipeline(transaction=False)
        pipe.set(self._key("sess", rec.owner, rec.session_id), encode_record(rec), px=self._ttl_ms)
        pipe.zadd(self._key("sess-ids", rec.owner), {rec.session_id: 0})
        await pipe.execute()

    async def delete(self, owner: str, session_id: str) -> bool:
        pipe = self._r.pipeline(transaction=False)
        pipe.delete(self._key("sess", owner, session_id))
        pipe.zrem(self._key("sess-ids", owner), session_id)
        deleted, _ = await pipe.execute()
        return bool(deleted)

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

    async def try_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        key = self._key("sess-lock", owner, session_id)
        return bool(await self._r.set(key, holder, nx=True, px=max(1, int(ttl_s * 1000))))

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
    Redis fails (down, timing out), or when Redis holds an older version of a record this
    replica wrote (same session incarnation, fewer turns: a write that missed Redis). So while Redis is away, sessions this replica
    served keep working here (turns are not refused), and a write that missed Redis is
    written again by the session's next successful turn. What cannot be had while Redis
    is down: sessions only another replica served.
    """

    def __init__(
        self, primary: SessionStore, local: InMemorySessionStore | None = None, *, unlock_retry_s: float = 0.5
    ) -> None:
        self.primary = primary
        self.local = local or InMemorySessionStore()
        self.primary_errors = 0
        self._unlock_retry_s = unlock_retry_s
        self._retries: set[asyncio.Task] = set()  # unlocks that missed Redis, tried again

    async def _try(self, what: str, call):
        try:
            return True, await call()
        except Exception as e:  # noqa: BLE001 - any backend failure falls back
            self.primary_errors += 1
            log.warning("session store: Redis %s failed (%s); using this replica's copy", what, e)
            return False, None

    async def get(self, owner: str, session_id: str) -> SessionRecord | None:
        ok, rec = await self._try("get", lambda: self.primary.get(owner, session_id))
        local = await self.local.get(owner, session_id)
        if not ok or rec is None:
            return local  # Redis is away, or lost it (eviction, restart): ours is still good
        if local is not None and local.created_at == rec.created_at and local.turns > rec.turns:
            # A write of ours missed Redis (a timeout, a blip) and it kept an older
            # version: using it would drop turns from the transcript. The next put repairs it.
            log.warning("session %r: Redis has %d turns, this replica %d; using this replica's record",
                        session_id, rec.turns, local.turns)  # fmt: skip
            return local
        return rec

    async def put(self, rec: SessionRecord) -> None:
        await self.local.put(rec)
        await self._try("put", lambda: self.primary.put(rec))

    async def delete(self, owner: str, session_id: str) -> bool:
        here = await self.local.delete(owner, session_id)
        ok, there = await self._try("delete", lambda: self.primary.delete(owner, session_id))
        return bool(there) or here

    async def list(self, owner: str, page_size: int, page_token: str = "") -> tuple[list[SessionRecord], str]:
        ok, page = await self._try("list", lambda: self.primary.list(owner, page_size, page_token))
        return page if ok else await self.local.list(owner, page_size, page_token)

    async def try_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        ok, got = await self._try("lock", lambda: self.primary.try_lock(owner, session_id, holder, ttl_s))
        if ok:
            return bool(got)
        return await self.local.try_lock(owner, session_id, holder, ttl_s)

    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        ok, got = await self._try("lock refresh", lambda: self.primary.refresh_lock(owner, session_id, holder, ttl_s))
        return bool(got) if ok else await self.local.refresh_lock(owner, session_id, holder, ttl_s)

    async def unlock(self, owner: str, session_id: str, holder: str) -> None:
        """An unlock that misses Redis is tried again in the background for a few
        seconds, so a blip does not leave the session busy until the lease runs out."""
        await self.local.unlock(owner, session_id, holder)
        ok, _ = await self._try("unlock", lambda: self.primary.unlock(owner, session_id, holder))
        if not ok and len(self._retries) < 10_000:
            task = asyncio.create_task(self._retry_unlock(owner, session_id, holder))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    async def _retry_unlock(self, owner: str, session_id: str, holder: str) -> None:
        for _ in range(8):
            await asyncio.sleep(self._unlock_retry_s)
            try:
                await self.primary.unlock(owner, session_id, holder)
                return
            except Exception as e:  # noqa: BLE001 - still away; the lease is the backstop
                log.debug("unlock of session %r still fails: %s", session_id, e)

    async def is_locked(self, owner: str, session_id: str) -> bool:
        ok, got = await self._try("lock check", lambda: self.primary.is_locked(owner, session_id))
        return bool(got) if ok else await self.local.is_locked(owner, session_id)

    async def count(self, owner: str, *, prune_at: int | None = None) -> int:
        primary = self.primary
        if isinstance(primary, RedisSessionStore):
            ok, n = await self._try("count", lambda: primary.count(owner, prune_at=prune_at))
        else:
            ok, n = await self._try("count", lambda: primary.count(owner))
        return int(n) if ok else await self.local.count(owner)

    async def expire(self) -> list[SessionRecord]:
        """Expire this replica's copies; report those whose Redis record is gone (or
        unreachable) or as old, not the ones another replica has used since."""
        out = []
        for rec in await self.local.expire():
            ok, there = await self._try("get", lambda r=rec: self.primary.get(r.owner, r.session_id))
            if ok and there is not None and there.last_used_at > rec.last_used_at:
                continue  # still alive elsewhere
            out.append(rec)
        ok, more = await self._try("expire", self.primary.expire)
        return out + (list(more) if ok and more else [])

    async def close(self) -> None:
        for task in list(self._retries):
            task.cancel()
        await self.primary.close()
        await self.local.close()


# ----------------------------------------------------------------------------- the table


@dataclass(slots=True)
class Turn:
    """One turn in flight: the record as it was at the start, and the lock lease."""

    record: SessionRecord
    holder: str
    created: bool  # this turn created the session
    _renewal: asyncio.Task | None = None
    committed: bool = False


class SessionManager:
    """The session table used by the servicer: one turn at a time per session.

    ``lock_ttl_s`` is the lease of a turn's lock; it is renewed every third of it while
    the turn runs, so a crashed replica's lock frees itself after at most that long.
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
    ) -> None:
        self.store = store
        self._lock_ttl_s = lock_ttl_s
        self.max_sessions_per_owner = max_sessions_per_owner
        self._clock = clock
        self._create_lock = asyncio.Lock()

    async def begin_turn(self, owner: str, session_id: str) -> Turn:
        """Lock the session (creating it if new) and return its record as of now.

        Raises InvalidSessionId or SessionBusy.
        """
        check_session_id(session_id)
        holder = uuid.uuid4().hex
        if not await self.store.try_lock(owner, session_id, holder, self._lock_ttl_s):
            raise SessionBusy(f"session {session_id!r} already has a turn in flight; retry when it finishes")
        try:
            rec = await self.store.get(owner, session_id)
            created = rec is None
            if rec is None:
                async with self._create_lock:
                    await self._check_room(owner)
                    rec = SessionRecord(session_id=session_id, owner=owner, created_at=self._clock())
                    rec.last_used_at = rec.created_at
                    await self.store.put(rec)
            else:
                rec.last_used_at = self._clock()
                await self.store.put(rec)
        except BaseException:
            await self.store.unlock(owner, session_id, holder)
            raise
        turn = Turn(record=rec, holder=holder, created=created)
        turn._renewal = asyncio.create_task(self._renew(turn), name=f"session-lock-{session_id}")
        return turn

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
        ``cache_salt`` is the turn's request salt (where its KV blocks are keyed)."""
        rec = turn.record
        if list(prompt_token_ids[: len(rec.token_ids)]) != rec.token_ids:
            raise RuntimeError("turn prompt does not extend the session transcript")
        rec.token_ids = list(prompt_token_ids) + list(output_token_ids)
        rec.cache_salt = cache_salt
        rec.turns += 1
        rec.last_used_at = self._clock()
        await self.store.put(rec)
        turn.committed = True
        return rec

    async def end_turn(self, turn: Turn) -> None:
        """Release the lock. Without a commit the transcript stays as before the turn
        (a session whose first turn did not complete is removed again)."""
        if turn._renewal is not None:
            turn._renewal.cancel()
        rec = turn.record
        try:
            if turn.created and not turn.committed:
                await self.store.delete(rec.owner, rec.session_id)
        finally:
            await self.store.unlock(rec.owner, rec.session_id, turn.holder)

    async def _renew(self, turn: Turn) -> None:
        rec = turn.record
        while True:
            await asyncio.sleep(self._lock_ttl_s / 3)
            try:
                if not await self.store.refresh_lock(rec.owner, rec.session_id, turn.holder, self._lock_ttl_s):
                    log.warning("lost the turn lock of session %r", rec.session_id)
                    return
            except Exception:  # the store may be briefly unreachable; the lease covers it
                log.warning("could not renew the turn lock of session %r", rec.session_id, exc_info=True)

    async def get(self, owner: str, session_id: str) -> tuple[SessionRecord, bool]:
        """The record and whether a turn is in flight. Raises SessionNotFound."""
        check_session_id(session_id)
        rec = await self.store.get(owner, session_id)
        if rec is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return rec, await self.store.is_locked(owner, session_id)

    async def delete(self, owner: str, session_id: str) -> SessionRecord:
        """Remove the session and return its last record. Raises SessionNotFound, or
        SessionBusy while a turn runs."""
        check_session_id(session_id)
        if await self.store.is_locked(owner, session_id):
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
        return list(zip(recs, busy)), next_token


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
