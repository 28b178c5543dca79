"""The OpenAI-compatible HTTP front: translates, nothing more (like the gRPC servicer).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``POST /v1/sessions/{id}/warm`` (WarmSession),
``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}`` (``service.http.responses``),
``GET /v1/models``, ``GET /health``. A request is parsed by ``service.http.openai`` into
a ``TurnInput`` and run by the same ``Conversations`` as gRPC's Generate; stream
admission, the drain and per-tenant limits are the same ``Admission`` object as gRPC's
(``service.admission``: one count for both fronts); the tenant comes from ``Authorization: Bearer`` through the same
``Authenticator``; errors map through ``service.wire``'s status table to HTTP.

Sessions (``X-Session-Id`` on chat): OpenAI clients resend the whole history. The turn
runs with ``resent_history``: ``Conversations.run_turn`` matches it against the
session's record under the turn lock, after every check of the request
(``service.history``: it extends the session, rewinds it to the last turn the history
follows, or starts it over), and a refused, failed or cancelled turn leaves the session
as it was. The response says where it diverged (``kvserve.history_diverged_at`` and the
``X-Kvserve-History-Diverged-At`` header) and how many turns were rewound
(``kvserve.history_rewound_turns``).
Without a session id the whole history is the prompt and prefix caching by content
applies.

Runs in the gRPC server's event loop (uvicorn's ``Server`` on a socket bound before the
model loads), so there is one engine and one model copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import aclosing, contextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import wire
from . import openai as oa
from .limits import BodyReader, HttpLimits, front_protocol, status_label
from .responses import ResponsesRoutes
from ..tracing import Tracing
from ..types import Delta, Finished, Started, ToolCallDelta, TurnInput

if TYPE_CHECKING:
    from ..admission import Admission, Ticket
    from ..auth import Authenticator
    from ..conversations import Conversations
    from ..metrics import ServiceMetrics

log = logging.getLogger(__name__)

DIVERGED_HEADER = "X-Kvserve-History-Diverged-At"


class HttpFront:
    """The Starlette app over the gRPC front's conversations, admission and drain."""

    def __init__(
        self,
        conversations: Conversations,
        admission: Admission,
        authenticator: Authenticator,
        metrics: ServiceMetrics,
        *,
        model_id: str,
        max_body_bytes: int,
        default_max_new_tokens: int,
        tracing: Tracing | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.conversations = conversations
        self.admission = admission
        self.metrics = metrics
        self.default_max_new_tokens = default_max_new_tokens
        self.tracing = tracing or Tracing.off()
        self.authenticator = authenticator
        self.model_id = model_id
        self.max_body_bytes = max_body_bytes
        self.bodies = BodyReader(dataclasses.replace(limits or HttpLimits(), max_body_bytes=max_body_bytes))
        self.created = int(time.time())
        self.responses = ResponsesRoutes(self)  # /v1/responses (service.http.responses)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/responses", self.responses.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.responses.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.responses.delete, methods=["DELETE"]),
                Route("/v1/sessions/{session_id}/warm", self.warm_session, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # ------------------------------------------------------------------ plumbing

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return self._error(oa.HttpError(404, f"no route {request.url.path}", "not_found_error"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return self._error(oa.HttpError(405, f"{request.method} is not allowed on {request.url.path}"))

    @staticmethod
    def _error(err: oa.HttpError, headers: dict[str, str] | None = None) -> Response:
        """OpenAI's error object; 429 and 503 say when to retry (``Retry-After``)."""
        if err.status in oa.RETRY_AFTER_S:
            headers = {**(headers or {}), "Retry-After": str(oa.RETRY_AFTER_S[err.status])}
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def error_of(self, exc: BaseException, request_id: str, names: Any = None) -> oa.HttpError:
        """``oa.error_of`` with the served model's context length."""
        return oa.error_of(exc, request_id, names, self.conversations.engine.model_info.context_length)

    def _tenant(self, request: Request) -> str:
        return self.authenticator.authenticate([("authorization", request.headers.get("authorization", ""))])

    def _count(self, method: str, outcome: int | oa.HttpError) -> None:
        """One answer in ``kvserve_requests_total``: an HTTP status, or the error sent, counted
        under the gRPC code it came from (the gRPC front's label for the same failure) where
        it came from one, else under its status's."""
        if isinstance(outcome, oa.HttpError):
            code = outcome.grpc_code
            label = code.name if code is not None else status_label(outcome.status, oa.HTTP_OF_CODE)
        else:
            label = status_label(outcome, oa.HTTP_OF_CODE)
        self.metrics.requests.labels(f"http:{method}", label).inc()

    async def _body(self, request: Request) -> Any:
        """The request's JSON, read and parsed within the front's limits (service.http.limits)."""
        return await self.bodies.parse(await self.bodies.read(request))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_id:
            raise oa.HttpError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                               "not_found_error", param="model", code="model_not_found")  # fmt: skip

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        """As gRPC health: SERVING until the drain starts, then 503 NOT_SERVING; no key needed."""
        if self.admission.draining:
            return JSONResponse({"status": "NOT_SERVING"}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def models(self, request: Request) -> Response:
        try:
            self.admission.check_serving()
            self._tenant(request)
        except Exception as exc:  # noqa: BLE001
            err = oa.error_of(exc, wire.new_request_id())
            self._count("models", err)
            return self._error(err)
        self._count("models", 200)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self.admission.check_serving()
            self._tenant(request)
            self._check_model(request.path_params["model_id"])
        except Exception as exc:  # noqa: BLE001
            err = oa.error_of(exc, wire.new_request_id())
            self._count("models", err)
            return self._error(err)
        self._count("models", 200)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        info = self.conversations.engine.model_info
        return {
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "kvserve",
            "max_model_len": info.context_length,
            "kvserve": {"architecture": info.architecture, "model_fingerprint": info.model_fingerprint,
                        "block_size": info.block_size, "tiers": [t.value for t in info.tiers]},
        }  # fmt: skip

    async def warm_session(self, request: Request) -> Response:
        """WarmSession over HTTP: the session named in the path (the one a chat request
        names in X-Session-Id), the caller's own; no body needed."""
        session_id = request.path_params["session_id"]
        try:
            self.admission.check_serving()
            r = await self.conversations.warm(self._tenant(request), session_id)
        except Exception as exc:  # noqa: BLE001
            err = self.error_of(exc, wire.new_request_id())
            self._count("WarmSession", err)
            return self._error(err)
        self._count("WarmSession", 200)
        return JSONResponse({
            "object": "session.warm", "session_id": session_id, "blocks": r.blocks, "on_device": r.on_device,
            "restored": r.restored, "restored_by_tier": {t.value: n for t, n in sorted(r.restored_by_tier.items())},
            "missing": r.missing, "over_cap": r.over_cap, "ttl_s": r.ttl_s,
        })  # fmt: skip

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        method = "ChatCompletions" if chat else "Completions"
        request_id = wire.new_request_id()
        session_id = request.headers.get("x-session-id", "")
        ticket: Ticket | None = None
        events: Any = None
        names: Any = None
        route = "/v1/chat/completions" if chat else "/v1/completions"
        trace = self.tracing.generate(request.headers.items(), request_id, session_id, http_route=route)
        try:
            self.admission.check_serving()
            tenant = self._tenant(request)
            body = await self._body(request)
            default = self.default_max_new_tokens
            parsed = oa.chat_request(body, default) if chat else oa.completion_request(body, default)
            names = parsed.names
            self._check_model(parsed.model)
            if session_id and not chat:
                raise oa.HttpError(400, "X-Session-Id works on /v1/chat/completions only (a completion has no history)",
                                   param="X-Session-Id")  # fmt: skip
            if session_id and parsed.inp.sampling.n > 1:
                raise oa.HttpError(400, f"n = {parsed.inp.sampling.n} cannot be used with X-Session-Id: a session keeps "
                                   "one transcript (ask for n > 1 without it)", param="n")  # fmt: skip
            ticket = self.admission.admit(tenant, request_id)
            inp = _with(parsed.inp, session_id=session_id)
            events = aclosing(self.conversations.run_turn(tenant, inp, request_id, trace,
                                                          resent_history=bool(session_id)))  # fmt: skip
            gen = await events.__aenter__()
            start = await anext(gen)
            if not isinstance(start, Started):
                raise RuntimeError("the conversation did not start with a Started event")
            diverged, rewound = start.history_diverged_at, start.history_rewound_turns
        except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
            if events is not None:
                await events.__aexit__(None, None, None)
            if ticket is not None:
                ticket.release()
            err = self.error_of(exc, request_id, names)
            self._count(method, err)
            trace.end(err.status, err.message)
            return self._error(err)
        headers = {"X-Request-Id": request_id}
        if session_id:
            headers["X-Session-Id"] = session_id
        if diverged is not None:
            headers[DIVERGED_HEADER] = str(diverged)
        ext = oa.extension(request_id, session_id, start, diverged, rewound)
        ctx = _Ctx(self, method, ticket, request_id, chat, parsed.model or self.model_id, start, ext, events, gen, trace,
                   inp.sampling.n, names, inp.sampling.logprobs is not None)  # fmt: skip
        if parsed.stream:
            headers["Cache-Control"] = "no-cache"
            return StreamingResponse(ctx.sse(parsed.include_usage), media_type="text/event-stream", headers=headers)
        return await whole_or_gone(request, ctx.whole(), headers)


def _with(inp: TurnInput, **changes: Any) -> TurnInput:
    return dataclasses.replace(inp, **changes)


class _Ctx:
    """One admitted generation: turns the rest of the events into a JSON body or SSE."""

    def __init__(self, front: HttpFront, method: str, ticket: Ticket, request_id: str, chat: bool, model: str,
                 start: Started, ext: dict[str, Any], events: Any, gen: AsyncIterator[Any], trace: Any,
                 n: int = 1, names: Any = None, logprobs: bool = False) -> None:  # fmt: skip
        self.front, self.method, self.ticket, self.request_id = front, method, ticket, request_id
        self.trace = trace  # service.tracing: ended with the call's HTTP status
        self.chat, self.model, self.start, self.ext = chat, model, start, ext
        self.events, self.gen = events, gen
        self.n = n  # choices: the request's SamplingParams.n
        self.names = names  # the request's field names (errors in its words)
        self.logprobs = logprobs  # the request asked for them
        self.pieces = front.conversations.token_pieces if logprobs else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    async def _close(self) -> None:
        try:
            await self.events.__aexit__(None, None, None)
        finally:
            self.ticket.release()

    def _finish_error(self, fin: Finished) -> oa.HttpError | None:
        status = wire.finish_status(fin, self.request_id, self.front.admission.draining)
        return self.front.error_of(status, self.request_id, self.names) if status is not None else None

    async def whole(self) -> tuple[dict[str, Any], int]:
        status, message = 499, "the client went away"  # unless the call gets further
        ends: dict[int, Finished] = {}
        lps: dict[int, list[Any]] = {}  # choice -> its tokens' TokenLogprob
        try:
            async for ev in self.gen:
                if isinstance(ev, Delta) and self.logprobs:
                    lps.setdefault(ev.index, []).extend(ev.logprobs)
                if isinstance(ev, Finished):
                    err = self._finish_error(ev)
                    if err is not None:
                        status, message = err.status, err.message
                        self.front._count(self.method, err)
                        return err.body(), err.status
                    ends[ev.index] = ev
                    if len(ends) == self.n:
                        status, message = 200, ""
                        self.front._count(self.method, 200)
                        return self._body([ends[i] for i in sorted(ends)], lps), 200
            raise RuntimeError("the conversation ended without a Finished event")
        except asyncio.CancelledError:  # the client went away (_generate cancels the call)
            self.front._count(self.method, 499)
            raise
        except Exception as exc:  # noqa: BLE001
            err = self.front.error_of(exc, self.request_id, self.names)
            status, message = err.status, err.message
            self.front._count(self.method, err)
            return err.body(), err.status
        finally:
            await self._close()
            self.trace.end(status, message)

    def _logprobs(self, items: list[Any] | None) -> dict[str, Any] | None:
        """A choice's (or a chunk's) logprobs in the route's shape, None when not asked for."""
        if self.pieces is None:
            return None
        render = oa.chat_logprobs if self.chat else oa.completion_logprobs
        return render(items or [], self.pieces)

    def _body(self, ends: list[Finished], lps: dict[int, list[Any]] | None = None) -> dict[str, Any]:
        """The whole response: one choice per sequence (``Finished.text`` is its text)."""
        choices: list[dict[str, Any]] = []
        lps = lps or {}
        for fin in ends:
            logprobs = self._logprobs(lps.get(fin.index))
            if self.chat:
                message = {**oa.chat_message(fin), "refusal": None}
                choices.append({"index": fin.index, "message": message, "finish_reason": oa.finish_reason(fin),
                                "logprobs": logprobs})  # fmt: skip
            else:
                choices.append({"index": fin.index, "text": fin.text, "finish_reason": oa.finish_reason(fin),
                                "logprobs": logprobs})  # fmt: skip
        used = oa.usage(self.start, ends[0], sum(f.completion_tokens for f in ends))
        return {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": used, "timings": oa.timings(ends), "kvserve": self.ext,
        }  # fmt: skip

    def _chunk(self, delta: dict[str, Any] | str | None, finish: str | None, index: int = 0,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
        if self.chat:
            choices = [{"index": index, "delta": delta or {}, "finish_reason": finish, "logprobs": logprobs}]
            kind = "chat.completion.chunk"
        else:
            choices = [{"index": index, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}]
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def sse(self, include_usage: bool) -> AsyncIterator[bytes]:
        def data(obj: Any) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        status, failed = 200, None
        completion_tokens = 0
        left = self.n
        try:
            if self.chat:
                for i in range(self.n):
                    yield data(self._chunk({"role": "assistant", "content": ""}, None, i))
            async for ev in self.gen:
                if isinstance(ev, Delta):
                    if ev.text or (self.logprobs and ev.logprobs):
                        lp = self._logprobs(ev.logprobs)
                        yield data(self._chunk({"content": ev.text} if self.chat else ev.text, None, ev.index, lp))
                elif isinstance(ev, ToolCallDelta):  # a piece of a tool call (service/tools)
                    yield data(self._chunk(oa.tool_call_delta(ev), None, ev.index))
                elif isinstance(ev, Finished):
                    err = self._finish_error(ev)
                    if err is not None:
                        status, failed = err.status, err
                        yield data(err.body())
                        break
                    completion_tokens += ev.completion_tokens
                    left -= 1
                    last = self._chunk(None, oa.finish_reason(ev), ev.index)
                    last["timings"] = oa.timings([ev])  # llama.cpp's, in the chunk that ends the choice
                    last["kvserve"] = self.ext
                    if include_usage:
                        last["usage"] = None
                    yield data(last)
                    if left:  # n > 1: the other choices go on
                        continue
                    if include_usage:
                        tail = self._chunk(None, None)
                        tail["choices"] = []
                        tail["usage"] = oa.usage(self.start, ev, completion_tokens)
                        tail["kvserve"] = self.ext
                        yield data(tail)
                    break
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = 499  # the client went away
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            err = self.front.error_of(exc, self.request_id, self.names)
            status, failed = err.status, err
            yield data(err.body())
        finally:
            await self._close()
            self.front._count(self.method, failed or status)
            self.trace.end(status)


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


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def make_uvicorn_server(app: Any, *, ssl: dict[str, Any], log_level: str, limits: HttpLimits | None = None,
                        metrics: ServiceMetrics | None = None) -> Any:  # fmt: skip
    """A uvicorn Server for ``app`` that leaves signals to kvserve (it runs inside
    kvserve's event loop; ``run`` handles SIGTERM and drains both fronts), with the
    front's connection limit and read deadlines (``limits.front_protocol``)."""
    import uvicorn

    limits = limits or HttpLimits()

    class _Server(uvicorn.Server):
        def capture_signals(self) -> Any:  # kvserve owns the signals
            return _nothing()

    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=2,
        http=front_protocol(limits, metrics), timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
        **ssl,
    )  # fmt: skip
    return _Server(config)


__all__ = ["HttpFront", "make_uvicorn_server", "DIVERGED_HEADER"]
