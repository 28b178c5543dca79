"""Protobuf <-> domain: pure functions (no I/O, no engine, no sessions) and the status table.

The servicer calls these and nothing else to translate: ``turn_input`` turns a
``GenerateRequest`` into a ``TurnInput``; ``start_event``/``delta_event``/
``final_event``/``session``/``model_info`` turn domain results into messages;
``status_of`` maps a domain error to its gRPC status:

==============================================  ===================
empty input, unknown role, token id outside      INVALID_ARGUMENT
the vocabulary, bad sampling field, prompt or
session turn longer than the context or than
max_prompt_tokens, bad id, salt or stop list
no or invalid API key (when keys are set)        UNAUTHENTICATED
turns to rewind or at_turn outside the          INVALID_ARGUMENT
session's turns; an input with regenerate
unknown session (Get/Delete/Rewind/Fork, a       NOT_FOUND
regenerate or edit), or another tenant's;
require_existing_session and the session does
not exist
fork to a session id that exists                 ALREADY_EXISTS
session has a turn in flight; another replica    FAILED_PRECONDITION
wrote the session while this turn ran (the
turn is not recorded); expected_turns differs;
no completed turn to regenerate or edit, or
turns recorded before turn boundaries were kept
engine queue full, too many streams (in all or   RESOURCE_EXHAUSTED
for the tenant), too many sessions for the
tenant, message too large (gRPC itself)
server draining / engine stopped                 UNAVAILABLE
anything unexpected                              INTERNAL "... (request id R)", traceback logged with R
request bytes that are not a valid message       INVALID_ARGUMENT (one log line)
(bad UTF-8, truncated, nesting too deep)
==============================================  ===================
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Callable, Mapping

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from .admission import Draining, TooManyStreams
from .auth import Unauthenticated
from .errors import (
    BadTurnCount,
    InvalidSessionId,
    SessionBusy,
    SessionConflict,
    SessionExists,
    SessionLimit,
    SessionNotFound,
    SessionStoreUnavailable,
    TurnsChanged,
    TurnUnavailable,
)
from .types import (
    ChatMessage,
    Delta,
    EngineStopped,
    Finished,
    FinishReason,
    MAX_LOGIT_BIAS,
    InvalidRequest,
    ModelInfo,
    QueueFull,
    ResponseFormat,
    RetentionRefused,
    SamplingParams,
    SessionView,
    Started,
    Tier,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    TurnInput,
    TurnMode,
    WarmResult,
)

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # kvserve.v1.GenerationService

TIER_TO_PB: Mapping[Tier | None, int] = {
    None: pb.CACHE_TIER_NONE,
    Tier.DEVICE: pb.CACHE_TIER_DEVICE,
    Tier.HOST: pb.CACHE_TIER_HOST,
    Tier.DISK: pb.CACHE_TIER_DISK,
    Tier.REDIS: pb.CACHE_TIER_REDIS,
}
FINISH_TO_PB: Mapping[FinishReason, int] = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}
TOOL_CHOICE_FROM_PB: Mapping[int, str] = {
    pb.TOOL_CHOICE_MODE_NONE: "none",
    pb.TOOL_CHOICE_MODE_AUTO: "auto",
    pb.TOOL_CHOICE_MODE_REQUIRED: "required",
    pb.TOOL_CHOICE_MODE_FUNCTION: "function",
}
TURN_MODE_FROM_PB: Mapping[int, TurnMode] = {
    pb.TURN_MODE_UNSPECIFIED: TurnMode.APPEND,
    pb.TURN_MODE_APPEND: TurnMode.APPEND,
    pb.TURN_MODE_REGENERATE: TurnMode.REGENERATE,
    pb.TURN_MODE_EDIT: TurnMode.EDIT,
}


# ----------------------------------------------------------------------------- statuses


class RpcStatus(Exception):
    """Raised inside a handler to end the call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


