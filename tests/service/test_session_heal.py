"""A session record that fails to decode or verify, or a session key of the wrong Redis
type, is that session's problem alone: it reads as absent (GetSession NOT_FOUND, Generate
starts the session over) on every replica, the next write replaces it, and the session
store's circuit breaker stays closed, so every other session keeps its history.

Two replicas share one real redis-server; the records are damaged in Redis directly."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.metrics import SessionStoreCollector
from kvserve.service.sessions import (
    FallbackSessionStore,
    InMemorySessionStore,
    RedisSessionStore,
    SessionLimit,
    SessionManager,
    SessionRecord,
    decode_record,
    encode_record,
)
from kvserve.service.sessions.stores import CONFLICT, HEALED, WRITTEN, Expect
from tests.fixtures.serving import ServerThread, tiny_config

OWNER = ""  # no auth: every caller is the tenant ""
PREFIX = "kvserve:"


def record_key(sid: str) -> str:
    return f"{PREFIX}sess:{OWNER}:{sid}"


def replica(model_dir, url):
    return ServerThread(tiny_config(model_dir, redis_url=url, host_cache_memory=0, log_level="error"))


@pytest.fixture
def pair(tiny_llama_dir, redis_url):
    with replica(tiny_llama_dir, redis_url) as sa, replica(tiny_llama_dir, redis_url) as sb:
        with KVServeClient(sa.address, timeout=60) as a, KVServeClient(sb.address, timeout=60) as b:
            yield sa, sb, a, b, redis.Redis.from_url(redis_url)


def not_found(call) -> str:
    with pytest.raises(KVServeError) as e:
        call()
    assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
    return e.value.details


def flip_a_token_byte(raw: bytes) -> bytes:
    body = bytearray(raw)
    body[-12] ^= 0x01  # inside the tokens / turn log: the metadata still parses, the CRC does not match
    return bytes(body)


def other_sessions_record(r, sid: str, other: str) -> bytes:
    return r.get(record_key(other))  # a good record, of another session


DAMAGE = {
    "flipped byte": lambda r, sid, raw: flip_a_token_byte(raw),
    "truncated": lambda r, sid, raw: raw[: len(raw) - 7],
    "another session's record": lambda r, sid, raw: other_sessions_record(r, sid, "bystander"),
}


def store_of(server):
    return server.running.sessions.store


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_corrupt_record_reads_as_absent_and_the_next_write_replaces_it(pair, damage):
    sa, sb, a, b, r = pair
    a.chat("bystander", "a session nobody damages", max_new_tokens=2)
    a.chat("broken", "hello there, this is a fairly long first message", max_new_tokens=4)
    raw = r.get(record_key("broken"))
    bad = DAMAGE[damage](r, "broken", raw)
    r.set(record_key("broken"), bad, keepttl=True)

    # B has no copy: the record is absent for reads, and a turn starts the session over
    # (it used to answer FAILED_PRECONDITION "just written by another replica" forever)
    assert "not found" in not_found(lambda: b.get_session("broken"))
    first = b.chat("broken", "start again", max_new_tokens=3)
    assert first.start.session_created
    healed = decode_record(r.get(record_key("broken")))  # the next write replaced the bad value
    assert healed.session_id == "broken" and healed.turns == 1
    assert b.get_session("broken").turns == 1
    again = b.chat("broken", "and more", max_new_tokens=3)  # a normal session from now on
    assert not again.start.session_created and again.start.prompt_tokens > first.start.prompt_tokens
    assert b.get_session("broken").turns == 2
    assert a.get_session("broken").turns == 2  # A reads Redis's version, not its old copy
    assert decode_record(r.get(record_key("bystander"))).turns == 1  # untouched

    sessions = sb.running.sessions
    assert sessions.store.unreadable_records == 1  # counted once, though read several times
    assert sessions.records_healed == 1
    assert store_of(sb).breaker.state == "closed"
    scraped = {m.name: m.samples[0].value for m in SessionStoreCollector(sessions).collect() if len(m.samples) == 1}
    assert scraped["kvserve_session_records_unreadable"] == 1
    assert scraped["kvserve_session_records_healed"] == 1


def test_a_corrupt_record_on_the_replica_that_holds_a_copy_is_written_back(pair):
    sa, sb, a, b, r = pair
    a.chat("kept", "hello there, this is a fairly long first message", max_new_tokens=4)
    r.set(record_key("kept"), flip_a_token_byte(r.get(record_key("kept"))), keepttl=True)
    # A still has its own copy: it continues the conversation and repairs Redis
    assert a.get_session("kept").turns == 1
    nxt = a.chat("kept", "second", max_new_tokens=2)
    assert not nxt.start.session_created
    assert decode_record(r.get(record_key("kept"))).turns == 2
    assert b.get_session("kept").turns == 2
    assert sa.running.sessions.records_healed == 1


def test_a_session_key_of_the_wrong_type_fails_that_session_only(pair):
    sa, sb, a, b, r = pair
    roaming = [f"roaming-{i}" for i in range(8)]  # sessions of A that B must keep serving with their history
    for i, sid in enumerate(roaming):
        a.chat(sid, f"hello there number {i}, this is a fairly long first message", max_new_tokens=4)
    a.chat("hashed", "soon a hash", max_new_tokens=2)
    r.delete(record_key("hashed"))
    r.hset(record_key("hashed"), mapping={"not": "ours"})

    for _ in range(4):  # more than the breaker's failure threshold (2)
        assert "not found" in not_found(lambda: b.get_session("hashed"))
    assert store_of(sb).breaker.state == "closed"
    for sid in roaming:  # every session A wrote is still whole on B (it used to "start over")
        assert b.get_session(sid).turns == 1
        reply = b.chat(sid, "and then?", max_new_tokens=2)
        assert not reply.start.session_created, sid
        assert reply.start.prompt_tokens > 20  # the history came along
        assert b.get_session(sid).turns == 2
    assert store_of(sb).breaker.state == "closed"
    assert store_of(sb).primary_errors == 0

    # the wrong-type key is not ours to trust: the next turn starts the session over and
    # its write replaces the key with a record
    fresh = b.chat("hashed", "a new start", max_new_tokens=2)
    assert fresh.start.session_created
    assert r.type(record_key("hashed")) == b"string"
    assert decode_record(r.get(record_key("hashed"))).turns == 1
    assert a.get_session("hashed").turns == 1
    assert sb.running.sessions.records_healed == 1


def test_a_lock_key_of_the_wrong_type_is_not_a_lock(pair):
    sa, sb, a, b, r = pair
    a.chat("locked", "hello", max_new_tokens=2)
    r.hset(f"{PREFIX}sess-lock:{OWNER}:locked", mapping={"not": "ours"})
    assert not b.get_session("locked").busy
    for _ in range(3):
        assert not b.chat("locked", "go on", max_new_tokens=2).start.session_created
    assert b.get_session("locked").turns == 4
    assert store_of(sb).breaker.state == "closed" and store_of(sb).primary_errors == 0


def test_deleting_a_corrupt_session_answers_not_found_and_clears_it(pair):
    sa, sb, a, b, r = pair
    a.chat("gone", "hello", max_new_tokens=2)
    r.set(record_key("gone"), r.get(record_key("gone"))[:-5], keepttl=True)
    assert "not found" in not_found(lambda: b.delete_session("gone"))
    assert b.chat("gone", "new", max_new_tokens=2).start.session_created


# ----------------------------------------------------------------------------- the store


def _rec(sid: str, etag: str = "e1", turns: int = 1) -> SessionRecord:
    return SessionRecord(session_id=sid, owner="o", token_ids=[1, 2, 3], created_at=1.0, last_used_at=2.0,
                         turns=turns, etag=etag)  # fmt: skip


def test_the_store_replaces_only_the_unreadable_value_its_read_found(redis_url):
    r = redis.Redis.from_url(redis_url)

    async def run() -> None:
        s = RedisSessionStore.from_url(redis_url, key_prefix="heal:", ttl_s=60)
        try:
            assert await s.put_if(_rec("a"), Expect(absent_ok=True), create=True) == WRITTEN
            key = "heal:sess:o:a"
            r.set(key, flip_a_token_byte(r.get(key)))
            rec, expect = await s.read("o", "a")
            assert rec is None and expect.absent_ok and expect.unreadable
            # another value since the read (a healthy write elsewhere) is not replaced
            r.set(key, flip_a_token_byte(flip_a_token_byte(r.get(key))[:-1] + b"\x00"))
            assert await s.put_if(_rec("a", "e2"), expect, create=True) == CONFLICT
            rec, expect = await s.read("o", "a")
            assert await s.put_if(_rec("a", "e2"), expect, create=True) == HEALED
            assert (await s.get("o", "a")).etag == "e2"
            assert s.unreadable_records == 2
            # a HASH in the record's key: absent, replaced by the next write, never an error
            r.delete(key)
            r.hset(key, "x", "y")
            rec, expect = await s.read("o", "a")
            assert rec is None and expect.unreadable == "type:hash"
            assert await s.put_if(_rec("a", "e3"), expect, create=True) == HEALED
            assert (await s.get("o", "a")).etag == "e3"
            r.delete(key)
            r.hset(key, "x", "y")
            assert await s.delete("o", "a") is True and await s.get_state("o", "a") == (None, True)
        finally:
            await s.close()

    asyncio.run(run())


def test_a_key_error_fails_that_call_alone_and_never_opens_the_breaker(redis_url):
    r = redis.Redis.from_url(redis_url)

    async def run() -> None:
        fb = FallbackSessionStore(RedisSessionStore.from_url(redis_url, key_prefix="keyerr:", ttl_s=60))
        try:
            r.hset("keyerr:sess-ids:o", "x", "y")  # the owner's index is a HASH
            for _ in range(5):
                assert await fb.count("o") == 0  # zcard fails for this key: answered from this replica
            assert fb.key_errors == 5 and fb.primary_errors == 0
            assert fb.breaker.state == "closed"
            # a delete of a session is not held up by its tenant's index
            r.set("keyerr:sess:o:z", encode_record(_rec("z")))
            assert await fb.delete("o", "z") is True and fb.unsynced == 0
            # a write replaces the index (not ours) and the session is there for everyone
            assert await fb.put_if(_rec("a"), Expect(absent_ok=True), create=True, limit=3) == WRITTEN
            assert r.type("keyerr:sess-ids:o") == b"zset" and await fb.primary.count("o") == 1
        finally:
            await fb.close()

    asyncio.run(run())


@pytest.mark.parametrize("store", ["memory", "redis", "redis-down"])
def test_concurrent_creations_hold_the_limit_in_every_store(redis_url, store):
    async def run() -> None:
        if store == "memory":
            stores = [InMemorySessionStore()]
        else:
            url = redis_url if store == "redis" else "redis://127.0.0.1:1/0"  # nothing listens there
            # (a generous timeout: on a loaded machine 60 calls at once pass 0.3 s, and a
            # call that times out is decided by this replica alone, as while Redis is away)
            # (the socket timeout too: a read past it is a connection failure, and the
            # store then counts this replica's sessions alone)
            timeout = 5.0 if store == "redis" else 0.3
            stores = [FallbackSessionStore(RedisSessionStore.from_url(url, key_prefix="lim:", socket_timeout_s=min(timeout, 2.0)),
                                           timeout_s=timeout) for _ in range(2)]  # fmt: skip
        managers = [SessionManager(st, max_sessions_per_owner=5) for st in stores]

        async def create(i: int) -> bool:
            m = managers[i % len(managers)]
            try:
                turn = await m.begin_turn("o", f"s{i}")
            except SessionLimit:
                return False
            await m.commit_turn(turn, [1, 2, 3], [4])
            await m.end_turn(turn)
            return True

        try:
            made = await asyncio.gather(*(create(i) for i in range(60)))
            per = 5 if store != "redis-down" else 5 * len(managers)  # Redis away: each replica counts its own
            assert sum(made) == per
        finally:
            for st in stores:
                await st.close()

    asyncio.run(run())
