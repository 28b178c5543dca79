"""OpenAI's Responses API over sessions: ``POST /v1/responses`` (SSE events when
``stream``), ``GET`` and ``DELETE /v1/responses/{id}``.

A stored response is a point in a server-side conversation: the response id is the id
of a session whose transcript is the conversation up to and including this response
(the Redis session records when Redis is configured, so any replica finds it, after a
restart too). A follow-up with ``previous_response_id`` sends only the new input: its
turn runs in a new session that starts with the previous response's transcript
(``Conversations.prepare(fork_from=...)``, as ``ForkSession`` would make it, in the
turn's one write), so every earlier block hashes the same and is found in the cache;
following up an older response is a fork of the conversation there. ``store: false``
runs the turn the same way and removes its session afterwards (a response nobody can
follow up or retrieve). A turn refused, failed or cancelled leaves no response behind.

A response not finished is not followed up: a follow-up naming one whose turn is still
running (on any replica: its turn lock) is 409 ``response_in_progress`` (the SDKs retry a
409), and one that will never finish (its replica died in its first turn: no completed
turn, no lock, the lease lapsed) is removed on the next read, which answers 404
(``SessionManager.reap_abandoned``), never a turn from an empty transcript.

``GET`` rebuilds the response from its session: the reply (the last turn's output
decoded, its calls read back by the family's parser), status, ``previous_response_id``
(the session it was forked from); the request parameters and usage are not stored
(``usage`` is null there). A call's ``call_id`` is derived from the response's id and
the call's index (``ToolFormat.stable_id``), so the response, a retrieve and the check of
a follow-up's ``function_call_output`` agree on it. ``DELETE`` removes the
session and forgets its KV blocks (``Conversations.remove``), except the prefix another
stored response still shares (the one it followed, its follow-ups: a deleted parent
leaves its children's history cached).

Function tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, flat as the
Responses API writes them) run through the same machinery as chat's (``service/tools``,
applied by ``Conversations.prepare`` and ``stream``): each call is a ``function_call`` output item, and a
follow-up's ``function_call_output`` items are tool messages of the next turn, so the
previous response's calls stay in the transcript as the model wrote them (cached). The
items' bookkeeping is checked as OpenAI checks it, naming the item (an output answering
no call, arguments that are not JSON, a call of a function not in ``tools``), before the
turn starts.

Parsing and rendering here are pure functions; ``ResponsesRoutes`` runs them over the
HTTP front's admission, authentication and conversations (docs/api.md lists what of
OpenAI's Responses surface is not implemented and the error each field gets).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import wire
from . import openai as oa
from .plumbing import HttpTurn, Plumbing, TurnRequest, whole_or_gone
from ..errors import SESSION_ID_RE, SessionNotFound
from ..types import (
    ChatMessage,
    Delta,
    Finished,
    FinishReason,
    ResponseFormat,
    Started,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    TurnInput,
)


RESPONSE_PREFIX = "resp_"
# (owner, the request, its raw input, the response id, call_id) -> the turn's input and attach
InConversation = Callable[[str, "ResponseRequest", Any, str, Callable[[str, int], str]], Awaitable[tuple[TurnInput, Any]]]
LOGPROBS_INCLUDE = "message.output_text.logprobs"

_FIELDS = {
    "model", "input", "instructions", "previous_response_id", "store", "stream", "stream_options",
    "max_output_tokens", "temperature", "top_p", "top_logprobs", "text", "tools", "tool_choice",
    "parallel_tool_calls", "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier",
    "prompt_cache_retention", "truncation", "reasoning", "include", "background", "conversation", "prompt", "max_tool_calls",
    # kvserve's extensions, as on chat
    "top_k", "min_p", "repetition_penalty", "seed", "ignore_eos", "cache_salt", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "speculative", "speculative.n_max",
}  # fmt: skip
# OpenAI fields kvserve does not implement: accepted at these values (what SDKs send by default)
_DEFAULTS_ONLY: Mapping[str, tuple[Any, ...]] = {
    "background": (None, False),
    "prompt": (None,),
    "truncation": (None, "disabled"),
    "max_tool_calls": (None,),
}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


@dataclass(frozen=True)
class ResponseRequest:
    """A parsed ``POST /v1/responses`` body."""

    model: str | None
    inp: TurnInput
    stream: bool
    store: bool
    previous_response_id: str | None
    instructions: str | None
    text_format: dict[str, Any]  # echoed as the response's text.format
    logprobs: bool  # include has message.output_text.logprobs
    echo: dict[str, Any]  # request fields the response object repeats
    # the function_call_output items that lead the input, (index, call_id): they answer the
    # previous response's calls (checked against them once it is read)
    answers: tuple[tuple[int, str], ...] = ()
    conversation: str | None = None  # the conversation the turn joins (service.http.conversations_api)


def new_response_id() -> str:
    return RESPONSE_PREFIX + uuid.uuid4().hex


def is_response_id(value: Any) -> bool:
    """Whether ``value`` can name a response: ``resp_`` and a session id's characters."""
    return isinstance(value, str) and value.startswith(RESPONSE_PREFIX) and SESSION_ID_RE.fullmatch(value) is not None


