"""What the model files share, once: the products (``Linear``; quant.py's formats), the
norm (``RMSNorm``, with Gemma's (1 + w) offset), the gated MLP, paged attention, and
``CausalLM``, the loader's contract and the forward every family runs:

    x = embed(ids, positions)
    for block in blocks:  x = block(x, rope, layout, kv)
    logits = head(x at each sequence's last token)

A family file defines its blocks and whatever differs (its embedding, its RoPE, its
head) and nothing else. The forward is the prefill path and the reference of the
engine's decode step, whose backends (models/step.py: the native CPU step, the CUDA
step) read the same modules through ``CausalLM.decoder``. Where the native kernels
serve (``use_kernels``) a module's CPU work (its products, norms, gates, RoPE, a
prefill's causal attention) is their call inside its own forward.
"""

from __future__ import annotations

import contextlib
import torch
import torch.nn.functional as F
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager

from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..kernels import ops as kernel_ops
from ..kernels.layer import MAX_ROWS, NormWeights, ProductWeights, norm, product
from .config import ModelConfig
from .rope import Rotary, apply_rope_

if TYPE_CHECKING:
    from ..kv.cache import BatchLayout, KVPool

Rope = tuple[Tensor, Tensor]  # (cos, signed sin), (B, T, 1, rot) each: rope.Rotary's output

# Row counts (tokens in the forward) that take the CPU fast path of ``Linear``.
SMALL_ROWS = range(2, 65)
# Row counts that run on the oneDNN-packed weight when a ``Linear`` has one (``pack``).
# One row joins them when torch runs more than one thread: MKL's one-row GEMV barely
# gains from a second thread where oneDNN's packed GEMM does (measured: docs/benchmarks-log.md, "Measurement notes").
PACKED_ROWS = range(2, 65)
# Smaller weights are not packed: oneDNN's fixed cost per call outweighs its faster read
# below ~256K elements (measured: docs/benchmarks-log.md, "Measurement notes").
PACK_MIN_ELEMENTS = 1 << 18
# From this many rows (prefill: compute-bound) a float32 CPU ``Linear`` of at least
# PACK_MIN_ELEMENTS runs oneDNN's GEMM on its dense weight (``mkldnn._linear_pointwise``:
# the weight read in place, no second copy) instead of MKL's ``F.linear``: MKL takes its
# generic path on AMD CPUs, oneDNN JITs for the ISA it finds (docs/benchmarks.md,
# choice-onednn-prefill; the products: docs/benchmarks-log.md, "Measurement notes").
ONEDNN_MIN_ROWS = 65
# The native causal attention (``attend_natively``) from this many query rows per kv head
# (T * nh / n_kv): it packs each kv head's K and V once per call, which fewer rows do not
# repay (measured against torch's SDPA: docs/benchmarks-log.md, "Measurement notes").
NATIVE_ATTENTION_MIN_ROWS = 8
ONEDNN_F32 = torch.backends.mkldnn.is_available()


# torch's oneDNN linear has no public entry: its two ops below are the ones torch's own
# inductor (mkldnn fusion) calls. Named here once; a torch without them: ``pack`` refuses.
def onednn_pack(w: Tensor) -> Tensor:
    """``w`` (out, in) float32 in oneDNN's packed layout for ~8-row products (opaque)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, 8)


def onednn_linear(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ w.T + bias`` by oneDNN's GEMM, ``w`` dense or ``onednn_pack``'s."""
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def weight_version(w: Tensor) -> int | None:
    """``w``'s version counter (torch bumps it on every in-place change; a cache keyed by it
    sees the change), None for an inference tensor, which has none and cannot change."""
    return None if w.is_inference() else w._version


class UsesKernels:
    """A module with a native implementation of its CPU work: ``use_kernels()`` (called
    once at load by ``use_kernels(model)``, only where the kernels loaded and the model
    computes in float32 on the CPU) takes the typed view of its weights that the kernels
    read; its forward then runs them (a product's 1..``MAX_ROWS`` rows; a norm's, a
    gate's and RoPE's rows, however many: one pass over the rows, where torch's path runs
    3-7 ops with a parallel region each: ~110M bf16, 512 and 2048 tokens, 2 threads, +11-12%
    on the whole prefill, docs/benchmarks.md "Causal prefill attention"), and the native
    decode step (models/step.py) reads the same views."""

    def use_kernels(self) -> None:
        raise NotImplementedError


