"""Sampling controls and logprobs through a live server: min_p, presence/frequency
penalties, logit_bias, min_new_tokens, logprobs against transformers, and the edge's
INVALID_ARGUMENT messages."""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from tests.fixtures.serving import ServerThread, tiny_config

PROMPT = [5, 17, 42, 9, 100, 23, 7, 5, 17]


@pytest.fixture(scope="module")
def stub(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, max_new_tokens_limit=64)) as s:
        with grpc.insecure_channel(s.address) as ch:
            yield pb_grpc.GenerationServiceStub(ch)


def generate(stub, **sampling):
    req = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), sampling=pb.SamplingParams(**sampling))
    responses = list(stub.Generate(req, timeout=60))
    deltas = [r.delta for r in responses if r.WhichOneof("event") == "delta"]
    return [t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs]


def test_greedy_with_neutral_controls_equals_greedy_without(stub):
    plain, _ = generate(stub, max_new_tokens=12, ignore_eos=True)
    neutral, lps = generate(
        stub, max_new_tokens=12, ignore_eos=True, min_p=0.0, presence_penalty=0.0,
        frequency_penalty=0.0, min_new_tokens=0, logprobs=False, top_logprobs=0,
    )  # fmt: skip
    assert neutral == plain and lps == []


def test_seeded_sampling_with_controls_is_reproducible(stub):
    kw = dict(max_new_tokens=12, ignore_eos=True, temperature=1.0, seed=42, min_p=0.05,
              presence_penalty=0.5, frequency_penalty=0.3, logit_bias={7: 2.0})  # fmt: skip
    a, _ = generate(stub, **kw)
    assert generate(stub, **kw)[0] == a
    assert generate(stub, **{**kw, "seed": 43})[0] != a


def test_logit_bias_forces_and_bans_tokens(stub):
    forced, _ = generate(stub, max_new_tokens=5, ignore_eos=True, logit_bias={77: 100.0})
    assert forced == [77] * 5
    plain, _ = generate(stub, max_new_tokens=5, ignore_eos=True)
    banned, _ = generate(stub, max_new_tokens=5, ignore_eos=True, logit_bias={plain[0]: -100.0})
    assert banned[0] != plain[0]


def test_frequency_penalty_breaks_a_forced_repeat(stub):
    # a bias of 3 makes 77 the greedy pick; a frequency penalty of 2 per use wears it off
    biased, _ = generate(stub, max_new_tokens=6, ignore_eos=True, logit_bias={77: 30.0})
    assert biased == [77] * 6
    worn, _ = generate(stub, max_new_tokens=30, ignore_eos=True, logit_bias={77: 30.0}, frequency_penalty=2.0)
    assert worn.count(77) < 30 and worn[0] == 77


def test_min_new_tokens_holds_back_stop_token_ids(stub):
    plain, _ = generate(stub, max_new_tokens=8, ignore_eos=True)
    stop = plain[0]
    early, _ = generate(stub, max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop])
    assert early == [stop]  # the first token stops it
    held, _ = generate(stub, max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_new_tokens=3)
    assert len(held) >= 3 and stop not in held[:3]


def test_logprobs_match_transformers_log_softmax(stub, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    out, lps = generate(stub, max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=5)
    assert [lp.token_id for lp in lps] == out and len(out) == 8
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = ref(torch.tensor([PROMPT + out])).logits[0, len(PROMPT) - 1 : -1]  # (8, V)
    expect = torch.log_softmax(logits.double(), -1)
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - float(expect[i, lp.token_id])) < 1e-4
        assert lp.logprob == pytest.approx(float(expect[i].max()), abs=1e-4)  # greedy: the top token
        top = expect[i].topk(5)
        assert [t.token_id for t in lp.top] == top.indices.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(lp.top, top.values.tolist())) < 1e-4


def test_logprobs_come_after_penalties_and_before_temperature(stub):
    _, greedy = generate(stub, max_new_tokens=1, logprobs=True, top_logprobs=3)
    _, hot = generate(stub, max_new_tokens=1, logprobs=True, top_logprobs=3, temperature=5.0, seed=1)
    assert [(t.token_id, round(t.logprob, 5)) for t in hot[0].top] == [(t.token_id, round(t.logprob, 5)) for t in greedy[0].top]
    _, biased = generate(stub, max_new_tokens=1, logprobs=True, top_logprobs=1, logit_bias={77: 100.0})
    assert biased[0].token_id == 77 and biased[0].logprob > -1e-3


@pytest.mark.parametrize(
    "sampling, message",
    [
        (dict(min_p=math.nan), "min_p must be in [0, 1], got nan"),
        (dict(min_p=2.0), "min_p must be in [0, 1], got 2.0"),
        (dict(presence_penalty=math.inf), "presence_penalty must be in [-2, 2], got inf"),
        (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0"),
        (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias has 301 entries; the limit is 300"),
        (dict(logit_bias={5: math.nan}), "logit_bias[5] must be in [-100, 100], got nan"),
        (dict(logit_bias={5: 101.0}), "logit_bias[5] must be in [-100, 100], got 101.0"),
        (dict(logit_bias={4000: 1.0}), "logit_bias token id 4000 is outside the vocabulary"),
        (dict(max_new_tokens=4, min_new_tokens=5), "min_new_tokens 5 exceeds max_new_tokens 4"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs must be in [0, 20], got 21"),
        (dict(top_logprobs=3), "sampling.top_logprobs needs sampling.logprobs = true"),
    ],
)
def test_bad_controls_get_invalid_argument(stub, sampling, message):
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()


def test_python_clients_pass_the_controls_and_return_logprobs(tiny_llama_dir):
    import asyncio

    from kvserve.clients import AsyncKVServeClient, KVServeClient

    kw = dict(token_ids=PROMPT, max_new_tokens=6, ignore_eos=True, temperature=0.9, seed=3, min_p=0.02,
              presence_penalty=0.4, frequency_penalty=0.2, logit_bias={77: 1.5}, min_new_tokens=2,
              logprobs=True, top_logprobs=2)  # fmt: skip
    with ServerThread(tiny_config(tiny_llama_dir)) as s:
        with KVServeClient(s.address, timeout=60) as c:
            done = c.complete(**kw)

        async def run():
            async with AsyncKVServeClient(s.address) as ac:
                return await ac.complete(**kw)

        adone = asyncio.run(run())
    assert done.token_ids == adone.token_ids and len(done.token_ids) == 6
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in done.logprobs)
    # the second call reads the first's cached prompt blocks: equal up to float rounding
    assert [lp.logprob for lp in adone.logprobs] == pytest.approx([lp.logprob for lp in done.logprobs], abs=1e-4)
