"""The warm-up bookkeeping (service/engine/warm.py) over a real BlockManager: what it
holds, within which caps, and when it lets go (claimed, expired, reclaimed, forgotten)."""

from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.service.engine.warm import Warmer
from kvserve.service.kv.block_manager import BlockManager

NS = make_namespace("fp", "float32", 4, "")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def cached(bm, tokens):
    """Register ``tokens``' full blocks on the device and free them: idle cached blocks."""
    hs = block_hashes(NS, tokens, 4)
    blocks = bm.allocate(len(hs))
    for b, h in zip(blocks, hs):
        bm.register(b, h, NS)
    bm.free(blocks)
    return hs, blocks


def warmer(bm, clock, total=8, tenant=8, ttl=10.0):
    return Warmer(bm, max_blocks=total, max_blocks_per_tenant=tenant, ttl_s=ttl, clock=clock)


def test_device_hits_are_held_until_a_turn_claims_them():
    bm, clock = BlockManager(17), Clock()
    hs, blocks = cached(bm, list(range(12)))
    w = warmer(bm, clock)
    job = w.begin(NS, hs + block_hashes(NS, list(range(16)), 4)[3:], "t")
    assert job.on_device == 3 and len(job.rest) == 1
    assert [b.ref_count for b in blocks] == [1, 1, 1] and bm.num_cached_idle == 0  # no eviction can take them
    bm.touch(blocks[:2])  # a turn admitted with the first two as device hits
    assert w.claim(blocks[:2]) == 2
    assert [b.ref_count for b in blocks] == [1, 1, 1]  # the turn's own two, the warm-up's last one
    s = w.stats()
    assert (s.hits, s.claimed_blocks, s.pinned_blocks) == (1, 2, 1)
    assert w.claim(blocks[:2]) == 0 and w.stats().hits == 1  # nothing held there any more


def test_unclaimed_blocks_expire_into_evictable_cache_and_rewarming_renews():
    bm, clock = BlockManager(9), Clock()
    hs, blocks = cached(bm, list(range(8)))
    w = warmer(bm, clock, ttl=10.0)
    w.begin(NS, hs, "t")
    clock.t += 6
    w.begin(NS, hs[:1], "t")  # again: the first is held once, its deadline renewed
    assert w.stats().pinned_blocks == 2 and blocks[0].ref_count == 1
    clock.t += 5
    assert w.due() and w.expire() == 1  # only the second one's deadline passed
    assert blocks[1].ref_count == 0 and bm.lookup(hs[1]) is blocks[1]  # cached, findable, evictable
    clock.t += 10
    assert w.expire() == 1 and not w.due()
    assert w.stats().wasted_blocks["expired"] == 2 and bm.num_cached_idle == 2


def test_caps_bound_what_is_held_and_restored():
    bm, clock = BlockManager(17), Clock()
    hs, _ = cached(bm, list(range(8)))  # 2 blocks on the device
    w = warmer(bm, clock, total=6, tenant=4)
    chain = block_hashes(NS, list(range(40)), 4)  # 10 blocks: 2 on the device, 8 in a tier
    job = w.begin(NS, chain, "a")
    assert job.on_device == 2 and w.room("a") == 2 and w.room("b") == 4
    fresh = w.allocate(job, 8)
    assert len(fresh) == 2 and w.room("a") == 0 and w.room("b") == 2  # the total cap: 6
    result = w.landed(job, ["host"])  # the second one failed to load
    assert (result.blocks, result.on_device, result.restored, result.over_cap, result.missing) == (10, 2, 1, 6, 1)
    assert result.restored_by_tier == {"host": 1}
    assert bm.lookup(chain[2]) is fresh[0] and bm.lookup(chain[3]) is None
    assert fresh[1].ref_count == 0 and fresh[1].block_hash is None  # freed, holding nothing
    assert w.stats().pinned_blocks == 3 and w.room("a") == 1


def test_a_sequence_short_of_blocks_takes_held_ones_back_oldest_first():
    bm, clock = BlockManager(9), Clock()
    hs, blocks = cached(bm, list(range(12)))
    w = warmer(bm, clock)
    w.begin(NS, hs, "t")
    bm.touch([blocks[0]])  # a running sequence shares the oldest: letting it go frees nothing
    assert w.reclaim(1) == 1 and blocks[1].ref_count == 0 and blocks[0].ref_count == 2
    assert w.reclaim(5) == 1  # only the third one is left to take
    assert w.stats().wasted_blocks["reclaimed"] == 2 and w.stats().pinned_blocks == 1


def test_forgetting_lets_go_and_cancels_a_warm_up_in_flight():
    bm, clock = BlockManager(9), Clock()
    hs, blocks = cached(bm, list(range(4)))
    w = warmer(bm, clock)
    chain = block_hashes(NS, list(range(12)), 4)
    job = w.begin(NS, chain, "t")
    fresh = w.allocate(job, 2)
    w.forget(set(chain), [blocks[0]])  # the session was deleted meanwhile
    assert blocks[0].ref_count == 0 and w.stats().wasted_blocks["forgotten"] == 1
    result = w.landed(job, ["host", "host"])
    assert result.restored == 0 and all(b.ref_count == 0 and b.block_hash is None for b in fresh)
    assert bm.lookup(chain[1]) is None and w.stats().pinned_blocks == 0