def no_call_found(where: str, call_id: str) -> oa.HttpError:
    """OpenAI's error for a function_call_output that answers no call (its words, the item's field as param)."""
    return oa.HttpError(400, f"{where}: No tool call found for function call output with call_id {call_id[:80]!r}.",
                        param=where)  # fmt: skip


def _input_messages(value: Any, declared: frozenset[str]) -> tuple[list[ChatMessage], list[tuple[int, str]]]:
    """``input``: a string (one user message) or a list of items: messages,
    ``function_call`` items (an assistant's calls, consecutive ones one message) and
    ``function_call_output`` items (a tool message with the call's result); and the
    outputs that lead the input (they answer the previous response's calls).

    The calls' bookkeeping is checked as OpenAI checks it, naming the item: a call of a
    function not in ``declared`` (when the request has tools), arguments that are not
    JSON, an output whose ``call_id`` is not a call of the ``function_call`` items just
    before it (only outputs between)."""
    if isinstance(value, str):
        return [ChatMessage("user", value)], []
    if not isinstance(value, list) or not value:
        raise oa.HttpError(400, "input must be a string or a non-empty list of items", param="input")
    out: list[ChatMessage] = []
    leading: list[tuple[int, str]] = []
    names: dict[str, str] = {}  # call_id -> function name, for the results that follow
    answerable: set[str] | None = None  # None: the input's start (the previous response's calls)
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise oa.HttpError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "function_call":
            _only(item, where, ("type", "id", "call_id", "name", "arguments", "status"))
            call = ToolCall(oa.string_field(item.get("call_id"), f"{where}.call_id"), oa.string_field(item.get("name"), f"{where}.name"),
                            oa.string_field(item.get("arguments", "{}"), f"{where}.arguments"))  # fmt: skip
            if declared and call.name not in declared:
                raise oa.HttpError(400, f"{where}.name: the function {call.name[:80]!r} is not in tools",
                                   param=f"{where}.name")  # fmt: skip
            _check_arguments(call.arguments, f"{where}.arguments")
            names[call.id] = call.name
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1] = dataclasses.replace(out[-1], tool_calls=out[-1].tool_calls + (call,))
                assert answerable is not None
                answerable.add(call.id)
            else:
                out.append(ChatMessage("assistant", "", (call,)))
                answerable = {call.id}
            continue
        if kind == "function_call_output":
            _only(item, where, ("type", "id", "call_id", "output", "status"))
            call_id = oa.string_field(item.get("call_id"), f"{where}.call_id")
            output = oa.content_field(item.get("output"), f"{where}.output", _TEXT_PARTS)
            if answerable is None:
                leading.append((i, call_id))
            elif call_id not in answerable:
                raise no_call_found(f"{where}.call_id", call_id)
            out.append(ChatMessage("tool", output, (), call_id, names.get(call_id, "")))
            continue
        if kind != "message":
            raise oa.unsupported(f"{where}.type", f"{kind!r}: only message, function_call and function_call_output items are supported")
        role = item.get("role")
        if role not in _ROLES:
            raise oa.HttpError(400, f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}"[:200],
                               param=f"{where}.role", code="invalid_value")  # fmt: skip
        _only(item, where, ("type", "role", "content", "id", "status"))
        content = oa.content_field(item.get("content"), f"{where}.content", _TEXT_PARTS)
        out.append(ChatMessage(role, content))
        answerable = set()
    return out, leading


def _check_arguments(arguments: str, where: str) -> None:
    try:
        if arguments.strip():  # (blank: no arguments)
            json.loads(arguments)
    except (ValueError, RecursionError):
        raise oa.HttpError(400, f"{where}: the call's arguments are not valid JSON: {arguments[:80]!r}",
                           param=where) from None  # fmt: skip