class Linear(nn.Linear, UsesKernels):
    """``nn.Linear`` (same parameters, same result) with CPU fast paths for a few rows.

    A few rows (1..64: a short prompt's, the reference decode step's) are bound by
    reading the weights. With the native kernels (``use_kernels``) their product reads
    the float32 weight in place, one dot product per output, the same sum whatever the
    other rows. Without them (torch's path):

    - ``pack()`` (called by the loader, ``pack_linears``) keeps a second copy of the
      weight in oneDNN's blocked layout; 2..64 rows run oneDNN's GEMM on it
      (``mkldnn._linear_pointwise``), which reads it faster than MKL at 2-64 rows; one row
      runs there too when torch has more than one thread, and stays on MKL's GEMV at one
      thread, where MKL is faster (measured: docs/benchmarks-log.md, "Measurement notes"). Costs one more copy of
      the weight.
    - Unpacked, 2..64 rows compute ``W @ x.T`` instead of ``x @ W.T`` (MKL is several
      times slower per weight byte on the latter at a few rows on AVX2).

    From 65 rows (prefill, compute-bound) oneDNN's GEMM runs on the dense float32 CPU
    weight (``ONEDNN_MIN_ROWS``; small weights, other dtypes and devices: ``F.linear``).
    Rounding may differ in the last bits between the paths.
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
            packed = onednn_pack(w.detach())
            onednn_linear(torch.zeros(1, self.in_features), packed, self.bias)
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
            return onednn_linear(x, packed, self.bias)
        if x.device.type != "cpu" or rows not in SMALL_ROWS:
            w = self.weight
            if (rows >= ONEDNN_MIN_ROWS and ONEDNN_F32 and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32
                    and w.numel() >= PACK_MIN_ELEMENTS and w.is_contiguous()):  # fmt: skip
                return onednn_linear(x, w, self.bias)
            return F.linear(x, w, self.bias)
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
    """Route the CPU work of ``model``'s modules to the native kernels (the caller checked
    that they loaded and that the model computes in float32 on the CPU): every
    ``UsesKernels`` module takes its weights' view. Returns how many modules were switched."""
    users = [m for m in model.modules() if isinstance(m, UsesKernels)]
    for m in users:
        m.use_kernels()
    return len(users)


def rope_span(positions: Tensor, layout: BatchLayout | None) -> tuple[int, int | None]:
    """``Rotary``'s span of the forward's positions (B, T), from the layout's host-side
    lengths (no device read): (the longest sequence's length, the first position when the
    positions in order are one run: one sequence's tokens, or one new token per row at
    consecutive positions, as a verify step's rows; else None). No layout (no cache, every
    row at 0 .. T - 1): (T, 0) for one row."""
    if layout is None:
        T = positions.shape[-1]
        return T, 0 if positions.shape[0] == 1 else None
    lens, new = layout.seq_lens, layout.num_new_tokens
    if len(lens) == 1:
        return lens[0], lens[0] - new[0]
    if positions.shape[1] == 1 and all(b == a + 1 for a, b in zip(lens, lens[1:])):
        return lens[-1], lens[0] - 1
    return max(lens), None


def last_tokens(x: Tensor, layout: BatchLayout) -> Tensor:
    """(B, D): each sequence's last new token's row of x (B, T, D); a decode step's x
    (T == 1) as it is, a view (no copy)."""
    if x.shape[1] == 1:
        return x.flatten(0, 1)
    return x.flatten(0, 1).index_select(0, layout.last_index)


