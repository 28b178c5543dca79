"""Sampling (greedy, temperature, top-k, top-p, repetition penalty, seeds) and stop strings."""

import torch

from service.engine.output import TextStream
from service.engine.sampling import (
    apply_repetition_penalty,
    filter_top_k_top_p,
    make_generator,
    sample,
)
from service.types import SamplingParams


class CharDetok:
    """Token id = Unicode code point; enough to exercise stop-string logic."""

    def __init__(self):
        self.text = ""

    def push(self, ids):
        s = "".join(map(chr, ids))
        self.text += s
        return s

    def flush(self):
        return ""


def run_stream(text, stop):
    ts = TextStream(CharDetok(), stop)
    pieces = []
    for ch in text:
        pieces.append(ts.push([ord(ch)]))
        if ts.stopped:
            break
    pieces.append(ts.finish())
    return "".join(pieces), ts


def test_stop_string_cuts_text_and_never_emits_a_retracted_prefix():
    out, ts = run_stream("hello ENDworld", ["END"])
    assert out == "hello " and ts.text == "hello " and ts.stopped


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    ts = TextStream(CharDetok(), ["END"])
    assert ts.push([ord("a")]) == "a"
    assert ts.push([ord("E")]) == ""  # could be the start of END: held back
    assert ts.push([ord("N")]) == ""
    assert ts.push([ord("x")]) == "ENx"  # it was not
    assert ts.finish() == ""
    assert ts.text == "aENx"


def test_held_text_is_flushed_at_the_end():
    out, ts = run_stream("abcE", ["END"])
    assert out == "abcE" and not ts.stopped


def test_earliest_of_several_stop_strings_wins():
    out, _ = run_stream("one two three", ["three", "two"])
    assert out == "one "


def test_greedy_is_argmax_per_row():
    logits = torch.randn(5, 50)
    params = [SamplingParams()] * 5
    assert sample(logits, params, [None] * 5, [()] * 5) == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_different_seed_differs():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    p = SamplingParams(temperature=1.0, seed=1234)

    def draw(params):
        g = make_generator(params, torch.device("cpu"))
        return [sample(logits, [params], [g], [()])[0] for _ in range(20)]

    assert draw(p) == draw(p)
    assert draw(p) != draw(SamplingParams(temperature=1.0, seed=99))


def test_top_k_keeps_only_k_candidates():
    logits = torch.arange(10, dtype=torch.float32)
    kept = filter_top_k_top_p(logits, top_k=3, top_p=1.0)
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [7, 8, 9]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_top_k_top_p(probs.log(), top_k=0, top_p=0.75)
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [0, 1]
    # top_p so small that only the best token survives
    kept = filter_top_k_top_p(probs.log(), top_k=0, top_p=0.01)
    assert torch.isfinite(kept).nonzero().flatten().tolist() == [0]


def test_sampled_tokens_stay_inside_top_k():
    logits = torch.randn(1, 100)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    p = SamplingParams(temperature=2.0, top_k=5, seed=7)
    g = make_generator(p, torch.device("cpu"))
    for _ in range(50):
        assert sample(logits, [p], [g], [()])[0] in allowed


def test_repetition_penalty_matches_transformers_rule():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]
    # greedy with a penalty steers away from a seen token
    p = SamplingParams(repetition_penalty=10.0)
    assert sample(torch.tensor([[3.0, 2.9]]), [p], [None], [[0]]) == [1]


def test_sampling_params_validation_messages():
    import pytest

    from service.types import InvalidRequest

    cases = [
        (SamplingParams(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (SamplingParams(max_new_tokens=10_000), "exceeds the limit 4096"),
        (SamplingParams(temperature=-1), "temperature must be >= 0"),
        (SamplingParams(top_p=0.0), "top_p must be in (0, 1]"),
        (SamplingParams(top_p=1.5), "top_p must be in (0, 1]"),
        (SamplingParams(top_k=-1), "top_k must be >= 0"),
        (SamplingParams(stop=("",)), "stop strings must not be empty"),
    ]
    for params, msg in cases:
        with pytest.raises(InvalidRequest, match=__import__("re").escape(msg)):
            params.validate(4096)


def test_overflowing_parameters_fall_back_to_greedy_instead_of_failing():
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=1e-45, seed=1), SamplingParams()]
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    assert sample(logits, params, gens, [(), ()]) == logits.argmax(-1).tolist()
