"""Property tests over request fields through a live server on loopback.

Every generated request gets either a well-formed stream (start, deltas, final) or a
precise error status with a message: never INTERNAL, UNKNOWN, a hang or a dead server;
over HTTP, JSON bodies with integers of any size, any float JSON can spell and text with
lone surrogates get a 200 or a 4xx with a message, never a 500. After the run the
server is healthy, serves a good request, holds no blocks and no engine step failed."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from tests.fixtures.serving import ServerThread, tiny_config, wait_until

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LIMIT = 12  # max_new_tokens_limit of the server under test: generations stay short
DEADLINE_S = 60.0  # a call that takes this long is a hang
# A bad request gets one of these; INTERNAL / UNKNOWN / DEADLINE_EXCEEDED / UNAVAILABLE never.
PRECISE = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}

utf8_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
wild_floats = st.floats(width=32) | st.sampled_from([0.0, 1e-45, 1e-30, 0.009, 3.4e38, -0.0, -1.0])


def mostly(valid: st.SearchStrategy, wild: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values seven times in eight, so many requests reach the engine."""
    return st.integers(0, 7).flatmap(lambda i: wild if i == 0 else valid)


session_ids = mostly(st.sampled_from(["", "", "fz-1", "fz-2", "fz.3:x"]), utf8_text)
valid_ids = st.lists(st.integers(3, 399), min_size=1, max_size=40)
wild_ids = st.lists(st.integers(0, 420) | st.integers(0, 2**32 - 1), max_size=40) | st.just(list(range(5, 600)))


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    s = pb.SamplingParams()
    if draw(st.booleans()):
        s.max_new_tokens = draw(mostly(st.integers(1, LIMIT), st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        s.temperature = draw(mostly(st.sampled_from([0.0, 0.7, 1.0, 5.0]), wild_floats))
    if draw(st.booleans()):
        s.top_k = draw(mostly(st.integers(0, 500), st.integers(-(2**31), 2**31 - 1)))
    if draw(st.booleans()):
        s.top_p = draw(mostly(st.floats(0.25, 1.0, width=32), wild_floats))
    if draw(st.booleans()):
        s.repetition_penalty = draw(mostly(st.floats(0.5, 2.0, width=32), wild_floats))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1) | st.sampled_from([2**64 - 1, 2**63]))  # n > 1 wraps seed + i
    s.stop.extend(draw(mostly(st.just([]), st.lists(utf8_text, max_size=3))))
    s.stop_token_ids.extend(draw(mostly(st.lists(st.integers(0, 399), max_size=2), st.lists(st.integers(0, 2**32 - 1), max_size=3))))
    s.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        s.min_p = draw(mostly(st.floats(0.0, 0.5, width=32), wild_floats))
    if draw(st.booleans()):
        s.presence_penalty = draw(mostly(st.floats(-2.0, 2.0, width=32), wild_floats))
    if draw(st.booleans()):
        s.frequency_penalty = draw(mostly(st.floats(-2.0, 2.0, width=32), wild_floats))
    bias_ids = mostly(st.integers(0, 399), st.integers(0, 2**32 - 1))
    bias = mostly(st.floats(-100.0, 100.0, width=32), wild_floats)
    if draw(st.booleans()):
        too_many = st.just({i: 1.0 for i in range(301)})
        s.logit_bias.update(draw(mostly(st.dictionaries(bias_ids, bias, max_size=3), too_many)))
    if draw(st.booleans()):
        s.min_new_tokens = draw(mostly(st.integers(0, 4), st.integers(0, 2**32 - 1)))
    s.logprobs = draw(st.booleans())
    if draw(st.booleans()):
        s.top_logprobs = draw(mostly(st.integers(0, 20), st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):
        s.n = draw(mostly(st.integers(0, 4), st.integers(0, 2**32 - 1)))
    if draw(st.integers(0, 3)) == 0:
        kind = draw(st.sampled_from(["json_schema", "json_object", "regex", "empty"]))
        if kind == "json_schema":
            s.response_format.json_schema = draw(mostly(SCHEMAS, utf8_text | st.just("{" * 40000)))
        elif kind == "json_object":
            s.response_format.json_object.SetInParent()
        elif kind == "regex":
            s.response_format.regex = draw(mostly(st.sampled_from([r"[a-z]{1,4}", r"(yes|no)", r"\d+"]), utf8_text))
        else:
            s.response_format.SetInParent()
    return s


SCHEMAS = st.sampled_from([
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
    '{"type": "array", "items": {"type": "boolean"}, "maxItems": 2}',
    '{"enum": ["x", "y"]}',
    '{"type": "string", "format": "no-such-format"}',
    '{"type": 7}',
    "true",
])  # fmt: skip


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(session_id=draw(session_ids), cache_salt=draw(mostly(st.sampled_from(["", "a"]), utf8_text)))
    kind = draw(st.sampled_from(["none", "text", "text", "chat", "chat", "tokens", "tokens", "tokens"]))
    if kind == "text":
        req.text = draw(utf8_text)
    elif kind == "chat":
        roles = mostly(st.sampled_from(["system", "user", "assistant"]), utf8_text)
        for role, content in draw(st.lists(st.tuples(roles, utf8_text), max_size=3)):
            req.chat.messages.add(role=role, content=content)
        req.chat.SetInParent()
    elif kind == "tokens":
        req.tokens.ids.extend(draw(mostly(valid_ids, wild_ids)))
        req.tokens.SetInParent()
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params()))
    if draw(st.booleans()):
        req.turn_mode = draw(mostly(st.sampled_from([0, 1, 2, 3]), st.integers(-(2**31), 2**31 - 1)))
    if draw(st.integers(0, 3)) == 0:
        req.expected_turns = draw(mostly(st.integers(0, 3), st.integers(0, 2**32 - 1)))
    return req


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # warm-ups hold their blocks a moment only: the last test finds every block free again
    cfg = tiny_config(tiny_llama_dir, max_new_tokens_limit=LIMIT, default_max_new_tokens=4, max_prompt_tokens=400,
                      warm_ttl=0.2)  # fmt: skip
    with ServerThread(cfg, http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def _check_stream(req: pb.GenerateRequest, responses: list[pb.GenerateResponse]) -> None:
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds[0] == "start" and kinds[-1] == "final" and set(kinds[1:]) <= {"delta", "final"}, kinds
    n = req.sampling.n or 1
    start = responses[0].start
    finals = [r.final for r in responses if r.WhichOneof("event") == "final"]
    assert sorted(f.index for f in finals) == list(range(n))  # one final per sequence
    for final in finals:
        tokens = [t for r in responses if r.WhichOneof("event") == "delta" and r.delta.index == final.index
                  for t in r.delta.token_ids]  # fmt: skip
        assert final.usage.completion_tokens == len(tokens) >= 1
        assert final.usage.prompt_tokens == start.prompt_tokens >= 1
        assert final.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        if req.sampling.HasField("max_new_tokens"):
            assert len(tokens) <= req.sampling.max_new_tokens
        assert len(tokens) <= LIMIT
    assert start.cached_tokens < start.prompt_tokens  # the last prompt token is always computed


@FUZZ
@given(req=generate_requests())
def test_every_request_gets_a_stream_or_a_precise_status(stub, req):
    try:
        responses = list(stub.Generate(req, timeout=DEADLINE_S))
    except grpc.RpcError as e:
        event(e.code().name)  # pytest --hypothesis-show-statistics shows the mix
        assert e.code() in PRECISE, (e.code(), e.details(), req)
        assert e.details(), req
        return
    event("stream")
    _check_stream(req, responses)


@settings(FUZZ, max_examples=60)
@given(
    temperature=wild_floats | st.sampled_from([0.0, 1.0]),
    top_p=wild_floats | st.just(1.0),
    repetition_penalty=wild_floats | st.just(1.0),
    top_k=st.integers(-2, 500) | st.sampled_from([399, 400, 401, 2**31 - 1]),  # about the vocabulary, int32's top
)
@example(temperature=1e-45, top_p=1.0, repetition_penalty=1.0, top_k=0)  # x / 1e-45 = inf
@example(temperature=1.0, top_p=1.0, repetition_penalty=1e-45, top_k=0)
@example(temperature=float("inf"), top_p=1.0, repetition_penalty=1.0, top_k=0)
@example(temperature=1.0, top_p=0.5, repetition_penalty=1.0, top_k=2**31 - 1)
def test_extreme_sampling_values_are_served_or_refused(stub, temperature, top_p, repetition_penalty, top_k):
    """Values at the edges of float32 (denormals, huge, inf, NaN) never break the sampler:
    a NaN there fails the whole engine step, every stream in the batch with it."""
    req = pb.GenerateRequest(tokens=pb.TokenIds(ids=[5, 6, 7, 5, 6, 7]))
    req.sampling.CopyFrom(pb.SamplingParams(
        max_new_tokens=4, temperature=temperature, top_p=top_p, repetition_penalty=repetition_penalty, top_k=top_k,
    ))  # fmt: skip
    try:
        responses = list(stub.Generate(req, timeout=DEADLINE_S))
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details(), (e.code(), e.details(), req)
        return
    _check_stream(req, responses)


any_text = st.text(max_size=40)  # lone surrogates (category Cs) included: json.dumps writes "\\ud800"
any_int = st.integers() | st.integers(-(2**80), 2**80) | st.sampled_from([2**31, 2**63, 2**64, -(2**63) - 1, -1])
any_number = any_int | st.floats() | st.sampled_from([10**400, -(10**309), 1e-45])  # NaN and inf as JSON's NaN/Infinity


@st.composite
def http_bodies(draw) -> tuple[str, dict]:
    """A /v1/completions or /v1/chat/completions body, mostly valid, every field wild at times."""
    body: dict = {"max_tokens": draw(mostly(st.integers(1, LIMIT), any_int))}
    chat = draw(st.booleans())
    if chat:
        roles = mostly(st.sampled_from(["system", "user"]), any_text)
        body["messages"] = [{"role": r, "content": c} for r, c in draw(st.lists(st.tuples(roles, any_text), min_size=1, max_size=2))]
        if draw(st.integers(0, 5)) == 0:
            schema = {"enum": draw(st.lists(any_text, min_size=1, max_size=2))}
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}
    else:
        body["prompt"] = draw(mostly(utf8_text.filter(bool), any_text | st.lists(st.integers(3, 399) | any_int, min_size=1, max_size=4)))
    floats = dict(temperature=(0.0, 2.0), top_p=(0.1, 1.0), min_p=(0.0, 0.5), presence_penalty=(-2.0, 2.0),
                  frequency_penalty=(-2.0, 2.0), repetition_penalty=(0.5, 2.0))  # fmt: skip
    for name, (lo, hi) in floats.items():
        if draw(st.booleans()):
            body[name] = draw(mostly(st.floats(lo, hi), any_number))
    ints = dict(top_k=st.integers(-1, 500), seed=st.integers(-(2**63), 2**64 - 1), n=st.integers(1, 3),
                min_tokens=st.integers(0, 2))  # fmt: skip
    for name, valid in ints.items():
        if draw(st.booleans()):
            body[name] = draw(mostly(valid, any_int))
    if draw(st.booleans()):
        body["stop"] = draw(mostly(st.lists(utf8_text.filter(bool), max_size=2), st.lists(any_text, max_size=2)))
    if draw(st.booleans()):
        body["stop_token_ids"] = draw(st.lists(mostly(st.integers(0, 399), any_int), max_size=2))
    if draw(st.booleans()):
        ids = mostly(st.integers(0, 399), st.integers(0, 2**40))
        body["logit_bias"] = {str(k): v for k, v in draw(st.dictionaries(ids, mostly(st.floats(-5, 5), any_number), max_size=2)).items()}
    if draw(st.booleans()):
        body["cache_salt"] = draw(mostly(st.sampled_from(["", "a"]), any_text))
    return ("chat/completions" if chat else "completions"), body


