"""ggml's block types in the native kernels (service/kernels/src/qblocks.cpp).

The quantizers are ggml's reference ones, bit for bit against the ``gguf`` package's where
it has one (Q8_0, Q4_0, Q4_1, Q5_0); Q4_K and Q6_K (which gguf does not quantize) are
checked for what their blocks must be: gguf's dequantization reads them as ours does and
they stay within the type's error. The products equal a float64 reference computed from
the weight's dequantization (``dequantize_blocks``, bit-exact to ggml's) and the input's
per-block int8 rounding, at every ISA level the host runs, one row or many, and a row's
result does not depend on the others. Then the weights served that way: a tiny Llama
quantized to each ``--weight-format`` block type runs on these kernels in its uncached
forward and in the engine's native decode step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.service import kernels
from kvserve.service.kernels import ops
from kvserve.service.kernels.layer import ProductWeights, product
from kvserve.service.models.quant import BLOCK_WEIGHT_FORMATS, QuantLinear, dequantize_blocks

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels unavailable: {kernels.reason()}")

LEVELS = [name for name, _, _ in kernels.ISAS]
BLOCKS = list(ops.BLOCK_FORMATS)
GGUF_QUANTIZES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0"}
K_TYPES = ("q4_k", "q6_k")


@pytest.fixture(params=LEVELS)
def isa(request):
    """Each ISA level this CPU runs, selected for the test (the best again after)."""
    if request.param not in kernels.cpu_isas():
        pytest.skip(f"this CPU does not run {request.param}")
    kernels.select(request.param)
    yield request.param
    kernels.select(kernels.cpu_isas()[0])


def _odd_k(fmt: str) -> int:
    """An odd number of the type's blocks per row."""
    return 3 * 256 if fmt in K_TYPES else 9 * 32


