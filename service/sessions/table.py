"""The session table: owners, one turn at a time per session, TTL and limits
(``SessionManager``, ``Turn``). See the package docstring for the rules."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .records import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    BadTurnCount,
    SessionBusy,
    SessionConflict,
    SessionDeleted,
    SessionExists,
    SessionLimit,
    SessionNotFound,
    SessionRecord,
    TurnInfo,
    TurnsChanged,
    TurnUnavailable,
    check_session_id,
    copy_record,
    dropped_answers,
    with_recall,
)
from .stores import (
    CONFLICT,
    DELETED,
    HEALED,
    KEPT_ETAG_PREFIX,
    LIMIT,
    REPLACED,
    RESTORED,
    UNKNOWN,
    Expect,
    FallbackSessionStore,
    RedisSessionStore,
    SessionStore,
    new_etag,
)

log = logging.getLogger(__name__)


def _completed(turns: int) -> str:
    return f"{turns} completed turn{'' if turns == 1 else 's'}"


@dataclass(slots=True)
class Turn:
    """One turn in flight: the record as it was at the start, the lock lease, and what a
    conditional write of the session may find in the store (its version at the start
    and every version this turn wrote)."""

    record: SessionRecord
    holder: str
    created: bool  # this turn created the session
    expect: Expect = field(default_factory=Expect)
    _renewal: asyncio.Task | None = None
    committed: bool = False
    ended: bool = False
    deleted: bool = False  # a write found the session deleted (its tombstone): the turn cannot commit
    started_at: float = 0.0  # unix seconds


class SessionManager:
    """The session table used by the servicer: one turn at a time per session.

    One turn at a time, whatever the store lost:

    * This replica's own turns in flight are held here (``_inflight``), consulted before
      the store: a second turn of a session in flight on this replica is refused even
      when Redis restarted, was flushed or hangs.
    * Across replicas the store's lock (a lease of ``lock_ttl_s``, renewed every
      ``min(lock_ttl_s / 3, renew_every_s)`` while the turn runs) keeps a second turn
      out. A renewal that finds the lock gone (Redis restarted or flushed) takes it
      again and writes the turn's record back.
    * Every write of a record is conditional on the version the turn started from
      (``put_if``), so a commit never silently overwrites a newer record: when another
      replica wrote the session meanwhile (possible only while the lock was lost) the
      commit raises ``SessionConflict`` and the turn fails instead of an acknowledged
      turn vanishing. When Redis lost the record mid-turn, the commit writes this
      replica's copy back (logged, counted in ``records_lost``).
    * A deleted session stays deleted: ``delete`` leaves a tombstone in the store
      (Redis), and no write of a turn that started before it (a commit, the renewal's
      write-back, a write-back after Redis missed writes) re-creates the session; such
      a turn raises ``SessionDeleted`` (NOT_FOUND) and records nothing. Only a creation
      (a first turn that found no record, a fork) writes over the tombstone: the same
      id can be used again for a new session.
    * Lock holders are ``{replica_id}:{uuid}``: a lock left in Redis by an ended turn of
      this replica (an unlock that missed a hung Redis, a lock write applied late) is
      taken over by this replica's next turn instead of blocking it until its lease ends.

    ``max_sessions_per_owner`` (0 = none) caps the sessions one owner holds, exactly,
    however many creations (first turns, forks) run at once on however many replicas:
    the store admits each creation atomically (``put_if(..., limit=)``: in Redis one
    script over the owner's index), and a refused one leaves nothing behind
    (``SessionLimit``). While Redis is away each replica counts only the sessions it
    holds itself.

    A record the store cannot read (corrupt, truncated, another session's, a key of
    another type) is no record: ``get`` raises SessionNotFound and a turn starts the
    session over, and that turn's first write replaces the value (``records_healed``).

    Over 400 lines: every session operation (a turn's begin, commit and end, fork, rewind, delete, list, reap) holds the same turn lock, in-flight table and limits.
    """

    def __init__(
        self,
        store: SessionStore,
        *,
        lock_ttl_s: float = 30.0,
        max_sessions_per_owner: int = 0,
        clock: Callable[[], float] = time.time,
        renew_every_s: float = 1.0,
    ) -> None:
        self.store = store
        self._lock_ttl_s = lock_ttl_s
        self._renew_every_s = min(lock_ttl_s / 3, renew_every_s)
        self.max_sessions_per_owner = max_sessions_per_owner
        self._clock = clock
        self.replica_id = uuid.uuid4().hex[:12]
        self._inflight: dict[tuple[str, str], str] = {}  # this replica's turns in flight -> holder
        self._records_lost = 0  # records the store had lost mid-session, written back by a turn
        self.conflicts = 0  # turns refused because another replica wrote the session meanwhile
        self.unconfirmed_writes = 0  # writes the store could not confirm (kept on this replica)
        self.deleted_turns = 0  # turns that ended because their session was deleted meanwhile
        self.records_healed = 0  # unreadable records (corrupt, wrong type) a write of this replica replaced

    @property
    def records_lost(self) -> int:
        """Records the store had lost (Redis restarted, was flushed, evicted them) while this
        replica held them, written back from here: by a turn, or by the store as soon as it
        noticed (``FallbackSessionStore.restored``)."""
        return self._records_lost + getattr(self.store, "restored", 0)

    @property
    def turns_in_flight(self) -> int:
        return len(self._inflight)

    def in_flight_here(self, owner: str, session_id: str) -> bool:
        return (owner, session_id) in self._inflight

    def _busy(self, session_id: str) -> SessionBusy:
        return SessionBusy(f"session {session_id!r} already has a turn in flight; retry when it finishes")

    async def begin_turn(self, owner: str, session_id: str, *, require_existing: bool = False) -> Turn:
        """Lock the session (creating it if new, unless ``require_existing``) and return
        its record as of now.

        Raises InvalidSessionId, SessionBusy, or SessionNotFound (``require_existing``).
        """
        check_session_id(session_id)
        key = (owner, session_id)
        if key in self._inflight:
            raise self._busy(session_id)
        holder = f"{self.replica_id}:{uuid.uuid4().hex}"
        self._inflight[key] = holder  # reserved before the first await
        try:
            if not await self.store.try_lock(
                owner, session_id, holder, self._lock_ttl_s, takeover_prefix=f"{self.replica_id}:"
            ):
                raise self._busy(session_id)
            try:
                rec, expect = await self.store.read(owner, session_id)
                created = rec is None
                if rec is None:
                    if require_existing:
                        raise SessionNotFound(
                            f"session {session_id!r} not found (require_existing_session is set): it expired, "
                            f"was deleted, or the server lost it"
                        )
                    await self._check_room(owner, session_id)
                    rec = SessionRecord(session_id=session_id, owner=owner, created_at=self._clock())
                rec.last_used_at = self._clock() if not created else rec.created_at
                rec.etag = new_etag(kept=created and expect.after_delete)
                outcome = await self.store.put_if(rec, expect, create=created, limit=self.max_sessions_per_owner)
                self._note(outcome, rec, "at the start of a turn")
                if outcome == LIMIT:
                    raise self._limit_error(self.max_sessions_per_owner)
                if outcome == DELETED:  # a DeleteSession between the read and this write
                    raise SessionDeleted(
                        f"session {session_id!r} was deleted as this turn started; nothing was recorded"
                    )
                if outcome == CONFLICT:
                    raise SessionBusy(
                        f"session {session_id!r} was just written by another replica; retry when its turn finishes"
                    )
            except BaseException:
                await self.store.unlock(owner, session_id, holder)
                raise
        except BaseException:
            if self._inflight.get(key) == holder:
                del self._inflight[key]
            raise
        turn = Turn(record=rec, holder=holder, created=created, expect=expect.plus(rec.etag),
                    started_at=rec.last_used_at)  # fmt: skip
        turn._renewal = asyncio.create_task(self._renew(turn), name=f"session-lock-{session_id}")
        return turn

    def _note(self, outcome: str, rec: SessionRecord, when: str) -> None:
        if outcome == HEALED:
            self.records_healed += 1
            log.warning("session %r: its unreadable record in the session store was replaced %s (%d turns, %d tokens)",
                        rec.session_id, when, rec.turns, len(rec.token_ids))  # fmt: skip
        elif outcome in (RESTORED, REPLACED):
            self._records_lost += 1
            log.warning(
                "session %r: the session store had lost its record %s (%s); wrote back this replica's copy "
                "(%d turns, %d tokens)",
                rec.session_id, when,
                "Redis restarted, was flushed or evicted it" if outcome == RESTORED
                else "another replica started it over while Redis had lost it",
                rec.turns, len(rec.token_ids),
            )  # fmt: skip
        elif outcome == UNKNOWN:
            self.unconfirmed_writes += 1

    async def _check_room(self, owner: str, session_id: str) -> None:
        """SessionLimit if the owner, ``session_id`` apart, holds the limit already (the
        store's ``put_if`` decides exactly; this spares a refused creation its write)."""
        limit = self.max_sessions_per_owner
        if not limit:
            return
        count = self.store.count
        n = await (count(owner, prune_at=limit, creating=session_id) if _takes_prune_at(self.store) else count(owner))
        if n >= limit:
            raise self._limit_error(n)

    def _limit_error(self, n: int) -> SessionLimit:
        return SessionLimit(
            f"this tenant already has {n} sessions; the limit is {self.max_sessions_per_owner} per tenant "
            f"(max_sessions_per_tenant): delete one (DeleteSession) or let one expire"
        )

    async def commit_turn(
        self,
        turn: Turn,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        *,
        cache_salt: str = "",
        finish_reason: str = "stop",
        replace_last: bool = False,
        attachment: str | None = None,
    ) -> SessionRecord:
        """The turn completed: the transcript becomes prompt + output, one more turn (its
        boundaries appended to the turn log). With ``replace_last`` the turn replaces the
        session's last completed turn instead (regenerate, edit): the prompt extends the
        transcript as it was before that turn, the turn count stays, and the replaced
        answer joins the record's ``recall`` (records.py, Recall). ``cache_salt`` is
        the turn's request salt (where its KV blocks are keyed); ``attachment`` (not None)
        replaces the record's front state in the same write.

        Raises SessionConflict (nothing written) when the store holds a version of the
        session this turn did not start from (another replica wrote it meanwhile)."""
        rec = turn.record
        recall = rec.recall
        if replace_last:
            if not rec.turn_log:
                raise RuntimeError("no tracked turn to replace")
            base, turn_log, turns = rec.turn_end(rec.turns - 1), rec.turn_log[:-1], rec.turns
            recall = with_recall(rec.recall, dropped_answers(rec, 1))  # the replaced answer, drafted from later
        else:
            base, turn_log, turns = len(rec.token_ids), rec.turn_log, rec.turns + 1
        if list(prompt_token_ids[:base]) != rec.token_ids[:base] or len(prompt_token_ids) < base:
            raise RuntimeError("turn prompt does not extend the session transcript")
        now = self._clock()
        info = TurnInfo(len(prompt_token_ids) - base, len(output_token_ids), finish_reason, turn.started_at, now)
        new = copy_record(
            rec, token_ids=list(prompt_token_ids) + list(output_token_ids), cache_salt=cache_salt,
            turns=turns, turn_log=[*turn_log, info], last_used_at=now, etag=new_etag(), recall=recall,
        )  # fmt: skip
        if attachment is not None:
            new.attachment = attachment
        return await self._commit(turn, new)

    async def attach(
        self, owner: str, session_id: str, change: Callable[[SessionRecord], str], *, create: bool = False
    ) -> SessionRecord:
        """Write ``change(record)`` as the session's ``attachment`` (a front's state: the
        Conversations API's items and metadata), under the turn lock (so it excludes a
        turn in flight on any replica: SessionBusy), transcript untouched; with
        ``create`` the session must not exist yet (SessionExists) and is created with it
        (counted toward ``max_sessions_per_owner``), else it must (SessionNotFound).
        ``change`` may raise to write nothing. The new record."""
        turn = await (self.begin_turn(owner, session_id) if create else self.begin_op(owner, session_id))
        try:
            if create and not turn.created:
                raise SessionExists(f"session {session_id!r} already exists")
            rec = turn.record
            new = copy_record(rec, attachment=change(rec), last_used_at=self._clock(),
                              etag=new_etag(kept=rec.turns == 0))  # fmt: skip (no turn yet: never a placeholder)
            return await self._commit(turn, new)
        finally:
            await self.end_turn(turn)

    async def _commit(self, turn: Turn, new: SessionRecord) -> SessionRecord:
        """Write ``new`` as the session's next version, conditional on what the turn expects."""
        rec = turn.record
        outcome = await self.store.put_if(new, turn.expect, replace_uncommitted=True)
        self._note(outcome, new, "while a turn ran")
        if outcome == DELETED:
            turn.deleted = True
            raise self.deleted_error(turn)
        if outcome == CONFLICT:
            self.conflicts += 1
            log.warning(
                "session %r: another replica wrote it while this turn ran (the turn lock was lost: Redis "
                "restarted or was flushed); this turn is not recorded", rec.session_id,
            )  # fmt: skip
            raise SessionConflict(
                f"session {rec.session_id!r} was changed by another replica while this turn ran (the session "
                f"store lost its turn lock); this turn was not recorded: read the session and retry"
            )
        turn.record = new
        turn.expect = Expect(frozenset({new.etag}))
        turn.committed = True
        return new

    def deleted_error(self, turn: Turn) -> SessionDeleted:
        """The session of ``turn`` was deleted while it ran (counted, logged)."""
        self.deleted_turns += 1
        sid = turn.record.session_id
        log.info("session %r was deleted while a turn ran; the turn is not recorded", sid)
        return SessionDeleted(f"session {sid!r} was deleted while this turn ran; this turn was not recorded")

    # ------------------------------------------------------------------ rewind, fork

    @staticmethod
    def check_expected_turns(rec: SessionRecord, expected_turns: int | None) -> None:
        """TurnsChanged unless ``expected_turns`` is None or the session's turn count."""
        if expected_turns is not None and rec.turns != expected_turns:
            raise TurnsChanged(
                f"session {rec.session_id!r} has {_completed(rec.turns)}, the request expected "
                f"{expected_turns} (expected_turns): another turn or operation changed it; read it and retry"
            )

    @staticmethod
    def last_turn_start(rec: SessionRecord, what: str) -> int:
        """Where the last completed turn starts in the transcript (regenerate, edit);
        TurnUnavailable when there is none or its boundaries were not recorded."""
        if rec.turns == 0:
            raise TurnUnavailable(f"session {rec.session_id!r} has no completed turn to {what}")
        if not rec.turn_log:
            raise TurnUnavailable(
                f"session {rec.session_id!r}: its last turn was recorded before turn boundaries were kept; "
                f"it cannot be replaced (to {what} it: continue the session, or fork it)"
            )
        return rec.turn_end(rec.turns - 1)

    async def begin_op(self, owner: str, session_id: str) -> Turn:
        """``begin_turn`` for an operation on an existing session (rewind, regenerate,
        edit): SessionNotFound when it does not exist."""
        try:
            return await self.begin_turn(owner, session_id, require_existing=True)
        except SessionNotFound:
            raise SessionNotFound(f"session {session_id!r} not found") from None

    async def rewind(
        self, owner: str, session_id: str, turns: int, *, expected_turns: int | None = None
    ) -> tuple[SessionRecord, SessionRecord]:
        """Drop the last ``turns`` completed turns (under the turn lock, so it excludes a
        turn in flight on any replica). Returns the records before and after. The KV
        blocks of the dropped turns are left cached (content-addressed: a re-ask finds them),
        their answers kept in the record's ``recall`` (a re-ask drafts from them).

        Raises InvalidSessionId, BadTurnCount, SessionNotFound, SessionBusy, TurnsChanged,
        TurnUnavailable (the turns predate turn boundaries), SessionConflict."""
        check_session_id(session_id)
        if turns < 1:
            raise BadTurnCount(f"turns must be at least 1, got {turns}")
        turn = await self.begin_op(owner, session_id)
        try:
            rec = turn.record
            self.check_expected_turns(rec, expected_turns)
            if turns > rec.turns:
                raise BadTurnCount(
                    f"session {session_id!r} has {_completed(rec.turns)}; cannot rewind {turns}"
                )
            keep = rec.turns - turns
            if keep < rec.untracked_turns:
                raise TurnUnavailable(
                    f"session {session_id!r}: its first {rec.untracked_turns} turns were recorded before turn "
                    f"boundaries were kept; at most {rec.turns - rec.untracked_turns} turns can be rewound"
                )
            end = rec.turn_end(keep)
            new = copy_record(
                rec, token_ids=rec.token_ids[:end], turns=keep, turn_log=rec.turn_log[: keep - rec.untracked_turns],
                last_used_at=self._clock(), etag=new_etag(), recall=with_recall(rec.recall, dropped_answers(rec, turns)),
            )  # fmt: skip
            before = copy_record(rec)
            return before, await self._commit(turn, new)
        finally:
            await self.end_turn(turn)

    async def fork(
        self, owner: str, session_id: str, new_session_id: str, at_turn: int | None = None
    ) -> SessionRecord:
        """A new session ``new_session_id`` of the same owner whose transcript is
        ``session_id``'s up to the end of turn ``at_turn`` (None: all of it), with the
        same cache salt: its prompts hash to the same blocks, so no KV is copied. The
        source's last committed version is read (a turn in flight there does not block
        a fork); the new session counts toward ``max_sessions_per_owner``.

        Raises InvalidSessionId, SessionNotFound, SessionExists, BadTurnCount,
        TurnUnavailable, SessionLimit."""
        check_session_id(session_id)
        check_session_id(new_session_id, "new_session_id")
        src = await self.store.get(owner, session_id)
        if src is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        at = src.turns if at_turn is None else at_turn
        if at > src.turns:
            raise BadTurnCount(f"at_turn is {at} but session {session_id!r} has {_completed(src.turns)}")
        if at < src.untracked_turns:
            raise TurnUnavailable(
                f"session {session_id!r}: its first {src.untracked_turns} turns were recorded before turn "
                f"boundaries were kept; fork at turn {src.untracked_turns} or later"
            )
        exists = SessionExists(f"session {new_session_id!r} already exists; pick another new_session_id")
        key = (owner, new_session_id)
        if key in self._inflight:
            raise exists
        now = self._clock()
        child = SessionRecord(
            session_id=new_session_id, owner=owner, token_ids=src.token_ids[: src.turn_end(at)], created_at=now,
            last_used_at=now, turns=at, cache_salt=src.cache_salt, etag=new_etag(kept=True),
            turn_log=src.turn_log[: at - src.untracked_turns], forked_from=session_id,
        )  # fmt: skip
        # The new id's turn lock, held while it is created: no turn of that id (on any
        # replica) runs in between, and the index is not pruned of it meanwhile.
        holder = f"{self.replica_id}:{uuid.uuid4().hex}"
        self._inflight[key] = holder
        try:
            if not await self.store.try_lock(
                owner, new_session_id, holder, self._lock_ttl_s, takeover_prefix=f"{self.replica_id}:"
            ):
                raise exists  # a turn of that id is in flight: it exists
            try:
                there, expect = await self.store.read(owner, new_session_id)
                if there is not None:
                    raise exists
                await self._check_room(owner, new_session_id)
                expect = Expect(frozenset(), absent_ok=True, unreadable=expect.unreadable)
                outcome = await self.store.put_if(child, expect, create=True, limit=self.max_sessions_per_owner)
            finally:
                await self.store.unlock(owner, new_session_id, holder)
        finally:
            if self._inflight.get(key) == holder:
                del self._inflight[key]
        if outcome == LIMIT:
            raise self._limit_error(self.max_sessions_per_owner)
        if outcome == CONFLICT:
            raise exists
        self._note(outcome, child, "when it was forked")
        return child

    async def end_turn(self, turn: Turn) -> None:
        """Release the lock. Without a commit the transcript stays as before the turn
        (a session whose first turn did not complete is removed again, unless another
        replica has written it since)."""
        turn.ended = True  # the renewal stops even if its cancellation were lost
        if turn._renewal is not None:
            turn._renewal.cancel()
        rec = turn.record
        key = (rec.owner, rec.session_id)
        try:
            if turn.created and not turn.committed:
                await self.store.delete_if(rec.owner, rec.session_id, turn.expect.etags)
        finally:
            try:
                await self.store.unlock(rec.owner, rec.session_id, turn.holder)
            finally:
                if self._inflight.get(key) == turn.holder:
                    del self._inflight[key]

    async def _renew(self, turn: Turn) -> None:
        rec = turn.record
        while not turn.ended:
            await asyncio.sleep(self._renew_every_s)
            if turn.ended:
                return
            try:
                if await self.store.refresh_lock(rec.owner, rec.session_id, turn.holder, self._lock_ttl_s):
                    continue
                if turn.ended:
                    return
                # The lock is gone from the store (Redis restarted or was flushed, or the
                # lease ran out): take it again and put the record back, so no other
                # replica starts this session over while the turn runs.
                retaken = await self.store.try_lock(
                    rec.owner, rec.session_id, turn.holder, self._lock_ttl_s, takeover_prefix=f"{self.replica_id}:"
                )
                log.warning("session %r: its turn lock was gone from the session store; %s", rec.session_id,
                            "taken again" if retaken else "another replica holds it now")  # fmt: skip
                if not turn.committed:
                    back = copy_record(turn.record, etag=new_etag())
                    outcome = await self.store.put_if(back, turn.expect, replace_uncommitted=True)
                    self._note(outcome, back, "while a turn ran")
                    if outcome == DELETED:  # deleted while its lock was gone: the turn ends
                        turn.deleted = True
                        log.info("session %r was deleted while its turn lock was gone", rec.session_id)
                    elif outcome != CONFLICT:
                        turn.expect = turn.expect.plus(back.etag)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store may be briefly unreachable; the lease covers it
                log.warning("could not renew the turn lock of session %r", rec.session_id, exc_info=True)

    async def get(self, owner: str, session_id: str) -> tuple[SessionRecord, bool]:
        """The record and whether a turn is in flight. Raises SessionNotFound."""
        check_session_id(session_id)
        rec = await self.store.get(owner, session_id)
        if rec is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return rec, self.in_flight_here(owner, session_id) or await self.store.is_locked(owner, session_id)

    async def delete(self, owner: str, session_id: str) -> SessionRecord:
        """Remove the session and return its last record. Raises SessionNotFound, or
        SessionBusy while a turn runs."""
        check_session_id(session_id)
        if self.in_flight_here(owner, session_id) or await self.store.is_locked(owner, session_id):
            raise SessionBusy(f"session {session_id!r} has a turn in flight; cancel it first")
        rec = await self.store.get(owner, session_id)
        if not await self.store.delete(owner, session_id) or rec is None:
            raise SessionNotFound(f"session {session_id!r} not found")
        return rec

    async def reap_abandoned(self, owner: str, session_id: str) -> bool:
        """Remove the session if it is an abandoned first turn's placeholder: no completed
        turn, written by a turn (not a fork or a creation after a delete: its etag is not a
        kept one), older than a lock lease (in Redis), and no turn lock on any replica, so the turn
        that wrote it is gone (its replica died and the lock's lease lapsed) and can never
        commit. The delete is conditional on the version read. True when it removed it.
        (The Responses API calls it on a response that is not finished and not running:
        that response will never be, so it is not found, never followed up from an empty
        transcript.) A live turn whose lock Redis lost (evicted, restarted) takes it back
        within a renewal (``_renew``); the age bound keeps a young turn safe meanwhile. (A
        store in this process holds its locks itself: unlocked there is not running.)"""
        check_session_id(session_id)
        if self.in_flight_here(owner, session_id):
            return False
        rec = await self.store.get(owner, session_id)
        if rec is None or rec.turns or rec.token_ids or rec.etag.startswith(KEPT_ETAG_PREFIX):
            return False
        if _locks_in_redis(self.store) and self._clock() - rec.created_at < self._lock_ttl_s:
            return False  # a lock in Redis: its lease cannot have lapsed yet
        if await self.store.is_locked(owner, session_id):
            return False
        removed = await self.store.delete_if(owner, session_id, frozenset({rec.etag}))
        if removed:
            log.info("session %r: removed the placeholder of a first turn that never completed (its turn lock "
                     "lapsed)", session_id)  # fmt: skip
        return removed

    async def shared_prefix(self, rec: SessionRecord) -> int:
        """How many leading tokens of ``rec``'s transcript another live session of its
        owner, in its cache namespace (the same ``cache_salt``), still has: the most any
        one shares (0 when none does). The KV blocks of that prefix are that session's
        too, so a removed session's blocks past it are the only ones nothing references:
        the session it was forked from (a Responses API follow-up's previous response),
        the forks of it (the follow-ups of a deleted response), theirs, and any other
        transcript that happens to start the same way.

        Reads every session of the owner (a page of ``MAX_PAGE_SIZE`` at a time): a
        delete costs one pass over the tenant's records (``--max-sessions-per-tenant``
        bounds it). A store error makes it 0 (the caller then drops every block: a
        later miss, never wrong output)."""
        n, token = 0, ""
        try:
            while n < len(rec.token_ids):
                page, token = await self.store.list(rec.owner, MAX_PAGE_SIZE, token)
                for other in page:
                    if other.session_id != rec.session_id and other.cache_salt == rec.cache_salt:
                        n = max(n, _common_prefix(rec.token_ids, other.token_ids))
                if not token:
                    break
        except Exception:  # noqa: BLE001 - best effort: the caller then drops every block
            log.warning("could not read the sessions sharing blocks with %r", rec.session_id, exc_info=True)
            return 0
        return n

    async def reap(self) -> list[SessionRecord]:
        """Remove sessions whose TTL passed; returns their last records."""
        return await self.store.expire()

    async def list(self, owner: str, page_size: int, page_token: str) -> tuple[list[tuple[SessionRecord, bool]], str]:
        """One page of the owner's sessions (with their busy flags), ordered by id."""
        if page_size < 0 or page_size > MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be in 0..{MAX_PAGE_SIZE}, got {page_size}")
        if page_token:
            check_session_id(page_token)
        recs, next_token = await self.store.list(owner, page_size or DEFAULT_PAGE_SIZE, page_token)
        busy = await asyncio.gather(*(self.store.is_locked(owner, r.session_id) for r in recs))
        return [(r, b or self.in_flight_here(owner, r.session_id)) for r, b in zip(recs, busy)], next_token


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _takes_prune_at(store: SessionStore) -> bool:
    return isinstance(store, (RedisSessionStore, FallbackSessionStore))


def _locks_in_redis(store: SessionStore) -> bool:
    """Whether the store's turn locks are Redis's (shared by replicas, lost with its data)."""
    return isinstance(store, (RedisSessionStore, FallbackSessionStore))
