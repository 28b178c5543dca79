"""Sampling (greedy, temperature, top-k, top-p, repetition penalty, seeds) and stop strings."""

import torch

from kvserve.service.engine.sequence import TextStream
from kvserve.service.engine.sampling import (
    apply_penalties,
    filter_logits,
    greedy,
    RowState,
    make_generator,
    sample as _sample,
)
from kvserve.service.types import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The oracle: one row (V,), transformers' CTRL-style rule on the ids in ``seen``
    (what ``apply_penalties`` batches)."""
    scores = logits.gather(-1, seen)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.scatter(-1, seen, scores)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row (V,) through the engine's ``filter_logits``."""
    return filter_logits(logits.unsqueeze(0), torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([0.0]))[0]


def sample(logits, params, gens, seen):
    """Token ids only; ``seen`` per row is the prompt (no output yet)."""
    return _sample(logits.clone(), params, gens, [RowState(list(s), len(s)) for s in seen]).tokens


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


def test_greedy_picks_torch_argmax_row_by_row_ties_infinities_and_nans_included():
    """The sampler's argmax (numpy's on CPU float32) is torch.argmax's: the first of equal
    maxima, NaN above +inf, an all -inf row at 0; other dtypes and strided rows too."""
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        B, V = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 300, (1,), generator=g))
        logits = torch.randint(-3, 3, (B, V), generator=g).float()  # many ties
        r = torch.rand(B, V, generator=g)
        logits[r < 0.03] = float("nan")
        logits[(r > 0.05) & (r < 0.1)] = float("-inf")
        logits[(r > 0.1) & (r < 0.12)] = float("inf")
        if trial % 7 == 0:
            logits[0] = float("-inf")
        assert greedy(logits) == logits.argmax(-1).tolist()
        assert greedy(logits.t().contiguous().t()) == logits.argmax(-1).tolist()  # column-major rows
        assert greedy(logits.bfloat16()) == logits.bfloat16().argmax(-1).tolist()


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
    batched = logits.unsqueeze(0).clone()  # the engine's batched rule: each distinct seen id once
    apply_penalties(batched, [SamplingParams(repetition_penalty=2.0)], [RowState([0, 1, 0], 3)])
    assert batched[0].tolist() == out.tolist()
    # greedy with a penalty steers away from a seen token
    p = SamplingParams(repetition_penalty=10.0)
    assert sample(torch.tensor([[3.0, 2.9]]), [p], [None], [[0]]) == [1]


def test_sampling_params_validation_messages():
    import pytest

    from kvserve.service.types import InvalidRequest

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


def _state(prompt, output=(), stop_ids=()):
    return RowState(list(prompt) + list(output), len(prompt), tuple(stop_ids))


def test_min_p_drops_tokens_under_the_fraction_of_the_top_probability():
    from kvserve.service.engine.sampling import filter_logits

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.2]))
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [0, 1, 2]  # 0.05 < 0.2 * 0.5
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    g = make_generator(p, torch.device("cpu"))
    assert {sample(probs.log(), [p], [g], [()])[0] for _ in range(40)} == {0, 1}


def test_presence_and_frequency_penalties_count_output_tokens_only():
    from kvserve.service.engine.sampling import apply_penalties

    logits = torch.zeros(1, 6)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [1, 2], output [3, 3, 4]: 1 and 2 untouched, 3 twice, 4 once
    apply_penalties(logits, [p], [_state([1, 2], [3, 3, 4])])
    assert logits[0].tolist() == [0.0, 0.0, 0.0, -1.0, -0.75, 0.0]


def test_logit_bias_and_min_new_tokens_steer_greedy():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    assert sample(logits, [SamplingParams(logit_bias=((2, 10.0),))], [None], [[]]) == [2]
    assert sample(logits, [SamplingParams(logit_bias=((0, -100.0),))], [None], [[]]) == [1]
    # token 0 is the stop id: held back until the row has min_new_tokens outputs
    p = SamplingParams(min_new_tokens=2)
    assert _sample(logits.clone(), [p], [None], [_state([1], [], [0])]).tokens == [1]
    assert _sample(logits.clone(), [p], [None], [_state([1], [1, 1], [0])]).tokens == [0]


