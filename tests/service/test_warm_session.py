"""WarmSession (and POST /v1/sessions/{id}/warm) through real servers and a real
redis-server: a spilled session is restored into the device pool before its next turn,
which then finds it on the device and answers exactly as a cold server; warm-ups stay
inside their caps, never touch a running request's blocks, expire unused, and are the
caller's own."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.auth import hash_key
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config, wait_until

POOL_40 = 40 * BLOCK_SIZE * 512  # tiny Llama: 512 bytes per token -> 40 blocks (39 usable)
SESSION = list(range(40, 40 + 10 * BLOCK_SIZE))  # 10 full blocks of input


def warm_stats(srv):
    return srv.engine.cache_stats().warm


def transcript(client, sid):
    return client.get_session(sid, include_token_ids=True).token_ids


def cold_reply(model_dir, prompt, n):
    cfg = tiny_config(model_dir, host_cache_memory=0, redis_url=None)
    with ServerThread(cfg) as cold, KVServeClient(cold.address, timeout=60) as c:
        r = c.complete(token_ids=prompt, max_new_tokens=n)
        assert r.start.cached_tokens == 0
        return r.token_ids


def spill_and_push_off(srv, c, sid, tier):
    """Wait for the idle spill to reach ``tier``, then fill the pool with other prompts
    until none of the session's blocks is on the device."""
    n = len(transcript(c, sid)) // BLOCK_SIZE
    assert wait_until(lambda: c.get_session(sid).cached_blocks.get(tier, 0) == n)
    for i in range(4):
        c.complete(token_ids=[5 + i] * 120, max_new_tokens=2)
    assert c.get_session(sid).cached_blocks["device"] == 0
    return n


@pytest.mark.parametrize("tier", ["host", "redis"])
def test_a_warmed_session_returns_from_the_device_with_the_same_answer(tiny_llama_dir, tier, request):
    tiers = {"redis_url": request.getfixturevalue("redis_url"), "host_cache_memory": 0} if tier == "redis" else {
        "host_cache_memory": 1 << 20}
    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=POOL_40, spill_after=0.05, spill_to=(tier,),
                      restore_policy="always", warm_pool_fraction=0.5, warm_tenant_fraction=0.5, **tiers)  # fmt: skip
    with ServerThread(cfg, http_port=0) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.complete(token_ids=SESSION, session_id="w", max_new_tokens=6)
        n = spill_and_push_off(srv, c, "w", tier)
        if tier == "host":
            w = c.warm_session("w")
        else:  # the HTTP endpoint: the same warm-up
            url = f"http://127.0.0.1:{srv.running.http_port}/v1/sessions/w/warm"
            body = json.loads(urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60).read())
            w = c.warm_session("w")  # idempotent: the blocks are held once, found on the device
            assert body["restored"] == n and body["restored_by_tier"] == {"redis": n} and body["on_device"] == 0
            assert (w.on_device, w.restored) == (n, 0)
        if tier == "host":
            assert (w.blocks, w.on_device, w.restored, w.missing, w.over_cap) == (n, 0, n, 0, 0)
            assert w.restored_by_tier == {"host": n} and w.ttl_s == cfg.warm_ttl
        stats = warm_stats(srv)
        assert stats.pinned_blocks == n and stats.blocks_restored == {tier: n}
        assert c.get_session("w").cached_blocks["device"] == n
        r = c.complete(token_ids=[9, 9, 9], session_id="w", max_new_tokens=6)
        assert r.start.cached_tokens == n * BLOCK_SIZE and r.start.cached_tier == "device"
        assert r.start.cached_by_tier[tier] == 0
        stats = warm_stats(srv)
        assert (stats.hits, stats.claimed_blocks, stats.pinned_blocks) == (1, n, 0)
        assert sum(stats.wasted_blocks.values()) == 0
        prompt = transcript(c, "w")[: -len(r.token_ids)]
    assert r.token_ids == cold_reply(tiny_llama_dir, prompt, 6)


