"""OpenAI JSON <-> domain: pure functions (no I/O, no engine, no sessions), like
``service.wire`` is for protobuf.

``chat_request``/``completion_request`` check a request body field by field and turn it
into a ``TurnInput`` (plus what the response needs: stream, include_usage); a field
kvserve does not support is refused (``HttpError`` 400 naming it), never ignored.
``error_of`` maps a domain error (through ``service.wire.status_of``, the one status
table) to an HTTP status and OpenAI's error object.

Sampling fields, one to one:

=========================================  ==========================================
OpenAI                                     kvserve
=========================================  ==========================================
max_completion_tokens / max_tokens         max_new_tokens (unset: the server default,
                                           fitted to the context left)
temperature, top_p, seed                   the same
stop (string or list)                      stop
top_k, repetition_penalty, ignore_eos,     the same (extensions, as vLLM names them)
stop_token_ids, cache_salt
n                                          n (1 to 16; choices by index, streamed
                                           interleaved; not with X-Session-Id)
best_of                                    1 only
frequency_penalty, presence_penalty        the same ([-2, 2]; counted over this reply's
                                           tokens, as vLLM does)
logit_bias                                 logit_bias (token id strings -> [-100, 100])
min_p, min_tokens                          min_p, min_new_tokens (vLLM's extensions)
speculative (a boolean),                   speculative, spec_max_draft (kvserve's switch;
speculative.n_max (llama.cpp's name)       n_max 0: off, as llama.cpp reads it)
response_format (chat)                     text: free text; json_object and
                                           json_schema (its ``schema``): the
                                           response_format of SamplingParams
                                           (llama.cpp's json_object + schema: that
                                           schema; the peers' constraint fields:
                                           ``output_constraint``, one per request)
logprobs + top_logprobs (chat),            logprobs (top_logprobs, or 0): OpenAI's
logprobs (completions)                     shapes (chat_logprobs, completion_logprobs)
tools, tool_choice, parallel_tool_calls    tools, tool_choice (none, auto, required, a
                                           named function), parallel_tool_calls
                                           (service/tools; docs/api.md, Tools)
messages: tool_calls, role tool            assistant tool_calls, tool results
                                           (tool_call_id, name)
functions, function_call, echo, suffix,    refused (400 unsupported_parameter) unless
reasoning_effort, verbosity, audio, ...    null / empty
prompt_cache_retention                     retain: the whole prompt for 5 min
                                           ("in_memory") or 24 h ("24h")
user, metadata, store, service_tier,       accepted; they change nothing
prompt_cache_key, safety_identifier,
stream_options
the peers' and routers' fields             service/http/peers.py's table: honoured,
(no_stop_trim, skip_special_tokens, ...)   ignored, or accepted at their default only
=========================================  ==========================================

Messages take what an SDK's own response message dumps (refusal, tool_calls,
function_call, audio, annotations, parsed: null or empty). ``error_of`` speaks OpenAI's
vocabulary: ``context_length_exceeded``, the request's field names (``names``: the
domain's -> the route's) in the message and ``param``, an HTTP-worded 401.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import grpc

from . import peers
from .. import wire
from ..auth import MISSING_CREDENTIALS, Unauthenticated
from ..errors import SessionBusy, SessionConflict, SessionExists, SessionNotFound, TurnsChanged, TurnUnavailable
from ..types import (
    MAX_LOGIT_BIAS,
    ChatMessage,
    ContextOverflow,
    Finished,
    FinishReason,
    ResponseFormat,
    Retain,
    SamplingParams,
    Started,
    Tier,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    TokenLogprob,
    TurnInput,
)

# gRPC status (service/wire.py's table) -> HTTP status and OpenAI error type, as
# google.rpc's HTTP mapping has it except FAILED_PRECONDITION: google.rpc's 400 is kept
# for the cases a retry never mends (``SESSION_ERRORS``: a turn unavailable), while the
# session errors that are races (busy, overtaken, turns changed) are 409 conflicts, as
# clients treat them (the OpenAI SDKs' ConflictError, retried by them). ALREADY_EXISTS is
# google.rpc's 409 too; ``error.code`` tells every case apart (docs/api.md's table).
HTTP_OF_CODE: Mapping[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),  # the metrics' label of a 409
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.INTERNAL: (500, "internal_error"),
}

_COMMON_FIELDS = {
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
    "frequency_penalty", "presence_penalty", "user", "metadata", "store", "logprobs", "logit_bias",
    "top_k", "repetition_penalty", "ignore_eos", "stop_token_ids", "cache_salt", "min_p", "min_tokens",
    "service_tier", "prompt_cache_key", "safety_identifier", "speculative", "speculative.n_max",
}  # fmt: skip
CHAT_FIELDS = _COMMON_FIELDS | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
    "response_format", "parallel_tool_calls", "reasoning_effort", "modalities", "verbosity", "prediction", "audio",
    "web_search_options", "prompt_cache_retention",
} | peers.names(peers.CHAT)  # fmt: skip
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # accepted; one tier here
# Fields that change a reply only on models or features kvserve lacks: null (what SDKs send back) is accepted.
_NULL_ONLY = ("reasoning_effort", "verbosity", "prediction", "audio", "web_search_options")
# The message fields an SDK's own ChatCompletionMessage.model_dump() carries back, empty.
_EMPTY_MESSAGE_FIELDS = ("refusal", "tool_calls", "function_call", "audio", "annotations", "parsed")
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"} | peers.names(peers.COMPLETIONS)


class HttpError(Exception):
    """Ends a request with ``status`` and OpenAI's error object."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.grpc_code: grpc.StatusCode | None = None  # error_of's: the code kvserve_requests_total counts it under

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# gRPC status -> OpenAI's error code (the ``code`` of the error object)
CODE_OF_STATUS: Mapping[grpc.StatusCode, str] = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_value",
    grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
    grpc.StatusCode.PERMISSION_DENIED: "permission_denied",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "already_exists",
    grpc.StatusCode.FAILED_PRECONDITION: "conflict",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    grpc.StatusCode.UNAVAILABLE: "service_unavailable",
    grpc.StatusCode.INTERNAL: "internal_error",
}
# Session errors -> (HTTP status, error type, error code): every FAILED_PRECONDITION and
# ALREADY_EXISTS case its own code
SESSION_ERRORS: Mapping[type, tuple[int, str, str]] = {
    SessionExists: (409, "conflict_error", "already_exists"),  # a fork to an id the tenant has
    SessionBusy: (409, "conflict_error", "session_busy"),  # a turn in flight: retry when it ends
    SessionConflict: (409, "conflict_error", "session_conflict"),  # another replica's write overtook the turn
    TurnsChanged: (409, "conflict_error", "turns_changed"),  # expected_turns: another turn changed it
    TurnUnavailable: (400, "invalid_request_error", "turn_unavailable"),  # never there: no retry mends it
}
RETRY_AFTER_S: Mapping[int, int] = {429: 1, 503: 2}  # the Retry-After of a status (seconds)
HTTP_MISSING_CREDENTIALS = "missing API key: send the header 'Authorization: Bearer <api key>'"


