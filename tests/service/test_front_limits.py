"""The HTTP front sheds abuse (service/http/limits.py) against a real server on loopback,
with real sockets: the chat-message limit and the item limit refused while the body is
parsed, the body-size limit applied while the body is read (before the client has sent
it all), half-open connections closed by the header and body deadlines (408), the
connection limit (503), UTF-16 bodies refused, a client gone mid-body counted as
CANCELLED without an "unexpected error", and the parse giving the event loop turns."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import pytest

from kvserve.service.http.limits import FAST_BYTES, BodyReader, HttpLimits
from kvserve.service.http.openai import HttpError
from tests.fixtures.serving import ServerThread, tiny_config, wait_until

HEADER_TIMEOUT = 0.6
BODY_TIMEOUT = 0.6
MAX_CONNECTIONS = 6


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    cfg = tiny_config(
        tiny_llama_dir, max_message_size=64 << 10, max_chat_messages=8, http_header_timeout=HEADER_TIMEOUT,
        http_body_timeout=BODY_TIMEOUT, http_max_connections=MAX_CONNECTIONS, http_keep_alive_timeout=30.0,
    )  # fmt: skip
    with ServerThread(cfg, http_port=0) as s:
        yield s


def connect(s: ServerThread) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", s.running.http_port), timeout=10)
    return sock


def read_all(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything until the server closes the connection (b'' at once means it did)."""
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def post(s: ServerThread, body: bytes, path: str = "/v1/chat/completions", headers: str = "") -> tuple[int, dict]:
    sock = connect(s)
    try:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{headers}\r\n".encode() + body
        )  # fmt: skip
        return parse_response(read_all(sock))
    finally:
        sock.close()


def parse_response(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body) if body else {}


def _content_length(raw: bytes) -> int:
    head = raw.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else 0


