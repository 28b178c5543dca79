"""A request that is refused, fails or is cancelled leaves its session exactly as it was,
on both fronts and for every session operation: each kind of bad request is sent to a
session with turns (over the OpenAI HTTP front with X-Session-Id, over gRPC's Generate,
RewindSession and ForkSession, and over /v1/responses with previous_response_id) and the
session's record is compared before and after: transcript, turns, turn boundaries, cache
salt, fork source (only ``last_used_at`` and the write's etag may change: a turn that
started touched the session). Real server, real clients, on loopback."""

from __future__ import annotations

import grpc
import openai
import pytest

from kvserve.clients import KVServeClient, KVServeError
from kvserve.service.history import HistoryAction, plan_history
from kvserve.service.sessions.stores import copy_record
from kvserve.service.types import ChatMessage, SamplingParams, TurnInput
from tests.fixtures.serving import EngineHold, ServerThread, held_running, tiny_config, wait_until

HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, tell me about the fox"}]
USERS = [HELLO, [{"role": "user", "content": "what is the fox doing now"}], [{"role": "user", "content": "and the dog?"}]]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    url = f"http://127.0.0.1:{server.running.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    with KVServeClient(server.address, timeout=60) as g:
        yield g


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


def _record(server, sid: str) -> tuple | None:
    rec = server.call(server.running.sessions.store.get("", sid))
    if rec is None:
        return None
    return rec.token_ids, rec.turns, rec.turn_log, rec.cache_salt, rec.forked_from, rec.created_at


def _three_turns(oai, model, sid: str) -> list[dict]:
    history: list[dict] = []
    for user in USERS:
        history += user
        r = oai.chat.completions.create(model=model, messages=history, max_tokens=4, extra_headers={"X-Session-Id": sid},
                                        extra_body={"ignore_eos": True})  # fmt: skip
        history.append({"role": "assistant", "content": r.choices[0].message.content})
    return history


def _bad_histories(msgs: list[dict], ctx: int) -> list[tuple[str, list[dict], dict, type]]:
    """(name, messages, extra request fields, the error) for each way an HTTP turn is refused."""
    wizard = [*msgs[:-2], {"role": "wizard", "content": "and the dog?"}]  # regenerate pattern, then an unknown role
    edited = [dict(m) for m in msgs]
    edited[3]["content"] = "something else entirely"  # diverges at turn 2
    edited.append({"role": "wizard", "content": "x"})
    big = [*msgs[:-1], {"role": "user", "content": "fox " * ctx}]
    return [
        ("rewind then unknown role", wizard, {}, openai.BadRequestError),
        ("edit then unknown role", edited, {}, openai.BadRequestError),
        ("extend then unknown role", [*msgs, {"role": "wizard", "content": "x"}], {}, openai.BadRequestError),
        ("rewind then context overflow", big, {}, openai.BadRequestError),
        ("extend then context overflow", [*msgs, {"role": "user", "content": "fox " * ctx}], {}, openai.BadRequestError),
        ("rewind then too many tokens asked", msgs[:-1], {"max_tokens": ctx}, openai.BadRequestError),
        ("rewind then a bad schema", msgs[:-1], {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}}, openai.BadRequestError),  # fmt: skip
        ("rewind then a bad sampling field", msgs[:-1], {"temperature": -1}, openai.BadRequestError),
        ("reset then context overflow", msgs, {"max_tokens": ctx - 8}, openai.BadRequestError),
        ("n = 2", [*msgs, {"role": "user", "content": "more"}], {"n": 2}, openai.BadRequestError),
    ]


def test_a_refused_http_turn_leaves_the_session_as_it_was(oai, model, server):
    msgs = _three_turns(oai, model, "integrity")
    before = _record(server, "integrity")
    assert before[1] == 3
    ctx = server.engine.model_info.context_length
    for name, history, extra, error in _bad_histories(msgs, ctx):
        body = {k: v for k, v in extra.items() if k not in ("max_tokens", "temperature", "n", "response_format")}
        kw = {k: v for k, v in extra.items() if k in ("max_tokens", "temperature", "n", "response_format")}
        with pytest.raises(error):
            oai.chat.completions.create(model=model, messages=history, extra_headers={"X-Session-Id": "integrity"},
                                        extra_body=body or None, **({"max_tokens": 4} | kw))  # fmt: skip
        assert _record(server, "integrity") == before, name


