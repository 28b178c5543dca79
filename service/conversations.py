"""One turn of a conversation, front to engine and back: the rules of a Generate call
that are not gRPC.

    prepared = await conversations.prepare(owner, turn_input, request_id)   # every check
    async for event in conversations.stream(prepared, observer):            # Started, Delta..., Finished
        ...

A turn is two calls, which the fronts make through ``service.turns.Turns.start``.
``prepare`` runs every check and builds what the turn runs, a frozen ``PreparedTurn``:
the request's checks before the session is touched (one call,
``validation.check_request``: sampling, cache salt, stop lists, input text and size
limits, the session options, the roles), then the session's turn
(``SessionManager.begin_turn``: the lock, the transcript) and the record it extends
(a fork's source, a regenerate's or an edit's earlier transcript, a resent history's
plan), and the prompt's checks around the input's tokenizing (one call,
``validation.check_prompt``, in a worker thread: text that cannot fit refused before
``Prompts.input_tokens`` tokenizes it, then vocabulary, prompt limit, context, which
fits ``max_new_tokens`` to the context left), and the request's ``CacheScope`` (tenant
+ request salt, or shared). ``stream`` runs it: the engine's events, counted and
observed (with tools, the calls parsed out as they leave: ``ToolEvents``), the commit
before the last event leaves (so the client's next turn never finds the session busy),
the spill scheduler told the session went idle. A turn refused, failed or cancelled
leaves the transcript as it was. ``run_turn`` is the two in one call.

A session turn appends (``TurnMode.APPEND``) or replaces the last completed turn:
``REGENERATE`` generates again from that turn's input (the request has no input),
``EDIT`` uses the request's input instead of it. Both take the turn lock like any
turn (a racing turn, on this replica or another, gets ``SessionBusy``), build the
prompt from the transcript as it was before that turn (every earlier block is found
in the cache, and for a regenerate the input's blocks too) and commit with
``replace_last``; one that does not complete leaves the old turn in place. The answer it
replaces joins the record's ``recall`` (sessions/records.py), as a rewind's dropped
answers do: every later turn of the session drafts from them (``GenerationRequest.recall``,
engine/draft_pool.py), on any replica.
``expected_turns`` makes any session turn conditional on the session's turn count.

The session operations outside a turn (Get, List, Rewind, Fork, Delete, Warm) are
``service.session_ops.SessionOps``'; the tokenizer's side of a turn (its input as
tokens, the bytes one token covers, logprobs' pieces) is ``service.prompts.Prompts``'.

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
import functools
import time
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Protocol

from .history import HistoryAction, HistoryPlan, plan_history
from .metrics import ServiceMetrics
from .prefix_guard import VolatileSystem
from .prompts import Prompts
from .sessions import SessionExists, SessionManager, SessionRecord, Turn, TurnUnavailable
from .sessions.records import copy_record, dropped_answers, with_recall
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
    ModelInfo,
    SamplingParams,
    Started,
    TurnInput,
    TurnMode,
)
from .validation import Limits, check_prompt, check_request

if TYPE_CHECKING:
    from .engine import AsyncEngine

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
    recall: tuple[tuple[int, ...], ...] = ()  # the session's dropped answers the turn drafts from

    def request(self) -> GenerationRequest:
        return GenerationRequest(
            request_id=self.request_id, prompt_token_ids=self.prompt, sampling=self.sampling, scope=self.scope,
            session_id=self.inp.session_id or None, retain=self.inp.retain, tenant=self.owner, recall=self.recall,
        )  # fmt: skip


def _recall(turn: Turn | None, base: SessionRecord | None, mode: TurnMode) -> tuple[tuple[int, ...], ...]:
    """The answers a session turn drafts from besides its prompt (``GenerationRequest.recall``):
    the record's dropped ones (``SessionRecord.recall``; a rewound or reset ``base``'s, which
    holds the answers it dropped) and, for a regenerate or an edit, the answer it replaces."""
    if turn is None:
        return ()
    rec = base if base is not None else turn.record
    recall = rec.recall if mode is TurnMode.APPEND else with_recall(rec.recall, dropped_answers(rec, 1))
    return tuple(tuple(t) for t in recall)


class Conversations:
    """Turns of sessions (and one-off generations) over an engine and a session table:
    ``prepare``, then ``stream`` (see the module docstring)."""

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
        strip_volatile_system: str = "",
    ) -> None:
        self.engine = engine
        self.volatile_system = VolatileSystem(strip_volatile_system)  # --strip-volatile-system (service/prefix_guard.py)
        self.sessions = sessions
        self.metrics = metrics
        self.max_new_tokens_limit = max_new_tokens_limit
        self.limits = limits
        self.shared_cache_salts = frozenset(shared_cache_salts)
        self.spill = spill
        self.prompts = Prompts(engine, tool_call_parser)  # the tokenizer's side: input tokens, logprobs' pieces

    @property
    def model_info(self) -> ModelInfo:
        """The served model's facts (``AsyncEngine.model_info``), for the fronts."""
        return self.engine.model_info

    @property
    def tools(self) -> ToolCalling:
        """Tool calling over the engine's tokenizer (``service/tools``, ``Prompts.tools``)."""
        return self.prompts.tools

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
                async for event in events:
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
        the prompt's checks around the input's tokenizing (``validation.check_prompt``).
        A refused turn ends the session's turn it began: the session stays as it was."""
        tooled = uses_tools(inp)
        if tooled:  # tools and the messages' calls checked; tool_choice required / named: its grammar
            inp = self.tools.prepare(inp, continues=bool(inp.session_id) and not resent_history)
        arrival = time.perf_counter()
        info = self.engine.model_info
        check_request(inp, self.limits, vocab_size=info.vocab_size, max_new_tokens_limit=self.max_new_tokens_limit,
                      roles=self.engine.tokenizer.known_roles, resent_history=resent_history,
                      fork_from=fork_from)  # fmt: skip
        inp = self.volatile_system.apply(self._with_template_roles(inp))
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
            new_tokens, sampling = await self._check_prompt(turn, inp, transcript)
        except BaseException:
            if turn is not None:  # refused: the transcript stays as before the turn
                await asyncio.shield(self.sessions.end_turn(turn))
            raise
        return PreparedTurn(owner, request_id, inp, turn, base, history, transcript + new_tokens, sampling,
                            self.cache_scope(owner, inp.cache_salt), tooled, arrival, attach,
                            _recall(turn, base, inp.mode))  # fmt: skip

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
            history = await asyncio.to_thread(plan_history, tok, turn.record, inp.messages)  # as Prompts.input_tokens renders
            inp, rebased = self._apply_history(inp, turn.record, history)
            if rebased is not None:
                base, transcript = rebased, rebased.token_ids
        return inp, transcript, base, history

    async def _check_prompt(
        self, turn: Turn | None, inp: TurnInput, transcript: list[int]
    ) -> tuple[list[int], SamplingParams]:
        """The turn's new input as tokens and its sampling, through the prompt's checks
        (``validation.check_prompt``): a regenerate's the last turn's own input tokens,
        token ids as sent, text and chat tokenized (``Prompts.input_tokens``) in a worker
        thread, refused before that when they cannot fit."""
        info = self.engine.model_info
        check = functools.partial(check_prompt, inp, len(transcript), limits=self.limits, vocab_size=info.vocab_size,
                                  context_length=info.context_length)  # fmt: skip
        if inp.mode is TurnMode.REGENERATE:  # the last turn's own input tokens
            assert turn is not None
            rec = turn.record
            start = len(transcript)
            return check(functools.partial(list, rec.token_ids[start : start + rec.turn_log[-1].input_tokens]))
        encode = functools.partial(self.prompts.input_tokens, inp, transcript)
        if inp.text is None and inp.messages is None:  # token ids (or none): nothing to tokenize
            return check(encode)
        bpt = self.prompts.bytes_per_token_known or await asyncio.to_thread(self.prompts.max_bytes_per_token)
        return await asyncio.to_thread(check, encode, bytes_per_token=bpt)  # a long text takes a while

    async def stream(self, p: PreparedTurn, observer: TurnObserver = NO_OBSERVER) -> AsyncIterator[Event]:
        """Run a prepared turn: the engine's events, counted and observed (``observer``
        hears of the start and the finish); at the last ``Finished`` a completed turn
        (stop, length) commits, is recorded (spill, metrics) and ends before that event
        leaves, so the client's next turn never finds the session busy. However it stops
        it ends the session's turn; one that failed or was cancelled leaves the session
        exactly as it was. With tools, the events leave with the calls parsed out
        (``ToolEvents``), the commit's transcript keeping the tokens as the model wrote them."""
        turn = p.session
        calls = self.tools.parsed(p.inp) if p.tooled else None  # with tools: parses each event as it leaves
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
                        for out in calls.feed(event) if calls is not None else (event,):
                            yield out
                    elif isinstance(event, Finished):
                        self.metrics.finished.labels(event.finish_reason.value).inc()
                        remaining -= 1
                        if not remaining:  # the last one (n > 1: the others go on before it)
                            finished = True
                            observer.finished(event)
                            if turn is not None:
                                await self._record(p, turn, event)
                                turn = None  # ended
                        for out in calls.feed(event) if calls is not None else (event,):
                            yield out
                        if finished:
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
        if plan.action is HistoryAction.REWIND:  # the dropped turns' answers are recalled
            keep = plan.keep_turns
            base = copy_record(rec, token_ids=rec.token_ids[: rec.turn_end(keep)], turns=keep,
                               turn_log=rec.turn_log[: keep - rec.untracked_turns],
                               recall=with_recall(rec.recall, dropped_answers(rec, rec.turns - keep)))  # fmt: skip
            return dataclasses.replace(inp, messages=messages), base
        if plan.action is HistoryAction.RESET:  # the old transcript's KV stays cached by content
            return inp, copy_record(rec, token_ids=[], turns=0, turn_log=[],
                                    recall=with_recall(rec.recall, dropped_answers(rec, rec.turns)))  # fmt: skip
        return dataclasses.replace(inp, messages=messages), None

    def _with_template_roles(self, inp: TurnInput) -> TurnInput:
        """OpenAI's ``developer`` role is ``system`` for a template that has no such role."""
        if inp.messages is None or not any(m.role == "developer" for m in inp.messages):
            return inp
        if "developer" in self.engine.tokenizer.known_roles:
            return inp
        msgs = tuple(ChatMessage("system", m.content) if m.role == "developer" else m for m in inp.messages)
        return dataclasses.replace(inp, messages=msgs)

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
        leaves the tenant out and is the same for every tenant (``CacheScope.of``)."""
        return CacheScope.of(owner, request_salt, self.shared_cache_salts)
