"""Layers shared by the model files."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import TYPE_CHECKING

from torch import Tensor, nn

from kvserve.service.models.native import ops as native_ops
from kvserve.service.models.rope import apply_rope_

if TYPE_CHECKING:
    from kvserve.service.kv.cache import BatchLayout, KVPool

# Row counts (tokens in the forward) that take the CPU fast path of ``Linear``.
SMALL_ROWS = range(2, 65)
# Row counts that run on the oneDNN-packed weight when a ``Linear`` has one (``pack``).
# One row joins them when torch runs more than one thread: MKL's one-row GEMV barely
# gains from a second thread where oneDNN's packed GEMM does (a ~110M model's products at
# one row, two threads: 34.8 ms MKL, 24.8 ms packed; one thread: 39.6 ms vs 45.2 ms).
PACKED_ROWS = range(2, 65)
# Smaller weights are not packed: oneDNN's fixed cost per call (~35 us against ~20 us for
# MKL) outweighs its faster read below ~256K elements (measured at 4 rows, one thread).
PACK_MIN_ELEMENTS = 1 << 18


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same result) with CPU fast paths for a few rows.

    Decode (1..64 rows) is bound by reading the weights. On the CPU, float32, the native
    kernel runs them when the loader enabled it (``enable_native``: ``native/gemv.cpp``
    reads the weight in place, one dot product per output, the same sum whatever the
    other rows). Without it:

    - ``pack()`` (called by the loader, ``pack_linears``) keeps a second copy of the
      weight in oneDNN's blocked layout; 2..64 rows run oneDNN's GEMM on it
      (``mkldnn._linear_pointwise``): 1.4-1.7x MKL per weight byte at 2-64 rows; one row
      runs there too when torch has more than one thread (1.4x MKL's GEMV at two), and
      stays on MKL's GEMV at one thread (~5-15% faster there; docs/benchmarks.md). Costs
      one more copy of the weight.
    - Unpacked, 2..64 rows compute ``W @ x.T`` instead of ``x @ W.T`` (MKL is several
      times slower per weight byte on the latter at a few rows on AVX2).

    From 65 rows (prefill, compute-bound) MKL's ``F.linear`` runs. Rounding may differ in
    the last bits between the paths.
    """

    _packed: Tensor | None = None  # the weight in oneDNN's layout (opaque tensor); None: unpacked
    _native: bool = False  # decode-sized float32 products by the native kernel (``enable_native``)

    def pack(self) -> bool:
        """Keep a oneDNN-packed copy of the weight for decode-sized products (CPU,
        float32, at least ``PACK_MIN_ELEMENTS``); False (and nothing changes) where that
        does not apply or fails."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
            return False
        if w.numel() < PACK_MIN_ELEMENTS:
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 8)  # packed for ~8 rows
            x = torch.zeros(1, self.in_features)
            torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        except (RuntimeError, AttributeError):
            return False
        self._packed = packed
        return True

    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // x.shape[-1]
        if self._native and rows <= native_ops.MAX_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
            return native_ops.gemv(x, self.weight, None, self.bias)
        packed = self._packed
        if packed is not None and x.dtype == torch.float32 and (
            rows in PACKED_ROWS or (rows == 1 and torch.get_num_threads() > 1)
        ):
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        if x.device.type != "cpu" or rows not in SMALL_ROWS:
            return F.linear(x, self.weight, self.bias)
        xt = x.reshape(rows, x.shape[-1]).t()  # (in, rows)
        if self.bias is None:
            y = torch.mm(self.weight, xt)  # (out, rows)
        else:
            y = torch.addmm(self.bias[:, None], self.weight, xt)
        return y.t().contiguous().view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """``pack()`` every ``Linear`` of ``model`` (after loading, fusing and quantizing:
    quantized layers are not ``Linear``); returns how many were packed."""
    return sum(m.pack() for m in model.modules() if isinstance(m, Linear))


def enable_native(model: nn.Module) -> int:
    """Route the decode-sized work of every module of ``model`` that has a native path
    to the native kernels (the caller checks ``native.available()``): modules with a
    ``_native`` flag (products, norms, gates, attention) run their own op natively,
    blocks with a ``native_spec()`` run whole on decode steps (``native/layer.py``), and
    a model with a ``native_stack()`` runs its blocks' native layers as one stack (None
    when a block has none). Returns how many modules were switched."""
    from kvserve.service.models.native.layer import NativeLayer

    count = 0
    for m in model.modules():
        if hasattr(m, "_native"):
            enable = getattr(m, "enable_native", None)
            if enable is not None:
                count += bool(enable())
            else:
                m._native = True
                count += 1
    for m in model.modules():  # after the products: a QuantLinear's float scales are made above
        spec = getattr(m, "native_spec", None)
        if callable(spec) and (s := spec()) is not None:
            try:
                m._native_layer = NativeLayer(s)
                count += 1
            except ValueError:
                pass  # a part the native layer cannot read: the block keeps its per-op path
    for m in model.modules():  # after the blocks: a model whose blocks all have a native layer runs them as one stack
        stack = getattr(m, "native_stack", None)
        if callable(stack):
            m._native_stack = stack()
    return count


def last_tokens(x: Tensor, layout: BatchLayout) -> Tensor:
    """(B, D): each sequence's last new token's row of x (B, T, D); a decode step's x
    (T == 1) as it is, a view (no copy)."""
    if x.shape[1] == 1:
        return x.flatten(0, 1)
    return x.flatten(0, 1).index_select(0, layout.last_index)


def causal_mask(T: int, window: int | None, dtype: torch.dtype, device: torch.device) -> tuple[Tensor | None, bool]:
    """(additive mask (T, T) or None, is_causal) for plain causal attention over T tokens
    from position 0, limited to the last ``window`` positions when one is given
    (``BatchLayout.mask_for``'s rule: key j is visible to query i iff i - window < j <= i)."""
    if window is None or T <= window:
        return None, T > 1
    i = torch.arange(T, device=device)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # (T, T)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")), False


def fuse_linears(linears: list[Linear]) -> Linear:
    """One ``Linear`` computing the given ones side by side: its output is their outputs
    concatenated on the last dim (split it with ``.split([l.out_features ...], -1)``).

    Used after loading (q/k/v, gate/up): one weight read and one kernel call instead of
    several per step. Every input must have the same in_features, dtype and device and
    all or none a bias; the weights are copied, the inputs can be dropped."""
    first = linears[0]
    has_bias = first.bias is not None
    if any(l.in_features != first.in_features or (l.bias is not None) != has_bias for l in linears):
        raise ValueError("fuse_linears: inputs differ in in_features or bias")
    w = first.weight
    out = Linear(first.in_features, sum(l.out_features for l in linears), bias=has_bias, device="meta", dtype=w.dtype)
    out.weight = nn.Parameter(torch.cat([l.weight.detach() for l in linears]), requires_grad=False)  # (sum out, in)
    if has_bias:
        out.bias = nn.Parameter(torch.cat([l.bias.detach() for l in linears]), requires_grad=False)
    return out


def fuse_projections(model: nn.Module) -> None:
    """Call ``fuse()`` on every submodule that has one (after the weights are loaded:
    checkpoints name the projections separately, the loader fills them by name)."""
    for module in list(model.modules()):
        fuse = getattr(module, "fuse", None)
        if callable(fuse):
            fuse()


class PagedAttention(nn.Module):
    """What every family's attention shares once q, k, v are made: write k and v into the
    paged pool, attend (SDPA, GQA, the layer's window) and project out. A family sets
    ``layer_idx``, ``n_heads``, ``n_kv``, ``head_dim``, ``scale``, ``window`` and ``o_proj``,
    and defines ``qkv(x, cos, sin) -> (q, k, v)``, each (B, T, heads, hd)."""

    layer_idx: int
    n_heads: int
    n_kv: int
    head_dim: int
    scale: float
    window: int | None
    o_proj: nn.Module
    softcap: float | None = None  # attention logit soft-cap (Gemma 2)
    _native = False  # decode tokens by native/decode.cpp (``enable_native``)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        """(B, nh, T, hd) from q (B, nh, T, hd) and k, v (B, n_kv, C, hd)."""
        if q.shape[2] > 1:  # prefill: the flash kernel runs markedly faster on contiguous heads
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=self.n_kv != self.n_heads,
        )

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        B, T = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hd), (B, n_kv, C, hd)
        y = self.sdpa(q, k, v, mask, is_causal)  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))

    def rope_(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``rope.apply_rope_`` on x (B, T, heads, hd), in place: one native call for
        decode-sized float32 CPU inputs when enabled, torch's four ops otherwise."""
        if self._native and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[1] == 1:
            return native_ops.rope_(x, cos, sin)
        return apply_rope_(x, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: BatchLayout, kv: KVPool) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        if (self._native and q.shape[1] == 1 and layout.ctx_blocks is not None and q.dtype == torch.float32
                and kv.data.dtype == torch.float32 and kv.device.type == "cpu"):
            # one new token per sequence: K/V written and the context attended in place in the pool
            y = native_ops.decode_attention(q, k, v, kv.data, self.layer_idx, layout.slot_blocks, layout.slot_offsets,
                                            layout.ctx_blocks, layout.lens_tensor(), self.window, self.scale,
                                            self.softcap)  # (B, 1, nh * hd)
            return self.o_proj(y)
        k, v = kv.update(self.layer_idx, layout, k, v)  # (B, C, n_kv, hd)
        return self.attend(q, k, v, *layout.mask_for(q.dtype, self.window))

    def forward_nocache(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.attend(q, k, v, *causal_mask(x.shape[1], self.window, q.dtype, x.device))