def test_a_warm_up_never_takes_a_running_requests_blocks(tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=POOL_40, host_cache_memory=1 << 20, spill_after=0.05,
                      spill_to=("host",), restore_policy="always", warm_pool_fraction=1.0, warm_tenant_fraction=1.0,
                      stream_interval=0)  # fmt: skip
    long_prompt = [7 + i % 50 for i in range(30 * BLOCK_SIZE)]  # 30 of the 39 usable blocks
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.complete(token_ids=SESSION, session_id="s", max_new_tokens=6)
        n = spill_and_push_off(srv, c, "s", "host")
        engine, step = srv.engine.engine, srv.engine.engine.step

        def slow_step():  # the long request still runs when the warm-up comes (a fast host once finished it first)
            time.sleep(0.01)
            return step()

        engine.step = slow_step
        with c.generate(token_ids=long_prompt, max_new_tokens=40) as stream:
            events = iter(stream)
            first = [next(events) for _ in range(2)]  # started, and a first token: it runs
            free = srv.engine.stats().blocks_free
            w = c.warm_session("s")
            assert 0 < w.restored <= free < n and w.over_cap == n - w.restored
            out = [t for e in first + list(events) for t in getattr(e, "token_ids", ())]
    # its decode took blocks back from the warm-up when it needed them, and its KV was never
    # overwritten: the same tokens as a server that never warmed anything
    assert out == cold_reply(tiny_llama_dir, long_prompt, 40)


def test_warmed_blocks_nobody_uses_expire_into_ordinary_cache(tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=POOL_40, host_cache_memory=1 << 20, spill_after=0.05,
                      spill_to=("host",), warm_pool_fraction=0.5, warm_tenant_fraction=0.5, warm_ttl=0.3)  # fmt: skip
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.complete(token_ids=SESSION, session_id="e", max_new_tokens=6)
        n = spill_and_push_off(srv, c, "e", "host")
        assert c.warm_session("e").restored == n
        assert wait_until(lambda: warm_stats(srv).pinned_blocks == 0)
        stats = warm_stats(srv)
        assert stats.wasted_blocks["expired"] == n and stats.hits == 0
        assert c.get_session("e").cached_blocks["device"] == n  # still cached, evictable again
        blocks_used = srv.engine.stats().blocks_total - srv.engine.stats().blocks_free
        assert blocks_used == 0


