"""Many replicas, one conversation: deploy/haproxy/haproxy.cfg, run as is by a real
haproxy in front of three real replicas (``python -m kvserve.service``, the packaged default
model) sharing one real redis-server.

- With the session-affine config, >= 95% of returning turns find their whole cached
  prefix in the device pool of the replica that served the previous turn, and the
  proxy's log shows each session on one replica;
- with a session-blind balancer in its place (``balance random(1)``: strict
  round-robin is no baseline, its hit rate follows the arrival pattern; 6 sessions in
  lockstep on 3 replicas come back to the same replica every time) the same run lands
  near the 1/N baseline;
- with one replica killed (SIGKILL, between turns), every session's next turn
  completes, the killed replica's sessions restore from Redis elsewhere, and every
  reply equals the cold greedy reply to the same prompt.

The run prints its figures (device-hit share, client TTFT p50/p99 through the proxy);
docs/benchmarks.md quotes them. Quicker checks: the config passes ``haproxy -c`` with the
compose environment, the compose ``replicas`` profile is wired to it, and every client
(Python sync and asyncio, kvserve-chat, the Node example) sends the session metadata the
proxy hashes on, as the proxy's own log shows.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvserve.clients import AsyncKVServeClient, KVServeClient, StreamStart, TextDelta
from tests.fixtures.redis_server import free_port
from tests.fixtures.routers import SessionRuns
from tests.fixtures.serving import REPO, ServerThread, start_server_process, subprocess_env, tiny_config, wait_until
from tests.system.test_deploy import COMPOSE, compose_env, k8s_resource, load_yaml
from tests.system.test_node_client import node_client  # noqa: F401  (fixture)

HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
REPLICAS = 3
SESSIONS = 30
TURNS = 5
NEW_TOKENS = 8
BLOCK_SIZE = 8
CONCURRENCY = 6
FOLLOW_UPS = ["Where did you go then?", "What did the teacher say?", "And what did you do?", "Why was that?",
              "Tell me more."]  # fmt: skip
LOG_LINE = re.compile(r" grpc (?P<backend>\w+)/(?P<server>[\w-]+) (?P<status>-?\d+) \S+ session=(?P<session>\S*) ")


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.access(p, os.X_OK)), None)


class HAProxy:
    """``haproxy -db -f CFG`` with the replica addresses in its environment; its log
    lines (stdout) are kept."""

    def __init__(self, cfg: Path, replicas: list[str], metrics_ports: list[int], up: int = REPLICAS,
                 http: list[str] | None = None) -> None:  # fmt: skip
        self.port, self.stats_port, self.http_port = free_port(), free_port(), free_port()
        env = dict(subprocess_env(), GRPC_BIND=f"127.0.0.1:{self.port}", STATS_BIND=f"127.0.0.1:{self.stats_port}",
                   HTTP_BIND=f"127.0.0.1:{self.http_port}")  # fmt: skip
        env.update({f"REPLICA_{i + 1}": r for i, r in enumerate(replicas)})
        # the replicas' HTTP API (a gRPC-only test gives none: the HTTP backends then name the gRPC ports, unused)
        env.update({f"REPLICA_{i + 1}_HTTP": r for i, r in enumerate(http or replicas)})
        env.update({f"REPLICA_{i + 1}_METRICS_PORT": str(p) for i, p in enumerate(metrics_ports)})
        self.proc = subprocess.Popen([haproxy_binary(), "-db", "-f", str(cfg)], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        assert wait_until(lambda: self.servers_up() == up, timeout=30), "".join(self.lines)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def servers_up(self) -> int:
        """How many servers the `any` backend (whose checks the session backend tracks) has UP."""
        assert self.proc.poll() is None, "haproxy exited:\n" + "".join(self.lines)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2) as resp:
                rows = [r.split(",") for r in resp.read().decode().splitlines()[1:]]
        except OSError:
            return 0
        return sum(1 for r in rows if r[0] == "any" and r[1] not in ("FRONTEND", "BACKEND") and r[17] == "UP")

    def calls(self) -> list[dict[str, str]]:
        return [m.groupdict() for line in self.lines if (m := LOG_LINE.search(line))]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@dataclass
class Turn:
    session: str
    index: int
    start: StreamStart
    token_ids: list[int]
    ttft_s: float


@dataclass
class Run(SessionRuns):
    turns: list[Turn] = field(default_factory=list)

    @staticmethod
    def device_hit(prev: Turn, turn: Turn) -> bool:
        """Every full block the previous turn left came from this replica's device pool:
        no restore, no recompute of anything the session had already seen."""
        transcript = prev.start.prompt_tokens + len(prev.token_ids)
        by_tier = turn.start.cached_by_tier
        return by_tier.get("device", 0) >= transcript // BLOCK_SIZE * BLOCK_SIZE and turn.start.cached_tokens == by_tier.get("device", 0)


async def _turn(client: AsyncKVServeClient, session: str, index: int, message: str) -> Turn:
    sent = time.perf_counter()
    start, ttft, tokens = None, None, []
    async for ev in client.generate(messages=[{"role": "user", "content": message}], session_id=session,
                                    require_existing_session=index > 0, max_new_tokens=NEW_TOKENS, ignore_eos=True):
        if isinstance(ev, StreamStart):
            start = ev
        elif isinstance(ev, TextDelta) and ev.token_ids:
            ttft = time.perf_counter() - sent if ttft is None else ttft
            tokens.extend(ev.token_ids)
    assert start is not None and ttft is not None
    return Turn(session, index, start, tokens, ttft)


async def _sessions(address: str, sessions: list[str], turns: range) -> Run:
    """Each session's turns in order; CONCURRENCY sessions at a time."""
    run, gate = Run(), asyncio.Semaphore(CONCURRENCY)
    async with AsyncKVServeClient(address, timeout=120) as client:

        async def one(i: int, sid: str) -> None:
            async with gate:
                for k in turns:
                    msg = f"Hello! I am visitor {sid}. Who are you?" if k == 0 else FOLLOW_UPS[(k - 1 + i) % len(FOLLOW_UPS)]
                    run.turns.append(await _turn(client, sid, k, msg))

        await asyncio.gather(*(one(i, sid) for i, sid in enumerate(sessions)))
    return run


