"""Anthropic's Messages API (service/http/anthropic.py) with the official ``anthropic``
client, LangChain's ``ChatAnthropic`` and LiteLLM's anthropic route against a real server
on loopback: whole and streamed messages, count_tokens against the usage, forced tool calls
whose input validates against a nested pydantic schema (whole and streamed), a tool loop
with tool_result blocks, Anthropic's error shapes and statuses, and ``cache_control`` as a
retention (its usage figures, the prefix read back, a tenant's bound passed: the hint dropped, the turn run); OpenAI's
``prompt_cache_retention`` on chat and Responses.

One server for the module (a Llama whose template takes no tools: service/tools' fallback
rendering), two keys (two tenants)."""

from __future__ import annotations

import json
import uuid

import anthropic
import jsonschema
import openai
import pydantic
import pytest

from kvserve.service.auth import hash_key
from tests.fixtures.models import make_tiny_llama
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config

KEY, OTHER_KEY = "sk-ant-acme", "sk-ant-bravo"
PER_BLOCK = 512 * BLOCK_SIZE  # the tiny Llama's KV bytes per block
BOUND_BLOCKS = 160  # each tenant's bound of retained blocks


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    zip: str = pydantic.Field(max_length=6)


class Order(pydantic.BaseModel):
    item: str = pydantic.Field(max_length=10)
    qty: int = pydantic.Field(ge=1, le=9)
    ship_to: Address


ORDER_SCHEMA = Order.model_json_schema()
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                  "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"name": "place_order", "description": "Place an order", "input_schema": ORDER_SCHEMA},
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA},
]
GREEDY = {"temperature": 0}  # the SDK (2.x) has no sampling arguments; the API takes them
SCHEMAS = {"place_order": ORDER_SCHEMA, "get_weather": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_anthropic"), max_position_embeddings=4096)
    keys = f"acme:{hash_key(KEY)}\nbravo:{hash_key(OTHER_KEY)}"
    cfg = tiny_config(path, api_keys=keys, default_max_new_tokens=64, kv_cache_memory=16 << 20,
                      host_cache_memory=512 * PER_BLOCK, retention_tenant_memory=BOUND_BLOCKS * PER_BLOCK)  # fmt: skip
    with ServerThread(cfg, http_port=0) as s:
        yield s


def base_url(s: ServerThread) -> str:
    return f"http://127.0.0.1:{s.running.http_port}"


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=base_url(server), api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(server):
    import httpx

    models = httpx.get(base_url(server) + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
    return models["data"][0]["id"]


def unique(text: str) -> str:
    """``text`` after a fresh word: a prompt no block of the cache holds past its first
    (the template's header, which every prompt shares)."""
    return f"{uuid.uuid4().hex} {text}"


def test_whole_and_streamed_text_and_count_tokens(claude, model):
    system = unique("You are terse.")
    messages = [{"role": "user", "content": "Say hello to the world, please."}]
    counted = claude.messages.count_tokens(model=model, system=system, messages=messages).input_tokens
    whole = claude.messages.create(model=model, system=system, messages=messages, max_tokens=12, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.content[0].type == "text"
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens == 12 if whole.stop_reason == "max_tokens" else whole.usage.output_tokens <= 12
    # a prompt no cache held past its header: count_tokens counted every token of it
    u = whole.usage
    assert u.cache_read_input_tokens <= BLOCK_SIZE and u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == counted
    with claude.messages.stream(model=model, system=system, messages=messages, max_tokens=12, extra_body=GREEDY) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    # the second time every full block of the prompt is cached (content-addressed)
    u = final.usage
    assert u.cache_read_input_tokens == counted // BLOCK_SIZE * BLOCK_SIZE or u.cache_read_input_tokens == counted - 1
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted


def test_stop_sequences_and_raw_sse(server, claude, model):
    import httpx

    messages = [{"role": "user", "content": unique("Count: one two three four five six.")}]
    free = claude.messages.create(model=model, messages=messages, max_tokens=16, extra_body=GREEDY).content[0].text
    stop = free.strip()[2:5]
    r = claude.messages.create(model=model, messages=messages, max_tokens=16, extra_body=GREEDY, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop and stop not in r.content[0].text
    body = {"model": model, "messages": messages, "max_tokens": 4, "stream": True}
    raw = httpx.post(base_url(server) + "/v1/messages", json=body, timeout=60,
                     headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}).text  # fmt: skip
    events = [line[len("event: "):] for line in raw.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "place_order"}])
def test_forced_tool_calls_validate(claude, model, choice):
    messages = [{"role": "user", "content": "Order two lamps to Paris 75001."}]
    r = claude.messages.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=200,
                               extra_body=GREEDY)  # fmt: skip
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert calls and all(c.id and c.name in SCHEMAS for c in calls)
    if choice["type"] == "tool":
        assert {c.name for c in calls} == {"place_order"}
        Order.model_validate(calls[0].input)  # the nested pydantic schema
    for c in calls:
        jsonschema.validate(c.input, SCHEMAS[c.name])
    with claude.messages.stream(model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=200,
                                extra_body=GREEDY) as stream:  # fmt: skip
        final = stream.get_final_message()  # input_json_delta pieces joined by the SDK
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]


