"""Soak and fault test: many concurrent multi-turn sessions against one server, with
small device and host budgets (idle sessions spill to Redis), optionally with faults.

    python bench/soak.py                          # 32 clients, 300 s
    python bench/soak.py --ci                     # 32 clients, 60 s
    python bench/soak.py --faults                 # + Redis restart, down, frozen, flushed; server SIGKILL; a deploy while Redis is frozen
    python bench/soak.py --store disk --faults    # no Redis: records directory unwritable; a deploy; server SIGKILL
    python bench/soak.py --store redis-no-disk --faults   # Redis without a disk directory (no journal): the comparison
    python bench/soak.py --duration 45 --clients 8 --faults --redis-down 3 --redis-freeze 3 --json out.json

The server (``python -m kvserve.service``) and Redis (a private ``redis-server``) are child
processes, so both can be killed. The server has a disk directory (``--disk-cache-dir``:
the disk tier, and the session journal with Redis, or the session record files with
``--store disk``, which runs it without Redis). Each client runs sessions of a few turns:
random token-id input, greedy generation, a short think time; it keeps its own copy of the
transcript (every prompt and output token it sent and received) and checks it against
the server's at the end of each session and after a fault. Half of the sessions are
deleted when done.

Faults (``--faults``), each at its share of the run and after the previous one's window
ended (a restarted server holds its sessions again once their clients came back).
With Redis (``--store redis``, the default):

* Redis restarted (its data is gone: no persistence), at 8 %;
* Redis killed (SIGKILL) and kept down for ``--redis-down`` seconds, at 18 %;
* Redis frozen (SIGSTOP) for ``--redis-freeze`` seconds, then resumed (SIGCONT): a hang,
  like a network partition, where calls time out instead of being refused, at 30 %;
* FLUSHALL: every session record, turn lock and block in Redis gone at once, with turns
  in flight, at 40 %;
* the server killed with SIGKILL and restarted on the same port, at 48 %: sessions resume
  from their Redis transcripts; turns in flight at the kill fail at the client (UNAVAILABLE)
  and are counted as lost; a turn the server committed just before dying but whose end
  the client never saw is counted apart ("committed, unacknowledged");
* a deploy while Redis is frozen, at 66 % (the issue's attack): Redis SIGSTOPped, turns
  acknowledged for half of ``--redis-freeze`` (on the server's copy and its session
  journal), the server stopped with SIGTERM (its drain waits for Redis, then leaves the
  rest in the journal), Redis resumed (SIGCONT), the server started again (it replays the
  journal and writes it to Redis).

Without Redis (``--store disk``):

* the session records directory unwritable (replaced by a file) for ``--unwritable``
  seconds, at 15 %: every turn asked meanwhile fails (UNAVAILABLE, nothing recorded);
* a deploy (SIGTERM, started again), at 40 %;
* the server killed with SIGKILL and started again, at 65 %.

Every acknowledged turn must be in the server's transcript afterwards: "acknowledged turns
lost" counts those missing (a session gone counts all of its turns).

Figures: requests served, errors by status (outside fault windows and inside them),
tokens/s, p50/p99 time to first token (client side), cached prompt tokens by tier,
server anonymous resident memory over time (growth after warm-up, per server incarnation), the
block pool at the end, transcripts equal to the clients' copies, and greedy outputs
equal to a fresh cold server's for a sample of turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvserve.clients import AsyncKVServeClient, KVServeError, StreamEnd, StreamStart, TextDelta  # noqa: E402
from tests.fixtures.redis_server import RedisProcess, free_port, start_redis_server  # noqa: E402
from tests.fixtures.serving import start_server_process  # noqa: E402

PACKAGED_MODEL = REPO / "service" / "default_model"
TINY_MODEL = REPO / "bench" / "out" / "models" / "soak-tiny"
CHANNEL_OPTIONS = [  # reconnect quickly after the server restarts
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
STORE_WORDS = {"redis": "Redis + disk journal", "disk": "disk, no Redis", "redis-no-disk": "Redis, no disk directory"}
CALL_TIMEOUT_S = 120.0  # a call this slow is reported as DEADLINE_EXCEEDED, not waited for


@dataclass
class SoakConfig:
    duration_s: float = 300.0
    clients: int = 32
    faults: bool = False
    store: str = "redis"  # "redis": Redis + a disk directory (journal); "disk": no Redis, record files;
    # "redis-no-disk": Redis alone (no journal; the comparison)
    redis_down_s: float = 10.0
    redis_freeze_s: float = 10.0
    unwritable_s: float = 5.0  # --store disk: the records directory stays unwritable this long
    drain_s: float = 5.0  # the server's --drain-timeout
    model: str | None = None
    block_size: int = 16
    device_tokens: int = 0  # device KV pool, in tokens (0: 96 per client, well below the transcripts)
    host_tokens: int = 0  # host tier, in tokens (0: 32 per client)
    disk_tokens: int = 0  # disk tier, in tokens (0: 64 per client)
    turns: tuple[int, int] = (4, 8)  # turns per session (transcripts up to 8 * 40 tokens)
    input_tokens: tuple[int, int] = (8, 24)  # new tokens per turn
    output_tokens: tuple[int, int] = (8, 16)  # max_new_tokens per turn
    think_s: float = 0.5  # mean pause between turns (exponential)
    session_lock_ttl_s: float = 5.0
    # "always": restore every host/Redis hit. The server's default ("auto") skips tiers
    # slower than recomputing, which on a tiny model is every tier: nothing to test.
    restore_policy: str = "always"
    check_turns: int = 64  # turns replayed on a cold server
    seed: int = 0


# ----------------------------------------------------------------------------- records


@dataclass
class TurnRecord:
    prompt: list[int]
    output: list[int]
    max_new_tokens: int


@dataclass
class Window:
    kind: str  # "redis-restart" | "redis-down" | "redis-freeze" | "redis-flushall" | "server-kill" |
    # "deploy-redis-frozen" | "records-unwritable" | "server-deploy"
    start: float
    end: float = float("inf")


@dataclass
class Figures:
    turns_ok: int = 0
    calls: int = 0
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    ttft_by_window: dict[str, list[float]] = field(default_factory=dict)  # window of the send -> TTFTs
    cached_by_tier: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    errors: Counter = field(default_factory=Counter)  # (window kind or "none", code) -> n
    overload: int = 0  # RESOURCE_EXHAUSTED (explicit overload), retried
    busy_retries: int = 0  # FAILED_PRECONDITION (turn lock still leased after a crash), retried
    lost_in_flight: int = 0  # turns whose stream had started when the server died
    refused_while_down: int = 0  # turns that failed before their first event (server down)
    committed_unacked: int = 0
    sessions: int = 0
    sessions_verified: int = 0
    sessions_deleted: int = 0
    transcript_mismatches: int = 0
    sessions_lost: int = 0  # NOT_FOUND for a session that had completed turns
    acked_turns_lost: int = 0  # acknowledged turns missing from the server's transcript
    kept_checked: int = 0  # sessions that ended undeleted, read again at the end of the run
    kept_mismatches: int = 0  # of those, not as they ended
    prompt_mismatches: int = 0  # start.prompt_tokens != client's count
    sample: list[TurnRecord] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)  # details of any mismatch (first 50)
    rss: list[tuple[float, float, int]] = field(default_factory=list)  # (t, RssAnon MiB, incarnation)


class Soak:
    def __init__(self, cfg: SoakConfig, model_dir: Path, workdir: Path) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.workdir = workdir
        self.fig = Figures()
        self.windows: list[Window] = []
        self.rng = random.Random(cfg.seed)
        self.port = free_port()
        self.metrics_port = free_port()
        self.redis: RedisProcess | None = None
        self.server: subprocess.Popen | None = None
        self.incarnation = 0
        self.server_up = asyncio.Event()
        self.t0 = 0.0
        self.vocab = 0
        self.model_info: Any = None
        self.history: dict[str, list[str]] = {}  # per session: what happened, for anomaly reports
        self.server_logs: list[list[str]] = []  # stderr lines of each server incarnation
        self.deploy_exit_codes: list[int] = []  # the status each deploy's SIGTERM ended with
        self.kept: dict[str, tuple[list[int], list[int]]] = {}  # ended, undeleted: transcript, turn ends
        self.disk_dir = workdir / "disk"

    # ---- processes ---------------------------------------------------------------------

    def server_args(self) -> list[str]:
        bpt = kv_bytes_per_token(self.model_dir)
        c = self.cfg
        store = ["--redis-url", self.redis.url, "--spill-to", "host,redis"] if self.redis else ["--spill-to", "host,disk"]
        if c.store != "redis-no-disk":
            store += ["--disk-cache-dir", str(self.disk_dir),
                      "--disk-cache-size", str((c.disk_tokens or 64 * c.clients) * bpt)]  # fmt: skip
        return [
            "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
            "--dtype", "float32", "--block-size", str(c.block_size),
            "--kv-cache-memory", str((c.device_tokens or 96 * c.clients) * bpt),
            "--host-cache-memory", str((c.host_tokens or 32 * c.clients) * bpt),
            *store, "--spill-after", "1s",
            "--max-num-seqs", str(max(c.clients, 1)), "--metrics-port", str(self.metrics_port),
            "--session-lock-ttl", f"{c.session_lock_ttl_s}s", "--drain-timeout", f"{c.drain_s}s", "--log-level", "info",
            "--restore-policy", c.restore_policy,
        ]  # fmt: skip

    def start_server(self) -> None:
        self.server, _, log_lines = start_server_process(self.server_args())
        self.server_logs.append(log_lines)
        self.incarnation += 1
        self.server_up.set()

    def kill_server(self) -> None:
        self.server_up.clear()
        assert self.server is not None
        self.server.send_signal(signal.SIGKILL)
        self.server.wait()

    def deploy_server(self) -> None:
        """SIGTERM (the drain runs: in-flight turns finish, new calls are refused), then
        the server started again on the same port and directory."""
        self.server_up.clear()
        assert self.server is not None
        self.deploy_exit_codes.append(self._stop_server())
        self.start_server()

    # ---- the run -------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        # A private copy: the soak, the restarted server and the cold check all load the
        # same bytes even if the model directory is rewritten meanwhile.
        self.model_dir = Path(shutil.copytree(self.model_dir, self.workdir / "model"))
        if self.cfg.store != "disk":
            self.redis = start_redis_server(self.workdir / "redis", port=free_port())
        try:
            await asyncio.to_thread(self.start_server)
            async with AsyncKVServeClient(self._address(), timeout=60) as c:
                self.model_info = await c.model_info()
            self.vocab = self.model_info.vocab_size
            self.blocks_total = await self._metric_blocks()
            self.t0 = time.monotonic()
            deadline = self.t0 + self.cfg.duration_s
            tasks = [asyncio.create_task(self._rss_sampler(deadline))]
            if self.cfg.faults:
                faults = self._redis_faults() if self.redis is not None else self._disk_faults()
                tasks.append(asyncio.create_task(faults))
            await asyncio.gather(*(self._client(i, deadline) for i in range(self.cfg.clients)))
            wall = time.monotonic() - self.t0
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.server_up.wait()
            await self._verify_kept()
            pool = await self._pool_at_end()
            exit_code = await asyncio.to_thread(self._stop_server)
        finally:
            if self.server is not None and self.server.poll() is None:
                self.server.kill()
            if self.redis is not None:
                self.redis.stop()
        cold = await self._cold_check()
        return self._report(wall, pool, exit_code, cold)

    def _address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _stop_server(self) -> int:
        assert self.server is not None
        self.server.send_signal(signal.SIGTERM)
        return self.server.wait(60)

    def _window(self, now: float) -> str:
        for w in self.windows:
            if w.start <= now <= w.end:
                return w.kind
        return "none"

    async def _redis_faults(self) -> None:
        d, c = self.cfg.duration_s, self.cfg
        assert self.redis is not None
        await self._at(0.08 * d)
        w = Window("redis-restart", time.monotonic())
        self.windows.append(w)
        await asyncio.to_thread(self.redis.stop)
        await asyncio.to_thread(self.redis.start)
        w.end = time.monotonic() + 2.0

        await self._at(0.18 * d)
        w = Window("redis-down", time.monotonic())
        self.windows.append(w)
        proc = self.redis._proc  # SIGKILL: no shutdown, no goodbye to clients
        assert proc is not None
        proc.kill()
        proc.wait()
        await asyncio.sleep(c.redis_down_s)
        await asyncio.to_thread(self.redis.start)
        w.end = time.monotonic() + 2.0

        await self._at(0.30 * d)
        w = Window("redis-freeze", time.monotonic())
        self.windows.append(w)
        proc = self.redis._proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)  # hung: connections accepted, nothing answered
        try:
            await asyncio.sleep(c.redis_freeze_s)
        finally:
            proc.send_signal(signal.SIGCONT)
        w.end = time.monotonic() + 2.0

        await self._at(0.40 * d)
        w = Window("redis-flushall", time.monotonic())
        self.windows.append(w)
        await asyncio.to_thread(self._flushall)
        w.end = time.monotonic() + 2.0

        await self._at(0.48 * d)
        await self._server_kill(c.session_lock_ttl_s + 2.0)  # its turn locks stay leased until their TTL

        await self._at(0.66 * d)
        w = Window("deploy-redis-frozen", time.monotonic())
        self.windows.append(w)
        proc = self.redis._proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(c.redis_freeze_s / 2)  # turns acknowledged on the server's copy and journal
            self.server_up.clear()
            code = await asyncio.to_thread(self._stop_server)  # the drain waits for Redis; the rest stays in the journal
            self.deploy_exit_codes.append(code)
        finally:
            proc.send_signal(signal.SIGCONT)  # the order: Redis resumed, then the server restarted
        await asyncio.to_thread(self.start_server)  # replays the journal, writes it to Redis
        # the old server's lock writes Redis applies late hold those sessions for their lease
        w.end = time.monotonic() + c.session_lock_ttl_s + 2.0

    async def _server_kill(self, after_s: float) -> None:
        w = Window("server-kill", time.monotonic())
        self.windows.append(w)
        self.kill_server()
        await asyncio.to_thread(self.start_server)
        w.end = time.monotonic() + after_s

    async def _disk_faults(self) -> None:
        d, c = self.cfg.duration_s, self.cfg
        records = self.disk_dir / "sessions"
        await self._at(0.15 * d)
        w = Window("records-unwritable", time.monotonic())
        self.windows.append(w)
        aside = records.with_name("sessions.aside")
        records.rename(aside)  # replaced by a file: no write there succeeds, also for root
        records.write_text("not a directory")
        try:
            await asyncio.sleep(c.unwritable_s)
        finally:
            records.unlink()
            aside.rename(records)
        w.end = time.monotonic() + 1.0

        await self._at(0.40 * d)
        w = Window("server-deploy", time.monotonic())
        self.windows.append(w)
        await asyncio.to_thread(self.deploy_server)
        w.end = time.monotonic() + 2.0

        await self._at(0.65 * d)
        await self._server_kill(2.0)  # no Redis: its turn locks died with it

    def _flushall(self) -> None:
        assert self.redis is not None
        with self.redis.client(socket_timeout=10) as r:
            r.flushall()

    async def _at(self, offset_s: float) -> None:
        """Wait until ``offset_s`` into the run, and until the previous fault's window has
        ended (a restarted server holds the sessions again once their clients came back)."""
        start = self.t0 + offset_s
        if self.windows:
            start = max(start, self.windows[-1].end)
        await asyncio.sleep(max(0.0, start - time.monotonic()))

    async def _rss_sampler(self, deadline: float) -> None:
        while True:
            proc = self.server
            if proc is not None and proc.poll() is None:
                rss = rss_mib(proc.pid)
                if rss is not None:
                    self.fig.rss.append((time.monotonic() - self.t0, rss, self.incarnation))
            await asyncio.sleep(1.0)

    async def _metric_blocks(self) -> dict[str, float]:
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        )
        out: dict[str, float] = {}
        for line in body.splitlines():
            for name in ("kvserve_kv_blocks{state=\"free\"}", "kvserve_kv_blocks{state=\"used\"}",
                         "kvserve_running_sequences", "kvserve_waiting_sequences"):  # fmt: skip
                if line.startswith(name + " "):
                    out[name] = float(line.split()[-1])
        return out

    async def _pool_at_end(self) -> dict[str, float]:
        """Blocks once nothing runs and the background writes are through: every block
        free or evictable cache (baseline). An idle session's spill (``--spill-after``)
        holds a reference on its device blocks until the writer has copied them, so a
        spill that began as the last turns ended leaves blocks in use for a moment; a
        block that stays in use past the deadline is a leak."""
        t0 = time.monotonic()
        first_quiet: float | None = None  # blocks in use when nothing ran any more
        while True:
            m = await self._metric_blocks()
            used = m.get('kvserve_kv_blocks{state="used"}', 1)
            quiet = m.get("kvserve_running_sequences", 1) == 0 and m.get("kvserve_waiting_sequences", 1) == 0
            if quiet and first_quiet is None:
                first_quiet = used
            if (quiet and used == 0) or time.monotonic() > t0 + 15.0:
                return {**m, "used_when_quiet": first_quiet if first_quiet is not None else used,
                        "settle_s": time.monotonic() - t0}  # fmt: skip
            await asyncio.sleep(0.1)

    # ---- one client ----------------------------------------------------------------------

    async def _client(self, i: int, deadline: float) -> None:
        rng = random.Random(self.cfg.seed * 1000 + i)
        n = 0
        async with AsyncKVServeClient(self._address(), timeout=CALL_TIMEOUT_S, options=CHANNEL_OPTIONS) as client:
            while time.monotonic() < deadline:
                sid = f"soak-{i}-{n}"
                n += 1
                await self._session(client, sid, rng, deadline)

    async def _session(self, client: AsyncKVServeClient, sid: str, rng: random.Random, deadline: float) -> None:
        c, fig = self.cfg, self.fig
        fig.sessions += 1
        mine: list[int] = []  # the client's copy of the transcript
        marks: list[int] = []  # its length after each acknowledged turn
        turns = rng.randint(*c.turns)
        done = 0
        while done < turns and time.monotonic() < deadline:
            new = [rng.randrange(3, self.vocab) for _ in range(rng.randint(*c.input_tokens))]
            max_new = rng.randint(*c.output_tokens)
            result = await self._turn(client, sid, mine, new, max_new)
            status, output, prompt_ok = result
            if status == "ok" and not prompt_ok:
                # The server built this turn on another transcript than ours: earlier turns
                # are gone. Count them once, then go on from the server's copy.
                mine, marks = await self._after_loss(client, sid, mine, marks, new, output)
            elif status == "ok":
                if len(fig.sample) < 4 * c.check_turns and rng.random() < 0.5:
                    fig.sample.append(TurnRecord(mine + new, list(output), max_new))
                mine = mine + new + output
                marks.append(len(mine))
            else:
                # The call failed: refused, or cut mid-stream, or even after the server
                # committed the turn (its end never reached us). The server's copy says which.
                mine, marks = await self._resync(client, sid, mine, marks, new, output)
            done += 1
            await asyncio.sleep(rng.expovariate(1.0 / c.think_s) if c.think_s else 0.0)
        if not done:
            return
        server_copy = await self._get_transcript(client, sid)
        if server_copy is None and not marks:
            return  # no turn of it was ever acknowledged (all refused): there is nothing to have
        if server_copy is None:
            fig.sessions_lost += 1
            fig.acked_turns_lost += len(marks)
            self._anomaly("session lost at its end", sid, mine=len(mine))
        elif server_copy == mine:
            fig.sessions_verified += 1
        else:
            fig.transcript_mismatches += 1
            fig.acked_turns_lost += _turns_missing(marks, mine, server_copy)
            self._anomaly("transcript at session end", sid, mine=len(mine), server=len(server_copy),
                          common=common_prefix(mine, server_copy))  # fmt: skip
        if rng.random() < 0.5:
            await self._call(lambda: client.delete_session(sid))
            fig.sessions_deleted += 1
        elif server_copy is not None:
            self.kept[sid] = (server_copy, marks if server_copy == mine else [len(server_copy)])

    async def _turn(
        self, client: AsyncKVServeClient, sid: str, mine: list[int], new: list[int], max_new: int
    ) -> tuple[str, list[int], bool]:
        """One turn, retried on explicit overload and on a leased lock. Returns
        ("ok" or "failed", the output received, whether the prompt count was ours)."""
        fig = self.fig
        while True:
            await self.server_up.wait()
            started = False
            prompt_ok = False
            output: list[int] = []
            t_send = time.monotonic()
            fig.calls += 1
            try:
                async for ev in client.generate(token_ids=new, session_id=sid, max_new_tokens=max_new):
                    if isinstance(ev, StreamStart):
                        started = True
                        prompt_ok = ev.prompt_tokens == len(mine) + len(new)
                        if not prompt_ok:
                            fig.prompt_mismatches += 1
                            self._anomaly("prompt", sid, expected=len(mine) + len(new), got=ev.prompt_tokens)
                        fig.prompt_tokens += ev.prompt_tokens
                        for tier, k in ev.cached_by_tier.items():
                            fig.cached_by_tier[tier] += k
                    elif isinstance(ev, TextDelta) and ev.token_ids:
                        if not output:
                            fig.ttft_s.append(time.monotonic() - t_send)
                            fig.ttft_by_window.setdefault(self._window(t_send), []).append(time.monotonic() - t_send)
                        output.extend(ev.token_ids)
                    elif isinstance(ev, StreamEnd):
                        fig.tokens += ev.completion_tokens
                fig.turns_ok += 1
                self._note(sid, f"ok prompt={len(mine) + len(new)} out={len(output)}")
                return "ok", output, prompt_ok
            except KVServeError as e:
                where = self._window(time.monotonic())
                fig.errors[(where, e.code.name)] += 1
                self._note(sid, f"{e.code.name} started={started} out={len(output)} {e.details[:60]!r}")
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    fig.overload += 1
                    await asyncio.sleep(0.2)
                    continue
                if e.code == grpc.StatusCode.FAILED_PRECONDITION:
                    fig.busy_retries += 1
                    await asyncio.sleep(0.5)
                    continue
                if started:
                    fig.lost_in_flight += 1
                else:
                    fig.refused_while_down += 1
                    await asyncio.sleep(0.3)
                return "failed", output, prompt_ok

    async def _get_transcript(self, client: AsyncKVServeClient, sid: str) -> list[int] | None:
        while True:
            await self.server_up.wait()
            try:
                return (await client.get_session(sid, include_token_ids=True)).token_ids
            except KVServeError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    return None
                self.fig.errors[(self._window(time.monotonic()), e.code.name)] += 1
                await asyncio.sleep(0.3)

    async def _resync(
        self, client: AsyncKVServeClient, sid: str, mine: list[int], marks: list[int], new: list[int],
        partial: list[int],
    ) -> tuple[list[int], list[int]]:
        """After a cut turn: the server either has the transcript as before the turn, or
        committed it (then what the client saw must be a prefix of the output). Returns the
        transcript to go on from and its acknowledged-turn marks."""
        fig = self.fig
        server_copy = await self._get_transcript(client, sid)
        self._note(sid, f"resync mine={len(mine)} server={None if server_copy is None else len(server_copy)}")
        if server_copy is None:
            if mine:
                fig.sessions_lost += 1
                fig.acked_turns_lost += len(marks)
                self._anomaly("session lost after a failed turn", sid, mine=len(mine))
            return [], []
        if server_copy == mine:
            return mine, marks
        head = mine + new
        if server_copy[: len(head)] == head and server_copy[len(head) : len(head) + len(partial)] == partial:
            fig.committed_unacked += 1
            return server_copy, [*marks, len(server_copy)]
        fig.transcript_mismatches += 1
        fig.acked_turns_lost += _turns_missing(marks, mine, server_copy)
        self._anomaly("transcript after a failed turn", sid, mine=len(mine), new=len(new), partial=len(partial),
                      server=len(server_copy), common=common_prefix(head, server_copy))  # fmt: skip
        return server_copy, [m for m in marks if m <= common_prefix(mine, server_copy)]

    async def _verify_kept(self) -> None:
        """At the end of the run, every session that ended undeleted is read again: the
        faults after it ended (a Redis restart or FLUSHALL, a server crash, a deploy) must
        not have taken any of its acknowledged turns."""
        fig = self.fig
        async with AsyncKVServeClient(self._address(), timeout=CALL_TIMEOUT_S, options=CHANNEL_OPTIONS) as client:
            for sid, (mine, marks) in self.kept.items():
                server_copy = await self._get_transcript(client, sid)
                fig.kept_checked += 1
                if server_copy == mine:
                    continue
                fig.kept_mismatches += 1
                lost = len(marks) if server_copy is None else _turns_missing(marks, mine, server_copy)
                fig.acked_turns_lost += lost
                self._anomaly("ended session read again at the end of the run", sid, mine=len(mine),
                              server=None if server_copy is None else len(server_copy), turns_lost=lost)  # fmt: skip

    async def _after_loss(
        self, client: AsyncKVServeClient, sid: str, mine: list[int], marks: list[int], new: list[int],
        output: list[int],
    ) -> tuple[list[int], list[int]]:
        """A turn acknowledged on a transcript other than the client's: the acknowledged
        turns the server's prompt lacks are lost (counted once); the client goes on from
        the server's copy, this turn included."""
        fig = self.fig
        server_copy = await self._get_transcript(client, sid)
        if server_copy is None:  # gone again since (deleted by no one: lost)
            fig.sessions_lost += 1
            fig.acked_turns_lost += len(marks) + 1
            return [], []
        base = server_copy[: max(0, len(server_copy) - len(new) - len(output))]  # what the turn extended
        fig.transcript_mismatches += 1
        lost = _turns_missing(marks, mine, base)
        fig.acked_turns_lost += lost
        self._anomaly("turn acknowledged on another transcript", sid, mine=len(mine), server=len(base),
                      common=common_prefix(mine, base), turns_lost=lost)  # fmt: skip
        common = common_prefix(mine, base)
        return server_copy, [*(m for m in marks if m <= common), len(server_copy)]

    def _anomaly(self, kind: str, sid: str, **details: Any) -> None:
        if len(self.fig.anomalies) < 50:
            now = time.monotonic()
            self.fig.anomalies.append({
                "kind": kind, "session": sid, "t": round(now - self.t0, 2), "window": self._window(now), **details,
                "history": self.history.get(sid, [])[-12:],
            })  # fmt: skip

    def _note(self, sid: str, what: str) -> None:
        self.history.setdefault(sid, []).append(f"{time.monotonic() - self.t0:.2f} {what}")

    async def _call(self, fn) -> Any:
        for _ in range(50):
            await self.server_up.wait()
            try:
                return await fn()
            except KVServeError as e:
                if e.code == grpc.StatusCode.NOT_FOUND:
                    return None
                self.fig.errors[(self._window(time.monotonic()), e.code.name)] += 1
                await asyncio.sleep(0.3)
        return None

    # ---- the cold check ------------------------------------------------------------------

    async def _cold_check(self) -> dict[str, int]:
        """Replay a sample of turns on a fresh server with no cache tiers: greedy
        outputs must be equal token for token."""
        sample = self.rng.sample(self.fig.sample, min(self.cfg.check_turns, len(self.fig.sample)))
        if not sample:
            return {"checked": 0, "mismatches": 0}
        args = ["--model", str(self.model_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
                "--dtype", "float32", "--block-size", str(self.cfg.block_size), "--kv-cache-memory", "64MiB",
                "--host-cache-memory", "0", "--log-level", "info"]  # fmt: skip
        proc, port, _ = await asyncio.to_thread(start_server_process, args)
        mismatches = 0
        try:
            async with AsyncKVServeClient(f"127.0.0.1:{port}", timeout=CALL_TIMEOUT_S) as c:
                fingerprint = (await c.model_info()).model_fingerprint
                assert fingerprint == self.model_info.model_fingerprint, "the cold server loaded other weights"
                sem = asyncio.Semaphore(8)

                async def one(k: int, rec: TurnRecord) -> bool:
                    async with sem:  # a salt per replay: replays never share blocks
                        r = await c.complete(token_ids=rec.prompt, max_new_tokens=rec.max_new_tokens,
                                             cache_salt=f"cold-{k}")  # fmt: skip
                        return r.token_ids == rec.output

                results = await asyncio.gather(*(one(k, rec) for k, rec in enumerate(sample)))
                mismatches = sum(not ok for ok in results)
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
        return {"checked": len(sample), "mismatches": mismatches}

    # ---- figures -------------------------------------------------------------------------

    def _report(self, wall: float, pool: dict[str, float], exit_code: int, cold: dict[str, int]) -> dict[str, Any]:
        f = self.fig
        ttft = sorted(f.ttft_s)

        def q(p: float) -> float:
            return 1000 * ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else float("nan")

        errors_by_window: dict[str, dict[str, int]] = {}
        for (where, code), n in sorted(f.errors.items()):
            errors_by_window.setdefault(where, {})[code] = n
        return {
            "config": {**asdict(self.cfg), "model": str(self.model_dir)},
            "wall_s": round(wall, 1),
            "turns_ok": f.turns_ok,
            "calls": f.calls,
            "tokens": f.tokens,
            "tokens_per_s": round(f.tokens / wall, 1),
            "ttft_p50_ms": round(q(0.50), 1),
            "ttft_p99_ms": round(q(0.99), 1),
            "ttft_by_window_ms": {
                w: {"turns": len(v), "p50": round(1000 * _quantile(v, 0.5), 1), "p99": round(1000 * _quantile(v, 0.99), 1),
                    "max": round(1000 * max(v), 1)}
                for w, v in sorted(f.ttft_by_window.items())
            },  # fmt: skip
            "prompt_tokens": f.prompt_tokens,
            "cached_tokens_by_tier": dict(f.cached_by_tier),
            "errors": errors_by_window,
            "unexpected_errors": sum(n for (w, code), n in f.errors.items() if w == "none" and code != "RESOURCE_EXHAUSTED"),
            "redis_fault_errors": sum(n for (w, _), n in f.errors.items() if w.startswith("redis")),
            "overload_retries": f.overload,
            "busy_retries": f.busy_retries,
            "lost_in_flight": f.lost_in_flight,
            "refused_while_down": f.refused_while_down,
            "committed_unacked": f.committed_unacked,
            "sessions": f.sessions,
            "sessions_verified": f.sessions_verified,
            "sessions_deleted": f.sessions_deleted,
            "sessions_lost": f.sessions_lost,
            "acked_turns_lost": f.acked_turns_lost,
            "kept_checked": f.kept_checked,
            "kept_mismatches": f.kept_mismatches,
            "deploy_exit_codes": self.deploy_exit_codes,
            "transcript_mismatches": f.transcript_mismatches,
            "prompt_mismatches": f.prompt_mismatches,
            "windows": [
                asdict(w) | {"start": round(w.start - self.t0, 1), "end": round(w.end - self.t0, 1)}
                for w in self.windows
            ],
            "rss": rss_summary(f.rss),
            "rss_samples": [(round(t), round(m, 1), i) for t, m, i in f.rss[::5]],
            "blocks_total": self.blocks_total.get('kvserve_kv_blocks{state="free"}', 0.0),
            "blocks_free_at_end": pool.get('kvserve_kv_blocks{state="free"}'),
            "blocks_used_at_end": pool.get('kvserve_kv_blocks{state="used"}'),
            "blocks_used_when_quiet": pool.get("used_when_quiet"),
            "pool_settle_s": round(pool.get("settle_s", 0.0), 2),
            "server_exit_code": exit_code,
            "cold_checked": cold["checked"],
            "cold_mismatches": cold["mismatches"],
            "anomalies": f.anomalies,
            "server_warnings": [
                line.rstrip() for lines in self.server_logs for line in lines if " WARNING " in line or " ERROR " in line
            ][:200],
        }


# ----------------------------------------------------------------------------- helpers


def _quantile(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(p * len(v)))]


