"""What the model code hands the kernels: typed views of its weights, and the decoder
stack that runs a whole decode step natively.

    ProductWeights   one product's weight in its stored format  -> product(w, x)
    NormWeights      an RMSNorm's weight, eps and offset         -> norm(n, x)
    LayerWeights     one decoder layer: its norms, products and attention geometry
    DecoderStack     every layer of a model: run(x, ropes, step), one call per layer
    StackEnds        the step's ends: the embedding rows in, the final norm and head out
    DecodeStep       one decode step's batch over the block pool (arrays only)
    NativeStep       a model's whole decode step over one pool as one native call: the
                     embedding, every layer, the head (the engine's rows, as int64 arrays)

A layer of the model builds its view once at load (``Linear.kernel_weights`` and the
like, in ``models/``); the views hold the tensors themselves (nothing is copied) and the
kernels read nothing else: this module imports nothing from ``models/``.
"""

from __future__ import annotations

import array
import ctypes
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .. import kernels
from . import ops
from .binding import header_binding

MAX_ROWS = ops.MAX_ROWS  # decode-sized work; more rows (prefill) are compute-bound: torch's GEMM
# rows one whole-layer step (DecoderStack) takes: the decode rows, and a returning turn's
# new tokens over its cached context as rows (engine/runner.py decode_step), which
# measured ahead of the padded forward up to about this many (~110M, a 320-position
# context, one chunk: 80 rows 133-146 against 159-188 ms, 128 rows 234-291 against
# 237-268, 256 rows 459-493 against 394-419)
STACK_ROWS = 2 * MAX_ROWS
_H = header_binding()
_C = _H.constants
KvLinear, KvLayer, KvStep, KvModel = (_H.structs[n] for n in ("KvLinear", "KvLayer", "KvStep", "KvModel"))
FORMATS = {"f32": _C["KV_F32"], "bf16": _C["KV_BF16"], "i8": _C["KV_I8"], "q8": _C["KV_Q8"]}
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i8": torch.int8, "q8": torch.int8}


def _usable(t: Tensor | None, dtype: torch.dtype = torch.float32) -> bool:
    return t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous())


@dataclass(frozen=True)
class ProductWeights:
    """y = x W^T * scales + bias as the kernels read it. ``fmt``: "f32" (float32 W),
    "bf16", "i8" (int8 W, float32 input) or "q8" (int8 W, the input quantized per block
    of 32: w8a8; K % 32 == 0). ``scales`` (N,) float32 for the int8 formats."""

    w: Tensor  # (N, K)
    scales: Tensor | None
    bias: Tensor | None
    fmt: str

    @classmethod
    def of(cls, w: Tensor, scales: Tensor | None, bias: Tensor | None, fmt: str) -> ProductWeights | None:
        """The view, or None when the kernels cannot read these tensors (not CPU, not
        contiguous, another dtype, a q8 K not a multiple of 32)."""
        int8 = fmt in ("i8", "q8")
        if fmt not in FORMATS or not _usable(w, _DTYPES[fmt]) or not _usable(bias) or w.dim() != 2:
            return None
        if int8 != (scales is not None) or not _usable(scales) or (fmt == "q8" and w.shape[1] % 32):
            return None
        return cls(w, scales, bias, fmt)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)

    def struct(self) -> KvLinear:
        N, K = self.w.shape
        return KvLinear(self.w.data_ptr(), None if self.scales is None else self.scales.data_ptr(),
                        None if self.bias is None else self.bias.data_ptr(), N, K, FORMATS[self.fmt])  # fmt: skip


