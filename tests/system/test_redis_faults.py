"""Session promises under Redis faults, against real redis-server processes: a restart
(no persistence) or a FLUSHALL during a turn never lets a second turn of the session run
next to it nor drops an acknowledged turn (one replica and two), and a hung Redis
(SIGSTOP) stalls no session call; lock writes it applies late block nothing."""

from __future__ import annotations

import signal
from typing import Any

import grpc
import pytest

from kvserve.clients import KVServeClient, KVServeError
from tests.fixtures.serving import ChatTurn, HeldServer, ServerThread, redis_session_config, transcript, wait_until


def _ends_with_turn(tokens: list[int], turn) -> bool:
    return tokens[: turn.start.prompt_tokens + len(turn.token_ids)][-len(turn.token_ids):] == turn.token_ids


def test_redis_restart_during_a_turn_refuses_a_second_turn_and_keeps_the_first(tiny_llama_dir, make_redis_server):
    redis = make_redis_server()
    with HeldServer(redis_session_config(tiny_llama_dir, redis.url)) as srv, KVServeClient(srv.address, timeout=60) as c:
        first = c.chat("s", "hello there", max_new_tokens=6)
        assert first.start.session_created
        srv.hold(True)
        a = ChatTurn(srv.address, "s", "tell me more")
        a.start()
        try:
            assert wait_until(lambda: srv.held == 1)  # turn A generated, not yet committed
            redis.stop()
            redis.start()  # empty: no persistence
            with pytest.raises(KVServeError) as err:
                c.chat("s", "a second turn while A runs", max_new_tokens=4)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            srv.hold(False)
            a.join(60)
        assert a.error is None and a.result is not None and not a.result.start.session_created
        t = transcript(c, "s")
        assert len(t) == a.result.start.prompt_tokens + len(a.result.token_ids)
        assert t[-len(a.result.token_ids):] == a.result.token_ids
        assert c.get_session("s").turns == 2
        assert srv.running.sessions.records_lost >= 1  # said in the log and the metric
        scrape = srv.running.metrics.exposition().decode()
        assert "kvserve_session_records_lost_total" in scrape
        # Redis holds the record again (written back), and the next turn resumes it
        with redis.client() as r:
            assert any(k.endswith(b"sess::s") for k in r.keys("*"))
        nxt = c.chat("s", "and then?", max_new_tokens=4)
        assert not nxt.start.session_created and nxt.start.prompt_tokens > len(t)


