"""The engine's decode step: one interface, three backends.

A decode step computes rows, each one new token at its position over its sequence's block
table (a decode row; a verify sequence's pending token and drafts, rows at consecutive
positions over one table; a returning turn's new tokens): every row's K/V written into
the pool before any row attends, each row attending over its context up to itself, the
logits of every row (or of the rows asked for). The runner (engine/runner.py) packs the
rows (``kv.cache.DecodeRows``) and calls one ``DecodeStep``:

    backend       where            what computes it
    NativeStep    CPU, float32     kernels/layer.py: the whole step in one native call
                                   (the modules' kernel views: products in their stored
                                   format, attention read in place from the pool)
    CudaStep      CUDA             models/cuda_step.py: the Triton kernels of kernels/triton
                                   over the pool in place, the products the modules' own
                                   (cuBLAS); replayed from CUDA graphs by row count
                                   (``CudaGraphStep``)
    TorchStep     anywhere         the model's forward over a ``BatchLayout`` of the rows:
                                   its torch modules, the reference the other two are
                                   tested against (tests/engine/test_native.py,
                                   tests/engine/test_step.py)

``build_step`` picks the backend once, at the engine's start: the native step where the
kernels serve the model (``use_kernels``) and read the pool, the CUDA step where the
device is CUDA and triton imports, else the reference. A family without a ``Decoder``
(GPT-2), a pool the native kernels do not read (fp8 on the CPU) and steps of more rows
than the backend takes (``max_rows``) run the reference.
"""

from __future__ import annotations

import array
import logging
import sys
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from ..kernels import ops as kernel_ops
from ..kernels.layer import LayerWeights, NativeStep, StepEnds
from ..kv.cache import BatchLayout, DecodeRows, KVPool, SeqSlice
from .layers import Decoder, DecoderLayer

log = logging.getLogger(__name__)


class DecodeStep(Protocol):
    """One decode step over the block pool (module docstring)."""

    name: str  # the backend, as logged at start ("native", "cuda", "cuda graphs", "torch")
    max_rows: int  # rows one call takes; a step of more runs the reference
    chunk_rows: int  # of those, prefill chunks' rows it takes beside the decode rows (0: chunks go to the prefill forward)

    def __call__(self, rows: DecodeRows, which: array.array | None = None) -> Tensor:
        """Float32 logits (B, V) of the B rows, or of rows ``which`` alone (R, V); the rows'
        K/V written into the pool. IndexError for a token id outside the vocabulary."""


class TorchStep:
    """The reference backend: the model's forward (its torch modules; on the CPU with the
    native kernels, the modules' kernel calls) over a ``BatchLayout`` of the rows, a
    sequence per row. Any family, pool format, device and row count."""

    name = "torch"
    max_rows = sys.maxsize
    chunk_rows = 0  # a row per token, each gathering its context: the padded prefill forward is faster

    def __init__(self, model: nn.Module, pool: KVPool, device: torch.device) -> None:
        self.model, self.pool, self.device = model, pool, torch.device(device)

    def __call__(self, rows: DecodeRows, which: array.array | None = None) -> Tensor:
        slices = [SeqSlice(table, pos, [tok], long) for tok, pos, table, long
                  in zip(rows.ids, rows.positions, rows.tables, rows.long_rope)]  # fmt: skip
        layout = BatchLayout.build(slices, rows.block_size, self.device)
        picked = None if which is None else torch.tensor(list(which), dtype=torch.long, device=self.device)
        return self.model(layout, self.pool, rows=picked)


def layer_weights(layer: DecoderLayer) -> LayerWeights | None:
    """A decoder layer's ``LayerWeights`` for the native step, from its modules' kernel
    views (after ``fuse`` and ``use_kernels``); None when a part has none."""
    attn, mlp = layer.attn, layer.mlp
    norms = {"norm_in": layer.norm_in, "norm_mlp": layer.norm_mlp, "norm_post_attn": layer.norm_post_attn,
             "norm_post_mlp": layer.norm_post_mlp, "q_norm": getattr(attn, "q_norm", None),
             "k_norm": getattr(attn, "k_norm", None)}  # fmt: skip
    products = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    views = {name: None if m is None else getattr(m, "kernel", None) for name, m in (norms | products).items()}
    if any(views[name] is None for name in products) or any(views[n] is None for n, m in norms.items() if m is not None):
        return None
    return LayerWeights(**views, act=mlp.act, n_heads=attn.n_heads, n_kv=attn.n_kv, head_dim=attn.head_dim,
                        scale=attn.scale, layer=attn.layer_idx, window=attn.window, softcap=attn.softcap)  # fmt: skip


def native_step(decoder: Decoder, pool: KVPool) -> NativeStep | None:
    """The native backend over ``pool``, or None where it does not apply: a pool not on
    the CPU or of a format the kernels do not read (fp8), a module without its kernel view
    (the kernels off, a bfloat16 model)."""
    if pool.data.device.type != "cpu" or pool.data.dtype not in kernel_ops.KV_POOL_FORMATS:
        return None
    layers = [layer_weights(layer) for layer in decoder.layers]
    e = decoder.ends
    ends = StepEnds.of(e.embedding, e.scale, getattr(e.norm, "kernel", None), getattr(e.head, "kernel", None), e.softcap)
    if ends is None or any(layer is None for layer in layers):
        return None
    cpu = torch.device("cpu")
    return NativeStep(layers, decoder.groups, ends, pool.data, pool.block_size,
                      lambda n: decoder.rope_tables(n, torch.float32, cpu), decoder.long_threshold)  # fmt: skip


@dataclass(frozen=True)
class GraphConfig:
    """CUDA graphs of the CUDA step (``CudaGraphStep``): on or off, the largest row count
    captured (steps of more rows run eagerly) and the device memory the captures may take
    (static buffers and the graphs' shared pool; a bucket that would pass it is not
    captured)."""

    enabled: bool = True
    max_rows: int = 64
    memory: int = 512 << 20


def build_step(model: nn.Module, pool: KVPool, device: torch.device, *, max_context: int,
               graphs: GraphConfig = GraphConfig()) -> DecodeStep:
    """The decode step backend for ``model`` over ``pool`` (module docstring): chosen once,
    logged once. ``max_context``: the longest context a row may have (the CUDA step's
    static tables); ``graphs``: the CUDA step's graphs."""
    make = getattr(model, "decoder", None)
    decoder = make() if callable(make) else None
    step: DecodeStep | None = None
    why = "the family has no decode step backend" if decoder is None else ""
    if decoder is not None and pool.data.device.type == "cpu":
        step = native_step(decoder, pool)
        why = "" if step is not None else "the native kernels do not serve this model or pool"
    elif decoder is not None and pool.data.device.type == "cuda":
        from . import cuda_step

        step, why = cuda_step.build(decoder, pool, max_context=max_context, graphs=graphs)
    if step is None:
        step = TorchStep(model, pool, device)
        log.info("decode step: torch (%s)", why)
    else:
        log.info("decode step: %s", step.name)
    return step