def test_forgetting_while_a_warm_up_looks_its_blocks_up_cancels_it_too():
    """The session deleted between ``begin`` (device hits held) and ``allocate`` (the
    store's answer, from the restore thread): the hits are let go, the warm-up allocates
    nothing, and it lands holding nothing, whatever the store said it had."""
    bm, clock = BlockManager(9), Clock()
    hs, blocks = cached(bm, list(range(8)))
    w = warmer(bm, clock)
    chain = block_hashes(NS, list(range(20)), 4)  # 2 blocks on the device, 3 in a store tier
    job = w.begin(NS, chain, "t")
    assert job.on_device == 2 and w.stats().pinned_blocks == 2
    w.forget(set(chain), blocks)
    assert w.allocate(job, 3) == [] and not w.loading()
    result = w.landed(job, [])
    assert (result.restored, result.over_cap, result.missing) == (0, 0, 3)  # the session is gone: missing
    assert (w.stats().pinned_blocks, w.stats().wasted_blocks["forgotten"]) == (0, 2)
    assert bm.num_free == bm.num_usable and all(b.ref_count == 0 for b in blocks)
    assert w.room("t") == 8  # nothing counted against the tenant


def test_a_warm_up_takes_only_free_or_evictable_blocks_never_a_running_sequences():
    bm, clock = BlockManager(9), Clock()
    running = bm.allocate(5)  # a running sequence's blocks (a reference each)
    _, idle = cached(bm, list(range(8)))  # two evictable cached blocks of another transcript
    w = warmer(bm, clock)
    chain = block_hashes(NS, list(range(100, 124)), 4)  # 6 blocks in a tier
    job = w.begin(NS, chain, "t")
    fresh = w.allocate(job, 6)
    assert len(fresh) == 3 and not {b.block_id for b in fresh} & {b.block_id for b in running}
    assert all(b.ref_count == 1 for b in running)
    assert {b.block_id for b in idle} <= {b.block_id for b in fresh}  # evicted: ordinary cache may go
    result = w.landed(job, ["host"] * 3)
    assert (result.restored, result.over_cap, result.missing) == (3, 3, 0)


def test_a_sequence_short_of_blocks_waits_for_a_warm_up_in_flight_instead_of_failing():
    """Nothing runs, and a warm-up's load in flight holds the free blocks: a sequence that
    does not fit now waits (it is not refused "not enough KV blocks"), and once the load
    lands its held blocks are let go for it (reclaim)."""
    from kvserve.service.engine.config import EngineConfig
    from kvserve.service.engine.scheduler import Scheduler
    from kvserve.service.engine.sequence import Sequence
    from kvserve.service.kv.keys import BlockKeys
    from kvserve.service.types import CacheScope, GenerationRequest, SamplingParams

    bm, clock = BlockManager(9), Clock()  # 8 usable blocks
    w = warmer(bm, clock)
    keys = BlockKeys("fp", "float32", 4, None)
    sched = Scheduler(EngineConfig(block_size=4), bm, keys, has_tiers=False, reclaim=w.reclaim, warming=w.loading)
    job = w.begin(NS, block_hashes(NS, list(range(32)), 4), "t")
    assert len(w.allocate(job, 8)) == 8 and bm.num_free == 0  # loading into every free block
    request = GenerationRequest(request_id="r", prompt_token_ids=list(range(100, 124)),
                                sampling=SamplingParams(max_new_tokens=4))  # fmt: skip
    seq = Sequence(request, keys.namespace(CacheScope("t", "")), list(request.prompt_token_ids), 24, 0.0, None, None)
    sched.waiting.append(seq)
    admitted = sched.admit()
    assert admitted.refused == [] and admitted.running == [] and list(sched.waiting) == [seq]
    w.landed(job, ["host"] * 8)  # landed: the 8 blocks are held for the coming turn
    assert w.stats().pinned_blocks == 8 and bm.num_free == 0
    admitted = sched.admit()  # now it fits: 6 held blocks let go for it
    assert admitted.running == [seq] and len(seq.blocks) == 6 and w.stats().pinned_blocks == 2
    assert w.wasted["reclaimed"] == 6


def test_without_a_warm_up_in_flight_a_sequence_that_can_never_fit_is_refused():
    from kvserve.service.engine.config import EngineConfig
    from kvserve.service.engine.scheduler import Scheduler
    from kvserve.service.engine.sequence import Sequence
    from kvserve.service.kv.keys import BlockKeys
    from kvserve.service.types import CacheScope, GenerationRequest, SamplingParams

    bm, clock = BlockManager(5), Clock()  # 4 usable blocks
    w = warmer(bm, clock)
    keys = BlockKeys("fp", "float32", 4, None)
    sched = Scheduler(EngineConfig(block_size=4), bm, keys, has_tiers=False, reclaim=w.reclaim, warming=w.loading)
    request = GenerationRequest(request_id="r", prompt_token_ids=list(range(100, 124)),
                                sampling=SamplingParams(max_new_tokens=4))  # fmt: skip
    seq = Sequence(request, keys.namespace(CacheScope("t", "")), list(request.prompt_token_ids), 24, 0.0, None, None)
    sched.waiting.append(seq)
    assert sched.admit().refused == [seq]
