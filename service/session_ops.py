"""The session operations outside a turn, over the session table and the engine:
Get, List, Rewind, Fork, Delete (``remove``), Warm, a front's attachment, and the KV a
removed session leaves (``forget``). A turn is ``service.conversations``'.

``rewind`` and ``fork`` write session records only (``SessionManager.rewind`` /
``fork``), telling the spill scheduler about the new transcript. Neither touches KV:
blocks are content-addressed, so a rewound turn's blocks stay cached for a re-ask and a
fork's prompts hash to its source's blocks.

``forget(rec)`` stops a removed session's KV blocks from being found (DeleteSession
and the reaper call it); ``block_locations(owner, rec)`` says which tiers hold them.
A session's blocks are keyed in the namespace ``CacheScope.of`` gives its owner and
cache salt, the same rule as a turn's.

Errors are domain errors (the session errors, ``RetentionRefused``...);
``service.wire.status_of`` maps them to gRPC statuses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Callable

from .metrics import ServiceMetrics
from .sessions import SessionManager, SessionRecord
from .spill import SpillScheduler
from .types import CacheScope, RetainedPrefix, Tier, WarmResult

if TYPE_CHECKING:
    from .engine import AsyncEngine

log = logging.getLogger(__name__)


class SessionOps:
    """What the fronts do to a session outside a turn (see the module docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        sessions: SessionManager,
        metrics: ServiceMetrics,
        *,
        spill: SpillScheduler | None = None,
        shared_cache_salts: frozenset[str] | tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.sessions = sessions
        self.metrics = metrics
        self.spill = spill
        self.shared_cache_salts = frozenset(shared_cache_salts)

    def _scope(self, owner: str, salt: str) -> CacheScope:
        return CacheScope.of(owner, salt, self.shared_cache_salts)

    async def rewind(
        self, owner: str, session_id: str, turns: int, expected_turns: int | None = None
    ) -> tuple[SessionRecord, int]:
        """Drop the last ``turns`` turns; returns the new record and the tokens dropped.
        The dropped turns' KV stays cached (a re-ask restores it)."""
        before, after = await self.sessions.rewind(owner, session_id, turns, expected_turns=expected_turns)
        self.metrics.session_operations.labels("rewind").inc()
        if self.spill is not None and after.token_ids:
            self.spill.touch(owner, session_id, after.token_ids, self._scope(owner, after.cache_salt))
        return after, len(before.token_ids) - len(after.token_ids)

    async def fork(self, owner: str, session_id: str, new_session_id: str, at_turn: int | None) -> SessionRecord:
        """A new session sharing ``session_id``'s transcript up to turn ``at_turn``; no KV
        is copied (same namespace, same tokens: the same block keys)."""
        rec = await self.sessions.fork(owner, session_id, new_session_id, at_turn)
        self.metrics.session_operations.labels("fork").inc()
        if self.spill is not None and rec.token_ids:
            self.spill.touch(owner, new_session_id, rec.token_ids, self._scope(owner, rec.cache_salt))
        return rec

    async def get(self, owner: str, session_id: str) -> tuple[SessionRecord, bool]:
        """A session's record and whether a turn is in flight (``SessionManager.get``).
        Raises SessionNotFound."""
        return await self.sessions.get(owner, session_id)

    async def list_sessions(
        self, owner: str, page_size: int, page_token: str
    ) -> tuple[list[tuple[SessionRecord, bool]], str]:
        """One page of ``owner``'s sessions with their busy flags, and the next page's
        token (``SessionManager.list``). Raises InvalidSessionId for a token this server
        did not issue, ValueError for a page size out of range."""
        return await self.sessions.list(owner, page_size, page_token)

    async def session(self, owner: str, session_id: str) -> tuple[SessionRecord, bool, str]:
        """A session's record, whether a turn is in flight, and its last completed turn's
        reply as text ("" before its first turn). Raises SessionNotFound."""
        rec, busy = await self.sessions.get(owner, session_id)
        reply = ""
        if rec.turn_log:
            out = rec.token_ids[len(rec.token_ids) - rec.turn_log[-1].output_tokens :]
            reply = await asyncio.to_thread(self.engine.tokenizer.decode, out)
        return rec, busy, reply

    async def remove(self, owner: str, session_id: str) -> SessionRecord:
        """Delete a session and stop its KV blocks from being found (``forget``); its last
        record. Raises SessionNotFound, SessionBusy."""
        rec = await self.sessions.delete(owner, session_id)
        await self.forget(rec)
        return rec

    async def attach(
        self, owner: str, session_id: str, change: Callable[[SessionRecord], str], *, create: bool = False
    ) -> SessionRecord:
        """Write ``change(record)`` as the session's ``attachment`` (a front's state: the
        Conversations API's items and metadata) under its turn lock, the transcript as it
        is (``SessionManager.attach``); ``create``: a new session. The new record."""
        return await self.sessions.attach(owner, session_id, change, create=create)

    async def reap_abandoned(self, owner: str, session_id: str) -> bool:
        """Remove a first turn's placeholder whose turn can never complete (its replica
        died): ``SessionManager.reap_abandoned``. It holds no tokens, so no KV to forget."""
        return await self.sessions.reap_abandoned(owner, session_id)

    async def reap(self) -> list[SessionRecord]:
        """Remove the expired sessions (``SessionManager.reap``) and ``forget`` each one's
        blocks; the records removed."""
        removed = await self.sessions.reap()
        for rec in removed:
            dropped = await self.forget(rec)
            log.info("session %r of tenant %r expired; KV entries dropped: %s", rec.session_id, rec.owner, dropped)
        return removed

    async def forget(self, rec: SessionRecord) -> dict[Tier, int]:
        """Stop a removed session's KV blocks from being found (device, host, Redis).
        Blocks in a shared namespace are left alone: they are not the session's own; so
        are the leading blocks another live session still shares (its source, its
        forks, theirs: ``SessionManager.shared_prefix``), so a deleted parent response
        leaves its follow-ups' history cached."""
        if self.spill is not None:
            self.spill.forget(rec.owner, rec.session_id)
        scope = self._scope(rec.owner, rec.cache_salt)
        if scope.tenant is None or not rec.token_ids:
            return {}
        try:
            keep = await self.sessions.shared_prefix(rec) // self.engine.model_info.block_size
            if keep >= len(rec.token_ids) // self.engine.model_info.block_size:
                return {}
            return await self.engine.forget(rec.token_ids, scope, keep_blocks=keep)
        except Exception:  # the transcript is gone already; dropping its cache is best effort
            log.exception("dropping the KV blocks of session %r failed", rec.session_id)
            return {}

    async def warm(self, owner: str, session_id: str) -> WarmResult:
        """Warm the session's blocks up for its next turn (``AsyncEngine.warm``): the
        caller's own session (another tenant's, an unknown or an expired one: raises
        SessionNotFound), a turn in flight or not; counted against ``owner``'s warm-up share."""
        rec, _busy = await self.sessions.get(owner, session_id)
        return await self.engine.warm(rec.token_ids, self._scope(owner, rec.cache_salt), owner)

    async def retain(self, owner: str, session_id: str, ttl_s: float) -> RetainedPrefix:
        """Pin the session's transcript for ``ttl_s`` seconds (``AsyncEngine.retain``):
        the caller's own session (else SessionNotFound), counted against ``owner``'s
        bound (``RetentionRefused`` past it); what was kept."""
        rec, _busy = await self.sessions.get(owner, session_id)
        return await self.engine.retain(rec.token_ids, self._scope(owner, rec.cache_salt), ttl_s)

    async def block_locations(self, owner: str, rec: SessionRecord) -> dict[Tier, int]:
        """How many of the session's full blocks each tier holds now."""
        return await self.engine.block_locations(rec.token_ids, self._scope(owner, rec.cache_salt))
