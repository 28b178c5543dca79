"""Forced tool calls over the schemas SDKs send, against a real server on loopback:
real pydantic models (a nested model and an enum in ``$defs``, a list of models,
Optional, a recursive model whose root is a ``$ref``) as their ``model_json_schema()``
(what the Agents SDK and ``openai.pydantic_function_tool`` send, ``$defs`` kept), a
draft-07 ``definitions`` schema and a ``$ref`` to the schema's root, under
``tool_choice`` required and named, through the official ``openai`` client on chat
(``chat.completions.parse`` gives the pydantic object) and on the Responses API,
LangChain's ``bind_tools`` with the pydantic classes (chat and ``use_responses_api``),
and the gRPC client: every call's arguments validate against the tool's own schema and
the pydantic model. Parameter schemas that are not objects are refused with 400 (gRPC
INVALID_ARGUMENT) in OpenAI's words on every front, whatever the tool_choice."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest

from kvserve.clients import KVServeClient, KVServeError
from tests.fixtures.models import make_tiny_llama
from tests.fixtures.serving import ServerThread, tiny_config
from tests.unit.test_tool_schemas import DRAFT7, LINKED, Person, Tree

ASK = [{"role": "user", "content": "Describe a person, a tree, two points and a short list."}]
PYDANTIC = {"Person": Person, "Tree": Tree}
SCHEMAS = {"Person": Person.model_json_schema(), "Tree": Tree.model_json_schema(), "points": DRAFT7, "linked": LINKED}
MAX = 400  # tokens: the tiny random model's calls under these schemas end well within it


def _chat_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"Record a {name}", "parameters": SCHEMAS[name]}}


def _responses_tool(name: str) -> dict:
    return {"type": "function", "name": name, "description": f"Record a {name}", "parameters": SCHEMAS[name], "strict": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_tool_schemas"), max_position_embeddings=4096)
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


def _valid(name: str, arguments: str) -> None:
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])  # the tool's own schema: no wrapper, no other shape
    if name in PYDANTIC:
        PYDANTIC[name].model_validate(value)


@pytest.mark.parametrize("name", ["Person", "Tree", "points"])
def test_named_calls_on_chat_and_responses_validate_against_the_tools_own_schema(oai, model, name):
    tools = [_chat_tool(n) for n in sorted(SCHEMAS)]
    r = oai.chat.completions.create(model=model, messages=ASK, tools=tools, max_tokens=MAX, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": name}})  # fmt: skip
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and [c.function.name for c in ch.message.tool_calls] == [name], ch
    _valid(name, ch.message.tool_calls[0].function.arguments)
    rr = oai.responses.create(model=model, input=ASK[0]["content"], tools=[_responses_tool(n) for n in sorted(SCHEMAS)],
                              tool_choice={"type": "function", "name": name}, max_output_tokens=MAX, temperature=0,
                              store=False)  # fmt: skip
    calls = [o for o in rr.output if o.type == "function_call"]
    assert rr.status == "completed" and [c.name for c in calls] == [name], rr
    _valid(name, calls[0].arguments)


def _depth(value) -> int:
    return 1 + _depth(value["next"]) if isinstance(value, dict) and value.get("next") is not None else 1


def test_a_ref_to_the_root_nests_the_tools_own_objects(oai, model):
    """``"$ref": "#"`` is the tool's schema (not the grammar's wrapper): the nested
    objects are list nodes. A random model may nest without end (greedy does, here: cut
    by max_tokens), so the calls are sampled over seeds; those that end validate, and
    some nest."""
    tool = [_chat_tool("linked")]
    ended = []
    for seed in range(6):
        kw = dict(model=model, tools=tool, max_tokens=MAX, temperature=1.0, seed=seed, parallel_tool_calls=False)
        r = oai.chat.completions.create(messages=ASK, tool_choice={"type": "function", "function": {"name": "linked"}}, **kw)
        rr = oai.responses.create(input=ASK[0]["content"], tools=[_responses_tool("linked")], max_output_tokens=MAX,
                                  tool_choice={"type": "function", "name": "linked"}, temperature=1.0, store=False,
                                  parallel_tool_calls=False, extra_body={"seed": seed}, model=model)  # fmt: skip
        if r.choices[0].finish_reason == "tool_calls":
            ended.append(r.choices[0].message.tool_calls[0].function.arguments)
        if rr.status == "completed":
            ended.append([o for o in rr.output if o.type == "function_call"][0].arguments)
    assert len(ended) >= 6, ended
    for args in ended:
        _valid("linked", args)
    assert max(_depth(json.loads(a)) for a in ended) >= 2, ended


def test_required_calls_over_every_schema_whatever_the_seed(oai, model):
    tools = [_chat_tool(n) for n in sorted(SCHEMAS)]
    seen = set()
    for seed in range(4):
        r = oai.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice="required", max_tokens=MAX,
                                        temperature=1.0, seed=seed, parallel_tool_calls=False)  # fmt: skip
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        call = ch.message.tool_calls[0]
        _valid(call.function.name, call.function.arguments)
        seen.add(call.function.name)
    assert seen  # (which tool a random model picks is its own affair)


def test_the_official_clients_pydantic_tools_parse_back(oai, model):
    """``openai.pydantic_function_tool`` sends the strict schema with ``$defs`` kept;
    ``parse`` turns the arguments back into the pydantic objects."""
    tools = [openai.pydantic_function_tool(Person), openai.pydantic_function_tool(Tree)]
    for name, cls in PYDANTIC.items():
        r = oai.chat.completions.parse(model=model, messages=ASK, tools=tools, max_tokens=MAX, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": name}})  # fmt: skip
        call = r.choices[0].message.tool_calls[0]
        assert isinstance(call.function.parsed_arguments, cls), call


@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_bind_tools_with_pydantic_classes(server, model, responses_api):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.output_parsers.openai_tools import PydanticToolsParser

    llm = lc.ChatOpenAI(model=model, base_url=f"http://127.0.0.1:{server.running.http_port}/v1", api_key="x",
                        temperature=0, max_tokens=MAX, max_retries=0, use_responses_api=responses_api)  # fmt: skip
    # (LangChain inlines the models' $defs; a recursive one's self-reference becomes "items": {}, any
    # JSON, which a random model may write without end: it is bound, not chosen here)
    for tools, choice in (([Person, Tree], "Person"), ([Person], "required")):
        bound = llm.bind_tools(tools, tool_choice=choice, parallel_tool_calls=False)
        ai = bound.invoke(ASK[0]["content"])
        assert [c["name"] for c in ai.tool_calls] == ["Person"] and not ai.invalid_tool_calls, ai
        parsed = PydanticToolsParser(tools=tools).invoke(ai)
        assert len(parsed) == 1 and isinstance(parsed[0], Person)


def test_grpc_required_calls_over_pydantic_schemas(server):
    tools = [_chat_tool(n) for n in sorted(SCHEMAS)]
    with KVServeClient(server.address, timeout=120) as g:
        for name in ("Person", "Tree"):
            r = g.complete(messages=ASK, tools=tools, tool_choice=name, max_new_tokens=MAX)
            assert r.end.finish_reason == "tool_calls" and [c.name for c in r.tool_calls] == [name]
            _valid(name, r.tool_calls[0].arguments)


NOT_OBJECTS = [{"type": "string"}, {"type": "array", "items": {}}, {"$defs": {"S": {"type": "integer"}}, "$ref": "#/$defs/S"}]


@pytest.mark.parametrize("params", NOT_OBJECTS)
def test_parameters_that_are_not_an_object_are_400_on_every_front(server, oai, model, params):
    says = "Invalid schema for function 'f': schema must be a JSON Schema of 'type: \"object\"'"
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=ASK, max_tokens=4, tool_choice=choice,
                                        tools=[{"type": "function", "function": {"name": "f", "parameters": params}}])  # fmt: skip
        assert e.value.body["param"] == "tools[0].function.parameters" and says in e.value.body["message"]
        with pytest.raises(openai.BadRequestError) as e:
            oai.responses.create(model=model, input="hi", max_output_tokens=4, tool_choice=choice,
                                 tools=[{"type": "function", "name": "f", "parameters": params, "strict": True}])  # fmt: skip
        assert e.value.body["param"] == "tools[0].parameters" and says in e.value.body["message"]
    with KVServeClient(server.address, timeout=60) as g, pytest.raises(KVServeError) as e:
        g.complete(messages=ASK, tools=[{"type": "function", "function": {"name": "f", "parameters": params}}],
                   tool_choice="required", max_new_tokens=4)  # fmt: skip
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details
