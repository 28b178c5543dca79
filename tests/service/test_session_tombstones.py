"""A deleted session stays deleted, against real redis-server processes: DeleteSession
leaves a tombstone in the record's key that no stale writer passes (a turn that started
before the delete, the lock renewal's write-back, a replica's write-back after Redis
missed its writes), a turn whose session was deleted under it ends NOT_FOUND with
nothing recorded, and a new session with the same id (a first turn, a fork) replaces
the tombstone."""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
import redis

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.sessions import (
    FallbackSessionStore,
    InMemorySessionStore,
    RedisSessionStore,
    SessionDeleted,
    SessionManager,
    SessionRecord,
)
from kvserve.service.sessions.stores import DELETED, REPLACED, RESTORED, TOMBSTONE_PREFIX, WRITTEN, Expect, new_etag
from tests.fixtures.serving import ChatTurn, HeldServer, ServerThread, redis_session_config, transcript, wait_until

PREFIX = "tomb:"


def _rec(sid: str, turns: int = 1, etag: str | None = None, **kw) -> SessionRecord:
    return SessionRecord(session_id=sid, owner="o", token_ids=[1, 2, 3][: turns + 1], created_at=1.0,
                         last_used_at=2.0, turns=turns, etag=etag or new_etag(), **kw)  # fmt: skip


def _not_found(call) -> KVServeError:
    with pytest.raises(KVServeError) as err:
        call()
    assert err.value.code == grpc.StatusCode.NOT_FOUND, err.value
    return err.value


# ----------------------------------------------------------------------------- the store


def test_redis_delete_leaves_a_tombstone_that_only_a_creation_replaces(redis_url):
    r = redis.Redis.from_url(redis_url)

    async def run() -> None:
        s = RedisSessionStore.from_url(redis_url, key_prefix=PREFIX, ttl_s=60)
        try:
            old = _rec("a")
            assert await s.put_if(old, Expect(absent_ok=True), create=True) == WRITTEN
            assert await s.delete("o", "a") is True
            assert await s.delete("o", "a") is False  # already gone: the tombstone is no session
            assert await s.get("o", "a") is None and await s.get_state("o", "a") == (None, True)
            assert (await s.list("o", 10))[0] == [] and await s.count("o") == 0
            # writers of the deleted version: a commit, a renewal's write-back, a write-back
            newer = _rec("a", turns=2)
            assert await s.put_if(newer, Expect.of(old)) == DELETED
            assert await s.put_if(newer, Expect.of(old), replace_uncommitted=True) == DELETED
            assert await s.put_if(newer, Expect(frozenset({old.etag}), absent_ok=True)) == DELETED
            assert await s.get_state("o", "a") == (None, True)
            # without a tombstone the same write restores a lost record (Redis flushed)
            assert await s.put_if(_rec("b"), Expect.of(old)) == RESTORED
            # a creation replaces the tombstone: the id is a new session
            fresh = _rec("a", turns=0, etag=new_etag(kept=True))
            assert await s.put_if(fresh, Expect(absent_ok=True), create=True) == WRITTEN
            assert (await s.get("o", "a")).etag == fresh.etag
            # ... that the deleted version's writer cannot replace, though it has no turn yet
            assert await s.put_if(newer, Expect.of(old), replace_uncommitted=True) == "conflict"
            plain = _rec("c", turns=0)
            await s.put(plain)
            assert await s.put_if(_rec("c"), Expect.of(old), replace_uncommitted=True) == REPLACED
            # its first turn does not complete: the tombstone is back, not a free id
            assert await s.delete_if("o", "a", frozenset({fresh.etag})) is True
            assert await s.get_state("o", "a") == (None, True)
        finally:
            await s.close()

    asyncio.run(run())
    tomb = r.get(f"{PREFIX}sess:o:a")
    assert tomb.startswith(TOMBSTONE_PREFIX) and 0 < r.pttl(f"{PREFIX}sess:o:a") <= 60_000  # the record TTL


