"""``FallbackSessionStore``: Redis as the source of truth, this process's memory as the
fallback, with per-call timeouts, a circuit breaker and the journal of what Redis has not
confirmed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from kvserve.common.breaker import CircuitBreaker

from ..records import SessionRecord, SessionStoreUnavailable
from .memory import InMemorySessionStore
from .protocol import CONFLICT, DELETED, LIMIT, RESTORED, UNKNOWN, Expect, FlushReport, SessionStore
from .redis import RedisSessionStore, is_key_error

if TYPE_CHECKING:
    from ..journal import SessionJournal

log = logging.getLogger(__name__)


class FallbackSessionStore:
    """Redis as the source of truth, this process's memory as the fallback.

    Every write goes to both; reads and locks go to Redis and fall back to memory when
    Redis fails. Each Redis call is bounded by ``timeout_s`` and goes through a circuit
    breaker (``kvserve.common.breaker``): after ``breaker.failure_threshold`` consecutive
    failures or timeouts Redis is not asked at all (every call answers from this
    replica's copy at once) until a probe after ``breaker.reset_timeout_s`` succeeds. So
    a Redis that is down or hung (SIGSTOP, a partition) costs a turn at most a few
    timeouts, never the socket timeout of every call. Only failures of Redis itself
    count against the breaker (connection errors, timeouts, server states such as
    OOM or READONLY): an error about one key (``is_key_error``: a key of another type, a
    script that failed on what it read) fails that call alone (``key_errors``), and an
    unreadable record is no error at all (``RedisSessionStore``: it reads as absent).

    Reads also prefer this replica's record when Redis holds an older version of it
    (same incarnation, fewer turns: a write that missed Redis). A write that could not
    reach Redis is remembered and written back (conditionally, so never over a newer
    version) once Redis answers again. What cannot be had while Redis is down:
    sessions only another replica served.

    A deleted session stays deleted: a read that finds its tombstone in Redis drops this
    replica's copy (it is not written back), a write of it that finds the tombstone
    (a turn's commit, a write-back) writes nothing and drops the copy (DELETED), and a
    delete that missed Redis is retried in the background (meanwhile this replica
    answers for the session from its own copy, which the delete removed). A session
    created on this replica while Redis was away is written back as a creation: it
    replaces a tombstone it finds (the id was free for a new session).

    Durable acknowledgement: what Redis has not confirmed lives in this process's memory,
    and with a ``journal`` (``journal.SessionJournal``, in the disk directory) also in a
    file: a write or delete that misses Redis is appended there before it is answered (a
    journal that cannot be written fails the call: ``SessionStoreUnavailable``, the
    session as it was), is marked done when Redis has it, and is replayed at the next
    start (into this replica's copy, then written back to Redis by the same conditional
    write-back, so never over a newer version or a tombstone). Records Redis confirmed and
    then lost (a restart without persistence, FLUSHALL: its mark is gone, checked every
    ``sync_every_s``) are written back from this replica's copies at once (``restored``),
    not at each session's next turn. ``flush`` (the drain)
    writes back until Redis has everything or ``timeout_s`` has passed (a directory that
    does not outlive the process, e.g. a Kubernetes emptyDir on a pod's replacement,
    keeps nothing); what is left is in its report (sessions and acknowledged turns).

    Over 400 lines: one state (this replica's copies, what Redis may lack, deletes and creations in flight) that every method and the write-back loop read and change together.
    """

    def __init__(
        self,
        primary: SessionStore,
        local: InMemorySessionStore | None = None,
        *,
        timeout_s: float = 0.3,
        breaker: CircuitBreaker | None = None,
        unlock_retry_s: float = 0.5,
        sync_every_s: float = 1.0,
        journal: SessionJournal | None = None,
    ) -> None:
        self.primary = primary
        self.local = local or InMemorySessionStore()
        self.timeout_s = timeout_s
        self.breaker = breaker if breaker is not None else CircuitBreaker(failure_threshold=2, reset_timeout_s=2.0)
        self.primary_errors = 0  # Redis calls that failed or timed out
        self.primary_skipped = 0  # Redis calls not made: the breaker was open
        self.written_back = 0  # records written back to Redis after it missed them
        self.key_errors = 0  # Redis calls that failed for their key alone (never the breaker's)
        self._unlock_retry_s = unlock_retry_s
        self._sync_every_s = sync_every_s
        self._retries: set[asyncio.Task] = set()  # unlocks that missed Redis, tried again
        self._unsynced: dict[tuple[str, str], Expect] = {}  # records Redis may lack, what it may hold
        self._deletes: set[tuple[str, str]] = set()  # deletes that missed Redis, tried again
        self._creates: set[tuple[str, str]] = set()  # creations whose write has not reached Redis
        self._sync_task: asyncio.Task | None = None
        self._failing = False  # the last Redis call failed (log once per outage)
        self._closed = False
        self._writing: dict[tuple[str, str], list] = {}  # key -> [lock, users]: one write at a time
        self._base_turns: dict[tuple[str, str], int] = {}  # unsynced session -> turns Redis was known to hold
        self._journal_failing = 0  # journal appends failed since the last that went through
        self._watch_task: asyncio.Task | None = None
        self._lost_pending = False  # Redis lost its data and not every held record was checked since
        self.restored = 0  # records Redis lost after confirming them, written back from this replica's copies
        self.journal = journal
        if journal is not None:
            self._replay(journal)

    def _replay(self, journal: SessionJournal) -> None:
        """Take back what the journal says Redis may lack (a previous run of this server),
        to be written back when Redis answers."""
        for key, p in journal.pending.items():
            if p.delete:
                self._deletes.add(key)
            if p.record is not None:
                self.local.adopt(p.record)
                self._unsynced[key] = p.expect
                self._base_turns[key] = p.base_turns
                if p.create:
                    self._creates.add(key)
        if journal.pending:
            log.warning("session store: %d session(s) from the journal %s that Redis may lack (%d acknowledged "
                        "turn(s), %d delete(s)); written back to Redis when it answers",
                        len(journal.pending), journal.path, sum(p.turns for p in journal.pending.values()),
                        sum(p.delete for p in journal.pending.values()))  # fmt: skip
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop yet: the first write (or flush) starts the write-back
                return
            self._start_sync()

    @contextlib.asynccontextmanager
    async def _one_writer(self, key: tuple[str, str]):
        """Conditional writes of one session run one at a time here (a turn's and the
        background write-back's), so each sees the outcome of the one before."""
        entry = self._writing.get(key)
        if entry is None:
            entry = self._writing[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                self._writing.pop(key, None)

    @property
    def unsynced(self) -> int:
        """Session records whose last write (or delete) may not have reached Redis."""
        return len(self._unsynced) + len(self._deletes)

    @property
    def unreadable_records(self) -> int:
        """Distinct unreadable records Redis answered with (treated as absent)."""
        return getattr(self.primary, "unreadable_records", 0)

    @property
    def write_errors(self) -> int:
        """Journal appends that failed (each failed the call it journaled)."""
        return self.journal.write_errors if self.journal is not None else 0

    @property
    def journaled(self) -> int:
        """Sessions whose last change Redis may lack, kept in the journal (0 without one)."""
        return self.journal.sessions if self.journal is not None else 0

    async def _unsaved_turns(self) -> int:
        """Acknowledged turns Redis may lack (past the turns it was known to hold)."""
        n = 0
        for key in list(self._unsynced):
            rec = await self.local.get(*key)
            if rec is not None:
                n += max(0, rec.turns - self._base_turns.get(key, rec.turns))
        return n

    async def _journal(self, key: tuple[str, str]) -> None:
        """Tell the journal what Redis may lack of ``key`` now. Raises OSError."""
        if self.journal is None:
            return
        from ..journal import Pending

        expect = self._unsynced.get(key)
        rec = await self.local.get(*key) if expect is not None else None
        pending = None
        if rec is not None or key in self._deletes:
            pending = Pending(rec, expect or Expect(), key in self._creates, self._base_turns.get(key, 0),
                              key in self._deletes)  # fmt: skip
        self.journal.put(key, pending)

    def _journal_failed(self, key: tuple[str, str], e: OSError, what: str) -> None:
        """A journal append failed (its call fails): logged once per run of failures."""
        self._journal_failing += 1
        level = logging.ERROR if self._journal_failing == 1 else logging.DEBUG
        log.log(level, "session %r: Redis did not confirm its %s and the session journal could not take it (%r); "
                "the call fails, and so does every change Redis does not confirm until the journal writes again",
                key[1], what, e)  # fmt: skip

    async def _journal_quietly(self, key: tuple[str, str]) -> None:
        """``_journal`` where a failure costs nothing: the journal may then replay a change
        Redis already has, whose write-back the compare-and-set refuses or repeats."""
        try:
            await self._journal(key)
        except OSError as e:
            log.warning("session journal: could not note that Redis has session %r (%r)", key[1], e)

    async def _settled(self, key: tuple[str, str]) -> None:
        """Redis has the last write of ``key``, or it no longer matters."""
        self._unsynced.pop(key, None)
        self._creates.discard(key)
        self._base_turns.pop(key, None)
        await self._journal_quietly(key)

    async def _forget(self, key: tuple[str, str]) -> None:
        """The session was deleted in Redis: this replica's copy must not come back."""
        await self.local.delete(*key)
        await self._settled(key)

    async def _flush_delete(self, key: tuple[str, str]) -> bool:
        """Retry a delete that missed Redis; True once Redis has it (or it was not pending)."""
        if key not in self._deletes:
            return True
        ok, _ = await self._try("delete", lambda: self.primary.delete(*key))
        if ok:
            self._deletes.discard(key)
            await self._journal_quietly(key)
        return ok

    async def _try(self, what: str, call, timeout_s: float | None = None):
        if not self.breaker.allow():
            self.primary_skipped += 1
            return False, None
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
            # cancellation that arrives as the call completes (a turn's lock renewal
            # then outlived its turn)
            async with asyncio.timeout(timeout_s or self.timeout_s):
                result = await call()
        except Exception as e:  # noqa: BLE001 - any backend failure falls back
            if is_key_error(e):  # Redis answered: this key's problem, not the store's
                self.breaker.record_success()
                self.key_errors += 1
                log.warning("session store: Redis %s failed for its key alone (%r); using this replica's copy "
                            "for that call", what, e)  # fmt: skip
                return False, None
            self.primary_errors += 1
            self.breaker.record_failure()
            why = f"timed out after {timeout_s or self.timeout_s:g} s" if isinstance(e, asyncio.TimeoutError) else repr(e)
            if not self._failing:
                log.warning("session store: Redis %s failed (%s); using this replica's copy", what, why)
            else:
                log.debug("session store: Redis %s failed (%s)", what, why)
            self._failing = True
            return False, None
        self.breaker.record_success()
        if self._failing:
            log.info("session store: Redis answers again")
            self._failing = False
        return True, result

    async def get(self, owner: str, session_id: str) -> SessionRecord | None:
        return (await self.read(owner, session_id))[0]

    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]:
        key = (owner, session_id)
        if not await self._flush_delete(key):  # deleted here, Redis not told yet: only our copy counts
            local = await self.local.get(owner, session_id)
            pending = self._unsynced.get(key)
            return local, (Expect.of(local) if pending is None or local is None else pending.plus(local.etag))
        ok, state = await self._try("get", lambda: self.primary.read(owner, session_id))
        rec, there = state if ok else (None, Expect())
        if there.after_delete:
            await self._forget(key)
            return None, Expect(frozenset(), True, after_delete=True)
        local = await self.local.get(owner, session_id)
        pending = self._unsynced.get(key)
        if not ok or rec is None:
            # Redis is away, or lost it (eviction, restart), or holds an unreadable value
            # (``there.unreadable``, which the next write replaces): ours is still good.
            expect = Expect.of(local) if pending is None or local is None else pending.plus(local.etag)
            if ok and local is not None:
                expect = Expect(expect.etags, False)  # Redis has nothing: writing is restoring
            if there.unreadable:
                expect = Expect(expect.etags, expect.absent_ok, unreadable=there.unreadable)
            return local, expect
        if local is not None and local.created_at == rec.created_at and local.turns > rec.turns:
            # A write of ours missed Redis (a timeout, a blip) and it kept an older
            # version: using it would drop turns from the transcript. The next write repairs it.
            log.warning("session %r: Redis has %d turns, this replica %d; using this replica's record",
                        session_id, rec.turns, local.turns)  # fmt: skip
            return local, Expect(frozenset({rec.etag, local.etag}), False)
        return rec, Expect.of(rec)

    async def put(self, rec: SessionRecord) -> None:
        await self.local.put(rec)
        await self._try("put", lambda: self.primary.put(rec))

    async def put_if(
        self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False, create: bool = False,
        limit: int = 0,
    ) -> str:
        self._start_watch()
        async with self._one_writer((rec.owner, rec.session_id)):
            return await self._put_if(rec, expect, replace_uncommitted, create, limit)

    async def _put_if(
        self, rec: SessionRecord, expect: Expect, replace_uncommitted: bool, create: bool, limit: int
    ) -> str:
        key = (rec.owner, rec.session_id)
        pending = self._unsynced.get(key)
        if pending is not None:  # an earlier write may land (or have landed) late: it is ours too
            expect = expect.merge(pending)
        limit = limit if create else 0  # a limit binds creations only
        create = create or key in self._creates  # a creation not yet in Redis: its next writes create too
        ok, outcome = False, None
        if await self._flush_delete(key):  # else this replica's delete has not reached Redis: nothing after it may
            ok, outcome = await self._try(
                "write", lambda: self.primary.put_if(
                    rec, expect, replace_uncommitted=replace_uncommitted, create=create, limit=limit
                ),
            )  # fmt: skip
        if ok and outcome == LIMIT:
            return LIMIT
        if not ok:
            if limit and self.local.would_exceed(key, limit):  # Redis away: this replica's sessions decide
                return LIMIT
            return await self._keep_here(key, rec, expect, create)
        if outcome == DELETED:
            await self._forget(key)
        elif outcome == CONFLICT:
            await self.local.delete(*key)  # Redis has another replica's version: ours is stale
            await self._settled(key)
        else:
            await self.local.put(rec)
            await self._settled(key)
        return outcome

    async def _keep_here(self, key: tuple[str, str], rec: SessionRecord, expect: Expect, create: bool) -> str:
        """A write Redis did not confirm: this replica's copy (and the journal) hold it until
        the write-back. If the journal cannot take it, the write fails and the copy stays
        as it was (SessionStoreUnavailable); Redis may still apply it late (its etag stays
        expected, so the write-back of the old copy goes over it)."""
        before = await self.local.get(*key)
        state = (self._unsynced.get(key), key in self._creates, self._base_turns.get(key))
        if state[0] is None:  # Redis had everything of it until now
            self._base_turns[key] = min(before.turns if before is not None else rec.turns, rec.turns)
        if create:
            self._creates.add(key)
        await self.local.put(rec)
        self._unsynced[key] = expect.plus(rec.etag)
        try:
            await self._journal(key)
        except OSError as e:
            self._journal_failed(key, e, "write")
            if before is None:
                await self.local.delete(*key)
                self._unsynced.pop(key, None)
                self._creates.discard(key)
                self._base_turns.pop(key, None)
            else:
                await self.local.put(before)
                self._unsynced[key] = (state[0] or Expect.of(before)).plus(rec.etag)
                if not state[1]:
                    self._creates.discard(key)
                if state[2] is not None:
                    self._base_turns[key] = state[2]
            raise SessionStoreUnavailable(
                f"session {key[1]!r}: the session store could not save this change (Redis did not answer and "
                f"the server's journal failed to write); nothing was recorded: retry"
            ) from None
        if self._journal_failing and self.journal is not None:
            log.info("session journal: written again (%d append(s) failed meanwhile)", self._journal_failing)
            self._journal_failing = 0
        self._start_sync()
        return UNKNOWN

    def _start_sync(self) -> None:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.create_task(self._sync_loop(), name="kvserve-session-sync")

    def _start_watch(self) -> None:
        if (self._watch_task is None or self._watch_task.done()) and not self._closed:
            self._watch_task = asyncio.create_task(self._watch_loop(), name="kvserve-session-watch")

    async def _watch_loop(self) -> None:
        """Every ``sync_every_s``: has Redis lost its data (``RedisSessionStore.mark``)? Then
        the records this replica holds that it no longer has are written back at once, not
        at each session's next turn (a replica lost meanwhile would take them with it)."""
        primary = self.primary
        if not isinstance(primary, RedisSessionStore):
            return
        while not self._closed:
            try:
                if self.breaker.state == "closed":  # an open breaker's probes are the turns' and the sync's
                    ok, lost = await self._try("mark", primary.mark)
                    self._lost_pending |= bool(ok and lost)
                    if self._lost_pending:  # until one pass got through them all
                        _, complete = await self._restore_lost(time.monotonic() + 30.0)
                        self._lost_pending = not complete
            except Exception:  # noqa: BLE001 - tried again next round
                log.warning("checking Redis for lost session records failed", exc_info=True)
            await asyncio.sleep(self._sync_every_s)

    async def _sync_loop(self) -> None:
        while (self._unsynced or self._deletes) and not self._closed:
            await asyncio.sleep(self._sync_every_s)
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - tried again next round
                log.warning("writing session records back to Redis failed", exc_info=True)

    async def sync(self) -> int:
        """Send Redis the deletes that missed it, then write back the records whose last
        write may have missed Redis, each only over a version this replica wrote or
        expected and never over a tombstone (unless this replica created the session
        while Redis was away); returns how many records reached Redis."""
        done = 0
        for key in list(self._deletes):
            async with self._one_writer(key):
                if not await self._flush_delete(key):
                    return done
        for key in list(self._unsynced):
            async with self._one_writer(key):
                expect = self._unsynced.get(key)
                rec = await self.local.get(*key)
                if expect is None or rec is None:
                    await self._settled(key)
                    continue
                create = key in self._creates
                ok, outcome = await self._try(
                    "write-back", lambda r=rec, e=expect, c=create: self.primary.put_if(r, e, create=c)
                )
                if not ok:
                    return done  # still away; the breaker paces the next try
                if outcome == DELETED:
                    log.warning("session %r was deleted while Redis missed this replica's last write of it; "
                                "not written back", key[1])  # fmt: skip
                    await self._forget(key)
                elif outcome == CONFLICT:
                    log.warning("session %r: another replica wrote it while Redis missed this replica's version; "
                                "keeping theirs (%d turn(s) acknowledged here are not in it)", key[1],
                                max(0, rec.turns - self._base_turns.get(key, rec.turns)))  # fmt: skip
                    await self.local.delete(*key)
                    await self._settled(key)
                else:
                    await self._settled(key)
                    done += 1
                    self.written_back += 1
                    if outcome == RESTORED:
                        log.warning("session %r: Redis had lost its record; wrote back this replica's copy", key[1])
        return done

    async def delete(self, owner: str, session_id: str) -> bool:
        key = (owner, session_id)
        async with self._one_writer(key):
            before = await self.local.get(owner, session_id)
            state = (self._unsynced.pop(key, None), key in self._creates, self._base_turns.pop(key, None))
            self._creates.discard(key)
            here = await self.local.delete(owner, session_id)
            ok, there = await self._try("delete", lambda: self.primary.delete(owner, session_id))
            if ok:
                self._deletes.discard(key)
                await self._journal_quietly(key)
            elif here and len(self._deletes) < 100_000:  # Redis keeps the record until it hears of the delete
                self._deletes.add(key)
                try:
                    await self._journal(key)
                except OSError as e:  # as it was: the delete is refused
                    self._journal_failed(key, e, "delete")
                    self._deletes.discard(key)
                    if before is not None:
                        await self.local.put(before)
                    if state[0] is not None:
                        self._unsynced[key] = state[0]
                    if state[1]:
                        self._creates.add(key)
                    if state[2] is not None:
                        self._base_turns[key] = state[2]
                    raise SessionStoreUnavailable(
                        f"session {session_id!r}: the delete could not be saved (Redis did not answer and the "
                        f"server's journal failed to write); the session is as it was: retry"
                    ) from None
                self._start_sync()
            else:
                await self._journal_quietly(key)
            return bool(there) or here

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        key = (owner, session_id)
        pending = self._unsynced.get(key)
        if pending is not None:
            etags = etags | pending.etags
        here = await self.local.delete_if(owner, session_id, etags)
        await self._settled(key)
        ok, there = await self._try("delete", lambda: self.primary.delete_if(owner, session_id, etags))
        return bool(there) or here

    async def list(self, owner: str, page_size: int, page_token: str = "") -> tuple[list[SessionRecord], str]:
        ok, page = await self._try(
            "list", lambda: self.primary.list(owner, page_size, page_token), timeout_s=self.timeout_s * 10
        )
        return page if ok else await self.local.list(owner, page_size, page_token)

    async def try_lock(
        self, owner: str, session_id: str, holder: str, ttl_s: float, *, takeover_prefix: str = ""
    ) -> bool:
        ok, got = await self._try(
            "lock",
            lambda: self.primary.try_lock(owner, session_id, holder, ttl_s, takeover_prefix=takeover_prefix),
        )
        if ok:
            if got:  # mirror it here, so a lock check while Redis is away still sees it
                await self.local.try_lock(owner, session_id, holder, ttl_s, takeover_prefix=takeover_prefix)
            return bool(got)
        return await self.local.try_lock(owner, session_id, holder, ttl_s, takeover_prefix=takeover_prefix)

    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool:
        await self.local.refresh_lock(owner, session_id, holder, ttl_s)
        ok, got = await self._try("lock refresh", lambda: self.primary.refresh_lock(owner, session_id, holder, ttl_s))
        return bool(got) if ok else True  # Redis away: the lease is this replica's to keep

    async def unlock(self, owner: str, session_id: str, holder: str) -> None:
        """An unlock that misses Redis is tried again in the background until Redis
        answers, so a blip or a hang does not leave the session busy for other replicas
        until the lease runs out (on this replica a leftover lock of its own never
        blocks: see ``try_lock``)."""
        await self.local.unlock(owner, session_id, holder)
        ok, _ = await self._try("unlock", lambda: self.primary.unlock(owner, session_id, holder))
        if not ok and len(self._retries) < 10_000:
            task = asyncio.create_task(self._retry_unlock(owner, session_id, holder))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    async def _retry_unlock(self, owner: str, session_id: str, holder: str) -> None:
        """Until Redis answers (a minute at most): a lock write it applies late, after a
        hang, is then removed before other replicas wait out its lease."""
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline:
            await asyncio.sleep(self._unlock_retry_s)
            if self._closed:
                return
            if self.breaker.state == "open":
                continue  # not a call: the breaker would refuse it
            ok, _ = await self._try("unlock", lambda: self.primary.unlock(owner, session_id, holder))
            if ok:
                return

    async def is_locked(self, owner: str, session_id: str) -> bool:
        ok, got = await self._try("lock check", lambda: self.primary.is_locked(owner, session_id))
        return bool(got) if ok else await self.local.is_locked(owner, session_id)

    async def count(self, owner: str, *, prune_at: int | None = None, creating: str = "") -> int:
        primary = self.primary
        if isinstance(primary, RedisSessionStore):
            call = lambda: primary.count(owner, prune_at=prune_at, creating=creating)  # noqa: E731
        else:
            call = lambda: primary.count(owner)  # noqa: E731
        ok, n = await self._try("count", call, timeout_s=self.timeout_s * 10)
        return int(n) if ok else await self.local.count(owner)

    async def expire(self) -> list[SessionRecord]:
        """Expire this replica's copies; report those whose Redis record is gone (or
        unreachable) or as old, not the ones another replica has used since."""
        out = []
        for rec in await self.local.expire():
            await self._settled((rec.owner, rec.session_id))
            ok, there = await self._try("get", lambda r=rec: self.primary.get(r.owner, r.session_id))
            if ok and there is not None and there.last_used_at > rec.last_used_at:
                continue  # still alive elsewhere
            out.append(rec)
        ok, more = await self._try("expire", self.primary.expire)
        return out + (list(more) if ok and more else [])

    async def flush(self, timeout_s: float) -> FlushReport:
        """Write back what Redis lacks (the drain), until Redis has everything or
        ``timeout_s`` has passed. What is left is reported: kept in the journal (for the
        next start on this directory), or, without one, lost with the process."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        before = self.unsynced
        why = ""
        while self.unsynced:
            try:
                async with asyncio.timeout(max(deadline - time.monotonic(), 0.001)):
                    await self.sync()
            except TimeoutError:
                why = f"Redis did not take them within {timeout_s:.1f} s"
                break
            if not self.unsynced:
                break
            if time.monotonic() >= deadline:
                why = f"Redis did not take them within {timeout_s:.1f} s"
                break
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        left = set(self._unsynced) | self._deletes
        turns = await self._unsaved_turns()
        if left and not why:
            why = "Redis did not answer" if self.breaker.state != "closed" else "Redis did not take them"
        restored = 0 if left else (await self._restore_lost(deadline))[0]
        waited = time.monotonic() - t0
        written = max(0, before - self.unsynced)
        if self.journal is not None:  # every change Redis lacks is in the journal
            return FlushReport(journaled=len(left), journaled_turns=turns, written=written, restored=restored,
                               waited_s=waited, where="Redis", why=why)  # fmt: skip
        return FlushReport(sessions=len(left), turns=turns, written=written, restored=restored, waited_s=waited,
                           where="Redis", why=why)  # fmt: skip

    async def _restore_lost(self, deadline: float) -> tuple[int, bool]:
        """Write back the records this replica holds that Redis lost after confirming them
        (a restart without persistence, FLUSHALL, eviction): they would otherwise live on
        only in this process, until the session's next turn. Each is a conditional write
        that finds nothing there (RESTORED), never over another version or a tombstone.
        Best effort, within ``deadline``; returns how many were written back and whether
        every held record was dealt with (else the caller tries again)."""
        primary = self.primary
        if not isinstance(primary, RedisSessionStore):
            return 0, True
        held = {key: r for r in self.local.held() if (key := (r.owner, r.session_id)) not in self._unsynced}
        if not held:  # (what Redis has not confirmed is the write-back's: ``sync``)
            return 0, True
        budget = max(deadline - time.monotonic(), self.timeout_s)
        ok, lost = await self._try("check", lambda: primary.missing(list(held)), timeout_s=budget)
        complete = ok
        n = 0
        for key in lost if ok else []:
            rec = held[key]
            if time.monotonic() >= deadline:
                complete = False
                break
            async with self._one_writer(key):
                ok, outcome = await self._try("write-back", lambda r=rec: primary.put_if(r, Expect.of(r)))
            if not ok:
                complete = False
                break
            if outcome == RESTORED:
                n += 1
                self.written_back += 1
                self.restored += 1
        if n:
            log.warning("session store: %d record(s) Redis had lost (restarted without persistence, flushed or "
                        "evicted) written back from this replica's copies%s", n,
                        "" if complete else "; the rest on the next pass")  # fmt: skip
        return n, complete

    async def close(self) -> None:
        self._closed = True
        tasks = [*self._retries, *(t for t in (self._sync_task, self._watch_task) if t is not None)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.primary.close()
        await self.local.close()
        if self.journal is not None:
            self.journal.close()
