"""kvserve behind the routers people run in front of a fleet, as real processes on loopback:
``sglang-router`` 0.3.2 and ``vllm-router`` (PyPI, the test extra) in front of three
kvserve replicas (the packaged model, their HTTP front) sharing one real redis-server,
driven by the official ``openai`` client as a stateless chat client (the whole history
resent each turn).

- sglang-router registers each replica through ``/server_info`` and ``/model_info``
  (service/http/discovery.py) and lists the model by its real name; the fields it adds
  to every request are accepted. vllm-router's ``cache_aware`` renders each request on
  every replica (``/v1/chat/completions/render``) and routes by token prefix.
- Without any session header, ``cache_aware`` (a prefix tree of what it sent where) sends
  >= 90% of returning turns to the replica whose device pool holds their prefix, through
  either router; a session-blind ``random`` policy lands near 1/3 (the same check failing).
- With the routing key (sglang-router's ``manual`` policy on ``X-SMG-Routing-Key``;
  vllm-router's ``consistent_hash`` on ``X-Session-Id``, which it also forwards, so the
  replica runs the turn in that session) every returning turn is a device hit.
- With a replica SIGKILLed between turns, every session's next turn completes through
  the router with the cold greedy reply to its prompt. Behind vllm-router with the
  session header the killed replica's sessions continue from the blocks Redis holds
  (a session spills there); behind cache_aware without a header they are recomputed
  (kvserve writes sessions and retained prompts to Redis, not every stateless prompt).

The figures (device-hit share, TTFT) come from each turn's usage
(``prompt_tokens_details.kvserve_cached_by_tier``), not from timing assertions.
"""

from __future__ import annotations

import re
import signal
import tomllib
import urllib.request
import uuid
from typing import Callable

import openai
import pytest

from kvserve.clients import KVServeClient

from tests.fixtures.routers import (
    BLOCK_SIZE, MODEL, ChatRun, Replica, RouterProcess, run_chats, start_replicas, stop_replicas,
)  # fmt: skip
from tests.fixtures.serving import REPO, wait_until
from tests.system.test_deploy import COMPOSE, compose_env, load_yaml
from tests.system.test_routing import HAPROXY_CFG, HAProxy, need_haproxy  # noqa: F401  (fixture)

REPLICAS = 3
SESSIONS = 9
TURNS = 4



def test_compose_router_profile_runs_the_tested_sglang_router_over_the_three_replicas_http_api():
    services = load_yaml(COMPOSE)["services"]
    gateway = services["sglang-router"]
    assert gateway["profiles"] == ["router"]
    assert all("router" in services[n]["profiles"] for n in ("kvserve-2", "kvserve-3"))  # started with it
    script = " ".join(gateway["command"][2:])
    pinned = re.search(r"pip install --no-cache-dir (sglang-router==\S+) &&", script)
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert pinned and pinned.group(1) in extra  # the version this file's tests run
    argv = script.split("exec ", 1)[1].split()
    http_port = compose_env(services["kvserve"])["KVSERVE_HTTP_PORT"]
    workers = argv[argv.index("--worker-urls") + 1 : argv.index("--policy")]
    assert workers == [f"http://{n}:{http_port}" for n in ("kvserve", "kvserve-2", "kvserve-3")]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    published = {p.split(":")[1] for p in gateway["ports"]}
    assert {argv[argv.index("--port") + 1], argv[argv.index("--prometheus-port") + 1]} == published
    assert all(gateway["depends_on"][n]["condition"] == "service_healthy" for n in ("kvserve", "kvserve-2", "kvserve-3"))


def _client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=120)


def _sessions(prefix: str) -> dict[str, list[dict[str, str]]]:
    tag = uuid.uuid4().hex[:6]
    return {f"{prefix}-{tag}-{i}": [] for i in range(SESSIONS)}


