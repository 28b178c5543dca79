"""Session warm-up (WarmSession): a session's blocks into the device pool before its next turn.

A client that knows a session is coming back (the user opened the chat, started typing)
asks for it; ``LLMEngine.warm`` runs it in hops, each on the thread that may do it:

1. engine thread, ``begin``: the transcript's leading blocks already on the device are
   held (a reference each, so nothing evicts them) and the rest is named;
2. ``kv-restore`` thread (``Restorer.locate_warm``): which leading ones of the rest a
   store tier (host, disk, Redis) holds;
3. engine thread, ``allocate``: fresh device blocks for them within the caps, taken
   from free or evictable cached blocks only (``BlockManager.allocate``: a block of a
   running request has a reference and is never handed out); ``kv-restore``
   (``Restorer.fetch_warm``) loads and verifies them straight into those blocks;
4. engine thread, ``landed``: the loaded blocks are registered under their hashes and
   held; the others are freed (a block that failed to load is a miss, never wrong KV).

Bounds: the blocks held and those in flight count against ``max_blocks`` in all and
``max_blocks_per_tenant`` per tenant; past them a warm-up holds what it can and reports
the rest ``over_cap``. A held block is let go (an ordinary evictable cached block
again) when a turn uses it (``claim``: the turn took its own reference; a *hit*), when
``ttl_s`` passes without one (``expire``: *waste*), when a sequence needs a block and none
is free (``reclaim``, oldest first, before anything waits or is preempted: waste), or
when its session is deleted (``forget``: waste). A warm-up is in flight from ``begin``
until ``landed``, whichever hop it is at (a lookup on the restore thread, loads into its
blocks): a session deleted meanwhile cancels it, so it allocates nothing more, and what it
loaded is freed instead of held. Warming twice is harmless: a held block is held once and
its deadline renewed.

Pure bookkeeping over the ``BlockManager`` (no tensors, no store): engine thread only,
but ``stats`` (a snapshot any thread may take).
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvserve.cachestore.keys import BlockHash
from ..kv.block_manager import Block, BlockManager
from ..types import Tier, WarmResult, WarmStats

EXPIRED, RECLAIMED, FORGOTTEN = "expired", "reclaimed", "forgotten"  # why a warmed block went unused


@dataclass(slots=True)
class _Pin:
    block: Block
    tenant: str
    deadline: float  # monotonic seconds


@dataclass(slots=True)
class WarmJob:
    """One warm-up in flight: the transcript's chain, what is held, what is loading."""

    namespace: bytes
    hashes: list[BlockHash]  # every full block of the transcript
    tenant: str
    token_ids: Sequence[int] = ()  # the transcript (the blocks' tokens, for the KV events)
    on_device: int = 0  # leading blocks that were on the device (held within the caps)
    located: int = 0  # leading blocks past those that a store tier holds
    blocks: list[Block] = field(default_factory=list)  # fresh blocks being loaded into
    cancelled: bool = False  # its session was forgotten meanwhile: allocate, register and hold nothing

    @property
    def rest(self) -> list[BlockHash]:
        """The blocks past the device hits: what a restore may load."""
        return self.hashes[self.on_device :]


