"""The peers' request fields against a real server on loopback (service/http/peers.py's
table, docs/api.md "Peer fields"): a body exactly as sglang-router and vllm-router
forward it is answered, whole and streamed, with the same text as the plain request; an
honoured field is honoured end to end; a refused one is a 400 naming it, through raw
httpx and through the official ``openai`` client's ``extra_body``."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.fixtures.serving import ServerThread, tiny_config
from tests.unit.test_peer_fields import ROUTER_COMPLETION, SGLANG_ROUTER_CHAT, VLLM_ROUTER_CHAT


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.running.http_port}", timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    url = f"http://127.0.0.1:{server.running.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


def _sse_text(r: httpx.Response) -> str:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                out.append((c.get("delta") or {}).get("content") or c.get("text") or "")
    return "".join(out)


def test_router_forwarded_requests_answer_as_the_plain_request(http, model):
    plain = {"model": model, "messages": SGLANG_ROUTER_CHAT["messages"], "max_tokens": 8, "temperature": 0}
    want = http.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]["content"]
    for shape in (SGLANG_ROUTER_CHAT, VLLM_ROUTER_CHAT):
        body = {**shape, "model": model, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
        r = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.status_code == 200 and _sse_text(r) == want
    plain = {"model": model, "prompt": "once upon", "max_tokens": 8, "temperature": 0}
    want = http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
    r = http.post("/v1/completions", json={**ROUTER_COMPLETION, "model": model, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_honoured_and_refused_through_the_openai_client(oai, model):
    msgs = SGLANG_ROUTER_CHAT["messages"]
    r = oai.chat.completions.create(model=model, messages=msgs, max_completion_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "separate_reasoning": False,
                                                "skip_special_tokens": True})  # fmt: skip
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"  # no stop before the limit
    for field, value in (("no_stop_trim", True), ("continue_final_message", True), ("skip_special_tokens", False),
                         ("return_hidden_states", True), ("chat_template_kwargs", {"enable_thinking": True})):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=model, messages=msgs, max_tokens=4, extra_body={field: value})
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_parameter"


def test_a_refused_peer_field_names_itself_over_raw_http(http, model):
    r = http.post("/v1/completions", json={**ROUTER_COMPLETION, "model": model, "no_stop_trim": True})
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("no_stop_trim", "unsupported_parameter") and "stop string" in err["message"]
    r = http.post("/v1/chat/completions", json={**SGLANG_ROUTER_CHAT, "model": model, "stream_reasoning": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_reasoning"


# ----------------------------------------------------------------------------- constrained outputs

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b"]}},
        "required": ["ok", "tag"], "additionalProperties": False}  # fmt: skip
PICK = ["red apple", "green pear", "blue plum"]
CODE = "(yes|no)-[0-9]{2}"
GBNF = 'root ::= ("cat" | "dog") " " [0-9] [0-9]'
LARK = 'start: ("cat" | "dog") " " /[0-9][0-9]/'


def _chat_text(http, model, **fields):
    body = {"model": model, "messages": SGLANG_ROUTER_CHAT["messages"], "max_tokens": 40, "temperature": 1.0,
            "seed": 7, **fields}  # fmt: skip
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # the grammar ended the reply, within the limit
    return choice["message"]["content"]


def _completion_text(http, model, **fields):
    body = {"model": model, "prompt": "once upon", "max_tokens": 40, "temperature": 1.0, "seed": 7, **fields}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    return r.json()["choices"][0]["text"]


def test_llama_cpp_schemas_constrain_the_reply(http, model):
    jsonschema.validate(json.loads(_chat_text(http, model, json_schema=FLAG)), FLAG)
    fmt = {"type": "json_object", "schema": FLAG}
    jsonschema.validate(json.loads(_chat_text(http, model, response_format=fmt)), FLAG)
    jsonschema.validate(json.loads(_completion_text(http, model, json_schema=FLAG)), FLAG)
    jsonschema.validate(json.loads(_completion_text(http, model, json_schema=json.dumps(FLAG))), FLAG)  # SGLang's string
    assert re.fullmatch(r"(cat|dog) [0-9][0-9]", _chat_text(http, model, grammar=GBNF))


def test_vllm_structured_outputs_constrain_the_reply(oai, http, model):
    msgs = SGLANG_ROUTER_CHAT["messages"]

    def text(so, **kw):
        r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=40, seed=3, temperature=1.0,
                                        extra_body={"structured_outputs": so}, **kw)  # fmt: skip
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    assert text({"choice": PICK}) in PICK
    assert re.fullmatch(CODE, text({"regex": CODE}))
    jsonschema.validate(json.loads(text({"json": FLAG, "disable_any_whitespace": True})), FLAG)
    assert isinstance(json.loads(text({"json_object": True})), dict)
    assert re.fullmatch(r"(cat|dog) [0-9][0-9]", text({"grammar": GBNF}))
    assert re.fullmatch(r"(cat|dog) [0-9][0-9]", text({"grammar": LARK}))
    assert _completion_text(http, model, guided_choice=PICK) in PICK  # the older names, on completions too
    assert re.fullmatch(CODE, _completion_text(http, model, guided_regex=CODE))
    assert re.fullmatch(CODE, _chat_text(http, model, regex=CODE))  # SGLang's
    assert re.fullmatch(r"(cat|dog) [0-9][0-9]", _completion_text(http, model, ebnf=GBNF))


@pytest.mark.parametrize("fields,param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs.regex"),
    ({"json_schema": {"type": "object"}, "guided_regex": "x"}, "guided_regex"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema"),
    ({"grammar": 'root ::= "a'}, "grammar"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"cache_prompt": False}, "cache_prompt"),
    ({"n_probs": 3, "logprobs": True, "top_logprobs": 2}, "n_probs"),
    ({"n_probs": 50}, "n_probs"),
])  # fmt: skip
def test_invalid_peer_constraints_are_refused_naming_the_field(oai, model, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=SGLANG_ROUTER_CHAT["messages"], max_tokens=4,
                                    extra_body=fields)  # fmt: skip
    assert e.value.body["param"] == param, e.value.body
    assert param.split(".")[-1] in e.value.body["message"]


def test_n_probs_returns_the_routes_logprobs_with_n_alternatives(oai, http, model):
    r = oai.chat.completions.create(model=model, messages=SGLANG_ROUTER_CHAT["messages"], max_tokens=4,
                                    temperature=0, extra_body={"n_probs": 3, "cache_prompt": True})  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[2].logprob
    body = {"model": model, "prompt": "once upon", "max_tokens": 4, "temperature": 0, "n_probs": 2}
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    assert http.post("/v1/completions", json={**body, "n_probs": 0}).json()["choices"][0]["logprobs"] is None


def test_continuous_usage_stats_puts_usage_on_every_chunk(oai, model):
    msgs = SGLANG_ROUTER_CHAT["messages"]
    chunks = list(oai.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # fmt: skip
    with_choice = [c for c in chunks if c.choices]
    assert with_choice and all(c.usage is not None for c in with_choice)
    counts = [c.usage.completion_tokens for c in with_choice]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == chunks[-1].usage.completion_tokens
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    plain = list(oai.chat.completions.create(
        model=model, messages=msgs, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True}))  # fmt: skip
    assert all(c.usage is None for c in plain)  # as vLLM: continuous usage only with include_usage


def test_router_forwarded_tools_with_the_choice_the_router_fills_in(http, model):
    """sglang-router sets tool_choice when the client sent tools without one: "auto" for
    a list of tools, "none" for an empty list."""
    tool = {"type": "function", "function": {"name": "ls", "description": "list files",
                                             "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    for tools, choice in (([tool], "auto"), ([], "none")):
        body = {**SGLANG_ROUTER_CHAT, "model": model, "tools": tools, "tool_choice": choice}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
