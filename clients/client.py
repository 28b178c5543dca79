"""Python clients of ``kvserve.v1.GenerationService``: ``KVServeClient`` (blocking) and
``AsyncKVServeClient`` (asyncio). Same methods, same typed results.

    with KVServeClient("localhost:50051") as client:
        for event in client.generate(text="Once upon a time", max_new_tokens=32):
            if isinstance(event, TextDelta):
                print(event.text, end="", flush=True)
        reply = client.chat("my-session", "Hello!")          # a Completion
        print(reply.text, reply.start.cached_tokens)

Session operations: ``regenerate(session_id)`` replaces the last answer (same input, new
sampling), ``edit(session_id, message)`` replaces the last message and answers it,
``rewind_session(session_id, turns)`` drops the last turns, ``fork_session(session_id,
new_session_id, at_turn=None)`` branches a conversation; ``get_session(...,
include_turns=True)`` lists the turn boundaries (``SessionInfo.turn_log``).

A stream yields ``StreamStart``, then ``TextDelta``s, then ``StreamEnd`` (with ``n > 1``:
the n sequences' deltas interleaved, each event with its ``index``, and n ``StreamEnd``s;
``complete`` returns them as ``Completion.choices``). ``json_schema=`` (a dict or JSON
text), ``json_object=True`` or ``regex=`` constrain the output. Stop it early
with ``stream.cancel()`` (sync or async) or by cancelling the task iterating it
(async); the server stops generating within one engine step. ``timeout`` (seconds)
is the call's deadline. Failed calls raise ``KVServeError`` carrying the gRPC status
code and the server's message.

``token`` is sent as ``authorization: Bearer <token>`` metadata. A call that names a
session also carries it as ``x-kvserve-session`` metadata (``SESSION_METADATA_KEY``), so
a proxy in front of several replicas can hash on it and send every turn of a
conversation to the replica that holds its KV (deploy/haproxy/haproxy.cfg). For TLS pass
``tls=TLSConfig(root_certificates=..., private_key=..., certificate_chain=...)``
(PEM bytes; all optional: no root certificates means the system's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc

_TIERS = {
    pb.CACHE_TIER_UNSPECIFIED: "none",
    pb.CACHE_TIER_NONE: "none",
    pb.CACHE_TIER_DEVICE: "device",
    pb.CACHE_TIER_HOST: "host",
    pb.CACHE_TIER_REDIS: "redis",
    pb.CACHE_TIER_DISK: "disk",
}
_TURN_MODES = {
    "append": pb.TURN_MODE_APPEND,
    "regenerate": pb.TURN_MODE_REGENERATE,
    "edit": pb.TURN_MODE_EDIT,
}
_FINISH = {
    pb.FINISH_REASON_UNSPECIFIED: "unspecified",
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
_TOOL_CHOICE = {
    "none": pb.TOOL_CHOICE_MODE_NONE,
    "auto": pb.TOOL_CHOICE_MODE_AUTO,
    "required": pb.TOOL_CHOICE_MODE_REQUIRED,
}


# ----------------------------------------------------------------------------- results


class KVServeError(Exception):
    """A call failed: ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> KVServeError:
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


