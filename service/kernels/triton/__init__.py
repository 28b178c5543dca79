"""Triton kernels of the CUDA decode and prefill step. They know tensors, never modules:
nothing here imports from ``models/``, the engine or ``kv/`` (the CUDA step hands them
the pool's views and the step's metadata), and triton itself is imported on the first
call, so a host without triton (no CUDA build of torch, not x86-64) imports this package
and ``available()`` says why the kernels cannot run.

Every op writes into tensors the caller gives (``out``, the pool, ``residual``): none
allocates (``decode_attention``'s split partials live in a ``workspace`` the caller
made once with ``attention_workspace``), none reads a tensor back to the host, and none
branches in Python on a tensor's values, only on shapes, dtypes and the keyword options
(the family's, fixed per layer). Every piece of per-step metadata is a device tensor
whose shape is static for a CUDA graph bucket (rows padded: a padding row has slot -1 /
context length 0 and writes nothing, or zeros where it has an output), so a call is
captured once and replayed.

The KV pool is ``kv.cache.KVPool``'s; the ops take its per-layer views as they are:

    k_cache, v_cache   (N, bs, n_kv, hd) ``pool.k(layer)`` / ``pool.v(layer)``: the model's
                       dtype (exact), bfloat16 / float16 (narrower than the model's), or
                       int8 / float8_e4m3fn (``--kv-cache-format int8 | fp8``)
    k_scale, v_scale   int8 / fp8 only: (N, bs, n_kv) float32 ``pool.k_scale(layer)`` /
                       ``pool.v_scale(layer)``, the per-(block, layer, K|V, row, kv head)
                       absmax scales stored inside each block's plane

Metadata (device tensors, int32 or int64):

    slot_mapping   (T,)  where each new row's K/V goes: block * bs + offset; -1: skip
                         (padding). The rows of one sequence are consecutive and in
                         position order, and no two sequences write one block (the
                         runner's packing)
    block_tables   (B, max_blocks) each sequence's (decode: each row's) blocks, padded
                   with any valid id (the null block 0) past its context
    context_lens   (B,)  decode: each row's context length, its own new token included
                         (0: a padding row, output zeros)
    query_start    (B + 1,) extend: cumulative new-token counts, q rows of sequence b are
                         query_start[b] .. query_start[b + 1] - 1 (varlen, packed)
    seq_lens       (B,)  extend: each sequence's length, its new tokens included (its new
                         tokens are its last query_start[b + 1] - query_start[b] positions)
    positions      (T,)  RoPE: each row's row of the cos/sin tables (its position; a
                         LongRoPE step may offset the long factors' rows in one stacked table)

Attention options, as the families need them (``PagedAttention``'s): ``scale`` (head_dim
^-1/2, Gemma's query_pre_attn_scalar^-1/2), ``window`` (None or W: a query at position p
sees keys p - W < c <= p, ``BatchLayout.mask_for``'s rule; Mistral, Qwen2, Phi-3,
Gemma 2/3's sliding layers), ``softcap`` (None or cap: scores -> cap * tanh(s / cap),
Gemma 2), GQA/MQA (n_heads a multiple of n_kv: a program computes every q head of one kv
head, so each K/V tile is read once per group). Compute is in float32 (scores, softmax,
accumulators) from q's dtype; a stored int8 / fp8 / bf16 / fp16 row is widened in the
kernel (int8 / fp8: the K scale applied to each score, the V scale to each weight), never
copied out of the pool.

Ops:

    write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None)
    decode_attention(out, q, k_cache, v_cache, block_tables, context_lens, workspace, ...)
    extend_attention(out, q, k_cache, v_cache, block_tables, query_start, seq_lens, ...)
    rms_norm(out, x, weight, eps, offset=0.0, residual=None, x_weight=None)
    rope_(x, positions, cos, sin, n_q_heads=0, q_norm=None, k_norm=None, eps=..., norm_offset=0.0)
    scatter_blocks(pool, staging, block_ids)

On a CPU host the kernels run under Triton's interpreter (numpy, one program at a time:
for tests): set ``TRITON_INTERPRET=1`` before triton is first imported in the process
and leave it set (Triton 3.9 reads it as it imports, as a kernel is defined, here at
the first call, and at launches); the tests do. Without it a CPU tensor is refused with
one line (``TritonUnavailable``). Triton 3.4 or newer (what torch's CUDA builds ship).
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from types import ModuleType

__all__ = [
    "TritonUnavailable",
    "available",
    "reason",
    "interpreted",
    "write_kv",
    "attention_workspace",
    "decode_splits",
    "decode_attention",
    "extend_attention",
    "rms_norm",
    "rope_",
    "scatter_blocks",
]

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn)
SCALED = (torch.int8, torch.float8_e4m3fn)  # values with per-(block, row, kv head) scales
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TritonUnavailable(RuntimeError):
    """The kernels cannot run here: no triton, or CPU tensors without the interpreter."""


@functools.cache
def _load() -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(f"{__name__}._kernels"), ""
    except ImportError as e:  # no triton (torch's CPU wheels do not carry it), or a broken install
        return None, f"triton is not importable ({e})"


def available() -> bool:
    """True where triton imports (the kernels then run on CUDA tensors, or on CPU
    tensors under ``TRITON_INTERPRET=1``)."""
    return _load()[0] is not None


def reason() -> str:
    """Why ``available()`` is False, in one line ("" when it is True)."""
    return _load()[1]


def interpreted() -> bool:
    """True when the kernels were defined under Triton's interpreter (CPU tensors)."""
    mod = _load()[0]
    return mod is not None and mod.INTERPRETED


