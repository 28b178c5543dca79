"""A response that is not finished is not a response to follow up, against real servers
on loopback through the official ``openai`` client: while a response's turn runs (its
last event held in the engine), on this replica or on another one sharing Redis, a
follow-up naming it is 409 ``response_in_progress`` (``param`` ``previous_response_id``;
the SDKs retry a 409) and creates nothing, ``GET`` says ``in_progress``; once it
completes, the same follow-up runs from its whole transcript. An invalid
``previous_response_id`` is 400 naming that field, never a session id. (A response whose
replica died in its first turn: tests/system/test_responses_abandoned.py.)"""

from __future__ import annotations

import threading

import openai
import pytest

from tests.fixtures.serving import BLOCK_SIZE, HeldServer, ServerThread, redis_session_config, tiny_config, wait_until

FOX = "hello there, tell me about the fox"


def _client(s: ServerThread, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.running.http_port}/v1", api_key="x", max_retries=retries,
                         timeout=60)  # fmt: skip


class _Create(threading.Thread):
    """One ``responses.create`` in the background (streamed: its id comes with the first event)."""

    def __init__(self, c: openai.OpenAI, model: str, stream: bool) -> None:
        super().__init__(daemon=True)
        self.c, self.model, self.stream = c, model, stream
        self.id: str | None = None
        self.started = threading.Event()
        self.result: openai.types.responses.Response | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            kw = dict(model=self.model, input=FOX, max_output_tokens=12, temperature=0, extra_body={"ignore_eos": True})
            if self.stream:
                with self.c.responses.create(stream=True, **kw) as events:
                    for ev in events:
                        if ev.type == "response.created":
                            self.id = ev.response.id
                            self.started.set()
                        elif ev.type in ("response.completed", "response.incomplete"):
                            self.result = ev.response
            else:
                self.result = self.c.responses.create(**kw)
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e
        finally:
            self.started.set()


def _sessions(s: ServerThread) -> int:
    return len(s.call(s.running.sessions.store.list("", 100, ""))[0])


def _follow_up_refused(c: openai.OpenAI, model: str, prev: str) -> None:
    with pytest.raises(openai.ConflictError) as e:
        c.responses.create(model=model, input="and the dog?", previous_response_id=prev, max_output_tokens=4)
    body = e.value.body
    assert e.value.status_code == 409 and body["code"] == "response_in_progress", body
    assert body["param"] == "previous_response_id" and prev in body["message"] and "in progress" in body["message"]


def _follow_up_runs_from_the_whole_transcript(c: openai.OpenAI, model: str, first, cached: bool = True) -> None:
    r = c.responses.create(model=model, input="and the dog?", previous_response_id=first.id, max_output_tokens=4,
                           temperature=0)  # fmt: skip
    whole = first.usage.input_tokens + first.usage.output_tokens
    assert r.previous_response_id == first.id and r.usage.input_tokens > whole  # the parent's conversation and more
    if cached:  # (on this replica: its blocks on the device)
        assert r.usage.input_tokens_details.cached_tokens >= whole // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_follow_up_of_a_response_still_running_is_409_until_it_completes(tiny_llama_dir, stream):
    with HeldServer(tiny_config(tiny_llama_dir), http_port=0) as s, _client(s) as c:
        model = str(tiny_llama_dir)
        s.hold(True)
        first = _Create(c, model, stream)
        try:
            first.start()
            assert wait_until(lambda: s.held == 1)  # generated, not committed: in progress
            rid = first.id or s.call(s.running.sessions.store.list("", 100, ""))[0][0].session_id
            assert c.responses.retrieve(rid).status == "in_progress"
            before = _sessions(s)
            _follow_up_refused(c, model, rid)
            assert _sessions(s) == before  # nothing created
        finally:
            s.hold(False)
            first.join(60)
        assert first.error is None and first.result is not None and first.result.id == rid
        assert c.responses.retrieve(rid).status == "incomplete"  # 12 tokens, no eos
        _follow_up_runs_from_the_whole_transcript(c, model, first.result)


def test_a_response_running_on_another_replica_is_409_there_too(tiny_llama_dir, redis_url):
    cfg = redis_session_config(tiny_llama_dir, redis_url)
    with HeldServer(cfg, http_port=0) as a, ServerThread(cfg, http_port=0) as b, _client(a) as ca, _client(b) as cb:
        model = str(tiny_llama_dir)
        a.hold(True)
        first = _Create(ca, model, stream=True)
        try:
            first.start()
            assert wait_until(lambda: a.held == 1) and first.started.wait(30) and first.id
            assert cb.responses.retrieve(first.id).status == "in_progress"  # its record and lock in Redis
            _follow_up_refused(cb, model, first.id)
        finally:
            a.hold(False)
            first.join(60)
        assert first.error is None and first.result is not None
        _follow_up_runs_from_the_whole_transcript(cb, model, first.result, cached=False)  # (no shared KV tier here)


def test_an_invalid_previous_response_id_is_400_naming_that_field(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as s, _client(s) as c:
        for bad in ("resp_bad id!", "resp_" + "x" * 200, "resp_\u00e9", 123, "chatcmpl-1"):
            with pytest.raises(openai.BadRequestError) as e:
                c.responses.create(model=str(tiny_llama_dir), input=FOX, max_output_tokens=2,
                                   extra_body={"previous_response_id": bad})  # fmt: skip
            body = e.value.body
            assert body["param"] == "previous_response_id" and "previous_response_id" in body["message"], body
            assert "session" not in body["message"]
            if isinstance(bad, str):  # as a path: an unknown response
                with pytest.raises(openai.NotFoundError):
                    c.responses.retrieve(bad)
