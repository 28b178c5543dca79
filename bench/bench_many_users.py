"""Many users at once: concurrent multi-turn sessions, time to first token of a returning turn.

N users each hold a session of ``--turns`` turns: the first turn is a cold prompt of
``--first-len`` token ids; every later turn sends the user's whole transcript (every
earlier prompt and every generated token) plus ``--new-tokens`` new ids, so its prefix
is cached and only the new tokens (and the partial last block) need computing. Each turn
generates ``--tokens`` tokens (greedy, ignore_eos). A user sends its next turn as soon
as its previous one ended; in engine mode the users start ``--stagger`` steps apart, so
the returning turns meet the other users' decodes (all users returning in one step
would measure one prefill step, not the scheduler).
``--cold-len L`` adds a cold prompt of L tokens alongside every returning turn of user 0
(the chunked-prefill case: a long cold prefill must not delay returning turns).

Two ways to run it:

- engine (the default): ``LLMEngine`` in this process, stepped synchronously, with the
  server's own settings (``ServerConfig`` of the flags below: the host tier on, as
  deployed). Besides wall-clock figures it counts engine steps from a turn's submission to
  its first token: a CPU-time-insensitive figure (the machine may be loaded). ``--repo
  PATH`` runs the same workload against another checkout (e.g. ``git archive <rev> | tar
  -x -C /tmp/base``) in a subprocess, alternating with this one run by run, and prints
  both with ratios;
- HTTP: ``--kvserve-url URL`` and/or ``--llama-server URL`` drive OpenAI ``/v1/completions``
  endpoints (token-id prompts, streaming) with the same sessions; there the transcript is
  the earlier prompts plus the new ids (the generated ids are not returned as ids), so
  the cached prefix is the earlier prompts. Start llama-server with ``-np N`` (N = users)
  and kvserve with ``--http-port``; both serve the same model. TTFT: to the first streamed
  chunk; tokens: the usage (kvserve coalesces the tokens of ``--stream-interval`` into one
  chunk); ITL: each turn's mean gap, first token to last;
- HTTP with the servers started here: ``--llama-bin DIR`` (llama.cpp's build/bin) writes the
  random ``--shape`` model (or takes ``--model``), converts it to GGUF F32 (kvserve's exact
  weights) and, rep by rep, starts ``llama-server -np USERS -t THREADS -c USERS*512`` and
  ``python -m kvserve.service --http-port`` (CPU float32, ``--torch-threads THREADS``, the
  server's defaults otherwise: host tier on; with ``--repo`` also that checkout's), one server
  at a time, alternating the order, and prints all of them in one table.

Figures: aggregate tokens/s (all generated tokens / wall time), TTFT of the returning
turns p50/p99 (wall; engine mode also in steps), inter-token gap p50/p99.

    python bench/bench_many_users.py --users 8,16 --repo /tmp/base     # before/after
    python bench/bench_many_users.py --users 8 --kvserve-url http://127.0.0.1:8000 \\
        --llama-server http://127.0.0.1:8080 --model-name m
    python bench/bench_many_users.py --users 8,16 --shape 110m --llama-bin /work/llama/src/build/bin
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(os.environ.get("BENCH_MANY_USERS_REPO") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(REPO))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server runs: before torch loads (spinning OpenMP threads stall a loaded CPU)

SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096),
    "small": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=4096),
    "110m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, max_position_embeddings=4096),
}  # fmt: skip
VOCAB = 400  # the test tokenizer's


@dataclass
class Result:
    label: str
    tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  # returning turns
    ttft_steps: list[int] = field(default_factory=list)  # returning turns (engine mode)
    gaps_s: list[float] = field(default_factory=list)
    steps: int = 0
    prompt_tokens: int = 0  # returning turns' prompts (HTTP mode)
    cached_tokens: int = 0  # of them served from the server's cache (its timings' cache_n, else the usage's)
    cpu_s: float = 0.0  # --llama-bin: the server process's CPU time over the run (user + system, all threads)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def first_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


# ---- engine mode ------------------------------------------------------------------------


def engine_flags(args: argparse.Namespace, model: str, users: int) -> list[str]:
    return ["--model", model, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", args.kv_cache,
            "--block-size", "16", "--max-num-seqs", str(max(users + 1, 8)),
            "--max-num-batched-tokens", str(args.batched_tokens)]  # fmt: skip


def run_engine(args: argparse.Namespace, model: str, users: int, label: str) -> Result:
    import torch

    from kvserve.service.config import ServerConfig
    from kvserve.service.engine.engine import LLMEngine
    from kvserve.service.engine.store import build_store
    from kvserve.service.models.loading import load_model
    from kvserve.service.types import Delta, Finished, GenerationRequest, SamplingParams

    torch.manual_seed(0)
    cfg = ServerConfig.from_args(engine_flags(args, model, users), {}).engine_config()
    loaded = load_model(model, dtype="float32", device="cpu", native_kernels=cfg.native_kernels)
    engine = LLMEngine(loaded, cfg, store=build_store(cfg, loaded))
    rng = random.Random(1)
    res = Result(label)
    try:
        # warm-up: one short request through every path
        warm = GenerationRequest("warm", first_prompts(1, 40, 9)[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.add_request(warm)
        while engine.has_work():
            engine.step()
        transcripts = first_prompts(users, args.first_len, seed=2)
        turn = [0] * users
        sent: dict[str, tuple[int, float, int, bool]] = {}  # rid -> (user, t_sent, step_sent, returning)
        last: dict[str, float] = {}
        step = 0

        def submit(u: int) -> None:
            rid = f"u{u}-t{turn[u]}"
            sp = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
            engine.add_request(GenerationRequest(rid, list(transcripts[u]), sp))
            sent[rid] = (u, time.perf_counter(), step, turn[u] > 0)
            if u == 0 and turn[u] > 0 and args.cold_len:
                cold = [rng.randrange(3, VOCAB) for _ in range(args.cold_len)]
                engine.add_request(GenerationRequest(f"cold-{turn[u]}", cold, sp))

        # staggered starts (engine steps apart), so returning turns meet other users' decodes
        # instead of all users returning in the same step
        start_at = [u * args.stagger for u in range(users)]
        t0 = time.perf_counter()
        while engine.has_work() or any(s >= step for s in start_at):
            for u in range(users):
                if start_at[u] == step:
                    submit(u)
            events = engine.step()
            step += 1
            now = time.perf_counter()
            for rid, ev in events:
                if rid not in sent:  # the cold prompts: counted in tokens only
                    if isinstance(ev, Delta):
                        res.tokens += len(ev.token_ids)
                    continue
                u, t_sent, s_sent, returning = sent[rid]
                if isinstance(ev, Delta) and ev.token_ids:
                    res.tokens += len(ev.token_ids)
                    if rid not in last:
                        if returning:
                            res.ttft_s.append(now - t_sent)
                            res.ttft_steps.append(step - s_sent)
                    else:
                        res.gaps_s.extend([(now - last[rid]) / len(ev.token_ids)] * len(ev.token_ids))
                    last[rid] = now
                elif isinstance(ev, Finished):
                    assert not ev.error, ev.error
                    turn[u] += 1
                    if turn[u] < args.turns:
                        transcripts[u] = transcripts[u] + ev.output_token_ids + [
                            rng.randrange(3, VOCAB) for _ in range(args.new_tokens)
                        ]
                        submit(u)
        res.wall_s = time.perf_counter() - t0
        res.steps = step
    finally:
        engine.close()
    return res


# ---- HTTP mode --------------------------------------------------------------------------


async def run_http(args: argparse.Namespace, url: str, users: int, label: str) -> Result:
    import openai

    res = Result(label)
    rng = random.Random(1)
    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="bench", max_retries=0, timeout=600) as client:

        async def turn_of(prompt: list[int], returning: bool) -> None:
            t_sent = time.perf_counter()
            first = last = None
            n = 0
            stream = await client.completions.create(
                model=args.model_name, prompt=prompt, max_tokens=args.tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            cached = None
            async for chunk in stream:
                if chunk.usage is not None and chunk.usage.completion_tokens:
                    n = chunk.usage.completion_tokens
                    details = chunk.usage.prompt_tokens_details
                    if cached is None and details is not None and details.cached_tokens is not None:
                        cached = details.cached_tokens
                timings = (chunk.model_extra or {}).get("timings")
                if isinstance(timings, dict) and "cache_n" in timings:  # llama.cpp's names (kvserve's too)
                    cached = int(timings["cache_n"])
                if not chunk.choices:
                    continue
                now = time.perf_counter()
                # the first chunk carrying a choice is the first token, its text possibly empty
                # (a random model's token may be part of a UTF-8 character)
                if first is None:
                    first = now
                    if returning:
                        res.ttft_s.append(now - t_sent)
                last = now
            # tokens from the usage (kvserve coalesces tokens made within --stream-interval into
            # one chunk: chunks are not tokens); ITL: the turn's mean gap, first to last token
            n = n or args.tokens
            res.tokens += n
            if returning:
                res.prompt_tokens += len(prompt)
                res.cached_tokens += cached or 0
            if first is not None and n > 1:
                res.gaps_s.append((last - first) / (n - 1))

        async def user(u: int, first: list[int]) -> None:
            prompt = list(first)
            for t in range(args.turns):
                await turn_of(prompt, t > 0)
                prompt = prompt + [rng.randrange(3, VOCAB) for _ in range(args.new_tokens)]

        firsts = first_prompts(users, args.first_len, seed=2)
        await turn_of(first_prompts(1, 40, 9)[0], False)  # warm-up
        res.ttft_s.clear()
        res.gaps_s.clear()
        res.tokens = res.prompt_tokens = res.cached_tokens = 0
        t0 = time.perf_counter()
        await asyncio.gather(*(user(u, firsts[u]) for u in range(users)))
        res.wall_s = time.perf_counter() - t0
    return res


# ---- servers started by the bench (--llama-bin) -------------------------------------------

ENV_AT_START = dict(os.environ)  # llama-server runs with this (its OpenMP threads keep their own wait policy)
SESSION_CTX = 512  # context per session: first prompt + 3 x 64 new + 64 out, rounded up


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on a free loopback port, up once GET ``/v1/models`` answers."""

    def __init__(self, label: str, cmd: list[str], port: int, env: dict, cwd: Path, log_dir: Path) -> None:
        import urllib.request

        self.label, self.url = label, f"http://127.0.0.1:{port}"
        self.log = open(log_dir / f"{label}-{port}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{label} exited ({self.proc.returncode}): see {self.log.name}\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5) as r:
                    self.model_name = json.loads(r.read())["data"][0]["id"]
                break
            except (OSError, KeyError, IndexError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{label} did not come up: see {self.log.name}")
            time.sleep(0.5)

    def cpu_s(self) -> float:
        """The process's CPU seconds so far (user + system, every thread): /proc/PID/stat."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def start_llama(args: argparse.Namespace, gguf: Path, users: int, log_dir: Path) -> Server:
    port = free_port()
    cmd = [str(Path(args.llama_bin) / "llama-server"), "-m", str(gguf), "-t", str(args.threads), "-tb", str(args.threads),
           "-np", str(users), "-c", str(users * SESSION_CTX), "--host", "127.0.0.1", "--port", str(port), "--no-webui"]  # fmt: skip
    return Server("llama-server", cmd, port, ENV_AT_START, log_dir, log_dir)


def start_kvserve(args: argparse.Namespace, repo: Path, label: str, model: Path, users: int, log_dir: Path) -> Server:
    """``kvserve serve`` of the checkout ``repo`` (its own ``kvserve/``: cwd and PYTHONPATH),
    CPU float32, the server's defaults otherwise (host tier on)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve.service", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
           "--http-port", str(port), "--device", "cpu", "--dtype", "float32", "--torch-threads", str(args.threads),
           "--max-num-seqs", str(max(users, 32))]  # fmt: skip
    env = dict(ENV_AT_START, PYTHONPATH=str(repo))
    return Server(label, cmd, port, env, repo, log_dir)


def gguf_of(args: argparse.Namespace, model: Path, out: Path) -> Path:
    """The checkpoint as GGUF F32 (kvserve's exact weights), by llama.cpp's converter."""
    src = Path(args.llama_src) if args.llama_src else next(
        (d for d in Path(args.llama_bin).resolve().parents if (d / "convert_hf_to_gguf.py").exists()), None)  # fmt: skip
    if src is None:
        raise SystemExit("no convert_hf_to_gguf.py above --llama-bin: give --llama-src")
    env = dict(ENV_AT_START, PYTHONPATH=str(src / "gguf-py"))
    conv = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model), "--outfile", str(out),
                           "--outtype", "f32"], env=env, capture_output=True, text=True)  # fmt: skip
    if conv.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{conv.stderr[-3000:]}")
    return out


