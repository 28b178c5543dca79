"""Where one decode step's time goes: ``torch.profiler`` over ``model(layout, kv)`` steps.

Writes a random checkpoint at one of bench_engine.py's shapes, loads it in a weight
format, prefills B sequences of ``--context`` tokens, then times decode steps (layout build,
forward, argmax, as bench_engine.py drives them) without the profiler, and profiles 10
more. Prints the step time and each category's share of the profiled self CPU time:
matmuls, SDPA, KV write + gather, RMSNorm, everything else.

    python bench/profile_decode.py --shape 110m --weight-format exact --batch 8 --threads 1
    python bench/profile_decode.py --weight-format exact --batch 8 --no-pack   # MKL instead of oneDNN-packed
    python bench/profile_decode.py --table 25                                   # also the top ops
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_engine import BLOCK_SIZE, SHAPES  # noqa: E402
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.models.quant import WEIGHT_FORMATS  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

MATMULS = ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
           "quantized::linear_dynamic")
KV_OPS = ("aten::index_select", "aten::_index_put_impl_", "aten::index_put_")
NORM_OPS = ("aten::pow", "aten::mean", "aten::rsqrt")


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
    ap.add_argument("--no-pack", action="store_true", help="drop the oneDNN-packed float32 weights (MKL paths)")
    ap.add_argument("--table", type=int, default=0, help="also print the profiler's top N ops")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, ctx = args.batch, args.context
    with tempfile.TemporaryDirectory(prefix="kvserve-prof-") as tmp:
        path = make_tiny_llama(Path(tmp) / args.shape, max_position_embeddings=max(512, ctx + 64), **SHAPES[args.shape])
        loaded = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=args.weight_format)
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

        def step(i: int) -> list[int]:
            layout = BatchLayout.build([SeqSlice(t, ctx + i % 8, [7]) for t in tables], BLOCK_SIZE, "cpu")
            return model(layout, pool).argmax(-1).tolist()

        for i in range(3):
            step(i)
        t0 = time.process_time()
        for i in range(args.steps):
            step(i)
        step_s = (time.process_time() - t0) / args.steps
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(10):
                step(i)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares: dict[str, float] = dict.fromkeys(("matmuls", "SDPA", "KV write + gather", "RMSNorm", "other ops"), 0.0)
    for e in events:
        shares[category(e.key)] += e.self_cpu_time_total
    mm_calls = sum(e.count for e in events if e.key in MATMULS) / 10
    packed = "MKL" if args.no_pack else "packed where float32"
    print(f"{args.shape} {args.weight_format} batch {B} ({packed}), context {ctx}, {args.threads} thread(s): "
          f"step {step_s * 1e3:.1f} ms CPU = {B / step_s:.1f} tok/s; {mm_calls:.0f} matmul calls/step")
    print("profiled self CPU time: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in shares.items()))
    if args.table:
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.table))


if __name__ == "__main__":
    main()
