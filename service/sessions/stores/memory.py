"""``InMemorySessionStore``: session records in a dict of this process (lost on restart);
also the fallback's copy behind Redis (``fallback.py``) and the disk store's base (``disk.py``)."""

from __future__ import annotations

import time
from typing import Callable

from ..records import SessionRecord, copy_record
from .protocol import CONFLICT, LIMIT, Expect, FlushReport, cas_outcome


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
