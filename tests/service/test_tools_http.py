"""Tool calling over the OpenAI-compatible HTTP front, with the official ``openai``
client against a real server on loopback (service/tools): every tool_choice, a
three-step tool loop with results, streamed tool-call deltas reassembled by the SDK,
``chat.completions.parse`` with tools, the tools reaching the template (or the
fallback rendering), and a session whose tool-result turns find every full block of the
previous step cached, from the device and from Redis after a restart.

The tiny random-weight models rarely call a tool on their own (``auto``); required and
named calls are grammar-constrained, so their arguments always validate against the
tool's schema."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pydantic
import pytest

from tests.fixtures.models import make_tiny_llama
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"],
               "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME_SCHEMA}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = [{"role": "system", "content": "You are a helpful assistant with tools."},
       {"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]  # fmt: skip

# A Qwen 2.5 style template that takes tools (its tools block, <tool_call> calls, <tool_response> results).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}You are a helpful assistant.{%- endif %}\n\n# Tools\n\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\nFor each function call, return a json "
    "object within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{%- if message.content %}\n{{ message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}{%- set f = tool_call.function %}\n<tool_call>\n"
    '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n'
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


LONG = dict(max_position_embeddings=4096)  # the tools prompt alone is ~900 tokens of the tiny vocabulary


def config(path, **kw):
    return tiny_config(path, **{"default_max_new_tokens": 64, "kv_cache_memory": 16 << 20, **kw})


@pytest.fixture(scope="module")
def fallback_dir(tmp_path_factory):
    """A Llama whose (zephyr) template takes no tools: the fallback rendering."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_fallback"), **LONG)


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_hermes"), seed=3, **LONG)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = HERMES_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def server(fallback_dir):
    with ServerThread(config(fallback_dir), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def hermes_server(hermes_dir):
    with ServerThread(config(hermes_dir), http_port=0) as s:
        yield s


def client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{s.running.http_port}/v1", api_key="unused", max_retries=0,
                         timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def oai(server):
    with client(server) as c:
        yield c


@pytest.fixture(scope="module")
def hermes(hermes_server):
    with client(hermes_server) as c:
        yield c


def _model(c: openai.OpenAI) -> str:
    return c.models.list().data[0].id


def _valid(calls) -> None:
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("fixture", ["oai", "hermes"])
def test_required_calls_always_validate_whatever_the_seed(fixture, request):
    c = request.getfixturevalue(fixture)
    for seed in range(6):
        r = c.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                                      seed=seed, max_tokens=300, parallel_tool_calls=seed % 2 == 0)  # fmt: skip
        ch = r.choices[0]
        calls = ch.message.tool_calls
        assert ch.message.content is None or ch.finish_reason == "length"  # (the text of a block cut before its name)
        if seed % 2:
            assert ch.finish_reason == "tool_calls" and len(calls) == 1, ch
        elif ch.finish_reason == "length":  # a random model may go on calling: the last call is cut short
            assert len(calls) > 1
            calls = calls[:-1]
        else:
            assert ch.finish_reason == "tool_calls", ch
        _valid(calls)


def test_named_function_and_parallel_tool_calls_false(oai):
    c = oai
    for seed in range(4):
        r = oai.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=200,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["get_time"] and r.choices[0].finish_reason == "tool_calls"
        _valid(calls)
        r = oai.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                                        seed=seed, max_tokens=200, parallel_tool_calls=False)  # fmt: skip
        assert len(r.choices[0].message.tool_calls) == 1


def test_none_and_auto_give_text_and_none_never_parses(oai):
    c = oai
    r = oai.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    r = oai.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls
    # the same prompt either way: the tools are rendered under none too (its blocks are cached)
    assert r.usage.prompt_tokens_details.cached_tokens >= (r.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_streamed_tool_calls_reassemble_to_the_whole_response(oai):
    c = oai
    kw = dict(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=11, max_tokens=200)
    whole = oai.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    calls: dict[int, dict] = {}
    firsts = 0
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if d.id:  # the first delta of a call: index, id, type, name
                firsts += 1
                assert d.type == "function" and d.function.name and d.index not in calls
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert firsts == len(whole)
    assert [calls[i]["name"] for i in sorted(calls)] == [c.function.name for c in whole]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [c.function.arguments for c in whole]
    # the SDK's own stream helper accumulates the same calls
    with oai.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole]


