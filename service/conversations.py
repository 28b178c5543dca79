"""One turn of a conversation, front to engine and back: the rules of a Generate call
that are not gRPC.

    async for event in conversations.run_turn(owner, turn_input, request_id):
        ...  # Started, then Delta..., then Finished (domain events)

A turn is two steps. ``prepare`` runs every check and builds what the turn runs, a
frozen ``PreparedTurn``: the request's checks before the session is touched (one call,
``validation.check_request``: sampling, cache salt, stop lists, input text and size
limits, the session options, the roles), then the session's turn
(``SessionManager.begin_turn``: the lock, the transcript) and the record it extends
(a fork's source, a regenerate's or an edit's earlier transcript, a resent history's
plan), the input tokenized (text that cannot fit refused first) and the prompt's checks
(one call, ``validation.check_prompt``: vocabulary, prompt limit, context, which fits
``max_new_tokens`` to the context left), and the request's ``CacheScope`` (tenant +
request salt, or shared). ``stream`` runs it: the engine's events, counted and
observed, the commit before the last event leaves (so the client's next turn never
finds the session busy), the spill scheduler told the session went idle. A turn
refused, failed or cancelled leaves the transcript as it was.

A session turn appends (``TurnMode.APPEND``) or replaces the last completed turn:
``REGENERATE`` generates again from that turn's input (the request has no input),
``EDIT`` uses the request's input instead of it. Both take the turn lock like any
turn (a racing turn, on this replica or another, gets ``SessionBusy``), build the
prompt from the transcript as it was before that turn (every earlier block is found
in the cache, and for a regenerate the input's blocks too) and commit with
``replace_last``; one that does not complete leaves the old turn in place.
``expected_turns`` makes any session turn conditional on the session's turn count.

``rewind`` and ``fork`` are the session operations over the table
(``SessionManager.rewind`` / ``fork``), telling the spill scheduler about the new
transcript. Neither touches KV: blocks are content-addressed, so a rewound turn's
blocks stay cached for a re-ask and a fork's prompts hash to its source's blocks.

``forget(rec)`` stops a removed session's KV blocks from being found (DeleteSession
and the reaper call it); ``block_locations(owner, rec)`` says which tiers hold them.

Errors are domain errors (``InvalidRequest``, the session errors,
``QueueFull``...); ``service.wire.status_of`` maps them to gRPC statuses.

Text and chat input is tokenized in a worker thread, never on the event loop, and
input that cannot fit the prompt limit (``max_prompt_tokens``, else the context
length) is refused before it is tokenized: no token covers more than
``max_bytes_per_token`` bytes of text, so ``ceil(bytes / that)`` tokens is a lower
bound on what the text becomes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol, Sequence

from .history import HistoryAction, HistoryPlan, plan_history
from .metrics import ServiceMetrics
from .models.tokenizer import ChatTemplateError
from .sessions import SessionExists, SessionManager, SessionRecord, Turn, TurnUnavailable
from .sessions.records import copy_record
from .spill import SpillScheduler
from .tools import ToolCalling, uses_tools
from .types import (
    CacheScope,
    ChatMessage,
    Delta,
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    ModelInfo,
    RetainedPrefix,
    SamplingParams,
    Started,
    Tier,
    TurnInput,
    TurnMode,
    WarmResult,
)
from .validation import Limits, check_input_size, check_prompt, check_request

if TYPE_CHECKING:
    from .engine import AsyncEngine

log = logging.getLogger(__name__)


class TurnObserver(Protocol):
    """Hears of a turn's start event and of its finish (before the commit): a call's trace
    (``service.tracing.GenerateTrace``)."""

    def started(self, event: Started, block_size: int, bytes_per_token: int) -> None: ...

    def finished(self, event: Finished) -> None: ...


class _NoObserver:
    def started(self, event: Started, block_size: int, bytes_per_token: int) -> None:
        pass

    def finished(self, event: Finished) -> None:
        pass


NO_OBSERVER: TurnObserver = _NoObserver()

# (the stored attachment, the turn's raw Finished) -> the attachment its commit writes
Attach = Callable[[str, Finished], str]


@dataclass(frozen=True)
class PreparedTurn:
    """A turn every check has passed (``Conversations.prepare``), ready to ``stream``."""

    owner: str
    request_id: str
    inp: TurnInput  # as the turn runs it (template roles; a resent history's new messages only)
    session: Turn | None  # the session's turn in flight, its lock held (None: no session)
    base: SessionRecord | None  # what the commit extends when not the stored record (forked, rewound, reset)
    history: HistoryPlan | None  # a resent history's plan
    prompt: list[int]  # the transcript the turn extends + its new input
    sampling: SamplingParams  # max_new_tokens fitted to the context
    scope: CacheScope
    tooled: bool  # the input uses tools (its events leave through ToolCalling.events)
    arrival: float  # perf_counter at prepare (time to first token)
    attach: Attach | None = None  # the session's new attachment, written by the commit (run_turn)

    def request(self) -> GenerationRequest:
        return GenerationRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt, sampling=self.sampling, scope=self.scope,
            session_id=self.inp.session_id or None, retain=self.inp.retain,
        )  # fmt: skip


class Conversations:
    """Turns of sessions (and one-off generations) over an engine and a session table.
    (Over 400 lines: the turn's two steps and the session operations share one engine,
    table and scope rule; the sessions' side is a candidate room of its own.)"""

    def __init__(
        self,
        engine: AsyncEngine,
        sessions: SessionManager,
        metrics: ServiceMetrics,
        *,
        max_new_tokens_limit: int,
        spill: SpillScheduler | None = None,
        limits: Limits = Limits(),
        shared_cache_salts: frozenset[str] | tuple[str, ...] = (),
        tool_call_parser: str = "auto",
    ) -> None:
        self.engine = engine
        self.sessions = sessions
        self.metrics = metrics
        self.max_new_tokens_limit = max_new_tokens_limit
        self.limits = limits
        self.shared_cache_salts = frozenset(shared_cache_salts)
        self.spill = spill
        self._max_bytes_per_token: int | None = None
        self.tool_call_parser = tool_call_parser
        self._tools: ToolCalling | None = None
        self._piece_bytes: list[bytes] | None = None  # token_pieces: sentencepiece's bytes per id, once

    @property
    def model_info(self) -> ModelInfo:
        """The served model's facts (``AsyncEngine.model_info``), for the fronts."""
        return self.engine.model_info

    @property
    def tools(self) -> ToolCalling:
        """Tool calling over the engine's tokenizer (``service/tools``), built on first use."""
        if self._tools is None or self._tools.tokenizer is not self.engine.tokenizer:
            self._tools = ToolCalling(self.engine.tokenizer, self.tool_call_parser)
        return self._tools

    # ------------------------------------------------------------------ the turn

    async def run_turn(
        self, owner: str, inp: TurnInput, request_id: str, observer: TurnObserver = NO_OBSERVER, *,
        resent_history: bool = False, fork_from: str = "", attach: Attach | None = None,
    ) -> AsyncIterator[Event]:  # fmt: skip
        """Serve one Generate call of ``owner``: ``prepare`` the turn, then ``stream`` it
        (see the module docstring). ``observer`` (the call's trace) hears of the start
        event and of the finish, before the commit. With tools, the events leave with the
        calls parsed out (``ToolCalling.events``), after the commit: the transcript keeps
        the tokens as the model wrote them.

        ``resent_history`` (a session turn of chat messages): the messages are the whole
        history, as OpenAI clients send it; under the turn lock it is matched against the
        session's record (``service.history.plan_history``) and the turn extends the
        session, rewinds it to the last turn the history follows or starts it over. The
        start event says where it diverged (``history_diverged_at``) and how many turns
        it rewound (``history_rewound_turns``).

        ``fork_from`` (a session turn that creates ``inp.session_id``): the new session
        starts with that session's whole transcript, as ``fork`` would make it, and this
        turn is its next one (the Responses API's ``previous_response_id``).

        ``attach`` (a session turn): the session's new ``attachment`` (a front's state: the
        Conversations API's items), from the stored one and the turn's raw Finished event
        (its text before tool calls are parsed out), written by the turn's commit.

        All change the session only through the turn's commit: a turn refused, failed or
        cancelled after them leaves every session exactly as it was."""
        prepared = await self.prepare(owner, inp, request_id, resent_history=resent_history, fork_from=fork_from,
                                      attach=attach)  # fmt: skip
        try:
            async with aclosing(self.stream(prepared, observer)) as events:
                async for event in self.tools.events(prepared.inp, events) if prepared.tooled else events:
                    yield event
        finally:
            await self.release(prepared)  # a turn closed before its stream began

    async def prepare(
        self, owner: str, inp: TurnInput, request_id: str, *, resent_history: bool = False, fork_from: str = "",
        attach: Attach | None = None,
    ) -> PreparedTurn:  # fmt: skip
        """Every check of the turn, and what it runs: the request's checks before the
        session's lock (``validation.check_request``; with tools, ``ToolCalling.prepare``
        first), the session's turn begun (the lock), the record it extends (a fork's
        source, a regenerate's or an edit's earlier transcript, a resent history's plan),
        the input tokenised and the prompt's checks after (``validation.check_prompt``).
        A refused turn ends the session's turn it began: the session stays as it was."""
        tooled = uses_tools(inp)
        if tooled:  # tools and the messages' calls checked; tool_choice required / named: its grammar
            inp = self.tools.prepare(inp, continues=bool(inp.session_id) and not resent_history)
        arrival = time.perf_counter()
        info = self.engine.model_info
        check_request(inp, self.limits, vocab_size=info.vocab_size, max_new_tokens_limit=self.max_new_tokens_limit,
                      roles=self.engine.tokenizer.known_roles, resent_history=resent_history,
                      fork_from=fork_from)  # fmt: skip
        inp = self._with_template_roles(inp)
        source: SessionRecord | None = None
        if fork_from:
            source, _busy = await self.sessions.get(owner, fork_from)  # its last committed version
        if inp.sampling.response_format is not None:  # compiled (or refused) before any other work
            await self.engine.check_format(inp.sampling.response_format)
        turn: Turn | None = None
        if inp.session_id and inp.mode is TurnMode.APPEND:
            turn = await self.sessions.begin_turn(owner, inp.session_id, require_existing=inp.require_existing_session)
        elif inp.session_id:
            turn = await self.sessions.begin_op(owner, inp.session_id)
        try:
            inp, transcript, base, history = await self._base(turn, inp, source, resent_history)
            new_tokens = await self._new_tokens(turn, inp, transcript)
            sampling = check_prompt(inp, len(transcript), new_tokens, self.limits, vocab_size=info.vocab_size,
                                    context_length=info.context_length)  # fmt: skip
        except BaseException:
            if turn is not None:  # refused: the transcript stays as before the turn
                await asyncio.shield(self.sessions.end_turn(turn))
            raise
        return PreparedTurn(owner, request_id, inp, turn, base, history, transcript + new_tokens, sampling,
                            self.cache_scope(owner, inp.cache_salt), tooled, arrival, attach)  # fmt: skip

    async def _base(
        self, turn: Turn | None, inp: TurnInput, source: SessionRecord | None, resent_history: bool
    ) -> tuple[TurnInput, list[int], SessionRecord | None, HistoryPlan | None]:
        """Under the turn's lock: the input as the turn runs it, the transcript its prompt
        extends, the record its commit extends when not the stored one (``base``: a fork's
        copy of ``source``, a rewound or reset copy), and a resent history's plan."""
        if turn is None:
            return inp, [], None, None
        self.sessions.check_expected_turns(turn.record, inp.expected_turns)
        transcript = turn.record.token_ids
        if inp.mode is not TurnMode.APPEND:  # the transcript as it was before the last turn
            transcript = transcript[: self.sessions.last_turn_start(turn.record, inp.mode.value)]
        base: SessionRecord | None = None
        if source is not None:
            if not turn.created:
                raise SessionExists(f"session {inp.session_id!r} already exists; a fork needs a new session id")
            base = copy_record(turn.record, token_ids=list(source.token_ids), turns=source.turns,
                               turn_log=list(source.turn_log), cache_salt=source.cache_salt,
                               forked_from=source.session_id)  # fmt: skip
            if base.untracked_turns:
                raise TurnUnavailable(f"session {source.session_id!r} was recorded before turn boundaries were kept")
            transcript = base.token_ids
        history: HistoryPlan | None = None
        if resent_history:
            assert inp.messages is not None
            tok = self.tools.turn_encoder(inp.tools) if uses_tools(inp) else self.engine.tokenizer  # tool messages
            history = await asyncio.to_thread(plan_history, tok, turn.record, inp.messages)  # as _input_tokens renders
            inp, rebased = self._apply_history(inp, turn.record, history)
            if rebased is not None:
                base, transcript = rebased, rebased.token_ids
        return inp, transcript, base, history

    async def _new_tokens(self, turn: Turn | None, inp: TurnInput, transcript: list[int]) -> list[int]:
        """The turn's new input as tokens: a regenerate's the last turn's own; text and chat
        refused before tokenising when they cannot fit, then tokenised off the event loop."""
        await self._check_input_size(inp, transcript)
        if inp.mode is TurnMode.REGENERATE:  # the last turn's own input tokens
            assert turn is not None
            rec = turn.record
            return rec.token_ids[len(transcript) : len(transcript) + rec.turn_log[-1].input_tokens]
        if inp.kind == "tokens":
            return self._input_tokens(inp, transcript)
        return await asyncio.to_thread(self._input_tokens, inp, transcript)  # a long text takes a while

    async def stream(self, p: PreparedTurn, observer: TurnObserver = NO_OBSERVER) -> AsyncIterator[Event]:
        """Run a prepared turn: the engine's events, counted and observed (``observer``
        hears of the start and the finish); at the last ``Finished`` a completed turn
        (stop, length) commits, is recorded (spill, metrics) and ends before that event
        leaves, so the client's next turn never finds the session busy. However it stops
        it ends the session's turn; one that failed or was cancelled leaves the session
        exactly as it was."""
        turn = p.session
        remaining = p.sampling.n  # the turn ends with the n-th Finished
        finished = False  # the last Finished came
        last_token_at: float | None = None
        try:
            async with aclosing(self.engine.generate(p.request())) as events:
                async for event in events:
                    if isinstance(event, Started):
                        self._started(p, event, observer)
                        yield event
                    elif isinstance(event, Delta):
                        if turn is not None and turn.deleted:  # deleted on another replica meanwhile
                            raise self.sessions.deleted_error(turn)
                        if not event.token_ids and not event.text:
                            continue
                        last_token_at = self._observe_delta(event, p.arrival, last_token_at)
                        yield event
                    elif isinstance(event, Finished):
                        self.metrics.finished.labels(event.finish_reason.value).inc()
                        remaining -= 1
                        if remaining:  # n > 1: another sequence ended; the others go on
                            yield event
                            continue
                        finished = True
                        observer.finished(event)
                        if turn is not None:
                            await self._record(p, turn, event)
                            turn = None  # ended
                        yield event
                        return
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # the client cancelled, went away or passed its deadline
                self.metrics.finished.labels(FinishReason.CANCELLED.value).inc()
            raise
        finally:
            if turn is not None:  # cancelled or failed: the transcript stays as before the turn
                await asyncio.shield(self.sessions.end_turn(turn))

    async def release(self, p: PreparedTurn) -> None:
        """End a prepared turn's session turn if nothing ended it yet (a turn closed before
        or while it streamed): the lock released, the transcript as before the turn."""
        if p.session is not None and not p.session.ended:
            await asyncio.shield(self.sessions.end_turn(p.session))

    def _started(self, p: PreparedTurn, event: Started, observer: TurnObserver) -> None:
        """Count and observe the start event, and complete it with the session's side."""
        self._observe_start(event)
        info = self.engine.model_info
        observer.started(event, info.block_size, info.bytes_per_token)
        history = p.history
        event.session_created = p.session is not None and (
            p.session.created or (history is not None and history.action is HistoryAction.RESET)
        )
        if history is not None:
            event.history_diverged_at = history.diverged_at
            event.history_rewound_turns = history.rewound_turns

    async def _record(self, p: PreparedTurn, turn: Turn, event: Finished) -> None:
        """The last Finished of a session turn: a completed one (stop, length) commits and
        is told to the spill scheduler and the metrics; the turn ends either way."""
        if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            mode = p.inp.mode
            rec = await self._commit(turn, p.base, p.prompt, event, p.inp.cache_salt, mode, p.attach)
            if p.history is not None and p.history.action is HistoryAction.REWIND:
                self.metrics.session_operations.labels("rewind").inc()
            if self.spill is not None:
                self.spill.touch(p.owner, p.inp.session_id, rec.token_ids, p.scope)
            if mode is not TurnMode.APPEND:
                self.metrics.session_operations.labels(mode.value).inc()
        await self.sessions.end_turn(turn)

    async def _commit(
        self, turn: Turn, base: SessionRecord | None, prompt: list[int], fin: Finished, salt: str, mode: TurnMode,
        attach: Attach | None = None,
    ) -> SessionRecord:  # fmt: skip
        """Commit the turn; with ``base`` (a rewound, reset or forked copy of the record)
        the turn extends that instead of the stored version, in the same one write
        (conditional on the version the turn started from)."""
        stored = turn.record
        attachment = attach(stored.attachment, fin) if attach is not None else None
        if base is not None:
            turn.record = base
        try:
            return await self.sessions.commit_turn(
                turn, prompt, fin.output_token_ids, cache_salt=salt, finish_reason=fin.finish_reason.value,
                replace_last=mode is not TurnMode.APPEND, attachment=attachment,
            )  # fmt: skip
        except BaseException:
            if not turn.committed:
                turn.record = stored  # nothing was written: the lock's renewal keeps the stored version
            raise

    def _apply_history(
        self, inp: TurnInput, rec: SessionRecord, plan: HistoryPlan
    ) -> tuple[TurnInput, SessionRecord | None]:
        """The turn's input and the record it extends (None: the stored one) under ``plan``."""
        assert inp.messages is not None
        messages = inp.messages[plan.first :]
        if plan.action is HistoryAction.REWIND:
            keep = plan.keep_turns
            base = copy_record(rec, token_ids=rec.token_ids[: rec.turn_end(keep)], turns=keep,
                               turn_log=rec.turn_log[: keep - rec.untracked_turns])  # fmt: skip
            return dataclasses.replace(inp, messages=messages), base
        if plan.action is HistoryAction.RESET:  # the old transcript's KV stays cached by content
            return inp, copy_record(rec, token_ids=[], turns=0, turn_log=[])
        return dataclasses.replace(inp, messages=messages), None

    def _with_template_roles(self, inp: TurnInput) -> TurnInput:
        """OpenAI's ``developer`` role is ``system`` for a template that has no such role."""
        if inp.messages is None or not any(m.role == "developer" for m in inp.messages):
            return inp
        if "developer" in self.engine.tokenizer.known_roles:
            return inp
        msgs = tuple(ChatMessage("system", m.content) if m.role == "developer" else m for m in inp.messages)
        return dataclasses.replace(inp, messages=msgs)

    # ------------------------------------------------------------------ session operations

    async def rewind(
        self, owner: str, session_id: str, turns: int, expected_turns: int | None = None
    ) -> tuple[SessionRecord, int]:
        """Drop the last ``turns`` turns; returns the new record and the tokens dropped.
        The dropped turns' KV stays cached (a re-ask restores it)."""
        before, after = await self.sessions.rewind(owner, session_id, turns, expected_turns=expected_turns)
        self.metrics.session_operations.labels("rewind").inc()
        if self.spill is not None and after.token_ids:
            self.spill.touch(owner, session_id, after.token_ids, self.cache_scope(owner, after.cache_salt))
        return after, len(before.token_ids) - len(after.token_ids)

    async def fork(self, owner: str, session_id: str, new_session_id: str, at_turn: int | None) -> SessionRecord:
        """A new session sharing ``session_id``'s transcript up to turn ``at_turn``; no KV
        is copied (same namespace, same tokens: the same block keys)."""
        rec = await self.sessions.fork(owner, session_id, new_session_id, at_turn)
        self.metrics.session_operations.labels("fork").inc()
        if self.spill is not None and rec.token_ids:
            self.spill.touch(owner, new_session_id, rec.token_ids, self.cache_scope(owner, rec.cache_salt))
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

    def _observe_start(self, ev: Started) -> None:
        self.metrics.prompt_tokens.inc(ev.prompt_tokens)
        for tier, n in ev.cached_by_tier.items():
            if n:
                self.metrics.cached_prompt_tokens.labels(tier.value).inc(n)

    def _observe_delta(self, ev: Delta, arrival: float, last_token_at: float | None) -> float | None:
        now = time.perf_counter()
        n = len(ev.token_ids)
        if last_token_at is None:
            if n:
                self.metrics.time_to_first_token.observe(now - arrival)
                for _ in range(n - 1):  # tokens that reached the client with the first one
                    self.metrics.inter_token_latency.observe(0.0)
        elif n:
            for _ in range(n):
                self.metrics.inter_token_latency.observe((now - last_token_at) / n)
        self.metrics.generated_tokens.inc(n)
        return now if n else last_token_at

    # ------------------------------------------------------------------ salts

    def cache_scope(self, owner: str, request_salt: str) -> CacheScope:
        """The block-hash namespace of a request: the tenant and the request's own salt.
        KV is never shared across tenants or across different request salts, except for
        a request salt the operator listed in ``shared_cache_salts``: that namespace
        leaves the tenant out and is the same for every tenant."""
        if self.is_shared_salt(request_salt):
            return CacheScope.shared(request_salt)
        return CacheScope(owner, request_salt)

    def is_shared_salt(self, request_salt: str) -> bool:
        return bool(request_salt) and request_salt in self.shared_cache_salts

    # ------------------------------------------------------------------ sessions' KV

    async def forget(self, rec: SessionRecord) -> dict[Tier, int]:
        """Stop a removed session's KV blocks from being found (device, host, Redis).
        Blocks in a shared namespace are left alone: they are not the session's own; so
        are the leading blocks another live session still shares (its source, its
        forks, theirs: ``SessionManager.shared_prefix``), so a deleted parent response
        leaves its follow-ups' history cached."""
        if self.spill is not None:
            self.spill.forget(rec.owner, rec.session_id)
        if self.is_shared_salt(rec.cache_salt) or not rec.token_ids:
            return {}
        try:
            keep = await self.sessions.shared_prefix(rec) // self.engine.model_info.block_size
            if keep >= len(rec.token_ids) // self.engine.model_info.block_size:
                return {}
            return await self.engine.forget(
                rec.token_ids, self.cache_scope(rec.owner, rec.cache_salt), keep_blocks=keep
            )
        except Exception:  # the transcript is gone already; dropping its cache is best effort
            log.exception("dropping the KV blocks of session %r failed", rec.session_id)
            return {}

    async def warm(self, owner: str, session_id: str) -> WarmResult:
        """Warm the session's blocks up for its next turn (``AsyncEngine.warm``): the
        caller's own session (another tenant's, an unknown or an expired one: raises
        SessionNotFound), a turn in flight or not; counted against ``owner``'s warm-up share."""
        rec, _busy = await self.sessions.get(owner, session_id)
        return await self.engine.warm(rec.token_ids, self.cache_scope(owner, rec.cache_salt), owner)

    async def retain(self, owner: str, session_id: str, ttl_s: float) -> RetainedPrefix:
        """Pin the session's transcript for ``ttl_s`` seconds (``AsyncEngine.retain``):
        the caller's own session (else SessionNotFound), counted against ``owner``'s
        bound (``RetentionRefused`` past it); what was kept."""
        rec, _busy = await self.sessions.get(owner, session_id)
        return await self.engine.retain(rec.token_ids, self.cache_scope(owner, rec.cache_salt), ttl_s)

    async def block_locations(self, owner: str, rec: SessionRecord) -> dict[Tier, int]:
        """How many of the session's full blocks each tier holds now."""
        return await self.engine.block_locations(rec.token_ids, self.cache_scope(owner, rec.cache_salt))

    # ------------------------------------------------------------------ checks (once, here)

    def token_pieces(self, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """Each token's text and bytes as it appears in decoded text (logprobs): a
        sentencepiece piece's own bytes (its leading space, a byte piece's one byte),
        else the token decoded alone."""
        tok = self.engine.tokenizer
        if self._piece_bytes is None:
            try:
                self._piece_bytes = tok.token_bytes()[0]
            except Exception:  # noqa: BLE001 - not sentencepiece: decode tokens alone
                self._piece_bytes = []
        out = []
        for i in ids:
            raw = self._piece_bytes[i] if i < len(self._piece_bytes) else tok.decode([i]).encode("utf-8", "replace")
            out.append((raw.decode("utf-8", "replace"), raw))
        return out

    def max_bytes_per_token(self) -> int:
        """An upper bound on the bytes of text one token covers: twice the longest
        decoded vocabulary entry plus one (a leading space a decoder drops, text that
        normalization shortens). Computed once."""
        if self._max_bytes_per_token is None:
            tok = self.engine.tokenizer
            n = int(getattr(tok, "vocab_size", 0) or self.engine.model_info.vocab_size)
            longest = 1
            for i in range(n):
                try:
                    longest = max(longest, len(tok.decode([i]).encode("utf-8", "surrogatepass")))
                except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode alone
                    continue
            self._max_bytes_per_token = 2 * (longest + 1)
        return self._max_bytes_per_token

    async def _check_input_size(self, inp: TurnInput, transcript: list[int]) -> None:
        """Refuse text or chat input that cannot fit the prompt limit, before tokenizing it."""
        if inp.text is not None:
            n_bytes = len(inp.text.encode("utf-8", "surrogatepass"))
        elif inp.messages is not None:
            n_bytes = sum(m.text_bytes() for m in inp.messages)
        else:
            return
        limit = self.limits.max_prompt_tokens or self.engine.model_info.context_length
        which = "max_prompt_tokens" if self.limits.max_prompt_tokens else "the context length"
        bpt = self._max_bytes_per_token or await asyncio.to_thread(self.max_bytes_per_token)
        check_input_size(inp.kind or "", n_bytes, len(transcript), bpt, limit, which, inp.session_id)

    def _input_tokens(self, inp: TurnInput, transcript: list[int]) -> list[int]:
        """The new input as token ids (appended to ``transcript``); an empty one refused."""
        tok = self.engine.tokenizer
        if inp.text is not None:
            if not inp.text:
                raise InvalidRequest("empty input: text is empty")
            return tok.encode_text_turn(transcript, inp.text)
        if inp.messages is not None:
            if not inp.messages:
                raise InvalidRequest("empty input: chat.messages is empty")
            if uses_tools(inp):  # tool calls and results, the tools: service/tools renders them
                msgs, tools = self.tools.template_messages(inp.messages, inp.tools, first=not transcript)
            else:
                msgs, tools = [{"role": m.role, "content": m.content} for m in inp.messages], None
            try:
                return tok.encode_chat_turn(transcript, msgs, tools=tools)
            except ChatTemplateError as e:
                raise InvalidRequest(str(e)) from None
        if inp.token_ids is None:
            raise InvalidRequest("empty input: set one of text, chat or tokens")
        ids = list(inp.token_ids)
        if not ids:
            raise InvalidRequest("empty input: tokens.ids is empty")
        return ids  # checked against the vocabulary with the prompt (check_prompt)
