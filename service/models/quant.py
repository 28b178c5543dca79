"""Served weight formats: the loaded model's linear layers re-encoded at load time.

    exact  the checkpoint's weights in the compute dtype (``--dtype``), untouched
    bf16   weights stored as bfloat16 (half the bytes); products in bfloat16
    int8   weight-only int8, symmetric, one scale per output channel (a quarter of the
           bytes); products by torch's ``_weight_int8pack_mm`` with bfloat16 activations
    w8a8   the same int8 weights, activations quantized too and the product done in
           integers (CPU only): the fast int8 path

With the native kernels (``service/kernels/``, CPU, float32 compute: the default on
x86-64 with AVX2) every 1..64-row product reads the stored weight directly: bf16
and int8 with float32 activations (weight-only: the activations are not rounded), w8a8
with the activations quantized per block of 32 values (symmetric int8, one float scale
per block: llama.cpp's Q8_0 activations) and integer dot products. Without them, bf16
and int8 run torch's kernels with bfloat16 activations as below, and w8a8 runs
fbgemm's dynamic int8 linear with per-row 7-bit activations.

Decode reads every weight once per step, so its speed follows the weight bytes. Only
the matmul weights change (every ``layers.Linear``, lm_head included); embeddings,
norms, attention and the KV cache stay in the compute dtype, and each layer's output is
cast back to it, so the residual stream keeps full precision. Activations go into the
product as bfloat16: the int8 kernel is ~2x slower with float32 activations than the
float32 matmul, and several times faster with bfloat16 ones (docs/benchmarks.md).

From ``DEQUANT_ROWS`` rows up (prefill, compute-bound), bf16 and int8 products with the
native kernels and without AVX-512 BF16 run their GEMM (``kernels/src/gemm.cpp``): the
stored weight widened to float32 in cache-sized panels, each reused by every prompt row,
so it is read at its own size and never copied whole (float32 activations, as decode).
Otherwise they run a GEMM on the weight widened for the call: to bfloat16 where the CPU has AVX-512 BF16
(``BF16_GEMM``: oneDNN's bfloat16 GEMM, ~2.3x float32's there; the activations and the
product's output are rounded to bfloat16, as on CUDA and as llama.cpp rounds F16's
activations; int8 values are exact in bfloat16, the scales are applied in float32 after),
else to the compute dtype (without AVX-512 BF16 torch's bf16/int8 kernels are several
times slower than float32 GEMM).

The format is part of the model fingerprint (``format_fingerprint``): KV computed with
other weights is never restored. New model families get this for free as long as their
projections are ``layers.Linear`` modules.
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kernels.layer import MAX_ROWS, ProductWeights, product, product_gemm
from .layers import Linear, UsesKernels

WEIGHT_FORMATS = ("exact", "bf16", "int8", "w8a8")
# From this many rows (prefill chunks) bf16/int8 products run on the widened weight in
# the compute dtype: same weights, the compute dtype's fast GEMM.
DEQUANT_ROWS = 64


def _has_bf16_gemm() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


BF16_GEMM = _has_bf16_gemm()  # CPU prefill of bf16/int8 as a bfloat16 GEMM (module docstring)
# Without it, with the native kernels: prefill of bf16/int8 by their GEMM (module docstring).
# A module switch for benchmarks (bench/bench_kernels.py's prefill rows A/B it); always on.
NATIVE_GEMM = True


class QuantLinear(nn.Module, UsesKernels):
    """A ``Linear`` whose weight is stored in a smaller format; same call, same output dtype.

    int8 / w8a8: ``weight`` (out, in) int8 and ``scales`` (out,) bfloat16 with
    W ~= weight * scales[:, None]. bf16: ``weight`` (out, in) bfloat16, ``scales`` None.
    ``bias`` stays in the compute dtype and is added after the product.

    w8a8 runs fbgemm's dynamic int8 linear, which quantizes its whole input with one
    scale and zero point. To keep each row's numerics independent of the other rows in
    the batch (a seeded request gives the same tokens whatever runs beside it), every
    row is first divided by its own absmax, and one constant row holding +1 and -1 is
    appended, so the quantization range is always exactly [-1, 1]; the outputs are
    multiplied back by the row absmax.
    """

    def __init__(self, fmt: str, weight: Tensor, scales: Tensor | None, bias: Tensor | None) -> None:
        super().__init__()
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias)
        # torch's int8 weight-only kernel runs on the CPU (and, in recent builds, CUDA)
        self._packed_kernel = fmt == "int8" and weight.device.type == "cpu"
        self._fbgemm = None
        self.kernel: ProductWeights | None = None  # the weight as the native product reads it (``use_kernels``)
        if fmt == "w8a8":
            if weight.device.type != "cpu":
                raise ValueError("weight format w8a8 runs on the CPU only (use int8 or bf16 on CUDA)")
            with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm still packs them
                warnings.simplefilter("ignore", UserWarning)
                qw = torch._make_per_channel_quantized_tensor(
                    weight, scales.double(), torch.zeros_like(scales, dtype=torch.long), 0
                )
            self._fbgemm = torch.ops.quantized.linear_prepack(qw, None)
            self._range_row = torch.zeros(1, self.in_features)  # (1, in): fixes the range at [-1, 1]
            self._range_row[0, 0], self._range_row[0, -1] = 1.0, -1.0

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str) -> "QuantLinear":
        w = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if fmt == "bf16":
            return cls(fmt, w.to(torch.bfloat16).contiguous(), None, bias)
        if fmt in ("int8", "w8a8"):
            q, scales = quantize_int8(w)
            return cls(fmt, q, scales, bias)
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")

    def dequantized(self) -> Tensor:
        """The weight this layer multiplies by, in float32 (out, in)."""
        w = self.weight.float()  # a new tensor: scaled in place
        return w.mul_(self.scales.float()[:, None]) if self.scales is not None else w

    def kernel_weights(self) -> ProductWeights | None:
        """The stored weight as the native product reads it: bfloat16, or int8 with float32
        scales and float32 activations (int8), or quantized per block of 32 (w8a8, when
        in_features is a multiple of 32; else as int8)."""
        scales = None if self.scales is None else self.scales.float().contiguous()
        fmt = {"bf16": "bf16", "int8": "i8", "w8a8": "q8" if self.in_features % 32 == 0 else "i8"}[self.fmt]
        return ProductWeights.of(self.weight, scales, self.bias, fmt)

    def use_kernels(self) -> None:
        self.kernel = self.kernel_weights()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        if self.kernel is not None and rows <= MAX_ROWS:
            return product(self.kernel, x)
        if self._fbgemm is not None:
            return self._forward_w8a8(x, rows)
        if rows >= DEQUANT_ROWS and x.device.type == "cpu":
            # prefill: compute-bound (module docstring)
            if self.kernel is not None and NATIVE_GEMM and not BF16_GEMM:
                return product_gemm(self.kernel, x)  # widened per cache-sized panel
            if BF16_GEMM and x.dtype == torch.float32:
                y = F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).float()  # (.., out)
                if self.scales is not None:
                    y.mul_(self.scales.float())
                return y if self.bias is None else y.add_(self.bias)
            # torch's bf16/int8 kernels have no fast many-row path on CPUs without AVX-512
            # BF16 (a 512-token bf16 prefill ran 5x slower than float32)
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        xa = x.reshape(rows, self.in_features).to(torch.bfloat16)  # (rows, in)
        if self._packed_kernel:
            y = torch._weight_int8pack_mm(xa, self.weight, self.scales)  # (rows, out) bf16
        elif self.fmt == "int8":
            y = F.linear(xa, self.weight.to(xa.dtype)) * self.scales
        else:
            y = F.linear(xa, self.weight)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _forward_w8a8(self, x: Tensor, rows: int) -> Tensor:
        x2 = x.reshape(rows, self.in_features).float()  # (rows, in)
        amax = x2.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)  # (rows, 1)
        xn = torch.cat((x2 / amax, self._range_row))  # (rows + 1, in), values in [-1, 1]
        y = torch.ops.quantized.linear_dynamic(xn, self._fbgemm, True)[:rows].mul_(amax)  # (rows, out)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}"


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q (out, in) int8, scales (out,) bfloat16).

    The scale is rounded to bfloat16 first and the weights quantized against that
    rounded scale, so q * scale is the nearest grid point of the scale actually used."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(torch.bfloat16)  # (out,)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def quantize_model(model: nn.Module, fmt: str, progress: bool = False) -> int:
    """Replace every ``layers.Linear`` of ``model`` by a ``QuantLinear`` in ``fmt``, in
    place; returns how many were replaced. ``exact`` changes nothing."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "exact":
        return 0
    from tqdm import tqdm

    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, linear in tqdm(targets, desc=f"weights to {fmt}", unit="matrix", disable=not progress):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantLinear.from_linear(linear, fmt))
    return len(targets)


def format_fingerprint(fingerprint: str, fmt: str) -> str:
    """The served model's fingerprint: the checkpoint's, unchanged for ``exact``, else
    mixed with the weight format (and the quantizer's version) so KV never crosses."""
    if fmt == "exact":
        return fingerprint
    return hashlib.sha256(f"kvserve-weight-format-v1:{fmt}:{fingerprint}".encode()).hexdigest()
