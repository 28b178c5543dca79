"""The cache tiers through the gRPC service (a real redis-server): sessions come back
from host memory and Redis, survive a SIGTERM restart, and a Redis outage costs cache
hits, never answers."""

from __future__ import annotations

import signal

import pytest

from kvserve.clients import KVServeClient
from tests.fixtures.serving import (
    BLOCK_SIZE,
    ServerThread,
    cold_reply,
    start_server_process,
    tiny_config,
    transcript,
    wait_until,
)

MSGS = ["hello, tell me a short story about a fox", "what is the fox doing now", "and the dog?"]


def full(n):
    return n // BLOCK_SIZE * BLOCK_SIZE


def test_idle_session_spills_to_host_and_returns_from_it(tiny_llama_dir):
    # a pool of 40 blocks: the other conversation evicts the session's idle blocks
    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=40 * BLOCK_SIZE * 512, host_cache_memory=1 << 20,
                      spill_after=0.05, spill_to=("host",), restore_policy="always")
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.chat("s", MSGS[0], max_new_tokens=10)
        t1 = transcript(c, "s")
        assert wait_until(lambda: c.get_session("s").cached_blocks.get("host", 0) == len(t1) // BLOCK_SIZE)
        for i in range(4):  # push the session's blocks off the device
            c.complete(token_ids=[5 + i] * 120, max_new_tokens=2)
        prefill0 = srv.engine.stats().prefill_tokens
        r = c.chat("s", MSGS[1], max_new_tokens=10)
        assert r.start.cached_tokens == full(len(t1))
        assert r.start.cached_by_tier["host"] > 0 and r.start.cached_tier == "host"
        assert srv.engine.stats().prefill_tokens - prefill0 == r.start.prompt_tokens - r.start.cached_tokens
        prompt = transcript(c, "s")[: -len(r.token_ids)]
    assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 10)


def test_restart_resumes_from_redis_after_sigterm(tiny_llama_dir, redis_url):
    args = ["--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
            "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory", "1MiB",
            "--redis-url", redis_url, "--spill-after", "1h", "--host-cache-memory", "0",
            "--restore-policy", "always"]  # fmt: skip
    proc, port, _ = start_server_process(args)
    try:
        with KVServeClient(f"127.0.0.1:{port}", timeout=60) as c:
            c.chat("r", MSGS[0], max_new_tokens=10)
            t1 = transcript(c, "r")
    finally:
        proc.send_signal(signal.SIGTERM)  # the drain writes the session's blocks to Redis
        assert proc.wait(60) == 0
    proc, port, _ = start_server_process(args)  # "server B": same Redis, empty pool
    try:
        with KVServeClient(f"127.0.0.1:{port}", timeout=60) as c:
            assert transcript(c, "r") == t1  # the transcript came back from Redis
            r = c.chat("r", MSGS[1], max_new_tokens=10)
            assert r.start.cached_tokens == full(len(t1)) > 0
            assert r.start.cached_by_tier == {"device": 0, "host": 0, "disk": 0, "redis": full(len(t1))}
            prompt = transcript(c, "r")[: -len(r.token_ids)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 10)


def test_two_sessions_share_a_three_block_system_prompt(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir)) as srv, KVServeClient(srv.address, timeout=60) as c:
        system = list(range(10, 10 + 3 * BLOCK_SIZE))
        c.complete(token_ids=system + [7, 8], session_id="a", max_new_tokens=4)
        r = c.complete(token_ids=system + [9, 9, 9], session_id="b", max_new_tokens=4)
        assert r.start.cached_tokens == 3 * BLOCK_SIZE and r.start.cached_tier == "device"


def test_get_session_says_where_the_blocks_are(tiny_llama_dir, redis_url):
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, spill_after=0.05, spill_to=("host", "redis"))
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.chat("w", MSGS[0], max_new_tokens=10)
        n = len(transcript(c, "w")) // BLOCK_SIZE
        assert wait_until(lambda: c.get_session("w").cached_blocks == {"device": n, "host": n, "disk": 0, "redis": n})
        assert c.get_session("w").full_blocks == n


def test_redis_outage_costs_hits_not_answers(tiny_llama_dir, redis_server, redis_url):
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, host_cache_memory=0, spill_after=0.05,
                      spill_to=("redis",))
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.chat("o", MSGS[0], max_new_tokens=8)
        redis_server.stop()
        try:
            r2 = c.chat("o", MSGS[1], max_new_tokens=8)  # sessions fall back to this replica
            assert r2.start.cached_tier == "device"
            r3 = c.complete(text="a new one-off prompt with nothing cached", max_new_tokens=8)
            assert r3.end.finish_reason in ("stop", "length") and r3.token_ids
        finally:
            redis_server.start()
        # Redis is back: the next idle spill reaches it again, and a one-off is fine
        c.chat("o", MSGS[2], max_new_tokens=8)
        t = transcript(c, "o")
        assert wait_until(
            lambda: c.get_session("o").cached_blocks.get("redis", 0) == len(t) // BLOCK_SIZE, timeout=30
        )
