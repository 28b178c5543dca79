"""Retention in the engine (tiny Llama, real host and disk tiers, a real redis-server): a
retained prefix survives the pressure of other sessions that evicts every block no
retention holds, on the device, in host memory and on disk, and a later turn reads it
from the cache; an expired retention lets it go; a tenant past its bound is refused
before anything runs; a retention a server acknowledged holds after it restarts, on disk
and in Redis. The figures a turn reports (cache read, cache creation per prefix) are
checked against what the tiers hold. The store's clock is a fake one: expiry needs no
sleep."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import redis
import torch

from kvserve.cachestore.base import BlockRef
from kvserve.cachestore.disk import DiskTier
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.keys import block_hashes
from kvserve.cachestore.redis import RedisTier
from kvserve.cachestore.tiered import TieredStore
from kvserve.service.models.loading import load_model
from kvserve.service.types import (
    Finished,
    CacheScope,
    GenerationRequest,
    InvalidRequest,
    Retain,
    RetentionRefused,
    SamplingParams,
    Tier,
)
from tests.fixtures.engine import BS, finished, greedy_reference, make_engine, prompts, run

T0 = 1_700_000_000.0
HOUR = 3600.0
PREFIX = 24  # tokens retained: 6 blocks of 4


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def store_for(loaded, clock, *, host_blocks=0, disk_dir: Path | None = None, disk_blocks=0, redis_url=None,
              tenant_blocks=64) -> TieredStore:  # fmt: skip
    """The tiers build_store makes, at tiny sizes, on the fake clock."""
    spec = loaded.kv_spec(BS)
    tiers: list[Any] = []
    if host_blocks:
        tiers.append(HostTier(host_blocks * spec.bytes_per_block, spec.block_shape, spec.dtype))
    if disk_dir is not None:
        tiers.append(DiskTier(disk_dir, disk_blocks * (spec.bytes_per_block + 4096), spec.block_shape, spec.dtype))
    if redis_url:
        tiers.append(RedisTier(redis_url, block_shape=spec.block_shape, dtype=spec.dtype, ttl_s=600,
                               key_prefix="rt:", wall_clock=clock))  # fmt: skip
    return TieredStore(tiers, max_retained_blocks_per_owner=tenant_blocks, wall_clock=clock)


def engine_for(loaded, store, *, pool_blocks=16, **kw):
    return make_engine(loaded, store, kv_cache_memory=pool_blocks * loaded.kv_spec(BS).bytes_per_block,
                       restore_policy="always", **kw)  # fmt: skip


def turn(rid, prompt, n=4, retain=(), tenant="acme"):
    return GenerationRequest(
        request_id=rid, prompt_token_ids=list(prompt), sampling=SamplingParams(max_new_tokens=n, ignore_eos=True),
        scope=CacheScope(tenant), retain=tuple(retain),
    )  # fmt: skip


def pressure(engine, loaded, n=12, seed=100, tenant="other"):
    """Other sessions' turns, whose blocks fill the device, host and disk many times over."""
    for i, p in enumerate(prompts(loaded.config.vocab_size, [22] * n, seed=seed)):
        run(engine, [turn(f"p{seed}-{i}", p, tenant=tenant)])
    assert engine.store.flush(30)
    return prompts(loaded.config.vocab_size, [22] * n, seed=seed)


def where(engine, prompt, tenant="acme"):
    assert engine.store.flush(30)
    return engine.block_locations(prompt, CacheScope(tenant))


