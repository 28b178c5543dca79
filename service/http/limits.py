"""What the HTTP front bounds before a request reaches the conversation: the body's
size (while it is read), its parse (time-sliced on the event loop, never one long
stall), the number of chat messages and of items in any JSON array or object (refused
while parsing: a body of 100,000 messages stops at the limit's first message past it),
and, per connection, how long the headers and the body may take to arrive and how many
connections the front holds at once (``front_protocol``: uvicorn's h11 protocol with
the deadlines and the limit; uvicorn has neither).

Why time-sliced: ``json.loads`` is C code that holds the GIL for its whole run (3.3 MB of
100,000 small objects: 130-230 ms on a loaded 2-core machine), so neither the event loop
nor a worker thread gets a turn meanwhile; a bigger body parsed here yields to the event
loop every ``SLICE_S``, and bodies are parsed one at a time (``BodyReader``'s lock), so
8 such requests at once cost another stream one slice, not 8 parses.
"""

from __future__ import annotations

import asyncio
import json
import json.decoder
import json.scanner
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from starlette.requests import ClientDisconnect, Request

from .openai import HttpError

if TYPE_CHECKING:
    from ..metrics import ServiceMetrics

log = logging.getLogger(__name__)

SLICE_S = 0.004  # the longest the parse holds the event loop at once (about)
FAST_BYTES = 16 << 10  # a body up to this size is parsed in one go (at most ~5,000 values: a few ms)
# a container below the second level (a message, a content part) that closes within this
# many characters is parsed whole by json's scanner (bigger ones are walked); it holds
# fewer items than any limit
WINDOW = 512
MAX_DEPTH = 900  # json.loads' own limit is the recursion limit (1000): about the same either way


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP front's limits (service/config.py's --http-* flags and --max-chat-messages)."""

    max_body_bytes: int = 4 << 20  # --max-message-size
    max_messages: int = 2048  # --max-chat-messages
    max_items: int = 1 << 17  # any other JSON array or object (a token-id prompt: the context length)
    header_timeout_s: float = 10.0  # --http-header-timeout
    body_timeout_s: float = 30.0  # --http-body-timeout
    keep_alive_timeout_s: float = 5.0  # --http-keep-alive-timeout
    max_connections: int = 1024  # --http-max-connections


class BodyReader:
    """Reads and parses request bodies within ``limits``; one parse at a time."""

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self._lock = asyncio.Lock()

    async def read(self, request: Request) -> bytes:
        """The body, refused (413) as soon as it passes ``max_body_bytes``, by its
        Content-Length or while it is read; a client gone meanwhile is a 499, not an error."""
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise HttpError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes "
                            "(--max-message-size)", code="request_too_large")  # fmt: skip
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > limit:
                    raise HttpError(413, f"request body exceeds the limit of {limit} bytes (--max-message-size)",
                                    code="request_too_large")  # fmt: skip
        except ClientDisconnect:
            raise HttpError(499, "the client went away while sending the request body",
                            code="client_closed_request") from None  # fmt: skip
        return bytes(data)

    async def parse(self, data: bytes) -> Any:
        """The JSON value of ``data`` (UTF-8 only), within the message and item limits."""
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise HttpError(400, f"the request body is not UTF-8 (byte {e.start}); send JSON in UTF-8") from None
        if text.startswith("\ufeff"):
            raise HttpError(400, "the request body starts with a byte order mark; send JSON in UTF-8 without one")
        async with self._lock:
            if len(data) <= FAST_BYTES:
                try:
                    value = json.loads(text)
                except (ValueError, RecursionError) as e:
                    raise _invalid(e) from None
                _check_items(value, self.limits)
                return value
            walk = _walk(text, self.limits)
            deadline = time.perf_counter() + SLICE_S
            try:
                while True:
                    next(walk)
                    if time.perf_counter() > deadline:
                        await asyncio.sleep(0)
                        deadline = time.perf_counter() + SLICE_S
            except StopIteration as stop:
                return stop.value
            except ValueError as e:
                raise _invalid(e) from None


def _invalid(e: Exception) -> HttpError:
    return HttpError(400, f"the request body is not valid JSON: {str(e)[:200]}")


def _too_many(path: str, limits: HttpLimits) -> HttpError:
    if path == "messages":
        return HttpError(400, f"messages has more than {limits.max_messages} messages; the limit is "
                         f"{limits.max_messages} (--max-chat-messages)", param="messages", code="too_many_messages")  # fmt: skip
    return HttpError(400, f"{path or 'the request body'} has more than {limits.max_items} items; the limit is "
                     f"{limits.max_items}", param=path or None, code="too_many_items")  # fmt: skip


def _limit_of(path: str, limits: HttpLimits) -> int:
    return limits.max_messages if path == "messages" else limits.max_items


def _check_items(value: Any, limits: HttpLimits) -> None:
    """The item limits on a body parsed in one go (``FAST_BYTES`` at most)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, (list, dict)):
            if len(v) > _limit_of(path, limits):
                raise _too_many(path, limits)
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in items if isinstance(x, (list, dict)))


