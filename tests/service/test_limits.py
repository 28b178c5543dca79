"""Limits: each one answers at once with RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming the
limit, never a hang; session TTL and DeleteSession remove the transcript and stop the
session's KV blocks from being found in any tier."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.auth import hash_key
from tests.fixtures.serving import BLOCK_SIZE, HeldServer, ServerThread, tiny_config, wait_until

KEY_A, KEY_B = "limits-key-a", "limits-key-b"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    cfg = tiny_config(
        tiny_llama_dir,
        api_keys=f"acme:{hash_key(KEY_A)}\nbravo:{hash_key(KEY_B)}",
        max_prompt_tokens=40, max_streams=3, max_streams_per_tenant=2, max_sessions_per_tenant=2,
        max_message_size=64 << 10, max_new_tokens_limit=64,
    )  # fmt: skip
    with HeldServer(cfg) as s:
        yield s


def _client(server, key=KEY_A):
    return KVServeClient(server.address, token=key, timeout=60)


def _error(call) -> KVServeError:
    with pytest.raises(KVServeError) as err:
        call()
    return err.value


def test_concurrent_streams_per_tenant_and_in_total(server):
    admission = server.running.admission
    server.set_gate(False)
    results: list[Any] = []

    def run(key: str) -> None:
        with _client(server, key) as c:
            try:
                results.append(c.complete(token_ids=[5, 6, 7], max_new_tokens=4))
            except KVServeError as e:  # surfaced below
                results.append(e)

    threads = []
    try:
        for key in (KEY_A, KEY_A):
            threads.append(threading.Thread(target=run, args=(key,)))
            threads[-1].start()
        assert wait_until(lambda: admission.streams_of("acme") == 2)
        err = _error(lambda: _client(server, KEY_A).complete(token_ids=[5], max_new_tokens=1))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 in flight, the limit is 2 per tenant" in err.details
        # another tenant still gets in, up to the server's total
        threads.append(threading.Thread(target=run, args=(KEY_B,)))
        threads[-1].start()
        assert wait_until(lambda: admission.inflight == 3)
        err = _error(lambda: _client(server, KEY_B).complete(token_ids=[5], max_new_tokens=1))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 3 at once" in err.details
    finally:
        server.set_gate(True)
        for t in threads:
            t.join(60)
    assert len(results) == 3 and all(not isinstance(r, Exception) and len(r.token_ids) == 4 for r in results)
    assert admission.inflight == 0 and admission.streams_of("acme") == admission.streams_of("bravo") == 0
    with _client(server) as c:
        assert len(c.complete(token_ids=[5, 6], max_new_tokens=2).token_ids) == 2


def test_prompt_token_limit_for_requests_and_sessions(server):
    with _client(server) as c:
        err = _error(lambda: c.complete(token_ids=list(range(5, 46)), max_new_tokens=1))  # 41 tokens
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt has 41 tokens; the limit is 40" in err.details
        assert len(c.complete(token_ids=list(range(5, 45)), max_new_tokens=1).token_ids) == 1  # 40 is fine
        # a session's transcript counts: 20 + 4 generated, then 20 more is over
        c.complete(token_ids=list(range(5, 25)), session_id="long", max_new_tokens=4)
        err = _error(lambda: c.complete(token_ids=list(range(5, 25)), session_id="long", max_new_tokens=1))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "transcript has 24 tokens and this turn adds 20: 44 > max_prompt_tokens 40" in err.details
        assert c.get_session("long").turns == 1 and not c.get_session("long").busy
        c.delete_session("long")


def test_sessions_per_tenant(server):
    with _client(server) as a, _client(server, KEY_B) as b:
        a.complete(token_ids=[5, 6], session_id="s1", max_new_tokens=1)
        a.complete(token_ids=[5, 6], session_id="s2", max_new_tokens=1)
        err = _error(lambda: a.complete(token_ids=[5, 6], session_id="s3", max_new_tokens=1))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already has 2 sessions; the limit is 2 per tenant" in err.details
        assert _error(lambda: a.get_session("s3")).code == grpc.StatusCode.NOT_FOUND  # not created
        a.complete(token_ids=[7], session_id="s1", max_new_tokens=1)  # existing sessions go on
        b.complete(token_ids=[5, 6], session_id="s3", max_new_tokens=1)  # the other tenant has room
        a.delete_session("s1")
        a.complete(token_ids=[5, 6], session_id="s3", max_new_tokens=1)
        assert sorted(s.session_id for s in a.iter_sessions()) == ["s2", "s3"]
        for sid in ("s2", "s3"):
            a.delete_session(sid)
        b.delete_session("s3")


def test_request_size_limits(server):
    with _client(server) as c:
        err = _error(lambda: c.complete(text="x" * (100 << 10), max_new_tokens=1))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "65536" in err.details
        err = _error(lambda: c.complete(token_ids=[5], max_new_tokens=65))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit 64" in err.details
        err = _error(lambda: c.complete(token_ids=[5], max_new_tokens=1, cache_salt="s" * 257))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "257 characters; the limit is 256" in err.details
        err = _error(lambda: c.complete(token_ids=[5], max_new_tokens=1, stop=["a"] * 17))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "17 strings; the limit is 16" in err.details
        err = _error(lambda: c.complete(token_ids=[5], max_new_tokens=1, stop=["a" * 300]))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "300 characters; the limit is 256" in err.details
        err = _error(lambda: c.complete(token_ids=[5], max_new_tokens=1, stop_token_ids=[3] * 65))
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "65 ids; the limit is 64" in err.details
        assert c.health() == "SERVING"
        assert len(c.complete(token_ids=[5, 6], max_new_tokens=2).token_ids) == 2


# ----------------------------------------------------------------------------- forgetting


def _where(srv: ServerThread, tokens: list[int], salt: str = "") -> dict[str, int]:
    return srv.call(srv.engine.block_locations(tokens, srv.running.conversations.cache_scope("", salt)))


def test_delete_session_removes_the_transcript_and_its_blocks_in_every_tier(tiny_llama_dir, redis_server, redis_url):
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, host_cache_memory=1 << 20, spill_after=0.05,
                      spill_to=("host", "redis"))  # fmt: skip
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        prompt = list(range(30, 30 + 3 * BLOCK_SIZE))
        c.complete(token_ids=prompt, session_id="gone", max_new_tokens=BLOCK_SIZE)
        tokens = c.get_session("gone", include_token_ids=True).token_ids
        n = len(tokens) // BLOCK_SIZE
        c.complete(token_ids=prompt, cache_salt="elsewhere", max_new_tokens=2)  # same tokens, other namespace
        assert wait_until(lambda: c.get_session("gone").cached_blocks == {"device": n, "host": n, "disk": 0, "redis": n})
        c.delete_session("gone")
        assert _error(lambda: c.get_session("gone")).code == grpc.StatusCode.NOT_FOUND
        assert _where(srv, tokens) == {"device": 0, "host": 0, "redis": 0}
        with redis_server.client() as r:
            # the record's key holds only the tombstone (no transcript), until the id is used again
            assert [r.get(k)[:8] for k in r.keys("*") if k.endswith(b"sess::gone")] == [b"KVSDEL1:"]
        # the same id and the same tokens again: nothing of the deleted session is found
        again = c.complete(token_ids=prompt, session_id="gone", max_new_tokens=2)
        assert again.start.cached_tokens == 0
        # KV of another namespace with the same tokens was not touched
        other = c.complete(token_ids=prompt, cache_salt="elsewhere", max_new_tokens=2)
        assert other.start.cached_tokens == 2 * BLOCK_SIZE  # the 3rd block holds the recomputed last token


def test_expired_sessions_lose_transcript_and_blocks(tiny_llama_dir, redis_server, redis_url):
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, host_cache_memory=1 << 20, spill_after=0.05,
                      spill_to=("host", "redis"), session_ttl=3.0)  # fmt: skip
    with ServerThread(cfg) as srv, KVServeClient(srv.address, timeout=60) as c:
        prompt = list(range(60, 60 + 2 * BLOCK_SIZE))
        c.complete(token_ids=prompt, session_id="brief", max_new_tokens=BLOCK_SIZE)
        tokens = c.get_session("brief", include_token_ids=True).token_ids
        n = len(tokens) // BLOCK_SIZE
        assert _where(srv, tokens)["device"] == n
        with redis_server.client() as r:
            key = next(k for k in r.keys("*") if k.endswith(b"sess::brief"))
            assert 0 < r.pttl(key) <= 3000  # the record's TTL in Redis is the session TTL

        def gone() -> bool:
            try:
                c.get_session("brief")
                return False
            except KVServeError as e:
                return e.code == grpc.StatusCode.NOT_FOUND

        assert wait_until(gone, timeout=30)
        assert wait_until(lambda: _where(srv, tokens) == {"device": 0, "host": 0, "redis": 0}, timeout=30)
        assert c.complete(token_ids=prompt, session_id="brief", max_new_tokens=2).start.cached_tokens == 0
