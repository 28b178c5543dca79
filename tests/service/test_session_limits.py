"""``--max-sessions-per-tenant`` holds under concurrency: 60 Generate calls on new
session ids at once, through one replica or spread over two that share one real
redis-server, create exactly ``limit`` sessions; every other call is RESOURCE_EXHAUSTED
and leaves nothing behind. ForkSession counts the same way."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from kvserve.clients import AsyncKVServeClient, KVServeClient, KVServeError
from kvserve.service.sessions import (
    FallbackSessionStore,
    RedisSessionStore,
    SessionLimit,
    SessionManager,
    decode_record,
)
from tests.fixtures.serving import ServerThread, tiny_config

CALLS = 60


def replica(model_dir, url, limit):
    return ServerThread(
        # a generous session-store timeout: a call that passes it is decided by this
        # replica alone (as while Redis is away), and 60 calls at once on a loaded
        # machine can pass the default 0.3 s
        tiny_config(model_dir, redis_url=url, host_cache_memory=0, max_sessions_per_tenant=limit,
                    max_num_seqs=16, session_store_timeout=5.0, log_level="error")
    )  # fmt: skip


async def create_at_once(addresses: list[str], prefix: str) -> list[tuple[str, object]]:
    """CALLS first turns on new ids, all at once, spread round-robin over ``addresses``."""
    clients = [AsyncKVServeClient(a, timeout=120) for a in addresses]

    async def one(i: int) -> tuple[str, object]:
        sid = f"{prefix}-{i}"
        try:
            return sid, await clients[i % len(clients)].complete(session_id=sid, token_ids=[5, 6, 7], max_new_tokens=1)
        except KVServeError as e:
            return sid, e

    try:
        return await asyncio.gather(*(one(i) for i in range(CALLS)))
    finally:
        for c in clients:
            await c.close()


def stored_sessions(r) -> set[str]:
    out = set()
    for key in r.scan_iter(match="kvserve:sess:*"):
        data = r.get(key)
        if data and data.startswith(b"KVSS"):
            out.add(decode_record(data).session_id)
    return out


@pytest.mark.parametrize("limit", [1, 5, 20])
def test_the_session_limit_holds_for_concurrent_creations(tiny_llama_dir, redis_url, limit):
    r = redis.Redis.from_url(redis_url)
    with replica(tiny_llama_dir, redis_url, limit) as sa, replica(tiny_llama_dir, redis_url, limit) as sb:
        for name, addresses in (("one", [sa.address]), ("two", [sa.address, sb.address])):
            results = asyncio.run(create_at_once(addresses, name))
            created = {sid for sid, res in results if not isinstance(res, Exception)}
            refused = [res for sid, res in results if isinstance(res, Exception)]
            assert len(created) == limit, (name, len(created))
            assert len(refused) == CALLS - limit
            for e in refused:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                assert f"the limit is {limit} per tenant" in e.details
            # exactly the sessions that were acknowledged exist, on every replica
            assert stored_sessions(r) == created
            with KVServeClient(sa.address) as a, KVServeClient(sb.address) as b:
                assert {s.session_id for s in a.iter_sessions()} == created
                assert {s.session_id for s in b.iter_sessions()} == created
                # the tenant is full: a fork is refused too, and a deleted session frees one place
                some = sorted(created)[0]
                with pytest.raises(KVServeError) as e:
                    b.fork_session(some, f"forked-{name}")
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                a.delete_session(some)
                assert b.complete(session_id=f"after-{name}", token_ids=[5], max_new_tokens=1).start.session_created
                with pytest.raises(KVServeError) as e:
                    a.complete(session_id=f"one-more-{name}", token_ids=[5], max_new_tokens=1)
                assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert len(stored_sessions(r)) == limit
                for s in b.iter_sessions():  # the tenant starts the next round empty
                    b.delete_session(s.session_id)
            assert stored_sessions(r) == set()


def test_concurrent_forks_hold_the_limit(tiny_llama_dir, redis_url):
    limit = 5
    with replica(tiny_llama_dir, redis_url, limit) as sa, replica(tiny_llama_dir, redis_url, limit) as sb:
        with KVServeClient(sa.address) as a:
            a.complete(session_id="src", token_ids=[5, 6, 7], max_new_tokens=1)

        async def forks() -> list[object]:
            clients = [AsyncKVServeClient(x, timeout=120) for x in (sa.address, sb.address)]

            async def one(i: int):
                try:
                    return await clients[i % 2].fork_session("src", f"fork-{i}")
                except KVServeError as e:
                    return e

            try:
                return await asyncio.gather(*(one(i) for i in range(30)))
            finally:
                for c in clients:
                    await c.close()

        results = asyncio.run(forks())
        ok = [x for x in results if not isinstance(x, Exception)]
        assert len(ok) == limit - 1
        assert all(x.code == grpc.StatusCode.RESOURCE_EXHAUSTED for x in results if isinstance(x, Exception))
        assert len(stored_sessions(redis.Redis.from_url(redis_url))) == limit


def test_an_expired_session_frees_its_place_and_its_id_can_be_used_again(redis_url):
    """The index still lists a session whose record Redis expired: at the limit it is
    pruned, and a first turn on that very id is no extra session."""
    r = redis.Redis.from_url(redis_url)

    async def run() -> None:
        store = FallbackSessionStore(RedisSessionStore.from_url(redis_url, key_prefix="lim:"), timeout_s=5.0)
        m = SessionManager(store, max_sessions_per_owner=2)

        async def turn(sid: str) -> None:
            t = await m.begin_turn("o", sid)
            await m.commit_turn(t, [1, 2, 3], [4])
            await m.end_turn(t)

        try:
            await turn("a")
            await turn("b")
            with pytest.raises(SessionLimit):
                await turn("c")
            r.delete("lim:sess:o:a")  # as Redis expiring it; the index still lists it
            await store.local.delete("o", "a")  # and this replica's copy expired too
            await turn("a")  # the same id again: its place is its own
            with pytest.raises(SessionLimit):
                await turn("c")
            r.delete("lim:sess:o:b")
            await store.local.delete("o", "b")
            await turn("c")  # b's place, pruned from the index
            assert sorted(i.decode() for i in r.zrange("lim:sess-ids:o", 0, -1)) == ["a", "c"]
        finally:
            await store.close()

    asyncio.run(run())