STATUS_TABLE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (RetentionRefused, grpc.StatusCode.RESOURCE_EXHAUSTED),  # before InvalidRequest (its base): HTTP 429
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidSessionId, grpc.StatusCode.INVALID_ARGUMENT),
    (BadTurnCount, grpc.StatusCode.INVALID_ARGUMENT),
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionExists, grpc.StatusCode.ALREADY_EXISTS),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionConflict, grpc.StatusCode.FAILED_PRECONDITION),
    (TurnsChanged, grpc.StatusCode.FAILED_PRECONDITION),
    (TurnUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SessionStoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    (TooManyStreams, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
)


def status_of(exc: BaseException) -> RpcStatus | None:
    """The status of a known domain error, None for an unexpected one."""
    if isinstance(exc, RpcStatus):
        return exc
    for kind, code in STATUS_TABLE:
        if isinstance(exc, kind):
            return RpcStatus(code, str(exc))
    return None


def failure(exc: Exception, method: str, request_id: str) -> RpcStatus:
    """``status_of(exc)``, or INTERNAL naming ``request_id`` (the traceback is logged with it)."""
    status = status_of(exc)
    if status is not None:
        return status
    log.error("%s request %s failed with an unexpected error", method, request_id, exc_info=exc)
    return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")


def finish_status(event: Finished, request_id: str, draining: bool) -> RpcStatus | None:
    """The status a stream ends with instead of its final event: INVALID_ARGUMENT when
    the request's own format failed it (a grammar llguidance gave up on), INTERNAL when
    the engine failed it, UNAVAILABLE when the drain stopped it."""
    if event.finish_reason == FinishReason.ERROR and event.rejected:
        return RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, f"{event.error} (request id {request_id})")
    if event.finish_reason == FinishReason.ERROR:
        log.error("request %s failed in the engine: %s", request_id, event.error)
        return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")
    if event.finish_reason == FinishReason.CANCELLED and draining:
        return RpcStatus(
            grpc.StatusCode.UNAVAILABLE,
            f"the server shut down before this stream finished (drain timeout passed) after "
            f"{event.completion_tokens} tokens; request id {request_id}",
        )
    return None


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


