"""Ordering of restores and demotions between the KV pool and host memory
(service/kv/transfer.py), with a fake stream/event implementation on the CPU: copies are
issued on their own streams after the compute stream's earlier work, a restore's rounds
are a few copies into device staging and one scatter each, the compute stream waits for
them before its next kernel, staging buffers and host copies are used only once their
event completed, the restore scatter writes what per-block copies write, a lossy format
is copied in its stored form and decoded after the copy to the same bits, and the engine
restores through staging correctly."""

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


class ListSource:
    """A ``BlockSource`` over given blocks (exact), loading into the caller's buffers;
    ``fail_at``: the first block that does not load."""

    storage_dtype = None

    def __init__(self, blocks: list[torch.Tensor], fail_at: int | None = None, log: list | None = None) -> None:
        self.blocks, self.fail_at, self.log = blocks, fail_at, log
        self.stored_nbytes = blocks[0].numel() * blocks[0].element_size()

    def __len__(self) -> int:
        return len(self.blocks)

    def load(self, start: int, outs: Any) -> int:
        if self.log is not None:
            self.log.append(("load", start, len(outs)))
        for i, out in enumerate(outs):
            if start + i == self.fail_at:
                return i
            out.copy_(self.blocks[start + i])
        return len(outs)

    def hold(self, start: int, end: int) -> None:
        return None


def logged_scatter(pool: KVPool, ops: FakeOps) -> Any:
    def scatter(ids: torch.Tensor, blocks: torch.Tensor) -> None:
        ops.log.append(("scatter", ops.current_stream(), tuple(ids.tolist())))
        pool.scatter(ids, blocks)

    return scatter


def test_restore_loads_rounds_into_the_pinned_halves_copies_each_once_and_scatters_once() -> None:
    """Five blocks, rounds of 2 (a staging of 8: a restore region of two rounds, device
    staging of one): each round is loaded into one half of the restore region, goes to
    the device in one copy on the restore stream after the compute stream's mark, and is
    scattered into its pool blocks by one kernel; a half is loaded again only after its
    last copy completed; the compute stream waits for the last round."""
    pool, ops = make_pool(16), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=8, scatter=logged_scatter(pool, ops))
    assert tr.round_blocks == 2 and tr.staging.capacity == 4  # the rest: the demotions'
    after = tr.begin_restore()  # engine thread, at submission
    src = ListSource([block_value(pool, i) for i in range(5)], log=ops.log)
    ids = [9, 2, 14, 5, 7]
    n, event = tr.restore([src], ids, after)
    assert n == 5
    for i, b in enumerate(ids):
        assert torch.equal(pool.data[b], block_value(pool, i))
    rs = tr.restore_stream
    assert ops.log == [
        ("record", "compute", "e0"),  # begin_restore: after the blocks' previous users
        ("wait_event", rs, "e0"),
        ("load", 0, 2), ("copy", rs), ("scatter", rs, (9, 2)), ("record", rs, "e1"),
        ("load", 2, 2), ("copy", rs), ("scatter", rs, (14, 5)), ("record", rs, "e2"),
        ("synchronize", "e1"),  # the first half again: once its copy read it
        ("load", 4, 1), ("copy", rs), ("scatter", rs, (7,)), ("record", rs, "e3"),
        ("synchronize", "e3"),  # the region is free for the next restore
    ]  # fmt: skip
    tr.finish_restore(event)  # engine thread, before the sequence runs
    assert ops.log[-1] == ("wait_event", "compute", "e3")


def test_a_restore_stops_at_the_first_block_that_does_not_load() -> None:
    pool, ops = make_pool(16), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=8)
    blocks = [block_value(pool, i) for i in range(5)]
    n, event = tr.restore([ListSource(blocks, fail_at=3), ListSource(blocks)], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], None)
    assert n == 3 and event is not None  # and the second source was never asked
    assert all(torch.equal(pool.data[b], blocks[i]) for i, b in enumerate([1, 2, 3]))
    n, event = tr.restore([ListSource(blocks, fail_at=0)], [1, 2], None)
    assert n == 0 and event is None and ops.log[-1][0] != "copy"

    class Broken(ListSource):
        def load(self, start: int, outs: Any) -> int:
            raise RuntimeError("store failed")

    with pytest.raises(RuntimeError):
        tr.restore([Broken(blocks)], [1], None)
    n, _ = tr.restore([ListSource(blocks)], [11, 12], None)  # the staging is usable again
    assert n == 2 and torch.equal(pool.data[12], blocks[1])