def paged_int8_attention(q: Tensor, kv: KVPool, layer: int, layout: BatchLayout, mask: Tensor | None, scale: float,
                         softcap: float | None = None, chunk_blocks: int = 32) -> Tensor:
    """softmax(cap(q k^T * scale) + mask) v over each sequence's cached context in an int8
    or fp8 pool (``--kv-cache-format int8 | fp8``: values and per-row scales), its
    blocks (``layout.ctx_blocks``) dequantized ``chunk_blocks`` at a time inside the
    attention, the chunks joined by an online softmax (running max and sum): no widened
    copy of the whole context is ever made.

    q (B, T, nh, hd); mask (B, 1, T, C) additive or None (``layout.mask_for``); softcap
    None or cap: cap * tanh(s / cap) (Gemma 2) -> (B, T, nh, hd) in q's dtype."""
    B, T, nh, hd = q.shape
    n_kv, bs, C = kv.num_kv_heads, kv.block_size, layout.ctx_len
    G = nh // n_kv
    qg = q.float().reshape(B, T, n_kv, G, hd).permute(0, 2, 3, 1, 4).reshape(B, n_kv, G * T, hd)  # rows per kv head
    if mask is not None:
        mask = mask.float().expand(B, 1, T, C)[:, :, None]  # (B, 1, 1, T, C)
    run_max = torch.full((B, n_kv, G * T, 1), float("-inf"), device=q.device)
    run_sum = torch.zeros(B, n_kv, G * T, 1, device=q.device)
    acc = torch.zeros(B, n_kv, G * T, hd, device=q.device)
    nb = -(-C // bs)
    for c0 in range(0, nb, chunk_blocks):
        c1 = min(nb, c0 + chunk_blocks)
        k_c, v_c = kv.dequantized(layer, layout.ctx_blocks[:, c0:c1].reshape(-1))  # (B*cb, bs, n_kv, hd)
        n = min(C, c1 * bs) - c0 * bs  # positions of this chunk inside the context
        k_c = k_c.view(B, -1, n_kv, hd)[:, :n].permute(0, 2, 3, 1)  # (B, n_kv, hd, n)
        v_c = v_c.view(B, -1, n_kv, hd)[:, :n].transpose(1, 2)  # (B, n_kv, n, hd)
        s = torch.matmul(qg, k_c) * scale  # (B, n_kv, G*T, n)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if mask is not None:
            s = (s.view(B, n_kv, G, T, n) + mask[..., c0 * bs : c0 * bs + n]).view(B, n_kv, G * T, n)
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        safe = new_max.masked_fill(new_max == float("-inf"), 0.0)  # rows that saw nothing yet: weights 0
        p = torch.exp(s - safe)
        alpha = torch.exp(run_max - safe)
        run_sum = run_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v_c)
        run_max = new_max
    out = acc / run_sum  # (B, n_kv, G*T, hd)
    return out.view(B, n_kv, G, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, nh, hd).to(q.dtype)


