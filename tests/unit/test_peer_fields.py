"""service/http/peers.py's table of the peers' and routers' fields, through the OpenAI
front's parsing (pure): a request as sglang-router and vllm-router re-serialise it is
accepted; an honoured field changes the domain request; a default-only field at another
value, a malformed ignored one and a wrong type are refused naming the field; and
docs/api.md's "Peer fields" table lists exactly the table's rows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvserve.service.http import peers
from kvserve.service.http.openai import HttpError, chat_request, completion_request

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

# What sglang-router 0.3.2 forwards for {"model", "messages", "max_tokens": 8}: its typed
# ChatCompletionRequest re-serialised (the non-Option fields at their defaults).
SGLANG_ROUTER_CHAT = {
    "messages": MESSAGES, "model": "m", "logprobs": False, "max_completion_tokens": 8, "stream": False,
    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
    "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
}  # fmt: skip
# vllm-router's adds include_reasoning; its completions carry echo: false like SGLang's.
VLLM_ROUTER_CHAT = {**SGLANG_ROUTER_CHAT, "include_reasoning": True}
# llama.cpp's own sampler fields at their defaults (off), as a client written for it may send them.
LLAMA_CPP_DEFAULTS = {
    "cache_prompt": True, "n_probs": 0, "typical_p": 1.0, "mirostat": 0, "dynatemp_range": 0.0, "dry_multiplier": 0,
    "xtc_probability": 0.0, "t_max_predict_ms": 0, "id_slot": -1, "return_tokens": False, "timings_per_token": False,
    "post_sampling_probs": False,
}  # fmt: skip
ROUTER_COMPLETION = {
    "model": "m", "prompt": "once upon", "max_tokens": 8, "stream": False, "echo": False, "no_stop_trim": False,
    "ignore_eos": False, "skip_special_tokens": True, "return_hidden_states": False,
}  # fmt: skip


def refused(parse, body, param, code="unsupported_parameter"):
    with pytest.raises(HttpError) as e:
        parse(body, 64)
    assert (e.value.status, e.value.param, e.value.code) == (400, param, code), e.value.message
    assert param in e.value.message
    return e.value


def test_requests_as_the_routers_forward_them_are_accepted():
    for body in (SGLANG_ROUTER_CHAT, VLLM_ROUTER_CHAT):
        req = chat_request(dict(body), 64)
        assert req.inp.max_new_tokens == 8 and not req.inp.sampling.ignore_eos
        assert [m.content for m in req.inp.messages] == ["be brief", "hi"]
    assert completion_request(dict(ROUTER_COMPLETION), 64).inp.text == "once upon"
    req = chat_request({"messages": MESSAGES, **LLAMA_CPP_DEFAULTS}, 64)
    assert req.inp.sampling.logprobs is None and req.inp.sampling.response_format is None
    assert completion_request({"prompt": "x", **LLAMA_CPP_DEFAULTS}, 64).inp.text == "x"


def test_honoured_fields_reach_the_domain_request():
    req = chat_request({**SGLANG_ROUTER_CHAT, "ignore_eos": True, "max_completion_tokens": 5}, 64)
    assert req.inp.sampling.ignore_eos and req.inp.max_new_tokens == 5
    assert completion_request({**ROUTER_COMPLETION, "ignore_eos": True}, 64).inp.sampling.ignore_eos


def test_ignored_fields_take_any_value_of_their_type():
    for name in ("separate_reasoning", "stream_reasoning", "include_reasoning"):
        chat_request({**VLLM_ROUTER_CHAT, name: False}, 64)
        refused(chat_request, {**VLLM_ROUTER_CHAT, name: "no"}, name, "invalid_type")
    chat_request({**SGLANG_ROUTER_CHAT, "session_params": {"session_id": "s1"}, "id_slot": 3}, 64)
    refused(chat_request, {**SGLANG_ROUTER_CHAT, "id_slot": 1.5}, "id_slot", "invalid_type")
    completion_request({**ROUTER_COMPLETION, "session_params": {}}, 64)
    err = refused(chat_request, {**SGLANG_ROUTER_CHAT, "session_params": {"id": "x", "offset": 3}}, "session_params")
    assert "continual prompting" in err.message


@pytest.mark.parametrize("field", [f for f in peers.PEER_FIELDS if f.disposition == peers.DEFAULT_ONLY],
                         ids=lambda f: f.name)  # fmt: skip
def test_default_only_fields_refuse_another_value(field):
    other = {bool: not field.default, str: "adapter-1", dict: {"enable_thinking": False}, int: 1,
             peers._NUMBER: 0.5}[field.kind]  # fmt: skip
    wrong = "x" if field.kind in (int, peers._NUMBER) else 3
    for route in field.routes:
        parse, base = (chat_request, SGLANG_ROUTER_CHAT) if route == peers.CHAT else (completion_request,
                                                                                       ROUTER_COMPLETION)  # fmt: skip
        parse({**base, field.name: field.default}, 64)  # the default, and null, change nothing
        parse({**base, field.name: None}, 64)
        err = refused(parse, {**base, field.name: other}, field.name)
        assert "is accepted" in err.message
        refused(parse, {**base, field.name: wrong}, field.name, "invalid_type")
        if field.kind is not bool:
            refused(parse, {**base, field.name: True}, field.name, "invalid_type")


def test_a_field_of_the_other_route_is_unknown_there():
    refused(completion_request, {**ROUTER_COMPLETION, "continue_final_message": False}, "continue_final_message")
    refused(chat_request, {**SGLANG_ROUTER_CHAT, "no_such_field": 1}, "no_such_field")


def test_docs_list_every_row_of_the_table():
    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    section = text[text.index("### Peer fields"):]
    section = section[:section.index("\n### ", 1)]
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \| ([^|]+) \| ([^|]+) \|", section, re.M)
    table = [(f.name, ", ".join(f.routes), f.disposition, "null" if f.default is None else str(f.default).lower())
             for f in peers.PEER_FIELDS]  # fmt: skip
    assert [tuple(c.strip() for c in r) for r in rows] == table


def test_n_probs_is_the_logprobs_count():
    assert chat_request({"messages": MESSAGES, "n_probs": 3}, 64).inp.sampling.logprobs == 3
    assert chat_request({"messages": MESSAGES, "n_probs": 3, "logprobs": True}, 64).inp.sampling.logprobs == 3
    assert chat_request({"messages": MESSAGES, "n_probs": 3, "logprobs": True, "top_logprobs": 3},
                        64).inp.sampling.logprobs == 3  # fmt: skip
    assert completion_request({"prompt": "x", "n_probs": 2, "logprobs": 2}, 64).inp.sampling.logprobs == 2
    refused(chat_request, {"messages": MESSAGES, "n_probs": 3, "logprobs": True, "top_logprobs": 1}, "n_probs",
            "invalid_value")  # fmt: skip
    refused(completion_request, {"prompt": "x", "n_probs": 2, "logprobs": 4}, "n_probs", "invalid_value")
    refused(chat_request, {"messages": MESSAGES, "n_probs": -1}, "n_probs", "invalid_value")
    assert chat_request({"messages": MESSAGES, "n_probs": 0}, 64).inp.sampling.logprobs is None