def test_the_history_plan_that_the_review_found_rewinding_before_a_refusal(oai, model, server):
    """The regenerate pattern with an unknown role: the plan is a rewind of one turn (it
    used to be applied before the role was checked, leaving a 2-turn session with 0 turns)."""
    msgs = _three_turns(oai, model, "plan")
    rec = server.call(server.running.sessions.store.get("", "plan"))
    wizard = tuple(ChatMessage(m["role"], m["content"]) for m in [*msgs[:-2], {"role": "wizard", "content": "x"}])
    plan = plan_history(server.engine.tokenizer, rec, wizard)
    assert (plan.action, plan.keep_turns, plan.rewound_turns) == (HistoryAction.REWIND, 2, 1)
    before = _record(server, "plan")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[dict(m) for m in msgs[:-2]] + [{"role": "wizard", "content": "x"}],
                                    max_tokens=4, extra_headers={"X-Session-Id": "plan"})  # fmt: skip
    assert e.value.body["param"] == f"messages[{len(msgs) - 2}].role"  # the index in the request sent
    assert _record(server, "plan") == before


def test_a_refused_turn_on_a_record_without_turn_boundaries_leaves_it_as_it_was(oai, model, server):
    msgs = _three_turns(oai, model, "legacy-int")
    store = server.running.sessions.store
    server.call(store.put(copy_record(server.call(store.get("", "legacy-int")), turn_log=[])))
    before = _record(server, "legacy-int")
    edited = [dict(m) for m in msgs]
    edited[3]["content"] = "something else entirely"  # a reset: the record cannot be rewound
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=model, messages=[*edited, {"role": "wizard", "content": "x"}], max_tokens=4,
                                    extra_headers={"X-Session-Id": "legacy-int"})  # fmt: skip
    assert _record(server, "legacy-int") == before


def test_a_cancelled_http_turn_that_diverged_leaves_the_session_as_it_was(oai, model, server):
    msgs = _three_turns(oai, model, "cancel")
    before = _record(server, "cancel")
    # the turn is held running from its first step until the server has ended it: its 300
    # tokens could otherwise end, and commit, before the connection closes (the hold is in
    # place before the request comes, the engine's loop stepping idle until it runs)
    running = EngineHold(server, running=1)
    try:
        with oai.chat.completions.with_streaming_response.create(
            model=model, messages=msgs[:-1], max_tokens=300, stream=True, extra_headers={"X-Session-Id": "cancel"},
            extra_body={"ignore_eos": True},
        ) as resp:  # fmt: skip
            next(resp.iter_lines())  # the role chunk: the turn started
            # its sequence runs, held (its first token may have no text yet: no chunk for it)
            assert running.held.wait(60) and server.engine.stats().running == 1
        # the stream is closed: the turn is cancelled in the engine and not recorded
        assert wait_until(lambda: not server.running.sessions.in_flight_here("", "cancel"), timeout=30)
    finally:
        running.release()
    assert _record(server, "cancel") == before


