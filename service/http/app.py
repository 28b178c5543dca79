"""The OpenAI-compatible HTTP front: translates, nothing more (like the gRPC servicer).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``GET /v1/models``, ``GET /health``. A request is parsed by ``service.http.openai`` into
a ``TurnInput`` and run by the same ``Conversations`` as gRPC's Generate; stream
admission, the drain and per-tenant limits are the same ``Admission`` object as gRPC's
(``service.admission``: one count for both fronts); the tenant comes from ``Authorization: Bearer`` through the same
``Authenticator``; errors map through ``service.wire``'s status table to HTTP.

Sessions (``X-Session-Id`` on chat): OpenAI clients resend the whole history. The
front walks the session's transcript against it, turn by turn by the turn boundaries of
the record (``agreed_turns``): a turn is followed when its messages encode to exactly
its input tokens and the assistant message after them is what the model generated.
When the history follows every turn and only non-assistant messages come after, it
extends the session: those messages are the turn, the transcript's tokens are reused
exactly. Otherwise it diverges (an edited message, a changed reply, or the regenerate
pattern: the history resent without the last reply): the session is rewound to the last
turn the history follows (``Conversations.rewind``: under the turn lock, conditional on
the turn count the walk saw) and the rest of the history runs as the next turn,
conditional on the rewound count (``expected_turns``): the kept turns' tokens are the
new prompt's prefix, so their KV blocks are restored, not prefilled. The response says
where it diverged (``kvserve.history_diverged_at`` and the
``X-Kvserve-History-Diverged-At`` header) and how many turns were rewound
(``kvserve.history_rewound_turns``). A record without turn boundaries (written before
they were kept) is walked by ``match_history`` (reply ends found by where the next
turn's tokens start) and cannot be rewound: it extends the session only when it covers
the whole transcript; any other history (an edit, the regenerate pattern, a truncated
history) diverges: the session is reset to the new history (the stale record deleted,
its KV left cached by content) and the whole history becomes its first turn; so is a
history that ends with a reply the session has.
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

from kvserve.service import wire
from kvserve.service.http import openai as oa
from kvserve.service.sessions import SessionNotFound, SessionRecord
from kvserve.service.tools import uses_tools
from kvserve.service.tracing import Tracing
from kvserve.service.types import ChatMessage, Delta, Finished, Started, ToolCallDelta, TurnInput
from kvserve.service.validation import check_salt, check_turn_options

if TYPE_CHECKING:
    from kvserve.service.admission import Admission, Ticket
    from kvserve.service.auth import Authenticator
    from kvserve.service.conversations import Conversations
    from kvserve.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

DIVERGED_HEADER = "X-Kvserve-History-Diverged-At"


def match_history(tok: Any, transcript: list[int], messages: tuple[ChatMessage, ...]) -> tuple[int, int | None]:
    """How far ``messages`` follow a session ``transcript``: ``(first_new, diverged_at)``.

    The transcript of a session served through this front is, per turn, the tokens of
    the turn's new messages (``encode_chat_turn``) then the generated tokens. Walk it:
    each run of non-assistant messages must encode to the next tokens; each assistant
    message must be what the model generated there: its decoded tokens begin with the
    message, and what follows the message up to the reply's end (where the next run's
    tokens start, or the transcript's end after the last reply) is too short to hold
    another turn (``_turn_floor``: a stop string or the eos may follow, a turn the
    history lacks may not). When everything matched and the transcript is used up,
    ``first_new`` is the index after the last assistant message and ``diverged_at``
    None; otherwise ``first_new`` is 0 and ``diverged_at`` the message where the
    transcript could no longer be followed: the first message of a turn whose tokens
    differ, or the assistant reply after which the transcript goes on differently (an
    edited next message, or turns the history lacks: the regenerate pattern, a
    truncated history). A history that does not cover the whole transcript is never
    taken as continuing it.
    """
    n = len(messages)
    pos = 0
    i = 0
    floor: list[int] = []  # _turn_floor, computed at the first reply
    while i < n:
        j = i
        while j < n and messages[j].role != "assistant":
            j += 1
        if j == n:  # the new messages
            return (i, None) if i > 0 and pos == len(transcript) else (0, i)
        group = messages[i:j]
        if not group:  # an assistant message first or two in a row: not a history of this session
            return 0, i
        try:
            seg = _encode(tok, transcript[:pos], group)
        except Exception:  # noqa: BLE001 - a template that cannot render it: no match
            return 0, i
        if transcript[pos : pos + len(seg)] != seg:
            return 0, i
        pos += len(seg)
        if not floor:
            floor.append(_turn_floor(tok, transcript))
        end = _assistant_end(tok, transcript, pos, messages, j, floor[0])
        if end is None:
            return 0, j
        pos = end
        i = j + 1
    return 0, n  # ends with an assistant message: nothing new to answer


def agreed_turns(tok: Any, rec: SessionRecord, messages: tuple[ChatMessage, ...]) -> tuple[int, int, int]:
    """How many of the session's completed turns ``messages`` follow, by the turn
    boundaries of its record: ``(turns, first, stop)``, ``messages[:first]`` being those
    turns and ``stop`` the message where the walk stopped.

    Turn ``t`` is followed when its run of non-assistant messages encodes to exactly the
    turn's input tokens and the assistant message after them is what the turn generated
    (its decoded tokens begin with the message, as in ``match_history``). The walk stops
    at the first turn not followed: ``stop`` is that turn's first message when its input
    differs or the history ends before its reply (the regenerate pattern), the reply
    when that differs, ``first`` when every turn was followed. Needs a record whose every
    turn has its boundaries (``untracked_turns == 0``)."""
    transcript = rec.token_ids
    n = len(messages)
    pos = i = t = 0
    while t < rec.turns:
        j = i
        while j < n and messages[j].role != "assistant":
            j += 1
        if j == n or j == i:  # no reply to compare (the history ends here) or two replies in a row
            break
        info = rec.turn_log[t]
        try:
            seg = _encode(tok, transcript[:pos], messages[i:j])
        except Exception:  # noqa: BLE001 - a template that cannot render it: not followed
            break
        if len(seg) != info.input_tokens or transcript[pos : pos + len(seg)] != seg:
            break
        out, end = pos + info.input_tokens, pos + info.tokens
        if not _reply_matches(tok, transcript[out:end], messages[j]):
            return t, i, j
        pos, i, t = end, j + 1, t + 1
    return t, i, i


def _encode(tok: Any, transcript: list[int], messages: tuple[ChatMessage, ...]) -> list[int]:
    """A run of messages as a continuation of ``transcript``, rendered as the conversation
    renders them: through tool calling's encoder (``ToolCalling.turn_encoder``) for a
    request with tools, else as plain role and content."""
    encode = getattr(tok, "encode_messages", None)
    if encode is not None:
        return encode(transcript, messages)
    return tok.encode_chat_turn(transcript, [{"role": m.role, "content": m.content} for m in messages])


def _reply_matches(tok: Any, ids: list[int], message: ChatMessage) -> bool:
    """Whether a turn's generated ``ids`` are the assistant ``message``: its text begins
    with the message's content and, through tool calling's encoder
    (``TurnEncoder.reply_matches``), its calls are the message's calls."""
    check = getattr(tok, "reply_matches", None)
    if check is not None:
        return check(ids, message)
    return tok.decode(ids).strip().startswith(message.content.strip())