def _weights(fmt: str, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[1] = 0.0  # an all-zero row: zero scales, no division by zero
    w[2, : K // 2] *= 40  # rows of very different ranges
    return w, ops.quantize_blocks(w, fmt)


def _input_rounding(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """What the kernels multiply by for input x (rows, K): the 32-value types' per-32 int8
    (scale amax / 127, round half to even), the K types' ggml Q8_K per 256 (scale
    -127 / the signed max, round half to even, capped at 127); the same float32 operations."""
    rows, K = x.shape
    if fmt in K_TYPES:
        xb = x.view(rows, K // 256, 256)
        mx = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))  # the first value of largest magnitude
        iscale = torch.full_like(mx, -127.0) / mx  # float32 division (a scalar numerator rounds otherwise)
        q = torch.round(iscale * xb).clamp(max=127)
        d = torch.full_like(mx, 1.0) / iscale
        return torch.where(mx == 0, 0.0, q.double() * d.double()).view(rows, K)
    xb = x.view(rows, K // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.round(xb * torch.where(d > 0, torch.full_like(d, 1.0) / d, 0.0))
    return (q.double() * d.double()).view(rows, K)


def _reference(x: torch.Tensor, raw: torch.Tensor, fmt: str, bias: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """(the float64 product of the rounded input and the dequantized weight (+ bias), the
    scale of its terms: float32 sums' tolerance is relative to it)."""
    xq, w = _input_rounding(x, fmt), dequantize_blocks(raw, fmt).double()
    ref = xq @ w.T + (0 if bias is None else bias.double())
    return ref, float((xq.abs() @ w.abs().T).max())


@pytest.mark.parametrize("fmt", list(GGUF_QUANTIZES))
@pytest.mark.parametrize("K", [32, 288, 2048])
def test_quantizer_is_ggmls_bit_for_bit(fmt: str, K: int) -> None:
    from gguf import GGMLQuantizationType, quants

    w, raw = _weights(fmt, 37, K, seed=K)
    want = quants.quantize(w.numpy(), GGMLQuantizationType[GGUF_QUANTIZES[fmt]])
    assert raw.dtype == torch.uint8 and raw.shape == (37, ops.block_row_bytes(fmt, K))
    assert np.array_equal(raw.numpy(), want)


@pytest.mark.parametrize("fmt,bound", [("q4_k", 0.01), ("q6_k", 0.001)])
def test_k_quantizers_write_blocks_ggml_reads_within_the_types_error(fmt: str, bound: float) -> None:
    """gguf's dequantization of our blocks is ours (the layout is ggml's), a zero row
    quantizes to zeros, and the relative squared error is the type's (measured on Gaussian
    weights: Q4_K 0.5%, Q6_K 0.03%)."""
    from gguf import GGMLQuantizationType, quants

    w, raw = _weights(fmt, 40, 512, seed=3)
    deq = dequantize_blocks(raw, fmt)
    assert np.array_equal(quants.dequantize(raw.numpy(), GGMLQuantizationType[fmt.upper()]), deq.numpy())
    assert torch.equal(deq[1], torch.zeros(512))
    rel = float(((deq - w)[3:] ** 2).mean() / (w[3:] ** 2).mean())
    assert 0 < rel < bound, rel
    assert float(((deq - w)[2, :256] ** 2).mean() / (w[2, :256] ** 2).mean()) < bound  # the block scale follows the range


@pytest.mark.parametrize("fmt", BLOCKS)
@pytest.mark.parametrize("rows", [1, 3, 64, 200])
def test_block_product_is_its_dequantized_weight_times_the_rounded_input(isa, fmt: str, rows: int) -> None:
    K, N = _odd_k(fmt), 45  # N: no whole number of 4-row tiles
    _, raw = _weights(fmt, N, K, seed=rows)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, K, generator=g)
    x[0, :32] = 0.0  # an all-zero input block
    bias = torch.randn(N, generator=g)
    got = ops.gemv_blocks(x, raw, fmt, bias)
    ref, scale = _reference(x, raw, fmt, bias)
    assert got.shape == (rows, N) and got.dtype == torch.float32
    assert float((got.double() - ref).abs().max()) <= 1e-6 * scale
    acc = torch.randn(rows, N, generator=g)
    summed = ops.gemv_blocks(x, raw, fmt, bias, out=acc.clone(), accumulate=True)
    torch.testing.assert_close(summed, acc + got, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("fmt", BLOCKS)
def test_a_rows_result_does_not_depend_on_the_other_rows(isa, fmt: str) -> None:
    K = _odd_k(fmt)
    _, raw = _weights(fmt, 21, K, seed=5)
    x = torch.randn(70, K, generator=torch.Generator().manual_seed(6))
    whole = ops.gemv_blocks(x, raw, fmt)
    for r in (0, 17, 69):
        assert torch.equal(ops.gemv_blocks(x[r : r + 1], raw, fmt), whole[r : r + 1])
    assert torch.equal(ops.gemv_blocks(x[5:9], raw, fmt), whole[5:9])


def test_a_mixed_product_is_its_parts_side_by_side(isa) -> None:
    """A chain of parts of different formats (a Q4_K_M file's fused q/k/v) in one call: each
    part's columns are that part's product with its rows of the bias."""
    parts = [(fmt, _weights(fmt, n, 256, seed=n)[1], torch.randn(n)) for fmt, n in (("q4_k", 12), ("q6_k", 8), ("q8_0", 5))]
    chain = ProductWeights.chain([ProductWeights.of(raw, None, b, fmt) for fmt, raw, b in parts])
    assert chain.fmt == "chain" and chain.shape == (25, 256)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(7))
    want = torch.cat([ops.gemv_blocks(x, raw, fmt, b) for fmt, raw, b in parts], dim=-1)
    assert torch.equal(product(chain, x), want)


def test_block_arguments_are_checked_before_any_native_call() -> None:
    _, raw = _weights("q4_0", 8, 64, seed=0)
    with pytest.raises(ValueError, match="features"):
        ops.gemv_blocks(torch.zeros(1, 96), raw, "q4_0")
    with pytest.raises(ValueError, match="unknown block type 'q3_k'"):
        ops.gemv_blocks(torch.zeros(1, 64), raw, "q3_k")
    with pytest.raises(ValueError, match="not a whole number of its 34-byte blocks"):
        ops.gemv_blocks(torch.zeros(1, 64), raw, "q8_0")
    with pytest.raises(ValueError, match="uint8"):
        ops.gemv_blocks(torch.zeros(1, 64), raw.view(torch.int8), "q4_0")
    with pytest.raises(ValueError, match="out"):
        ops.gemv_blocks(torch.zeros(2, 64), raw, "q4_0", out=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="not a whole number of its 256-value blocks"):
        ops.quantize_blocks(torch.zeros(4, 288), "q6_k")
    assert ProductWeights.of(raw, None, None, "q4_k") is None  # 36 bytes: no whole Q4_K block


# ---- served: --weight-format in ggml's block types ---------------------------------------------------


@pytest.fixture(scope="module")
def llama256(tmp_path_factory):
    """A tiny Llama whose rows are whole 256-value blocks (the K types apply everywhere)."""
    from tests.fixtures.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("qblocks") / "m", seed=21, hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.mark.parametrize("fmt", list(BLOCK_WEIGHT_FORMATS))
def test_a_block_format_model_runs_on_the_kernels_near_its_dequantized_weights(llama256, fmt: str) -> None:
    """Every product is served from its blocks by the kernels; the logits are those of the same
    weights dequantized and run by torch in float32, but for the inputs' 8-bit rounding (the
    relative L2 error below 6%, measured 2.3-3.3%; the argmax the same on 85% of positions)."""
    from kvserve.service.models.loading import load_model

    lm = load_model(llama256, progress=False, weight_format=fmt)
    blocks = [m for m in lm.model.modules() if isinstance(m, QuantLinear)]
    assert lm.native == "on" and blocks and all(m.kernel is not None for m in blocks)
    want = {BLOCK_WEIGHT_FORMATS[fmt]} | ({"q6_k", "mixed"} if fmt == "q4_k_m" else set())
    assert want <= {m.fmt for m in blocks} <= want | {"q6_k"}  # the head is Q6_K in the 4-bit files
    ids = torch.randint(3, lm.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = lm.model.forward_nocache(ids)
        for m in blocks:  # the same weights through torch: dequantized per call
            m.kernel = None
        ref = lm.model.forward_nocache(ids)
    rel = float((got - ref).norm() / ref.norm())
    assert 0 < rel < 0.06, rel
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.85


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k_m"])
def test_the_engine_decodes_a_block_format_model_as_its_uncached_forward(llama256, fmt: str) -> None:
    """The engine's native decode step (kv_decode_forward over the blocks, a Q4_K_M file's
    mixed q/k/v as one chained product) gives the greedy tokens of the same model's uncached
    forward over the whole sequence."""
    from kvserve.service.models.loading import load_model
    from tests.fixtures.engine import finished, greedy_reference, make_engine, prompts, req, run

    lm = load_model(llama256, progress=False, weight_format=fmt)
    engine = make_engine(lm)
    assert engine.runner.step.name == "native"
    prompt = prompts(lm.config.vocab_size, [21])[0]
    events = run(engine, [req("a", prompt, n=12)])
    assert finished(events["a"]).output_token_ids == greedy_reference(lm.model, prompt, 12)
