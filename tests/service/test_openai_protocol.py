"""The OpenAI protocol as SDKs speak it, through the official ``openai`` package against a
real server on loopback: what an SDK sends back (a response message's ``model_dump()``,
a ``.parse()`` result, the developer role, null/default fields) is accepted; logprobs on
chat and completions, streamed and not, in OpenAI's shapes; errors in OpenAI's
vocabulary (``context_length_exceeded``, ``param`` named as the request names it,
Retry-After, an HTTP-worded 401); response bodies validate strictly against the
package's own types."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvserve.clients import KVServeClient
from kvserve.service.auth import hash_key
from tests.fixtures.serving import ServerThread, tiny_config

HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, tell me about the fox"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, max_sessions_per_tenant=2), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    url = f"http://127.0.0.1:{server.running.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return str(tiny_llama_dir)


def _raw_chat(oai, **kw):
    raw = oai.chat.completions.with_raw_response.create(**kw)
    return raw.http_response.json(), raw.parse()


def test_a_response_message_sent_back_as_the_sdk_dumps_it_is_accepted(oai, model):
    """Turn 2 carries turn 1's ``message.model_dump()`` (refusal: null, tool_calls: None ...)
    and a ``.parse()`` result's message (tool_calls: [], parsed: None), a developer
    message and the fields SDKs and frameworks set (parallel_tool_calls, service_tier,
    store, metadata, user, top_logprobs: 0, function_call: null ...)."""
    body, r1 = _raw_chat(oai, model=model, messages=HELLO, max_tokens=4)
    ChatCompletion.model_validate(body, strict=True)
    assert body["choices"][0]["message"]["refusal"] is None and "refusal" in body["choices"][0]["message"]
    boolean = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "boolean"}}}
    parsed = oai.chat.completions.parse(model=model, messages=HELLO, max_tokens=20, response_format=boolean)
    dumped = parsed.choices[0].message.model_dump()
    assert "parsed" in dumped and "refusal" in dumped
    history = [
        {"role": "developer", "content": "answer in one word"},
        *HELLO,
        r1.choices[0].message.model_dump(),
        {"role": "user", "content": "and the dog?"},
        dumped,
        {"role": "user", "content": [{"type": "text", "text": "one more"}]},
        {"role": "assistant", "content": "ok", "tool_calls": [], "function_call": None, "refusal": None,
         "annotations": [], "audio": None},
        {"role": "user", "content": "last one"},
    ]
    body, r2 = _raw_chat(
        oai, model=model, messages=history, max_tokens=4, parallel_tool_calls=False, service_tier="auto",
        store=False, metadata={"app": "test"}, user="u1", top_logprobs=0, extra_body={"function_call": None},
        safety_identifier="s1", prompt_cache_key="k",
    )  # fmt: skip
    ChatCompletion.model_validate(body, strict=True)
    assert r2.choices[0].message.content is not None and r2.usage.completion_tokens >= 1


def test_the_developer_role_is_the_system_role_for_a_template_without_it(oai, model):
    as_dev = [{"role": "developer", "content": HELLO[0]["content"]}, HELLO[1]]
    a = oai.chat.completions.create(model=model, messages=as_dev, max_tokens=6, temperature=0)
    b = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0)
    assert (a.choices[0].message.content, a.usage.prompt_tokens) == (b.choices[0].message.content, b.usage.prompt_tokens)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"service_tier": "premium"}, "service_tier"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "x", "audio": {"id": "a"}}]}, "messages[2].audio"),
    ],
)
def test_what_would_change_the_output_and_is_not_implemented_is_refused_naming_the_field(oai, model, extra, param):
    kw = {"model": model, "messages": HELLO, "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**{**kw, **{k: v for k, v in extra.items() if k == "messages"}},
                                    extra_body={k: v for k, v in extra.items() if k != "messages"})  # fmt: skip
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"


def _check_chat_logprobs(content, k):
    for item in content:
        assert len(item["top_logprobs"]) == k and item["logprob"] <= 0 and bytes(item["bytes"]).decode(errors="replace") == item["token"]
        tops = [t["logprob"] for t in item["top_logprobs"]]
        assert tops == sorted(tops, reverse=True)
        if k:  # greedy: the sampled token is the most likely one
            assert math.isclose(item["logprob"], tops[0], abs_tol=1e-5)


def _without_logprobs(content):
    """Chat logprobs content with every figure taken out: tokens, bytes, alternatives."""
    drop = lambda d: {k: v for k, v in d.items() if k != "logprob"}  # noqa: E731
    return [{**drop(c), "top_logprobs": [drop(t) for t in c["top_logprobs"]]} for c in content]


def _logprobs(content):
    """Every figure of chat logprobs content, in order: each token's, then its alternatives'."""
    return [x for c in content for x in [c["logprob"], *(t["logprob"] for t in c["top_logprobs"])]]


def test_chat_logprobs_whole_and_streamed(oai, model, server):
    kw = dict(model=model, messages=HELLO, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})  # fmt: skip
    body, r = _raw_chat(oai, **kw)
    ChatCompletion.model_validate(body, strict=True)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == r.usage.completion_tokens == 6
    _check_chat_logprobs(content, 3)
    spelled = b"".join(bytes(c["bytes"]) for c in content).decode(errors="replace")
    assert spelled.strip() == r.choices[0].message.content.strip()
    streamed = []
    with oai.chat.completions.with_streaming_response.create(**kw, stream=True) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = ChatCompletionChunk.model_validate_json(line[6:], strict=True)
                lp = chunk.choices[0].logprobs if chunk.choices else None
                streamed += [c.model_dump() for c in (lp.content or [])] if lp else []
    # the same tokens and the same figures, up to float32 rounding: the second request finds
    # the first's prompt blocks cached, and a forward over a cached prefix may round its last
    # bits otherwise than the cold one did
    assert _without_logprobs(streamed) == _without_logprobs(content)
    assert _logprobs(streamed) == pytest.approx(_logprobs(content), abs=1e-5)
    # the same figures as gRPC's DeltaEvent.logprobs
    with KVServeClient(server.address, timeout=60) as g:
        ref = g.complete(messages=HELLO, max_new_tokens=6, temperature=0, ignore_eos=True, logprobs=True,
                         top_logprobs=3)  # fmt: skip
    grpc_lps = [lp.logprob for lp in ref.logprobs]
    assert [c["logprob"] for c in content] == pytest.approx(grpc_lps, abs=1e-6)
    # logprobs: true alone: the sampled tokens, no alternatives
    body, _ = _raw_chat(oai, model=model, messages=HELLO, max_tokens=3, logprobs=True)
    _check_chat_logprobs(body["choices"][0]["logprobs"]["content"], 0)


def test_completion_logprobs_whole_and_streamed(oai, model):
    kw = dict(model=model, prompt="the quick brown fox", max_tokens=5, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    raw = oai.completions.with_raw_response.create(**kw)
    body = raw.http_response.json()
    Completion.model_validate(body, strict=True)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v, abs=1e-5)
               for t, v in zip(lp["top_logprobs"], lp["token_logprobs"]))  # fmt: skip
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    tokens = []
    for chunk in oai.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
    assert tokens == lp["tokens"]


def test_errors_in_openai_vocabulary(oai, model, server):
    # context overflow: OpenAI's code and wording (LangChain's and LiteLLM's classifiers key on them)
    ctx = server.engine.model_info.context_length
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "fox " * (ctx + 10)}])
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert f"maximum context length is {ctx} tokens" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt="fox " * 20, max_tokens=ctx)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "prompt")
    assert "max_new_tokens" not in e.value.body["message"] and "max_tokens" in e.value.body["message"]
    # value errors: param and message in the request's field names, never gRPC's
    cases = [
        (dict(max_completion_tokens=10_000_000), "max_completion_tokens"),
        (dict(max_tokens=10_000_000), "max_tokens"),
        (dict(temperature=1000.0), "temperature"),
        (dict(max_tokens=4, extra_body={"min_tokens": 9}), "min_tokens"),
        (dict(stop=["x"] * 40), "stop"),
        (dict(messages=[HELLO[1], {"role": "wizard", "content": "x"}]), "messages[1].role"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(**{"model": model, "messages": HELLO, **kw})
        body = e.value.body
        assert body["param"] == param, (kw, body)
        for grpc_name in ("max_new_tokens", "min_new_tokens", "sampling.", "chat.messages"):
            assert grpc_name not in body["message"], (kw, body)
    # 429 says when to retry
    sids = ["p0", "p1"]
    for sid in sids:
        oai.chat.completions.create(model=model, messages=HELLO, max_tokens=2, extra_headers={"X-Session-Id": sid})
    with pytest.raises(openai.RateLimitError) as e:
        oai.chat.completions.create(model=model, messages=HELLO, max_tokens=2, extra_headers={"X-Session-Id": "p2"})
    assert e.value.response.headers["retry-after"] == "1"
    with KVServeClient(server.address, timeout=60) as g:
        for sid in sids:
            g.delete_session(sid)


def test_401_is_worded_for_http_and_503_says_when_to_retry(tiny_llama_dir, model):
    cfg = tiny_config(tiny_llama_dir, api_keys=f"alice:{hash_key('ka')}")
    with ServerThread(cfg, http_port=0) as s:
        url = f"http://127.0.0.1:{s.running.http_port}/v1"
        req = urllib.request.Request(f"{url}/chat/completions", data=json.dumps({"model": model, "messages": HELLO})
                                     .encode(), headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(req, timeout=30)
        assert he.value.code == 401
        err = json.loads(he.value.read())["error"]
        assert "Authorization: Bearer" in err["message"] and "metadata" not in err["message"]
        assert err["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=url, api_key="ka", max_retries=0) as alice:
            s.running.admission.start_draining()
            with pytest.raises(openai.InternalServerError) as e:
                alice.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "2"
