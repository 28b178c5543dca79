"""Where one decode step's time goes: ``torch.profiler`` over ``model(layout, kv)`` steps.

Writes a random checkpoint at one of bench_engine.py's shapes, loads it in a weight
format, prefills B sequences of ``--context`` tokens, then times decode steps (layout build,
forward, greedy pick by the engine's sampler) without the profiler, and profiles 10
more. Prints the step time and each category's share of the profiled self CPU time:
matmuls, SDPA, KV write + gather, RMSNorm, everything else; and the op counts of one
step (``model(layout, kv)`` alone): the ops the model calls, and the compute ops they
run (profiler events with no child that are not views or allocations: about one
kernel launch each), per step and per decoder layer.

    python bench/profile_decode.py --shape 110m --weight-format exact --batch 8 --threads 1
    python bench/profile_decode.py --weight-format exact --batch 8 --no-pack   # MKL instead of oneDNN-packed
    python bench/profile_decode.py --table 25                                   # also the top ops
    python bench/profile_decode.py --shape tiny --layers 12 --clock cpu         # per-op overhead alone
    python bench/profile_decode.py --weight-format w8a8 --empty-kernels         # what runs around the kernels

``--empty-kernels`` times the same steps with every native kernel an empty C function of
the same signature (libc's ``abs``: it reads one register and returns), so a step costs
only what runs around the kernels: Python, ctypes, torch's ops (embedding, RoPE, the
layout's tensors, argmax). Its logits are meaningless.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not an installed one

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server does, before torch loads: torch's idle threads sleep instead of spinning
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.bench_engine import BLOCK_SIZE, SHAPES  # noqa: E402
from kvserve.service.engine.sampling import greedy  # noqa: E402
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.models.quant import WEIGHT_FORMATS  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
           "quantized::linear_dynamic")
KV_OPS = ("aten::index_select", "aten::_index_put_impl_", "aten::index_put_")
NORM_OPS = ("aten::pow", "aten::mean", "aten::sum", "aten::div_", "aten::rsqrt", "aten::rsqrt_")
# events that launch no kernel: views, metadata, allocations
NO_KERNEL = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select",
    "aten::narrow", "aten::transpose", "aten::t", "aten::permute", "aten::expand", "aten::unsqueeze",
    "aten::squeeze", "aten::alias", "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::empty",
    "aten::empty_strided", "aten::empty_like", "aten::result_type", "aten::split", "aten::split_with_sizes",
    "aten::chunk", "aten::unflatten", "aten::flatten", "aten::contiguous", "aten::to", "aten::type_as",
    "aten::resolve_conj", "aten::resolve_neg", "aten::_unsafe_view", "aten::unbind", "aten::resize_",
}
# ops that only call other ops (their children are counted)
COMPOSITE = {
    "aten::linear", "aten::matmul", "aten::rms_norm", "aten::_fused_rms_norm", "aten::mean", "aten::index_put_",
    "aten::scaled_dot_product_attention", "aten::_to_copy", "aten::roll", "aten::clone", "aten::embedding",
    "aten::flatten", "aten::silu",
}


class EmptyKernels:
    """The native library with every ``kv_*`` entry point an empty C function taking the
    same arguments (``--empty-kernels``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._empty = ctypes.cast(ctypes.CDLL(None).abs, ctypes.c_void_p).value

    def __getattr__(self, name: str):
        real = getattr(self._lib, name)
        if not name.startswith("kv_"):
            return real
        fn = type(real)(self._empty)
        fn.argtypes, fn.restype = real.argtypes, None
        setattr(self, name, fn)
        return fn


def is_compute(e) -> bool:
    """A profiler event that runs a kernel itself: not a view or allocation, and not an op
    that only calls others (aten::linear -> aten::mm counts once, as aten::mm)."""
    return e.name not in NO_KERNEL and e.name not in COMPOSITE


def category(op: str) -> str:
    if op in MATMULS:
        return "matmuls"
    if "scaled_dot_product" in op:
        return "SDPA"
    if op in KV_OPS:
        return "KV write + gather"
    if "rms_norm" in op or op in NORM_OPS:
        return "RMSNorm"
    return "other ops"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="110m", choices=sorted(SHAPES))
    ap.add_argument("--weight-format", default="exact", choices=WEIGHT_FORMATS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache per sequence")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (without the profiler)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (default: the shape's)")
    ap.add_argument("--clock", default="cpu", choices=("cpu", "wall"),
                    help="step time as this process's CPU time (robust on a loaded host) or wall time")
    ap.add_argument("--no-pack", action="store_true", help="drop the oneDNN-packed float32 weights (MKL paths)")
    ap.add_argument("--native-kernels", default="auto", choices=("auto", "off"),
                    help="products by the native kernels (their time is not in the profiler's ops) or torch's")
    ap.add_argument("--table", type=int, default=0, help="also print the profiler's top N ops")
    ap.add_argument("--empty-kernels", action="store_true",
                    help="every native kernel an empty function: time what runs around them (meaningless logits)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, ctx = args.batch, args.context
    with tempfile.TemporaryDirectory(prefix="kvserve-prof-") as tmp:
        shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
        path = make_tiny_llama(Path(tmp) / args.shape, max_position_embeddings=max(512, ctx + 64), **shape)
        loaded = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=args.weight_format,
                            native_kernels=args.native_kernels)
    model, cfg = loaded.model, loaded.config
    if args.no_pack:
        for m in model.modules():
            if getattr(m, "_packed", None) is not None:
                m._packed = None
    nb = (ctx + 16) // BLOCK_SIZE + 1
    pool = KVPool(1 + B * nb, cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(B)]
    with torch.inference_mode():
        model(BatchLayout.build([SeqSlice(t, 0, [5] * ctx) for t in tables], BLOCK_SIZE, "cpu"), pool)
        if args.empty_kernels:
            if loaded.native != "on":
                raise SystemExit("--empty-kernels: the native kernels are not serving")
            served = kernels.load()
            empty = dataclasses.replace(served, lib=EmptyKernels(served.lib))
            kernels.load = lambda: empty  # what the model's native calls look up

        def step(i: int) -> list[int]:
            layout = BatchLayout.build([SeqSlice(t, ctx + i % 8, [7]) for t in tables], BLOCK_SIZE, "cpu")
            return greedy(model(layout, pool))

        for i in range(3):
            step(i)
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        t0 = clock()
        for i in range(args.steps):
            step(i)
        step_s = (clock() - t0) / args.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(10):
                step(i)
        layout = BatchLayout.build([SeqSlice(t, ctx, [7]) for t in tables], BLOCK_SIZE, "cpu")
        with profile(activities=[ProfilerActivity.CPU]) as one:
            model(layout, pool)
    called = [e for e in one.events() if e.cpu_parent is None]
    compute = [e for e in one.events() if is_compute(e)]
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares: dict[str, float] = dict.fromkeys(("matmuls", "SDPA", "KV write + gather", "RMSNorm", "other ops"), 0.0)
    for e in events:
        shares[category(e.key)] += e.self_cpu_time_total
    mm_calls = sum(e.count for e in events if e.key in MATMULS) / 10
    packed = "MKL" if args.no_pack else "packed where float32"
    if loaded.native == "on":
        packed = "native products, emptied" if args.empty_kernels else "native products"
    L = cfg.num_layers
    print(f"{args.shape} ({L} layers) {args.weight_format} batch {B} ({packed}), context {ctx}, {args.threads} "
          f"thread(s): step {step_s * 1e3:.2f} ms {args.clock} = {B / step_s:.1f} tok/s; {mm_calls:.0f} matmul calls/step")
    print(f"ops per step (model forward): {len(called)} called ({len(called) / L:.1f} per layer), "
          f"{len(compute)} compute ({len(compute) / L:.1f} per layer)")
    print("profiled self CPU time: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in shares.items()))
    if args.table:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.table))


if __name__ == "__main__":
    main()