def product(p: ProductWeights, x: Tensor, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """x (..., K) float32, 1..MAX_ROWS rows, through the product: (..., N) float32."""
    if p.fmt == "q8":
        return ops.gemv_q8(x, p.w, p.scales, p.bias, out, accumulate)
    return ops.gemv(x, p.w, p.scales, p.bias, out, accumulate)


def product_gemm(p: ProductWeights, x: Tensor, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """x (..., K) float32, any number of rows (prefill), through the product of an f32,
    bf16 or i8 weight (gemm.cpp; not q8: w8a8's prefill quantizes its input otherwise)."""
    if p.fmt == "q8":
        raise ValueError("product_gemm: f32, bf16 or i8 weights")
    return ops.gemm(x, p.w, p.scales, p.bias, out, accumulate)


@dataclass(frozen=True)
class NormWeights:
    """x * rsqrt(mean(x^2) + eps) * (weight + offset) (offset 1: Gemma's (1 + w))."""

    weight: Tensor  # (D,) float32
    eps: float
    offset: float = 0.0

    @classmethod
    def of(cls, weight: Tensor, eps: float, offset: float = 0.0) -> NormWeights | None:
        return cls(weight, float(eps), float(offset)) if _usable(weight) else None


def norm(n: NormWeights, x: Tensor) -> Tensor:
    """x (..., D) float32, 1..MAX_ROWS rows, normalized: a new tensor."""
    return ops.rmsnorm(x, n.weight, n.eps, n.offset)


ACTS = {"silu": _C["KV_SILU"], "gelu_tanh": _C["KV_GELU_TANH"], "gelu": _C["KV_GELU"]}


@dataclass(frozen=True)
class LayerWeights:
    """One pre-norm decoder layer (layer.cpp):

        x += post_attn(o(attention(rope(qk_norm(split(qkv(norm_in(x))))))))
        x += post_mlp(down(act(gate) * up)),  gate | up = gate_up(norm_mlp(x))

    ``qkv``'s output is (n_heads + 2 n_kv) * head_dim, ``gate_up``'s 2 * intermediate."""

    norm_in: NormWeights
    qkv: ProductWeights
    o: ProductWeights
    norm_mlp: NormWeights
    gate_up: ProductWeights
    down: ProductWeights
    act: str  # ACTS
    n_heads: int
    n_kv: int
    head_dim: int
    scale: float
    layer: int  # index into the pool's layers
    window: int | None = None
    softcap: float | None = None
    norm_post_attn: NormWeights | None = None
    norm_post_mlp: NormWeights | None = None
    q_norm: NormWeights | None = None  # per head, over head_dim
    k_norm: NormWeights | None = None

    def struct(self) -> KvLayer:
        """The C struct (pointers into this view's tensors); ValueError on a shape or
        setting the layer cannot run."""
        if self.qkv.shape[0] != (self.n_heads + 2 * self.n_kv) * self.head_dim:
            raise ValueError("qkv's output is not (n_heads + 2 n_kv) * head_dim")
        if self.gate_up.shape[0] % 2 or self.down.shape[1] != self.gate_up.shape[0] // 2:
            raise ValueError("gate_up's output is not twice down's input")
        if self.act not in ACTS:
            raise ValueError(f"activation {self.act}")
        norms = (self.norm_in, self.norm_post_attn, self.norm_mlp, self.norm_post_mlp, self.q_norm, self.k_norm)
        if len({n.eps for n in norms if n is not None}) != 1 or len({n.offset for n in norms if n is not None}) != 1:
            raise ValueError("the layer's norms differ in eps or offset")
        ptr = [None if n is None else n.weight.data_ptr() for n in norms]
        return KvLayer(*ptr, self.qkv.struct(), self.o.struct(), self.gate_up.struct(), self.down.struct(),
                       self.norm_in.eps, self.norm_in.offset, float(self.scale), float(self.softcap or 0.0),
                       self.n_heads, self.n_kv, self.head_dim, int(self.window or 0), self.layer,
                       ACTS[self.act])  # fmt: skip


@dataclass
class DecodeStep:
    """One decode step's batch, as arrays: the pool (num_blocks, L, 2, bs, n_kv, hd)
    float32, bfloat16 or float16, or int8 planes (``ops.KV_POOL_FORMATS``), where each sequence's new token goes (slot_blocks, slot_offsets (B,)), its
    block table (tables (B, nb)) and context length with the new token (lens (B,)), all
    int64 contiguous. The arrays are kept referenced while the C struct points at them."""

    pool: Tensor
    slot_blocks: Tensor
    slot_offsets: Tensor
    tables: Tensor
    lens: Tensor
    block_size: int = 0  # 0: the pool's dim 3 (an int8 pool's (N, L, 2, plane) needs it given)

    def __post_init__(self) -> None:
        B, nb = self.tables.shape
        N, L, two = self.pool.shape[:3]
        bs = self.block_size or self.pool.shape[3]
        self.struct = KvStep(B, 0, self.pool.data_ptr(), ops.KV_POOL_FORMATS[self.pool.dtype], L, bs, self.slot_blocks.data_ptr(),
                             self.slot_offsets.data_ptr(), self.tables.data_ptr(), nb, self.lens.data_ptr(),
                             torch.get_num_threads())  # fmt: skip


def _rope_rows(cos: Tensor, sin: Tensor, B: int) -> tuple[Tensor, Tensor]:
    """cos and signed sin (B, 1, 1, rot) as the (B, rot) float32 contiguous rows the layer reads."""
    c = cos.reshape(cos.shape[0], -1)  # (B, rot): one token per sequence
    s = sin.reshape(sin.shape[0], -1)
    if c.dtype != torch.float32 or not c.is_contiguous() or not s.is_contiguous() or c.shape[0] != B:
        c, s = c.float().contiguous(), s.float().contiguous()
    return c, s


@dataclass(frozen=True)
class StackEnds:
    """What a decode step runs around the layers, natively: the embedding's rows in
    (``x = embedding[ids] * scale``) and the logits out (``head(norm(x))``, then
    ``tanh(l / softcap) * softcap`` by torch where the family caps them). The same kernels
    and order as the per-op path (torch's gather; ``norm``, ``product``), so the same bits."""

    embedding: Tensor  # (V, D) float32
    scale: float  # 1.0: none (Gemma's sqrt(D), rounded to float32 as its reference does)
    norm: NormWeights
    head: ProductWeights
    softcap: float | None = None

    @classmethod
    def of(cls, embedding: Tensor, scale: float, norm: NormWeights | None, head: ProductWeights | None,
           softcap: float | None = None) -> StackEnds | None:
        """The ends, or None where the kernels cannot run them (no native norm or head, an
        embedding not float32 contiguous on the CPU, or of another width)."""
        if norm is None or head is None or not _usable(embedding) or embedding.dim() != 2:
            return None
        if embedding.shape[1] != norm.weight.numel() or head.shape[1] != embedding.shape[1]:
            return None
        return cls(embedding, float(scale), norm, head, softcap)


class DecoderStack:
    """Every decoder layer of a model on a decode step (one new token per sequence), in
    order, one native call each (``kv_decode_layer``); what the step needs (its
    ``DecodeStep``, the cos/sin rows, the library's function) is looked up once.

    ``groups[i]``: which of the step's (cos, sin) pairs layer i rotates with (Gemma 3's
    sliding layers have their own RoPE base: pair 1); pair 0 for every layer by default."""

    def __init__(self, layers: list[LayerWeights], groups: list[int] | None = None, ends: StackEnds | None = None) -> None:
        groups = [0] * len(layers) if groups is None else list(groups)
        if not layers or len(groups) != len(layers) or min(groups) < 0:
            raise ValueError("a decoder stack needs one layer and one rope group per layer")
        hidden = {layer.norm_in.weight.numel() for layer in layers}
        if len(hidden) != 1:
            raise ValueError("the layers of a decoder stack differ in hidden size")
        self.hidden = hidden.pop()
        self.layers = list(layers)  # the views keep the weights referenced
        self._structs = [layer.struct() for layer in layers]
        self.num_groups = max(groups) + 1
        self.groups = groups
        self._calls = [(ctypes.byref(s), g) for s, g in zip(self._structs, groups)]
        if ends is not None and ends.embedding.shape[1] != self.hidden:
            raise ValueError("the stack's ends differ from its layers in hidden size")
        self.ends = ends  # None: the family's own embedding and head run around the layers
        self._head_struct = ends.head.struct() if ends is not None else None  # kept referenced, as _structs
        self._head = ctypes.byref(self._head_struct) if ends is not None else None

    def __len__(self) -> int:
        return len(self.layers)

    @staticmethod
    def applies(x: Tensor) -> bool:
        """Whether x (B, T, D) is a decode step the stack runs: one float32 token per
        row, B <= STACK_ROWS."""
        return x.shape[1] == 1 and x.shape[0] <= STACK_ROWS and x.dtype == torch.float32 and x.is_contiguous()

    @staticmethod
    def takes(input_ids: Tensor) -> bool:
        """Whether input_ids (B, T) is a decode step the stack runs whole, ends included."""
        return input_ids.shape[1] == 1 and input_ids.shape[0] <= STACK_ROWS and input_ids.device.type == "cpu"

    def embed(self, input_ids: Tensor) -> Tensor:
        """(B, 1) ids -> x (B, 1, D) float32, the ends' embedding rows (``ends`` set;
        IndexError for an id outside the vocabulary, as torch's embedding raises)."""
        e = self.ends
        ids = input_ids if input_ids.dtype == torch.int64 and input_ids.is_contiguous() else input_ids.long().contiguous()
        x = torch.empty(*ids.shape, self.hidden, dtype=torch.float32)
        V = e.embedding.shape[0]
        if kernels.load().lib.kv_embed(ids.data_ptr(), ids.numel(), e.embedding.data_ptr(), V, self.hidden, e.scale, x.data_ptr()):
            raise IndexError(f"a token id is outside the vocabulary (0..{V - 1})")
        return x

    def head(self, x: Tensor, rows: Tensor | None = None) -> Tensor:
        """x (B, 1, D) after the layers -> float32 logits (B, V), or of ``rows`` (R,) of
        the B alone (R, V): the ends' norm and head in one call (``ends`` set)."""
        e = self.ends
        B = x.shape[0]
        which = None
        if rows is not None:
            which = rows if rows.dtype == torch.int64 and rows.is_contiguous() else rows.long().contiguous()
        n = B if which is None else which.numel()
        logits = torch.empty(n, e.head.shape[0], dtype=torch.float32)
        kernels.load().lib.kv_decode_head(x.data_ptr(), self.hidden, None if which is None else which.data_ptr(), n,
                                          e.norm.weight.data_ptr(), e.norm.eps, e.norm.offset, self._head,
                                          logits.data_ptr(), torch.get_num_threads())  # fmt: skip
        if e.softcap is not None:
            logits = torch.tanh(logits / e.softcap) * e.softcap
        return logits

    def run(self, x: Tensor, ropes: tuple[tuple[Tensor, Tensor], ...], step: DecodeStep) -> Tensor:
        """x (B, 1, D) through every layer, in place (the caller checked ``applies``);
        ``ropes``: the step's (cos, sin) pairs, (B, 1, 1, rot) each. Returns x."""
        s = step.struct
        s.D = self.hidden
        B = x.shape[0]
        rows = [_rope_rows(*ropes[g], B) for g in range(self.num_groups)]  # kept referenced through the calls
        ptrs = [(c.data_ptr(), sn.data_ptr(), c.shape[1]) for c, sn in rows]
        fn, xp, sp = kernels.load().lib.kv_decode_layer, x.data_ptr(), ctypes.byref(s)  # the library served now
        for ref, g in self._calls:
            cp, snp, rot = ptrs[g]
            fn(ref, xp, sp, cp, snp, rot)
        return x


RopeTables = Callable[[int], tuple[tuple[Tensor, Tensor], ...]]  # length -> per group (cos, sin) (n >= length, rot)


class NativeStep:
    """A decode step whole in one native call (``kv_decode_forward``): the embedding rows,
    every layer, the final norm and head, for a model whose stack has its ends
    (``StackEnds``) over one pool the kernels read. The same kernels in the same order as
    ``DecoderStack``'s embed, run and head (the RoPE rows copied from the same tables the
    family's ``ropes`` slices), so the same bits; what it saves is the Python between them:
    no layout tensors, no per-step structs, one call where there were six or more.

    ``tables(length)``: the family's RoPE tables, one (cos, signed sin) (n, rot) float32
    pair per rope group (at most two; () without RoPE), n >= length rows by position.

    A call takes the step's rows as one int64 array (``pack``): ids, positions, the slot
    block and offset of each row's new K/V, context lengths (the new token included) and
    the block tables (B, nb)."""

    def __init__(self, stack: DecoderStack, pool: Tensor, block_size: int, tables: RopeTables) -> None:
        if stack.ends is None:
            raise ValueError("a native step needs the stack's ends")
        e = stack.ends
        self.stack, self.pool, self.tables = stack, pool, tables
        self.V, self.softcap = e.embedding.shape[0], e.softcap
        self._layers = (KvLayer * len(stack))(*stack._structs)  # copies of the structs (they point at the weights)
        self._groups = array.array("q", stack.groups)
        self._model = KvModel(ctypes.addressof(self._layers), self._groups.buffer_info()[0], len(stack),
                              e.embedding.data_ptr(), self.V, stack.hidden, e.scale, e.norm.eps, e.norm.offset,
                              e.norm.weight.data_ptr(), ctypes.addressof(stack._head_struct))  # fmt: skip
        # the pool's part of each step's KvStep (kv_decode_forward fills in the rows'): (N, L, 2, ...)
        self._pool = KvStep(0, stack.hidden, pool.data_ptr(), ops.KV_POOL_FORMATS[pool.dtype], pool.shape[1], block_size)
        self._rope: tuple[tuple[Tensor, Tensor], ...] = ()  # the tables the struct points at (kept referenced)
        self._rope_len = -1  # positions they cover

    def _cover(self, length: int) -> None:
        """Point the model struct at RoPE tables of at least ``length`` rows (the family's
        own, kept referenced here: a table that grows is a new tensor, the rows it had the
        same values)."""
        got = self.tables(length)
        if len(got) > 2:
            raise ValueError("a native step takes at most two RoPE groups")
        m = self._model
        if got:
            (c0, s0), (c1, s1) = got[0], got[-1]
            for t in (c0, s0, c1, s1):
                if t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2 or t.shape != c0.shape:
                    raise ValueError("RoPE tables: (n, rot) float32 contiguous, the same shape per group")
            m.cos0, m.sin0, m.cos1, m.sin1 = c0.data_ptr(), s0.data_ptr(), c1.data_ptr(), s1.data_ptr()
            m.table_len, m.rot = c0.shape
        else:
            m.rot, m.table_len = 0, 0
        self._rope, self._rope_len = got, m.table_len if got else 1 << 62

    def __call__(self, batch: array.array, B: int, nb: int, longest: int, which: array.array | None = None) -> Tensor:
        """Logits (B, V), or of rows ``which`` alone (R, V), for the step packed in ``batch``
        (``pack``'s layout: B rows, tables of nb blocks; ``longest``: the largest context
        length). IndexError for an id outside the vocabulary, before anything is computed."""
        if longest > self._rope_len:
            self._cover(longest)
        n = B if which is None else len(which)
        logits = torch.empty(n, self.V, dtype=torch.float32)
        got = kernels.load().lib.kv_decode_forward(ctypes.byref(self._model), ctypes.byref(self._pool), batch.buffer_info()[0], B, nb,
                                                   None if which is None else which.buffer_info()[0], n, logits.data_ptr(),
                                                   torch.get_num_threads())  # fmt: skip
        if got:
            if got < 0:
                raise IndexError("a position is outside the RoPE tables")
            raise IndexError(f"a token id is outside the vocabulary (0..{self.V - 1})")
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
