"""Every bad request gets a precise status and message, and the server serves a good
request right after. Over real gRPC, on a server with a short context (128 tokens),
one running sequence and a queue of one, so limits are reachable with tiny inputs."""

from __future__ import annotations

import logging
import re
import threading

import grpc
import pytest

from kvserve.clients import KVServeClient, KVServeError, TextDelta
from kvserve.service.types import InvalidRequest
from kvserve.service.validation import check_context
from tests.fixtures.serving import ServerThread, held_running, tiny_config, wait_until

CONTEXT = 128
LIMIT = 64


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    cfg = tiny_config(
        tiny_llama_dir, max_model_len=CONTEXT, max_new_tokens_limit=LIMIT, default_max_new_tokens=8,
        max_num_seqs=1, max_queue=1,
    )  # fmt: skip
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture
def client(server):
    with KVServeClient(server.address, timeout=60) as c:
        yield c


def _status(call) -> KVServeError:
    with pytest.raises(KVServeError) as err:
        call()
    return err.value


def _good_request_works(client: KVServeClient) -> None:
    reply = client.complete(text="good request", max_new_tokens=3)
    assert reply.end.completion_tokens == 3


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _message(check, *args) -> str:
    """The message ``service.validation``'s ``check`` raises for ``args``."""
    with pytest.raises(InvalidRequest) as e:
        check(*args)
    return str(e.value)

# (id, request kwargs, expected code, regex the message must match)
BAD_REQUESTS = [
    ("no-input", dict(token_ids=None, text=None), INVALID, r"empty input: set one of text, chat or tokens"),
    ("empty-text", dict(text=""), INVALID, r"empty input: text is empty"),
    ("empty-chat", dict(messages=[]), INVALID, r"empty input: chat.messages is empty"),
    ("empty-tokens", dict(token_ids=[]), INVALID, r"empty input: tokens.ids is empty"),
    ("unknown-role", dict(messages=[("user", "hi"), ("wizard", "zap")]), INVALID,
     r"chat.messages\[1\].role 'wizard' is unknown; use one of .*user"),
    ("token-outside-vocab", dict(token_ids=[1, 5, 400]), INVALID,
     r"tokens.ids\[2\] = 400 is outside the vocabulary \(ids must be < 400\)"),
    ("max-new-tokens-0", dict(text="hi", max_new_tokens=0), INVALID, r"max_new_tokens must be >= 1, got 0"),
    ("max-new-tokens-over-limit", dict(text="hi", max_new_tokens=LIMIT + 1), INVALID,
     rf"max_new_tokens {LIMIT + 1} exceeds the limit {LIMIT}"),
    ("negative-temperature", dict(text="hi", temperature=-0.5), INVALID, r"temperature must be >= 0, got -0.5"),
    ("top-p-zero", dict(text="hi", top_p=0.0), INVALID, r"top_p must be in \(0, 1\], got 0.0"),
    ("top-p-above-one", dict(text="hi", top_p=1.5), INVALID, r"top_p must be in \(0, 1\], got 1.5"),
    ("negative-top-k", dict(text="hi", top_k=-1), INVALID, r"top_k must be >= 0, got -1"),
    ("stop-token-outside-vocab", dict(text="hi", stop_token_ids=[9999]), INVALID,
     r"stop_token_ids\[0\] = 9999 is outside the vocabulary"),
    # the context messages' text is asserted in tests/unit/test_validation.py
    ("prompt-longer-than-context", dict(token_ids=[7] * (CONTEXT + 5)), INVALID,
     re.escape(_message(check_context, 0, CONTEXT + 5, CONTEXT))),
    ("prompt-plus-max-new-tokens-over-context", dict(token_ids=[7] * 100, max_new_tokens=40), INVALID,
     re.escape(_message(check_context, 0, 100, CONTEXT, 40))),
    ("bad-session-id", dict(text="hi", session_id="no spaces allowed"), INVALID,
     r"session_id must be 1 to 128 characters"),
]  # fmt: skip