class GetWeather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    unit: str


def test_parse_with_pydantic_tools(oai):
    c = oai
    tool = openai.pydantic_function_tool(GetWeather)
    r = oai.chat.completions.parse(model=_model(c), messages=ASK, tools=[tool], tool_choice="required", temperature=1.0,
                                   seed=5, max_tokens=200)  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather"
    assert isinstance(call.function.parsed_arguments, GetWeather)


def _loop(c: openai.OpenAI, session: str | None, steps: int = 3) -> list:
    """A tool loop: each step's calls get results and go back; returns the responses."""
    messages = list(ASK)
    out = []
    headers = {"X-Session-Id": session} if session else None
    for step in range(steps):
        r = c.chat.completions.create(model=_model(c), messages=messages, tools=TOOLS, tool_choice="required", temperature=0,
                                      max_tokens=200, extra_headers=headers)  # fmt: skip
        out.append(r)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"step": step, "ok": True})})
    return out


@pytest.mark.parametrize("fixture", ["oai", "hermes"])
def test_three_step_tool_loop_in_a_session_finds_the_previous_step_cached(fixture, request):
    c = request.getfixturevalue(fixture)
    steps = _loop(c, f"loop-{fixture}")
    for prev, r in zip(steps, steps[1:]):
        _valid(r.choices[0].message.tool_calls)
        assert r.kvserve["history_diverged_at"] is None  # the tool results extended the session
        # every full block of the previous step (its prompt and its calls) is a cache hit
        before = prev.usage.prompt_tokens + prev.usage.completion_tokens
        assert r.usage.prompt_tokens > before
        assert r.usage.prompt_tokens_details.cached_tokens >= before // BLOCK_SIZE * BLOCK_SIZE
    # without a session the same loop runs (the whole history each time), prefix-cached by content
    plain = _loop(c, None, steps=2)
    _valid(plain[1].choices[0].message.tool_calls)


def test_hermes_template_sees_the_tools_and_the_calls(hermes_server, hermes):
    steps = _loop(hermes, None, steps=2)
    r = steps[0]
    assert r.choices[0].finish_reason == "tool_calls"
    from kvserve.service.tools import ToolCalling
    from kvserve.service.types import ChatMessage, ToolSpec

    tok = hermes_server.engine.tokenizer
    calling = ToolCalling(tok)
    assert calling.family == "hermes"  # the template names <tool_call>
    specs = tuple(ToolSpec(t["function"]["name"], t["function"]["description"], json.dumps(t["function"]["parameters"]))
                  for t in TOOLS)  # fmt: skip
    text = tok.decode(calling.encode_turn([], [ChatMessage(m["role"], m["content"]) for m in ASK], specs))
    assert "# Tools" in text and '"name": "get_weather"' in text and text.count("<|im_start|>system") == 1


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "stop": ["x"]}, "stop"),
        ({"tools": "x"}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ],
)
def test_bad_tools_are_400(oai, extra, param):
    c = oai
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=_model(c), messages=ASK, max_tokens=4, **extra)
    assert e.value.body["param"] == param


def test_tool_messages_need_a_tool_call_id(oai):
    c = oai
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        oai.chat.completions.create(model=_model(c), messages=ASK + [{"role": "tool", "content": "x"}], max_tokens=4)


def test_langchain_bind_tools_runs_a_tool_loop(server, oai):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(model=_model(oai), base_url=f"http://127.0.0.1:{server.running.http_port}/v1", api_key="x",
                        temperature=0, max_tokens=200, max_retries=0)  # fmt: skip
    bound = llm.bind_tools(TOOLS, tool_choice="required")
    messages = [HumanMessage(ASK[1]["content"])]
    for step in range(2):
        ai = bound.invoke(messages)
        assert ai.tool_calls and ai.response_metadata["finish_reason"] == "tool_calls"
        for call in ai.tool_calls:
            jsonschema.validate(call["args"], SCHEMAS[call["name"]])
        messages += [ai] + [ToolMessage(json.dumps({"step": step}), tool_call_id=c["id"]) for c in ai.tool_calls]
    streamed = None
    for chunk in bound.stream(messages):  # streamed tool-call chunks, merged by LangChain
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls and all(c["name"] in SCHEMAS for c in streamed.tool_calls)