@dataclass(frozen=True)
class StreamStart:
    """First event: the prompt was admitted and its cache looked up."""

    request_id: str
    session_id: str
    prompt_tokens: int
    cached_tokens: int
    cached_tier: str  # "none" | "device" | "host" | "redis"
    cached_by_tier: dict[str, int]  # {"device": n, "host": n, "redis": n}
    session_created: bool = False  # a session turn that created the session (not resumed it)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability (after penalties and logit_bias, before
    temperature) and the ``top_logprobs`` most likely alternatives as (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(frozen=True)
class ToolCall:
    """A function call of the reply: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call: the first of a call has its id and name, the next ones
    argument text (joined: the call's arguments)."""

    call_index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class TextDelta:
    """Newly generated tokens and the text they complete (with tools: the text outside
    calls, and pieces of the calls in ``tool_calls``)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked
    index: int = 0  # which of the request's n sequences
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class Timings:
    queue_s: float
    restore_s: float
    prefill_s: float
    ttft_s: float
    decode_s: float
    decode_tokens_per_s: float
    # speculative decoding: tokens drafted and verified, how many were accepted, their
    # ratio (0 with no drafts) and generated tokens per forward (1 without speculation)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    acceptance_rate: float = 0.0
    tokens_per_step: float = 0.0


@dataclass(frozen=True)
class StreamEnd:
    """Last event: why generation stopped, token counts and timings."""

    finish_reason: str  # "stop" | "length" | "cancelled" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    timings: Timings
    index: int = 0  # which of the request's n sequences ended
    tool_calls: list[ToolCall] = field(default_factory=list)  # the reply's complete calls


Event = StreamStart | TextDelta | StreamEnd


@dataclass
class Choice:
    """One of a request's n sequences, gathered."""

    index: int
    text: str
    token_ids: list[int]
    end: StreamEnd
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.end.tool_calls


@dataclass
class Completion:
    """A whole stream gathered: the text, the token ids and the first and last events
    (of sequence 0), and with ``n > 1`` every sequence in ``choices`` (by index)."""

    text: str
    token_ids: list[int]
    start: StreamStart
    end: StreamEnd
    logprobs: list[TokenLogprob] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls of sequence 0 (``end.tool_calls``)."""
        return self.end.tool_calls


@dataclass(frozen=True)
class SessionTurn:
    """One completed turn's place in the transcript: ``token_ids[start_token :
    start_token + input_tokens]`` is its input, the next ``output_tokens`` its output."""

    index: int  # from 0
    start_token: int
    input_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" | "length"
    started_at: float  # unix seconds
    ended_at: float


@dataclass(frozen=True)
class SessionInfo:
    session_id: str
    token_count: int
    turns: int
    created_at: float  # unix seconds
    last_used_at: float
    busy: bool
    cached_blocks: dict[str, int]  # full blocks per tier
    full_blocks: int
    token_ids: list[int] | None  # only when asked for
    turn_log: list[SessionTurn] | None = None  # only when asked for (turns recorded before boundaries were kept are left out)


@dataclass(frozen=True)
class WarmInfo:
    """What WarmSession did with the session's full blocks: ``blocks`` = ``on_device`` +
    ``restored`` + ``missing`` + ``over_cap`` (see the proto's WarmSessionResponse)."""

    blocks: int
    on_device: int  # on the device already
    restored: int  # restored into it by this call
    restored_by_tier: dict[str, int]  # restored, per tier they came from
    missing: int  # in no tier: the next turn computes them
    over_cap: int  # left where they are by the server's warm-up caps
    ttl_s: float  # how long the warmed blocks wait for the next turn


def warm_from_pb(r: pb.WarmSessionResponse) -> WarmInfo:
    by_tier = {"host": r.restored_by_tier.host, "disk": r.restored_by_tier.disk, "redis": r.restored_by_tier.redis}
    return WarmInfo(r.blocks, r.on_device, r.restored, {k: v for k, v in by_tier.items() if v}, r.missing,
                    r.over_cap, _seconds(r.ttl))  # fmt: skip


@dataclass(frozen=True)
class TLSConfig:
    """PEM-encoded TLS material; ``private_key`` + ``certificate_chain`` for mutual TLS."""

    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None
    server_name_override: str | None = None  # for certificates not naming the address


@dataclass
class _Gather:
    start: StreamStart | None = None
    ends: dict[int, StreamEnd] = field(default_factory=dict)
    text: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)

    def add(self, event: Event) -> None:
        if isinstance(event, StreamStart):
            self.start = event
        elif isinstance(event, TextDelta):
            self.text.setdefault(event.index, []).append(event.text)
            self.token_ids.setdefault(event.index, []).extend(event.token_ids)
            self.logprobs.setdefault(event.index, []).extend(event.logprobs)
        else:
            self.ends[event.index] = event

    def result(self) -> Completion:
        if self.start is None or 0 not in self.ends:
            raise KVServeError(grpc.StatusCode.UNKNOWN, "stream ended without its first or last event")
        choices = [
            Choice(i, "".join(self.text.get(i, [])), self.token_ids.get(i, []), end, self.logprobs.get(i, []))
            for i, end in sorted(self.ends.items())
        ]
        first = choices[0]
        return Completion(first.text, first.token_ids, self.start, first.end, first.logprobs, choices)


