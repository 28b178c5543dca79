"""Moving KV blocks between the device pool and host memory without stalling compute.

On CUDA, restores and demotions are copies between the pool and pinned host memory,
issued on streams of their own so they overlap the model's kernels, and ordered
against the compute stream with events, never with a host synchronisation:

- **Restore** (host/Redis -> pool). At submission the engine marks the compute stream
  (``begin_restore``: the target blocks' previous users may still be reading them).
  The restore thread then works in rounds through pinned *staging* buffers (one slab,
  allocated once): load a round from the store into them, enqueue ``non_blocking`` H2D
  copies on the restore stream (after that mark), record an event, wait for it on the
  restore thread only, reuse the buffers for the next round. Before the sequence runs,
  the engine makes the compute stream wait for the last copy's event
  (``finish_restore``), so no attention kernel reads a restored block before its bytes
  landed (the bug class of copies racing the compute stream: restored KV that is
  garbage under load).
- **Demotion** (pool -> host tier). ``demote`` makes the demotion stream wait for the
  compute stream (the block's last writes), copies the block into a staging buffer
  there, records an event, and makes the compute stream wait for it: the next kernel
  that may overwrite the block (its next owner) runs only after the copy read it, so
  the block manager may hand the block out right away. The host tier receives the copy
  (``on_copied``) only once the event completed, polled by ``poll`` at the top of each
  engine step; the staging buffer is reused after that.
- ``poll`` never waits: it asks each event whether it completed (``cudaEventQuery``).

On the CPU every copy is synchronous and every event complete: restores write into the
pool in place (no staging), and a demotion hands the pool block itself to
``on_copied`` during the call. The engine runs the same calls on both (``SyncOps``);
the ordering itself is tested on the CPU with a fake stream/event implementation
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


class StagingSlab:
    """``n`` block buffers in one host allocation (pinned when asked), made once and
    reused; ``take`` and ``give_back`` are thread-safe (the restore thread takes too)."""

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
    but ``staging.take`` / ``give_back`` are for the engine thread."""

    def __init__(self, pool: KVPool, ops: StreamOps, staging_blocks: int = 0) -> None:
        self.pool = pool
        self.ops = ops
        self.staging = StagingSlab(
            staging_blocks if ops.asynchronous else 0,
            pool.block_shape,
            pool.dtype,
            pin=ops.asynchronous and pool.device.type == "cuda",
        )
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

    def restore_in_rounds(
        self,
        block_ids: Sequence[int],
        load: Callable[[list[torch.Tensor], int], int],
        after: Any,
    ) -> tuple[int, Any]:
        """Restore thread: fill pool blocks ``block_ids`` through ``load(targets, start)``,
        which loads blocks ``start, start+1, ...`` into ``targets`` and returns how many
        it loaded (stopping at the first miss). CPU: one round, straight into the pool.
        CUDA: rounds of at most half the staging slab (the rest stays free for
        demotions): load into pinned buffers, copy them into the pool on the restore
        stream (after ``after``, from ``begin_restore``), wait for that copy here (only
        this thread waits) and reuse the buffers, so a restore of any size goes through
        a slab of fixed size. Returns (blocks restored, the last copy's event for
        ``finish_restore``; None when nothing was copied)."""
        if self.in_place:
            return load([self.pool.block_view(b) for b in block_ids], 0), None
        done, event = 0, None
        bufs = self.staging.take(max(1, self.staging.capacity // 2))
        if not bufs:
            return 0, None
        try:
            if after is not None:
                self.ops.wait_event(self.restore_stream, after)
            while done < len(block_ids):
                k = min(len(bufs), len(block_ids) - done)
                got = load(bufs[:k], done)
                if got:
                    with self.ops.use(self.restore_stream):
                        for i in range(got):
                            self.ops.copy(self.pool.block_view(block_ids[done + i]), bufs[i])
                        event = self.ops.record(self.restore_stream)
                    self.ops.synchronize(event)  # the buffers are refilled next round
                done += got
                if got < k:
                    break
        finally:
            self.staging.give_back(bufs)
        return done, event

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
