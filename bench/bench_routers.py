"""Routers in front of three kvserve replicas: TTFT and device-hit rate per router.

Three replicas (the packaged model, CPU, one torch thread each, their HTTP front) share a
private redis-server; each router is a real process on loopback (``sglang-router`` 0.3.2,
``vllm-router`` 0.1.17: the test extra) in front of them, one at a time, driven by the
official ``openai`` client as a stateless client (the whole history resent each turn,
greedy, streamed). Two workloads:

- sessions: ``--sessions`` chats of ``--turns`` turns, 6 at a time, each first message
  its own;
- agents: ``--agents`` runs of ``--steps`` steps sharing one system prompt of about
  ``--prefix-tokens`` tokens (the packaged model's context is 512 tokens, so the issue's
  2k-token prefix is scaled down to ~250), each run's own task after it, 6 at a time.

A returning turn (or step) is a device hit when every full block of the previous turn's
prompt came from the serving replica's device pool and nothing from Redis (the turn's
``usage.prompt_tokens_details.kvserve_cached_by_tier``); for an agent's first step, the
share of its prompt found on the device (the shared system prompt, where the router sent
the run to a replica that holds it). TTFT: to the first content chunk, returning turns only.
The routers compared: deploy/haproxy/haproxy.cfg as is (its HTTP frontend; ``haproxy`` on
PATH) hashing ``X-Session-Id``, the body's ``prompt_cache_key``, or neither (least
connections); sglang-router ``cache_aware`` (no header), ``manual`` with
``X-SMG-Routing-Key`` = the session, ``random`` (the session-blind baseline); and
vllm-router ``cache_aware`` (by the token prefix each replica renders,
``/v1/chat/completions/render``) and ``consistent_hash`` with ``X-Session-Id`` (which it
forwards: the replica runs the turn in that session).

    python bench/bench_routers.py                 # both workloads, the defaults below
    python bench/bench_routers.py --sessions 8 --turns 4 --agents 8 --steps 3
"""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from tests.fixtures.redis_server import start_redis_server  # noqa: E402
from tests.fixtures.routers import (  # noqa: E402
    ChatRun, RouterProcess, chat_turn, run_chats, start_replicas, stop_replicas,
)  # fmt: skip
from tests.system.test_routing import HAPROXY_CFG, HAProxy, haproxy_binary  # noqa: E402

KEY = lambda sid: {"X-Session-Id": sid}  # noqa: E731
ROUTERS = [  # (row name, kind, policy, header per session, body fields per session)
    ("HAProxy, X-Session-Id", "haproxy", "", KEY, None),
    ("HAProxy, prompt_cache_key (no header)", "haproxy", "", None, lambda sid: {"prompt_cache_key": sid}),
    ("HAProxy, no key (leastconn)", "haproxy", "", None, None),
    ("sglang-router cache_aware, no header", "sglang", "cache_aware", None, None),
    ("sglang-router manual, X-SMG-Routing-Key", "sglang", "manual", lambda sid: {"X-SMG-Routing-Key": sid}, None),
    ("sglang-router random (baseline)", "sglang", "random", None, None),
    ("vllm-router cache_aware, no header", "vllm", "cache_aware", None, None),
    ("vllm-router consistent_hash, X-Session-Id", "vllm", "consistent_hash", KEY, None),
]
TOOLS = ("You are a careful agent. You may call these tools: search(query) finds documents, read(path) "
         "returns a file, write(path, text) stores a file, run(command) runs a shell command and returns "
         "its output, ask(question) asks the user. Answer with one tool call per step, then wait. ")  # fmt: skip