def _launcher(*tensors: Tensor) -> ModuleType:
    mod, why = _load()
    if mod is None:
        raise TritonUnavailable(why)
    dev = tensors[0].device
    if any(t.device != dev for t in tensors if t is not None):
        raise ValueError(f"tensors on different devices: {sorted({str(t.device) for t in tensors if t is not None})}")
    if dev.type == "cpu" and not mod.INTERPRETED:
        raise TritonUnavailable("CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before the first call")
    if dev.type not in ("cpu", "cuda"):
        raise TritonUnavailable(f"the triton kernels run on CUDA (or the interpreter on the CPU), not {dev.type}")
    return mod


# ---- KV write ----------------------------------------------------------------------------


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
             k_scale: Tensor | None = None, v_scale: Tensor | None = None) -> None:
    """Write the new K/V rows into their pool slots, in the pool's format.

    k, v (T, n_kv, hd) in the model's dtype (views into the fused q/k/v output are fine:
    the last dim contiguous); k_cache, v_cache the layer's (N, bs, n_kv, hd) views;
    slot_mapping (T,) block * bs + offset, -1 skips the row.

    Exact / bf16 / fp16 pools: each row stored as ``Tensor.to`` rounds it (to nearest
    even), the same bits as ``KVPool.update``. Int8 / fp8 pools (k_scale, v_scale given):
    ``KVPool._write_int8``'s semantics, byte for byte: each row's kv head quantized at its
    own scale, absmax / qmax (127; e4m3: 448; round to nearest even, clamped; fp8: e4m3 of
    it), stored beside it; nothing else in the block changes."""
    mod = _launcher(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _check_rows(k, "k")
    _check_rows(v, "v")
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0]:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         "disagree")
    _check_cache(k_cache, v_cache, k_scale, v_scale, k.shape[1], k.shape[2])
    mod.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


# ---- attention ---------------------------------------------------------------------------