def test_litellm_tool_calls(server, oai, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network for its price list
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/" + _model(oai), api_base=f"http://127.0.0.1:{server.running.http_port}/v1",
                           api_key="x", messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                           max_tokens=200)  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    """A Llama whose sentencepiece vocabulary has Mistral's [TOOL_CALLS] and [ARGS] as
    control tokens (special: decoding skips them unless kept)."""
    import io

    import sentencepiece as spm

    from tests.fixtures.models import english_corpus

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_mistral_tools"), seed=5, **LONG)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(english_corpus()), model_writer=buf, vocab_size=400, model_type="bpe", byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2, control_symbols=["[TOOL_CALLS]", "[ARGS]"],
    )  # fmt: skip
    (path / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(sp.piece_to_id(t)): {"content": t, "special": True} for t in ("[TOOL_CALLS]", "[ARGS]")}
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_special_token_markers_mistral_calls_by_grammar_and_back(mistral_dir):
    """[TOOL_CALLS] is a control token: the grammar writes it by id, the decoded text keeps
    it, the mistral parser reads the calls (named form: [TOOL_CALLS]name[ARGS]{...})."""
    with ServerThread(config(mistral_dir), http_port=0) as s, client(s) as c:
        tok = s.engine.tokenizer
        marker = tok.token_to_id("[TOOL_CALLS]")
        assert tok.decode([marker]) == "[TOOL_CALLS]"  # kept, though special
        for seed in range(3):
            r = c.chat.completions.create(model=_model(c), messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)  # fmt: skip
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None
            assert len(ch.message.tool_calls[0].id) == 9  # Mistral's templates want 9 letters and digits
            _valid_any(ch.message.tool_calls)


def _valid_any(calls) -> None:
    assert calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_a_history_with_an_edited_tool_call_diverges_from_the_session(oai):
    c = oai
    headers = {"X-Session-Id": "edited-call"}
    kw = dict(model=_model(c), tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200, extra_headers=headers,
              parallel_tool_calls=False)  # fmt: skip
    r = c.chat.completions.create(messages=ASK, **kw)
    msg = r.choices[0].message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "ok"}
    follows = c.chat.completions.create(messages=ASK + [msg, result], **kw)
    assert follows.kvserve["history_diverged_at"] is None
    msg2 = follows.choices[0].message.model_dump(exclude_none=True)
    edited = json.loads(json.dumps(msg2))
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"tz": "edited"})
    edited["tool_calls"][0]["function"]["name"] = "get_time"
    result2 = {"role": "tool", "tool_call_id": edited["tool_calls"][0]["id"], "content": "ok"}
    r3 = c.chat.completions.create(messages=ASK + [msg, result, edited, result2], **kw)
    assert r3.kvserve["history_diverged_at"] == len(ASK) + 2  # the edited reply
    assert r3.kvserve["history_rewound_turns"] == 1


@pytest.mark.parametrize("field", [
    '"tools": [{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]',
    '"tools": [{"type": "function", "function": {"name": "f", "parameters": {"enum": ["\\ud800"]}}}]',
    '"messages": [{"role": "assistant", "tool_calls": [{"id": "\\ud800", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, {"role": "user", "content": "x"}]',
])
def test_lone_surrogates_in_tool_fields_are_400(server, field):
    """A JSON "\\ud800" escape in a tool definition or a call is refused with a message
    (the SDK cannot even send one: raw bytes)."""
    import urllib.error
    import urllib.request

    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' + field + "}"
    req = urllib.request.Request(f"http://127.0.0.1:{server.running.http_port}/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 400
    assert "surrogate" in json.loads(e.value.read())["error"]["message"]
