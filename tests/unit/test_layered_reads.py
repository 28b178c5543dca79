"""Layer-by-layer reads (``BlockTier.layered_read``, ``TieredStore.fetch_layered``: the
overlapped restore's loads): the same blocks as whole reads, and the same guarantees:
every corrupted, truncated, swapped or foreign value of the disk tier's corruption table
(and Redis' values, mutated alike) ends the read at that block, is counted and removed,
and the blocks before it are exact; a host slot evicted or reused between two layer
groups ends the read there. Real tiers: files in a temporary directory, a real
redis-server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.cachestore.base import NOT_FOUND
from kvserve.cachestore.disk import DiskTier
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.redis import RedisTier
from kvserve.cachestore.tiered import TieredStore
from tests.unit.test_disk_tier import CORRUPTIONS, NS, REFS, SHAPE, value

STAGES = [(0, 1), (1, 2)]  # SHAPE has 2 layers: one per group


def layered(tier, refs, outs, stages=STAGES) -> tuple[list[int], int]:
    """(what each read said, what finish said)."""
    r = tier.layered_read(refs, outs)
    assert r is not None
    said = [r.read(a, b) for a, b in stages]
    return said, r.finish()


def make(kind: str, tmp_path: Path, redis_url: str):
    if kind == "host":
        return HostTier(64 * 1024, SHAPE, torch.float32)
    if kind == "disk":
        return DiskTier(tmp_path / "disk", 1 << 20, SHAPE, torch.float32)
    return RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32, key_prefix=f"layered-{tmp_path.name}:")


@pytest.mark.parametrize("kind", ["host", "disk", "redis"])
def test_layered_read_loads_what_a_whole_read_does(kind, tmp_path, redis_url):
    tier = make(kind, tmp_path, redis_url)
    tier.put_many(REFS[:6], [value(i) for i in range(6)])
    outs = [torch.full(SHAPE, -1.0) for _ in range(7)]
    said, n = layered(tier, REFS[:7], outs)  # the 7th is not there
    assert n == 6 and said[-1] == 6
    assert all(torch.equal(outs[i], value(i)) for i in range(6))
    s = tier.stats()
    assert s.hits == 6 and s.misses == 1 and s.failures == {NOT_FOUND: 1}
    tier.close()


def _mutate(kind: str, tier, how: str, redis_server: Any) -> None:
    mutate, _ = CORRUPTIONS[how]
    if kind == "disk":
        path = tier.path(REFS[2])
        path.write_bytes(mutate(bytearray(path.read_bytes())))
    else:
        with redis_server.client() as c:
            key = tier.key(REFS[2])
            c.set(key, mutate(bytearray(c.get(key))))


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_a_bad_value_ends_the_layered_read_and_is_removed(kind, how, tmp_path, redis_url, redis_server):
    tier = make(kind, tmp_path, redis_url)
    tier.put_many(REFS[:6], [value(i) for i in range(6)])
    _mutate(kind, tier, how, redis_server)
    outs = [torch.empty(SHAPE) for _ in range(6)]
    said, good = layered(tier, REFS[:6], outs)
    assert all(torch.equal(outs[i], value(i)) for i in range(good))  # never wrong KV
    if CORRUPTIONS[how][1] is None:  # a valid value in another layout: loaded whole
        assert good == 6
        return
    assert good == 2 and said[-1] >= good
    assert not tier.contains(REFS[2])  # removed: the next write replaces it
    s = tier.stats()
    assert s.failures and set(s.failures) != {NOT_FOUND} and s.errors == 0
    assert tier.get_many_into(REFS[3:6], outs[:3]) == 3  # the others are fine (Redis: the connection in step)
    assert tier.put(REFS[2], value(2))
    said, good = layered(tier, REFS[:6], outs)
    assert good == 6 and torch.equal(outs[2], value(2))
    tier.close()


def test_redis_value_rewritten_between_layer_groups_fails_the_checksum(tmp_path, redis_url, redis_server):
    """A key rewritten with other bytes between two groups: the checksum over the mixed
    bytes fails, the block is a miss (whichever version is right)."""
    tier = make("redis", tmp_path, redis_url)
    tier.put_many(REFS[:4], [value(i) for i in range(4)])
    outs = [torch.empty(SHAPE) for _ in range(4)]
    r = tier.layered_read(REFS[:4], outs)
    assert r.read(0, 1) == 4
    with redis_server.client() as c:
        from kvserve.cachestore import codec

        c.set(tier.key(REFS[1]), codec.encode(NS, REFS[1].block_hash, value(1) + 1))  # same block, other bits
    r.read(1, 2)
    assert r.finish() == 1
    assert torch.equal(outs[0], value(0))
    tier.close()


@pytest.mark.parametrize("change", ["evicted", "deleted", "deleted_and_put_again"])
def test_host_slot_reused_between_layer_groups_ends_the_read(change):
    tier = HostTier(6 * 4 * 2 * 4 * 2 * 2 * 8, SHAPE, torch.float32)  # 6 blocks
    assert tier.capacity_blocks == 6
    tier.put_many(REFS[:6], [value(i) for i in range(6)])
    outs = [torch.empty(SHAPE) for _ in range(6)]
    r = tier.layered_read(REFS[:6], outs)
    assert r.read(0, 1) == 6
    if change == "evicted":  # the least recently used block is not read: the oldest after the read is REFS[0]
        tier.put(REFS[10], value(10))  # evicts REFS[0]
    else:
        tier.delete(REFS[3])
        if change == "deleted_and_put_again":
            tier.put(REFS[3], value(3) + 1)  # into the freed slot: same ref, another generation
    n = r.read(1, 2)
    assert r.finish() == n == (0 if change == "evicted" else 3)
    assert all(torch.equal(outs[i], value(i)) for i in range(n))


def test_store_fetch_layered_across_tiers_and_without_layered_reads(tmp_path, redis_url):
    """Host blocks then Redis blocks, layer group by layer group; a Redis tier that reads
    whole blocks only (compressed values) loads them whole in the first group."""
    host = HostTier(1 << 20, SHAPE, torch.float32)
    for compression, layered_redis in ((None, True), ("lz4", False)):
        redis_tier = RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32, compression=compression,
                               key_prefix=f"layered-store-{compression}:")
        assert (redis_tier.layered_read(REFS[:1], [torch.empty(SHAPE)]) is not None) == layered_redis
        store = TieredStore([host, redis_tier])
        host.put_many(REFS[:3], [value(i) for i in range(3)])
        redis_tier.put_many(REFS[3:8], [value(i) for i in range(3, 8)])
        outs = [torch.empty(SHAPE) for _ in range(8)]
        where = store.match_prefix(NS, [r.block_hash for r in REFS[:8]])
        assert where == ["host"] * 3 + ["redis"] * 5
        stages: list[tuple[int, int]] = []
        n = store.fetch_layered(NS, [r.block_hash for r in REFS[:8]], where, outs, STAGES,
                                lambda l1, k: stages.append((l1, k)))
        assert n == 8 and stages == [(1, 8), (2, 8)]
        assert all(torch.equal(outs[i], value(i)) for i in range(8))
        redis_tier.delete_many(REFS[3:8])
        host.clear()
        store.close()


@pytest.mark.parametrize("change", ["rewritten", "removed"])
def test_disk_file_replaced_between_layer_groups_ends_the_read(tmp_path, change):
    """No descriptor is held across groups: a file renamed over (the same block written
    again) or removed between two groups ends the read at it, never a mix of two files."""
    tier = DiskTier(tmp_path / "disk", 1 << 20, SHAPE, torch.float32)
    tier.put_many(REFS[:4], [value(i) for i in range(4)])
    outs = [torch.empty(SHAPE) for _ in range(4)]
    r = tier.layered_read(REFS[:4], outs)
    assert r.read(0, 1) == 4
    path = tier.path(REFS[1])
    if change == "rewritten":
        from kvserve.cachestore import codec

        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(codec.encode(NS, REFS[1].block_hash, value(1) + 1))
        tmp.rename(path)  # as a write does: a new inode under the name
    else:
        path.unlink()
    assert r.read(1, 2) == 1
    assert r.finish() == 1 and torch.equal(outs[0], value(0))
    tier.close()
