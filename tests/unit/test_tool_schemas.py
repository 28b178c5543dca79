"""Tool schemas as SDKs send them, and the bookkeeping of a conversation's calls
(service/tools): a required call's grammar (llguidance lark, every family) over real
pydantic models' ``model_json_schema()`` (nested models in ``$defs``, a recursive root
``$ref``, Optional, enums, lists of models), draft-07 ``definitions`` and a ``$ref`` to
the schema's root accepts exactly the calls whose arguments validate against the tool's
own schema, never the grammar's wrapper inside the arguments; parameter schemas that are
not objects are refused at the edge in OpenAI's words; tool messages, call arguments and
call names are checked as OpenAI checks them, naming the message and the field."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import jsonschema
import pydantic
import pytest

from kvserve.service.tools import ToolCalling, check_tool_messages, check_tools
from kvserve.service.tools.formats import ToolFormat, arguments_schema, root_type
from kvserve.service.types import ChatMessage, InvalidRequest, ResponseFormat, ToolCall, ToolChoice, ToolSpec, TurnInput


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Addr(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=10)
    city: str = pydantic.Field(max_length=8)


class Person(pydantic.BaseModel):
    """A person, their home and where they lived."""

    name: str = pydantic.Field(max_length=8)
    home: Addr
    past: list[Addr] = pydantic.Field(default_factory=list, max_length=2)
    unit: Unit
    nick: Optional[str] = pydantic.Field(default=None, max_length=6)


class Tree(pydantic.BaseModel):
    """A labelled tree (pydantic writes it as a root ``$ref`` into ``$defs``)."""

    label: str = pydantic.Field(max_length=6)
    kids: list["Tree"] = pydantic.Field(default_factory=list, max_length=2)


DRAFT7 = {  # draft-07's "definitions", as older generators write them
    "type": "object",
    "definitions": {"point": {"type": "object", "properties": {"x": {"$ref": "#/definitions/coord"},
                                                               "y": {"$ref": "#/definitions/coord"}},
                              "required": ["x", "y"]},
                    "coord": {"type": "integer", "minimum": -99, "maximum": 99}},  # fmt: skip
    "properties": {"a": {"$ref": "#/definitions/point"}, "b": {"$ref": "#/definitions/point"}},
    "required": ["a"],
}
LINKED = {  # a "$ref" to the schema's root: a linked list
    "type": "object",
    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
    "additionalProperties": False,
}

# Person as LangChain's bind_tools sends it (langchain_core's convert_to_openai_tool: $defs inlined, titles dropped)
ADDR_INLINED = {"properties": {"street": {"maxLength": 10, "type": "string"}, "city": {"maxLength": 8, "type": "string"}},
                "required": ["street", "city"], "type": "object"}  # fmt: skip
PERSON_INLINED = {
    "properties": {"name": {"maxLength": 8, "type": "string"}, "home": ADDR_INLINED,
                   "past": {"items": ADDR_INLINED, "maxItems": 2, "type": "array"},
                   "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"},
                   "nick": {"anyOf": [{"maxLength": 6, "type": "string"}, {"type": "null"}], "default": None}},
    "required": ["name", "home", "unit"], "type": "object",
}  # fmt: skip

VALID = {
    "person": (Person.model_json_schema(), {"name": "Ann", "home": {"street": "Main 1", "city": "Oslo"},
                                            "past": [{"street": "Elm 2", "city": "Rome"}], "unit": "celsius",
                                            "nick": None}),  # fmt: skip
    "tree": (Tree.model_json_schema(), {"label": "root", "kids": [{"label": "a", "kids": [{"label": "b"}]}, {"label": "c"}]}),
    "draft7": (DRAFT7, {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}),
    "linked": (LINKED, {"v": 1, "next": {"v": 2, "next": None}}),
}
INVALID = {
    "person": {"name": "Ann", "home": {"street": "Main 1"}, "unit": "celsius"},  # home.city missing
    "tree": {"label": "root", "kids": [{"kids": []}]},  # a kid without a label
    "draft7": {"a": {"x": 1}},  # a.y missing
    "linked": {"v": 1, "next": {"v": 12, "next": None}},  # next.v out of range
}
FAMILIES = [("hermes", False), ("mistral", False), ("mistral", True), ("llama3_json", False)]


@pytest.fixture(scope="module")
def default_tok():
    from kvserve.service.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(Path(__file__).resolve().parents[2] / "service" / "default_model")


@pytest.fixture(scope="module")
def compiler(default_tok):
    from kvserve.service.engine.grammar import GrammarCompiler

    return GrammarCompiler(default_tok, default_tok.eos_token_ids)


def _accepts(tok, compiler, grammar: str, text: str) -> bool:
    m = compiler.matcher(ResponseFormat("lark", grammar))
    for t in tok.encode_plain(text):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


@pytest.mark.parametrize("family,named", FAMILIES)
@pytest.mark.parametrize("case", sorted(VALID))
def test_sdk_schemas_compile_against_the_tools_own_root(default_tok, compiler, family, named, case) -> None:
    """The grammar compiles (no "Pointer '/$defs/Addr' does not exist"), accepts a call
    whose arguments validate, refuses one whose arguments do not, and refuses the
    grammar's own wrapper as the arguments (what a ``$ref: "#"`` resolved against the
    wrapper allowed)."""
    schema, good = VALID[case]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(INVALID[case], schema)
    fmt = ToolFormat(family, mistral_named=named)
    tools = [ToolSpec("f", "", json.dumps(schema))]
    grammar = fmt.grammar(tools, parallel=False)
    assert _accepts(default_tok, compiler, grammar, fmt.render_calls([ToolCall("a", "f", json.dumps(good))]))
    assert not _accepts(default_tok, compiler, grammar, fmt.render_calls([ToolCall("a", "f", json.dumps(INVALID[case]))]))
    key = "parameters" if family == "llama3_json" else "arguments"
    wrapped = {"name": "f", key: good}
    assert not _accepts(default_tok, compiler, grammar, fmt.render_calls([ToolCall("a", "f", json.dumps(wrapped))]))


def test_the_arguments_schema_is_an_object_closed_where_it_lists_properties() -> None:
    tree = arguments_schema(ToolSpec("t", "", json.dumps(Tree.model_json_schema())))
    assert tree["type"] == "object" and tree["$ref"] == "#/$defs/Tree"  # a root that names no type: an object
    assert tree["$defs"]["Tree"]["additionalProperties"] is False  # each definition closed, as the root is
    person = arguments_schema(ToolSpec("p", "", json.dumps(Person.model_json_schema())))
    assert person["additionalProperties"] is False and person["$defs"]["Addr"]["additionalProperties"] is False
    assert "additionalProperties" not in person["$defs"]["Unit"]  # not an object with properties
    combined = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}], "properties": {"a": {}}}
    assert "additionalProperties" not in arguments_schema(ToolSpec("c", "", json.dumps(combined)))
    # LangChain's bind_tools sends pydantic models dereferenced: the nested objects inline, closed too
    inline = arguments_schema(ToolSpec("p", "", json.dumps(PERSON_INLINED)))
    assert inline["properties"]["home"]["additionalProperties"] is False
    assert inline["properties"]["past"]["items"]["additionalProperties"] is False
    # a property named "properties" is a property, not a keyword
    odd = arguments_schema(ToolSpec("o", "", json.dumps({"properties": {"properties": {"type": "string"}}})))
    assert odd["properties"] == {"properties": {"type": "string"}} and odd["additionalProperties"] is False
    assert arguments_schema(ToolSpec("e", "", "{}")) == {"type": "object"}


@pytest.mark.parametrize("schema, kind", [
    ({"type": "string"}, '"string"'),
    ({"type": "array", "items": {"type": "integer"}}, '"array"'),
    ({"type": ["object", "null"]}, '["object", "null"]'),
    ({"$defs": {"S": {"type": "string"}}, "$ref": "#/$defs/S"}, '"string"'),
])  # fmt: skip
def test_parameters_that_are_not_an_object_are_refused_in_openais_words(schema, kind) -> None:
    """Whatever the tool_choice: OpenAI refuses them too (a function's arguments are an object)."""
    for choice in (None, ToolChoice("required")):
        inp = TurnInput(messages=(ChatMessage("user", "hi"),), tools=(ToolSpec("f", "", json.dumps(schema)),),
                        tool_choice=choice)  # fmt: skip
        with pytest.raises(InvalidRequest) as e:
            check_tools(inp)
        assert str(e.value).startswith("tools[0].function.parameters: Invalid schema for function 'f': schema must "
                                       "be a JSON Schema of 'type: \"object\"', got 'type: " + kind)  # fmt: skip


def test_object_schemas_in_every_form_are_taken() -> None:
    for schema in ({}, {"type": "object"}, {"properties": {"a": {}}}, Tree.model_json_schema(), Person.model_json_schema(),
                   DRAFT7, LINKED, {"type": ["object"]}):  # fmt: skip
        assert root_type(schema) in (None, "object", ["object"])
        check_tools(TurnInput(messages=(ChatMessage("user", "hi"),), tools=(ToolSpec("f", "", json.dumps(schema)),)))


ASK = ChatMessage("user", "weather?")
CALL = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
TOOLS = (ToolSpec("get_weather", "", json.dumps({"type": "object", "properties": {"city": {"type": "string"}}})),)


def _refused(messages, tools=TOOLS, continues=False) -> str:
    with pytest.raises(InvalidRequest) as e:
        check_tool_messages(messages, tools, continues=continues)
    return str(e.value)


def test_tool_bookkeeping_is_checked_naming_the_message_and_the_field() -> None:
    ok = [ASK, ChatMessage("assistant", "", (CALL, ToolCall("call_2", "get_weather", "{}"))),
          ChatMessage("tool", "sunny", (), "call_2"), ChatMessage("tool", "rainy", (), "call_1"), ChatMessage("user", "and?")]  # fmt: skip
    check_tool_messages(ok, TOOLS)
    check_tool_messages(ok, ())  # a request without tools may carry earlier calls
    check_tool_messages([ASK, ChatMessage("assistant", "", (ToolCall("c", "get_weather", ""),)),
                         ChatMessage("tool", "x", (), "c")], TOOLS)  # blank arguments: none  # fmt: skip
    assert _refused([ASK, ChatMessage("assistant", "", (CALL,)), ChatMessage("tool", "x", (), "call_9")]).startswith(
        "messages[2].tool_call_id: 'call_9' answers no call")
    assert _refused([ASK, ChatMessage("tool", "x", (), "call_1")]).startswith("messages[1].tool_call_id")  # no call before
    # a user message between the calls and the result: the result answers nothing
    assert _refused([ASK, ChatMessage("assistant", "", (CALL,)), ChatMessage("user", "hm"),
                     ChatMessage("tool", "x", (), "call_1")]).startswith("messages[3].tool_call_id")  # fmt: skip
    bad_args = ToolCall("call_1", "get_weather", '{"city": "Par')
    assert _refused([ASK, ChatMessage("assistant", "", (CALL, bad_args))]).startswith(
        "messages[1].tool_calls[1].function.arguments: the arguments of call 'call_1' are not valid JSON")
    undeclared = ToolCall("call_3", "launch", "{}")
    assert _refused([ASK, ChatMessage("assistant", "", (undeclared,))]).startswith(
        "messages[1].tool_calls[0].function.name: the function 'launch' is not in tools")


def test_a_continuing_turns_leading_results_answer_the_previous_turn() -> None:
    """A gRPC session turn sends only its new messages: the results that lead them answer
    the previous turn's calls (in the transcript, not in the request)."""
    check_tool_messages([ChatMessage("tool", "x", (), "call_from_before"), ChatMessage("user", "go on")], TOOLS,
                        continues=True)  # fmt: skip
    assert _refused([ChatMessage("user", "hm"), ChatMessage("tool", "x", (), "call_from_before")],
                    continues=True).startswith("messages[1].tool_call_id")  # fmt: skip
    assert _refused([ChatMessage("tool", "x", (), "call_from_before")], continues=False).startswith("messages[0]")


def test_prepare_checks_messages_without_tools_too(default_tok) -> None:
    calling = ToolCalling(default_tok)
    inp = TurnInput(messages=(ASK, ChatMessage("assistant", "", (ToolCall("c", "f", "not json"),))))
    with pytest.raises(InvalidRequest, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        calling.prepare(inp)


def test_stable_call_ids_have_the_familys_shape() -> None:
    hermes, mistral = ToolFormat("hermes"), ToolFormat("mistral")
    a = hermes.stable_id("resp_1:0")
    assert a == hermes.stable_id("resp_1:0") != hermes.stable_id("resp_1:1")
    assert a.startswith("call_") and len(a) == 29 and a[5:].isalnum()
    m = mistral.stable_id("resp_1:0")
    assert len(m) == 9 and m.isalnum()
