"""Every request value that reaches a tensor, the seeded generator, a tokenizer or a hash
is checked at the edge (service/validation.py), over real HTTP and gRPC servers on
loopback: an out-of-range ``top_k`` or ``seed`` and a lone surrogate in any text get 400 /
INVALID_ARGUMENT naming the field, and streams in flight beside them finish normally (an
unchecked ``top_k`` >= 2**63 used to fail the engine step, every stream in it INTERNAL)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from kvserve.service.types import GenerationRequest, InvalidRequest, SamplingParams
from tests.fixtures.serving import ServerThread, held_running, tiny_config, wait_until

VICTIM_TOKENS = 400  # streams held running while the bad requests come and go
SURROGATE = "\ud800"  # json.dumps writes it as the escape "\ud800", as a client's JSON would


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, max_new_tokens_limit=VICTIM_TOKENS), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def post(server: ServerThread, path: str, body: dict[str, Any] | bytes,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:  # fmt: skip
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.running.http_port}/v1/{path}", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refused(server: ServerThread, path: str, body: dict[str, Any] | bytes, **kw: Any) -> str:
    """The 400's message (never a 500)."""
    status, out = post(server, path, body, **kw)
    assert status == 400, (status, out)
    assert out["error"]["type"] == "invalid_request_error", out
    return out["error"]["message"]


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "the fox", "max_tokens": 3, "temperature": 1.0, **fields}


def chat(content: str = "hello", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 3, **fields}


def raw_generate(server: ServerThread, data: bytes) -> grpc.RpcError:
    """A GenerateRequest sent as the bytes given (a string field gRPC's own client would
    never encode); the error it ends with."""
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_stream("/kvserve.v1.GenerationService/Generate", request_serializer=None,
                               response_deserializer=pb.GenerateResponse.FromString)  # fmt: skip
        with pytest.raises(grpc.RpcError) as e:
            list(call(data, timeout=60))
    return e.value


def with_surrogate_bytes(req: pb.GenerateRequest, placeholder: str) -> bytes:
    """``req`` serialized, its ``placeholder`` (3 ASCII letters) replaced by U+D800 in the
    CESU form ED A0 80: the same length, so the message still parses as far as that string."""
    data = req.SerializeToString()
    assert data.count(placeholder.encode()) == 1 and len(placeholder) == 3
    return data.replace(placeholder.encode(), b"\xed\xa0\x80")


# ----------------------------------------------------------------------------- ranges


def test_top_k_at_and_past_the_limit(server):
    assert refused(server, "completions", completion(top_k=2**63)) == (
        "top_k must be in [0, 2147483647] (0 = off; at or above the vocabulary size it keeps every token), "
        "got 9223372036854775808"
    )
    assert "got 2147483648" in refused(server, "completions", completion(top_k=2**31))
    assert refused(server, "completions", completion(top_k=10**30)).endswith("got 10000000000000000000... (31 digits)")
    # the largest top_k keeps every token: the same draw as no top_k at all
    status, big = post(server, "completions", completion(top_k=2**31 - 1, seed=11, max_tokens=8))
    status_off, off = post(server, "completions", completion(top_k=-1, seed=11, max_tokens=8))
    assert status == status_off == 200, (big, off)
    assert big["choices"][0]["text"] == off["choices"][0]["text"]


def test_top_k_on_grpc_keeps_every_token_at_the_int32_limit(stub):
    def tokens(top_k: int) -> list[int]:
        req = pb.GenerateRequest(tokens=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(
            max_new_tokens=8, temperature=1.0, top_k=top_k, seed=3, ignore_eos=True))  # fmt: skip
        return [t for r in stub.Generate(req, timeout=60) if r.WhichOneof("event") == "delta" for t in r.delta.token_ids]

    assert tokens(2**31 - 1) == tokens(0)
    assert len(tokens(2**31 - 1)) == 8