def test_a_retained_prefix_survives_pressure_and_is_read_back(loaded, tmp_path: Path) -> None:
    clock = Clock()
    store = store_for(loaded, clock, host_blocks=10, disk_dir=tmp_path / "kv", disk_blocks=12)
    engine = engine_for(loaded, store)
    (p,) = prompts(loaded.config.vocab_size, [PREFIX + 3], seed=1)
    evs = run(engine, [turn("r1", p, retain=[Retain(HOUR, PREFIX)])])["r1"]
    assert evs[0].retain_tokens == PREFIX
    fin = finished(evs)
    (kept,) = fin.retained
    assert (kept.prefix_tokens, kept.retained_tokens, kept.created_tokens) == (PREFIX, PREFIX, PREFIX)
    assert kept.tiers == (Tier.HOST, Tier.DISK) and kept.expires_at >= T0 + HOUR
    assert fin.cache_creation_tokens == PREFIX and fin.cache_read_tokens == 0

    others = pressure(engine, loaded)
    for q in others[:4]:  # every block no retention holds was evicted from every tier
        assert where(engine, q, "other") == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    assert where(engine, p[:PREFIX]) == {Tier.DEVICE: 0, Tier.HOST: 6, Tier.DISK: 6}

    follow = p + [7, 8, 9, 10, 11]
    clock.t = T0 + 100
    evs = run(engine, [turn("r2", follow, n=5, retain=[Retain(HOUR, PREFIX)])])["r2"]
    assert evs[0].cached_tokens == PREFIX and evs[0].cached_by_tier == {Tier.HOST: PREFIX}
    fin = finished(evs)
    assert fin.output_token_ids == greedy_reference(loaded.model, follow, 5)
    (kept,) = fin.retained
    assert (kept.retained_tokens, kept.created_tokens) == (PREFIX, 0)  # a refresh: read, not written
    assert kept.expires_at == T0 + 100 + HOUR  # ... and kept an hour from now
    _, hashes = engine.keys.of(p[:PREFIX], CacheScope("acme"))
    assert all(engine.store.retentions.until(h) == T0 + 100 + HOUR for h in hashes)
    clock.t = T0 + HOUR + 50
    engine.store.expire_retentions()  # the first retention's time passed, not the refresh's
    assert engine.store.stats().tiers[Tier.DISK].blocks_retained == 6
    assert fin.cache_read_tokens == PREFIX and fin.cache_creation_tokens == 0
    stats = engine.cache_stats()
    assert stats.retention.created_tokens == PREFIX and stats.retention.retained_tokens == 2 * PREFIX
    assert stats.store.tiers[Tier.HOST].blocks_retained == 6
    engine.close()


def test_breakpoints_split_the_creation_by_ttl(loaded) -> None:
    """Two prefixes, the longer ttl first (as Anthropic's cache_control orders them): each
    reports its own share of what the turn wrote; a block is pinned until the longest
    ttl of the prefixes holding it."""
    clock = Clock()
    engine = engine_for(loaded, store_for(loaded, clock, host_blocks=32))
    (p,) = prompts(loaded.config.vocab_size, [30], seed=2)
    run(engine, [turn("warm", p[:10])])  # 2 blocks cached on the device already
    fin = finished(run(engine, [turn("r", p, retain=[Retain(300, 29), Retain(HOUR, 12)])])["r"])
    short, long_ = fin.retained  # shortest prefix first
    assert (short.prefix_tokens, short.retained_tokens, short.created_tokens, short.ttl_s) == (12, 12, 4, HOUR)
    assert (long_.prefix_tokens, long_.retained_tokens, long_.created_tokens, long_.ttl_s) == (29, 28, 16, 300)
    assert fin.cached_tokens == 8 and fin.cache_creation_tokens == 20
    assert short.expires_at == T0 + HOUR and long_.expires_at == T0 + 300
    clock.t = T0 + 300
    engine.store.expire_retentions()
    assert engine.store.stats().tiers[Tier.HOST].blocks_retained == 3  # the 1h prefix's blocks
    engine.close()


def test_an_expired_retention_lets_the_blocks_go(loaded, tmp_path: Path) -> None:
    clock = Clock()
    engine = engine_for(loaded, store_for(loaded, clock, host_blocks=10, disk_dir=tmp_path / "kv", disk_blocks=12))
    (p,) = prompts(loaded.config.vocab_size, [PREFIX + 3], seed=3)
    finished(run(engine, [turn("r1", p, retain=[Retain(300, PREFIX)])])["r1"])
    clock.t = T0 + 299
    assert engine.store.expire_retentions() == 0
    clock.t = T0 + 300
    assert engine.store.expire_retentions() == 12  # 6 blocks, each in host and disk
    assert engine.store.retentions.stats().blocks == 0
    pressure(engine, loaded)
    assert where(engine, p[:PREFIX]) == {Tier.DEVICE: 0, Tier.HOST: 0, Tier.DISK: 0}
    evs = run(engine, [turn("r2", p)])["r2"]
    assert evs[0].cached_tokens == 0
    engine.close()


