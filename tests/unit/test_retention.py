"""Retention in the cache store: the book's per-owner bound, pins that every tier's own
eviction skips (host and disk LRU, Redis' maxmemory under a volatile policy on a real
redis-server), pins that outlive a restart where the tier does (the disk journal, Redis'
retained set), and expiry at a time the store's clock says (a fake clock: no sleeps)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest
import redis
import torch

from kvserve.cachestore import codec
from kvserve.cachestore.base import BlockRef
from kvserve.cachestore.disk import JOURNAL, DiskTier
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.cachestore.redis import RedisTier
from kvserve.cachestore.retention import RetentionBook, RetentionBudget
from kvserve.cachestore.tiered import RetainResult, TieredStore
from kvserve.common.tiers import Tier

SHAPE = (2, 2, 4, 2, 8)  # (L, 2, B, n_kv, hd)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
FILE = codec.encoded_size(SHAPE, torch.float32)
NS = make_namespace("weights-a", "float32", 4)
HASHES = block_hashes(NS, list(range(4 * 64)), 4)
REFS = [BlockRef(NS, h) for h in HASHES]
T0 = 1_700_000_000.0  # the fake clock's start (unix seconds)
HOUR = 3600.0


def value(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i))


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# ---- the book ------------------------------------------------------------------------


def test_book_bounds_each_owner_counting_each_block_once() -> None:
    book = RetentionBook(max_blocks_per_owner=4)
    a = book.reserve("alice", HASHES[:3])
    book.commit(a, {h: T0 + HOUR for h in HASHES[:3]})
    assert book.owner_blocks("alice") == 3
    # a refresh of what alice retains, and one more block: within the bound
    b = book.reserve("alice", HASHES[:4])
    # a reservation in flight counts: one more new block is past the bound
    with pytest.raises(RetentionBudget) as e:
        book.reserve("alice", HASHES[4:5])
    assert (e.value.retained, e.value.wanted, e.value.limit) == (4, 5, 4)
    book.cancel(b)
    book.reserve("alice", HASHES[4:5])  # room again
    book.reserve("bob", HASHES[:4])  # every owner has its own bound
    assert book.stats().refusals == {"tenant_bound": 1}


def test_book_keeps_the_latest_time_and_expires_entries() -> None:
    book = RetentionBook(max_blocks_per_owner=10)
    book.commit(book.reserve("a", HASHES[:2]), {HASHES[0]: T0 + 60, HASHES[1]: T0 + HOUR})
    book.commit(book.reserve("a", HASHES[:1]), {HASHES[0]: T0 + 30})  # never moves earlier
    book.commit(book.reserve("b", HASHES[:1]), {HASHES[0]: T0 + 120})
    assert book.until(HASHES[0]) == T0 + 120
    assert book.retained(HASHES[:3], T0 + 100) == [True, True, False]
    assert book.expire(T0 + 60) == 1  # a's entry for block 0
    assert book.owner_blocks("a") == 1 and book.until(HASHES[0]) == T0 + 120
    assert book.expire(T0 + HOUR) == 2
    assert book.stats().blocks == 0 and book.stats().expired_entries == 3


# ---- the host tier -------------------------------------------------------------------


def test_host_lru_skips_pinned_blocks_and_a_full_slab_of_pins_refuses() -> None:
    evicted: list[BlockRef] = []
    tier = HostTier(4 * BLOCK_BYTES, SHAPE, torch.float32, on_evict=lambda ref, _b: evicted.append(ref))
    for i in range(4):
        assert tier.put(REFS[i], value(i))
    assert tier.retain(REFS[:2] + [REFS[9]], T0 + HOUR, "a") == [True, True, False]
    for i in range(4, 20):  # pressure: every unpinned block goes, the pinned two stay
        assert tier.put(REFS[i], value(i))
    assert REFS[0] not in evicted and REFS[1] not in evicted
    out = torch.empty(SHAPE)
    assert tier.get_into(REFS[0], out) and torch.equal(out, value(0))
    assert tier.stats().blocks_retained == 2
    assert tier.retain(REFS[18:20], T0 + HOUR, "a") == [True, True]
    assert not tier.put(REFS[30], value(30))  # every slot pinned: refused, nothing evicted
    assert tier.contains_many(REFS[:2] + REFS[18:20]) == [True] * 4
    assert tier.expire_retained(T0 + HOUR - 1) == 0
    assert tier.expire_retained(T0 + HOUR) == 4  # released: ordinary cached blocks again
    assert tier.put(REFS[30], value(30)) and tier.stats().retention_expired == 4


# ---- the disk tier -------------------------------------------------------------------


def test_disk_pins_survive_pressure_and_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    tier = DiskTier(root, 6 * FILE, SHAPE, torch.float32)
    for i in range(3):
        tier.put(REFS[i], value(i))
    assert tier.retain(REFS[:2], T0 + HOUR, "alice") == [True, True]
    assert tier.retain(REFS[1:3], T0 + 2 * HOUR, "bob") == [True, True]
    for i in range(3, 30):
        assert tier.put(REFS[i], value(i))
    assert tier.contains_many(REFS[:3]) == [True] * 3  # pinned: never the LRU's victims
    tier.close()

    again = DiskTier(root, 4 * FILE, SHAPE, torch.float32)  # restarted, with a smaller size
    assert again.contains_many(REFS[:3]) == [True] * 3  # honoured before the index was trimmed
    assert len(again) == 4
    assert sorted(again.retained_entries()) == sorted([
        (REFS[0].block_hash, T0 + HOUR, "alice"), (REFS[1].block_hash, T0 + HOUR, "alice"),
        (REFS[1].block_hash, T0 + 2 * HOUR, "bob"), (REFS[2].block_hash, T0 + 2 * HOUR, "bob"),
    ])  # fmt: skip
    out = torch.empty(SHAPE)
    assert again.get_into(REFS[2], out) and torch.equal(out, value(2))
    assert again.expire_retained(T0 + HOUR) == 1  # block 0 (block 1: bob's still)
    for i in range(40, 50):
        again.put(REFS[i], value(i))
    assert again.contains_many(REFS[:3]) == [False, True, True]
    again.close()


def test_disk_journal_torn_tail_and_gone_files(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    tier = DiskTier(root, 10 * FILE, SHAPE, torch.float32)
    for i in range(3):
        tier.put(REFS[i], value(i))
    tier.retain(REFS[:3], T0 + HOUR, "a")
    tier.close()
    with open(root / JOURNAL, "ab") as f:
        f.write(b"\x01\x02\x03")  # a record torn by a crash
    tier.path(REFS[2]).unlink()  # a file removed by hand
    again = DiskTier(root, 10 * FILE, SHAPE, torch.float32)
    assert sorted(h for h, _, _ in again.retained_entries()) == sorted([REFS[0].block_hash, REFS[1].block_hash])
    assert again.stats().blocks_retained == 2
    again.close()
    assert len(DiskTier(root, 10 * FILE, SHAPE, torch.float32).retained_entries()) == 2  # compacted, still whole


# ---- the Redis tier ------------------------------------------------------------------


def make_redis(url: str, **kw: Any) -> RedisTier:
    kw.setdefault("key_prefix", "ret:")
    return RedisTier(url, block_shape=SHAPE, dtype=torch.float32, **kw)


def test_redis_retained_keys_have_no_ttl_until_released(redis_url: str) -> None:
    tier = make_redis(redis_url, ttl_s=600)
    tier.put_many(REFS[:3], [value(i) for i in range(3)])
    c = redis.Redis.from_url(redis_url)
    assert tier.retain(REFS[:2] + [REFS[7]], T0 + HOUR, "a") == [True, True, False]
    assert c.ttl(tier.key(REFS[0])) == -1 and c.ttl(tier.key(REFS[2])) > 590  # pinned / ordinary
    assert tier.retained_until(REFS[0]) == T0 + HOUR and tier.retained_until(REFS[2]) is None
    tier.retain(REFS[:1], T0 + 60, "b")  # an earlier time never shortens a retention
    assert tier.retained_until(REFS[0]) == T0 + HOUR
    tier.put_many(REFS[:3], [value(i) for i in range(3)])  # written again: its TTL refresh leaves the pin
    assert c.ttl(tier.key(REFS[0])) == -1
    # a session's blocks deleted: those retained past now stay
    deleting = make_redis(redis_url, ttl_s=600, wall_clock=lambda: T0)
    assert deleting.delete_many(REFS[:3]) == [False, False, True]
    assert tier.expire_retained(T0 + HOUR) == 2  # any replica releases: the set is shared
    assert c.ttl(tier.key(REFS[0])) > 590 and tier.retained_until(REFS[0]) is None
    assert tier.stats().blocks_retained == 0 and tier.stats().retention_expired == 2
    assert deleting.delete_many(REFS[:2]) == [True, True]


@pytest.mark.parametrize("policy, keeps", [("volatile-lru", True), ("noeviction", True), ("allkeys-lru", False)])
def test_redis_says_whether_its_eviction_keeps_retentions(
    make_redis_server: Callable[..., Any], policy: str, keeps: bool
) -> None:
    server = make_redis_server(maxmemory="64mb", maxmemory_policy=policy)
    assert make_redis(server.url).keeps_retentions()[0] is keeps
    assert make_redis(server.url).eviction_policy() == (policy, 64 << 20)


@pytest.mark.parametrize("policy, ttl_s, safe, says", [
    ("allkeys-lru", 600, False, "may evict retained blocks under memory pressure (maxmemory-policy allkeys-lru"),
    ("volatile-lru", None, True, "--redis-ttl is 0, so no block has one"),
    ("volatile-lru", 600, True, None),
])  # fmt: skip
def test_the_store_says_where_redis_may_drop_retentions(
    make_redis_server: Callable[..., Any], caplog: pytest.LogCaptureFixture, policy: str, ttl_s: Any, safe: bool,
    says: str | None,
) -> None:
    server = make_redis_server(maxmemory="64mb", maxmemory_policy=policy)
    store = TieredStore([make_redis(server.url, ttl_s=ttl_s)], max_retained_blocks_per_owner=8)
    try:
        with caplog.at_level("WARNING", logger="kvserve.cachestore.tiered"):
            assert store.check_retention_safety() == {Tier.REDIS: safe}
        lines = [r.getMessage() for r in caplog.records if r.name == "kvserve.cachestore.tiered"]
        assert (says in lines[0]) if says else not lines
        assert store.stats().retention_safe == {Tier.REDIS: safe}
    finally:
        store.close()


def test_redis_volatile_eviction_leaves_retained_blocks(make_redis_server: Callable[..., Any]) -> None:
    """Under maxmemory with volatile-lru, filling Redis evicts ordinary blocks (they have a
    TTL) and never a retained one (kept without)."""
    server = make_redis_server(maxmemory="3mb", maxmemory_policy="volatile-lru")
    tier = make_redis(server.url, ttl_s=3600)
    tier.put_many(REFS[:4], [value(i) for i in range(4)])
    assert tier.retain(REFS[:4], T0 + HOUR, "a") == [True] * 4
    other = make_namespace("weights-a", "float32", 4, "another tenant")
    big = [BlockRef(other, h) for h in block_hashes(other, list(range(4 * 4000)), 4)]
    one = value(99)
    for start in range(0, len(big), 256):  # ~5 MB of other blocks: more than fit beside them
        tier.put_many(big[start : start + 256], [one] * len(big[start : start + 256]))
    with server.client() as c:
        assert c.info("stats")["evicted_keys"] > 0
    assert tier.contains_many(REFS[:4]) == [True] * 4
    outs = [torch.empty(SHAPE) for _ in range(4)]
    assert tier.get_many_into(REFS[:4], outs) == 4 and all(torch.equal(outs[i], value(i)) for i in range(4))


def test_redis_cluster_retention_extends_the_ttl(make_redis_cluster: Callable[..., Any]) -> None:
    cluster = make_redis_cluster(masters=3)
    tier = make_redis(cluster.url, cluster=True, ttl_s=600)
    tier.put_many(REFS[:6], [value(i) for i in range(6)])
    import time

    until = time.time() + 2 * HOUR
    assert tier.retain(REFS[:6] + [REFS[9]], until, "a") == [True] * 6 + [False]
    c = redis.cluster.RedisCluster.from_url(cluster.url)
    assert all(2 * HOUR - 60 < c.ttl(tier.key(r)) <= 2 * HOUR for r in REFS[:6])
    tier.put_many(REFS[:6], [value(i) for i in range(6)])  # a write never shortens it
    assert all(c.ttl(tier.key(r)) > HOUR for r in REFS[:6])
    assert tier.stats().blocks_retained is None  # a cluster does not count them
    c.close()


# ---- the tiered store ----------------------------------------------------------------


@pytest.fixture
def make_store(tmp_path: Path, redis_url: str) -> Any:
    stores: list[TieredStore] = []

    def make(host_blocks: int = 8, disk_blocks: int | None = None, with_redis: bool = False, **kw: Any) -> TieredStore:
        tiers: list[Any] = [HostTier(host_blocks * BLOCK_BYTES, SHAPE, torch.float32)]
        if disk_blocks is not None:
            tiers.append(DiskTier(tmp_path / f"kv{len(stores)}", disk_blocks * FILE, SHAPE, torch.float32))
        if with_redis:
            tiers.append(make_redis(redis_url))
        kw.setdefault("max_retained_blocks_per_owner", 16)
        store = TieredStore(tiers, **kw)
        stores.append(store)
        return store

    yield make
    for s in stores:
        s.close(timeout=5)


def retain_now(store: TieredStore, owner: str, items: list, untils: list[float]) -> RetainResult:
    got: list[RetainResult] = []
    done = threading.Event()
    res = store.reserve_retention(owner, [h for _, h, _ in items])
    store.submit_retain(items, untils, res, lambda r: (got.append(r), done.set()))
    assert done.wait(30)
    return got[0]


def test_store_writes_device_only_blocks_and_pins_them_everywhere(make_store: Any) -> None:
    clock = Clock()
    store = make_store(host_blocks=4, disk_blocks=6, with_redis=True, wall_clock=clock)
    assert store.retain_to == (Tier.HOST, Tier.DISK, Tier.REDIS)
    result = retain_now(store, "a", [(NS, HASHES[i], value(i)) for i in range(3)], [T0 + HOUR] * 3)
    assert result.tiers == [(Tier.HOST, Tier.DISK, Tier.REDIS)] * 3 and result.leading == 3
    assert store.retentions.owner_blocks("a") == 3
    for i in range(3, 40):  # other sessions' blocks: every unretained one leaves host and disk
        store.demote(NS, HASHES[i], value(i))
    assert store.flush(30)
    assert store.match_prefix(NS, HASHES[:3]) == [Tier.HOST] * 3
    outs = [torch.empty(SHAPE) for _ in range(3)]
    assert store.fetch_into(NS, HASHES[:3], [Tier.HOST] * 3, outs) == 3
    assert all(torch.equal(outs[i], value(i)) for i in range(3))
    # host full of pinned blocks: a demotion goes past it to disk
    retain_now(store, "a", [(NS, HASHES[i], value(i)) for i in range(50, 51)], [T0 + HOUR])
    store.demote(NS, HASHES[60], value(60))
    assert store.flush(30) and store.location(NS, [HASHES[60]])[Tier.DISK] == 1
    # a session's blocks deleted: the retained ones stay
    assert store.delete_many(NS, HASHES[:3] + [HASHES[60]])[Tier.DISK] == 1
    assert store.match_prefix(NS, HASHES[:3]) == [Tier.HOST] * 3
    clock.t = T0 + HOUR
    assert store.expire_retentions() == 3 * 4  # 4 blocks, each pinned in three tiers
    assert store.retentions.owner_blocks("a") == 0
    assert store.stats().tiers[Tier.HOST].blocks_retained == 0


def test_store_refuses_past_the_owners_bound_and_answers_when_closed(make_store: Any) -> None:
    store = make_store(host_blocks=8, max_retained_blocks_per_owner=2)
    with pytest.raises(RetentionBudget):
        store.reserve_retention("a", HASHES[:3])
    res = store.reserve_retention("a", HASHES[:2])
    store.close()
    got: list[RetainResult] = []
    store.submit_retain([(NS, HASHES[0], value(0)), (NS, HASHES[1], value(1))], [T0 + HOUR] * 2, res, got.append)
    assert got and got[0].leading == 0  # answered at once: nothing pinned, nothing counted
    assert store.retentions.stats().reserved_blocks == 0 and store.retentions.owner_blocks("a") == 0


def test_store_rebuilds_the_book_from_the_disk_journal(tmp_path: Path) -> None:
    clock = Clock()
    disk = DiskTier(tmp_path / "kv", 10 * FILE, SHAPE, torch.float32)
    store = TieredStore([disk], max_retained_blocks_per_owner=3, wall_clock=clock)
    retain_now(store, "a", [(NS, HASHES[i], value(i)) for i in range(3)], [T0 + HOUR] * 3)
    store.close()
    again = TieredStore([DiskTier(tmp_path / "kv", 10 * FILE, SHAPE, torch.float32)],
                        max_retained_blocks_per_owner=3, wall_clock=clock)  # fmt: skip
    assert again.retentions.owner_blocks("a") == 3  # the bound still counts them
    with pytest.raises(RetentionBudget):
        again.reserve_retention("a", HASHES[3:4])
    assert again.delete_many(NS, HASHES[:3])[Tier.DISK] == 0
    clock.t = T0 + HOUR
    again.expire_retentions()
    again.reserve_retention("a", HASHES[3:6])
    again.close()
