"""Tiered store against a real redis-server: longest-prefix lookup, verified restores
that stop at the first bad block, background spills, demotion, restore rates."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import redis
import torch

from kvserve.cachestore import codec
from kvserve.cachestore.base import BlockRef
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.cachestore.redis import RedisTier
from kvserve.cachestore.tiered import SpillResult, TieredStore
from kvserve.common.tiers import Tier

SHAPE = (2, 2, 4, 2, 8)  # (L, 2, B, n_kv, hd)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
NS = make_namespace("weights-a", "float32", 4)
HASHES = block_hashes(NS, list(range(4 * 24)), 4)


def value(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


def pool(n: int) -> torch.Tensor:
    """A stand-in for the engine's device pool: (num_blocks, L, 2, B, n_kv, hd)."""
    return torch.full((n, *SHAPE), 7.0)


@pytest.fixture
def make_store(redis_url: str) -> Any:
    stores: list[TieredStore] = []

    def make(host_blocks: int | None = 8, with_redis: bool = True, **kw: Any) -> TieredStore:
        host = HostTier(host_blocks * BLOCK_BYTES, SHAPE, torch.float32) if host_blocks is not None else None
        rt = RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32, key_prefix="t:") if with_redis else None
        store = TieredStore([t for t in (host, rt) if t is not None], **kw)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close(timeout=5)


def test_match_prefix_prefers_host_and_asks_redis_once(make_store: Any, count_round_trips: Callable[[], int]) -> None:
    store = make_store()
    store.put_many(NS, HASHES[0:2], [value(0), value(1)], [Tier.HOST])
    store.put_many(NS, HASHES[1:4], [value(1), value(2), value(3)], [Tier.REDIS])
    store.put(NS, HASHES[5], value(5), [Tier.HOST])
    start = count_round_trips()
    assert store.match_prefix(NS, HASHES[:8]) == [Tier.HOST, Tier.HOST, Tier.REDIS, Tier.REDIS]
    assert count_round_trips() - start == 1
    # All in host: Redis is not asked at all.
    start = count_round_trips()
    assert store.match_prefix(NS, HASHES[:2]) == [Tier.HOST, Tier.HOST]
    assert count_round_trips() == start
    assert store.match_prefix(NS, []) == []
    assert store.match_prefix(NS, HASHES[10:12]) == []
    assert store.location(NS, HASHES[:8]) == {Tier.HOST: 3, Tier.REDIS: 3}


def test_host_only_and_redis_only(make_store: Any) -> None:
    host_only = make_store(with_redis=False)
    host_only.put(NS, HASHES[0], value(0), [Tier.HOST, Tier.REDIS])  # an unconfigured tier holds nothing
    assert host_only.match_prefix(NS, HASHES[:2]) == [Tier.HOST]
    assert host_only.tiers == (Tier.HOST,)
    redis_only = make_store(host_blocks=None)
    redis_only.put(NS, HASHES[0], value(0), [Tier.REDIS])
    assert redis_only.match_prefix(NS, HASHES[:2]) == [Tier.REDIS]
    assert redis_only.estimated_restore_seconds(Tier.HOST, 4) == float("inf")


def test_fetch_into_restores_each_tier(make_store: Any) -> None:
    store = make_store()
    store.put_many(NS, HASHES[0:3], [value(i) for i in range(3)], [Tier.HOST])
    store.put_many(NS, HASHES[3:6], [value(i) for i in range(3, 6)], [Tier.REDIS])
    tiers = store.match_prefix(NS, HASHES[:6])
    assert tiers == [Tier.HOST] * 3 + [Tier.REDIS] * 3
    p = pool(8)
    dest = [4, 0, 7, 1, 6, 2]  # any free device blocks
    assert store.fetch_into(NS, HASHES[:6], tiers, [p[d] for d in dest]) == 6
    for i, d in enumerate(dest):
        assert torch.equal(p[d], value(i))
    assert torch.equal(p[3], torch.full(SHAPE, 7.0)) and torch.equal(p[5], torch.full(SHAPE, 7.0))
    s = store.stats()
    assert s.tiers[Tier.HOST].hits == 3 and s.tiers[Tier.REDIS].hits == 3


