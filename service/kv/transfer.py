"""Moving KV blocks between the device pool and host memory without stalling compute.

On CUDA, restores and demotions are copies between the pool and pinned host memory,
issued on streams of their own so they overlap the model's kernels, and ordered
against the compute stream with events, never with a host synchronisation:

- **Restore** (host/disk/Redis -> pool). At submission the engine marks the compute
  stream (``begin_restore``: the target blocks' previous users may still be reading
  them). The restore thread then moves the blocks tier by tier (``restore``, one
  ``BlockSource`` per run of one tier: cachestore's ``TierRead``), in rounds of at most
  ``round_blocks`` blocks, each round on the restore stream (after that mark): a few large
  host-to-device copies into *device staging* (``round_blocks`` blocks, allocated once),
  then one scatter kernel from there into the blocks' pool slots (``scatter``:
  kernels.triton's ``scatter_blocks``, or ``KVPool.scatter``'s ``index_copy_``):
  - a tier that lends its memory (``hold``: the host tier's pinned slab) is copied
    straight out of its slots, one copy per run of consecutive slots (``spans``), with no
    copy on the CPU; once the copies completed the tier says how many blocks stayed
    intact (``release``: a slot reused meanwhile ends the restore there);
  - any other (disk, Redis) loads a round into one half of a contiguous pinned *restore
    region* (disk reads and Redis replies land there directly), which goes to the
    device in one copy while the next round loads into the other half (a half is
    refilled once its copy's event completed);
  - a lossy Redis format (int8, fp8, bf16, fp16 values) is loaded in its stored form (the
    compact bytes, verified), copied as it is, and decoded on the device
    (``BlockSource.expand``: the same bits as the CPU's decode), then scattered.
  Before the sequence runs, the engine makes the compute stream wait for the last
  round's event (``finish_restore``), so no attention kernel reads a restored block
  before its bytes landed (the bug class of copies racing the compute stream: restored
  KV that is garbage under load).
- **Demotion** (pool -> host tier). ``demote`` makes the demotion stream wait for the
  compute stream (the block's last writes), copies the block into a staging buffer
  there, records an event, and makes the compute stream wait for it: the next kernel
  that may overwrite the block (its next owner) runs only after the copy read it, so
  the block manager may hand the block out right away. The host tier receives the copy
  (``on_copied``) only once the event completed, polled by ``poll`` at the top of each
  engine step; the staging buffer is reused after that.
- ``poll`` never waits: it asks each event whether it completed (``cudaEventQuery``).

``staging_blocks`` pinned host blocks are allocated once: half the restore region, half
the demotions' buffers; device staging is a quarter of it (one round).

On the CPU every copy is synchronous and every event complete: restores write into the
pool in place (no staging: each source loads into the pool's blocks, a lossy format
decoded on the CPU), and a demotion hands the pool block itself to ``on_copied`` during
the call. The engine runs the same calls on both (``SyncOps``); the ordering and the
rounds are tested on the CPU with a fake stream/event implementation
(tests/engine/test_transfer.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch

from .cache import KVPool

Scatter = Callable[[torch.Tensor, torch.Tensor], None]  # (block ids on the device, blocks (n, ...) there)

log = logging.getLogger(__name__)


class StreamOps(Protocol):
    """The few stream/event operations the transfers need (CUDA, CPU, or a fake)."""

    asynchronous: bool  # False: copies complete in the call, events are always done

    def current_stream(self) -> Any: ...
    def new_stream(self) -> Any: ...
    def use(self, stream: Any) -> ContextManager[Any]: ...
    def wait_stream(self, stream: Any, other: Any) -> None: ...
    def record(self, stream: Any) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def done(self, event: Any) -> bool: ...
    def synchronize(self, event: Any) -> None: ...
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...
    def mark(self) -> Any: ...
    def seconds_between(self, start: Any, end: Any) -> float | None: ...


class SyncOps:
    """The CPU: one implicit stream, synchronous copies, events that are always done."""

    asynchronous = False

    def current_stream(self) -> None:
        return None

    def new_stream(self) -> None:
        return None

    def use(self, stream: Any) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def record(self, stream: Any) -> None:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def done(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def mark(self) -> float:
        return time.perf_counter()

    def seconds_between(self, start: float, end: float) -> float:
        return end - start


class CudaOps:
    """torch.cuda streams and events; copies ``non_blocking`` (pinned host memory)."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def use(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def mark(self) -> Any:
        """A timing event on the current stream: kernels are asynchronous, so the host
        clock around a forward measures its launch, not its run."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds_between(self, start: Any, end: Any) -> float | None:
        """GPU time between two marks once ``end`` completed; None before (no wait)."""
        return start.elapsed_time(end) / 1000.0 if end.query() else None


def stream_ops_for(device: torch.device) -> StreamOps:
    return CudaOps(device) if device.type == "cuda" else SyncOps()


def pool_scatter(pool: KVPool) -> Scatter:
    """The restore's scatter into ``pool``: kernels.triton's ``scatter_blocks`` on CUDA
    where it is there, else ``KVPool.scatter`` (one ``index_copy_``: the same bytes)."""
    if pool.device.type == "cuda":
        try:
            from ..kernels import triton as kernels
        except ImportError:  # not built into this tree
            return pool.scatter
        if getattr(kernels, "available", lambda: False)():
            return lambda ids, blocks: kernels.scatter_blocks(pool.data, blocks, ids)
    return pool.scatter


class Held(Protocol):
    """Blocks a source lends in place (cachestore's ``HeldBlocks``)."""

    n: int

    def spans(self, start: int, end: int) -> list[torch.Tensor]: ...


class BlockSource(Protocol):
    """One tier's run of a restore, in order (cachestore's ``TierRead``)."""

    storage_dtype: torch.dtype | None  # the stored form ``load_stored`` gives (None: the blocks' bytes)
    stored_nbytes: int

    def __len__(self) -> int: ...
    def load(self, start: int, outs: Sequence[torch.Tensor]) -> int: ...
    def load_stored(self, start: int, outs: Sequence[torch.Tensor]) -> int: ...
    def expand(self, stored: torch.Tensor, out: torch.Tensor) -> None: ...
    def hold(self, start: int, end: int) -> Held | None: ...
    def release(self, held: Any) -> int: ...


class StagingSlab:
    """``n`` block buffers in one host allocation (pinned when asked), made once and
    reused by demotions; ``take`` and ``give_back`` are thread-safe."""

    def __init__(self, n: int, block_shape: Sequence[int], dtype: torch.dtype, pin: bool) -> None:
        self.capacity = n
        self._slab = torch.empty((n, *block_shape), dtype=dtype, pin_memory=pin) if n else None
        self._free: list[torch.Tensor] = list(self._slab.unbind(0)) if n else []
        self._ids = {id(b) for b in self._free}
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> list[torch.Tensor]:
        """Up to ``n`` free buffers (fewer, or none, when they are in use)."""
        with self._lock:
            k = min(n, len(self._free))
            got, self._free = self._free[len(self._free) - k :], self._free[: len(self._free) - k]
            return got

    def give_back(self, bufs: Sequence[torch.Tensor]) -> None:
        for b in bufs:
            if id(b) not in self._ids:
                raise ValueError("not a buffer of this slab")
        with self._lock:
            self._free.extend(bufs)


@dataclass(slots=True)
class _Pending:
    event: Any
    buffers: list[torch.Tensor]
    on_copied: Callable[[torch.Tensor], None] | None = None


class BlockTransfers:
    """Restores into and demotions out of ``pool``. See the module docstring. All calls
    but ``restore`` (the restore thread's) are for the engine thread."""

    def __init__(self, pool: KVPool, ops: StreamOps, staging_blocks: int = 0, scatter: Scatter | None = None) -> None:
        self.pool = pool
        self.ops = ops
        pin = ops.asynchronous and pool.device.type == "cuda"
        n = staging_blocks if ops.asynchronous else 0
        # half the blocks: the demotions' buffers; the other half the restore region, two
        # rounds (one loads while the other's copy runs); a round: what device staging holds
        demotions = max(1, n // 2) if n else 0
        self.round_blocks = max(1, (n - demotions) // 2) if n else 0
        self.staging = StagingSlab(demotions, pool.block_shape, pool.dtype, pin=pin)
        self._restore_host = (
            torch.empty((2 * self.round_blocks, *pool.block_shape), dtype=pool.dtype, pin_memory=pin) if n else None
        )
        self._restore_device = (
            torch.empty((self.round_blocks, *pool.block_shape), dtype=pool.dtype, device=pool.device) if n else None
        )
        self._restore_lock = threading.Lock()  # one restore at a time in the staging
        self.scatter = scatter or pool_scatter(pool)
        self.restore_stream = ops.new_stream()
        self.demote_stream = ops.new_stream()
        self._inflight: list[_Pending] = []
        self.num_sync_demotions = 0  # demotions done synchronously: no staging buffer free

    @classmethod
    def for_pool(cls, pool: KVPool, staging_bytes: int) -> BlockTransfers:
        ops = stream_ops_for(pool.device)
        return cls(pool, ops, staging_bytes // pool.bytes_per_block if ops.asynchronous else 0)

    @property
    def in_place(self) -> bool:
        """True when restores write straight into the pool (CPU): no staging."""
        return not self.ops.asynchronous

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # ---- restores ----------------------------------------------------------------

    def begin_restore(self) -> Any:
        """Engine thread, when a restore is submitted: a mark on the compute stream after
        everything queued so far (the target blocks' previous users may still read
        them); the restore's copies wait for it. None on the CPU."""
        return None if self.in_place else self.ops.record(self.ops.current_stream())

    def restore(self, sources: Sequence[BlockSource], block_ids: Sequence[int], after: Any) -> tuple[int, Any]:
        """Restore thread: fill pool blocks ``block_ids`` from ``sources`` (their blocks in
        order, one source per tier run), stopping at the first block that does not load.
        CPU: each source loads into the pool's blocks. CUDA: rounds through the staging
        on the restore stream, after ``after`` (``begin_restore``); see the module
        docstring. Returns (blocks restored, the last round's event for
        ``finish_restore``; None when nothing was copied)."""
        if self.in_place:
            done = 0
            for src in sources:
                got = src.load(0, [self.pool.block_view(b) for b in block_ids[done : done + len(src)]])
                done += got
                if got < len(src):
                    break
            return done, None
        if self._restore_device is None:
            return 0, None
        with self._restore_lock:
            if after is not None:
                self.ops.wait_event(self.restore_stream, after)
            done, event = 0, None
            for src in sources:
                ids = list(block_ids[done : done + len(src)])
                held = src.hold(0, len(src))
                if held is not None:
                    got, event = self._from_held(src, held, ids, event)
                else:
                    got, event = self._from_loads(src, ids, event)
                done += got
                if got < len(src):
                    break
            return done, event

    def _from_held(self, src: BlockSource, held: Any, ids: list[int], event: Any) -> tuple[int, Any]:
        """Blocks lent in place: per round, a copy per span into device staging, one
        scatter; the lender is released (counts what stayed intact) once the copies
        completed."""
        dev, r = self._restore_device, self.round_blocks
        assert dev is not None
        try:
            for a in range(0, held.n, r):
                b = min(held.n, a + r)
                with self.ops.use(self.restore_stream):
                    k = 0
                    for span in held.spans(a, b):
                        self.ops.copy(dev[k : k + len(span)], span)
                        k += len(span)
                    self._scatter(ids[a:b], dev[: b - a])
                    event = self.ops.record(self.restore_stream)
            if event is not None:
                self.ops.synchronize(event)  # the slots were read: now ask whether they stayed intact
        finally:
            got = src.release(held)
        return got, event

    def _from_loads(self, src: BlockSource, ids: list[int], event: Any) -> tuple[int, Any]:
        """Blocks loaded into the pinned restore region, a half per round (the other half's
        copy runs meanwhile), one copy of the round into device staging, decoded there
        when stored in a lossy form, one scatter."""
        host, dev, r = self._restore_host, self._restore_device, self.round_blocks
        assert host is not None and dev is not None
        halves, pending = (host[:r], host[r:]), [None, None]
        stored = src.storage_dtype is not None
        nbytes = src.stored_nbytes
        if stored and nbytes > self.pool.bytes_per_block:
            raise ValueError(f"a stored block of {nbytes} bytes does not fit a staging block of {self.pool.bytes_per_block}")
        done, h = 0, 0
        try:
            while done < len(ids):
                k = min(r, len(ids) - done)
                if pending[h] is not None:
                    self.ops.synchronize(pending[h])  # the half's last copy read it
                if stored:
                    bufs = halves[h].view(-1).view(torch.uint8)[: k * nbytes].view(k, nbytes)
                    got = src.load_stored(done, list(bufs.unbind(0)))
                else:
                    bufs = halves[h][:k]
                    got = src.load(done, list(bufs.unbind(0)))
                if got:
                    with self.ops.use(self.restore_stream):
                        if stored:
                            dev_bytes = dev.view(-1).view(torch.uint8)[: got * nbytes].view(got, nbytes)
                            self.ops.copy(dev_bytes, bufs[:got])
                            blocks = torch.empty((got, *self.pool.block_shape), dtype=self.pool.dtype,
                                                 device=self.pool.device)
                            src.expand(dev_bytes, blocks)  # decoded on the device
                        else:
                            self.ops.copy(dev[:got], bufs[:got])
                            blocks = dev[:got]
                        self._scatter(ids[done : done + got], blocks)
                        event = pending[h] = self.ops.record(self.restore_stream)
                done += got
                if got < k:
                    break
                h ^= 1
        finally:
            if event is not None:
                self.ops.synchronize(event)  # the region is free for the next restore
        return done, event

    def _scatter(self, ids: list[int], blocks: torch.Tensor) -> None:
        """On the current stream: ``blocks`` (on the device) into pool blocks ``ids``."""
        self.scatter(torch.tensor(ids, dtype=torch.long).to(self.pool.device, non_blocking=True), blocks)

    def finish_restore(self, event: Any) -> None:
        """Engine thread, before the restored blocks are used: the compute stream waits
        for the restore's last copy (a device-side wait, not a host one)."""
        if event is not None:
            self.ops.wait_event(self.ops.current_stream(), event)

    # ---- demotions ---------------------------------------------------------------

    def demote(self, block_id: int, on_copied: Callable[[torch.Tensor], None]) -> None:
        """Copy pool block ``block_id`` to host memory and call ``on_copied(copy)`` once
        the copy is complete (CPU: now, with the pool block itself; CUDA: from a later
        ``poll``, with a staging buffer). ``copy`` is valid only during the call. The
        block may be reused as soon as this returns (the compute stream waits for the
        copy). With no staging buffer free the copy is synchronous (counted)."""
        if self.in_place:
            on_copied(self.pool.block_view(block_id))
            return
        bufs = self.staging.take(1)
        if not bufs:
            self.num_sync_demotions += 1
            host = self.pool.block_view(block_id).to("cpu")  # waits for the compute stream
            on_copied(host)
            return
        compute = self.ops.current_stream()
        self.ops.wait_stream(self.demote_stream, compute)  # the block's last writes
        with self.ops.use(self.demote_stream):
            self.ops.copy(bufs[0], self.pool.block_view(block_id))
            event = self.ops.record(self.demote_stream)
        self.ops.wait_event(compute, event)  # its next owner writes only after the copy
        self._inflight.append(_Pending(event, bufs, on_copied))

    # ---- completion --------------------------------------------------------------

    def poll(self) -> int:
        """Finish the transfers whose events completed, in order; never waits. Returns
        how many finished."""
        if not self._inflight:
            return 0
        still: list[_Pending] = []
        finished = 0
        for p in self._inflight:
            if still or not self.ops.done(p.event):  # keep completion in issue order
                still.append(p)
                continue
            self._complete(p)
            finished += 1
        self._inflight = still
        return finished

    def drain(self) -> None:
        """Wait for every transfer in flight and finish it (shutdown, tests)."""
        for p in self._inflight:
            self.ops.synchronize(p.event)
        pending, self._inflight = self._inflight, []
        for p in pending:
            self._complete(p)

    def _complete(self, p: _Pending) -> None:
        try:
            if p.on_copied is not None:
                p.on_copied(p.buffers[0])
        except Exception:  # noqa: BLE001 - a demotion failure must not stop the engine
            log.exception("demotion callback failed")
        finally:
            self.staging.give_back(p.buffers)
