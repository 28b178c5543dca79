"""Several replicas, one cache: any replica serves any session, from Redis or a Redis
Cluster, and a cluster that loses a master costs cache hits, never answers."""

from __future__ import annotations

from kvserve.clients import KVServeClient
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, cold_reply, tiny_config, wait_until

MSGS = ["hello, tell me a short story about a fox", "what is the fox doing now", "and the dog?"]


def replica(model_dir, url, cluster=False):
    return ServerThread(
        tiny_config(model_dir, redis_url=url, redis_cluster=cluster, host_cache_memory=0,
                    spill_after=0.05, spill_to=("redis",), restore_policy="always")
    )  # fmt: skip


def spilled(client, sid):
    """The session's whole transcript is in Redis (as this replica sees it)."""
    s = client.get_session(sid)
    return s.cached_blocks.get("redis", 0) == s.full_blocks > 0


def turn_elsewhere(model_dir, a, b, sid):
    """Turn 1 on replica a, turn 2 on replica b; returns (reply, its prompt)."""
    a.chat(sid, f"{MSGS[0]} called {sid}", max_new_tokens=10)  # distinct content per session
    t1 = a.get_session(sid, include_token_ids=True).token_ids
    assert wait_until(lambda: spilled(a, sid), timeout=30)
    r = b.chat(sid, MSGS[1], max_new_tokens=10)
    full = len(t1) // BLOCK_SIZE * BLOCK_SIZE
    # B restores from Redis whatever it does not already hold (a prefix shared with an
    # earlier session may still be on B's device)
    assert r.start.cached_tokens == full
    assert r.start.cached_by_tier["redis"] > 0 and r.start.cached_tier == "redis"
    assert r.start.cached_by_tier["device"] + r.start.cached_by_tier["redis"] == full
    t2 = b.get_session(sid, include_token_ids=True).token_ids
    assert t2[: len(t1)] == t1
    return r, t2[: len(t2) - len(r.token_ids)]


def test_turn_one_on_a_turn_two_on_b(tiny_llama_dir, redis_url):
    with replica(tiny_llama_dir, redis_url) as sa, replica(tiny_llama_dir, redis_url) as sb:
        with KVServeClient(sa.address, timeout=60) as a, KVServeClient(sb.address, timeout=60) as b:
            r, prompt = turn_elsewhere(tiny_llama_dir, a, b, "roaming")
            # and back again: turn 3 on A sees turn 2's transcript
            r3 = a.chat("roaming", MSGS[2], max_new_tokens=6)
            assert r3.start.prompt_tokens > len(prompt)
    assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 10)


def test_redis_cluster_serves_replicas_and_survives_a_lost_master(tiny_llama_dir, make_redis_cluster):
    cluster = make_redis_cluster(masters=3)
    with replica(tiny_llama_dir, cluster.url, True) as sa, replica(tiny_llama_dir, cluster.url, True) as sb:
        with KVServeClient(sa.address, timeout=120) as a, KVServeClient(sb.address, timeout=120) as b:
            checks = []
            for i in range(3):  # several sessions: their keys spread over the slots
                checks.append(turn_elsewhere(tiny_llama_dir, a, b, f"cluster-{i}"))
            cluster.nodes[1].stop()  # one master's process is gone
            after = []
            for i in range(3):  # every session keeps answering on the replica that served it
                r = b.chat(f"cluster-{i}", MSGS[2], max_new_tokens=6)
                t = b.get_session(f"cluster-{i}", include_token_ids=True).token_ids
                after.append((r, t[: len(t) - len(r.token_ids)]))
            fresh = a.complete(text="a brand new prompt after the failure", max_new_tokens=6)
            assert fresh.token_ids
    for r, prompt in checks:
        assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 10)
    for r, prompt in after:
        assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 6)
