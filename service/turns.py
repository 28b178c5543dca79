"""The fronts' one turn prologue: how every protocol (gRPC's Generate, OpenAI's chat,
completions and Responses, any new one) runs a turn.

    call = turns.call("http:ChatCompletions", headers, request_id, session_id, http_route="/v1/chat/completions")
    try:
        turns.check_serving()
        ...  # the protocol's translation: tenant, body -> TurnInput
        turn = await turns.start(owner, inp, request_id, call)  # admitted, running, Started arrived
    except Exception as exc:
        ...  # the protocol's error; call.end(label, status, message)
    turn.start                            # the Started event
    async for event in turn.events: ...   # Delta / ToolCallDelta / Finished (domain events)
    await turn.close()             # the turn's events closed, its stream slot released
    call.end(label, status, message)

``Turns.start`` admits the stream (``Admission.admit``: the stream limits and the drain,
one count for every front), prepares the turn (``Conversations.prepare``: every check),
runs it (``Conversations.stream``, with the call's trace as its observer) and awaits
its first event: two calls into the conversation, nothing calling back. If any of that
fails, what it took is given back (the events closed, the prepared turn released, the
ticket released) before the error leaves.
``TurnCall`` is the call's accounting: its trace, started with the call, and its one
count in ``kvserve_requests_total``, both ended once, by ``end``. What stays in a front
is its protocol: parsing into domain terms, rendering events, mapping errors.

Imports nothing of the fronts, the session table or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

from .types import Event, Started, TurnInput

if TYPE_CHECKING:
    from .admission import Admission, Ticket
    from .conversations import Attach, Conversations, PreparedTurn
    from .metrics import ServiceMetrics
    from .tracing import Tracing


class TurnCall:
    """One generation call's accounting: its trace (the conversation marks the start and
    the end of generation on it) and its count, under ``method``, ended exactly once."""

    def __init__(self, metrics: ServiceMetrics, method: str, trace: Any) -> None:
        self.metrics = metrics
        self.method = method
        self.trace = trace
        self.ended = False

    def end(self, label: str, status: str | int, message: str = "") -> None:
        """Count the call under ``label`` (a gRPC code name, or the HTTP front's label) and
        close its trace with ``status`` (a gRPC code name or an HTTP status); once."""
        if self.ended:
            return
        self.ended = True
        self.metrics.requests.labels(self.method, label).inc()
        self.trace.end(status, message)


class RunningTurn:
    """An admitted turn whose ``Started`` event has arrived: ``start``, then the rest of
    its events (``async for event in turn.events``); ``close`` ends it (once)."""

    def __init__(self, start: Started, events: AsyncIterator[Event], ticket: Ticket) -> None:
        self.start = start
        self.events = events
        self._ticket = ticket
        self._closed = False

    async def close(self, then: Callable[[], Awaitable[None]] | None = None) -> None:
        """Close the turn's events (an unfinished turn is cancelled: the engine aborts it,
        the session stays as it was), await ``then`` (a protocol's own cleanup), release
        the stream's slot. Once; later calls do nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.events.aclose()  # type: ignore[attr-defined]
            if then is not None:
                await then()
        finally:
            self._ticket.release()


class Turns:
    """The prologue every front runs a turn through (see the module docstring)."""

    def __init__(self, conversations: Conversations, admission: Admission, metrics: ServiceMetrics,
                 tracing: Tracing) -> None:  # fmt: skip
        self.conversations = conversations
        self.admission = admission
        self.metrics = metrics
        self.tracing = tracing

    def call(self, method: str, metadata: Sequence[tuple[str, Any]] | None, request_id: str, session_id: str,
             http_route: str | None = None) -> TurnCall:  # fmt: skip
        """A call's accounting, its trace started now (its parent from ``metadata``: the
        gRPC call's invocation metadata or the HTTP request's headers)."""
        return TurnCall(self.metrics, method, self.tracing.generate(metadata, request_id, session_id, http_route))

    def check_serving(self) -> None:
        """Raises ``Draining`` once the drain has started (every call asks first)."""
        self.admission.check_serving()

    async def start(
        self, owner: str, inp: TurnInput, request_id: str, call: TurnCall, *, resent_history: bool = False,
        fork_from: str = "", attach: Attach | None = None,
    ) -> RunningTurn:  # fmt: skip
        """Admit ``owner``'s stream, prepare the turn (``Conversations.prepare``: every check;
        ``resent_history``, ``fork_from`` and ``attach`` as there), run it
        (``Conversations.stream``, the call's trace its observer) and await its ``Started``
        event. Raises what refused or failed it, having closed what it opened."""
        ticket = self.admission.admit(owner, request_id)
        prepared: PreparedTurn | None = None
        events: Any = None
        try:
            prepared = await self.conversations.prepare(owner, inp, request_id, resent_history=resent_history,
                                                        fork_from=fork_from, attach=attach)  # fmt: skip
            events = self.conversations.stream(prepared, call.trace)
            start = await anext(events)
            if not isinstance(start, Started):
                raise RuntimeError("the conversation did not start with a Started event")
        except BaseException:
            try:
                if events is not None:
                    await events.aclose()  # its stream began: closing it ends the session's turn
                if prepared is not None:
                    await self.conversations.release(prepared)  # one that never began: ended here
            finally:
                ticket.release()
            raise
        return RunningTurn(start, events, ticket)

    async def prompt_tokens(self, owner: str, inp: TurnInput, request_id: str) -> int:
        """The prompt's length as ``owner``'s turn would run it (``prompt``). Anthropic's
        count_tokens."""
        return len(await self.prompt(owner, inp, request_id))

    async def prompt(self, owner: str, inp: TurnInput, request_id: str) -> list[int]:
        """The prompt's token ids as ``owner``'s turn would run them: every check the turn
        runs (``Conversations.prepare``), then the prepared turn released unrun (the
        session as it was). vLLM's render routes."""
        prepared = await self.conversations.prepare(owner, inp, request_id)
        await self.conversations.release(prepared)
        return list(prepared.prompt)
