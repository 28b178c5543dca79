"""OpenAI's chat and text completions: ``POST /v1/chat/completions`` and
``POST /v1/completions`` (SSE when ``stream``), over the HTTP front's plumbing
(``service.http.plumbing``). A body is parsed by ``service.http.openai`` into a
``TurnInput`` and run by the same ``Conversations`` as gRPC's Generate (``start_turn``:
the shared turn prologue); the events become OpenAI's response object or chunks here.

Sessions (``X-Session-Id`` on chat): OpenAI clients resend the whole history. The turn
runs with ``resent_history``: ``Conversations.prepare`` matches it against the
session's record under the turn lock, after every check of the request
(``service.history``: it extends the session, rewinds it to the last turn the history
follows, or starts it over), and a refused, failed or cancelled turn leaves the session
as it was. The response says where it diverged (``kvserve.history_diverged_at`` and the
``X-Kvserve-History-Diverged-At`` header) and how many turns were rewound
(``kvserve.history_rewound_turns``).
Without a session id the whole history is the prompt and prefix caching by content
applies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from . import openai as oa
from .plumbing import HttpTurn, Plumbing, TurnRequest, whole_or_gone
from ..types import Delta, Finished, ToolCallDelta

DIVERGED_HEADER = "X-Kvserve-History-Diverged-At"


class CompletionRoutes:
    """The two routes (chat: ``chat=True``), over the HTTP front's plumbing."""

    def __init__(self, plumbing: Plumbing) -> None:
        self.plumbing = plumbing

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        front = self.plumbing
        method = "ChatCompletions" if chat else "Completions"
        session_id = request.headers.get("x-session-id", "")
        parsed: Any = None

        async def parse(owner: str, body: Any) -> TurnRequest:
            nonlocal parsed
            default = front.default_max_new_tokens
            parsed = oa.chat_request(body, default) if chat else oa.completion_request(body, default)
            front.check_model(parsed.model)
            if session_id and not chat:
                raise oa.HttpError(400, "X-Session-Id works on /v1/chat/completions only (a completion has no history)",
                                   param="X-Session-Id")  # fmt: skip
            if session_id and parsed.inp.sampling.n > 1:
                raise oa.HttpError(400, f"n = {parsed.inp.sampling.n} cannot be used with X-Session-Id: a session keeps "
                                   "one transcript (ask for n > 1 without it)", param="n")  # fmt: skip
            inp = dataclasses.replace(parsed.inp, session_id=session_id)
            return TurnRequest(inp, parsed.names, resent_history=bool(session_id))

        route = "/v1/chat/completions" if chat else "/v1/completions"
        turn = await front.start_turn(request, method, route, session_id, parse)
        if isinstance(turn, oa.HttpError):
            return front.error_response(turn)
        start = turn.start
        diverged, rewound = start.history_diverged_at, start.history_rewound_turns
        headers = {"X-Request-Id": turn.request_id}
        if session_id:
            headers["X-Session-Id"] = session_id
        if diverged is not None:
            headers[DIVERGED_HEADER] = str(diverged)
        ext = oa.extension(turn.request_id, session_id, start, diverged, rewound)
        sampling = turn.req.inp.sampling
        ctx = _Completion(turn, chat, parsed.model or front.model_id, ext, sampling.n, sampling.logprobs is not None)
        if parsed.stream:
            headers["Cache-Control"] = "no-cache"
            sse = ctx.sse(parsed.include_usage, parsed.continuous_usage)
            return StreamingResponse(sse, media_type="text/event-stream", headers=headers)
        return await whole_or_gone(request, ctx.whole(), headers)


class _Completion:
    """One admitted generation: turns the rest of the events into a JSON body or SSE."""

    def __init__(self, turn: HttpTurn, chat: bool, model: str, ext: dict[str, Any], n: int = 1,
                 logprobs: bool = False) -> None:  # fmt: skip
        self.turn = turn  # its end closes it, counts the call and ends its trace
        self.chat, self.model, self.start, self.ext = chat, model, turn.start, ext
        self.n = n  # choices: the request's SamplingParams.n
        self.logprobs = logprobs  # the request asked for them
        self.pieces = turn.plumbing.conversations.prompts.token_pieces if logprobs else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + turn.request_id
        self.created = int(time.time())

    async def whole(self) -> tuple[dict[str, Any], int]:
        outcome: int | oa.HttpError = 499  # unless the call gets further
        message = "the client went away"
        ends: dict[int, Finished] = {}
        lps: dict[int, list[Any]] = {}  # choice -> its tokens' TokenLogprob
        try:
            async for ev in self.turn.events:
                if isinstance(ev, Delta) and self.logprobs:
                    lps.setdefault(ev.index, []).extend(ev.logprobs)
                if isinstance(ev, Finished):
                    err = self.turn.finish_error(ev)
                    if err is not None:
                        outcome, message = err, err.message
                        return err.body(), err.status
                    ends[ev.index] = ev
                    if len(ends) == self.n:
                        outcome, message = 200, ""
                        return self._body([ends[i] for i in sorted(ends)], lps), 200
            raise RuntimeError("the conversation ended without a Finished event")
        except Exception as exc:  # noqa: BLE001 - (CancelledError: the client went away, 499)
            err = self.turn.error_of(exc)
            outcome, message = err, err.message
            return err.body(), err.status
        finally:
            await self.turn.end(outcome, message)

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

    async def sse(self, include_usage: bool, continuous: bool = False) -> AsyncIterator[bytes]:
        """The chunks; with ``continuous`` (vLLM's continuous_usage_stats) each carries
        the usage so far (its choice's completion tokens)."""
        made: dict[int, int] = {}  # choice -> tokens so far

        def data(obj: Any, index: int | None = None) -> bytes:
            if continuous and index is not None:
                obj["usage"] = oa.running_usage(self.start, made.get(index, 0))
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        status, failed = 200, None
        completion_tokens = 0
        left = self.n
        try:
            if self.chat:
                for i in range(self.n):
                    yield data(self._chunk({"role": "assistant", "content": ""}, None, i), i)
            async for ev in self.turn.events:
                if isinstance(ev, Delta):
                    made[ev.index] = made.get(ev.index, 0) + len(ev.token_ids)
                    if ev.text or (self.logprobs and ev.logprobs):
                        lp = self._logprobs(ev.logprobs)
                        chunk = self._chunk({"content": ev.text} if self.chat else ev.text, None, ev.index, lp)
                        yield data(chunk, ev.index)
                elif isinstance(ev, ToolCallDelta):  # a piece of a tool call (service/tools)
                    yield data(self._chunk(oa.tool_call_delta(ev), None, ev.index), ev.index)
                elif isinstance(ev, Finished):
                    err = self.turn.finish_error(ev)
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
                    made[ev.index] = ev.completion_tokens
                    yield data(last, ev.index)
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
            err = self.turn.error_of(exc)
            status, failed = err.status, err
            yield data(err.body())
        finally:
            await self.turn.end(failed or status)