@pytest.mark.parametrize("kwargs,code,message", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_its_status_then_a_good_request_succeeds(server, client, kwargs, code, message):
    if kwargs.get("text") is None and kwargs.get("token_ids") is None and "messages" not in kwargs:
        from kvserve.proto.kvserve.v1 import generation_pb2 as pb
        from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc

        # the client refuses to build a request without input; send a raw empty one
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as raw:
                list(pb_grpc.GenerationServiceStub(ch).Generate(pb.GenerateRequest(), timeout=30))
        err = KVServeError.from_rpc_error(raw.value)
    else:
        err = _status(lambda: client.complete(**kwargs))
    assert err.code == code, err
    assert re.search(message, err.details), err.details
    _good_request_works(client)


def test_unknown_session_on_get_and_delete_is_not_found(client):
    for call in (lambda: client.get_session("never-made"), lambda: client.delete_session("never-made")):
        err = _status(call)
        assert err.code == grpc.StatusCode.NOT_FOUND and "'never-made' not found" in err.details
    _good_request_works(client)


def test_a_session_turn_that_would_exceed_the_context_gives_the_numbers(client):
    sid = "grows-too-long"
    client.complete(token_ids=list(range(10, 100)), session_id=sid, max_new_tokens=10)  # 100 tokens
    err = _status(lambda: client.complete(token_ids=list(range(10, 30)), session_id=sid, max_new_tokens=10))
    assert err.code == INVALID
    assert err.details == _message(check_context, 100, 20, CONTEXT, 10, sid)  # the numbers: test_validation.py
    assert client.get_session(sid).token_count == 100  # unchanged
    _good_request_works(client)


@pytest.fixture
def long_turns(tiny_llama_dir):
    """A client of a server like ``server`` with one running slot and one queue place, whose
    turns can run long (480 tokens) when a test holds one running (``EngineHold``)."""
    cfg = tiny_config(tiny_llama_dir, max_model_len=512, max_new_tokens_limit=480, default_max_new_tokens=8,
                      max_num_seqs=1, max_queue=1)  # fmt: skip
    with ServerThread(cfg) as s, KVServeClient(s.address, timeout=60) as c:
        yield s, c


def test_busy_session_is_failed_precondition_and_queue_full_is_resource_exhausted(long_turns):
    """The long turn is held running from its first step (``EngineHold``, in place before it
    starts) until its cancel has ended it on the server: its 480 tokens take the tiny model
    some tens of ms, so unheld it could end before the calls that need it in flight."""
    server, client = long_turns
    sid = "busy"
    client.complete(text="first turn", session_id=sid, max_new_tokens=2)
    stream, running = held_running(
        server, lambda: client.generate(text="long running turn", session_id=sid, max_new_tokens=480, ignore_eos=True))
    try:
        events = iter(stream)
        next(events)  # Started: the turn holds the session
        assert running.held.wait(60)  # and the only running slot, held before its second step

        err = _status(lambda: client.complete(text="second turn", session_id=sid))
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION and "already has a turn in flight" in err.details
        assert client.get_session(sid).busy
        err = _status(lambda: client.delete_session(sid))
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION

        # one running (max_num_seqs=1), one waiting (max_queue=1): the next is refused
        waiting = client.generate(text="waits in the queue", max_new_tokens=4)
        waiter = threading.Thread(target=lambda: list(waiting))
        waiter.start()
        assert wait_until(lambda: server.engine.stats().waiting == 1)
        err = _status(lambda: client.complete(text="one too many", max_new_tokens=4))
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in err.details
        assert server.engine.stats().running == 1  # the long turn still ran

        stream.cancel()
        assert wait_until(lambda: not client.get_session(sid).busy)  # the server ended the turn
    finally:
        running.release()
    waiter.join(60)
    assert client.get_session(sid).turns == 1  # the cancelled turn left nothing
    _good_request_works(client)


class _Exploding:
    """The real engine, except that ``generate`` fails unexpectedly."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, req):
        raise RuntimeError("kaboom in the engine")


def test_unexpected_error_is_internal_with_a_logged_request_id(server, client, caplog):
    conversations = server.running.conversations
    real = conversations.engine
    conversations.engine = _Exploding(real)
    try:
        with caplog.at_level(logging.ERROR, logger="kvserve.service.servicer"):
            err = _status(lambda: client.complete(text="boom", max_new_tokens=2))
    finally:
        conversations.engine = real
    assert err.code == grpc.StatusCode.INTERNAL
    m = re.fullmatch(r"internal error \(request id ([0-9a-f]+)\)", err.details)
    assert m, err.details
    logged = [r for r in caplog.records if m.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info and "kaboom in the engine" in str(logged[0].exc_info[1])
    assert "kaboom" not in err.details  # internals stay in the log
    _good_request_works(client)


def test_a_stream_after_errors_is_still_well_formed(client):
    events = list(client.generate(text="final check", max_new_tokens=5))
    assert sum(isinstance(e, TextDelta) for e in events) >= 1
    assert events[-1].completion_tokens == 5