# ----------------------------------------------------------------------------- conversions


@dataclass(frozen=True, kw_only=True)
class RequestOptions:
    """One ``GenerateRequest``'s options, as ``build_request`` takes them (every field a
    keyword of it; the same defaults). Build one once and vary it with
    ``dataclasses.replace``, or pass it to ``build_request`` with keywords on top."""

    text: str | None = None
    messages: Sequence[dict[str, str] | tuple[str, str]] | None = None
    token_ids: Sequence[int] | None = None
    session_id: str | None = None
    cache_salt: str = ""
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0
    require_existing_session: bool = False
    turn_mode: str = "append"
    expected_turns: int | None = None
    n: int | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    tools: Sequence[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    speculative: bool | None = None
    speculative_max_draft: int | None = None


# The sampling fields set only when given (None: the server's default).
_OPTIONAL_SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "min_p",
                      "presence_penalty", "frequency_penalty", "speculative", "speculative_max_draft")  # fmt: skip


def build_request(options: RequestOptions | None = None, /, **fields: Any) -> pb.GenerateRequest:
    """A ``GenerateRequest`` from ``options`` (a ``RequestOptions``) and keyword arguments
    (``RequestOptions``' fields, over ``options``' values); exactly one input must be
    given, none with ``turn_mode="regenerate"``. An unknown keyword is a TypeError.

    Unset sampling fields (None) take the server's defaults (greedy). ``n``: sequences
    sampled from the prompt. At most one of ``json_schema`` (a dict, or the schema as
    JSON text), ``json_object`` and ``regex`` constrains the output.
    ``require_existing_session``: NOT_FOUND unless ``session_id`` names an existing
    session, instead of starting it over (for follow-up turns). ``turn_mode``:
    "append" (a new turn), "regenerate" (the last turn's answer again, replacing it) or
    "edit" (this input replaces the last turn's, answered anew). ``expected_turns``: run
    only if the session has exactly that many turns (else FAILED_PRECONDITION).
    ``speculative``: True or False turns speculative decoding on or off for this request
    (None: the server's setting); ``speculative_max_draft``: its drafts per step at most.

    Tools, as OpenAI writes them: ``tools`` ``[{"type": "function", "function": {"name",
    "description", "parameters"}}]`` (or the function objects alone), ``tool_choice``
    "none", "auto", "required" or ``{"type": "function", "function": {"name": ...}}``
    (or the name alone); messages may carry ``tool_calls`` (OpenAI's shape) and
    ``tool_call_id`` / ``name`` (role "tool").
    """
    o = dataclasses.replace(options, **fields) if options is not None else RequestOptions(**fields)
    if o.turn_mode not in _TURN_MODES:
        raise ValueError(f"turn_mode must be one of {', '.join(_TURN_MODES)}, got {o.turn_mode!r}")
    given = [name for name in ("text", "messages", "token_ids") if getattr(o, name) is not None]
    if o.turn_mode == "regenerate":
        if given:
            raise ValueError(f"turn_mode='regenerate' takes no input (got {', '.join(given)})")
    elif len(given) != 1:
        raise ValueError(f"give exactly one of text, messages, token_ids (got {', '.join(given) or 'none'})")
    req = pb.GenerateRequest(
        session_id=o.session_id or "", cache_salt=o.cache_salt, require_existing_session=o.require_existing_session,
        turn_mode=_TURN_MODES[o.turn_mode],
    )  # fmt: skip
    if o.expected_turns is not None:
        req.expected_turns = o.expected_turns
    _set_input(req, o)
    _set_sampling(req.sampling, o)
    req.sampling.SetInParent()
    _add_tools(req, o.tools, o.tool_choice, o.parallel_tool_calls)
    return req


