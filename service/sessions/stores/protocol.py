"""The ``SessionStore`` protocol every session store keeps (get / put / conditional put /
delete / list, plus the per-session turn lock), the outcomes of a conditional write
(``put_if``) and the rule that decides them (``cas_outcome``), the versions a write
expects (``Expect``, ``new_etag``) and what a drain could not save (``FlushReport``)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Protocol

from ..records import SessionRecord


# Outcomes of a conditional write (``put_if``).
WRITTEN = "written"  # the store held an expected version (or nothing, where that was expected)
RESTORED = "restored"  # the store had lost the record (restart, FLUSHALL, eviction): ours was written back
REPLACED = "replaced"  # the store held another incarnation that no turn had completed yet: overwritten
CONFLICT = "conflict"  # the store holds a version this writer did not expect: nothing written
UNKNOWN = "unknown"  # the store could not be asked (down, hung): written to this replica's copy only
DELETED = "deleted"  # the session was deleted (its tombstone is there) and the write was no creation: nothing written
HEALED = "healed"  # the store held an unreadable value (corrupt, truncated, another session's, a key of another type): replaced
LIMIT = "limit"  # a creation found the owner at its session limit (``limit``): nothing written (or the write undone)

# Etags of incarnations a stale writer must not replace (new_etag(kept=True)); the first
# turn of such a session that does not complete leaves the tombstone back (delete_if).
KEPT_ETAG_PREFIX = "d-"


@dataclass(frozen=True, slots=True)
class Expect:
    """What a conditional write expects the store to hold: a version whose etag is one
    of ``etags``, or (``absent_ok``) no record. Any other version is a conflict.
    ``unreadable``: the fingerprint (``fingerprint``) of an unreadable value the read
    found there, which counts as no record: a write may replace exactly that value."""

    etags: frozenset[str] = frozenset()
    absent_ok: bool = False
    after_delete: bool = False  # (a read's answer) there is no record because the session was deleted
    unreadable: str = ""

    def plus(self, etag: str) -> Expect:
        return Expect(self.etags | {etag}, self.absent_ok, unreadable=self.unreadable)

    def merge(self, other: Expect) -> Expect:
        """What either may find (a write that may land late is also ours)."""
        return Expect(self.etags | other.etags, self.absent_ok or other.absent_ok,
                      unreadable=self.unreadable or other.unreadable)  # fmt: skip

    @staticmethod
    def of(rec: SessionRecord | None) -> Expect:
        return Expect(frozenset({rec.etag}), False) if rec is not None else Expect(frozenset(), True)


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What a store's ``flush`` (the drain) could not save where it promises to: sessions
    whose last change is only in this process's memory (``sessions``, with ``turns``
    acknowledged turns among them), and those kept in the journal instead of Redis
    (``journaled``, ``journaled_turns``: replayed at the next start). ``why`` says what
    failed, ``where`` where the changes were meant to go."""

    sessions: int = 0
    turns: int = 0
    journaled: int = 0
    journaled_turns: int = 0
    written: int = 0  # changes the flush itself got through
    restored: int = 0  # records the primary store had lost since it confirmed them, written back
    waited_s: float = 0.0
    where: str = ""
    why: str = ""

    @property
    def lost(self) -> bool:
        return self.sessions > 0


def new_etag(*, kept: bool = False) -> str:
    """A version id. ``kept``: the version is a new incarnation that no writer of an
    older one may replace while it has no completed turn (``replace_uncommitted``): a
    session created again after a delete, a fork."""
    return (KEPT_ETAG_PREFIX if kept else "") + uuid.uuid4().hex[:16]


def fingerprint(value: bytes | None = None, *, key_type: str = "") -> str:
    """What names an unreadable stored value exactly (the Redis scripts compute the same):
    the SHA-1 of its bytes, or ``type:<name>`` for a key that is not a string."""
    return f"type:{key_type}" if key_type else hashlib.sha1(value or b"").hexdigest()