_WS = re.compile(r"[ \t\n\r]*")
_SCAN = json.scanner.make_scanner(json.JSONDecoder())  # one scalar (or a whole container) at an index
_STRING = json.decoder.scanstring


def _walk(s: str, limits: HttpLimits) -> Iterator[None]:
    """``json.loads(s)`` as a generator: it yields every 256 values (the caller gives
    the event loop a turn when its slice is over) and returns the value; containers
    are walked here (so their item counts are checked as they grow), scalars and small
    containers below the second level (a ``WINDOW`` at most) parsed by json's own
    scanner. Raises ValueError where ``s`` is not JSON."""
    ws = _WS.match
    n = len(s)
    # a frame: [container, path, limit, key (objects)]
    stack: list[list[Any]] = []
    i = ws(s, 0).end()
    count = 0
    while True:
        # -- a value at i
        if i >= n:
            raise json.JSONDecodeError("Expecting value", s, i)
        c = s[i]
        # an item's container: whole, when it ends within WINDOW (whose at most WINDOW / 2
        # levels keep it within MAX_DEPTH)
        if (c == "{" or c == "[") and 2 <= len(stack) <= MAX_DEPTH - WINDOW // 2:
            try:
                value_done, end = _SCAN(s[i : i + WINDOW], 0)
                i += end
                c = ""
            except (StopIteration, ValueError, RecursionError):
                pass  # longer than the window (or not JSON): walked below
        if c == "":
            pass
        elif c == "{" or c == "[":
            path = _child_path(stack)
            value: Any = {} if c == "{" else []
            stack.append([value, path, _limit_of(path, limits), None])
            if len(stack) > MAX_DEPTH:
                raise ValueError(f"nested too deeply (more than {MAX_DEPTH} levels)")
            i = ws(s, i + 1).end()
            close = "}" if c == "{" else "]"
            if i < n and s[i] == close:
                i += 1
                value_done = stack.pop()[0]
            else:
                if c == "{":
                    i = _key(s, i, stack[-1])
                continue
        else:
            try:
                value_done, i = _SCAN(s, i)
            except StopIteration as e:
                raise json.JSONDecodeError("Expecting value", s, e.value) from None
        # -- a finished value: into its container, then a ',' or the container's end
        while True:
            count += 1
            if count & 255 == 0:
                yield
            if not stack:
                i = ws(s, i).end()
                if i != n:
                    raise json.JSONDecodeError("Extra data", s, i)
                return value_done
            frame = stack[-1]
            box = frame[0]
            if isinstance(box, dict):
                box[frame[3]] = value_done
            else:
                box.append(value_done)
            if len(box) > frame[2]:
                raise _too_many(frame[1], limits)
            i = ws(s, i).end()
            close = "}" if isinstance(box, dict) else "]"
            if i < n and s[i] == ",":
                i = ws(s, i + 1).end()
                if isinstance(box, dict):
                    i = _key(s, i, frame)
                break  # the next item's value
            if i < n and s[i] == close:
                i += 1
                value_done = stack.pop()[0]
                continue
            raise json.JSONDecodeError(f"Expecting ',' or '{close}'", s, i)


