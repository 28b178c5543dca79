"""Durable acknowledgement at the session store, against real redis-server processes and
real files: a write Redis did not confirm is in the journal before it is answered and
comes back after the process (replayed, then written back by compare-and-set, never over
a newer version or a tombstone); a journal that cannot be written fails the write; without
a journal the drain's flush waits for Redis and reports what it could not save; the disk
store fails a write its file refuses and retries what has no caller from a dirty set."""

from __future__ import annotations

import asyncio
import logging
import resource
import signal
import threading
import time

import grpc
import httpx
import pytest
import redis

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.sessions import (
    FallbackSessionStore,
    InMemorySessionStore,
    RedisSessionStore,
    SessionRecord,
    SessionStoreUnavailable,
    decode_record,
)
from kvserve.service.sessions.disk import DiskSessionStore
from kvserve.service.sessions.journal import FILE, SessionJournal
from kvserve.service.sessions.stores import UNKNOWN, WRITTEN, Expect, copy_record, new_etag
from tests.fixtures.serving import ServerThread, redis_session_config, tiny_config, wait_until

PREFIX = "dur:"


def _rec(sid: str, turns: int = 0, etag: str | None = None) -> SessionRecord:
    return SessionRecord(session_id=sid, owner="o", token_ids=list(range(1, 3 * turns + 2)), created_at=1.0,
                         last_used_at=time.time(), turns=turns, etag=etag or new_etag())  # fmt: skip


def _next(rec: SessionRecord) -> SessionRecord:
    """The record after one more turn (a commit)."""
    return copy_record(rec, token_ids=rec.token_ids + [7, 8, 9], turns=rec.turns + 1, etag=new_etag())


def _store(url: str, journal_dir=None, sync_every_s: float = 3600.0) -> FallbackSessionStore:
    journal = SessionJournal(journal_dir) if journal_dir is not None else None
    return FallbackSessionStore(RedisSessionStore.from_url(url, key_prefix=PREFIX, ttl_s=600), InMemorySessionStore(),
                                timeout_s=0.3, sync_every_s=sync_every_s, journal=journal)  # fmt: skip


async def _commit(store: FallbackSessionStore, rec: SessionRecord) -> SessionRecord:
    """A turn's commit, as the table writes it: conditional on the version it read."""
    got, expect = await store.read(rec.owner, rec.session_id)
    new = _next(got)
    assert await store.put_if(new, expect.plus(got.etag), replace_uncommitted=True) in (WRITTEN, UNKNOWN)
    return new


async def _until(pred, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(0.1)
    return bool(await pred())


def test_writes_a_hung_redis_missed_come_back_from_the_journal_after_the_process(make_redis_server, tmp_path):
    """SIGSTOP; two commits of one session and the delete of another are answered from
    this replica's copy and the journal; the store goes away without a drain (the process
    died); SIGCONT; a new store on the same journal serves them at once and writes them to
    Redis (the commits over the version Redis held, the delete as a tombstone)."""
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url, tmp_path / "journal")
        a = _rec("a")
        assert await fb.put_if(a, Expect(absent_ok=True), create=True) == WRITTEN
        assert await fb.put_if(_rec("gone"), Expect(absent_ok=True), create=True) == WRITTEN
        a1 = await _commit(fb, a)  # in Redis
        srv._proc.send_signal(signal.SIGSTOP)
        try:
            a2 = await _commit(fb, a1)
            a3 = await _commit(fb, a2)
            assert await fb.delete("o", "gone") is True
            assert fb.journaled == 2 and (tmp_path / "journal" / FILE).stat().st_size > 0
            await fb.close()  # the process is gone: no flush, no write-back
        finally:
            srv._proc.send_signal(signal.SIGCONT)
        fb = _store(srv.url, tmp_path / "journal")
        try:
            assert fb.journaled == 2 and fb.unsynced == 2
            got, _ = await fb.read("o", "a")
            assert got == a3 and got.turns == 3
            assert await _until(lambda: _synced(fb))
            assert await fb.primary.get("o", "a") == a3
            assert await fb.primary.get_state("o", "gone") == (None, True)  # the tombstone, not the record
            assert fb.journaled == 0 and (tmp_path / "journal" / FILE).stat().st_size == 0
        finally:
            await fb.close()

    async def _synced(fb: FallbackSessionStore) -> bool:
        await fb.sync()
        return fb.unsynced == 0

    asyncio.run(run())