@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "other_namespace"])
def test_fetch_stops_at_the_first_bad_block(make_store: Any, redis_url: str, how: str) -> None:
    store = make_store()
    store.put_many(NS, HASHES[:6], [value(i) for i in range(6)], [Tier.REDIS])
    tiers = store.match_prefix(NS, HASHES[:6])
    assert tiers == [Tier.REDIS] * 6
    key = store.tier(Tier.REDIS).key(BlockRef(NS, HASHES[3]))
    with redis.Redis.from_url(redis_url) as c:
        raw = bytearray(c.get(key))
        if how == "flip":
            raw[200] ^= 0x04
            c.set(key, bytes(raw))
        elif how == "truncate":
            c.set(key, bytes(raw[:-1]))
        elif how == "delete":
            c.delete(key)
        else:
            c.set(key, codec.encode(make_namespace("weights-b", "float32", 4), HASHES[3], value(3)))
    p = pool(6)
    assert store.fetch_into(NS, HASHES[:6], tiers, list(p)) == 3
    assert all(torch.equal(p[i], value(i)) for i in range(3))
    assert all(torch.equal(p[i], torch.full(SHAPE, 7.0)) for i in (4, 5))  # never reached
    failures = store.stats().tiers[Tier.REDIS].failures
    reason = {
        "flip": codec.BAD_CHECKSUM, "truncate": codec.TRUNCATED,
        "delete": "not_found", "other_namespace": codec.WRONG_NAMESPACE,
    }[how]  # fmt: skip
    assert failures == {reason: 1}


def test_fetch_stops_when_a_host_block_went_away(make_store: Any) -> None:
    store = make_store()
    store.put_many(NS, HASHES[:4], [value(i) for i in range(4)], [Tier.HOST])
    tiers = store.match_prefix(NS, HASHES[:4])
    store.tier(Tier.HOST).delete(BlockRef(NS, HASHES[1]))  # evicted between lookup and restore
    assert store.fetch_into(NS, HASHES[:4], tiers, list(pool(4))) == 1
    assert store.fetch_into(NS, HASHES[:2], ["nowhere", Tier.HOST], list(pool(2))) == 0
    with pytest.raises(ValueError):
        store.fetch_into(NS, HASHES[:2], [Tier.HOST], list(pool(2)))


def test_put_is_idempotent_across_sessions(make_store: Any) -> None:
    store = make_store()
    for _ in range(3):  # three sessions share the same system prompt blocks
        assert store.put_many(NS, HASHES[:3], [value(i) for i in range(3)], [Tier.HOST, Tier.REDIS]) == [True] * 3
    s = store.stats().tiers
    assert s[Tier.HOST].puts == 3 and s[Tier.HOST].put_skips == 6
    assert s[Tier.REDIS].puts == 3 and s[Tier.REDIS].put_skips == 6
    assert len(store.tier(Tier.HOST)) == 3


def test_spill_of_blocks_the_caller_no_longer_holds(make_store: Any) -> None:
    """Blocks given as None (demoted off the device) are copied from the host tier to
    Redis, or only looked up where the host does not hold them: no hit is counted."""
    store = make_store()
    store.put_many(NS, HASHES[:3], [value(i) for i in range(3)], [Tier.HOST])  # demoted: host only
    store.put_many(NS, HASHES[3:4], [value(3)], [Tier.REDIS])  # Redis only
    p = torch.stack([value(4)])  # still on the device
    items = [(NS, HASHES[i], None) for i in range(4)] + [(NS, HASHES[4], p[0]), (NS, HASHES[5], None)]
    done: list[SpillResult] = []
    assert store.submit_spill(items, [Tier.HOST, Tier.REDIS], on_done=done.append)
    assert store.flush(timeout=10)
    # host: 0-2 held, 4 written; Redis: 0-2 copied from the host, 3 there, 4 written; 5 nowhere
    assert done == [SpillResult(6, {Tier.HOST: 4, Tier.REDIS: 5})]
    assert store.tier(Tier.HOST).stats().hits == 0
    store.tier(Tier.HOST).clear()
    outs = list(pool(5))
    assert store.fetch_into(NS, HASHES[:5], [Tier.REDIS] * 5, outs) == 5
    assert all(torch.equal(outs[i], value(i)) for i in range(5))


