"""Refused requests against another tenant's stream (issue 26, item 5).

A server (``python -m kvserve.service`` in a subprocess, the tiny random Llama, the
HTTP front on) streams one victim completion of ``--tokens`` tokens over SSE. Meanwhile
attackers send, round after round until the victim is done, ``--attackers`` parallel
chat requests of ``--messages`` empty messages each (3.3 MB for 100,000), which the
server refuses (400); a poller asks ``GET /health`` every 50 ms. Printed per case
(quiet: no attackers; abuse: with them): the victim's wall time and largest gap between
two SSE chunks, the slowest /health answer, and the attackers' statuses.

Goal (issue 26): under abuse the victim's largest gap stays under 100 ms and /health
answers within 100 ms.

    python bench/bench_front_abuse.py                      # this checkout
    python bench/bench_front_abuse.py --server-repo /work/main   # another checkout's server, same load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.models import make_tiny_llama  # noqa: E402

_LISTEN = re.compile(r"OpenAI-compatible HTTP on :(\d+)")


def start_server(repo: Path, model: Path) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvserve.service", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
         "--http-port", str(_free_port()), "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", "64MiB",
         "--block-size", "16", "--log-level", "info"],
        cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    port: list[int] = []
    found = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = _LISTEN.search(line)
            if m and not port:
                port.append(int(m.group(1)))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    found.wait(180)
    if not port:
        proc.kill()
        raise SystemExit("the server did not start")
    return proc, port[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)  # fmt: skip
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    return int(raw.split(b" ", 2)[1]), raw.partition(b"\r\n\r\n")[2]


async def victim(port: int, tokens: int) -> tuple[float, float, int]:
    """(wall seconds, largest gap between SSE chunks, chunks with text)."""
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": tokens, "ignore_eos": True, "stream": True,
                       "temperature": 0}).encode()  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)  # fmt: skip
    await writer.drain()
    last, gap, chunks = None, 0.0, 0
    while True:
        line = await reader.readline()
        if not line:
            break
        if line.startswith(b"data: ") and b'"text":"' in line and b'"text":""' not in line:
            now = time.perf_counter()
            if last is not None:
                gap = max(gap, now - last)
            last, chunks = now, chunks + 1
        if line.startswith(b"data: [DONE]"):
            break
    writer.close()
    return time.perf_counter() - t0, gap, chunks


async def health_poller(port: int, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await request(port, "GET", "/health")
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)


async def attackers(port: int, n: int, body: bytes, stop: asyncio.Event, statuses: dict[int, int]) -> None:
    while not stop.is_set():
        for status, _ in await asyncio.gather(*(request(port, "POST", "/v1/chat/completions", body) for _ in range(n))):
            statuses[status] = statuses.get(status, 0) + 1


async def case(port: int, tokens: int, n_attackers: int, body: bytes) -> dict:
    stop = asyncio.Event()
    health: list[float] = []
    statuses: dict[int, int] = {}
    tasks = [asyncio.create_task(health_poller(port, stop, health))]
    if n_attackers:
        tasks.append(asyncio.create_task(attackers(port, n_attackers, body, stop, statuses)))
        await asyncio.sleep(0.3)  # the attack under way
    wall, gap, chunks = await victim(port, tokens)
    stop.set()
    await asyncio.gather(*tasks)
    return dict(wall=wall, gap=gap, chunks=chunks, health=max(health) if health else float("nan"),
                statuses=statuses)  # fmt: skip


async def main_async(args: argparse.Namespace, port: int) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": ""}] * args.messages, "max_tokens": 4}).encode()
    await victim(port, 8)  # warm up
    rows = []
    for name, n in (("quiet", 0), (f"abuse: {args.attackers} x {args.messages} messages ({len(body) / 1e6:.1f} MB)",
                                    args.attackers)):  # fmt: skip
        for _ in range(args.reps):
            rows.append((name, await case(port, args.tokens, n, body)))
    print(f"\nserver: {args.server_repo}; victim: {args.tokens} tokens over SSE (default --stream-interval 20ms)\n")
    print("| case | victim wall s | victim max gap ms | chunks | slowest /health ms | attacker statuses |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in rows:
        st = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())) or "-"
        print(f"| {name} | {r['wall']:.2f} | {1000 * r['gap']:.0f} | {r['chunks']} | {1000 * r['health']:.0f} | {st} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-repo", type=Path, default=REPO, help="checkout whose server to run (default: this one)")
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--attackers", type=int, default=8)
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny", max_position_embeddings=1024)
        proc, port = start_server(args.server_repo, model)
        try:
            asyncio.run(main_async(args, port))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