def test_a_replayed_record_never_overwrites_a_newer_version_or_a_tombstone(make_redis_server, tmp_path):
    """Redis down (refused: nothing sent lands late); commits of three sessions go to the
    journal; the process ends. Redis restarts empty and, before this replica comes back,
    another replica continues "x" (a newer version) and deletes "y". The replay writes
    back only "z", the one Redis lost; "x" keeps the other replica's turn, "y" stays deleted."""
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url, tmp_path / "journal")
        recs = {sid: _rec(sid) for sid in "xyz"}
        for rec in recs.values():
            assert await fb.put_if(rec, Expect(absent_ok=True), create=True) == WRITTEN
        srv.stop()
        mine = {sid: await _commit(fb, rec) for sid, rec in recs.items()}
        await fb.close()
        srv.start()  # empty
        other = RedisSessionStore.from_url(srv.url, key_prefix=PREFIX, ttl_s=600)
        theirs = _rec("x", turns=1)
        assert await other.put_if(theirs, Expect(absent_ok=True), create=True) == WRITTEN
        await other.put(_rec("y", turns=1))
        assert await other.delete("o", "y")
        fb = _store(srv.url, tmp_path / "journal")
        try:
            assert fb.journaled == 3
            for _ in range(50):
                await fb.sync()
                if fb.unsynced == 0:
                    break
                await asyncio.sleep(0.1)
            assert fb.unsynced == 0 and fb.journaled == 0
            assert await other.get("o", "x") == theirs  # CONFLICT: theirs kept
            assert (await fb.read("o", "x"))[0] == theirs  # and this replica's stale copy dropped
            assert await other.get_state("o", "y") == (None, True)  # DELETED: not written back
            assert await other.get("o", "z") == mine["z"]  # RESTORED: Redis had lost it
        finally:
            await fb.close()
            await other.close()

    asyncio.run(run())


def test_a_journal_that_cannot_be_written_fails_the_write_and_keeps_the_copy(make_redis_server, tmp_path):
    """Redis down and the journal's file past its size limit (RLIMIT_FSIZE: EFBIG, what a
    full disk gives as ENOSPC): the commit raises SessionStoreUnavailable and this replica's
    copy is the version before it; once the journal writes again the same commit goes through."""
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url, tmp_path / "journal")
        try:
            a = _rec("a")
            assert await fb.put_if(a, Expect(absent_ok=True), create=True) == WRITTEN
            srv.stop()
            a1 = await _commit(fb, a)  # journaled
            got, expect = await fb.read("o", "a")
            a2 = _next(got)
            path = tmp_path / "journal" / FILE
            size = path.stat().st_size
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))  # no byte more for any file of this process
            try:
                with pytest.raises(SessionStoreUnavailable):
                    await fb.put_if(a2, expect.plus(got.etag), replace_uncommitted=True)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            assert path.stat().st_size == size  # nothing of the frame left behind
            assert (await fb.read("o", "a"))[0] == a1 and fb.write_errors == 1
            assert await fb.put_if(a2, expect.plus(got.etag), replace_uncommitted=True) == UNKNOWN
            assert (await fb.read("o", "a"))[0] == a2
        finally:
            await fb.close()
        assert SessionJournal(tmp_path / "journal").pending[("o", "a")].record == a2

    asyncio.run(run())


def test_flush_without_a_journal_waits_for_redis_and_reports_what_is_left(make_redis_server):
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url)
        try:
            a = _rec("a")
            assert await fb.put_if(a, Expect(absent_ok=True), create=True) == WRITTEN
            srv._proc.send_signal(signal.SIGSTOP)
            try:
                a1 = await _commit(fb, a)
                a2 = await _commit(fb, a1)
                t0 = time.monotonic()
                report = await fb.flush(1.0)
                assert time.monotonic() - t0 >= 0.9  # it waited for Redis
                assert (report.sessions, report.turns, report.lost, report.journaled) == (1, 2, True, 0)
                loop = asyncio.get_running_loop()
                loop.call_later(1.0, srv._proc.send_signal, signal.SIGCONT)  # Redis answers during the next flush
                report = await fb.flush(20.0)
            finally:
                srv._proc.send_signal(signal.SIGCONT)
            assert not report.lost and report.written == 1 and report.sessions == 0
            assert await fb.primary.get("o", "a") == a2
        finally:
            await fb.close()

    asyncio.run(run())