def cas_outcome(
    stored: SessionRecord | None, expect: Expect, replace_uncommitted: bool, *, deleted: bool = False,
    create: bool = False,
) -> str:
    """The rule of ``put_if`` (the Redis store runs the same rule in Lua). ``deleted``:
    the store holds the session's tombstone (it was deleted) instead of a record; only a
    creation (``create``) may write then. (An unreadable stored value counts as no
    record; the Redis store answers HEALED when it replaces one.)"""
    if deleted:
        if not create:
            return DELETED
        stored = None
    if stored is None:
        return WRITTEN if expect.absent_ok else RESTORED
    if stored.etag in expect.etags:
        return WRITTEN
    if replace_uncommitted and stored.turns == 0 and not stored.etag.startswith(KEPT_ETAG_PREFIX):
        return REPLACED
    return CONFLICT


class SessionStore(Protocol):
    """Where session records live. All methods are coroutines.

    Contract: ``get`` returns None when the session does not exist (or its record is
    unreadable: corrupt, truncated, another session's, a key of another type; that is
    counted and logged once); ``read`` also returns what a conditional write of the
    next version should expect (an unreadable value it found is named there, so the
    next write replaces it: HEALED); ``put_if`` writes unless the store holds a version
    ``expect`` does not name (see ``cas_outcome``; ``replace_uncommitted`` lets it
    overwrite another incarnation with no completed turn) and returns the outcome;
    a creation (``create``) with ``limit`` > 0 is written only if the owner then holds
    at most ``limit`` sessions, decided atomically with the other creations (LIMIT
    otherwise: nothing is left written);
    a store that keeps tombstones (Redis: ``delete`` leaves one) answers DELETED to any
    write of a deleted session except a creation (``create``: a first turn or a fork
    that found no record), which writes and so clears the tombstone;
    ``delete_if`` removes the record only if it is one of ``etags`` (True if removed);
    ``delete`` returns whether it existed; ``list`` pages through one owner's sessions
    ordered by session id, ``page_token`` being the ``next_page_token`` of the previous
    page ("" at the end). The lock is a lease: ``try_lock`` takes it for ``ttl_s``
    seconds unless another holder has it (a holder whose id starts with
    ``takeover_prefix`` counts as free: the caller knows that holder is gone),
    ``refresh_lock`` extends it (False if it was lost), ``unlock`` releases it if
    ``holder`` still has it. ``count`` is how many sessions the owner holds; ``expire``
    removes the sessions whose TTL has passed and returns them (a store whose backend
    expires records by itself returns what it knows of, possibly nothing). ``flush``
    (the drain, before ``close``) saves what the store holds only in memory where it
    promises to keep it, within ``timeout_s``, and reports what it could not
    (``FlushReport``). A store that cannot save a change raises ``SessionStoreUnavailable``
    rather than answer it (the session as it was).
    """

    async def get(self, owner: str, session_id: str) -> SessionRecord | None: ...
    async def read(self, owner: str, session_id: str) -> tuple[SessionRecord | None, Expect]: ...
    async def put(self, rec: SessionRecord) -> None: ...
    async def put_if(
        self, rec: SessionRecord, expect: Expect, *, replace_uncommitted: bool = False, create: bool = False,
        limit: int = 0,
    ) -> str: ...
    async def delete(self, owner: str, session_id: str) -> bool: ...
    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool: ...
    async def list(
        self, owner: str, page_size: int, page_token: str = ""
    ) -> tuple[list[SessionRecord], str]: ...
    async def try_lock(
        self, owner: str, session_id: str, holder: str, ttl_s: float, *, takeover_prefix: str = ""
    ) -> bool: ...
    async def refresh_lock(self, owner: str, session_id: str, holder: str, ttl_s: float) -> bool: ...
    async def unlock(self, owner: str, session_id: str, holder: str) -> None: ...
    async def is_locked(self, owner: str, session_id: str) -> bool: ...
    async def count(self, owner: str) -> int: ...
    async def expire(self) -> list[SessionRecord]: ...
    async def flush(self, timeout_s: float) -> FlushReport: ...
    async def close(self) -> None: ...
