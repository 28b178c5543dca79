"""What every HTTP protocol's routes share (``Plumbing``): the caller's tenant, the body
read within the front's limits, the model check, errors in OpenAI's words, the request
counter, and the turn prologue for HTTP (``Plumbing.start_turn`` over
``service.turns.Turns``: admit, run, await the start; on error release, count, trace).

A protocol module (``completions.py``, ``responses.py``) holds its routes: it parses a
body into a ``TurnRequest`` (its own translation), hands it to ``start_turn``, and renders
the ``HttpTurn``'s events as its JSON body or SSE stream; ``HttpTurn.end`` closes the turn
and counts and traces the call once. ``whole_or_gone`` answers a non-streamed call, or
499 when its client goes away first.

A new protocol is one module: its routes class over ``Plumbing``, a ``parse(owner,
body) -> TurnRequest`` of its own (a chat turn: ``TurnInput(messages=...)``),
``start_turn`` to run the turn and get its events (an ``HttpTurn``, or the ``HttpError``
that refused it, to render in its own error shape), ``HttpTurn.end`` once it is
answered; and one ``Route`` line per endpoint in ``app.py``.

Imports no protocol module but ``openai`` (the errors' vocabulary), so the protocols
import this and never each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .. import wire
from . import openai as oa
from .limits import BodyReader, HttpLimits, status_label
from ..tracing import Tracing
from ..turns import RunningTurn, TurnCall, Turns
from ..types import Started, TurnInput

if TYPE_CHECKING:
    from ..admission import Admission
    from ..auth import Authenticator
    from ..conversations import Attach, Conversations
    from ..metrics import ServiceMetrics
    from ..session_ops import SessionOps


@dataclass(frozen=True)
class TurnRequest:
    """A protocol's parsed request, as the turn runs it: the domain input, the request's
    field names (errors in its words), and the turn's options (``Conversations.prepare``)."""

    inp: TurnInput
    names: Mapping[str, str] | None = None
    resent_history: bool = False
    fork_from: str = ""
    attach: Attach | None = None  # the session's new attachment, written by the turn's commit (conversations)


class HttpTurn:
    """One admitted HTTP generation: its ``Started`` event (``start``), the rest of its
    events (``async for event in turn.events``), and ``end``, which closes the turn and
    counts and traces the call."""

    def __init__(self, plumbing: Plumbing, call: TurnCall, turn: RunningTurn, request_id: str, owner: str,
                 req: TurnRequest) -> None:  # fmt: skip
        self.plumbing, self.call, self.turn = plumbing, call, turn
        self.request_id, self.owner, self.req = request_id, owner, req
        self.start: Started = turn.start
        self.events = turn.events

    def error_of(self, exc: BaseException) -> oa.HttpError:
        """An error of the running turn in the request's words."""
        return self.plumbing.error_of(exc, self.request_id, self.req.names)

    def finish_error(self, fin: Any) -> oa.HttpError | None:
        """The error a ``Finished`` event stands for (cancelled by the drain, failed), or None."""
        status = wire.finish_status(fin, self.request_id, self.plumbing.admission.draining)
        return self.error_of(status) if status is not None else None

    async def end(self, outcome: int | oa.HttpError, message: str = "",
                  then: Callable[[], Awaitable[None]] | None = None) -> None:  # fmt: skip
        """Close the turn (``RunningTurn.close``, with ``then``), then count the call under
        ``outcome`` (an HTTP status or the error sent) and end its trace with ``message``."""
        try:
            await self.turn.close(then)
        finally:
            status = outcome.status if isinstance(outcome, oa.HttpError) else outcome
            self.call.end(self.plumbing.label(outcome), status, message)


