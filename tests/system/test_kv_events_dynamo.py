"""NVIDIA Dynamo's own KV indexer (``python -m dynamo.indexer`` from ai-dynamo-runtime on
PyPI: the radix tree its KV router scores workers with) subscribed to a real kvserve
server's KV events, with the replay socket for its gap recovery: after multi-turn sessions
that evict, demote down to Redis and restore, and again after a restart, the tree it dumps
holds per storage tier exactly what each kvserve tier holds, and its /query of each
session's tokens matches the session's leading blocks per tier, computed from the token
ids alone (Dynamo hashes them itself)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid

import pytest
import redis

from kvserve.clients import KVServeClient
from kvserve.service.kv_events import hash64
from kvserve.service.types import CacheScope
from tests.fixtures.redis_server import free_port
from tests.fixtures.serving import BLOCK_SIZE, subprocess_env, wait_until
from tests.service.test_kv_events import TURNS, diff, disk_listing, events_server, redis_listing, settle, tier_listing

pytest.importorskip("dynamo.llm", reason="ai-dynamo-runtime (the test extra) is not installed")
pytestmark = pytest.mark.slow

TIERS = {"device": "DEVICE", "host_pinned": "CPU", "disk": "DISK", "external": "SHARED"}  # Dynamo's StorageTier -> medium


class DynamoIndexer:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(self.port)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env())  # fmt: skip
        assert wait_until(self._up, timeout=60), self.stop()

    def _up(self) -> bool:
        try:
            self.http("/health")
            return True
        except OSError:
            return False

    def http(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
        return json.loads(raw) if raw.strip() else None

    def register(self, events) -> None:
        self.http("/register", {"instance_id": 1, "endpoint": events.endpoint, "replay_endpoint": events.replay_endpoint,
                                "model_name": "tiny", "block_size": BLOCK_SIZE})  # fmt: skip
        assert wait_until(lambda: self.http("/workers")[0]["status"] == "active", timeout=30)

    def view(self) -> dict[str, set[int]]:
        """The radix tree's blocks per tier, from its /dump."""
        out: dict[str, set[int]] = {}
        for event in self.http("/dump").get("tiny:default", {}).get("events", []):
            stored = event["event"]["data"].get("stored")
            if stored:
                out.setdefault(TIERS[event["storage_tier"]], set()).update(b["block_hash"] for b in stored["blocks"])
        return out

    def stop(self) -> str:
        self.proc.terminate()
        try:
            return self.proc.communicate(timeout=10)[0][-4000:]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[0][-4000:]


def expected_reach(srv, transcript: list[int]) -> dict[str, int]:
    """The session's leading blocks per tier as Dynamo's /query counts them (in tokens,
    cumulative: the device prefix, then extended through host memory, then through disk
    and Redis), from what each kvserve tier holds."""
    _, chain = srv.engine.engine.keys.of(transcript, CacheScope())
    held = tier_listing(srv, srv.config.redis_url, srv.config.redis_key_prefix)
    reach, n = {}, 0
    for tier, media in (("gpu", {"DEVICE"}), ("cpu", {"DEVICE", "CPU"}), ("disk", {"DEVICE", "CPU", "DISK", "SHARED"})):
        while n < len(chain) and any(hash64(chain[n]) in held.get(m, set()) for m in media):
            n += 1
        reach[tier] = n * BLOCK_SIZE
    return reach


def test_dynamos_indexer_holds_what_each_tier_holds(tiny_llama_dir, tmp_path, redis_url):
    root, prefix = tmp_path / "kv", f"kvdyn-{uuid.uuid4().hex[:8]}:"
    sessions = [f"d{i}" for i in range(6)]
    indexer = DynamoIndexer()
    try:
        with events_server(tiny_llama_dir, root, redis_url, prefix) as srv, KVServeClient(srv.address, timeout=60) as c:
            indexer.register(srv.running.events)
            for turn in TURNS:
                for sid in sessions:
                    c.chat(sid, f"{sid}: {turn}", max_new_tokens=6)
            settle(srv)
            want = tier_listing(srv, redis_url, prefix)
            assert set(want) == {"DEVICE", "CPU", "DISK", "SHARED"}
            assert wait_until(lambda: indexer.view() == want, timeout=30), diff(indexer.view(), want)
            for sid in sessions:  # Dynamo hashes the tokens itself: the events' token ids must be the blocks'
                transcript = c.get_session(sid, include_token_ids=True).token_ids
                got = indexer.http("/query", {"token_ids": transcript, "model_name": "tiny"})["instances"]["1"]
                assert {t: got[t] for t in ("gpu", "cpu", "disk")} == expected_reach(srv, transcript), sid
        durable = {"DISK": disk_listing(root), "SHARED": redis_listing(redis_url, prefix)}
        assert wait_until(lambda: indexer.view() == durable, timeout=30), diff(indexer.view(), durable)

        with events_server(tiny_llama_dir, root, redis_url, prefix) as srv, KVServeClient(srv.address, timeout=60) as c:
            indexer.http("/unregister", {"instance_id": 1, "model_name": "tiny"})  # Dynamo's restart procedure
            indexer.register(srv.running.events)
            # Dynamo replays from 0 (the start's snapshot of what disk and Redis hold) when
            # the first live batch comes: the returning turns' restores
            for sid in sessions[:3]:
                c.chat(sid, f"{sid}: one more thing", max_new_tokens=6)
            settle(srv)
            want = tier_listing(srv, redis_url, prefix)
            assert wait_until(lambda: indexer.view() == want, timeout=30), diff(indexer.view(), want)
    finally:
        log = indexer.stop()
        client = redis.Redis.from_url(redis_url)
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()
    assert "panicked" not in log, log