def attention_workspace(rows: int, n_heads: int, head_dim: int, num_splits: int,
                        device: torch.device | str) -> tuple[Tensor, Tensor]:
    """The split partials a split attention call writes and reduces, allocated once per
    CUDA graph bucket: ((rows, n_heads, num_splits, head_dim) float32 outputs,
    (rows, n_heads, num_splits) float32 log-sum-exps)."""
    return (torch.empty(rows, n_heads, num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(rows, n_heads, num_splits, dtype=torch.float32, device=device))


def decode_splits(rows: int, n_kv: int, max_context: int, sm_count: int = 132, tile: int = 64) -> int:
    """How many splits along the context a decode step of ``rows`` rows over contexts of
    up to ``max_context`` tokens wants: enough (row, kv head, split) programs to give
    every one of ``sm_count`` multiprocessors two (flash-decoding), no split shorter than
    a tile, at most 64. A host-side choice from the bucket's static sizes."""
    programs = max(1, rows * n_kv)
    want = -(-2 * sm_count // programs)
    return max(1, min(64, want, -(-max_context // tile)))


def decode_attention(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     context_lens: Tensor, workspace: tuple[Tensor, Tensor] | None = None, *, scale: float,
                     window: int | None = None, softcap: float | None = None, k_scale: Tensor | None = None,
                     v_scale: Tensor | None = None, tile: int | None = None) -> Tensor:
    """Paged attention of one query row per entry over its context, read in place from
    the pool through its block table (flash-decoding: the context split in
    ``workspace``'s num_splits parts, each a program per (row, kv head, split) that
    computes every q head of the kv head, then one reduce).

    out (R, nh, hd) written; q (R, nh, hd) in the model's dtype, its K/V already in the
    pool (``write_kv`` first); block_tables (R, max_blocks); context_lens (R,) (the row's
    own token included; 0: padding, out zeros). A speculative step's verify rows are rows
    like any other (each its own context length over the sequence's table).
    ``workspace`` None: one split (no partials). ``tile``: keys a step of a program's loop
    (a power of two >= 16; None: the kernel's choice by dtype and head_dim). Returns ``out``."""
    mod = _launcher(out, q, k_cache, v_cache, block_tables, context_lens, k_scale, v_scale)
    _check_attention(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens.shape[0], context_lens)
    _check_blocks(tile, None)
    if workspace is not None:
        _check_workspace(workspace, q)
    mod.attention(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, None, 1, workspace,
                  scale=scale, window=window, softcap=softcap, tile=tile)
    return out


def extend_attention(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                     query_start: Tensor, seq_lens: Tensor, max_query_len: int,
                     workspace: tuple[Tensor, Tensor] | None = None, *, scale: float, window: int | None = None,
                     softcap: float | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     tile: int | None = None, block_q: int | None = None) -> Tensor:
    """Causal paged attention of new tokens over their cached context and themselves
    (a returning turn, a chunk of a chunked prefill, a fresh prefill: no cached
    context), every sequence's tokens packed (varlen), all K/V read from the pool (the new
    tokens' written first by ``write_kv``, so a prefill attends over its KV as stored, as
    ``KVPool.update`` returns it).

    out, q (T, nh, hd): rows query_start[b] .. query_start[b + 1] - 1 are sequence b's new
    tokens, at positions seq_lens[b] - n_b .. seq_lens[b] - 1; max_query_len a host int
    bounding every n_b (the grid's size: static per bucket). ``workspace`` (T rows) splits
    each query block's keys too (a short turn over a long history); None: one split.
    ``block_q``: new tokens a program (None: ~128 rows of tokens times the group's heads).
    Rows past query_start[B] are not written. Returns ``out``."""
    mod = _launcher(out, q, k_cache, v_cache, block_tables, query_start, seq_lens, k_scale, v_scale)
    B = seq_lens.shape[0]
    if query_start.shape != (B + 1,):
        raise ValueError(f"query_start {tuple(query_start.shape)}: expected ({B + 1},) for {B} sequences")
    _check_attention(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, B, seq_lens)
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    _check_blocks(tile, block_q)
    if workspace is not None:
        _check_workspace(workspace, q)
    mod.attention(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, query_start, max_query_len,
                  workspace, scale=scale, window=window, softcap=softcap, tile=tile, block_q=block_q)
    return out


# ---- norms and RoPE --------------------------------------------------------------------


def rms_norm(out: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float = 0.0, residual: Tensor | None = None,
             x_weight: Tensor | None = None) -> Tensor:
    """RMSNorm of each row (last dim D) as ``layers.RMSNorm`` computes it, with the
    residual add fused in:

        h = x                                   (x_weight None)
        h = rmsnorm(x, x_weight)                (Gemma's post-attention / post-feedforward norm)
        residual += h; h = residual             (residual given: written in place)
        out = rmsnorm(h, weight)

    rmsnorm(h, w) = h * rsqrt(mean(h^2) + eps) * (offset + w): offset 0 (Llama, Qwen,
    Phi-3; in bf16/fp16 the normalized row is rounded to the dtype before the weight, as
    the reference's ``weight * norm(x).to(dtype)``), or 1 (Gemma's (1 + w), all in
    float32); every intermediate the reference rounds to the model dtype (the residual,
    the post-norm) is rounded alike. x, out, residual (R, D) (or (..., D) with contiguous
    rows), weights (D,). Returns ``out``."""
    mod = _launcher(out, x, weight, residual, x_weight)
    for name, t in (("out", out), ("residual", residual)):
        if t is not None and (t.shape != x.shape or t.dtype != x.dtype):
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype}: expected x's {tuple(x.shape)} {x.dtype}")
    D = x.shape[-1]
    for name, w in (("weight", weight), ("x_weight", x_weight)):
        if w is not None and w.shape != (D,):
            raise ValueError(f"{name} {tuple(w.shape)}: expected ({D},)")
    if x.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"x: {x.dtype}; one of {COMPUTE_DTYPES}")
    mod.rms_norm(out, x, weight, eps, offset, residual, x_weight)
    return out


def rope_(x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor, n_q_heads: int = 0, q_norm: Tensor | None = None,
          k_norm: Tensor | None = None, eps: float = 1e-6, norm_offset: float = 0.0) -> Tensor:
    """Rotate x in place (GPT-NeoX style, rotate_half: every family's) on its first rot =
    cos.shape[-1] dims (partial rotary: Phi-4-mini; the rest pass), after the optional
    per-head RMSNorm of q and k (Qwen3; Gemma 3 with norm_offset 1): one launch for
    what the reference runs as norms plus ``apply_rope_``.

    x (T, H, hd): the q and k heads of the fused q/k/v output (``qkv[:, :nh + n_kv]``,
    a view), written in place; n_q_heads: how many of the H are q heads (q_norm applies to
    them, k_norm to the rest); positions (T,) rows of the tables; cos, sin (n, rot) in
    x's dtype: ``rope.Rotary``'s tables (sin signed: [-sin f, sin f]; LongRoPE's
    attention factor folded in), so a rotated element is x * cos + roll(x) * sin, rounded
    as the reference's ops round. Returns x."""
    mod = _launcher(x, positions, cos, sin, q_norm, k_norm)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x: expected (T, H, hd) with a contiguous last dim, got {tuple(x.shape)} {x.stride()}")
    T, H, hd = x.shape
    rot = cos.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or rot % 2 or rot > hd or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)} {sin.dtype}: expected (n, rot) "
                         f"in {x.dtype}, rot even and <= {hd}")
    if positions.shape != (T,):
        raise ValueError(f"positions {tuple(positions.shape)}: expected ({T},)")
    if not 0 <= n_q_heads <= H:
        raise ValueError(f"n_q_heads {n_q_heads} outside 0..{H}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and w.shape != (hd,):
            raise ValueError(f"{name} {tuple(w.shape)}: expected ({hd},)")
    mod.rope_(x, positions, cos, sin, n_q_heads, q_norm, k_norm, eps, norm_offset)
    return x


# ---- restores --------------------------------------------------------------------------


def scatter_blocks(pool: Tensor, staging: Tensor, block_ids: Tensor) -> None:
    """pool[block_ids[i]] = staging[i] for every i with block_ids[i] >= 0, one launch:
    a restore's blocks, landed contiguously in device staging (a few large H2D copies),
    moved into their pool slots. pool (N, *block) (``KVPool.data``), staging (n, *block)
    of the pool's dtype, both contiguous; block_ids (n,) device int (-1: skip, padding).
    The same bytes as ``pool.index_copy_(0, ids, staging)`` (or a copy per block); one
    kernel of 16-byte accesses whatever the dtype (torch's CPU ``index_copy_`` has no
    float8 kernel; its CUDA one indexes element by element) and padded ids, so a
    graph-captured restore needs no host count."""
    mod = _launcher(pool, staging, block_ids)
    if staging.dim() != pool.dim() or staging.shape[1:] != pool.shape[1:] or staging.dtype != pool.dtype:
        raise ValueError(f"staging {tuple(staging.shape)} {staging.dtype}: expected (n, {tuple(pool.shape[1:])}) "
                         f"{pool.dtype}")
    if block_ids.shape != (staging.shape[0],):
        raise ValueError(f"block_ids {tuple(block_ids.shape)}: expected ({staging.shape[0]},)")
    if not (pool.is_contiguous() and staging.is_contiguous()):
        raise ValueError("pool and staging must be contiguous")
    mod.scatter_blocks(pool, staging, block_ids)


# ---- argument checks (shapes and dtypes only: no tensor value is read) -----------------


def _check_rows(t: Tensor, name: str) -> None:
    if t.dim() != 3 or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected (T, n_kv, hd) with a contiguous last dim, got {tuple(t.shape)} "
                         f"{t.stride()}")
    if t.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"{name}: {t.dtype}; one of {COMPUTE_DTYPES}")


