"""Ordering of restores and demotions between the KV pool and host memory
(service/kv/transfer.py), with a fake stream/event implementation on the CPU: copies are
issued on their own streams after the compute stream's earlier work, the compute stream
waits for them before its next kernel, staging buffers and host copies are used only
once their event completed, and the engine restores through staging correctly."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from kvserve.service.kv.cache import KVPool
from kvserve.service.kv.transfer import BlockTransfers, CudaOps, StagingSlab, SyncOps, stream_ops_for


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.completed = False


class FakeOps:
    """Streams are names; every operation is logged as a tuple. Copies happen at once
    (so the data is right), but an event completes only when the test says so."""

    asynchronous = True

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self._current = "compute"
        self._n_streams = 0
        self.events: list[FakeEvent] = []

    def current_stream(self) -> str:
        return self._current

    def new_stream(self) -> str:
        self._n_streams += 1
        return f"side{self._n_streams}"

    @contextlib.contextmanager
    def use(self, stream: str):
        prev, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = prev

    def wait_stream(self, stream: str, other: str) -> None:
        self.log.append(("wait_stream", stream, other))

    def record(self, stream: str) -> FakeEvent:
        ev = FakeEvent(f"e{len(self.events)}")
        self.events.append(ev)
        self.log.append(("record", stream, ev.name))
        return ev

    def wait_event(self, stream: str, event: FakeEvent) -> None:
        self.log.append(("wait_event", stream, event.name))

    def done(self, event: FakeEvent) -> bool:
        return event.completed

    def synchronize(self, event: FakeEvent) -> None:
        self.log.append(("synchronize", event.name))
        event.completed = True

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append(("copy", self._current))
        dst.copy_(src)

    def forward(self) -> None:  # stands for a kernel on the compute stream
        self.log.append(("kernel", self._current))

    def mark(self) -> FakeEvent:  # a timing event: t is its "GPU time"
        ev = FakeEvent(f"m{len(self.events)}")
        ev.t = 0.1 * len(self.events)  # type: ignore[attr-defined]
        ev.completed = self.marks_complete
        self.events.append(ev)
        return ev

    marks_complete = True

    def seconds_between(self, start: FakeEvent, end: FakeEvent) -> float | None:
        return end.t - start.t if end.completed else None  # type: ignore[attr-defined]


def make_pool(n: int = 8) -> KVPool:
    return KVPool(n, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8)


def block_value(pool: KVPool, seed: int) -> torch.Tensor:
    return torch.randn(pool.block_shape, generator=torch.Generator().manual_seed(seed))


def test_restore_copies_in_rounds_on_its_stream_and_the_compute_stream_waits() -> None:
    """Five blocks through a slab of 4 (rounds of 2): each round's copies go on the
    restore stream after the compute stream's mark, the restore thread waits for a
    round's copy before refilling its buffers, and the compute stream waits for the
    last copy; the staging buffers all come back."""
    pool, ops = make_pool(), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=4)
    after = tr.begin_restore()  # engine thread, at submission
    calls: list[tuple[int, int]] = []

    def load(targets: list[torch.Tensor], start: int) -> int:  # the store, on the restore thread
        calls.append((start, len(targets)))
        for i, t in enumerate(targets):
            t.copy_(block_value(pool, start + i))
        return len(targets)

    n, event = tr.restore_in_rounds([1, 2, 3, 4, 5], load, after)
    assert n == 5 and calls == [(0, 2), (2, 2), (4, 1)]
    for i, b in enumerate([1, 2, 3, 4, 5]):
        assert torch.equal(pool.data[b], block_value(pool, i))
    rs = tr.restore_stream
    round_ops = lambda k, ev: [("copy", rs)] * k + [("record", rs, ev), ("synchronize", ev)]  # noqa: E731
    assert ops.log == [
        ("record", "compute", "e0"),  # begin_restore: after the blocks' previous users
        ("wait_event", rs, "e0"),
        *round_ops(2, "e1"),
        *round_ops(2, "e2"),
        *round_ops(1, "e3"),
    ]
    assert tr.staging.num_free == 4
    tr.finish_restore(event)  # engine thread, before the sequence runs
    assert ops.log[-1] == ("wait_event", "compute", "e3")


def test_a_restore_stops_at_the_first_block_that_does_not_load() -> None:
    pool, ops = make_pool(), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=4)
    n, event = tr.restore_in_rounds([1, 2, 3, 4, 5], lambda targets, start: 1 if start == 2 else len(targets), None)
    assert n == 3 and event is not None and tr.staging.num_free == 4
    n, event = tr.restore_in_rounds([1, 2], lambda targets, start: 0, None)
    assert n == 0 and event is None and ("copy", tr.restore_stream) not in ops.log[-1:]

    def broken(targets: list[torch.Tensor], start: int) -> int:
        raise RuntimeError("store failed")

    with pytest.raises(RuntimeError):
        tr.restore_in_rounds([1], broken, None)
    assert tr.staging.num_free == 4  # given back whatever happened


def test_demotion_reaches_the_host_only_after_its_copy_completed() -> None:
    pool, ops = make_pool(), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=1)
    pool.data[2].copy_(block_value(pool, 7))
    got: list[torch.Tensor] = []
    tr.demote(2, lambda data: got.append(data.clone()))
    ds = tr.demote_stream
    assert ops.log == [
        ("wait_stream", ds, "compute"),  # after the block's last writes
        ("copy", ds),
        ("record", ds, "e0"),
        ("wait_event", "compute", "e0"),  # the block's next owner writes after the copy
    ]
    pool.data[2].zero_()  # the block's next owner (ordered after the copy on the device)
    assert got == [] and tr.poll() == 0  # not complete yet: the host tier has nothing
    # no staging buffer free: the next demotion is a synchronous copy, delivered at once
    pool.data[4].copy_(block_value(pool, 8))
    tr.demote(4, lambda data: got.append(data.clone()))
    assert tr.num_sync_demotions == 1 and torch.equal(got[0], block_value(pool, 8))
    ops.events[0].completed = True
    assert tr.poll() == 1
    assert torch.equal(got[1], block_value(pool, 7)) and tr.staging.num_free == 1


def test_completions_run_in_issue_order_and_drain_waits() -> None:
    pool, ops = make_pool(), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=4)
    order: list[int] = []
    tr.demote(1, lambda _: order.append(1))
    tr.demote(2, lambda _: order.append(2))
    ops.events[1].completed = True  # the later one first: it still waits for the earlier
    assert tr.poll() == 0 and order == []
    tr.demote(3, lambda _: (_ for _ in ()).throw(RuntimeError("host tier failed")))
    tr.drain()
    assert order == [1, 2] and tr.num_inflight == 0 and tr.staging.num_free == 4


def test_cpu_transfers_are_in_place_and_synchronous() -> None:
    pool = make_pool()
    tr = BlockTransfers.for_pool(pool, staging_bytes=1 << 20)
    assert isinstance(tr.ops, SyncOps) and tr.in_place and tr.staging.capacity == 0
    ptrs: list[int] = []
    n, event = tr.restore_in_rounds([2, 3], lambda ts, start: ptrs.extend(t.data_ptr() for t in ts) or 2, None)
    assert n == 2 and event is None and tr.begin_restore() is None
    assert ptrs == [pool.data[2].data_ptr(), pool.data[3].data_ptr()]  # straight into the pool
    seen: list[int] = []
    tr.demote(2, lambda data: seen.append(data.data_ptr()))
    assert seen == [pool.data[2].data_ptr()] and tr.poll() == 0
    assert isinstance(stream_ops_for(torch.device("cuda")), CudaOps)


def test_staging_slab_is_one_allocation_and_checks_returns() -> None:
    slab = StagingSlab(3, (2, 4), torch.float32, pin=False)
    bufs = slab.take(3)
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1  # one slab
    with pytest.raises(ValueError):
        slab.give_back([torch.empty(2, 4)])
    slab.give_back(bufs)
    assert slab.num_free == 3


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Any) -> Any:
    from kvserve.service.models.loading import load_model

    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def _logged_engine(loaded: Any, store: Any) -> tuple[Any, FakeOps]:
    """An engine whose transfers run on fake streams and whose forwards are logged as
    kernels on the compute stream."""
    from tests.fixtures.engine import make_engine

    import dataclasses

    ops = FakeOps()
    model = loaded.model

    class Logged(torch.nn.Module):
        def forward(self, layout: Any, kv: Any, **kw: Any) -> torch.Tensor:
            ops.forward()
            return model(layout, kv, **kw)

        def native_rows(self, kv: Any) -> int:
            return model.native_rows(kv)

        def native_step(self, kv: Any) -> None:
            return None  # as on CUDA: every forward through ``forward``, where the ops are logged

    eng = make_engine(dataclasses.replace(loaded, model=Logged()), store=store, restore_policy="always",
                      engine_kw=dict(transfers=lambda pool: BlockTransfers(pool, ops, staging_blocks=4)))
    return eng, ops


def _history_on_host(loaded: Any, length: int, seed: int) -> tuple[Any, Any, FakeOps, list[int], list[Any]]:
    """A history of ``length`` tokens run by engine ``a``, its full blocks put in a host
    tier, and engine ``b`` (fake streams) over a new device pool and that same tier:
    (a, b, b's ops, history, its block hashes)."""
    from kvserve.cachestore.host import HostTier
    from kvserve.cachestore.keys import block_hashes
    from kvserve.cachestore.tiered import TieredStore
    from kvserve.service.types import CacheScope
    from tests.fixtures.engine import BS, bytes_per_token, prompts, req, run

    c = loaded.config
    shape = (c.num_layers, 2, BS, c.num_kv_heads, c.head_dim)
    store = TieredStore([HostTier(64 * BS * bytes_per_token(loaded), shape, torch.float32)])
    a, _ = _logged_engine(loaded, store)
    (hist,) = prompts(c.vocab_size, [length], seed=seed)
    run(a, [req("a", hist, n=1)])
    ns = a.keys.namespace(CacheScope())
    hashes = block_hashes(ns, hist, BS)
    for h in hashes:  # the history's blocks to the host tier
        store.put(ns, h, a.pool.data[a.blocks.lookup(h).block_id], ("host",))
    b, ops = _logged_engine(loaded, store)  # a new device pool, the same host tier
    return a, b, ops, hist, hashes


def test_engine_restores_through_staging_and_orders_the_forward_after_the_copy(loaded: Any) -> None:
    """The engine's CUDA code path on the CPU: restores land in staging buffers, are
    copied into the pool on the restore stream in rounds (a slab of 4 buffers for 4
    blocks), and the compute stream waits for the last copy before the forward that
    reads them; the output equals recomputing and every staging buffer comes back."""
    from tests.fixtures.engine import BS, finished, greedy_reference, req, run

    a, b, ops, hist, hashes = _history_on_host(loaded, 13, seed=5)

    turn = hist + [3, 4]
    fin = finished(run(b, [req("b", turn, n=3)])["b"])
    assert fin.cached_tokens == len(hashes) * BS
    assert fin.output_token_ids == greedy_reference(loaded.model, turn, 3)
    kinds = [e[0] for e in ops.log]
    first_kernel = kinds.index("kernel")
    assert kinds.count("copy") == len(hashes) and kinds.index("copy") < first_kernel
    last_copy_event = [e for e in ops.log if e[0] == "record" and e[1] == b.transfers.restore_stream][-1][2]
    assert ("wait_event", "compute", last_copy_event) in ops.log[:first_kernel]
    b.close()
    assert b.transfers.staging.num_free == 4
    a.close()


def test_an_engine_built_under_inference_mode_restores_through_staging(loaded: Any) -> None:
    """The same CUDA code path with the engine built inside ``torch.inference_mode`` (its
    pool an inference tensor, which only inference mode may write): the restore thread's
    copies into the pool still land, and the turn restores rather than recomputes (on the
    H200 every such restore failed with "Inplace update to inference tensor outside
    InferenceMode" and fell back to prefill)."""
    from tests.fixtures.engine import BS, finished, greedy_reference, req, run

    with torch.inference_mode():
        a, b, ops, hist, hashes = _history_on_host(loaded, 13, seed=6)
    assert b.pool.data.is_inference()
    turn = hist + [3, 4]
    fin = finished(run(b, [req("b", turn, n=3)])["b"])
    assert fin.cached_tokens == len(hashes) * BS
    assert fin.output_token_ids == greedy_reference(loaded.model, turn, 3)
    b.close()
    a.close()


def test_prefill_rate_is_read_from_completed_marks_only(loaded: Any) -> None:
    """On CUDA the host clock around a forward measures its launch: the engine times
    prefill with marks on the compute stream and reads them only once complete."""
    from tests.fixtures.engine import prompts, req, run

    eng, ops = _logged_engine(loaded, None)
    ops.marks_complete = False
    (p,) = prompts(loaded.config.vocab_size, [40], seed=9)
    run(eng, [req("p", p, n=1)])
    assert eng.runner.prefill_tokens_per_s is None and len(eng.runner._prefill_marks) == 1
    n, start, end = eng.runner._prefill_marks[0]
    end.completed = True
    eng.step()
    assert eng.runner.prefill_tokens_per_s == pytest.approx(n / (end.t - start.t))
    assert not eng.runner._prefill_marks
    eng.close()
