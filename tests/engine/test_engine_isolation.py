"""One request's failure in sampling fails that request alone (issue 26): the step's other
sequences finish with exactly the tokens they get when run without it.

The fault is injected where it would happen: the output room's sampler (passed to the
engine's constructor, ``LLMEngine(sampler=...)``) raises whenever it is asked to sample
one particular request's row, from that request's fourth token on, as a broken logits
processor or an overflowing parameter would. The batched call raises (it holds that
row), so the engine must find the row and keep every other one."""

from __future__ import annotations

import re

import pytest

from kvserve.service.engine.sampling import sample
from kvserve.service.models.loading import load_model
from kvserve.service.types import Delta, Finished, FinishReason, InvalidRequest, ResponseFormat
from tests.fixtures.engine import finished, make_engine, prompts, req, run

POISON_AFTER = 3  # output tokens the failing request gets before its sampling raises


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def _batch(loaded):
    """8 requests decoding together: greedy and seeded sampled ones, penalties on some
    (the path that changes logits in place), a grammar-constrained one, different
    lengths; "bad" is the 4th."""
    ps = prompts(loaded.config.vocab_size, [5, 9, 13, 7, 11, 6, 15, 8], seed=3)
    kinds = [
        dict(),
        dict(temperature=0.9, seed=11),
        dict(repetition_penalty=1.3),
        dict(temperature=0.7, top_k=20, seed=5),  # the one that fails
        dict(temperature=1.1, top_p=0.9, seed=7, presence_penalty=0.5),
        dict(logprobs=2),
        dict(temperature=0.8, min_p=0.05, seed=9, frequency_penalty=0.3),
        dict(temperature=0.9, seed=3, response_format=ResponseFormat("regex", r"[a-z]{10,14}-[0-9]{3}")),
    ]
    return [req("bad" if i == 3 else f"r{i}", p, n=12, **k) for i, (p, k) in enumerate(zip(ps, kinds))]


class FaultySampler:
    """``sampling.sample``, except that it raises ``exc`` for any batch holding ``victim``'s
    row once that row has ``POISON_AFTER`` outputs. Counts the batched calls it failed."""

    def __init__(self, victim, exc: Exception) -> None:
        self.victim, self.exc = victim, exc
        self.failed_batches = 0

    def __call__(self, logits, params, generators, states, masks=None):
        for p, st in zip(params, states):
            if p is self.victim and st.num_output >= POISON_AFTER:
                if len(params) > 1:
                    self.failed_batches += 1
                raise self.exc
        return sample(logits, params, generators, states, masks)


def _cold(loaded, reqs):
    """Each request alone on a fresh engine: the reference outputs."""
    return {r.request_id: finished(run(make_engine(loaded), [r])[r.request_id]) for r in reqs}


def test_a_failure_in_one_rows_sampling_fails_that_request_alone(loaded):
    reqs = _batch(loaded)
    bad = next(r for r in reqs if r.request_id == "bad")
    sampler = FaultySampler(bad.sampling, RuntimeError("a logits processor broke"))
    eng = make_engine(loaded, engine_kw=dict(sampler=sampler))
    batch_sizes = []
    events = run(eng, reqs, on_step=lambda i, e: batch_sizes.append(len(eng.scheduler.running)))
    assert max(batch_sizes) == 8 and sampler.failed_batches >= 1  # the fault hit a batch of 8

    fin = finished(events["bad"])
    assert fin.finish_reason is FinishReason.ERROR and not fin.rejected  # INTERNAL at the front
    assert fin.error == "internal error in sampling: RuntimeError"
    assert fin.completion_tokens == POISON_AFTER
    assert sum(len(e.token_ids) for e in events["bad"] if isinstance(e, Delta)) == POISON_AFTER

    cold = _cold(loaded, [r for r in reqs if r.request_id != "bad"])
    for rid, ref in cold.items():
        got = finished(events[rid])
        assert got.finish_reason is ref.finish_reason is FinishReason.LENGTH, rid
        assert got.output_token_ids == ref.output_token_ids, rid
        assert got.text == ref.text, rid
    assert re.fullmatch(r"[a-z]{0,14}(-[0-9]{0,3})?", finished(events["r7"]).text)  # the grammar held through the retry
    lp = [t for e in events["r5"] if isinstance(e, Delta) for t in e.logprobs]
    assert len(lp) == 12 and all(len(t.top) == 2 for t in lp)  # logprobs survived the fallback step
    assert not eng.scheduler.running and eng.blocks.num_free == eng.blocks.num_usable
    eng.close()


def test_an_invalid_request_raised_in_sampling_is_that_requests_invalid_argument(loaded):
    reqs = _batch(loaded)[:4]
    bad = reqs[3].sampling
    eng = make_engine(loaded, engine_kw=dict(sampler=FaultySampler(bad, InvalidRequest("top_k cannot be applied here"))))
    events = run(eng, reqs)
    fin = finished(events["bad"])
    assert fin.finish_reason is FinishReason.ERROR and fin.rejected  # INVALID_ARGUMENT at the front
    assert fin.error == "top_k cannot be applied here"
    cold = _cold(loaded, reqs[:3])
    for rid, ref in cold.items():
        assert finished(events[rid]).output_token_ids == ref.output_token_ids, rid
    eng.close()


def test_a_failing_forward_still_fails_the_whole_step(loaded):
    """The isolation is the output room's: a forward that raises is the step's error
    (AsyncEngine then fails the requests in flight, ``fail_all``)."""
    import dataclasses

    model = loaded.model

    class Exploding:
        def __call__(self, layout, kv):
            raise RuntimeError("the device fell over")

        def __getattr__(self, name):
            return getattr(model, name)

    eng = make_engine(dataclasses.replace(loaded, model=Exploding()))
    for r in _batch(loaded)[:2]:
        eng.add_request(r)
    with pytest.raises(RuntimeError, match="fell over"):
        for _ in range(5):
            eng.step()
    ends = [ev for _, ev in eng.fail_all("internal engine error: RuntimeError") if isinstance(ev, Finished)]
    assert len(ends) == 2 and all(e.finish_reason is FinishReason.ERROR for e in ends)
    assert eng.blocks.num_free == eng.blocks.num_usable
    eng.close()
