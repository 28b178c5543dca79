"""What session operations cost: regenerate, rewind + re-ask and fork + a new turn on a
long conversation, against the same prompt prefilled cold.

A server (``python -m kvserve.service``, the packaged default model unless ``--model``)
runs in a subprocess on a free port. One session is built with ``--turns`` chat turns
(each a ``--message-words`` word message and ``--reply-tokens`` generated tokens, greedy,
ignore_eos so the transcript length is fixed). Then, ``--reps`` times each:

- regenerate: ``Generate`` with ``TURN_MODE_REGENERATE`` (a new seed each time);
- rewind + re-ask: ``RewindSession`` by one turn, then the same message again;
- fork + turn: ``ForkSession`` at the last turn, then a new message in the fork;
- cold: the regenerate's exact prompt as a one-off request under a fresh ``cache_salt``
  (nothing cached: what a server without these operations, or a client that resends
  the history as a new session, pays).

Per operation: median server-side time to first token (``FinalEvent.timings``), prompt
tokens and cached prompt tokens (``StartEvent``), and the median time of the unary call
(rewind, fork).

    python bench/bench_session_ops.py                    # about a minute on a CPU
    python bench/bench_session_ops.py --turns 4 --reps 15   # (the default model's context is 512 tokens)
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.clients import KVServeClient  # noqa: E402

WORDS = ("the teacher said that the school was near the river and the boys went there every "
         "morning before the lessons began with a story about the town").split()  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def message(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kvserve.service", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--log-level", "warning", *(["--model", args.model] if args.model else [])]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_ready(address: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with KVServeClient(address, timeout=5) as c:
                if c.health() == "SERVING":
                    return
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.5)
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the packaged default model)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--message-words", type=int, default=25)
    ap.add_argument("--reply-tokens", type=int, default=24)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = start_server(args, port)
    try:
        wait_ready(address)
        rng = random.Random(0)
        rows: dict[str, list[tuple[float, int, int]]] = {}
        calls: dict[str, list[float]] = {"rewind": [], "fork": []}
        sample = dict(max_new_tokens=args.reply_tokens, ignore_eos=True)
        with KVServeClient(address, timeout=120) as c:
            info = c.model_info()
            for _ in range(args.turns):
                c.chat("bench", message(rng, args.message_words), **sample)
            last_message = message(random.Random(1), args.message_words)
            c.rewind_session("bench", 1)
            c.chat("bench", last_message, **sample)  # the last turn is now one we can re-ask
            s = c.get_session("bench", include_token_ids=True, include_turns=True)
            last = s.turn_log[-1]
            prompt = s.token_ids[: last.start_token + last.input_tokens]  # what regenerate prefills

            def record(name: str, r) -> None:
                rows.setdefault(name, []).append((r.end.timings.ttft_s, r.start.prompt_tokens, r.start.cached_tokens))

            for i in range(args.reps):
                record("regenerate", c.regenerate("bench", temperature=1.0, seed=i, **sample))
                t = time.perf_counter()
                c.rewind_session("bench", 1)
                calls["rewind"].append(time.perf_counter() - t)
                record("rewind + re-ask", c.chat("bench", last_message, **sample))
                t = time.perf_counter()
                c.fork_session("bench", f"bench-fork-{i}")
                calls["fork"].append(time.perf_counter() - t)
                record("fork + new turn", c.chat(f"bench-fork-{i}", message(rng, args.message_words), **sample))
                record("cold (same prompt as regenerate)", c.complete(token_ids=prompt, cache_salt=f"cold-{i}", **sample))
        print(f"{info.architecture} ({info.device}, {info.dtype}, block size {info.block_size}); "
              f"{args.turns} turns, transcript {s.token_count} tokens; median of {args.reps}")
        print(f"{'operation':36s} {'ttft ms':>8s} {'prompt':>7s} {'cached':>7s}")
        for name, vals in rows.items():
            ttft = statistics.median(v[0] for v in vals) * 1000
            print(f"{name:36s} {ttft:8.1f} {vals[0][1]:7d} {statistics.median(v[2] for v in vals):7.0f}")
        for name, ts in calls.items():
            print(f"{name + ' call':36s} {statistics.median(ts) * 1000:8.1f} ms (client round trip)")
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
