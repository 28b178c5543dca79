"""Host tier: copies in a preallocated slab, LRU by bytes, eviction callback, no torn reads."""

from __future__ import annotations

import threading

import pytest
import torch

from kvserve.cachestore.base import NOT_FOUND, BlockRef
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.keys import block_hashes, make_namespace

SHAPE = (2, 2, 4, 2, 8)  # (L, 2, B, n_kv, hd)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
NS = make_namespace("w", "float32", 4)
REFS = [BlockRef(NS, h) for h in block_hashes(NS, list(range(4 * 32)), 4)]


def value(i: int) -> torch.Tensor:
    """A block whose every element encodes ``i`` (so a torn read is visible)."""
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32) / 100


def make(n_blocks: int, **kw: object) -> HostTier:
    return HostTier(n_blocks * BLOCK_BYTES, SHAPE, torch.float32, **kw)  # type: ignore[arg-type]


def test_round_trip_is_a_copy() -> None:
    tier = make(4)
    src = value(1)
    assert tier.put(REFS[1], src)
    src.zero_()  # the tier holds its own copy
    out = torch.empty(SHAPE)
    assert tier.get_into(REFS[1], out)
    assert torch.equal(out, value(1))
    got = tier.get(REFS[1])
    assert got is not None and torch.equal(got, value(1))
    got.zero_()  # and hands out copies
    assert tier.get_into(REFS[1], out) and torch.equal(out, value(1))


def test_miss_is_none_and_counted() -> None:
    tier = make(2)
    out = torch.full(SHAPE, 7.0)
    assert not tier.get_into(REFS[0], out)
    assert tier.get(REFS[0]) is None
    assert torch.equal(out, torch.full(SHAPE, 7.0))
    s = tier.stats()
    assert s.misses == 2 and s.hits == 0 and s.failures == {NOT_FOUND: 2}


