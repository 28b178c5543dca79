"""Speculative decoding on the wire, through a live server: the per-request switch
(SamplingParams.speculative / speculative_max_draft on gRPC and the Python client; the
HTTP fronts' ``speculative`` and llama.cpp's ``speculative.n_max``), the drafts in the
final event's Timings and in llama.cpp's ``timings`` object beside an untouched OpenAI
``usage`` (chat and completions, streamed or not, and /v1/responses), the bad values'
400 / INVALID_ARGUMENT, and the tokens-per-step histogram on the metrics page."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from kvserve.clients import KVServeClient
from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from kvserve.service.metrics import EngineStatsCollector
from tests.fixtures.engine import prompts
from tests.fixtures.serving import ServerThread, tiny_config

USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, max_new_tokens_limit=64), http_port=0) as s:
        yield s


@pytest.fixture(scope="module")
def prompt(server) -> list[int]:
    """A random phrase said three times then started again: its continuation is in it."""
    (a,) = prompts(server.engine.model_info.vocab_size, [6], seed=7)
    return a * 3 + a[:2]


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)  # the served model's id


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.GenerationServiceStub(ch)


@pytest.fixture(scope="module")
def oai(server):
    url = f"http://127.0.0.1:{server.running.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def final(stub, prompt, **sampling) -> tuple[list[int], pb.FinalEvent]:
    req = pb.GenerateRequest(tokens=pb.TokenIds(ids=prompt),
                             sampling=pb.SamplingParams(max_new_tokens=40, ignore_eos=True, **sampling))  # fmt: skip
    events = list(stub.Generate(req, timeout=60))
    toks = [t for r in events if r.WhichOneof("event") == "delta" for t in r.delta.token_ids]
    return toks, events[-1].final


def test_grpc_timings_carry_the_drafts_and_the_switch_turns_them_off(stub, prompt):
    toks, f = final(stub, prompt)  # the server's default: --speculative ngram
    t = f.timings
    assert 0 < t.accepted_draft_tokens <= t.draft_tokens
    assert t.acceptance_rate == pytest.approx(t.accepted_draft_tokens / t.draft_tokens)
    assert t.tokens_per_step == pytest.approx(40 / (40 - t.accepted_draft_tokens))
    off_toks, off = final(stub, prompt, speculative=False)
    assert off_toks == toks  # greedy: the same tokens either way
    assert (off.timings.draft_tokens, off.timings.acceptance_rate, off.timings.tokens_per_step) == (0, 0.0, 1.0)
    capped_toks, capped = final(stub, prompt, speculative_max_draft=1)
    assert capped_toks == toks and capped.timings.tokens_per_step <= 2.0 and capped.timings.draft_tokens > 0


def test_grpc_refuses_a_draft_cap_out_of_range(stub, prompt):
    for bad in (0, 33):
        with pytest.raises(grpc.RpcError) as e:
            final(stub, prompt, speculative_max_draft=bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "speculative_max_draft must be in [1, 32]" in e.value.details()


def test_python_client_switch_and_timings(server, prompt):
    with KVServeClient(server.address, timeout=60) as c:
        on = c.complete(token_ids=prompt, max_new_tokens=40, ignore_eos=True, speculative=True)
        off = c.complete(token_ids=prompt, max_new_tokens=40, ignore_eos=True, speculative=False)
    assert on.token_ids == off.token_ids
    assert on.end.timings.accepted_draft_tokens > 0 and on.end.timings.tokens_per_step > 1.0
    assert on.end.timings.acceptance_rate == pytest.approx(
        on.end.timings.accepted_draft_tokens / on.end.timings.draft_tokens)
    assert off.end.timings.draft_tokens == 0 and off.end.timings.tokens_per_step == 1.0


def test_http_completions_timings_beside_an_untouched_usage(oai, model, prompt):
    on = oai.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    off = oai.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                 extra_body={"ignore_eos": True, "speculative": False})  # fmt: skip
    assert on.choices[0].text == off.choices[0].text
    assert set(on.usage.model_dump(exclude_none=True)) == USAGE_KEYS
    t, t_off = on.model_extra["timings"], off.model_extra["timings"]
    assert 0 < t["draft_n_accepted"] <= t["draft_n"] and t["predicted_n"] == 40 == on.usage.completion_tokens
    assert t["prompt_n"] + t["cache_n"] == on.usage.prompt_tokens
    assert t["tokens_per_step"] > 1.0 and t["predicted_ms"] > 0
    assert (t_off["draft_n"], t_off["draft_n_accepted"], t_off["tokens_per_step"]) == (0, 0, 1.0)
    # llama.cpp's name: n_max 0 is off, n_max 1 caps the drafts at one a step
    zero = oai.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"ignore_eos": True, "speculative.n_max": 0})  # fmt: skip
    one = oai.completions.create(model=model, prompt=prompt, max_tokens=40, temperature=0,
                                 extra_body={"ignore_eos": True, "speculative.n_max": 1})  # fmt: skip
    assert zero.model_extra["timings"]["draft_n"] == 0
    assert 0 < one.model_extra["timings"]["draft_n"] and one.model_extra["timings"]["tokens_per_step"] <= 2.0
    assert zero.choices[0].text == one.choices[0].text == on.choices[0].text


def test_http_chat_stream_ends_each_choice_with_its_timings(oai, model):
    text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat"
    chunks = list(oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))  # fmt: skip
    ends = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1
    t = ends[0].model_extra["timings"]
    assert t["predicted_n"] == 24 and t["draft_n"] >= t["draft_n_accepted"] >= 0
    assert all("timings" not in (c.model_extra or {}) for c in chunks if c is not ends[0])
    assert set(chunks[-1].usage.model_dump(exclude_none=True)) == USAGE_KEYS  # the usage chunk: OpenAI's alone
    whole = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    w = whole.model_extra["timings"]
    assert w["predicted_n"] == 24 and w["draft_n"] >= w["draft_n_accepted"] >= 0
    # the same greedy text streamed or not (how many drafts a step takes follows the measured
    # cost of a row, so the draft counts of two runs may differ; the tokens may not)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed


def test_http_responses_object_has_timings(oai, model):
    r = oai.responses.create(model=model, input="the cat sat on the mat. the cat sat on the mat. the cat",
                             max_output_tokens=16, temperature=0, extra_body={"speculative": True})  # fmt: skip
    t = r.model_extra["timings"]
    assert t["predicted_n"] == r.usage.output_tokens and t["draft_n"] >= t["draft_n_accepted"] >= 0


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.running.http_port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("extra, param, says", [
    ({"speculative": "yes"}, "speculative", "speculative must be a boolean"),
    ({"speculative.n_max": -1}, "speculative.n_max", "speculative.n_max must be >= 0"),
    ({"speculative.n_max": 2, "speculative": False}, "speculative.n_max", "agree with speculative"),
    ({"speculative.n_max": 0, "speculative": True}, "speculative.n_max", "agree with speculative"),
    ({"speculative.n_max": 40}, "speculative.n_max", "speculative.n_max must be in [1, 32], got 40"),
    ({"speculative.n_max": 1.5}, "speculative.n_max", "must be an integer"),
    ({"speculative.n_min": 2}, "speculative.n_min", "unknown or unsupported parameter"),
])  # fmt: skip
def test_http_refuses_bad_switches(server, extra, param, says):
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 4})):  # fmt: skip
        status, body = _post(server, path, {**body, **extra})
        assert status == 400, (path, body)
        assert body["error"]["param"] == param and says in body["error"]["message"], (path, body)


def test_tokens_per_step_histogram_counts_every_output_token(server, stub, prompt):
    final(stub, prompt)
    fams = {m.name: m for m in EngineStatsCollector(server.engine.stats).collect()}
    h = fams["kvserve_spec_tokens_per_step"]
    samples = {(s.name, s.labels.get("le")): s.value for s in h.samples}
    count, total = samples[("kvserve_spec_tokens_per_step_count", None)], samples[("kvserve_spec_tokens_per_step_sum", None)]
    assert 0 < samples[("kvserve_spec_tokens_per_step_bucket", "1.0")] < count  # plain steps and verifications
    assert total > count  # more tokens than steps: drafts were accepted
    # every generated token of the server's life is in the sum (the gRPC and HTTP calls above)
    assert total >= 40
