"""Layers shared by the model files."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import TYPE_CHECKING

from torch import Tensor, nn

from kvserve.service.kernels.layer import MAX_ROWS, DecodeStep, LayerWeights, NormWeights, ProductWeights, norm, product
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


class UsesKernels:
    """A module with a native implementation of its decode-sized work: ``use_kernels()``
    (called once at load by ``use_kernels(model)``, only where the kernels loaded and the
    model computes in float32 on the CPU) takes the typed view of its weights that the
    kernels read; its forward then runs them for 1..``MAX_ROWS`` rows."""

    def use_kernels(self) -> None:
        raise NotImplementedError


class Linear(nn.Linear, UsesKernels):
    """``nn.Linear`` (same parameters, same result) with CPU fast paths for a few rows.

    Decode (1..64 rows) is bound by reading the weights. With the native kernels
    (``use_kernels``) their product reads the float32 weight in place, one dot product
    per output, the same sum whatever the other rows. Without them (torch's path):

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
    kernel: ProductWeights | None = None  # the weight as the native product reads it (``use_kernels``)

    def kernel_weights(self) -> ProductWeights | None:
        return ProductWeights.of(self.weight, None, self.bias, "f32")

    def use_kernels(self) -> None:
        self.kernel = self.kernel_weights()

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
        if self.kernel is not None and rows <= MAX_ROWS:
            return product(self.kernel, x)
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


def use_kernels(model: nn.Module) -> int:
    """Route the decode-sized work of ``model`` to the native kernels (the caller checked
    that they loaded and that the model computes in float32 on the CPU): every
    ``UsesKernels`` module takes its weights' view, then the model builds its decoder
    stack (``decoder_stack()``: every block of a decode step in one native call each;
    None when a block cannot run natively). Returns how many modules were switched."""
    users = [m for m in model.modules() if isinstance(m, UsesKernels)]
    for m in users:
        m.use_kernels()
    stack = getattr(model, "decoder_stack", None)
    if callable(stack):
        model.stack = stack()
    return len(users)


def decode_step(layout: BatchLayout | None, kv: KVPool | None) -> DecodeStep | None:
    """The kernels' view of a decode step over ``kv`` (made once per layout), or None
    when ``layout`` is no decode step over a cached float32 context."""
    if layout is None or layout.ctx_blocks is None or kv.data.dtype != torch.float32:
        return None
    key = ("kernels_step", id(kv))
    step = layout._bias.get(key)
    if step is None:
        step = layout._bias[key] = DecodeStep(kv.data, layout.slot_blocks, layout.slot_offsets, layout.ctx_blocks,
                                              layout.lens_tensor())  # fmt: skip
    return step


def layer_weights(attn: PagedAttention, norm_in: nn.Module, norm_mlp: nn.Module, gate_up: nn.Module,
                  down: nn.Module, act: str, norm_post_attn: nn.Module | None = None,
                  norm_post_mlp: nn.Module | None = None, q_norm: nn.Module | None = None,
                  k_norm: nn.Module | None = None) -> LayerWeights | None:
    """A block's ``LayerWeights`` for the decoder stack, from its modules' kernel views
    (after ``use_kernels``; the q/k/v and gate/up products fused); None when one part has
    no view (the block keeps its per-op path)."""
    parts = {"norm_in": norm_in, "qkv": getattr(attn, "qkv_proj", None), "o": attn.o_proj, "norm_mlp": norm_mlp,
             "gate_up": gate_up, "down": down}  # fmt: skip
    optional = {"norm_post_attn": norm_post_attn, "norm_post_mlp": norm_post_mlp, "q_norm": q_norm, "k_norm": k_norm}
    views = {name: getattr(m, "kernel", None) for name, m in parts.items()}
    if any(v is None for v in views.values()) or any(getattr(m, "kernel", 0) is None for m in optional.values()):
        return None
    views.update({name: None if m is None else m.kernel for name, m in optional.items()})
    return LayerWeights(**views, act=act, n_heads=attn.n_heads, n_kv=attn.n_kv, head_dim=attn.head_dim,
                        scale=attn.scale, layer=attn.layer_idx, window=attn.window, softcap=attn.softcap)  # fmt: skip


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
        """``rope.apply_rope_`` on x (B, T, heads, hd), in place."""
        return apply_rope_(x, cos, sin)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: BatchLayout, kv: KVPool) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        k, v = kv.update(self.layer_idx, layout, k, v)  # (B, C, n_kv, hd)
        return self.attend(q, k, v, *layout.mask_for(q.dtype, self.window))

    def forward_nocache(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.qkv(x, cos, sin)
        return self.attend(q, k, v, *causal_mask(x.shape[1], self.window, q.dtype, x.device))