def test_the_drain_writes_back_what_redis_lost_after_confirming_it(make_redis_server):
    """Redis confirmed three sessions' records, then lost them (a restart without
    persistence); meanwhile another replica wrote one again and deleted another. The
    drain's flush writes back only the record nothing replaced: never over the other
    replica's version, never over the tombstone."""
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url)
        other = None
        try:
            recs = {sid: _rec(sid, turns=1) for sid in ("kept", "theirs", "deleted")}
            for rec in recs.values():
                assert await fb.put_if(rec, Expect(absent_ok=True), create=True) == WRITTEN
            srv.stop()
            srv.start()  # empty
            other = RedisSessionStore.from_url(srv.url, key_prefix=PREFIX, ttl_s=600)
            theirs = _rec("theirs", turns=2)
            await other.put(theirs)
            await other.put(_rec("deleted", turns=1))
            assert await other.delete("o", "deleted")
            report = None
            for _ in range(50):  # the first calls after the restart may meet dead pooled connections
                report = await fb.flush(5.0)
                if report.restored:
                    break
                await asyncio.sleep(0.1)
            assert report is not None and report.restored == 1 and not report.lost
            assert await other.get("o", "kept") == recs["kept"]
            assert await other.get("o", "theirs") == theirs
            assert await other.get_state("o", "deleted") == (None, True)
        finally:
            await fb.close()
            if other is not None:
                await other.close()

    asyncio.run(run())


def test_records_redis_lost_are_written_back_without_waiting_for_a_turn(make_redis_server):
    """FLUSHALL (as a Redis restart without persistence): the records this replica holds
    are back in Redis within a moment, no turn needed, so a replica lost after that takes
    none with it; a session whose tombstone is there (deleted through another replica) is
    not brought back."""
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url, sync_every_s=0.2)
        try:
            recs = [_rec(f"s{i}", turns=2) for i in range(3)]
            for rec in recs:
                assert await fb.put_if(rec, Expect(absent_ok=True), create=True) == WRITTEN
            with redis.Redis.from_url(srv.url) as r:  # one transaction: nothing runs in between
                r.pipeline(transaction=True).flushall().set(f"{PREFIX}sess:o:s2", b"KVSDEL1:1").execute()

            async def back() -> bool:  # in Redis, and counted as restored: the count follows Redis's
                # reply to the write-back, which a read of Redis can see land before the store does
                return all([await fb.primary.get("o", r.session_id) == r for r in recs[:2]]) and fb.restored == 2

            assert await _until(back), fb.restored
            assert await fb.primary.get_state("o", "s2") == (None, True)
        finally:
            await fb.close()

    asyncio.run(run())


def test_a_tenant_with_hundreds_of_sessions_lists_them_in_one_round_trip(make_redis_server):
    """A page of ``list`` (what a delete's shared-prefix check reads) is one pipeline: 250
    sessions are no 250 connections at once (redis-py's pool holds 100: the gather it
    replaced failed with MaxConnectionsError, which opened the session store's breaker)."""
    srv = make_redis_server()

    async def run() -> None:
        fb = _store(srv.url)
        try:
            for i in range(250):
                await fb.primary.put(_rec(f"s{i:03d}", turns=1))
            page, token = await fb.list("o", 1000)
            assert [r.session_id for r in page] == [f"s{i:03d}" for i in range(250)] and token == ""
            assert fb.primary_errors == 0 and fb.breaker.state == "closed"
        finally:
            await fb.close()

    asyncio.run(run())


# ----------------------------------------------------------------------------- the disk store


def _break(root) -> None:
    """The records directory replaced by a file (what makes writes fail for root too)."""
    root.rename(root.with_name(root.name + ".aside"))
    root.write_text("not a directory")


