"""Anthropic's Messages API: ``POST /v1/messages`` (SSE events when ``stream``) and
``POST /v1/messages/count_tokens``, translated onto the chat path, over the HTTP front's
plumbing (``service.http.plumbing``: ``start_turn`` runs the turn; count_tokens is
``Turns.prompt_tokens``: ``Conversations.prepare``, every check a turn runs, released unrun).

A Messages request becomes the ``TurnInput`` a chat completion would (``parse``: pure):
``system`` (a string or text blocks) is a system message, a user message's
``tool_result`` blocks are tool messages (each named after the ``tool_use`` it answers;
``is_error`` prefixes its text with ``Error: ``) followed by its text, an assistant's
``tool_use`` blocks are its calls; ``tools`` (``input_schema``) and ``tool_choice`` (auto,
any: required, tool: a named function, none; ``disable_parallel_tool_use``) go through
``service/tools`` as on the OpenAI front (forced calls by the grammar engine);
``max_tokens`` (required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` are the
sampling's; ``metadata`` (``user_id``), ``service_tier`` and ``thinking`` disabled are
accepted and change nothing. Any other field is refused (400 naming it).

``cache_control`` (``{"type": "ephemeral", "ttl": "5m" | "1h"}``) on a tool, a system
block or a message block is a breakpoint: the turn retains (docs/api.md, Retention) the
prompt's prefix up to the LAST breakpoint for the LONGEST ttl any breakpoint asked
(one ``Retain``: every earlier breakpoint's prefix lies inside it). The prefix's tokens
are where the rendering of the messages up to that block stops agreeing with the whole
prompt's (``retain_of``); a breakpoint on the request's last block retains the whole
prompt.

Errors are Anthropic's shape ``{"type": "error", "error": {"type", "message"}}`` with the
OpenAI front's statuses (``ERROR_TYPES``); the key comes from ``x-api-key`` or
``Authorization: Bearer`` (the same ``--api-keys``, ``Plumbing.tenant``); ``anthropic-version`` and
``anthropic-beta`` are accepted whatever they say. Usage is kvserve's own blocks':
``cache_read_input_tokens`` (``Finished.cache_read_tokens``), ``cache_creation_input_tokens``
(``Finished.cache_creation_tokens``, per ttl in ``cache_creation``) and ``input_tokens``
the rest of the prompt. ``X-Session-Id`` works as on chat (the messages are the whole
history, matched against the session's record).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .. import wire
from . import openai as oa
from .plumbing import HttpTurn, Plumbing, TurnRequest, whole_or_gone
from ..auth import MISSING_CREDENTIALS, Unauthenticated
from ..tools import uses_tools
from ..types import (
    ChatMessage,
    Delta,
    Finished,
    FinishReason,
    ResponseFormat,
    Retain,
    SamplingParams,
    Started,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    TurnInput,
)

if TYPE_CHECKING:
    from ..conversations import Conversations

FIELDS = {
    "model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "metadata", "tools", "tool_choice", "service_tier", "thinking", "cache_control", "output_config",
}  # fmt: skip
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "output_config"}
# Fields of features kvserve lacks: accepted when null
NULL_ONLY = ("container", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id", "mcp_servers",
             "context_management")  # fmt: skip
TTLS: Mapping[str, float] = {"5m": 300.0, "1h": 3600.0}  # cache_control ttl -> seconds
# HTTP status -> Anthropic's error type (the statuses are the OpenAI front's)
ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error",
}  # fmt: skip
NAMES: Mapping[str, str] = {
    **oa.chat_names("max_tokens"), "sampling.stop": "stop_sequences", "stop strings": "stop_sequences",
    "stop": "stop_sequences", ".function.name": ".name", ".function.parameters": ".input_schema",
    ".tool_call_id": ".tool_use_id",
}  # fmt: skip
MISSING_KEY = "missing API key: send the header 'x-api-key: <api key>' (or 'Authorization: Bearer <api key>')"


def error_body(err: oa.HttpError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def bad(message: str) -> oa.HttpError:
    return oa.HttpError(400, message)


@dataclass(frozen=True)
class Breakpoint:
    """The last ``cache_control`` of a request: where (``part``: tools, system or
    messages; ``index`` of the tool or message, ``block`` in it) and the longest ttl."""

    part: str
    index: int
    block: int
    ttl_s: float
    last: bool  # on the request's last block: the whole prompt


@dataclass(frozen=True)
class MessagesRequest:
    model: str | None
    inp: TurnInput
    stream: bool
    system: tuple[str, ...]  # the system blocks' texts
    messages: tuple[Any, ...]  # as sent (a prefix is rendered from them)
    breakpoint: Breakpoint | None
    names: Mapping[str, str] = dataclasses.field(default_factory=lambda: NAMES)  # domain -> the request's fields


# ----------------------------------------------------------------------------- parsing


def _cache_control(value: Any, where: str) -> float | None:
    """A block's ``cache_control``: its ttl in seconds (None: not a breakpoint)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "ephemeral" or set(value) - {"type", "ttl"}:
        raise bad(f'{where}.cache_control must be {{"type": "ephemeral", "ttl": "5m" | "1h"}}')
    ttl = value.get("ttl", "5m")
    if ttl not in TTLS:
        raise bad(f"{where}.cache_control.ttl must be \"5m\" or \"1h\", got {json.dumps(ttl)[:40]}")
    return TTLS[ttl]


