"""Idle sessions spill: their KV blocks are written to host memory and/or Redis.

When a session's turn completes, the conversation calls ``touch``. Once the session has
been idle for ``spill_after_s`` every full block of its transcript is queued for the
cache store's background writer, from whichever tier holds it (the device pool, or the
host tier for blocks already demoted there); from then on the device copy is evictable
at no loss, and any replica (or this one after a restart) can restore them.

On shutdown, ``persist_all`` writes every full block of every remembered session that
the drain's tier (``ModelInfo.shared_tier``: Redis, which every replica reads, or with
no Redis the disk tier, which this server restarted reads) does not yet hold, from the
device or the host tier, bounded by a timeout, so a rolling deploy loses no cache; it
reports how many blocks that tier holds and how many were left (``DrainReport``, logged
by the server and counted in ``drained_blocks`` / ``drain_left_blocks``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .types import CacheScope

if TYPE_CHECKING:
    from .engine import AsyncEngine

log = logging.getLogger(__name__)


TIER_WORDS = {"redis": "Redis", "disk": "the disk tier"}  # the drain's tier, as its log line names it


@dataclass(frozen=True, slots=True)
class DrainReport:
    sessions: int  # sessions this replica remembers
    blocks: int  # their full blocks
    held: int  # of those, held by the drain's tier afterwards (written now or already there)
    written: int  # blocks that tier newly stored during the drain
    left: int  # full blocks not in that tier when the drain ended (timeout, tier away or full, queue full)
    complete: bool  # every block is in that tier and every queued write is through
    tier: str | None = None  # the drain's tier (``ModelInfo.shared_tier``: redis, else disk); None: none

    @property
    def where(self) -> str:
        """The drain's tier in words, for the log line."""
        return TIER_WORDS.get(self.tier or "", str(self.tier))


@dataclass(slots=True)
class _Idle:
    token_ids: list[int]
    scope: CacheScope
    last_used: float
    spilled_to: frozenset[str] = frozenset()


class SpillScheduler:
    def __init__(
        self,
        engine: AsyncEngine,
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
        self.shared_tier = engine.model_info.shared_tier  # where the drain writes (Redis), or None
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[tuple[str, str], _Idle] = OrderedDict()
        self._task: asyncio.Task | None = None
        self.spilled_sessions = 0
        self.spilled_blocks = 0
        self.drained_blocks = 0  # blocks the drain left in its tier (written or already there)
        self.drain_left_blocks = 0  # blocks the drain could not get into its tier

    @property
    def enabled(self) -> bool:
        return bool(self.tiers)

    def touch(self, owner: str, session_id: str, token_ids: list[int], scope: CacheScope) -> None:
        """A turn of this session completed now (remembered for the idle spill and, with
        Redis, for the drain)."""
        if not self.enabled and self.shared_tier is None:
            return
        key = (owner, session_id)
        self._sessions[key] = _Idle(list(token_ids), scope, self._clock())
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

    async def persist_all(self, timeout_s: float) -> DrainReport:
        """Write every full block of every remembered session to the drain's tier
        (``shared_tier``: Redis, else the disk tier) on shutdown, from the device or the
        host tier, within ``timeout_s``."""
        shared = self.shared_tier
        if shared is None:
            return DrainReport(len(self._sessions), 0, 0, 0, 0, True)
        deadline = time.monotonic() + timeout_s
        puts_before = self._shared_puts()
        blocks = held_n = 0
        complete = True
        for s in list(self._sessions.values()):
            n = len(s.token_ids) // self.engine.model_info.block_size
            blocks += n
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                complete = False
                continue
            try:
                n, held = await asyncio.wait_for(self._spill(s, (shared,), force=True), remaining)
            except asyncio.TimeoutError:
                complete = False
                continue
            held_n += min(held.get(shared, 0), n)
        flushed = await self.engine.flush_store(max(deadline - time.monotonic(), 0.0))
        report = DrainReport(
            sessions=len(self._sessions), blocks=blocks, held=held_n,
            written=self._shared_puts() - puts_before, left=blocks - held_n,
            complete=complete and flushed and held_n == blocks, tier=shared,
        )  # fmt: skip
        self.drained_blocks += report.held
        self.drain_left_blocks += report.left
        return report

    def _shared_puts(self) -> int:
        store = self.engine.cache_stats().store
        stats = store.tiers.get(self.shared_tier) if store is not None and self.shared_tier else None
        return stats.puts if stats is not None else 0

    async def _spill(self, s: _Idle, tiers: tuple[str, ...], force: bool = False) -> tuple[int, dict[str, int]]:
        """Spill every full block of the session (device or host) and remember the
        tiers that now hold all of them; a tier that missed some (Redis down, queue
        full, a block no tier holds any more) is tried again on the next pass.
        Returns (full blocks, how many each tier holds)."""
        if not force and set(tiers) <= s.spilled_to:
            return 0, {}
        n, held = await self.engine.spill(s.token_ids, s.scope, tiers)
        if n == 0:  # no full block
            s.spilled_to = s.spilled_to | set(tiers)
            return 0, {t: 0 for t in tiers}
        s.spilled_to = s.spilled_to | {t for t in tiers if held.get(t, 0) >= n}
        self.spilled_sessions += 1
        self.spilled_blocks += n
        return n, held