def _key(s: str, i: int, frame: list[Any]) -> int:
    """Reads ``"key" :`` at ``i`` into ``frame``; the index of the value after it."""
    if i >= len(s) or s[i] != '"':
        raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
    key, i = _STRING(s, i + 1)
    frame[3] = key
    i = _WS.match(s, i).end()
    if i >= len(s) or s[i] != ":":
        raise json.JSONDecodeError("Expecting ':' delimiter", s, i)
    return _WS.match(s, i + 1).end()


def _child_path(stack: list[list[Any]]) -> str:
    """The path of a container starting inside the innermost frame (``messages``,
    ``messages.3.content``); only the top level's names matter to the limits."""
    if not stack:
        return ""
    box, path, _, key = stack[-1]
    part = key if isinstance(box, dict) else str(len(box))
    return f"{path}.{part}" if path else str(part)


# ----------------------------------------------------------------------------- connections


def error_bytes(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection (OpenAI's error object)."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "service_unavailable", "param": None, "code": code}}).encode()  # fmt: skip
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


def front_protocol(limits: HttpLimits, metrics: ServiceMetrics | None = None) -> type:
    """uvicorn's h11 protocol with ``limits``' connection limit and read deadlines.

    A connection past ``max_connections`` gets 503 and is closed at once. From the
    connection (or the previous response) the request's headers must be complete within
    ``header_timeout_s``, and from the headers its body within ``body_timeout_s``; else
    it gets 408 (when no response has started) and is closed. Idle keep-alive
    connections close after ``keep_alive_timeout_s`` (uvicorn's own timer)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def count(reason: str) -> None:
        if metrics is not None:
            metrics.http_connections_closed.labels(reason).inc()

    class FrontProtocol(H11Protocol):
        _phase: str | None = None
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                count("connection_limit")
                transport.write(error_bytes(503, "Service Unavailable", f"the HTTP front holds its limit of "
                                            f"{limits.max_connections} connections (--http-max-connections); retry "
                                            "later", "too_many_connections"))  # fmt: skip
                transport.close()
                return
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._set(None)
            super().connection_lost(exc)

        def _watch(self) -> None:
            """The read deadline of where the request is: its headers, its body, or none."""
            if self.transport.is_closing():
                return self._set(None)
            state = self.conn.their_state
            self._set("headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None)

        def _set(self, phase: str | None) -> None:
            if phase == self._phase:
                return
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = phase
            if phase is not None:
                after = limits.header_timeout_s if phase == "headers" else limits.body_timeout_s
                self._timer = self.loop.call_later(after, self._expired, phase)

        def _expired(self, phase: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            count(f"{phase}_timeout")
            if self.cycle is None or not self.cycle.response_started:
                flag, after = (("--http-header-timeout", limits.header_timeout_s) if phase == "headers"
                               else ("--http-body-timeout", limits.body_timeout_s))  # fmt: skip
                what = "the request headers" if phase == "headers" else "the request body"
                self.transport.write(error_bytes(408, "Request Timeout", f"{what} did not arrive within {after:g} s "
                                                 f"({flag})", "request_timeout"))  # fmt: skip
            self.transport.close()

    return FrontProtocol


# ----------------------------------------------------------------------------- metrics labels

_LABELS = {408: "DEADLINE_EXCEEDED", 413: "RESOURCE_EXHAUSTED", 499: "CANCELLED"}


def status_label(status: int, code_of: Mapping[Any, tuple[int, str]]) -> str:
    """The gRPC code name ``kvserve_requests_total`` counts an HTTP status under (the
    same names as the gRPC front's): OK below 400, else the code ``code_of`` maps to it."""
    if status < 400:
        return "OK"
    if status in _LABELS:
        return _LABELS[status]
    code = next((c for c, (h, _) in code_of.items() if h == status), None)
    return code.name if code is not None else "UNKNOWN"


__all__ = ["HttpLimits", "BodyReader", "front_protocol", "status_label", "error_bytes", "SLICE_S"]