def test_spill_in_the_background(make_store: Any) -> None:
    store = make_store()
    p = torch.stack([value(i) for i in range(5)])  # the session's device blocks
    done: list[SpillResult] = []
    released = threading.Event()

    def on_done(result: SpillResult) -> None:
        done.append(result)
        released.set()  # the engine would drop its reference on the blocks here

    items = [(NS, HASHES[i], p[i]) for i in range(5)]
    assert store.submit_spill(items, [Tier.HOST, Tier.REDIS], on_done=on_done)
    assert store.flush(timeout=10)
    assert released.is_set()
    assert done == [SpillResult(5, {Tier.HOST: 5, Tier.REDIS: 5})]
    assert store.location(NS, HASHES[:5]) == {Tier.HOST: 5, Tier.REDIS: 5}
    store.tier(Tier.HOST).clear()
    outs = list(pool(5))
    assert store.fetch_into(NS, HASHES[:5], store.match_prefix(NS, HASHES[:5]), outs) == 5
    assert all(torch.equal(outs[i], p[i]) for i in range(5))
    w = store.stats().writer
    assert w.submitted_blocks == 5 and w.written_blocks == 5 and w.queued_blocks == 0


def test_full_queue_drops_instead_of_blocking(make_store: Any) -> None:
    store = make_store(max_pending_blocks=4)
    gate = threading.Event()
    # The first job's callback holds the writer busy until we open the gate.
    assert store.submit_spill([(NS, HASHES[0], value(0))], [Tier.HOST], on_done=lambda r: gate.wait(10))
    assert store.submit_spill([(NS, HASHES[i], value(i)) for i in (1, 2, 3)], [Tier.HOST])
    assert not store.submit_spill([(NS, HASHES[4], value(4))], [Tier.HOST])  # full: refused at once
    assert not store.flush(timeout=0.05)
    gate.set()
    assert store.flush(timeout=10)
    assert store.submit_spill([(NS, HASHES[4], value(4))], [Tier.HOST])  # room again
    assert store.flush(timeout=10)
    w = store.stats().writer
    assert w.dropped_blocks == 1 and w.submitted_blocks == 5 and w.written_blocks == 5


def test_host_eviction_demotes_to_redis(make_store: Any) -> None:
    store = make_store(host_blocks=2)
    store.put_many(NS, HASHES[:5], [value(i) for i in range(5)], [Tier.HOST])  # evicts 0, 1, 2
    assert store.flush(timeout=10)
    assert store.match_prefix(NS, HASHES[:5]) == [Tier.REDIS, Tier.REDIS, Tier.REDIS, Tier.HOST, Tier.HOST]
    outs = list(pool(5))
    assert store.fetch_into(NS, HASHES[:5], store.match_prefix(NS, HASHES[:5]), outs) == 5
    assert all(torch.equal(outs[i], value(i)) for i in range(5))
    s = store.stats()
    assert s.writer.demoted_blocks == 3 and s.tiers[Tier.HOST].evictions == 3
    assert s.tiers[Tier.REDIS].puts == 3


def test_demote_goes_down_whatever_tiers_exist(make_store: Any) -> None:
    """``demote`` (a device eviction) lands in the first tier: the host when there is
    one (whose own evictions go on to Redis), else Redis through the writer. The block
    passed in may be overwritten as soon as the call returns."""
    both = make_store(host_blocks=1)
    src = value(0)
    both.demote(NS, HASHES[0], src)
    src.fill_(-1.0)  # the device block is reused right away
    assert both.location(NS, HASHES[:1]) == {Tier.HOST: 1, Tier.REDIS: 0}
    both.demote(NS, HASHES[1], value(1))  # the host's eviction of block 0 goes on to Redis
    assert both.flush(timeout=10)
    assert both.match_prefix(NS, HASHES[:2]) == [Tier.REDIS, Tier.HOST]
    redis_only = make_store(host_blocks=None)
    src = value(2)
    redis_only.demote(NS, HASHES[2], src)
    src.fill_(-1.0)
    assert redis_only.flush(timeout=10)
    outs = list(pool(1))
    assert redis_only.fetch_into(NS, HASHES[2:3], [Tier.REDIS], outs) == 1 and torch.equal(outs[0], value(2))
    assert redis_only.stats().writer.demoted_blocks == 1
    host_only = make_store(host_blocks=1, with_redis=False)
    host_only.demote(NS, HASHES[3], value(3))
    host_only.demote(NS, HASHES[4], value(4))  # evicts 3: the last tier drops it
    assert host_only.match_prefix(NS, HASHES[3:5]) == [] and host_only.location(NS, HASHES[4:5]) == {Tier.HOST: 1}


