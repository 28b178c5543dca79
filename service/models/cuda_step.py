"""The decode step on a CUDA device (models/step.py's ``DecodeStep``), and its CUDA graphs.

``CudaStep`` runs a ``Decoder`` (layers.py: the family's own modules) over rows packed as
device tensors whose shapes depend on the row count alone, so that one step is captured
once per row count and replayed:

    x = embedding[ids] * scale                                   torch
    h = norm_in(x)                                               rms_norm
    for each layer:
        q, k, v = split(qkv(h))                                  the module's product (cuBLAS)
        q, k = rope(q_norm(q)), rope(k_norm(k))                  rope_ (q/k norms fused)
        pool[slots] = k, v                                       write_kv (the pool's format)
        y = attention(q, pool, tables, lens)                     decode_attention (split along the context)
        x += post_attn(o(y));  h = norm_mlp(x)                   o's product, rms_norm (residual fused)
        x += post_mlp(down(act(gate) * up));  h = next norm(x)   products, rms_norm
    logits = softcap(head(h))                                    the head's product, torch

The kernels are ``kernels/triton``'s (or, in tests on the CPU, any object with the same
functions: ``ops``). The step's inputs live in one int64 device tensor per row count
(``StepBuffers.meta``: ids, RoPE rows, slots, context lengths, block tables as wide as
``max_context``), filled from the host by two copies (the rows' fields; their tables as
far as the step's longest context): a padding row has id 0, RoPE row 0, slot -1 (its K/V
written nowhere) and context length 0 (attention reads no block and writes zeros), so a
padding row never touches a block.

``CudaGraphStep`` is vLLM's CUDAGraphRunner manner: at start, for each row count of
``graph_buckets`` (largest first, one shared memory pool, within a stated memory
budget), static buffers are allocated, the step run once (Triton compiles, cuBLAS picks
its kernels) and captured; a step of B rows copies its rows into the smallest bucket of
at least B rows, pads the rest, replays, and copies the B rows' logits out. Rows of a
speculative step (a sequence's pending token and drafts) are rows like any other, so the
bucket is by rows. Without CUDA (the tests) the same buffers, padding and bucket choice
run the step eagerly over the static buffers instead of replaying a graph.
"""

from __future__ import annotations

import array
import logging
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kv.cache import DecodeRows, KVPool
from .layers import Decoder, gated
from .step import GraphConfig

log = logging.getLogger(__name__)

META_FIELDS = 4  # ids, RoPE rows, slots, context lengths: (R,) each, then the tables (R, width)


def graph_buckets(max_rows: int) -> list[int]:
    """The row counts captured: 1, 2, 4, 8, then every multiple of 8 up to ``max_rows``
    (and ``max_rows``), as vLLM's batch sizes: a step pads at most 7 rows past 8."""
    rows = [r for r in (1, 2, 4, 8) if r <= max_rows] + list(range(16, max_rows + 1, 8))
    return sorted(set(rows) | ({max_rows} if max_rows >= 1 else set()))


@dataclass
class StepBuffers:
    """One row count's inputs, as device tensors of static shapes: ``meta`` (R * (4 +
    width),) int64 holds them all (``fill`` copies into it from ``host``), the others are
    views of it; ``workspace``: the attention's split partials; ``logits``: the last
    run's output (a captured graph's static output)."""

    rows: int
    width: int  # blocks per table: max_context / block_size, rounded up
    meta: Tensor
    host: Tensor  # meta's host side (pinned on CUDA)
    ids: Tensor
    positions: Tensor  # each row's row of the RoPE tables (LongRoPE: long rows offset)
    slots: Tensor  # block * block_size + offset; -1: padding
    lens: Tensor  # context length with the row's own token; 0: padding
    tables: Tensor  # (R, width)
    workspace: tuple[Tensor, Tensor] | None
    logits: Tensor | None = None
    copied: Any = None  # CUDA: the event of the last host-to-device copy (the host side is reused after it)

    @property
    def nbytes(self) -> int:
        ws = sum(t.numel() * t.element_size() for t in self.workspace) if self.workspace is not None else 0
        return self.meta.numel() * 8 + ws


