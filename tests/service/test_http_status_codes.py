"""The HTTP front's status and ``error.code`` of each session error (docs/api.md's
table), over a real server on loopback through the official ``openai`` package: a busy
session (a conflict a retry mends) and a fork to an existing id are 409 with their own
codes, a turn that is not there is 400 (google.rpc's FAILED_PRECONDITION); the cases one
server cannot reach over HTTP, through ``error_of``."""

from __future__ import annotations

import openai
import pytest

from kvserve.service.http import openai as oa
from kvserve.service.http import responses
from kvserve.service.sessions import SessionBusy, SessionConflict, SessionExists, TurnsChanged, TurnUnavailable
from kvserve.service.sessions.stores import copy_record
from tests.fixtures.serving import ServerThread, tiny_config

FOX = "hello there, tell me about the fox"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.running.http_port}/v1", api_key="x", max_retries=0,
                       timeout=60) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


def _chat(oai, model, sid: str, n: int = 4):
    return oai.chat.completions.create(model=model, messages=[{"role": "user", "content": FOX}], max_tokens=n,
                                       extra_headers={"X-Session-Id": sid}, extra_body={"ignore_eos": True})  # fmt: skip


def _error(e: pytest.ExceptionInfo) -> tuple[int, str, str]:
    return e.value.status_code, e.value.body["type"], e.value.body["code"]


def _counted(server, code: str) -> float:
    """kvserve_requests_total of the Responses API under a gRPC code name."""
    value = server.running.metrics.registry.get_sample_value(
        "kvserve_requests_total", {"method": "http:Responses", "code": code})  # fmt: skip
    return value or 0.0


def test_a_turn_on_a_busy_session_is_409_session_busy(oai, model, server):
    sessions = server.running.sessions
    turn = server.call(sessions.begin_turn("", "codes-busy"))  # a turn in flight holds the session's lock
    try:
        with pytest.raises(openai.ConflictError) as e:
            _chat(oai, model, "codes-busy")
        assert _error(e) == (409, "conflict_error", "session_busy") and "in flight" in e.value.body["message"]
    finally:
        server.call(sessions.end_turn(turn))
    _chat(oai, model, "codes-busy")  # free again
    server.call(sessions.delete("", "codes-busy"))


@pytest.mark.parametrize(
    "exc, want",
    [
        (SessionBusy("session 's' has a turn in flight"), (409, "conflict_error", "session_busy")),
        (SessionConflict("another replica wrote session 's'"), (409, "conflict_error", "session_conflict")),
        (TurnsChanged("session 's' has 3 turns, not 2"), (409, "conflict_error", "turns_changed")),
        (TurnUnavailable("no completed turn"), (400, "invalid_request_error", "turn_unavailable")),
        (SessionExists("session 's' already exists"), (409, "conflict_error", "already_exists")),
    ],
)
def test_each_session_error_has_its_status_and_code(exc, want):
    """The cases a single server cannot reach over HTTP (an overtaken turn needs another
    replica's write through Redis: tests/system/test_redis_faults.py; expected_turns is
    gRPC's) get the table's status and code, as those the tests above reach do."""
    err = oa.error_of(exc, "r1")
    assert (err.status, err.type, err.code) == want and err.message == str(exc)


def test_a_fork_to_an_existing_id_is_409_already_exists(oai, model, server, monkeypatch):
    r1 = oai.responses.create(model=model, input=FOX, max_output_tokens=3)
    r2 = oai.responses.create(model=model, input=FOX, max_output_tokens=3)
    monkeypatch.setattr(responses, "new_response_id", lambda: r2.id)  # the new response's id is taken
    before = {c: _counted(server, c) for c in ("ALREADY_EXISTS", "FAILED_PRECONDITION")}
    with pytest.raises(openai.ConflictError) as e:
        oai.responses.create(model=model, input="more", previous_response_id=r1.id, max_output_tokens=3)
    assert _error(e) == (409, "conflict_error", "already_exists") and "already exists" in e.value.body["message"]
    # counted under the gRPC code it came from, as the gRPC front counts it, not as any 409
    assert _counted(server, "ALREADY_EXISTS") == before["ALREADY_EXISTS"] + 1
    assert _counted(server, "FAILED_PRECONDITION") == before["FAILED_PRECONDITION"]
    monkeypatch.undo()
    for r in (r1, r2):
        oai.responses.delete(r.id)


def test_a_follow_up_of_a_response_without_turn_boundaries_is_400_turn_unavailable(oai, model, server):
    r1 = oai.responses.create(model=model, input=FOX, max_output_tokens=3)
    store = server.running.sessions.store
    rec = server.call(store.get("", r1.id))
    server.call(store.put(copy_record(rec, turn_log=[])))  # as a version 1 record loads
    before = {c: _counted(server, c) for c in ("FAILED_PRECONDITION", "INVALID_ARGUMENT")}
    with pytest.raises(openai.BadRequestError) as e:  # retrying never mends it
        oai.responses.create(model=model, input="more", previous_response_id=r1.id, max_output_tokens=3)
    assert _error(e) == (400, "invalid_request_error", "turn_unavailable")
    assert _counted(server, "FAILED_PRECONDITION") == before["FAILED_PRECONDITION"] + 1  # not as any 400
    assert _counted(server, "INVALID_ARGUMENT") == before["INVALID_ARGUMENT"]
    assert "turn boundaries" in e.value.body["message"]
    oai.responses.delete(r1.id)
