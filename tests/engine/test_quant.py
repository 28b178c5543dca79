"""Served weight formats (service/models/quant.py) and fused projections (layers.py).

Tolerances, on the random tiny checkpoints (logits of 4 x 24 tokens, uncached forward)
against the exact float32 model: relative L2 error of the logits below 2% for bf16, 4%
for int8 and 8% for w8a8 (measured: 0.6-0.8%, 1.3-1.8%, 3.3-4.1%), the same argmax on at
least 95% (bf16), 85% (int8) and 80% (w8a8) of the positions (measured: 90-99%). Quality on real-sized models (held-out
loss, greedy agreement over 100+ prompts) is in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.service.kv.cache import KVPool
from kvserve.service.models.layers import Linear, fuse_linears
from kvserve.service.models.loading import load_model
from kvserve.service.models.quant import QuantLinear, quantize_int8
from tests.engine.test_models import greedy_nocache, greedy_paged, prompt_ids, trivial_tables

BLOCK = 4
TOLERANCE = {"bf16": (0.02, 0.95), "int8": (0.04, 0.85), "w8a8": (0.08, 0.80)}  # (relative L2 error, argmax agreement)


@pytest.fixture(scope="module")
def exact_logits(request: pytest.FixtureRequest):
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(variant: str) -> tuple[torch.Tensor, torch.Tensor]:
        if variant not in cache:
            lm = load_model(request.getfixturevalue(variant), progress=False)
            ids = torch.randint(3, lm.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                cache[variant] = ids, lm.model.forward_nocache(ids)
        return cache[variant]

    return get


@pytest.mark.parametrize("fmt", ["bf16", "int8", "w8a8"])
@pytest.mark.parametrize("variant", ["tiny_llama_dir", "tiny_gpt2_dir"])
def test_format_logits_within_tolerance_of_exact(request, exact_logits, variant: str, fmt: str) -> None:
    ids, ref = exact_logits(variant)
    lm = load_model(request.getfixturevalue(variant), progress=False, weight_format=fmt)
    assert lm.weight_format == fmt
    assert all(not isinstance(m, Linear) for m in lm.model.modules())  # every projection re-encoded
    with torch.inference_mode():
        got = lm.model.forward_nocache(ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    max_rel, min_agree = TOLERANCE[fmt]
    rel = float((got - ref).norm() / ref.norm())
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    assert 0 < rel < max_rel, rel  # > 0: the weights really changed
    assert agree >= min_agree, agree


@pytest.mark.parametrize("fmt", ["bf16", "int8", "w8a8"])
def test_quantized_model_paged_decode_equals_its_uncached_decode(tiny_llama_dir, fmt: str) -> None:
    lm = load_model(tiny_llama_dir, progress=False, weight_format=fmt)
    c = lm.config
    pool = KVPool(64, c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, lm.dtype, lm.device)
    prompts = [prompt_ids(c.vocab_size, 9, seed=3), prompt_ids(c.vocab_size, 5, seed=4)]
    got = greedy_paged(lm.model, pool, prompts, 16, trivial_tables([9 + 16, 5 + 16]))
    assert got == [greedy_nocache(lm.model, p, 16) for p in prompts]


def test_fingerprint_covers_the_weight_format(tiny_llama_dir) -> None:
    prints = {fmt: load_model(tiny_llama_dir, progress=False, weight_format=fmt).fingerprint
              for fmt in ("exact", "bf16", "int8", "w8a8")}
    assert len(set(prints.values())) == 4 and all(len(p) == 64 for p in prints.values())
    assert load_model(tiny_llama_dir, progress=False, weight_format="int8").fingerprint == prints["int8"]
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        load_model(tiny_llama_dir, progress=False, weight_format="int3")


@pytest.mark.parametrize("rows", [1, 3, 8, 100])  # 100: the prefill path (DEQUANT_ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_computes_its_dequantized_weight(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    ref = torch.nn.Linear(96, 40, bias=bias)
    q = QuantLinear.from_linear(ref, "int8")
    assert q.weight.dtype == torch.int8 and q.scales.shape == (40,)
    # per-channel grid: every weight within half a step of its dequantized value
    err = (q.dequantized() - ref.weight).abs()
    assert bool((err <= q.scales.float()[:, None] / 2 + 1e-6).all())
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        got = q(x)
        want = torch.nn.functional.linear(x.bfloat16().float(), q.dequantized(), ref.bias)
    assert got.shape == (2, rows, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.03, rtol=0.02)  # bfloat16 products


def test_int8_zero_rows_and_extremes_quantize_cleanly() -> None:
    w = torch.zeros(3, 8)
    w[1] = torch.linspace(-5, 5, 8)
    w[2, 0] = 1e30
    q, s = quantize_int8(w)
    assert torch.equal(q[0], torch.zeros(8, dtype=torch.int8))  # an all-zero row stays zero, no NaN
    assert int(q[1].min()) == -127 and int(q[1].max()) == 127
    assert torch.isfinite(s.float()).all()


def test_fused_linear_equals_its_parts() -> None:
    torch.manual_seed(0)
    parts = [Linear(32, n, bias=True) for n in (16, 8, 8)]
    fused = fuse_linears(parts)
    x = torch.randn(1, 5, 32)
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], -1), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="in_features or bias"):
        fuse_linears([Linear(32, 4), Linear(16, 4)])


def test_w8a8_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    q = QuantLinear.from_linear(torch.nn.Linear(64, 32), "w8a8")
    row = torch.randn(1, 64)
    others = torch.randn(5, 64) * 50  # much larger rows: a shared activation scale would coarsen `row`
    with torch.inference_mode():
        alone = q(row)
        batched = q(torch.cat([others[:2], row, others[2:]]))[2:3]
        want = torch.nn.functional.linear(row, q.dequantized(), q.bias)
    assert torch.equal(alone, batched)
    torch.testing.assert_close(alone, want, atol=0.05, rtol=0.05)  # 7-bit activations


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("bf16_gemm", [False, True])
def test_prefill_products_widen_the_weight_to_bfloat16_only_where_the_cpu_has_a_bf16_gemm(
        monkeypatch, fmt: str, bf16_gemm: bool) -> None:  # fmt: skip
    """From DEQUANT_ROWS rows: without AVX-512 BF16 the weight is widened to float32 and
    the product is float32's (tight); with it, a bfloat16 GEMM (activations and output
    rounded to bfloat16: within bfloat16's error of the float64 product)."""
    from kvserve.service.models import quant

    if bf16_gemm and not quant._has_bf16_gemm():
        pytest.skip("this CPU has no AVX-512 BF16")
    monkeypatch.setattr(quant, "BF16_GEMM", bf16_gemm)
    torch.manual_seed(5)
    ref = torch.nn.Linear(256, 48, bias=True)
    q = QuantLinear.from_linear(ref, fmt)
    x = torch.randn(1, quant.DEQUANT_ROWS + 7, 256)
    with torch.inference_mode():
        got = q(x)
    want = x.double() @ q.dequantized().double().T + ref.bias.detach().double()
    assert got.dtype == torch.float32 and got.shape == (1, quant.DEQUANT_ROWS + 7, 48)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    if bf16_gemm:
        assert 1e-6 < err < 2e-2  # bfloat16 activations and output: rounded, not float32-exact
    else:
        assert err < 1e-5