def _turns_missing(marks: list[int], mine: list[int], server_copy: list[int]) -> int:
    """Acknowledged turns (their ends at ``marks`` in ``mine``) not in ``server_copy``."""
    common = common_prefix(mine, server_copy)
    return sum(1 for m in marks if m > common)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """K and V bytes per token from config.json (Llama-family or GPT-2 keys), float32."""
    c = json.loads((model_dir / "config.json").read_text())
    layers = c.get("num_hidden_layers", c.get("n_layer"))
    heads = c.get("num_attention_heads", c.get("n_head"))
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c.get("hidden_size", c.get("n_embd")) // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def rss_mib(pid: int) -> float | None:
    """Anonymous resident memory (``RssAnon``) of ``pid`` in MiB: the heap, tensors and
    buffers a leak would grow. File-backed pages (the memory-mapped weights, shared
    libraries) are left out: the kernel drops and refaults them under memory pressure."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def rss_summary(samples: list[tuple[float, float, int]]) -> list[dict[str, float]]:
    """Per server incarnation: RSS after warm-up (the first third of its life), at the
    end, the most, and the growth from warm-up to the end."""
    out = []
    for inc in sorted({s[2] for s in samples}):
        mine = [(t, r) for t, r, i in samples if i == inc]
        t_start, t_end = mine[0][0], mine[-1][0]
        warm = next(r for t, r in mine if t >= t_start + (t_end - t_start) / 3)
        end = statistics.mean(r for _, r in mine[-3:])
        out.append({
            "incarnation": inc, "from_s": round(t_start, 1), "to_s": round(t_end, 1),
            "warm_mib": round(warm, 1), "end_mib": round(end, 1), "max_mib": round(max(r for _, r in mine), 1),
            "growth_mib": round(end - warm, 1),
        })  # fmt: skip
    return out


def resolve_model(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    if (PACKAGED_MODEL / "config.json").exists():
        return PACKAGED_MODEL
    if not (TINY_MODEL / "config.json").exists():
        from tests.fixtures.models import make_tiny_llama

        make_tiny_llama(TINY_MODEL)
    return TINY_MODEL


def table(r: dict[str, Any]) -> str:
    cfg = r["config"]
    cached = r["cached_tokens_by_tier"]
    errs = "; ".join(f"{w}: " + ", ".join(f"{c} {n}" for c, n in codes.items()) for w, codes in r["errors"].items())
    rows = [
        ("clients x duration (sessions in)", f"{cfg['clients']} x {cfg['duration_s']:.0f} s (wall {r['wall_s']} s; "
                                             f"{STORE_WORDS[cfg['store']]})"),
        ("faults", ", ".join(f"{w['kind']} at {w['start']} s" for w in r["windows"]) or "none"),
        ("turns served (calls)", f"{r['turns_ok']} ({r['calls']})"),
        ("generated tokens, tokens/s", f"{r['tokens']}, {r['tokens_per_s']}"),
        ("TTFT p50 / p99", f"{r['ttft_p50_ms']} ms / {r['ttft_p99_ms']} ms"),
        ("TTFT p50 / p99 / max by window (turns)", "; ".join(
            f"{w}: {t['p50']} / {t['p99']} / {t['max']} ms ({t['turns']})" for w, t in r["ttft_by_window_ms"].items())),
        ("prompt tokens, cached: device / host / disk / redis",
         f"{r['prompt_tokens']}: {cached.get('device', 0)} / {cached.get('host', 0)} / {cached.get('disk', 0)} / "
         f"{cached.get('redis', 0)}"),
        ("errors by window and status", errs or "none"),
        ("unexpected errors (outside faults, not overload)", str(r["unexpected_errors"])),
        ("client errors during Redis faults", str(r["redis_fault_errors"])),
        ("failed turns: cut in flight / refused / committed unacked",
         f"{r['lost_in_flight']} / {r['refused_while_down']} / {r['committed_unacked']}"),
        ("sessions: run / verified / deleted / lost",
         f"{r['sessions']} / {r['sessions_verified']} / {r['sessions_deleted']} / {r['sessions_lost']}"),
        ("acknowledged turns lost", str(r["acked_turns_lost"])),
        ("ended sessions read again at the end / not as they ended", f"{r['kept_checked']} / {r['kept_mismatches']}"),
        ("transcript mismatches (end of session, after faults)", str(r["transcript_mismatches"])),
        ("prompt-count mismatches", str(r["prompt_mismatches"])),
        ("server anonymous RSS MiB: warm -> end (max), per run",
         "; ".join(f"#{s['incarnation']} {s['warm_mib']} -> {s['end_mib']} ({s['max_mib']})" for s in r["rss"])),
        ("KV blocks free at end / total (in use when the last turn ended, settled in)",
         f"{r['blocks_free_at_end']:.0f} / {r['blocks_total']:.0f} ({r['blocks_used_when_quiet']:.0f}, {r['pool_settle_s']} s)"),
        ("greedy turns replayed cold / mismatches", f"{r['cold_checked']} / {r['cold_mismatches']}"),
        ("server exit status on SIGTERM: deploys during the run, at the end",
         f"{', '.join(map(str, r['deploy_exit_codes'])) or 'none'}; {r['server_exit_code']}"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'figure':<{width}} | value |", f"| {'-' * width} | --- |"]
    lines += [f"| {k:<{width}} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=None, help="seconds (default 300; --ci: 60)")
    p.add_argument("--ci", action="store_true", help="the CI length: 60 s")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--faults", action="store_true",
                   help="Redis restart, Redis down, Redis frozen (SIGSTOP), FLUSHALL, server SIGKILL, a deploy while "
                        "Redis is frozen; with --store disk: records directory unwritable, a deploy, server SIGKILL")
    p.add_argument("--store", choices=("redis", "disk", "redis-no-disk"), default="redis",
                   help="where sessions live: Redis with a disk directory (the session journal; default), the disk "
                        "directory alone (record files, no Redis), or Redis alone (no journal: the comparison)")
    p.add_argument("--unwritable", type=float, default=5.0,
                   help="--store disk: seconds the records directory stays unwritable")
    p.add_argument("--drain-timeout", type=float, default=5.0, help="the server's --drain-timeout, seconds")
    p.add_argument("--disk-tokens", type=int, default=0, help="disk tier, in tokens (default 64 per client)")
    p.add_argument("--redis-down", type=float, default=10.0, help="seconds Redis stays killed")
    p.add_argument("--redis-freeze", type=float, default=10.0, help="seconds Redis stays frozen (SIGSTOP)")
    p.add_argument("--model", help="model directory (default: the packaged model, else a tiny random Llama)")
    p.add_argument("--device-tokens", type=int, default=0, help="device KV pool, in tokens (default 96 per client)")
    p.add_argument("--host-tokens", type=int, default=0, help="host tier, in tokens (default 32 per client)")
    p.add_argument("--check-turns", type=int, default=64, help="turns replayed on a cold server")
    p.add_argument("--restore-policy", choices=("always", "auto"), default="always",
                   help="the server's --restore-policy (default always: restore every hit, to exercise the tiers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures as JSON here")
    args = p.parse_args(argv)
    duration = args.duration if args.duration is not None else (60.0 if args.ci else 300.0)
    cfg = SoakConfig(
        duration_s=duration, clients=args.clients, faults=args.faults, store=args.store, redis_down_s=args.redis_down,
        redis_freeze_s=args.redis_freeze, unwritable_s=args.unwritable, drain_s=args.drain_timeout,
        device_tokens=args.device_tokens, host_tokens=args.host_tokens, disk_tokens=args.disk_tokens,
        check_turns=args.check_turns, seed=args.seed, restore_policy=args.restore_policy,
    )  # fmt: skip
    model = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="kvserve-soak-") as work:
        report = asyncio.run(Soak(cfg, model, Path(work)).run())
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    ok = (
        report["unexpected_errors"] == 0 and report["redis_fault_errors"] == 0 and report["transcript_mismatches"] == 0
        and report["sessions_lost"] == 0 and report["cold_mismatches"] == 0 and report["prompt_mismatches"] == 0
        and report["acked_turns_lost"] == 0 and report["kept_mismatches"] == 0 and report["blocks_used_at_end"] == 0 and report["server_exit_code"] == 0
        and all(code == 0 for code in report["deploy_exit_codes"])
    )  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
