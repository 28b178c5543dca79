"""n > 1 and structured output through a live server: the n sequences stream
interleaved with their index and share the prompt (prefilled once), greedy n = 2 equals
n = 1, seeds are per index, a cancel mid-stream leaves no block held; a JSON schema or a
regex constrains sampled output so that it always parses; bad fields get a precise
INVALID_ARGUMENT; the Python clients expose both."""

from __future__ import annotations

import asyncio
import json
import math
import re

import grpc
import jsonschema
import pytest

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from tests.fixtures.serving import ServerThread, tiny_config, wait_until

PROMPT = [5, 17, 42, 9, 100, 23, 7, 5, 17, 3, 88]  # 11 tokens: a partial last block of 8
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": -5, "maximum": 500},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, max_new_tokens_limit=96, max_num_seqs=16, kv_cache_memory=1 << 19)) as s:
        yield s


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


def call(stub, **sampling):
    req = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(**sampling))
    return list(stub.Generate(req, timeout=60))


def by_index(responses) -> tuple[dict[int, list[int]], dict[int, str], dict[int, pb.FinalEvent]]:
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finals = {}
    for r in responses:
        if r.WhichOneof("event") == "delta":
            tokens.setdefault(r.delta.index, []).extend(r.delta.token_ids)
            text[r.delta.index] = text.get(r.delta.index, "") + r.delta.text
        elif r.WhichOneof("event") == "final":
            finals[r.final.index] = r.final
    return tokens, text, finals


def test_greedy_n2_gives_two_copies_of_n1_interleaved_with_indexes(server, stub):
    # as many tokens as the module's server allows: 10 took about a millisecond on a fast
    # host, inside one 20 ms stream interval, so each choice came as one message
    count = 96
    one = by_index(call(stub, max_new_tokens=count, ignore_eos=True))[0][0]
    before = server.engine.stats().prefill_tokens
    responses = call(stub, max_new_tokens=count, ignore_eos=True, n=2)
    tokens, _, finals = by_index(responses)
    assert tokens == {0: one, 1: one}
    assert sorted(finals) == [0, 1] and all(f.usage.completion_tokens == count for f in finals.values())
    kinds = [r.WhichOneof("event") for r in responses]
    assert kinds[0] == "start" and kinds.count("start") == 1 and kinds.count("final") == 2
    indexes = [r.delta.index for r in responses if r.WhichOneof("event") == "delta"]
    assert indexes.index(1) < len(indexes) - 1 - indexes[::-1].index(0)  # interleaved, not one after the other
    # the prompt's full block was a device hit and the partial one was computed once for both
    assert server.engine.stats().prefill_tokens - before == len(PROMPT) - 8


def test_seeded_sampling_is_reproducible_per_index(stub):
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=99, n=3)
    a, _, _ = by_index(call(stub, **kw))
    b, _, _ = by_index(call(stub, **kw))
    assert a == b and len(a) == 3 and len({tuple(v) for v in a.values()}) > 1
    alone, _, _ = by_index(call(stub, max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=101))
    assert a[2] == alone[0]  # index i samples with seed + i


def test_cancel_mid_stream_with_n_leaks_no_block(server, stub):
    req = pb.GenerateRequest(
        tokens=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(max_new_tokens=90, ignore_eos=True, n=4)
    )
    it = stub.Generate(req, timeout=60)
    seen = set()
    for r in it:
        if r.WhichOneof("event") == "delta":
            seen.add(r.delta.index)
        if len(seen) == 4:
            break
    it.cancel()
    engine = server.engine
    assert wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0)
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total


def test_sampled_json_schema_output_always_parses_and_validates(stub):
    fmt = pb.ResponseFormat(json_schema=json.dumps(SCHEMA))
    _, text, finals = by_index(call(stub, max_new_tokens=96, temperature=1.0, seed=5, n=6, response_format=fmt))
    assert len(finals) == 6
    for i, f in finals.items():
        assert f.finish_reason == pb.FINISH_REASON_STOP, text[i]
        jsonschema.validate(json.loads(text[i]), SCHEMA)


def test_regex_output_matches(stub):
    fmt = pb.ResponseFormat(regex=r"(cat|dog)-[0-9]{2,4}")
    _, text, finals = by_index(call(stub, max_new_tokens=40, temperature=1.0, seed=8, n=4, response_format=fmt))
    for i, f in finals.items():
        assert f.finish_reason == pb.FINISH_REASON_STOP and re.fullmatch(r"(cat|dog)-[0-9]{2,4}", text[i]), text[i]