def _set_input(req: pb.GenerateRequest, o: RequestOptions) -> None:
    if o.turn_mode == "regenerate":
        pass
    elif o.text is not None:
        req.text = o.text
    elif o.messages is not None:
        chat = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in o.messages]
        req.chat.messages.extend(_chat_message(m) for m in chat)
        req.chat.SetInParent()  # an empty list is still "chat" (the server rejects it precisely)
    else:
        req.tokens.ids.extend(o.token_ids or ())
        req.tokens.SetInParent()


def _set_sampling(s: pb.SamplingParams, o: RequestOptions) -> None:
    for name in _OPTIONAL_SAMPLING:
        if (value := getattr(o, name)) is not None:
            setattr(s, name, value)
    s.stop.extend(o.stop)
    s.stop_token_ids.extend(o.stop_token_ids)
    s.ignore_eos = o.ignore_eos
    s.logit_bias.update(o.logit_bias or {})
    s.min_new_tokens = o.min_new_tokens
    s.logprobs = o.logprobs
    s.top_logprobs = o.top_logprobs
    if o.n is not None:
        s.n = o.n
    formats = [k for k, v in (("json_schema", o.json_schema), ("json_object", o.json_object or None),
                              ("regex", o.regex)) if v is not None]  # fmt: skip
    if len(formats) > 1:
        raise ValueError(f"give at most one of json_schema, json_object, regex (got {', '.join(formats)})")
    if o.json_schema is not None:
        s.response_format.json_schema = o.json_schema if isinstance(o.json_schema, str) else json.dumps(o.json_schema)
    elif o.json_object:
        s.response_format.json_object.SetInParent()
    elif o.regex is not None:
        s.response_format.regex = o.regex


def _chat_message(m: dict[str, Any]) -> pb.ChatMessage:
    calls = []
    for c in m.get("tool_calls") or ():
        fn = c.get("function", c)
        args = fn.get("arguments", "{}")
        calls.append(pb.ToolCall(id=c.get("id", ""), name=fn["name"], arguments=args if isinstance(args, str) else json.dumps(args)))
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                          tool_call_id=m.get("tool_call_id") or "", name=m.get("name") or "")  # fmt: skip


def _add_tools(req: pb.GenerateRequest, tools: Sequence[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
               parallel: bool | None) -> None:  # fmt: skip
    for t in tools or ():
        fn = t.get("function", t)
        params = fn.get("parameters")
        req.tools.append(pb.Tool(name=fn["name"], description=fn.get("description") or "",
                                 parameters=json.dumps(params) if params is not None else "", strict=bool(fn.get("strict"))))  # fmt: skip
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or tool_choice).get("name")
        req.tool_choice.CopyFrom(pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION, function_name=name))
    elif tool_choice in _TOOL_CHOICE:
        req.tool_choice.mode = _TOOL_CHOICE[tool_choice]
    elif tool_choice is not None:  # a function's name
        req.tool_choice.CopyFrom(pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION, function_name=tool_choice))
    if parallel is not None:
        req.parallel_tool_calls = parallel


def _seconds(d: Any) -> float:
    return d.seconds + d.nanos * 1e-9


_stamp = _seconds  # a Timestamp's unix seconds


def rewind_request(session_id: str, turns: int, expected_turns: int | None) -> pb.RewindSessionRequest:
    req = pb.RewindSessionRequest(session_id=session_id, turns=turns)
    if expected_turns is not None:
        req.expected_turns = expected_turns
    return req


