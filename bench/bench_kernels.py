"""The native decode kernels alone, and two builds of them side by side.

Times the products of one decode step of a bench_engine.py shape (every decoder layer's
q/k/v, o, gate/up and down products and the LM head: 49 at ~110M) in each weight format
(ggml's block types too: q8_0, q4_0, q4_1, q5_0, q4_k, q6_k, random weights in each),
at a few input-row counts (1: one stream; 8: a batch), and optionally the decode
attention of every layer over a paged context; through ctypes, no model, no torch ops in
the timed region.

``--against REV`` builds the library a second time from git revision REV's sources (the
same compiler flags and ISA level) and times the two builds step by step in turn, in one
process, so both see the same host: on a shared machine whose speed moves by 20% from one
run to the next, that pairing is what makes a 5% difference measurable. Both builds must
have the entry points' current signatures.

    python bench/bench_kernels.py                                     # ~110M, every format, 1 and 8 rows
    python bench/bench_kernels.py --formats f32 --rows 1,8 --against HEAD~1
    python bench/bench_kernels.py --formats w8a8,q8_0,q4_0,q4_k,q6_k --rows 1,8,64 --threads 1 --against main
    python bench/bench_kernels.py --formats bf16 --rows 1,2,4,8,16 --steps 50 --against main
    python bench/bench_kernels.py --formats none --attention 1x1024,8x1024 --against HEAD~1
    python bench/bench_kernels.py --shape default --formats none --attention 1x320,g4x320 --warm

Per format and row count: the median and quartile of the step's products (ms), the
weights read per second at the median, and with ``--against`` the ratio of medians
(< 1: this checkout's build is faster).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.service import kernels  # noqa: E402  torch-free
from kvserve.service.kernels import build  # noqa: E402
from kvserve.service.kernels.binding import header_binding  # noqa: E402

kernels.passive_openmp()
import torch  # noqa: E402

from kvserve.service.kernels import ops  # noqa: E402

from bench.bench_engine import BLOCK_SIZE, SHAPES  # noqa: E402

FORMATS = {  # name: (entry point, weight dtype)
    "f32": ("kv_gemv_f32", torch.float32),
    "bf16": ("kv_gemv_bf16", torch.bfloat16),
    "int8": ("kv_gemv_i8", torch.int8),
    "w8a8": ("kv_gemv_q8", torch.int8),
    **{fmt: ("kv_gemv_blocks", torch.uint8) for fmt in ops.BLOCK_FORMATS},  # ggml's blocks (qblocks.cpp)
}


SOURCE_DIRS = ("service/kernels/src", "service/models/native")  # where a revision keeps them: now, and before


def build_from_revision(rev: str, isa: str, out_dir: Path) -> Path:
    """The native library compiled from ``rev``'s sources (``git show``, from the kernels'
    room or, in older revisions, models/native/), this checkout's flags, at ``isa``;
    SystemExit with one line when it cannot be."""
    src = out_dir / "src"
    src.mkdir()
    for where in SOURCE_DIRS:
        listing = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{where}"], cwd=REPO, capture_output=True,
                                 text=True)  # fmt: skip
        if listing.returncode == 0:
            break
    else:
        raise SystemExit(f"--against {rev}: no kernel sources in {' or '.join(SOURCE_DIRS)}")
    for name in listing.stdout.split():
        if name.endswith((".cpp", ".h")):
            done = subprocess.run(["git", "show", f"{rev}:{where}/{name}"], cwd=REPO, capture_output=True)
            if done.returncode != 0:
                raise SystemExit(f"--against {rev}: {done.stderr.decode().strip() or 'git show failed'}")
            (src / name).write_bytes(done.stdout)
    lib = out_dir / f"libkvkernels-{isa}-{rev.replace('/', '_')}.so"
    try:
        build.compile_sources(src, isa, lib, sources=tuple(sorted(p.name for p in src.glob("*.cpp"))))
    except RuntimeError as e:
        raise SystemExit(f"--against {rev}: {e}") from None
    return lib


def load(path: Path) -> ctypes.CDLL:
    """``path`` with the entry points it has declared as kvkernels.h declares them (an
    older revision lacks the build-id functions; the timed ones must not differ)."""
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in header_binding().functions.items():
        if hasattr(lib, name):
            getattr(lib, name).argtypes, getattr(lib, name).restype = argtypes, restype
    return lib


def products(shape: dict) -> list[tuple[int, int]]:
    """(N, K) of one decode step's products: per layer fused q/k/v, o, fused gate/up and
    down, then the LM head."""
    D, I = shape["hidden_size"], shape["intermediate_size"]
    hd = D // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * hd
    layer = [(qkv, D), (D, D), (2 * I, D), (D, I)]
    return layer * shape["num_hidden_layers"] + [(shape["vocab_size"], D)]


class Products:
    """One step's products in one format at ``rows`` input rows: random weights (int8:
    with per-row scales), inputs and outputs allocated once."""

    def __init__(self, fmt: str, rows: int, shapes: list[tuple[int, int]], threads: int) -> None:
        self.fmt, self.rows, self.threads = fmt, rows, threads
        self.entry, dtype = FORMATS[fmt]
        g = torch.Generator().manual_seed(0)
        self.shapes = shapes
        if dtype == torch.uint8:  # random float32 weights quantized to the format's blocks
            self.weights = [ops.quantize_blocks(torch.randn(s, generator=g) * 0.02, fmt) for s in shapes]
            self.scales = [None] * len(shapes)
        elif dtype == torch.int8:
            self.weights = [torch.randint(-127, 128, s, dtype=torch.int8, generator=g) for s in shapes]
            self.scales = [torch.rand(n, generator=g) / 127 for n, _ in shapes]
        else:
            self.weights = [torch.randn(s, generator=g).to(dtype) for s in shapes]
            self.scales = [None] * len(shapes)
        ks = sorted({k for _, k in shapes})
        self.x = {k: torch.randn(rows, k, generator=g) for k in ks}
        self.y = [torch.empty(rows, n) for n, _ in shapes]
        self.xq = torch.empty(rows * max(ks), dtype=torch.int8)  # w8a8's quantized input
        self.xs = torch.empty(rows * max(ks) // 32 * 8)  # and its block scales (room for AVX-512's repeats)
        self.bytes = sum(w.numel() * w.element_size() for w in self.weights)

    def step(self, lib: ctypes.CDLL) -> None:
        fn = getattr(lib, self.entry)
        for w, s, y, (n, k) in zip(self.weights, self.scales, self.y, self.shapes):
            if self.fmt in ops.BLOCK_CODES:
                fn(self.x[k].data_ptr(), self.rows, k, k, w.data_ptr(), n, ops.BLOCK_CODES[self.fmt], None, y.data_ptr(),
                   n, 0, self.threads)  # fmt: skip
                continue
            args = [self.x[k].data_ptr(), self.rows, k, k, w.data_ptr(), n, None if s is None else s.data_ptr(), None,
                    y.data_ptr(), n, 0, self.threads]  # fmt: skip
            if self.fmt == "w8a8":
                args += [self.xq.data_ptr(), self.xs.data_ptr()]
            fn(*args)

    def label(self) -> str:
        return f"{self.fmt} products, {self.rows} row{'s' if self.rows > 1 else ''}"


class Attention:
    """Decode attention of every layer for B sequences over ``ctx`` positions each, in a
    random float32 pool (each sequence its own blocks), as ``kv_decode_attention`` reads
    it in a step; ``group``: the B rows are one sequence's speculative verification (its
    pending token and B - 1 drafts at consecutive positions from ``ctx``, one block table:
    the kernel reads their common context once)."""

    def __init__(self, B: int, ctx: int, shape: dict, threads: int, group: bool = False) -> None:
        self.B, self.ctx, self.threads, self.group = B, ctx, threads, group
        self.L, self.nh, self.nkv = shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"]
        self.hd = shape["hidden_size"] // self.nh
        nb = (ctx + B + BLOCK_SIZE) // BLOCK_SIZE + 1  # blocks per sequence: the context and the new tokens
        g = torch.Generator().manual_seed(0)
        seqs = 1 if group else B
        self.pool = torch.randn(1 + seqs * nb, self.L, 2, BLOCK_SIZE, self.nkv, self.hd, generator=g)
        self.tables = torch.tensor([[1 + (0 if group else b) * nb + j for j in range(nb)] for b in range(B)])
        pos = torch.arange(ctx, ctx + B) if group else torch.full((B,), ctx, dtype=torch.long)
        self.lens = (pos + 1).contiguous()
        self.slot_blocks = self.tables.gather(1, (pos // BLOCK_SIZE)[:, None]).reshape(-1).contiguous()
        self.slot_offsets = (pos % BLOCK_SIZE).contiguous()
        self.qkv = torch.randn(B, (self.nh + 2 * self.nkv) * self.hd, generator=g)
        self.out = torch.empty(B, self.nh * self.hd)
        self.bytes = seqs * (ctx + 1) * self.L * 2 * self.nkv * self.hd * 4
        q, s = self.qkv, self.qkv.stride(0)
        k = q[:, self.nh * self.hd :]
        v = q[:, (self.nh + self.nkv) * self.hd :]
        self.args = [  # each layer's arguments, made once (a step times the calls, not the look-ups that make them)
            (q.data_ptr(), s, k.data_ptr(), v.data_ptr(), s, self.B, self.nh, self.nkv, self.hd, self.pool.data_ptr(),
             header_binding().constants["KV_F32"], layer, self.L, BLOCK_SIZE, self.slot_blocks.data_ptr(),
             self.slot_offsets.data_ptr(), self.tables.data_ptr(), self.tables.shape[1], self.lens.data_ptr(), 0,
             self.hd**-0.5, 0.0, self.out.data_ptr(), self.threads)
            for layer in range(self.L)
        ]  # fmt: skip

    def step(self, lib: ctypes.CDLL) -> None:
        fn = lib.kv_decode_attention
        for args in self.args:
            fn(*args)

    def label(self) -> str:
        if self.group:
            return f"attention, a verify group of {self.B} rows over {self.ctx} positions"
        return f"attention, {self.B} x {self.ctx} positions"


def libraries(isa: str, against: str | None, tmp: Path) -> tuple[list[ctypes.CDLL], list[str]]:
    """This checkout's library for ``isa`` and, with ``against``, the one built from that
    git revision (in ``tmp``), with their names."""
    this = kernels.library_path(isa)
    if not this.is_file():
        raise SystemExit(f"no {this.name}: build the kernels first (pip install -e . or python -m kvserve.service.kernels)")
    if against is None:
        return [load(this)], ["this checkout"]
    return [load(this), load(build_from_revision(against, isa, tmp))], ["this checkout", against]


def timed(work, libs: list[ctypes.CDLL], steps: int, flush: torch.Tensor | None) -> list[list[float]]:
    """Seconds per step for each build, the builds taking turns step by step (after two
    warm-up steps each). ``flush``: a buffer written before every step, so the step's data
    comes from memory as in a real step (where the weights evict the KV from the caches)."""
    for lib in libs:
        for _ in range(2):
            work.step(lib)
    times: list[list[float]] = [[] for _ in libs]
    for _ in range(steps):
        for i, lib in enumerate(libs):
            if flush is not None:
                flush.add_(1)
            t = time.perf_counter()
            work.step(lib)
            times[i].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="110m", choices=sorted(SHAPES))
    ap.add_argument("--formats", default="f32,bf16,int8,w8a8", help=f"comma list of {', '.join(FORMATS)}, or none")
    ap.add_argument("--rows", default="1,8", help="input rows per product (1..64)")
    ap.add_argument("--attention", default="", help="comma list of BxCTX (B sequences), or gRxCTX (one sequence's "
                    "verify group of R rows), e.g. 1x1024,8x1024,g4x320")
    ap.add_argument("--warm", action="store_true", help="attention: no cache flush before each step (a small "
                    "model's context stays in the caches between steps)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per build and workload")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--against", metavar="REV", help="also time the library built from git revision REV")
    args = ap.parse_args()
    isas = kernels.cpu_isas()
    if not isas:
        raise SystemExit("the native kernels need an x86-64 CPU with AVX2 and FMA")
    isa = isas[0]
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="kvserve-kernels-") as tmp:
        libs, names = libraries(isa, args.against, Path(tmp))
        work: list = []
        formats = [f for f in args.formats.split(",") if f and f != "none"]
        for f in formats:
            if f not in FORMATS:
                raise SystemExit(f"unknown format {f!r}; one of {', '.join(FORMATS)}")
            work += [Products(f, int(r), products(shape), args.threads) for r in args.rows.split(",")]
        for spec in filter(None, args.attention.split(",")):
            b, c = spec.lower().split("x")
            work.append(Attention(int(b.removeprefix("g")), int(c), shape, args.threads, group=b.startswith("g")))
        flush = torch.empty(64 << 20, dtype=torch.uint8)  # larger than the L3 caches of these hosts
        print(f"{args.shape}, {isa} build, {args.threads} threads, {args.steps} steps per build"
              f"{' in turn' if len(libs) > 1 else ''}", file=sys.stderr)  # fmt: skip
        head = "| workload | build | median (ms) | p25-p75 (ms) | GB/s at the median |" + (
            " vs " + names[1] + " |" if len(libs) > 1 else ""
        )
        print(head)
        print("|---|---|---:|---:|---:|" + ("---:|" if len(libs) > 1 else ""))
        for w in work:
            times = timed(w, libs, args.steps, flush if isinstance(w, Attention) and not args.warm else None)
            med = [statistics.median(t) for t in times]
            for i, (name, t) in enumerate(zip(names, times)):
                q = statistics.quantiles(t, n=4)
                ratio = f" {med[0] / med[1]:.2f}x |" if len(libs) > 1 and i == 0 else (" |" if len(libs) > 1 else "")
                print(f"| {w.label()} | {name} | {med[i] * 1e3:.2f} | {q[0] * 1e3:.2f}-{q[2] * 1e3:.2f} "
                      f"| {w.bytes / med[i] / 1e9:.1f} |{ratio}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
