"""What the model code hands the kernels: typed views of its weights, and the CPU
backend of the engine's decode step (``models/step.py``'s ``DecodeStep``), one native call.

    ProductWeights   one product's weight in its stored format  -> product(w, x)
    NormWeights      an RMSNorm's weight, eps and offset         -> norm(n, x)
    LayerWeights     one decoder layer: its norms, products and attention geometry
    StepEnds         the step's ends: the embedding rows in, the final norm and head out
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
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from .. import kernels
from . import ops
from .binding import header_binding

MAX_ROWS = ops.MAX_ROWS  # decode-sized work; more rows (prefill) are compute-bound: torch's GEMM
# rows one native step takes: the decode rows, and a returning turn's new tokens over its
# cached context as rows (engine/runner.py decode_step), which measured ahead of the
# padded forward up to about this many (docs/benchmarks-log.md, "Measurement notes")
STEP_ROWS = 2 * MAX_ROWS
_H = header_binding()
_C = _H.constants
KvLinear, KvLayer, KvStep, KvModel = (_H.structs[n] for n in ("KvLinear", "KvLayer", "KvStep", "KvModel"))
FORMATS = {"f32": _C["KV_F32"], "bf16": _C["KV_BF16"], "i8": _C["KV_I8"], "q8": _C["KV_Q8"], **ops.BLOCK_CODES}
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "i8": torch.int8, "q8": torch.int8,
           **{fmt: torch.uint8 for fmt in ops.BLOCK_FORMATS}}  # fmt: skip


def _usable(t: Tensor | None, dtype: torch.dtype = torch.float32) -> bool:
    return t is None or (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous())


@dataclass(frozen=True)
class ProductWeights:
    """y = x W^T * scales + bias as the kernels read it. ``fmt``: "f32" (float32 W),
    "bf16", "i8" (int8 W, float32 input), "q8" (int8 W, the input quantized per block
    of 32: w8a8; K % 32 == 0), or one of ggml's block types (``ops.BLOCK_FORMATS``: W
    (N, bytes per row) uint8, the rows as ggml stores them; the input quantized per block
    as llama.cpp's dot products do), or "chain": the ``parts``' outputs side by side (a
    product whose rows are stored in different formats, each part with its rows of the
    bias). ``scales`` (N,) float32 for the int8 formats."""

    w: Tensor | None  # (N, K); block types (N, bytes per row); chain: None
    scales: Tensor | None
    bias: Tensor | None
    fmt: str
    parts: tuple[ProductWeights, ...] = ()

    @classmethod
    def of(cls, w: Tensor, scales: Tensor | None, bias: Tensor | None, fmt: str) -> ProductWeights | None:
        """The view, or None when the kernels cannot read these tensors (not CPU, not
        contiguous, another dtype, a q8 K not a multiple of 32, a block type's rows no
        whole number of its blocks)."""
        int8 = fmt in ("i8", "q8")
        if fmt not in FORMATS or not _usable(w, _DTYPES[fmt]) or not _usable(bias) or w.dim() != 2:
            return None
        if int8 != (scales is not None) or not _usable(scales) or (fmt == "q8" and w.shape[1] % 32):
            return None
        if fmt in ops.BLOCK_FORMATS:
            try:
                ops.block_row_values(fmt, w.shape[1])
            except ValueError:
                return None
        return cls(w, scales, bias, fmt)

    @classmethod
    def chain(cls, parts: list[ProductWeights]) -> ProductWeights | None:
        """One product computing ``parts`` (each (N_i, K), any format) side by side: its
        output their outputs concatenated. None where they differ in K or a part is a chain."""
        if not parts or len({p.shape[1] for p in parts}) != 1 or any(p.fmt == "chain" for p in parts):
            return None
        return parts[0] if len(parts) == 1 else cls(None, None, None, "chain", tuple(parts))

    @property
    def shape(self) -> tuple[int, int]:
        if self.parts:
            return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])
        if self.fmt in ops.BLOCK_FORMATS:
            return (self.w.shape[0], ops.block_row_values(self.fmt, self.w.shape[1]))
        return tuple(self.w.shape)

    def struct(self) -> KvLinear:
        """The C struct (pointers into this view's tensors; a chain's parts linked through
        ``next``, the structs after the first kept alive by this view)."""
        if self.parts:
            tail = self.__dict__.get("_tail")
            if tail is None:  # built once: the pointers into it must outlive every copy of the head
                tail = [p.struct() for p in self.parts[1:]]
                for a, b in zip(tail, tail[1:]):
                    a.next = ctypes.addressof(b)
                object.__setattr__(self, "_tail", tail)
            head = self.parts[0].struct()
            head.next = ctypes.addressof(tail[0])
            return head
        N, K = self.shape
        return KvLinear(self.w.data_ptr(), None if self.scales is None else self.scales.data_ptr(),
                        None if self.bias is None else self.bias.data_ptr(), N, K, FORMATS[self.fmt])  # fmt: skip


def product(p: ProductWeights, x: Tensor, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """x (..., K) float32, 1..MAX_ROWS rows, through the product: (..., N) float32."""
    if p.fmt == "q8":
        return ops.gemv_q8(x, p.w, p.scales, p.bias, out, accumulate)
    if p.fmt in ops.BLOCK_FORMATS:
        return ops.gemv_blocks(x, p.w, p.fmt, p.bias, out, accumulate)
    if p.parts:
        return _chain(p, x, out, accumulate)
    return ops.gemv(x, p.w, p.scales, p.bias, out, accumulate)


def _chain(p: ProductWeights, x: Tensor, out: Tensor | None, accumulate: bool) -> Tensor:
    """A chain's product in one native call (``kv_product``, as the decode step runs it)."""
    N, K = p.shape
    if x.shape[-1] != K or x.dtype != torch.float32:
        raise ValueError(f"product: x has {x.shape[-1]} features, the weight expects {K} (float32)")
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if out is None:
        if accumulate:
            raise ValueError("product: accumulate needs out")
        out = torch.empty(*x.shape[:-1], N, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != x2.shape[0] * N or not out.is_contiguous():
        raise ValueError("product: out must be float32 contiguous with rows * N elements")
    s = p.struct()
    kernels.load().lib.kv_product(ctypes.byref(s), x2.data_ptr(), x2.shape[0], x2.stride(0), out.data_ptr(), N,
                                  int(accumulate), torch.get_num_threads())  # fmt: skip
    return out


def product_gemm(p: ProductWeights, x: Tensor, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
    """x (..., K) float32, any number of rows (prefill), through the product of an f32,
    bf16 or i8 weight (gemm.cpp; not q8: w8a8's prefill quantizes its input otherwise), or
    of ggml's blocks and chains of them (the same arithmetic as ``product``'s rows)."""
    if p.fmt in ops.BLOCK_FORMATS or p.parts:
        return product(p, x, out, accumulate)
    if p.fmt == "q8":
        raise ValueError("product_gemm: f32, bf16, i8 or block-type weights")
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


@dataclass(frozen=True)
class StepEnds:
    """What a decode step runs around the layers, natively: the embedding's rows in
    (``x = embedding[ids] * scale``) and the logits out (``head(norm(x))``, then
    ``tanh(l / softcap) * softcap`` by torch where the family caps them)."""

    embedding: Tensor  # (V, D) float32
    scale: float  # 1.0: none (Gemma's sqrt(D), rounded to float32 as its reference does)
    norm: NormWeights
    head: ProductWeights
    softcap: float | None = None

    @classmethod
    def of(cls, embedding: Tensor, scale: float, norm: NormWeights | None, head: ProductWeights | None,
           softcap: float | None = None) -> StepEnds | None:
        """The ends, or None where the kernels cannot run them (no native norm or head, an
        embedding not float32 contiguous on the CPU, or of another width)."""
        if norm is None or head is None or not _usable(embedding) or embedding.dim() != 2:
            return None
        if embedding.shape[1] != norm.weight.numel() or head.shape[1] != embedding.shape[1]:
            return None
        return cls(embedding, float(scale), norm, head, softcap)


RopeTables = Callable[[int], tuple[tuple[Tensor, Tensor], ...]]  # length -> per group (cos, sin) (n >= length, rot)


class PackedRows(Protocol):
    """A step's rows as ``NativeStep`` reads them (kv.cache.DecodeRows)."""

    long_rope: Sequence[bool | None]

    def pack(self) -> tuple[array.array, int, int, int]:
        """(the int64 array, rows B, blocks per table nb, the longest context)."""


class NativeStep:
    """A decode step whole in one native call (``kv_decode_forward``): the embedding rows,
    every layer (norms, the fused q/k/v product, per-head q/k norms, RoPE, the K/V write
    and attention read in place from the pool, o with the residual add, the gate and
    down), the final norm and head, over one pool the kernels read (float32, bfloat16,
    float16, int8: ``ops.KV_POOL_FORMATS``). Every row's K/V is written before any row
    attends, a sequence's rows (a verify step's drafts, a returning turn's new tokens)
    read their common context once, and each row's result is the same bits whatever
    else is in the step.

    ``layers`` in order, layer i rotating with the RoPE pair ``groups[i]`` (0 or 1: Gemma
    3's sliding layers have their own base); ``tables(length)``: the family's RoPE
    tables, one (cos, signed sin) (n, rot) float32 pair per group (at most two; () without
    RoPE), n >= length rows by position. ``long_threshold`` (LongRoPE): the tables hold
    the short factors' n rows, then the long factors' n rows, and a row in the long regime
    (its ``long_rope``, or, where None, a context longer than the threshold) reads its
    position's row of the second half.

    A call takes the step's rows (``kv.cache.DecodeRows``: ``pack()`` gives ids,
    positions, the slot block and offset of each row's new K/V, context lengths (the new
    token included) and the block tables (B, nb), one int64 array)."""

    name = "native"
    max_rows = STEP_ROWS  # rows one call takes
    chunk_rows = STEP_ROWS  # of them, a returning turn's new tokens beside the decode rows

    def __init__(self, layers: list[LayerWeights], groups: list[int], ends: StepEnds, pool: Tensor, block_size: int,
                 tables: RopeTables, long_threshold: int | None = None) -> None:
        if not layers or len(groups) != len(layers) or min(groups) < 0 or max(groups) > 1:
            raise ValueError("a native step needs one layer and one rope group (0 or 1) per layer")
        D = ends.embedding.shape[1]
        if {layer.norm_in.weight.numel() for layer in layers} != {D}:
            raise ValueError("the layers and ends of a native step differ in hidden size")
        self.layers, self.ends, self.pool, self.tables = list(layers), ends, pool, tables  # the views keep the weights
        self.long_threshold = long_threshold
        self.V, self.softcap = ends.embedding.shape[0], ends.softcap
        self._structs = (KvLayer * len(layers))(*(layer.struct() for layer in layers))  # pointers into the weights
        self._head = ends.head.struct()
        self._groups = array.array("q", groups)
        self._model = KvModel(ctypes.addressof(self._structs), self._groups.buffer_info()[0], len(layers),
                              ends.embedding.data_ptr(), self.V, D, ends.scale, ends.norm.eps, ends.norm.offset,
                              ends.norm.weight.data_ptr(), ctypes.addressof(self._head))  # fmt: skip
        # the pool's part of each step's KvStep (kv_decode_forward fills in the rows'): (N, L, 2, ...)
        self._pool = KvStep(0, D, pool.data_ptr(), ops.KV_POOL_FORMATS[pool.dtype], pool.shape[1], block_size)
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
        self._rope = got
        self._rope_len = (m.table_len // 2 if self.long_threshold is not None else m.table_len) if got else 1 << 62

    def __call__(self, rows: PackedRows, which: array.array | None = None) -> Tensor:
        """Logits (B, V) of the step's B rows, or of rows ``which`` alone (R, V).
        IndexError for an id outside the vocabulary, before anything is computed."""
        batch, B, nb, longest = rows.pack()
        if longest > self._rope_len:
            self._cover(longest)
        if self.long_threshold is not None:  # the long regime's rows read the tables' second half
            half, pos = self._rope_len, B
            for b, long in enumerate(rows.long_rope):
                if long or (long is None and batch[pos + b] + 1 > self.long_threshold):
                    batch[pos + b] += half
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