@FUZZ
@given(request=http_bodies())
@example(request=("completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "top_k": 2**63}))
@example(request=("completions", {"prompt": "hi", "max_tokens": 2, "temperature": 1.0, "seed": 2**70}))
@example(request=("completions", {"prompt": "hi", "max_tokens": 2, "cache_salt": "\ud800"}))
@example(request=("completions", {"prompt": "\ud800", "max_tokens": 2}))
@example(request=("completions", {"prompt": "hi", "max_tokens": 2, "temperature": 10**400}))
@example(request=("chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}))
def test_every_http_body_gets_a_reply_or_a_4xx(server, request):
    path, body = request
    data = json.dumps(body).encode()  # NaN and inf as NaN / Infinity, which JSON parsers (and this one) take
    req = urllib.request.Request(f"http://127.0.0.1:{server.running.http_port}/v1/{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as r:
            status, out = r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        status, out = e.code, json.loads(e.read())
    event(str(status))
    if status != 200:
        assert status in (400, 409, 429), (status, out, body)
        assert out["error"]["message"], out
        return
    n = body.get("n", 1)
    assert sorted(c["index"] for c in out["choices"]) == list(range(n)), out
    assert all(c["finish_reason"] in ("stop", "length") for c in out["choices"]), out
    assert 1 <= out["usage"]["completion_tokens"] <= n * min(LIMIT, body["max_tokens"]), out
    if isinstance(body.get("temperature"), float) and not math.isfinite(body["temperature"]):
        raise AssertionError(f"a non-finite temperature was served: {body}")


@FUZZ
@given(
    session_id=st.sampled_from(["fz-1", "fz-2", "missing"]) | utf8_text,
    page_size=st.integers(-(2**31), 2**31 - 1) | st.integers(0, 3),
    page_token=st.sampled_from(["", "fz-1"]) | utf8_text,
    turns=st.integers(0, 3) | st.integers(0, 2**32 - 1),
    new_session_id=st.sampled_from(["fz-1", "fz-fork", ""]) | utf8_text,
)
def test_session_calls_get_an_answer_or_a_precise_status(stub, session_id, page_size, page_token, turns,
                                                         new_session_id):  # fmt: skip
    get = pb.GetSessionRequest(session_id=session_id, include_token_ids=True, include_turns=True)
    fork = pb.ForkSessionRequest(session_id=session_id, new_session_id=new_session_id)
    if turns % 2:
        fork.at_turn = turns
    calls = [
        lambda: stub.GetSession(get, timeout=DEADLINE_S),
        lambda: stub.ListSessions(pb.ListSessionsRequest(page_size=page_size, page_token=page_token), timeout=DEADLINE_S),
        lambda: stub.ForkSession(fork, timeout=DEADLINE_S),
        lambda: stub.RewindSession(pb.RewindSessionRequest(session_id=session_id, turns=turns), timeout=DEADLINE_S),
        lambda: stub.WarmSession(pb.WarmSessionRequest(session_id=session_id), timeout=DEADLINE_S),
    ]
    for call in calls:
        try:
            call()
        except grpc.RpcError as e:
            assert e.code() in PRECISE and e.details(), (e.code(), e.details())


def test_the_server_is_healthy_afterwards(server, stub):
    # runs after the fuzz tests (file order): nothing leaked, nothing stuck
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    good = pb.GenerateRequest(tokens=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(max_new_tokens=3))
    _check_stream(good, list(stub.Generate(good, timeout=DEADLINE_S)))
    engine = server.engine
    assert wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0)
    assert wait_until(lambda: engine.cache_stats().warm.pinned_blocks == 0)  # warm-ups expired (warm_ttl)
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total  # every block free or evictable cache
    assert server.running.admission.inflight == 0
    assert engine.loop_error is None  # no engine step ever failed