def test_seed_outside_64_bits_is_refused_and_its_edges_are_served(server, stub):
    msg = "seed must be a 64-bit integer, signed or unsigned: in [-2**63, 2**64), got "
    assert refused(server, "completions", completion(seed=2**70)) == msg + "1180591620717411303424"
    assert refused(server, "completions", completion(seed=-(2**63) - 1)) == msg + "-9223372036854775809"
    assert refused(server, "chat/completions", chat(seed=2**64)) == msg + "18446744073709551616"
    assert refused(server, "completions", completion(seed=10**100)) == msg + "10000000000000000000... (101 digits)"
    # greedy too: a value out of range is refused whether or not it is used
    assert refused(server, "completions", completion(seed=2**64, temperature=0)) == msg + "18446744073709551616"
    for seed in (2**64 - 1, 2**63, -(2**63), -1):
        status, out = post(server, "completions", completion(seed=seed, n=3))  # seed + i wraps past 2**64 - 1
        assert status == 200 and len(out["choices"]) == 3, (seed, out)
    # a negative seed is torch's: -5 seeds as 2**64 - 5 (the one generator state for both spellings)
    same = [post(server, "completions", completion(seed=s, max_tokens=8))[1]["choices"][0]["text"] for s in (-5, 2**64 - 5)]
    assert same[0] == same[1]
    # gRPC's seed is a uint64: every value it can carry is served, n > 1 wrapping past the top
    req = pb.GenerateRequest(text="the fox", sampling=pb.SamplingParams(
        max_new_tokens=3, temperature=1.0, seed=2**64 - 1, n=3))  # fmt: skip
    finals = [r.final for r in stub.Generate(req, timeout=60) if r.WhichOneof("event") == "final"]
    assert sorted(f.index for f in finals) == [0, 1, 2]


def test_integers_past_a_float_are_refused_not_overflowed(server):
    assert refused(server, "completions", completion(temperature=10**400)).startswith("temperature must be a number")
    assert refused(server, "completions", completion(top_p=-(10**309))).startswith("top_p must be a number")
    assert refused(server, "completions", completion(logit_bias={"5": 10**400})).startswith("logit_bias[5] must be a number")
    # stop_token_ids, prompt ids, max_tokens, min_tokens and n of any size: their own range checks
    assert refused(server, "completions", completion(stop_token_ids=[2**64])).startswith(
        "stop_token_ids[0] = 18446744073709551616 is outside the vocabulary")  # the HTTP field names
    assert refused(server, "completions", completion(prompt=[5, 2**70])).startswith("prompt[1] = 1180591620717411303424")
    assert refused(server, "completions", completion(max_tokens=2**70)).startswith("max_tokens 1180591620717411303424")
    assert refused(server, "completions", completion(n=2**70)) == "n must be in [1, 16], got 1180591620717411303424"


def test_the_engine_guards_its_own_input_with_the_same_checks(server):
    """LLMEngine.validate (the engine's guard, whoever calls it) refuses what the front does."""
    engine = server.engine
    for sampling, start in [
        (SamplingParams(temperature=1.0, top_k=2**63), "top_k must be in [0, 2147483647]"),
        (SamplingParams(temperature=1.0, seed=2**64), "seed must be a 64-bit integer"),
        (SamplingParams(stop=(SURROGATE,)), "sampling.stop[0]: character 0 is a lone surrogate (U+D800)"),
    ]:
        with pytest.raises(InvalidRequest) as e:
            engine.validate(GenerationRequest("r", [5, 6, 7], sampling))
        assert str(e.value).startswith(start), str(e.value)


# ----------------------------------------------------------------------------- text


def lone(what: str, at: int = 0) -> str:
    return f"{what}: character {at} is a lone surrogate (U+D800), not valid Unicode text (UTF-8 cannot encode it)"