def test_flushall_with_two_replicas(tiny_llama_dir, make_redis_server):
    """A turn in flight on replica 1, FLUSHALL, turns of the same session on replica 2:
    a follow-up that demands the session never runs; once replica 1 has taken the lock
    again and written its record back, replica 2 refuses; and in the moment before
    that, whichever of two overlapping turns commits second fails with
    FAILED_PRECONDITION: every turn a client saw end is in the transcript."""
    redis = make_redis_server()
    with HeldServer(redis_session_config(tiny_llama_dir, redis.url)) as r1, ServerThread(redis_session_config(tiny_llama_dir, redis.url)) as r2, \
            KVServeClient(r1.address, timeout=60) as c1, KVServeClient(r2.address, timeout=60) as c2:  # fmt: skip
        # --- s1: the replica that holds the session writes it back; the other refuses
        c1.chat("s1", "hello there", max_new_tokens=6)
        before = transcript(c2, "s1")
        r1.hold(True)
        a = ChatTurn(r1.address, "s1", "tell me more")
        a.start()
        try:
            assert wait_until(lambda: r1.held == 1)
            lost = r1.running.sessions.records_lost
            with redis.client() as r:
                r.flushall()
            with pytest.raises(KVServeError) as err:
                c2.chat("s1", "a follow-up elsewhere", max_new_tokens=4, require_existing_session=True)
            assert err.value.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)
            assert wait_until(lambda: r1.running.sessions.records_lost > lost)  # record written back

            def r1_holds_the_lock() -> bool:
                with redis.client() as r:
                    holder = r.get("kvserve:sess-lock::s1")
                return holder is not None and holder.decode().startswith(r1.running.sessions.replica_id + ":")

            assert wait_until(r1_holds_the_lock)  # taken again (within a renewal period)
            with pytest.raises(KVServeError) as err:
                c2.chat("s1", "a concurrent turn elsewhere", max_new_tokens=4)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            r1.hold(False)
            a.join(60)
        assert a.error is None and a.result is not None
        t = transcript(c2, "s1")
        assert t[: len(before)] == before and _ends_with_turn(t, a.result)

        # --- s2: a turn on replica 2 right after the FLUSHALL, before replica 1 noticed
        c1.chat("s2", "good morning", max_new_tokens=6)
        r1.hold(True)
        a = ChatTurn(r1.address, "s2", "what next")
        a.start()
        try:
            assert wait_until(lambda: r1.held == 1)
            with redis.client() as r:
                r.flushall()
            b = ChatTurn(r2.address, "s2", "hi from elsewhere")
            b.run()
        finally:
            r1.hold(False)
            a.join(60)
        acked = [x for x in (a, b) if x.result is not None]
        assert len(acked) == 1, "two overlapping turns of one session both acknowledged"
        failed = b if acked[0] is a else a
        assert failed.error is not None and failed.error.code == grpc.StatusCode.FAILED_PRECONDITION
        t = transcript(c2, "s2")
        assert _ends_with_turn(t, acked[0].result)
        if acked[0] is b:  # it started the session over, and said so
            assert b.result.start.session_created and len(t) == b.result.start.prompt_tokens + len(b.result.token_ids)
            assert r1.running.sessions.conflicts == 1
        else:
            assert r2.running.sessions.conflicts == 1 or b.error.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_hung_redis_stalls_no_session_call(tiny_llama_dir, make_redis_server):
    """SIGSTOP: turns, GetSession and a new session answer within a 5 s deadline (Redis
    socket timeouts alone would take longer); after SIGCONT the lock writes Redis applies
    late do not refuse the next turn, and the turns it missed are written back."""
    redis = make_redis_server()
    with ServerThread(redis_session_config(tiny_llama_dir, redis.url)) as srv, KVServeClient(srv.address, timeout=5) as c:
        c.chat("h", "hello there", max_new_tokens=6)
        store = srv.running.sessions.store
        redis._proc.send_signal(signal.SIGSTOP)
        try:
            for i in range(3):
                r = c.chat("h", f"turn {i} while Redis hangs", max_new_tokens=6)
                assert not r.start.session_created
            assert c.get_session("h").turns == 4
            assert c.chat("new-while-hung", "hi", max_new_tokens=4).start.session_created
            assert store.breaker.state != "closed" and store.unsynced >= 1
        finally:
            redis._proc.send_signal(signal.SIGCONT)
        r = c.chat("h", "Redis is back", max_new_tokens=6)  # not FAILED_PRECONDITION
        assert not r.start.session_created
        assert wait_until(lambda: store.unsynced == 0, timeout=30)
        mine = c.get_session("h", include_token_ids=True)
        assert mine.turns == 5

        async def in_redis():
            return await store.primary.get("", "h")

        rec = srv.call(in_redis())
        assert rec is not None and rec.turns == 5 and rec.token_ids == mine.token_ids
        assert srv.running.sessions.unconfirmed_writes >= 1

        # another replica is not kept out for the lease (30 s) by lock writes applied late
        with ServerThread(redis_session_config(tiny_llama_dir, redis.url)) as r2, KVServeClient(r2.address, timeout=5) as c2:
            got: list[Any] = []

            def turn_elsewhere() -> bool:
                try:
                    got.append(c2.chat("h", "on another replica", max_new_tokens=4))
                    return True
                except KVServeError as e:
                    if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    return False

            assert wait_until(turn_elsewhere, timeout=15, interval=0.5)
            assert not got[0].start.session_created and got[0].start.prompt_tokens > len(mine.token_ids)