def test_a_tenant_past_its_bound_is_refused_before_anything_runs(loaded) -> None:
    clock = Clock()
    engine = engine_for(loaded, store_for(loaded, clock, host_blocks=32, tenant_blocks=8))
    (p, q) = prompts(loaded.config.vocab_size, [PREFIX + 3, PREFIX + 3], seed=4)
    finished(run(engine, [turn("r1", p, retain=[Retain(HOUR, PREFIX)])])["r1"])  # 6 of 8 blocks
    before = engine.stats()
    with pytest.raises(RetentionRefused, match=r"tenant 'acme' retains 6 blocks .* would make 12 .* bound of 8"):
        engine.add_request(turn("r2", q, retain=[Retain(HOUR, PREFIX)]))
    assert not engine.has_work() and engine.stats().waiting == before.waiting == 0
    assert engine.store.retentions.stats().reserved_blocks == 0
    # the same prefix again is a refresh (no new block), another tenant has its own bound
    finished(run(engine, [turn("r3", p, retain=[Retain(HOUR, PREFIX)])])["r3"])
    finished(run(engine, [turn("r4", q, retain=[Retain(HOUR, PREFIX)], tenant="globex")])["r4"])
    assert engine.cache_stats().retention.refusals == {"tenant_bound": 1, "unavailable": 0}
    engine.close()


def test_requests_a_server_cannot_retain_are_refused(loaded) -> None:
    (p,) = prompts(loaded.config.vocab_size, [PREFIX + 3], seed=5)
    bare = make_engine(loaded)  # no tier below the device
    with pytest.raises(RetentionRefused, match="no cache tier"):
        bare.add_request(turn("r", p, retain=[Retain(HOUR)]))
    engine = engine_for(loaded, store_for(loaded, Clock(), host_blocks=8), retention_max_ttl_s=HOUR)
    for retain, message in [
        ([Retain(2 * HOUR)], r"retain\[0\].ttl 7200 s exceeds the longest retention this server keeps, 3600 s"),
        ([Retain(0)], r"retain\[0\].ttl must be > 0"),
        ([Retain(60, 0)], r"retain\[0\].prefix_tokens must be in \[1, 27\]"),
        ([Retain(60)] * 5, "retain has 5 entries; the limit is 4"),
    ]:
        with pytest.raises(InvalidRequest, match=message):
            engine.add_request(turn("r", p, retain=retain))
    with pytest.raises(InvalidRequest, match="retain cannot be combined with n = 2"):
        engine.add_request(GenerationRequest("n2", p, SamplingParams(max_new_tokens=2, n=2), retain=(Retain(60),)))
    # a prefix shorter than a block keeps nothing, and says so
    fin = finished(run(engine, [turn("short", p, retain=[Retain(60, 3)])])["short"])
    assert fin.retained[0].retained_tokens == 0 and fin.retained[0].expires_at == 0.0
    engine.close()


def test_a_retention_on_disk_holds_after_a_restart(loaded, tmp_path: Path) -> None:
    clock = Clock()
    engine = engine_for(loaded, store_for(loaded, clock, disk_dir=tmp_path / "kv", disk_blocks=12))
    (p,) = prompts(loaded.config.vocab_size, [PREFIX + 3], seed=6)
    fin = finished(run(engine, [turn("r1", p, retain=[Retain(HOUR, PREFIX)])])["r1"])
    assert fin.retained[0].tiers == (Tier.DISK,)
    engine.close()

    clock.t = T0 + 60
    engine = engine_for(loaded, store_for(loaded, clock, disk_dir=tmp_path / "kv", disk_blocks=12))
    assert engine.store.retentions.owner_blocks("acme") == 6  # the book, from the journal
    pressure(engine, loaded)
    assert where(engine, p[:PREFIX])[Tier.DISK] == 6
    follow = p + [5, 6, 7]
    evs = run(engine, [turn("r2", follow)])["r2"]
    assert evs[0].cached_by_tier == {Tier.DISK: PREFIX}
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, follow, 4)
    engine.close()