def fork_request(session_id: str, new_session_id: str, at_turn: int | None) -> pb.ForkSessionRequest:
    req = pb.ForkSessionRequest(session_id=session_id, new_session_id=new_session_id)
    if at_turn is not None:
        req.at_turn = at_turn
    return req


def event_from_pb(resp: pb.GenerateResponse) -> Event:
    kind = resp.WhichOneof("event")
    if kind == "start":
        s = resp.start
        return StreamStart(
            request_id=s.request_id,
            session_id=s.session_id,
            prompt_tokens=s.prompt_tokens,
            cached_tokens=s.cached_tokens,
            cached_tier=_TIERS.get(s.cached_tier, "none"),
            cached_by_tier={
                "device": s.cached_by_tier.device, "host": s.cached_by_tier.host, "redis": s.cached_by_tier.redis,
                "disk": s.cached_by_tier.disk,
            },
            session_created=s.session_created,
        )
    if kind == "delta":
        lps = [
            TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            for lp in resp.delta.logprobs
        ]
        calls = [ToolCallDelta(c.call_index, c.id, c.name, c.arguments) for c in resp.delta.tool_calls]
        return TextDelta(text=resp.delta.text, token_ids=list(resp.delta.token_ids), logprobs=lps,
                         index=resp.delta.index, tool_calls=calls)  # fmt: skip
    if kind == "final":
        f, t = resp.final, resp.final.timings
        return StreamEnd(
            finish_reason=_FINISH.get(f.finish_reason, "unspecified"),
            prompt_tokens=f.usage.prompt_tokens,
            completion_tokens=f.usage.completion_tokens,
            cached_tokens=f.usage.cached_tokens,
            timings=Timings(
                queue_s=_seconds(t.queue),
                restore_s=_seconds(t.restore),
                prefill_s=_seconds(t.prefill),
                ttft_s=_seconds(t.time_to_first_token),
                decode_s=_seconds(t.decode),
                decode_tokens_per_s=t.decode_tokens_per_second,
                draft_tokens=t.draft_tokens,
                accepted_draft_tokens=t.accepted_draft_tokens,
                acceptance_rate=t.acceptance_rate,
                tokens_per_step=t.tokens_per_step,
            ),
            index=f.index,
            tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in f.tool_calls],
        )
    raise KVServeError(grpc.StatusCode.UNKNOWN, f"unknown stream event {kind!r}")


def session_from_pb(s: pb.Session, with_tokens: bool = False, with_turns: bool = False) -> SessionInfo:
    return SessionInfo(
        turn_log=[
            SessionTurn(t.index, t.start_token, t.input_tokens, t.output_tokens,
                        _FINISH.get(t.finish_reason, "unspecified"), _stamp(t.start_time), _stamp(t.end_time))
            for t in s.turn_log
        ] if with_turns else None,  # fmt: skip
        session_id=s.session_id,
        token_count=s.token_count,
        turns=s.turns,
        created_at=_stamp(s.create_time),
        last_used_at=_stamp(s.last_use_time),
        busy=s.state == pb.SESSION_STATE_BUSY,
        cached_blocks={"device": s.cached_blocks.device, "host": s.cached_blocks.host, "redis": s.cached_blocks.redis, "disk": s.cached_blocks.disk},
        full_blocks=s.full_blocks,
        token_ids=list(s.token_ids) if with_tokens else None,
    )


def _credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )


