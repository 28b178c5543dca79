"""bf16/int8 prefill: the three ways a stored-weight product of many rows can run, in one
process, in turn, and llama.cpp's ``llama-bench -p N -n 0`` on the same weights between
rounds (optional).

    native gemm   kernels/src/gemm.cpp: the stored weight widened per L2-sized panel,
                  attention by kernels/src/attention.cpp (causal: no work above the
                  diagonal), norms, RoPE and gates by the kernels (layers.NATIVE_ROWWISE)
    native gemm + torch SDPA and row ops   the same products, the rest torch's (before)
    torch widen   a whole float32 copy of the weight per call, then MKL's SGEMM (before)
    oneDNN bf16   torch's bfloat16 GEMM (CPUs with AVX-512 BF16 only: ``quant.BF16_GEMM``)

``--isa avx2`` serves with the AVX2 library (what an AVX2 host runs) on an AVX-512 host.
``--products`` (bf16) also times the products alone (the ~110M layer's four shapes at the
prompt's rows, GFLOP per CPU second: the host's load counts less than in wall time);
``--attention`` the layer's causal attention alone, native against torch's SDPA.

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
from kvserve.service.models import layers, quant  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402

# mode -> (quant.NATIVE_GEMM, quant.BF16_GEMM, native attention and row-wise ops)
MODES = {"native gemm": (True, False, True), "native gemm + torch SDPA and row ops": (True, False, False),
         "torch widen": (False, False, True), "oneDNN bf16": (False, True, True)}


def native_attention(model: torch.nn.Module, on: bool) -> None:
    """The layers' attention by the native kernel (``layers.attend_natively``) and a
    prefill's norms, RoPE and gates too (``layers.NATIVE_ROWWISE``), or torch's SDPA and
    row-wise ops (before)."""
    layers.NATIVE_ROWWISE = on
    for m in model.modules():
        if hasattr(m, "native_attention"):
            m.native_attention = on and kernels.available()
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


def attention_alone(T: int, shape: dict, repeats: int = 7) -> None:
    """The ~110M layer's causal attention over T fresh tokens, alone: the native kernel
    (attention.cpp) against torch's SDPA on contiguous heads (the model's path before), min
    of ``repeats`` alternating calls each; GFLOP per second counts the causal work
    (2 T^2 hd nh: the half below the diagonal)."""
    nh, nkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    hd = shape["hidden_size"] // nh
    q, k, v = torch.randn(1, T, nh + 2 * nkv, hd).split((nh, nkv, nkv), 2)  # one fused projection's output
    lens = torch.tensor([T])

    def native() -> torch.Tensor:
        return ops.prefill_attention(q, k, v, lens, lens, None, hd**-0.5, None)

    def sdpa() -> torch.Tensor:
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=hd**-0.5, enable_gqa=True)

    diff = (native() - sdpa().transpose(1, 2)).abs().max().item()
    best = {"native": float("inf"), "torch SDPA": float("inf")}
    for _ in range(repeats):
        for name, fn in (("native", native), ("torch SDPA", sdpa)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    flops = 2 * T * T * hd * nh
    print(f"  attention of {T} tokens, {torch.get_num_threads()} threads: native {best['native'] * 1e3:.2f} ms "
          f"({flops / best['native'] / 1e9:.0f} GFLOP/s), torch SDPA {best['torch SDPA'] * 1e3:.2f} ms: "
          f"{best['torch SDPA'] / best['native']:.2f}x; max |difference| {diff:.1e}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", default="bf16", choices=sorted(LLAMA_TYPE))
    ap.add_argument("--shape", default="110m", choices=["110m", "1.1b"])
    ap.add_argument("--modes", help="comma-separated modes to run (default: all; 'torch widen' is the logits' reference)")
    ap.add_argument("--lens", default="512,2048")
    ap.add_argument("--rounds", type=int, default=3, help="0: no prefill rounds (--attention alone)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", help="serve with this ISA level's library (avx2 on an AVX-512 host)")
    ap.add_argument("--products", action="store_true")
    ap.add_argument("--attention", action="store_true",
                    help="time the causal attention alone (native kernel against torch SDPA) on 1 and --threads threads")
    ap.add_argument("--llama-bench", type=Path)
    ap.add_argument("--llama-src", type=Path, default=Path("/work/llama/src"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.isa:
        kernels.select(args.isa)
    lens = [int(n) for n in args.lens.split(",")]
    modes = {m: v for m, v in MODES.items() if m != "oneDNN bf16" or quant.BF16_GEMM}
    if args.modes:
        keep = {m.strip() for m in args.modes.split(",")} | {"torch widen"}
        modes = {m: v for m, v in modes.items() if m in keep}
    saved = quant.NATIVE_GEMM, quant.BF16_GEMM
    print(f"{args.format}, {kernels.isa()} library, {args.threads} threads, BF16_GEMM on this CPU: {quant.BF16_GEMM}")
    if args.attention:
        for n in lens:
            for threads in sorted({1, args.threads}):
                torch.set_num_threads(threads)
                attention_alone(n, bench_engine.SHAPES[args.shape])
        torch.set_num_threads(args.threads)
    if args.rounds < 1:  # the attention alone
        return
    with tempfile.TemporaryDirectory(prefix="bench_prefill_") as tmp:
        path = bench_engine.family_checkpoint("llama", Path(tmp) / args.shape, bench_engine.SHAPES[args.shape], max(lens) + 16)
        gguf = None
        if args.llama_bench:
            gguf = Path(tmp) / f"{args.shape}.gguf"
            env = dict(ENV_AT_START, PYTHONPATH=str(args.llama_src / "gguf-py"))
            subprocess.run([sys.executable, str(args.llama_src / "convert_hf_to_gguf.py"), str(path), "--outfile",
                            str(gguf), "--outtype", LLAMA_TYPE[args.format]], env=env, capture_output=True, check=True)
        loaded = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=args.format)
        ours = bench_engine.Ours(loaded, max(lens) + 16)
        g = torch.Generator().manual_seed(0)
        for n in lens:
            p = torch.randint(3, loaded.config.vocab_size, (1, n), generator=g).tolist()
            first = {}
            for m, (native, bf16, attention) in modes.items():
                quant.NATIVE_GEMM, quant.BF16_GEMM = native, bf16
                native_attention(loaded.model, attention)
                first[m] = ours.prefill(p)  # untimed
            wall = {m: [] for m in modes}
            cpu = {m: [] for m in modes}
            llama = []
            for _ in range(args.rounds):
                for m, (native, bf16, attention) in modes.items():
                    quant.NATIVE_GEMM, quant.BF16_GEMM = native, bf16
                    native_attention(loaded.model, attention)
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
            native_attention(loaded.model, True)
            for m in modes:
                diff = (first[m] - first["torch widen"]).abs().max().item()
                print(f"  prefill {n}, {m}: {statistics.median(wall[m]):.0f} tok/s (median of {args.rounds}, "
                      f"{min(wall[m]):.0f}-{max(wall[m]):.0f}), CPU {statistics.median(cpu[m]) * 1e3:.0f} ms, "
                      f"max |logit - torch widen's| {diff:.1e}", flush=True)  # fmt: skip
            if llama:
                print(f"  prefill {n}, llama.cpp {LLAMA_TYPE[args.format].upper()}: {statistics.median(llama):.0f} "
                      f"tok/s (median of {len(llama)}, {min(llama):.0f}-{max(llama):.0f})", flush=True)  # fmt: skip
            if args.products and args.format == "bf16":
                products(n, torch.bfloat16, bench_engine.SHAPES[args.shape])
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