def test_a_retention_in_redis_holds_after_a_restart(loaded, make_redis_server: Callable[..., Any]) -> None:
    """The retained keys have no TTL (the TTL command says -1) and are listed until their
    time; a restarted server with an empty host tier reads them back after Redis, under a
    volatile maxmemory-policy, evicted every other block to make room."""
    server = make_redis_server(maxmemory="4mb", maxmemory_policy="volatile-lru")
    clock = Clock()
    engine = engine_for(loaded, store_for(loaded, clock, host_blocks=8, redis_url=server.url))
    (p,) = prompts(loaded.config.vocab_size, [PREFIX + 3], seed=7)
    fin = finished(run(engine, [turn("r1", p, retain=[Retain(HOUR, PREFIX)])])["r1"])
    assert fin.retained[0].tiers == (Tier.HOST, Tier.REDIS)
    engine.close()

    engine = engine_for(loaded, store_for(loaded, clock, host_blocks=8, redis_url=server.url))
    tier = engine.store.tier(Tier.REDIS)
    ns, hashes = engine.keys.of(p[:PREFIX], CacheScope("acme"))
    keys = [tier.key(BlockRef(ns, h)) for h in hashes]
    c = redis.Redis.from_url(server.url)
    assert [c.ttl(k) for k in keys] == [-1] * 6
    assert [c.zscore("rt:retained", k) for k in keys] == [(T0 + HOUR) * 1000] * 6
    # other tenants' blocks, more than Redis holds beside them: it evicts what has a TTL
    spec = loaded.kv_spec(BS)
    other = engine.keys.namespace(CacheScope("other"))
    block = torch.zeros(spec.block_shape, dtype=spec.dtype)
    for start in range(0, 4000, 200):
        hs = block_hashes(other, list(range(start * BS, (start + 200) * BS)), BS)[:200]
        engine.store.put_many(other, hs, [block] * len(hs), [Tier.REDIS])
    assert c.info("stats")["evicted_keys"] > 0
    follow = p + [5, 6, 7]
    evs = run(engine, [turn("r2", follow)])["r2"]
    assert evs[0].cached_by_tier == {Tier.REDIS: PREFIX}
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, follow, 4)
    clock.t = T0 + HOUR
    engine.store.expire_retentions()
    assert all(590 < c.ttl(k) <= 600 for k in keys) and c.zcard("rt:retained") == 0
    c.close()
    engine.close()


class GatedHost(HostTier):
    """A real host tier whose pins wait for ``gate``: the store's answer comes when the
    test says."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.gate = threading.Event()

    def retain(self, refs, until, owner):  # type: ignore[no-untyped-def]
        assert self.gate.wait(30)
        return super().retain(refs, until, owner)


def test_the_pins_start_at_the_first_token_and_the_end_waits_for_them(loaded) -> None:
    """The retained prefix goes to the store as soon as the prompt is computed, while the
    turn decodes; a turn that ends before the store answered leaves only with the answer;
    one cancelled after its first token reports nothing, and what was pinned stays until
    its time."""
    clock = Clock()
    spec = loaded.kv_spec(BS)
    host = GatedHost(32 * spec.bytes_per_block, spec.block_shape, spec.dtype)
    engine = engine_for(loaded, TieredStore([host], max_retained_blocks_per_owner=64, wall_clock=clock))
    (p, q) = prompts(loaded.config.vocab_size, [PREFIX + 3, PREFIX + 3], seed=8)
    engine.add_request(turn("r1", p, n=3, retain=[Retain(HOUR, PREFIX)]))
    seen: list[Any] = []
    for _ in range(200):  # every token generated, the end held: the store has not answered
        seen += [ev for _, ev in engine.step()]
        if sum(len(getattr(ev, "token_ids", ())) for ev in seen) == 3 and not engine.has_work():
            break
    assert not any(isinstance(ev, Finished) for ev in seen)
    assert engine.store.retentions.stats().reserved_blocks == 6  # in flight
    host.gate.set()
    for _ in range(300):
        engine.wait_for_work(0.1)  # the store's answer wakes the engine
        seen += [ev for _, ev in engine.step()]
        if isinstance(seen[-1], Finished):
            break
    fin = seen[-1]
    assert isinstance(fin, Finished) and fin.retained[0].retained_tokens == PREFIX
    assert fin.retained[0].tiers == (Tier.HOST,)

    engine.add_request(turn("r2", q, n=30, retain=[Retain(HOUR, PREFIX)]))
    events: list[Any] = []
    while not any(getattr(ev, "token_ids", None) for ev in events):
        events += [ev for _, ev in engine.step()]
    engine.abort("r2")
    while not any(isinstance(ev, Finished) for ev in events):
        events += [ev for _, ev in engine.step()]
    assert events[-1].finish_reason.value == "cancelled" and events[-1].retained == ()
    assert engine.store.flush(30)
    _, hashes = engine.keys.of(q[:PREFIX], CacheScope("acme"))
    assert engine.store.retentions.retained(hashes, clock.t) == [True] * 6
    engine.close()
