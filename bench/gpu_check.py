"""The correctness part of bench/gpu_check.sh, and its restore figures, runnable on any device.

    python bench/gpu_check.py parity   --device cuda   # kvserve vs transformers, fp32 and bf16
    python bench/gpu_check.py sessions --device cuda   # 3-turn sessions restored = cold
    python bench/gpu_check.py restore  --device cuda   # restores against pinned H2D, cold, raw GET

parity: tiny random Llama (GQA: 4 heads, 2 KV heads) and GPT-2, each in float32 and
bfloat16 on ``--device``: kvserve's paged forward (a prefill of the prompt in two chunks,
then decode steps through the block pool) against transformers' forward of the same
weights on the same device. Reports the max |logit difference| over every position, the
tolerance, and whether the greedy tokens agree. Tolerances: float32 1e-3, bfloat16 0.15
(bf16 keeps 8 bits of mantissa; logits of these random models are O(1-10)).

sessions: a 3-turn greedy session (tiny Llama, float32 and bfloat16) run on one engine;
then turns 2 and 3 replayed on a new engine (a new device pool) whose blocks come from
the host tier, and on another whose blocks come from Redis (a private redis-server),
each compared token for token with a cold engine (no cache) on the same device. A
mismatch is counted; float32 must have none. bfloat16 is reported (a cold prefill and a
restore + partial prefill run different kernels, so bf16 greedy ties may break
differently).

restore: the restore path's figures at TinyLlama-1.1B's KV shape in bfloat16 (22 layers, 4
kv heads of 64, blocks of 16: 360 KB), each beside its limit measured in the same run:
pinned host -> device (one large copy) for the host tier's restore of an 8k history into
a CUDA pool (``BlockTransfers.restore``, spans of pinned slots, one scatter a round;
target >= 50%); the engine's 8k returning turn restored from the host tier against the
same turn cold (a random TinyLlama-shaped checkpoint, ``--models`` caches it; target <=
1/10); a Redis restore on 1 and 4 connections (``--redis-read-connections``) against
redis-py GETs on as many threads and against 3 GB/s (a private redis-server, with its
default single I/O thread and with ``io-threads 4``); and the int8 / fp8 Redis formats,
decoded on the device after the copy, against exact (target: faster). ``--restore-stages``
is CPU-only: the engine line says so. Each figure is a median of ``--reps``.

Every figure is printed as ``key: value`` lines; the exit status is 1 when a float32
check fails (restore: when a restore loads fewer blocks than asked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.service.engine.config import EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.engine.store import build_store  # noqa: E402
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.types import CacheScope, Finished, GenerationRequest, SamplingParams  # noqa: E402
from tests.fixtures.models import make_tiny_gpt2, make_tiny_llama  # noqa: E402

TOL = {torch.float32: 1e-3, torch.bfloat16: 0.15}
BS = 8


def _paged_logits(loaded, ids: list[int], n_decode: int) -> tuple[torch.Tensor, list[int]]:
    """All-position logits of ``ids`` (two prefill chunks), then ``n_decode`` greedy steps."""
    c = loaded.config
    total = len(ids) + n_decode
    nb = -(-total // BS)
    pool = KVPool(nb + 1, c.num_layers, BS, c.num_kv_heads, c.head_dim, loaded.dtype, loaded.device)
    table = list(range(1, nb + 1))
    half = len(ids) // 2
    parts = []
    for start, chunk in ((0, ids[:half]), (half, ids[half:])):
        layout = BatchLayout.build([SeqSlice(table, start, chunk)], BS, loaded.device, loaded.dtype)
        parts.append(loaded.model(layout, pool, all_logits=True)[0].float())
    logits = torch.cat(parts)  # (T, vocab)
    out, pos, last = [], len(ids), logits[-1]
    for _ in range(n_decode):
        tok = int(last.argmax())
        out.append(tok)
        layout = BatchLayout.build([SeqSlice(table, pos, [tok])], BS, loaded.device, loaded.dtype)
        last = loaded.model(layout, pool)[0].float()
        pos += 1
    return logits, out


@torch.inference_mode()
def parity(device: str, tmp: Path) -> bool:
    from transformers import AutoModelForCausalLM

    ok = True
    for family, make in (("llama-gqa", make_tiny_llama), ("gpt2", make_tiny_gpt2)):
        path = make(tmp / family)
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(path), dtype=dtype, device=device)
            ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, loaded.config.vocab_size, (40,), generator=g).tolist()
            got, greedy = _paged_logits(loaded, ids, 8)
            want = ref(torch.tensor([ids], device=device)).logits[0].float()
            diff = float((got - want).abs().max())
            ref_ids = list(ids)
            for _ in range(8):
                ref_ids.append(int(ref(torch.tensor([ref_ids], device=device)).logits[0, -1].argmax()))
            agree = greedy == ref_ids[len(ids) :]
            passed = diff <= TOL[dtype] and (agree or dtype != torch.float32)
            name = f"parity.{family}.{str(dtype).removeprefix('torch.')}"
            print(f"{name}.max_logit_diff: {diff:.3g} (tolerance {TOL[dtype]})")
            print(f"{name}.greedy_8_agree: {agree}")
            print(f"{name}: {'PASS' if passed else 'FAIL'}")
            ok &= passed or dtype != torch.float32
            del loaded, ref
    return ok


def _engine(loaded, store=None) -> LLMEngine:
    cfg = EngineConfig(block_size=BS, kv_cache_memory=256 * BS * _bpt(loaded), restore_policy="always")
    return LLMEngine(loaded, cfg, store=store)


def _bpt(loaded) -> int:
    c = loaded.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * loaded.dtype.itemsize


def _run(eng: LLMEngine, tokens: list[int], rid: str, n: int = 8) -> Finished:
    eng.add_request(GenerationRequest(rid, tokens, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    while True:
        for _, ev in eng.step():
            if isinstance(ev, Finished):
                return ev


def _spill(eng: LLMEngine, tokens: list[int], tier: str) -> None:
    eng.spill(tokens, CacheScope(), (tier,), lambda n, held: None)
    assert eng.store.flush(60)
    eng.step()


@torch.inference_mode()
def sessions(device: str, tmp: Path) -> bool:
    from tests.fixtures.redis_server import start_redis_server

    path = make_tiny_llama(tmp / "session-llama", max_position_embeddings=1024)
    server = start_redis_server(tmp / "redis")
    ok = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(path), dtype=dtype, device=device)
            g = torch.Generator().manual_seed(1)
            new = [torch.randint(3, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (97, 40, 33)]
            # the session, turn by turn, on one engine with both tiers
            host_cfg = EngineConfig(block_size=BS, host_cache_memory=512 * BS * _bpt(loaded))
            host_store = build_store(host_cfg, loaded)
            first = _engine(loaded, host_store)
            prompts, transcript = [], []
            for i, turn in enumerate(new):
                transcript = transcript + turn
                prompts.append(list(transcript))
                transcript += _run(first, transcript, f"t{i}").output_token_ids
            cold = _engine(loaded)
            want = [_run(cold, p, f"cold{i}").output_token_ids for i, p in enumerate(prompts)]
            cold.close()
            dname = str(dtype).removeprefix("torch.")
            mismatches = 0
            for tier in ("host", "redis"):
                for i in (1, 2):  # turns 2 and 3 restored into a new device pool
                    hist = prompts[i - 1] + want[i - 1]
                    if tier == "host":
                        _spill(first, hist, "host")
                        eng = _engine(loaded, host_store)
                    else:
                        import redis

                        redis.Redis.from_url(server.url).flushall()
                        rcfg = EngineConfig(block_size=BS, redis_url=server.url)
                        writer = _engine(loaded, build_store(rcfg, loaded))
                        _run(writer, hist, "w", n=1)
                        _spill(writer, hist, "redis")
                        writer.close()
                        eng = _engine(loaded, build_store(rcfg, loaded))
                    fin = _run(eng, prompts[i], f"{tier}{i}")
                    same = fin.output_token_ids == want[i]
                    mismatches += not same
                    print(f"sessions.{dname}.{tier}.turn{i + 1}: restored {fin.cached_tokens}/{len(prompts[i])} "
                          f"tokens, {'equal to cold' if same else 'DIFFERS from cold'}")
                    if tier == "redis":
                        eng.close()
            first.close()
            print(f"sessions.{dname}.mismatches: {mismatches}")
            if dtype == torch.float32:
                ok &= mismatches == 0
    finally:
        server.stop()
    return ok


# ---- restore figures ----------------------------------------------------------------

R_LAYERS, R_KV_HEADS, R_HEAD_DIM, R_BLOCK = 22, 4, 64, 16  # TinyLlama-1.1B's KV
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000)


def _timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median wall seconds of ``fn`` (the device synchronized before and after)."""
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _pinned_h2d_gbps(nbytes: int, device: str, reps: int) -> float:
    """One large copy from pinned host memory (the CPU: a memcpy), the limit of a host
    restore."""
    cuda = device.startswith("cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory() if cuda else torch.randint(
        0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=cuda), device, reps) / 1e9