@pytest.mark.parametrize("fmt", ["exact", "bf16", "int8", "fp8"])
def test_the_restore_scatter_equals_the_per_block_copy(fmt: str) -> None:
    """``KVPool.scatter`` (the torch scatter a restore round ends with) writes exactly the
    bytes that per-block copies write, for every pool format, ids in any order; and a
    whole staged restore (fake streams) leaves the pool byte for byte as the CPU's
    in-place restore of the same blocks."""
    from kvserve.service.kv.cache import KV_CACHE_FORMATS, KVCacheSpec

    spec = KVCacheSpec(2, 2, 8, 4, KV_CACHE_FORMATS[fmt] or torch.float32, torch.float32)
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    nbytes = spec.bytes_per_block
    blocks = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(spec.dtype).view(spec.block_shape)
              for _ in range(6)]  # any bytes (fp8 NaN patterns too)
    ids = [7, 3, 11, 1, 9, 4]
    a, b = KVPool.from_spec(spec, 12 * nbytes), KVPool.from_spec(spec, 12 * nbytes)
    a.scatter(torch.tensor(ids), torch.stack(blocks))
    for i, bid in enumerate(ids):
        b.data[bid].copy_(blocks[i])
    assert torch.equal(raw(a.data), raw(b.data))
    staged, ops = KVPool.from_spec(spec, 12 * nbytes), FakeOps()
    assert BlockTransfers(staged, ops, staging_blocks=8).restore([ListSource(blocks)], ids, None)[0] == 6
    in_place = KVPool.from_spec(spec, 12 * nbytes)
    assert BlockTransfers(in_place, SyncOps()).restore([ListSource(blocks)], ids, None)[0] == 6
    assert torch.equal(raw(staged.data), raw(in_place.data)) and torch.equal(raw(staged.data), raw(b.data))


def test_host_blocks_go_to_the_device_straight_from_their_slots_by_span_and_count_after_the_copy() -> None:
    """The host tier lends its slots (pinned on CUDA): a round is one copy per run of
    consecutive slots within a registered chunk, then one scatter, with no load into the
    restore region; the hits are counted once the copies completed, and a slot a put
    took before then ends the restore there."""
    from kvserve.cachestore.host import HostTier
    from kvserve.cachestore.keys import block_hashes, make_namespace
    from kvserve.cachestore.tiered import TieredStore

    pool, ops = make_pool(16), FakeOps()
    tr = BlockTransfers(pool, ops, staging_blocks=16, scatter=logged_scatter(pool, ops))  # rounds of 4
    nbytes = pool.bytes_per_block
    host = HostTier(12 * nbytes, pool.block_shape, torch.float32, pin_chunk_bytes=6 * nbytes)
    store = TieredStore([host])
    ns = make_namespace("w", "float32", 4)
    hashes = block_hashes(ns, list(range(4 * 8)), 4)
    for i, h in enumerate(hashes):  # slots 0..7 in order; a chunk boundary after slot 5
        store.put(ns, h, block_value(pool, i), ("host",))
    ids = [3, 1, 4, 15, 9, 2, 6, 5]
    reads = store.reads(ns, hashes, ["host"] * 8)
    n, event = tr.restore(reads, ids, None)
    assert n == 8 and all(torch.equal(pool.data[b], block_value(pool, i)) for i, b in enumerate(ids))
    rs = tr.restore_stream
    assert [e for e in ops.log if e[0] in ("copy", "scatter", "synchronize")] == [
        ("copy", rs), ("scatter", rs, (3, 1, 4, 15)),  # slots 0-3: one span
        ("copy", rs), ("copy", rs), ("scatter", rs, (9, 2, 6, 5)),  # slots 4-5 | 6-7: the chunk boundary
        ("synchronize", event.name),
    ]  # fmt: skip
    assert host.stats().hits == 8

    class Racing:  # a put takes the slot of block 5 while the copies run
        def __init__(self, read: Any) -> None:
            self.read = read

        def __getattr__(self, name: str) -> Any:
            return getattr(self.read, name)

        def __len__(self) -> int:
            return len(self.read)

        def release(self, held: Any) -> int:
            host.delete(store.reads(ns, [hashes[5]], ["host"])[0].refs[0])
            host.put(store.reads(ns, [hashes[0]], ["host"])[0].refs[0]._replace(block_hash=b"x" * 32), block_value(pool, 99))
            return self.read.release(held)

    n, _ = tr.restore([Racing(store.reads(ns, hashes, ["host"] * 8)[0])], ids, None)
    assert n == 5  # block 5's slot was taken (maybe mid-copy): it and the rest are recomputed