def agent_prefix(tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens (~3.4 characters a token here)."""
    return (TOOLS * (1 + int(tokens * 3.4) // len(TOOLS)))[: int(tokens * 3.4)]


def run_agents(client: openai.OpenAI, prefix: str, agents: int, steps: int, headers, body) -> tuple[ChatRun, float]:
    """``agents`` runs of ``steps`` steps over one system prompt; (the run, the share of
    the first steps' prompt tokens found on the serving replica's device: the shared
    prefix, when the router sent the run where it lives)."""
    tag = uuid.uuid4().hex[:6]
    run = ChatRun()
    prefix = f"[{tag}] {prefix}"  # this router's runs share it; no earlier router's run did

    def one(i: int) -> None:
        sid = f"agent-{tag}-{i}"
        history = [{"role": "system", "content": prefix}]
        for k in range(steps):
            history.append({"role": "user", "content": f"Task {i}: step {k}. What next?" if k else f"Task {i}: {sid}"})
            run.turns.append(chat_turn(client, sid, k, history, 8, headers(sid) if headers else None,
                                       body(sid) if body else None))  # fmt: skip

    with ThreadPoolExecutor(6) as pool:
        for f in [pool.submit(one, i) for i in range(agents)]:
            f.result()
    firsts = [t for t in run.turns if t.index == 0]
    return run, sum(t.cached_by_tier.get("device", 0) for t in firsts) / sum(t.prompt_tokens for t in firsts)


def start_router(kind: str, policy: str, replicas: list) -> tuple[str, Callable[[], None]] | None:
    """(its OpenAI base URL, how to stop it), or None when it is not installed."""
    if kind == "haproxy":
        if haproxy_binary() is None:
            return None
        proxy = HAProxy(HAPROXY_CFG, [f"127.0.0.1:{r.grpc_port}" for r in replicas], [r.metrics_port for r in replicas],
                        up=len(replicas), http=[f"127.0.0.1:{r.http_port}" for r in replicas])  # fmt: skip
        return f"http://127.0.0.1:{proxy.http_port}/v1", proxy.stop
    if not RouterProcess.installed(kind):
        return None
    router = RouterProcess(kind, [r.url for r in replicas], policy)
    return router.base_url, router.stop


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--agents", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=250)
    args = ap.parse_args(argv)

    redis = start_redis_server()
    replicas = start_replicas(args.replicas, redis.url)
    rows = []
    try:
        prefix = agent_prefix(args.prefix_tokens)
        for r in replicas:  # warm each replica (first-call costs) before the first router's rows
            with openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=120) as direct:
                run_chats(direct, {f"warm-{uuid.uuid4().hex[:6]}-{i}": [] for i in range(6)}, range(2))
        for name, kind, policy, headers, body in ROUTERS:
            router = start_router(kind, policy, replicas)
            if router is None:
                print(f"{name}: {kind} not installed, skipped")
                continue
            url, stop = router
            try:
                with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as client:
                    tag = uuid.uuid4().hex[:6]
                    chats = run_chats(client, {f"s-{tag}-{i}": [] for i in range(args.sessions)}, range(args.turns),
                                      headers=headers, body=body)  # fmt: skip
                    agents, first = run_agents(client, prefix, args.agents, args.steps, headers, body)
            finally:
                stop()
            rows.append((name, chats, agents, first))
            print(f"done: {name}", flush=True)
    finally:
        stop_replicas(replicas)
        redis.stop()

    print(f"\n{args.replicas} replicas; sessions: {args.sessions} x {args.turns} turns; agents: {args.agents} runs x "
          f"{args.steps} steps over a ~{args.prefix_tokens}-token shared system prompt; 8 new tokens a turn")  # fmt: skip
    print("| router | sessions: device hits | TTFT p50 | TTFT p99 | agents: first steps' prompt on device "
          "| later steps: device hits | TTFT p50 | TTFT p99 |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, chats, agents, first in rows:
        print(f"| {name} | {chats.device_share():.0%} | {chats.ttft_ms(0.5):.0f} ms | {chats.ttft_ms(0.99):.0f} ms "
              f"| {first:.0%} | {agents.device_share():.0%} | {agents.ttft_ms(0.5):.0f} ms "
              f"| {agents.ttft_ms(0.99):.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
