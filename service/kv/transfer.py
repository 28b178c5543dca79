"""Moving KV blocks between the device pool and host memory without stalling compute.

On CUDA, restores and demotions are copies between the pool and pinned host memory,
issued on streams of their own so they overlap the model's kernels, and ordered
against the compute stream with events, never with a host synchronisation:

- **Restore** (host/Redis -> pool). The restore thread fills pinned *staging* buffers
  (one slab, allocated once; a restore takes some and gives them back when its copies
  are done). ``restore`` then, on the engine thread: makes the restore stream wait for
  everything already queued on the compute stream (the blocks' previous users may still
  be reading them), enqueues ``non_blocking`` H2D copies there, records an event, and
  makes the compute stream wait for that event, so no attention kernel reads a restored
  block before its bytes landed (the bug class of copies racing the compute stream:
  restored KV that is garbage under load).
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
(tests/test_transfer.py).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch

from service.kv.cache import KVPool

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

    def restore_targets(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Where the restore thread should load these blocks: the pool blocks themselves
        (CPU), or up to ``len(block_ids)`` staging buffers (fewer when the slab is busy:
        restore only that many, recompute the rest). Hand them to ``restore`` (loaded)
        and ``release`` (not used)."""
        if self.in_place:
            return [self.pool.data[b] for b in block_ids]
        return self.staging.take(len(block_ids))

    def restore(self, block_ids: Sequence[int], loaded: Sequence[torch.Tensor]) -> None:
        """Copy ``loaded[i]`` (from ``restore_targets``) into pool block ``block_ids[i]``,
        ordered before the compute stream's next kernel. Staging buffers come back to
        the slab once the copies completed (``poll``)."""
        if self.in_place or not loaded:
            return
        compute = self.ops.current_stream()
        self.ops.wait_stream(self.restore_stream, compute)  # the blocks' previous users
        with self.ops.use(self.restore_stream):
            for block_id, buf in zip(block_ids, loaded):
                self.ops.copy(self.pool.data[block_id], buf)
            event = self.ops.record(self.restore_stream)
        self.ops.wait_event(compute, event)  # attention reads them only after they landed
        self._inflight.append(_Pending(event, list(loaded)))

    def release(self, targets: Sequence[torch.Tensor]) -> None:
        """Give back restore targets that were not restored (no copy was enqueued)."""
        if not self.in_place and targets:
            self.staging.give_back(targets)

    # ---- demotions ---------------------------------------------------------------

    def demote(self, block_id: int, on_copied: Callable[[torch.Tensor], None]) -> None:
        """Copy pool block ``block_id`` to host memory and call ``on_copied(copy)`` once
        the copy is complete (CPU: now, with the pool block itself; CUDA: from a later
        ``poll``, with a staging buffer). ``copy`` is valid only during the call. The
        block may be reused as soon as this returns (the compute stream waits for the
        copy). With no staging buffer free the copy is synchronous (counted)."""
        if self.in_place:
            on_copied(self.pool.data[block_id])
            return
        bufs = self.staging.take(1)
        if not bufs:
            self.num_sync_demotions += 1
            host = self.pool.data[block_id].to("cpu")  # waits for the compute stream
            on_copied(host)
            return
        compute = self.ops.current_stream()
        self.ops.wait_stream(self.demote_stream, compute)  # the block's last writes
        with self.ops.use(self.demote_stream):
            self.ops.copy(bufs[0], self.pool.data[block_id])
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