def chat(n_messages: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": ""}] * n_messages, "max_tokens": 2}).encode()


def requests_total(s: ServerThread, code: str) -> float:
    value = s.running.metrics.registry.get_sample_value(
        "kvserve_requests_total", {"method": "http:ChatCompletions", "code": code}
    )
    return value or 0.0


def closed_total(s: ServerThread, reason: str) -> float:
    return s.running.metrics.registry.get_sample_value("kvserve_http_connections_closed_total", {"reason": reason}) or 0.0


# ----------------------------------------------------------------------------- body limits


def test_too_many_messages_is_its_own_error(server):
    status, body = post(server, chat(9))
    assert status == 400
    assert body["error"]["code"] == "too_many_messages"
    assert body["error"]["param"] == "messages"
    assert "--max-chat-messages" in body["error"]["message"] and "8" in body["error"]["message"]
    # 1,500 of them (as much as the 64 KiB body limit holds): refused the same way, at the 9th, while parsing
    assert len(chat(1500)) < 64 << 10
    status, body = post(server, chat(1500))
    assert (status, body["error"]["code"]) == (400, "too_many_messages")


def test_at_the_message_limit_is_accepted(server):
    status, body = post(server, json.dumps({"messages": [{"role": "user", "content": "hi"}] * 8, "max_tokens": 2}).encode())
    assert status == 200, body


def test_too_many_items_in_another_array(server):
    limit = max(server.engine.model_info.context_length, 1 << 16)
    body = json.dumps({"prompt": [5] * (limit + 1), "max_tokens": 1}).encode()
    assert len(body) <= 4 << 20
    reader = BodyReader(HttpLimits(max_body_bytes=4 << 20, max_items=limit))
    with pytest.raises(HttpError) as e:
        asyncio.run(reader.parse(body))
    assert e.value.status == 400 and e.value.code == "too_many_items" and e.value.param == "prompt"


def test_utf16_body_is_refused(server):
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode("utf-16")
    status, err = post(server, body)
    assert status == 400
    assert "UTF-8" in err["error"]["message"]


def test_body_limit_applies_while_reading(server):
    """A chunked body (no Content-Length) past --max-message-size gets 413 while the
    client is still sending: the rest is never read."""
    before = requests_total(server, "RESOURCE_EXHAUSTED")
    sock = connect(server)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip
        chunk = b"[" + b" " * 8190 + b"\n"
        for _ in range(10):  # 80 KiB: past the 64 KiB limit, and the body is not finished
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        sock.settimeout(10)
        raw = sock.recv(65536)
        while b"\r\n\r\n" not in raw or len(raw.partition(b"\r\n\r\n")[2]) < _content_length(raw):
            raw += sock.recv(65536)
    finally:
        sock.close()
    status, body = parse_response(raw)
    assert status == 413
    assert "--max-message-size" in body["error"]["message"]
    # counted under a gRPC code name, as every other refusal (not the label "413")
    assert wait_until(lambda: requests_total(server, "RESOURCE_EXHAUSTED") == before + 1, timeout=10)
    assert server.running.metrics.registry.get_sample_value(
        "kvserve_requests_total", {"method": "http:ChatCompletions", "code": "413"}) is None  # fmt: skip


# ----------------------------------------------------------------------------- connections


def test_partial_headers_are_closed_after_the_header_timeout(server):
    before = closed_total(server, "headers_timeout")
    socks = [connect(server) for _ in range(3)]
    for sock in socks:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # never finished
    t0 = time.monotonic()
    raws = [read_all(sock, timeout=HEADER_TIMEOUT + 10) for sock in socks]
    waited = time.monotonic() - t0
    for sock in socks:
        sock.close()
    for raw in raws:
        status, body = parse_response(raw)
        assert status == 408
        assert "--http-header-timeout" in body["error"]["message"]
    assert waited >= HEADER_TIMEOUT * 0.8  # the deadline, not an immediate refusal
    assert closed_total(server, "headers_timeout") == before + 3
    assert wait_until(lambda: len(server.running.http_server.server_state.connections) == 0, timeout=10)


def test_a_silent_connection_is_closed_too(server):
    sock = connect(server)
    raw = read_all(sock, timeout=HEADER_TIMEOUT + 10)
    sock.close()
    assert parse_response(raw)[0] == 408


def test_partial_body_is_closed_after_the_body_timeout(server):
    before = closed_total(server, "body_timeout")
    sock = connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: 1000\r\n\r\n{\"messages\": [")  # fmt: skip
    raw = read_all(sock, timeout=BODY_TIMEOUT + 10)
    sock.close()
    status, body = parse_response(raw)
    assert status == 408
    assert "--http-body-timeout" in body["error"]["message"]
    assert closed_total(server, "body_timeout") == before + 1


def test_slow_drip_body_is_closed_too(server):
    """A body that trickles in (a byte at a time) is bound by the same deadline."""
    sock = connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < BODY_TIMEOUT + 10:
        try:
            sock.sendall(b" ")
        except OSError:
            closed = True
            break
        sock.settimeout(0.05)
        try:
            if sock.recv(65536) == b"":
                closed = True
                break
        except socket.timeout:
            pass
        except OSError:
            closed = True
            break
    sock.close()
    assert closed


def test_connection_limit(server):
    before = closed_total(server, "connection_limit")
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            sock = connect(server)
            held.append(sock)
        assert wait_until(lambda: len(server.running.http_server.server_state.connections) == MAX_CONNECTIONS,
                          timeout=10)  # fmt: skip
        extra = connect(server)
        raw = read_all(extra, timeout=5)
        extra.close()
        status, body = parse_response(raw)
        assert status == 503
        assert body["error"]["code"] == "too_many_connections" and "--http-max-connections" in body["error"]["message"]
        assert closed_total(server, "connection_limit") == before + 1
    finally:
        for sock in held:
            sock.close()
    # the slots free up: a request goes through again
    assert wait_until(lambda: len(server.running.http_server.server_state.connections) == 0, timeout=10)
    status, _ = _get_health(server)
    assert status == 200


def _get_health(s: ServerThread) -> tuple[int, dict]:
    sock = connect(s)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return parse_response(read_all(sock))
    finally:
        sock.close()


def test_client_gone_mid_body_is_cancelled_not_an_error(server, caplog):
    before = requests_total(server, "CANCELLED")
    caplog.set_level(logging.INFO)
    sock = connect(server)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n{\"messages\"")
    time.sleep(0.1)
    sock.close()
    assert wait_until(lambda: requests_total(server, "CANCELLED") == before + 1, timeout=10)
    assert not [r for r in caplog.records if "unexpected error" in r.getMessage()]
    assert not [r for r in caplog.records if r.exc_info]


# ----------------------------------------------------------------------------- the parse


def test_large_parse_matches_json_and_gives_the_loop_turns():
    """A body past the one-go size is parsed in slices: the same value as json.loads,
    and a task beside it gets turns while it runs."""
    value = {"messages": [{"role": "user", "content": f"m{i} \u00e9\\\""} for i in range(20_000)],
             "stop": ["a", "b"], "temperature": 0.5, "seed": None, "x": {"y": [1, 2.5e-3, True, False, None]}}  # fmt: skip
    data = json.dumps(value, indent=1).encode()
    reader = BodyReader(HttpLimits(max_body_bytes=len(data), max_messages=20_000))

    async def main() -> tuple[object, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        try:
            out = await reader.parse(data)
        finally:
            done.set()
            await task
        return out, ticks

    out, ticks = asyncio.run(main())
    assert out == value
    assert ticks > 2  # the parse yielded to the loop (one go would give the ticker no turn at all)


@pytest.mark.parametrize("bad", [b"[1,]", b'{"a":1,}', b'{"a" 1}', b"[1 2]", b'{"a":1}x', b"", b"[" * 1100 + b"]" * 1100])
def test_large_parse_refuses_what_json_refuses(bad):
    reader = BodyReader(HttpLimits())
    big = b'{"pad": [' + b",".join([b"0"] * 10_000) + b'], "v": ' + bad + b"}"
    assert len(big) > FAST_BYTES  # parsed in slices, not in one go
    with pytest.raises((ValueError, RecursionError)):
        json.loads(big)
    with pytest.raises(HttpError) as e:
        asyncio.run(reader.parse(big))
    assert e.value.status == 400


def test_large_parse_takes_what_json_takes_nested():
    reader = BodyReader(HttpLimits())
    big = b'{"pad": [' + b",".join([b"0"] * 10_000) + b'], "v": ' + b"[" * 300 + b"{}" + b"]" * 300 + b"}"
    assert asyncio.run(reader.parse(big)) == json.loads(big)
