"""One decoder layer of a decode step in one native call (``layer.cpp``).

A family's ``Block`` describes itself with ``native_spec()`` (its norms, the fused
q/k/v and gate/up products, the attention's geometry), ``NativeLayer`` turns that into
the C struct once at load time (pointers into the module's own tensors: nothing is
copied), and the model's forward runs every block of a decode step (one new token per sequence) through
``NativeStack.run``: what the step needs (the pool, block tables, slots, cos/sin) is made
once, then one native call per block, with no per-block Python checks. A block alone
(``Block.forward``, when some block of the model has no native layer) calls ``run_layer``.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvserve.service.models import native

ACTS = {"silu": 0, "gelu_tanh": 1}
MAX_ROWS = 64


class KvLinear(ctypes.Structure):
    _fields_ = [("w", ctypes.c_void_p), ("scales", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("fmt", ctypes.c_int64)]  # fmt: skip


class KvLayer(ctypes.Structure):
    _fields_ = [("norm_in", ctypes.c_void_p), ("norm_post_attn", ctypes.c_void_p), ("norm_mlp", ctypes.c_void_p),
                ("norm_post_mlp", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qkv", KvLinear), ("o", KvLinear), ("gate_up", KvLinear), ("down", KvLinear),
                ("eps", ctypes.c_float), ("norm_offset", ctypes.c_float), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float), ("nh", ctypes.c_int64), ("nkv", ctypes.c_int64), ("hd", ctypes.c_int64),
                ("window", ctypes.c_int64), ("layer", ctypes.c_int64), ("act", ctypes.c_int64)]  # fmt: skip


class KvStep(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int64), ("D", ctypes.c_int64), ("pool", ctypes.c_void_p), ("L", ctypes.c_int64),
                ("bs", ctypes.c_int64), ("slot_block", ctypes.c_void_p), ("slot_off", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("nb", ctypes.c_int64), ("lens", ctypes.c_void_p),
                ("nthreads", ctypes.c_int64)]  # fmt: skip


@dataclass
class LayerSpec:
    """What a family's block is made of, for the native layer (Block.native_spec)."""

    norm_in: nn.Module  # RMSNorm modules (``weight``, ``eps``)
    qkv: nn.Module  # fused q/k/v: layers.Linear or quant.QuantLinear, out = (nh + 2 n_kv) * hd
    o: nn.Module
    norm_mlp: nn.Module
    gate_up: nn.Module  # fused gate/up, out = 2 * intermediate
    down: nn.Module
    act: str  # "silu" | "gelu_tanh"
    attn: nn.Module  # the PagedAttention: n_heads, n_kv, head_dim, scale, window, softcap, layer_idx
    norm_offset: float = 0.0  # 1.0: Gemma's (1 + w) norms
    norm_post_attn: nn.Module | None = None
    norm_post_mlp: nn.Module | None = None
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None


def _linear(m: nn.Module, keep: list[Tensor]) -> KvLinear | None:
    """The C view of a product module; None when its weights cannot be read natively."""
    from kvserve.service.models.layers import Linear
    from kvserve.service.models.quant import QuantLinear

    bias = getattr(m, "bias", None)
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    if isinstance(m, QuantLinear):
        w = m.weight
        if m.fmt == "bf16":
            fmt, scales = 1, None
        else:
            scales = m._scales32  # made by QuantLinear.enable_native, which layers.enable_native runs first
            if scales is None:
                return None
            fmt = 3 if m.fmt == "w8a8" and m.in_features % 32 == 0 else 2
    elif isinstance(m, Linear):
        w, fmt, scales = m.weight, 0, None
        if w.dtype != torch.float32:
            return None
    else:
        return None
    if w.device.type != "cpu" or not w.is_contiguous():
        return None
    keep += [t for t in (w, scales, bias) if t is not None]
    N, K = w.shape
    return KvLinear(w.data_ptr(), scales.data_ptr() if scales is not None else None,
                    bias.data_ptr() if bias is not None else None, N, K, fmt)  # fmt: skip


def _norm(m: nn.Module | None, keep: list[Tensor]) -> int | None:
    if m is None:
        return None
    w = m.weight
    if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        raise ValueError("norm weight not float32 CPU contiguous")
    keep.append(w)
    return w.data_ptr()


class NativeLayer:
    """The C struct of one block (pointers into its modules' tensors, kept referenced)."""

    def __init__(self, spec: LayerSpec) -> None:
        keep: list[Tensor] = []
        a = spec.attn
        linears = [_linear(m, keep) for m in (spec.qkv, spec.o, spec.gate_up, spec.down)]
        if any(l is None for l in linears):
            raise ValueError("a product the native layer cannot read")
        qkv, o, gate_up, down = linears
        if qkv.N != (a.n_heads + 2 * a.n_kv) * a.head_dim or gate_up.N % 2 or down.K != gate_up.N // 2:
            raise ValueError("unexpected projection shapes")
        if spec.act not in ACTS:
            raise ValueError(f"activation {spec.act}")
        self.struct = KvLayer(
            _norm(spec.norm_in, keep), _norm(spec.norm_post_attn, keep), _norm(spec.norm_mlp, keep),
            _norm(spec.norm_post_mlp, keep), _norm(spec.q_norm, keep), _norm(spec.k_norm, keep),
            qkv, o, gate_up, down, float(spec.norm_in.eps), float(spec.norm_offset), float(a.scale),
            float(a.softcap or 0.0), a.n_heads, a.n_kv, a.head_dim, int(a.window or 0), a.layer_idx, ACTS[spec.act],
        )  # fmt: skip
        self.hidden = spec.norm_in.weight.numel()
        self._keep = keep
        self._ref = ctypes.byref(self.struct)