class InvalidMessage:
    """Stands in for a request whose bytes did not parse (``safe_deserializer``): the
    handler answers INVALID_ARGUMENT instead of grpc's UNKNOWN with a traceback."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.kind = kind
        self.error = error

    def status(self) -> RpcStatus:
        why = str(self.error).splitlines()[0][:200] if str(self.error) else type(self.error).__name__
        log.warning("refused a request that is not a valid %s message: %s", self.kind, why)
        return RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {self.kind} message: {why}")


def safe_deserializer(message_cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, RecursionError, ValueError) as e:
            return InvalidMessage(message_cls.DESCRIPTOR.full_name, e)

    return parse


# ----------------------------------------------------------------------------- requests


def f32(x: float) -> float:
    """A proto float32 as the short decimal the client most likely typed (0.9, not 0.899999976)."""
    return float(f"{x:.7g}")


def _sampling_controls(s: pb.SamplingParams) -> dict[str, Any]:
    """min_p, penalties, logit_bias, min_new_tokens and logprobs; ranges are checked by
    SamplingParams.validate, the proto-only rules here."""
    if s.top_logprobs and not s.logprobs:
        raise InvalidRequest("sampling.top_logprobs needs sampling.logprobs = true")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:  # before building a tuple of an unbounded map
        raise InvalidRequest(f"logit_bias has {len(s.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}")
    return dict(
        min_p=f32(s.min_p) if s.HasField("min_p") else 0.0,
        presence_penalty=f32(s.presence_penalty) if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=f32(s.frequency_penalty) if s.HasField("frequency_penalty") else 0.0,
        logit_bias=tuple(sorted((tok, f32(b)) for tok, b in s.logit_bias.items())),
        min_new_tokens=s.min_new_tokens,
        logprobs=s.top_logprobs if s.logprobs else None,
        n=s.n if s.HasField("n") and s.n else 1,
        response_format=response_format(s.response_format) if s.HasField("response_format") else None,
        speculative=s.speculative if s.HasField("speculative") else None,
        spec_max_draft=s.speculative_max_draft if s.HasField("speculative_max_draft") else None,
    )


def response_format(f: pb.ResponseFormat) -> ResponseFormat:
    """The domain form of a set ``response_format`` (its size and grammar are checked later)."""
    kind = f.WhichOneof("format")
    if kind is None:
        raise InvalidRequest("response_format is set but empty: set one of json_schema, json_object, regex")
    return ResponseFormat(kind, "" if kind == "json_object" else getattr(f, kind))


def sampling(s: pb.SamplingParams, default_max_new_tokens: int) -> SamplingParams:
    """Domain sampling params from the proto; an unset max_new_tokens is ``default_max_new_tokens``.
    InvalidRequest for the rules only the proto's shape has (top_logprobs without logprobs,
    an oversized logit_bias map); every range is checked by ``SamplingParams.validate``."""
    return SamplingParams(
        max_new_tokens=s.max_new_tokens if s.HasField("max_new_tokens") else default_max_new_tokens,
        temperature=f32(s.temperature) if s.HasField("temperature") else 0.0,
        top_k=s.top_k if s.HasField("top_k") else 0,
        top_p=f32(s.top_p) if s.HasField("top_p") else 1.0,
        repetition_penalty=f32(s.repetition_penalty) if s.HasField("repetition_penalty") else 1.0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        **_sampling_controls(s),
    )


def turn_input(request: pb.GenerateRequest, default_max_new_tokens: int) -> TurnInput:
    """The domain form of a ``GenerateRequest`` (nothing checked yet)."""
    kind = request.WhichOneof("input")
    has_sampling = request.HasField("sampling")
    return TurnInput(
        text=request.text if kind == "text" else None,
        messages=tuple(chat_message(m) for m in request.chat.messages) if kind == "chat" else None,
        token_ids=tuple(request.tokens.ids) if kind == "tokens" else None,
        sampling=sampling(request.sampling, default_max_new_tokens) if has_sampling else SamplingParams(
            max_new_tokens=default_max_new_tokens
        ),
        max_new_tokens=(
            request.sampling.max_new_tokens if has_sampling and request.sampling.HasField("max_new_tokens") else None
        ),
        session_id=request.session_id,
        require_existing_session=request.require_existing_session,
        cache_salt=request.cache_salt,
        mode=turn_mode(request.turn_mode),
        expected_turns=request.expected_turns if request.HasField("expected_turns") else None,
        tools=tuple(ToolSpec(t.name, t.description, t.parameters or "{}", t.strict) for t in request.tools),
        tool_choice=tool_choice(request.tool_choice) if request.HasField("tool_choice") else None,
        parallel_tool_calls=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
    )


def chat_message(m: pb.ChatMessage) -> ChatMessage:
    return ChatMessage(
        m.role, m.content, tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls), m.tool_call_id, m.name
    )


def tool_choice(c: pb.ToolChoice) -> ToolChoice | None:
    """The domain tool_choice (None: unspecified); InvalidRequest for a mode this server does not know."""
    if c.mode == pb.TOOL_CHOICE_MODE_UNSPECIFIED:
        if c.function_name:
            raise InvalidRequest("tool_choice.function_name needs mode TOOL_CHOICE_MODE_FUNCTION")
        return None
    kind = TOOL_CHOICE_FROM_PB.get(c.mode)
    if kind is None:
        raise InvalidRequest(f"tool_choice.mode {c.mode} is not a known ToolChoiceMode")
    if kind == "function" and not c.function_name:
        raise InvalidRequest("tool_choice mode TOOL_CHOICE_MODE_FUNCTION needs function_name")
    return ToolChoice(kind, c.function_name if kind == "function" else "")


def turn_mode(value: int) -> TurnMode:
    """The domain turn mode; InvalidRequest for a number this server does not know."""
    mode = TURN_MODE_FROM_PB.get(value)
    if mode is None:
        raise InvalidRequest(f"turn_mode {value} is not a known TurnMode")
    return mode


# ----------------------------------------------------------------------------- responses


def duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


def timestamp(unix_s: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(unix_s * 1e9))
    return t


def tier_counts(counts: Mapping[Tier, int]) -> pb.TierCounts:
    return pb.TierCounts(
        device=counts.get(Tier.DEVICE, 0), host=counts.get(Tier.HOST, 0), redis=counts.get(Tier.REDIS, 0),
        disk=counts.get(Tier.DISK, 0),
    )


def start_event(ev: Started, session_id: str) -> pb.StartEvent:
    return pb.StartEvent(
        request_id=ev.request_id,
        session_id=session_id,
        prompt_tokens=ev.prompt_tokens,
        cached_tokens=ev.cached_tokens,
        cached_tier=TIER_TO_PB[ev.cached_tier if ev.cached_tokens else None],
        cached_by_tier=tier_counts(ev.cached_by_tier),
        session_created=ev.session_created,
    )


def delta_event(ev: Delta) -> pb.DeltaEvent:
    return pb.DeltaEvent(
        index=ev.index,
        text=ev.text,
        token_ids=ev.token_ids,
        logprobs=[
            pb.TokenLogprob(
                token_id=lp.token_id, logprob=lp.logprob, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
            )
            for lp in ev.logprobs
        ],
    )


def tool_call_event(ev: ToolCallDelta) -> pb.DeltaEvent:
    """A piece of a tool call: a DeltaEvent with no text and no tokens."""
    return pb.DeltaEvent(
        index=ev.index,
        tool_calls=[pb.ToolCallDelta(call_index=ev.call_index, id=ev.id, name=ev.name, arguments=ev.arguments)],
    )


def final_event(ev: Finished) -> pb.FinalEvent:
    t = ev.timings
    return pb.FinalEvent(
        tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in ev.tool_calls],
        index=ev.index,
        finish_reason=FINISH_TO_PB[ev.finish_reason],
        usage=pb.Usage(
            prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens
        ),
        timings=pb.Timings(
            queue=duration(t.queue_s),
            restore=duration(t.restore_s),
            prefill=duration(t.prefill_s),
            time_to_first_token=duration(t.ttft_s),
            decode=duration(t.decode_s),
            decode_tokens_per_second=t.decode_tokens_per_s,
            draft_tokens=t.draft_tokens,
            accepted_draft_tokens=t.accepted_draft_tokens,
            acceptance_rate=t.accepted_draft_tokens / t.draft_tokens if t.draft_tokens else 0.0,
            tokens_per_step=t.tokens_per_step,
        ),
    )


def turn_log(rec: SessionView) -> list[pb.SessionTurn]:
    out = []
    index, start = rec.untracked_turns, rec.untracked_tokens
    for t in rec.turn_log:
        out.append(pb.SessionTurn(
            index=index, start_token=start, input_tokens=t.input_tokens, output_tokens=t.output_tokens,
            finish_reason=FINISH_TO_PB[FinishReason(t.finish_reason)], start_time=timestamp(t.started_at),
            end_time=timestamp(t.ended_at),
        ))  # fmt: skip
        index, start = index + 1, start + t.tokens
    return out


def session(
    rec: SessionView,
    busy: bool,
    block_size: int,
    include_tokens: bool = False,
    where: Mapping[Tier, int] | None = None,
    include_turns: bool = False,
) -> pb.Session:
    """``where``: how many of the transcript's full blocks each tier holds (GetSession
    asks the engine and the store; listings leave it empty)."""
    return pb.Session(
        turn_log=turn_log(rec) if include_turns else (),
        session_id=rec.session_id,
        token_count=len(rec.token_ids),
        turns=rec.turns,
        create_time=timestamp(rec.created_at),
        last_use_time=timestamp(rec.last_used_at),
        state=pb.SESSION_STATE_BUSY if busy else pb.SESSION_STATE_IDLE,
        cached_blocks=tier_counts(where or {}),
        full_blocks=len(rec.token_ids) // block_size,
        token_ids=rec.token_ids if include_tokens else (),
    )


def warm_response(r: WarmResult) -> pb.WarmSessionResponse:
    return pb.WarmSessionResponse(
        blocks=r.blocks, on_device=r.on_device, restored=r.restored, restored_by_tier=tier_counts(r.restored_by_tier),
        missing=r.missing, over_cap=r.over_cap, ttl=duration(r.ttl_s),
    )  # fmt: skip


def model_info(m: ModelInfo, max_new_tokens_limit: int) -> pb.ModelInfo:
    return pb.ModelInfo(
        architecture=m.architecture,
        model_type=m.model_type,
        model_fingerprint=m.model_fingerprint,
        context_length=m.context_length,
        vocab_size=m.vocab_size,
        block_size=m.block_size,
        dtype=m.dtype,
        device=m.device,
        tiers=[TIER_TO_PB[t] for t in m.tiers],
        bytes_per_token=m.bytes_per_token,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        eos_token_ids=list(m.eos_token_ids),
        max_new_tokens_limit=max_new_tokens_limit,
    )
