"""--kv-cache-format: the device pool and every tier store KV as bf16/fp16, or int8 or
fp8 (e4m3) with a scale per row (float32 compute), attention reads it as stored (the
native kernels and torch; fp8: torch alone), the format is in the block namespace, and
the tiers move the pool's bytes as they are (int8, fp8: the scales with them)."""

from __future__ import annotations

import pytest
import torch

from kvserve.cachestore import codec
from kvserve.service.config import ConfigError, ServerConfig
from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.store import build_store
from kvserve.service.kernels import ops
from kvserve.service.kv.block_manager import NULL_BLOCK
from kvserve.service.kv.cache import BatchLayout, KVCacheSpec, KVPool, SeqSlice, dequantize
from kvserve.service.models.loading import load_model
from kvserve.service.types import CacheScope, Tier
from tests.fixtures.engine import BS, finished, prompts, req, run
from tests.fixtures.engine import make_engine as _make_engine

FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALED = ("int8", "fp8")  # values and a scale per row and kv head in each plane


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, for exact comparisons (torch's CPU ``equal`` has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu", progress=False)


def make_engine(loaded, fmt, store=None, blocks=64, **kw):
    spec = loaded.kv_spec(BS, fmt)
    kw.setdefault("restore_policy", "always")
    return _make_engine(loaded, store=store, kv_cache_format=fmt, kv_cache_memory=blocks * spec.bytes_per_block, **kw)


def store_for(loaded, fmt, *, host_blocks=0, redis_url=None, redis_kv_format="exact", disk_dir=None):
    spec = loaded.kv_spec(BS, fmt)
    cfg = EngineConfig(block_size=BS, kv_cache_format=fmt, host_cache_memory=host_blocks * spec.bytes_per_block,
                       redis_url=redis_url, redis_kv_format=redis_kv_format,
                       disk_cache_dir=None if disk_dir is None else str(disk_dir))  # fmt: skip
    return build_store(cfg, loaded)


def stored_kv(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of ``layer`` as attention reads them, (N, bs, n_kv, hd) float32, any format."""
    if pool.spec.quantized:  # int8, fp8
        return (dequantize(pool.k(layer), pool.k_scale(layer)), dequantize(pool.v(layer), pool.v_scale(layer)))
    return pool.k(layer).float(), pool.v(layer).float()


def test_the_spec_derives_dtype_bytes_and_namespace_field_once(loaded) -> None:
    exact, bf16, fp16, int8 = (loaded.kv_spec(BS, f) for f in ("exact", "bf16", "fp16", "int8"))
    assert (exact.dtype, bf16.dtype, fp16.dtype, int8.dtype) == (torch.float32, torch.bfloat16, torch.float16, torch.int8)
    assert bf16.bytes_per_token * 2 == exact.bytes_per_token == fp16.bytes_per_token * 2
    assert (exact.format, bf16.format, fp16.format, int8.format) == ("exact", "bf16", "fp16", "int8")
    assert len({exact.namespace_field, bf16.namespace_field, fp16.namespace_field, int8.namespace_field}) == 4
    assert exact.namespace_field == "float32" and bf16.namespace_field == "float32/kv=bf16"
    assert int8.namespace_field == "float32/kv=int8/rows"  # a scale per row: not the per-block layout's blocks
    # int8: a quarter of float32's bytes, plus one float32 scale per (layer, K|V, token, kv head)
    c = loaded.config
    scales = 2 * c.num_layers * c.num_kv_heads * 4  # per token
    assert int8.bytes_per_block == exact.bytes_per_block // 4 + BS * scales  # (BS * n_kv * hd is a multiple of 4)
    assert int8.block_shape == (c.num_layers, 2, int8.bytes_per_block // (2 * c.num_layers))
    assert int8.bytes_per_token == exact.bytes_per_token // 4 + scales
    # a model computing in bfloat16 already stores bf16: the format is exact, the same namespace as before
    spec = KVCacheSpec.for_model(loaded.config, BS, torch.bfloat16, "bf16")
    assert spec.dtype == torch.bfloat16 and spec.format == "exact" and spec.namespace_field == "bfloat16"
    # fp8: int8's planes, one e4m3 byte per value: the same bytes, its own namespace
    fp8 = loaded.kv_spec(BS, "fp8")
    assert (fp8.dtype, fp8.format, fp8.namespace_field) == (torch.float8_e4m3fn, "fp8", "float32/kv=fp8/rows")
    assert (fp8.block_shape, fp8.bytes_per_block, fp8.bytes_per_token) == (int8.block_shape, int8.bytes_per_block,
                                                                           int8.bytes_per_token)  # fmt: skip
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
    assert ServerConfig.from_args(["--kv-cache-format", "int8"], {}).engine_config().kv_cache_format == "int8"
    ServerConfig.from_args(["--kv-cache-format", "int8", "--redis-kv-format", "int8"], {})  # stored as it is
    for other in ("bf16", "fp16", "fp8"):  # an int8 block (values and scales) re-encoded: refused
        with pytest.raises(ConfigError, match="would re-encode the --kv-cache-format int8 blocks"):
            ServerConfig.from_args(["--kv-cache-format", "int8", "--redis-kv-format", other], {})
    assert ServerConfig.from_args(["--kv-cache-format", "fp8", "--redis-kv-format", "fp8"], {}).engine_config(
        ).kv_cache_format == "fp8"  # fmt: skip
    with pytest.raises(ConfigError, match="would re-encode the --kv-cache-format fp8 blocks"):
        ServerConfig.from_args(["--kv-cache-format", "fp8", "--redis-kv-format", "int8"], {})


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "fp8"])
def test_the_engine_serves_the_format_and_reports_its_bytes_per_token(loaded, fmt) -> None:
    eng = make_engine(loaded, fmt)
    assert eng.pool.data.dtype == FORMATS[fmt]
    exact = loaded.kv_spec(BS).bytes_per_token
    want = exact // 2 if fmt not in SCALED else loaded.kv_spec(BS, fmt).bytes_per_token
    # int8, fp8: a quarter, plus a float32 scale per head_dim (16) values
    assert eng.model_info.bytes_per_token == want and (fmt not in SCALED or want == exact * (1 + 4 / 16) // 4)
    assert eng.model_info.dtype == "float32"  # the compute dtype
    assert eng.keys.kv_dtype == f"float32/kv={fmt}" + ("/rows" if fmt in SCALED else "")
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


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "int8", "fp8"])
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
    cases = (("exact", "bf16"), ("bf16", "fp16"), ("bf16", "exact"), ("exact", "int8"), ("int8", "exact"),
             ("int8", "bf16"), ("exact", "fp8"), ("fp8", "exact"), ("fp8", "int8"), ("int8", "fp8"))  # fmt: skip
    for i, (writer, reader) in enumerate(cases):
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


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
def test_redis_disk_and_host_restores_give_the_device_hits_tokens(loaded, redis_url, tmp_path, fmt) -> None:
    """Turn 2 of a conversation in bf16 / int8 / fp8: from the device, after a restart from
    Redis, after a restart from the disk tier, and after a device eviction from the host,
    the same tokens; Redis and the disk hold the pool's bytes as they are (bf16: half the
    exact value size; int8, fp8: a quarter plus the scales; no re-encoding)."""
    (p1,) = prompts(loaded.config.vocab_size, [13], seed=31 + len(fmt))
    dev = make_engine(loaded, fmt, store=store_for(loaded, fmt, redis_url=redis_url, redis_kv_format=fmt,
                                                   disk_dir=tmp_path))  # fmt: skip
    fin = finished(run(dev, [req("t1", p1, n=6)])["t1"])
    transcript = p1 + fin.output_token_ids
    prompt = transcript + [5, 6, 7]
    start_dev, *_, fin_dev = run(dev, [req("t2", prompt, n=6)])["t2"]
    assert start_dev.cached_by_tier.get(Tier.DEVICE, 0) == (len(transcript) // BS) * BS
    dev.spill(transcript, CacheScope(), ("disk", "redis"), lambda n, held: None)
    assert dev.store.flush(30)
    dev.step()
    dev.close()

    rs = store_for(loaded, fmt, redis_url=redis_url, redis_kv_format=fmt)
    rt, ert = rs.tier("redis"), store_for(loaded, "exact", redis_url=redis_url).tier("redis")
    assert rt.storage_dtype is None and rt.dtype == FORMATS[fmt]  # the pool's format in Redis: stored as it is
    assert rt.block_nbytes == loaded.kv_spec(BS, fmt).bytes_per_block
    # each value saves half (int8, fp8: three quarters, less a float32 scale per row of head_dim
    # (16) values: 11/16) of the exact block's bytes
    assert rt.value_nbytes < ert.value_nbytes - (0.45 if fmt == "bf16" else 0.65) * ert.block_nbytes
    b = make_engine(loaded, fmt, store=rs)
    start_r, *_, fin_r = run(b, [req("t2", prompt, n=6)])["t2"]
    assert start_r.cached_by_tier.get(Tier.REDIS, 0) == (len(transcript) // BS) * BS
    assert fin_r.output_token_ids == fin_dev.output_token_ids
    b.close()

    d = make_engine(loaded, fmt, store=store_for(loaded, fmt, disk_dir=tmp_path))  # a restart with the disk alone
    start_d, *_, fin_d = run(d, [req("t2", prompt, n=6)])["t2"]
    assert start_d.cached_by_tier.get(Tier.DISK, 0) == (len(transcript) // BS) * BS
    assert fin_d.output_token_ids == fin_dev.output_token_ids
    d.close()

    # the host tier: 10 device blocks, another conversation evicts the first one's
    h = make_engine(loaded, fmt, store=store_for(loaded, fmt, host_blocks=64), blocks=11)
    run(h, [req("t1", p1, n=6)])
    (other,) = prompts(loaded.config.vocab_size, [30], seed=99)
    run(h, [req("other", other, n=4)])
    assert h.blocks.num_evicted > 0
    start_h, *_, fin_h = run(h, [req("t2", prompt, n=6)])["t2"]
    assert start_h.cached_by_tier.get(Tier.HOST, 0) > 0
    assert fin_h.output_token_ids == fin_dev.output_token_ids
    h.close()


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("family", ["tiny_gpt2_dir", "tiny_qwen2_window_dir", "tiny_gemma3_dir"])
def test_torch_decode_over_scaled_kv_stays_close_to_exact(family, fmt, request) -> None:
    """Torch's path alone (native kernels off) over an int8 / fp8 pool, in the families with
    their own attention (GPT-2), sliding windows (Qwen2, Gemma 3): a prefill of half,
    then decode steps reading the scaled context block by block; mean NLL within 1% of the
    exact pool's, and the quantization really changed something."""
    lm = load_model(request.getfixturevalue(family), dtype="float32", device="cpu", progress=False,
                    native_kernels="off")  # fmt: skip
    c = lm.config
    (s,) = prompts(c.vocab_size, [45], seed=13)
    exact = _nll(lm, KVPool(14, c.num_layers, BS, c.num_kv_heads, c.head_dim), s)
    lossy = _nll(lm, KVPool(14, c.num_layers, BS, c.num_kv_heads, c.head_dim, FORMATS[fmt],
                            compute_dtype=torch.float32), s)  # fmt: skip
    assert not torch.equal(exact, lossy)
    assert abs(lossy.mean() - exact.mean()) / exact.mean() < 0.01


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


@pytest.mark.parametrize("nh,nkv,window,hd", [(4, 2, None, 32), (6, 1, 5, 40), (4, 4, None, 12)])
def test_native_decode_attention_reads_an_int8_pool_in_place(nh, nkv, window, hd) -> None:
    """Over contexts written by torch's path, the kernel writes the new K/V as torch's
    path does (the same int8 values and scales; the new rows are 3x the context's, and the
    rows already in their blocks keep their bytes) and attends over the stored KV as
    float64 attention over the dequantized pool."""
    from tests.engine.test_native import _ref_attention

    g = torch.Generator().manual_seed(nh + hd)
    bs, L = 4, 3
    native, torch_path = (KVPool(40, L, bs, nkv, hd, torch.int8, compute_dtype=torch.float32) for _ in range(2))
    tables, lens = [[7, 3, 22, 9], [30, 1, 15], [12]], [14, 9, 2]
    for t, n in zip(tables, lens):  # n - 1 cached positions each, by one prefill
        layout = BatchLayout.build([SeqSlice(t, 0, [1] * (n - 1))], bs)
        k, v = torch.randn(2, 1, n - 1, nkv, hd, generator=g)
        for pool in (native, torch_path):
            pool.update(1, layout, k, v)
    layout = BatchLayout.build([SeqSlice(t, n - 1, [5]) for t, n in zip(tables, lens)], bs)
    q = torch.randn(3, 1, nh, hd, generator=g)
    k, v = (3 * torch.randn(3, 1, 2 * nkv, hd, generator=g)).split(nkv, dim=2)
    out = ops.decode_attention(q, k, v, native.data, 1, layout.slot_blocks, layout.slot_offsets, layout.ctx_blocks,
                               layout.lens_tensor(), window, hd**-0.5, None, block_size=bs)  # fmt: skip
    before = torch_path.data.clone()
    k_ctx, v_ctx = torch_path.update(1, layout, k.contiguous(), v.contiguous())
    assert torch.equal(native.data, torch_path.data)  # values and scales, bit for bit
    for t, n in zip(tables, lens):  # the new row's slot alone changed: the rows before it in its block did not
        blk, off = t[(n - 1) // bs], (n - 1) % bs
        assert torch.equal(native.k(1)[blk, :off], before[blk, 1, 0, : off * nkv * hd].view(off, nkv, hd))
        assert torch.equal(native.k_scale(1)[blk, :off], before[blk, 1, 0, -4 * bs * nkv :].view(torch.float32)
                           .view(bs, nkv)[:off])  # fmt: skip
    rows = k[:, 0].abs().amax(-1) / 127  # (3, n_kv): each new row's own scale
    assert torch.equal(native.k_scale(1)[layout.slot_blocks, layout.slot_offsets], rows)
    ref = _ref_attention(q[:, 0], k_ctx.double(), v_ctx.double(), lens, window, hd**-0.5, None)
    torch.testing.assert_close(out.view(3, nh, hd).double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", SCALED)
@pytest.mark.parametrize("nh,nkv,window,softcap", [(4, 2, None, None), (6, 3, 7, None), (4, 1, None, 5.0)])
def test_torch_attention_over_scaled_kv_reads_the_pool_chunk_by_chunk(nh, nkv, window, softcap, fmt) -> None:
    """A prefill chunk over a cached context and a decode row in one batch: attention
    over the int8 / fp8 pool a few blocks at a time (online softmax) equals attention over the
    whole dequantized context (what ``KVPool.update`` returns) with the layout's mask,
    and both write the same KV."""
    from kvserve.service.models.gemma import softcapped_attention
    from kvserve.service.models.layers import paged_int8_attention

    g = torch.Generator().manual_seed(nh * nkv)
    bs, hd = 4, 16
    pools = [KVPool(40, 2, bs, nkv, hd, FORMATS[fmt], compute_dtype=torch.float32) for _ in range(2)]
    tables, cached, new = [[7, 3, 22, 9, 30, 2], [12, 5, 6, 1]], [13, 10], [5, 1]
    for t, n in zip(tables, cached):
        kv = torch.randn(2, 1, n, nkv, hd, generator=g)
        for pool in pools:
            pool.update(1, BatchLayout.build([SeqSlice(t, 0, [1] * n)], bs), kv[0], kv[1])
    layout = BatchLayout.build([SeqSlice(t, c, [1] * m) for t, c, m in zip(tables, cached, new)], bs)
    q = torch.randn(2, 5, nh, hd, generator=g)
    k, v = torch.randn(2, 2, 5, nkv, hd, generator=g)
    mask, _ = layout.mask_for(torch.float32, window)
    pools[0].write_int8(1, layout, k, v)
    out = paged_int8_attention(q, pools[0], 1, layout, mask, hd**-0.5, softcap, chunk_blocks=2)
    k_ctx, v_ctx = pools[1].update(1, layout, k, v)  # (B, C, n_kv, hd) dequantized
    assert torch.equal(raw(pools[0].data), raw(pools[1].data))
    qt, kt, vt = q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2)
    if softcap is None:
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=hd**-0.5,
                                                               enable_gqa=True)  # fmt: skip
    else:
        ref = softcapped_attention(qt, kt, vt, mask, False, hd**-0.5, softcap)
    real = [(b, t) for b in range(2) for t in range(new[b])]  # padding rows attend to anything
    for b, t in real:
        torch.testing.assert_close(out[b, t], ref.transpose(1, 2)[b, t], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", SCALED)
def test_a_rows_bytes_depend_on_that_row_alone(fmt) -> None:
    """Int8 / fp8: each row's scale per kv head is its own absmax / qmax and its values
    are within half a step of it (int8: half the scale; e4m3: half its relative step, or
    its subnormal step) whatever else is written, so a block holds the same bytes
    however it was filled: token by token (plain decoding), by one prefill, or by a
    verify step whose rejected drafts (rows 10x larger) were written past the accepted
    rows and then overwritten by the tokens really computed there."""
    bs, nkv, hd = 8, 2, 16
    qmax = 127 if fmt == "int8" else 448
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 1, 2 * bs, nkv, hd, generator=g) * torch.linspace(0.1, 3, 2 * bs)[None, None, :, None, None]
    table = [2, 3]

    def pool():
        return KVPool(5, 1, bs, nkv, hd, FORMATS[fmt], compute_dtype=torch.float32)

    def write(p, start, kk, vv):
        p.update(0, BatchLayout.build([SeqSlice(table, start, [1] * kk.shape[1])], bs), kk, vv)

    one_by_one, prefill, verified = pool(), pool(), pool()
    for i in range(2 * bs):
        write(one_by_one, i, k[:, i : i + 1], v[:, i : i + 1])
    write(prefill, 0, k, v)
    write(verified, 0, k[:, :5], v[:, :5])  # then a verify step: rows 5, 6 accepted, 7..12 rejected drafts
    drafts_k, drafts_v = torch.cat([k[:, 5:7], 10 * k[:, 7:13]], 1), torch.cat([v[:, 5:7], 10 * v[:, 7:13]], 1)
    write(verified, 5, drafts_k, drafts_v)
    write(verified, 7, k[:, 7:], v[:, 7:])  # the tokens really there, from the rejected drafts' positions on
    want = raw(one_by_one.data[1:4])  # the null block aside (padding writes there)
    assert torch.equal(raw(prefill.data[1:4]), want) and torch.equal(raw(verified.data[1:4]), want)

    rows = k[0].reshape(2, bs, nkv, hd)  # (blocks, bs, n_kv, hd) as the table holds them
    scale = one_by_one.k_scale(0)[table]  # (2, bs, n_kv)
    torch.testing.assert_close(scale, rows.abs().amax(-1) / qmax, rtol=1e-6, atol=0)
    err = (stored_kv(one_by_one, 0)[0][table] - rows).abs()
    step = scale[..., None] / 2 if fmt == "int8" else rows.abs() * 2**-4 + scale[..., None] * 2**-10
    assert (err <= step * (1 + 1e-5)).all()
    assert float(one_by_one.k(0)[table].float().abs().amax(-1).min()) == qmax  # every row fills its range


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_gemma2_dir", "tiny_qwen3_dir"])
def test_native_decode_steps_over_narrow_kv_match_torch(family, fmt, request) -> None:
    """Prefill, then 6 decode steps of two sequences over a bf16 / int8 pool: the decoder
    stack (native attention reading the stored KV) and torch's path (the gathered context
    widened / the int8 context dequantized in the attention) give the same logits (within
    one stored step of the KV) and leave the same stored KV."""
    path = request.getfixturevalue(family)
    on = load_model(path, dtype="float32", device="cpu", progress=False)
    off = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    if on.native != "on":
        pytest.skip(f"native kernels unavailable: {on.native}")
    cfg = on.config
    pools = [KVPool(32, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, FORMATS[fmt], compute_dtype=torch.float32)
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
            # paths' prefill K/V may round to neighbouring bf16 (int8) values, which moves a tiny
            # model's logits by up to ~1e-3 (Qwen3's q/k norms amplify it); a wrong block or
            # position moves them by O(1)
            torch.testing.assert_close(a, c, atol=2e-3, rtol=2e-3)
            for s, tok in zip(seqs, c.argmax(-1).tolist()):
                s.append(tok)
    # the same stored KV up to one bf16 / int8 step (the paths' float32 K/V differ in the
    # last bits, which may round to neighbouring values; the rounding itself is exact: above),
    # the null block aside: the padding rows' K/V land there and are never read
    for layer in range(cfg.num_layers):
        for a, c in zip(stored_kv(pools[0], layer), stored_kv(pools[1], layer)):
            keep = torch.arange(a.shape[0]) != NULL_BLOCK
            a, c = a[keep], c[keep]
            step = 2**-7 if fmt == "bf16" else c.abs().amax(dim=3, keepdim=True) / 127 * 1.01  # int8: the row's step
            assert ((a - c).abs() <= 1e-5 + step * (c.abs() if fmt == "bf16" else 1)).all()


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
def test_codec_moves_a_narrow_block_as_it_is(fmt) -> None:
    """A bf16 block, or an int8 / fp8 pool's block (values and scales), through the codec with
    no storage dtype (or its own): the same bytes back, its payload half (int8: about a
    quarter of, plus the scales) a float32 block's."""
    from kvserve.cachestore.keys import make_namespace

    pool = KVPool(3, 2, 16, 2, 32, FORMATS[fmt], compute_dtype=torch.float32)
    x = torch.randn(1, 16, 2, 32)
    for layer in range(2):
        pool.update(layer, BatchLayout.build([SeqSlice([1], 0, [1] * 16)], 16), x, x.clone())
    block = pool.export_block(1)
    ns = make_namespace("fp", f"float32/kv={fmt}", 16)
    bh = bytes(32)
    exact = codec.encode(ns, bh, torch.randn(2, 2, 16, 2, 32))
    for storage in (None, FORMATS[fmt]):
        enc = codec.encode(ns, bh, block, storage_dtype=storage)
        out = torch.empty_like(block)
        assert codec.decode_into(enc, ns, bh, out).ok and torch.equal(raw(out), raw(block))
        assert len(enc) < (0.52 if fmt == "bf16" else 0.3) * len(exact)  # int8, fp8: 1/4 + 1/32 (a scale per row of 32)
    if fmt in SCALED:  # never re-encoded: its bytes are not float values alone
        with pytest.raises(ValueError, match="can only be stored as itself"):
            codec.encode(ns, bh, block, storage_dtype=torch.bfloat16)


def _logits(loaded, pool, tokens) -> torch.Tensor:
    """(n, V) float64 logits of ``tokens``, teacher-forced as ``_nll`` runs them: a prefill
    of half, then one-token decode steps reading the rest of the context from ``pool``."""
    n, half = len(tokens), len(tokens) // 2
    table = list(range(1, 1 + -(-n // BS)))
    with torch.inference_mode():
        out = [loaded.model(BatchLayout.build([SeqSlice(table, 0, tokens[:half])], BS), pool, all_logits=True)[0]]
        for p in range(half, n):
            out.append(loaded.model(BatchLayout.build([SeqSlice(table, p, [tokens[p]])], BS), pool)[:1])
    return torch.cat(out)[:n].double()


def test_fp8_kv_output_stays_within_fp8_tolerance_of_transformers(loaded, tiny_llama_dir) -> None:
    """The tiny Llama over an fp8 pool (torch's block-wise attention; the native kernels
    decline fp8) against Hugging Face transformers' float32 forward of the same tokens:
    the exact pool matches transformers to float32 rounding (log-probs within 1e-4), the
    fp8 pool within fp8's tolerance, stated as KL(transformers || fp8) at most 5e-3 nats
    at every position and 1e-3 on average (measured: 1.3e-3 and 4e-4; int8's are ~20x
    smaller: e4m3 keeps 3 mantissa bits), greedy tokens transformers' at >= 85% of the
    positions (measured 92%: a random tiny model has near ties), and the rounding really
    moved the output."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    c = loaded.config
    seqs = prompts(c.vocab_size, [40, 29, 47], seed=17)
    worst_exact, kls, agree = 0.0, [], 0
    for s in seqs:
        with torch.inference_mode():
            hf = torch.log_softmax(ref(torch.tensor([s])).logits[0].double(), -1)  # (n, V)
        nb = 1 + -(-len(s) // BS)
        exact = torch.log_softmax(_logits(loaded, KVPool(nb, c.num_layers, BS, c.num_kv_heads, c.head_dim), s), -1)
        pool = KVPool(nb, c.num_layers, BS, c.num_kv_heads, c.head_dim, torch.float8_e4m3fn,
                      compute_dtype=torch.float32)  # fmt: skip
        fp8 = torch.log_softmax(_logits(loaded, pool, s), -1)
        worst_exact = max(worst_exact, float((exact - hf).abs().max()))
        kls.append((hf.exp() * (hf - fp8)).sum(-1))  # (n,) nats
        agree += int((fp8.argmax(-1) == hf.argmax(-1)).sum())
    kl = torch.cat(kls)
    assert worst_exact < 1e-4
    assert 0 < kl.mean() < 1e-3 and kl.max() < 5e-3, (kl.mean(), kl.max())
    assert agree >= 0.85 * len(kl), (agree, len(kl))


def test_the_native_kernels_decline_an_fp8_pool_and_torch_reads_it(tiny_llama_dir) -> None:
    """Fp8 is read by torch's path alone: the native decode step refuses the pool, so the
    engine's decode steps over it run the reference (the model's forward), whose
    attention is the same with the kernels on or off."""
    from kvserve.service.models.step import build_step, native_step

    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False)
    cfg = loaded.config
    pool = KVPool(8, cfg.num_layers, BS, cfg.num_kv_heads, cfg.head_dim, torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert pool.data.dtype not in ops.KV_POOL_FORMATS and native_step(loaded.model.decoder(), pool) is None
    assert build_step(loaded.model, pool, torch.device("cpu"), max_context=64).name == "torch"

