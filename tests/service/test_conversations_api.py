"""OpenAI's Conversations API over durable sessions, through the official ``openai``
package against real servers on loopback over a real Redis: a conversation's responses
find every earlier block cached and append their items in order (listed, paged,
retrieved, deleted), a second replica over the same Redis continues it from Redis's
blocks, another tenant sees none of it, bad ids are 404 in OpenAI's shape, and a
deleted conversation is gone with its session and blocks."""

from __future__ import annotations

import threading

import openai
import pytest
from openai.types.conversations import Conversation, ConversationItemList
from openai.types.responses import Response

from kvserve.service.auth import hash_key
from kvserve.service.sessions import SessionNotFound
from kvserve.service.types import CacheScope
from tests.fixtures.models import make_tiny_llama
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config, wait_until

KEY_A, KEY_B = "key-of-acme", "key-of-bravo"
KEYS = f"acme:{hash_key(KEY_A)}\nbravo:{hash_key(KEY_B)}\n"
GEN = dict(max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_conversations"), max_position_embeddings=4096)  # tools' prompt


@pytest.fixture(scope="module")
def config(model_dir, redis_server):
    with redis_server.client() as c:
        c.flushall()
    return tiny_config(model_dir, redis_url=redis_server.url, api_keys=KEYS, host_cache_memory=0, spill_after=0.05,
                       spill_to=("redis",), restore_policy="always", kv_cache_memory=16 << 20)  # fmt: skip


@pytest.fixture(scope="module")
def server(config):
    with ServerThread(config, http_port=0) as s:
        yield s


def _client(s: ServerThread, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.running.http_port}/v1", api_key=key, max_retries=0,
                         timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def oai(server):
    with _client(server) as c:
        yield c


@pytest.fixture(scope="module")
def model(model_dir):
    return str(model_dir)


def _respond(oai, model, conv, text, **kw) -> Response:
    raw = oai.responses.with_raw_response.create(model=model, input=text, conversation=conv, **GEN, **kw)
    Response.model_validate(raw.http_response.json(), strict=True)
    return raw.parse()


def _items(oai, cid, **kw) -> list:
    return list(oai.conversations.items.list(cid, order="asc", **kw))


def _texts(items) -> list[tuple[str, str]]:
    return [(it.role, "".join(p.text for p in it.content)) for it in items]


def _full(n: int) -> int:
    return n // BLOCK_SIZE * BLOCK_SIZE


def test_three_turns_append_their_items_in_order_and_find_the_conversation_cached(oai, model, server):
    raw = oai.conversations.with_raw_response.create(metadata={"topic": "fox"},
                                                     items=[{"type": "message", "role": "user", "content": "hi"}])
    conv = Conversation.model_validate(raw.http_response.json(), strict=True)
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "fox"} and conv.object == "conversation"
    r1 = _respond(oai, model, conv.id, "tell me about the fox", instructions="be brief")
    r2 = _respond(oai, model, {"id": conv.id}, "and the dog?", instructions="be brief")
    assert r1.conversation.id == r2.conversation.id == conv.id
    # the second turn finds the first exchange cached (its full blocks)
    assert r2.usage.input_tokens_details.cached_tokens >= _full(r1.usage.input_tokens + r1.usage.output_tokens) - BLOCK_SIZE > 0
    # streamed: the same items, the same cache
    events = list(oai.responses.create(model=model, input="and the cat?", conversation=conv.id, stream=True,
                                       instructions="be brief", **GEN))  # fmt: skip
    r3 = events[-1].response
    assert events[-1].type == "response.incomplete" and r3.conversation.id == conv.id  # max_output_tokens
    assert r3.usage.input_tokens_details.cached_tokens >= _full(r2.usage.input_tokens + r2.usage.output_tokens) - BLOCK_SIZE
    items = _items(oai, conv.id)
    assert _texts(items) == [("user", "hi"), ("user", "tell me about the fox"), ("assistant", r1.output_text),
                             ("user", "and the dog?"), ("assistant", r2.output_text), ("user", "and the cat?"),
                             ("assistant", r3.output_text)]  # fmt: skip
    assert [items[i].id for i in (2, 4, 6)] == [r.output[0].id for r in (r1, r2, r3)]
    # newest first by default; one item by id
    assert [it.id for it in oai.conversations.items.list(conv.id)] == [it.id for it in items[::-1]]
    assert oai.conversations.items.retrieve(items[4].id, conversation_id=conv.id).id == items[4].id
    rec, _ = server.call(server.running.sessions.get("acme", conv.id))
    assert rec.turns == 3 and rec.token_ids  # one session, three turns: the conversation IS it


