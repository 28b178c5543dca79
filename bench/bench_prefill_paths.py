"""bf16/int8 prefill: the three ways a stored-weight product of many rows can run, in one
process, in turn, and llama.cpp's ``llama-bench -p N -n 0`` on the same weights between
rounds (optional).

    native gemm   kernels/src/gemm.cpp: the stored weight widened per L2-sized panel
    torch widen   a whole float32 copy of the weight per call, then MKL's SGEMM (before)
    oneDNN bf16   torch's bfloat16 GEMM (CPUs with AVX-512 BF16 only: ``quant.BF16_GEMM``)

``--isa avx2`` serves with the AVX2 library (what an AVX2 host runs) on an AVX-512 host.
``--products`` (bf16) also times the products alone (the ~110M layer's four shapes at the
prompt's rows, GFLOP per CPU second: the host's load counts less than in wall time).

    python bench/bench_prefill_paths.py --isa avx2 --lens 512,2048 \\
        --llama-bench /work/llama/src/build/bin/llama-bench --llama-src /work/llama/src
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvserve.service import kernels  # noqa: E402  torch-free

ENV_AT_START = dict(os.environ)
kernels.passive_openmp()
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bench_engine  # noqa: E402
from kvserve.service.kernels import ops  # noqa: E402
from kvserve.service.models import quant  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402

MODES = {"native gemm": (True, False), "torch widen": (False, False), "oneDNN bf16": (False, True)}
LLAMA_TYPE = {"bf16": "f16", "int8": "q8_0"}


def products(rows: int, dtype: torch.dtype, shape: dict, repeats: int = 5) -> None:
    D, I = shape["hidden_size"], shape["intermediate_size"]
    hd = D // shape["num_attention_heads"]
    dims = [(D + 2 * shape["num_key_value_heads"] * hd, D), (D, D), (2 * I, D), (D, I)]  # qkv, o, gate_up, down
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g).to(dtype) for n, k in dims]
    xs = [torch.randn(rows, k, generator=g) for _, k in dims]
    flops = sum(2 * rows * n * k for n, k in dims)
    paths = {"native gemm": lambda: [ops.gemm(x, w) for x, w in zip(xs, ws)],
             "torch widen": lambda: [F.linear(x, w.float()) for x, w in zip(xs, ws)],
             "MKL on float32 weights": lambda: [F.linear(x, w) for x, w in zip(xs, [w.float() for w in ws])]}  # fmt: skip
    cpu = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            c0 = time.process_time()
            fn()
            cpu[name].append(time.process_time() - c0)
    for name, t in cpu.items():
        print(f"  products at {rows} rows, {name}: {flops / statistics.median(t) / 1e9:.1f} GFLOP per CPU second")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="bf16", choices=sorted(LLAMA_TYPE))
    ap.add_argument("--lens", default="512,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", help="serve with this ISA level's library (avx2 on an AVX-512 host)")
    ap.add_argument("--products", action="store_true")
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--llama-src", type=Path, default=Path("/work/llama/src"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa:
        kernels.select(args.isa)
    lens = [int(n) for n in args.lens.split(",")]
    modes = {m: v for m, v in MODES.items() if m != "oneDNN bf16" or quant.BF16_GEMM}
    saved = quant.NATIVE_GEMM, quant.BF16_GEMM
    print(f"{args.format}, {kernels.isa()} library, {args.threads} threads, BF16_GEMM on this CPU: {quant.BF16_GEMM}")
    with tempfile.TemporaryDirectory(prefix="bench_prefill_") as tmp:
        path = bench_engine.family_checkpoint("llama", Path(tmp) / "110m", bench_engine.SHAPES["110m"], max(lens) + 16)
        gguf = None
        if args.llama_bench:
            gguf = Path(tmp) / "110m.gguf"
            env = dict(ENV_AT_START, PYTHONPATH=str(args.llama_src / "gguf-py"))
            subprocess.run([sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(path), "--outfile",
                            str(gguf), "--outtype", LLAMA_TYPE[args.format]], env=env, capture_output=True, check=True)
        loaded = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=args.format)
        ours = bench_engine.Ours(loaded, max(lens) + 16)
        g = torch.Generator().manual_seed(0)
        for n in lens:
            p = torch.randint(3, loaded.config.vocab_size, (1, n), generator=g).tolist()
            first = {}
            for m, (native, bf16) in modes.items():
                quant.NATIVE_GEMM, quant.BF16_GEMM = native, bf16
                first[m] = ours.prefill(p)  # untimed
            wall = {m: [] for m in modes}
            cpu = {m: [] for m in modes}
            llama = []
            for _ in range(args.rounds):
                for m, (native, bf16) in modes.items():
                    quant.NATIVE_GEMM, quant.BF16_GEMM = native, bf16
                    t0, c0 = time.perf_counter(), time.process_time()
                    ours.prefill(p)
                    wall[m].append(n / (time.perf_counter() - t0))
                    cpu[m].append(time.process_time() - c0)
                if gguf is not None:
                    res = subprocess.run([str(args.llama_bench), "-m", str(gguf), "-t", str(args.threads), "-r", "1",
                                          "-o", "json", "-p", str(n), "-n", "0"], capture_output=True, text=True,
                                         env=ENV_AT_START)  # fmt: skip
                    if res.returncode == 0:
                        llama.append(float(json.loads(res.stdout)[0]["avg_ts"]))
            quant.NATIVE_GEMM, quant.BF16_GEMM = saved
            for m in modes:
                diff = (first[m] - first["torch widen"]).abs().max().item()
                print(f"  prefill {n}, {m}: {statistics.median(wall[m]):.0f} tok/s (median of {args.rounds}, "
                      f"{min(wall[m]):.0f}-{max(wall[m]):.0f}), CPU {statistics.median(cpu[m]) * 1e3:.0f} ms, "
                      f"max |logit - torch widen's| {diff:.1e}", flush=True)  # fmt: skip
            if llama:
                print(f"  prefill {n}, llama.cpp {LLAMA_TYPE[args.format].upper()}: {statistics.median(llama):.0f} "
                      f"tok/s (median of {len(llama)}, {min(llama):.0f}-{max(llama):.0f})", flush=True)  # fmt: skip
            if args.products and args.format == "bf16":
                products(n, torch.bfloat16, bench_engine.SHAPES["110m"])
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