def test_tool_loop_with_results(claude, model):
    """Three steps in a session: a forced call, its result (an error), another forced
    call, its result, then an answer; the reply's blocks go back as the SDK returned
    them, and each step finds the previous step's full blocks cached."""
    messages: list = [{"role": "user", "content": unique("What is the weather in Rome and in Oslo?")}]
    SESSION = {"X-Session-Id": f"loop-{uuid.uuid4().hex[:8]}"}
    cached, prompts = [], []
    for step, is_error in enumerate((True, False)):
        r = claude.messages.create(model=model, messages=messages, tools=TOOLS, max_tokens=120, extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_headers=SESSION)  # fmt: skip
        (call,) = [b for b in r.content if b.type == "tool_use"][:1]
        cached.append(r.usage.cache_read_input_tokens)
        prompts.append(r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.output_tokens)
        messages.append({"role": "assistant", "content": r.content})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": "timeout" if is_error else "sunny, 21 C",
             "is_error": is_error}, {"type": "text", "text": "Go on."}]})  # fmt: skip
    last = claude.messages.create(model=model, messages=messages, tools=TOOLS, max_tokens=8, extra_body=GREEDY,
                                  extra_headers=SESSION)  # fmt: skip
    cached.append(last.usage.cache_read_input_tokens)
    assert last.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the session keeps the tokens as the model wrote them: each step reads back every full
    # block of the previous step's prompt and reply
    for k in (1, 2):
        assert cached[k] >= prompts[k - 1] // BLOCK_SIZE * BLOCK_SIZE, (cached, prompts)
    # a result naming no call of the assistant before it is refused
    bad = messages[:1] + [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\[1\]\.content\[0\]\.tool_use_id: 'nope' answers no call"):
        claude.messages.create(model=model, messages=bad, tools=TOOLS, max_tokens=4)


def test_errors_in_anthropic_shapes(server, claude, model):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                               extra_body={"max_tokens": None})  # sent without it  # fmt: skip
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    with anthropic.Anthropic(base_url=base_url(server), api_key="wrong", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError) as e:
            c.messages.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])  # fmt: skip
    with anthropic.Anthropic(base_url=base_url(server), auth_token=KEY, max_retries=0) as c:  # Bearer works too
        assert c.messages.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2).usage


def test_cache_control_retains_the_prefix(claude, model):
    """A 1h breakpoint on the system block: the turn writes and retains that prefix
    (cache creation, in the 1h figure), and the next request with a new question reads
    it back."""
    system = [{"type": "text", "text": unique("You answer questions about the sea. " * 12),
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]  # fmt: skip
    first = claude.messages.create(model=model, system=system, max_tokens=2,
                                   messages=[{"role": "user", "content": "Why is it blue?"}])  # fmt: skip
    u = first.usage
    assert u.cache_read_input_tokens <= BLOCK_SIZE and u.cache_creation_input_tokens >= 8 * BLOCK_SIZE
    assert u.cache_creation.ephemeral_1h_input_tokens == u.cache_creation_input_tokens
    assert u.cache_creation.ephemeral_5m_input_tokens == 0
    counted = claude.messages.count_tokens(model=model, system=system,
                                           messages=[{"role": "user", "content": "Why is it blue?"}]).input_tokens  # fmt: skip
    assert u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens == counted
    second = claude.messages.create(model=model, system=system, max_tokens=2,
                                    messages=[{"role": "user", "content": "How deep is it?"}])  # fmt: skip
    assert second.usage.cache_read_input_tokens >= u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert second.usage.cache_creation_input_tokens == 0  # retained already: a refresh writes nothing


def test_a_cache_hint_past_the_tenant_bound_runs_without_a_retention(server, model):
    """cache_control is a hint Anthropic never refuses a request for: past the tenant's
    bound the turn runs, reports nothing written for a retention, and the refusal is counted."""
    before = server.running.engine.cache_stats().retention.refusals["tenant_bound"]
    with anthropic.Anthropic(base_url=base_url(server), api_key=OTHER_KEY, max_retries=0) as c:
        text = unique("tide " * (BOUND_BLOCKS * BLOCK_SIZE))
        r = c.messages.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}])  # fmt: skip
    assert r.usage.cache_creation_input_tokens == 0 and r.usage.output_tokens >= 1
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > BOUND_BLOCKS * BLOCK_SIZE
    assert server.running.engine.cache_stats().retention.refusals["tenant_bound"] == before + 1


