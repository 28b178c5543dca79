"""Python entry points of the native kernels (``native/__init__.py``): argument checks
that keep a bad call from reading out of bounds, then one ctypes call.

Every function takes and returns CPU tensors; the caller decides when to use them
(``native.ENABLED``) and keeps its torch path for everything else.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvserve.service.models import native

MAX_ROWS = 64  # decode-sized products; more rows (prefill) are compute-bound: torch's GEMM

_GEMV = {torch.float32: "kv_gemv_f32", torch.bfloat16: "kv_gemv_bf16", torch.int8: "kv_gemv_i8"}


def gemv_supported(x: Tensor, weight: Tensor) -> bool:
    """Whether ``gemv(x, weight, ...)`` applies: CPU float32 input of 1..MAX_ROWS rows,
    a contiguous CPU weight of a supported dtype."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.dtype in _GEMV
        and weight.is_contiguous()
        and x.numel() // max(x.shape[-1], 1) <= MAX_ROWS
    )


def _check(x: Tensor, weight: Tensor, scales: Tensor | None, bias: Tensor | None, out: Tensor | None,
           accumulate: bool) -> tuple[Tensor, Tensor]:
    """(x as (rows, K) with unit stride, out (..., N)) after checking every argument."""
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ValueError(f"gemv: x has {x.shape[-1]} features, weight expects {K}")
    if x.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError("gemv: x must be float32 and the weight contiguous")
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv: {rows} rows; 1..{MAX_ROWS} supported")
    if weight.dtype == torch.int8:
        if scales is None or scales.dtype != torch.float32 or scales.numel() != N or not scales.is_contiguous():
            raise ValueError("gemv: int8 weights need float32 contiguous scales (N,)")
    elif scales is not None:
        raise ValueError("gemv: scales are for int8 weights only")
    if bias is not None and (bias.dtype != torch.float32 or bias.numel() != N or not bias.is_contiguous()):
        raise ValueError("gemv: bias must be float32 contiguous (N,)")
    if out is None:
        if accumulate:
            raise ValueError("gemv: accumulate needs out")
        out = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != rows * N or not out.is_contiguous():
        raise ValueError("gemv: out must be float32 contiguous with rows * N elements")
    return x2, out


def gemv(x: Tensor, weight: Tensor, scales: Tensor | None = None, bias: Tensor | None = None,
         out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """x (..., K) float32 @ weight (N, K).T * scales (N,) + bias (N,) -> (..., N) float32.

    ``weight`` float32, bfloat16 or int8 (then ``scales``, float32, is required);
    ``out`` (..., N) float32 contiguous receives the result (``accumulate``: added to it,
    a residual add in the same pass)."""
    lib = native.load()
    N, K = weight.shape
    x2, out = _check(x, weight, scales, bias, out, accumulate)
    rows = x2.shape[0]
    getattr(lib, _GEMV[weight.dtype])(
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
    lib = native.load()
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