def rename_fields(message: str, names: Mapping[str, str]) -> str:
    """``message`` with the domain's field names replaced by the request's (``names``;
    its ``prompt`` entry names the field of a context overflow only)."""
    keys = [k for k in names if k != "prompt"]
    if not keys:
        return message
    pattern = "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
    return re.sub(rf"(?<![\w.])({pattern})(?![\w])", lambda m: names[m.group(1)], message)  # "text:" ends in \W


def param_of(message: str) -> str | None:
    """The request field an error message names first (``messages[2].role``), if any."""
    m = re.match(r"([a-z_]+(?:\.[a-z_]+)?)((?:\[\d+\]|\.[a-z_]+)*)", message)
    if m is None:
        return None
    if m.group(1) in _PARAMS:
        return m.group(1) + m.group(2)
    head = m.group(1).split(".")[0]
    return head if head in _PARAMS else None


def error_of(
    exc: BaseException, request_id: str, names: Mapping[str, str] | None = None, context_length: int = 0
) -> HttpError:
    """The HTTP error of a domain error or ``RpcStatus`` (unexpected ones: 500 naming the
    request id), in OpenAI's vocabulary: its error codes (``context_length_exceeded``
    for a prompt that does not fit), the request's field names (``names``: domain ->
    OpenAI) in the message and in ``param``, an HTTP-worded 401."""
    if isinstance(exc, HttpError):
        return exc
    status = wire.failure(exc, "http", request_id) if isinstance(exc, Exception) else None
    if status is None:
        return HttpError(500, f"internal error (request id {request_id})", "internal_error", code="internal_error")
    http, kind = HTTP_OF_CODE.get(status.code, (500, "internal_error"))
    code = CODE_OF_STATUS.get(status.code, "internal_error")
    names = names if names is not None else {}
    message = rename_fields(status.details, names)
    param = param_of(message) if http == 400 else None
    if isinstance(exc, ContextOverflow):
        code, param = "context_length_exceeded", names.get("prompt", "messages")
        ctx = f"This model's maximum context length is {context_length} tokens. " if context_length else ""
        message = f"{ctx}{message[:1].upper()}{message[1:]}. Please reduce the length of the {param}."
    elif isinstance(exc, Unauthenticated):
        message = HTTP_MISSING_CREDENTIALS if str(exc) == MISSING_CREDENTIALS else message
    elif isinstance(exc, SessionNotFound):
        code = "session_not_found"
    elif type(exc) in SESSION_ERRORS:
        http, kind, code = SESSION_ERRORS[type(exc)]
    err = HttpError(http, message, kind, param=param, code=code)
    err.grpc_code = status.code  # a 409 already_exists counts as ALREADY_EXISTS, a 400 turn_unavailable as FAILED_PRECONDITION
    return err


def unsupported(name: str, why: str = "kvserve does not support it") -> HttpError:
    return HttpError(400, f"{name}: {why}", param=name, code="unsupported_parameter")


