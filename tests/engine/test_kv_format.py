"""--kv-cache-format: the device pool and every tier store KV as bf16/fp16 (float32
compute), attention reads it as stored (the native kernels and torch), the format is in
the block namespace, and the tiers move the pool's bytes as they are."""

from __future__ import annotations

import pytest
import torch

from kvserve.cachestore import codec
from kvserve.service.config import ConfigError, ServerConfig
from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.store import build_store
from kvserve.service.kernels import ops
from kvserve.service.kv.cache import BatchLayout, KVCacheSpec, KVPool, SeqSlice
from kvserve.service.models.loading import load_model
from kvserve.service.types import CacheScope, Tier
from tests.fixtures.engine import BS, finished, prompts, req, run
from tests.fixtures.engine import make_engine as _make_engine

FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu", progress=False)


def make_engine(loaded, fmt, store=None, blocks=64, **kw):
    spec = loaded.kv_spec(BS, fmt)
    kw.setdefault("restore_policy", "always")
    return _make_engine(loaded, store=store, kv_cache_format=fmt, kv_cache_memory=blocks * spec.bytes_per_block, **kw)


def store_for(loaded, fmt, *, host_blocks=0, redis_url=None, redis_kv_format="exact"):
    spec = loaded.kv_spec(BS, fmt)
    cfg = EngineConfig(block_size=BS, kv_cache_format=fmt, host_cache_memory=host_blocks * spec.bytes_per_block,
                       redis_url=redis_url, redis_kv_format=redis_kv_format)  # fmt: skip
    return build_store(cfg, loaded)


def test_the_spec_derives_dtype_bytes_and_namespace_field_once(loaded) -> None:
    exact, bf16, fp16 = (loaded.kv_spec(BS, f) for f in ("exact", "bf16", "fp16"))
    assert (exact.dtype, bf16.dtype, fp16.dtype) == (torch.float32, torch.bfloat16, torch.float16)
    assert bf16.bytes_per_token * 2 == exact.bytes_per_token == fp16.bytes_per_token * 2
    assert (exact.format, bf16.format, fp16.format) == ("exact", "bf16", "fp16")
    assert len({exact.namespace_field, bf16.namespace_field, fp16.namespace_field}) == 3
    assert exact.namespace_field == "float32" and bf16.namespace_field == "float32/kv=bf16"
    # a model computing in bfloat16 already stores bf16: the format is exact, the same namespace as before
    spec = KVCacheSpec.for_model(loaded.config, BS, torch.bfloat16, "bf16")
    assert spec.dtype == torch.bfloat16 and spec.format == "exact" and spec.namespace_field == "bfloat16"
    with pytest.raises(ValueError, match="unknown KV cache format 'int4'"):
        loaded.kv_spec(BS, "int4")


def test_the_setting_reaches_the_engine_and_refuses_a_redis_re_encoding() -> None:
    assert ServerConfig.from_args([], {}).engine_config().kv_cache_format == "exact"
    assert ServerConfig.from_args(["--kv-cache-format", "bf16"], {}).engine_config().kv_cache_format == "bf16"
    assert ServerConfig.from_args([], {"KVSERVE_KV_CACHE_FORMAT": "fp16"}).engine_config().kv_cache_format == "fp16"
    ServerConfig.from_args(["--kv-cache-format", "bf16", "--redis-kv-format", "bf16"], {})  # the same bytes: fine
    with pytest.raises(ConfigError, match="^--redis-kv-format / KVSERVE_REDIS_KV_FORMAT would re-encode the "
                                          "--kv-cache-format bf16 blocks"):  # fmt: skip
        ServerConfig.from_args(["--kv-cache-format", "bf16", "--redis-kv-format", "int8"], {})


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_the_engine_serves_the_format_and_reports_its_bytes_per_token(loaded, fmt) -> None:
    eng = make_engine(loaded, fmt)
    assert eng.pool.data.dtype == FORMATS[fmt]
    assert eng.model_info.bytes_per_token == loaded.kv_spec(BS).bytes_per_token // 2
    assert eng.model_info.dtype == "float32"  # the compute dtype
    assert eng.keys.kv_dtype == f"float32/kv={fmt}"
    eng.close()