def _check_cache(k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None, v_scale: Tensor | None, n_kv: int,
                 hd: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[2:] != (n_kv, hd) or c.stride(-1) != 1:
            raise ValueError(f"{name} {tuple(c.shape)}: expected (N, bs, {n_kv}, {hd}) with a contiguous last dim")
        if c.dtype not in POOL_DTYPES:
            raise ValueError(f"{name}: {c.dtype}; one of {POOL_DTYPES}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache differ in shape or dtype")
    scaled = k_cache.dtype in SCALED
    if scaled != (k_scale is not None) or scaled != (v_scale is not None):
        raise ValueError(f"a {k_cache.dtype} pool {'needs' if scaled else 'takes no'} k_scale and v_scale")
    if scaled:
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if s.shape != k_cache.shape[:3] or s.dtype != torch.float32:
                raise ValueError(f"{name} {tuple(s.shape)} {s.dtype}: expected {tuple(k_cache.shape[:3])} float32")


def _check_attention(out: Tensor, q: Tensor, k_cache: Tensor, v_cache: Tensor, k_scale: Tensor | None,
                     v_scale: Tensor | None, block_tables: Tensor, B: int, lens: Tensor) -> None:
    if q.dim() != 3 or q.stride(-1) != 1 or q.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"q: expected (T, nh, hd) float with a contiguous last dim, got {tuple(q.shape)} {q.dtype}")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: expected q's {tuple(q.shape)} {q.dtype}")
    n_kv = k_cache.shape[2] if k_cache.dim() == 4 else 0
    _check_cache(k_cache, v_cache, k_scale, v_scale, n_kv, q.shape[2])
    if q.shape[1] % n_kv:
        raise ValueError(f"{q.shape[1]} q heads are not a multiple of {n_kv} kv heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or lens.shape != (B,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and lengths {tuple(lens.shape)}: "
                         f"expected ({B}, nb), ({B},)")
    if k_cache.dtype not in SCALED and k_cache.dtype.itemsize > q.dtype.itemsize:
        raise ValueError(f"a {k_cache.dtype} pool is wider than q's {q.dtype}")


def _check_blocks(tile: int | None, block_q: int | None) -> None:
    if tile is not None and (tile < 16 or tile & (tile - 1)):
        raise ValueError(f"tile must be a power of two >= 16 (a tensor-core product's side), got {tile}")
    if block_q is not None and block_q < 1:
        raise ValueError(f"block_q must be >= 1, got {block_q}")


def _check_workspace(workspace: tuple[Tensor, Tensor], q: Tensor) -> None:
    part, lse = workspace
    T, nh, hd = q.shape
    if (part.dim() != 4 or part.shape[0] < T or part.shape[1] != nh or part.shape[3] != hd
            or part.dtype != torch.float32):
        raise ValueError(f"workspace partials {tuple(part.shape)}: expected (>= {T}, {nh}, splits, {hd}) float32")
    if lse.shape != part.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"workspace lse {tuple(lse.shape)}: expected {tuple(part.shape[:3])} float32")
    if not (part.is_contiguous() and lse.is_contiguous()):
        raise ValueError("workspace tensors must be contiguous")
