"""The gRPC servicer: translates, nothing more.

Each RPC turns its request into domain terms (``service.wire``), hands it to the
turn prologue (``service.turns``: Generate) or the session operations
(``service.session_ops``: Get, Delete, List, Rewind, Fork, Warm), and turns the result or the error back into messages and a status
(``wire.status_of``: the status table is in ``service/wire.py``; every limit's message
names the limit and its value). What stays here is what is gRPC's: the caller's tenant
(``tenant_of``), per-method request counters, and request bytes that do not parse
(``wire.safe_deserializer``: INVALID_ARGUMENT, not grpc's UNKNOWN), and the call's trace
(``service/tracing.py``: its parent comes from the call's metadata; the conversation
marks the start and the end of generation on it). A Generate runs its turn through the
fronts' one prologue (``service.turns.Turns``, as every HTTP protocol does): stream
admission and the drain are ``service.admission.Admission``'s, shared with the HTTP
front: every call asks ``check_serving`` and every Generate stream holds a ``Ticket``
until it ends.

Cancellation: ``Generate`` is an async generator that iterates the running turn's
events. When the client cancels, disconnects or passes its deadline, grpc.aio cancels
the handler task; the CancelledError unwinds through ``RunningTurn.close``, which closes
the conversation and the engine iterator, and the engine aborts the request on its next
step (its blocks are released and stay cached).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import grpc

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from . import wire
from .admission import Admission
from .conversations import Conversations
from .metrics import ServiceMetrics
from .errors import InvalidSessionId
from .session_ops import SessionOps
from .tracing import Tracing
from .turns import RunningTurn, Turns
from .types import Delta, Finished, SessionView, ToolCallDelta
from .wire import SERVICE_NAME, InvalidMessage, RpcStatus

__all__ = ["SERVICE_NAME", "GenerationServicer", "RpcStatus", "add_to_server"]


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
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
            request_deserializer=wire.safe_deserializer(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """Implements ``kvserve.v1.GenerationService`` over ``Turns`` (Generate) and
    ``SessionOps`` (the session RPCs).

    ``tenant_of(context)`` names the caller's tenant (the owner of its sessions and
    part of its KV namespace); it may raise ``Unauthenticated``. Without auth every
    caller is the tenant "".
    """

    def __init__(
        self,
        conversations: Conversations,
        metrics: ServiceMetrics,
        *,
        session_ops: SessionOps,
        default_max_new_tokens: int,
        tenant_of: Callable[[grpc.aio.ServicerContext], str] = lambda context: "",
        admission: Admission,
        tracing: Tracing | None = None,
    ) -> None:
        self.conversations = conversations
        self.session_ops = session_ops  # Get, Delete, List, Rewind, Fork, Warm
        self.tracing = tracing or Tracing.off()
        self.metrics = metrics
        self.default_max_new_tokens = default_max_new_tokens
        self._tenant_of = tenant_of
        self.admission = admission  # shared with the HTTP front: one count, one drain
        self.turns = Turns(conversations, admission, metrics, self.tracing)  # the fronts' one turn prologue

    # ------------------------------------------------------------------ Generate

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = wire.new_request_id()
        code = grpc.StatusCode.OK
        failure: RpcStatus | None = None
        turn: RunningTurn | None = None  # set once the stream is admitted and started
        session_id = "" if isinstance(request, InvalidMessage) else request.session_id
        call = self.turns.call("Generate", context.invocation_metadata(), request_id, session_id)
        try:
            if isinstance(request, InvalidMessage):
                raise request.status()
            self.turns.check_serving()
            owner = self._tenant_of(context)
            inp = wire.turn_input(request, self.default_max_new_tokens)
            turn = await self.turns.start(owner, inp, request_id, call)
            yield pb.GenerateResponse(start=wire.start_event(turn.start, inp.session_id))
            async for event in turn.events:
                if isinstance(event, Delta):
                    yield pb.GenerateResponse(delta=wire.delta_event(event))
                elif isinstance(event, ToolCallDelta):
                    yield pb.GenerateResponse(delta=wire.tool_call_event(event))
                elif isinstance(event, Finished):
                    status = wire.finish_status(event, request_id, self.admission.draining)
                    if status is not None:
                        raise status
                    yield pb.GenerateResponse(final=wire.final_event(event))
        except (asyncio.CancelledError, GeneratorExit):
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            failure = wire.failure(exc, "Generate", request_id)
            code = failure.code
        finally:
            try:
                if turn is not None:
                    await turn.close()
            finally:
                call.end(code.name, code.name, failure.details if failure is not None else "")
        if failure is not None:
            await context.abort(failure.code, failure.details)

    # ------------------------------------------------------------------ sessions

    async def _session(
        self, owner: str, rec: SessionView, busy: bool = False, token_ids: bool = False, turns: bool = True
    ) -> pb.Session:
        """A session's message with where its blocks are (GetSession, RewindSession, ForkSession)."""
        where = await self.session_ops.block_locations(owner, rec)
        return wire.session(rec, busy, self.conversations.model_info.block_size, token_ids, where, turns)

    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext) -> pb.GetSessionResponse:
        async def handle() -> pb.GetSessionResponse:
            owner = self._tenant_of(context)
            rec, busy = await self.session_ops.get(owner, request.session_id)
            return pb.GetSessionResponse(
                session=await self._session(owner, rec, busy, request.include_token_ids, request.include_turns)
            )

        return await self._unary("GetSession", request, context, handle)

    async def DeleteSession(
        self, request: pb.DeleteSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSessionResponse:
        async def handle() -> pb.DeleteSessionResponse:
            await self.session_ops.remove(self._tenant_of(context), request.session_id)
            return pb.DeleteSessionResponse()

        return await self._unary("DeleteSession", request, context, handle)

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSessionsResponse:
        async def handle() -> pb.ListSessionsResponse:
            try:
                page, next_token = await self.session_ops.list_sessions(
                    self._tenant_of(context), request.page_size, request.page_token
                )
            except InvalidSessionId:
                raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, "page_token is not one this server issued") from None
            except ValueError as e:
                raise RpcStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            block_size = self.conversations.model_info.block_size
            return pb.ListSessionsResponse(
                sessions=[wire.session(rec, busy, block_size) for rec, busy in page], next_page_token=next_token
            )

        return await self._unary("ListSessions", request, context, handle)

    async def RewindSession(
        self, request: pb.RewindSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RewindSessionResponse:
        async def handle() -> pb.RewindSessionResponse:
            owner = self._tenant_of(context)
            expected = request.expected_turns if request.HasField("expected_turns") else None
            rec, dropped = await self.session_ops.rewind(owner, request.session_id, request.turns, expected)
            return pb.RewindSessionResponse(session=await self._session(owner, rec), dropped_tokens=dropped)

        return await self._unary("RewindSession", request, context, handle)

    async def ForkSession(
        self, request: pb.ForkSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.ForkSessionResponse:
        async def handle() -> pb.ForkSessionResponse:
            owner = self._tenant_of(context)
            at_turn = request.at_turn if request.HasField("at_turn") else None
            rec = await self.session_ops.fork(owner, request.session_id, request.new_session_id, at_turn)
            return pb.ForkSessionResponse(session=await self._session(owner, rec))

        return await self._unary("ForkSession", request, context, handle)

    async def WarmSession(
        self, request: pb.WarmSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.WarmSessionResponse:
        async def handle() -> pb.WarmSessionResponse:
            return wire.warm_response(await self.session_ops.warm(self._tenant_of(context), request.session_id))

        return await self._unary("WarmSession", request, context, handle)

    # ------------------------------------------------------------------ model info

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        async def handle() -> pb.GetModelInfoResponse:
            limit = self.conversations.max_new_tokens_limit
            return pb.GetModelInfoResponse(model=wire.model_info(self.conversations.model_info, limit))

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
            self.admission.check_serving()
            return await handle()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            failure = wire.failure(exc, method, wire.new_request_id())
            code = failure.code
        finally:
            self.metrics.requests.labels(method, code.name).inc()
        await context.abort(failure.code, failure.details)
