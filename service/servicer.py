"""The gRPC servicer: protobuf <-> domain objects, statuses, sessions, cancellation.

Thin on purpose: no tensors, no model code. Each RPC validates its request, calls the
engine or the session table, and maps every error to a precise gRPC status:

==============================================  ===================
empty input, unknown role, token id outside      INVALID_ARGUMENT
the vocabulary, bad sampling field, prompt or
session turn longer than the context or than
max_prompt_tokens, bad id, salt or stop list
no or invalid API key (when keys are set)        UNAUTHENTICATED
unknown session (Get/Delete), or another         NOT_FOUND
tenant's; require_existing_session and the
session does not exist
session has a turn in flight; another replica    FAILED_PRECONDITION
wrote the session while this turn ran (the
turn is not recorded)
engine queue full, too many streams (in all or   RESOURCE_EXHAUSTED
for the tenant), too many sessions for the
tenant, message too large (gRPC itself)
server draining / engine stopped                 UNAVAILABLE
anything unexpected                              INTERNAL "... (request id R)", traceback logged with R
request bytes that are not a valid message       INVALID_ARGUMENT (one log line)
(bad UTF-8, truncated, nesting too deep)
==============================================  ===================

Every limit's message names the limit and its value.

Text and chat input is tokenized in a worker thread, never on the event loop, and
input that cannot fit the prompt limit (``max_prompt_tokens``, else the context
length) is refused before it is tokenized: no token covers more than
``max_bytes_per_token`` bytes of text, so ``ceil(bytes / that)`` tokens is a lower
bound on what the text becomes.

Tenants: ``tenant_of(context)`` (``service.auth.Authenticator.tenant_of``) names the
caller's tenant. It owns the caller's sessions and, with the request's own
``cache_salt``, makes the request's KV namespace (``cache_scope``); a request salt listed
in ``shared_cache_salts`` leaves the tenant out, so those blocks are shared by everyone.

Cancellation: ``Generate`` is an async generator that iterates the engine's event
stream inside ``aclosing``. When the client cancels, disconnects or passes its
deadline, grpc.aio cancels the handler task; the CancelledError unwinds through
``aclosing``, which closes the engine iterator, and the engine aborts the request
on its next step (its blocks are released and stay cached).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from clients._proto.kvserve.v1 import generation_pb2 as pb
from clients._proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from service.auth import Unauthenticated
from service.types import (
    CacheScope,
    Delta,
    EngineStopped,
    Finished,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    MAX_LOGIT_BIAS,
    QueueFull,
    SamplingParams,
    Started,
    Tier,
    Timings,
)
from service.metrics import ServiceMetrics
from service.retention import forget_blocks
from service.sessions import (
    InvalidSessionId,
    SessionBusy,
    SessionConflict,
    SessionLimit,
    SessionManager,
    SessionNotFound,
    SessionRecord,
    Turn,
    TurnInputError,
    chat_tokens,
    text_tokens,
)
from service.spill import SpillScheduler
from service.tracing import Tracing

log = logging.getLogger(__name__)

# Sampling values beyond these overflow float32 logits (x / 1e-45 = inf -> NaN probabilities).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name  # kvserve.v1.GenerationService
DEFAULT_ROLES = ("system", "user", "assistant")

_TIER_TO_PB = {
    None: pb.CACHE_TIER_NONE,
    Tier.DEVICE: pb.CACHE_TIER_DEVICE,
    Tier.HOST: pb.CACHE_TIER_HOST,
    Tier.REDIS: pb.CACHE_TIER_REDIS,
}
_FINISH_TO_PB = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}


class RpcStatus(Exception):
    """Raised inside a handler to end the call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def _status_of(exc: BaseException) -> RpcStatus | None:
    """The status of a known domain error, None for an unexpected one."""
    if isinstance(exc, RpcStatus):
        return exc
    table: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
        (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (TurnInputError, grpc.StatusCode.INVALID_ARGUMENT),
        (InvalidSessionId, grpc.StatusCode.INVALID_ARGUMENT),
        (SessionNotFound, grpc.StatusCode.NOT_FOUND),
        (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
        (SessionConflict, grpc.StatusCode.FAILED_PRECONDITION),
        (SessionLimit, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
        (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineStopped, grpc.StatusCode.UNAVAILABLE),
    )
    for kind, code in table:
        if isinstance(exc, kind):
            return RpcStatus(code, str(exc))
    return None


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


def add_to_server(servicer: "GenerationServicer", server: grpc.aio.Server) -> None:
    """Register the service like the generated ``add_GenerationServiceServicer_to_server``,
    with deserializers that turn unparsable request bytes into INVALID_ARGUMENT."""
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=safe_deserializer(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _f32(x: float) -> float:
    """A proto float32 as the short decimal the client most likely typed (0.9, not 0.899999976)."""
    return float(f"{x:.7g}")


def _sampling_controls(s: pb.SamplingParams) -> dict:
    """min_p, penalties, logit_bias, min_new_tokens and logprobs; ranges are checked by
    SamplingParams.validate, the proto-only rules here."""
    if s.top_logprobs and not s.logprobs:
        raise InvalidRequest("sampling.top_logprobs needs sampling.logprobs = true")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:  # before building a tuple of an unbounded map
        raise InvalidRequest(f"logit_bias has {len(s.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}")
    return dict(
        min_p=_f32(s.min_p) if s.HasField("min_p") else 0.0,
        presence_penalty=_f32(s.presence_penalty) if s.HasField("presence_penalty") else 0.0,
        frequency_penalty=_f32(s.frequency_penalty) if s.HasField("frequency_penalty") else 0.0,
        logit_bias=tuple(sorted((tok, _f32(b)) for tok, b in s.logit_bias.items())),
        min_new_tokens=s.min_new_tokens,
        logprobs=s.top_logprobs if s.logprobs else None,
    )


def _logprobs_pb(lps) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in lps
    ]


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(max(seconds, 0.0) * 1e9))
    return d


def _timestamp(unix_s: float) -> Timestamp:
    t = Timestamp()
    t.FromNanoseconds(int(unix_s * 1e9))
    return t


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request and concurrency limits of the servicer (0 = no limit)."""

    max_prompt_tokens: int = 0  # transcript + new input
    max_streams: int = 0  # Generate streams in flight, all tenants
    max_streams_per_tenant: int = 0
    max_cache_salt_chars: int = 256
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """Implements ``kvserve.v1.GenerationService`` over an ``AsyncEngine`` and a ``SessionManager``.

    ``tenant_of(context)`` names the caller's tenant (the owner of its sessions and
    part of its KV namespace); it may raise ``Unauthenticated``. Without auth every
    caller is the tenant "". ``shared_cache_salts``: request salts whose KV is shared
    across tenants (see ``cache_scope``).
    """

    def __init__(
        self,
        engine: Any,  # service.engine.AsyncEngine (duck-typed so tests may wrap it)
        sessions: SessionManager,
        metrics: ServiceMetrics,
        *,
        default_max_new_tokens: int,
        max_new_tokens_limit: int,
        tenant_of: Callable[[grpc.aio.ServicerContext], str] = lambda context: "",
        spill: SpillScheduler | None = None,
        limits: Limits = Limits(),
        shared_cache_salts: frozenset[str] | tuple[str, ...] = (),
        tracing: Tracing | None = None,
    ) -> None:
        self.engine = engine
        self.tracing = tracing or Tracing.off()
        self.sessions = sessions
        self.metrics = metrics
        self.default_max_new_tokens = default_max_new_tokens
        self.max_new_tokens_limit = max_new_tokens_limit
        self.limits = limits
        self.shared_cache_salts = frozenset(shared_cache_salts)
        self._tenant_of = tenant_of
        self._spill = spill
        self._draining = False
        self._inflight: set[str] = set()  # request ids of Generate streams being served
        self._streams_by_tenant: dict[str, int] = {}  # tenants with streams in flight only
        self._idle = asyncio.Event()
        self._idle.set()
        self._max_bytes_per_token: int | None = None

    def start_draining(self) -> None:
        """From now on new calls get UNAVAILABLE; calls in flight continue."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def inflight(self) -> int:
        """Generate streams in flight."""
        return len(self._inflight)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no Generate stream is in flight; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_inflight(self) -> None:
        """Ask the engine to stop every stream in flight; while draining they end UNAVAILABLE."""
        for request_id in list(self._inflight):
            self.engine.abort(request_id)

    def _check_serving(self) -> None:
        if self._draining:
            raise RpcStatus(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")

    # ------------------------------------------------------------------ Generate

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = new_request_id()
        code = grpc.StatusCode.OK
        failure: RpcStatus | None = None
        owner: str | None = None  # set once the stream is admitted (counted)
        session_id = "" if isinstance(request, InvalidMessage) else request.session_id
        trace = self.tracing.generate(context.invocation_metadata(), request_id, session_id)
        try:
            if isinstance(request, InvalidMessage):
                raise request.status()
            self._check_serving()
            tenant = self._tenant_of(context)
            self._admit_stream(tenant, request_id)
            owner = tenant
            async for response in self._generate(request, context, request_id, owner, trace):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            failure = self._failure(exc, "Generate", request_id)
            code = failure.code
        finally:
            if owner is not None:
                self._release_stream(owner, request_id)
            self.metrics.requests.labels("Generate", code.name).inc()
            trace.end(code.name, failure.details if failure is not None else "")
        if failure is not None:
            await context.abort(failure.code, failure.details)

    def _admit_stream(self, owner: str, request_id: str) -> None:
        """Count a new stream in, or RESOURCE_EXHAUSTED naming the limit it would pass."""
        lim = self.limits
        if lim.max_streams and len(self._inflight) >= lim.max_streams:
            raise RpcStatus(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many streams: the server serves at most {lim.max_streams} at once "
                f"(max_streams); retry later",
            )
        mine = self._streams_by_tenant.get(owner, 0)
        if lim.max_streams_per_tenant and mine >= lim.max_streams_per_tenant:
            raise RpcStatus(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many streams for this tenant: {mine} in flight, the limit is "
                f"{lim.max_streams_per_tenant} per tenant (max_streams_per_tenant); retry when one ends",
            )
        self._streams_by_tenant[owner] = mine + 1
        self._inflight.add(request_id)
        self._idle.clear()
        self.metrics.active_streams.inc()

    def _release_stream(self, owner: str, request_id: str) -> None:
        left = self._streams_by_tenant.get(owner, 1) - 1
        if left > 0:
            self._streams_by_tenant[owner] = left
        else:
            self._streams_by_tenant.pop(owner, None)
        self._inflight.discard(request_id)
        if not self._inflight:
            self._idle.set()
        self.metrics.active_streams.dec()

    def streams_of(self, owner: str) -> int:
        """Generate streams in flight for ``owner``."""
        return self._streams_by_tenant.get(owner, 0)

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str, owner: str,
        trace: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.perf_counter()
        sampling = self._sampling(request.sampling) if request.HasField("sampling") else None
        self._check_salt(request.cache_salt)
        session_id = request.session_id
        if request.require_existing_session and not session_id:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "require_existing_session needs a session_id")
        turn: Turn | None = None
        if session_id:
            turn = await self.sessions.begin_turn(
                owner, session_id, require_existing=request.require_existing_session
            )
        finished = False
        try:
            transcript = turn.record.token_ids if turn else []
            await self._check_input_size(request, transcript, session_id)
            if request.WhichOneof("input") == "tokens":
                new_tokens = self._input_tokens(request, transcript)
            else:  # tokenizing a long text takes a while: never on the event loop
                new_tokens = await asyncio.to_thread(self._input_tokens, request, transcript)
            prompt = transcript + new_tokens
            self._check_prompt_limit(transcript, new_tokens, session_id)
            sampling = self._fit_to_context(sampling, request.sampling, transcript, new_tokens, session_id)
            scope = self.cache_scope(owner, request.cache_salt)
            req = GenerationRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                scope=scope,
                session_id=session_id or None,
            )
            self.engine.validate(req)
            last_token_at: float | None = None
            async with aclosing(self.engine.generate(req)) as events:
                async for event in events:
                    if isinstance(event, Started):
                        self._observe_start(event)
                        trace.started(event, self.engine.model_info.block_size, self.engine.model_info.bytes_per_token)
                        start = self._start_pb(event, session_id)
                        start.session_created = turn is not None and turn.created
                        yield pb.GenerateResponse(start=start)
                    elif isinstance(event, Delta):
                        if not event.token_ids and not event.text:
                            continue
                        now = time.perf_counter()
                        n = len(event.token_ids)
                        if last_token_at is None:
                            self.metrics.time_to_first_token.observe(now - arrival)
                        elif n:
                            for _ in range(n):
                                self.metrics.inter_token_latency.observe((now - last_token_at) / n)
                        if n:
                            last_token_at = now
                        self.metrics.generated_tokens.inc(n)
                        yield pb.GenerateResponse(
                            delta=pb.DeltaEvent(
                                text=event.text, token_ids=event.token_ids, logprobs=_logprobs_pb(event.logprobs)
                            )
                        )
                    elif isinstance(event, Finished):
                        finished = True
                        trace.finished(event)
                        self.metrics.finished.labels(event.finish_reason.value).inc()
                        # Commit and unlock the session before the client sees the end of
                        # the stream, so its next turn never finds the session busy.
                        if turn is not None:
                            if event.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                                rec = await self.sessions.commit_turn(
                                    turn, prompt, event.output_token_ids, cache_salt=request.cache_salt
                                )
                                if self._spill is not None:
                                    self._spill.touch(owner, session_id, rec.token_ids, scope)
                            await self.sessions.end_turn(turn)
                            turn = None
                        self._check_finish(event, request_id)
                        yield pb.GenerateResponse(final=self._final_pb(event))
                        return
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:  # the client cancelled, went away or passed its deadline
                self.metrics.finished.labels(FinishReason.CANCELLED.value).inc()
            raise
        finally:
            if turn is not None:  # cancelled or failed: the transcript stays as before the turn
                await asyncio.shield(self.sessions.end_turn(turn))

    def _check_finish(self, event: Finished, request_id: str) -> None:
        if event.finish_reason == FinishReason.ERROR:
            log.error("request %s failed in the engine: %s", request_id, event.error)
            raise RpcStatus(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")
        if event.finish_reason == FinishReason.CANCELLED and self._draining:
            raise RpcStatus(
                grpc.StatusCode.UNAVAILABLE,
                f"the server shut down before this stream finished (drain timeout passed) after "
                f"{event.completion_tokens} tokens; request id {request_id}",
            )

    def cache_scope(self, owner: str, request_salt: str) -> CacheScope:
        """The block-hash namespace of a request: the tenant and the request's own salt.
        KV is never shared across tenants or across different request salts, except for
        a request salt the operator listed in ``shared_cache_salts``: that namespace
        leaves the tenant out and is the same for every tenant."""
        if self.is_shared_salt(request_salt):
            return CacheScope.shared(request_salt)
        return CacheScope(owner, request_salt)

    def is_shared_salt(self, request_salt: str) -> bool:
        return bool(request_salt) and request_salt in self.shared_cache_salts

    def _check_salt(self, salt: str) -> None:
        limit = self.limits.max_cache_salt_chars
        if len(salt) > limit:
            raise RpcStatus(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"cache_salt has {len(salt)} characters; the limit is {limit}",
            )

    def _check_prompt_limit(self, transcript: list[int], new_tokens: list[int], session_id: str) -> None:
        limit = self.limits.max_prompt_tokens
        n = len(transcript) + len(new_tokens)
        if not limit or n <= limit:
            return
        if session_id and transcript:
            msg = (
                f"session {session_id!r} would exceed the prompt limit: its transcript has {len(transcript)} "
                f"tokens and this turn adds {len(new_tokens)}: {n} > max_prompt_tokens {limit}; "
                f"start a new session"
            )
        else:
            msg = f"prompt has {n} tokens; the limit is {limit} (max_prompt_tokens)"
        raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, msg)

    def max_bytes_per_token(self) -> int:
        """An upper bound on the bytes of text one token covers: twice the longest
        decoded vocabulary entry plus one (a leading space a decoder drops, text that
        normalization shortens). Computed once."""
        if self._max_bytes_per_token is None:
            tok = self.engine.tokenizer
            n = int(getattr(tok, "vocab_size", 0) or self.engine.model_info.vocab_size)
            longest = 1
            for i in range(n):
                try:
                    longest = max(longest, len(tok.decode([i]).encode("utf-8", "surrogatepass")))
                except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode alone
                    continue
            self._max_bytes_per_token = 2 * (longest + 1)
        return self._max_bytes_per_token

    async def _check_input_size(self, request: pb.GenerateRequest, transcript: list[int], session_id: str) -> None:
        """Refuse text or chat input that cannot fit the prompt limit, before tokenizing it."""
        kind = request.WhichOneof("input")
        if kind == "text":
            n_bytes = len(request.text.encode("utf-8", "surrogatepass"))
        elif kind == "chat":
            n_bytes = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in request.chat.messages)
        else:
            return
        limit = self.limits.max_prompt_tokens or self.engine.model_info.context_length
        which = "max_prompt_tokens" if self.limits.max_prompt_tokens else "the context length"
        bpt = self._max_bytes_per_token or await asyncio.to_thread(self.max_bytes_per_token)
        if n_bytes <= (limit - len(transcript)) * bpt:
            return
        at_least = len(transcript) + -(-n_bytes // bpt)
        where = f"session {session_id!r} has {len(transcript)} tokens and " if session_id and transcript else ""
        raise RpcStatus(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"input too long: {where}the new {kind} has {n_bytes} bytes, at least {at_least} tokens in all "
            f"(a token covers at most {bpt} bytes); the limit is {limit} ({which})",
        )

    async def forget_session(self, rec: SessionRecord) -> dict[str, int]:
        """Stop a removed session's KV blocks from being found (device, host, Redis).
        Blocks in a shared namespace are left alone: they are not the session's own."""
        if self._spill is not None:
            self._spill.forget(rec.owner, rec.session_id)
        if self.is_shared_salt(rec.cache_salt) or not rec.token_ids:
            return {}
        try:
            return await forget_blocks(self.engine, rec.token_ids, self.cache_scope(rec.owner, rec.cache_salt))
        except Exception:  # the transcript is gone already; dropping its cache is best effort
            log.exception("dropping the KV blocks of session %r failed", rec.session_id)
            return {}

    def _input_tokens(self, request: pb.GenerateRequest, transcript: list[int]) -> list[int]:
        """The new input as token ids (appended to ``transcript``), checked."""
        kind = request.WhichOneof("input")
        tok = self.engine.tokenizer
        vocab = self.engine.model_info.vocab_size
        if kind is None:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "empty input: set one of text, chat or tokens")
        if kind == "text":
            if not request.text:
                raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "empty input: text is empty")
            return text_tokens(tok, transcript, request.text)
        if kind == "chat":
            messages = request.chat.messages
            if not messages:
                raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "empty input: chat.messages is empty")
            roles = tuple(getattr(tok, "known_roles", DEFAULT_ROLES))
            for i, m in enumerate(messages):
                if m.role not in roles:
                    raise RpcStatus(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"chat.messages[{i}].role {m.role!r} is unknown; use one of {', '.join(roles)}",
                    )
            return chat_tokens(tok, transcript, [{"role": m.role, "content": m.content} for m in messages])
        ids = list(request.tokens.ids)
        if not ids:
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "empty input: tokens.ids is empty")
        for i, t in enumerate(ids):
            if t >= vocab:
                raise RpcStatus(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tokens.ids[{i}] = {t} is outside the vocabulary (ids must be < {vocab})",
                )
        return ids

    def _sampling(self, s: pb.SamplingParams) -> SamplingParams:
        """Domain sampling params from the proto; max_new_tokens is settled by _fit_to_context."""
        params = SamplingParams(
            max_new_tokens=s.max_new_tokens if s.HasField("max_new_tokens") else self.default_max_new_tokens,
            temperature=_f32(s.temperature) if s.HasField("temperature") else 0.0,
            top_k=s.top_k if s.HasField("top_k") else 0,
            top_p=_f32(s.top_p) if s.HasField("top_p") else 1.0,
            repetition_penalty=_f32(s.repetition_penalty) if s.HasField("repetition_penalty") else 1.0,
            seed=s.seed if s.HasField("seed") else None,
            stop=tuple(s.stop),
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            **_sampling_controls(s),
        )
        params.validate(self.max_new_tokens_limit)  # InvalidRequest with the field and value
        # Extreme values overflow the sampler (inf/NaN probabilities); refused precisely.
        if params.temperature and not MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {params.temperature}"
            )
        if not MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}], "
                f"got {params.repetition_penalty}"
            )
        lim = self.limits
        if len(params.stop) > lim.max_stop_strings:
            raise InvalidRequest(f"sampling.stop has {len(params.stop)} strings; the limit is {lim.max_stop_strings}")
        for i, stop in enumerate(params.stop):
            if len(stop) > lim.max_stop_string_chars:
                raise InvalidRequest(
                    f"sampling.stop[{i}] has {len(stop)} characters; the limit is {lim.max_stop_string_chars}"
                )
        if len(params.stop_token_ids) > lim.max_stop_token_ids:
            raise InvalidRequest(
                f"sampling.stop_token_ids has {len(params.stop_token_ids)} ids; the limit is {lim.max_stop_token_ids}"
            )
        vocab = self.engine.model_info.vocab_size
        for i, t in enumerate(params.stop_token_ids):
            if t >= vocab:
                raise InvalidRequest(f"sampling.stop_token_ids[{i}] = {t} is outside the vocabulary (ids must be < {vocab})")
        return params

    def _fit_to_context(
        self,
        params: SamplingParams | None,
        s: pb.SamplingParams,
        transcript: list[int],
        new_tokens: list[int],
        session_id: str,
    ) -> SamplingParams:
        """Check the prompt against the context; an unset max_new_tokens fills what is left."""
        ctx = self.engine.model_info.context_length
        n_prompt = len(transcript) + len(new_tokens)
        explicit = params is not None and s.HasField("max_new_tokens")
        want = params.max_new_tokens if explicit else self.default_max_new_tokens  # type: ignore[union-attr]
        room = ctx - n_prompt
        if room < 1 or (explicit and want > room):
            asked = f"up to {want} new tokens" if explicit else "at least 1 new token"
            need = n_prompt + (want if explicit else 1)
            if session_id:
                msg = (
                    f"session {session_id!r} would exceed the context: its transcript has "
                    f"{len(transcript)} tokens, this turn adds {len(new_tokens)} and asks for {asked}: "
                    f"{need} > context length {ctx}"
                )
            elif explicit:
                msg = (f"prompt ({n_prompt} tokens) + max_new_tokens ({want}) = {need} exceeds the "
                       f"context length {ctx}")  # fmt: skip
            else:
                msg = f"prompt has {n_prompt} tokens; the context length is {ctx} (room for at least 1 new token needed)"
            raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, msg)
        base = params if params is not None else SamplingParams(max_new_tokens=self.default_max_new_tokens)
        return dataclasses.replace(base, max_new_tokens=want if explicit else min(want, room))

    def _observe_start(self, ev: Started) -> None:
        self.metrics.prompt_tokens.inc(ev.prompt_tokens)
        for tier, n in ev.cached_by_tier.items():
            if n:
                self.metrics.cached_prompt_tokens.labels(tier.value).inc(n)

    @staticmethod
    def _start_pb(ev: Started, session_id: str) -> pb.StartEvent:
        by_tier = ev.cached_by_tier
        return pb.StartEvent(
            request_id=ev.request_id,
            session_id=session_id,
            prompt_tokens=ev.prompt_tokens,
            cached_tokens=ev.cached_tokens,
            cached_tier=_TIER_TO_PB[ev.cached_tier if ev.cached_tokens else None],
            cached_by_tier=pb.TierCounts(
                device=by_tier.get(Tier.DEVICE, 0), host=by_tier.get(Tier.HOST, 0), redis=by_tier.get(Tier.REDIS, 0)
            ),
        )

    @staticmethod
    def _final_pb(ev: Finished) -> pb.FinalEvent:
        t: Timings = ev.timings
        return pb.FinalEvent(
            finish_reason=_FINISH_TO_PB[ev.finish_reason],
            usage=pb.Usage(
                prompt_tokens=ev.prompt_tokens, completion_tokens=ev.completion_tokens, cached_tokens=ev.cached_tokens
            ),
            timings=pb.Timings(
                queue=_duration(t.queue_s),
                restore=_duration(t.restore_s),
                prefill=_duration(t.prefill_s),
                time_to_first_token=_duration(t.ttft_s),
                decode=_duration(t.decode_s),
                decode_tokens_per_second=t.decode_tokens_per_s,
            ),
        )

    # ------------------------------------------------------------------ sessions

    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext) -> pb.GetSessionResponse:
        async def handle() -> pb.GetSessionResponse:
            owner = self._tenant_of(context)
            rec, busy = await self.sessions.get(owner, request.session_id)
            where = await self.engine.block_locations(rec.token_ids, self.cache_scope(owner, rec.cache_salt))
            return pb.GetSessionResponse(
                session=self._session_pb(rec, busy, request.include_token_ids, where)
            )

        return await self._unary("GetSession", request, context, handle)

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSessionResponse:
        async def handle() -> pb.DeleteSessionResponse:
            owner = self._tenant_of(context)
            rec = await self.sessions.delete(owner, request.session_id)
            await self.forget_session(rec)
            return pb.DeleteSessionResponse()

        return await self._unary("DeleteSession", request, context, handle)

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        async def handle() -> pb.ListSessionsResponse:
            try:
                page, next_token = await self.sessions.list(
                    self._tenant_of(context), request.page_size, request.page_token
                )
            except InvalidSessionId:
                raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "page_token is not one this server issued") from None
            except ValueError as e:
                raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            return pb.ListSessionsResponse(
                sessions=[self._session_pb(rec, busy, False) for rec, busy in page], next_page_token=next_token
            )

        return await self._unary("ListSessions", request, context, handle)

    def _session_pb(
        self, rec: SessionRecord, busy: bool, include_tokens: bool, where: dict[str, int] | None = None
    ) -> pb.Session:
        # cached_blocks: how many of the transcript's full blocks each tier holds
        # (GetSession asks the engine and the store; listings leave it empty).
        return pb.Session(
            session_id=rec.session_id,
            token_count=len(rec.token_ids),
            turns=rec.turns,
            create_time=_timestamp(rec.created_at),
            last_use_time=_timestamp(rec.last_used_at),
            state=pb.SESSION_STATE_BUSY if busy else pb.SESSION_STATE_IDLE,
            cached_blocks=pb.TierCounts(**(where or {})),
            full_blocks=len(rec.token_ids) // self.engine.model_info.block_size,
            token_ids=rec.token_ids if include_tokens else (),
        )

    # ------------------------------------------------------------------ model info

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        async def handle() -> pb.GetModelInfoResponse:
            m = self.engine.model_info
            return pb.GetModelInfoResponse(
                model=pb.ModelInfo(
                    architecture=m.architecture,
                    model_type=m.model_type,
                    model_fingerprint=m.model_fingerprint,
                    context_length=m.context_length,
                    vocab_size=m.vocab_size,
                    block_size=m.block_size,
                    dtype=m.dtype,
                    device=m.device,
                    tiers=[_TIER_TO_PB[t] for t in m.tiers],
                    bytes_per_token=m.bytes_per_token,
                    num_layers=m.num_layers,
                    num_kv_heads=m.num_kv_heads,
                    head_dim=m.head_dim,
                    eos_token_ids=list(m.eos_token_ids),
                    max_new_tokens_limit=self.max_new_tokens_limit,
                )
            )

        return await self._unary("GetModelInfo", request, context, handle)

    # ------------------------------------------------------------------ plumbing

    async def _unary(
        self, method: str, request: Any, context: grpc.aio.ServicerContext, handle: Callable[[], Any]
    ) -> Any:
        """Run ``handle`` and map its errors to a status; count the call by code."""
        code = grpc.StatusCode.OK
        failure: RpcStatus | None = None
        try:
            if isinstance(request, InvalidMessage):
                raise request.status()
            self._check_serving()
            return await handle()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            failure = self._failure(exc, method, new_request_id())
            code = failure.code
        finally:
            self.metrics.requests.labels(method, code.name).inc()
        await context.abort(failure.code, failure.details)

    @staticmethod
    def _failure(exc: Exception, method: str, request_id: str) -> RpcStatus:
        status = _status_of(exc)
        if status is not None:
            return status
        log.error("%s request %s failed with an unexpected error", method, request_id, exc_info=exc)
        return RpcStatus(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")