# The domain's field names (gRPC's, as service.validation's messages spell them) -> the
# OpenAI request's, per route: an error's message and param name the field the client sent.
_BASE_NAMES: Mapping[str, str] = {
    "min_new_tokens": "min_tokens", "sampling.stop_token_ids": "stop_token_ids", "sampling.stop": "stop",
    "stop strings": "stop", "stop_token_ids": "stop_token_ids", "speculative_max_draft": "speculative.n_max",
}  # fmt: skip


def chat_names(max_name: str = "max_completion_tokens") -> Mapping[str, str]:
    return {**_BASE_NAMES, "max_new_tokens": max_name, "chat.messages": "messages", "prompt": "messages"}


COMPLETION_NAMES: Mapping[str, str] = {
    **_BASE_NAMES, "max_new_tokens": "max_tokens", "tokens.ids": "prompt", "top_logprobs": "logprobs",
    "prompt": "prompt", "text:": "prompt:",
}  # fmt: skip
RESPONSES_NAMES: Mapping[str, str] = {
    **_BASE_NAMES, "max_new_tokens": "max_output_tokens", "chat.messages": "input", "prompt": "input", "text:": "input:",
    "response_format": "text.format", ".function.name": ".name", ".function.parameters": ".parameters",
}  # fmt: skip
# Request fields an error message may start with (after renaming): the error's param.
_PARAMS = (
    "max_completion_tokens", "max_tokens", "max_output_tokens", "min_tokens", "temperature", "top_p", "top_k",
    "repetition_penalty", "seed", "stop_token_ids", "stop", "n", "min_p", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs", "top_logprobs", "cache_salt", "messages", "prompt", "input", "response_format",
    "text.format", "tools", "tool_choice", "parallel_tool_calls", "speculative.n_max", "speculative",
    "n_probs", "json_schema", "grammar", "regex", "ebnf", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs", "structured_outputs.json", "structured_outputs.regex",
    "structured_outputs.choice", "structured_outputs.grammar",
)  # fmt: skip


@dataclass(frozen=True)
class ParsedRequest:
    model: str | None
    inp: TurnInput
    stream: bool
    include_usage: bool
    names: Mapping[str, str] = dataclasses.field(default_factory=chat_names)  # domain -> OpenAI field names
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: usage on every chunk


def number_field(body: Mapping[str, Any], name: str, kind: type = float) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or (kind is float and not abs(value) <= sys.float_info.max):
        raise HttpError(400, f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}"[:200],
                        param=name)  # fmt: skip
    return value


def _check_common(body: Mapping[str, Any], allowed: set[str], where: str, route: str) -> None:
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object")
    for name in body:
        if name not in allowed:
            raise unsupported(name, f"unknown or unsupported parameter for {where}")
    problem = peers.check(body, route)  # the peers' and routers' fields (service/http/peers.py)
    if problem is not None:
        name, message, code = problem
        raise HttpError(400, message, param=name, code=code)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise HttpError(400, "model must be a string", param="model")
    number_field(body, "n", int)  # its range: SamplingParams.validate
    check_bookkeeping(body)


def check_bookkeeping(body: Mapping[str, Any]) -> None:
    """The fields that change nothing in the output (user, metadata, store, service_tier,
    prompt_cache_key, safety_identifier): accepted when well-formed."""
    for name in ("user", "prompt_cache_key", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise HttpError(400, f"{name} must be a string", param=name, code="invalid_type")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise HttpError(400, "store must be a boolean", param="store", code="invalid_type")
    meta = body.get("metadata")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                 for k, v in meta.items())):  # fmt: skip
        raise HttpError(400, "metadata must be an object of string keys and string values", param="metadata",
                        code="invalid_type")  # fmt: skip
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise HttpError(400, f"service_tier must be one of {', '.join(SERVICE_TIERS)}, got {tier!r}"[:200],
                        param="service_tier", code="invalid_value")  # fmt: skip


# prompt_cache_retention -> seconds the whole prompt is retained (docs/api.md, Retention):
# "in_memory" the 5 minutes OpenAI names as its in-memory lifetime's least, "24h" a day
PROMPT_CACHE_RETENTION: Mapping[str, float] = {"in_memory": 300.0, "24h": 24 * 3600.0}


def retention(body: Mapping[str, Any]) -> tuple[Retain, ...]:
    """``prompt_cache_retention`` as a retention of the whole prompt (none when absent)."""
    value = body.get("prompt_cache_retention")
    if value is None:
        return ()
    if value not in PROMPT_CACHE_RETENTION:
        raise HttpError(400, f"prompt_cache_retention must be \"in_memory\" or \"24h\", got {json.dumps(value)[:40]}",
                        param="prompt_cache_retention", code="invalid_value")  # fmt: skip
    return (Retain(PROMPT_CACHE_RETENTION[value], hint=True),)