def causal_mask(T: int, window: int | None, dtype: torch.dtype, device: torch.device) -> tuple[Tensor | None, bool]:
    """(additive mask (T, T) or None, is_causal) for plain causal attention over T tokens
    from position 0, limited to the last ``window`` positions when one is given
    (``BatchLayout.mask_for``'s rule: key j is visible to query i iff i - window < j <= i)."""
    if window is None or T <= window:
        return None, T > 1
    i = torch.arange(T, device=device)
    allowed = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)  # (T, T)
    return torch.zeros(T, T, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")), False


# torch's CUDA attention kernels a forward may use, in torch's order: all but cuDNN's, which
# builds a graph for every new shape, and a decode step's context is a new length every step
# (docs/benchmarks.md, gpu-sdpa; docs/benchmarks-log.md, "Measurement notes").
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(device: torch.device) -> ContextManager:
    """The SDPA kernels for one forward's layers on ``device``: CUDA_SDPA_BACKENDS on
    CUDA (entered once per forward), torch's own choice elsewhere."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float | None = None,
         expand_heads: bool | None = None) -> Tensor:
    """(B, nh, T, hd) from q (B, nh, T, hd) and k, v (B, n_kv, C, hd): torch's
    scaled-dot-product attention, grouped-query when n_kv < nh. On CUDA a masked call
    over grouped kv heads gets them expanded (repeat_interleave) first: torch runs GQA
    only in its flash kernel, which takes no mask, and in the math one, which writes out
    every score (what that cost on the H200: docs/benchmarks-log.md, "Measurement notes"); the
    memory-efficient kernel takes the mask over the expanded heads (``expand_heads``:
    that choice forced either way, for tests)."""
    gqa = k.shape[1] != q.shape[1]
    if expand_heads is None:
        expand_heads = mask is not None and q.device.type == "cuda"
    if gqa and expand_heads:
        rep = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def fuse_linears(linears: list[Linear]) -> Linear:
    """One ``Linear`` computing the given ones side by side: its output is their outputs
    concatenated on the last dim (split it with ``.split([l.out_features ...], -1)``).

    Used after loading (q/k/v, gate/up): one weight read and one kernel call instead of
    several per step. Every input must have the same in_features, dtype and device and
    all or none a bias; the weights are copied, the inputs can be dropped. Products kept
    in stored blocks (quant.QuantLinear, a GGUF file's) are joined by their class's ``cat``."""
    first = linears[0]
    if not isinstance(first, Linear):
        return type(first).cat(linears)
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


class RMSNorm(nn.Module, UsesKernels):
    """x * rsqrt(mean(x^2) + eps) * (offset + w) over the last dim: offset 0 (Llama and
    most families, w starts at one), or 1 (Gemma: (1 + w), w starts at zero, all of it in
    float32 as its reference computes).

    float32: the ops of torch's ``F.rms_norm`` (on the CPU not one kernel but ten: pow,
    sum, fill, div, add, rsqrt, two muls and two copies wrapping the Python scalars 1/D
    and eps), bit for bit the same result, in eight: the scalars are 0-dim tensors made
    once per device and weight version (with (1 + w)), and the divide, add and rsqrt run
    in place. With the kernels, the rows are one native call."""

    kernel: NormWeights | None = None  # the rows by one native call (``use_kernels``)

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, float(offset)
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self._cache: dict[object, tuple[Tensor, Tensor, Tensor]] = {}  # (D, eps, offset + w) per weight version

    def use_kernels(self) -> None:
        self.kernel = NormWeights.of(self.weight, self.eps, self.offset)

    def _inv(self, xf: Tensor) -> tuple[Tensor, Tensor]:
        """(rsqrt(mean(xf^2) + eps) (..., 1), the scale (D,)) for float32 xf."""
        w = self.weight
        key = (w.device, w.data_ptr(), weight_version(w))  # a model loaded under inference_mode: None
        if key not in self._cache:
            with torch.inference_mode(False):  # plain tensors: usable with autograd too
                self._cache = {key: (
                    torch.tensor(float(xf.shape[-1]), dtype=torch.float32, device=w.device),
                    torch.tensor(self.eps, dtype=torch.float32, device=w.device),
                    self.offset + w.detach().float() if self.offset else w,
                )}  # fmt: skip
        d, eps, scale = self._cache[key]
        return xf.pow(2).sum(-1, keepdim=True).div_(d).add_(eps).rsqrt_(), scale

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None:
            return norm(self.kernel, x)
        if self.offset or x.dtype == torch.float32 == self.weight.dtype:
            xf = x.float()
            inv, scale = self._inv(xf)
            return torch.mul(xf, inv).mul_(scale).to(x.dtype)
        # normalize in float32 (as the reference does), scale in the model dtype
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def forward_(self, x: Tensor) -> Tensor:
        """``forward`` written into x itself (a view into a larger output: the per-head
        q/k norms on the fused q/k/v); the same values."""
        if x.dtype == torch.float32 == self.weight.dtype:
            inv, scale = self._inv(x)
            return x.mul_(inv).mul_(scale)
        return x.copy_(self(x))


_GATES = {  # the gate's activation in torch (the kernels' act_mul takes the same names)
    "silu": lambda g: F.silu(g, inplace=True),
    "gelu": lambda g: F.gelu(g),
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
}


class GatedMLP(nn.Module, UsesKernels):
    """down(act(gate(x)) * up(x)): SwiGLU (``silu``) or GeGLU (``gelu``, ``gelu_tanh``).
    gate and up run as one product, ``gate_up_proj``: fused in the checkpoint (Phi-3), or
    after loading (``fuse``: the checkpoint's ``gate_proj`` and ``up_proj``)."""

    kernel: bool = False  # act(gate) * up in one native call (``use_kernels``)

    def __init__(self, d: int, hidden: int, bias: bool, act: str, fused: bool = False) -> None:
        super().__init__()
        if act not in _GATES:
            raise ValueError(f"gate activation {act!r}; one of {', '.join(_GATES)}")
        self.act = act
        if fused:
            self.gate_up_proj = Linear(d, 2 * hidden, bias=bias)
        else:
            self.gate_proj = Linear(d, hidden, bias=bias)
            self.up_proj = Linear(d, hidden, bias=bias)
        self.down_proj = Linear(hidden, d, bias=bias)

    def fuse(self) -> None:
        if not hasattr(self, "gate_up_proj"):
            self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def use_kernels(self) -> None:
        self.kernel = True

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)  # (B, T, 2h)
        if self.kernel:
            return self.down_proj(kernel_ops.act_mul(gate_up, self.act))
        return self.down_proj(gated(gate_up, self.act))


def gated(gate_up: Tensor, act: str) -> Tensor:
    """act(gate) * up of a gate|up product's output (..., 2h) -> (..., h), torch's ops (the
    CUDA step's too); in place in the gate's half: no extra (.., h) temporaries (each a
    page-faulting allocation when large)."""
    gate, up = gate_up.chunk(2, dim=-1)  # (..., h) each
    return _GATES[act](gate).mul_(up)


def attend_natively(q: Tensor, k: Tensor, v: Tensor, layout: BatchLayout | None, window: int | None, scale: float,
                     softcap: float | None) -> Tensor | None:
    """Causal attention by the native kernel (``ops.prefill_attention``: the work above
    the diagonal and before the window skipped), q (B, T, nh, hd) over k, v (B, C, n_kv,
    hd) -> (B, T, nh, hd); None where it does not apply (not float32 on the CPU, heads not
    contiguous, fewer than NATIVE_ATTENTION_MIN_ROWS query rows per kv head): the caller's
    torch path then runs. ``layout`` None: each sequence's T tokens from position 0
    (``forward_nocache``)."""
    if q.shape[1] * (q.shape[2] // k.shape[2]) < NATIVE_ATTENTION_MIN_ROWS:
        return None
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in (q, k, v)):
        return None
    if k.stride()[:2] != v.stride()[:2]:
        v = v.contiguous()
        k = k.contiguous()
    if layout is None:
        lens = torch.full((q.shape[0],), q.shape[1], dtype=torch.long)
        return kernel_ops.prefill_attention(q, k, v, lens, lens, window, scale, softcap)
    return kernel_ops.prefill_attention(q, k, v, layout.lens_tensor(), layout.new_tokens_tensor(), window, scale, softcap)


class PagedAttention(nn.Module, UsesKernels):
    """Grouped-query attention over the paged KV pool, as every RoPE family has it:

        q, k, v = split(qkv_proj(x))     # one product (fused in the checkpoint, or by ``fuse``)
        q, k = q_norm(q), k_norm(k)      # per head, when the config has them (Qwen3, Gemma 3)
        q, k = rope(q), rope(k)          # in place, q and k heads together
        y = o_proj(attention(q, K, V))   # K, V: the pool's context with k, v written in

    ``scale`` defaults to head_dim^-1/2; ``window`` is the config's for this layer. A
    family changes the scores by overriding ``sdpa`` (Gemma 2's soft-cap). With the native
    kernels (``use_kernels``) the attention of float32 rows runs ``attend_natively``
    instead of ``sdpa`` (soft-cap and window included), and RoPE one native call."""

    softcap: float | None = None  # attention logit soft-cap (Gemma 2)
    native_attention: bool = False  # attention by the native kernel (``use_kernels``)

    def __init__(self, config: ModelConfig, layer_idx: int, fused: bool = False, scale: float | None = None,
                 norm_offset: float = 0.0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.window = config.layer_window(layer_idx)  # None: full attention; else a sliding window
        d, bias = config.hidden_size, config.attention_bias
        if fused:
            self.qkv_proj = Linear(d, config.q_size + 2 * config.kv_size, bias=bias)
        else:
            self.q_proj = Linear(d, config.q_size, bias=bias)
            self.k_proj = Linear(d, config.kv_size, bias=bias)
            self.v_proj = Linear(d, config.kv_size, bias=bias)
        self.o_proj = Linear(config.q_size, d, bias=config.attention_out_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps, norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps, norm_offset)

    def use_kernels(self) -> None:
        self.native_attention = True

    def fuse(self) -> None:
        """One projection for q, k and v (one weight read, one kernel call per step)."""
        if not hasattr(self, "qkv_proj"):
            self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
            del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
        """(q (B, T, nh, hd), k, v (B, T, n_kv, hd)): views into one product's output."""
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=2)
        # in place in qkv: norms, then q and k rotated together; k and v stay side by
        # side, so KVPool.update writes them with one index_put_
        if self.qk_norm:
            self.q_norm.forward_(q)
            self.k_norm.forward_(k)
        if self.native_attention and qkv.dtype == torch.float32:
            kernel_ops.rope_(qkv[:, :, : self.n_heads + self.n_kv], *rope)
        else:
            apply_rope_(qkv[:, :, : self.n_heads + self.n_kv], *rope)
        return q, k, v

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        """(B, nh, T, hd) from q (B, nh, T, hd) and k, v (B, n_kv, C, hd)."""
        if q.shape[2] > 1:  # prefill: the flash kernel runs markedly faster on contiguous heads
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return sdpa(q, k, v, mask, is_causal, self.scale)

    def forward(self, x: Tensor, rope: Rope, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        """x (B, T, D) -> (B, T, D); ``layout`` None: plain causal attention over x alone."""
        q, k, v = self.qkv(x, rope)
        B, T = q.shape[:2]
        if layout is not None and kv.spec.quantized and not layout.fresh:  # int8 / fp8 KV over a cached context
            kv.write_int8(self.layer_idx, layout, k, v)
            mask, _ = layout.mask_for(torch.float32, self.window)
            y = paged_int8_attention(q, kv, self.layer_idx, layout, mask, self.scale, self.softcap)  # (B, T, nh, hd)
            return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))
        if layout is not None:
            k, v = kv.update(self.layer_idx, layout, k, v)  # (B, C, n_kv, hd)
        y = attend_natively(q, k, v, layout, self.window, self.scale, self.softcap) if self.native_attention else None
        if y is None:
            if layout is not None:
                mask, is_causal = layout.mask_for(q.dtype, self.window)
            else:
                mask, is_causal = causal_mask(x.shape[1], self.window, q.dtype, x.device)
            y = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, is_causal).transpose(1, 2)
        return self.o_proj(y.reshape(B, T, self.n_heads * self.head_dim))  # y (B, T, nh, hd)


