"""The peers' request fields against a real server on loopback (service/http/peers.py's
table, docs/api.md "Peer fields"): a body exactly as sglang-router and vllm-router
forward it is answered, whole and streamed, with the same text as the plain request; an
honoured field is honoured end to end; a refused one is a 400 naming it, through raw
httpx and through the official ``openai`` client's ``extra_body``."""

from __future__ import annotations

import json

import httpx
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