def test_items_page_create_and_delete_and_the_next_turn_follows_them(oai, model):
    conv = oai.conversations.create()
    new = oai.conversations.items.create(conv.id, items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"note {i}"}]} for i in range(5)
    ])  # fmt: skip
    ConversationItemList.model_validate(new.model_dump(), strict=True)
    assert [t for _r, t in _texts(new.data)] == [f"note {i}" for i in range(5)]
    page = oai.conversations.items.list(conv.id, limit=2, order="asc")
    assert [it.id for it in page.data] == [it.id for it in new.data[:2]] and page.has_more
    assert page.last_id == new.data[1].id
    after = oai.conversations.items.list(conv.id, limit=2, order="asc", after=page.last_id)
    assert [it.id for it in after.data] == [it.id for it in new.data[2:4]]
    assert [it.id for it in _items(oai, conv.id, limit=2)] == [it.id for it in new.data]  # the SDK pages through
    with pytest.raises(openai.BadRequestError) as e:
        oai.conversations.items.list(conv.id, limit=101)
    assert e.value.body["param"] == "limit"
    # deleting an item answers the conversation; the item is gone
    assert oai.conversations.items.delete(new.data[1].id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        oai.conversations.items.retrieve(new.data[1].id, conversation_id=conv.id)
    r1 = _respond(oai, model, conv.id, "go on")
    r2 = _respond(oai, model, conv.id, "more")
    assert _texts(_items(oai, conv.id)) == [("user", f"note {i}") for i in (0, 2, 3, 4)] + [
        ("user", "go on"), ("assistant", r1.output_text), ("user", "more"), ("assistant", r2.output_text)]
    # deleting an item the transcript holds: the next turn rewinds to what the items still follow
    oai.conversations.items.delete(_items(oai, conv.id)[-1].id, conversation_id=conv.id)
    oai.conversations.items.delete(_items(oai, conv.id)[-1].id, conversation_id=conv.id)
    r3 = _respond(oai, model, conv.id, "more")
    assert r3.output_text == r2.output_text  # greedy: the same prompt as r2's
    assert r3.usage.input_tokens == r2.usage.input_tokens and r3.usage.input_tokens_details.cached_tokens > 0
    oai.conversations.update(conv.id, metadata={"k": "v"})
    assert oai.conversations.retrieve(conv.id).metadata == {"k": "v"}
    oai.conversations.delete(conv.id)


def test_another_tenant_bad_ids_and_bad_requests(oai, model, server):
    conv = oai.conversations.create(items=[{"role": "user", "content": "mine"}])
    first = _items(oai, conv.id)[0]
    with _client(server, KEY_B) as other:
        for call in (lambda: other.conversations.retrieve(conv.id), lambda: other.conversations.delete(conv.id),
                     lambda: other.conversations.items.list(conv.id),
                     lambda: other.conversations.update(conv.id, metadata={}),
                     lambda: other.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                     lambda: other.conversations.items.delete(first.id, conversation_id=conv.id),
                     lambda: other.responses.create(model=model, input="x", conversation=conv.id)):  # fmt: skip
            with pytest.raises(openai.NotFoundError) as e:
                call()
            assert e.value.body["type"] == "invalid_request_error" and conv.id in e.value.body["message"]
    assert oai.conversations.retrieve(conv.id).id == conv.id  # still there, untouched
    for bad in ("conv_nope", "nope", "resp_" + conv.id[5:]):
        with pytest.raises(openai.NotFoundError):
            oai.conversations.retrieve(bad)
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=model, input="x", conversation="conv_nope")
    assert e.value.body["param"] == "conversation"
    r = oai.responses.create(model=model, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input="x", conversation=conv.id, previous_response_id=r.id)
    assert e.value.body["code"] == "mutually_exclusive_parameters"
    for body, param in (({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
                        ({"items": [{"type": "reasoning", "summary": []}]}, "items[0].type"),
                        ({"items": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "items[0].call_id"),
                        ({"metadata": {"k": "v" * 513}}, "metadata")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            oai.conversations.create(extra_body=body)
        assert e.value.body["param"] == param
    assert _texts(_items(oai, conv.id)) == [("user", "mine")]  # a refused turn added nothing
    oai.responses.delete(r.id)


def test_a_second_replica_continues_from_redis_and_deletion_releases_it(oai, model, server, config):
    conv = oai.conversations.create()
    r1 = _respond(oai, model, conv.id, "tell me about the fox, the dog and the cat, please")
    rec, _ = server.call(server.running.sessions.get("acme", conv.id))
    scope = CacheScope("acme", "")
    full = len(rec.token_ids) // BLOCK_SIZE
    assert wait_until(lambda: server.call(server.engine.block_locations(rec.token_ids, scope)).get("redis", 0) == full)
    with ServerThread(config, http_port=0) as replica, _client(replica) as c:  # its device holds nothing
        r2 = _respond(c, model, conv.id, "and then?")
        by_tier = r2.usage.input_tokens_details.model_extra["kvserve_cached_by_tier"]
        assert by_tier["redis"] == r2.usage.input_tokens_details.cached_tokens >= _full(len(rec.token_ids)) - BLOCK_SIZE > 0
        assert _texts(_items(c, conv.id)) == _texts(_items(oai, conv.id)) == [
            ("user", "tell me about the fox, the dog and the cat, please"), ("assistant", r1.output_text),
            ("user", "and then?"), ("assistant", r2.output_text)]  # fmt: skip
        rec, _ = replica.call(replica.running.sessions.get("acme", conv.id))
        deleted = c.conversations.delete(conv.id)
        assert deleted.deleted and deleted.id == conv.id and deleted.object == "conversation.deleted"
        locations = replica.call(replica.engine.block_locations(rec.token_ids, scope))
        assert not any(locations.values())  # its blocks are found nowhere
    with pytest.raises(openai.NotFoundError):
        oai.conversations.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=model, input="x", conversation=conv.id)
    with pytest.raises(SessionNotFound):
        server.call(server.running.sessions.get("acme", conv.id))


TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": TIME, "strict": True}]


def test_a_tool_loop_in_a_conversation_keeps_its_calls_and_finds_them_cached(oai, model):
    conv = oai.conversations.create()
    gen = dict(model=model, conversation=conv.id, tools=TOOLS, temperature=0, max_output_tokens=200)
    named = {"type": "function", "name": "get_time"}
    # a call cut off by max_output_tokens is kept as an incomplete item and never rendered again
    cut = oai.responses.create(input="Hello", tool_choice=named, **{**gen, "max_output_tokens": 2})
    assert cut.status == "incomplete" and [it.status for it in _items(oai, conv.id)][1:] == ["incomplete"]
    r1 = oai.responses.create(input="What time is it in Paris?", tool_choice=named, **gen)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert calls and all(c.name == "get_time" for c in calls)
    with pytest.raises(openai.BadRequestError) as e:  # an output answering no call of the conversation
        oai.responses.create(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}], **gen)
    assert e.value.body["param"] == "input[0].call_id"
    r2 = oai.responses.create(input=[{"type": "function_call_output", "call_id": c.call_id, "output": "12:00"}
                                     for c in calls], tool_choice="none", **gen)  # fmt: skip
    # every full block of the first step (its prompt and its calls as the model wrote them) is a hit
    assert r2.usage.input_tokens_details.cached_tokens >= _full(r1.usage.input_tokens + r1.usage.output_tokens) > 0
    items = _items(oai, conv.id)[2:]  # (after the cut-off exchange)
    assert [it.type for it in items] == ["message"] + ["function_call"] * len(calls) + \
        ["function_call_output"] * len(calls) + [o.type for o in r2.output]  # fmt: skip
    assert [(it.id, it.call_id, it.arguments) for it in items[1 : 1 + len(calls)]] == \
        [(c.id, c.call_id, c.arguments) for c in calls]  # fmt: skip
    oai.conversations.delete(conv.id)


def test_writing_a_conversation_while_its_response_runs_is_409_and_changes_nothing(oai, model, server):
    conv = oai.conversations.create(metadata={"k": "v"})
    gate = threading.Event()  # the engine's loop held: the response's turn (its lock taken) waits for it
    server.engine.engine.call_soon(lambda: gate.wait(30))
    done: list = []
    turn = threading.Thread(target=lambda: done.append(_respond(oai, model, conv.id, "hello")))
    try:
        turn.start()
        assert wait_until(lambda: server.call(server.running.sessions.get("acme", conv.id))[1])  # busy
        for call in (lambda: oai.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                     lambda: oai.conversations.update(conv.id, metadata={}),
                     lambda: oai.conversations.delete(conv.id)):  # fmt: skip
            with pytest.raises(openai.ConflictError):
                call()
    finally:
        gate.set()
        turn.join(60)
    assert _texts(_items(oai, conv.id)) == [("user", "hello"), ("assistant", done[0].output_text)]
    assert oai.conversations.retrieve(conv.id).metadata == {"k": "v"}
    oai.conversations.delete(conv.id)