def step_args(layout, kv) -> KvStep:
    """The per-step C arguments for ``layout`` over ``kv`` (made once per layout)."""
    key = ("native_step", id(kv))
    step = layout._bias.get(key)
    if step is None:
        B, nb = layout.ctx_blocks.shape
        step = KvStep(B, 0, kv.data.data_ptr(), kv.num_layers, kv.block_size, layout.slot_blocks.data_ptr(),
                      layout.slot_offsets.data_ptr(), layout.ctx_blocks.data_ptr(), nb,
                      layout.lens_tensor().data_ptr(), torch.get_num_threads())  # fmt: skip
        layout._bias[key] = step
    return step


def applies(x: Tensor, layout, kv) -> bool:
    """Whether a block's forward can run natively: one new float32 CPU token per sequence
    (B <= 64) over a cached context in a float32 CPU pool."""
    return (layout is not None and layout.ctx_blocks is not None and x.shape[1] == 1 and x.shape[0] <= MAX_ROWS
            and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
            and kv.data.dtype == torch.float32)  # fmt: skip


def _rope_args(cos: Tensor, sin: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """cos and signed sin (B, 1, 1, rot) as the (B, rot) float32 contiguous rows the layer reads."""
    c = cos.reshape(cos.shape[0], -1)  # (B, rot): one token per sequence
    s = sin.reshape(sin.shape[0], -1)
    if c.dtype != torch.float32 or not c.is_contiguous() or not s.is_contiguous() or c.shape[0] != B:
        c, s = c.float().contiguous(), s.float().contiguous()
    return c, s


def run_layer(layer: NativeLayer, x: Tensor, cos: Tensor, sin: Tensor, layout, kv) -> Tensor:
    """x (B, 1, D) through one decoder layer, in place; returns x."""
    step = step_args(layout, kv)
    step.D = layer.hidden
    c, s = _rope_args(cos, sin, x.shape[0])
    native.load().kv_decode_layer(layer._ref, x.data_ptr(), ctypes.byref(step), c.data_ptr(), s.data_ptr(), c.shape[1])
    return x


class NativeStack:
    """Every decoder block of a model on a decode step, in order, each by its
    ``NativeLayer``: the step's arguments (``step_args``, cos/sin rows, the library's
    function) are looked up once per step, then one native call per block. Built by
    ``layers.enable_native`` from the family's ``native_stack()`` when every block has a
    native layer; the family's forward checks ``applies`` once per step and runs ``run``.

    ``groups[i]``: which of the step's (cos, sin) pairs block i rotates with (Gemma 3's
    sliding layers have their own RoPE base: pair 1); pair 0 for every block by default."""

    def __init__(self, layers: list[NativeLayer], groups: list[int] | None = None) -> None:
        groups = [0] * len(layers) if groups is None else list(groups)
        if not layers or len(groups) != len(layers) or min(groups) < 0:
            raise ValueError("a native stack needs one layer and one rope group per block")
        if len({layer.hidden for layer in layers}) != 1:
            raise ValueError("the blocks of a native stack differ in hidden size")
        self.hidden = layers[0].hidden
        self.layers = list(layers)
        self.num_groups = max(groups) + 1
        self._calls = [(layer._ref, g) for layer, g in zip(layers, groups)]
        self._refs = [layer._ref for layer in layers]

    @classmethod
    def of(cls, blocks, groups: list[int] | None = None) -> NativeStack | None:
        """The stack of ``blocks`` (their ``_native_layer``s); None when one has none."""
        layers = [getattr(b, "_native_layer", None) for b in blocks]
        if not layers or any(layer is None for layer in layers):
            return None
        return cls(layers, groups)

    def __len__(self) -> int:
        return len(self.layers)

    def run(self, x: Tensor, ropes: tuple[tuple[Tensor, Tensor], ...], layout, kv) -> Tensor:
        """x (B, 1, D) through every block, in place (the caller checked ``applies``);
        ``ropes``: the step's (cos, sin) pairs, (B, 1, 1, rot) each. Returns x."""
        step = step_args(layout, kv)
        step.D = self.hidden
        B = x.shape[0]
        rows = [_rope_args(*ropes[g], B) for g in range(self.num_groups)]  # kept referenced through the calls
        fn, xp, sp = native.load().kv_decode_layer, x.data_ptr(), ctypes.byref(step)  # the library served now
        if self.num_groups == 1:
            c, s = rows[0]
            cp, snp, rot = c.data_ptr(), s.data_ptr(), c.shape[1]
            for ref in self._refs:
                fn(ref, xp, sp, cp, snp, rot)
            return x
        ptrs = [(c.data_ptr(), s.data_ptr(), c.shape[1]) for c, s in rows]
        for ref, g in self._calls:
            cp, snp, rot = ptrs[g]
            fn(ref, xp, sp, cp, snp, rot)
        return x