def test_openai_prompt_cache_retention(server, model):
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key=KEY, max_retries=0) as oai:
        ask = [{"role": "user", "content": unique("Tell me about the moon. " * 8)}]
        before = server.running.engine.cache_stats().retention.retained_tokens
        r = oai.chat.completions.create(model=model, messages=ask, max_tokens=2, prompt_cache_retention="24h")
        assert r.usage.prompt_tokens_details.cached_tokens <= BLOCK_SIZE
        kept = server.running.engine.cache_stats().retention.retained_tokens - before
        assert kept == r.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE  # the whole prompt's full blocks
        again = oai.chat.completions.create(model=model, messages=ask, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
        resp = oai.responses.create(model=model, input=unique("Moon?"), max_output_tokens=2,
                                    prompt_cache_retention="in_memory")  # fmt: skip
        assert resp.status in ("completed", "incomplete")
        with pytest.raises(openai.BadRequestError, match="prompt_cache_retention"):
            oai.chat.completions.create(model=model, messages=ask, max_tokens=2, extra_body={"prompt_cache_retention": "1w"})
    with openai.OpenAI(base_url=base_url(server) + "/v1", api_key=OTHER_KEY, max_retries=0) as oai:
        big = [{"role": "user", "content": unique("tide " * (BOUND_BLOCKS * BLOCK_SIZE))}]
        before = server.running.engine.cache_stats().retention.retained_tokens
        r = oai.chat.completions.create(model=model, messages=big, max_tokens=2, prompt_cache_retention="24h")
        assert r.choices[0].finish_reason in ("length", "stop")  # a hint: run, not refused
        assert server.running.engine.cache_stats().retention.retained_tokens == before
    counts = server.running.engine.cache_stats().retention
    assert counts is not None and counts.refusals["tenant_bound"] >= 1


def test_langchain_chat_anthropic_bind_tools(server, model):
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=model, base_url=base_url(server), api_key=KEY, max_tokens=200, temperature=0,
                        max_retries=0)  # fmt: skip
    bound = llm.bind_tools([Order], tool_choice="Order")
    msg = bound.invoke("Order two lamps to Paris.")
    (call,) = msg.tool_calls[:1]
    assert call["name"] == "Order"
    Order.model_validate(call["args"])
    assert msg.usage_metadata["input_tokens"] > 0


def test_litellm_anthropic_route(server, model, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network for its price list
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="anthropic/" + model, api_base=base_url(server), api_key=KEY, max_tokens=6,
                           messages=[{"role": "user", "content": "Hello there"}], temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0


def test_a_retained_prefix_survives_an_eviction_storm(tiny_llama_dir):
    """Device and host hold 64 blocks each; after a 1h breakpoint's prefix and an
    unretained one, other prompts fill both several times over: the retained prefix is
    read back (from the host, where it is pinned), the unretained one is gone."""
    cfg = tiny_config(tiny_llama_dir, kv_cache_memory=64 * PER_BLOCK, host_cache_memory=64 * PER_BLOCK)
    with ServerThread(cfg, http_port=0) as s, anthropic.Anthropic(base_url=base_url(s), api_key="-", max_retries=0) as c:
        def ask(system: str, question: str, ttl: str | None = None) -> anthropic.types.Usage:
            block = {"type": "text", "text": system, **({"cache_control": {"type": "ephemeral", "ttl": ttl}} if ttl else {})}
            return c.messages.create(model=str(tiny_llama_dir), system=[block], max_tokens=2,
                                     messages=[{"role": "user", "content": question}]).usage  # fmt: skip

        kept, lost = unique("harbour " * 60), unique("meadow " * 60)
        first = ask(kept, "Why?", "1h")
        assert first.cache_creation_input_tokens >= 10 * BLOCK_SIZE
        ask(lost, "Why?")
        for _ in range(8):  # ~40 blocks each: 320 blocks through a 64-block device and a 64-block host
            ask(unique("storm " * 70), "Go.")
        again = ask(kept, "How?", "1h")
        assert again.cache_read_input_tokens >= first.cache_creation_input_tokens
        assert ask(lost, "How?").cache_read_input_tokens <= BLOCK_SIZE  # its blocks were evicted