def _prompt_tokens_served(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        m = re.search(r"^kvserve_prompt_tokens_total (\S+)$", r.read().decode(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def fleet(redis_server):
    if not RouterProcess.installed("sglang"):
        pytest.skip("sglang-router not installed (the test extra)")
    with redis_server.client() as c:
        c.flushall()
    replicas = start_replicas(REPLICAS, redis_server.url)
    try:
        yield replicas
    finally:
        stop_replicas(replicas)


def _assert_cold_replies(replica: Replica, histories: dict[str, list[dict[str, str]]], run: ChatRun) -> None:
    """Each stateless reply of ``run`` is the cold greedy reply to the same messages on
    ``replica`` (a fresh cache salt shares no block with anything)."""
    with openai.OpenAI(base_url=replica.url + "/v1", api_key="unused", max_retries=0, timeout=120) as direct:
        for t in run.turns:
            history = histories[t.session][: 2 * t.index + 1]  # the prompt of turn t.index
            cold = direct.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True, "cache_salt": f"cold-{t.session}"})  # fmt: skip
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            assert cold.choices[0].message.content == t.text, t.session


def _assert_cold_session_replies(replica: Replica, run: ChatRun) -> None:
    """Each session turn's reply of ``run`` is the cold greedy reply to the prompt the
    session ran (its record's token ids: the earlier replies as generated, not as their
    text re-tokenizes), computed on ``replica`` under a fresh cache salt."""
    with KVServeClient(f"127.0.0.1:{replica.grpc_port}", timeout=120) as direct:
        for t in run.turns:
            transcript = direct.get_session(t.session, include_token_ids=True).token_ids
            cold = direct.complete(token_ids=transcript[:-8], max_new_tokens=8, ignore_eos=True,
                                   cache_salt=f"cold-{t.session}")  # fmt: skip
            assert cold.start.cached_tokens == 0
            assert cold.token_ids == transcript[-8:] and cold.text == t.text, t.session


def _print(rows: list[tuple[str, ChatRun]]) -> None:
    print(f"\n{SESSIONS} sessions x {TURNS} turns, {REPLICAS} replicas, stateless chat (openai client)")
    print("| router | returning turns | device hits | TTFT p50 | TTFT p99 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, run in rows:
        print(f"| {name} | {len(run.returning())} | {run.device_share():.1%} | {run.ttft_ms(0.5):.1f} ms "
              f"| {run.ttft_ms(0.99):.1f} ms |")  # fmt: skip


@pytest.mark.slow
def test_sglang_router_cache_aware_finds_the_prefix_without_a_header_and_survives_a_killed_replica(fleet):
    workers = [r.url for r in fleet]
    rows = []
    router = RouterProcess("sglang", workers, "cache_aware")  # ready once /v1/models names MODEL
    try:
        assert router.models() == [MODEL]  # from /server_info's served_model_name, not "unknown"
        with _client(router) as client:
            histories = _sessions("ca")
            aware = run_chats(client, histories, range(TURNS))
            rows.append(("sglang-router cache_aware, no header", aware))
            assert aware.device_share() >= 0.9, aware.device_share()

            # One replica is killed between turns: the one that served the most.
            victim = max(range(REPLICAS), key=lambda i: _prompt_tokens_served(fleet[i].metrics_port))
            fleet[victim].proc.send_signal(signal.SIGKILL)
            fleet[victim].proc.wait(timeout=10)
            prompts_before = {t.session: t.prompt_tokens for t in aware.turns if t.index == TURNS - 1}
            after = run_chats(client, histories, range(TURNS, TURNS + 1))  # no call fails
    finally:
        router.stop()
    assert len(after.turns) == SESSIONS
    # A stateless prefix lives on the device of the replica that served it (kvserve writes
    # sessions and retained prompts to Redis, not every prompt): the sessions that stayed
    # find theirs on the device, those of the killed replica are recomputed elsewhere.
    stayed = [t for t in after.turns if t.cached_by_tier["device"] >= prompts_before[t.session] // BLOCK_SIZE * BLOCK_SIZE]
    assert 0 < len(stayed) < SESSIONS
    _assert_cold_replies(next(r for i, r in enumerate(fleet) if i != victim), histories, after)
    _print(rows)


@pytest.fixture(scope="module")
def live_fleet(fleet, redis_server):
    """Three running replicas: the fleet's survivors and a fresh one for each killed."""
    alive = [r for r in fleet if r.proc.poll() is None]
    fresh = start_replicas(REPLICAS - len(alive), redis_server.url) if len(alive) < REPLICAS else []
    try:
        yield alive + fresh
    finally:
        stop_replicas(fresh)


def _chats_through(fleet: list[Replica], kind: str, policy: str, prefix: str,
                   headers: Callable[[str], dict[str, str]] | None = None) -> ChatRun:  # fmt: skip
    """_sessions(prefix)'s chats, TURNS turns each, through a ``kind`` router with ``policy``
    in front of ``fleet`` (stopped after)."""
    router = RouterProcess(kind, [r.url for r in fleet], policy)
    try:
        with _client(router) as client:
            return run_chats(client, _sessions(prefix), range(TURNS), headers=headers)
    finally:
        router.stop()


@pytest.mark.slow
def test_sglang_router_random_is_the_session_blind_baseline(live_fleet):
    blind = _chats_through(live_fleet, "sglang", "random", "rnd")
    _print([(f"sglang-router random ({len(live_fleet)} replicas)", blind)])
    # 1/N expected (27 returning turns): 0.75 is far above it and far below cache_aware's
    assert blind.device_share() < 0.75, blind.device_share()


@pytest.mark.slow
def test_sglang_router_routing_key_keeps_each_session_on_one_replica(live_fleet):
    keyed = _chats_through(live_fleet, "sglang", "manual", "key", headers=lambda sid: {"X-SMG-Routing-Key": sid})
    _print([("sglang-router manual, X-SMG-Routing-Key", keyed)])
    assert keyed.device_share() == 1.0, keyed.device_share()


def _spilled(replica: Replica, sessions: list[str]) -> bool:
    """Every full block of each session's transcript is in Redis."""
    with KVServeClient(f"127.0.0.1:{replica.grpc_port}", timeout=30) as c:
        infos = [c.get_session(sid) for sid in sessions]
    return all(s.cached_blocks.get("redis", 0) == s.full_blocks > 0 for s in infos)


@pytest.mark.slow
@pytest.mark.skipif(not RouterProcess.installed("vllm"), reason="vllm-router not installed (the test extra)")
def test_vllm_router_cache_aware_routes_by_the_rendered_prompt_without_a_header(live_fleet):
    """vllm-router's cache_aware asks each worker /v1/chat/completions/render for the
    prompt's token ids (service/http/discovery.py) and routes by the longest token prefix."""
    aware = _chats_through(live_fleet, "vllm", "cache_aware", "vca")
    _print([("vllm-router cache_aware, no header", aware)])
    assert aware.device_share() >= 0.9, aware.device_share()


HTTP_LOG_LINE = re.compile(r" http (?P<backend>[\w-]+)/(?P<server>[\w-]+) (?P<status>-?\d+) \S+ session=(?P<session>\S*) ")


@pytest.mark.slow
def test_haproxy_hashes_http_requests_on_the_session_header_or_the_prompt_cache_key(live_fleet, need_haproxy):
    """deploy/haproxy/haproxy.cfg as is, its HTTP frontend in front of the replicas' HTTP
    API: X-Session-Id, else the JSON body's prompt_cache_key, picks the replica."""
    proxy = HAProxy(HAPROXY_CFG, [f"127.0.0.1:{r.grpc_port}" for r in live_fleet], [r.metrics_port for r in live_fleet],
                    http=[f"127.0.0.1:{r.http_port}" for r in live_fleet])  # fmt: skip
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=120) as client:  # fmt: skip
            keyed_ids, headed_ids = _sessions("pck"), _sessions("hdr")
            keyed = run_chats(client, keyed_ids, range(TURNS), body=lambda sid: {"prompt_cache_key": sid})
            headed = run_chats(client, headed_ids, range(TURNS), headers=lambda sid: {"X-Session-Id": sid})
            client.models.list()  # neither: the least-loaded replica
        calls = SESSIONS * TURNS * 2 + 1
        assert wait_until(lambda: sum(1 for l in proxy.lines if HTTP_LOG_LINE.search(l)) >= calls, timeout=10)
        logged = [m.groupdict() for l in proxy.lines if (m := HTTP_LOG_LINE.search(l))]
    finally:
        proxy.stop()
    _print([("haproxy, prompt_cache_key", keyed), ("haproxy, X-Session-Id", headed)])
    assert keyed.device_share() == 1.0 and headed.device_share() == 1.0
    servers: dict[str, set[str]] = {}
    for call in logged:
        assert call["status"] == "200", call
        if call["session"] != "-":
            assert call["backend"] == "http-sessions"
            servers.setdefault(call["session"], set()).add(call["server"])
    assert set(servers) == set(keyed_ids) | set(headed_ids)
    assert all(len(s) == 1 for s in servers.values()), servers  # each key on one replica
    assert len(set().union(*servers.values())) > 1  # the hash spreads keys over the replicas
    assert [c["backend"] for c in logged if c["session"] == "-"] == ["http-any"]


@pytest.mark.slow
@pytest.mark.skipif(not RouterProcess.installed("vllm"), reason="vllm-router not installed (the test extra)")
def test_vllm_router_hashes_the_session_header_and_a_killed_replicas_sessions_restore_from_redis(live_fleet):
    """vllm-router forwards X-Session-Id: each replica runs the turns in that session, whose
    blocks spill to Redis, so a killed replica's sessions continue elsewhere from Redis.
    (Last in this file: it kills one of the replicas the tests above share.)"""
    router = RouterProcess("vllm", [r.url for r in live_fleet], "consistent_hash")
    header = lambda sid: {"X-Session-Id": sid}  # noqa: E731
    try:
        with _client(router) as client:
            histories = _sessions("vh")
            served = [_prompt_tokens_served(r.metrics_port) for r in live_fleet]
            hashed = run_chats(client, histories, range(TURNS), headers=header)
            assert router.models() == [MODEL]  # passed through from a replica's /v1/models
            assert hashed.device_share() == 1.0, hashed.device_share()
            with KVServeClient(f"127.0.0.1:{live_fleet[0].grpc_port}", timeout=30) as c:  # records are in Redis
                assert all(c.get_session(sid).turns == TURNS for sid in histories)  # the header reached the replica
            assert wait_until(lambda: _spilled(live_fleet[0], list(histories)), timeout=30)

            victim = max(range(REPLICAS), key=lambda i: _prompt_tokens_served(live_fleet[i].metrics_port) - served[i])
            live_fleet[victim].proc.send_signal(signal.SIGKILL)
            live_fleet[victim].proc.wait(timeout=10)
            prompts_before = {t.session: t.prompt_tokens for t in hashed.turns if t.index == TURNS - 1}
            after = run_chats(client, histories, range(TURNS, TURNS + 1), headers=header)  # no call fails
    finally:
        router.stop()
    _print([("vllm-router consistent_hash, X-Session-Id", hashed)])
    assert len(after.turns) == SESSIONS
    for t in after.turns:  # every session continues from its blocks: on the device if it stayed, from Redis if it moved
        assert sum(t.cached_by_tier.values()) >= prompts_before[t.session] // BLOCK_SIZE * BLOCK_SIZE, t
    assert any(t.cached_by_tier["redis"] > 0 for t in after.turns)
    _assert_cold_session_replies(next(r for i, r in enumerate(live_fleet) if i != victim), after)
