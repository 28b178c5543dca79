"""Host-memory tier: an LRU of KV blocks, bounded by bytes, in one preallocated slab.

The slab holds ``capacity_bytes // block_nbytes`` block buffers, allocated once and
reused: a put copies into a free slot or into the least recently used one, never
allocating (fresh allocations are ~4x slower than memcpy into warm memory). Reads copy
out of the slot into a destination the caller owns (``get_into``: e.g. a device-pool
block), so a block is never visible half-written and a slot is never read while it is
reused.

Pinned (the device is CUDA): the slab is one ordinary allocation of exactly its size,
page-locked with ``cudaHostRegister`` in chunks of ``pin_chunk_bytes`` (torch's pinned
allocator would round the size up to a power of two: 40 GiB would lock 64), with a
progress line every few seconds for a large slab. A restore then copies straight out of
the slots to the device (``hold``: DMA, no staging copy on the CPU), in one copy per run
of consecutive slots within a chunk (``HeldBlocks.spans``); the slots are not locked
meanwhile: each keeps the generation it had when held, and ``release`` (after the copies
completed) counts only the leading blocks whose slots no put took in between, so a slot
reused while it was being copied ends the restore there instead of landing torn.

Retention (``cachestore.base``): a pinned block keeps its slot until its time passes;
eviction takes the least recently used block no retention pins (pinned blocks it meets
on the way are moved to the back of the LRU), and a slab whose every slot is pinned
refuses new blocks (``put`` returns False: the store demotes them past this tier).

Eviction calls ``on_evict(ref, block)`` with a view of the slot *before* it is reused;
the view is valid only during the call, so the callback copies or encodes it (the
tiered store encodes it for Redis). The callback runs without the tier's lock held and
must not raise (exceptions are counted and swallowed).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from typing import Callable, Sequence

import numpy as np
import torch

from kvserve.common.tiers import Tier

from .base import NOT_FOUND, BlockRef, BlockTier, HeldBlocks, LayeredRead, TierCounters, TierObserver, TierStats
from .codec import byte_view, cpu_byte_view

log = logging.getLogger(__name__)

EvictCallback = Callable[[BlockRef, torch.Tensor], None]


class HostTier(BlockTier):
    """LRU of blocks in host memory. See the module docstring and ``cachestore.base``."""

    name = Tier.HOST
    writes_inline = True  # a put is a memcpy into the slab
    retains = True

    def __init__(
        self,
        capacity_bytes: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        pin_memory: bool = False,
        on_evict: EvictCallback | None = None,
        pin_chunk_bytes: int = 1 << 30,
    ) -> None:
        """``pin_memory`` asks for page-locked memory (only when the device is CUDA;
        raises ValueError if CUDA is not available, ``PinError`` if the memory cannot be
        locked); ``pin_chunk_bytes``: the size of each registration (a copy out of the
        slab never spans two)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA, which is not available")
        self._init_block(block_shape, dtype)
        self.pinned = pin_memory
        self.capacity_blocks = capacity_bytes // self.block_nbytes
        self.capacity_bytes = self.capacity_blocks * self.block_nbytes
        # slots per registered chunk: the runs ``hold`` hands out stay inside one
        self.chunk_blocks = max(1, pin_chunk_bytes // self.block_nbytes)
        # (capacity_blocks, L, 2, B, n_kv, hd); unpinned, pages are touched on first write.
        self._slab = torch.empty((self.capacity_blocks, *self.block_shape), dtype=dtype)
        if pin_memory and self.capacity_bytes:
            ptrs = pin_host_memory(self._slab, self.chunk_blocks * self.block_nbytes, "the host KV tier")
            weakref.finalize(self._slab, unpin_host_memory, ptrs)  # before the memory is freed
        # Slot i is self._slab[i] (a view) and, for memcpy, row i of one uint8 view of the
        # slab: O(1) to build whatever the slot count (a view per slot, built up front,
        # cost seconds at the default 1 GiB of small blocks: 262,144 of them).
        self._slot_bytes: np.ndarray = byte_view(self._slab).reshape(self.capacity_blocks, self.block_nbytes)
        self._torch_shape = torch.Size(self.block_shape)
        self._free: list[int] = list(range(self.capacity_blocks - 1, -1, -1))
        self._lru: OrderedDict[BlockRef, int] = OrderedDict()  # oldest first
        self._gen = [0] * self.capacity_blocks  # per slot: bumped each time a put takes it
        self._pins: dict[BlockRef, float] = {}  # retained blocks (all held) -> unix time they are pinned until
        self._expired = 0
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self._counters = TierCounters(self.name)

    def set_on_evict(self, on_evict: EvictCallback | None) -> None:
        """Install the eviction callback (the tiered store installs its demotion)."""
        self._on_evict = on_evict

    def set_observer(self, observer: TierObserver | None) -> None:
        """Report the blocks held now to ``observer``, then every change (``cachestore.base``)."""
        with self._lock:
            self._observer = observer
            self._stored([ref.block_hash for ref in self._lru])

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    # ---- reads ---------------------------------------------------------------------

    def get_into(self, ref: BlockRef, out: torch.Tensor) -> bool:
        """Copy the block into ``out`` (same shape and dtype, any device). Refreshes its
        LRU position. False on a miss."""
        return self.get_many_into([ref], [out]) == 1

    def get_many_into(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> int:
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        t0 = time.perf_counter()
        n = 0
        for ref, out in zip(refs, outs):
            self._check_block(out, "out")
            dst = cpu_byte_view(out)
            with self._lock:
                slot = self._lru.get(ref)
                if slot is None:
                    break
                self._lru.move_to_end(ref)
                # Copy under the lock: the slot cannot be evicted and reused meanwhile.
                if dst is not None:
                    np.copyto(dst, self._slot_bytes[slot])
                else:
                    out.copy_(self._slab[slot])
            n += 1
        self._counters.add(hits=n, bytes_out=n * self.block_nbytes)
        if n < len(refs):
            self._counters.add(misses=1)
            self._counters.fail(NOT_FOUND)
        self._counters.add_seconds("read", time.perf_counter() - t0)
        return n

    def layered_read(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> LayeredRead | None:
        """Layer by layer out of the slots: each ``read`` copies its layers of every
        leading block still held, under the lock, and a block whose slot was evicted or
        reused since the first ``read`` (its generation moved) ends the read there."""
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        for out in outs[: len(refs)]:
            self._check_block(out, "out")
        if not all(cpu_byte_view(o) is not None for o in outs[: len(refs)]):
            return None  # a device destination: whole blocks (the CUDA path stages them)
        return _HostLayers(self, refs, outs)

    def hold(self, refs: Sequence[BlockRef]) -> HeldBlocks:
        """The leading blocks of ``refs`` the tier holds, read in place (a restore's copies
        to the device go straight out of the slots: see the module docstring). Refreshes
        their LRU positions; hits are counted by ``release``."""
        return _HeldSlots(self, refs)

    def copy_out(self, ref: BlockRef, out: torch.Tensor) -> bool:
        """Copy the block into ``out`` to write it elsewhere (a spill, the drain): unlike
        ``get_into`` it is not a restore, so it counts no hit and keeps the LRU order."""
        self._check_block(out, "out")
        dst = cpu_byte_view(out)
        with self._lock:
            slot = self._lru.get(ref)
            if slot is None:
                return False
            if dst is not None:
                np.copyto(dst, self._slot_bytes[slot])
            else:
                out.copy_(self._slab[slot])
        return True

    def get(self, ref: BlockRef) -> torch.Tensor | None:
        """A fresh copy of the block (allocates; the engine uses ``get_into``)."""
        out = torch.empty(self.block_shape, dtype=self.dtype)
        return out if self.get_into(ref, out) else None

    def contains(self, ref: BlockRef) -> bool:
        with self._lock:
            return ref in self._lru

    def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        with self._lock:
            return [r in self._lru for r in refs]

    # ---- writes --------------------------------------------------------------------

    def put(self, ref: BlockRef, value: torch.Tensor) -> bool:
        """Store a copy of ``value`` (any device). Idempotent: a ref already held is only
        refreshed in the LRU. Evicts the least recently used block when full (calling
        ``on_evict`` first). False only when the tier has no capacity at all."""
        self._check_block(value, "value")
        t0 = time.perf_counter()
        with self._lock:
            if ref in self._lru:
                self._lru.move_to_end(ref)
                self._counters.add(put_skips=1)
                return True
            if self._free:
                slot, victim = self._free.pop(), None
            elif (lru := self._victim()) is not None:
                victim, slot = lru
            else:  # no capacity, or every slot pinned
                return False
            self._gen[slot] += 1  # a layered read of the slot's previous block stops there
            if victim is not None:
                self._removed([victim.block_hash])
        # The slot is private now: not in the LRU, not in the free list.
        if victim is not None:
            self._counters.add(evictions=1)
            if self._on_evict is not None:
                try:
                    self._on_evict(victim, self._slab[slot])
                except Exception:  # noqa: BLE001 - a demotion failure must not fail the put
                    log.exception("host tier on_evict callback failed")
                    self._counters.fail("evict_callback")
        src = cpu_byte_view(value)
        if src is not None:
            np.copyto(self._slot_bytes[slot], src)
        else:
            self._slab[slot].copy_(value)
        with self._lock:
            if ref in self._lru:  # another thread stored it meanwhile: keep theirs
                self._free.append(slot)
                self._counters.add(put_skips=1)
                return True
            self._lru[ref] = slot
            self._stored([ref.block_hash])
        self._counters.add(puts=1, bytes_in=self.block_nbytes)
        self._counters.add_seconds("write", time.perf_counter() - t0)
        return True

    def _victim(self) -> tuple[BlockRef, int] | None:
        """Under the lock: the least recently used block no retention pins, out of the
        LRU (the pinned ones met on the way go to its back); None when every block held
        is pinned."""
        if len(self._pins) >= len(self._lru):
            return None
        while True:
            ref, slot = self._lru.popitem(last=False)
            if ref not in self._pins:
                return ref, slot
            self._lru[ref] = slot

    def delete(self, ref: BlockRef) -> bool:
        """Drop the block, pinned or not (the tiered store does not delete retained blocks)."""
        with self._lock:
            slot = self._lru.pop(ref, None)
            if slot is None:
                return False
            self._pins.pop(ref, None)
            self._free.append(slot)
            self._removed([ref.block_hash])
            return True

    def clear(self) -> None:
        """Drop every block, pins included (no eviction callbacks)."""
        with self._lock:
            self._removed([ref.block_hash for ref in self._lru])
            self._lru.clear()
            self._pins.clear()
            self._free = list(range(self.capacity_blocks - 1, -1, -1))

    # ---- retention -----------------------------------------------------------------

    def retain(self, refs: Sequence[BlockRef], until: float, owner: str) -> list[bool]:
        """Pin the held blocks of ``refs`` until at least ``until`` (in memory: lost with
        the process, as the blocks are)."""
        with self._lock:
            out = []
            for ref in refs:
                held = ref in self._lru
                if held and until > self._pins.get(ref, 0.0):
                    self._pins[ref] = until
                out.append(held)
            return out

    def expire_retained(self, now: float) -> int:
        with self._lock:
            due = [ref for ref, until in self._pins.items() if until <= now]
            for ref in due:
                del self._pins[ref]
            self._expired += len(due)
        return len(due)

    # ---- stats ---------------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            n, pinned, expired = len(self._lru), len(self._pins), self._expired
        return self._counters.snapshot(
            blocks_held=n, bytes_held=n * self.block_nbytes, blocks_retained=pinned,
            bytes_retained=pinned * self.block_nbytes, retention_expired=expired,
        )

    def _check_block(self, t: torch.Tensor, what: str) -> None:
        if t.shape != self._torch_shape or t.dtype != self.dtype:
            raise ValueError(
                f"{what} must be {self.block_shape} {self.dtype}, got {tuple(t.shape)} {t.dtype}"
            )


class _HostLayers(LayeredRead):
    """``HostTier.layered_read``: the slots of the leading held blocks, taken at the
    start (with their generations), copied layer range by layer range."""

    def __init__(self, tier: HostTier, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> None:
        self.tier = tier
        self.t0 = time.perf_counter()
        self.layer_nbytes = tier.block_nbytes // tier.block_shape[0]
        self.dst = [byte_view(o) for o in outs[: len(refs)]]
        self.slots: list[tuple[BlockRef, int, int]] = []  # (ref, slot, generation)
        with tier._lock:
            for ref in refs:
                slot = tier._lru.get(ref)
                if slot is None:
                    break
                tier._lru.move_to_end(ref)
                self.slots.append((ref, slot, tier._gen[slot]))
        self.n = len(self.slots)
        self.missed = self.n < len(refs)

    def read(self, l0: int, l1: int) -> int:
        t, a, b = self.tier, l0 * self.layer_nbytes, l1 * self.layer_nbytes
        with t._lock:  # the slots cannot be reused while their layers are copied
            for i in range(self.n):
                ref, slot, gen = self.slots[i]
                if t._lru.get(ref) != slot or t._gen[slot] != gen:
                    self.n, self.missed = i, True
                    break
                np.copyto(self.dst[i][a:b], t._slot_bytes[slot][a:b])
        return self.n

    def finish(self) -> int:
        c = self.tier._counters
        c.add(hits=self.n, bytes_out=self.n * self.tier.block_nbytes)
        if self.missed:
            c.add(misses=1)
            c.fail(NOT_FOUND)
        c.add_seconds("read", time.perf_counter() - self.t0)
        return self.n


class _HeldSlots(HeldBlocks):
    """``HostTier.hold``: the slots of the leading held blocks with their generations."""

    def __init__(self, tier: HostTier, refs: Sequence[BlockRef]) -> None:
        self.tier = tier
        self.t0 = time.perf_counter()
        self.slots: list[tuple[BlockRef, int, int]] = []  # (ref, slot, generation)
        with tier._lock:
            for ref in refs:
                slot = tier._lru.get(ref)
                if slot is None:
                    break
                tier._lru.move_to_end(ref)
                self.slots.append((ref, slot, tier._gen[slot]))
        self.n = len(self.slots)
        self.missed = self.n < len(refs)
        self.seconds = 0.0  # hold to release: what the copies out of the slots took

    def spans(self, start: int, end: int) -> list[torch.Tensor]:
        """Blocks ``start:end`` of the held ones as runs of consecutive slots, each one
        tensor ``(r, *block_shape)`` of the slab within one registered chunk, in order."""
        out: list[torch.Tensor] = []
        slab, chunk = self.tier._slab, self.tier.chunk_blocks
        i = start
        while i < end:
            first = self.slots[i][1]
            j = i + 1
            while j < end and self.slots[j][1] == first + (j - i) and (first + (j - i)) % chunk:
                j += 1
            out.append(slab[first : first + (j - i)])
            i = j
        return out

    def release(self) -> int:
        t = self.tier
        with t._lock:  # a slot a put took since ``hold`` (its generation moved) was maybe overwritten mid-copy
            n = next((i for i, (ref, slot, gen) in enumerate(self.slots) if t._gen[slot] != gen), self.n)
        self.seconds = time.perf_counter() - self.t0
        c = t._counters
        c.add(hits=n, bytes_out=n * t.block_nbytes)
        if n < self.n or self.missed:
            c.add(misses=1)
            c.fail(NOT_FOUND)
        c.add_seconds("read", self.seconds)
        self.n = n
        return n


class PinError(RuntimeError):
    """Host memory could not be page-locked for the device (``pin_host_memory``)."""


def pin_host_memory(t: torch.Tensor, chunk_bytes: int, what: str) -> list[int]:
    """Page-lock the memory of the contiguous CPU tensor ``t`` for CUDA copies
    (``cudaHostRegister``), ``chunk_bytes`` at a time, with a progress line every 5 s;
    the registered addresses, for ``unpin_host_memory``. Raises ``PinError``."""
    cudart = torch.cuda.cudart()
    base, total = t.data_ptr(), t.numel() * t.element_size()
    ptrs: list[int] = []
    t0 = last = time.monotonic()
    for off in range(0, total, chunk_bytes):
        err = int(cudart.cudaHostRegister(base + off, min(chunk_bytes, total - off), 1))  # 1: portable
        if err:
            unpin_host_memory(ptrs)
            raise PinError(f"cannot pin {total / 2**30:.1f} GiB for {what}: cudaHostRegister error {err} "
                           f"after {off / 2**30:.1f} GiB")
        ptrs.append(base + off)
        if time.monotonic() - last >= 5.0:
            last = time.monotonic()
            log.info("pinning %s: %.1f of %.1f GiB", what, (off + chunk_bytes) / 2**30, total / 2**30)
    if time.monotonic() - t0 >= 1.0:
        log.info("pinned %s: %.1f GiB in %.1f s", what, total / 2**30, time.monotonic() - t0)
    return ptrs


def unpin_host_memory(ptrs: Sequence[int]) -> None:
    """Unregister what ``pin_host_memory`` registered (best effort: at exit the CUDA
    context may be gone already, and the memory with the process)."""
    try:
        cudart = torch.cuda.cudart()
        for p in ptrs:
            cudart.cudaHostUnregister(p)
    except Exception:  # noqa: BLE001
        log.debug("unpinning host memory failed", exc_info=True)