def _logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    """SamplingParams.logprobs: chat's ``logprobs: true`` with ``top_logprobs`` (0 to 20),
    a completion's ``logprobs`` (the alternatives per token, an integer), or llama.cpp's
    ``n_probs`` (N > 0: the top N alternatives of each token, as its OpenAI endpoints
    return them: the route's own logprobs shape; 0: none)."""
    n_probs = number_field(body, "n_probs", int)
    asked = _openai_logprobs(body, chat)
    if n_probs is not None and n_probs < 0:
        raise HttpError(400, f"n_probs must be >= 0, got {n_probs}", param="n_probs", code="invalid_value")
    if not n_probs:
        return asked
    other = "top_logprobs" if chat else "logprobs"  # the OpenAI field that counts the alternatives
    count = body.get(other)
    if count is not None and count != n_probs:
        raise HttpError(400, f"n_probs ({n_probs}) and {other} ({asked}) ask for different numbers of alternatives; "
                        "send one", param="n_probs", code="invalid_value")  # fmt: skip
    return n_probs  # with chat's logprobs: true and no top_logprobs, n_probs says how many


def _openai_logprobs(body: Mapping[str, Any], chat: bool) -> int | None:
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise HttpError(400, "logprobs must be a boolean", param="logprobs", code="invalid_type")
        top = number_field(body, "top_logprobs", int)
        if top and not on:
            raise HttpError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return (top or 0) if on else None
    value = body.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HttpError(400, f"logprobs must be an integer, got {value!r}"[:200], param="logprobs", code="invalid_type")
    return value