def test_neutral_controls_leave_greedy_and_seeded_draws_unchanged():
    torch.manual_seed(1)
    logits = torch.randn(3, 200)
    plain = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.3, top_k=20, seed=6)]
    neutral = [
        SamplingParams(**{**_fields(q), "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_new_tokens": 0, "logit_bias": ()})
        for q in plain
    ]
    states = [_state([1, 2, 3], [7, 7])] * 3

    def draw(params):
        gens = [make_generator(q, torch.device("cpu")) for q in params]
        return [_sample(logits.clone(), params, gens, states).tokens for _ in range(10)]

    assert draw(plain) == draw(neutral)


def _fields(p):
    import dataclasses

    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


def test_a_seeded_row_draws_the_same_alone_or_in_a_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, 300)
    p = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.01, presence_penalty=0.7, seed=11)
    others = [SamplingParams(), SamplingParams(temperature=0.5, seed=1), SamplingParams(frequency_penalty=1.0)]
    st = _state([1, 2], [5, 6, 5])

    def alone():
        g = make_generator(p, torch.device("cpu"))
        return [_sample(logits[:1].clone(), [p], [g], [st]).tokens[0] for _ in range(15)]

    def batched():
        params = [p] + others
        gens = [make_generator(q, torch.device("cpu")) for q in params]
        return [_sample(logits.clone(), params, gens, [st] * 4).tokens[0] for _ in range(15)]

    assert alone() == batched()


def test_logprobs_are_the_log_softmax_of_the_processed_logits():
    torch.manual_seed(3)
    logits = torch.randn(2, 50)
    p = SamplingParams(logprobs=5, logit_bias=((4, 3.0),), temperature=0.7, seed=2)
    out = _sample(logits.clone(), [p, SamplingParams()], [make_generator(p, torch.device("cpu")), None], [_state([1]), _state([1])])
    processed = logits[0].clone()
    processed[4] += 3.0
    ref = torch.log_softmax(processed, -1)  # before temperature
    lp = out.logprobs[0]
    assert lp.token_id == out.tokens[0]
    assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-6
    assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()
    assert out.logprobs[1] is None


def test_sampling_control_validation_messages():
    import re

    import pytest

    from kvserve.service.types import InvalidRequest

    nan, inf = float("nan"), float("inf")
    cases = [
        (SamplingParams(min_p=nan), "min_p must be in [0, 1], got nan"),
        (SamplingParams(min_p=1.5), "min_p must be in [0, 1]"),
        (SamplingParams(presence_penalty=inf), "presence_penalty must be in [-2, 2], got inf"),
        (SamplingParams(frequency_penalty=-2.5), "frequency_penalty must be in [-2, 2]"),
        (SamplingParams(frequency_penalty=nan), "frequency_penalty must be in [-2, 2], got nan"),
        (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))), "logit_bias has 301 entries; the limit is 300"),
        (SamplingParams(logit_bias=((3, nan),)), "logit_bias[3] must be in [-100, 100], got nan"),
        (SamplingParams(logit_bias=((3, -inf),)), "logit_bias[3] must be in [-100, 100], got -inf"),
        (SamplingParams(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias names a token id twice"),
        (SamplingParams(min_new_tokens=-1), "min_new_tokens must be >= 0"),
        (SamplingParams(max_new_tokens=4, min_new_tokens=5), "min_new_tokens 5 exceeds max_new_tokens 4"),
        (SamplingParams(logprobs=21), "top_logprobs must be in [0, 20], got 21"),
    ]
    for params, msg in cases:
        with pytest.raises(InvalidRequest, match=re.escape(msg)):
            params.validate(4096)
    SamplingParams(min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, logit_bias=((1, -100.0),), min_new_tokens=4, max_new_tokens=4, logprobs=20).validate(4096)


def test_top_k_through_topk_and_through_the_full_sort_agree():
    from kvserve.service.engine.sampling import filter_logits

    torch.manual_seed(4)
    logits = torch.randn(3, 500)
    k, p, m = torch.tensor([5, 40, 7]), torch.tensor([0.8, 1.0, 0.5]), torch.zeros(3)
    fast = filter_logits(logits, k, p, m)  # every row has a top_k: top-k path
    # a fourth row without top_k forces the full sort for the whole batch
    slow = filter_logits(torch.cat([logits, logits[:1]]), torch.cat([k, torch.tensor([0])]),
                         torch.cat([p, torch.tensor([1.0])]), torch.zeros(4))[:3]  # fmt: skip
    assert torch.equal(fast, slow)
    assert (torch.isfinite(fast).sum(-1) <= k).all()