def run_sessions(address: str, sessions: list[str], turns: range) -> Run:
    return asyncio.run(_sessions(address, sessions, turns))


@pytest.fixture(scope="module")
def replicas(redis_server):
    if haproxy_binary() is None:
        pytest.skip("haproxy not installed (.ci/run installs it)")
    with redis_server.client() as c:
        c.flushall()
    args = ["--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--redis-url", redis_server.url,
            "--kv-cache-memory", "32MiB", "--block-size", str(BLOCK_SIZE), "--host-cache-memory", "0", "--spill-after", "50ms",
            "--spill-to", "redis", "--restore-policy", "always", "--torch-threads", "1", "--log-level", "info",
            "--session-store-timeout", "5s"]  # fmt: skip
    started: list = [None] * REPLICAS
    metrics_ports = [free_port() for _ in range(REPLICAS)]
    threads = [threading.Thread(target=lambda i=i: started.__setitem__(
                   i, start_server_process([*args, "--metrics-port", str(metrics_ports[i])])))
               for i in range(REPLICAS)]  # fmt: skip
    for t in threads:  # started together: they load in parallel
        t.start()
    for t in threads:
        t.join()
    procs = [s[0] for s in started if s is not None]
    try:
        assert len(procs) == REPLICAS, "a replica did not start"
        yield [(p, f"127.0.0.1:{port}", m) for (p, port, _), m in zip(started, metrics_ports)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _print_table(rows: list[tuple[str, Run]]) -> None:
    print(f"\n{SESSIONS} sessions x {TURNS} turns, {REPLICAS} replicas behind haproxy, {NEW_TOKENS} new tokens a turn")
    print("| routing | returning turns | device hits (no restore) | TTFT p50 | TTFT p99 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, run in rows:
        print(f"| {name} | {len(run.returning())} | {run.device_share():.1%} | {run.ttft_ms(0.5):.1f} ms "
              f"| {run.ttft_ms(0.99):.1f} ms |")  # fmt: skip


@pytest.fixture
def need_haproxy() -> None:
    if haproxy_binary() is None:
        pytest.skip("haproxy not installed (.ci/run installs it)")


def _haproxy_check(cfg: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([haproxy_binary(), "-c", "-f", str(cfg)], env={**subprocess_env(), **env},
                          capture_output=True, text=True, timeout=30)  # fmt: skip


def test_haproxy_config_is_valid_with_the_compose_environment(need_haproxy, tmp_path):
    env = compose_env(load_yaml(COMPOSE)["services"]["haproxy"])
    result = _haproxy_check(HAPROXY_CFG, env)
    assert result.returncode == 0, result.stdout + result.stderr
    # The compose service names do not resolve here (init-addr none lets it start anyway).
    warnings = [l for l in (result.stdout + result.stderr).splitlines() if "[WARNING]" in l]
    assert all("could not resolve address" in w for w in warnings), warnings
    # Not vacuous: a typo in the balance algorithm and a missing replica address fail.
    bad = tmp_path / "haproxy.cfg"
    bad.write_text(HAPROXY_CFG.read_text().replace("balance hdr(", "balance hrd("))
    assert _haproxy_check(bad, env).returncode != 0
    assert _haproxy_check(HAPROXY_CFG, {k: v for k, v in env.items() if k != "REPLICA_3"}).returncode != 0


def test_compose_replicas_profile_puts_haproxy_in_front_of_three_identical_replicas():
    services = load_yaml(COMPOSE)["services"]
    base = services["kvserve"]
    for name in ("kvserve-2", "kvserve-3"):
        svc = services[name]
        assert svc["profiles"] == ["replicas", "router"] and "ports" not in svc  # reached through a router only
        assert {k: v for k, v in svc.items() if k != "profiles"} == {k: v for k, v in base.items() if k != "ports"}
    proxy = services["haproxy"]
    assert proxy["profiles"] == ["replicas"] and proxy["image"].split(":") == ["haproxy", "2.6"]
    mounts = {m.split(":")[1]: m.split(":")[0] for m in proxy["volumes"]}
    assert (REPO / mounts["/usr/local/etc/haproxy/haproxy.cfg"]).resolve() == HAPROXY_CFG.resolve()
    env = compose_env(proxy)
    grpc_port = compose_env(base)["KVSERVE_PORT"]
    assert [env[f"REPLICA_{i}"] for i in (1, 2, 3)] == [f"{n}:{grpc_port}" for n in ("kvserve", "kvserve-2", "kvserve-3")]
    http_port = compose_env(base)["KVSERVE_HTTP_PORT"]
    assert [env[f"REPLICA_{i}_HTTP"] for i in (1, 2, 3)] == [f"{n}:{http_port}" for n in ("kvserve", "kvserve-2", "kvserve-3")]
    metrics_port = compose_env(base)["KVSERVE_METRICS_PORT"]
    assert [env[f"REPLICA_{i}_METRICS_PORT"] for i in (1, 2, 3)] == [metrics_port] * 3  # the readiness check
    published = {int(p.split(":")[0]): int(p.split(":")[1]) for p in proxy["ports"]}
    assert published[50050] == int(env["GRPC_BIND"].rsplit(":", 1)[1])
    assert published[8080] == int(env["HTTP_BIND"].rsplit(":", 1)[1])
    assert all(proxy["depends_on"][n]["condition"] == "service_healthy" for n in ("kvserve", "kvserve-2", "kvserve-3"))


def _routing_lines(cfg: str) -> list[str]:
    """The lines that decide where a call goes and what a failed connection costs."""
    keys = ("capture ", "use_backend ", "default_backend ", "balance ", "hash-type ", "retries ", "option redispatch",
            "retry-on ", "timeout ", "option httpchk", "http-check ")  # fmt: skip
    seen: list[str] = []  # the k8s config repeats the check in both backends
    for line in cfg.splitlines():
        if line.strip().startswith(keys) and line.strip() not in seen:
            seen.append(line.strip())
    return seen


def test_k8s_router_config_passes_haproxy_check_and_routes_like_the_compose_config(need_haproxy, tmp_path):
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(k8s_resource("ConfigMap", "kvserve-router-config")["data"]["haproxy.cfg"])
    result = _haproxy_check(cfg, {})
    assert result.returncode == 0 and "[WARNING]" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert sorted(_routing_lines(cfg.read_text())) == sorted(_routing_lines(HAPROXY_CFG.read_text()))
    assert "balance hdr(x-kvserve-session)" in _routing_lines(cfg.read_text())


def test_k8s_router_finds_the_kvserve_pods_through_a_headless_service_and_mounts_its_config():
    cfg = k8s_resource("ConfigMap", "kvserve-router-config")["data"]["haproxy.cfg"]
    pods = k8s_resource("Service", "kvserve-pods")
    server = k8s_resource("Deployment", "kvserve")
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    # The SRV records: one per ready kvserve pod, on the port named in the template.
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"]: p["containerPort"] for p in server["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert [p["name"] for p in pods["spec"]["ports"]] == ["grpc", "http"]  # gRPC and the HTTP API
    for port in pods["spec"]["ports"]:
        assert port["targetPort"] in container_ports and port["port"] == container_ports[port["targetPort"]]
    srv = re.findall(r"server-template \S+ \d+ (\S+) ", cfg)
    assert srv and set(srv) == {f"_{p['name']}._tcp.kvserve-pods.default.svc.cluster.local" for p in pods["spec"]["ports"]}
    backends = {b.split()[0]: b for b in re.split(r"\n\s*backend ", cfg)[1:]}
    assert set(backends) == {"sessions", "any", "http-sessions", "http-any"}
    for name, block in backends.items():  # the HTTP backends reach the pods' HTTP port, the others gRPC
        assert f" _{'http' if name.startswith('http-') else 'grpc'}._tcp." in block.split("frontend")[0], name
    # The router: its Service selects its pods only; the config is mounted where the image reads it.
    router = k8s_resource("Deployment", "kvserve-router")
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    svc = k8s_resource("Service", "kvserve-router")
    assert svc["spec"]["selector"].items() <= router_labels.items()
    assert not svc["spec"]["selector"].items() <= pod_labels.items()
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["image"].split(":")[0] == "haproxy"
    (mount,) = container["volumeMounts"]
    (volume,) = router["spec"]["template"]["spec"]["volumes"]
    assert mount["name"] == volume["name"] and volume["configMap"]["name"] == "kvserve-router-config"
    assert mount["mountPath"] == "/usr/local/etc/haproxy"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert f"bind :{ports[svc['spec']['ports'][0]['targetPort']]} proto h2" in cfg
    assert f"bind :{ports[container['readinessProbe']['httpGet']['port']]}" in cfg
    assert f"if {{ path {container['readinessProbe']['httpGet']['path']} }}" in cfg


def test_every_client_sends_the_session_metadata_the_proxy_hashes_on(need_haproxy, tiny_llama_dir, node_client):
    from kvserve.clients.chat import main as chat_main

    tag = uuid.uuid4().hex[:6]
    with ServerThread(tiny_config(tiny_llama_dir, metrics_port=free_port())) as server:
        metrics_port = server.running.metrics_port
        proxy = HAProxy(HAPROXY_CFG, [server.address] * REPLICAS, [metrics_port] * REPLICAS)  # three names, one replica
        try:
            with KVServeClient(proxy.address, timeout=60) as c:
                c.chat(f"py-{tag}", "hello", max_new_tokens=2)
                c.get_session(f"py-{tag}")
                c.delete_session(f"py-{tag}")
                c.complete(text="no session", max_new_tokens=2)

            async def async_turn() -> None:
                async with AsyncKVServeClient(proxy.address, timeout=60) as c:
                    await c.chat(f"aio-{tag}", "hello", max_new_tokens=2)

            asyncio.run(async_turn())
            assert chat_main(["--address", proxy.address, "--session", f"chat-{tag}", "--max-new-tokens", "2"],
                             stdin=io.StringIO("hello\n"), stdout=io.StringIO()) == 0  # fmt: skip
            node = subprocess.run([*node_client, "--address", proxy.address, "--session", f"node-{tag}",
                                   "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)  # fmt: skip
            assert node.returncode == 0, node.stdout + node.stderr
            assert wait_until(lambda: len(proxy.calls()) >= 10, timeout=10)
            calls = proxy.calls()
        finally:
            proxy.stop()
    routed = [(c["backend"], c["session"]) for c in calls]
    assert routed.count(("sessions", f"py-{tag}")) == 3  # Generate, GetSession, DeleteSession
    assert ("any", "-") in routed  # the one-off call
    assert ("sessions", f"aio-{tag}") in routed
    assert ("sessions", f"chat-{tag}") in routed
    assert routed.count(("sessions", f"node-{tag}")) == 2  # its two turns
    assert all(c["status"] == "200" for c in calls)


@pytest.mark.slow
def test_a_draining_replica_leaves_the_proxy_before_it_refuses_a_call(need_haproxy, tiny_llama_dir, redis_url):
    """SIGTERM-style drain (``running.shutdown``) of one replica while a long stream runs
    on it: with --drain-delay the proxy's readiness check takes it out while it still
    serves, so no turn of its sessions meets its UNAVAILABLE; the long stream finishes."""
    cfg = dict(redis_url=redis_url, host_cache_memory=0, spill_after=0.05, spill_to=("redis",), drain_delay=2.0,
               drain_timeout=30.0, kv_cache_memory=4 << 20, session_store_timeout=5.0)  # fmt: skip
    # (a generous session-store timeout: on a loaded 2-core machine 0.3 s Redis calls time
    # out, the record stays on the replica that served the turn, and the moved turn is NOT_FOUND)
    servers = [ServerThread(tiny_config(tiny_llama_dir, metrics_port=free_port(), **cfg)) for _ in range(REPLICAS)]
    for s in servers:
        s.__enter__()
    proxy = HAProxy(HAPROXY_CFG, [s.address for s in servers], [s.running.metrics_port for s in servers])
    tag = uuid.uuid4().hex[:6]
    try:
        sessions = [f"drain-{tag}-{i}" for i in range(12)]
        run_sessions(proxy.address, sessions, range(1))
        assert wait_until(lambda: len(proxy.calls()) >= len(sessions), timeout=10)
        home = {c["session"]: c["server"] for c in proxy.calls()}
        victim = home[sessions[0]]
        index = int(victim.rsplit("-", 1)[1]) - 1
        moved = [sid for sid in sessions if home[sid] == victim]

        long_stream: list = []
        with KVServeClient(servers[index].address, timeout=120) as direct:
            stream = direct.generate(text="a long story", max_new_tokens=500, ignore_eos=True)
            events = iter(stream)
            next(events)  # started: in flight when the drain begins
            drain = threading.Thread(target=lambda: servers[index].call(servers[index].running.shutdown()), daemon=True)
            drain.start()
            # Turns keep coming while the replica drains; none may meet its refusal.
            deadline = time.monotonic() + 6
            k = 1
            while time.monotonic() < deadline and k <= 8:  # 8 turns keep the transcripts in context
                run_sessions(proxy.address, moved, range(k, k + 1))
                k += 1
                time.sleep(0.4)
            long_stream.extend(events)
            drain.join(timeout=60)
        assert proxy.servers_up() == REPLICAS - 1
        after = [c for c in proxy.calls() if c["session"] in moved]
        assert all(c["status"] == "200" for c in after)
        assert sum(len(ev.token_ids) for ev in long_stream if isinstance(ev, TextDelta)) > 0
        assert any(type(ev).__name__ == "StreamEnd" for ev in long_stream)
    finally:
        proxy.stop()
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_session_affinity_through_haproxy_and_a_killed_replica(replicas, tmp_path):
    addresses = [a for _, a, _ in replicas]
    metrics_ports = [m for _, _, m in replicas]
    tag = uuid.uuid4().hex[:6]

    # 1. Session-affine: the config as shipped.
    proxy = HAProxy(HAPROXY_CFG, addresses, metrics_ports)
    try:
        affine_ids = [f"aff-{tag}-{i}" for i in range(SESSIONS)]
        affine = run_sessions(proxy.address, affine_ids, range(TURNS))
        with KVServeClient(proxy.address, timeout=60) as c:  # a one-off call: no session metadata
            c.complete(text="a one-off prompt", max_new_tokens=2)
        # haproxy logs a call when its stream closes, just after the client has its end
        assert wait_until(lambda: len(proxy.calls()) >= SESSIONS * TURNS + 1, timeout=10)
        calls = proxy.calls()
    finally:
        proxy.stop()
    by_session: dict[str, set[str]] = {}
    for call in calls:
        if call["session"] != "-":
            assert call["backend"] == "sessions"
            by_session.setdefault(call["session"], set()).add(call["server"])
    assert set(by_session) == set(affine_ids)
    assert all(len(servers) == 1 for servers in by_session.values()), by_session
    assert len(set().union(*by_session.values())) == REPLICAS  # the hash spreads sessions over all three
    assert [c["backend"] for c in calls if c["session"] == "-"] == ["any"]
    assert affine.device_share() >= 0.95, affine.device_share()

    # 2. The same run with a session-blind balancer in place of the session hash: 1/N.
    text = HAPROXY_CFG.read_text()
    assert text.count("    balance hdr(x-kvserve-session)\n") == 1
    rr_cfg = tmp_path / "haproxy-random.cfg"
    rr_cfg.write_text(text.replace("    balance hdr(x-kvserve-session)\n", "    balance random(1)\n"))
    proxy = HAProxy(rr_cfg, addresses, metrics_ports)
    try:
        rr = run_sessions(proxy.address, [f"rr-{tag}-{i}" for i in range(SESSIONS)], range(TURNS))
    finally:
        proxy.stop()
    assert rr.device_share() < 0.55, rr.device_share()  # 1/3 expected; 0.55 is 5 standard deviations off
    _print_table([("session hash (deploy/haproxy/haproxy.cfg)", affine), ("session-blind (balance random(1))", rr)])

    # 3. One replica is killed between turns: the session-affine proxy moves its sessions.
    proxy = HAProxy(HAPROXY_CFG, addresses, metrics_ports)
    try:
        victim = next(iter(by_session[affine_ids[0]]))
        index = int(victim.rsplit("-", 1)[1]) - 1
        replicas[index][0].send_signal(signal.SIGKILL)
        replicas[index][0].wait(timeout=10)
        moved = {sid for sid, servers in by_session.items() if victim in servers}
        after = run_sessions(proxy.address, affine_ids, range(TURNS, TURNS + 1))  # no call fails
        survivors = [a for i, a in enumerate(addresses) if i != index]
        with KVServeClient(survivors[0], timeout=120) as direct:
            prompts = {}
            for t in after.turns:
                transcript = direct.get_session(t.session, include_token_ids=True).token_ids
                assert transcript[-len(t.token_ids) :] == t.token_ids
                prompts[t.session] = transcript[: -len(t.token_ids)]
            # Cold: the same prompt under a fresh cache salt shares no block with anything.
            cold = {sid: direct.complete(token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                         cache_salt=f"cold-{tag}-{sid}") for sid, p in prompts.items()}  # fmt: skip
        assert wait_until(lambda: proxy.servers_up() == REPLICAS - 1, timeout=30)
    finally:
        proxy.stop()
    assert moved and len(after.turns) == SESSIONS
    for t in after.turns:
        assert cold[t.session].start.cached_tokens == 0
        assert t.token_ids == cold[t.session].token_ids, t.session
        if t.session in moved:  # restored from Redis on the replica it moved to
            assert t.start.cached_by_tier.get("redis", 0) > 0, (t.session, t.start)