def test_a_lossy_format_is_copied_compact_and_decoded_after_the_copy_to_the_cpu_decodes_bits(redis_url: str) -> None:
    """Redis blocks stored int8 / fp8 / bf16 go to the device in their stored form (the
    compact bytes, verified, in the restore region), are decoded there after the copy,
    then scattered: the pool holds exactly the bits the CPU's decode writes (an in-place
    restore of the same blocks)."""
    from kvserve.cachestore.codec import STORAGE_FORMATS
    from kvserve.cachestore.keys import block_hashes, make_namespace
    from kvserve.cachestore.redis import RedisTier
    from kvserve.cachestore.tiered import TieredStore

    ns = make_namespace("w", "bfloat16", 4)
    hashes = block_hashes(ns, list(range(4 * 6)), 4)
    ids = [5, 2, 9, 1, 7, 3]
    for fmt in ("int8", "fp8", "bf16"):
        dtype = torch.bfloat16 if fmt != "bf16" else torch.float32
        pools = [KVPool(12, 2, 4, 2, 8, dtype=dtype) for _ in range(2)]
        tier = RedisTier(redis_url, block_shape=pools[0].block_shape, dtype=dtype, key_prefix=f"t-{fmt}:",
                         storage_dtype=STORAGE_FORMATS[fmt])
        store = TieredStore([tier])
        store.put_many(ns, hashes, [(3 * block_value(pools[0], i)).to(dtype) for i in range(6)], ("redis",))
        ops = FakeOps()
        staged = BlockTransfers(pools[0], ops, staging_blocks=16, scatter=logged_scatter(pools[0], ops))
        reads = store.reads(ns, hashes, ["redis"] * 6)
        expand = reads[0].expand
        reads[0].expand = lambda stored, out: (ops.log.append(("expand", ops.current_stream(), stored.dtype)),
                                               expand(stored, out))
        assert staged.restore(reads, ids, None)[0] == 6
        kinds = [e[:2] for e in ops.log if e[0] in ("copy", "expand", "scatter")]
        rs = staged.restore_stream
        assert kinds == [("copy", rs), ("expand", rs), ("scatter", rs)] * 2  # rounds of 4, then 2
        assert all(e[2] == torch.uint8 for e in ops.log if e[0] == "expand")  # the compact bytes
        assert BlockTransfers(pools[1], SyncOps()).restore(store.reads(ns, hashes, ["redis"] * 6), ids, None)[0] == 6
        raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(raw(pools[0].data), raw(pools[1].data)), fmt
        assert pools[0].data[ids].abs().sum() > 0
        store.close()


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
    tr = BlockTransfers(pool, ops, staging_blocks=8)  # 4 demotion buffers
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
    assert isinstance(tr.ops, SyncOps) and tr.in_place and tr.staging.capacity == 0 and tr.round_blocks == 0
    ptrs: list[int] = []

    class Pointers(ListSource):
        def load(self, start: int, outs: Any) -> int:
            ptrs.extend(t.data_ptr() for t in outs)
            return len(outs)

    n, event = tr.restore([Pointers([block_value(pool, 0)] * 2)], [2, 3], None)
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
            return model(layout, kv, **kw)  # no ``decoder``: every decode step the reference's forward, logged

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
    """The engine's CUDA code path on the CPU: restores go to device staging on the
    restore stream in rounds (a staging of 4 blocks: rounds of one) and are scattered
    into the pool, and the compute stream waits for the last round before the forward
    that reads them; the output equals recomputing and every staging buffer comes back."""
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
    assert b.transfers.staging.num_free == b.transfers.staging.capacity
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


def test_an_engine_restores_a_lossy_redis_format_decoded_after_the_copy_as_the_cpu_does(
    loaded: Any, redis_url: str
) -> None:
    """The whole chain on the CUDA code path (fake streams): a returning turn's blocks
    stored in Redis as int8 (fp8 takes the same path: test_the_stored_form...) are planned, loaded in their stored form, copied,
    decoded after the copy and scattered; the turn gives the tokens a CPU engine gives
    restoring the same blocks (decoded on the CPU), and both restored every full block."""
    from kvserve.service.types import CacheScope
    from tests.fixtures.engine import BS, finished, make_engine, prompts, req, run
    from kvserve.service.engine.config import EngineConfig
    from kvserve.service.engine.store import build_store

    fmt = "int8"

    def store() -> Any:
        return build_store(EngineConfig(block_size=BS, redis_url=redis_url, redis_kv_format=fmt,
                                        redis_key_prefix=f"lossy-{fmt}:"), loaded)

    (hist,) = prompts(loaded.config.vocab_size, [23], seed=11)
    a = make_engine(loaded, store(), restore_policy="always")
    run(a, [req("a", hist, n=1)])
    a.spill(hist, CacheScope(), ("redis",), lambda n, held: None)
    assert a.store.flush(30)
    a.step()
    a.close()
    turn = hist + [5, 6, 7]
    outs = []
    for transfers in (lambda pool: BlockTransfers(pool, FakeOps(), staging_blocks=8), None):
        eng = make_engine(loaded, store(), restore_policy="always",
                          engine_kw=dict(transfers=transfers) if transfers else None)
        if transfers is not None:
            assert not eng.transfers.in_place
        fin = finished(run(eng, [req("b", turn, n=4)])["b"])
        assert fin.cached_tokens == (len(hist) // BS) * BS
        outs.append(fin.output_token_ids)
        eng.close()
    assert outs[0] == outs[1]