def _turn_floor(tok: Any, transcript: list[int]) -> int:
    """The fewest tokens one more turn adds to a session's transcript: its input (a
    message rendered as a continuation; an empty one of the shortest role, after the
    eos or not) and at least one generated token. Never below 2."""
    eos = set(getattr(tok, "eos_token_ids", ()) or ())
    other = next(t for t in range(len(eos) + 1) if t not in eos)
    lengths = []
    for ctx in [[other]] + ([[min(eos)]] if eos else []):
        for role in ("user", "system", "tool", "developer"):
            try:
                lengths.append(len(tok.encode_chat_turn(ctx, [{"role": role, "content": ""}])))
            except Exception:  # noqa: BLE001 - a template that refuses the role
                pass
    return max(2, min(lengths, default=1) + 1)


def _spelled_end(tok: Any, transcript: list[int], pos: int, want: str) -> int | None:
    """The first ``end`` where ``transcript[pos:end]`` decodes to text that begins with
    ``want`` (stripped), or None when its text stops agreeing with ``want`` first."""
    if not want:
        return pos
    for end in range(pos + 1, len(transcript) + 1):
        text = tok.decode(transcript[pos:end]).strip()
        if text.startswith(want):
            return end
        if not want.startswith(text.rstrip("\ufffd")):  # (an incomplete UTF-8 character decodes to U+FFFD)
            return None
    return None