def _repair(root) -> None:
    root.unlink()
    root.with_name(root.name + ".aside").rename(root)


def test_the_disk_store_fails_a_write_its_file_refuses_and_keeps_the_session_as_it_was(tmp_path):
    async def run() -> None:
        root = tmp_path / "sessions"
        store = DiskSessionStore(root)
        a = _rec("a")
        assert await store.put_if(a, Expect(absent_ok=True), create=True) == WRITTEN
        a1 = _next(a)
        assert await store.put_if(a1, Expect.of(a)) == WRITTEN
        _break(root)
        try:
            with pytest.raises(SessionStoreUnavailable):
                await store.put_if(_next(a1), Expect.of(a1))  # a commit
            with pytest.raises(SessionStoreUnavailable):
                await store.put_if(_rec("new"), Expect(absent_ok=True), create=True)  # a first turn
            with pytest.raises(SessionStoreUnavailable):
                await store.delete("o", "a")
            assert await store.get("o", "a") == a1 and await store.get("o", "new") is None
            assert store.write_errors == 3 and store.dirty == 0  # the files are as they were
        finally:
            _repair(root)
        a2 = _next(a1)
        assert await store.put_if(a2, Expect.of(a1)) == WRITTEN
        await store.close()
        again = DiskSessionStore(root)
        assert await again.get("o", "a") == a2 and await again.get("o", "new") is None
        await again.close()

    asyncio.run(run())


def test_the_disk_store_retries_what_has_no_caller_and_its_flush_reports_what_is_left(tmp_path):
    """An expired session whose file cannot be removed is dirty: retried, and the drain's
    flush says it is left while the directory stays broken, and removes it once it works."""
    now = [1000.0]

    async def run() -> None:
        root = tmp_path / "sessions"
        store = DiskSessionStore(root, ttl_s=10.0, clock=lambda: now[0])
        a = SessionRecord("a", "o", [1, 2, 3], created_at=now[0], last_used_at=now[0], turns=1, etag="e1")
        assert await store.put_if(a, Expect(absent_ok=True), create=True) == WRITTEN
        path = store.path("o", "a")
        now[0] += 60
        _break(root)
        try:
            assert [r.session_id for r in await store.expire()] == ["a"]
            assert store.dirty == 1
            report = await store.flush(0.3)
            assert report.lost and report.sessions == 1 and "NotADirectoryError" in report.why
        finally:
            _repair(root)
        assert path.exists()  # the expired record is still on disk
        report = await store.flush(5.0)
        assert not report.lost and store.dirty == 0 and not path.exists()
        await store.close()

    asyncio.run(run())


# ----------------------------------------------------------------------------- a live server

SESSIONS = ("s0", "s1", "s2")


def _turns(address: str, acked: dict[str, list[int]], messages: list[str]) -> None:
    """Each session takes the turns; ``acked`` gets its transcript after each acknowledged one."""
    with KVServeClient(address, timeout=20) as c:
        for text in messages:
            for sid in SESSIONS:
                c.chat(sid, text, max_new_tokens=4)
                acked[sid] = c.get_session(sid, include_token_ids=True).token_ids


def test_without_a_journal_the_drain_waits_for_redis_to_answer(tiny_llama_dir, make_redis_server, caplog):
    """No disk directory, Redis hung at SIGTERM: the drain waits; Redis resumed two
    seconds in, every acknowledged turn is written to it and the drain ends clean."""
    rds = make_redis_server()
    caplog.set_level(logging.INFO, logger="kvserve.service.server")
    acked: dict[str, list[int]] = {}
    srv = ServerThread(redis_session_config(tiny_llama_dir, rds.url, drain_timeout=30.0))
    with srv:
        _turns(srv.address, acked, ["hello there"])
        rds._proc.send_signal(signal.SIGSTOP)
        try:
            _turns(srv.address, acked, ["tell me more"])
            t0 = time.monotonic()  # before the timer starts: Redis resumes 2 s after t0 or later
            threading.Timer(2.0, rds._proc.send_signal, (signal.SIGCONT,)).start()
            srv.stop()
            assert time.monotonic() - t0 >= 1.9  # it waited for Redis
        finally:
            rds._proc.send_signal(signal.SIGCONT)
        assert srv.running.exit_status == 0
    assert any("drain: 3 session record(s) written back to Redis" in r.getMessage() for r in caplog.records)
    with redis.Redis.from_url(rds.url) as r:
        for sid in SESSIONS:
            assert decode_record(r.get(f"kvserve:sess::{sid}")).token_ids == acked[sid]


