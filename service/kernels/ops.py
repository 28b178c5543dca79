"""The torch-facing entry points of the native kernels: argument checks that keep a bad
call from reading out of bounds, then one ctypes call into the library ``kernels.load()``
serves (looked up per call, so ``kernels.select`` switches every caller).

Every function takes and returns float32 CPU tensors. The model code calls them through
its layers' weight views (``layer.py``: ``product``, ``norm``) and keeps its torch path
for everything else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import kernels
from .binding import header_binding

MAX_ROWS = 64  # decode-sized products; more rows (prefill) are compute-bound: torch's GEMM
_C = header_binding().constants
# ggml's block types, stored as ggml stores them (a GGUF file's rows as they are): name ->
# (values per block, bytes per block). A row of K values is K / values blocks, back to back.
BLOCK_FORMATS = {
    "q8_0": (32, 34),  # fp16 d, 32 int8: d * q
    "q4_0": (32, 18),  # fp16 d, 16 bytes of nibbles: d * (q - 8)
    "q4_1": (32, 20),  # fp16 d, fp16 m, 16 bytes of nibbles: d * q + m
    "q5_0": (32, 22),  # fp16 d, 32 high bits, 16 bytes of nibbles: d * (q - 16)
    "q4_k": (256, 144),  # fp16 d, fp16 dmin, 8 x 6-bit (scale, min), 128 bytes of nibbles
    "q6_k": (256, 210),  # 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, fp16 d
}


def block_row_bytes(fmt: str, K: int) -> int:
    """Bytes of one row of K values in block format ``fmt``; ValueError when K is not a
    whole number of its blocks."""
    values, nbytes = BLOCK_FORMATS[fmt]
    if K <= 0 or K % values:
        raise ValueError(f"{fmt}: a row of {K} values is not a whole number of its {values}-value blocks")
    return K // values * nbytes


BLOCK_CODES = {fmt: _C[f"KV_{fmt.upper()}"] for fmt in BLOCK_FORMATS}  # kvkernels.h's KV_Q8_0..KV_Q6_K


def block_row_values(fmt: str, row_bytes: int) -> int:
    """Values (K) in one stored row of ``row_bytes`` bytes in block format ``fmt``."""
    values, nbytes = BLOCK_FORMATS[fmt]
    if row_bytes <= 0 or row_bytes % nbytes:
        raise ValueError(f"{fmt}: a row of {row_bytes} bytes is not a whole number of its {nbytes}-byte blocks")
    return row_bytes // nbytes * values
# the KV pool dtypes attention reads in place -> kvkernels.h's kv_fmt
KV_POOL_FORMATS = {torch.float32: _C["KV_F32"], torch.bfloat16: _C["KV_BF16"], torch.float16: _C["KV_F16"],
                   torch.int8: _C["KV_I8"]}  # int8: (N, L, 2, plane) planes of values and scales (kv/cache.py)


def _lib():
    return kernels.load().lib


_GEMV = {torch.float32: "kv_gemv_f32", torch.bfloat16: "kv_gemv_bf16", torch.int8: "kv_gemv_i8"}
_GEMM = {torch.float32: "kv_gemm_f32", torch.bfloat16: "kv_gemm_bf16", torch.int8: "kv_gemm_i8"}


def _check(x: Tensor, weight: Tensor, scales: Tensor | None, bias: Tensor | None, out: Tensor | None,
           accumulate: bool, max_rows: int | None = MAX_ROWS, name: str = "gemv") -> tuple[Tensor, Tensor]:
    """(x as (rows, K) with unit stride, out (..., N)) after checking every argument."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"{name}: x has {x.shape[-1]} features, weight expects {K}")
    if x.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"{name}: x must be float32 and the weight contiguous")
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows < 1 or (max_rows is not None and rows > max_rows):
        raise ValueError(f"{name}: {rows} rows; 1..{max_rows or 'any'} supported")
    if weight.dtype == torch.int8:
        if scales is None or scales.dtype != torch.float32 or scales.numel() != N or not scales.is_contiguous():
            raise ValueError(f"{name}: int8 weights need float32 contiguous scales (N,)")
    elif scales is not None:
        raise ValueError(f"{name}: scales are for int8 weights only")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != N or not bias.is_contiguous()):
        raise ValueError(f"{name}: bias must be float32 contiguous (N,)")
    if out is None:
        if accumulate:
            raise ValueError(f"{name}: accumulate needs out")
        out = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != rows * N or not out.is_contiguous():
        raise ValueError(f"{name}: out must be float32 contiguous with rows * N elements")
    return x2, out


