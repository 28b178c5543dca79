"""KV events from a real server (--kv-events-endpoint) with every tier (a small device
pool, host memory, a disk directory, a real Redis), read by a subscriber written from vLLM's
schema (tests/fixtures/kv_events.py): after multi-turn sessions that evict device blocks,
demote them down to Redis, restore them and delete a session, and again across a restart,
what the subscriber holds per medium is exactly what each tier holds (0 stale, 0 missing),
every block's tokens and parent are the session's, and a subscriber joining late catches up
through the replay socket. The scheduler's figures are scraped under vLLM's names."""

from __future__ import annotations

import urllib.request
import uuid
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvserve.clients import KVServeClient
from kvserve.service.kv_events import hash64
from kvserve.service.types import CacheScope
from tests.fixtures.kv_events import Subscriber
from tests.fixtures.redis_server import free_port
from tests.fixtures.serving import BLOCK_SIZE, EngineHold, ServerThread, tiny_config, wait_until

TURNS = ["tell me about foxes", "and what do they eat"]


def events_server(model_dir: Path, root: Path, redis_url: str, prefix: str, **kw) -> ServerThread:
    return ServerThread(tiny_config(
        model_dir,
        kv_cache_memory=24 * BLOCK_SIZE * 512,  # 24 blocks of the tiny Llama's 512 bytes a token
        host_cache_memory=6 * BLOCK_SIZE * 512,
        disk_cache_dir=str(root),
        disk_cache_size=8 * (BLOCK_SIZE * 512 + 512),  # ~8 block files
        redis_url=redis_url,
        redis_key_prefix=prefix,
        restore_policy="always",
        spill_after=3600.0,
        kv_events_endpoint="tcp://127.0.0.1:*",
        kv_events_replay_endpoint="tcp://127.0.0.1:*",
        metrics_port=free_port(),
        **kw,
    ))  # fmt: skip


def subscribe(srv: ServerThread) -> Subscriber:
    events = srv.running.events
    sub = Subscriber(events.endpoint, events.replay_endpoint, topic=b"kv@")
    sub.replay_from(0)  # joins late: what was published before it connected
    return sub


def tier_listing(srv: ServerThread, redis_url: str, prefix: str) -> dict[str, set[int]]:
    """What each tier holds, asked of the tiers themselves (and of Redis by SCAN)."""
    engine = srv.engine.engine
    store = engine.store
    out = {
        "DEVICE": {hash64(h) for h in engine.blocks._cached},
        "CPU": {hash64(r.block_hash) for r in store.tier("host")._lru},
        "DISK": {hash64(h) for h in store.tier("disk")._lru},
        "SHARED": redis_listing(redis_url, prefix),
    }
    return {m: hs for m, hs in out.items() if hs}


def redis_listing(redis_url: str, prefix: str) -> set[int]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {hash64(bytes.fromhex(k.decode().rsplit(":", 1)[1])) for k in client.scan_iter(f"{prefix}blk:*")}
    finally:
        client.close()


def disk_listing(root: Path) -> set[int]:
    return {hash64(bytes.fromhex(p.name.removesuffix(".kvb"))) for p in (root / "blocks").rglob("*.kvb")}


def settle(srv: ServerThread) -> None:
    assert wait_until(lambda: srv.engine.stats().running == 0 and srv.engine.stats().waiting == 0)
    assert srv.call(srv.engine.flush_store(10))