def _disk_server(model_dir, disk, http_port: int | None = None, **kw) -> ServerThread:
    return ServerThread(tiny_config(model_dir, disk_cache_dir=str(disk), disk_cache_size=64 << 20, **kw),
                        http_port=http_port)


def test_an_unwritable_records_directory_fails_turns_and_loses_none(tiny_llama_dir, tmp_path):
    """The issue's second attack: no Redis, the records directory unwritable (replaced by a
    file) while turns are asked for, repaired, a drain, a restart. Each turn asked while it
    was unwritable (a first turn, a delete, an HTTP turn too) fails UNAVAILABLE (HTTP 503),
    its session as before; every acknowledged turn is there after the restart."""
    disk = tmp_path / "disk"
    acked: dict[str, list[int]] = {}
    with _disk_server(tiny_llama_dir, disk, http_port=0) as srv:
        _turns(srv.address, acked, ["hello there"])
        _break(disk / "sessions")
        try:
            http = httpx.post(f"http://127.0.0.1:{srv.running.http_port}/v1/chat/completions", timeout=20,
                              headers={"X-Session-Id": "s2"},
                              json={"model": str(tiny_llama_dir), "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
            assert http.status_code == 503 and "nothing was recorded" in http.json()["error"]["message"], http.text
            with KVServeClient(srv.address, timeout=20) as c:
                for text in ("one", "two", "three"):
                    with pytest.raises(KVServeError) as err:
                        c.chat("s0", text, max_new_tokens=4)
                    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "nothing was recorded" in err.value.details
                with pytest.raises(KVServeError) as err:
                    c.chat("brand-new", "hello", max_new_tokens=4)
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                with pytest.raises(KVServeError) as err:
                    c.delete_session("s1")
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                assert c.get_session("s0", include_token_ids=True).token_ids == acked["s0"]
                assert c.get_session("s1").turns == 1 and c.get_session("s2").turns == 1
        finally:
            _repair(disk / "sessions")
        _turns(srv.address, acked, ["after the repair"])
        assert srv.running.sessions.store.write_errors == 6
    assert srv.running.exit_status == 0
    with _disk_server(tiny_llama_dir, disk) as srv, KVServeClient(srv.address, timeout=20) as c:
        for sid in SESSIONS:
            info = c.get_session(sid, include_token_ids=True)
            assert (info.turns, info.token_ids) == (2, acked[sid])
        with pytest.raises(KVServeError) as err:
            c.get_session("brand-new")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_a_record_file_the_drain_cannot_fix_is_one_line_and_exit_status_3(tiny_llama_dir, tmp_path, caplog):
    """No Redis: an expired session whose file cannot be removed (the directory broken)
    stays dirty; the drain retries it and, the directory still broken, says so in one
    error line and ends with status 3 (``RunningServer.exit_status``, what ``run`` returns)."""
    disk = tmp_path / "disk"
    caplog.set_level(logging.INFO, logger="kvserve.service.server")
    with _disk_server(tiny_llama_dir, disk, session_ttl=0.5, drain_timeout=1.0) as srv, \
            KVServeClient(srv.address, timeout=20) as c:  # fmt: skip
        c.chat("old", "hello there", max_new_tokens=4)
        store = srv.running.sessions.store
        _break(disk / "sessions")
        try:
            assert wait_until(lambda: store.dirty == 1, timeout=10)  # reaped, its file not removed
            srv.stop()
        finally:
            _repair(disk / "sessions")
        assert srv.running.exit_status == 3
    said = [r.getMessage() for r in caplog.records if r.name == "kvserve.service.server" and r.levelname == "ERROR"]
    assert len(said) == 1 and "drain: 1 session record file(s) in" in said[0] and "NotADirectoryError" in said[0]
    assert any((disk / "sessions").rglob("*.kvss"))  # still there: the next start finds it expired