def test_warm_ups_count_against_the_tenant_and_are_its_own(tiny_llama_dir):
    keys = f"alice:{hash_key('ka')}\nbob:{hash_key('kb')}"
    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=POOL_40, host_cache_memory=1 << 20, spill_after=0.05,
                      spill_to=("host",), api_keys=keys, restore_policy="always",
                      warm_tenant_fraction=0.125)  # 4 of 39 blocks per tenant
    with ServerThread(cfg, http_port=0) as srv, KVServeClient(srv.address, token="ka", timeout=60) as alice, \
            KVServeClient(srv.address, token="kb", timeout=60) as bob, \
            KVServeClient(srv.address, timeout=60) as anonymous:  # fmt: skip
        alice.complete(token_ids=SESSION, session_id="mine", max_new_tokens=6)
        n = spill_and_push_off(srv, alice, "mine", "host")
        for client, code in ((bob, grpc.StatusCode.NOT_FOUND), (anonymous, grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(KVServeError) as e:
                client.warm_session("mine")
            assert e.value.code == code
        assert warm_stats(srv).pinned_blocks == 0
        url = f"http://127.0.0.1:{srv.running.http_port}/v1/sessions/mine/warm"
        for key, status in (("kb", 404), ("", 401)):
            req = urllib.request.Request(url, method="POST", headers={"Authorization": f"Bearer {key}"} if key else {})
            with pytest.raises(urllib.error.HTTPError) as he:
                urllib.request.urlopen(req, timeout=60)
            assert he.value.code == status
        w = alice.warm_session("mine")
        assert (w.restored, w.over_cap, w.missing) == (4, n - 4, 0)  # the tenant's share: 4 blocks
        assert warm_stats(srv).pinned_blocks == 4
        r = alice.complete(token_ids=[9], session_id="mine", max_new_tokens=2)
        assert r.start.cached_by_tier["device"] == 4 * BLOCK_SIZE  # the rest came from the host tier
        assert r.start.cached_tokens == n * BLOCK_SIZE


def test_warming_an_unknown_session_is_not_found(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as srv, KVServeClient(srv.address, timeout=60) as c:
        with pytest.raises(KVServeError) as e:
            c.warm_session("nobody")
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "nobody" in e.value.details
        url = f"http://127.0.0.1:{srv.running.http_port}/v1/sessions/nobody/warm"
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60)
        assert he.value.code == 404 and json.loads(he.value.read())["error"]["code"] == "session_not_found"
        # a session whose blocks are on the device already: held, nothing restored
        c.complete(token_ids=SESSION, session_id="here", max_new_tokens=6)
        w = c.warm_session("here")
        n = len(transcript(c, "here")) // BLOCK_SIZE
        assert (w.blocks, w.on_device, w.restored, w.missing) == (n, n, 0, 0)
        assert warm_stats(srv).requests == 1  # the unknown one never reached the engine


@pytest.mark.parametrize("hop", ["locate_warm", "fetch_warm"])
def test_a_session_deleted_during_its_warm_up_from_redis_leaves_nothing_held(tiny_llama_dir, redis_url, hop):
    """WarmSession of a session spilled to Redis, and DeleteSession while the warm-up is
    on the restore thread: its answer (which blocks the store holds; the loaded blocks)
    waits there until the delete has dropped the session's device blocks, and the delete's
    removal from Redis waits for the warm-up to be through, so the warm-up could still
    load every block. It lands holding nothing, and every device block is free again."""
    import threading

    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=POOL_40, redis_url=redis_url, host_cache_memory=0,
                      spill_after=0.05, spill_to=("redis",), restore_policy="always", warm_pool_fraction=0.5,
                      warm_tenant_fraction=0.5)  # fmt: skip
    sid = f"gone-{hop}"
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        c.complete(token_ids=SESSION, session_id=sid, max_new_tokens=6)
        n = spill_and_push_off(srv, c, sid, "redis")
        engine = srv.engine.engine
        reached, dropped, warm_done = threading.Event(), threading.Event(), threading.Event()
        hop_call, forget_device, forget_stored = getattr(engine.restorer, hop), engine.forget_device, engine.forget_stored

        def held_until_dropped(*args):  # the hop's answer waits on the restore thread
            *head, then = args

            def answer(*result):
                reached.set()
                dropped.wait(30)
                then(*result)

            hop_call(*head, answer)

        def drop_device(*args, **kw):
            try:
                return forget_device(*args, **kw)
            finally:
                dropped.set()

        def drop_stored(*args, **kw):
            warm_done.wait(30)
            return forget_stored(*args, **kw)

        setattr(engine.restorer, hop, held_until_dropped)
        engine.forget_device, engine.forget_stored = drop_device, drop_stored
        warmed: list[object] = []

        def warm() -> None:
            try:
                warmed.append(c.warm_session(sid))
            finally:
                warm_done.set()

        warming = threading.Thread(target=warm)
        warming.start()
        assert reached.wait(30)
        c.delete_session(sid)
        warming.join(30)
        assert warmed and (warmed[0].blocks, warmed[0].restored, warmed[0].over_cap, warmed[0].missing) == (n, 0, 0, n)
        stats = warm_stats(srv)
        assert stats.pinned_blocks == 0 and stats.blocks_restored == {}
        assert srv.engine.stats().blocks_free == srv.engine.stats().blocks_total