def sampling_fields(
    body: Mapping[str, Any], max_tokens_field: str, default_max_new_tokens: int, logprobs: int | None = None
) -> tuple[SamplingParams, int | None]:
    max_tokens = number_field(body, max_tokens_field, int)
    if max_tokens is None and max_tokens_field != "max_tokens":
        max_tokens = number_field(body, "max_tokens", int)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise HttpError(400, "stop must be a string or a list of strings", param="stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise HttpError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
    ignore_eos = body.get("ignore_eos")
    ignore_eos = False if ignore_eos is None else ignore_eos
    if not isinstance(ignore_eos, bool):
        raise HttpError(400, "ignore_eos must be a boolean", param="ignore_eos")
    temperature = number_field(body, "temperature")
    top_p = number_field(body, "top_p")
    top_k = number_field(body, "top_k", int)
    rep = number_field(body, "repetition_penalty")
    seed = number_field(body, "seed", int)
    n = number_field(body, "n", int)
    presence, frequency = number_field(body, "presence_penalty"), number_field(body, "frequency_penalty")
    min_p, min_tokens = number_field(body, "min_p"), number_field(body, "min_tokens", int)
    params = SamplingParams(
        max_new_tokens=max_tokens if max_tokens is not None else default_max_new_tokens,
        temperature=1.0 if temperature is None else float(temperature),  # OpenAI's default is 1
        top_k=0 if top_k is None or top_k < 0 else top_k,  # vLLM: -1 = off
        top_p=1.0 if top_p is None else float(top_p),
        repetition_penalty=1.0 if rep is None else float(rep),
        seed=seed,
        stop=stops,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=ignore_eos,
        n=1 if n is None else n,
        min_p=0.0 if min_p is None else float(min_p),
        presence_penalty=0.0 if presence is None else float(presence),
        frequency_penalty=0.0 if frequency is None else float(frequency),
        logit_bias=_logit_bias(body),
        min_new_tokens=0 if min_tokens is None else min_tokens,
        logprobs=logprobs,
        **speculation(body),
    )
    return params, max_tokens


def speculation(body: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams' speculative and spec_max_draft from ``speculative`` (a boolean;
    null or absent: the server's setting) and llama.cpp's ``speculative.n_max`` (the most
    tokens drafted a step; 0 turns drafting off, as llama.cpp reads it)."""
    on = body.get("speculative")
    if on is not None and not isinstance(on, bool):
        raise HttpError(400, "speculative must be a boolean", param="speculative", code="invalid_type")
    n_max = number_field(body, "speculative.n_max", int)
    if n_max is None:
        return {"speculative": on}
    if n_max < 0 or (on is not None and on != (n_max > 0)):
        raise HttpError(400, f"speculative.n_max must be >= 0 (0: off) and agree with speculative, got {n_max} "
                        f"with speculative {json.dumps(on)}", param="speculative.n_max")  # fmt: skip
    return {"speculative": n_max > 0, "spec_max_draft": n_max or None}


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (ids as JSON object keys); ranges and the vocabulary
    are checked by SamplingParams.validate and the conversation, as on gRPC."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise HttpError(400, "logit_bias must be an object of token id -> bias", param="logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise HttpError(400, f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}", param="logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise HttpError(400, f"logit_bias keys must be token ids, got {key!r}"[:200], param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= sys.float_info.max:
            raise HttpError(400, f"logit_bias[{key}] must be a number, got {value!r}"[:200], param="logit_bias")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _stream(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """stream, ``stream_options.include_usage`` and vLLM's ``continuous_usage_stats``
    (usage on every chunk; with include_usage, as vLLM sends it only then)."""
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise HttpError(400, "stream must be a boolean", param="stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise HttpError(400, "stream_options takes include_usage and continuous_usage_stats", param="stream_options")
    if not stream:
        raise HttpError(400, "stream_options needs stream: true", param="stream_options")
    for key in ("include_usage", "continuous_usage_stats"):
        if opts.get(key) is not None and not isinstance(opts[key], bool):
            raise HttpError(400, f"stream_options.{key} must be a boolean", param=f"stream_options.{key}",
                            code="invalid_type")  # fmt: skip
    include = bool(opts.get("include_usage"))
    return stream, include, include and bool(opts.get("continuous_usage_stats"))


def cache_salt_field(body: Mapping[str, Any]) -> str:
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise HttpError(400, "cache_salt must be a string", param="cache_salt")
    return salt


def content_field(value: Any, where: str, text_types: tuple[str, ...] = ("text", "refusal")) -> str:
    """A message's content: a string, or a list of text parts (joined; an assistant's
    ``refusal`` part is its text)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            key = "refusal" if kind == "refusal" else "text"
            if kind not in text_types or not isinstance(part.get(key), str):
                raise unsupported(f"{where}[{j}]", f"only text content parts are supported ({', '.join(text_types)})")
            if set(part) - {"type", key, "annotations", "logprobs"}:
                raise unsupported(f"{where}[{j}]", f"a {kind} part takes type and {key}")
            parts.append(part[key])
        return "".join(parts)
    raise HttpError(400, f"{where} must be a string or a list of text parts", param=where, code="invalid_type")


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == ""


def string_field(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise HttpError(400, f"{where} must be a string", param=where)
    return value


def _tool_calls(value: Any, i: int) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls``: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``."""
    where = f"messages[{i}].tool_calls"
    if value is None:
        return ()
    if not isinstance(value, list):
        raise HttpError(400, f"{where} must be a list", param=where)
    out = []
    for j, c in enumerate(value):
        w = f"{where}[{j}]"
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
            raise HttpError(400, f'{w} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param=w)
        fn = c["function"]
        args = fn.get("arguments", "{}")
        if isinstance(args, (dict, list)):  # some clients send the object itself
            args = json.dumps(args, ensure_ascii=False)
        out.append(ToolCall(string_field(c.get("id", ""), f"{w}.id"), string_field(fn.get("name"), f"{w}.function.name"),
                            string_field(args, f"{w}.function.arguments")))  # fmt: skip
    return tuple(out)


def chat_messages(body: Mapping[str, Any]) -> tuple[ChatMessage, ...]:
    """The messages. What an SDK's own response message carries back unset (``refusal:
    null``, ``tool_calls: []``, ``function_call: null``, ``audio: null``,
    ``annotations: []``) is accepted; an assistant's ``refusal`` text is its content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise HttpError(400, f"messages[{i}] must be an object with a role", param=f"messages[{i}]")
        for key in m:
            if key in _EMPTY_MESSAGE_FIELDS and key != "tool_calls" and (
                _is_empty(m[key]) or (key == "refusal" and isinstance(m[key], str))
            ):
                continue
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise unsupported(f"messages[{i}].{key}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise HttpError(400, f"messages[{i}].name must be a string", param=f"messages[{i}].name")
        role = m["role"]
        calls = _tool_calls(m.get("tool_calls"), i)
        if calls and role != "assistant":
            raise HttpError(400, f"messages[{i}].tool_calls: only assistant messages make calls", param=f"messages[{i}].tool_calls")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise HttpError(400, f"messages[{i}]: a tool message needs tool_call_id (a string)",
                            param=f"messages[{i}].tool_call_id")  # fmt: skip
        content = content_field(m.get("content"), f"messages[{i}].content")
        if not content and isinstance(m.get("refusal"), str):
            content = m["refusal"]
        out.append(ChatMessage(role, content, calls, m.get("tool_call_id") or "",
                               (m.get("name") or "") if role == "tool" else ""))  # fmt: skip
    return tuple(out)


def chat_tools(body: Mapping[str, Any]) -> tuple[tuple[ToolSpec, ...], ToolChoice | None, bool]:
    """``tools`` ([{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}]), ``tool_choice`` and ``parallel_tool_calls``; names, schemas and their
    combination are checked by ``service.tools.check_tools``."""
    raw = body.get("tools")
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise HttpError(400, "tools must be a list", param="tools")
    tools = []
    for i, t in enumerate(raw):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise HttpError(400, f'{w} must be {{"type": "function", "function": {{"name", "parameters", ...}}}}', param=w)
        fn = t["function"]
        if set(fn) - {"name", "description", "parameters", "strict"}:
            raise unsupported(f"{w}.function", "takes name, description, parameters and strict")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise HttpError(400, f"{w}.function.parameters must be a JSON schema object", param=f"{w}.function.parameters")
        strict = fn.get("strict") or False
        if not isinstance(strict, bool):
            raise HttpError(400, f"{w}.function.strict must be a boolean", param=f"{w}.function.strict")
        tools.append(ToolSpec(string_field(fn.get("name"), f"{w}.function.name"),
                              string_field(fn.get("description") or "", f"{w}.function.description"),
                              json.dumps(params) if params is not None else "{}", strict))  # fmt: skip
    choice = body.get("tool_choice")
    tc: ToolChoice | None
    if choice is None:
        tc = None
    elif choice in ("none", "auto", "required"):
        tc = ToolChoice(choice)
    elif isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice  # Responses: {"type", "name"}
        tc = ToolChoice("function", string_field(fn.get("name"), "tool_choice.function.name"))
    else:
        raise HttpError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', param="tool_choice")  # fmt: skip
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise HttpError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls", code="invalid_type")
    return tuple(tools), tc, parallel is not False


def response_format(fmt: Any) -> ResponseFormat | None:
    """OpenAI's response_format: ``{"type": "text"}`` (None), ``{"type": "json_object"}``
    or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
    llama.cpp's ``{"type": "json_object", "schema": {...}}`` is the schema's constraint."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return ResponseFormat("json_object")
    if kind == "json_object" and set(fmt) == {"type", "schema"}:  # llama.cpp's: constrained by the schema
        return ResponseFormat("json_schema", schema_spec(fmt["schema"], "response_format.schema"))
    if kind == "json_schema" and set(fmt) == {"type", "json_schema"}:
        spec = fmt["json_schema"]
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise HttpError(400, "response_format.json_schema must be an object with a schema object",
                            param="response_format.json_schema")  # fmt: skip
        if set(spec) - {"name", "schema", "strict", "description"}:
            raise unsupported("response_format.json_schema", "takes name, description, schema and strict")
        return ResponseFormat("json_schema", json.dumps(spec["schema"]))
    raise HttpError(400, 'response_format must be {"type": "text"}, {"type": "json_object"} or '
                    '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}', param="response_format")  # fmt: skip


def schema_spec(value: Any, where: str) -> str:
    """A JSON schema as JSON text: an object or boolean, or (SGLang's ``json_schema``,
    vLLM's ``guided_json``) a string holding one."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, (dict, bool)):
            raise HttpError(400, f"{where} must be a JSON schema (an object, or a string holding one)", param=where)
        return value
    if not isinstance(value, (dict, bool)):
        raise HttpError(400, f"{where} must be a JSON schema (an object, or a string holding one)", param=where)
    return json.dumps(value)


def _choice_spec(value: Any, where: str) -> str:
    if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
        raise HttpError(400, f"{where} must be a non-empty list of non-empty strings", param=where)
    return json.dumps(value)


def _text_spec(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise HttpError(400, f"{where} must be a non-empty string", param=where)
    return value


# The peers' fields that constrain the output (service/http/peers.py's rows), each one
# ResponseFormat: field -> (kind, the spec of its value). vLLM's structured_outputs keys
# are "structured_outputs.<key>" here.
_CONSTRAINT_FIELDS: Mapping[str, tuple[str, Callable[[Any, str], str]]] = {
    "json_schema": ("json_schema", schema_spec),  # llama.cpp's (an object), SGLang's (a string)
    "grammar": ("grammar", _text_spec),  # llama.cpp's GBNF
    "regex": ("regex", _text_spec), "ebnf": ("grammar", _text_spec),  # SGLang's
    "guided_json": ("json_schema", schema_spec), "guided_regex": ("regex", _text_spec),  # vLLM's older names
    "guided_choice": ("choice", _choice_spec), "guided_grammar": ("grammar", _text_spec),
    "structured_outputs.json": ("json_schema", schema_spec), "structured_outputs.regex": ("regex", _text_spec),
    "structured_outputs.choice": ("choice", _choice_spec), "structured_outputs.grammar": ("grammar", _text_spec),
}  # fmt: skip
# structured_outputs' other keys: accepted when they ask for what kvserve does
_STRUCTURED_DEFAULTS: Mapping[str, tuple[Any, ...]] = {
    "json_object": (None, False, True),  # true: any JSON object (OpenAI's json_object); the constraint below
    "disable_fallback": (None, False, True),  # there is no other backend to fall back to
    "disable_any_whitespace": (None, False, True),  # JSON is generated compact either way
    "disable_additional_properties": (None, False),
    "whitespace_pattern": (None,),
    "structural_tag": (None,),
}


def output_constraint(body: Mapping[str, Any], chat: bool) -> tuple[ResponseFormat | None, dict[str, str]]:
    """The one output constraint a request asks for, from OpenAI's ``response_format``
    (chat) or a peer's field (``_CONSTRAINT_FIELDS``), and the names that rename the
    domain's messages about it to that field; two constraints are 400."""
    found: list[tuple[str, ResponseFormat]] = []
    fmt = response_format(body.get("response_format")) if chat else None
    if fmt is not None:
        found.append(("response_format", fmt))
    values = {k: v for k, v in body.items() if k in _CONSTRAINT_FIELDS}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise HttpError(400, "structured_outputs must be an object", param="structured_outputs", code="invalid_type")
        for key, value in so.items():
            name = f"structured_outputs.{key}"
            if name in _CONSTRAINT_FIELDS:
                values[name] = value
            elif key not in _STRUCTURED_DEFAULTS:
                raise unsupported(name, "unknown key of structured_outputs (json, regex, choice, grammar, json_object)")
            elif value not in _STRUCTURED_DEFAULTS[key] or isinstance(value, (int, float)) and not isinstance(value, bool):
                raise unsupported(name, "kvserve does not support it (null or its default only)")
        if so.get("json_object") is True:
            found.append(("structured_outputs.json_object", ResponseFormat("json_object")))
    for name, value in values.items():
        if value is not None:
            kind, spec = _CONSTRAINT_FIELDS[name]
            found.append((name, ResponseFormat(kind, spec(value, name))))
    if len(found) > 1:
        (a, _), (b, _) = found[:2]
        raise HttpError(400, f"{b} cannot be used with {a}: one output constraint per request", param=b,
                        code="invalid_value")  # fmt: skip
    if not found:
        return None, {}
    name, fmt = found[0]
    return fmt, ({} if name == "response_format" else {f"response_format {fmt.kind}": name})


def check_null_only(body: Mapping[str, Any], names: tuple[str, ...] = _NULL_ONLY) -> None:
    """Fields of models or features kvserve lacks: accepted when null, else refused as
    OpenAI refuses them for a model without them."""
    for name in names:
        if body.get(name) is not None:
            raise unsupported(name, f"Unsupported parameter: '{name}' is not supported with this model")


def chat_request(body: Any, default_max_new_tokens: int) -> ParsedRequest:
    """A /v1/chat/completions body as a domain request (the whole history as messages)."""
    _check_common(body, CHAT_FIELDS, "/v1/chat/completions", peers.CHAT)
    for name in ("functions", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise unsupported(name, "kvserve does not support it (use tools and tool_choice)")
    tools, tool_choice, parallel = chat_tools(body)
    check_null_only(body)
    if body.get("modalities") not in (None, ["text"]):
        raise unsupported("modalities", "only [\"text\"] is supported")
    stream, include_usage, continuous_usage = _stream(body)
    sampling, max_tokens = sampling_fields(body, "max_completion_tokens", default_max_new_tokens, _logprobs(body, True))
    fmt, fmt_names = output_constraint(body, chat=True)
    if fmt is not None:
        sampling = dataclasses.replace(sampling, response_format=fmt)
    inp = TurnInput(messages=chat_messages(body), sampling=sampling, max_new_tokens=max_tokens, cache_salt=cache_salt_field(body),
                    tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel, retain=retention(body))  # fmt: skip
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None or \
        body.get("max_tokens") is None else "max_tokens"  # fmt: skip
    names = {**chat_names(max_name), **fmt_names, **_logprobs_names(body)}
    return ParsedRequest(body.get("model"), inp, stream, include_usage, names, continuous_usage)


def completion_request(body: Any, default_max_new_tokens: int) -> ParsedRequest:
    """A /v1/completions body: the prompt is a string or a list of token ids (one prompt)."""
    _check_common(body, COMPLETION_FIELDS, "/v1/completions", peers.COMPLETIONS)
    if body.get("echo"):
        raise unsupported("echo")
    if body.get("suffix") is not None:
        raise unsupported("suffix")
    if number_field(body, "best_of", int) not in (None, 1):
        raise unsupported("best_of", "only 1 is supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    text: str | None = None
    ids: tuple[int, ...] | None = None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise unsupported("prompt", "one prompt per request (a list of prompts is a batch)")
    else:
        raise HttpError(400, "prompt must be a string or a list of token ids", param="prompt")
    stream, include_usage, continuous_usage = _stream(body)
    sampling, max_tokens = sampling_fields(body, "max_tokens", default_max_new_tokens, _logprobs(body, False))
    fmt, fmt_names = output_constraint(body, chat=False)
    if fmt is not None:
        sampling = dataclasses.replace(sampling, response_format=fmt)
    inp = TurnInput(text=text, token_ids=ids, sampling=sampling, max_new_tokens=max_tokens, cache_salt=cache_salt_field(body))
    names = {**COMPLETION_NAMES, **fmt_names, **_logprobs_names(body)}
    return ParsedRequest(body.get("model"), inp, stream, include_usage, names, continuous_usage)


def _logprobs_names(body: Mapping[str, Any]) -> dict[str, str]:
    """llama.cpp's n_probs names the domain's top_logprobs in errors when it asked for them."""
    return {"top_logprobs": "n_probs"} if body.get("n_probs") else {}


# ----------------------------------------------------------------------------- responses


def chat_logprobs(items: Sequence[TokenLogprob], pieces: Callable[[Sequence[int]], list[tuple[str, bytes]]]) -> dict[str, Any]:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}``
    (``pieces``: token ids -> (text, bytes))."""
    ids = [t.token_id for t in items] + [i for t in items for i, _ in t.top]
    piece = dict(zip(ids, pieces(ids)))

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = piece[token_id]
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    content = [{**one(t.token_id, t.logprob), "top_logprobs": [one(i, lp) for i, lp in t.top]} for t in items]
    return {"content": content, "refusal": None}


def completion_logprobs(
    items: Sequence[TokenLogprob], pieces: Callable[[Sequence[int]], list[tuple[str, bytes]]]
) -> dict[str, Any]:
    """A completion's ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (text -> logprob) and ``text_offset`` (into the completion's text)."""
    ids = [t.token_id for t in items] + [i for t in items for i, _ in t.top]
    text = {i: p[0] for i, p in zip(ids, pieces(ids))}
    offsets, at = [], 0
    for t in items:
        offsets.append(at)
        at += len(text[t.token_id])
    return {
        "tokens": [text[t.token_id] for t in items],
        "token_logprobs": [t.logprob for t in items],
        "top_logprobs": [{text[i]: lp for i, lp in t.top} for t in items],
        "text_offset": offsets,
    }


def finish_reason(ev: Finished) -> str:
    if ev.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_calls"
    return "length" if ev.finish_reason == FinishReason.LENGTH else "stop"


def chat_message(fin: Finished) -> dict[str, Any]:
    """The assistant message of a choice: content (null when the reply is only calls)
    and ``tool_calls`` when it made any."""
    if not fin.tool_calls:
        return {"role": "assistant", "content": fin.text}
    return {
        "role": "assistant",
        "content": fin.text or None,
        "tool_calls": [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                       for c in fin.tool_calls],
    }  # fmt: skip


def tool_call_delta(d: ToolCallDelta) -> dict[str, Any]:
    """A streamed chunk's ``delta`` for a piece of a call, as OpenAI streams them: the
    first with index, id, type and name (arguments ""), then index and argument text."""
    if d.name:
        call = {"index": d.call_index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
    else:
        call = {"index": d.call_index, "function": {"arguments": d.arguments}}
    return {"tool_calls": [call]}


def _usage(prompt: int, completion: int, cached: int, by_tier: Mapping[Tier, int]) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {
            "cached_tokens": cached,
            "kvserve_cached_by_tier": {t.value: by_tier.get(t, 0) for t in (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REDIS)},
        },
    }


def usage(start: Started | None, fin: Finished, completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage with ``prompt_tokens_details.cached_tokens`` always present, and the
    per-tier split in ``prompt_tokens_details.kvserve_cached_by_tier``. With n > 1,
    ``completion_tokens`` is every choice's together (the prompt is counted once)."""
    completion = fin.completion_tokens if completion_tokens is None else completion_tokens
    return _usage(fin.prompt_tokens, completion, fin.cache_read_tokens, start.cached_by_tier if start is not None else {})


def running_usage(start: Started, completion_tokens: int) -> dict[str, Any]:
    """A stream chunk's usage with vLLM's ``continuous_usage_stats``: the prompt's (and
    its cached) tokens and the completion tokens so far, in ``usage``'s shape."""
    return _usage(start.prompt_tokens, completion_tokens, start.cached_tokens, start.cached_by_tier)


def timings(fins: Sequence[Finished]) -> dict[str, Any]:
    """llama.cpp's ``timings`` object (its server's names) of a reply, beside ``usage``
    (which stays OpenAI's): ``cache_n`` prompt tokens from the cache, ``prompt_n`` /
    ``prompt_ms`` the prompt tokens computed and their time (restore included),
    ``predicted_n`` / ``predicted_ms`` the generated tokens and the decode time (first
    to last token), ``draft_n`` / ``draft_n_accepted`` the speculative drafts verified
    and accepted, and kvserve's ``tokens_per_step`` (generated tokens per forward that
    made them). With n > 1: the choices' counts and decode rates summed, their longest
    times."""
    f = fins[0]
    prompt_n = f.prompt_tokens - f.cached_tokens
    prompt_ms = max((x.timings.restore_s + x.timings.prefill_s) * 1e3 for x in fins)
    predicted_n = sum(x.completion_tokens for x in fins)
    predicted_ms = max(x.timings.decode_s * 1e3 for x in fins)
    steps = sum(x.completion_tokens / x.timings.tokens_per_step for x in fins if x.timings.tokens_per_step)
    return {
        "cache_n": f.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n * 1e3 / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": sum(x.timings.decode_tokens_per_s for x in fins),
        "draft_n": sum(x.timings.draft_tokens for x in fins),
        "draft_n_accepted": sum(x.timings.accepted_draft_tokens for x in fins),
        "tokens_per_step": predicted_n / steps if steps else 0.0,
    }


def extension(
    request_id: str, session_id: str, start: Started | None, diverged_at: int | None, rewound: int | None = None
) -> dict[str, Any]:
    """The ``kvserve`` object of a response: the request id and, with X-Session-Id, the
    session's part (``session_created``, ``history_diverged_at``: the first message the
    session's transcript did not match, null when the history extended it;
    ``history_rewound_turns``: the turns the divergence rewound, null when none was or
    the session started over)."""
    out: dict[str, Any] = {"request_id": request_id}
    if start is not None:
        out["cached_tier"] = start.cached_tier.value if start.cached_tier is not None and start.cached_tokens else None
    if session_id:
        out["session_id"] = session_id
        out["session_created"] = bool(start.session_created) if start is not None else False
        out["history_diverged_at"] = diverged_at
        out["history_rewound_turns"] = rewound
    return out