def _nll(loaded, pool, tokens) -> torch.Tensor:
    """Teacher-forced next-token NLL (n - 1,) of ``tokens``: a prefill of half, then
    one-token decode steps reading the rest of the context from ``pool``."""
    n = len(tokens)
    table = list(range(1, 1 + -(-n // BS)))
    half = n // 2
    with torch.inference_mode():
        logits = [loaded.model(BatchLayout.build([SeqSlice(table, 0, tokens[:half])], BS), pool, all_logits=True)[0]]
        for p in range(half, n - 1):
            logits.append(loaded.model(BatchLayout.build([SeqSlice(table, p, [tokens[p]])], BS), pool)[:1])
    logp = torch.log_softmax(torch.cat(logits)[: n - 1].double(), -1)
    return -logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_loss_and_greedy_tokens_stay_close_to_exact(loaded, fmt) -> None:
    """On the tiny model: mean NLL within 1% of the exact cache's, and the greedy tokens of
    the engine (native decode steps) mostly the exact engine's."""
    c = loaded.config
    seqs = prompts(c.vocab_size, [40, 33, 47], seed=11)
    nb = 1 + 13
    exact_nll, lossy_nll = [], []
    for s in seqs:
        exact_nll.append(_nll(loaded, KVPool(nb, c.num_layers, BS, c.num_kv_heads, c.head_dim), s))
        lossy = KVPool(nb, c.num_layers, BS, c.num_kv_heads, c.head_dim, FORMATS[fmt], compute_dtype=torch.float32)
        lossy_nll.append(_nll(loaded, lossy, s))
    e, lo = torch.cat(exact_nll), torch.cat(lossy_nll)
    assert not torch.equal(e, lo)  # the format really rounded something
    assert abs(lo.mean() - e.mean()) / e.mean() < 0.01

    outs = {}
    for f in ("exact", fmt):
        eng = make_engine(loaded, f)
        evs = run(eng, [req(str(i), p, n=12) for i, p in enumerate(seqs)])
        outs[f] = [finished(evs[str(i)]).output_token_ids for i in range(len(seqs))]
        eng.close()
    same = sum(a == b for x, y in zip(outs["exact"], outs[fmt]) for a, b in zip(x, y))
    assert same >= 0.8 * 12 * len(seqs), outs


def test_formats_never_read_each_others_blocks(loaded, redis_url) -> None:
    """A transcript spilled to Redis by an exact engine is a miss for a bf16 engine on the
    same Redis and prefix (and the reverse): different namespaces, not rounded reuse."""
    for i, (writer, reader) in enumerate((("exact", "bf16"), ("bf16", "fp16"), ("bf16", "exact"))):
        (p1,) = prompts(loaded.config.vocab_size, [16], seed=21 + i)  # a prefix no earlier case wrote
        a = make_engine(loaded, writer, store=store_for(loaded, writer, redis_url=redis_url))
        run(a, [req("t1", p1, n=4)])
        a.spill(p1, CacheScope(), ("redis",), lambda n, held: None)
        assert a.store.flush(30)
        a.step()
        a.close()
        b = make_engine(loaded, reader, store=store_for(loaded, reader, redis_url=redis_url))
        start = run(b, [req("t2", p1 + [5, 6], n=2)])["t2"][0]
        assert start.cached_tokens == 0, (writer, reader)
        b.close()
        again = make_engine(loaded, writer, store=store_for(loaded, writer, redis_url=redis_url))
        assert run(again, [req("t3", p1 + [5, 6], n=2)])["t3"][0].cached_by_tier.get(Tier.REDIS, 0) == 16
        again.close()


def test_redis_and_host_restores_in_bf16_give_the_device_hits_tokens(loaded, redis_url) -> None:
    """Turn 2 of a conversation in bf16: from the device, after a restart from Redis, and
    after a device eviction from the host, the same tokens; Redis holds the pool's bf16
    bytes as they are (half the exact value size, no re-encoding)."""
    (p1,) = prompts(loaded.config.vocab_size, [13], seed=31)
    dev = make_engine(loaded, "bf16", store=store_for(loaded, "bf16", redis_url=redis_url, redis_kv_format="bf16"))
    fin = finished(run(dev, [req("t1", p1, n=6)])["t1"])
    transcript = p1 + fin.output_token_ids
    prompt = transcript + [5, 6, 7]
    start_dev, *_, fin_dev = run(dev, [req("t2", prompt, n=6)])["t2"]
    assert start_dev.cached_by_tier.get(Tier.DEVICE, 0) == (len(transcript) // BS) * BS
    dev.spill(transcript, CacheScope(), ("redis",), lambda n, held: None)
    assert dev.store.flush(30)
    dev.step()
    dev.close()

    rs = store_for(loaded, "bf16", redis_url=redis_url, redis_kv_format="bf16")
    rt, ert = rs.tier("redis"), store_for(loaded, "exact", redis_url=redis_url).tier("redis")
    assert rt.storage_dtype is None and rt.dtype == torch.bfloat16  # bf16 pool, bf16 Redis: stored as it is
    assert rt.value_nbytes < 0.6 * ert.value_nbytes
    b = make_engine(loaded, "bf16", store=rs)
    start_r, *_, fin_r = run(b, [req("t2", prompt, n=6)])["t2"]
    assert start_r.cached_by_tier.get(Tier.REDIS, 0) == (len(transcript) // BS) * BS
    assert fin_r.output_token_ids == fin_dev.output_token_ids
    b.close()

    # the host tier: 10 device blocks, another conversation evicts the first one's
    h = make_engine(loaded, "bf16", store=store_for(loaded, "bf16", host_blocks=64), blocks=11)
    run(h, [req("t1", p1, n=6)])
    (other,) = prompts(loaded.config.vocab_size, [30], seed=99)
    run(h, [req("other", other, n=4)])
    assert h.blocks.num_evicted > 0
    start_h, *_, fin_h = run(h, [req("t2", prompt, n=6)])["t2"]
    assert start_h.cached_by_tier.get(Tier.HOST, 0) > 0
    assert fin_h.output_token_ids == fin_dev.output_token_ids
    h.close()


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("nh,nkv,window,hd", [(4, 2, None, 32), (6, 1, 5, 40), (4, 4, None, 12)])
def test_native_decode_attention_reads_a_narrow_pool_in_place(fmt, nh, nkv, window, hd) -> None:
    """The kernel rounds the new K/V into a bf16/fp16 pool as ``Tensor.to`` does (the same
    bits) and attends over the stored values, as float64 attention over the widened pool."""
    from tests.engine.test_native import _ref_attention

    dtype = FORMATS[fmt]
    g = torch.Generator().manual_seed(nh + hd)
    bs, L = 4, 3
    pool = KVPool(40, L, bs, nkv, hd, dtype, compute_dtype=torch.float32)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    tables, lens = [[7, 3, 22, 9], [30, 1, 15], [12]], [14, 9, 2]
    layout = BatchLayout.build([SeqSlice(t, n - 1, [5]) for t, n in zip(tables, lens)], bs)
    q = torch.randn(3, 1, nh, hd, generator=g)
    k, v = torch.randn(3, 1, 2 * nkv, hd, generator=g).split(nkv, dim=2)
    out = ops.decode_attention(q, k, v, pool.data, 1, layout.slot_blocks, layout.slot_offsets, layout.ctx_blocks,
                               layout.lens_tensor(), window, hd**-0.5, None)  # fmt: skip
    for b, (t, n) in enumerate(zip(tables, lens)):
        blk, off = t[(n - 1) // bs], (n - 1) % bs
        assert torch.equal(pool.k(1)[blk, off], k[b, 0].to(dtype)) and torch.equal(pool.v(1)[blk, off], v[b, 0].to(dtype))
    ids = layout.ctx_blocks.view(-1)
    k_ctx = pool.k(1).index_select(0, ids).view(3, -1, nkv, hd).float()
    v_ctx = pool.v(1).index_select(0, ids).view(3, -1, nkv, hd).float()
    ref = _ref_attention(q[:, 0], k_ctx, v_ctx, lens, window, hd**-0.5, None)
    torch.testing.assert_close(out.view(3, nh, hd).double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_gemma2_dir", "tiny_qwen3_dir"])
def test_native_decode_steps_over_bf16_kv_match_torch(family, request) -> None:
    """Prefill, then 6 decode steps of two sequences over a bf16 pool: the decoder stack
    (native attention reading bf16) and torch's path (gathered bf16 widened in the layer)
    give the same logits (within one bf16 step of the stored KV) and leave the same stored KV."""
    path = request.getfixturevalue(family)
    on = load_model(path, dtype="float32", device="cpu", progress=False)
    off = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    if on.native != "on":
        pytest.skip(f"native kernels unavailable: {on.native}")
    cfg = on.config
    pools = [KVPool(32, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, compute_dtype=torch.float32)
             for _ in range(2)]  # fmt: skip
    tables = [[3, 9, 4, 12, 5, 20], [7, 2, 17, 8, 11]]
    prompts_ = prompts(cfg.vocab_size, [11, 6], seed=5)
    seqs = [list(p) for p in prompts_]
    with torch.inference_mode():
        for m, pool in zip((on, off), pools):
            m.model(BatchLayout.build([SeqSlice(t, 0, p) for t, p in zip(tables, prompts_)], 4), pool)
        for _ in range(6):
            layout = BatchLayout.build([SeqSlice(t, len(s) - 1, [s[-1]]) for t, s in zip(tables, seqs)], 4)
            a, c = (m.model(layout, pool) for m, pool in zip((on, off), pools))
            # the tolerance of one bf16 step in the stored K/V (below), not float32's: the
            # paths' prefill K/V may round to neighbouring bf16 values, which moves a tiny
            # model's logits by up to ~1e-3 (Qwen3's q/k norms amplify it); a wrong block or
            # position moves them by O(1)
            torch.testing.assert_close(a, c, atol=2e-3, rtol=2e-3)
            for s, tok in zip(seqs, c.argmax(-1).tolist()):
                s.append(tok)
    # the same stored KV up to one bf16 step (the paths' float32 K/V differ in the last
    # bits, which may round to neighbouring bf16 values; the rounding itself is exact: above)
    torch.testing.assert_close(pools[0].data.float(), pools[1].data.float(), atol=1e-5, rtol=2**-7)


def test_codec_moves_a_bf16_block_as_it_is() -> None:
    """A bf16 block through the codec with no storage dtype: the same bytes back, its
    payload half a float32 block's."""
    from kvserve.cachestore.keys import make_namespace

    block = torch.randn(2, 2, 4, 2, 8).to(torch.bfloat16)
    ns = make_namespace("fp", "float32/kv=bf16", 4)
    bh = bytes(32)
    enc = codec.encode(ns, bh, block)
    out = torch.empty_like(block)
    assert codec.decode_into(enc, ns, bh, out).ok and torch.equal(out, block)
    assert len(enc) < 0.6 * len(codec.encode(ns, bh, block.float()))
