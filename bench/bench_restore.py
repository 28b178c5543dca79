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

Each restored path runs twice per repetition, alternating: with the restore overlapped
with the new tokens' prefill (``--restore-stages``, 4 here by ``--stages``: the blocks land in
groups of layers while the forward runs, each layer waiting for its own) and without
(0, the server's default: restore whole, then prefill); the first table and the plot give
the default's TTFT, the overlap table both and the overlapped one against max(restore,
prefill), the most an overlap can reach (restore: the non-overlapped run's
``restore_s``; prefill: the device path's TTFT), the llama.cpp table both. Every KV cache
format (``--kv-formats``: the pool's and every tier's, exact, bf16, fp16, and int8
where the engine has it) gets its own rows.

In the same run it measures the raw ceilings: memcpy GB/s into a preallocated buffer
and redis-py GET GB/s for values of one block, and reports each restore's throughput
as a fraction of them.

With ``--llama-bin DIR`` (llama.cpp's build/bin: llama-server; its converter is found
beside it or given by ``--llama-src``), llama.cpp serves the same random weights as GGUF
F32 and F16 (default f16 KV cache) in the same run, for the same history and new turn,
as token ids: its warm slot (the history still in the slot), its RAM prompt cache (the
slot taken by another prompt meanwhile, ``--cache-ram``) and a slot file
(``--slot-save-path``: the history's slot saved, the slot taken by another prompt,
then ``POST /slots/0?action=restore`` and the turn; the file in the page cache). TTFT
there is the client's wall time of a 1-token completion (plus the restore call).

    python bench/bench_restore.py                 # ~110M and TinyLlama-1.1B shapes
    python bench/bench_restore.py --quick         # tiny shape, short histories
    python bench/bench_restore.py --shapes 110m --histories 256,1024,2048
    python bench/bench_restore.py --formats exact,bf16,int8,fp8   # lossy Redis formats
    python bench/bench_restore.py --disk-dir /mnt/nvme/kvbench    # the disk tier on that filesystem
    python bench/bench_restore.py --shapes 110m --histories 2048 --kv-formats exact,bf16 --llama-bin ~/llama.cpp/build/bin

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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.service import kernels  # noqa: E402  torch-free

ENV_AT_START = dict(os.environ)  # llama.cpp runs with this: its own OpenMP threads keep libgomp's default wait
kernels.passive_openmp()  # as the server does, before torch loads: torch's idle threads sleep instead of spinning
import torch  # noqa: E402

from kvserve.cachestore.keys import block_hashes  # noqa: E402
from kvserve.cachestore.tiered import TieredStore  # noqa: E402
from kvserve.service.engine.config import EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.engine.store import build_store  # noqa: E402
from kvserve.service.kv.cache import KV_CACHE_FORMATS  # noqa: E402
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
STAGES = {"off": 0, "on": 4}  # --restore-stages without and with the overlap (on: set by --stages)
BLOCK = 16
RUN = {"device": "cpu", "dtype": "float32", "weight_format": "exact"}  # set by --device / --dtype / --weight-format


def checkpoint(shape: str, max_pos: int, cache: Path) -> Path:
    path = cache / f"{shape}-{max_pos}"
    if not (path / "config.json").exists():
        print(f"  building random {shape} checkpoint in {path} ...", flush=True)
        make_tiny_llama(path, max_position_embeddings=max_pos, **SHAPES[shape])
    return path


def engine(loaded, store=None, kv_format: str = "exact", stages: int = 0) -> LLMEngine:
    cfg = EngineConfig(
        block_size=BLOCK,
        kv_cache_memory=256 << 20 if loaded.config.num_layers > 4 else 64 << 20,  # fits 2k tokens of tinyllama
        max_num_batched_tokens=4096,
        max_model_len=loaded.config.max_position_embeddings,
        kv_cache_format=kv_format,
        restore_stages=stages,
        restore_policy="always",  # every path restores whatever the measured rates say
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


def spill(eng: LLMEngine, tokens: list[int], tier: str | tuple[str, ...]) -> None:
    eng.spill(tokens, CacheScope(), (tier,) if isinstance(tier, str) else tier, lambda n, held: None)
    assert eng.store.flush(120), "spill did not finish"
    eng.step()


def store(loaded, *, host: bool = False, redis_url: str | None = None, kv_format: str = "exact",
          disk: Path | None = None, cache_format: str = "exact"):
    """``kv_format``: the Redis storage format (--redis-kv-format); ``cache_format``:
    the pool's and every tier's (--kv-cache-format)."""
    cfg = EngineConfig(
        block_size=BLOCK,
        host_cache_memory=(2 << 30) if host else 0,
        disk_cache_dir=str(disk) if disk is not None else None,
        disk_cache_size=8 << 30,
        redis_url=redis_url,
        redis_kv_format=kv_format,
        kv_cache_format=cache_format,
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


def measure(shape: str, histories: list[int], redis_url: str, cache: Path, reps: int, disk_root: Path,
            kv_formats: list[str], paths: tuple[str, ...] = RESTORED) -> list[dict]:
    """Rows per (history, KV cache format): cold and device TTFT, and for each restored
    path its TTFT without and with the overlap (alternating within each repetition)."""
    import redis

    max_pos = max(histories) + NEW_TURN + 16
    loaded = load_model(str(checkpoint(shape, max_pos, cache)), dtype=RUN["dtype"], device=RUN["device"],
                        weight_format=RUN["weight_format"])
    g = torch.Generator().manual_seed(0)
    rows = []
    for H in histories:
        history = torch.randint(3, loaded.config.vocab_size, (H,), generator=g).tolist()
        turns = [history + torch.randint(3, loaded.config.vocab_size, (NEW_TURN,), generator=g).tolist()
                 for _ in range(reps + 1)]
        n_blocks = len(block_hashes(b"\0" * 32, history, BLOCK))
        for fmt in kv_formats:
            redis.Redis.from_url(redis_url).flushall()
            shutil.rmtree(disk_root, ignore_errors=True)
            # one engine computes the history (cold: the whole turn), serves the device path,
            # and spills the history to every tier
            writer = store(loaded, host=True, redis_url=redis_url, disk=disk_root, cache_format=fmt)
            host_tier = writer.tier("host")
            a = engine(loaded, writer, fmt)
            cold = run_once(a, turns[0], "cold")
            device = [run_once(a, turns[1 + r], f"dev{r}") for r in range(reps)]
            spill(a, history, ("host", "disk", "redis"))
            block_bytes = a.pool.bytes_per_block
            done(a)  # closes the store: the disk tier's lock, Redis' connections; host memory stays
            res: dict[tuple[str, str], list[Finished]] = {(p, o): [] for p in paths for o in STAGES}
            for r in range(reps):
                for path in paths:
                    for o in (list(STAGES) if r % 2 == 0 else list(STAGES)[::-1]):  # A/B alternating
                        if path == "host":
                            st = TieredStore([host_tier])  # a new device pool, the same host memory
                        elif path.startswith("disk"):
                            if path == "disk_cold":
                                drop_page_cache(disk_root)
                            st = store(loaded, disk=disk_root, cache_format=fmt)  # restarted: index from the files
                        else:
                            st = store(loaded, redis_url=redis_url, cache_format=fmt)  # "another replica"
                        b = engine(loaded, st, fmt, STAGES[o])
                        res[(path, o)].append(run_once(b, turns[1 + r], f"{path}{o}{r}"))
                        done(b)  # (closing the host tier keeps its memory: the next engine reads it)
            row = dict(shape=shape, history=H, format=fmt, kv_mb=n_blocks * block_bytes / 1e6, block_bytes=block_bytes,
                       cold_ms=cold.timings.ttft_s * 1000, cold_cached=cold.cached_tokens,
                       device_ms=statistics.median(f.timings.ttft_s for f in device) * 1000)
            for (path, o), fins in res.items():
                row[f"{path}_{o}_ms"] = statistics.median(f.timings.ttft_s for f in fins) * 1000
                row[f"{path}_{o}_cached"] = min(f.cached_tokens for f in fins)
                if o == "off":
                    rs = statistics.median(f.timings.restore_s for f in fins)
                    row[f"{path}_restore_ms"] = rs * 1000
                    row[f"{path}_gbps"] = (row[f"{path}_off_cached"] // BLOCK) * block_bytes / rs / 1e9 if rs else 0.0
            rows.append(row)
            print(
                f"  {shape:9s} H={H:5d} {fmt:5s} cold {row['cold_ms']:8.1f} ms  device {row['device_ms']:7.1f}  "
                + "  ".join(f"{p} {row[p + '_off_ms']:.1f}/{row[p + '_on_ms']:.1f}" for p in paths)
                + f"  (off/on; cached {row[paths[-1] + '_on_cached']}/{H + NEW_TURN})",
                flush=True,
            )
    return rows


def print_overlap(rows: list[dict], stages: int) -> None:
    print()
    print(f"Restore overlapped with prefill: TTFT ms without (--restore-stages 0) and with (--restore-stages {stages}); "
          "bound = max(restore, device-path TTFT), the most an overlap reaches; sum = restore + device-path TTFT")
    print()
    print("| shape | history | KV format | tier | restore ms | device ms | TTFT off | TTFT on | on/off "
          "| on / bound | on / sum |")
    print("|---" * 11 + "|")
    for r in rows:
        for p in RESTORED:
            if f"{p}_on_ms" not in r:
                continue
            rs, dev = r[f"{p}_restore_ms"], r["device_ms"]
            off, on = r[f"{p}_off_ms"], r[f"{p}_on_ms"]
            print(f"| {r['shape']} | {r['history']} | {r['format']} | {p.replace('_', '-')} | {rs:.1f} | {dev:.1f} "
                  f"| {off:.1f} | {on:.1f} | {on / off:.2f}x | {on / max(rs, dev):.2f}x | {on / (rs + dev):.2f}x |")


def measure_formats(
    shape: str, history: int, formats: list[str], redis_url: str, cache: Path, reps: int, sessions: int
) -> list[dict]:
    """Redis restore of ``history`` tokens in each storage format, and its error."""
    import redis

    from bench.lossy_kv import measure_kv_error
    from kvserve.cachestore import codec

    loaded = load_model(
        str(checkpoint(shape, history + NEW_TURN + 16, cache)), dtype=RUN["dtype"], device=RUN["device"],
        weight_format=RUN["weight_format"]
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


# ---- llama.cpp in the same run (--llama-bin) --------------------------------------------

LLAMA_TYPES = ("f32", "f16")  # GGUF weights; the KV cache is llama.cpp's default f16 either way


def _http(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[dict, float]:
    """POST ``body`` (GET when None) as JSON; (the JSON reply, wall seconds)."""
    import json
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        reply = r.read()
    return json.loads(reply or b"{}"), time.perf_counter() - t0


class LlamaServer:
    """llama-server on a free loopback port, one slot, ``threads`` threads."""

    def __init__(self, binary: Path, gguf: Path, ctx: int, threads: int, slot_dir: Path, cache_ram_mib: int) -> None:
        import subprocess

        from tests.fixtures.redis_server import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(slot_dir / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(ctx), "-np", "1", "--host", "127.0.0.1",
             "--port", str(self.port), "--slot-save-path", str(slot_dir), "--cache-ram", str(cache_ram_mib),
             "--no-webui"],
            stdout=self.log, stderr=subprocess.STDOUT, env=ENV_AT_START,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"[llama.cpp] llama-server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if _http(self.url + "/health", timeout=5)[0].get("status") == "ok":
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("[llama.cpp] llama-server did not come up")
            time.sleep(0.5)

    def complete(self, tokens: list[int]) -> tuple[dict, float]:
        return _http(self.url + "/completion", {"prompt": tokens, "n_predict": 1, "cache_prompt": True,
                                                "temperature": 0.0, "ignore_eos": True})

    def slot(self, action: str, filename: str) -> tuple[dict, float]:
        return _http(f"{self.url}/slots/0?action={action}", {"filename": filename})

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self.log.close()


def measure_llama(shape: str, history: int, cache: Path, bin_dir: Path, src_dir: Path | None, threads: int,
                  reps: int, workdir: Path, types: tuple[str, ...] = LLAMA_TYPES) -> list[dict]:
    """llama.cpp's returning-turn TTFT for the same random weights (GGUF F32 / F16, f16
    KV), history and new-turn length: warm slot, RAM prompt cache, slot-file restore."""
    import subprocess

    binary = bin_dir / "llama-server"
    if src_dir is None:
        src_dir = next((p.parent for d in (bin_dir, *bin_dir.parents)
                        for p in [d / "convert_hf_to_gguf.py"] if p.exists()), None)  # fmt: skip
    if src_dir is None or not binary.exists():
        raise SystemExit(f"[llama.cpp] need {binary} and convert_hf_to_gguf.py (--llama-src)")
    env = dict(os.environ)
    if (src_dir / "gguf-py").is_dir():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src_dir / "gguf-py"), env.get("PYTHONPATH")) if p)
    path = checkpoint(shape, history + NEW_TURN + 16, cache)
    vocab = int(__import__("json").loads((path / "config.json").read_text())["vocab_size"])
    g = torch.Generator().manual_seed(7)
    hist = torch.randint(3, vocab, (history,), generator=g).tolist()
    turns = [hist + torch.randint(3, vocab, (NEW_TURN,), generator=g).tolist() for _ in range(reps)]
    other = torch.randint(3, vocab, (64,), generator=g).tolist()  # another prompt, to take the slot
    # the RAM cache's own new turns: a turn the warm slot ran is in the RAM cache whole after it
    ram_turns = [hist + torch.randint(3, vocab, (NEW_TURN,), generator=g).tolist() for _ in range(reps)]
    rows = []
    for qtype in types:
        gguf = workdir / f"{shape}-{qtype}.gguf"
        conv = subprocess.run([sys.executable, str(src_dir / "convert_hf_to_gguf.py"), str(path), "--outfile",
                               str(gguf), "--outtype", qtype], env=env, capture_output=True, text=True)
        if conv.returncode != 0:
            raise SystemExit(f"[llama.cpp] convert_hf_to_gguf.py failed on {shape} {qtype}:\n{conv.stderr[-3000:]}")
        ctx = history + NEW_TURN + 64
        warm, ram, ram_cached, slot_restore, slot_total, slot_cached = [], [], [], [], [], []
        # the warm slot and the RAM prompt cache (the default --cache-ram)
        srv = LlamaServer(binary, gguf, ctx, threads, workdir, 8192)
        try:
            cold, cold_s = srv.complete(turns[0])
            for t, rt in zip(turns, ram_turns):
                srv.complete(hist)
                warm.append(srv.complete(t)[1])
                srv.complete(hist)
                srv.complete(other)  # the slot is taken: the history goes to the RAM cache
                reply, s = srv.complete(rt)  # a turn never sent: its history from the RAM cache
                ram.append(s)
                ram_cached.append(int(reply.get("timings", {}).get("cache_n", -1)))
        finally:
            srv.stop()
        # the slot file, with no RAM cache to serve the prompt instead
        srv = LlamaServer(binary, gguf, ctx, threads, workdir, 0)
        try:
            srv.complete(hist)
            saved, _ = srv.slot("save", "history.bin")
            file_mb = (workdir / "history.bin").stat().st_size / 1e6
            for t in turns:
                srv.complete(other)  # the slot holds another prompt
                restored, rs = srv.slot("restore", "history.bin")
                reply, s = srv.complete(t)
                slot_restore.append(rs)
                slot_total.append(rs + s)
                slot_cached.append(int(reply.get("timings", {}).get("cache_n", -1)))
        finally:
            srv.stop()
            (workdir / "history.bin").unlink(missing_ok=True)
        gguf.unlink()
        row = dict(shape=shape, history=history, type=qtype.upper(), cold_ms=cold_s * 1000,
                   warm_ms=statistics.median(warm) * 1000, ram_ms=statistics.median(ram) * 1000,
                   ram_cached=min(ram_cached), slot_restore_ms=statistics.median(slot_restore) * 1000,
                   slot_ms=statistics.median(slot_total) * 1000, slot_cached=min(slot_cached), slot_file_mb=file_mb)
        rows.append(row)
        print(f"  [llama.cpp] {shape} H={history} {row['type']}: cold {row['cold_ms']:.1f} ms, warm slot "
              f"{row['warm_ms']:.1f}, RAM cache {row['ram_ms']:.1f} (cached {row['ram_cached']}), slot file "
              f"{row['slot_ms']:.1f} (restore {row['slot_restore_ms']:.1f}, cached {row['slot_cached']}, "
              f"{file_mb:.1f} MB)", flush=True)
    return rows


def print_llama(llama_rows: list[dict], rows: list[dict]) -> None:
    print()
    print("llama.cpp (llama-server, default f16 KV, 1-token completions timed by the client, same history and "
          "new turn as token ids) against kvserve (engine TTFT: restore whole, the default / restore overlapped, "
          "--restore-stages; the ratio: the default's)")
    print()
    print("| shape | history | llama.cpp weights | cold ms | warm slot ms | RAM prompt cache ms | slot file ms "
          "(restore call) | slot file MB | kvserve format | kvserve device ms | kvserve host ms | kvserve disk ms "
          "| kvserve redis ms | redis / slot file |")
    print("|---" * 15 + "|")
    for lr in llama_rows:
        for r in rows:
            if r["shape"] != lr["shape"] or r["history"] != lr["history"]:
                continue
            print(f"| {lr['shape']} | {lr['history']} | {lr['type']} | {lr['cold_ms']:.1f} | {lr['warm_ms']:.1f} "
                  f"| {lr['ram_ms']:.1f} | {lr['slot_ms']:.1f} ({lr['slot_restore_ms']:.1f}) | {lr['slot_file_mb']:.1f} "
                  f"| {r['format']} | {r['device_ms']:.1f} | {_both(r, 'host')} | {_both(r, 'disk')} "
                  f"| {_both(r, 'redis')} | {r['redis_off_ms'] / lr['slot_ms'] if 'redis_off_ms' in r else 0:.2f}x |")


def _both(row: dict, tier: str) -> str:
    """A tier's TTFT with the restore whole (the default) / overlapped."""
    return f"{_ms(row, tier + '_off_ms')} / {_ms(row, tier + '_on_ms')}"


def _ms(row: dict, key: str) -> str:
    return f"{row[key]:.1f}" if key in row else "-"


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
    ap.add_argument("--kv-formats", default=",".join(KV_CACHE_FORMATS),
                    help=f"KV cache formats (--kv-cache-format) to run every path in; default all: {','.join(KV_CACHE_FORMATS)}")
    ap.add_argument("--stages", type=int, default=4, help="--restore-stages of the overlapped runs")
    ap.add_argument("--paths", default=",".join(RESTORED), help=f"restored paths to run (default all: {','.join(RESTORED)})")
    ap.add_argument("--llama-types", default=",".join(LLAMA_TYPES), help="GGUF weight types for llama.cpp (f32, f16)")
    ap.add_argument("--llama-bin", default="", help="llama.cpp's bin directory (llama-server): its figures in the same run")
    ap.add_argument("--llama-src", default="", help="llama.cpp's source tree (convert_hf_to_gguf.py); default: found above --llama-bin")
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    ap.add_argument("--weight-format", default="exact",
                    help="kvserve's served weight format (--weight-format): exact | bf16 | int8 | w8a8; "
                         "compare bf16 with --llama-types f16, exact with f32")
    args = ap.parse_args()
    RUN.update(device=args.device, dtype=args.dtype, weight_format=args.weight_format)
    STAGES["on"] = args.stages
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
            llama_rows: list[dict] = []
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
                    rows += measure(shape, histories, server.url, out / "models", args.reps, disk_root / "tier",
                                    args.kv_formats.split(","), tuple(args.paths.split(",")))
                    bb = rows[-1]["block_bytes"]
                    ceilings[shape] = (
                        raw_memcpy_gbps(bb * 64), raw_file_read_gbps(disk_root / "raw", bb, 64),
                        raw_redis_get_gbps(server.url, bb, 64),
                    )  # fmt: skip
                finally:
                    if not args.disk_dir:
                        shutil.rmtree(disk_root, ignore_errors=True)
                if args.llama_bin:
                    work = Path(tempfile.mkdtemp(prefix="llama-", dir=out))
                    try:
                        llama_rows += measure_llama(
                            shape, max(histories), out / "models", Path(args.llama_bin).expanduser(),
                            Path(args.llama_src).expanduser() if args.llama_src else None,
                            args.threads or torch.get_num_threads(), args.reps, work, tuple(args.llama_types.split(",")),
                        )
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
        finally:
            server.stop()
    if format_rows:
        print_formats(format_rows, args.sessions)
    if args.formats_only:
        return

    print()
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype} {where}, weights {args.weight_format}, block {BLOCK} tokens, "
          f"new turn {NEW_TURN} tokens, median of {args.reps}")
    print()
    hdr = ("| shape | history | KV format | KV MB | cold ms | device ms | host ms | disk ms | disk-cold ms | redis ms "
           "| disk/host | cold/redis | host GB/s (% memcpy) | disk GB/s (% raw read) | redis GB/s (% raw GET) |")
    print("TTFT as the server restores by default (the blocks whole, then the forward; with the overlap, "
          f"--restore-stages {args.stages}, in the table after); throughput: restored bytes over restore_s")
    print()
    print(hdr)
    print("|---" * 15 + "|")
    def ms(r: dict, key: str) -> str:  # "-" for a path not run (--paths)
        return f"{r[key]:.1f}" if key in r else "-"

    def ratio(r: dict, a: str, b: str, fmt: str) -> str:
        return f"{r[a] / r[b]:{fmt}}x" if a in r and b in r and r[b] else "-"

    def rate(r: dict, path: str, ceiling: float) -> str:
        key = f"{path}_gbps"
        return f"{r[key]:.2f} ({100 * r[key] / ceiling:.0f}%)" if key in r and ceiling else "-"

    for r in rows:
        memcpy, rawread, rawget = ceilings[r["shape"]]
        print(
            f"| {r['shape']} | {r['history']} | {r['format']} | {r['kv_mb']:.1f} | {r['cold_ms']:.1f} | {r['device_ms']:.1f} "
            f"| {ms(r, 'host_off_ms')} | {ms(r, 'disk_off_ms')} | {ms(r, 'disk_cold_off_ms')} | {ms(r, 'redis_off_ms')} "
            f"| {ratio(r, 'disk_off_ms', 'host_off_ms', '.2f')} | {ratio(r, 'cold_ms', 'redis_off_ms', '.1f')} "
            f"| {rate(r, 'host', memcpy)} | {rate(r, 'disk', rawread)} | {rate(r, 'redis', rawget)} |"
        )
    print_overlap(rows, args.stages)
    if llama_rows:
        print_llama(llama_rows, rows)
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
            rs = [r for r in rows if r["shape"] == shape and r["format"] == rows[0]["format"]]
            xs = [r["history"] for r in rs]
            for path in PATHS:
                key = f"{path}_ms" if path in ("cold", "device") else f"{path}_off_ms"
                if key not in rs[0]:  # not run (--paths)
                    continue
                ax.plot(xs, [r[key] for r in rs], marker="o", label=path)
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
