"""Overlapped restores (service/engine/restore.py): a returning turn's new tokens are
computed while its blocks land from the host, disk or Redis tier, layer group by layer
group, and nothing of that forward is kept unless every planned block verified. Real
tiers (a real redis-server, files in a temporary directory); outputs against an
uncached reference, or a cold engine's."""

from __future__ import annotations

import threading

import pytest
import torch

from kvserve.cachestore.base import BlockRef
from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.restore import Landing, layer_stages
from kvserve.service.engine.store import build_store
from kvserve.service.models.loading import load_model
from kvserve.service.types import CacheScope, Tier
from tests.fixtures.engine import BS, bytes_per_token, finished, greedy_reference, make_engine, prompts, req, run


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def store_for(loaded, tier, *, redis_url=None, disk_dir=None):
    cfg = EngineConfig(
        block_size=BS,
        host_cache_memory=256 * BS * bytes_per_token(loaded) if tier == Tier.HOST else 0,
        disk_cache_dir=str(disk_dir) if tier == Tier.DISK else None,
        redis_url=redis_url if tier == Tier.REDIS else None,
    )
    return build_store(cfg, loaded)


def engine(loaded, store=None, stages=2):
    return make_engine(loaded, store=store, restore_policy="always", restore_stages=stages)


def history_in(loaded, tier, *, redis_url, disk_dir, seed):
    """A 40-token transcript computed on one engine and spilled to ``tier``; returns the
    transcript, the next turn's prompt, and the store a second engine reads (for host:
    the same store; disk and Redis: a new one, as after a restart)."""
    (hist,) = prompts(loaded.config.vocab_size, [40], seed=seed)
    store = store_for(loaded, tier, redis_url=redis_url, disk_dir=disk_dir)
    a = engine(loaded, store)
    run(a, [req("t1", hist, n=1)])
    a.spill(hist, CacheScope(), (tier,), lambda n, held: None)
    assert a.store.flush(30)
    a.step()
    if tier != Tier.HOST:
        a.close()
        store = store_for(loaded, tier, redis_url=redis_url, disk_dir=disk_dir)
    return hist, hist + [5, 6, 7], store


def test_layer_stages_cover_every_layer_once():
    for layers in (1, 2, 5, 12, 22):
        for stages in (1, 2, 3, 4, 30):
            got = layer_stages(layers, stages)
            assert [l for a, b in got for l in range(a, b)] == list(range(layers))
            assert len(got) == min(stages, layers)


def hold_last_stage(b, monkeypatch, ref=None):
    """Hold the restore's last layer group back until the engine's forward waits for it
    (so the forward provably ran over the first layers while the rest was missing: the
    overlap happens whatever the timing). Returns what the forward saw at each wait:
    (layer, the restore over, the restored blocks' layer equal to ``ref``'s) where
    ``ref`` is (engine, block ids) holding the KV as computed."""
    last = b.pool.num_layers
    asked_for_last = threading.Event()
    seen: list[tuple[int, bool, bool | None]] = []
    ids: list[int] = []
    wait_layer = Landing.wait_layer

    def watched_wait(self, layer):
        if layer == last - 1:
            asked_for_last.set()
        wait_layer(self, layer)
        same = None if ref is None else torch.equal(b.pool.data[ids, layer], ref[0].pool.data[ref[1], layer])
        seen.append((layer, self.done, same))

    fetch = b.store.fetch_layered

    def held_back(namespace, hashes, tiers, outs, stages, on_stage):
        ids[:] = [int((o.data_ptr() - b.pool.data.data_ptr()) // b.pool.bytes_per_block) for o in outs]

        def stage(l1, n):
            if l1 == last:
                assert asked_for_last.wait(30), "the forward never reached the last layer during the restore"
            on_stage(l1, n)

        return fetch(namespace, hashes, tiers, outs, stages, stage)

    monkeypatch.setattr(Landing, "wait_layer", watched_wait)
    monkeypatch.setattr(b.store, "fetch_layered", held_back)
    return seen


@pytest.mark.parametrize("tier", [Tier.HOST, Tier.DISK, Tier.REDIS])
def test_overlapped_restore_gives_the_reference_answer(loaded, redis_url, tmp_path, tier, monkeypatch):
    hist, prompt, store = history_in(loaded, tier, redis_url=redis_url, disk_dir=tmp_path / "disk", seed=1)
    b = engine(loaded, store)
    seen = hold_last_stage(b, monkeypatch)
    before = b.runner.num_prefill_tokens
    evs = run(b, [req("t2", prompt, n=5)])["t2"]
    assert evs[0].cached_by_tier == {tier: 40}
    assert b.runner.num_prefill_tokens - before == len(prompt) - 40
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, prompt, 5)
    assert (b.restorer.num_overlapped, b.restorer.num_overlaps_voided) == (1, 0)
    assert seen[0][:2] == (0, False)  # layer 0 was attended over before the restore was over
    assert b.store.tier(tier).stats().hits == 10
    b.close()


def test_each_layer_is_read_only_after_it_landed(loaded, redis_url, monkeypatch):
    """Every layer the overlapped forward read held the restored KV by then (the KV as
    the first engine computed it), and layer 0 was read before the restore was over."""
    assert loaded.config.num_layers == 2
    hist, prompt, store = history_in(loaded, Tier.REDIS, redis_url=redis_url, disk_dir=None, seed=2)
    ref = engine(loaded)  # the history's KV as computed, to compare the landed layers with
    run(ref, [req("h", hist, n=1)])
    ref_ids = [b.block_id for b in ref.blocks.match_prefix(block_hashes(ref.keys.namespace(CacheScope(), len(hist)), hist, BS))]
    assert len(ref_ids) == 10
    b = engine(loaded, store, stages=2)
    seen = hold_last_stage(b, monkeypatch, ref=(ref, ref_ids))
    evs = run(b, [req("t2", prompt, n=4)])["t2"]
    assert evs[0].cached_by_tier == {Tier.REDIS: 40}
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, prompt, 4)
    assert [(layer, same) for layer, _, same in seen] == [(0, True), (1, True)]
    assert seen[0][1] is False  # layer 0 was read before the restore was over
    assert b.restorer.num_overlapped == 1
    ref.close()
    b.close()