def _raw_get_gbps(url: str, keys: list[str], threads: int, reps: int) -> float:
    """redis-py GETs, pipelined, on ``threads`` threads at once (no verification, no
    copy): the loopback limit as a client sees it."""
    import threading

    import redis

    clients = [redis.Redis.from_url(url) for _ in range(threads)]
    nbytes = sum(clients[0].strlen(k) for k in keys)

    def one(c: redis.Redis, part: list[str]) -> None:
        pipe = c.pipeline(transaction=False)
        for k in part:
            pipe.get(k)
        pipe.execute()

    def run() -> None:
        ts = [threading.Thread(target=one, args=(c, keys[i * len(keys) // threads : (i + 1) * len(keys) // threads]))
              for i, c in enumerate(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    run()
    return nbytes / _timed(run, "cpu", reps) / 1e9


@torch.inference_mode()
def restore(device: str, tmp: Path, tokens: int, reps: int, models: Path) -> bool:
    from kvserve.cachestore.host import HostTier
    from kvserve.cachestore.keys import block_hashes, make_namespace
    from kvserve.cachestore.redis import RedisTier
    from kvserve.cachestore.tiered import TieredStore
    from kvserve.service.kv.transfer import BlockTransfers
    from tests.fixtures.redis_server import start_redis_server

    dtype = torch.bfloat16
    cuda = device.startswith("cuda")
    n = tokens // R_BLOCK
    ns = make_namespace("gpu-check", "bfloat16", R_BLOCK)
    hashes = block_hashes(ns, list(range(n * R_BLOCK)), R_BLOCK)
    pool = KVPool(2 * n + 2, R_LAYERS, R_BLOCK, R_KV_HEADS, R_HEAD_DIM, dtype, device)
    ids = (torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n] + 1).tolist()  # scattered slots
    blocks = torch.randn(n, *pool.block_shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    nbytes = n * pool.bytes_per_block
    ok = True
    print(f"restore.shape: TinyLlama-1.1B KV, {tokens} tokens = {n} blocks of {pool.bytes_per_block} B "
          f"({nbytes / 1e6:.1f} MB), bfloat16, {device}")
    limit = _pinned_h2d_gbps(nbytes, device, reps)
    print(f"restore.limit.pinned_h2d_gbps: {limit:.2f}" + ("" if cuda else " (the CPU: memcpy)"))

    def check(got: int, what: str) -> None:
        nonlocal ok
        if got != n:
            print(f"restore.{what}: FAILED, {got} of {n} blocks loaded")
            ok = False

    def same() -> bool:
        return bool(torch.equal(pool.data[ids].cpu(), blocks))

    # the host tier: pinned slots, straight to the device by span, one scatter a round
    host = HostTier(nbytes, pool.block_shape, dtype, pin_memory=cuda)
    hstore = TieredStore([host], device=device.split(":")[0])
    for h, b in zip(hashes, blocks):
        hstore.put(ns, h, b, ("host",))
    tr = BlockTransfers.for_pool(pool, 256 << 20)
    run = lambda: check(tr.restore(hstore.reads(ns, hashes, ["host"] * n), ids, None)[0], "host")  # noqa: E731
    run()
    t = _timed(run, device, reps)
    print(f"restore.host.gbps: {nbytes / t / 1e9:.2f} ({nbytes / t / 1e9 / limit:.0%} of pinned H2D; target >= 50%), "
          f"{t * 1e3:.1f} ms, equal: {same()}")
    held = host.hold(hstore.reads(ns, hashes, ["host"] * n)[0].refs)
    slots = [b for span in held.spans(0, held.n) for b in span.unbind(0)]
    held.release()
    t = _timed(lambda: [pool.data[i].copy_(b, non_blocking=cuda) for i, b in zip(ids, slots)], device, reps)
    print(f"restore.host.per_block_copies_gbps: {nbytes / t / 1e9:.2f} ({nbytes / t / 1e9 / limit:.0%} of pinned "
          f"H2D: a copy per block out of the same slots, for comparison)")
    del slots, held
    hstore.close()

    # Redis: 1 and 4 connections, each format, into the device (lossy: decoded there)
    for io_threads in (1, 4):
        server = start_redis_server(tmp / f"redis-io{io_threads}", io_threads=io_threads)
        try:
            times: dict[str, float] = {}
            keys: list[str] = []
            for fmt, sdt in (("exact", None), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
                for k in ((1, 4) if fmt == "exact" else (4,)):
                    tier = RedisTier(server.url, block_shape=pool.block_shape, dtype=dtype, storage_dtype=sdt,
                                     read_connections=k, key_prefix=f"{fmt}:")
                    store = TieredStore([tier], device=device.split(":")[0])
                    if k == (1 if fmt == "exact" else 4):
                        assert store.put_many(ns, hashes, list(blocks), ("redis",)) == [True] * n
                    if fmt == "exact":
                        keys = [tier.key(r) for r in store.reads(ns, hashes, ["redis"] * n)[0].refs]
                    run = lambda: check(tr.restore(store.reads(ns, hashes, ["redis"] * n), ids, None)[0],  # noqa: E731
                                        f"redis.{fmt}")
                    run()
                    times[f"{fmt}{k}"] = t = _timed(run, device, reps)
                    wire = n * tier.value_nbytes
                    print(f"restore.redis.io{io_threads}.{fmt}.readers{k}: {t * 1e3:.1f} ms, {wire / t / 1e9:.2f} GB/s "
                          f"on the wire, {nbytes / t / 1e9:.2f} GB/s of KV ({nbytes / t / 1e9 / 3:.0%} of the 3 GB/s goal)"
                          + (f", equal: {same()}" if fmt == "exact" else ""))
                    store.close()
            for k in (1, 4):
                print(f"restore.redis.io{io_threads}.raw_get_threads{k}_gbps: {_raw_get_gbps(server.url, keys, k, reps):.2f}")
            print(f"restore.redis.io{io_threads}.readers4_vs_1: {times['exact1'] / times['exact4']:.2f}x")
            for fmt in ("int8", "fp8"):
                print(f"restore.redis.io{io_threads}.{fmt}_vs_exact: {times['exact4'] / times[f'{fmt}4']:.2f}x "
                      f"(> 1: faster than exact; target)")
        finally:
            server.stop()
    del pool

    # the engine: an 8k returning turn restored from the host tier against cold
    from bench.bench_restore import checkpoint

    path = checkpoint("tinyllama", tokens + 32, models) if cuda else make_tiny_llama(tmp / "tiny-restore",
                                                                                     max_position_embeddings=tokens + 32)
    loaded = load_model(str(path), dtype=dtype if cuda else torch.float32, device=device)
    g = torch.Generator().manual_seed(2)
    vocab = loaded.config.vocab_size
    hist = torch.randint(3, vocab, (tokens,), generator=g).tolist()
    turns = [hist + torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(reps + 1)]
    cfg = EngineConfig(block_size=R_BLOCK, kv_cache_memory=(tokens + 64) * 2 * _bpt(loaded),
                       max_num_batched_tokens=tokens + 64, max_model_len=tokens + 32, restore_policy="always",
                       host_cache_memory=(tokens + 64) * _bpt(loaded))
    hstore = build_store(cfg, loaded)
    a = LLMEngine(loaded, cfg, store=hstore)
    _run(a, torch.randint(3, vocab, (tokens + 16,), generator=g).tolist(), "shapes", n=1)  # this length's first
    cold = [_run(a, torch.randint(3, vocab, (tokens + 16,), generator=g).tolist(), f"cold{r}", n=1).timings.ttft_s
            for r in range(reps)]
    _run(a, turns[0], "history", n=1)
    _spill(a, hist, "host")
    a.close()
    host_ttft, restore_s, cached = [], [], []
    for r in range(reps):
        b = LLMEngine(loaded, cfg, store=build_store_over(hstore))
        fin = _run(b, turns[1 + r], f"host{r}", n=1)
        host_ttft.append(fin.timings.ttft_s)
        restore_s.append(fin.timings.restore_s)
        cached.append(fin.cached_tokens)
        b.close()
    c, h = statistics.median(cold), statistics.median(host_ttft)
    print(f"restore.engine.cold_ms: {c * 1e3:.1f} ({tokens + 16} tokens)")
    print(f"restore.engine.host_ms: {h * 1e3:.1f} (restored {min(cached)} tokens; restore "
          f"{statistics.median(restore_s) * 1e3:.1f} ms)")
    print(f"restore.engine.host_vs_cold: 1/{c / h:.1f} (target <= 1/10)")
    print("restore.engine.restore_stages: " + ("not built on CUDA (the overlap is the CPU pools'): off = on"
                                              if cuda else "see bench_restore.py's overlap table"))
    if min(cached) < (tokens // R_BLOCK) * R_BLOCK - R_BLOCK:
        print(f"restore.engine: FAILED, only {min(cached)} tokens restored")
        ok = False
    hstore.close()
    return ok


def build_store_over(store):
    """A new store over the same host tier (a new device pool, the host memory kept)."""
    from kvserve.cachestore.tiered import TieredStore

    return TieredStore([store.tier("host")], device=store.device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("parity", "sessions", "restore"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=8192, help="restore: the history restored")
    ap.add_argument("--reps", type=int, default=5, help="restore: repetitions (median)")
    ap.add_argument("--models", default=str(ROOT / "bench" / "out" / "models"),
                    help="restore: where the random TinyLlama-shaped checkpoint is built once (CUDA)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.what == "restore":
            ok = restore(args.device, Path(tmp), args.tokens, args.reps, Path(args.models))
        else:
            ok = (parity if args.what == "parity" else sessions)(args.device, Path(tmp))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
