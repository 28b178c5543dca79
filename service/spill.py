"""Idle sessions spill: their KV blocks are written to host memory and/or Redis.

When a session's turn completes, the servicer calls ``touch``. Once the session has
been idle for ``spill_after_s`` its blocks (still on the device, as cache) are queued
for the cache store's background writer; from then on the device copy is evictable at
no loss, and any replica (or this one after a restart) can restore them.

On shutdown, ``persist_all`` writes every remembered session that Redis does not yet
hold, bounded by a timeout, so a rolling deploy loses no cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Idle:
    token_ids: list[int]
    cache_salt: str
    last_used: float
    spilled_to: frozenset[str] = frozenset()


class SpillScheduler:
    def __init__(
        self,
        engine: Any,  # AsyncEngine
        *,
        spill_after_s: float,
        tiers: tuple[str, ...],
        max_sessions: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        configured = set(engine.model_info.tiers)
        self.engine = engine
        self.spill_after_s = spill_after_s
        self.tiers = tuple(t for t in tiers if t in configured)
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[tuple[str, str], _Idle] = OrderedDict()
        self._task: asyncio.Task | None = None
        self.spilled_sessions = 0
        self.spilled_blocks = 0

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def touch(self, owner: str, session_id: str, token_ids: list[int], cache_salt: str) -> None:
        """A turn of this session completed now."""
        if not self.enabled:
            return
        key = (owner, session_id)
        self._sessions[key] = _Idle(list(token_ids), cache_salt, self._clock())
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def forget(self, owner: str, session_id: str) -> None:
        self._sessions.pop((owner, session_id), None)

    def start(self) -> None:
        if self.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvserve-spill")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _loop(self) -> None:
        period = min(max(self.spill_after_s / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(period)
            try:
                await self.spill_idle()
            except Exception:
                log.exception("spilling idle sessions failed")

    async def spill_idle(self) -> int:
        """Spill every session idle for at least ``spill_after_s``; returns how many."""
        now = self._clock()
        due = [
            (k, s)
            for k, s in self._sessions.items()
            if now - s.last_used >= self.spill_after_s and not set(self.tiers) <= s.spilled_to
        ]
        for key, s in due:
            await self._spill(s, self.tiers)
        return len(due)

    async def persist_all(self, timeout_s: float) -> bool:
        """Write every remembered session to Redis (drain on shutdown), bounded."""
        if "redis" not in self.engine.model_info.tiers:
            return True
        deadline = time.monotonic() + timeout_s
        for s in list(self._sessions.values()):
            if "redis" in s.spilled_to:
                continue
            if time.monotonic() >= deadline:
                return False
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._spill(s, ("redis",)), remaining)
            except asyncio.TimeoutError:
                return False
        return await self.engine.flush_store(max(deadline - time.monotonic(), 0.0))

    async def _spill(self, s: _Idle, tiers: tuple[str, ...]) -> None:
        """Spill and remember the tiers that now hold every block; a tier that missed
        some (Redis down, queue full) is tried again on the next pass."""
        n, held = await self.engine.spill(s.token_ids, s.cache_salt, tiers)
        if n == 0:  # nothing on the device any more (evicted, already demoted)
            s.spilled_to = s.spilled_to | set(tiers)
            return
        s.spilled_to = s.spilled_to | {t for t in tiers if held.get(t, 0) >= n}
        self.spilled_sessions += 1
        self.spilled_blocks += n