@pytest.mark.parametrize(
    "sampling, message",
    [
        (dict(n=17), "n must be in [1, 16], got 17"),
        (dict(n=16, max_new_tokens=96), "n = 16 sequences of prompt + max_new_tokens need 209 KV blocks at once"),
        (dict(response_format=pb.ResponseFormat()), "response_format is set but empty"),
        (dict(response_format=pb.ResponseFormat(json_schema="{")), "response_format json_schema is not valid JSON"),
        (dict(response_format=pb.ResponseFormat(json_schema='{"type": "nope"}')), "json_schema cannot be used"),
        (dict(response_format=pb.ResponseFormat(regex="[a-")), "response_format regex cannot be used"),
        (dict(response_format=pb.ResponseFormat(regex="x" * 40000)), "the limit is 32768"),
        (dict(response_format=pb.ResponseFormat(json_schema="[" * 5000 + "]" * 5000)), "nested too deeply to parse"),
        (dict(response_format=pb.ResponseFormat(json_schema='{"items":' * 1000 + "{}" + "}" * 1000)), "too deeply"),
        (dict(response_format=pb.ResponseFormat(regex="[^\\x00-\\U0010FFFF]")), "regex matches no output"),
        (dict(response_format=pb.ResponseFormat(regex="x"), stop=["a"]), "stop strings cannot be combined"),
        (dict(response_format=pb.ResponseFormat(regex="x"), min_new_tokens=2), "min_new_tokens cannot be combined"),
    ],
)
def test_bad_fields_get_invalid_argument(stub, sampling, message):
    with pytest.raises(grpc.RpcError) as e:
        call(stub, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_a_grammar_llguidance_gives_up_on_mid_output_is_invalid_argument_not_a_stop(server, stub):
    """a{1000000} compiles, but llguidance's lexer gives up at the first 'a': the stream
    must end with a precise INVALID_ARGUMENT (never a ``stop`` on output that does not
    match), every sequence's blocks come back and the server keeps serving."""
    fmt = pb.ResponseFormat(regex="a{1000000}")
    with pytest.raises(grpc.RpcError) as e:
        call(stub, max_new_tokens=20, n=2, response_format=fmt)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "response_format regex could not be followed after 0 output tokens" in e.value.details()
    assert "too many expressions" in e.value.details() and "request id" in e.value.details()
    engine = server.engine
    assert wait_until(lambda: engine.stats().running == 0 and engine.stats().waiting == 0)
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total
    _, text, finals = by_index(call(stub, max_new_tokens=8, response_format=pb.ResponseFormat(regex="a{3}")))
    assert finals[0].finish_reason == pb.FINISH_REASON_STOP and text[0] == "aaa"


def test_top_logprobs_under_a_grammar_list_only_tokens_it_allows(stub):
    """The first token of a JSON object can only be '{': its alternatives are not the
    masked tokens at -inf but none (top holds fewer than top_logprobs entries)."""
    fmt = pb.ResponseFormat(json_object=pb.ResponseFormat.JsonObject())
    responses = call(stub, max_new_tokens=6, logprobs=True, top_logprobs=5, response_format=fmt)
    lps = [lp for r in responses if r.WhichOneof("event") == "delta" for lp in r.delta.logprobs]
    assert lps and all(math.isfinite(a.logprob) for lp in lps for a in lp.top)
    assert len(lps[0].top) == 1 and lps[0].top[0].token_id == lps[0].token_id and lps[0].logprob == 0.0


def test_n_with_a_session_is_refused(stub):
    req = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), session_id="s-n", sampling=pb.SamplingParams(n=2))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n = 2 cannot be used with a session_id" in e.value.details()


def test_python_clients_expose_n_and_the_response_format(server):
    from kvserve.clients import AsyncKVServeClient, KVServeClient

    kw = dict(token_ids=PROMPT, max_new_tokens=60, temperature=0.8, seed=4, n=3, json_schema=SCHEMA)
    with KVServeClient(server.address, timeout=60) as c:
        done = c.complete(**kw)
        rx = c.complete(token_ids=PROMPT, max_new_tokens=20, regex=r"[0-9]{3}")
        with pytest.raises(ValueError, match="at most one of json_schema, json_object, regex"):
            c.complete(token_ids=PROMPT, regex="x", json_object=True)

    async def run():
        async with AsyncKVServeClient(server.address) as ac:
            return await ac.complete(**kw)

    adone = asyncio.run(run())
    assert [ch.index for ch in done.choices] == [0, 1, 2]
    assert [ch.token_ids for ch in done.choices] == [ch.token_ids for ch in adone.choices]
    assert done.text == done.choices[0].text and done.end.index == 0
    for ch in done.choices:
        assert ch.end.finish_reason == "stop" and set(json.loads(ch.text)) == {"name", "ok", "n"}
    assert re.fullmatch(r"[0-9]{3}", rx.text)