def run_servers(args: argparse.Namespace, model: Path, gguf: Path, users: int, rep: int, log_dir: Path) -> list[Result]:
    """One rep: each server in turn (the order alternating rep by rep), one at a time."""
    order: list[tuple[str, Path | None]] = [("llama-server", None), ("kvserve", REPO)]
    if args.repo:
        order.append(("kvserve-base", Path(args.repo)))
    out = []
    for label, repo in order if rep % 2 == 0 else order[::-1]:
        srv = start_llama(args, gguf, users, log_dir) if repo is None else start_kvserve(args, repo, label, model, users, log_dir)
        try:
            run_args = argparse.Namespace(**{**vars(args), "model_name": srv.model_name})
            cpu0 = srv.cpu_s()
            try:
                r = asyncio.run(run_http(run_args, srv.url, users, label))
            except Exception as e:  # noqa: BLE001  which server, and its log's tail
                tail = Path(srv.log.name).read_text()[-3000:]
                raise SystemExit(f"{label} at {users} users failed ({e!r}, exit {srv.proc.poll()}); its log:\n{tail}") from e
            r.cpu_s = srv.cpu_s() - cpu0
            out.append(r)
        finally:
            srv.stop()
    return out


# ---- driver -----------------------------------------------------------------------------


def run_repo(args: argparse.Namespace, repo: Path, model: str, users: int, label: str) -> Result:
    """The engine-mode run under another checkout, in a subprocess."""
    cmd = [sys.executable, __file__, "--_one", "--model", model, "--users", str(users), "--label", label]
    for k in ("turns", "tokens", "new_tokens", "first_len", "cold_len", "stagger", "batched_tokens", "kv_cache"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    env = dict(os.environ, BENCH_MANY_USERS_REPO=str(repo), PYTHONPATH=str(repo))
    out = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"run under {repo} failed:\n{out.stderr[-3000:]}")
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return Result(**d)


