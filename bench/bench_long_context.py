"""Decode speed at long contexts: kvserve's model + paged KV pool at 1k/4k/8k positions,
one and eight streams, and llama.cpp's llama-bench (``-p 0 -n N -d CTX``) on the same
weights in the same run, each side alternately.

Where attention, not the weights, sets a step's time: at 8192 positions a ~110M model's
K and V are 200 MB per stream and step in float32 (100 MB as fp16/bf16), against its
300 MB of float32 weights. kvserve's context is written straight into the pool (random
K/V, as a prefill would leave them: the decode step's cost does not depend on the
values), so a long context costs no prefill; llama-bench fills its KV cache untimed
(``-d``). llama-bench decodes one stream (its KV cache F16 by default: compare with
``--kv-formats fp16``); ``--llama-batched-bench`` adds llama.cpp's many-stream figure:
``llama-batched-bench -npp CTX -ntg STEPS -npl B`` (B sequences, each its own CTX-token
prompt, not shared, then STEPS decode steps of all B together: its ``speed_tg``).

    python bench/bench_long_context.py --shapes 110m --weight-formats exact,bf16 --kv-formats exact,fp16 \\
        --contexts 1024,4096,8192 --batches 1,8 --llama-bench /work/llama/src/build/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvserve.service import kernels  # noqa: E402  torch-free

ENV_AT_START = dict(os.environ)  # llama-bench keeps libgomp's default wait policy
kernels.passive_openmp()
import torch  # noqa: E402

import bench_engine  # noqa: E402  its shapes and checkpoints
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402

KV_DTYPES = {"exact": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LLAMA_TYPE = {"exact": "f32", "bf16": "f16", "int8": "q8_0", "w8a8": "q8_0"}
BLOCK = bench_engine.BLOCK_SIZE


class LongDecode:
    """B streams decoding after ``ctx`` positions of random K/V in a pool of ``kv_dtype``."""

    def __init__(self, loaded, kv_dtype: torch.dtype, batch: int, ctx: int, steps: int) -> None:
        cfg = loaded.config
        self.model, self.batch, self.ctx, self.steps = loaded.model, batch, ctx, steps
        per = -(-(ctx + steps + 1) // BLOCK)
        self.pool = KVPool(1 + batch * per, cfg.num_layers, BLOCK, cfg.num_kv_heads, cfg.head_dim, kv_dtype,
                           compute_dtype=torch.float32)  # fmt: skip
        g = torch.Generator().manual_seed(batch * 7 + ctx)
        for n in range(1, self.pool.num_blocks):  # a block at a time: no float32 copy of the whole pool
            self.pool.data[n] = torch.randn(self.pool.data.shape[1:], generator=g).mul_(0.5).to(kv_dtype)
        self.tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(batch)]
        self.vocab = cfg.vocab_size

    @torch.inference_mode()
    def run(self) -> None:
        toks = [3 + b for b in range(self.batch)]
        for step in range(self.steps):
            seqs = [SeqSlice(t, self.ctx + step, [tok]) for t, tok in zip(self.tables, toks)]
            toks = self.model(BatchLayout.build(seqs, BLOCK, torch.device("cpu"), torch.float32),
                              self.pool).argmax(-1).tolist()  # fmt: skip


def llama_decode(binary: Path, gguf: Path, ctx: int, steps: int, threads: int) -> float | None:
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", "-p", "0", "-n", str(steps),
           "-d", str(ctx)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV_AT_START)
    if res.returncode != 0:
        print(f"[llama.cpp] llama-bench failed: {res.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(json.loads(res.stdout)[0]["avg_ts"])


def llama_batched_decode(binary: Path, gguf: Path, ctx: int, steps: int, batch: int, threads: int) -> float | None:
    """llama.cpp's aggregate decode tok/s of ``batch`` sequences of ``ctx`` positions each."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(batch * (ctx + steps + 16)),
           "-b", "2048", "-ub", "512", "-npp", str(ctx), "-ntg", str(steps), "-npl", str(batch),
           "--output-format", "jsonl"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=ENV_AT_START)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        print(f"[llama.cpp] llama-batched-bench failed: {res.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(json.loads(lines[-1])["speed_tg"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="110m")
    ap.add_argument("--weight-formats", default="exact,bf16")
    ap.add_argument("--kv-formats", default="exact,fp16", help="kvserve's pool: exact (float32), bf16, fp16")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-rounds", type=int, default=2, help="llama-bench runs per context (each refills -d)")
    ap.add_argument("--llama-bench", type=Path, help="llama-bench binary (outside the repository); none: kvserve alone")
    ap.add_argument("--llama-src", type=Path, default=Path("/work/llama/src"), help="for convert_hf_to_gguf.py")
    ap.add_argument("--llama-batched-bench", type=Path,
                    help="llama-batched-bench binary: llama.cpp's figure for the rows of more than one stream (once each)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_long_") as tmp:
        work = Path(tmp)
        for shape in args.shapes.split(","):
            path = bench_engine.family_checkpoint("llama", work / shape, bench_engine.SHAPES[shape],
                                                  max(contexts) + args.steps + 16)  # fmt: skip
            for fmt in args.weight_formats.split(","):
                loaded = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=fmt)
                gguf = None
                if args.llama_bench or args.llama_batched_bench:
                    gguf = work / f"{shape}-{LLAMA_TYPE[fmt]}.gguf"
                    if not gguf.exists():
                        env = dict(ENV_AT_START, PYTHONPATH=str(args.llama_src / "gguf-py"))
                        subprocess.run([sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(path),
                                        "--outfile", str(gguf), "--outtype", LLAMA_TYPE[fmt]], env=env,
                                       capture_output=True, check=True)  # fmt: skip
                for ctx in contexts:
                    # every (kv format, streams) run of this context, timed in turn each round, and
                    # llama-bench (one stream; its untimed -d prefill is the slow part) between rounds
                    runs = {(kvf, batch): LongDecode(loaded, KV_DTYPES[kvf], batch, ctx, args.steps)
                            for kvf in args.kv_formats.split(",") for batch in batches}  # fmt: skip
                    for run in runs.values():
                        run.run()  # untimed: first touch
                    ours = {key: [] for key in runs}
                    ref = []
                    for r in range(args.rounds):
                        for key, run in runs.items():
                            t0 = time.perf_counter()
                            run.run()
                            ours[key].append(key[1] * args.steps / (time.perf_counter() - t0))
                        if args.llama_bench and r < args.llama_rounds:
                            got = llama_decode(args.llama_bench, gguf, ctx, args.steps, args.threads)
                            if got is not None:
                                ref.append(got)
                    del runs
                    rr = statistics.median(ref) if ref else float("nan")
                    many = {}  # streams -> llama.cpp's aggregate tok/s (after kvserve's rounds: one process at a time)
                    if args.llama_batched_bench:
                        for batch in batches:
                            if batch > 1:
                                got = llama_batched_decode(args.llama_batched_bench, gguf, ctx, args.steps, batch,
                                                           args.threads)  # fmt: skip
                                many[batch] = float("nan") if got is None else got
                    for (kvf, batch), t in ours.items():
                        o = statistics.median(t)
                        r1 = rr if batch == 1 else many.get(batch, float("nan"))
                        rows.append((shape, fmt, kvf, ctx, batch, o, min(t), max(t), r1))
                        print(f"[{shape}] {fmt} kv {kvf} ctx {ctx} batch {batch}: {o:.1f} tok/s "
                              f"({min(t):.1f}-{max(t):.1f}); llama.cpp {LLAMA_TYPE[fmt]} {r1:.1f} {ref}",
                              file=sys.stderr, flush=True)  # fmt: skip
                del loaded
    print(f"\n{args.threads} threads, {args.steps} steps, median of {args.rounds} alternating rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| shape | weights / llama.cpp | kv pool | context | streams | kvserve tok/s (range) | llama.cpp tok/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, fmt, kvf, ctx, batch, o, lo, hi, r in rows:
        ratio = f"{o / r:.2f}x" if r == r else "-"
        rs = f"{r:.1f}" if r == r else "-"
        print(f"| {shape} | {fmt} / {LLAMA_TYPE[fmt].upper()} | {kvf} | {ctx} | {batch} | {o:.1f} ({lo:.1f}-{hi:.1f}) "
              f"| {rs} | {ratio} |")


if __name__ == "__main__":
    main()