def _corrupt_late_layer(value: bytes) -> bytes:
    """Flip a byte in the last layer's K/V: only the final checksum (after the forward
    ran over the first layers) can catch it."""
    v = bytearray(value)
    v[len(v) - 64] ^= 0x10
    return bytes(v)


@pytest.mark.parametrize("tier", [Tier.DISK, Tier.REDIS])
def test_a_block_failing_verification_mid_overlap_is_recomputed(loaded, redis_server, redis_url, tmp_path, tier,
                                                                monkeypatch):
    """One block corrupted in the tier: the overlapped forward is thrown away, the blocks
    before it are restored, it and the rest recomputed; the answer is a cold run's."""
    hist, prompt, store = history_in(loaded, tier, redis_url=redis_url, disk_dir=tmp_path / "disk", seed=3)
    ns = make_namespace(loaded.fingerprint, "float32", BS, "")
    hashes = block_hashes(ns, hist, BS)
    bad = 6
    ref = BlockRef(ns, hashes[bad])
    if tier == Tier.REDIS:
        key = store.tier(Tier.REDIS).key(ref)
        with redis_server.client() as c:
            c.set(key, _corrupt_late_layer(c.get(key)))
    else:
        path = store.tier(Tier.DISK).path(ref)
        path.write_bytes(_corrupt_late_layer(path.read_bytes()))
    cold = engine(loaded)
    want = finished(run(cold, [req("c", prompt, n=6)])["c"]).output_token_ids
    b = engine(loaded, store)
    hold_last_stage(b, monkeypatch)
    before = b.runner.num_prefill_tokens
    evs = run(b, [req("t2", prompt, n=6)])["t2"]
    assert evs[0].cached_by_tier == {tier: bad * BS}
    assert b.runner.num_prefill_tokens - before == len(prompt) - bad * BS
    assert finished(evs).output_token_ids == want == greedy_reference(loaded.model, prompt, 6)
    assert (b.restorer.num_overlapped, b.restorer.num_overlaps_voided) == (1, 1)
    assert b.store.tier(tier).stats().failures  # counted under its reason
    cold.close()
    b.close()


def test_stages_zero_restores_whole_before_prefill(loaded, redis_url):
    hist, prompt, store = history_in(loaded, Tier.REDIS, redis_url=redis_url, disk_dir=None, seed=4)
    b = engine(loaded, store, stages=0)
    evs = run(b, [req("t2", prompt, n=3)])["t2"]
    assert evs[0].cached_by_tier == {Tier.REDIS: 40}
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, prompt, 3)
    assert b.restorer.num_overlapped == 0
    b.close()