def _assistant_end(tok: Any, transcript: list[int], pos: int, messages: tuple[ChatMessage, ...], j: int,
                   floor: int) -> int | None:  # fmt: skip
    """Where the generated tokens of assistant message ``j`` (from ``pos``) end, or None.

    Past the tokens that spell the message, the reply may hold fewer than ``floor - 1``
    more (a stop string, the eos; one below the floor for tokenization's slack): more
    could be a turn the history lacks."""
    want = messages[j].content.strip()
    spelled = _spelled_end(tok, transcript, pos, want)
    if spelled is None:
        return None
    last = min(len(transcript), spelled + floor - 2)  # the reply's end is at most here
    k = j + 1
    while k < len(messages) and messages[k].role != "assistant":
        k += 1
    if k == len(messages):  # the messages after j are the new ones: the transcript ends here
        return len(transcript) if len(transcript) <= last else None
    nxt = messages[j + 1 : k]
    if not nxt:
        return None
    eos = set(getattr(tok, "eos_token_ids", ()) or ())
    segs: dict[bool, list[int]] = {}
    for end in range(max(spelled, pos + 1), last + 1):
        after_eos = transcript[end - 1] in eos
        if after_eos not in segs:
            try:
                segs[after_eos] = _encode(tok, transcript[end - 1 : end], nxt)
            except Exception:  # noqa: BLE001
                return None
        seg = segs[after_eos]
        if transcript[end : end + len(seg)] == seg and tok.decode(transcript[pos:end]).strip().startswith(want):
            return end
    return None


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
    ) -> None:
        self.conversations = conversations
        self.admission = admission
        self.metrics = metrics
        self.default_max_new_tokens = default_max_new_tokens
        self.tracing = tracing or Tracing.off()
        self.authenticator = authenticator
        self.model_id = model_id
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
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
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    def _tenant(self, request: Request) -> str:
        return self.authenticator.authenticate([("authorization", request.headers.get("authorization", ""))])

    def _count(self, method: str, status: int) -> None:
        code = next((c for c, (h, _) in oa.HTTP_OF_CODE.items() if h == status), None)
        name = "OK" if status < 400 else "CANCELLED" if status == 499 else (code.name if code is not None else str(status))
        self.metrics.requests.labels(f"http:{method}", name).inc()

    async def _body(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise oa.HttpError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes} bytes "
                               "(max_message_size)", code="request_too_large")  # fmt: skip
        data = b""
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body_bytes:
                raise oa.HttpError(413, f"request body exceeds the limit of {self.max_body_bytes} bytes "
                                   "(max_message_size)", code="request_too_large")  # fmt: skip
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:
            raise oa.HttpError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None

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
            self._count("models", err.status)
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
            self._count("models", err.status)
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
        route = "/v1/chat/completions" if chat else "/v1/completions"
        trace = self.tracing.generate(request.headers.items(), request_id, session_id, http_route=route)
        try:
            self.admission.check_serving()
            tenant = self._tenant(request)
            body = await self._body(request)
            default = self.default_max_new_tokens
            parsed = oa.chat_request(body, default) if chat else oa.completion_request(body, default)
            self._check_model(parsed.model)
            if session_id and not chat:
                raise oa.HttpError(400, "X-Session-Id works on /v1/chat/completions only (a completion has no history)",
                                   param="X-Session-Id")  # fmt: skip
            if session_id and parsed.inp.sampling.n > 1:
                raise oa.HttpError(400, f"n = {parsed.inp.sampling.n} cannot be used with X-Session-Id: a session keeps "
                                   "one transcript (ask for n > 1 without it)", param="n")  # fmt: skip
            ticket = self.admission.admit(tenant, request_id)
            inp, diverged, rewound = await self._session_input(tenant, parsed.inp, session_id)
            events = aclosing(self.conversations.run_turn(tenant, inp, request_id, trace))
            gen = await events.__aenter__()
            start = await anext(gen)
            if not isinstance(start, Started):
                raise RuntimeError("the conversation did not start with a Started event")
        except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
            if events is not None:
                await events.__aexit__(None, None, None)
            if ticket is not None:
                ticket.release()
            err = oa.error_of(exc, request_id)
            self._count(method, err.status)
            trace.end(err.status, err.message)
            return self._error(err)
        headers = {"X-Request-Id": request_id}
        if session_id:
            headers["X-Session-Id"] = session_id
        if diverged is not None:
            headers[DIVERGED_HEADER] = str(diverged)
        ext = oa.extension(request_id, session_id, start, diverged, rewound)
        ctx = _Ctx(self, method, ticket, request_id, chat, parsed.model or self.model_id, start, ext, events, gen, trace,
                   inp.sampling.n)  # fmt: skip
        if parsed.stream:
            headers["Cache-Control"] = "no-cache"
            return StreamingResponse(ctx.sse(parsed.include_usage), media_type="text/event-stream", headers=headers)
        whole = asyncio.ensure_future(ctx.whole())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({whole, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not whole.done():  # the client went away: cancelling the turn aborts it in the engine
            whole.cancel()
            try:
                await whole
            except asyncio.CancelledError:
                pass
            return Response(status_code=499)
        body_out, status = whole.result()
        return JSONResponse(body_out, status_code=status, headers=headers)

    async def _session_input(
        self, owner: str, inp: TurnInput, session_id: str
    ) -> tuple[TurnInput, int | None, int | None]:
        """The turn's input for ``session_id`` (see the module docstring), where the
        history diverged from the session (None: it extended it, or a new session) and
        how many turns were rewound for it (None: none, or the session was started over)."""
        if not session_id:
            return inp, None, None
        assert inp.messages is not None
        try:
            rec, _busy = await self.conversations.sessions.get(owner, session_id)
        except SessionNotFound:
            return _with(inp, session_id=session_id), None, None
        if not rec.token_ids:
            return _with(inp, session_id=session_id), None, None
        tok = self.conversations.engine.tokenizer
        if uses_tools(inp):  # the history's tool calls and results render as the conversation renders them
            tok = self.conversations.tools.turn_encoder(inp.tools)
        msgs = inp.messages
        if rec.untracked_turns == 0:  # every turn's boundaries are known: walk them
            keep, first, stop = await asyncio.to_thread(agreed_turns, tok, rec, msgs)
            rest = msgs[first:]
            if keep == rec.turns and first > 0 and rest and all(m.role != "assistant" for m in rest):
                return _with(inp, session_id=session_id, messages=rest), None, None  # it extends the session
            if rest:
                # diverged: rewind to the last turn the history follows (its KV stays cached:
                # the new prompt starts with exactly its tokens) and run the rest of the
                # history as the next turn, if that is still the next one (expected_turns)
                self._precheck(inp)  # a request that would be refused rewinds nothing
                if keep < rec.turns:
                    await self.conversations.rewind(owner, session_id, rec.turns - keep, expected_turns=rec.turns)
                return _with(inp, session_id=session_id, messages=rest, expected_turns=keep), stop, rec.turns - keep
            diverged: int | None = stop  # it ends with a reply the session has: nothing new to answer
        else:
            first_new, diverged = await asyncio.to_thread(match_history, tok, rec.token_ids, msgs)
            if diverged is None and first_new > 0:
                return _with(inp, session_id=session_id, messages=msgs[first_new:]), None, None
        # a record without turn boundaries (written before they were kept), or a history
        # that ends with a reply: the session starts over with the new history; the old
        # transcript's KV stays cached by content, so a common prefix is still reused
        self._precheck(inp)
        try:
            await self.conversations.sessions.delete(owner, session_id)
        except SessionNotFound:
            pass
        return _with(inp, session_id=session_id), diverged, None

    def _precheck(self, inp: TurnInput) -> None:
        """The turn's checks that need no session (``run_turn`` makes them again), made
        before a divergence changes the session."""
        self.conversations.check_sampling(inp.sampling)
        check_salt(inp.cache_salt, self.conversations.limits)
        check_turn_options(_with(inp, session_id="x"))


def _with(inp: TurnInput, **changes: Any) -> TurnInput:
    return dataclasses.replace(inp, **changes)


class _Ctx:
    """One admitted generation: turns the rest of the events into a JSON body or SSE."""

    def __init__(self, front: HttpFront, method: str, ticket: Ticket, request_id: str, chat: bool, model: str,
                 start: Started, ext: dict[str, Any], events: Any, gen: AsyncIterator[Any], trace: Any,
                 n: int = 1) -> None:  # fmt: skip
        self.front, self.method, self.ticket, self.request_id = front, method, ticket, request_id
        self.trace = trace  # service.tracing: ended with the call's HTTP status
        self.chat, self.model, self.start, self.ext = chat, model, start, ext
        self.events, self.gen = events, gen
        self.n = n  # choices: the request's SamplingParams.n
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    async def _close(self) -> None:
        try:
            await self.events.__aexit__(None, None, None)
        finally:
            self.ticket.release()

    def _finish_error(self, fin: Finished) -> oa.HttpError | None:
        status = wire.finish_status(fin, self.request_id, self.front.admission.draining)
        return oa.error_of(status, self.request_id) if status is not None else None

    async def whole(self) -> tuple[dict[str, Any], int]:
        status, message = 499, "the client went away"  # unless the call gets further
        ends: dict[int, Finished] = {}
        try:
            async for ev in self.gen:
                if isinstance(ev, Finished):
                    err = self._finish_error(ev)
                    if err is not None:
                        status, message = err.status, err.message
                        self.front._count(self.method, err.status)
                        return err.body(), err.status
                    ends[ev.index] = ev
                    if len(ends) == self.n:
                        status, message = 200, ""
                        self.front._count(self.method, 200)
                        return self._body([ends[i] for i in sorted(ends)]), 200
            raise RuntimeError("the conversation ended without a Finished event")
        except asyncio.CancelledError:  # the client went away (_generate cancels the call)
            self.front._count(self.method, 499)
            raise
        except Exception as exc:  # noqa: BLE001
            err = oa.error_of(exc, self.request_id)
            status, message = err.status, err.message
            self.front._count(self.method, err.status)
            return err.body(), err.status
        finally:
            await self._close()
            self.trace.end(status, message)

    def _body(self, ends: list[Finished]) -> dict[str, Any]:
        """The whole response: one choice per sequence (``Finished.text`` is its text)."""
        choices: list[dict[str, Any]] = []
        for fin in ends:
            if self.chat:
                choices.append({"index": fin.index, "message": oa.chat_message(fin),
                                "finish_reason": oa.finish_reason(fin), "logprobs": None})  # fmt: skip
            else:
                choices.append({"index": fin.index, "text": fin.text, "finish_reason": oa.finish_reason(fin),
                                "logprobs": None})  # fmt: skip
        used = oa.usage(self.start, ends[0], sum(f.completion_tokens for f in ends))
        return {
            "id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": used, "kvserve": self.ext,
        }  # fmt: skip

    def _chunk(self, delta: dict[str, Any] | str | None, finish: str | None, index: int = 0) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": index, "delta": delta or {}, "finish_reason": finish, "logprobs": None}]
            kind = "chat.completion.chunk"
        else:
            choices = [{"index": index, "text": delta or "", "finish_reason": finish, "logprobs": None}]
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def sse(self, include_usage: bool) -> AsyncIterator[bytes]:
        def data(obj: Any) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        status = 200
        completion_tokens = 0
        left = self.n
        try:
            if self.chat:
                for i in range(self.n):
                    yield data(self._chunk({"role": "assistant", "content": ""}, None, i))
            async for ev in self.gen:
                if isinstance(ev, Delta):
                    if ev.text:
                        yield data(self._chunk({"content": ev.text} if self.chat else ev.text, None, ev.index))
                elif isinstance(ev, ToolCallDelta):  # a piece of a tool call (service/tools)
                    yield data(self._chunk(oa.tool_call_delta(ev), None, ev.index))
                elif isinstance(ev, Finished):
                    err = self._finish_error(ev)
                    if err is not None:
                        status = err.status
                        yield data(err.body())
                        break
                    completion_tokens += ev.completion_tokens
                    left -= 1
                    last = self._chunk(None, oa.finish_reason(ev), ev.index)
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
            err = oa.error_of(exc, self.request_id)
            status = err.status
            yield data(err.body())
        finally:
            await self._close()
            self.front._count(self.method, status)
            self.trace.end(status)


async def _disconnected(request: Request) -> None:
    """Returns when the client of a whole (non-streamed) response disconnects: its body
    is read already, so the next ASGI message is ``http.disconnect``."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def make_uvicorn_server(app: Any, *, ssl: dict[str, Any], log_level: str) -> Any:
    """A uvicorn Server for ``app`` that leaves signals to kvserve (it runs inside
    kvserve's event loop; ``run`` handles SIGTERM and drains both fronts)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def capture_signals(self) -> Any:  # kvserve owns the signals
            return _nothing()

    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, lifespan="off", timeout_graceful_shutdown=2, **ssl
    )  # fmt: skip
    return _Server(config)


__all__ = ["HttpFront", "match_history", "agreed_turns", "make_uvicorn_server", "DIVERGED_HEADER"]