def _channel_options(tls: TLSConfig | None, options: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    opts = list(options)
    if tls is not None and tls.server_name_override:
        opts.append(("grpc.ssl_target_name_override", tls.server_name_override))
    return opts


# Request metadata naming the call's session: what a session-affine proxy hashes on.
SESSION_METADATA_KEY = "x-kvserve-session"


def _metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _with_session(metadata: tuple[tuple[str, str], ...], session_id: str | None) -> tuple[tuple[str, str], ...]:
    """``metadata`` plus the session routing key when the call names a session. An id
    that cannot be a metadata value (non-ASCII) is left to the server to reject."""
    if not session_id or not (session_id.isascii() and session_id.isprintable()):
        return metadata
    return (*metadata, (SESSION_METADATA_KEY, session_id))


# ----------------------------------------------------------------------------- sync


class GenerateStream:
    """Iterator of one Generate call's events; ``cancel()`` stops it (server-side too)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    def __iter__(self) -> Iterator[Event]:
        try:
            for resp in self._call:
                yield event_from_pb(resp)
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise KVServeError.from_rpc_error(e) from None

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class KVServeClient:
    """Blocking client. ``address`` is ``host:port``; ``timeout`` is the default deadline (s)."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TLSConfig | None = None,
        timeout: float | None = None,
        options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        opts = _channel_options(tls, options)
        self._channel = (
            grpc.secure_channel(address, _credentials(tls), options=opts)
            if tls is not None
            else grpc.insecure_channel(address, options=opts)
        )
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _metadata(token)
        self._timeout = timeout

    def _t(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def _unary(self, method: Any, request: Any, timeout: float | None, session_id: str | None = None) -> Any:
        try:
            return method(request, timeout=self._t(timeout), metadata=_with_session(self._metadata, session_id))
        except grpc.RpcError as e:
            raise KVServeError.from_rpc_error(e) from None

    def generate(self, options: RequestOptions | None = None, /, *, timeout: float | None = None,
                 **request: Any) -> GenerateStream:  # fmt: skip
        """Start a stream; ``options`` and keyword arguments as in ``build_request``."""
        req = build_request(options, **request)
        metadata = _with_session(self._metadata, req.session_id)
        call = self._stub.Generate(req, timeout=self._t(timeout), metadata=metadata)
        return GenerateStream(call)

    def complete(self, options: RequestOptions | None = None, /, *, timeout: float | None = None,
                 **request: Any) -> Completion:  # fmt: skip
        """Run a stream to its end and return the gathered result."""
        gather = _Gather()
        for event in self.generate(options, timeout=timeout, **request):
            gather.add(event)
        return gather.result()

    def chat(self, session_id: str, message: str, *, role: str = "user", timeout: float | None = None,
             **sampling: Any) -> Completion:  # fmt: skip
        """One chat turn in a session (created on first use)."""
        return self.complete(messages=[{"role": role, "content": message}], session_id=session_id,
                             timeout=timeout, **sampling)  # fmt: skip

    def regenerate(self, session_id: str, *, expected_turns: int | None = None, timeout: float | None = None,
                   **sampling: Any) -> Completion:  # fmt: skip
        """Answer the session's last message again (new sampling), replacing the last answer."""
        return self.complete(session_id=session_id, turn_mode="regenerate", expected_turns=expected_turns,
                             timeout=timeout, **sampling)  # fmt: skip

    def edit(self, session_id: str, message: str, *, role: str = "user", expected_turns: int | None = None,
             timeout: float | None = None, **sampling: Any) -> Completion:  # fmt: skip
        """Replace the session's last message (and its answer) with ``message``, answered anew."""
        return self.complete(messages=[{"role": role, "content": message}], session_id=session_id,
                             turn_mode="edit", expected_turns=expected_turns, timeout=timeout, **sampling)  # fmt: skip

    def rewind_session(self, session_id: str, turns: int = 1, *, expected_turns: int | None = None,
                       timeout: float | None = None) -> tuple[SessionInfo, int]:  # fmt: skip
        """Drop the last ``turns`` turns: (the session now, transcript tokens dropped)."""
        resp = self._unary(self._stub.RewindSession, rewind_request(session_id, turns, expected_turns), timeout,
                           session_id)  # fmt: skip
        return session_from_pb(resp.session, with_turns=True), resp.dropped_tokens

    def fork_session(self, session_id: str, new_session_id: str, *, at_turn: int | None = None,
                     timeout: float | None = None) -> SessionInfo:  # fmt: skip
        """A new session with ``session_id``'s first ``at_turn`` turns (None: all)."""
        resp = self._unary(self._stub.ForkSession, fork_request(session_id, new_session_id, at_turn), timeout,
                           session_id)  # fmt: skip
        return session_from_pb(resp.session, with_turns=True)

    def get_session(self, session_id: str, *, include_token_ids: bool = False, include_turns: bool = False,
                    timeout: float | None = None) -> SessionInfo:  # fmt: skip
        req = pb.GetSessionRequest(session_id=session_id, include_token_ids=include_token_ids, include_turns=include_turns)
        resp = self._unary(self._stub.GetSession, req, timeout, session_id)
        return session_from_pb(resp.session, include_token_ids, include_turns)

    def warm_session(self, session_id: str, *, timeout: float | None = None) -> WarmInfo:
        """Ask the server to restore the session's KV blocks into its device pool ahead of
        the next turn (call it when you know the session is coming back); returns where
        the blocks are now. NOT_FOUND for an unknown session."""
        resp = self._unary(self._stub.WarmSession, pb.WarmSessionRequest(session_id=session_id), timeout, session_id)
        return warm_from_pb(resp)

    def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        self._unary(self._stub.DeleteSession, pb.DeleteSessionRequest(session_id=session_id), timeout, session_id)

    def list_sessions(self, *, page_size: int = 0, page_token: str = "", timeout: float | None = None) -> tuple[list[SessionInfo], str]:
        """One page: (sessions, next_page_token); the token is "" on the last page."""
        resp = self._unary(
            self._stub.ListSessions, pb.ListSessionsRequest(page_size=page_size, page_token=page_token), timeout
        )
        return [session_from_pb(s) for s in resp.sessions], resp.next_page_token

    def iter_sessions(self, *, page_size: int = 0) -> Iterator[SessionInfo]:
        token = ""
        while True:
            page, token = self.list_sessions(page_size=page_size, page_token=token)
            yield from page
            if not token:
                return

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout).model

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The health status name: "SERVING", "NOT_SERVING", ..."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ----------------------------------------------------------------------------- asyncio


def _task_cancelling() -> bool:
    """Whether the current task itself is being cancelled (not just the call)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AsyncGenerateStream:
    """Async iterator of one Generate call's events; ``cancel()`` or cancelling the
    iterating task stops it (server-side too)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._cancelled = False

    async def __aiter__(self) -> AsyncIterator[Event]:
        try:
            async for resp in self._call:
                yield event_from_pb(resp)
        except asyncio.CancelledError:
            if self._cancelled and not _task_cancelling():
                return  # stream.cancel(): the stream ends; the task goes on
            self._call.cancel()
            raise
        except grpc.RpcError as e:
            if self._cancelled and e.code() == grpc.StatusCode.CANCELLED:
                return
            raise KVServeError.from_rpc_error(e) from None
        if self._cancelled:
            return

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class AsyncKVServeClient:
    """asyncio client; the same methods as ``KVServeClient`` as coroutines."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: TLSConfig | None = None,
        timeout: float | None = None,
        options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        opts = _channel_options(tls, options)
        self._channel = (
            grpc.aio.secure_channel(address, _credentials(tls), options=opts)
            if tls is not None
            else grpc.aio.insecure_channel(address, options=opts)
        )
        self._stub = pb_grpc.GenerationServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _metadata(token)
        self._timeout = timeout

    def _t(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    async def _unary(self, method: Any, request: Any, timeout: float | None, session_id: str | None = None) -> Any:
        try:
            return await method(request, timeout=self._t(timeout), metadata=_with_session(self._metadata, session_id))
        except grpc.RpcError as e:
            raise KVServeError.from_rpc_error(e) from None

    def generate(self, options: RequestOptions | None = None, /, *, timeout: float | None = None,
                 **request: Any) -> AsyncGenerateStream:  # fmt: skip
        """Start a stream; ``options`` and keyword arguments as in ``build_request``."""
        req = build_request(options, **request)
        metadata = _with_session(self._metadata, req.session_id)
        call = self._stub.Generate(req, timeout=self._t(timeout), metadata=metadata)
        return AsyncGenerateStream(call)

    async def complete(self, options: RequestOptions | None = None, /, *, timeout: float | None = None,
                       **request: Any) -> Completion:  # fmt: skip
        gather = _Gather()
        async for event in self.generate(options, timeout=timeout, **request):
            gather.add(event)
        return gather.result()

    async def chat(self, session_id: str, message: str, *, role: str = "user", timeout: float | None = None,
                   **sampling: Any) -> Completion:  # fmt: skip
        return await self.complete(messages=[{"role": role, "content": message}], session_id=session_id,
                                   timeout=timeout, **sampling)  # fmt: skip

    async def regenerate(self, session_id: str, *, expected_turns: int | None = None, timeout: float | None = None,
                         **sampling: Any) -> Completion:  # fmt: skip
        return await self.complete(session_id=session_id, turn_mode="regenerate", expected_turns=expected_turns,
                                   timeout=timeout, **sampling)  # fmt: skip

    async def edit(self, session_id: str, message: str, *, role: str = "user", expected_turns: int | None = None,
                   timeout: float | None = None, **sampling: Any) -> Completion:  # fmt: skip
        return await self.complete(messages=[{"role": role, "content": message}], session_id=session_id,
                                   turn_mode="edit", expected_turns=expected_turns, timeout=timeout,
                                   **sampling)  # fmt: skip

    async def rewind_session(self, session_id: str, turns: int = 1, *, expected_turns: int | None = None,
                             timeout: float | None = None) -> tuple[SessionInfo, int]:  # fmt: skip
        resp = await self._unary(self._stub.RewindSession, rewind_request(session_id, turns, expected_turns), timeout,
                                 session_id)  # fmt: skip
        return session_from_pb(resp.session, with_turns=True), resp.dropped_tokens

    async def fork_session(self, session_id: str, new_session_id: str, *, at_turn: int | None = None,
                           timeout: float | None = None) -> SessionInfo:  # fmt: skip
        resp = await self._unary(self._stub.ForkSession, fork_request(session_id, new_session_id, at_turn), timeout,
                                 session_id)  # fmt: skip
        return session_from_pb(resp.session, with_turns=True)

    async def get_session(self, session_id: str, *, include_token_ids: bool = False, include_turns: bool = False,
                          timeout: float | None = None) -> SessionInfo:  # fmt: skip
        req = pb.GetSessionRequest(session_id=session_id, include_token_ids=include_token_ids, include_turns=include_turns)
        resp = await self._unary(self._stub.GetSession, req, timeout, session_id)
        return session_from_pb(resp.session, include_token_ids, include_turns)

    async def warm_session(self, session_id: str, *, timeout: float | None = None) -> WarmInfo:
        resp = await self._unary(self._stub.WarmSession, pb.WarmSessionRequest(session_id=session_id), timeout,
                                 session_id)  # fmt: skip
        return warm_from_pb(resp)

    async def delete_session(self, session_id: str, *, timeout: float | None = None) -> None:
        await self._unary(self._stub.DeleteSession, pb.DeleteSessionRequest(session_id=session_id), timeout, session_id)

    async def list_sessions(self, *, page_size: int = 0, page_token: str = "",
                            timeout: float | None = None) -> tuple[list[SessionInfo], str]:  # fmt: skip
        resp = await self._unary(
            self._stub.ListSessions, pb.ListSessionsRequest(page_size=page_size, page_token=page_token), timeout
        )
        return [session_from_pb(s) for s in resp.sessions], resp.next_page_token

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        return (await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)).model

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        resp = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