def _only(item: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> None:
    for key in item:
        if key not in keys:
            raise oa.unsupported(f"{where}.{key}")


def response_tools(body: Mapping[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice | None, bool, list[dict[str, Any]]]:
    """``tools`` (``[{"type": "function", "name", "description", "parameters", "strict"}]``,
    flat; a built-in tool type is refused naming ``tools[i].type``), ``tool_choice``
    ("none", "auto", "required" or ``{"type": "function", "name"}``) and
    ``parallel_tool_calls``; and the tools to echo. Names, schemas and their combination
    are checked by ``service.tools.check_tools``, as on chat."""
    raw = body.get("tools")
    raw = [] if raw is None else raw
    if not isinstance(raw, list):
        raise oa.HttpError(400, "tools must be a list", param="tools")
    tools, echo = [], []
    for i, t in enumerate(raw):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise oa.HttpError(400, f"{w} must be an object", param=w)
        if t.get("type") != "function":
            raise oa.unsupported(f"{w}.type", f"{t.get('type')!r}: only function tools are implemented on /v1/responses"[:200])
        _only(t, w, ("type", "name", "description", "parameters", "strict"))
        params = t.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise oa.HttpError(400, f"{w}.parameters must be a JSON schema object", param=f"{w}.parameters")
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise oa.HttpError(400, f"{w}.strict must be a boolean", param=f"{w}.strict")
        name = oa.string_field(t.get("name"), f"{w}.name")
        desc = oa.string_field(t.get("description") or "", f"{w}.description")
        strict = True if strict is None else strict  # OpenAI's default on /v1/responses
        tools.append(ToolSpec(name, desc, json.dumps(params) if params is not None else "{}", strict))
        echo.append({"type": "function", "name": name, "description": desc or None, "parameters": params,
                     "strict": strict})  # fmt: skip
    choice = body.get("tool_choice")
    tc: ToolChoice | None
    if choice is None:
        tc = None
    elif choice in ("none", "auto", "required"):
        tc = ToolChoice(choice)
    elif isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        tc = ToolChoice("function", oa.string_field(choice.get("name"), "tool_choice.name"))
    else:
        raise oa.unsupported("tool_choice", 'accepted: "none", "auto", "required" or {"type": "function", "name": ...}')
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise oa.HttpError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    return tuple(tools), tc, parallel is not False, echo


def text_format(text: Any) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """``text: {"format": ...}``: text, json_object or json_schema (name, schema, strict,
    description), as the grammar of chat's response_format; and the format to echo."""
    if text is None:
        return None, {"type": "text"}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise oa.HttpError(400, "text must be an object with format", param="text")
    if text.get("verbosity") is not None:
        raise oa.unsupported("text.verbosity", "Unsupported parameter: 'text.verbosity' is not supported with this model")
    fmt = text.get("format")
    if fmt is None:
        return None, {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None, {"type": "text"}
    if kind == "json_object" and set(fmt) == {"type"}:
        return ResponseFormat("json_object"), {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), (dict, bool)) or not isinstance(fmt.get("name"), str):
            raise oa.HttpError(400, "text.format json_schema needs a name and a schema object", param="text.format")
        if set(fmt) - {"type", "name", "schema", "strict", "description"}:
            raise oa.unsupported("text.format", "a json_schema format takes name, description, schema and strict")
        return ResponseFormat("json_schema", json.dumps(fmt["schema"])), dict(fmt)
    raise oa.HttpError(400, 'text.format must be {"type": "text"}, {"type": "json_object"} or '
                       '{"type": "json_schema", "name": ..., "schema": {...}}', param="text.format")  # fmt: skip


def conversation_param(body: Mapping[str, Any]) -> str | None:
    """``conversation``: an id or ``{"id": ...}`` (service.http.conversations_api runs the
    turn in it); with ``previous_response_id`` it is 400, as OpenAI's."""
    value = body.get("conversation")
    if value is None:
        return None
    if isinstance(value, dict) and set(value) == {"id"}:
        value = value["id"]
    if not isinstance(value, str):
        raise oa.HttpError(400, 'conversation must be a conversation id or {"id": ...}', param="conversation",
                           code="invalid_type")  # fmt: skip
    if body.get("previous_response_id") is not None:
        raise oa.HttpError(400, "Mutually exclusive parameters: Ensure you are only providing one of: "
                           "'previous_response_id' or 'conversation'.", param="conversation",
                           code="mutually_exclusive_parameters")  # fmt: skip
    return value


def response_request(body: Any, default_max_new_tokens: int) -> ResponseRequest:
    """A ``POST /v1/responses`` body as a domain turn; a field that would change the
    output and is not implemented is refused (400 naming it)."""
    if not isinstance(body, dict):
        raise oa.HttpError(400, "the request body must be a JSON object")
    for name in body:
        if name not in _FIELDS:
            raise oa.unsupported(name, "unknown or unsupported parameter for /v1/responses")
    for name, allowed in _DEFAULTS_ONLY.items():
        if body.get(name) not in allowed:
            raise oa.unsupported(name, f"not implemented (accepted: {', '.join(json.dumps(a) for a in allowed)})")
    reasoning = body.get("reasoning")
    if reasoning is not None and not (isinstance(reasoning, dict) and all(v is None for v in reasoning.values())):
        raise oa.unsupported("reasoning", "Unsupported parameter: 'reasoning' is not supported with this model")
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != LOGPROBS_INCLUDE for x in include):
        raise oa.unsupported("include", f"only {LOGPROBS_INCLUDE!r} is supported")
    oa.check_bookkeeping(body)
    conversation = conversation_param(body)
    tools, tool_choice, parallel, echo_tools = response_tools(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise oa.HttpError(400, "model must be a string", param="model")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise oa.HttpError(400, "instructions must be a string", param="instructions")
    prev = body.get("previous_response_id")
    if prev is not None and not is_response_id(prev):
        shown = f", got {prev[:140]!r}" if isinstance(prev, str) else ""
        raise oa.HttpError(400, f"previous_response_id must be a response id ({RESPONSE_PREFIX} and up to 123 of "
                           f"[A-Za-z0-9._:-]){shown}", param="previous_response_id",
                           code="invalid_value")  # fmt: skip
    store = body.get("store")
    store = True if store is None else store
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise oa.HttpError(400, "stream must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}):
        raise oa.HttpError(400, "stream_options takes include_obfuscation only", param="stream_options")
    top = oa.number_field(body, "top_logprobs", int)
    logprobs = bool(include) or bool(top)
    messages, leading = _input_messages(body.get("input"), frozenset(t.name for t in tools))
    if leading and prev is None and conversation is None:  # nothing before this input made calls
        i, call_id = leading[0]
        raise no_call_found(f"input[{i}].call_id", call_id)
    if instructions:
        messages.insert(0, ChatMessage("system", instructions))
    sampling, max_tokens = oa.sampling_fields(body, "max_output_tokens", default_max_new_tokens,
                                        (top or 0) if logprobs else None)  # fmt: skip
    fmt, echo_fmt = text_format(body.get("text"))
    if fmt is not None:
        sampling = dataclasses.replace(sampling, response_format=fmt)
    inp = TurnInput(messages=tuple(messages), sampling=sampling, max_new_tokens=max_tokens, cache_salt=oa.cache_salt_field(body),
                    tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel,
                    retain=oa.retention(body))  # fmt: skip
    echo = {
        "temperature": body.get("temperature"), "top_p": body.get("top_p"), "max_output_tokens": max_tokens,
        "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "user": body.get("user"), "top_logprobs": top, "service_tier": body.get("service_tier"),
        "tools": echo_tools, "tool_choice": body.get("tool_choice") or "auto", "safety_identifier": body.get("safety_identifier"),
        "prompt_cache_key": body.get("prompt_cache_key"),
    }  # fmt: skip
    return ResponseRequest(model, inp, bool(stream), store, prev, instructions, echo_fmt, logprobs, echo, tuple(leading),
                           conversation)  # fmt: skip


# ----------------------------------------------------------------------------- the response object


def output_logprobs(items: list[TokenLogprob], pieces: Any) -> list[dict[str, Any]]:
    """An output_text part's logprobs (chat's shape without refusal)."""
    return oa.chat_logprobs(items, pieces)["content"] if items else []


def response_object(
    rid: str, model: str, created_at: int, status: str, text: str | None, *, req: ResponseRequest | None = None,
    previous: str | None = None, usage: dict[str, Any] | None = None, logprobs: list[dict[str, Any]] | None = None,
    incomplete: str | None = None, ext: dict[str, Any] | None = None, calls: tuple[ToolCall, ...] = (),
    timings: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """OpenAI's ``response`` object; ``text`` None: no output yet (in progress). With
    ``calls``: a ``function_call`` item each, after the message (left out when empty).
    ``timings``: llama.cpp's object (openai.timings) of a finished generation."""
    output = []
    if text is not None and (text or not calls):
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        output.append({"type": "message", "id": "msg_" + rid[len(RESPONSE_PREFIX):], "status": status,
                       "role": "assistant", "content": [part]})  # fmt: skip
    output.extend(function_call_item(rid, k, c, "completed") for k, c in enumerate(calls))
    echo = req.echo if req is not None else {}
    out: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions if req is not None else None,
        "previous_response_id": previous, "store": req.store if req is not None else True,
        "text": {"format": req.text_format if req is not None else {"type": "text"}},
        "tools": echo.get("tools", []), "tool_choice": echo.get("tool_choice", "auto"),
        "parallel_tool_calls": echo.get("parallel_tool_calls", True), "truncation": "disabled",
        "temperature": echo.get("temperature"), "top_p": echo.get("top_p"),
        "max_output_tokens": echo.get("max_output_tokens"), "metadata": echo.get("metadata", {}),
        "user": echo.get("user"), "top_logprobs": echo.get("top_logprobs"), "service_tier": echo.get("service_tier"),
        "safety_identifier": echo.get("safety_identifier"), "prompt_cache_key": echo.get("prompt_cache_key"),
        "reasoning": None, "usage": usage,
    }  # fmt: skip
    if req is not None and req.conversation is not None:
        out["conversation"] = {"id": req.conversation}
    if timings is not None:
        out["timings"] = timings
    if ext is not None:
        out["kvserve"] = ext
    return out


def call_item_id(rid: str, k: int) -> str:
    return f"fc_{rid[len(RESPONSE_PREFIX):]}_{k}"


def function_call_item(rid: str, k: int, call: ToolCall, status: str) -> dict[str, Any]:
    """The ``function_call`` output item of the response's ``k``-th call."""
    return {"type": "function_call", "id": call_item_id(rid, k), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}  # fmt: skip


def response_usage(start: Started, fin: Finished, block_size: int) -> dict[str, Any]:
    """Usage; ``cache_write_tokens``: the prompt tokens this response added to the cache
    (its full blocks past the cached ones; the tail of a block is not kept)."""
    chat = oa.usage(start, fin)
    written = max(0, fin.prompt_tokens // block_size * block_size - fin.cached_tokens)
    return {
        "input_tokens": fin.prompt_tokens,
        "input_tokens_details": {"cached_tokens": fin.cached_tokens, "cache_write_tokens": written,
                                 "kvserve_cached_by_tier": chat["prompt_tokens_details"]["kvserve_cached_by_tier"]},
        "output_tokens": fin.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }  # fmt: skip


# ----------------------------------------------------------------------------- the routes


class ResponsesRoutes:
    """The three routes, over the HTTP front's plumbing (``service.http.plumbing``)."""

    def __init__(self, plumbing: Plumbing, in_conversation: InConversation | None = None) -> None:
        self.front = plumbing
        self.conversations = plumbing.conversations
        self.session_ops = plumbing.session_ops
        # a response in a conversation: its turn's input and the items its commit appends
        # (service.http.conversations_api.ConversationRoutes.turn; None: 404 for every one)
        self.in_conversation = in_conversation

    def _fail(self, exc: BaseException, request_id: str, method: str, names: Any = None) -> Response:
        err = self.front.error_of(exc, request_id, names)
        self.front.count(method, err)
        return self.front.error_response(err)

    async def retrieve(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            self.front.admission.check_serving()
            owner = self.front.tenant(request)
            rec, busy, reply = await self._read(owner, rid)
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc, wire.new_request_id(), "Responses")
        log = rec.turn_log[-1] if rec.turn_log else None
        status = "in_progress" if log is None else "incomplete" if log.finish_reason == "length" else "completed"
        created = int(log.started_at if log is not None else rec.created_at)
        prev = rec.forked_from if rec.forked_from.startswith(RESPONSE_PREFIX) else None
        text, calls = self.reply_calls(rid, reply) if log is not None else (None, [])
        body = response_object(rid, self.front.model_id, created, status, text, previous=prev, calls=tuple(calls),
                               incomplete="max_output_tokens" if status == "incomplete" else None)  # fmt: skip
        self.front.count("Responses", 200)
        return JSONResponse(body)

    def reply_calls(self, rid: str, reply: str) -> tuple[str, list[ToolCall]]:
        """A stored reply's text outside calls and its calls (read by the served family's
        parser), each with the id it was given when the response was made (``call_id``)."""
        content, calls = self.conversations.tools.format.parser().parse(reply)
        return content, [dataclasses.replace(c, id=self.call_id(rid, k)) for k, c in enumerate(calls)]

    def call_id(self, rid: str, k: int) -> str:
        """The ``call_id`` of response ``rid``'s ``k``-th call: derived from both, so a
        retrieve and a follow-up's ``function_call_output`` find the same id."""
        return self.conversations.tools.format.stable_id(f"{rid}:{k}")

    async def delete(self, request: Request) -> Response:
        rid = request.path_params["response_id"]
        try:
            self.front.admission.check_serving()
            owner = self.front.tenant(request)
            if not rid.startswith(RESPONSE_PREFIX):
                raise _not_found(rid)
            try:
                await self.session_ops.remove(owner, rid)
            except SessionNotFound:
                raise _not_found(rid) from None
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc, wire.new_request_id(), "Responses")
        self.front.count("Responses", 200)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def _read(self, owner: str, rid: str) -> Any:
        """The response's session record, busy flag and reply: 404 for an id that names
        none, and for a response whose first turn was abandoned (``_unfinished``)."""
        if not is_response_id(rid):
            raise _not_found(rid)
        try:
            found = await self.session_ops.session(owner, rid)
        except SessionNotFound:
            raise _not_found(rid) from None
        return await self._unfinished(owner, rid, found, lambda: _not_found(rid))

    async def _unfinished(self, owner: str, rid: str, found: Any, gone: Any) -> Any:
        """``found`` (a response's record, busy flag, reply), or, for a response with no
        completed turn that no replica is running (the one that ran it died: its turn
        lock's lease lapsed), ``gone()`` raised after its placeholder is removed: it will
        never complete. A response that completed (or started) meanwhile is read again."""
        rec, busy, _reply = found
        if rec.turns or busy:
            return found
        if await self.session_ops.reap_abandoned(owner, rid):
            raise gone()
        try:
            found = await self.session_ops.session(owner, rid)  # it committed (or started) meanwhile
        except SessionNotFound:
            raise gone() from None
        if not found[0].turns and not found[1]:  # a session with no turn that no turn made: not a response
            raise gone()
        return found

    async def _previous(self, owner: str, prev: str) -> list[ToolCall]:
        """The calls of the response a follow-up names (``call_id``s as it gave them): 404
        when it is not there (or was abandoned), 409 while it is still in progress."""
        gone = lambda: _not_found(prev, param="previous_response_id")  # noqa: E731
        try:
            found = await self.session_ops.session(owner, prev)
        except SessionNotFound:
            raise gone() from None
        rec, _busy, reply = await self._unfinished(owner, prev, found, gone)
        if not rec.turns:
            raise oa.HttpError(409, f"Previous response with id {prev!r} is still in progress: follow it up once it "
                               f"has completed (retry)", "conflict_error", param="previous_response_id",
                               code="response_in_progress")  # fmt: skip
        return self.reply_calls(prev, reply)[1]

    async def create(self, request: Request) -> Response:
        front = self.front
        rid = new_response_id()
        req: ResponseRequest | None = None

        async def parse(owner: str, body: Any) -> TurnRequest:
            nonlocal req
            req = response_request(body, front.default_max_new_tokens)
            front.check_model(req.model)
            inp = dataclasses.replace(req.inp, session_id=rid)
            if req.previous_response_id is not None:  # 404 / 409 naming the field; the outputs that answer its calls checked
                inp = _answering(inp, req.answers, await self._previous(owner, req.previous_response_id))
            elif req.conversation is not None:  # its items as the whole history; the commit appends the turn's
                if self.in_conversation is None:
                    raise oa.HttpError(404, f"Conversation with id {req.conversation[:140]!r} not found.",
                                       param="conversation", code="not_found")  # fmt: skip
                inp, attach = await self.in_conversation(owner, req, body.get("input"), rid, self.call_id)
                return TurnRequest(inp, oa.RESPONSES_NAMES, resent_history=True, attach=attach)
            return TurnRequest(inp, oa.RESPONSES_NAMES, fork_from=req.previous_response_id or "")

        def on_error(exc: BaseException, err: oa.HttpError) -> oa.HttpError:
            prev = req.previous_response_id if req is not None else None
            if isinstance(exc, SessionNotFound) and prev is not None:  # removed since it was read
                return _not_found(prev, param="previous_response_id")
            return err

        turn = await front.start_turn(request, "Responses", "/v1/responses", rid, parse, on_error, oa.RESPONSES_NAMES)
        if isinstance(turn, oa.HttpError):
            return front.error_response(turn)
        assert req is not None
        answer = _Turn(self, rid, req, turn)
        headers = {"X-Request-Id": turn.request_id}
        if req.stream:
            headers["Cache-Control"] = "no-cache"
            return StreamingResponse(answer.sse(), media_type="text/event-stream", headers=headers)
        return await whole_or_gone(request, answer.whole(), headers)


def _answering(inp: TurnInput, answers: tuple[tuple[int, str], ...], calls: list[ToolCall]) -> TurnInput:
    """``inp`` whose leading tool messages (``answers``: their input index and call_id)
    answer ``calls`` (the previous response's): each names one of them (else 400, as
    OpenAI's), and gets that call's function name."""
    names = {c.id: c.name for c in calls}
    for i, call_id in answers:
        if call_id not in names:
            raise no_call_found(f"input[{i}].call_id", call_id)
    assert inp.messages is not None
    msgs = tuple(dataclasses.replace(m, name=m.name or names.get(m.tool_call_id, "")) if m.role == "tool" else m
                 for m in inp.messages)  # fmt: skip
    return dataclasses.replace(inp, messages=msgs)


def _not_found(rid: str, param: str | None = None) -> oa.HttpError:
    what = "Previous response" if param else "Response"
    return oa.HttpError(404, f"{what} with id {rid!r} not found.", "invalid_request_error", param=param,
                        code="previous_response_not_found" if param else "not_found")  # fmt: skip


class _Turn:
    """One admitted response: the rest of the events as a response object or SSE events."""

    def __init__(self, routes: ResponsesRoutes, rid: str, req: ResponseRequest, turn: HttpTurn) -> None:
        self.routes, self.front, self.turn = routes, routes.front, turn  # turn.end: closed, counted, traced
        self.owner, self.rid, self.req, self.request_id = turn.owner, rid, req, turn.request_id
        self.start = start = turn.start
        self.created = int(time.time())
        self.model = req.model or self.front.model_id
        self.block_size = routes.conversations.model_info.block_size
        self.pieces = routes.conversations.prompts.token_pieces if req.logprobs else None
        self.ext = {"request_id": turn.request_id,
                    "cached_tier": start.cached_tier.value if start.cached_tier is not None and start.cached_tokens
                    else None}  # fmt: skip

    def _object(self, status: str, text: str | None, fin: Finished | None = None,
                lps: list[TokenLogprob] | None = None) -> dict[str, Any]:  # fmt: skip
        calls = tuple(fin.tool_calls) if fin is not None else ()
        logprobs = output_logprobs(lps or [], self.pieces) if self.pieces is not None and text is not None else None
        return response_object(
            self.rid, self.model, self.created, status, text, req=self.req, previous=self.req.previous_response_id,
            usage=response_usage(self.start, fin, self.block_size) if fin is not None else None, logprobs=logprobs,
            incomplete="max_output_tokens" if status == "incomplete" else None, ext=self.ext, calls=calls,
            timings=oa.timings([fin]) if fin is not None else None,
        )  # fmt: skip

    def _ided(self, ev: Any) -> Any:
        """``ev`` with each call's id the response's own (``ResponsesRoutes.call_id``: what
        a retrieve shows and a follow-up's ``function_call_output`` names)."""
        if isinstance(ev, ToolCallDelta) and ev.id:
            ev.id = self.routes.call_id(self.rid, ev.call_index)
        elif isinstance(ev, Finished) and ev.tool_calls:
            ev = dataclasses.replace(ev, tool_calls=tuple(dataclasses.replace(c, id=self.routes.call_id(self.rid, k))
                                                          for k, c in enumerate(ev.tool_calls)))  # fmt: skip
        return ev

    async def _end(self, ok: bool, outcome: int | oa.HttpError, message: str = "") -> None:
        """End the turn (``HttpTurn.end``); a response not stored loses its session once
        the turn is closed: nobody can follow it up."""

        async def drop() -> None:
            if ok and not self.req.store and self.req.conversation is None:  # (a conversation keeps its items)
                try:
                    await self.routes.session_ops.remove(self.owner, self.rid)
                except Exception:  # noqa: BLE001 - best effort; the TTL reaps it otherwise
                    pass

        await self.turn.end(outcome, message, then=drop)

    async def whole(self) -> tuple[dict[str, Any], int]:
        outcome: int | oa.HttpError = 499
        message, ok = "the client went away", False
        lps: list[TokenLogprob] = []
        try:
            async for ev in self.turn.events:
                ev = self._ided(ev)
                if isinstance(ev, Delta) and self.pieces is not None:
                    lps.extend(ev.logprobs)
                elif isinstance(ev, Finished):
                    err = self.turn.finish_error(ev)
                    if err is not None:
                        outcome, message = err, err.message
                        return err.body(), err.status
                    outcome, message, ok = 200, "", True
                    done = "incomplete" if ev.finish_reason == FinishReason.LENGTH else "completed"
                    return self._object(done, ev.text, ev, lps), 200
            raise RuntimeError("the conversation ended without a Finished event")
        except Exception as exc:  # noqa: BLE001 - (CancelledError: the client went away, 499)
            err = self.turn.error_of(exc)
            outcome, message = err, err.message
            return err.body(), err.status
        finally:
            await self._end(ok, outcome, message)

    async def sse(self) -> AsyncIterator[bytes]:
        status, ok, failed = 200, False, None
        out = _Items(self.rid)
        text: list[str] = []
        lps: list[TokenLogprob] = []
        try:
            yield out.event("response.created", response=self._object("in_progress", None))
            yield out.event("response.in_progress", response=self._object("in_progress", None))
            # with tools the items open as their output comes (the message on its first text,
            # a function_call on its call's first piece); without, the message opens at once
            if not self.routes.conversations.tools.parsing(self.req.inp):
                for b in out.open_message():
                    yield b
            async for ev in self.turn.events:
                ev = self._ided(ev)
                if isinstance(ev, Delta):
                    if ev.text or (self.pieces is not None and ev.logprobs):
                        if "message" not in out.order:
                            for b in out.open_message():
                                yield b
                        text.append(ev.text)
                        lps.extend(ev.logprobs)
                        lp = output_logprobs(ev.logprobs, self.pieces) if self.pieces is not None else []
                        yield out.event("response.output_text.delta", **out.where(), delta=ev.text, logprobs=lp)
                elif isinstance(ev, ToolCallDelta):
                    for b in out.call_piece(ev):
                        yield b
                elif isinstance(ev, Finished):
                    err = self.turn.finish_error(ev)
                    if err is not None:
                        status, failed = err.status, err
                        yield out.error(err)
                        break
                    done = "incomplete" if ev.finish_reason == FinishReason.LENGTH else "completed"
                    whole = self._object(done, ev.text, ev, lps)
                    for b in out.finish(whole, ev.text):
                        yield b
                    ok = True
                    yield out.event(f"response.{done}", response=whole)
                    break
        except (asyncio.CancelledError, GeneratorExit):
            status = 499
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            err = self.turn.error_of(exc)
            status, failed = err.status, err
            yield out.error(err)
        finally:
            await self._end(ok, failed or status)


class _Items:
    """A streamed response's SSE events: their sequence numbers, and its output items in the
    order they opened (``order``: "message" or a call's index, the output_index)."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.seq = 0
        self.item_id = "msg_" + rid[len(RESPONSE_PREFIX):]
        self.order: list[Any] = []
        self.args: dict[int, list[str]] = {}

    def event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def error(self, err: oa.HttpError) -> bytes:
        e = err.body()["error"]
        return self.event("error", code=e["code"], message=e["message"], param=e["param"])

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": self.order.index("message"), "content_index": 0}

    def open_message(self) -> list[bytes]:
        self.order.append("message")
        item = {"type": "message", "id": self.item_id, "status": "in_progress", "role": "assistant", "content": []}
        return [self.event("response.output_item.added", output_index=len(self.order) - 1, item=item),
                self.event("response.content_part.added", **self.where(),
                           part={"type": "output_text", "text": "", "annotations": []})]  # fmt: skip

    def call_piece(self, ev: ToolCallDelta) -> list[bytes]:
        """A piece of call ``ev.call_index``: its item opened on its first piece, then its arguments' delta."""
        out, k = [], ev.call_index
        if k not in self.args:
            self.order.append(k)
            self.args[k] = []
            item = function_call_item(self.rid, k, ToolCall(ev.id, ev.name, ""), "in_progress")
            out.append(self.event("response.output_item.added", output_index=len(self.order) - 1, item=item))
        if ev.arguments:
            self.args[k].append(ev.arguments)
            out.append(self.event("response.function_call_arguments.delta", item_id=call_item_id(self.rid, k),
                                  output_index=self.order.index(k), delta=ev.arguments))  # fmt: skip
        return out

    def finish(self, whole: dict[str, Any], text: str) -> list[bytes]:
        """The finished response's items closed, in the order they opened (``whole``'s
        output put in that order): an item the stream never opened is opened first."""
        out = []
        items = {("message" if it["type"] == "message" else int(it["id"].rsplit("_", 1)[1])): it
                 for it in whole["output"]}  # fmt: skip
        if "message" in items and "message" not in self.order:  # no text, no call: an empty message
            out.extend(self.open_message())
        for k in items:
            if k not in self.order:  # a call the stream did not carry (never: the parser streams each)
                self.order.append(k)
                out.append(self.event("response.output_item.added", output_index=len(self.order) - 1,
                                      item={**items[k], "arguments": "", "status": "in_progress"}))  # fmt: skip
        whole["output"] = [items[k] for k in self.order if k in items]
        for at, k in enumerate(self.order):
            if k not in items:
                continue
            it = items[k]
            if k == "message":
                part = it["content"][0]
                out.append(self.event("response.output_text.done", **self.where(), text=text,
                                      logprobs=part.get("logprobs", [])))  # fmt: skip
                out.append(self.event("response.content_part.done", **self.where(), part=part))
            else:
                out.append(self.event("response.function_call_arguments.done", item_id=it["id"], output_index=at,
                                      arguments=it["arguments"]))  # fmt: skip
            out.append(self.event("response.output_item.done", output_index=at, item=it))
        return out
