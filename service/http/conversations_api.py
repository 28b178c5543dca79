"""OpenAI's Conversations API over sessions: ``POST /v1/conversations``, ``GET``,
``POST`` (its metadata) and ``DELETE /v1/conversations/{id}``, ``GET`` / ``POST
/v1/conversations/{id}/items``, ``GET`` / ``DELETE /v1/conversations/{id}/items/{item_id}``,
and ``conversation`` on a ``POST /v1/responses`` (``ResponsesRoutes.create`` asks
``turn`` for the turn's input and the items its commit appends).

A conversation IS a kvserve session: its id (``conv_`` and 48 hex digits) is the
session's, its items and metadata are the session record's ``attachment`` (JSON,
``ConversationState``), so they live where the record lives (the session store:
Redis when configured, every replica and a restart find them) and are written with the
turn that makes them, in its one conditional write. Its transcript is the KV cache's
key: a response in the conversation sends the conversation's items as the whole
history (``Conversations.prepare(resent_history=True)``), which ``service.history``
matches against the transcript under the turn lock; the turns it follows are reused
token for token (their KV blocks found, device, host, disk or Redis), the items after
them are the turn's input. The items are the truth and the transcript follows them:
items added with ``items.create`` are rendered by the next response, and deleting an
item the transcript already holds rewinds it, at that next response, to the last turn
the items still follow.

A response's output items carry the response's own ids (``msg_<response>``,
``fc_<response>_<k>`` and the ``call_id`` ``ResponsesRoutes.call_id`` gives), so the
response object, the items list and a follow-up's ``function_call_output`` agree. The
response itself is not a stored response (``GET /v1/responses/{id}`` is 404 for it):
the conversation is where it is kept.

A conversation is its tenant's (the API key's), as a session is: another tenant's id
is 404, as an unknown one, a deleted one, and a session that is no conversation.
Deleting one removes its session and forgets its KV blocks (``Conversations.remove``).
It expires with its session (``--session-ttl``), as every session does.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import wire
from . import openai as oa
from .responses import RESPONSE_PREFIX, call_item_id, no_call_found
from ..errors import SESSION_ID_RE, SessionNotFound
from ..tools import uses_tools
from ..types import ChatMessage, Finished, FinishReason, ToolCall, TurnInput

if TYPE_CHECKING:
    from .plumbing import Plumbing
    from .responses import ResponseRequest

CONVERSATION_PREFIX = "conv_"
MAX_NEW_ITEMS = 20  # items one create adds (OpenAI's bound)
MAX_METADATA = (16, 64, 512)  # keys, key length, value length (OpenAI's bounds)
PAGE_LIMIT = (1, 100, 20)  # items.list: least, most, default
MAX_STATE_BYTES = 8 << 20  # a conversation's items and metadata (the session record's metadata holds 16 MiB)
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_METHOD = "Conversations"  # kvserve_requests_total's method label


@dataclass
class ConversationState:
    """What a conversation keeps beside its transcript (the session's ``attachment``):
    its metadata and items (in OpenAI's shapes, ids included), and ``rev``, counted up by
    every write (a response whose items changed under it is refused, never misfiled)."""

    metadata: dict[str, str] = field(default_factory=dict)
    items: list[dict[str, Any]] = field(default_factory=list)
    rev: int = 0

    def dump(self) -> str:
        """The attachment; 400 past ``MAX_STATE_BYTES`` (the record must stay readable)."""
        out = json.dumps({"object": "conversation", "metadata": self.metadata, "items": self.items, "rev": self.rev},
                         separators=(",", ":"))  # fmt: skip
        if len(out) > MAX_STATE_BYTES:
            raise oa.HttpError(400, f"the conversation would hold more than {MAX_STATE_BYTES >> 20} MiB of items; "
                               f"delete items or start a new conversation", code="conversation_too_large")  # fmt: skip
        return out

    @classmethod
    def load(cls, attachment: str) -> ConversationState | None:
        """The state in a session's attachment; None when the session is no conversation."""
        if not attachment:
            return None
        try:
            d = json.loads(attachment)
        except ValueError:
            return None
        if not isinstance(d, dict) or d.get("object") != "conversation":
            return None
        return cls(dict(d.get("metadata") or {}), list(d.get("items") or []), int(d.get("rev", 0)))


def new_conversation_id() -> str:
    return CONVERSATION_PREFIX + uuid.uuid4().hex + uuid.uuid4().hex[:16]


def not_found(cid: str, param: str | None = None) -> oa.HttpError:
    return oa.HttpError(404, f"Conversation with id {str(cid)[:140]!r} not found.", "invalid_request_error",
                        param=param, code="not_found")  # fmt: skip


# ----------------------------------------------------------------------------- items


def _text(value: Any, where: str) -> str:
    """A string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            key = "refusal" if kind == "refusal" else "text"
            if kind not in _TEXT_PARTS or not isinstance(part.get(key), str):
                raise oa.unsupported(f"{where}[{j}]", f"only text content parts are supported ({', '.join(_TEXT_PARTS)})")
            out.append(part[key])
        return "".join(out)
    raise oa.HttpError(400, f"{where} must be a string or a list of text parts", param=where, code="invalid_type")


def _str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise oa.HttpError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _only(item: Mapping[str, Any], where: str, keys: tuple[str, ...]) -> None:
    for key in item:
        if key not in keys:
            raise oa.unsupported(f"{where}.{key}")


def message_item(role: str, text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
    part = ({"type": "output_text", "text": text, "annotations": []} if role == "assistant"
            else {"type": "input_text", "text": text})  # fmt: skip
    return {"type": "message", "id": item_id, "status": status, "role": role, "content": [part]}


def new_items(value: Any, where: str) -> list[dict[str, Any]]:
    """Input items (``where``: ``items`` or ``input``; a string is one user message) as
    stored items with new ids: messages, ``function_call`` and ``function_call_output``;
    anything else 400 naming the item."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise oa.HttpError(400, f"{where} must be a list of items", param=where)
    out = []
    for i, item in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise oa.HttpError(400, f"{w} must be an object", param=w)
        kind = item.get("type", "message")
        if kind == "message":
            _only(item, w, ("type", "role", "content", "id", "status"))
            role = item.get("role")
            if role not in _ROLES:
                raise oa.HttpError(400, f"{w}.role must be one of {', '.join(_ROLES)}, got {role!r}"[:200],
                                   param=f"{w}.role", code="invalid_value")  # fmt: skip
            out.append(message_item(role, _text(item.get("content"), f"{w}.content"), "msg_" + uuid.uuid4().hex))
        elif kind == "function_call":
            _only(item, w, ("type", "id", "call_id", "name", "arguments", "status"))
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise oa.HttpError(400, f"{w}.arguments must be a string", param=f"{w}.arguments")
            try:
                if args.strip():
                    json.loads(args)
            except (ValueError, RecursionError):
                raise oa.HttpError(400, f"{w}.arguments: the call's arguments are not valid JSON: {args[:80]!r}",
                                   param=f"{w}.arguments") from None  # fmt: skip
            out.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": _str(item, "call_id", w),
                        "name": _str(item, "name", w), "arguments": args, "status": "completed"})  # fmt: skip
        elif kind == "function_call_output":
            _only(item, w, ("type", "id", "call_id", "output", "status"))
            out.append({"type": "function_call_output", "id": "fco_" + uuid.uuid4().hex,
                        "call_id": _str(item, "call_id", w), "output": _text(item.get("output"), f"{w}.output"),
                        "status": "completed"})  # fmt: skip
        else:
            raise oa.unsupported(f"{w}.type", f"{str(kind)[:40]!r}: only message, function_call and "
                                 f"function_call_output items are supported")  # fmt: skip
    return out


