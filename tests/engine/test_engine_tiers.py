"""The engine with the host and Redis tiers (a real redis-server): returning sessions
restore their blocks instead of recomputing them, and nothing untrustworthy is ever
loaded. Every output is compared with an uncached reference computed without the pool."""

from __future__ import annotations

import pytest

from kvserve.cachestore import codec
from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.cachestore.redis import RedisTier
from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.store import build_store
from kvserve.service.types import CacheScope, Tier
from kvserve.service.models.loading import load_model
from tests.fixtures.engine import (
    BS,
    bytes_per_token,
    finished,
    greedy_reference,
    prompts,
    req,
    run,
)
from tests.fixtures.engine import make_engine as _make_engine


def make_engine(loaded, store=None, **kw):
    """These tests are about restore mechanics: restore every hit, whatever the rates
    (the rate-based choice has its own test below)."""
    kw.setdefault("restore_policy", "always")
    return _make_engine(loaded, store=store, **kw)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def store_for(loaded, *, host_blocks=0, redis_url=None):
    cfg = EngineConfig(
        block_size=BS,
        host_cache_memory=host_blocks * BS * bytes_per_token(loaded),
        redis_url=redis_url,
    )
    return build_store(cfg, loaded)


def spill_now(engine, tokens, tiers=("redis",)):
    """Write a transcript's device blocks out and wait for the writer."""
    got = []
    engine.spill(tokens, CacheScope(), tiers, lambda n, held: got.append(n))
    assert engine.store.flush(30)
    engine.step()  # releases the references the spill held
    return got[0]


def two_turns(loaded, engine_a, engine_b, seed, n1=6, n2=5):
    """Turn 1 on engine_a, turn 2 (transcript + 3 new tokens) on engine_b."""
    (p1,) = prompts(loaded.config.vocab_size, [13], seed=seed)
    fin = finished(run(engine_a, [req("t1", p1, n=n1)])["t1"])
    transcript = p1 + fin.output_token_ids
    return transcript, transcript + [5, 6, 7], n2


def check_turn2(loaded, engine, prompt, n, tier, expect_cached, exact_tier=True):
    """Turn 2 reports ``expect_cached`` tokens (from ``tier`` alone when ``exact_tier``,
    else with ``tier`` among them), prefill skips them, and the output is right."""
    before = engine.runner.num_prefill_tokens
    evs = run(engine, [req("t2", prompt, n=n)])["t2"]
    start, fin = evs[0], finished(evs)
    assert start.cached_tokens == expect_cached
    assert sum(start.cached_by_tier.values()) == expect_cached
    if expect_cached and exact_tier:
        assert start.cached_by_tier.get(tier, 0) == expect_cached
    elif expect_cached:
        assert start.cached_by_tier.get(tier, 0) > 0
    assert engine.runner.num_prefill_tokens - before == len(prompt) - expect_cached
    assert fin.output_token_ids == greedy_reference(loaded.model, prompt, n)
    return start


