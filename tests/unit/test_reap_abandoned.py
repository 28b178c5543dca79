"""``SessionManager.reap_abandoned`` (what the Responses API calls on a response with no
completed turn that nobody runs), on the in-memory store and a real Redis: a first
turn's placeholder whose replica died (its lock no longer renewed) stays while the lock's
lease lasts, on this replica and another, and is removed once it lapses; a session with
a completed turn, a fork (a kept incarnation) and a turn in flight are never removed."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from kvserve.service.sessions import InMemorySessionStore, RedisSessionStore, SessionManager

LEASE = 0.4  # seconds


@pytest.fixture(params=["memory", "redis"])
def stores(request) -> Any:
    """Two replicas' stores over one session store (a store each over one Redis)."""
    if request.param == "memory":
        shared = InMemorySessionStore()
        return lambda: (shared, shared)
    url = request.getfixturevalue("redis_url")
    return lambda: (RedisSessionStore.from_url(url, key_prefix="reap:"), RedisSessionStore.from_url(url, key_prefix="reap:"))


def _die(m: SessionManager, turn: Any) -> None:
    """The replica holding ``turn`` is gone: nothing renews its lock, nothing ends its turn."""
    turn._renewal.cancel()
    m._inflight.clear()


def test_a_dead_replicas_placeholder_is_removed_once_its_lock_lapses(stores):
    async def scenario() -> None:
        sa, sb = stores()
        a = SessionManager(sa, lock_ttl_s=LEASE)
        b = SessionManager(sb, lock_ttl_s=LEASE)
        turn = await a.begin_turn("t", "resp_1")
        assert not await a.reap_abandoned("t", "resp_1")  # its own turn in flight
        assert not await b.reap_abandoned("t", "resp_1")  # locked: running on another replica
        _die(a, turn)
        assert not await b.reap_abandoned("t", "resp_1")  # the lease still runs
        rec, busy = await b.get("t", "resp_1")
        assert rec.turns == 0 and busy
        await asyncio.sleep(LEASE + 0.2)
        assert await b.reap_abandoned("t", "resp_1")
        assert await sb.get("t", "resp_1") is None and await sa.get("t", "resp_1") is None
        assert not await b.reap_abandoned("t", "resp_1")  # gone already
        await sa.close()
        await sb.close()

    asyncio.run(scenario())


def test_sessions_that_are_not_abandoned_placeholders_stay(stores):
    async def scenario() -> None:
        sa, _ = stores()
        m = SessionManager(sa, lock_ttl_s=LEASE)
        turn = await m.begin_turn("t", "done")
        await m.commit_turn(turn, [1, 2, 3], [4, 5])
        await m.end_turn(turn)
        await m.fork("t", "done", "fork0", at_turn=0)  # a session of no turn made on purpose
        for sid in ("done", "fork0"):
            assert not await m.reap_abandoned("t", sid)
            assert await sa.get("t", sid) is not None
        assert not await m.reap_abandoned("t", "nobody")
        await sa.close()

    asyncio.run(scenario())


def test_a_live_turn_whose_lock_redis_lost_is_not_taken_for_abandoned(redis_url):
    """Redis loses the lock of a running first turn (evicted, restarted): until the turn's
    renewal takes it back, nobody holds it, yet the placeholder is younger than a lease,
    so another replica leaves it alone and the turn commits."""

    async def scenario() -> None:
        sa = RedisSessionStore.from_url(redis_url, key_prefix="reap:")
        sb = RedisSessionStore.from_url(redis_url, key_prefix="reap:")
        a, b = SessionManager(sa, lock_ttl_s=5.0), SessionManager(sb, lock_ttl_s=5.0)
        turn = await a.begin_turn("t", "resp_live")
        assert await sb.is_locked("t", "resp_live")
        r = aioredis.from_url(redis_url)
        assert await r.delete("reap:sess-lock:t:resp_live") == 1
        await r.aclose()
        assert not await sb.is_locked("t", "resp_live")
        assert not await b.reap_abandoned("t", "resp_live")
        await a.commit_turn(turn, [1, 2], [3])
        await a.end_turn(turn)
        assert (await sb.get("t", "resp_live")).turns == 1
        await sa.close()
        await sb.close()

    asyncio.run(scenario())
