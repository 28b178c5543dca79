"""OpenAI's Responses API over sessions, through the official ``openai`` package against
a real server on loopback: create (whole and streamed events), retrieve, delete,
``previous_response_id`` finding every earlier block cached (on the device, and from
Redis after a restart), forking from an older response, ``store: false``,
``text.format`` json_schema, and the fields not implemented refused naming them.
Bodies and events validate strictly against the package's own types."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvserve.clients import KVServeClient
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config, wait_until

EVENT = TypeAdapter(ResponseStreamEvent)
FOX = "hello there, tell me about the fox"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as s:
        yield s


def _client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.running.http_port}/v1", api_key="x", max_retries=0,
                         timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def oai(server):
    with _client(server) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


def _create(oai, **kw) -> tuple[dict, Response]:
    raw = oai.responses.with_raw_response.create(**kw)
    body = raw.http_response.json()
    Response.model_validate(body, strict=True)
    return body, raw.parse()


def _full_blocks(n_tokens: int) -> int:
    return n_tokens // BLOCK_SIZE * BLOCK_SIZE


def test_create_follow_up_fork_retrieve_delete(oai, model, server):
    gen = dict(model=model, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    body, r1 = _create(oai, input=FOX, instructions="be brief", **gen)
    assert r1.status == "incomplete" and r1.incomplete_details.reason == "max_output_tokens"  # 6 tokens, no eos
    assert r1.output_text and r1.usage.output_tokens == 6 and r1.previous_response_id is None
    # the follow-up sends only the new input: the whole first exchange is cached
    body, r2 = _create(oai, input="and the dog?", previous_response_id=r1.id, **gen)
    first = r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.previous_response_id == r1.id
    assert r2.usage.input_tokens > first
    assert r2.usage.input_tokens_details.cached_tokens >= _full_blocks(first) - BLOCK_SIZE > 0
    # the same conversation through gRPC's sessions gives the same replies (greedy; in its own cache
    # namespace: deleting it must not drop the blocks the responses use)
    with KVServeClient(server.address, timeout=60) as g:
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": FOX}]
        ref = dict(session_id="ref", max_new_tokens=6, temperature=0, ignore_eos=True, cache_salt="ref")
        a = g.complete(messages=msgs, **ref)
        b = g.complete(messages=[{"role": "user", "content": "and the dog?"}], **ref)
        assert (a.text, b.text) == (r1.output_text, r2.output_text)
        assert b.start.prompt_tokens == r2.usage.input_tokens
        assert g.get_session(r2.id, include_token_ids=True).token_ids == \
            g.get_session("ref", include_token_ids=True).token_ids  # fmt: skip
        g.delete_session("ref")
    # following up the older response again is a fork: r2 is left as it was
    _, r3 = _create(oai, input="and the cat?", previous_response_id=r1.id, **gen)
    assert r3.usage.input_tokens_details.cached_tokens >= _full_blocks(first) - BLOCK_SIZE
    got = oai.responses.retrieve(r2.id)
    Response.model_validate(oai.responses.with_raw_response.retrieve(r2.id).http_response.json(), strict=True)
    assert (got.output_text, got.previous_response_id, got.status) == (r2.output_text, r1.id, "incomplete")
    # delete: gone for retrieve and for a follow-up
    oai.responses.delete(r3.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r3.id)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(input="x", previous_response_id=r3.id, **gen)
    assert (e.value.body["param"], e.value.body["code"]) == ("previous_response_id", "previous_response_not_found")
    for r in (r1, r2):
        oai.responses.delete(r.id)


def test_deleting_a_response_leaves_its_follow_ups_history_cached(oai, model, server):
    gen = dict(model=model, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    _, r1 = _create(oai, input=FOX + " and the hound", **gen)
    _, r2 = _create(oai, input="and the dog?", previous_response_id=r1.id, **gen)
    first = r1.usage.input_tokens + r1.usage.output_tokens
    oai.responses.delete(r1.id)  # r2's leading blocks are r1's: still referenced, kept
    # r2's next turn finds its whole history cached, r1's part included
    _, r3 = _create(oai, input="and the cat?", previous_response_id=r2.id, **gen)
    second = r2.usage.input_tokens + r2.usage.output_tokens
    assert r3.usage.input_tokens_details.cached_tokens >= _full_blocks(second) - BLOCK_SIZE >= _full_blocks(first)
    # deleting the middle response keeps what r3 shares with it; deleting r3 then drops what nothing references
    oai.responses.delete(r2.id)
    with KVServeClient(server.address, timeout=60) as g:
        info = g.get_session(r3.id)
        assert info.cached_blocks.get("device", 0) == info.full_blocks > 0
        tokens = list(g.get_session(r3.id, include_token_ids=True).token_ids)
        assert g.complete(token_ids=tokens, max_new_tokens=1).start.cached_tokens == _full_blocks(len(tokens))
        oai.responses.delete(r3.id)
        again = g.complete(token_ids=tokens, max_new_tokens=1)  # no session holds them now: recomputed
        assert again.start.cached_tokens == 0


def test_streamed_events(oai, model):
    kinds, deltas, final = [], [], None
    with oai.responses.with_streaming_response.create(model=model, input=FOX, max_output_tokens=5, stream=True,
                                                      extra_body={"ignore_eos": True}) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if line.startswith("data: "):
                ev = EVENT.validate_json(line[6:], strict=True)
                kinds.append(ev.type)
                if ev.type == "response.output_text.delta":
                    deltas.append(ev.delta)
                if ev.type in ("response.completed", "response.incomplete"):
                    final = ev.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert final is not None and final.output_text == "".join(deltas) and final.usage.output_tokens == 5
    # the SDK's own stream helper reads them too (it wants a response that completes: a grammar ends it)
    boolean = {"format": {"type": "json_schema", "name": "b", "schema": {"type": "boolean"}}}
    with oai.responses.stream(model=model, input=FOX, max_output_tokens=20, text=boolean) as st:
        text = "".join(e.delta for e in st if e.type == "response.output_text.delta")
        done = st.get_final_response()
        assert done.status == "completed" and done.output_text == text and json.loads(text) in (True, False)
    oai.responses.delete(done.id)
    oai.responses.delete(final.id)


def test_text_format_json_schema_and_logprobs(oai, model):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # fmt: skip
    body, r = _create(oai, model=model, input=FOX, max_output_tokens=40,
                      text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})  # fmt: skip
    assert isinstance(json.loads(r.output_text)["ok"], bool)
    assert body["text"]["format"]["name"] == "answer"
    body, r = _create(oai, model=model, input=FOX, max_output_tokens=4, top_logprobs=2,
                      include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})  # fmt: skip
    lps = body["output"][0]["content"][0]["logprobs"]
    assert len(lps) == 4 and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in lps)


def test_store_false_leaves_nothing_to_retrieve(oai, model, server):
    _, r1 = _create(oai, model=model, input=FOX, max_output_tokens=3)
    _, r2 = _create(oai, model=model, input="more", previous_response_id=r1.id, store=False, max_output_tokens=3)
    assert r2.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r2.id)
    oai.responses.delete(r1.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),  # function tools: test_responses_tools.py
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        ({"max_output_tokens": 10_000_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_what_is_not_implemented_is_refused_naming_the_field(oai, model, server, extra, param):
    before = len(server.call(server.running.sessions.store.list("", 100, ""))[0])
    body = {"input": FOX, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, extra_body=body)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert len(server.call(server.running.sessions.store.list("", 100, ""))[0]) == before  # no response left behind


def test_follow_up_after_a_restart_finds_the_conversation_in_redis(tiny_llama_dir, redis_url):
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, host_cache_memory=0, spill_after=0.05,
                      spill_to=("redis",), restore_policy="always")  # fmt: skip
    model = str(tiny_llama_dir)
    with ServerThread(cfg, http_port=0) as s, _client(s) as c, KVServeClient(s.address, timeout=60) as g:
        _, r1 = _create(c, model=model, input=FOX, max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        assert wait_until(lambda: g.get_session(r1.id).cached_blocks.get("redis", 0) == g.get_session(r1.id).full_blocks,
                          timeout=30)  # fmt: skip
    with ServerThread(cfg, http_port=0) as s, _client(s) as c:  # restarted: the device is empty
        assert c.responses.retrieve(r1.id).output_text == r1.output_text
        _, r2 = _create(c, model=model, input="and the dog?", previous_response_id=r1.id, max_output_tokens=6,
                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        first = r1.usage.input_tokens + r1.usage.output_tokens
        by_tier = r2.usage.input_tokens_details.model_extra["kvserve_cached_by_tier"]
        assert by_tier["redis"] == r2.usage.input_tokens_details.cached_tokens >= _full_blocks(first) - BLOCK_SIZE > 0
        c.responses.delete(r2.id)
        c.responses.delete(r1.id)