RopeTables = Callable[[int, torch.dtype, torch.device], tuple[Rope, ...]]


@dataclass(frozen=True)
class DecoderLayer:
    """One pre-norm decoder block as a decode step backend reads it: its own modules (the
    backend takes their weights, or their kernel views, from them):

        x += norm_post_attn(attn(norm_in(x)))      # the norm_post_* only where the family has them (Gemma)
        x += norm_post_mlp(mlp(norm_mlp(x)))"""

    attn: PagedAttention
    norm_in: RMSNorm
    norm_mlp: RMSNorm
    mlp: GatedMLP
    norm_post_attn: RMSNorm | None = None
    norm_post_mlp: RMSNorm | None = None
    rope_group: int = 0  # which of the family's RoPE tables it rotates with (Gemma 3's sliding layers: 1)


@dataclass(frozen=True)
class DecoderEnds:
    """What a decode step runs around the layers: x = embedding[ids] * scale, and logits
    = head(norm(x)), then cap * tanh(logits / cap) where the family caps them."""

    embedding: Tensor  # (V, D)
    scale: float  # 1.0: none (Gemma: sqrt(D), rounded to the model dtype as its reference does)
    norm: RMSNorm
    head: nn.Module  # Linear or quant.py's QuantLinear: (..., D) -> (..., V)
    softcap: float | None = None