class CudaStep:
    """The CUDA backend of the decode step (module docstring). ``max_context``: the
    longest context a row may have (the RoPE tables and block tables are made for it,
    once); ``ops``: the kernels (``kernels.triton``); ``sm_count``: the multiprocessors
    the attention's context splits are sized for (the device's)."""

    name = "cuda"
    max_rows = sys.maxsize
    chunk_rows = 0  # a returning turn's tokens go to the prefill forward (extend attention)

    def __init__(self, decoder: Decoder, pool: KVPool, *, max_context: int, ops: Any = None,
                 sm_count: int | None = None) -> None:
        if ops is None:
            from ..kernels import triton as ops
        self.ops, self.decoder, self.pool = ops, decoder, pool
        e = decoder.ends
        self.device, self.dtype = pool.data.device, e.embedding.dtype
        if e.embedding.device != self.device:
            raise ValueError(f"the model is on {e.embedding.device}, the pool on {self.device}")
        self.block_size, self.max_context = pool.block_size, max_context
        self.width = -(-max_context // pool.block_size)
        self.tables = decoder.rope_tables(max_context, self.dtype, self.device)  # static: graphs read them in place
        self.long_threshold = decoder.long_threshold
        self.long_offset = self.tables[0][0].shape[0] // 2 if self.long_threshold is not None and self.tables else 0
        self.scale = None if e.scale == 1.0 else torch.tensor(e.scale, dtype=self.dtype, device=self.device)
        attn = decoder.layers[0].attn
        self.n_heads, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv, attn.head_dim
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 4
        self.sm_count = sm_count
        scaled = pool.spec.quantized
        self.kv = [(pool.k(layer.attn.layer_idx), pool.v(layer.attn.layer_idx),
                    pool.k_scale(layer.attn.layer_idx) if scaled else None,
                    pool.v_scale(layer.attn.layer_idx) if scaled else None) for layer in decoder.layers]  # fmt: skip

    # ---- buffers --------------------------------------------------------------------

    def buffers(self, rows: int, width: int | None = None, max_context: int | None = None) -> StepBuffers:
        """Static inputs for ``rows`` rows, tables of ``width`` blocks (default: the
        step's ``max_context``), the attention split for contexts up to ``max_context``.
        Plain tensors, not inference ones: filled in inference mode or out of it."""
        width = self.width if width is None else width
        n = rows * (META_FIELDS + width)
        splits = self.ops.decode_splits(rows, self.n_kv, max_context or self.max_context, self.sm_count)
        with torch.inference_mode(False):
            meta = torch.zeros(n, dtype=torch.long, device=self.device)
            host = meta if self.device.type == "cpu" else torch.zeros(n, dtype=torch.long, pin_memory=True)
            ws = self.ops.attention_workspace(rows, self.n_heads, self.head_dim, splits, self.device) if splits > 1 else None
        ids, positions, slots, lens, tables = meta.split_with_sizes((rows, rows, rows, rows, rows * width))
        return StepBuffers(rows, width, meta, host, ids, positions, slots, lens, tables.view(rows, width), ws)

    def fill(self, buf: StepBuffers, rows: DecodeRows) -> int:
        """Copy ``rows`` into ``buf`` (two host-to-device copies: the rows' fields, and
        their tables as far as the longest context reaches), the rows past them padding;
        returns how many rows are real. ValueError when they do not fit. A table's columns
        past its row's context, and a padding row's table, keep whatever ids they held
        (valid ones: no row reads them)."""
        B, R, bs = len(rows), buf.rows, self.block_size
        if not 0 < B <= R:
            raise ValueError(f"{B} rows for a step of {R}")
        pos = rows.positions
        longest = max(pos) + 1
        if longest > min(self.max_context, buf.width * bs):
            raise ValueError(f"a position past the step's context ({min(self.max_context, buf.width * bs)})")
        rope = list(pos)
        if self.long_threshold is not None:  # the long regime's rows: the tables' second half
            rope = [p + self.long_offset if (long or (long is None and p + 1 > self.long_threshold)) else p
                    for p, long in zip(pos, rows.long_rope)]  # fmt: skip
        pad, nb = R - B, -(-longest // bs)
        head = array.array("q", rows.ids)
        head.extend(_zeros(pad))
        head.extend(rope)
        head.extend(_zeros(pad))
        head.extend([t[p // bs] * bs + p % bs for t, p in zip(rows.tables, pos)])
        head.extend(array.array("q", [-1]) * pad)
        head.extend([p + 1 for p in pos])
        head.extend(_zeros(pad))
        tables = array.array("q")
        for t in rows.tables:
            cut = t[:nb]
            tables.extend(cut)
            if len(cut) < nb:
                tables.extend(_zeros(nb - len(cut)))
        if buf.copied is not None:
            buf.copied.synchronize()  # the last copies out of the host side are done
        n = META_FIELDS * R
        host_tables = buf.host[n:].view(R, buf.width)
        buf.host[:n].copy_(torch.frombuffer(head, dtype=torch.long))
        host_tables[:B, :nb].copy_(torch.frombuffer(tables, dtype=torch.long).view(B, nb))
        if buf.host is not buf.meta:
            buf.meta[:n].copy_(buf.host[:n], non_blocking=True)
            buf.tables[:B, :nb].copy_(host_tables[:B, :nb], non_blocking=True)
            buf.copied = torch.cuda.Event()
            buf.copied.record()
        return B

    def pad(self, buf: StepBuffers) -> None:
        """Every row of ``buf`` padding (what a capture runs over)."""
        buf.meta.zero_()
        buf.slots.fill_(-1)

    # ---- the step ---------------------------------------------------------------------

    def run(self, buf: StepBuffers) -> Tensor:
        """The step over ``buf``'s rows: their K/V written, (R, V) float32 logits (also
        ``buf.logits``). No host read, no shape but R's: capturable."""
        ops, d, R = self.ops, self.decoder, buf.rows
        nh, n_kv, hd = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(buf.ids, d.ends.embedding)  # (R, D): the residual stream
        if self.scale is not None:
            x.mul_(self.scale)
        h = torch.empty_like(x)
        first = d.layers[0].norm_in
        ops.rms_norm(h, x, first.weight, first.eps, first.offset)
        for i, layer in enumerate(d.layers):
            a = layer.attn
            qkv = a.qkv_proj(h).view(R, nh + 2 * n_kv, hd)
            if self.tables:
                cos, sin = self.tables[layer.rope_group]
                qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
                ops.rope_(qkv[:, : nh + n_kv], buf.positions, cos, sin, nh, None if qn is None else qn.weight,
                          None if kn is None else kn.weight, qn.eps if qn is not None else 1e-6,
                          qn.offset if qn is not None else 0.0)  # fmt: skip
            q, k, v = qkv[:, :nh], qkv[:, nh : nh + n_kv], qkv[:, nh + n_kv :]
            k_cache, v_cache, k_scale, v_scale = self.kv[i]
            ops.write_kv(k, v, k_cache, v_cache, buf.slots, k_scale, v_scale)
            y = torch.empty(R, nh, hd, dtype=x.dtype, device=x.device)
            ops.decode_attention(y, q, k_cache, v_cache, buf.tables, buf.lens, buf.workspace, scale=a.scale,
                                 window=a.window, softcap=a.softcap, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
            post = layer.norm_post_attn
            ops.rms_norm(h, a.o_proj(y.view(R, nh * hd)), layer.norm_mlp.weight, layer.norm_mlp.eps,
                         layer.norm_mlp.offset, residual=x, x_weight=None if post is None else post.weight)  # fmt: skip
            m = layer.mlp
            z = m.down_proj(gated(m.gate_up_proj(h), m.act))
            nxt = d.layers[i + 1].norm_in if i + 1 < len(d.layers) else d.ends.norm
            post = layer.norm_post_mlp
            ops.rms_norm(h, z, nxt.weight, nxt.eps, nxt.offset, residual=x, x_weight=None if post is None else post.weight)
        logits = d.ends.head(h).float()  # (R, V)
        cap = d.ends.softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        buf.logits = logits
        return logits

    @torch.inference_mode()
    def __call__(self, rows: DecodeRows, which: array.array | None = None) -> Tensor:
        """The step eagerly: buffers of exactly the rows (tables of the longest context)."""
        longest = max(rows.positions) + 1
        buf = self.buffers(len(rows), -(-longest // self.block_size), longest)
        self.fill(buf, rows)
        logits = self.run(buf)
        return logits if which is None else logits.index_select(0, _index(which, self.device))


@dataclass
class _Graph:
    buf: StepBuffers
    graph: Any  # torch.cuda.CUDAGraph; None: the static-buffer path runs eagerly (no CUDA)
    logits: Tensor | None
    nbytes: int


class CudaGraphStep:
    """``step`` replayed from CUDA graphs captured per row count (module docstring);
    ``buckets``: the row counts to capture, ``memory``: the bytes their buffers and the
    graphs' pool may take (a bucket that would pass it is skipped). A step of more rows
    than the largest bucket runs ``step`` eagerly."""

    name = "cuda graphs"
    max_rows = sys.maxsize
    chunk_rows = 0

    @torch.inference_mode()
    def __init__(self, step: CudaStep, buckets: Sequence[int], memory: int) -> None:
        self.step, self.memory = step, memory
        self.graphs: dict[int, _Graph] = {}
        self.nbytes = 0  # what the captures took
        self.skipped: list[int] = []  # buckets over the budget
        cuda = step.device.type == "cuda"
        shared = torch.cuda.graph_pool_handle() if cuda else None
        for rows in sorted(set(buckets), reverse=True):  # largest first: the smaller reuse its pool
            before = _reserved(step.device) if cuda else 0
            buf = step.buffers(rows)
            step.pad(buf)
            graph = logits = None
            if cuda:
                side = torch.cuda.Stream(step.device)
                side.wait_stream(torch.cuda.current_stream(step.device))
                with torch.cuda.stream(side):
                    step.run(buf)  # compiles the kernels, picks cuBLAS's; off the capture
                torch.cuda.current_stream(step.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=shared):
                    logits = step.run(buf)
                torch.cuda.synchronize(step.device)
            used = _reserved(step.device) - before if cuda else buf.nbytes
            if self.nbytes + used > memory:
                self.skipped.append(rows)
                del graph, logits, buf
                continue
            self.graphs[rows] = _Graph(buf, graph, logits, used)
            self.nbytes += used
        self.buckets = sorted(self.graphs)
        log.info("CUDA graphs: %d row counts captured (%s), %.1f MiB%s", len(self.buckets),
                 ",".join(map(str, self.buckets)), self.nbytes / 2**20,
                 f"; over the {memory >> 20} MiB budget: {sorted(self.skipped)}" if self.skipped else "")  # fmt: skip

    def bucket(self, rows: int) -> int | None:
        """The smallest captured row count of at least ``rows`` (None: more than any)."""
        return next((r for r in self.buckets if r >= rows), None)

    @torch.inference_mode()
    def __call__(self, rows: DecodeRows, which: array.array | None = None) -> Tensor:
        R = self.bucket(len(rows))
        if R is None:
            return self.step(rows, which)
        g = self.graphs[R]
        B = self.step.fill(g.buf, rows)
        if g.graph is not None:
            g.graph.replay()
            logits = g.logits
        else:
            logits = self.step.run(g.buf)
        if which is not None:
            return logits.index_select(0, _index(which, logits.device))
        return logits[:B].clone()  # the graph's output is overwritten by the next replay


def build(decoder: Decoder, pool: KVPool, *, max_context: int, graphs: GraphConfig) -> tuple[Any, str]:
    """(the CUDA step over ``pool``, wrapped in its graphs where ``graphs.enabled``; "") or
    (None, why it cannot run: no triton, a kernel that fails at its first step)."""
    from ..kernels import triton as ops

    if not ops.available():
        return None, ops.reason()
    try:
        step = CudaStep(decoder, pool, max_context=max_context, ops=ops)
        buf = step.buffers(1)
        with torch.inference_mode():
            step.pad(buf)
            step.run(buf)  # compiles the kernels; a padding row writes nothing
    except (ValueError, RuntimeError, NotImplementedError) as e:
        return None, f"the CUDA step cannot run: {e}"
    if not graphs.enabled:
        return step, ""
    try:
        return CudaGraphStep(step, graph_buckets(graphs.max_rows), graphs.memory), ""
    except RuntimeError as e:  # a capture that fails: the step runs eagerly
        log.warning("CUDA graphs: capture failed (%s); the CUDA step runs eagerly", e)
        return step, ""


def _zeros(n: int) -> array.array:
    return array.array("q", bytes(8 * n))


def _index(which: array.array, device: torch.device) -> Tensor:
    return torch.frombuffer(which, dtype=torch.long).to(device) if len(which) else torch.zeros(0, dtype=torch.long, device=device)


def _reserved(device: torch.device) -> int:
    """Device memory the caching allocator holds, its free cache returned first."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
