"""Decode attention alone: ``kv_decode_attention`` of every layer of a bench_engine.py
shape over a paged context, per KV pool format, through ctypes (no model, no torch ops in
the timed region), optionally against the library built from another git revision.

Each sequence's context is its own scattered blocks of a random pool (as an engine's
pool is after many requests), and a 64 MB buffer is written before every step so the
context comes from memory, as in a real step, where the weights evict it from the caches.
The builds take turns step by step (bench_kernels.py's pairing): both see the same host.

Per workload: wall and CPU time per step (the process's CPU seconds, all threads:
on a loaded host the CPU time is the steadier figure) at the median, and the context
read per wall second and per CPU second.

    python bench/bench_attention.py                                       # 1k/4k/8k x 1, 8 streams, f32/fp16/int8
    python bench/bench_attention.py --kv-formats f32,bf16,fp16,int8 --threads 1,2 --against HEAD~1
    python bench/bench_attention.py --contexts 128 --batches 1,8 --against main
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.service import kernels  # noqa: E402  torch-free
from kvserve.service.kernels.binding import header_binding  # noqa: E402

kernels.passive_openmp()
import torch  # noqa: E402

from bench.bench_engine import BLOCK_SIZE, SHAPES  # noqa: E402
from bench.bench_kernels import libraries  # noqa: E402

_C = header_binding().constants
KV_FORMATS = {"f32": (torch.float32, _C["KV_F32"]), "bf16": (torch.bfloat16, _C["KV_BF16"]),
              "fp16": (torch.float16, _C["KV_F16"]), "int8": (torch.int8, _C["KV_I8"])}  # fmt: skip


class Attention:
    """Every layer's decode attention for B sequences of ``ctx`` positions each (plus the
    new token) in a random pool of ``fmt`` (int8: planes of values and per-kv-head scales,
    kv/cache.py's layout), each sequence's blocks scattered over the pool."""

    def __init__(self, B: int, ctx: int, shape: dict, fmt: str, threads: int) -> None:
        self.B, self.ctx, self.fmt, self.threads = B, ctx, fmt, threads
        self.L, self.nh, self.nkv = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
        self.hd = shape["hidden_size"] // self.nh
        bs, nkv, hd = BLOCK_SIZE, self.nkv, self.hd
        nb = (ctx + bs) // bs + 1  # blocks per sequence: the context and the new token
        N = 1 + B * nb
        g = torch.Generator().manual_seed(0)
        dtype, self.kv_fmt = KV_FORMATS[fmt]
        if dtype == torch.int8:
            soff = -(-bs * nkv * hd // 4) * 4
            plane = soff + 4 * nkv
            self.pool = torch.randint(-127, 128, (N, self.L, 2, plane), dtype=torch.int8, generator=g)
            scales = (torch.rand(N, self.L, 2, nkv, generator=g) / 127 + 1e-3).contiguous()
            self.pool[..., soff:] = scales.view(torch.int8).view(N, self.L, 2, 4 * nkv)
            elem = 1.0
        else:
            self.pool = torch.randn(N, self.L, 2, bs, nkv, hd, generator=g).to(dtype)
            elem = self.pool.element_size()
        ids = list(range(1, N))
        random.Random(0).shuffle(ids)
        self.tables = torch.tensor(ids).view(B, nb).contiguous()
        self.lens = torch.full((B,), ctx + 1, dtype=torch.long)
        self.slot_blocks = self.tables[:, ctx // bs].contiguous()
        self.slot_offsets = torch.full((B,), ctx % bs, dtype=torch.long)
        self.qkv = torch.randn(B, (self.nh + 2 * nkv) * hd, generator=g)
        self.out = torch.empty(B, self.nh * hd)
        self.bytes = B * (ctx + 1) * self.L * 2 * nkv * hd * elem  # the context's K and V, every layer

    def step(self, lib) -> None:
        q, s = self.qkv, self.qkv.stride(0)
        k = q[:, self.nh * self.hd :]
        v = q[:, (self.nh + self.nkv) * self.hd :]
        for layer in range(self.L):
            lib.kv_decode_attention(
                q.data_ptr(), s, k.data_ptr(), v.data_ptr(), s, self.B, self.nh, self.nkv, self.hd, self.pool.data_ptr(),
                self.kv_fmt, layer, self.L, BLOCK_SIZE, self.slot_blocks.data_ptr(), self.slot_offsets.data_ptr(),
                self.tables.data_ptr(), self.tables.shape[1], self.lens.data_ptr(), 0, self.hd**-0.5, 0.0,
                self.out.data_ptr(), self.threads,
            )  # fmt: skip
        # every step writes its K/V at the same slot: the context stays ctx + 1 positions

    def label(self) -> str:
        return f"{self.fmt} KV, {self.B} x {self.ctx}, {self.threads} thr"


def timed(work: Attention, libs: list, steps: int, flush: torch.Tensor) -> list[tuple[list[float], list[float]]]:
    """(wall seconds, CPU seconds) per step for each build, the builds taking turns."""
    for lib in libs:
        for _ in range(2):
            work.step(lib)
    out: list[tuple[list[float], list[float]]] = [([], []) for _ in libs]
    for _ in range(steps):
        for i, lib in enumerate(libs):
            flush.add_(1)
            c, t = time.process_time(), time.perf_counter()
            work.step(lib)
            out[i][1].append(time.process_time() - c)
            out[i][0].append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="110m", choices=sorted(SHAPES))
    ap.add_argument("--kv-formats", default="f32,fp16,int8", help=f"comma list of {', '.join(KV_FORMATS)}")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="2", help="comma list of thread counts")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per build and workload")
    ap.add_argument("--against", metavar="REV", help="also time the library built from git revision REV")
    args = ap.parse_args()
    isas = kernels.cpu_isas()
    if not isas:
        raise SystemExit("the native kernels need an x86-64 CPU with AVX2 and FMA")
    isa = isas[0]
    shape = SHAPES[args.shape]
    for f in args.kv_formats.split(","):
        if f not in KV_FORMATS:
            raise SystemExit(f"unknown KV format {f!r}; one of {', '.join(KV_FORMATS)}")
    with tempfile.TemporaryDirectory(prefix="kvserve-attn-") as tmp:
        libs, names = libraries(isa, args.against, Path(tmp))
        flush = torch.empty(64 << 20, dtype=torch.uint8)
        print(f"{args.shape}, {isa} build, {args.steps} steps per build{' in turn' if len(libs) > 1 else ''}",
              file=sys.stderr)  # fmt: skip
        two = len(libs) > 1
        vs = f" CPU vs {names[1]} |" if two else ""
        print(f"| workload | build | wall (ms) | CPU (ms) | GB/s wall | GB/s CPU |{vs}")
        print("|---|---|---:|---:|---:|---:|" + ("---:|" if two else ""))
        for f in args.kv_formats.split(","):
            for ctx in map(int, args.contexts.split(",")):
                for B in map(int, args.batches.split(",")):
                    for nt in map(int, args.threads.split(",")):
                        w = Attention(B, ctx, shape, f, nt)
                        res = timed(w, libs, args.steps, flush)
                        cpu = [statistics.median(c) for _, c in res]
                        for i, (name, (wall, c)) in enumerate(zip(names, res)):
                            mw = statistics.median(wall)
                            ratio = (f" {cpu[0] / cpu[1]:.2f}x |" if i == 0 else " |") if two else ""
                            print(f"| {w.label()} | {name} | {mw * 1e3:.2f} | {cpu[i] * 1e3:.2f} "
                                  f"| {w.bytes / mw / 1e9:.1f} | {w.bytes / cpu[i] / 1e9:.1f} |{ratio}",
                                  flush=True)  # fmt: skip
                        del w


if __name__ == "__main__":
    main()
