"""Streaming through gRPC vs the engine in-process, under the same concurrent load.

For each model shape and each concurrency N (1, 4, 8, 16), N streams start together,
each with its own random prompt of ``--prompt-len`` token ids, and generate
``--tokens`` tokens (greedy, ignore_eos). Three paths, same engine settings:

- in-process: ``build_engine`` in this process, N asyncio tasks iterating
  ``engine.generate``;
- gRPC: ``python -m kvserve.service`` in a subprocess, N streams of ``AsyncKVServeClient``
  over loopback (client and server in different processes, as deployed);
- HTTP: the same server's OpenAI-compatible port (``--http-port``), N streaming
  ``/v1/completions`` calls of the official ``openai.AsyncOpenAI`` client (token-id
  prompts, ``stream_options.include_usage``). Its ITL is per SSE chunk (a chunk is one
  engine delta with text; deltas that end mid-character are merged into the next).

The in-process engine is built from the same settings as the server
(``ServerConfig.from_args`` of the server's flags, so the host tier and every default
match). Both paths stream through ``AsyncEngine.generate``, so both hold a stream's
tokens for its stream interval (20 ms) and deliver the tokens generated meanwhile in one
event (one gRPC message, one SSE chunk).

Figures per run: aggregate tokens/s (all generated tokens / wall time from the first
request sent to the last stream ended) and p50/p99 inter-token latency (the gaps
between token arrivals at the consumer, pooled over streams; a message of k tokens
counts k gaps of 1/k of its gap). Each row is the run of median tokens/s of ``--reps``
runs (``--pick best``: the fastest); the paths alternate run by run. Issue 3 goals:
gRPC adds <= 10% to in-process time at 8 streams; 8 streams give >= 4x the
single-stream aggregate tokens/s.

    python bench/bench_service.py --quick      # tiny shape, short streams (about a minute)
    python bench/bench_service.py              # tiny and ~110M shapes
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # the in-process engine as the server runs it: before torch loads
from kvserve.clients import AsyncKVServeClient, TextDelta  # noqa: E402
from kvserve.service.types import Delta, GenerationRequest, SamplingParams  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

# LlamaConfig overrides. The served models keep the test tokenizer's 400-token vocabulary
# (a random model must only emit ids its tokenizer can decode), so the ~110M shape's
# transformer stack is the real one and its embedding/LM head are small.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "110m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, max_position_embeddings=2048),
}  # fmt: skip
BLOCK_SIZE = 16
KV_CACHE = "512MiB"


@dataclass
class Run:
    tokens: int
    wall_s: float
    gaps_s: list[float]
    messages: int = 0  # events with tokens the consumer got

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def itl_ms(self, q: float) -> float:
        gaps = sorted(self.gaps_s)
        return 1000 * gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")


def prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def _consume(events, n_tokens_of, sent: float, gaps: list[float], messages: list[int]) -> int:
    last = sent
    got = 0
    first = True
    async for ev in events:
        n = n_tokens_of(ev)
        if not n:
            continue
        now = time.perf_counter()
        if not first:
            gaps.extend([(now - last) / n] * n)
        first = False
        last = now
        got += n
        messages.append(n)
    return got


async def run_inprocess(engine, batch: list[list[int]], max_new: int, tag: str) -> Run:
    gaps: list[float] = []
    msgs: list[int] = []
    t0 = time.perf_counter()

    async def one(i: int, prompt: list[int]) -> int:
        req = GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
        n_of = lambda e: len(e.token_ids) if isinstance(e, Delta) else 0  # noqa: E731
        return await _consume(engine.generate(req), n_of, t0, gaps, msgs)

    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
    return Run(sum(counts), time.perf_counter() - t0, gaps, len(msgs))


async def run_grpc(client: AsyncKVServeClient, batch: list[list[int]], max_new: int) -> Run:
    gaps: list[float] = []
    msgs: list[int] = []
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> int:
        stream = client.generate(token_ids=prompt, max_new_tokens=max_new, ignore_eos=True)
        return await _consume(stream, lambda e: len(e.token_ids) if isinstance(e, TextDelta) else 0, t0, gaps, msgs)

    counts = await asyncio.gather(*(one(p) for p in batch))
    return Run(sum(counts), time.perf_counter() - t0, gaps, len(msgs))


def engine_flags(model_dir: Path, max_seqs: int) -> list[str]:
    return ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", KV_CACHE,
            "--block-size", str(BLOCK_SIZE), "--max-num-seqs", str(max_seqs)]  # fmt: skip


def start_server(model_dir: Path, max_seqs: int) -> tuple[subprocess.Popen, int, int]:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service", *engine_flags(model_dir, max_seqs), "--host", "127.0.0.1", "--port", "0",
         "--log-level", "info", "--drain-timeout", "5", "--http-port", str(_free_port())],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    port: list[int] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"serving kvserve\.v1\.GenerationService on \S+:(\d+).*HTTP on :(\d+)", line)
            if m and not port:
                port.extend((int(m.group(1)), int(m.group(2))))
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    ready.wait(300)
    if not port:
        proc.kill()
        raise RuntimeError("the server did not start")
    return proc, port[0], port[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_http(client, model: str, batch: list[list[int]], max_new: int) -> Run:
    gaps: list[float] = []
    t0 = time.perf_counter()

    async def one(prompt: list[int]) -> int:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_new, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        usage: list[int] = []

        async def events():
            async for chunk in stream:
                if chunk.usage is not None:
                    usage.append(chunk.usage.completion_tokens)
                yield chunk

        await _consume(events(), lambda c: 1 if c.choices and c.choices[0].text else 0, t0, gaps, msgs)
        return usage[0] if usage else 0

    msgs: list[int] = []
    counts = await asyncio.gather(*(one(p) for p in batch))
    return Run(sum(counts), time.perf_counter() - t0, gaps, len(msgs))


async def bench_shape(shape: str, model_dir: Path, args: argparse.Namespace) -> list[dict]:
    from kvserve.service.config import ServerConfig
    from kvserve.service.engine import build_engine

    streams = [int(s) for s in args.streams.split(",")]
    rng = random.Random(0)
    vocab = 400
    # the server's own settings (the same flags, no KVSERVE_* variables), not EngineConfig's defaults
    engine = await build_engine(ServerConfig.from_args(engine_flags(model_dir, max(streams)), {}).engine_config())
    proc, port, http_port = start_server(model_dir, max(streams))
    rows = []
    import openai

    try:
        async with AsyncKVServeClient(f"127.0.0.1:{port}") as client, openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{http_port}/v1", api_key="bench", max_retries=0, timeout=600
        ) as http:
            # warm-up both paths (first-step allocations, lazy imports)
            await run_inprocess(engine, prompts(2, args.prompt_len, vocab, rng), 4, "warm")
            await run_grpc(client, prompts(2, args.prompt_len, vocab, rng), 4)
            await run_http(http, str(model_dir), prompts(2, args.prompt_len, vocab, rng), 4)
            for n in streams:
                runs: dict[str, list[Run]] = {}
                for rep in range(args.reps):
                    for path in ("in-process", "grpc", "http"):
                        batch = prompts(n, args.prompt_len, vocab, rng)
                        if path == "grpc":
                            run = await run_grpc(client, batch, args.tokens)
                        elif path == "http":
                            run = await run_http(http, str(model_dir), batch, args.tokens)
                        else:
                            run = await run_inprocess(engine, batch, args.tokens, f"{n}-{rep}")
                        assert run.tokens == n * args.tokens, (path, run.tokens)
                        runs.setdefault(path, []).append(run)
                pick = {p: _pick(rs, args.pick) for p, rs in runs.items()}
                rows.append(dict(shape=shape, streams=n, **pick))
                ip, gr, ht = pick["in-process"], pick["grpc"], pick["http"]
                each = "  ".join(f"{p} " + "/".join(f"{r.tok_s:.0f}" for r in rs) for p, rs in runs.items())
                print(f"  {shape} N={n:2d}: in-process {ip.tok_s:8.1f} tok/s, gRPC {gr.tok_s:8.1f} tok/s "
                      f"({100 * (gr.wall_s / ip.wall_s - 1):+.1f}% time, {gr.tokens / gr.messages:.1f} tokens/message), "
                      f"HTTP {ht.tok_s:8.1f} tok/s ({100 * (ht.wall_s / gr.wall_s - 1):+.1f}% time vs gRPC); "
                      f"every run's tok/s: {each}", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        await engine.shutdown(0)
        proc.terminate()
        proc.wait(60)
    return rows


def _pick(runs: list[Run], how: str) -> Run:
    """The run of median tokens/s (the lower middle of an even count), or the fastest."""
    ranked = sorted(runs, key=lambda r: r.tok_s)
    return ranked[-1] if how == "best" else ranked[(len(ranked) - 1) // 2]


def table(rows: list[dict]) -> str:
    out = [
        "| shape | streams | in-process tok/s | gRPC tok/s | gRPC time vs in-process | gRPC scaling vs 1 stream "
        "| ITL p50 in-proc / gRPC (ms) | ITL p99 in-proc / gRPC (ms) | HTTP tok/s | HTTP time vs gRPC "
        "| ITL p50 / p99 HTTP (ms) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    single: dict[str, float] = {}
    for r in rows:
        ip, gr, ht = r["in-process"], r["grpc"], r["http"]
        if r["streams"] == 1:
            single[r["shape"]] = gr.tok_s
        scale = gr.tok_s / single[r["shape"]] if r["shape"] in single else float("nan")
        out.append(
            f"| {r['shape']} | {r['streams']} | {ip.tok_s:.1f} | {gr.tok_s:.1f} | {100 * (gr.wall_s / ip.wall_s - 1):+.1f}% "
            f"| {scale:.2f}x | {ip.itl_ms(0.5):.1f} / {gr.itl_ms(0.5):.1f} | {ip.itl_ms(0.99):.1f} / {gr.itl_ms(0.99):.1f} "
            f"| {ht.tok_s:.1f} | {100 * (ht.wall_s / gr.wall_s - 1):+.1f}% | {ht.itl_ms(0.5):.1f} / {ht.itl_ms(0.99):.1f} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, 32-token streams, 1 rep")
    parser.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--streams", default="1,4,8,16")
    parser.add_argument("--tokens", type=int, default=None, help="tokens generated per stream")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--reps", type=int, default=None, help="runs per path and row (default 3, --quick 1)")
    parser.add_argument("--pick", choices=("median", "best"), default="median",
                        help="which of the reps a row shows: the median or the highest tokens/s")  # fmt: skip
    args = parser.parse_args()
    shapes = (args.shapes or ("tiny" if args.quick else "tiny,110m")).split(",")
    args.tokens = args.tokens or (32 if args.quick else 128)
    args.reps = args.reps or (1 if args.quick else 3)

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            model_dir = make_tiny_llama(Path(tmp) / shape, **SHAPES[shape])
            rows += asyncio.run(bench_shape(shape, model_dir, args))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nstreams of {args.tokens} tokens after {args.prompt_len}-token prompts, {args.pick} of {args.reps}; "
          f"CPU float32, torch {torch.__version__}, {os.cpu_count()} cores; load average at the end {load}\n")  # fmt: skip
    print(table(rows))


if __name__ == "__main__":
    main()
