"""Block bookkeeping: refcounts, the prefix-hash map, LRU eviction and demotion."""

import pytest

from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.service.kv.block_manager import NULL_BLOCK, BlockManager, NoFreeBlocks

NS = make_namespace("fp", "float32", 4, "")


def hashes(tokens):
    return block_hashes(NS, tokens, 4)


def test_null_block_is_never_allocated():
    bm = BlockManager(5)
    got = bm.allocate(4)
    assert NULL_BLOCK not in [b.block_id for b in got]
    assert bm.num_free == 0
    with pytest.raises(NoFreeBlocks):
        bm.allocate(1)


def test_allocate_is_all_or_nothing():
    bm = BlockManager(4)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(4)
    assert bm.num_free == 3


def test_free_returns_blocks_and_double_free_is_caught():
    bm = BlockManager(4)
    blocks = bm.allocate(3)
    bm.free(blocks)
    assert bm.num_free == 3
    with pytest.raises(AssertionError):
        bm.free(blocks[:1])


def test_registered_blocks_are_found_after_free_and_shared_by_refcount():
    bm = BlockManager(8)
    hs = hashes(list(range(12)))
    blocks = bm.allocate(3)
    for b, h in zip(blocks, hs):
        bm.register(b, h, NS)
    bm.free(blocks)
    assert bm.num_cached_idle == 3
    hit = bm.match_prefix(hs)
    assert [b.block_id for b in hit] == [b.block_id for b in blocks]
    bm.touch(hit[:2])
    bm.touch(hit[:2])  # a second sequence shares the same prefix
    assert hit[0].ref_count == 2
    assert bm.num_free == 8 - 1 - 2
    bm.free(hit[:2])
    assert hit[0].ref_count == 1


def test_match_prefix_stops_at_first_miss():
    bm = BlockManager(8)
    hs = hashes(list(range(12)))
    blocks = bm.allocate(3)
    bm.register(blocks[0], hs[0], NS)
    bm.register(blocks[2], hs[2], NS)
    assert len(bm.match_prefix(hs)) == 1


def test_eviction_prefers_unhashed_then_lru_and_calls_on_evict():
    evicted = []
    bm = BlockManager(5, on_evict=lambda b: evicted.append(b.block_hash))
    hs = hashes(list(range(8)))
    a = bm.allocate(2)
    for b, h in zip(a, hs):
        bm.register(b, h, NS)
    plain = bm.allocate(2)
    bm.free(a)
    bm.free(plain)
    got = bm.allocate(2)  # the unhashed blocks come first: nothing evicted
    assert {b.block_id for b in got} == {b.block_id for b in plain}
    assert evicted == []
    got2 = bm.allocate(1)  # now a cached block is evicted: the tail (hs[1]) first
    assert evicted == [hs[1]]
    assert got2[0].block_hash is None
    assert bm.lookup(hs[1]) is None and bm.lookup(hs[0]) is not None


def test_duplicate_registration_keeps_the_first_block():
    bm = BlockManager(4)
    h = hashes([1, 2, 3, 4])[0]
    a, b = bm.allocate(2)
    assert bm.register(a, h, NS) is a
    assert bm.register(b, h, NS) is a
    assert b.block_hash is None
