"""Time to first token of a returning session after a warm-up (WarmSession), against a
device hit and an unwarmed restore from the host tier and from Redis.

For each model shape and history length H, one engine computes an H-token history and
spills its blocks to the host tier and to Redis. Then, per repetition, each path answers
the same 16-token new turn (``Timings.ttft_s``: arrival to first sampled token):

* device:      the engine that computed the history: its blocks are in the device pool,
* host:        another engine over the same host tier, with none of them in its device pool
               (``forget_device``): the turn restores them,
* host+warm:   the same, but ``LLMEngine.warm`` ran first (the client called WarmSession
               while the user typed): the turn finds them on the device,
* redis:       another engine whose store is the same Redis alone (another replica, a restart),
* redis+warm:  the same after a warm-up.

Each of those engines first answers one unrelated prompt of a turn's length (the one-off
costs of a first forward at that length, which the device path's engine paid computing
the history, are paid before the first figure). The paths alternate within
each repetition; medians are printed, with the warm-up's own time and the ratio of each
warmed TTFT to the device hit's (the goal: within 1.1x).

    python bench/bench_warm.py                       # ~110M, H = 512, 2048
    python bench/bench_warm.py --shapes tiny --histories 256 --reps 3   # a quick look
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server does, before torch loads: torch's idle threads sleep instead of spinning
import torch  # noqa: E402

from bench.bench_restore import BLOCK, NEW_TURN, SHAPES, checkpoint, store  # noqa: E402
from kvserve.service.engine.config import EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.types import CacheScope, Finished, GenerationRequest, SamplingParams, Started  # noqa: E402
from tests.fixtures.redis_server import start_redis_server  # noqa: E402

PATHS = ("device", "host", "host+warm", "redis", "redis+warm")


def engine(loaded, st=None) -> LLMEngine:
    cfg = EngineConfig(
        block_size=BLOCK,
        kv_cache_memory=256 << 20 if loaded.config.num_layers > 4 else 64 << 20,
        max_num_batched_tokens=4096,
        max_model_len=loaded.config.max_position_embeddings,
        restore_policy="always",  # the unwarmed turns restore (never recompute) what the tiers hold
        warm_pool_fraction=1.0,
        warm_tenant_fraction=1.0,
    )
    return LLMEngine(loaded, cfg, store=st)


def run_once(eng: LLMEngine, tokens: list[int], rid: str) -> tuple[Started, Finished]:
    eng.add_request(GenerationRequest(rid, tokens, SamplingParams(max_new_tokens=1, ignore_eos=True)))
    start = None
    while True:
        for _, ev in eng.step():
            if isinstance(ev, Started):
                start = ev
            if isinstance(ev, Finished):
                return start, ev


def warm(eng: LLMEngine, tokens: list[int]):
    """``LLMEngine.warm`` as AsyncEngine runs it: on this (the engine) thread, stepping
    the engine until the restore thread's loads landed. Returns (result, seconds)."""
    got = []
    t0 = time.perf_counter()
    eng.warm(tokens, CacheScope(), "", got.append)
    while not got:
        eng.step()
        if not got:
            eng.wait_for_work(0.001)
    return got[0], time.perf_counter() - t0


def done(*engines: LLMEngine) -> None:
    for e in engines:
        e.close()
    gc.collect()