def test_refused_grpc_turns_and_session_operations_leave_the_session_as_it_was(grpc_client, server):
    g = grpc_client
    for user in USERS:
        g.complete(messages=user, session_id="g-int", max_new_tokens=4, ignore_eos=True)
    before = _record(server, "g-int")
    ctx = server.engine.model_info.context_length
    vocab = server.engine.model_info.vocab_size
    calls = [
        ("regenerate with n = 2", lambda: g.complete(session_id="g-int", turn_mode="regenerate", n=2)),
        ("regenerate, too many tokens asked", lambda: g.regenerate("g-int", max_new_tokens=ctx)),
        ("edit with an unknown role", lambda: g.edit("g-int", "x", role="wizard")),
        ("append with an unknown role", lambda: g.chat("g-int", "x", role="wizard")),
        ("append: expected_turns differs", lambda: g.chat("g-int", "x", expected_turns=1)),
        ("edit: expected_turns differs", lambda: g.edit("g-int", "x", expected_turns=5)),
        ("append: context overflow", lambda: g.chat("g-int", "fox " * ctx)),
        ("append: too many tokens asked", lambda: g.chat("g-int", "x", max_new_tokens=ctx)),
        ("append: token outside the vocabulary", lambda: g.complete(session_id="g-int", token_ids=[vocab + 5])),
        ("rewind more turns than it has", lambda: g.rewind_session("g-int", 5)),
        ("rewind: expected_turns differs", lambda: g.rewind_session("g-int", 1, expected_turns=2)),
        ("fork beyond its turns", lambda: g.fork_session("g-int", "g-int-fork", at_turn=9)),
        ("fork onto itself", lambda: g.fork_session("g-int", "g-int")),
    ]
    for name, call in calls:
        with pytest.raises(KVServeError) as e:
            call()
        assert e.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                grpc.StatusCode.ALREADY_EXISTS), (name, e.value)  # fmt: skip
        assert _record(server, "g-int") == before, name
    assert _record(server, "g-int-fork") is None
    # cancelled mid-stream: held running from its first step (in place before it starts)
    # until the server has ended it, its 300 tokens could otherwise end, and commit, first
    stream, running = held_running(
        server, lambda: g.generate(session_id="g-int", text=" more", max_new_tokens=300, ignore_eos=True))
    try:
        events = iter(stream)
        next(events)
        next(events)
        assert running.held.wait(60) and server.engine.stats().running == 1  # the turn runs, held
        stream.cancel()
        assert wait_until(lambda: not g.get_session("g-int").busy, timeout=30)
    finally:
        running.release()
    assert _record(server, "g-int") == before


def test_a_refused_response_leaves_the_previous_one_as_it_was_and_no_new_one(oai, model, server):
    r1 = oai.responses.create(model=model, input="hello there", max_output_tokens=4)
    before = _record(server, r1.id)
    count = len(server.call(server.running.sessions.store.list("", 100, ""))[0])
    ctx = server.engine.model_info.context_length
    bad = [
        {"input": [{"role": "wizard", "content": "x"}]},
        {"input": "fox " * ctx},
        {"input": "x", "max_output_tokens": ctx},
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
    ]
    for extra in bad:
        with pytest.raises(openai.BadRequestError):
            oai.responses.create(model=model, previous_response_id=r1.id, extra_body=extra)
        assert _record(server, r1.id) == before, extra
        assert len(server.call(server.running.sessions.store.list("", 100, ""))[0]) == count, extra
    oai.responses.delete(r1.id)


def test_a_prepared_turn_released_before_it_streams_leaves_the_session_as_it_was(oai, model, server):
    """``Conversations.prepare`` holds the session's turn (busy) and ``release`` ends it
    when the turn never streams (``run_turn`` does so for a call closed before its first
    event): the session is idle again and as it was; a second release does nothing."""
    _three_turns(oai, model, "prepared")
    before = _record(server, "prepared")
    conv, ops = server.running.conversations, server.running.session_ops

    async def prepare_then_release() -> tuple[bool, bool, int]:
        inp = TurnInput(text="one more thing", session_id="prepared", max_new_tokens=4,
                        sampling=SamplingParams(max_new_tokens=4))  # fmt: skip
        prepared = await conv.prepare("", inp, "prepared-1")
        held = (await ops.get("", "prepared"))[1]
        await conv.release(prepared)
        await conv.release(prepared)
        return held, (await ops.get("", "prepared"))[1], len(prepared.prompt)

    held, after, prompt = server.call(prepare_then_release())
    assert held and not after
    assert prompt > len(before[0])  # the transcript and the new input, tokenized
    assert _record(server, "prepared") == before