def test_capacity_is_whole_blocks_and_preallocated() -> None:
    tier = HostTier(3 * BLOCK_BYTES + BLOCK_BYTES // 2, SHAPE, torch.float32)
    assert tier.capacity_blocks == 3 and tier.capacity_bytes == 3 * BLOCK_BYTES
    slab_ptrs = {tier._slab[i].data_ptr() for i in range(tier.capacity_blocks)}
    assert len(slab_ptrs) == 3  # and the memcpy view of each slot is that slot's memory
    assert [tier._slot_bytes[i].ctypes.data for i in range(3)] == [tier._slab[i].data_ptr() for i in range(3)]
    for i in range(10):
        assert tier.put(REFS[i], value(i))
    # Every block lives in one of the preallocated slots: nothing was allocated per put.
    assert {tier._slab[slot].data_ptr() for slot in tier._lru.values()} <= slab_ptrs
    assert len(tier) == 3
    assert tier.stats().bytes_held == 3 * BLOCK_BYTES


def test_zero_capacity_holds_nothing() -> None:
    tier = HostTier(BLOCK_BYTES - 1, SHAPE, torch.float32)
    assert not tier.put(REFS[0], value(0))
    assert not tier.contains(REFS[0])


def test_lru_eviction_order_and_refresh() -> None:
    evicted: list[tuple[BlockRef, torch.Tensor]] = []
    tier = make(3, on_evict=lambda ref, t: evicted.append((ref, t.clone())))
    for i in range(3):
        tier.put(REFS[i], value(i))
    assert tier.get_into(REFS[0], torch.empty(SHAPE))  # 0 is now the most recent
    tier.put(REFS[3], value(3))  # evicts 1
    tier.put(REFS[0], value(0))  # already there: refreshes, evicts nothing
    tier.put(REFS[4], value(4))  # evicts 2
    assert [r for r, _ in evicted] == [REFS[1], REFS[2]]
    # The callback saw the evicted block's contents, before the slot was reused.
    assert torch.equal(evicted[0][1], value(1)) and torch.equal(evicted[1][1], value(2))
    assert tier.contains_many(REFS[:5]) == [True, False, False, True, True]
    s = tier.stats()
    assert s.evictions == 2 and s.puts == 5 and s.put_skips == 1


def test_put_is_idempotent() -> None:
    tier = make(4)
    for _ in range(3):
        assert tier.put(REFS[0], value(0))
    assert len(tier) == 1
    assert tier.stats().puts == 1 and tier.stats().put_skips == 2


def test_get_many_into_stops_at_first_miss() -> None:
    tier = make(8)
    for i in (0, 1, 3):
        tier.put(REFS[i], value(i))
    outs = [torch.full(SHAPE, -1.0) for _ in range(4)]
    assert tier.get_many_into(REFS[:4], outs) == 2
    assert torch.equal(outs[0], value(0)) and torch.equal(outs[1], value(1))
    assert torch.equal(outs[3], torch.full(SHAPE, -1.0))  # never reached
    assert tier.get_many_into([], []) == 0
    with pytest.raises(ValueError):
        tier.get_many_into(REFS[:2], outs[:1])


def test_get_into_a_pool_view() -> None:
    tier = make(2)
    tier.put(REFS[0], value(0))
    pool = torch.zeros(5, *SHAPE)  # (num_blocks, L, 2, B, n_kv, hd)
    assert tier.get_into(REFS[0], pool[2])
    assert torch.equal(pool[2], value(0)) and pool[[0, 1, 3, 4]].abs().sum() == 0


def test_delete_and_clear_free_slots() -> None:
    evicted: list[BlockRef] = []
    tier = make(2, on_evict=lambda ref, t: evicted.append(ref))
    tier.put(REFS[0], value(0))
    tier.put(REFS[1], value(1))
    assert tier.delete(REFS[0]) and not tier.delete(REFS[0])
    tier.put(REFS[2], value(2))  # uses the freed slot: no eviction
    assert evicted == []
    tier.clear()
    assert len(tier) == 0 and not tier.contains(REFS[1])
    tier.put(REFS[3], value(3))
    tier.put(REFS[4], value(4))
    assert evicted == [] and len(tier) == 2


def test_failing_callback_does_not_fail_the_put() -> None:
    def boom(ref: BlockRef, t: torch.Tensor) -> None:
        raise RuntimeError("demotion failed")

    tier = make(1, on_evict=boom)
    tier.put(REFS[0], value(0))
    assert tier.put(REFS[1], value(1))
    out = torch.empty(SHAPE)
    assert tier.get_into(REFS[1], out) and torch.equal(out, value(1))
    assert tier.stats().failures == {"evict_callback": 1}


def test_wrong_shape_or_dtype_is_a_caller_bug() -> None:
    tier = make(2)
    with pytest.raises(ValueError):
        tier.put(REFS[0], torch.zeros(2, 2, 4, 2, 4))
    with pytest.raises(ValueError):
        tier.put(REFS[0], torch.zeros(SHAPE, dtype=torch.float16))
    tier.put(REFS[0], value(0))
    with pytest.raises(ValueError):
        tier.get_into(REFS[0], torch.zeros(1, *SHAPE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_memory_needs_cuda() -> None:
    with pytest.raises(ValueError):
        make(2, pin_memory=True)


def test_concurrent_puts_and_reads_never_see_torn_blocks() -> None:
    """Writers churn a tier smaller than the working set while readers copy out; every
    hit must be exactly the block stored under that ref."""
    tier = make(6)
    errors: list[str] = []
    n_refs = 16

    def writer(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(300):
            i = int(torch.randint(n_refs, (1,), generator=g))
            tier.put(REFS[i], value(i))

    def reader(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(SHAPE)
        for _ in range(300):
            i = int(torch.randint(n_refs, (1,), generator=g))
            if tier.get_into(REFS[i], out) and not torch.equal(out, value(i)):
                errors.append(f"ref {i} read wrong contents")

    threads = [threading.Thread(target=writer, args=(s,)) for s in (1, 2)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(tier) == 6
    s = tier.stats()
    assert s.hits > 0 and s.evictions > 0


def test_hold_lends_the_slots_as_spans_of_consecutive_slots_within_a_chunk() -> None:
    """A restore to the device copies straight out of the slots: ``spans`` are the held
    blocks in order as runs of consecutive slots (one copy each), never across a pinned
    chunk; hits are counted at the release, the LRU refreshed at the hold."""
    tier = make(8, pin_chunk_bytes=3 * BLOCK_BYTES)  # chunks: slots 0-2, 3-5, 6-7
    for i in range(6):
        tier.put(REFS[i], value(i))  # slots 0..5 in order
    tier.delete(REFS[2])
    tier.put(REFS[6], value(6))  # takes slot 2 again
    held = tier.hold([REFS[0], REFS[1], REFS[3], REFS[4], REFS[5], REFS[6], REFS[7]])
    assert held.n == 6  # REFS[7] is not there: the held blocks end before it
    spans = held.spans(0, 6)
    assert [len(s) for s in spans] == [2, 3, 1]  # slots 0-1 | 3-5 | 2
    got = torch.cat(spans)
    assert all(torch.equal(got[k], value(i)) for k, i in enumerate([0, 1, 3, 4, 5, 6]))
    assert [len(s) for s in held.spans(1, 4)] == [1, 2]  # a round's part: slot 1 | 3-4
    assert all(s.data_ptr() >= tier._slab.data_ptr() for s in spans)  # views of the slab, no copy
    assert tier.stats().hits == 0
    assert held.release() == 6
    s = tier.stats()
    assert s.hits == 6 and s.misses == 1 and s.failures == {NOT_FOUND: 1}
    whole = make(8, pin_chunk_bytes=3 * BLOCK_BYTES)
    for i in range(8):
        whole.put(REFS[i], value(i))
    assert [len(s) for s in whole.hold(REFS[:8]).spans(0, 8)] == [3, 3, 2]  # cut at the chunks only


def test_a_held_slot_taken_by_a_put_before_the_release_ends_the_restore_there() -> None:
    tier = make(4)
    for i in range(4):
        tier.put(REFS[i], value(i))
    held = tier.hold(REFS[:4])
    tier.delete(REFS[2])
    tier.put(REFS[9], value(9))  # reuses block 2's slot: copies out of it may be torn
    assert held.release() == 2
    held = tier.hold(REFS[:2])
    tier.put(REFS[10], value(10))  # evicts REFS[3]: the hold refreshed the held ones
    assert held.release() == 2