# ---- ggml's block types (QuantLinear.from_blocks: a GGUF tensor's rows as stored) -------------------

GGML = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q4_k": "Q4_K", "q6_k": "Q6_K"}


def ggml_rows(fmt: str, N: int, K: int, seed: int = 0):
    """(float rows, their blocks) in block type ``fmt``: the gguf package's own quantizer
    where it has one; for the K-quants (it has none) random bytes with finite, small fp16
    scales, every other bit pattern a valid block."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from kvserve.service.kernels.ops import BLOCK_FORMATS

    g = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[GGML[fmt]]
    if fmt in ("q4_k", "q6_k"):
        values, nbytes = BLOCK_FORMATS[fmt]
        raw = g.integers(0, 256, (N, K // values, nbytes), dtype=np.uint8)
        for at in ((0, 2) if fmt == "q4_k" else (208,)):  # d (and dmin): finite fp16
            raw[..., at : at + 2] = (g.standard_normal((N, K // values, 1)) * 0.01).astype(np.float16).view(np.uint8)
        return None, torch.from_numpy(raw.reshape(N, -1))
    w = g.standard_normal((N, K)).astype(np.float32)
    return torch.from_numpy(w), torch.from_numpy(quantize(w, qtype))


@pytest.mark.parametrize("fmt", list(GGML))
def test_block_dequantization_is_ggmls_bit_for_bit(fmt: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from kvserve.service.models.quant import dequantize_blocks

    _, raw = ggml_rows(fmt, 9, 512, seed=1)
    want = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[GGML[fmt]]))
    got = dequantize_blocks(raw, fmt)
    assert got.dtype == torch.float32 and got.shape == (9, 512)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("fmt", list(GGML))
@pytest.mark.parametrize("rows", [1, 5, 100])
def test_a_block_product_without_kernels_is_its_dequantized_weights(fmt: str, rows: int) -> None:
    """from_blocks (the GGUF loader's constructor): the stored rows as they are, shape and
    bias kept; without the native kernels the product is F.linear on ggml's dequantized
    weight."""
    from kvserve.service.models.quant import dequantize_blocks

    _, raw = ggml_rows(fmt, 24, 256, seed=rows)
    bias = torch.randn(24)
    q = QuantLinear.from_blocks(fmt, raw, (24, 256), bias)
    assert (q.in_features, q.out_features, q.fmt) == (256, 24, fmt) and q.weight.data_ptr() == raw.data_ptr()
    x = torch.randn(rows, 256)
    with torch.inference_mode():
        got = q(x)
    assert torch.equal(got, torch.nn.functional.linear(x, dequantize_blocks(raw, fmt), bias))


def test_from_blocks_refuses_rows_that_are_not_the_shapes_blocks() -> None:
    _, raw = ggml_rows("q4_0", 8, 64)
    with pytest.raises(ValueError, match=r"q4_0 weight of shape \(8, 128\): expected \(8, 72\) uint8 blocks, got \(8, 36\) uint8"):
        QuantLinear.from_blocks("q4_0", raw, (8, 128))
    with pytest.raises(ValueError, match="expected .* got .* int8"):
        QuantLinear.from_blocks("q4_0", raw.view(torch.int8), (8, 64))
    with pytest.raises(ValueError, match="not a whole number of its 256-value blocks"):
        QuantLinear.from_blocks("q4_k", raw, (8, 64))
    with pytest.raises(ValueError, match="unknown block type 'q3_k'"):
        QuantLinear.from_blocks("q3_k", raw, (8, 64))
    with pytest.raises(ValueError, match="bias of shape"):
        QuantLinear.from_blocks("q4_0", raw, (8, 64), torch.zeros(7))


def test_block_products_side_by_side_are_their_parts_one_type_or_several() -> None:
    """QuantLinear.cat: q/k (Q4_K) and v (Q6_K) as one product whose output is theirs side
    by side; rows of one type joined into one stored weight."""
    parts = [QuantLinear.from_blocks(f, ggml_rows(f, n, 256, seed=n)[1], (n, 256), torch.randn(n))
             for f, n in (("q4_k", 16), ("q4_k", 8), ("q6_k", 8))]  # fmt: skip
    fused = QuantLinear.cat(parts)
    assert fused.fmt == "mixed" and [p.fmt for p in fused.parts] == ["q4_k", "q6_k"]
    assert (fused.out_features, fused.in_features) == (32, 256) and fused.parts[0].weight.shape == (24, 144)
    x = torch.randn(3, 256)
    with torch.inference_mode():
        assert torch.equal(fused(x), torch.cat([p(x) for p in parts], -1))
    same = QuantLinear.cat(parts[:2])
    assert same.fmt == "q4_k" and same.weight.shape == (24, 144)
    with pytest.raises(ValueError, match="in_features or bias"):
        QuantLinear.cat([parts[0], QuantLinear.from_blocks("q4_k", parts[1].weight, (8, 256))])
