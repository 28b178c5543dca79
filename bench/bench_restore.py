"""Time to first token of a returning session: cold prefill vs restore from each tier.

For each model shape and history length H, a session has H tokens of history and sends
a 16-token new turn. We time the new turn's first token (``Timings.ttft_s``: arrival to
first sampled token, queue + restore + prefill of the unmatched tokens) when:

* cold:   nothing cached; the whole H + 16 tokens are prefilled,
* device: the history's blocks are still in the device pool,
* host:   they were spilled to the host tier and the device pool is new,
* disk:   they were spilled to the disk tier (``--disk-cache-dir``) and the server
          restarted: a new pool and a new disk tier indexing the same directory, no
          Redis; the files are in the page cache (a process restart keeps it),
* disk-cold: the same with the files dropped from the page cache first
          (``posix_fadvise(DONTNEED)``): read from the device, as after a reboot,
* redis:  they were spilled to Redis and both the pool and the host tier are new
          (as on another replica or after a restart).

In the same run it measures the raw ceilings: memcpy GB/s into a preallocated buffer
and redis-py GET GB/s for values of one block, and reports each restore's throughput
as a fraction of them.

    python bench/bench_restore.py                 # ~110M and TinyLlama-1.1B shapes
    python bench/bench_restore.py --quick         # tiny shape, short histories
    python bench/bench_restore.py --shapes 110m --histories 256,1024,2048
    python bench/bench_restore.py --formats exact,bf16,int8,fp8   # lossy Redis formats
    python bench/bench_restore.py --disk-dir /mnt/nvme/kvbench    # the disk tier on that filesystem

``--formats`` adds a table per shape at the longest history: for each Redis storage format
(``--redis-kv-format``), bytes per block, the Redis restore time and TTFT and their speed-up
over exact, and the error against exact KV over ``--sessions`` random sessions
(``bench/lossy_kv.py``: max logit difference, greedy agreement).

Random weights, float32, CPU by default (``--device cuda --dtype bfloat16`` on a GPU: the
raw ceilings are then pinned host -> device copies and redis-py GET). Prints a table and
writes bench/out/restore_ttft.png.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.cachestore.keys import block_hashes  # noqa: E402
from kvserve.service.engine.config import EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.engine.store import build_store  # noqa: E402
from kvserve.service.types import CacheScope, Finished, GenerationRequest, SamplingParams  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402
from tests.fixtures.redis_server import start_redis_server  # noqa: E402

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "110m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip
NEW_TURN = 16
PATHS = ("cold", "device", "host", "disk", "disk_cold", "redis")
RESTORED = ("host", "disk", "disk_cold", "redis")  # the paths that restore from a tier
BLOCK = 16
RUN = {"device": "cpu", "dtype": "float32"}  # set by --device / --dtype


def checkpoint(shape: str, max_pos: int, cache: Path) -> Path:
    path = cache / f"{shape}-{max_pos}"
    if not (path / "config.json").exists():
        print(f"  building random {shape} checkpoint in {path} ...", flush=True)
        make_tiny_llama(path, max_position_embeddings=max_pos, **SHAPES[shape])
    return path


def engine(loaded, store=None) -> LLMEngine:
    cfg = EngineConfig(
        block_size=BLOCK,
        kv_cache_memory=256 << 20 if loaded.config.num_layers > 4 else 64 << 20,  # fits 2k tokens of tinyllama
        max_num_batched_tokens=4096,
        max_model_len=loaded.config.max_position_embeddings,
    )
    return LLMEngine(loaded, cfg, store=store)


def done(*engines: LLMEngine) -> None:
    """Close engines and free their pools now (a 1 GiB pool is zero-filled: resident
    until collected, and engines hold reference cycles)."""
    for e in engines:
        e.close()
    gc.collect()


def run_once(eng: LLMEngine, tokens: list[int], rid: str) -> Finished:
    eng.add_request(
        GenerationRequest(rid, tokens, SamplingParams(max_new_tokens=1, ignore_eos=True))
    )
    while True:
        for _, ev in eng.step():
            if isinstance(ev, Finished):
                return ev


def spill(eng: LLMEngine, tokens: list[int], tier: str) -> None:
    eng.spill(tokens, CacheScope(), (tier,), lambda n, held: None)
    assert eng.store.flush(120), "spill did not finish"
    eng.step()


def store(loaded, *, host: bool = False, redis_url: str | None = None, kv_format: str = "exact",
          disk: Path | None = None):
    cfg = EngineConfig(
        block_size=BLOCK,
        host_cache_memory=(2 << 30) if host else 0,
        disk_cache_dir=str(disk) if disk is not None else None,
        disk_cache_size=8 << 30,
        redis_url=redis_url,
        redis_kv_format=kv_format,
    )
    return build_store(cfg, loaded)


def raw_memcpy_gbps(nbytes: int, reps: int = 20) -> float:
    """memcpy into a preallocated buffer (CPU), or pinned host -> device (CUDA): the
    ceiling of a restore from the host tier."""
    cuda = RUN["device"].startswith("cuda")
    src = torch.randn(nbytes // 4, pin_memory=cuda)
    dst = torch.empty_like(src, device=RUN["device"])
    dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=cuda)
    if cuda:
        torch.cuda.synchronize()
    return nbytes * reps / (time.perf_counter() - t0) / 1e9


def drop_page_cache(root: Path) -> None:
    """Evict the block files under ``root`` from the page cache (this file only: no root
    needed, nothing else on the machine touched)."""
    for f in root.rglob("*.kvb"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_file_read_gbps(root: Path, value_bytes: int, n: int) -> float:
    """readinto a preallocated buffer from ``n`` files of one block (page cache warm):
    the ceiling of a restore from the disk tier."""
    root.mkdir(parents=True, exist_ok=True)
    paths = [root / f"raw{i}" for i in range(n)]
    for p in paths:
        p.write_bytes(os.urandom(value_bytes))
    buf = memoryview(bytearray(value_bytes))
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                f.readinto(buf)
        best = max(best, value_bytes * n / (time.perf_counter() - t0) / 1e9)
    for p in paths:
        p.unlink()
    return best


def raw_redis_get_gbps(url: str, value_bytes: int, n: int) -> float:
    import redis

    c = redis.Redis.from_url(url)
    payload = bytes(value_bytes)
    keys = [f"raw:{i}" for i in range(n)]
    with c.pipeline(transaction=False) as p:
        for k in keys:
            p.set(k, payload)
        p.execute()
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        with c.pipeline(transaction=False) as p:
            for k in keys:
                p.get(k)
            p.execute()
        best = max(best, value_bytes * n / (time.perf_counter() - t0) / 1e9)
    c.delete(*keys)
    c.close()
    return best


def measure(shape: str, histories: list[int], redis_url: str, cache: Path, reps: int, disk_root: Path) -> list[dict]:
    max_pos = max(histories) + NEW_TURN + 16
    loaded = load_model(str(checkpoint(shape, max_pos, cache)), dtype=RUN["dtype"], device=RUN["device"])
    g = torch.Generator().manual_seed(0)
    c = loaded.config
    block_bytes = BLOCK * c.num_layers * 2 * c.num_kv_heads * c.head_dim * loaded.dtype.itemsize
    rows = []
    for H in histories:
        history = torch.randint(3, loaded.config.vocab_size, (H,), generator=g).tolist()
        turn = history + torch.randint(3, loaded.config.vocab_size, (NEW_TURN,), generator=g).tolist()
        n_blocks = len(block_hashes(b"\0" * 32, history, BLOCK))
        res: dict[str, list[Finished]] = {k: [] for k in PATHS}
        for r in range(reps):
            e = engine(loaded)
            res["cold"].append(run_once(e, turn, f"cold{r}"))
            done(e)

            e = engine(loaded)
            run_once(e, history, "h")
            res["device"].append(run_once(e, turn, f"dev{r}"))
            done(e)

            shared = store(loaded, host=True)
            a = engine(loaded, shared)
            run_once(a, history, "h")
            spill(a, history, "host")
            b = engine(loaded, shared)  # a new device pool, the same host tier
            res["host"].append(run_once(b, turn, f"host{r}"))
            done(a, b)  # and the shared store

            for path in ("disk", "disk_cold"):
                shutil.rmtree(disk_root, ignore_errors=True)
                a = engine(loaded, store(loaded, disk=disk_root))
                run_once(a, history, "h")
                spill(a, history, "disk")
                done(a)  # the process ends: only the directory is left
                if path == "disk_cold":
                    drop_page_cache(disk_root)
                b = engine(loaded, store(loaded, disk=disk_root))  # restarted: the index rebuilt from the files
                res[path].append(run_once(b, turn, f"{path}{r}"))
                done(b)
            shutil.rmtree(disk_root, ignore_errors=True)

            import redis

            redis.Redis.from_url(redis_url).flushall()
            a = engine(loaded, store(loaded, redis_url=redis_url))
            run_once(a, history, "h")
            spill(a, history, "redis")
            done(a)
            b = engine(loaded, store(loaded, redis_url=redis_url))  # "another replica"
            res["redis"].append(run_once(b, turn, f"redis{r}"))
            done(b)
        row = dict(shape=shape, history=H, kv_mb=n_blocks * block_bytes / 1e6, block_bytes=block_bytes)
        for k, fins in res.items():
            row[f"{k}_ms"] = statistics.median(f.timings.ttft_s for f in fins) * 1000
            row[f"{k}_cached"] = fins[-1].cached_tokens
            if k in RESTORED:
                rs = statistics.median(f.timings.restore_s for f in fins)
                row[f"{k}_restore_ms"] = rs * 1000
                row[f"{k}_gbps"] = (fins[-1].cached_tokens // BLOCK) * block_bytes / rs / 1e9 if rs else 0.0
        rows.append(row)
        print(
            f"  {shape:9s} H={H:5d}  cold {row['cold_ms']:8.1f} ms  device {row['device_ms']:7.1f}  "
            f"host {row['host_ms']:7.1f}  disk {row['disk_ms']:7.1f}  disk-cold {row['disk_cold_ms']:7.1f}  "
            f"redis {row['redis_ms']:7.1f}  "
            f"(cached {row['redis_cached']}/{H + NEW_TURN})",
            flush=True,
        )
    return rows


def measure_formats(
    shape: str, history: int, formats: list[str], redis_url: str, cache: Path, reps: int, sessions: int
) -> list[dict]:
    """Redis restore of ``history`` tokens in each storage format, and its error."""
    import redis

    from bench.lossy_kv import measure_kv_error
    from kvserve.cachestore import codec

    loaded = load_model(
        str(checkpoint(shape, history + NEW_TURN + 16, cache)), dtype=RUN["dtype"], device=RUN["device"]
    )
    g = torch.Generator().manual_seed(1)
    hist = torch.randint(3, loaded.config.vocab_size, (history,), generator=g).tolist()
    turn = hist + torch.randint(3, loaded.config.vocab_size, (NEW_TURN,), generator=g).tolist()
    c = loaded.config
    block_shape = (c.num_layers, 2, BLOCK, c.num_kv_heads, c.head_dim)
    rows = []
    for fmt in formats:
        fins = []
        for r in range(reps):
            redis.Redis.from_url(redis_url).flushall()
            a = engine(loaded, store(loaded, redis_url=redis_url, kv_format=fmt))
            run_once(a, hist, "h")
            spill(a, hist, "redis")
            done(a)
            b = engine(loaded, store(loaded, redis_url=redis_url, kv_format=fmt))
            fins.append(run_once(b, turn, f"{fmt}{r}"))
            done(b)
        err = measure_kv_error(
            loaded, codec.STORAGE_FORMATS[fmt], sessions=sessions, history=256, new_turn=NEW_TURN, decode=16,
            block_size=BLOCK,
        )
        row = dict(
            shape=shape, history=history, format=fmt,
            value_bytes=codec.encoded_size(block_shape, loaded.dtype, codec.STORAGE_FORMATS[fmt]),
            restore_ms=statistics.median(f.timings.restore_s for f in fins) * 1000,
            ttft_ms=statistics.median(f.timings.ttft_s for f in fins) * 1000,
            cached=fins[-1].cached_tokens, **err,
        )  # fmt: skip
        rows.append(row)
        print(f"  {shape} H={history} {fmt:5s} restore {row['restore_ms']:.1f} ms, {err}", flush=True)
    return rows


def print_formats(rows: list[dict], sessions: int) -> None:
    print()
    print(f"Redis storage formats (error: {sessions} sessions, 256-token history, {NEW_TURN}-token turn, "
          f"16 greedy tokens, vs exact {RUN['dtype']} KV)")
    print()
    print("| shape | history | format | value bytes/block | redis restore ms | TTFT ms | restore speed-up "
          "| max logit diff | first token agrees | 16 greedy tokens agree | tokens before first difference |")
    print("|---" * 11 + "|")
    for r in rows:
        base = next(x for x in rows if x["shape"] == r["shape"] and x["format"] == "exact") if any(
            x["format"] == "exact" for x in rows) else r
        print(
            f"| {r['shape']} | {r['history']} | {r['format']} | {r['value_bytes']} | {r['restore_ms']:.1f} "
            f"| {r['ttft_ms']:.1f} | {base['restore_ms'] / r['restore_ms']:.2f}x | {r['max_logit_diff']:.4f} "
            f"| {100 * r['first_token_agreement']:.0f}% | {100 * r['greedy_agreement']:.0f}% "
            f"| {100 * r['token_agreement']:.0f}% |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="110m,tinyllama")
    ap.add_argument("--histories", default="256,1024,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shape, histories 64,256, 1 rep")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    ap.add_argument("--formats", default="", help="Redis storage formats to compare, e.g. exact,bf16,int8,fp8")
    ap.add_argument("--sessions", type=int, default=32, help="sessions for the formats' error figures")
    ap.add_argument("--formats-only", action="store_true", help="only the formats table")
    ap.add_argument("--disk-dir", default="", help="directory for the disk tier (default: a temporary one under --out)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    args = ap.parse_args()
    RUN.update(device=args.device, dtype=args.dtype)
    if args.quick:
        args.shapes, args.histories, args.reps = "tiny", "64,256", 1
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    histories = [int(h) for h in args.histories.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis_server(Path(tmp) / "redis")
        try:
            rows = []
            ceilings = {}
            format_rows = []
            for shape in args.shapes.split(","):
                if args.formats:
                    format_rows += measure_formats(
                        shape, max(histories), args.formats.split(","), server.url, out / "models", args.reps,
                        args.sessions,
                    )
                if args.formats_only:
                    continue
                disk_root = Path(args.disk_dir) if args.disk_dir else Path(tempfile.mkdtemp(prefix="disk-", dir=out))
                try:
                    rows += measure(shape, histories, server.url, out / "models", args.reps, disk_root / "tier")
                    bb = rows[-1]["block_bytes"]
                    ceilings[shape] = (
                        raw_memcpy_gbps(bb * 64), raw_file_read_gbps(disk_root / "raw", bb, 64),
                        raw_redis_get_gbps(server.url, bb, 64),
                    )  # fmt: skip
                finally:
                    if not args.disk_dir:
                        shutil.rmtree(disk_root, ignore_errors=True)
        finally:
            server.stop()
    if format_rows:
        print_formats(format_rows, args.sessions)
    if args.formats_only:
        return

    print()
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype} {where}, block {BLOCK} tokens, "
          f"new turn {NEW_TURN} tokens, median of {args.reps}")
    print()
    hdr = ("| shape | history | KV MB | cold ms | device ms | host ms | disk ms | disk-cold ms | redis ms "
           "| disk/host | cold/redis | host GB/s (% memcpy) | disk GB/s (% raw read) | redis GB/s (% raw GET) |")
    print(hdr)
    print("|---" * 14 + "|")
    for r in rows:
        memcpy, rawread, rawget = ceilings[r["shape"]]
        print(
            f"| {r['shape']} | {r['history']} | {r['kv_mb']:.1f} | {r['cold_ms']:.1f} | {r['device_ms']:.1f} "
            f"| {r['host_ms']:.1f} | {r['disk_ms']:.1f} | {r['disk_cold_ms']:.1f} | {r['redis_ms']:.1f} "
            f"| {r['disk_ms'] / r['host_ms']:.2f}x | {r['cold_ms'] / r['redis_ms']:.1f}x "
            f"| {r['host_gbps']:.2f} ({100 * r['host_gbps'] / memcpy:.0f}%) "
            f"| {r['disk_gbps']:.2f} ({100 * r['disk_gbps'] / rawread:.0f}%) "
            f"| {r['redis_gbps']:.2f} ({100 * r['redis_gbps'] / rawget:.0f}%) |"
        )
    print()
    for shape, (memcpy, rawread, rawget) in ceilings.items():
        what = "pinned H2D" if args.device.startswith("cuda") else "memcpy"
        print(f"raw ceilings at {shape} block size: {what} {memcpy:.2f} GB/s, file readinto (page cache) "
              f"{rawread:.2f} GB/s, redis-py GET {rawget:.2f} GB/s")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
        for ax, shape in zip(axes[0], shapes):
            rs = [r for r in rows if r["shape"] == shape]
            xs = [r["history"] for r in rs]
            for path in PATHS:
                ax.plot(xs, [r[f"{path}_ms"] for r in rs], marker="o", label=path)
            ax.set_yscale("log")
            ax.set_xlabel("history tokens (+16 new)")
            ax.set_ylabel("time to first token (ms)")
            ax.set_title(f"{shape}: returning session TTFT")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        png = out / "restore_ttft.png"
        fig.savefig(png, dpi=110)
        print(f"plot: {png}")
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