class Warmer:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_blocks: int,
        max_blocks_per_tenant: int,
        ttl_s: float,
        block_size: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.blocks = blocks
        self.block_size = block_size  # tokens per block: a landed block's tokens are the transcript's
        self.max_blocks = max_blocks
        self.max_blocks_per_tenant = max_blocks_per_tenant
        self.ttl_s = ttl_s
        self.clock = clock
        self._pins: OrderedDict[int, _Pin] = OrderedDict()  # block id -> pin, earliest deadline first
        self._held: Counter[str] = Counter()  # tenant -> blocks held + in flight
        self._in_flight = 0
        self._jobs: list[WarmJob] = []  # warm-ups in flight: from begin to landed
        self.num_requests = 0
        self.num_hits = 0
        self.num_claimed = 0
        # fixed keys: stats() reads them from other threads while this one counts
        self.restored: Counter[Tier] = Counter({Tier.HOST: 0, Tier.DISK: 0, Tier.REDIS: 0})
        self.wasted: Counter[str] = Counter({EXPIRED: 0, RECLAIMED: 0, FORGOTTEN: 0})

    # ---- a warm-up -------------------------------------------------------------------

    def begin(self, namespace: bytes, hashes: list[BlockHash], tenant: str, token_ids: Sequence[int] = ()) -> WarmJob:
        """Hold the leading blocks already on the device (within the caps); the warm-up is
        in flight until ``landed``."""
        self.num_requests += 1
        job = WarmJob(namespace, hashes, tenant, token_ids)
        hits = self.blocks.match_prefix(hashes)
        for block in hits:
            self._hold(block, tenant)  # past the caps a hit stays on the device, not held
        job.on_device = len(hits)
        self._jobs.append(job)
        return job

    def allocate(self, job: WarmJob, located: int) -> list[Block]:
        """Fresh blocks for the first ``located`` of ``job.rest`` (those a tier holds),
        as many as the caps and the free or evictable device blocks allow."""
        job.located = located
        n = min(located, self.room(job.tenant), self.blocks.num_free)
        if n <= 0 or job.cancelled:
            return []
        job.blocks = self.blocks.allocate(n)  # free first, then the least recently used cached
        self._in_flight += n
        self._held[job.tenant] += n
        return job.blocks

    def loading(self) -> bool:
        """Blocks are in flight to a warm-up: they are free or held (reclaimable) once it
        lands, so a sequence short of blocks now waits for that instead of being refused."""
        return self._in_flight > 0

    def landed(self, job: WarmJob, loaded: list[str]) -> WarmResult:
        """The first ``len(loaded)`` of ``job.blocks`` hold their blocks' KV (from those
        tiers): register and hold them, free the rest; what the warm-up did."""
        if job in self._jobs:
            self._jobs.remove(job)
            if job.blocks:
                self._in_flight -= len(job.blocks)
                self._held[job.tenant] -= len(job.blocks)
        by_tier: Counter[Tier] = Counter()
        for i, block in enumerate(job.blocks):
            if job.cancelled or i >= len(loaded):
                self.blocks.free([block])
                continue
            j, B = job.on_device + i, self.block_size
            kept = self.blocks.register(block, job.hashes[j], job.namespace,
                                        parent=job.hashes[j - 1] if j else None, tokens=job.token_ids[j * B : (j + 1) * B])
            if kept is block:
                self._pins[block.block_id] = _Pin(block, job.tenant, self.clock() + self.ttl_s)
                self._held[job.tenant] += 1
            else:  # a turn computed or restored it meanwhile: hold that one instead
                self.blocks.free([block])
                self._hold(kept, job.tenant)
            by_tier[Tier(loaded[i])] += 1
        restored = sum(by_tier.values())
        self.restored.update(by_tier)
        over_cap = 0 if job.cancelled else job.located - len(job.blocks)  # cancelled: the rest is gone, missing
        return WarmResult(
            blocks=len(job.hashes),
            on_device=job.on_device,
            restored=restored,
            missing=len(job.rest) - over_cap - restored,
            over_cap=over_cap,
            restored_by_tier=dict(by_tier),
            ttl_s=self.ttl_s,
        )

    def room(self, tenant: str) -> int:
        """Blocks ``tenant`` may still hold (the server's and the tenant's caps)."""
        total = len(self._pins) + self._in_flight
        return max(0, min(self.max_blocks - total, self.max_blocks_per_tenant - self._held[tenant]))

    def _hold(self, block: Block, tenant: str) -> bool:
        pin = self._pins.get(block.block_id)
        if pin is not None:  # held already: a new deadline
            pin.deadline = self.clock() + self.ttl_s
            self._pins.move_to_end(block.block_id)
            return True
        if self.room(tenant) <= 0:
            return False
        self.blocks.touch([block])
        self._pins[block.block_id] = _Pin(block, tenant, self.clock() + self.ttl_s)
        self._held[tenant] += 1
        return True

    # ---- letting go ------------------------------------------------------------------

    def holds_any(self) -> bool:
        return bool(self._pins)

    def claim(self, device_hits: list[Block]) -> int:
        """A sequence was admitted with these device hits (a reference of its own on
        each): the warmed ones among them are let go; returns how many."""
        n = 0
        for block in device_hits:
            pin = self._pins.pop(block.block_id, None)
            if pin is not None:
                self._release(pin)
                n += 1
        if n:
            self.num_hits += 1
            self.num_claimed += n
        return n

    def due(self) -> bool:
        """Whether a held block's deadline passed (the engine loop asks between steps)."""
        return bool(self._pins) and next(iter(self._pins.values())).deadline <= self.clock()

    def expire(self) -> int:
        """Let go of the blocks whose deadline passed; returns how many."""
        now = self.clock()
        n = 0
        while self._pins:
            block_id, pin = next(iter(self._pins.items()))
            if pin.deadline > now:
                break
            del self._pins[block_id]
            self._release(pin)
            n += 1
        self.wasted[EXPIRED] += n
        return n

    def reclaim(self, n: int) -> int:
        """A sequence needs ``n`` blocks and too few are free: let go of held blocks,
        oldest first, that nothing else uses (each becomes free or evictable) until
        ``n`` did; returns how many did."""
        freed = 0
        for block_id, pin in list(self._pins.items()):
            if freed >= n:
                break
            if pin.block.ref_count != 1:  # a running sequence uses it too: letting go frees nothing
                continue
            del self._pins[block_id]
            self._release(pin)
            freed += 1
        self.wasted[RECLAIMED] += freed
        return freed

    def forget(self, hashes: set[BlockHash], blocks: list[Block]) -> None:
        """A transcript's blocks are being forgotten (its session was deleted): let go of
        those held, and a warm-up in flight over them, at whichever hop, allocates,
        registers and holds nothing more."""
        for job in self._jobs:
            if not hashes.isdisjoint(job.rest):
                job.cancelled = True
        for block in blocks:
            pin = self._pins.pop(block.block_id, None)
            if pin is not None:
                self._release(pin)
                self.wasted[FORGOTTEN] += 1

    def _release(self, pin: _Pin) -> None:
        self._held[pin.tenant] -= 1
        if self._held[pin.tenant] <= 0:
            del self._held[pin.tenant]
        self.blocks.free([pin.block])

    def stats(self) -> WarmStats:
        return WarmStats(
            requests=self.num_requests,
            blocks_restored={t: n for t, n in list(self.restored.items()) if n},
            pinned_blocks=len(self._pins),
            hits=self.num_hits,
            claimed_blocks=self.num_claimed,
            wasted_blocks=dict(list(self.wasted.items())),
        )