def _blocks(value: Any, where: str) -> list[dict[str, Any]]:
    """Content as blocks: a string is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list) or not all(isinstance(b, dict) for b in value):
        raise bad(f"{where} must be a string or a list of content blocks")
    return value


_BLOCK_KEYS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
}


def _text(block: Mapping[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text must be a string")
    return block["text"]


def _result_text(block: Mapping[str, Any], where: str) -> str:
    """A tool_result's content (a string or text blocks), ``Error: `` first with is_error."""
    content = block.get("content", "")
    parts = [_text(b, f"{where}.content[{k}]") if b.get("type") == "text" else _refuse_block(b, f"{where}.content[{k}]")
             for k, b in enumerate(_blocks(content, f"{where}.content"))]  # fmt: skip
    if block.get("is_error") not in (None, False, True):
        raise bad(f"{where}.is_error must be a boolean")
    return ("Error: " if block.get("is_error") else "") + "".join(parts)


def _refuse_block(block: Mapping[str, Any], where: str) -> str:
    kind = block.get("type")
    raise oa.unsupported(where, f"content blocks of type {json.dumps(kind)[:40]} are not supported (text, tool_use, "
                         "tool_result)")  # fmt: skip


def _message(m: Any, i: int, names: dict[str, str], limit: int | None = None,
             origins: list[str] | None = None) -> list[ChatMessage]:  # fmt: skip
    """One Messages message as chat messages (its first ``limit`` blocks only, when set);
    ``names``: tool_use id -> tool name, filled by assistant messages, read by results;
    ``origins`` gets where each chat message came from (``messages[i]``, a result's block)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
        raise bad(f'{where} must be {{"role": "user" | "assistant", "content": ...}}')
    role, blocks = m["role"], _blocks(m.get("content"), f"{where}.content")
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, b in enumerate(blocks[:limit] if limit is not None else blocks):
        w = f"{where}.content[{j}]"
        kind = b.get("type")
        if kind not in _BLOCK_KEYS:
            _refuse_block(b, w)
        if extra := sorted(k for k in set(b) - _BLOCK_KEYS[kind] if b[k] is not None):  # null: what SDKs dump
            raise oa.unsupported(f"{w}.{extra[0]}", "kvserve does not support it")
        _cache_control(b.get("cache_control"), w)
        if kind == "text":
            texts.append(_text(b, w))
        elif kind == "tool_use" and role == "assistant":
            if not (isinstance(b.get("id"), str) and isinstance(b.get("name"), str) and isinstance(b.get("input"), dict)):
                raise bad(f"{w}: a tool_use block needs id, name (strings) and input (an object)")
            names[b["id"]] = b["name"]
            calls.append(ToolCall(b["id"], b["name"], json.dumps(b["input"], ensure_ascii=False)))
        elif kind == "tool_result" and role == "user":
            if texts:
                raise bad(f"{w}: tool_result blocks must come before any text in a user message")
            if not isinstance(b.get("tool_use_id"), str):
                raise bad(f"{w}.tool_use_id must be a string")
            out.append(ChatMessage("tool", _result_text(b, w), tool_call_id=b["tool_use_id"],
                                   name=names.get(b["tool_use_id"], "")))  # fmt: skip
            if origins is not None:
                origins.append(w)
        else:
            raise bad(f"{w}: a {kind} block belongs in {'an assistant' if kind == 'tool_use' else 'a user'} message")
    if texts or calls or not out:
        out.append(ChatMessage(role, "".join(texts), tuple(calls)))
        if origins is not None:
            origins.append(where)
    return out


def _system(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    blocks = _blocks(value, "system")
    for j, b in enumerate(blocks):
        if b.get("type") != "text" or set(b) - _BLOCK_KEYS["text"]:
            raise oa.unsupported(f"system[{j}]", "system takes text blocks (type, text, cache_control)")
        _cache_control(b.get("cache_control"), f"system[{j}]")
    return tuple(_text(b, f"system[{j}]") for j, b in enumerate(blocks))


def chat_messages(system: Sequence[str], messages: Sequence[Any], upto: tuple[int, int] | None = None,
                  origins: list[str] | None = None) -> tuple[ChatMessage, ...]:  # fmt: skip
    """The chat messages of a request; ``upto`` (message, block): only that far;
    ``origins`` gets where each came from in the request."""
    out = [ChatMessage("system", "".join(system))] if system else []
    if system and origins is not None:
        origins.append("system")
    names: dict[str, str] = {}
    for i, m in enumerate(messages if upto is None else messages[: upto[0] + 1]):
        out.extend(_message(m, i, names, upto[1] + 1 if upto is not None and i == upto[0] else None, origins))
    return tuple(out)


def field_names(origins: Sequence[str]) -> dict[str, str]:
    """``NAMES`` with each chat message's index (as the domain's errors name it) renamed to
    where it came from in the request (a result's block, the system)."""
    out = dict(NAMES)
    for k, where in enumerate(origins):
        out[f"messages[{k}]"] = out[f"chat.messages[{k}]"] = where
    return out


_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
_CHOICE_KEYS = {"type", "name", "disable_parallel_tool_use"}


def _tools(body: Mapping[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice | None, bool]:
    raw = body.get("tools") or []
    if not isinstance(raw, list):
        raise bad("tools must be a list")
    tools = []
    for i, t in enumerate(raw):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise oa.unsupported(w, "only custom tools (name, description, input_schema) are supported")
        if extra := sorted(set(t) - _TOOL_KEYS):
            raise oa.unsupported(f"{w}.{extra[0]}")
        if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise bad(f"{w} needs name (a string) and input_schema (a JSON schema object)")
        if not isinstance(t.get("description", ""), str):
            raise bad(f"{w}.description must be a string")
        _cache_control(t.get("cache_control"), w)
        tools.append(ToolSpec(t["name"], t.get("description", ""), json.dumps(t["input_schema"])))
    choice = body.get("tool_choice")
    if choice is None:
        return tuple(tools), None, True
    kinds = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    if not isinstance(choice, dict) or choice.get("type") not in kinds or set(choice) - _CHOICE_KEYS:
        raise bad('tool_choice must be {"type": "auto" | "any" | "tool" | "none"} (with "name" for tool)')
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise bad("tool_choice.name must be a string (the tool to call)")
    if choice.get("disable_parallel_tool_use") not in (None, True, False):
        raise bad("tool_choice.disable_parallel_tool_use must be a boolean")
    tc = ToolChoice(kinds[choice["type"]], choice.get("name", "") if choice["type"] == "tool" else "")
    return tuple(tools), tc, not choice.get("disable_parallel_tool_use")


def _breakpoint(body: Mapping[str, Any], system: Any, messages: Sequence[Any]) -> Breakpoint | None:
    """The last cache_control of the request (tools, then system, then messages) with the
    longest ttl of them all; None when there is none."""
    found: list[tuple[str, int, int, float]] = []
    for i, t in enumerate(body.get("tools") or []):
        if (ttl := _cache_control(t.get("cache_control"), f"tools[{i}]")) is not None:
            found.append(("tools", i, 0, ttl))
    for j, b in enumerate(_blocks(system, "system") if system is not None else []):
        if (ttl := _cache_control(b.get("cache_control"), f"system[{j}]")) is not None:
            found.append(("system", 0, j, ttl))
    for i, m in enumerate(messages):
        for j, b in enumerate(_blocks(m.get("content"), f"messages[{i}].content")):
            if (ttl := _cache_control(b.get("cache_control"), f"messages[{i}].content[{j}]")) is not None:
                found.append(("messages", i, j, ttl))
    if (ttl := _cache_control(body.get("cache_control"), "request")) is not None:  # automatic: the last block
        found.append(("messages", len(messages) - 1, len(_blocks(messages[-1].get("content"), "")) - 1, ttl))
    if not found:
        return None
    if len(found) > 4:
        raise bad(f"A maximum of 4 blocks with cache_control may be provided. Found {len(found)}.")
    part, i, j, _ = found[-1]
    last = part == "messages" and i == len(messages) - 1 and j == len(_blocks(messages[-1].get("content"), "")) - 1
    return Breakpoint(part, i, j, max(f[3] for f in found), last)


def _number(body: Mapping[str, Any], name: str, integer: bool = False) -> Any:
    value = body.get(name)
    ok = isinstance(value, int) if integer else isinstance(value, (int, float)) and abs(value) < float("inf")
    if value is not None and (isinstance(value, bool) or not ok):
        raise bad(f"{name} must be a{'n integer' if integer else ' number'}, got {json.dumps(value)[:40]}")
    return value


def _output_format(body: Mapping[str, Any]) -> ResponseFormat | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": {...}}``): structured
    output through the grammar engine; ``effort`` is refused (no reasoning here)."""
    cfg = body.get("output_config")
    if cfg is None:
        return None
    if not isinstance(cfg, dict) or set(cfg) - {"format", "effort"} or cfg.get("effort") is not None:
        raise oa.unsupported("output_config", "takes format only (kvserve has no effort levels)")
    fmt = cfg.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict) \
            or set(fmt) != {"type", "schema"}:  # fmt: skip
        raise bad('output_config.format must be {"type": "json_schema", "schema": {...}}')
    return ResponseFormat("json_schema", json.dumps(fmt["schema"]))


def _sampling(body: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop_sequences must be a list of strings")
    temperature, top_p, top_k = _number(body, "temperature"), _number(body, "top_p"), _number(body, "top_k", True)
    if temperature is not None and not 0 <= temperature <= 1:
        raise bad(f"temperature: range: 0 <= temperature <= 1, got {temperature}")
    return SamplingParams(max_new_tokens=max_tokens, temperature=1.0 if temperature is None else float(temperature),
                          top_p=1.0 if top_p is None else float(top_p), top_k=top_k or 0, stop=tuple(stops))  # fmt: skip


def parse(body: Any, *, count: bool = False) -> MessagesRequest:
    """A /v1/messages body (``count``: a /v1/messages/count_tokens one) as a chat turn."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for name in body:
        if name not in (COUNT_FIELDS if count else FIELDS) and not (name in NULL_ONLY and body[name] is None):
            raise oa.unsupported(name, "Extra inputs are not permitted")
    if not isinstance(body.get("model"), str):
        raise bad("model: Field required (a string)")
    if body.get("thinking") not in (None, {"type": "disabled"}):
        raise oa.unsupported("thinking", "kvserve serves no extended thinking (send {\"type\": \"disabled\"} or omit it)")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or set(meta) - {"user_id"}
                             or not isinstance(meta.get("user_id", ""), (str, type(None)))):  # fmt: skip
        raise bad("metadata takes user_id (a string)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages: Field required (a non-empty list)")
    max_tokens = _number(body, "max_tokens", True)
    if not count and max_tokens is None:
        raise bad("max_tokens: Field required")
    if not count and max_tokens < 1:
        raise bad(f"max_tokens: must be at least 1, got {max_tokens}")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean")
    system = _system(body.get("system"))
    tools, choice, parallel = _tools(body)
    origins: list[str] = []
    msgs = chat_messages(system, messages, origins=origins)
    sampling = dataclasses.replace(_sampling(body, max_tokens or 1), response_format=_output_format(body))
    inp = TurnInput(messages=msgs, sampling=sampling, max_new_tokens=max_tokens, tools=tools, tool_choice=choice,
                    parallel_tool_calls=parallel)  # fmt: skip
    return MessagesRequest(body["model"], inp, stream, system, tuple(messages),
                           _breakpoint(body, body.get("system"), messages), field_names(origins))  # fmt: skip


# ----------------------------------------------------------------------------- tokens


def prompt_ids(conv: Conversations, inp: TurnInput, messages: Sequence[ChatMessage] | None = None) -> list[int]:
    """The tokens of ``messages`` (default: the request's) as a first turn's prompt, with
    the request's tools (blocking: run it off the event loop)."""
    msgs = list(messages if messages is not None else inp.messages or ())
    if uses_tools(inp):
        return conv.tools.encode_turn([], msgs, inp.tools)
    return conv.tools.tokenizer.encode_chat_turn([], [{"role": m.role, "content": m.content} for m in msgs])


def retain_of(conv: Conversations, req: MessagesRequest) -> tuple[Retain, ...]:
    """The request's retention (blocking): the prefix up to its last breakpoint, for the
    longest ttl asked; the tokens where that prefix's rendering leaves the whole prompt's.
    A template that cannot render the prefix alone retains the whole prompt."""
    bp = req.breakpoint
    if bp is None:
        return ()
    if bp.last:
        return (Retain(bp.ttl_s, hint=True),)
    if bp.part == "messages":
        upto: tuple[int, int] | None = (bp.index, bp.block)
    else:  # tools or system: render the system (up to the block) and an empty user turn
        upto = None
    try:
        full = prompt_ids(conv, req.inp)
        if upto is not None:
            prefix = chat_messages(req.system, req.messages, upto)
        else:
            # a tool breakpoint keeps the system text too: templates render it beside the tools
            system = req.system[: bp.block + 1] if bp.part == "system" else req.system
            prefix = chat_messages(system, [{"role": "user", "content": ""}])
        part = prompt_ids(conv, req.inp, prefix)
    except ValueError:  # the tokenizer's ChatTemplateError: the template refused the prefix alone
        return (Retain(bp.ttl_s, hint=True),)
    same = next((k for k, (a, b) in enumerate(zip(full, part)) if a != b), min(len(full), len(part)))
    return (Retain(bp.ttl_s, same, hint=True),) if same else ()


# ----------------------------------------------------------------------------- responses


def usage(prompt: int, read: int, created: int, output: int, by_ttl: Mapping[float, int] | None = None) -> dict[str, Any]:
    by_ttl = by_ttl or {}
    return {
        "input_tokens": max(0, prompt - read - created), "output_tokens": output,
        "cache_read_input_tokens": read, "cache_creation_input_tokens": created,
        "cache_creation": {"ephemeral_5m_input_tokens": by_ttl.get(TTLS["5m"], 0),
                           "ephemeral_1h_input_tokens": by_ttl.get(TTLS["1h"], 0)},
    }  # fmt: skip


def final_usage(fin: Finished) -> dict[str, Any]:
    by_ttl: dict[float, int] = {}
    for r in fin.retained:
        key = TTLS["1h"] if r.ttl_s > TTLS["5m"] else TTLS["5m"]
        by_ttl[key] = by_ttl.get(key, 0) + r.created_tokens
    return usage(fin.prompt_tokens, fin.cache_read_tokens, fin.cache_creation_tokens, fin.completion_tokens, by_ttl)


def start_usage(start: Started) -> dict[str, Any]:
    """``message_start``'s usage, before the turn ran: creation at most what it will retain."""
    return usage(start.prompt_tokens, start.cached_tokens, max(0, start.retain_tokens - start.cached_tokens), 0)


def stop_of(fin: Finished, stops: Sequence[str], decode: Any) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence``: a stop string ended it when the output's
    decoded tokens go on with it after the text (the text stops before it)."""
    if fin.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if fin.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if stops:
        tail = decode(fin.output_token_ids)[len(fin.text):]
        for s in stops:
            if tail.startswith(s):
                return "stop_sequence", s
    return "end_turn", None


def tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return {"_raw": arguments}  # the model wrote no JSON (tool_choice auto): its text as is
    return value if isinstance(value, dict) else {"_value": value}


def content_of(fin: Finished) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "text", "text": fin.text}] if fin.text or not fin.tool_calls else []
    out += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)} for c in fin.tool_calls]
    return out


def message_body(msg_id: str, model: str, fin: Finished, stops: Sequence[str], decode: Any,
                 ext: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    reason, seq = stop_of(fin, stops, decode)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content_of(fin),
            "stop_reason": reason, "stop_sequence": seq, "usage": final_usage(fin), "kvserve": ext}  # fmt: skip


def sse_event(kind: str, obj: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + json.dumps({"type": kind, **obj}, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------------------- routes


class MessagesRoutes:
    """``/v1/messages`` (a turn through ``Plumbing.start_turn``) and
    ``/v1/messages/count_tokens`` over the HTTP front's plumbing."""

    def __init__(self, plumbing: Plumbing) -> None:
        self.plumbing = plumbing

    @staticmethod
    def error_response(err: oa.HttpError, request_id: str = "") -> Response:
        """Anthropic's error object; 429 and 503 say when to retry (``Retry-After``)."""
        headers = {"request-id": request_id} if request_id else {}
        if err.status in oa.RETRY_AFTER_S:
            headers["Retry-After"] = str(oa.RETRY_AFTER_S[err.status])
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    @staticmethod
    def _anthropic_words(exc: BaseException, err: oa.HttpError) -> oa.HttpError:
        """A missing key is asked for as Anthropic's clients send it."""
        if isinstance(exc, Unauthenticated) and str(exc) == MISSING_CREDENTIALS:
            err.message = MISSING_KEY
        return err

    def _parse(self, body: Any, count: bool) -> MessagesRequest:
        req = parse(body, count=count)
        if req.model != self.plumbing.model_id:
            raise oa.HttpError(404, f"model: {req.model!r} does not exist; this server serves "
                               f"{self.plumbing.model_id!r}", "not_found_error")  # fmt: skip
        return req

    async def count_tokens(self, request: Request) -> Response:
        """The prompt's tokens as the turn would render them (its tools checked)."""
        front, request_id, names = self.plumbing, wire.new_request_id(), NAMES
        try:
            front.turns.check_serving()
            owner = front.tenant(request)
            req = self._parse(await front.body(request), count=True)
            names = req.names
            counted = await front.turns.prompt_tokens(owner, req.inp, request_id)  # every check the turn runs
        except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
            err = self._anthropic_words(exc, front.error_of(exc, request_id, names))
            front.count("CountTokens", err)
            return self.error_response(err, request_id)
        front.count("CountTokens", 200)
        return JSONResponse({"input_tokens": counted}, headers={"request-id": request_id})

    async def create(self, request: Request) -> Response:
        front = self.plumbing
        session_id = request.headers.get("x-session-id", "")
        parsed: MessagesRequest | None = None

        async def translate(owner: str, body: Any) -> TurnRequest:
            nonlocal parsed
            parsed = req = self._parse(body, count=False)
            inp = dataclasses.replace(req.inp, session_id=session_id)
            if req.breakpoint is not None:
                inp = dataclasses.replace(inp, retain=await asyncio.to_thread(retain_of, front.conversations, req))
            return TurnRequest(inp, req.names, resent_history=bool(session_id))

        turn = await front.start_turn(request, "Messages", "/v1/messages", session_id, translate,
                                      on_error=self._anthropic_words, names=NAMES)  # fmt: skip
        if isinstance(turn, oa.HttpError):
            return self.error_response(turn)
        assert parsed is not None
        start = turn.start
        ext = oa.extension(turn.request_id, session_id, start, start.history_diverged_at, start.history_rewound_turns)
        message = _Message(turn, parsed, ext, front.conversations.tools.tokenizer.decode)
        headers = {"request-id": turn.request_id, "X-Request-Id": turn.request_id}
        if session_id:
            headers["X-Session-Id"] = session_id
        if parsed.stream:
            headers["Cache-Control"] = "no-cache"
            return StreamingResponse(message.sse(), media_type="text/event-stream", headers=headers)
        return await whole_or_gone(request, message.whole(), headers)


class _Message:
    """One admitted message: the rest of the turn's events as a message object or SSE."""

    def __init__(self, turn: HttpTurn, req: MessagesRequest, ext: dict[str, Any], decode: Any) -> None:
        self.turn, self.req, self.ext, self.decode = turn, req, ext, decode  # turn.end closes, counts, traces
        self.id = "msg_" + turn.request_id
        self.model = req.model or turn.plumbing.model_id
        self.stops = req.inp.sampling.stop

    async def whole(self) -> tuple[dict[str, Any], int]:
        outcome: int | oa.HttpError = 499  # unless the call gets further
        message = "the client went away"
        try:
            async for ev in self.turn.events:
                if isinstance(ev, Finished):
                    err = self.turn.finish_error(ev)
                    if err is not None:
                        outcome, message = err, err.message
                        return error_body(err), err.status
                    outcome, message = 200, ""
                    return message_body(self.id, self.model, ev, self.stops, self.decode, self.ext), 200
            raise RuntimeError("the conversation ended without a Finished event")
        except Exception as exc:  # noqa: BLE001 - (CancelledError: the client went away, 499)
            err = self.turn.error_of(exc)
            outcome, message = err, err.message
            return error_body(err), err.status
        finally:
            await self.turn.end(outcome, message)

    async def sse(self) -> AsyncIterator[bytes]:
        """message_start, ping, per block content_block_start / _delta / _stop (text
        blocks as text comes, a tool_use block per call), message_delta (stop_reason, the
        final usage), message_stop; an ``error`` event when the turn fails."""
        outcome: int | oa.HttpError = 200
        blocks = _Blocks()
        try:
            message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                       "stop_reason": None, "stop_sequence": None, "usage": start_usage(self.turn.start)}  # fmt: skip
            yield sse_event("message_start", {"message": message})
            yield sse_event("ping", {})
            async for ev in self.turn.events:
                if isinstance(ev, Delta) and ev.text:
                    for out in blocks.text(ev.text):
                        yield out
                elif isinstance(ev, ToolCallDelta):
                    for out in blocks.call(ev):
                        yield out
                elif isinstance(ev, Finished):
                    err = self.turn.finish_error(ev)
                    if err is not None:
                        outcome = err
                        yield sse_event("error", {"error": error_body(err)["error"]})
                        break
                    for out in blocks.end():
                        yield out
                    reason, seq = stop_of(ev, self.stops, self.decode)
                    yield sse_event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                                      "usage": final_usage(ev)})  # fmt: skip
                    yield sse_event("message_stop", {})
                    break
        except (asyncio.CancelledError, GeneratorExit):
            outcome = 499  # the client went away
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            err = self.turn.error_of(exc)
            outcome = err
            yield sse_event("error", {"error": error_body(err)["error"]})
        finally:
            await self.turn.end(outcome)


class _Blocks:
    """The content blocks of a streamed message: which one is open, their indexes."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        out = self._stop()
        self.index += 1
        self.open = block["type"]
        return out + [sse_event("content_block_start", {"index": self.index, "content_block": block})]

    def _stop(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"index": self.index})]

    def text(self, text: str) -> list[bytes]:
        out = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return out + [sse_event("content_block_delta", {"index": self.index,
                                                        "delta": {"type": "text_delta", "text": text}})]  # fmt: skip

    def call(self, d: ToolCallDelta) -> list[bytes]:
        out = self._start({"type": "tool_use", "id": d.id, "name": d.name, "input": {}}) if d.name else []
        if d.arguments:
            delta = {"type": "input_json_delta", "partial_json": d.arguments}
            out.append(sse_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def end(self) -> list[bytes]:
        """Close the open block (an empty text block when the message had none)."""
        out = self._start({"type": "text", "text": ""}) if self.index < 0 else []
        return out + self._stop()


__all__ = ["MessagesRoutes", "parse", "retain_of", "usage", "error_body"]