def test_a_lone_surrogate_anywhere_in_a_request_is_400(server):
    assert refused(server, "completions", completion(cache_salt="ab" + SURROGATE)) == lone("cache_salt", 2)
    assert refused(server, "completions", completion(prompt="the " + SURROGATE)) == lone("prompt", 4)
    assert refused(server, "completions", completion(prompt=["x" + SURROGATE])) == lone("prompt", 1)
    assert refused(server, "completions", completion(stop=["ok", SURROGATE])) == lone("stop[1]")
    assert refused(server, "chat/completions", chat(SURROGATE)) == lone("messages[0].content")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": SURROGATE}]
    assert refused(server, "chat/completions", chat(parts)) == lone("messages[0].content", 1)
    body = chat()
    body["messages"].insert(0, {"role": "system" + SURROGATE, "content": "x"})
    assert refused(server, "chat/completions", body) == lone("messages[0].role", 6)
    schema = {"type": "object", "properties": {SURROGATE: {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert refused(server, "chat/completions", chat(response_format=fmt)) == lone(
        "response_format json_schema (a string in its JSON)")
    fmt["json_schema"]["schema"] = {"enum": ["ok\udfff"]}
    assert refused(server, "chat/completions", chat(response_format=fmt)) == lone(
        "response_format json_schema (a string in its JSON)", 2).replace("U+D800", "U+DFFF")
    # a surrogate pair is one character, not a lone surrogate: served
    fmt["json_schema"]["schema"] = {"enum": ["\ud83d\ude00"]}
    status, out = post(server, "chat/completions", chat("\U0001f600 \ud83d\ude00", cache_salt="\U0001f600",
                                                        response_format=fmt))  # fmt: skip
    assert status == 200, out


def test_a_refused_surrogate_leaves_the_session_as_it_was(server, stub):
    """A history that diverges from an X-Session-Id session would rewind it: the
    surrogate is refused before the session is touched."""
    sid = {"X-Session-Id": "ranges-1"}
    status, first = post(server, "chat/completions", chat("hello there", temperature=0), headers=sid)
    assert status == 200, first
    before = stub.GetSession(pb.GetSessionRequest(session_id="ranges-1", include_token_ids=True), timeout=30).session
    assert before.turns == 1
    status, out = post(server, "chat/completions", chat(SURROGATE + " diverged at the first message"), headers=sid)
    after = stub.GetSession(pb.GetSessionRequest(session_id="ranges-1", include_token_ids=True), timeout=30).session
    assert (after.turns, list(after.token_ids)) == (before.turns, list(before.token_ids))
    assert (status, out["error"]["message"]) == (400, lone("messages[0].content"))


def test_grpc_strings_that_are_not_utf8_are_invalid_argument(server):
    """gRPC's strings are UTF-8 by the wire format: a surrogate's bytes in one are refused
    when the message is parsed, in any string field."""
    cases = [
        pb.GenerateRequest(text="hi", cache_salt="SLT"),
        pb.GenerateRequest(text="a SLT b"),
        pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="SLT")])),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["SLT"])),
    ]
    for req in cases:
        err = raw_generate(server, with_surrogate_bytes(req, "SLT"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert err.details().startswith("the request is not a valid kvserve.v1.GenerateRequest message"), err.details()


# ----------------------------------------------------------------------------- isolation


class GrpcVictim(threading.Thread):
    """A long greedy stream over gRPC, read as it goes."""

    def __init__(self, stub: Any) -> None:
        super().__init__(daemon=True)
        self.stub = stub
        self.started = threading.Event()
        self.tokens: list[int] = []
        self.final: pb.FinalEvent | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        req = pb.GenerateRequest(text="a long story", sampling=pb.SamplingParams(
            max_new_tokens=VICTIM_TOKENS, ignore_eos=True, temperature=0.8, seed=1))  # fmt: skip
        try:
            for r in self.stub.Generate(req, timeout=120):
                kind = r.WhichOneof("event")
                if kind == "delta":
                    self.tokens.extend(r.delta.token_ids)
                    self.started.set()
                elif kind == "final":
                    self.final = r.final
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e
        self.started.set()


class HttpVictim(threading.Thread):
    """A long stream over HTTP (SSE), read as it goes."""

    def __init__(self, server: ServerThread) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.started = threading.Event()
        self.text = ""
        self.chunks = 0
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "once upon a time", "max_tokens": VICTIM_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{self.server.running.http_port}/v1/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                for line in r:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    for choice in chunk["choices"]:
                        self.text += choice["text"]
                        self.finish = choice["finish_reason"] or self.finish
                    self.usage = chunk.get("usage") or self.usage
                    self.chunks += 1
                    self.started.set()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            self.error = e
        self.started.set()


def test_bad_requests_beside_streams_in_flight_fail_alone(server, stub):
    """Two long streams (one per front) in flight; every bad request of this file comes and
    goes (400 / INVALID_ARGUMENT) while they run; both then finish with all their tokens
    and no engine step ever failed. The streams are held running (the engine's loop held
    after their first step) while the bad requests come: a fast host could otherwise finish
    them first, and a bad request that reached the engine would wait in its queue and go
    into a step beside them once the hold ends."""
    engine = server.engine
    victims = [GrpcVictim(stub), HttpVictim(server)]
    _, running = held_running(server, lambda: [v.start() for v in victims], n=2)  # both start in one step
    try:
        # both running on the engine, neither a token past its first step (their first
        # tokens may reach the clients only once the hold ends: the step's output goes out
        # with the next, so waiting for them here would wait out the hold)
        assert running.held.wait(60)
        assert not any(v.error for v in victims), [v.error for v in victims]
        refused(server, "completions", completion(top_k=2**63))  # the request that used to kill the step
        refused(server, "completions", completion(top_k=2**63, stream=True))
        refused(server, "chat/completions", chat(top_k=2**63, temperature=1.0, n=2))
        refused(server, "completions", completion(seed=2**70))
        refused(server, "completions", completion(seed=-(2**64)))
        refused(server, "completions", completion(cache_salt=SURROGATE))
        refused(server, "completions", completion(prompt=SURROGATE))
        refused(server, "chat/completions", chat(SURROGATE))
        refused(server, "completions", completion(temperature=10**400))
        err = raw_generate(server, with_surrogate_bytes(pb.GenerateRequest(text="hi", cache_salt="SLT"), "SLT"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats = engine.stats()
        assert (stats.running, stats.waiting) == (2, 0)  # the victims still running; no bad request queued
        assert victims[0].final is None and victims[1].finish is None
    finally:
        running.release()
    for v in victims:
        v.join(120)
        assert not v.is_alive() and v.error is None, v.error
    grpc_victim, http_victim = victims
    assert grpc_victim.final is not None and grpc_victim.final.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(grpc_victim.tokens) == grpc_victim.final.usage.completion_tokens == VICTIM_TOKENS
    assert http_victim.finish == "length" and http_victim.usage["completion_tokens"] == VICTIM_TOKENS
    assert engine.loop_error is None  # no engine step failed
    assert wait_until(lambda: engine.stats().running == 0)


def test_grpc_chat_past_the_message_limit_is_refused_before_it_is_read(server, stub):
    """--max-chat-messages holds on gRPC too (the HTTP front stops its parse there): a
    longer list is INVALID_ARGUMENT naming the limit, checked before any message is."""
    many = [pb.ChatMessage(role="user", content="") for _ in range(2049)]
    many[-1] = pb.ChatMessage(role="nobody", content=SURROGATE.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))
    req = pb.GenerateRequest(chat=pb.ChatMessages(messages=many), sampling=pb.SamplingParams(max_new_tokens=1))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(req, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "messages: 2049 messages, more than the 2048 one request may hold (--max-chat-messages)"
    ok = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")] * 3),
                            sampling=pb.SamplingParams(max_new_tokens=1))  # fmt: skip
    assert any(r.WhichOneof("event") == "final" for r in stub.Generate(ok, timeout=60))