def row(users: int, r: Result, ref: Result | None) -> str:
    def ratio(a: float, b: float) -> str:
        return f" ({a / b:.2f}x)" if ref is not None and b == b and b else ""

    steps = (
        f"{q(r.ttft_steps, 0.5):.0f} / {q(r.ttft_steps, 0.99):.0f}" if r.ttft_steps else "-"
    )
    p50, p99 = q(r.ttft_s, 0.5), q(r.ttft_s, 0.99)
    return (
        f"| {users} | {r.label} | {r.tok_s:.1f}{ratio(r.tok_s, ref.tok_s if ref else 0)} "
        f"| {1000 * p50:.0f}{ratio(p50, q(ref.ttft_s, 0.5) if ref else 0)} "
        f"| {1000 * p99:.0f}{ratio(p99, q(ref.ttft_s, 0.99) if ref else 0)} | {steps} "
        f"| {1000 * q(r.gaps_s, 0.5):.1f} / {1000 * q(r.gaps_s, 0.99):.1f} "
        f"| {f'{100 * r.cached_tokens / r.prompt_tokens:.0f}%' if r.prompt_tokens else '-'} "
        f"| {f'{1000 * r.cpu_s / r.tokens:.1f}' if r.cpu_s else '-'} |"
    )


def median_run(runs: list[Result]) -> Result:
    """The run of median returning-turn TTFT p50 (lower middle)."""
    return sorted(runs, key=lambda r: q(r.ttft_s, 0.5))[(len(runs) - 1) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--users", default="8,16", help="comma list of concurrent sessions")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per turn")
    p.add_argument("--new-tokens", type=int, default=64, help="new prompt tokens per returning turn")
    p.add_argument("--first-len", type=int, default=64, help="first turn's prompt length")
    p.add_argument("--cold-len", type=int, default=0, help="a cold prompt of this length beside user 0's returning turns")
    p.add_argument("--stagger", type=int, default=4, help="engine mode: user u starts u * this many steps in")
    p.add_argument("--batched-tokens", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--kv-cache", default="512MiB")
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--model", default=None, help="a model directory (default: a random --shape model)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--repo", default=None, help="another checkout to compare against (engine mode)")
    p.add_argument("--kvserve-url", default=None, help="HTTP mode: kvserve's OpenAI endpoint")
    p.add_argument("--llama-server", default=None, help="HTTP mode: llama-server's OpenAI endpoint (-np = users)")
    p.add_argument("--model-name", default="model", help="HTTP mode: the model name to send")
    p.add_argument("--llama-bin", default=None,
                   help="llama.cpp's build/bin: the bench starts llama-server (-np = users) and kvserve (--http-port; "
                        "with --repo also that checkout's) one at a time, HTTP mode, the same random model")  # fmt: skip
    p.add_argument("--llama-src", default=None, help="llama.cpp's source tree (convert_hf_to_gguf.py); default: above --llama-bin")
    p.add_argument("--threads", type=int, default=2, help="--llama-bin: threads of each server (-t / --torch-threads)")
    p.add_argument("--label", default="this")
    p.add_argument("--_one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    user_counts = [int(x) for x in args.users.split(",")]

    if args._one:  # one engine run (under BENCH_MANY_USERS_REPO), JSON on stdout
        print(json.dumps(asdict(run_engine(args, args.model, user_counts[0], args.label))))
        return

    lines = [
        "| users | run | tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TTFT steps p50 / p99 | ITL p50 / p99 (ms) | returning prompts cached | server CPU ms / token |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None and not (args.kvserve_url or args.llama_server):
            from tests.fixtures.models import make_tiny_llama

            model = str(make_tiny_llama(Path(tmp) / args.shape, **SHAPES[args.shape]))
        gguf = gguf_of(args, Path(model), Path(tmp) / "model-f32.gguf") if args.llama_bin else None
        for users in user_counts:
            runs: dict[str, list[Result]] = {}
            for rep in range(args.reps):
                if args.llama_bin:
                    for r in run_servers(args, Path(model), gguf, users, rep, Path(tmp)):
                        runs.setdefault(r.label, []).append(r)
                        print(f"  users={users} rep={rep} {r.label}: {r.tok_s:.1f} tok/s, TTFT p50 "
                              f"{1000 * q(r.ttft_s, 0.5):.0f} ms p99 {1000 * q(r.ttft_s, 0.99):.0f} ms, "
                              f"{r.wall_s:.1f} s, CPU {r.cpu_s:.1f} s, cached {r.cached_tokens}/{r.prompt_tokens}, "
                              f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)  # fmt: skip
                elif args.kvserve_url or args.llama_server:
                    for label, url in (("llama-server", args.llama_server), ("kvserve", args.kvserve_url)):
                        if url:
                            runs.setdefault(label, []).append(asyncio.run(run_http(args, url, users, label)))
                else:
                    order = [("this", REPO)] + ([("base", Path(args.repo))] if args.repo else [])
                    for label, repo in order if rep % 2 == 0 else order[::-1]:  # alternate
                        r = run_repo(args, repo, model, users, label)
                        runs.setdefault(label, []).append(r)
                        print(f"  users={users} rep={rep} {label}: {r.tok_s:.1f} tok/s, TTFT p50 "
                              f"{1000 * q(r.ttft_s, 0.5):.0f} ms, steps p50 {q(r.ttft_steps, 0.5)}, {r.steps} engine steps in {r.wall_s:.1f} s",
                              file=sys.stderr, flush=True)  # fmt: skip
            picked = {k: median_run(v) for k, v in runs.items()}
            ref = picked.get("base") or picked.get("llama-server")
            for label, r in picked.items():
                lines.append(row(users, r, ref if r is not ref else None))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{args.turns} turns per user, +{args.new_tokens} tokens in and {args.tokens} out per turn, first prompt "
          f"{args.first_len}, cold {args.cold_len}; median of {args.reps} (by TTFT p50); ratios vs the reference row; "
          f"{os.cpu_count()} cores, load average at the end {load}\n")  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