def measure(shape: str, histories: list[int], redis_url: str, cache: Path, reps: int) -> list[dict]:
    import redis

    loaded = load_model(str(checkpoint(shape, max(histories) + NEW_TURN + 16, cache)), dtype="float32", device="cpu")
    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for H in histories:
        redis.Redis.from_url(redis_url).flushall()
        history = torch.randint(3, vocab, (H,), generator=g).tolist()
        turns = [history + torch.randint(3, vocab, (NEW_TURN,), generator=g).tolist() for _ in range(reps)]
        host_store = store(loaded, host=True, redis_url=redis_url)
        a = engine(loaded, host_store)
        run_once(a, history, "history")
        a.spill(history, CacheScope(), ("host", "redis"), lambda n, held: None)
        assert host_store.flush(120), "spill did not finish"
        a.step()
        # the engines the restores run on: one over the host tier, one over Redis alone (another
        # replica); each first answers an unrelated prompt as long as a turn, so that its one-off
        # costs (buffers grown to this length) are paid before the first figure, as the device
        # path's engine paid them computing the history
        h = engine(loaded, host_store)
        r = engine(loaded, store(loaded, redis_url=redis_url))
        for e in (h, r):
            run_once(e, torch.randint(3, vocab, (H + NEW_TURN,), generator=g).tolist(), "prime")
        ttft: dict[str, list[float]] = {p: [] for p in PATHS}
        warm_s: dict[str, list[float]] = {"host": [], "redis": []}
        for i in range(reps):
            turn = turns[i]
            _, fin = run_once(a, turn, f"device{i}")
            assert fin.cached_tokens == len(history)
            ttft["device"].append(fin.timings.ttft_s)
            for tier, e in (("host", h), ("redis", r)):
                for warmed in (False, True):
                    for t in turns:  # off this engine's device pool: only the store holds them
                        e.forget_device(t, CacheScope())
                    path = f"{tier}+warm" if warmed else tier
                    if warmed:
                        result, sec = warm(e, history)
                        assert result.restored == len(history) // BLOCK, result
                        warm_s[tier].append(sec)
                    start, fin = run_once(e, turn, f"{path}{i}")
                    ttft[path].append(fin.timings.ttft_s)
                    assert fin.cached_tokens == len(history), (path, start.cached_by_tier)
                    assert (start.cached_tier.value == "device") == warmed, (path, start.cached_by_tier)
        done(a, h, r)
        row = dict(shape=shape, history=H, **{f"{p}_ms": statistics.median(v) * 1000 for p, v in ttft.items()},
                   **{f"warm_{t}_ms": statistics.median(v) * 1000 for t, v in warm_s.items()})  # fmt: skip
        rows.append(row)
        print(f"  {shape:9s} H={H:5d}  " + "  ".join(f"{p} {row[p + '_ms']:7.1f}" for p in PATHS)
              + f"  (warm-up: host {row['warm_host_ms']:.1f} ms, redis {row['warm_redis_ms']:.1f} ms)", flush=True)
    return rows


def print_table(rows: list[dict]) -> None:
    print()
    print("| shape | history | device hit ms | host ms | host+warm ms | redis ms | redis+warm ms "
          "| host+warm / device | redis+warm / device | warm-up host ms | warm-up redis ms |")
    print("|---" * 11 + "|")
    for r in rows:
        d = r["device_ms"]
        print(f"| {r['shape']} | {r['history']} | {d:.1f} | {r['host_ms']:.1f} | {r['host+warm_ms']:.1f} "
              f"| {r['redis_ms']:.1f} | {r['redis+warm_ms']:.1f} | {r['host+warm_ms'] / d:.2f} "
              f"| {r['redis+warm_ms'] / d:.2f} | {r['warm_host_ms']:.1f} | {r['warm_redis_ms']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="110m")
    ap.add_argument("--histories", default="512,2048")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / "bench" / "out" / "models"), help="random checkpoints (built once)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    histories = [int(h) for h in args.histories.split(",")]
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_warm_") as tmp:
        server = start_redis_server(Path(tmp) / "redis")
        try:
            for shape in args.shapes.split(","):
                assert shape in SHAPES, f"unknown shape {shape}"
                rows += measure(shape, histories, server.url, cache, args.reps)
        finally:
            server.stop()
    print(f"\ntorch {torch.__version__}, {torch.get_num_threads()} threads, float32 CPU, block {BLOCK} tokens, "
          f"new turn {NEW_TURN} tokens, median of {args.reps}")
    print_table(rows)


if __name__ == "__main__":
    main()
