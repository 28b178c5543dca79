"""Request edges over real gRPC: unparsable request bytes answer INVALID_ARGUMENT, huge
text is refused before it is tokenized, client cancellations are counted, and a turn
can demand an existing session and learns whether it created or resumed one."""

from __future__ import annotations

import grpc
import pytest

from kvserve.clients import KVServeClient, KVServeError, TextDelta
from tests.fixtures.serving import ServerThread, held_running, tiny_config, wait_until

GENERATE = "/kvserve.v1.GenerationService/Generate"
GET_SESSION = "/kvserve.v1.GenerationService/GetSession"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, host_cache_memory=0)) as s:
        yield s


def _raw_call(address: str, method: str, data: bytes, streaming: bool) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        if streaming:
            call = ch.unary_stream(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as err:
                list(call(data, timeout=30))
        else:
            call = ch.unary_unary(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as err:
                call(data, timeout=30)
    return err.value


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x02\xff\xfe",  # text (field 1) with invalid UTF-8
        b"\x0a\x05ab",  # text claims 5 bytes, has 2
        b"\x7b" * 300,  # unknown field 15 as nested groups, 300 deep
    ],
    ids=["bad-utf8", "truncated", "group-bomb"],
)
def test_unparsable_requests_are_invalid_argument(server, data, caplog):
    err = _raw_call(server.address, GENERATE, data, streaming=True)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "not a valid kvserve.v1.GenerateRequest message" in err.details()
    err = _raw_call(server.address, GET_SESSION, data, streaming=False)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not [r for r in caplog.records if r.exc_info]  # one line, no traceback


def test_text_that_cannot_fit_is_refused_before_tokenizing(server):
    with KVServeClient(server.address, timeout=60) as c:
        with pytest.raises(KVServeError) as err:
            c.complete(text="word " * 780_000, max_new_tokens=1)  # 3.9 MB
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "input too long" in err.value.details and "the context length" in err.value.details
        # under the byte bound but over the context: tokenized (in a worker), then refused
        ctx = server.engine.model_info.context_length
        with pytest.raises(KVServeError) as err:
            c.complete(text="hello " * ctx, max_new_tokens=1)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "context length" in err.value.details
        assert c.complete(text="still serving", max_new_tokens=2).token_ids


def test_client_cancellations_are_counted(server):
    """Each stream is held running from its first step (``EngineHold``, in place before it
    starts) until the server has ended its cancelled call: its 400 tokens could otherwise
    end (counted as ``length``) before the cancel."""
    finished = server.running.metrics.finished.labels("cancelled")
    before = finished._value.get()
    engine = server.engine
    with KVServeClient(server.address, timeout=60) as c:
        for _ in range(3):
            stream, running = held_running(
                server, lambda: c.generate(text="count to a thousand", max_new_tokens=400, ignore_eos=True))
            try:
                for event in stream:
                    if isinstance(event, TextDelta) and event.token_ids:
                        assert running.held.wait(60) and engine.stats().running == 1  # the stream runs, held
                        stream.cancel()
                assert wait_until(lambda: server.running.admission.inflight == 0)  # the server ended the call
            finally:
                running.release()
            assert wait_until(lambda: engine.stats().running == 0)
    assert wait_until(lambda: finished._value.get() == before + 3)


def test_a_turn_can_demand_an_existing_session_and_says_created_or_resumed(server):
    with KVServeClient(server.address, timeout=60) as c:
        with pytest.raises(KVServeError) as err:
            c.chat("gone", "are you there?", max_new_tokens=2, require_existing_session=True)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "require_existing_session" in err.value.details
        with pytest.raises(KVServeError) as err:
            c.get_session("gone")  # nothing was created
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        first = c.chat("here", "hello", max_new_tokens=2)
        second = c.chat("here", "again", max_new_tokens=2, require_existing_session=True)
        assert first.start.session_created and not second.start.session_created
        one_off = c.complete(text="no session", max_new_tokens=2)
        assert not one_off.start.session_created
        with pytest.raises(KVServeError) as err:
            c.complete(text="x", max_new_tokens=2, require_existing_session=True)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