def assert_tokens_and_parents(srv: ServerThread, sub: Subscriber, client: KVServeClient, sessions: list[str]) -> int:
    """Every block the subscriber was told of in a session's chain came with that block's
    tokens and its parent's hash; how many were checked."""
    keys = srv.engine.engine.keys
    checked = 0
    for sid in sessions:
        transcript = client.get_session(sid, include_token_ids=True).token_ids
        _, chain = keys.of(transcript, CacheScope())
        for i, h in enumerate(chain):
            if hash64(h) in sub.tokens:
                assert sub.tokens[hash64(h)] == transcript[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                assert sub.parents[hash64(h)] == (hash64(chain[i - 1]) if i else None)
                checked += 1
    return checked


@pytest.mark.slow
def test_the_subscribers_view_is_what_each_tier_holds_through_a_restart(tiny_llama_dir, tmp_path, redis_url):
    root, prefix = tmp_path / "kv", f"kvev-{uuid.uuid4().hex[:8]}:"
    sessions = [f"s{i}" for i in range(6)]
    with events_server(tiny_llama_dir, root, redis_url, prefix) as srv, KVServeClient(srv.address, timeout=60) as c:
        with subscribe(srv) as sub:
            for turn in TURNS:  # six sessions round-robin: the 24-block pool evicts, host and disk demote
                for sid in sessions:
                    c.chat(sid, f"{sid}: {turn}", max_new_tokens=6)  # each its own blocks
            settle(srv)
            stats = srv.engine.cache_stats()
            assert stats.device_evictions > 0 and stats.store.tiers["host"].evictions > 0
            assert stats.store.tiers["disk"].evictions > 0 and stats.store.tiers["redis"].puts > 0
            restored = {t: s.hits for t, s in stats.store.tiers.items()}
            assert restored["host"] + restored["disk"] + restored["redis"] > 0  # returning turns restored
            want = tier_listing(srv, redis_url, prefix)
            assert set(want) == {"DEVICE", "CPU", "DISK", "SHARED"}
            assert sub.wait_for(lambda: sub.view() == want), diff(sub.view(), want)
            assert sub.topics == {f"kv@{__import__('socket').gethostname()}@{tiny_llama_dir}".encode()}
            assert assert_tokens_and_parents(srv, sub, c, sessions) > 20

            c.delete_session("s0")  # its blocks leave every tier (those no other session shares)
            settle(srv)
            want = tier_listing(srv, redis_url, prefix)
            assert sub.wait_for(lambda: sub.view() == want), diff(sub.view(), want)
        with subscribe(srv) as late:  # a second subscriber, long after the start
            assert late.wait_for(lambda: late.view() == want), diff(late.view(), want)
            assert late.replayed >= 1
        sub = subscribe(srv)
    try:
        # stopped: the drain wrote the sessions to Redis, the device and host tiers went with the process
        durable = {"DISK": disk_listing(root), "SHARED": redis_listing(redis_url, prefix)}
        assert sub.wait_for(lambda: sub.view() == durable), diff(sub.view(), durable)
    finally:
        sub.close()

    with events_server(tiny_llama_dir, root, redis_url, prefix) as srv, KVServeClient(srv.address, timeout=60) as c:
        with subscribe(srv) as sub:  # the new life's first batch: what the durable tiers still hold
            assert sub.wait_for(lambda: sub.view() == durable), diff(sub.view(), durable)
            assert sub.cleared == 1
            assert assert_tokens_and_parents(srv, sub, c, sessions[1:]) > 20  # from the journal
            for sid in sessions[1:]:  # returning turns: restored from disk and Redis
                reply = c.chat(sid, f"{sid}: one more thing", max_new_tokens=6)
                assert reply.start.cached_tokens > 0 and reply.start.cached_tier in ("disk", "redis")
            settle(srv)
            want = tier_listing(srv, redis_url, prefix)
            assert "DEVICE" in want and "DISK" in want and "SHARED" in want
            assert sub.wait_for(lambda: sub.view() == want), diff(sub.view(), want)
            assert srv.running.events.view() == {m: want.get(m, set()) for m in ("DEVICE", "CPU", "DISK", "SHARED")}
        with subscribe(srv) as late:
            assert late.wait_for(lambda: late.view() == want), diff(late.view(), want)
        scrape = _scrape(srv)
        assert scrape["kvserve_kv_events_resyncs_total"][("start",)] == 1
        assert scrape["kvserve_kv_events_blocks"][("DISK",)] == len(want["DISK"])
    client = redis.Redis.from_url(redis_url)
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


def diff(got: dict[str, set[int]], want: dict[str, set[int]]) -> str:
    media = sorted(set(got) | set(want))
    return "; ".join(
        f"{m}: {len(got.get(m, set()) - want.get(m, set()))} stale, {len(want.get(m, set()) - got.get(m, set()))} missing"
        for m in media
    )


def _scrape(srv: ServerThread) -> dict[str, dict[tuple, float]]:
    url = f"http://127.0.0.1:{srv.running.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(v for k, v in sorted(s.labels.items()))] = s.value
    return out


def test_a_kv_events_port_in_use_is_one_line_before_the_model_loads(tiny_llama_dir):
    import zmq

    from kvserve.service.server import StartupError

    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    try:
        srv = ServerThread(tiny_config(tiny_llama_dir, kv_events_endpoint=f"tcp://*:{port}"))
        with pytest.raises(RuntimeError) as err:
            srv.__enter__()
        cause = err.value.__cause__
        assert isinstance(cause, StartupError) and "\n" not in str(cause)
        assert "--kv-events-endpoint" in str(cause) and "in use" in str(cause).lower()
    finally:
        taken.close(0)
        ctx.term()


def test_the_scheduler_figures_under_vllms_names_from_a_live_server(tiny_llama_dir):
    """One running sequence (held mid-stream on the engine's loop) and one waiting request:
    the endpoint picker's metrics say so, labelled as vLLM's, and agree with kvserve's own.
    The running one is held from its first step (``EngineHold``, in place before it starts):
    its 400 tokens take the tiny model some tens of ms, so a hold placed at its first text
    could come after its end, and the one behind it would run instead of wait."""
    import threading

    cfg = tiny_config(tiny_llama_dir, metrics_port=free_port(), max_num_seqs=1, host_cache_memory=0)
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        key = ("0", str(tiny_llama_dir))  # (engine, model_name): label values by label name
        idle = _scrape(srv)
        assert idle["vllm:num_requests_running"][key] == 0 and idle["vllm:kv_cache_usage_perc"][key] == 0.0
        scheduler = srv.engine.engine.scheduler  # read on the engine thread, in the hold's check
        with EngineHold(srv):  # admitted only once the next hold is in place
            stream = c.generate(text="a long story about a server", max_new_tokens=400, ignore_eos=True)
            assert wait_until(lambda: srv.engine.stats().waiting == 1)
            running = EngineHold(srv, when=lambda s: len(scheduler.running) == 1)
        try:
            assert running.held.wait(60)  # the loop holds here, the sequence running
            second: list = []  # queued behind it (max_num_seqs 1), then served
            behind = threading.Thread(target=lambda: second.extend(c.generate(text="and another one", max_new_tokens=4)))
            behind.start()
            assert wait_until(lambda: srv.engine.stats().waiting == 1)
            busy = _scrape(srv)
            assert srv.engine.stats().running == 1  # still the first, held
        finally:
            running.release()
            stream.cancel()
        behind.join(60)
        assert second and type(second[-1]).__name__ == "StreamEnd"
    assert busy["vllm:num_requests_running"][key] == 1 == busy["kvserve_running_sequences"][()]
    assert busy["vllm:num_requests_waiting"][key] == 1 == busy["kvserve_waiting_sequences"][()]
    total = busy["kvserve_kv_blocks_total"][()]
    used = busy["kvserve_kv_blocks"][("used",)]
    assert used > 0 and busy["vllm:kv_cache_usage_perc"][key] == pytest.approx(used / total)
    assert busy["vllm:gpu_cache_usage_perc"][key] == busy["vllm:kv_cache_usage_perc"][key]
    [(info_labels, one)] = busy["vllm:cache_config_info"].items()
    assert one == 1.0 and info_labels == (str(BLOCK_SIZE), "True", str(int(total)))  # block_size, prefix caching, blocks