@dataclass(frozen=True)
class Decoder:
    """A model as the decode step backends read it (``CausalLM.decoder``): its layers, its
    ends and its RoPE. ``rope_tables(length, dtype, device)``: one (cos, signed sin)
    (n, rot) table pair per rope group (n >= length rows by position; () without RoPE);
    LongRoPE (``long_threshold`` set): the short factors' n rows then the long factors'
    n rows, a row of the long regime reading its position's row of the second half."""

    layers: tuple[DecoderLayer, ...]
    ends: DecoderEnds
    rope_tables: RopeTables
    long_threshold: int | None = None

    @property
    def groups(self) -> list[int]:
        return [layer.rope_group for layer in self.layers]


class CausalLM(nn.Module):
    """A decoder-only language model as the loader and the engine use it.

    The loader's contract (loading.py):

        transposed        checkpoint tensor names stored (in, out), transposed on load
        tied              (alias, source): lm_head's weight is the embedding's, when tied
        checkpoint_name   our parameter name for a checkpoint tensor name (None: skip it)
        tie_weights()     share the tied weights (again after ``to_empty``)
        reset_buffers()   recompute the non-persistent buffers (RoPE's) after meta init

    The forward contract (the engine's; the reference decode step's too, models/step.py):

        model(layout, kv, all_logits=False) -> logits (B, V) at each sequence's last new
                                               token ((B, T, V) when all_logits), float32
        model.forward_nocache(input_ids (B, T)) -> logits (B, T, V): plain causal attention
        model.decoder()   the model as the native and CUDA decode steps read it (None: the
                          family has no such step; its decode steps run ``forward``)

    A family defines ``blocks`` (its decoder blocks, each ``block(x, rope, layout, kv)``
    with ``rope_group``: which of ``ropes``' pairs it rotates with, and
    ``decoder_layer()``: the block as a ``DecoderLayer``), ``embed``, ``ropes``,
    ``rope_tables``, ``head`` and ``decoder_ends``."""

    transposed: tuple[str, ...] = ()
    tied: tuple[str, str] | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    # ---- the loader's hooks
    @property
    def tied_weights(self) -> dict[str, str]:
        """Parameter names that share storage with another one (alias -> source)."""
        return dict([self.tied]) if self.tied else {}

    def tie_weights(self) -> None:
        for alias, source in self.tied_weights.items():
            owner, _, name = alias.rpartition(".")
            setattr(self.get_submodule(owner), name, self.get_parameter(source))

    def checkpoint_name(self, key: str) -> str | None:
        return None if key.endswith("rotary_emb.inv_freq") else key  # old checkpoints saved it

    def reset_buffers(self) -> None:
        for m in self.modules():
            if isinstance(m, Rotary):
                m.reset_buffers()

    def decoder(self) -> Decoder | None:
        """The model as its decode step backends read it; None where a block is no
        ``DecoderLayer`` (GPT-2) or the family has no plain ends."""
        layers = [getattr(block, "decoder_layer", lambda: None)() for block in self.blocks]
        ends = self.decoder_ends()
        if ends is None or any(layer is None for layer in layers):
            return None
        return Decoder(tuple(layers), ends, self.rope_tables, self.config.longrope_threshold)

    def decoder_ends(self) -> DecoderEnds | None:
        """The embedding and head as a decode step runs them (``DecoderEnds``), when the
        family's ``embed`` and ``head`` are a plain row gather (times a scale) and a norm
        and product (and a softcap); None: no decode step backend but the reference."""
        return None

    # ---- what a family defines
    @property
    def blocks(self) -> nn.ModuleList:
        raise NotImplementedError

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """(B, T, D), the model's own tensor (the blocks add into it in place)."""
        raise NotImplementedError

    def ropes(self, positions: Tensor, dtype: torch.dtype, layout: BatchLayout | None) -> tuple[Rope, ...]:
        """The step's (cos, sin) pairs in ``dtype`` for positions (B, T); () without RoPE."""
        return ()

    def rope_tables(self, length: int, dtype: torch.dtype = torch.float32,
                    device: torch.device = torch.device("cpu")) -> tuple[Rope, ...]:
        """``ropes``' pairs as tables by position, (n, rot) cos and sin each (n >= length;
        LongRoPE: ``Decoder``'s two halves), in ``dtype`` on ``device``, for the decode step
        backends (``Decoder.rope_tables``); () without RoPE."""
        return ()

    def head(self, x: Tensor) -> Tensor:
        """(..., D) -> float32 logits (..., V)."""
        raise NotImplementedError

    # ---- the forward
    def run_blocks(self, x: Tensor, ropes: tuple[Rope, ...], layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        with attention_backends(x.device):
            for block in self.blocks:
                x = block(x, ropes[block.rope_group] if ropes else None, layout, kv)
        return x

    def forward(self, layout: BatchLayout, kv: KVPool, all_logits: bool = False, rows: Tensor | None = None) -> Tensor:
        """Logits of each sequence's last new token (B, V); ``all_logits``: of every new
        token (B, T, V); ``rows`` (R,): of those rows of the B alone (R, V)."""
        x = self.embed(layout.input_ids, layout.positions)  # (B, T, D)
        x = self.run_blocks(x, self.ropes(layout.positions, x.dtype, layout), layout, kv)
        if not all_logits:
            x = last_tokens(x, layout)  # (B, D)
            if rows is not None:
                x = x.index_select(0, rows)  # (R, D)
        return self.head(x)  # (B, V), (R, V) or (B, T, V)

    def forward_nocache(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids, positions)
        return self.head(self.run_blocks(x, self.ropes(positions, x.dtype, None), None, None))  # (B, T, V)
