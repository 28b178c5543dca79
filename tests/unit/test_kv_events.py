"""The KV events publisher (service/kv_events.py) against a subscriber written from vLLM's
schema (tests/fixtures/kv_events.py), over real ZMQ sockets on loopback: the device pool's
BlockManager and real host, disk and Redis tiers behind a TieredStore call its hooks, and
what the subscriber holds per medium must be exactly what each of them holds."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kvserve.cachestore import codec
from kvserve.cachestore.disk import DiskTier
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.tiered import TieredStore
from kvserve.common.tiers import Tier
from kvserve.service.kv.block_manager import BlockManager
from kvserve.service.kv_events import KVEvents, hash64
from tests.fixtures.kv_events import Subscriber

B = 4  # tokens per block
SHAPE = (2, 2, B, 1, 4)  # (layers, K|V, block_size, kv heads, head dim): 256 bytes a block
NS = bytes(32)


def chain(tokens: list[int]) -> list[bytes]:
    """kvserve's chain (cachestore/keys.py's shape: sha256(parent || uint32 tokens))."""
    out, parent = [], NS
    for i in range(0, len(tokens) - len(tokens) % B, B):
        parent = hashlib.sha256(parent + torch.tensor(tokens[i : i + B], dtype=torch.int32).numpy().tobytes()).digest()
        out.append(parent)
    return out


def publisher(tmp_path=None, **kw) -> KVEvents:
    kw.setdefault("replay_endpoint", "tcp://127.0.0.1:*")
    return KVEvents("tcp://127.0.0.1:*", block_size=B, topic="kv@pod-0@tiny", journal_dir=tmp_path, **kw)


def subscriber(ev: KVEvents, **kw) -> Subscriber:
    sub = Subscriber(ev.endpoint, ev.replay_endpoint, topic=b"kv@", **kw)
    sub.replay_from(0)  # a late joiner: what was published before the SUB connected
    assert sub.wait_for(lambda: sub.cleared >= 1)  # the start's resync came
    return sub


def block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


def h64s(hashes) -> set[int]:
    return {hash64(bytes(h)) for h in hashes}


def test_the_event_hash_is_the_low_64_bits_of_the_key_big_endian():
    key = bytes(range(32))
    assert hash64(key) == int.from_bytes(key[24:], "big") == 0x18191A1B1C1D1E1F


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_device_blocks_on_the_wire_decode_with_vllms_schema(encoding):
    ev = publisher(encoding=encoding)
    ev.attach(device="cpu", store=None)
    tokens = list(range(100, 100 + 3 * B + 2))
    hs = chain(tokens)
    try:
        with subscriber(ev, encoding=encoding) as sub:
            for i, h in enumerate(hs):
                ev.block_stored(h, hs[i - 1] if i else None, tokens[i * B : (i + 1) * B])
            assert sub.wait_for(lambda: sub.view() == {"DEVICE": h64s(hs)})
            assert sub.topics == {b"kv@pod-0@tiny"} and sub.block_sizes == {B}
            assert sub.parents == {hash64(hs[0]): None, hash64(hs[1]): hash64(hs[0]), hash64(hs[2]): hash64(hs[1])}
            assert [sub.tokens[hash64(h)] for h in hs] == [tokens[i * B : (i + 1) * B] for i in range(3)]
            assert sub.cleared == 1  # the start: AllBlocksCleared (nothing durable to announce)
            ev.block_removed(hs[2])
            assert sub.wait_for(lambda: sub.view() == {"DEVICE": h64s(hs[:2])})
        stats = ev.stats()
        assert stats.resyncs["start"] == 1 and stats.events["BlockStored"] >= 1 and stats.events["BlockRemoved"] == 1
        assert stats.blocks == {"DEVICE": 2, "CPU": 0, "DISK": 0, "SHARED": 0}
    finally:
        ev.close()


def test_a_chain_stored_at_once_is_one_event_and_the_gpu_medium_on_cuda():
    ev = publisher()
    ev.attach(device="cuda", store=None)
    tokens = list(range(8 * B))
    hs = chain(tokens)
    try:
        with subscriber(ev) as sub:
            with ev._lock:  # one flush: the eight stores are merged into one BlockStored
                for i, h in enumerate(hs):
                    ev._store(Tier.DEVICE, h, hash64(hs[i - 1]) if i else None, bytes(4 * B))
            assert sub.wait_for(lambda: sub.view() == {"GPU": h64s(hs)})
            assert ev.stats().events["BlockStored"] == 1
    finally:
        ev.close()


def make_store(root, host_blocks=2, disk_blocks=3) -> tuple[TieredStore, HostTier, DiskTier]:
    host = HostTier(host_blocks * block(0).numel() * 4, SHAPE, torch.float32)
    disk = DiskTier(root, disk_blocks * codec.encoded_size(SHAPE, torch.float32), SHAPE, torch.float32)
    return TieredStore([host, disk], demotion_buffers=64), host, disk


def listing(bm: BlockManager, host: HostTier, disk: DiskTier) -> dict[str, set[int]]:
    """What each tier holds, from the tiers themselves."""
    out = {"DEVICE": h64s(bm._cached), "CPU": h64s(r.block_hash for r in host._lru), "DISK": h64s(disk._lru)}
    return {m: hs for m, hs in out.items() if hs}


def test_evictions_demotions_and_deletes_down_the_tiers_are_what_each_tier_holds(tmp_path):
    """A 3-block device pool evicting into a 2-block host tier evicting into a 3-block
    disk tier (which drops its oldest): after every step the subscriber holds per medium
    exactly what each tier's own index holds, and the tokens it was told are each block's."""
    store, host, disk = make_store(tmp_path / "disk")
    ev = publisher(tmp_path)
    ev.attach(device="cpu", store=store)
    bm = BlockManager(4, on_evict=lambda b: store.demote(NS, b.block_hash, block(b.block_id)), events=ev)
    tokens = list(range(500, 500 + 10 * B))
    hs = chain(tokens)
    try:
        with subscriber(ev) as sub:
            for i, h in enumerate(hs):  # each block registered, then freed: the pool evicts the oldest
                [b] = bm.allocate(1)
                bm.register(b, h, NS, parent=hs[i - 1] if i else None, tokens=tokens[i * B : (i + 1) * B])
                bm.free([b])
                store.flush(10)
                want = listing(bm, host, disk)
                assert sub.wait_for(lambda: sub.view() == want), (i, sub.view(), want)
            assert len(want["DEVICE"]) == 3 and len(want["CPU"]) == 2 and len(want["DISK"]) == 3
            for h in hs:  # every block the subscriber was told of came with its own tokens
                i = hs.index(h)
                assert sub.tokens[hash64(h)] == tokens[i * B : (i + 1) * B]
            store.delete_many(NS, hs[5:8])  # a forgotten session: from every tier
            bm.drop_hash(bm.lookup(hs[9]))
            want = listing(bm, host, disk)
            assert sub.wait_for(lambda: sub.view() == want), (sub.view(), want)
            assert ev.view() == {**{"DEVICE": set(), "CPU": set(), "DISK": set(), "SHARED": set()}, **want}
    finally:
        ev.close()
        store.close()


def test_a_restart_announces_what_the_disk_still_holds_with_tokens_and_parents(tmp_path):
    store, host, disk = make_store(tmp_path / "disk", host_blocks=1, disk_blocks=8)
    ev = publisher(tmp_path / "disk")
    ev.attach(device="cpu", store=store)
    bm = BlockManager(3, on_evict=lambda b: store.demote(NS, b.block_hash, block(b.block_id)), events=ev)
    tokens = list(range(7 * B))
    hs = chain(tokens)
    for i, h in enumerate(hs):
        [b] = bm.allocate(1)
        bm.register(b, h, NS, parent=hs[i - 1] if i else None, tokens=tokens[i * B : (i + 1) * B])
        bm.free([b])
    store.flush(10)
    on_disk = h64s(disk._lru)
    assert len(on_disk) == 4  # 7 blocks: 2 on the device, 1 in host memory, 4 on disk
    with subscriber(ev) as sub:
        ev.close()  # the device and the host tier end with the process: removed
        assert sub.wait_for(lambda: sub.view() == {"DISK": on_disk})
    store.close()

    store2, _, disk2 = make_store(tmp_path / "disk", host_blocks=1, disk_blocks=8)
    ev2 = publisher(tmp_path / "disk")
    ev2.attach(device="cpu", store=store2)
    try:
        with subscriber(ev2) as sub:
            assert sub.wait_for(lambda: sub.view() == {"DISK": on_disk})
            assert sub.cleared == 1  # first the clear: whatever a router remembers of the last life
            for i, h in enumerate(hs):
                if hash64(h) in on_disk:  # the journal gave each its tokens and its parent back
                    assert sub.tokens[hash64(h)] == tokens[i * B : (i + 1) * B]
                    assert sub.parents[hash64(h)] == (hash64(hs[i - 1]) if i else None)
    finally:
        ev2.close()
        store2.close()


def test_a_full_queue_is_dropped_for_a_resync_of_the_whole_state():
    ev = publisher(max_pending=10)
    ev.attach(device="cpu", store=None)
    hs = chain(list(range(40 * B)))
    try:
        with subscriber(ev) as sub:
            with ev._lock:  # 40 changes before the publisher's next flush: past the queue
                for h in hs:
                    ev._store(Tier.DEVICE, h, None, b"")
            assert sub.wait_for(lambda: sub.view() == {"DEVICE": h64s(hs)})
            assert ev.stats().resyncs == {"start": 1, "overflow": 1} and sub.cleared == 2
    finally:
        ev.close()


def test_a_late_subscriber_past_the_replay_buffer_gets_the_whole_state_in_one_batch():
    ev = publisher(replay_buffer_bytes=1)  # keeps only the last batch
    ev.attach(device="cpu", store=None)
    hs = chain(list(range(30 * B)))
    try:
        with subscriber(ev) as first:
            for h in hs:
                ev.block_stored(h, None, [1] * B)
                first.pump(0.03)  # one flush each: many batches
            for h in hs[:10]:
                ev.block_removed(h)
            assert first.wait_for(lambda: first.view() == {"DEVICE": h64s(hs[10:])})
        assert ev.stats().batches > 3
        with Subscriber(ev.endpoint, ev.replay_endpoint) as late:
            assert late.replay_from(0) == 1  # one batch: AllBlocksCleared and every block held
            assert late.view() == {"DEVICE": h64s(hs[10:])} and late.cleared == 1
            assert late.last_seq == ev.stats().batches - 1
        assert ev.stats().replays["snapshot"] == 1
    finally:
        ev.close()


def test_without_token_ids_and_with_only_some_tiers(tmp_path):
    store, host, disk = make_store(tmp_path / "disk", host_blocks=1)
    ev = publisher(token_ids=False, tiers=(Tier.DEVICE, Tier.DISK))
    ev.attach(device="cpu", store=store)
    bm = BlockManager(2, on_evict=lambda b: store.demote(NS, b.block_hash, block(b.block_id)), events=ev)
    tokens = list(range(4 * B))
    hs = chain(tokens)
    try:
        with subscriber(ev) as sub:
            for i, h in enumerate(hs):
                [b] = bm.allocate(1)
                bm.register(b, h, NS, parent=hs[i - 1] if i else None, tokens=tokens[i * B : (i + 1) * B])
                bm.free([b])
            store.flush(10)
            want = listing(bm, host, disk)
            want.pop("CPU")
            assert sub.wait_for(lambda: sub.view() == want)
            assert sub.tokens == {}  # hashes, parents and media: no token ids
            assert sub.parents[hash64(hs[1])] == hash64(hs[0])
    finally:
        ev.close()
        store.close()


def test_redis_blocks_leave_after_the_ttl_and_past_the_cap(redis_url):
    from kvserve.cachestore.redis import RedisTier

    now = [0.0]
    redis_tier = RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32, key_prefix="kvev-test:")
    store = TieredStore([redis_tier])
    ev = publisher(redis_ttl_s=10.0, redis_max_blocks=3, clock=lambda: now[0])
    ev.attach(device="cpu", store=store)
    hs = chain(list(range(5 * B)))
    try:
        with subscriber(ev) as sub:
            store.put_many(NS, hs[:3], [block(i) for i in range(3)], [Tier.REDIS])
            assert sub.wait_for(lambda: sub.view() == {"SHARED": h64s(hs[:3])})
            now[0] = 6.0
            store.put_many(NS, hs[1:3], [block(i) for i in range(2)], [Tier.REDIS])  # written again: the TTL restarts
            now[0] = 11.0
            assert sub.wait_for(lambda: sub.view() == {"SHARED": h64s(hs[1:3])})  # the first expired
            store.put_many(NS, hs[3:5], [block(i) for i in range(2)], [Tier.REDIS])
            assert sub.wait_for(lambda: sub.view() == {"SHARED": h64s(hs[2:5])})  # 3 at most: the oldest left
            redis_tier._get_client().delete(redis_tier.key(redis_tier_ref(hs[4])))  # evicted by Redis itself
            assert store.match_prefix(NS, hs[2:5]) == ["redis", "redis"]  # a lookup finds it gone
            assert sub.wait_for(lambda: sub.view() == {"SHARED": h64s(hs[2:4])})
    finally:
        ev.close()
        client = redis_tier._get_client()
        for key in client.scan_iter("kvev-test:*"):
            client.delete(key)
        store.close()


def redis_tier_ref(h: bytes):
    from kvserve.cachestore.base import BlockRef

    return BlockRef(NS, h)


def test_a_restart_announces_what_redis_still_holds_of_the_journals_blocks(tmp_path, redis_url):
    """Blocks demoted device -> disk -> Redis: after a restart the journal names them, one
    pipelined EXISTS says which Redis still holds (one expired meanwhile), and those come
    back with their tokens and parents."""
    from kvserve.cachestore.redis import RedisTier

    def store_at(root):
        disk = DiskTier(root, 2 * codec.encoded_size(SHAPE, torch.float32), SHAPE, torch.float32)
        rt = RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32, key_prefix="kvev-journal:")
        return TieredStore([disk, rt], demotion_buffers=64), disk, rt

    store, disk, rt = store_at(tmp_path / "disk")
    ev = publisher(tmp_path / "disk")
    ev.attach(device="cpu", store=store)
    bm = BlockManager(2, on_evict=lambda b: store.demote(NS, b.block_hash, block(b.block_id)), events=ev)
    tokens = list(range(900, 900 + 7 * B))
    hs = chain(tokens)
    try:
        for i, h in enumerate(hs):
            [b] = bm.allocate(1)
            bm.register(b, h, NS, parent=hs[i - 1] if i else None, tokens=tokens[i * B : (i + 1) * B])
            bm.free([b])
        store.flush(10)
        in_redis = [h for h in hs if rt.contains(redis_tier_ref(h))]
        assert len(in_redis) == 4 and len(disk._lru) == 2  # 7: 1 on the device, 2 on disk, 4 in Redis
        ev.close()
        store.close()
        rt._get_client().delete(rt.key(redis_tier_ref(in_redis[1])))  # expired while the server was down

        store2, disk2, _ = store_at(tmp_path / "disk")
        ev2 = publisher(tmp_path / "disk")
        ev2.attach(device="cpu", store=store2)
        try:
            with subscriber(ev2) as sub:
                want = {"DISK": h64s(disk2._lru), "SHARED": h64s(in_redis[:1] + in_redis[2:])}
                assert sub.wait_for(lambda: sub.view() == want), (sub.view(), want)
                for h in in_redis[:1] + in_redis[2:]:
                    i = hs.index(h)
                    assert sub.tokens[hash64(h)] == tokens[i * B : (i + 1) * B]
                    assert sub.parents[hash64(h)] == (hash64(hs[i - 1]) if i else None)
        finally:
            ev2.close()
            store2.close()
    finally:
        client = rt._get_client()
        for key in client.scan_iter("kvev-journal:*"):
            client.delete(key)
        rt.close()
