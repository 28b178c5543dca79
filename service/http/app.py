"""The OpenAI-compatible HTTP front: translates, nothing more (like the gRPC servicer).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE when ``stream``),
``POST /v1/sessions/{id}/warm`` (WarmSession),
``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}`` (``service.http.responses``),
``POST /v1/messages``, ``POST /v1/messages/count_tokens`` (Anthropic's: ``service.http.anthropic``),
``/v1/conversations`` and its items (``service.http.conversations_api``),
``GET /v1/models``, ``GET /health``, and the discovery routes the routers in front of a
fleet ask (``/server_info``, ``/model_info``, vLLM's ``/v1/chat/completions/render``:
``service.http.discovery``). Each protocol is one module of routes over the
shared ``service.http.plumbing`` (``completions.py``: chat and text completions;
``responses.py``: the Responses API; ``anthropic.py``: Anthropic's Messages API); this module composes them into one Starlette app
and serves the routes that run no turn. A turn runs through the same prologue as gRPC's
Generate (``service.turns``): stream admission, the drain and per-tenant limits are the
same ``Admission`` object as gRPC's (``service.admission``: one count for both fronts);
the tenant comes from ``Authorization: Bearer`` through the same ``Authenticator``;
errors map through ``service.wire``'s status table to HTTP.

Runs in the gRPC server's event loop (uvicorn's ``Server`` on a socket bound before the
model loads), so there is one engine and one model copy.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import wire
from . import openai as oa
from .anthropic import MessagesRoutes
from .completions import CompletionRoutes
from .conversations_api import ConversationRoutes
from .discovery import DiscoveryRoutes
from .limits import HttpLimits, front_protocol
from .plumbing import Plumbing
from .responses import ResponsesRoutes
from ..tracing import Tracing

if TYPE_CHECKING:
    from ..admission import Admission
    from ..auth import Authenticator
    from ..conversations import Conversations
    from ..metrics import ServiceMetrics
    from ..session_ops import SessionOps


class HttpFront:
    """The Starlette app over the gRPC front's conversations, admission and drain."""

    def __init__(
        self,
        conversations: Conversations,
        admission: Admission,
        authenticator: Authenticator,
        metrics: ServiceMetrics,
        *,
        session_ops: SessionOps,
        model_id: str,
        max_body_bytes: int,
        default_max_new_tokens: int,
        tracing: Tracing | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        self.plumbing = Plumbing(conversations, admission, authenticator, metrics, session_ops=session_ops,
                                 model_id=model_id, max_body_bytes=max_body_bytes,
                                 default_max_new_tokens=default_max_new_tokens, tracing=tracing, limits=limits)  # fmt: skip
        self.conversations = conversations
        self.session_ops = session_ops
        self.admission = admission
        self.model_id = model_id
        self.created = int(time.time())
        self.completions = CompletionRoutes(self.plumbing)  # /v1/chat/completions, /v1/completions
        self.conversation_routes = ConversationRoutes(self.plumbing)  # /v1/conversations (service.http.conversations_api)
        self.responses = ResponsesRoutes(self.plumbing, self.conversation_routes.turn)  # /v1/responses (service.http.responses)
        self.messages = MessagesRoutes(self.plumbing)  # Anthropic's /v1/messages (service.http.anthropic)
        # sglang-router's worker discovery (service.http.discovery)
        self.discovery = DiscoveryRoutes(self.plumbing, admission, lambda: conversations.model_info, model_id=model_id,
                                         default_max_new_tokens=default_max_new_tokens)  # fmt: skip
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions.chat, methods=["POST"]),
                Route("/v1/completions", self.completions.completions, methods=["POST"]),
                Route("/v1/responses", self.responses.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.responses.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.responses.delete, methods=["DELETE"]),
                Route("/v1/messages", self.messages.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.messages.count_tokens, methods=["POST"]),
                *self.conversation_routes.routes(),
                Route("/v1/sessions/{session_id}/warm", self.warm_session, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                *self.discovery.routes(),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # ------------------------------------------------------------------ plumbing

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return self.plumbing.error_response(oa.HttpError(404, f"no route {request.url.path}", "not_found_error"))

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return self.plumbing.error_response(oa.HttpError(405, f"{request.method} is not allowed on {request.url.path}"))

    def _fail(self, method: str, err: oa.HttpError) -> Response:
        self.plumbing.count(method, err)
        return self.plumbing.error_response(err)

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        """As gRPC health: SERVING until the drain starts, then 503 NOT_SERVING; no key needed."""
        if self.admission.draining:
            return JSONResponse({"status": "NOT_SERVING"}, status_code=503)
        return JSONResponse({"status": "SERVING"})

    async def models(self, request: Request) -> Response:
        try:
            self.admission.check_serving()
            self.plumbing.tenant(request)
        except Exception as exc:  # noqa: BLE001
            return self._fail("models", oa.error_of(exc, wire.new_request_id()))
        self.plumbing.count("models", 200)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        try:
            self.admission.check_serving()
            self.plumbing.tenant(request)
            self.plumbing.check_model(request.path_params["model_id"])
        except Exception as exc:  # noqa: BLE001
            return self._fail("models", oa.error_of(exc, wire.new_request_id()))
        self.plumbing.count("models", 200)
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        info = self.conversations.model_info
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
            r = await self.session_ops.warm(self.plumbing.tenant(request), session_id)
        except Exception as exc:  # noqa: BLE001
            return self._fail("WarmSession", self.plumbing.error_of(exc, wire.new_request_id()))
        self.plumbing.count("WarmSession", 200)
        return JSONResponse({
            "object": "session.warm", "session_id": session_id, "blocks": r.blocks, "on_device": r.on_device,
            "restored": r.restored, "restored_by_tier": {t.value: n for t, n in sorted(r.restored_by_tier.items())},
            "missing": r.missing, "over_cap": r.over_cap, "ttl_s": r.ttl_s,
        })  # fmt: skip


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


__all__ = ["HttpFront", "make_uvicorn_server"]