def test_tiers_are_an_ordered_list_of_distinct_tiers_of_one_geometry(redis_url: str) -> None:
    host = HostTier(BLOCK_BYTES, SHAPE, torch.float32)
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])
    with pytest.raises(ValueError, match="distinct"):
        TieredStore([host, HostTier(BLOCK_BYTES, SHAPE, torch.float32)])
    with pytest.raises(ValueError, match="holds"):
        TieredStore([host, RedisTier(redis_url, block_shape=(1, 2, 3), dtype=torch.float32)])
    store = TieredStore([host])
    assert store.tiers == (Tier.HOST,) and store.tier(Tier.REDIS) is None and store.block_shape == SHAPE
    assert store.shared_tier is None  # nothing for a drain to write to
    store.close()
    both = TieredStore([HostTier(BLOCK_BYTES, SHAPE, torch.float32), RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32)])
    assert both.tiers == (Tier.HOST, Tier.REDIS) and both.shared_tier == Tier.REDIS
    both.close()


def test_demotions_never_wait(make_store: Any) -> None:
    store = make_store(host_blocks=1, demotion_buffers=1)
    gate = threading.Event()
    store.put(NS, HASHES[0], value(0), [Tier.HOST])
    # Hold the writer: the next demotion takes the only staging buffer and waits.
    assert store.submit_spill([(NS, HASHES[9], value(9))], [Tier.REDIS], on_done=lambda r: gate.wait(10))
    store.put(NS, HASHES[1], value(1), [Tier.HOST])  # evicts 0: staged
    store.put(NS, HASHES[2], value(2), [Tier.HOST])  # evicts 1: no buffer free, dropped
    w = store.stats().writer
    assert w.demoted_blocks == 1 and w.demotions_dropped == 1
    gate.set()
    assert store.flush(timeout=10)
    assert store.location(NS, HASHES[:3]) == {Tier.HOST: 1, Tier.REDIS: 1}
    outs = list(pool(1))
    assert store.fetch_into(NS, HASHES[:1], [Tier.REDIS], outs) == 1 and torch.equal(outs[0], value(0))
    store.put(NS, HASHES[3], value(3), [Tier.HOST])  # the buffer is free again: evicts 2, staged
    assert store.flush(timeout=10) and store.stats().writer.demoted_blocks == 2


def test_demotion_skips_blocks_redis_already_has(make_store: Any, redis_url: str) -> None:
    store = make_store(host_blocks=2)
    store.put_many(NS, HASHES[:2], [value(0), value(1)], [Tier.HOST, Tier.REDIS])
    with redis.Redis.from_url(redis_url) as c:
        sets = int(c.info("commandstats")["cmdstat_set"]["calls"])
        store.put_many(NS, HASHES[2:4], [value(2), value(3)], [Tier.HOST])  # evicts 0 and 1
        assert store.flush(timeout=10)
        assert int(c.info("commandstats")["cmdstat_set"]["calls"]) == sets  # nothing re-sent
    s = store.stats()
    assert s.writer.demoted_blocks == 2 and s.tiers[Tier.REDIS].put_skips == 2


def test_restore_rates_are_measured(make_store: Any) -> None:
    store = make_store(initial_restore_rates={Tier.HOST: 1.0, Tier.REDIS: 1.0})  # absurd priors
    assert store.estimated_restore_seconds(Tier.HOST, 2) == 2 * BLOCK_BYTES
    store.put_many(NS, HASHES[:8], [value(i) for i in range(8)], [Tier.HOST, Tier.REDIS])
    store.fetch_into(NS, HASHES[:1], [Tier.REDIS], list(pool(1)))  # too small to measure a rate
    assert store.restore_rate(Tier.REDIS) == 1.0
    for _ in range(2):  # the first measurement of a tier is warm-up (connection set-up)
        store.fetch_into(NS, HASHES[:8], [Tier.HOST] * 8, list(pool(8)))
        store.fetch_into(NS, HASHES[:8], [Tier.REDIS] * 8, list(pool(8)))
    for tier in (Tier.HOST, Tier.REDIS):
        assert store.restore_rate(tier) > 1.0  # replaced by the measurement
        assert 0 < store.estimated_restore_seconds(tier, 8) < 8 * BLOCK_BYTES
        assert store.estimated_restore_seconds(tier, 16) == pytest.approx(2 * store.estimated_restore_seconds(tier, 8))
    rates = store.stats().restore_rates
    assert set(rates) == {Tier.HOST, Tier.REDIS} and all(r > 1.0 for r in rates.values())
    store.record_restore(Tier.HOST, 1000, 1.0)  # EWMA: moves toward a new measurement
    assert store.restore_rate(Tier.HOST) < rates[Tier.HOST]


