"""The bookkeeping of a conversation's tool calls, checked as OpenAI checks it, against
a real server on loopback (the official ``openai`` client, the gRPC client): a tool
message that answers no call of the assistant message before it, call arguments that
are not JSON and a call of a function the request does not declare are 400 (gRPC
INVALID_ARGUMENT) naming the message and the field, and a refused request leaves its
session exactly as it was (transcript, turns, version); the same loop with the right
ids then extends it. A gRPC session turn's leading results answer the previous turn's
calls (the request does not carry them)."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from kvserve.clients import KVServeClient, KVServeError
from tests.fixtures.models import make_tiny_llama
from tests.fixtures.serving import ServerThread, tiny_config
from tests.service.test_tools_http import ASK, TOOLS

GEN = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200, parallel_tool_calls=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_tool_bookkeeping"), max_position_embeddings=4096)
    with ServerThread(tiny_config(path, default_max_new_tokens=64, kv_cache_memory=16 << 20), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.running.http_port}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _call(i: str, name: str = "get_time", args: str = '{"tz": "UTC"}') -> dict:
    return {"id": i, "type": "function", "function": {"name": name, "arguments": args}}


BAD = [
    # a result for a call nobody made
    ([{"role": "assistant", "content": None, "tool_calls": [_call("call_a")]},
      {"role": "tool", "tool_call_id": "call_zzz", "content": "x"}], "messages[3].tool_call_id", "answers no call"),
    # a result with no call before it
    ([{"role": "tool", "tool_call_id": "call_a", "content": "x"}], "messages[2].tool_call_id", "answers no call"),
    # a user message between the calls and their result
    ([{"role": "assistant", "content": None, "tool_calls": [_call("call_a")]}, {"role": "user", "content": "hm"},
      {"role": "tool", "tool_call_id": "call_a", "content": "x"}], "messages[4].tool_call_id", "answers no call"),
    # arguments that are not JSON
    ([{"role": "assistant", "content": None, "tool_calls": [_call("call_a"), _call("call_b", args='{"tz": "UT')]},
      {"role": "tool", "tool_call_id": "call_a", "content": "x"}], "messages[2].tool_calls[1].function.arguments",
     "not valid JSON"),
    # a function the request does not declare
    ([{"role": "assistant", "content": None, "tool_calls": [_call("call_a", name="launch_rockets", args="{}")]},
      {"role": "tool", "tool_call_id": "call_a", "content": "x"}], "messages[2].tool_calls[0].function.name",
     "is not in tools"),
]  # fmt: skip


@pytest.mark.parametrize("tail, param, says", BAD)
def test_bad_bookkeeping_is_400_naming_the_message_and_the_field(oai, model, tail, param, says):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=ASK + tail, **GEN)
    body = e.value.body
    assert body["param"] == param and says in body["message"] and body["type"] == "invalid_request_error", body


def test_a_refused_request_leaves_its_session_as_it_was(server, oai, model):
    headers = {"X-Session-Id": "bookkeeping"}
    r = oai.chat.completions.create(model=model, messages=ASK, extra_headers=headers, **GEN)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    call_id = msg["tool_calls"][0]["id"]
    with KVServeClient(server.address, timeout=60) as g:
        before = g.get_session("bookkeeping", include_token_ids=True)
        stored = server.call(server.running.sessions.store.get("", "bookkeeping"))
        for tail, param, _ in [
            ([msg, {"role": "tool", "tool_call_id": "call_wrong", "content": "x"}], "messages[3].tool_call_id", None),
            ([{**msg, "tool_calls": [{**msg["tool_calls"][0], "function": {**msg["tool_calls"][0]["function"],
                                                                           "arguments": "{oops"}}]},
              {"role": "tool", "tool_call_id": call_id, "content": "x"}], "messages[2].tool_calls[0].function.arguments", None),
        ]:  # fmt: skip
            with pytest.raises(openai.BadRequestError) as e:
                oai.chat.completions.create(model=model, messages=ASK + tail, extra_headers=headers, **GEN)
            assert e.value.body["param"] == param
            after = g.get_session("bookkeeping", include_token_ids=True)
            assert (after.turns, after.token_ids) == (before.turns, before.token_ids)
            assert server.call(server.running.sessions.store.get("", "bookkeeping")).etag == stored.etag  # not rewritten
        ok = oai.chat.completions.create(model=model, extra_headers=headers, **GEN,
                                         messages=ASK + [msg, {"role": "tool", "tool_call_id": call_id, "content": "18 C"}])  # fmt: skip
        assert ok.kvserve["history_diverged_at"] is None  # the results extended the session
        assert g.get_session("bookkeeping").turns == before.turns + 1


def test_grpc_checks_too_and_a_session_turns_leading_results_answer_the_previous_turn(server):
    with KVServeClient(server.address, timeout=120) as g:
        kw = dict(tools=TOOLS, tool_choice="required", max_new_tokens=200, parallel_tool_calls=False)
        first = g.complete(messages=ASK, session_id="g-bookkeeping", **kw)
        call = first.tool_calls[0]
        before = g.get_session("g-bookkeeping", include_token_ids=True)
        # a result after a user message answers nothing: refused, the session as it was
        with pytest.raises(KVServeError) as e:
            g.complete(messages=[{"role": "tool", "tool_call_id": call.id, "content": "18 C"},
                                 {"role": "user", "content": "and?"},
                                 {"role": "tool", "tool_call_id": call.id, "content": "again"}],
                       session_id="g-bookkeeping", **kw)  # fmt: skip
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.details.startswith("messages[2].tool_call_id")
        after = g.get_session("g-bookkeeping", include_token_ids=True)
        assert (after.turns, after.token_ids) == (before.turns, before.token_ids)
        # the leading result answers the previous turn's call (in the transcript, not in the request)
        nxt = g.complete(messages=[{"role": "tool", "tool_call_id": call.id, "content": json.dumps({"t": "12:00"})}],
                         session_id="g-bookkeeping", **kw)  # fmt: skip
        assert nxt.start.cached_tokens > 0 and g.get_session("g-bookkeeping").turns == before.turns + 1
        # without a session the whole history is checked
        with pytest.raises(KVServeError) as e:
            g.complete(messages=ASK + [{"role": "assistant", "content": "", "tool_calls": [_call("c1", args="nope")]}],
                       **kw)  # fmt: skip
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details.startswith("messages[2].tool_calls[0].function.arguments")