def test_a_delete_that_missed_a_hung_redis_is_sent_when_it_answers(make_redis_server):
    """SIGSTOP: the delete reaches only this replica's copy; after SIGCONT the next read
    sends it to Redis first, so the record Redis still held does not come back. A new
    session of that id created during another hang is written back over the tombstone."""
    srv = make_redis_server()

    async def run() -> None:
        fb = FallbackSessionStore(RedisSessionStore.from_url(srv.url, key_prefix=PREFIX, ttl_s=60),
                                  InMemorySessionStore(), timeout_s=0.3, sync_every_s=3600.0)  # fmt: skip
        try:
            rec = _rec("d")
            assert await fb.put_if(rec, Expect(absent_ok=True), create=True) == WRITTEN
            srv._proc.send_signal(signal.SIGSTOP)
            try:
                assert await fb.delete("o", "d") is True  # this replica's copy
                assert fb.unsynced == 1
            finally:
                srv._proc.send_signal(signal.SIGCONT)
            with redis.Redis.from_url(srv.url) as r:
                assert r.get(f"{PREFIX}sess:o:d").startswith(b"KVSS")  # Redis still has it
            for _ in range(50):  # the breaker may still be open for a moment
                got, _ = await fb.read("o", "d")
                assert got is None
                if fb.unsynced == 0:
                    break
                await asyncio.sleep(0.1)
            assert fb.unsynced == 0
            assert await fb.primary.get_state("o", "d") == (None, True)
            # the id used again while Redis hangs: a creation, written back over the tombstone
            again = _rec("d", turns=0)
            srv._proc.send_signal(signal.SIGSTOP)
            try:
                assert (await fb.read("o", "d"))[0] is None
                assert await fb.put_if(again, Expect(absent_ok=True), create=True) == "unknown"
            finally:
                srv._proc.send_signal(signal.SIGCONT)
            for _ in range(50):
                await fb.sync()
                if fb.unsynced == 0:
                    break
                await asyncio.sleep(0.1)
            assert (await fb.primary.get("o", "d")).etag == again.etag
        finally:
            await fb.close()

    asyncio.run(run())


def test_a_turn_whose_session_is_deleted_commits_nothing(redis_url):
    """The table: a turn in flight, the session deleted through another replica's table
    (its lock was lost): the commit raises SessionDeleted; a new turn starts it over."""

    async def run() -> None:
        def table() -> SessionManager:
            store = FallbackSessionStore(RedisSessionStore.from_url(redis_url, key_prefix=PREFIX, ttl_s=60))
            return SessionManager(store, lock_ttl_s=30.0)

        a, b = table(), table()
        try:
            t = await a.begin_turn("o", "t")
            await a.commit_turn(t, [1, 2], [3])
            await a.end_turn(t)
            t = await a.begin_turn("o", "t")
            await a.store.primary._r.delete(f"{PREFIX}sess-lock:o:t")  # the lease is lost
            await b.delete("o", "t")
            with pytest.raises(SessionDeleted, match="deleted while this turn ran"):
                await a.commit_turn(t, [1, 2, 3, 4], [5])
            assert t.deleted and a.deleted_turns == 1
            await a.end_turn(t)
            for mgr in (a, b):
                assert await mgr.store.get("o", "t") is None
            t = await a.begin_turn("o", "t")  # the same id again: a new session
            assert t.created and t.record.turns == 0 and t.record.token_ids == []
            await a.commit_turn(t, [7], [8])
            await a.end_turn(t)
            rec, _ = await b.get("o", "t")
            assert rec.turns == 1 and rec.token_ids == [7, 8]
        finally:
            await a.store.close()
            await b.store.close()

    asyncio.run(run())


# ----------------------------------------------------------------------------- live servers


