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
(``BF16_GEMM``: oneDNN's bfloat16 GEMM, faster than float32's there: docs/benchmarks-log.md,
"Measurement notes"; the activations and the product's output are rounded to bfloat16, as on CUDA and as llama.cpp rounds F16's
activations; int8 values are exact in bfloat16, the scales are applied in float32 after),
else to the compute dtype (without AVX-512 BF16 torch's bf16/int8 kernels are several
times slower than float32 GEMM).

ggml's block types (llama.cpp's GGUF weights), each row stored in blocks of 32 or 256
values with their own scales, byte for byte as ggml lays them out (``BLOCK_TYPES``):

    q8_0    Q8_0 everywhere (8.5 bits per weight)
    q6_k    Q6_K (6.56 bits), the head Q8_0 where its rows are no whole number of 256 blocks
    q4_k_m  Q4_K (4.5 bits); Q6_K for v and down in the first and last eighth of the layers
            and every third between, and for the head
    q4_1    Q4_1 (5 bits), the head Q6_K
    q4_0    Q4_0 (4.5 bits), the head Q6_K

each the block type llama.cpp's ``llama-quantize`` gives every tensor of that file type
(src/llama-quant.cpp, no importance matrix; a K-quant on rows that are no whole number of
256-value blocks falls back as there: Q4_K to Q5_0, Q6_K to Q8_0), quantized by ggml's own
reference algorithms ported to the kernels (``kv_quantize_blocks``, rows in parallel; bit
for bit the ``gguf`` package's quantizers for Q8_0, Q4_0, Q4_1 and Q5_0, which has none for
the K types). Quantizing needs the kernels' library: without it these formats are refused
at load. A GGUF file's tensors are the same blocks (``QuantLinear.from_blocks``). The
products run on the native kernels (``kernels/src/qblocks.cpp``) with the activations
quantized per block as llama.cpp's dot products do: the 32-value types' input as int8 per
32 values (ggml's Q8_0, its scale kept in float32), the K types' per 256 (ggml's Q8_K, with
its sums per 16), integer dot products per block, one float multiply-add per block; the
same arithmetic for one row and a prompt's many, so a row's result never depends on the
batch. Where the kernels do not run the model (``native_kernels`` off, a bfloat16 model) a
block product dequantizes its weight per call (slow). CPU only.

The format is part of the model fingerprint (``format_fingerprint``): KV computed with
other weights is never restored. New model families get this for free as long as their
projections are ``layers.Linear`` modules.
"""

from __future__ import annotations

import hashlib
import re
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..kernels import ops
from ..kernels.layer import MAX_ROWS, ProductWeights, product, product_gemm
from ..kernels.ops import BLOCK_FORMATS, block_row_bytes, block_row_values
from .layers import Linear, UsesKernels

BLOCK_TYPES = tuple(BLOCK_FORMATS)  # ggml's block types a QuantLinear stores (kernels/ops.py)
# --weight-format values in ggml's block types -> the file type's block type (module docstring)
BLOCK_WEIGHT_FORMATS = {"q8_0": "q8_0", "q6_k": "q6_k", "q4_k_m": "q4_k", "q4_1": "q4_1", "q4_0": "q4_0"}
WEIGHT_FORMATS = ("exact", "bf16", "int8", "w8a8", *BLOCK_WEIGHT_FORMATS)
# A K-quant on rows that are no whole number of its 256-value blocks: llama-quantize's fallback.
K_FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}
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

    ggml's block types (``BLOCK_TYPES``): ``weight`` (out, bytes per row) uint8, each row's
    blocks exactly as ggml stores them (``from_blocks``: a GGUF tensor's bytes), ``scales``
    None; ``fmt`` "mixed": rows in ``parts`` of different block types, side by side
    (``cat``: a fused q/k/v whose v is another type, as in Q4_K_M files).
    """

    def __init__(self, fmt: str, weight: Tensor | None, scales: Tensor | None, bias: Tensor | None,
                 parts: list[QuantLinear] | None = None) -> None:
        super().__init__()
        self.fmt = fmt
        if fmt == "mixed":  # rows in parts of different block types (``cat``)
            self.parts = nn.ModuleList(parts)
            self.out_features = sum(p.out_features for p in parts)
            self.in_features = parts[0].in_features
        elif fmt in BLOCK_TYPES:  # (out, bytes per row) uint8, ggml's blocks
            self.out_features, self.in_features = weight.shape[0], block_row_values(fmt, weight.shape[1])
        else:
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
        if fmt in BLOCK_TYPES:
            return cls(fmt, quantize_blocks(w, fmt), None, bias)
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")

    @classmethod
    def from_blocks(cls, fmt: str, raw: Tensor, shape: tuple[int, int], bias: Tensor | None = None) -> QuantLinear:
        """A product over a weight stored in one of ggml's block types, as a GGUF file holds
        it: ``fmt`` one of ``BLOCK_TYPES``, ``raw`` (out_features, bytes per row) uint8 (the
        rows exactly as ggml stores them: GGUF's (in, out) tensor of that type, as read),
        ``shape`` (out_features, in_features), ``bias`` (out_features,) or None.
        ValueError naming what does not fit."""
        if fmt not in BLOCK_TYPES:
            raise ValueError(f"unknown block type {fmt!r}; one of {', '.join(BLOCK_TYPES)}")
        out_features, in_features = shape
        want = (out_features, block_row_bytes(fmt, in_features))
        if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
            raise ValueError(f"{fmt} weight of shape {tuple(shape)}: expected {want} uint8 blocks, "
                             f"got {tuple(raw.shape)} {str(raw.dtype).removeprefix('torch.')}")  # fmt: skip
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {out_features} outputs")
        return cls(fmt, raw.contiguous(), None, bias)

    @classmethod
    def cat(cls, linears: list[QuantLinear]) -> QuantLinear:
        """One product computing ``linears`` (block types or mixed) side by side, its output
        their outputs concatenated on the last dim (``layers.fuse_linears``' contract): rows
        of one block type become one stored weight, rows of different types parts of one
        product (each run as stored). All or none have a bias; the weights are copied."""
        flat = [p for q in linears for p in (q.parts if q.fmt == "mixed" else [q])]
        if not flat or any(q.fmt not in BLOCK_TYPES for q in flat):
            raise ValueError("QuantLinear.cat: block types only")
        if len({q.in_features for q in flat}) != 1 or len({q.bias is None for q in linears}) != 1:
            raise ValueError("QuantLinear.cat: the products differ in in_features or bias")
        bias = None if linears[0].bias is None else torch.cat([q.bias for q in linears])
        runs: list[list[QuantLinear]] = []
        for q in flat:  # consecutive rows of one type: one part
            if runs and runs[-1][0].fmt == q.fmt:
                runs[-1].append(q)
            else:
                runs.append([q])
        parts = [cls(r[0].fmt, torch.cat([q.weight for q in r]), None, None) for r in runs]
        if len(parts) == 1:
            return cls(parts[0].fmt, parts[0].weight, None, bias)
        return cls("mixed", None, None, bias, parts)

    def dequantized(self) -> Tensor:
        """The weight this layer multiplies by, in float32 (out, in)."""
        if self.fmt == "mixed":
            return torch.cat([p.dequantized() for p in self.parts])
        if self.fmt in BLOCK_TYPES:
            return dequantize_blocks(self.weight, self.fmt)
        w = self.weight.float()  # a new tensor: scaled in place
        return w.mul_(self.scales.float()[:, None]) if self.scales is not None else w

    def kernel_weights(self) -> ProductWeights | None:
        """The stored weight as the native product reads it: bfloat16, or int8 with float32
        scales and float32 activations (int8), or quantized per block of 32 (w8a8, when
        in_features is a multiple of 32; else as int8); ggml's blocks as stored, their
        activations quantized as llama.cpp's dot products do (a mixed product's parts one
        after the other, each with its rows of the bias)."""
        if self.fmt == "mixed":
            views, at = [], 0
            for p in self.parts:
                b = None if self.bias is None else self.bias[at : at + p.out_features]
                views.append(ProductWeights.of(p.weight, None, b, p.fmt))
                at += p.out_features
            return None if any(v is None for v in views) else ProductWeights.chain(views)
        if self.fmt in BLOCK_TYPES:
            return ProductWeights.of(self.weight, None, self.bias, self.fmt)
        scales = None if self.scales is None else self.scales.float().contiguous()
        fmt = {"bf16": "bf16", "int8": "i8", "w8a8": "q8" if self.in_features % 32 == 0 else "i8"}[self.fmt]
        return ProductWeights.of(self.weight, scales, self.bias, fmt)

    def use_kernels(self) -> None:
        self.kernel = self.kernel_weights()

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        if self.kernel is not None and rows <= MAX_ROWS:
            return product(self.kernel, x)
        if self.weight is None or self.fmt in BLOCK_TYPES:  # ggml's blocks (module docstring)
            if self.kernel is not None:
                return product_gemm(self.kernel, x)  # the same arithmetic as decode's rows
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
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


def _f16(b: Tensor) -> Tensor:
    """(..., 2) uint8, little-endian IEEE half -> (...) float32."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: Tensor) -> Tensor:
    """(..., n) bytes -> (..., 2n) values: the low nibbles, then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _k4_scales(sc: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K's 12 bytes of 6-bit (scale, min) pairs (..., 12) -> scales, mins (..., 8) uint8
    (ggml's get_scale_min_k4)."""
    d, m, md = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales, mins


def dequantize_blocks(raw: Tensor, fmt: str) -> Tensor:
    """ggml's dequantization of rows stored in block type ``fmt``: raw (N, bytes per row)
    uint8 -> (N, K) float32, bit for bit what ggml (and the ``gguf`` package) computes: the
    same float32 operations in the same order."""
    values, nbytes = BLOCK_FORMATS[fmt]
    N = raw.shape[0]
    b = raw.reshape(N, -1, nbytes)  # (N, blocks, bytes)
    if fmt == "q8_0":
        out = b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])[..., None]
    elif fmt == "q4_0":
        out = _f16(b[..., 0:2])[..., None] * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
    elif fmt == "q4_1":
        out = _f16(b[..., 0:2])[..., None] * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])[..., None]
    elif fmt == "q5_0":
        qh = b[..., 2:6].contiguous().view(torch.int32)  # (N, blocks, 1): bit j is value j's fifth bit
        high = ((qh >> torch.arange(32, dtype=torch.int32)) & 1).to(torch.uint8)  # (N, blocks, 32)
        q = (_nibbles(b[..., 6:]) | (high << 4)).to(torch.int8) - 16
        out = _f16(b[..., 0:2])[..., None] * q.float()
    elif fmt == "q4_k":
        scales, mins = _k4_scales(b[..., 4:16])  # (N, blocks, 8)
        d = (_f16(b[..., 0:2])[..., None] * scales.float())[..., None]  # (N, blocks, 8, 1)
        dm = (_f16(b[..., 2:4])[..., None] * mins.float())[..., None]
        qs = b[..., 16:].reshape(N, -1, 4, 32)  # 4 runs of 32 bytes: sub-blocks 2j (low), 2j + 1 (high)
        q = torch.stack((qs & 0x0F, qs >> 4), dim=3).reshape(N, -1, 8, 32).float()
        out = d * q - dm
    elif fmt == "q6_k":
        ql, qh = b[..., :128].reshape(N, -1, 2, 1, 64), b[..., 128:192].reshape(N, -1, 2, 1, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).float()  # (N, blocks, 16)
        d = (_f16(b[..., 208:210])[..., None] * sc)[..., None]  # (N, blocks, 16, 1)
        low = ((ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0x0F).reshape(N, -1, 8, 32)
        high = ((qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 0x03).reshape(N, -1, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(N, -1, 16, 16).float()
        out = d * q
    else:
        raise ValueError(f"unknown block type {fmt!r}; one of {', '.join(BLOCK_TYPES)}")
    return out.reshape(N, -1)


def quantize_blocks(w: Tensor, fmt: str) -> Tensor:
    """w (N, K) float -> (N, bytes per row) uint8 in block type ``fmt``, by ggml's reference
    quantizers (what ``llama-quantize`` runs without an importance matrix), in the native
    kernels (``kv_quantize_blocks``: rows in parallel). RuntimeError where they are unavailable."""
    if not kernels.available():
        raise RuntimeError(f"quantizing to {fmt} needs the native kernels ({kernels.reason()})")
    return ops.quantize_blocks(w.detach().float().contiguous(), fmt)


def _use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's layers that get more bits in a _M file: the first and last eighth,
    and every third layer between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def block_type_for(fmt: str, name: str, K: int, n_layers: int) -> str:
    """The block type llama-quantize gives the product ``name`` (a module name: the head is
    ``lm_head``, a layer's ``...layers.<i>.<...>.down_proj``) in file type ``fmt``
    (``BLOCK_WEIGHT_FORMATS``), with its fallback for rows of K values that are no whole
    number of the type's blocks (module docstring). The v rows of a fused q/k/v: ``name``
    ending ``.v_rows`` (``quantize_model`` splits them off)."""
    base = BLOCK_WEIGHT_FORMATS[fmt]
    layer = re.search(r"\.(\d+)\.", name)
    if name.rsplit(".", 1)[-1] == "lm_head":
        t = base if base == "q8_0" else ("q6_k" if K % 256 == 0 else "q8_0")
    elif fmt == "q4_k_m" and layer and name.endswith((".v_rows", "down_proj")) and _use_more_bits(int(layer[1]), n_layers):
        t = "q6_k"
    else:
        t = base
    return K_FALLBACK.get(t, t) if K % BLOCK_FORMATS[t][0] else t


def _to_blocks(linear: Linear, fmt: str, name: str, n_layers: int, parent: nn.Module) -> QuantLinear:
    """``linear`` (module ``name``) in file type ``fmt``'s block types; a fused q/k/v
    (``qkv_proj`` of an attention with ``n_heads``, ``n_kv``, ``head_dim``) quantized in its
    q, k and v rows, each its own type, then joined (``QuantLinear.cat``)."""
    K = linear.in_features
    if name.endswith("qkv_proj") and all(hasattr(parent, a) for a in ("n_heads", "n_kv", "head_dim")):
        q_rows, kv_rows = parent.n_heads * parent.head_dim, parent.n_kv * parent.head_dim
        w, b = linear.weight.detach(), linear.bias
        parts = []
        for suffix, lo, hi in (("q_rows", 0, q_rows), ("k_rows", q_rows, q_rows + kv_rows),
                               ("v_rows", q_rows + kv_rows, q_rows + 2 * kv_rows)):  # fmt: skip
            t = block_type_for(fmt, f"{name}.{suffix}", K, n_layers)
            parts.append(QuantLinear(t, quantize_blocks(w[lo:hi], t), None, None if b is None else b.detach()[lo:hi]))
        return QuantLinear.cat(parts)
    return QuantLinear.from_linear(linear, block_type_for(fmt, name, K, n_layers))


def quantize_model(model: nn.Module, fmt: str, progress: bool = False) -> int:
    """Replace every ``layers.Linear`` of ``model`` by a ``QuantLinear`` in ``fmt``, in
    place; returns how many were replaced. ``exact`` changes nothing; in ggml's block types
    a product whose rows are no whole number of 32-value blocks stays as it is."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "exact":
        return 0
    from tqdm import tqdm

    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    if fmt in BLOCK_WEIGHT_FORMATS and any(m.weight.device.type != "cpu" for _, m in targets):
        raise ValueError(f"weight format {fmt} runs on the CPU only (use int8 or bf16 on CUDA)")
    n_layers = len({int(m[1]) for name, _ in targets if (m := re.search(r"\.(\d+)\.", name))})
    done = 0
    for name, linear in tqdm(targets, desc=f"weights to {fmt}", unit="matrix", disable=not progress):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if fmt in BLOCK_WEIGHT_FORMATS:
            if linear.in_features % 32:  # no block type fits: kept as it is, as llama-quantize keeps it in F16/F32
                continue
            setattr(parent, attr, _to_blocks(linear, fmt, name, n_layers, parent))
        else:
            setattr(parent, attr, QuantLinear.from_linear(linear, fmt))
        done += 1
    return done


def format_fingerprint(fingerprint: str, fmt: str) -> str:
    """The served model's fingerprint: the checkpoint's, unchanged for ``exact``, else
    mixed with the weight format (and the quantizer's version) so KV never crosses."""
    if fmt == "exact":
        return fingerprint
    return hashlib.sha256(f"kvserve-weight-format-v1:{fmt}:{fingerprint}".encode()).hexdigest()
