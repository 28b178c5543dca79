"""Function tools on the Responses API, through the official ``openai`` package against a
real server on loopback: tool_choice required and named give ``function_call`` items whose
arguments validate against the tool's schema; a two-step loop (``previous_response_id``
with a ``function_call_output``) finds every full block of the previous step cached; the
streamed events (``function_call_arguments.delta``/``.done``) reassemble to the same call;
built-in tool types are refused naming ``tools[i].type``. Bodies and events validate
strictly against the package's own types."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.fixtures.models import make_tiny_llama
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"],
        "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "description": "Time in a zone", "parameters": TIME, "strict": True},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = "What is the weather in Paris, and what time is it there?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_resp_tools"), max_position_embeddings=4096)
    cfg = tiny_config(path, default_max_new_tokens=64, kv_cache_memory=16 << 20)
    with ServerThread(cfg, http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=f"http://127.0.0.1:{server.running.http_port}/v1", api_key="x", max_retries=0,
                       timeout=120) as c:  # fmt: skip
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def _create(oai, **kw) -> tuple[dict, Response]:
    raw = oai.responses.with_raw_response.create(**kw)
    body = raw.http_response.json()
    Response.model_validate(body, strict=True)
    return body, raw.parse()


def _calls(r: Response) -> list:
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls
    for c in calls:
        assert c.status == "completed" and c.call_id and c.id.startswith("fc_")
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


def test_required_and_named_give_function_calls_that_validate(oai, model):
    for seed in range(3):
        body, r = _create(oai, model=model, input=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                          max_output_tokens=300, parallel_tool_calls=seed % 2 == 0, extra_body={"seed": seed})  # fmt: skip
        calls = _calls(r)
        assert r.status == "completed"
        if seed % 2:
            assert len(calls) == 1
        assert [t["name"] for t in body["tools"]] == ["get_weather", "get_time"] and body["tool_choice"] == "required"
    body, r = _create(oai, model=model, input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "get_time"},
                      temperature=1.0, max_output_tokens=300, extra_body={"seed": 7})  # fmt: skip
    assert [c.name for c in _calls(r)] == ["get_time"]
    assert body["tool_choice"] == {"type": "function", "name": "get_time"}
    # none: the tools are not called (text only)
    _, r = _create(oai, model=model, input=ASK, tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0)
    assert [o.type for o in r.output] == ["message"]


def test_two_step_loop_finds_the_previous_step_cached(oai, model):
    gen = dict(model=model, tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=300)
    _, r1 = _create(oai, input=ASK, instructions="You are a helpful assistant with tools.", **gen)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"ok": c.name})}
               for c in _calls(r1)]  # fmt: skip
    _, r2 = _create(oai, input=results, previous_response_id=r1.id, **gen)
    _calls(r2)
    assert r2.previous_response_id == r1.id
    before = r1.usage.input_tokens + r1.usage.output_tokens
    assert r2.usage.input_tokens > before
    # every full block of step one (its prompt and its calls) is a cache hit
    assert r2.usage.input_tokens_details.cached_tokens >= before // BLOCK_SIZE * BLOCK_SIZE > 0
    # the same loop without previous_response_id: the call items are sent back as input
    _, r3 = _create(oai, input=[{"role": "user", "content": ASK}, *[c.model_dump(exclude_none=True) for c in r1.output
                                                                    if c.type == "function_call"], *results], **gen)  # fmt: skip
    _calls(r3)


def test_streamed_calls_reassemble_to_the_whole_response(oai, model):
    kw = dict(model=model, input=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=300)
    _, whole = _create(oai, **kw)
    events = []
    with oai.responses.create(stream=True, **kw) as stream:
        for ev in stream:
            EVENT.validate_python(ev.model_dump(exclude_unset=True), strict=True)
            events.append(ev)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    final = events[-1].response
    Response.model_validate(final.model_dump(exclude_unset=True), strict=True)
    added = {e.output_index: e.item for e in events if e.type == "response.output_item.added"}
    args: dict[int, str] = {}
    for e in events:
        if e.type == "response.function_call_arguments.delta":
            assert e.item_id == added[e.output_index].id
            args[e.output_index] = args.get(e.output_index, "") + e.delta
    done = {e.output_index: e.arguments for e in events if e.type == "response.function_call_arguments.done"}
    assert args == done
    got = [(o.name, o.call_id and True, o.arguments) for o in final.output]
    assert got == [(o.name, True, o.arguments) for o in whole.output]  # greedy: the same calls
    assert [o.arguments for o in final.output] == [args[i] for i in sorted(args)]
    # the SDK's own accumulator agrees
    with oai.responses.stream(**kw) as s:
        acc = s.get_final_response()
    assert [(o.name, o.arguments) for o in acc.output] == [(o.name, o.arguments) for o in whole.output]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [TOOLS[0], {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
        ({"tools": [{"type": "function", "function": {"name": "x"}}]}, "tools[0].function"),
        ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]}, "input[0].type"),
    ],
)
def test_unsupported_tools_are_400_naming_the_field(oai, model, extra, param):
    kw = {"model": model, "input": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**kw)
    assert e.value.body["param"] == param, e.value.body


def test_bad_tool_choice_is_400(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input=ASK, tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    assert "not in tools" in e.value.body["message"]


def _sessions(server) -> int:
    return len(server.call(server.running.sessions.store.list("", 1000, ""))[0])


def test_outputs_answer_calls_as_openai_checks_them(oai, model, server):
    """A ``function_call_output`` answers a ``function_call`` just before it in the input
    or, leading a follow-up's input, a call of the previous response (its ``call_id`` as
    the response and a retrieve show it): otherwise 400 in OpenAI's words naming the item,
    and nothing is created; a call item's arguments must be JSON and its function one of
    the tools."""
    gen = dict(model=model, tools=TOOLS, tool_choice="required", temperature=0, max_output_tokens=300,
               parallel_tool_calls=False)  # fmt: skip
    _, r1 = _create(oai, input=ASK, **gen)
    call = _calls(r1)[0]
    got = oai.responses.retrieve(r1.id)  # the calls read back from the session, with the ids they were given
    assert [(o.call_id, o.name, o.arguments) for o in got.output if o.type == "function_call"] == [
        (call.call_id, call.name, call.arguments)]
    assert not [o for o in got.output if o.type == "message"]  # (the reply is only the call)
    before = _sessions(server)
    out = {"type": "function_call_output", "output": "18 C"}
    item = {"type": "function_call", "call_id": "call_x", "name": "get_time", "arguments": '{"tz": "UTC"}'}
    cases = [
        (dict(input=[{**out, "call_id": "call_nope"}], previous_response_id=r1.id), "input[0].call_id",
         "No tool call found for function call output with call_id 'call_nope'"),
        (dict(input=[{**out, "call_id": call.call_id}]), "input[0].call_id", "No tool call found"),  # no previous response
        (dict(input=[{"role": "user", "content": "hm"}, {**out, "call_id": call.call_id}], previous_response_id=r1.id),
         "input[1].call_id", "No tool call found"),  # not leading: it answers nothing
        (dict(input=[item, {**out, "call_id": "call_y"}]), "input[1].call_id", "No tool call found"),
        (dict(input=[{**item, "arguments": "{oops"}, {**out, "call_id": "call_x"}]), "input[0].arguments", "not valid JSON"),
        (dict(input=[{**item, "name": "launch"}, {**out, "call_id": "call_x"}]), "input[0].name", "not in tools"),
    ]  # fmt: skip
    for kw, param, says in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(**gen, **kw)
        assert e.value.body["param"] == param and says in e.value.body["message"], (kw, e.value.body)
    assert _sessions(server) == before
    # the previous response's call answered (leading), then a call resent with its answer
    _, r2 = _create(oai, input=[{**out, "call_id": call.call_id}, item, {**out, "call_id": "call_x"}],
                    previous_response_id=r1.id, **gen)  # fmt: skip
    assert r2.status == "completed" and _calls(r2)
