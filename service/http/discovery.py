"""The discovery routes the routers in front of a fleet ask a worker (docs/deploy.md,
"Behind sglang-router and vllm-router"): translation of the served model's facts into
SGLang's shapes, nothing more.

``sglang-router`` (the SGLang Model Gateway) registers an HTTP worker by asking it
``GET /server_info`` and ``GET /model_info`` (``/get_server_info`` and
``/get_model_info``, the deprecated names, when those are 404) and names the worker's
model from ``served_model_name`` (else ``model_path``; with neither it lists the model
as ``unknown`` and routes every model name to every worker); it reads ``model_type`` and
``architectures`` from the model info. Its health check is ``GET /health`` (served by
``app.py``). ``vllm-router`` asks none of these: it passes ``/v1/models`` through.

No ``model_path`` is given: the gateway would try to load a tokenizer from it, which an
HTTP worker does not need (the worker tokenizes). Like ``/v1/models`` these answer a
caller with a valid key (the router's ``--api-key`` is sent as ``Authorization: Bearer``)
and are 503 while the server drains.

``vllm-router``'s ``cache_aware`` policy routes by token prefix: for each request it asks
every worker ``POST /v1/chat/completions/render`` (``/v1/completions/render`` for a
completion) with the request's body and reads vLLM's answer, ``{"request_id",
"token_ids"}``, the prompt the worker would run. Without it the policy has no tokens and
routes blind. The prompt is the turn's own (``Turns.prompt``: every check a turn runs,
then released unrun, as Anthropic's count_tokens), stateless (a session
header is not applied: the render is the request's whole prompt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import wire
from . import openai as oa

if TYPE_CHECKING:
    from ..admission import Admission
    from ..types import ModelInfo
    from .plumbing import Plumbing

class DiscoveryRoutes:
    """``/server_info``, ``/model_info`` and their ``/get_*`` aliases; vLLM's render routes."""

    def __init__(self, plumbing: Plumbing, admission: Admission, model_info: Callable[[], ModelInfo], *,
                 model_id: str, default_max_new_tokens: int) -> None:  # fmt: skip
        self.plumbing = plumbing
        self.default_max_new_tokens = default_max_new_tokens
        self.admission = admission
        self.model_info = model_info
        self.model_id = model_id

    def routes(self) -> list[Route]:
        return [
            Route(path, handler, methods=["GET"])
            for path, handler in (("/server_info", self.server_info), ("/get_server_info", self.server_info),
                                  ("/model_info", self.model_info_route), ("/get_model_info", self.model_info_route))
        ] + [
            Route("/v1/chat/completions/render", self.render_chat, methods=["POST"]),
            Route("/v1/completions/render", self.render_completion, methods=["POST"]),
        ]  # fmt: skip

    async def _answer(self, request: Request, method: str, body: Callable[[ModelInfo], dict[str, Any]]) -> Response:
        try:
            self.admission.check_serving()
            self.plumbing.tenant(request)
        except Exception as exc:  # noqa: BLE001
            err = oa.error_of(exc, wire.new_request_id())
            self.plumbing.count(method, err)
            return self.plumbing.error_response(err)
        self.plumbing.count(method, 200)
        return JSONResponse(body(self.model_info()))

    async def server_info(self, request: Request) -> Response:
        """SGLang's server info, the fields that hold for kvserve: the served name (the
        gateway's model id), one engine (tp and dp 1), the context and the block size
        (SGLang's ``page_size``)."""
        return await self._answer(request, "server_info", lambda info: {
            "served_model_name": self.model_id, "tp_size": 1, "dp_size": 1,
            "context_length": info.context_length, "page_size": info.block_size,
            "disaggregation_mode": "null", "engine": "kvserve",
        })  # fmt: skip

    async def model_info_route(self, request: Request) -> Response:
        """SGLang's model info: a generation model, its Hugging Face ``model_type`` and
        architecture, the served name."""
        return await self._answer(request, "model_info", lambda info: {
            "served_model_name": self.model_id, "is_generation": True, "model_type": info.model_type,
            "architectures": [info.architecture], "max_context_length": info.context_length,
            "vocab_size": info.vocab_size, "eos_token_ids": list(info.eos_token_ids),
        })  # fmt: skip


    async def render_chat(self, request: Request) -> Response:
        return await self._render(request, chat=True)

    async def render_completion(self, request: Request) -> Response:
        return await self._render(request, chat=False)

    async def _render(self, request: Request, *, chat: bool) -> Response:
        """vLLM's render: the prompt's token ids as the turn would run them, nothing run."""
        front, request_id = self.plumbing, wire.new_request_id()
        method = "RenderChat" if chat else "RenderCompletion"
        names = None
        try:
            front.turns.check_serving()
            owner = front.tenant(request)
            body = await front.body(request)
            parsed = (oa.chat_request if chat else oa.completion_request)(body, self.default_max_new_tokens)
            names = parsed.names
            front.check_model(parsed.model)
            token_ids = await front.turns.prompt(owner, parsed.inp, request_id)  # every check the turn runs
        except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
            err = front.error_of(exc, request_id, names)
            front.count(method, err)
            return front.error_response(err)
        front.count(method, 200)
        return JSONResponse({"request_id": request_id, "token_ids": token_ids})


__all__ = ["DiscoveryRoutes"]