def test_first_restore_sample_is_not_counted(make_store: Any) -> None:
    """A first restore that paid a slow connection set-up does not stick to the tier."""
    store = make_store(initial_restore_rates={Tier.REDIS: 1e9})
    store.record_restore(Tier.REDIS, BLOCK_BYTES * 8, 10.0)  # first: set-up dominated
    assert store.restore_rate(Tier.REDIS) == 1e9
    store.record_restore(Tier.REDIS, 4_000_000, 0.002)  # 2 GB/s
    assert store.restore_rate(Tier.REDIS) == pytest.approx(2e9)
    # a store with no warm-up counts the first sample
    cold = make_store(initial_restore_rates={Tier.REDIS: 1e9}, warmup_samples=0)
    cold.record_restore(Tier.REDIS, 1000, 1.0)
    assert cold.restore_rate(Tier.REDIS) == pytest.approx(1000.0)


def test_priors_are_per_device(make_store: Any) -> None:
    cpu, cuda = make_store(), make_store(device="cuda")
    assert cuda.restore_rate(Tier.HOST) > cpu.restore_rate(Tier.HOST)
    assert cuda.restore_rate(Tier.REDIS) == cpu.restore_rate(Tier.REDIS)


def _decisions(store: TieredStore) -> dict[tuple[str, str, str], int]:
    return store.stats().decisions


def test_plan_restore_decides_per_tier(make_store: Any) -> None:
    """Host blocks that beat prefill are restored while the slower Redis blocks after
    them are recomputed; every block found is counted by decision and reason."""
    now = [0.0]
    block_s = 1e-3  # prefill time of one block's tokens
    # host: 1 block in 1e-4 s (wins), Redis: 1 block in 1e-2 s (loses)
    store = make_store(
        initial_restore_rates={Tier.HOST: BLOCK_BYTES / 1e-4, Tier.REDIS: BLOCK_BYTES / 1e-2}, clock=lambda: now[0]
    )
    store.put_many(NS, HASHES[:3], [value(i) for i in range(3)], [Tier.HOST])
    store.put_many(NS, HASHES[3:8], [value(i) for i in range(3, 8)], [Tier.REDIS])
    plan = store.plan_restore(NS, HASHES[:10], block_s)
    assert plan.tiers == [Tier.HOST] * 3 and plan.found == 8 and plan.cut
    assert _decisions(store) == {(Tier.HOST, "restored", "faster"): 3, (Tier.REDIS, "recomputed", "slower"): 5}
    # min_speedup: host must be 20x faster than prefill; it is only 10x
    plan = store.plan_restore(NS, HASHES[:10], block_s, min_speedup=20.0)
    assert plan.tiers == []
    # a fast prefill loses to nothing: everything restored when prefill is unmeasured
    assert store.plan_restore(NS, HASHES[:10], None).tiers == [Tier.HOST] * 3 + [Tier.REDIS] * 5
    assert _decisions(store)[(Tier.REDIS, "restored", "prefill_unmeasured")] == 5
    assert store.plan_restore(NS, HASHES[:10], 1e-9, always=True).tiers == [Tier.HOST] * 3 + [Tier.REDIS] * 5
    assert _decisions(store)[(Tier.HOST, "restored", "policy_always")] == 3
    # slow Redis blocks are taken when the host blocks before them save more than they cost
    plan = store.plan_restore(NS, HASHES[:10], 2e-2)  # prefill slower than both tiers
    assert plan.tiers == [Tier.HOST] * 3 + [Tier.REDIS] * 5 and not plan.cut
    store.note_load_failed([Tier.REDIS] * 2)
    assert _decisions(store)[(Tier.REDIS, "recomputed", "load_failed")] == 2


def test_a_slow_tier_is_probed_again_when_its_rate_is_stale(make_store: Any) -> None:
    now = [100.0]
    store = make_store(initial_restore_rates={Tier.REDIS: 1.0}, clock=lambda: now[0], probe_after_s=30.0)
    store.put_many(NS, HASHES[:8], [value(i) for i in range(8)], [Tier.REDIS])
    assert store.plan_restore(NS, HASHES[:8], 1e-3).tiers == []  # never sampled: the prior decides
    store.record_restore(Tier.REDIS, 1, 1.0)  # warm-up sample: sets the sample time only
    store.record_restore(Tier.REDIS, 1, 1.0)  # measured: 1 B/s
    assert store.plan_restore(NS, HASHES[:8], 1e-3).tiers == []  # fresh and slow: recomputed
    now[0] += 31.0
    plan = store.plan_restore(NS, HASHES[:8], 1e-3)
    assert plan.tiers == [Tier.REDIS] * store.min_rate_blocks  # enough blocks to measure a rate
    assert _decisions(store)[(Tier.REDIS, "restored", "probe")] == store.min_rate_blocks
    assert _decisions(store)[(Tier.REDIS, "recomputed", "slower")] == 8 + 8 + 8 - store.min_rate_blocks