def gemv(x: Tensor, weight: Tensor, scales: Tensor | None = None, bias: Tensor | None = None,
         out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """x (..., K) float32 @ weight (N, K).T * scales (N,) + bias (N,) -> (..., N) float32.

    ``weight`` float32, bfloat16 or int8 (then ``scales``, float32, is required);
    ``out`` (..., N) float32 contiguous receives the result (``accumulate``: added to it,
    a residual add in the same pass)."""
    lib = _lib()
    N, K = weight.shape
    x2, out = _check(x, weight, scales, bias, out, accumulate)
    rows = x2.shape[0]
    getattr(lib, _GEMV[weight.dtype])(
        x2.data_ptr(), rows, x2.stride(0), K, weight.data_ptr(), N,
        None if scales is None else scales.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), N, int(accumulate), torch.get_num_threads(),
    )
    return out


def gemm(x: Tensor, weight: Tensor, scales: Tensor | None = None, bias: Tensor | None = None,
         out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """``gemv``'s product for any number of rows (prefill; gemm.cpp): the weight, float32,
    bfloat16 or int8 (with ``scales``), widened to float32 in cache-sized panels once per
    call, never as a whole float32 copy. Each row's result does not depend on the others."""
    lib = _lib()
    N, K = weight.shape
    x2, out = _check(x, weight, scales, bias, out, accumulate, max_rows=None, name="gemm")
    rows = x2.shape[0]
    getattr(lib, _GEMM[weight.dtype])(
        x2.data_ptr(), rows, x2.stride(0), K, weight.data_ptr(), N,
        None if scales is None else scales.data_ptr(), None if bias is None else bias.data_ptr(),
        out.data_ptr(), N, int(accumulate), torch.get_num_threads(),
    )
    return out


def gemv_q8(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None = None,
            out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """``gemv`` for int8 weights with the input quantized too: per block of 32 values,
    symmetric int8 with one float32 scale (llama.cpp's Q8_0 activations), products in
    integers. K must be a multiple of 32 (``q8_supported``)."""
    lib = _lib()
    N, K = weight.shape
    if weight.dtype != torch.int8 or K % 32:
        raise ValueError("gemv_q8: int8 weights with in_features a multiple of 32")
    x2, out = _check(x, weight, scales, bias, out, accumulate)
    rows = x2.shape[0]
    xq = torch.empty(rows, K, dtype=torch.int8)
    xs = torch.empty(rows, K // 32, dtype=torch.float32)
    lib.kv_gemv_q8(
        x2.data_ptr(), rows, x2.stride(0), K, weight.data_ptr(), N, scales.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), N, int(accumulate), torch.get_num_threads(),
        xq.data_ptr(), xs.data_ptr(),
    )
    return out


def quantize_blocks(w: Tensor, fmt: str) -> Tensor:
    """w (N, K) float32 -> (N, bytes per row) uint8 in block type ``fmt`` (``BLOCK_FORMATS``),
    by ggml's reference quantizers (qblocks.cpp), rows in parallel. ValueError when K is no
    whole number of the type's blocks."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block type {fmt!r}; one of {', '.join(BLOCK_FORMATS)}")
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError("quantize_blocks: a float32 CPU (N, K) weight")
    w = w.contiguous()
    N, K = w.shape
    out = torch.empty(N, block_row_bytes(fmt, K), dtype=torch.uint8)
    if N:
        _lib().kv_quantize_blocks(w.data_ptr(), N, K, BLOCK_CODES[fmt], out.data_ptr(), torch.get_num_threads())
    return out


def gemv_blocks(x: Tensor, weight: Tensor, fmt: str, bias: Tensor | None = None, out: Tensor | None = None,
                accumulate: bool = False) -> Tensor:
    """x (..., K) float32, any number of rows, @ the weight stored in block type ``fmt``
    (``weight`` (N, bytes per row) uint8, ggml's blocks) .T + bias -> (..., N) float32: the
    input quantized per block as llama.cpp's dot products do and the products in integers
    (qblocks.cpp); a row's result does not depend on the other rows."""
    if fmt not in BLOCK_FORMATS:
        raise ValueError(f"unknown block type {fmt!r}; one of {', '.join(BLOCK_FORMATS)}")
    if weight.dtype != torch.uint8 or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError("gemv_blocks: the weight is (N, bytes per row) uint8, contiguous")
    N, K = weight.shape[0], block_row_values(fmt, weight.shape[1])
    x2, out = _check(x, torch.empty(N, K, dtype=torch.uint8, device="meta"), None, bias, out, accumulate,
                     max_rows=None, name="gemv_blocks")  # fmt: skip
    _lib().kv_gemv_blocks(
        x2.data_ptr(), x2.shape[0], x2.stride(0), K, weight.data_ptr(), N, BLOCK_CODES[fmt],
        None if bias is None else bias.data_ptr(), out.data_ptr(), N, int(accumulate), torch.get_num_threads(),
    )
    return out


def rmsnorm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """x (..., D) * rsqrt(mean(x^2) + eps) * (weight + offset) per row, as a new tensor;
    float32 CPU (offset 1.0: Gemma's (1 + w))."""
    D = x.shape[-1]
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.numel() != D or not weight.is_contiguous():
        raise ValueError("rmsnorm: float32 x (..., D) and a contiguous float32 (D,) weight")
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    _lib().kv_rmsnorm(x2.data_ptr(), x2.shape[0], x2.stride(0), D, weight.data_ptr(), float(eps),
                             float(offset), out.data_ptr(), D)
    return out


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rope.apply_rope_`` (x (B, T, H, hd), a view; cos and signed sin (B, T, 1, rot))
    in place in one call. float32 CPU, x's last dim contiguous."""
    B, T, H, hd = x.shape
    rot = cos.shape[-1]
    if (x.dtype != torch.float32 or x.stride(-1) != 1 or rot > hd or rot % 2 or cos.shape[:2] != (B, T)
            or sin.shape != cos.shape):
        raise ValueError("rope_: float32 x (B, T, H, hd) with a contiguous last dim and cos/sin (B, T, 1, rot)")
    c = cos.reshape(B, T, rot).contiguous()
    s = sin.reshape(B, T, rot).contiguous()
    if c.dtype != torch.float32 or s.dtype != torch.float32:
        raise ValueError("rope_: float32 cos/sin")
    _lib().kv_rope(x.data_ptr(), B, T, H, x.stride(0), x.stride(1), x.stride(2), rot, c.data_ptr(), s.data_ptr())
    return x


_C = header_binding().constants
ACTIVATIONS = {"silu": _C["KV_SILU"], "gelu_tanh": _C["KV_GELU_TANH"], "gelu": _C["KV_GELU"]}


def act_mul(gate_up: Tensor, act: str) -> Tensor:
    """act(gate) * up from gate_up (..., 2I) = [gate | up]: (..., I) float32."""
    two_i = gate_up.shape[-1]
    if gate_up.dtype != torch.float32 or gate_up.stride(-1) != 1 or two_i % 2:
        raise ValueError("act_mul: float32 (..., 2I) with a contiguous last dim")
    g2 = gate_up.reshape(-1, two_i)
    I = two_i // 2
    out = torch.empty(*gate_up.shape[:-1], I, dtype=torch.float32)
    _lib().kv_act_mul(g2.data_ptr(), g2.shape[0], g2.stride(0), I, ACTIVATIONS[act], out.data_ptr(),
                             torch.get_num_threads())
    return out


def decode_attention(q: Tensor, k: Tensor, v: Tensor, pool: Tensor, layer: int, slot_blocks: Tensor,
                     slot_offsets: Tensor, tables: Tensor, lens: Tensor, window: int | None, scale: float,
                     softcap: float | None, block_size: int | None = None) -> Tensor:
    """One new token per sequence: write k, v (B, 1, n_kv, hd) into ``pool`` (the KVPool's
    (N, L, 2, bs, n_kv, hd) tensor: float32, bfloat16 or float16, ``KV_POOL_FORMATS``;
    the new K/V rounded to it to nearest even, as ``Tensor.to``; int8: the pool's
    (N, L, 2, plane) planes of ``block_size`` tokens, the new K/V quantized at their
    rows' own scales, as ``KVPool.update``) at (slot_blocks, slot_offsets) (B,), then
    attend q (B, 1, nh, hd) over each sequence's ``lens[b]`` positions in the blocks
    ``tables`` (B, nb), the last ``window`` only when given: (B, 1, nh * hd)."""
    B, T, nh, hd = q.shape
    if pool.dtype == torch.int8:
        N, L, two, plane = pool.shape
        nkv, hd2, bs = k.shape[2], hd, block_size or 0
        if bs < 1 or plane != -(-bs * nkv * hd // 4) * 4 + 4 * bs * nkv:
            raise ValueError("decode_attention: an int8 pool's planes must hold block_size tokens of k's heads")
    else:
        N, L, two, bs, nkv, hd2 = pool.shape
    if T != 1 or k.shape != (B, 1, nkv, hd) or v.shape != k.shape or hd2 != hd or two != 2 or nh % nkv:
        raise ValueError("decode_attention: q (B, 1, nh, hd), k and v (B, 1, n_kv, hd) matching the pool")
    for t in (q, k, v):
        if t.dtype != torch.float32 or t.stride(-1) != 1 or t.stride(-2) != hd:
            raise ValueError("decode_attention: float32 q, k, v with contiguous heads")
    if k.stride(0) != v.stride(0) or pool.dtype not in KV_POOL_FORMATS or not pool.is_contiguous():
        raise ValueError("decode_attention: k and v rows at one stride; a contiguous float32, bfloat16, float16 or int8 pool")
    for t in (slot_blocks, slot_offsets, lens):
        if t.dtype != torch.long or t.numel() != B or not t.is_contiguous():
            raise ValueError("decode_attention: slot_blocks, slot_offsets and lens are (B,) int64")
    if tables.dtype != torch.long or tables.dim() != 2 or tables.shape[0] != B or not tables.is_contiguous():
        raise ValueError("decode_attention: tables (B, nb) int64 contiguous")
    if not 0 <= layer < L:
        raise ValueError(f"decode_attention: layer {layer} of {L}")
    out = torch.empty(B, 1, nh * hd, dtype=torch.float32)
    _lib().kv_decode_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), B, nh, nkv, hd, pool.data_ptr(), KV_POOL_FORMATS[pool.dtype], layer, L,
        bs, slot_blocks.data_ptr(), slot_offsets.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        int(window or 0), float(scale), float(softcap or 0.0), out.data_ptr(), torch.get_num_threads(),
    )
    return out


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, kv_len: Tensor, n_new: Tensor, window: int | None,
                      scale: float, softcap: float | None) -> Tensor:
    """Causal attention of each sequence's new tokens over its keys (attention.cpp), the
    work above the diagonal and before the window skipped: q (B, T, nh, hd), k and v
    (B, C, n_kv, hd) float32 with contiguous heads (views into one fused q/k/v output, or
    a gathered context); sequence b has ``kv_len[b]`` keys and its first ``n_new[b]``
    rows are real, query t at position kv_len[b] - n_new[b] + t (the rest padding: zeros).
    Key c is visible from position p iff c <= p (and c > p - window when given); the
    scores are soft-capped (cap * tanh(s / cap)) when ``softcap`` is given. -> (B, T, nh, hd)."""
    B, T, nh, hd = q.shape
    Bk, C, nkv, hd2 = k.shape
    if Bk != B or v.shape != k.shape or hd2 != hd or nh % nkv:
        raise ValueError("prefill_attention: q (B, T, nh, hd), k and v (B, C, n_kv, hd)")
    for t in (q, k, v):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1 or t.stride(-2) != hd:
            raise ValueError("prefill_attention: float32 CPU q, k, v with contiguous heads")
    if k.stride()[:2] != v.stride()[:2]:
        raise ValueError("prefill_attention: k and v at the same strides")
    for t in (kv_len, n_new):
        if t.dtype != torch.long or t.numel() != B or not t.is_contiguous():
            raise ValueError("prefill_attention: kv_len and n_new are (B,) int64")
    if not all(1 <= n <= T and n <= c <= C for n, c in zip(n_new.tolist(), kv_len.tolist())):
        raise ValueError("prefill_attention: need 1 <= n_new[b] <= T, n_new[b] <= kv_len[b] <= C")
    out = torch.empty(B, T, nh, hd, dtype=torch.float32)
    _lib().kv_prefill_attention(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), B, T, nh, nkv,
        hd, kv_len.data_ptr(), n_new.data_ptr(), int(window or 0), float(scale), float(softcap or 0.0),
        out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(),
    )
    return out