def test_delete_on_one_replica_while_a_turn_streams_on_the_other(tiny_llama_dir, make_redis_server):
    """Replica 1 streams a turn of "s"; Redis loses the turn lock (a failover, a lost
    lease); DeleteSession on replica 2 goes through. Replica 1's turn ends NOT_FOUND,
    nothing of it is written back, neither replica finds the session, and a new turn
    with the same id starts a new session that both see."""
    redis_srv = make_redis_server()
    with HeldServer(redis_session_config(tiny_llama_dir, redis_srv.url)) as r1, \
            ServerThread(redis_session_config(tiny_llama_dir, redis_srv.url)) as r2, \
            KVServeClient(r1.address, timeout=60) as c1, KVServeClient(r2.address, timeout=60) as c2:  # fmt: skip
        c1.chat("s", "hello there", max_new_tokens=6)
        r1.hold(True)
        a = ChatTurn(r1.address, "s", "tell me more")
        a.start()
        try:
            assert wait_until(lambda: r1.held == 1)  # generated, not committed
            with pytest.raises(KVServeError) as err:  # the lock is there: refused
                c2.delete_session("s")
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION

            def lose_lock_and_delete() -> bool:
                with redis_srv.client() as r:
                    r.delete("kvserve:sess-lock::s")
                try:
                    c2.delete_session("s")
                    return True
                except KVServeError as e:  # replica 1's renewal took the lock again first
                    assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
                    return False

            assert wait_until(lose_lock_and_delete, timeout=30, interval=0.2)
        finally:
            r1.hold(False)
            a.join(60)
        assert a.result is None and a.error is not None
        assert a.error.code == grpc.StatusCode.NOT_FOUND and "deleted while this turn ran" in a.error.details
        assert r1.running.sessions.deleted_turns == 1
        assert "kvserve_session_deleted_turns_total 1.0" in r1.running.metrics.exposition().decode()
        for c in (c1, c2):
            _not_found(lambda c=c: c.get_session("s"))
            _not_found(lambda c=c: c.chat("s", "still there?", max_new_tokens=4, require_existing_session=True))
        with redis_srv.client() as r:
            assert r.get("kvserve:sess::s").startswith(TOMBSTONE_PREFIX)
        # the same id is free for a new session, on either replica
        n = c1.chat("s", "a new start", max_new_tokens=4)
        assert n.start.session_created
        assert transcript(c2, "s") == transcript(c1, "s") and c2.get_session("s").turns == 1
        assert len(transcript(c2, "s")) == n.start.prompt_tokens + len(n.token_ids)


def test_a_write_back_after_a_freeze_does_not_bring_back_a_deleted_session(tiny_llama_dir, make_redis_server):
    """Replica 1 takes turns of "w-del" and "w-keep" while Redis hangs (SIGSTOP): only its
    copy has them. After SIGCONT, before replica 1 writes back, "w-del" is deleted
    through replica 2: the write-back restores "w-keep" and not "w-del"."""
    redis_srv = make_redis_server()
    with ServerThread(redis_session_config(tiny_llama_dir, redis_srv.url)) as r1, \
            ServerThread(redis_session_config(tiny_llama_dir, redis_srv.url)) as r2, \
            KVServeClient(r1.address, timeout=10) as c1, KVServeClient(r2.address, timeout=10) as c2:  # fmt: skip
        store = r1.running.sessions.store

        async def pause_write_back() -> None:
            store._sync_every_s = 3600.0  # the test writes back by hand (sync), after the delete

        r1.call(pause_write_back())
        for sid in ("w-del", "w-keep"):
            c1.chat(sid, f"hello {sid}", max_new_tokens=4)
        redis_srv._proc.send_signal(signal.SIGSTOP)
        try:
            for sid in ("w-del", "w-keep"):
                c1.chat(sid, "a turn while Redis hangs", max_new_tokens=4)
            assert store.unsynced == 2
        finally:
            redis_srv._proc.send_signal(signal.SIGCONT)
        assert c2.get_session("w-del").turns == 1  # Redis has the version before the freeze

        def delete() -> bool:
            try:
                c2.delete_session("w-del")
                return True
            except KVServeError as e:  # a lock write Redis applied late, until replica 1's unlock retry
                assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
                return False

        assert wait_until(delete, timeout=30, interval=0.2)
        assert store.unsynced == 2  # replica 1 has not written back yet

        def written_back() -> bool:
            r1.call(store.sync())
            return store.unsynced == 0

        assert wait_until(written_back, timeout=30, interval=0.2)
        assert c2.get_session("w-keep").turns == 2  # written back
        for c in (c1, c2):
            _not_found(lambda c=c: c.get_session("w-del"))
        with redis_srv.client() as r:
            assert r.get("kvserve:sess::w-del").startswith(TOMBSTONE_PREFIX)
        assert c1.chat("w-del", "again", max_new_tokens=4).start.session_created