def test_redis_down_degrades_to_host(make_store: Any, redis_server: Any) -> None:
    store = make_store()
    store.put_many(NS, HASHES[:4], [value(i) for i in range(4)], [Tier.REDIS])
    store.put_many(NS, HASHES[:2], [value(0), value(1)], [Tier.HOST])
    redis_server.stop()
    try:
        assert store.match_prefix(NS, HASHES[:4]) == [Tier.HOST, Tier.HOST]
        assert store.fetch_into(NS, HASHES[:4], [Tier.HOST, Tier.HOST, Tier.REDIS, Tier.REDIS], list(pool(4))) == 2
        assert store.submit_spill([(NS, HASHES[5], value(5))], [Tier.HOST, Tier.REDIS])
        assert store.flush(timeout=10)
        assert store.location(NS, HASHES[:6]) == {Tier.HOST: 3, Tier.REDIS: 0}
        assert store.stats().writer.errors == 0
    finally:
        redis_server.start()


def test_close_drains_then_refuses(make_store: Any) -> None:
    store = make_store()
    assert store.submit_spill([(NS, HASHES[i], value(i)) for i in range(3)], [Tier.REDIS])
    assert store.close(timeout=10)
    assert not store.submit_spill([(NS, HASHES[3], value(3))], [Tier.REDIS])
    assert store.stats().writer.dropped_blocks == 1
    check = RedisTier(store.tier(Tier.REDIS).url, block_shape=SHAPE, dtype=torch.float32, key_prefix="t:")
    assert check.contains_many([BlockRef(NS, h) for h in HASHES[:3]]) == [True] * 3


def test_bad_arguments(make_store: Any) -> None:
    store = make_store()
    with pytest.raises(ValueError):
        store.put(NS, HASHES[0], value(0), ["tape"])
    with pytest.raises(TypeError):
        store.put(NS, HASHES[0], value(0), "host")
    with pytest.raises(ValueError):
        store.submit_spill([(NS, HASHES[0], torch.zeros(3))], [Tier.HOST])
    with pytest.raises(ValueError):
        TieredStore([HostTier(BLOCK_BYTES, (1, 2, 3), torch.float32), store.tier(Tier.HOST)])


def test_concurrent_spills_demotions_and_restores_never_return_wrong_kv(make_store: Any) -> None:
    """A small host tier churning (so evictions demote to Redis) while two threads
    restore random prefixes: every block reported good is exactly the block of its hash."""
    store = make_store(host_blocks=4, max_pending_blocks=64)
    n = 20
    values = [value(i) for i in range(n)]
    errors: list[str] = []
    stop, first_spill = threading.Event(), threading.Event()

    def spiller() -> None:
        g = torch.Generator().manual_seed(1)
        while not stop.is_set():
            start = int(torch.randint(6, (1,), generator=g))  # blocks 0..8 churn a 4-block host
            items = [(NS, HASHES[i], values[i]) for i in range(start, start + 3)]
            store.submit_spill(items, [Tier.HOST] if start % 2 else [Tier.HOST, Tier.REDIS])
            store.flush(timeout=5)
            first_spill.set()

    def restorer(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        outs = list(pool(n))
        first_spill.wait(10)
        store.put_many(NS, HASHES[:2], values[:2], [Tier.REDIS])  # a prefix is always somewhere
        for _ in range(40):
            k = int(torch.randint(1, n + 1, (1,), generator=g))
            tiers = store.match_prefix(NS, HASHES[:k])
            good = store.fetch_into(NS, HASHES[: len(tiers)], tiers, outs)
            for i in range(good):
                if not torch.equal(outs[i], values[i]):
                    errors.append(f"block {i} from {tiers[i]} is wrong")

    spill = threading.Thread(target=spiller)
    spill.start()
    restorers = [threading.Thread(target=restorer, args=(s,)) for s in (2, 3)]
    for t in restorers:
        t.start()
    for t in restorers:
        t.join()
    stop.set()
    spill.join()
    assert errors == []
    s = store.stats()
    assert s.tiers[Tier.HOST].evictions > 0 and s.writer.demoted_blocks > 0
    assert s.tiers[Tier.REDIS].hits > 0  # (host hits depend on the interleaving)
    assert s.writer.errors == 0
