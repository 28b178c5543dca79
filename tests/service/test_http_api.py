"""The OpenAI-compatible HTTP front, through the official ``openai`` client against a
real server on loopback: chat and completions, sync and async, streaming and not, the
errors (400/401/404/413/429/503), sessions by X-Session-Id (extension, divergence
rewound to the last turn the history follows, restart from Redis) against the gRPC
path's figures."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request

import openai
import pytest

from kvserve.clients import KVServeClient
from kvserve.service.auth import hash_key
from kvserve.service.history import _turn_floor, match_history
from kvserve.service.sessions.stores import copy_record
from kvserve.service.types import ChatMessage
from tests.fixtures.serving import BLOCK_SIZE, EngineHold, ServerThread, held_running, tiny_config, wait_until

HELLO = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there, tell me about the fox"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    cfg = tiny_config(tiny_llama_dir, max_message_size=64 << 10, max_sessions_per_tenant=3)
    with ServerThread(cfg, http_port=0) as s:
        yield s


def base_url(s: ServerThread) -> str:
    return f"http://127.0.0.1:{s.running.http_port}/v1"


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=base_url(server), api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def model(server, tiny_llama_dir):
    return str(tiny_llama_dir)


def test_models_lists_the_served_model(oai, model, server):
    ids = [m.id for m in oai.models.list()]
    assert ids == [model]
    assert oai.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")


def test_router_discovery_routes_name_the_served_model(model, server):
    """What sglang-router asks a worker it registers (service/http/discovery.py): its model
    id is served_model_name; the deprecated /get_* names answer the same."""
    root = f"http://127.0.0.1:{server.running.http_port}"

    def get(path: str) -> dict:
        with urllib.request.urlopen(root + path, timeout=10) as r:
            assert r.status == 200
            return json.loads(r.read())

    info = server.engine.model_info
    server_info, model_info = get("/server_info"), get("/model_info")
    assert server_info["served_model_name"] == model and "model_path" not in server_info
    assert (server_info["dp_size"], server_info["page_size"]) == (1, info.block_size)
    assert model_info["is_generation"] is True
    assert (model_info["model_type"], model_info["architectures"]) == (info.model_type, [info.architecture])
    assert get("/get_server_info") == server_info and get("/get_model_info") == model_info
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(root + "/server_info", method="POST"), timeout=10)
    assert e.value.code == 405


def test_render_gives_the_token_ids_the_turn_runs(oai, model, server):
    """vLLM's render routes (what vllm-router's cache_aware asks every worker): the prompt's
    token ids, equal to the prompt the same request runs; a bad request is refused as the
    turn would be."""
    root = f"http://127.0.0.1:{server.running.http_port}"

    def post(path: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(root + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, rendered = post("/v1/chat/completions/render", {"model": model, "messages": HELLO, "max_tokens": 4})
    assert status == 200 and set(rendered) == {"request_id", "token_ids"}
    # ignore_eos: a sampled end of text within the 4 tokens would make the transcript shorter
    oai.chat.completions.create(model=model, messages=HELLO, max_tokens=4, extra_headers={"X-Session-Id": "rendered"},
                                extra_body={"ignore_eos": True})  # fmt: skip
    with KVServeClient(server.address, timeout=60) as g:
        transcript = g.get_session("rendered", include_token_ids=True).token_ids
        g.delete_session("rendered")  # the module's tenant may hold 3
    assert rendered["token_ids"] == transcript[: len(rendered["token_ids"])] and len(transcript) == len(rendered["token_ids"]) + 4
    status, text = post("/v1/completions/render", {"model": model, "prompt": [5, 6, 7], "max_tokens": 4})
    assert status == 200 and text["token_ids"] == [5, 6, 7]
    status, err = post("/v1/chat/completions/render", {"model": model, "messages": [], "max_tokens": 4})
    assert status == 400 and err["error"]["param"] == "messages"


def test_chat_equals_grpc_streamed_or_not(oai, model, server):
    with KVServeClient(server.address, timeout=60) as g:
        ref = g.complete(messages=HELLO, max_new_tokens=12, ignore_eos=True, cache_salt="grpc-ref")
    r = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == ref.start.prompt_tokens and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    details = r.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None  # always present
    assert set(details.model_extra["kvserve_cached_by_tier"]) == {"device", "host", "disk", "redis"}

    chunks = list(oai.chat.completions.create(model=model, messages=HELLO, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True}, stream=True,
                                              stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    # streamed, not one lump: a stream long enough to outlast a 20 ms stream interval (the
    # tiny model can make 12 tokens before the first chunk goes out)
    longer = list(oai.chat.completions.create(model=model, messages=HELLO, max_tokens=240, temperature=0,
                                              extra_body={"ignore_eos": True}, stream=True))  # fmt: skip
    assert len([c for c in longer if c.choices and c.choices[0].delta.content]) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # the same prompt again: its full blocks are on the device
    full = r.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == full > 0
    assert chunks[-1].usage.prompt_tokens_details.model_extra["kvserve_cached_by_tier"]["device"] == full
    # without include_usage no usage chunk
    plain = list(oai.chat.completions.create(model=model, messages=HELLO, max_tokens=3, temperature=0, stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_completions_text_and_token_ids(oai, model, server):
    prompt = "Once upon a time the quick brown fox"
    with KVServeClient(server.address, timeout=60) as g:
        ref = g.complete(text=prompt, max_new_tokens=10, ignore_eos=True)
    r = oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.text and r.object == "text_completion"
    ids = server.engine.tokenizer.encode(prompt, add_bos=True)
    r2 = oai.completions.create(model=model, prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    assert r2.choices[0].text == ref.text and r2.usage.prompt_tokens == len(ids)
    chunks = list(oai.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == ref.text


def test_async_client_streams_concurrently(server, model):
    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=base_url(server), api_key="x", max_retries=0, timeout=60) as c:
            async def one(i: int) -> str:
                stream = await c.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=8,
                    temperature=0, stream=True,
                )  # fmt: skip
                return "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])

            many = await asyncio.gather(*(one(i) for i in range(4)))
            single = await c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "count to 2"}], max_tokens=8, temperature=0
            )
            assert single.choices[0].message.content == many[2]
            return many

    assert len(asyncio.run(main())) == 4


def test_a_client_that_goes_away_frees_its_stream(oai, model, server):
    free = server.engine.stats().blocks_free
    cancelled = server.running.metrics.requests.labels("http:ChatCompletions", "CANCELLED")
    before = cancelled._value.get()
    # held running from its first step until the server has ended the call: its 400 tokens
    # could otherwise end before the connection closes (the hold is in place before the
    # request comes, the engine's loop stepping idle until it runs)
    running = EngineHold(server, running=1)
    try:
        stream = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=400, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))  # the role chunk: the turn started
        assert running.held.wait(60) and server.engine.stats().running == 1  # its sequence runs, held
        stream.close()  # the connection closes mid-stream
        assert wait_until(lambda: server.running.admission.inflight == 0)  # the server ended the call
    finally:
        running.release()
    assert wait_until(lambda: server.engine.stats().running == 0)
    assert wait_until(lambda: server.engine.stats().blocks_free == free)
    assert cancelled._value.get() == before + 1  # stopped early, not run to its end


def test_a_client_that_goes_away_before_a_whole_response_stops_its_turn(model, server):
    """stream: false: nothing is written until the end, yet a closed connection cancels
    the turn (all n sequences) instead of generating on for no one."""
    free = server.engine.stats().blocks_free
    cancelled = server.running.metrics.requests.labels("http:ChatCompletions", "CANCELLED")
    before = cancelled._value.get()
    body = json.dumps({"model": model, "messages": HELLO, "max_tokens": 400, "n": 2, "temperature": 0,
                       "ignore_eos": True}).encode()  # fmt: skip
    # both sequences held running from their first step until the server has ended the call
    # (in place before the request comes): their 400 tokens could otherwise end first
    running = EngineHold(server, running=2)
    try:
        with socket.create_connection(("127.0.0.1", server.running.http_port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            assert running.held.wait(60) and server.engine.stats().running == 2
            sock.shutdown(socket.SHUT_RDWR)
        assert wait_until(lambda: server.running.admission.inflight == 0)  # the server ended the call
    finally:
        running.release()
    assert wait_until(lambda: server.engine.stats().running == 0)
    assert wait_until(lambda: server.engine.stats().blocks_free == free)
    assert cancelled._value.get() == before + 1  # stopped early, not run to its end


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"logprobs": "yes"}, "logprobs"),
        ({"n": 17}, None),
        ({"n": "2"}, "n"),
        ({"frequency_penalty": 3}, None),
        ({"frequency_penalty": "0.5"}, "frequency_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": "x"}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, None),
        ({"logit_bias": {"5": 101}}, None),
        ({"functions": [{"name": "f"}]}, "functions"),  # the legacy form: use tools (tests/service/test_tools_http.py)
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"temperature": -1}, None),
        ({"max_tokens": 10_000_000}, None),
    ],
)
def test_unsupported_or_bad_fields_are_refused_with_400(oai, model, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=HELLO, extra_body=extra)
    assert e.value.status_code == 400
    body = e.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    if param:
        assert body["param"] == param


def test_penalties_logit_bias_min_p_and_min_tokens_map_to_the_grpc_fields(oai, model, server):
    """presence/frequency_penalty, logit_bias (OpenAI's token-id-string keys), and vLLM's
    min_p and min_tokens: the same tokens as a gRPC request with the same fields."""
    with KVServeClient(server.address, timeout=60) as g:
        plain = g.complete(messages=HELLO, max_new_tokens=10, ignore_eos=True)
        banned = plain.token_ids[0]
        ref = g.complete(messages=HELLO, max_new_tokens=10, ignore_eos=True, presence_penalty=1.5,
                         frequency_penalty=0.7, logit_bias={banned: -100.0, 7: 2.5}, min_p=0.1, min_new_tokens=3,
                         temperature=0.9, seed=11)  # fmt: skip
    r = oai.completions.create(model=model, prompt="x", max_tokens=2, presence_penalty=0.5, frequency_penalty=0.5,
                               logit_bias={"5": 1})  # completions take them as well  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")
    r = oai.chat.completions.create(
        model=model, messages=HELLO, max_tokens=10, presence_penalty=1.5, frequency_penalty=0.7,
        logit_bias={str(banned): -100, "7": 2.5}, temperature=0.9, seed=11,
        extra_body={"ignore_eos": True, "min_p": 0.1, "min_tokens": 3},
    )  # fmt: skip
    assert r.choices[0].message.content == ref.text and ref.token_ids[0] != banned


def test_n_choices_whole_and_streamed(oai, model):
    one = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    r = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=6, temperature=0, n=3,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == one.choices[0].message.content for c in r.choices)  # greedy: n copies
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    stream = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=7,
                                    n=2, stream=True, stream_options={"include_usage": True})  # fmt: skip
    text: dict[int, str] = {0: "", 1: ""}
    finished, usage = [], None
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
            if c.finish_reason:
                finished.append(c.index)
        usage = chunk.usage or usage
    assert sorted(finished) == [0, 1] and usage.completion_tokens == 10
    whole = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=5, temperature=1.0, seed=7, n=2)
    assert [c.text for c in whole.choices] == [text[0], text[1]]  # seeded per index
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=HELLO, n=2, extra_headers={"X-Session-Id": "n-two"})
    assert e.value.body["message"].startswith("n = 2 cannot be used with X-Session-Id")  # the header this API has
    assert e.value.body["param"] == "n"


def test_response_format_json_schema_constrains_the_reply(oai, model):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    r = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=80, seed=3, response_format=fmt)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = oai.chat.completions.create(model=model, messages=HELLO, max_tokens=80, seed=3,
                                    response_format={"type": "json_object"})  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=HELLO, response_format=bad)
    assert "json_schema cannot be used" in e.value.body["message"]


def test_not_found_too_large_and_bad_json(oai, model, server):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.APIStatusError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * (80 << 10)}])
    assert e.value.status_code == 413
    req = urllib.request.Request(base_url(server) + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as he:
        urllib.request.urlopen(req, timeout=30)
    assert he.value.code == 400 and "not valid JSON" in json.loads(he.value.read())["error"]["message"]
    with pytest.raises(openai.BadRequestError):  # unknown role: the conversation's own check
        oai.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "hi"}])


def test_session_limit_is_429(oai, model, server):
    for i in range(3):
        oai.chat.completions.create(model=model, messages=HELLO, max_tokens=2, extra_headers={"X-Session-Id": f"lim{i}"})
    with pytest.raises(openai.RateLimitError) as e:
        oai.chat.completions.create(model=model, messages=HELLO, max_tokens=2, extra_headers={"X-Session-Id": "lim3"})
    assert e.value.status_code == 429 and "max_sessions_per_tenant" in e.value.body["message"]
    with KVServeClient(server.address, timeout=60) as g:  # the same sessions as gRPC's
        for i in range(3):
            g.delete_session(f"lim{i}")


def test_api_keys_tenants_health_and_drain(tiny_llama_dir):
    keys = f"alice:{hash_key('ka')}\nbob:{hash_key('kb')}"
    with ServerThread(tiny_config(tiny_llama_dir, api_keys=keys), http_port=0) as s:
        url = base_url(s)
        model = str(tiny_llama_dir)
        for key in ("wrong", ""):
            with openai.OpenAI(base_url=url, api_key=key or "-", max_retries=0) as c:
                with pytest.raises(openai.AuthenticationError) as e:
                    c.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
                assert e.value.status_code == 401 and "ka" not in str(e.value.body)
        with openai.OpenAI(base_url=url, api_key="ka", max_retries=0) as alice, \
                openai.OpenAI(base_url=url, api_key="kb", max_retries=0) as bob:  # fmt: skip
            alice.chat.completions.create(model=model, messages=HELLO, max_tokens=3,
                                          extra_headers={"X-Session-Id": "mine"})  # fmt: skip
            # bob's "mine" is another session (a new one); alice's is hers, in her namespace
            r = bob.chat.completions.create(model=model, messages=HELLO, max_tokens=3,
                                            extra_headers={"X-Session-Id": "mine"})  # fmt: skip
            assert r.model_extra["kvserve"]["session_created"] is True
            assert r.usage.prompt_tokens_details.cached_tokens == 0  # KV is never shared across tenants
            health = f"http://127.0.0.1:{s.running.http_port}/health"
            assert json.loads(urllib.request.urlopen(health, timeout=10).read())["status"] == "SERVING"
            s.running.admission.start_draining()
            with pytest.raises(urllib.error.HTTPError) as he:
                urllib.request.urlopen(health, timeout=10)
            assert he.value.code == 503
            with pytest.raises(openai.InternalServerError) as e:
                alice.chat.completions.create(model=model, messages=HELLO, max_tokens=2)
            assert e.value.status_code == 503


# ----------------------------------------------------------------------------- sessions


def _turn(c: openai.OpenAI, model: str, sid: str, messages: list[dict], n: int = 6, **kw):
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=n, temperature=0, extra_headers={"X-Session-Id": sid},
        extra_body={"ignore_eos": True, **kw},
    )  # fmt: skip
    return raw.parse(), raw.headers


def test_session_history_extends_or_diverges(oai, model, server):
    msgs = list(HELLO)
    transcripts = []
    with KVServeClient(server.address, timeout=60) as g:
        for i in range(3):
            r, headers = _turn(oai, model, "conv", msgs)
            ext = r.model_extra["kvserve"]
            assert ext["session_created"] is (i == 0) and ext["history_diverged_at"] is None
            assert "x-kvserve-history-diverged-at" not in headers
            t = g.get_session("conv", include_token_ids=True).token_ids
            if transcripts:  # only the new messages were appended: the old transcript is a prefix
                assert t[: len(transcripts[-1])] == transcripts[-1]
                assert r.usage.prompt_tokens == len(t) - 6
                assert r.usage.prompt_tokens_details.cached_tokens == len(transcripts[-1]) // BLOCK_SIZE * BLOCK_SIZE
            transcripts.append(t)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"and then {i}?"}]  # fmt: skip
        # an edited earlier message (turn 2's input): the session is rewound to turn 1, the
        # last turn the history still follows, and the rest of the history is its next turn
        edited = [dict(m) for m in msgs]
        edited[3]["content"] = "something else entirely"
        prefill = server.engine.stats().prefill_tokens
        r, headers = _turn(oai, model, "conv", edited)
        ext = r.model_extra["kvserve"]
        # where the history stopped following the session: the edited message
        assert ext["history_diverged_at"] == 3 == int(headers["x-kvserve-history-diverged-at"])
        assert ext["history_rewound_turns"] == 2 and ext["session_created"] is False
        info = g.get_session("conv", include_token_ids=True)
        assert info.turns == 2  # turn 1 kept, the new one after it
        t = info.token_ids
        assert t[: len(transcripts[0])] == transcripts[0]  # turn 1's tokens, exactly
        assert r.usage.prompt_tokens == len(t) - 6
        # turn 1's KV was restored, not prefilled again
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(transcripts[0]) // BLOCK_SIZE * BLOCK_SIZE > 0
        assert server.engine.stats().prefill_tokens - prefill == r.usage.prompt_tokens - cached
        # the answer (greedy) and the transcript are a fresh session's with the same history,
        # computed cold in its own cache namespace
        g.complete(messages=edited[:2], session_id="conv-ref", cache_salt="ref", max_new_tokens=6, ignore_eos=True)
        ref = g.complete(messages=edited[3:], session_id="conv-ref", cache_salt="ref", max_new_tokens=6,
                         ignore_eos=True)  # fmt: skip
        assert r.choices[0].message.content == ref.text
        assert g.get_session("conv-ref", include_token_ids=True).token_ids == t
        for sid in ("conv", "conv-ref"):
            g.delete_session(sid)
    with pytest.raises(openai.BadRequestError):  # completions have no history
        oai.completions.create(model=model, prompt="hi", extra_headers={"X-Session-Id": "conv"})


def _three_turns(c: openai.OpenAI, model: str, sid: str) -> tuple[list[dict], list]:
    msgs, replies = list(HELLO), []
    for i in range(3):
        r, _ = _turn(c, model, sid, msgs)
        replies.append(r)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": f"and then {i}?"}]  # fmt: skip
    return msgs[:-1], replies  # the history with the last reply, without the unasked question


def test_session_regenerate_pattern_restores_the_earlier_turns(oai, model, server):
    """The app regenerates the last answer: it resends the history without it. The
    session is rewound one turn and the turn is asked again: its whole prompt is
    restored from the device (nothing before the last prompt block prefilled again),
    the answer (greedy) and the transcript are the first ones."""
    msgs, replies = _three_turns(oai, model, "regen")
    with KVServeClient(server.address, timeout=60) as g:
        before = g.get_session("regen", include_token_ids=True)
        device = server.running.metrics.cached_prompt_tokens.labels("device")
        hits, prefill = device._value.get(), server.engine.stats().prefill_tokens
        history = msgs[:-1]
        r, headers = _turn(oai, model, "regen", history)
        ext = r.model_extra["kvserve"]
        assert ext["history_rewound_turns"] == 1 and ext["history_diverged_at"] == len(history) - 1
        assert int(headers["x-kvserve-history-diverged-at"]) == len(history) - 1
        assert r.usage.prompt_tokens == replies[2].usage.prompt_tokens
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert cached == (r.usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0  # every full block
        assert r.usage.prompt_tokens_details.model_extra["kvserve_cached_by_tier"]["device"] == cached
        assert device._value.get() - hits == cached  # the metrics say so too
        assert server.engine.stats().prefill_tokens - prefill == r.usage.prompt_tokens - cached
        assert r.choices[0].message.content == replies[2].choices[0].message.content
        after = g.get_session("regen", include_token_ids=True)
        assert after.turns == 3 and after.token_ids == before.token_ids
        # a fresh session asked the same turns, computed cold in its own cache namespace
        for i, user in enumerate([history[:2], history[3:4], history[5:6]]):
            ref = g.complete(messages=user, session_id="regen-ref", cache_salt="ref", max_new_tokens=6,
                             ignore_eos=True)  # fmt: skip
            assert ref.text == (history[2 * i + 2]["content"] if i < 2 else r.choices[0].message.content)
        assert g.get_session("regen-ref", include_token_ids=True).token_ids == after.token_ids
        g.delete_session("regen-ref")
        # the regenerated answer as the history goes on: the session extends again
        more = history + [{"role": "assistant", "content": r.choices[0].message.content},
                          {"role": "user", "content": "and after that?"}]  # fmt: skip
        r2, _ = _turn(oai, model, "regen", more)
        assert r2.model_extra["kvserve"]["history_diverged_at"] is None
        assert r2.model_extra["kvserve"]["history_rewound_turns"] is None
        assert g.get_session("regen").turns == 4
        g.delete_session("regen")


def test_a_diverging_history_racing_a_turn_is_refused_and_rewinds_nothing(oai, model, server):
    """The regenerate pattern (a history one turn short: a rewind) while the session's next
    turn runs is 409 and rewinds nothing; the cancelled turn leaves the three turns. The
    turn's sequence is held running from its first step (the engine's loop held,
    ``EngineHold``) until the refusal is in: its 200 tokens take the tiny model some tens
    of ms, so it could otherwise end first, and then the rewind is no race and is right."""
    msgs, _ = _three_turns(oai, model, "busy")
    engine = server.engine
    with KVServeClient(server.address, timeout=60) as g:
        before = g.get_session("busy", include_token_ids=True)
        stream, running = held_running(
            server, lambda: g.generate(session_id="busy", text=" more", max_new_tokens=200, ignore_eos=True))
        try:
            events = iter(stream)
            assert type(next(events)).__name__ == "StreamStart"  # the turn lock is held from here on
            assert running.held.wait(60)  # the turn's sequence running, held before its second step
            with pytest.raises(openai.ConflictError) as e:  # the regenerate pattern needs a rewind: refused
                _turn(oai, model, "busy", msgs[:-1])
            assert e.value.status_code == 409 and "in flight" in e.value.body["message"]
            assert engine.stats().running == 1 and g.get_session("busy").busy  # the turn still ran
            stream.cancel()
        finally:
            running.release()
        assert wait_until(lambda: not g.get_session("busy").busy, timeout=30)
        after = g.get_session("busy", include_token_ids=True)
        assert (after.turns, after.token_ids) == (3, before.token_ids)
        g.delete_session("busy")


def test_session_divergence_checks_the_request_before_rewinding(oai, model, server):
    msgs, _ = _three_turns(oai, model, "keep")
    with KVServeClient(server.address, timeout=60) as g:
        before = g.get_session("keep", include_token_ids=True)
        with pytest.raises(openai.BadRequestError) as e:  # refused: the session is left as it was
            _turn(oai, model, "keep", msgs[:-1], repetition_penalty=-1.0)
        assert "repetition_penalty" in e.value.body["message"]
        after = g.get_session("keep", include_token_ids=True)
        assert (after.turns, after.token_ids) == (3, before.token_ids)
        g.delete_session("keep")


def test_session_without_turn_boundaries_starts_over_on_divergence(oai, model, server):
    """A record written before turn boundaries were kept cannot be rewound: a diverging
    history replaces the session (today's rule), the response says no turns were rewound."""
    msgs, _ = _three_turns(oai, model, "legacy")
    store = server.running.sessions.store
    rec = server.call(store.get("", "legacy"))
    server.call(store.put(copy_record(rec, turn_log=[])))  # as a version 1 record loads
    with KVServeClient(server.address, timeout=60) as g:
        assert g.get_session("legacy", include_turns=True).turn_log == []
        edited = [dict(m) for m in msgs] + [{"role": "user", "content": "and then?"}]
        edited[3]["content"] = "something else entirely"
        r, _ = _turn(oai, model, "legacy", edited)
        ext = r.model_extra["kvserve"]
        assert ext["history_rewound_turns"] is None and ext["session_created"] is True
        assert ext["history_diverged_at"] == 2  # match_history: the reply the edited message follows
        info = g.get_session("legacy", include_token_ids=True)
        fresh = server.engine.tokenizer.encode_chat([{"role": m["role"], "content": m["content"]} for m in edited])
        assert info.turns == 1 and info.token_ids[: len(fresh)] == fresh  # the whole history as its first turn
        g.delete_session("legacy")


def test_session_without_turn_boundaries_continues_only_a_history_that_covers_it(oai, model, server):
    """A record without turn boundaries is continued only by a history that covers its
    whole transcript. The regenerate pattern (the history without the last reply) and a
    truncated history are divergences: the session starts over with that history, and the
    answer (greedy) and transcript are a fresh session's, never an answer to turns the
    client did not send."""
    store = server.running.sessions.store

    def as_version_1(sid: str) -> None:
        rec = server.call(store.get("", sid))
        server.call(store.put(copy_record(rec, turn_log=[])))  # as a version 1 record loads

    msgs, _ = _three_turns(oai, model, "v1")
    with KVServeClient(server.address, timeout=60) as g:
        # the whole history and a new question: it extends the session
        as_version_1("v1")
        before = g.get_session("v1", include_token_ids=True).token_ids
        more = msgs + [{"role": "user", "content": "and later?"}]
        r, headers = _turn(oai, model, "v1", more)
        ext = r.model_extra["kvserve"]
        assert ext["session_created"] is False and ext["history_diverged_at"] is None
        after = g.get_session("v1", include_token_ids=True)
        assert after.turns == 4 and after.token_ids[: len(before)] == before
        msgs = more + [{"role": "assistant", "content": r.choices[0].message.content}]
        cases = [
            ("regen", msgs[:-1], len(msgs) - 3),  # without the last reply: it follows the one before
            ("cut", msgs[:4], 2),  # the first turn and one question of a four-turn session
        ]
        for name, history, diverged in cases:
            g.delete_session("v1")
            for i, user in enumerate([msgs[:2], msgs[3:4], msgs[5:6], msgs[7:8]]):  # the four turns again
                ref = g.complete(messages=user, session_id="v1", max_new_tokens=6, ignore_eos=True)
                assert ref.text == msgs[2 * i + 2]["content"]
            as_version_1("v1")
            if name == "regen":  # a history without a turn in the middle (turn 2) does not follow it either
                t = g.get_session("v1", include_token_ids=True).token_ids
                skipped = tuple(ChatMessage(m["role"], m["content"]) for m in msgs[:3] + msgs[5:])
                skipped += (ChatMessage("user", "and then?"),)
                assert match_history(server.engine.tokenizer, list(t), skipped) == (0, 2)
            r, headers = _turn(oai, model, "v1", history)
            ext = r.model_extra["kvserve"]
            assert ext["session_created"] is True, name
            assert ext["history_diverged_at"] == diverged == int(headers["x-kvserve-history-diverged-at"]), name
            assert ext["history_rewound_turns"] is None, name
            # a fresh session with that history, computed cold in its own cache namespace
            ref = g.complete(messages=history, session_id=f"v1-{name}", cache_salt=name, max_new_tokens=6,
                             ignore_eos=True)  # fmt: skip
            assert r.choices[0].message.content == ref.text, name
            info = g.get_session("v1", include_token_ids=True)
            assert info.turns == 1, name
            assert info.token_ids == g.get_session(f"v1-{name}", include_token_ids=True).token_ids, name
            g.delete_session(f"v1-{name}")
        g.delete_session("v1")


def test_turn_floor_of_a_tokenizer_without_eos_or_a_template_that_renders_nothing():
    """A tokenizer without eos ids whose template refuses every message: the floor is 2,
    so only a reply followed by nothing continues a record without turn boundaries."""

    class Refusing:
        eos_token_ids = ()

        def encode_chat_turn(self, transcript, messages):
            raise ValueError("no")

    assert _turn_floor(Refusing(), [5]) == 2


def test_multi_turn_openai_equals_grpc_from_device_then_redis_after_restart(tiny_llama_dir, redis_url):
    """Turns 1-2 on one server (device hits), turn 3 on a restarted one (Redis hits):
    the OpenAI client with X-Session-Id and the gRPC client get the same outputs and
    the same cached_tokens, each in its own cache namespace (cache_salt)."""
    cfg = tiny_config(tiny_llama_dir, redis_url=redis_url, host_cache_memory=0, spill_after=0.05,
                      spill_to=("redis",), restore_policy="always")  # fmt: skip
    model = str(tiny_llama_dir)
    users = [HELLO, [{"role": "user", "content": "what is the fox doing now"}],
             [{"role": "user", "content": "and the dog?"}]]  # fmt: skip
    grpc_out, http_out = [], []
    history: list[dict] = []

    def both_turns(s: ServerThread, turn: int) -> None:
        nonlocal history
        with KVServeClient(s.address, timeout=60) as g, \
                openai.OpenAI(base_url=base_url(s), api_key="x", max_retries=0, timeout=60) as c:  # fmt: skip
            gr = g.complete(messages=users[turn], session_id="g", cache_salt="grpc", max_new_tokens=6, ignore_eos=True)
            history = history + users[turn]
            hr, _ = _turn(c, model, "h", history, cache_salt="http")
            history = history + [{"role": "assistant", "content": hr.choices[0].message.content}]
            grpc_out.append((gr.text, gr.start.prompt_tokens, gr.start.cached_tokens, dict(gr.start.cached_by_tier)))
            by_tier = {k: v for k, v in hr.usage.prompt_tokens_details.model_extra["kvserve_cached_by_tier"].items()}
            http_out.append((hr.choices[0].message.content, hr.usage.prompt_tokens,
                             hr.usage.prompt_tokens_details.cached_tokens, by_tier))  # fmt: skip
            assert wait_until(lambda: all(
                g.get_session(sid).cached_blocks.get("redis", 0) == g.get_session(sid).full_blocks for sid in "gh"
            ), timeout=30)  # fmt: skip

    with ServerThread(cfg, http_port=0) as s:
        both_turns(s, 0)
        both_turns(s, 1)
    with ServerThread(cfg, http_port=0) as s:  # restarted: the device is empty, Redis holds the sessions
        both_turns(s, 2)
    assert http_out == grpc_out
    assert grpc_out[1][2] > 0 and grpc_out[1][3]["device"] == grpc_out[1][2]  # turn 2 from the device
    assert grpc_out[2][2] > 0 and grpc_out[2][3]["redis"] == grpc_out[2][2]  # turn 3 from Redis


def test_tls_with_the_grpc_certificates(tiny_llama_dir, tmp_path):
    import ssl

    from tests.fixtures.redis_server import make_tls_files

    tls = make_tls_files(tmp_path / "tls")
    cfg = tiny_config(tiny_llama_dir, tls_cert=str(tls.cert), tls_key=str(tls.key))
    with ServerThread(cfg, http_port=0) as s:
        port = s.running.http_port
        ctx = ssl.create_default_context(cafile=str(tls.ca_cert))
        health = json.loads(urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=ctx, timeout=10).read())
        assert health["status"] == "SERVING"
        with openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                           http_client=openai.DefaultHttpxClient(verify=ctx)) as c:  # fmt: skip
            r = c.chat.completions.create(model=str(tiny_llama_dir), messages=HELLO, max_tokens=3)
            assert r.usage.completion_tokens >= 1
        with pytest.raises(OSError):  # plaintext HTTP is not served on a TLS port
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10).read()