def test_redis_restore_after_restart(loaded, redis_url):
    a = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    transcript, prompt, n = two_turns(loaded, a, a, seed=1)
    assert spill_now(a, transcript) == len(transcript) // BS
    a.close()
    b = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))  # a new process
    check_turn2(loaded, b, prompt, n, Tier.REDIS, (len(transcript) // BS) * BS)
    b.close()


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.REDIS])
def test_an_engine_built_under_inference_mode_restores(tiny_llama_dir, redis_url, tier):
    """Everything built inside ``torch.inference_mode`` (model, pool, host slab: inference
    tensors, which only inference mode may write): the store's writer thread and the
    restore thread still write them, so the returning turn restores instead of falling
    back to recomputing (the first GPU check's script built its engines so, and every
    restore there failed: "Inplace update to inference tensor outside InferenceMode")."""
    import torch

    with torch.inference_mode():
        model = load_model(str(tiny_llama_dir), dtype="float32", device="cpu")

        def store():
            return store_for(model, host_blocks=64 if tier is Tier.HOST else 0,
                             redis_url=redis_url if tier is Tier.REDIS else None)

        shared = store()
        a = make_engine(model, store=shared)
        transcript, prompt, n = two_turns(model, a, a, seed=5)
        assert spill_now(a, transcript, (tier.value,)) == len(transcript) // BS
        b = make_engine(model, store=shared if tier is Tier.HOST else store())
    check_turn2(model, b, prompt, n, tier, (len(transcript) // BS) * BS)
    a.close()
    b.close()


def test_device_eviction_demotes_to_host_and_restores(loaded):
    # 10 usable blocks: the second conversation evicts the first one's blocks
    eng = make_engine(
        loaded, store=store_for(loaded, host_blocks=64), kv_cache_memory=11 * BS * bytes_per_token(loaded)
    )
    transcript, prompt, n = two_turns(loaded, eng, eng, seed=2)
    (other,) = prompts(loaded.config.vocab_size, [30], seed=99)
    run(eng, [req("other", other, n=4)])
    assert eng.blocks.num_evicted > 0
    start = check_turn2(
        loaded, eng, prompt, n, Tier.HOST, (len(transcript) // BS) * BS, exact_tier=False
    )
    assert start.cached_tier is Tier.HOST
    eng.close()


def test_host_eviction_demotes_to_redis(loaded, redis_url):
    eng = make_engine(
        loaded,
        store=store_for(loaded, host_blocks=2, redis_url=redis_url),
        kv_cache_memory=11 * BS * bytes_per_token(loaded),
    )
    transcript, prompt, n = two_turns(loaded, eng, eng, seed=3)
    for i in range(3):  # push the first conversation out of the device and the host
        (other,) = prompts(loaded.config.vocab_size, [30], seed=100 + i)
        run(eng, [req(f"o{i}", other, n=4)])
    assert eng.store.flush(30)
    start = check_turn2(
        loaded, eng, prompt, n, Tier.REDIS, (len(transcript) // BS) * BS, exact_tier=False
    )
    assert start.cached_tier is Tier.REDIS
    eng.close()


def test_pressure_three_times_the_device_pool(loaded, redis_url):
    usable = 12
    eng = make_engine(
        loaded,
        store=store_for(loaded, host_blocks=8, redis_url=redis_url),
        kv_cache_memory=(usable + 1) * BS * bytes_per_token(loaded),
    )
    convs = prompts(loaded.config.vocab_size, [14, 15, 13, 14, 15, 16], seed=4)  # ~3x the pool
    transcripts = []
    for i, p in enumerate(convs):
        fin = finished(run(eng, [req(f"c{i}", p, n=4)])[f"c{i}"])
        transcripts.append(p + fin.output_token_ids)
    assert eng.store.flush(30)
    restored = 0
    for i, t in enumerate(transcripts):
        nxt = t + [9, 10]
        evs = run(eng, [req(f"r{i}", nxt, n=3)])[f"r{i}"]
        restored += evs[0].cached_by_tier.get(Tier.HOST, 0) + evs[0].cached_by_tier.get(Tier.REDIS, 0)
        assert finished(evs).output_token_ids == greedy_reference(loaded.model, nxt, 3)
    assert restored > 0
    assert eng.blocks.num_free == eng.blocks.num_usable
    eng.close()


def _keys_of(loaded, tokens, redis_tier):
    from kvserve.cachestore.base import BlockRef

    ns = make_namespace(loaded.fingerprint, "float32", BS, "")
    return ns, [redis_tier.key(BlockRef(ns, h)) for h in block_hashes(ns, tokens, BS)]


@pytest.mark.parametrize("fault", ["flipped_byte", "truncated", "other_weights"])
def test_untrustworthy_value_is_a_miss_and_the_answer_is_right(loaded, redis_server, redis_url, fault):
    a = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    transcript, prompt, n = two_turns(loaded, a, a, seed=5)
    spill_now(a, transcript)
    a.close()
    ns, keys = _keys_of(loaded, transcript, a.store.tier(Tier.REDIS))
    bad = 1  # the second block goes bad: only the first may be restored
    with redis_server.client() as c:
        value = bytearray(c.get(keys[bad]))
        if fault == "flipped_byte":
            value[len(value) // 2] ^= 0x01
        elif fault == "truncated":
            value = value[: len(value) - 7]
        else:  # a value written by a model with other weights, stored under this key
            other_ns = make_namespace("f" * 64, "float32", BS, "")
            tensor = a.pool.data[1].clone()
            value = bytearray(codec.encode(other_ns, block_hashes(ns, transcript, BS)[bad], tensor))
        c.set(keys[bad], bytes(value))
    b = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    check_turn2(loaded, b, prompt, n, Tier.REDIS, bad * BS)
    assert b.store.tier(Tier.REDIS).stats().failures  # the reason was counted
    b.close()


def test_redis_down_mid_conversation_then_back(loaded, redis_server, redis_url):
    eng = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    transcript, prompt, n = two_turns(loaded, eng, eng, seed=6)
    redis_server.stop()
    try:
        spill_now(eng, transcript)  # writes fail quietly
        fresh = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
        check_turn2(loaded, fresh, prompt, n, Tier.REDIS, 0)  # a miss, a right answer
        fresh.close()
    finally:
        redis_server.start()
    eng2 = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    t2, p2, n2 = two_turns(loaded, eng2, eng2, seed=7)
    spill_now(eng2, t2)
    eng3 = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    check_turn2(loaded, eng3, p2, n2, Tier.REDIS, (len(t2) // BS) * BS)
    for e in (eng, eng2, eng3):
        e.close()


def test_redis_at_maxmemory_evicting_keys(loaded, make_redis_server):
    server = make_redis_server(maxmemory="64mb", maxmemory_policy="allkeys-lru")
    url = server.url
    a = make_engine(loaded, store=store_for(loaded, redis_url=url))
    convs = prompts(loaded.config.vocab_size, [40] * 12, seed=8)
    transcripts = []
    for i, p in enumerate(convs):
        fin = finished(run(a, [req(f"c{i}", p, n=4)])[f"c{i}"])
        transcripts.append(p + fin.output_token_ids)
        spill_now(a, transcripts[-1])
        if i == 0:
            # The store's connections are open now. Leave room for a few conversations'
            # blocks (~40 kB each) above what Redis itself uses, whatever its connection
            # overhead (a fixed 1 MB limit sat below it: every write was refused, none evicted).
            with server.client() as c:
                c.config_set("maxmemory", int(c.info("memory")["used_memory"]) + 150_000)
    with server.client() as c:
        assert int(c.info("stats")["evicted_keys"]) > 0
    assert a.store.stats().tiers[Tier.REDIS].puts > 100  # written, not refused (OOM)
    a.close()
    b = make_engine(loaded, store=store_for(loaded, redis_url=url))
    for i in (0, len(transcripts) - 1):  # the oldest was evicted, the newest is there
        nxt = transcripts[i] + [11]
        evs = run(b, [req(f"r{i}", nxt, n=3)])[f"r{i}"]
        assert finished(evs).output_token_ids == greedy_reference(loaded.model, nxt, 3)
    b.close()


def test_auto_policy_recomputes_when_the_tier_is_slower(loaded, redis_url):
    from kvserve.cachestore.tiered import TieredStore

    a = make_engine(loaded, store=store_for(loaded, redis_url=redis_url))
    transcript, prompt, n = two_turns(loaded, a, a, seed=11)
    spill_now(a, transcript)
    a.close()
    slow = store_for(loaded, redis_url=redis_url)
    # a Redis that restores at 1 kB/s (as measured) loses to any prefill
    store = TieredStore([slow.tier(Tier.REDIS)], initial_restore_rates={"redis": 1e3})
    b = make_engine(loaded, store=store, restore_policy="auto")
    (warm,) = prompts(loaded.config.vocab_size, [40], seed=12)
    run(b, [req("warm", warm, n=1)])  # measures the prefill rate
    assert b.runner.prefill_tokens_per_s is not None
    check_turn2(loaded, b, prompt, n, Tier.REDIS, 0)
    assert b.restorer.num_restores_skipped > 0
    decisions = store.stats().decisions
    assert decisions[("redis", "recomputed", "slower")] > 0
    assert not any(d == "restored" for _, d, _ in decisions)
    b.close()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])  # bf16: tests/unit/test_codec.py, test_redis_tier.py
def test_lossy_redis_format_restores_a_session_close_to_exact(loaded, redis_url, fmt):
    """A session restored from Redis stored in a lossy format (--redis-kv-format): the
    turn's greedy output agrees with recomputing it (on this tiny model, at this length;
    bench/bench_restore.py --formats measures the error over many sessions), and an
    exact reader of the same Redis finds none of those blocks."""
    from bench.lossy_kv import measure_kv_error

    def lossy_store():
        return build_store(EngineConfig(block_size=BS, redis_url=redis_url, redis_kv_format=fmt), loaded)

    a = make_engine(loaded, store=lossy_store())
    (p1,) = prompts(loaded.config.vocab_size, [16], seed=31)
    run(a, [req("t1", p1, n=4)])
    spill_now(a, p1)
    a.close()
    b = make_engine(loaded, store=lossy_store())
    turn = p1 + [5, 6, 7]
    fin = finished(run(b, [req("t2", turn, n=4)])["t2"])
    assert fin.cached_tokens == 16
    assert fin.output_token_ids == greedy_reference(loaded.model, turn, 4)
    b.close()
    exact = store_for(loaded, redis_url=redis_url)
    ns = make_namespace(loaded.fingerprint, "float32", BS, "")
    assert exact.match_prefix(ns, block_hashes(ns, p1, BS)) == []
    exact.close()
    err = measure_kv_error(loaded, codec.STORAGE_FORMATS[fmt], sessions=3, history=16, decode=3, block_size=BS)
    assert err["first_token_agreement"] == 1.0
    assert 0 < err["max_logit_diff"] < 0.2