def check_answers(items: list[dict[str, Any]], new: list[dict[str, Any]], where: str) -> None:
    """Each ``function_call_output`` of ``new`` answers a call made before it (in the
    conversation's ``items`` or earlier in ``new``): else 400 naming it, as OpenAI's."""
    calls = {it["call_id"] for it in items if it["type"] == "function_call"}
    for i, it in enumerate(new):
        if it["type"] == "function_call":
            calls.add(it["call_id"])
        elif it["type"] == "function_call_output" and it["call_id"] not in calls:
            raise no_call_found(f"{where}[{i}].call_id", it["call_id"])


def history(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The items as chat messages: a response's text and its calls one assistant message
    (as the model wrote them: what ``service.history`` compares with the transcript),
    each output a tool message naming its call's function; a call whose arguments were
    cut off (``incomplete``) is left out."""
    out: list[ChatMessage] = []
    names: dict[str, str] = {}
    for it in items:
        if it["type"] == "function_call" and it["status"] == "incomplete":
            continue  # a call cut off by max_output_tokens: no call to render (the next turn rewinds past it)
        if it["type"] == "function_call":
            call = ToolCall(it["call_id"], it["name"], it["arguments"])
            names[call.id] = call.name
            if out and out[-1].role == "assistant":
                out[-1] = dataclasses.replace(out[-1], tool_calls=out[-1].tool_calls + (call,))
            else:
                out.append(ChatMessage("assistant", "", (call,)))
        elif it["type"] == "function_call_output":
            out.append(ChatMessage("tool", it["output"], (), it["call_id"], names.get(it["call_id"], "")))
        else:
            out.append(ChatMessage(it["role"], "".join(p.get("text", p.get("refusal", "")) for p in it["content"])))
    return out


Parse = Callable[[str], "tuple[str, list[ToolCall]]"]


def output_items(rid: str, fin: Finished, parse: Parse | None, call_id: Callable[[str, int], str]) -> list[dict[str, Any]]:
    """A response's output items from its turn's raw Finished event: its text outside
    calls (``parse``: the served family's parser, for a turn with tools) as a message
    (left out when empty and there are calls) and each call, ids as the response object
    gives them."""
    text, calls = (fin.text, []) if parse is None else parse(fin.text)
    status = "incomplete" if fin.finish_reason == FinishReason.LENGTH else "completed"
    out = []
    if text or not calls:
        out.append(message_item("assistant", text, "msg_" + rid[len(RESPONSE_PREFIX):], status))
    out.extend({"type": "function_call", "id": call_item_id(rid, k), "call_id": call_id(rid, k), "name": c.name,
                "arguments": c.arguments, "status": "completed" if _is_json(c.arguments) else "incomplete"}
               for k, c in enumerate(calls))  # fmt: skip
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """``items.list``: ``limit`` (1-100, default 20), ``order`` (``desc`` by default),
    ``after`` (an item id: the items after it in that order)."""
    for key in query:
        if key not in ("limit", "order", "after", "include", "include[]"):
            raise oa.unsupported(key, "items.list takes limit, order, after and include")
    lo, hi, default = PAGE_LIMIT
    try:
        limit = int(query.get("limit", default))
    except ValueError:
        limit = 0
    if not lo <= limit <= hi:
        raise oa.HttpError(400, f"limit must be an integer from {lo} to {hi}, got {query.get('limit')!r}"[:200],
                           param="limit", code="invalid_value")  # fmt: skip
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise oa.HttpError(400, f"order must be asc or desc, got {order!r}"[:200], param="order", code="invalid_value")
    seq = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        at = next((i for i, it in enumerate(seq) if it["id"] == after), None)
        if at is None:
            raise oa.HttpError(404, f"Item with id {after[:140]!r} not found.", "invalid_request_error",
                               param="after", code="not_found")  # fmt: skip
        seq = seq[at + 1 :]
    return item_list(seq[:limit], has_more=len(seq) > limit)


def item_list(data: list[dict[str, Any]], has_more: bool = False) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}  # fmt: skip


def check_metadata(value: Any) -> dict[str, str]:
    """OpenAI's metadata: up to 16 string keys of at most 64 characters, string values of at most 512."""
    n, klen, vlen = MAX_METADATA
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > n or not all(
        isinstance(k, str) and len(k) <= klen and isinstance(v, str) and len(v) <= vlen for k, v in value.items()
    ):
        raise oa.HttpError(400, f"metadata must be an object of at most {n} string keys (up to {klen} characters) "
                           f"and string values (up to {vlen} characters)", param="metadata", code="invalid_type")
    return dict(value)


# ----------------------------------------------------------------------------- the routes


class ConversationRoutes:
    """The conversation routes and the Responses hook, over the HTTP front's plumbing."""

    def __init__(self, plumbing: Plumbing) -> None:
        self.front = plumbing

    def routes(self) -> list[Route]:
        return [
            Route("/v1/conversations", self.create, methods=["POST"]),
            Route("/v1/conversations/{cid}", self.retrieve, methods=["GET"]),
            Route("/v1/conversations/{cid}", self.update, methods=["POST"]),
            Route("/v1/conversations/{cid}", self.delete, methods=["DELETE"]),
            Route("/v1/conversations/{cid}/items", self.list_items, methods=["GET"]),
            Route("/v1/conversations/{cid}/items", self.create_items, methods=["POST"]),
            Route("/v1/conversations/{cid}/items/{item_id}", self.retrieve_item, methods=["GET"]),
            Route("/v1/conversations/{cid}/items/{item_id}", self.delete_item, methods=["DELETE"]),
        ]

    @property
    def conversations(self) -> Any:
        return self.front.conversations

    @property
    def session_ops(self) -> Any:
        return self.front.session_ops

    async def _answer(self, request: Request, work: Callable[[str], Any]) -> Response:
        """Serve a route: admission's check, the tenant, ``work(owner)``'s body or its error."""
        front = self.front
        try:
            front.admission.check_serving()
            body = await work(front.tenant(request))
        except Exception as exc:  # noqa: BLE001 - every error becomes an HTTP error
            err = front.error_of(exc, wire.new_request_id())
            front.count(_METHOD, err)
            return front.error_response(err)
        front.count(_METHOD, 200)
        return JSONResponse(body)

    async def _read(self, owner: str, cid: str, param: str | None = None) -> tuple[Any, ConversationState]:
        """The conversation's record and state: 404 for an id that names none of this tenant's."""
        if not (isinstance(cid, str) and cid.startswith(CONVERSATION_PREFIX) and SESSION_ID_RE.fullmatch(cid)):
            raise not_found(cid, param)
        try:
            rec, _busy = await self.session_ops.get(owner, cid)
        except SessionNotFound:
            raise not_found(cid, param) from None
        state = ConversationState.load(rec.attachment)
        if state is None:
            raise not_found(cid, param)
        return rec, state

    async def _change(self, owner: str, cid: str, change: Callable[[ConversationState], Any]) -> tuple[Any, Any]:
        """Apply ``change`` to the conversation's state under its turn lock (a response
        running in it: 409); the new record and what ``change`` returned."""
        await self._read(owner, cid)  # 404 before the lock is taken
        out: list[Any] = []

        def write(rec: Any) -> str:
            state = ConversationState.load(rec.attachment)
            if state is None:
                raise not_found(cid)
            out.append(change(state))
            state.rev += 1
            return state.dump()

        try:
            rec = await self.session_ops.attach(owner, cid, write)
        except SessionNotFound:
            raise not_found(cid) from None
        return rec, out[0]

    @staticmethod
    def _object(cid: str, rec: Any, state: ConversationState) -> dict[str, Any]:
        return {"id": cid, "object": "conversation", "created_at": int(rec.created_at), "metadata": state.metadata}

    async def create(self, request: Request) -> Response:
        async def work(owner: str) -> Any:
            body = await self.front.body(request)
            if not isinstance(body, dict):
                raise oa.HttpError(400, "the request body must be a JSON object")
            _only(body, "body", ("items", "metadata", "safety_identifier"))
            items = body.get("items")
            state = ConversationState(check_metadata(body.get("metadata")), [] if items is None else
                                      self._new_items(items, []), 1)  # fmt: skip
            cid = new_conversation_id()
            rec = await self.session_ops.attach(owner, cid, lambda _rec: state.dump(), create=True)
            return self._object(cid, rec, state)

        return await self._answer(request, work)

    def _new_items(self, value: Any, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not isinstance(value, list) or len(value) > MAX_NEW_ITEMS:
            raise oa.HttpError(400, f"items must be a list of at most {MAX_NEW_ITEMS} items", param="items")
        new = new_items(value, "items")
        check_answers(items, new, "items")
        return new

    async def retrieve(self, request: Request) -> Response:
        cid = request.path_params["cid"]

        async def work(owner: str) -> Any:
            rec, state = await self._read(owner, cid)
            return self._object(cid, rec, state)

        return await self._answer(request, work)

    async def update(self, request: Request) -> Response:
        cid = request.path_params["cid"]

        async def work(owner: str) -> Any:
            body = await self.front.body(request)
            if not isinstance(body, dict) or "metadata" not in body:
                raise oa.HttpError(400, "the request body must be an object with metadata", param="metadata")
            _only(body, "body", ("metadata",))
            meta = check_metadata(body["metadata"])
            rec, state = await self._change(owner, cid, lambda s: setattr(s, "metadata", meta) or s)
            return self._object(cid, rec, state)

        return await self._answer(request, work)

    async def delete(self, request: Request) -> Response:
        cid = request.path_params["cid"]

        async def work(owner: str) -> Any:
            await self._read(owner, cid)
            try:
                await self.session_ops.remove(owner, cid)
            except SessionNotFound:
                raise not_found(cid) from None
            return {"id": cid, "object": "conversation.deleted", "deleted": True}

        return await self._answer(request, work)

    async def list_items(self, request: Request) -> Response:
        cid = request.path_params["cid"]

        async def work(owner: str) -> Any:
            _rec, state = await self._read(owner, cid)
            return _page(state.items, request.query_params)

        return await self._answer(request, work)

    async def create_items(self, request: Request) -> Response:
        cid = request.path_params["cid"]

        async def work(owner: str) -> Any:
            body = await self.front.body(request)
            if not isinstance(body, dict) or "items" not in body:
                raise oa.HttpError(400, "the request body must be an object with items", param="items")
            _only(body, "body", ("items",))

            def add(state: ConversationState) -> list[dict[str, Any]]:
                new = self._new_items(body["items"], state.items)
                state.items.extend(new)
                return new

            _rec, new = await self._change(owner, cid, add)
            return item_list(new)

        return await self._answer(request, work)

    async def retrieve_item(self, request: Request) -> Response:
        cid, item_id = request.path_params["cid"], request.path_params["item_id"]

        async def work(owner: str) -> Any:
            _rec, state = await self._read(owner, cid)
            return _find(state, item_id)

        return await self._answer(request, work)

    async def delete_item(self, request: Request) -> Response:
        cid, item_id = request.path_params["cid"], request.path_params["item_id"]

        async def work(owner: str) -> Any:
            def drop(state: ConversationState) -> ConversationState:
                state.items.remove(_find(state, item_id))
                return state

            rec, state = await self._change(owner, cid, drop)
            return self._object(cid, rec, state)

        return await self._answer(request, work)

    # ------------------------------------------------------------------ the Responses hook

    async def turn(self, owner: str, req: ResponseRequest, raw_input: Any, rid: str, call_id: Callable[[str, int], str]
                   ) -> tuple[TurnInput, Callable[[str, Finished], str]]:  # fmt: skip
        """A response in conversation ``req.conversation``: the turn's input (the
        conversation's items and the request's, as the whole history, in the
        conversation's session, which must exist) and the attachment its commit writes
        (the conversation's items, the request's input items and the response's output
        items appended). 404 naming ``conversation`` when there is none."""
        cid = req.conversation
        assert cid is not None
        _rec, state = await self._read(owner, cid, param="conversation")
        new = new_items(raw_input, "input")
        check_answers(state.items, new, "input")
        messages = history(state.items + new)
        if req.instructions:  # first, every turn: the same prefix (instructions are not items)
            messages.insert(0, ChatMessage("system", req.instructions))
        inp = dataclasses.replace(req.inp, session_id=cid, messages=tuple(messages), require_existing_session=True)
        tools = self.conversations.tools
        parse = (lambda text: tools.format.parser().parse(text)) if uses_tools(inp) else None
        rev = state.rev

        def attach(stored: str, fin: Finished) -> str:
            now = ConversationState.load(stored)
            if now is None:
                raise not_found(cid, param="conversation")
            if now.rev != rev:
                raise oa.HttpError(409, f"Conversation {cid!r} changed while this response ran (its items or "
                                   f"metadata were written); nothing was added: retry", "conflict_error",
                                   param="conversation", code="conversation_changed")  # fmt: skip
            now.items.extend(new + output_items(rid, fin, parse, call_id))
            now.rev += 1
            return now.dump()

        return inp, attach


def _find(state: ConversationState, item_id: str) -> dict[str, Any]:
    for it in state.items:
        if it["id"] == item_id:
            return it
    raise oa.HttpError(404, f"Item with id {item_id[:140]!r} not found.", "invalid_request_error", code="not_found")
