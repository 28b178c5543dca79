"""The SIGTERM drain and the idle spill write every full block of a session from
whichever tier holds it: blocks already demoted from the device pool to the host tier
reach Redis (or, with no Redis, the disk tier) too, so the session resumes with all its
cached tokens after a restart."""

from __future__ import annotations

import random
import signal

from kvserve.clients import KVServeClient
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, start_server_process, tiny_config, wait_until

POOL = 96 << 10  # 24 blocks of 8 tokens for the tiny Llama (512 bytes per token)


def _push_off_the_device(client: KVServeClient) -> None:
    """Two one-off prompts of 15 blocks each: every idle cached block of the session is
    evicted from the device pool (oldest first), i.e. demoted to the host tier."""
    for seed in (1, 2):
        rng = random.Random(seed)
        client.complete(token_ids=[rng.randrange(3, 400) for _ in range(15 * BLOCK_SIZE)], max_new_tokens=1)


def _host_only(client: KVServeClient, sid: str) -> bool:
    s = client.get_session(sid)
    where = s.cached_blocks
    return s.full_blocks > 0 and where.get("device", 0) == 0 and where.get("redis", 0) == 0 \
        and where.get("host", 0) == s.full_blocks  # fmt: skip


def test_sigterm_drain_writes_blocks_that_sit_in_the_host_tier(tiny_llama_dir, redis_url):
    proc, port, log = start_server_process([
        "--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
        "--dtype", "float32", "--kv-cache-memory", str(POOL), "--block-size", str(BLOCK_SIZE),
        "--host-cache-memory", "1MiB", "--redis-url", redis_url, "--spill-after", "3600",
        "--drain-timeout", "20", "--log-level", "info",
    ])  # fmt: skip
    try:
        with KVServeClient(f"127.0.0.1:{port}", timeout=60) as c:
            c.chat("d", "hello, tell me a story about a fox and a dog", max_new_tokens=16)
            full = c.get_session("d").full_blocks
            assert full >= 4
            _push_off_the_device(c)
            assert wait_until(lambda: _host_only(c, "d"), timeout=30), c.get_session("d")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    drain = [line for line in log if "drain:" in line]
    assert drain and f"1 session(s), {full} full block(s): {full} in Redis" in drain[-1] and "0 left" in drain[-1], log

    with ServerThread(tiny_config(tiny_llama_dir, redis_url=redis_url, host_cache_memory=0)) as srv, \
            KVServeClient(srv.address, timeout=60) as c:  # fmt: skip
        r = c.chat("d", "and then?", max_new_tokens=4)
        assert not r.start.session_created
        assert r.start.cached_tokens == full * BLOCK_SIZE == r.start.cached_by_tier["redis"]


def test_sigterm_drain_with_no_redis_writes_to_the_disk_tier_and_says_so(tiny_llama_dir, tmp_path):
    """With no Redis the drain's tier is the disk tier: its log line names it (not Redis)
    and a restarted server resumes the session from the files."""
    root = tmp_path / "kv"
    proc, port, log = start_server_process([
        "--model", str(tiny_llama_dir), "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
        "--dtype", "float32", "--kv-cache-memory", str(POOL), "--block-size", str(BLOCK_SIZE),
        "--host-cache-memory", "1MiB", "--disk-cache-dir", str(root), "--disk-cache-size", "64MiB",
        "--spill-after", "3600", "--drain-timeout", "20", "--log-level", "info",
    ])  # fmt: skip
    try:
        with KVServeClient(f"127.0.0.1:{port}", timeout=60) as c:
            c.chat("d", "hello, tell me a story about a fox and a dog", max_new_tokens=16)
            full = c.get_session("d").full_blocks
            assert full >= 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    drain = [line for line in log if "drain:" in line]
    assert drain and f"1 session(s), {full} full block(s): {full} in the disk tier" in drain[-1], log
    assert "0 left" in drain[-1] and "Redis" not in drain[-1], log

    with ServerThread(tiny_config(tiny_llama_dir, disk_cache_dir=str(root), disk_cache_size=64 << 20,
                                  host_cache_memory=0, restore_policy="always")) as srv, \
            KVServeClient(srv.address, timeout=60) as c:  # fmt: skip
        r = c.chat("d", "and then?", max_new_tokens=4)
        assert not r.start.session_created
        assert r.start.cached_tokens == full * BLOCK_SIZE == r.start.cached_by_tier["disk"]


def test_idle_spill_writes_blocks_that_sit_in_the_host_tier(tiny_llama_dir, redis_url):
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, kv_cache_memory=POOL, host_cache_memory=1 << 20,
                      spill_after=1.0, spill_to=("redis",))  # fmt: skip
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.chat("idle", "hello, tell me a story about a cat and a mouse", max_new_tokens=16)
        _push_off_the_device(c)  # before the session has been idle for spill_after
        s = c.get_session("idle")
        assert s.cached_blocks.get("device", 0) == 0 and s.cached_blocks.get("redis", 0) == 0

        def in_redis() -> bool:
            s = c.get_session("idle")
            return s.cached_blocks.get("redis", 0) == s.full_blocks > 0

        assert wait_until(in_redis, timeout=30), c.get_session("idle")