class Plumbing:
    """The HTTP front's shared parts (see the module docstring)."""

    def __init__(
        self,
        conversations: Conversations,
        admission: Admission,
        authenticator: Authenticator,
        metrics: ServiceMetrics,
        *,
        session_ops: SessionOps,
        model_id: str,
        max_body_bytes: int,
        default_max_new_tokens: int,
        tracing: Tracing | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.conversations = conversations
        self.session_ops = session_ops  # a session's operations outside a turn (the Responses and Conversations APIs)
        self.admission = admission
        self.authenticator = authenticator
        self.metrics = metrics
        self.model_id = model_id
        self.default_max_new_tokens = default_max_new_tokens
        self.tracing = tracing or Tracing.off()
        self.turns = Turns(conversations, admission, metrics, self.tracing)
        self.bodies = BodyReader(dataclasses.replace(limits or HttpLimits(), max_body_bytes=max_body_bytes))

    def tenant(self, request: Request) -> str:
        """The caller's tenant, from ``Authorization: Bearer`` or, without that header,
        ``x-api-key`` (Anthropic's clients send it) (raises ``Unauthenticated``)."""
        auth = request.headers.get("authorization", "")
        if not auth and request.headers.get("x-api-key"):
            auth = f"Bearer {request.headers['x-api-key']}"
        return self.authenticator.authenticate([("authorization", auth)])

    async def body(self, request: Request) -> Any:
        """The request's JSON, read and parsed within the front's limits (service.http.limits)."""
        return await self.bodies.parse(await self.bodies.read(request))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise oa.HttpError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                               "not_found_error", param="model", code="model_not_found")  # fmt: skip

    def error_of(self, exc: BaseException, request_id: str, names: Any = None) -> oa.HttpError:
        """``oa.error_of`` with the served model's context length."""
        return oa.error_of(exc, request_id, names, self.conversations.model_info.context_length)

    @staticmethod
    def label(outcome: int | oa.HttpError) -> str:
        """An answer's label in ``kvserve_requests_total``: an HTTP status, or the error
        sent, counted under the gRPC code it came from (the gRPC front's label for the same
        failure) where it came from one, else under its status's."""
        if isinstance(outcome, oa.HttpError):
            code = outcome.grpc_code
            return code.name if code is not None else status_label(outcome.status, oa.HTTP_OF_CODE)
        return status_label(outcome, oa.HTTP_OF_CODE)

    def count(self, method: str, outcome: int | oa.HttpError) -> None:
        """One answer of ``method`` (a route that runs no turn) in ``kvserve_requests_total``."""
        self.metrics.requests.labels(f"http:{method}", self.label(outcome)).inc()

    @staticmethod
    def error_response(err: oa.HttpError, headers: dict[str, str] | None = None) -> Response:
        """OpenAI's error object; 429 and 503 say when to retry (``Retry-After``)."""
        if err.status in oa.RETRY_AFTER_S:
            headers = {**(headers or {}), "Retry-After": str(oa.RETRY_AFTER_S[err.status])}
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def start_turn(
        self, request: Request, method: str, route: str, session_id: str,
        parse: Callable[[str, Any], Awaitable[TurnRequest]],
        on_error: Callable[[BaseException, oa.HttpError], oa.HttpError] | None = None,
        names: Mapping[str, str] | None = None,
    ) -> HttpTurn | oa.HttpError:  # fmt: skip
        """Run one generation of ``route``: the drain's check, the tenant, the body,
        ``parse(tenant, body)`` (the protocol's translation), then ``Turns.start``. Returns
        the running ``HttpTurn``, or the error that refused it (in OpenAI's words with
        ``names``, the parsed request's once there is one, or ``on_error``'s), already
        counted and traced, for the protocol to render."""
        request_id = wire.new_request_id()
        call = self.turns.call(f"http:{method}", request.headers.items(), request_id, session_id, http_route=route)
        req: TurnRequest | None = None
        try:
            self.turns.check_serving()
            owner = self.tenant(request)
            req = await parse(owner, await self.body(request))
            turn = await self.turns.start(owner, req.inp, request_id, call, resent_history=req.resent_history,
                                          fork_from=req.fork_from, attach=req.attach)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
            err = self.error_of(exc, request_id, req.names if req is not None else names)
            if on_error is not None:
                err = on_error(exc, err)
            call.end(self.label(err), err.status, err.message)
            return err
        return HttpTurn(self, call, turn, request_id, owner, req)


async def whole_or_gone(request: Request, whole_body: Any, headers: dict[str, str]) -> Response:
    """A non-streamed answer: ``whole_body`` (a coroutine of ``(body, status)``) as JSON,
    or 499 when the client goes away first (cancelling it aborts the turn in the engine)."""
    whole = asyncio.ensure_future(whole_body)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not whole.done():
        whole.cancel()
        try:
            await whole
        except asyncio.CancelledError:
            pass
        return Response(status_code=499)
    body, status = whole.result()
    return JSONResponse(body, status_code=status, headers=headers)


async def _disconnected(request: Request) -> None:
    """Returns when the client of a whole (non-streamed) response disconnects: its body
    is read already, so the next ASGI message is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
