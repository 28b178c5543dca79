"""The n-gram drafter and the verification rule of service/engine/speculative.py, alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from kvserve.service.engine.speculative import (
    MAX_MATCH,
    NgramDrafter,
    SpecConfig,
    accept,
    accept_greedy,
    accept_sampled,
    match_length,
    target_probs,
)
from kvserve.service.engine.sampling import draw, position_seed
from kvserve.service.types import SamplingParams


def drafter(**kw) -> NgramDrafter:
    d = NgramDrafter(SpecConfig(**kw))
    d.draft_len = d.config.max_draft
    return d


# ---- drafting ----------------------------------------------------------------------------


def test_draft_is_the_continuation_of_the_longest_suffix_match():
    #        0  1  2  3  4  5  6  7  8  9
    hist = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 1, 6, 7]
    # suffix (1, 6, 7) occurs at 5..7 continuing with 3, 4; (6, 7) alone also at 1..2 -> 8, 9
    assert drafter(max_draft=3, max_ngram=3, min_ngram=2).propose(hist) == [3, 4, 1]
    # with only bigrams the most recent (6, 7) wins too: at 6..7
    assert drafter(max_draft=2, max_ngram=2, min_ngram=2).propose(hist) == [3, 4]


def test_most_recent_occurrence_wins_and_the_suffix_itself_is_no_match():
    hist = [1, 2, 10, 1, 2, 20, 1, 2]
    assert drafter(max_draft=1, max_ngram=2, min_ngram=2).propose(hist) == [20]
    assert drafter(max_draft=4, max_ngram=2, min_ngram=2).propose([3, 4]) == []  # only the suffix
    assert drafter(max_draft=4, max_ngram=3, min_ngram=2).propose([9, 8, 7]) == []  # no repeat


def test_draft_stops_at_the_end_of_history_and_at_the_limit():
    hist = [1, 2, 3, 1, 2]
    d = drafter(max_draft=8, max_ngram=2, min_ngram=2)
    assert d.propose(hist) == [3, 1, 2]  # the continuation runs into the suffix, not past the end
    assert d.propose(hist, limit=1) == [3]
    assert d.propose(hist, limit=0) == []


def test_index_is_incremental_over_a_growing_history():
    hist = [4, 5, 6, 7]
    d = drafter(max_draft=2, max_ngram=2, min_ngram=2)
    assert d.propose(hist) == []
    hist += [8, 4, 5]
    assert d.propose(hist) == [6, 7]
    hist += [6, 9, 5, 6]
    assert d.propose(hist) == [9, 5]  # (5, 6) most recently continued with 9
    fresh = drafter(max_draft=2, max_ngram=2, min_ngram=2)
    assert fresh.propose(hist) == [9, 5] and fresh.index == d.index


def test_adaptive_draft_length_and_sit_out():
    d = NgramDrafter(SpecConfig(max_draft=6, max_ngram=2, min_ngram=2))
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert len(d.propose(hist)) == 3  # starts at half the cap
    d.record(3, 3)
    assert d.draft_len == 4
    d.record(4, 4), d.record(5, 5), d.record(6, 6)
    assert d.draft_len == 6  # capped
    d.record(6, 2)
    assert d.draft_len == 3 and d.skip == 0
    d.record(3, 0)  # nothing accepted: sits out 1 step, then 2, then 4
    assert d.draft_len == 1 and d.skip == 1
    assert d.propose(hist) == [] and d.propose(hist) == [3]
    d.record(1, 0)
    assert d.skip == 2
    assert d.propose(hist) == [] and d.propose(hist) == [] and d.propose(hist) == [3]
    d.record(1, 1)  # an acceptance resets the backoff
    assert d.backoff == 1 and (d.steps, d.drafted, d.accepted) == (8, 29, 21)


def test_match_length_counts_back_from_the_occurrence():
    #        0  1  2  3  4  5  6  7  8
    hist = [9, 1, 2, 3, 5, 8, 1, 2, 3]
    assert match_length(hist, 4, 2) == 3  # (2, 3) found continuing at 4; 1 agrees too, 9 vs 8 not
    assert match_length([7] * 100, 60, 2) == MAX_MATCH  # counted up to the bound


def test_a_short_match_drafts_less_and_a_long_match_more():
    # max_ngram 4: the suffix (1, 2) matches only 2 long -> one draft, whatever the draft length
    d = drafter(max_draft=8, max_ngram=4, min_ngram=2)
    assert d.propose([1, 2, 30, 31, 32, 33, 7, 1, 2]) == [30]
    # a 3-token match: two drafts
    d = drafter(max_draft=8, max_ngram=4, min_ngram=2)
    assert d.propose([1, 2, 3, 30, 31, 32, 33, 7, 1, 2, 3]) == [30, 31]
    # a 12-token repeat of a long run: at least half of it (6), past a draft length of 2
    run = list(range(100, 112))
    hist = run + list(range(200, 220)) + [5] + run
    d = drafter(max_draft=16, max_ngram=4, min_ngram=2)
    d.draft_len = 2
    assert d.propose(hist) == list(range(200, 206))
    assert d.propose(hist, limit=3) == [200, 201, 202]  # the limit still binds
    d = drafter(max_draft=4, max_ngram=4, min_ngram=2)
    assert len(d.propose(hist)) == 4  # and the cap


def test_config_rejects_bad_ranges():
    with pytest.raises(ValueError, match="max draft"):
        SpecConfig(max_draft=0)
    with pytest.raises(ValueError, match="n-gram range"):
        SpecConfig(min_ngram=3, max_ngram=2)


# ---- greedy verification -------------------------------------------------------------------


def test_accept_greedy_is_the_prefix_then_the_target():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # stops at the first disagreement
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept_greedy([], [3]) == [3]


def test_accept_at_temperature_zero_is_argmax_and_draws_nothing():
    logits = torch.full((3, 10), -5.0)
    logits[0, 2], logits[1, 7], logits[2, 1] = 1.0, 1.0, 1.0
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert accept(logits, [2, 7], SamplingParams(temperature=0.0), g) == [2, 7, 1]
    assert accept(logits, [2, 3], SamplingParams(temperature=0.0), g) == [2, 7]
    assert torch.equal(g.get_state(), state)


# ---- sampled verification: the emitted tokens are distributed as the target -------------------

V = 8


def _target(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 1.5, -1)


@pytest.mark.parametrize("draft", [0, 3, 7])  # the most likely, a middling and a rare token
def test_first_token_is_distributed_as_the_target(draft):
    p = _target(1, 2)
    order = p[0].argsort(descending=True).tolist()
    d = order[draft]
    g = torch.Generator().manual_seed(1234)
    N = 12000
    counts = torch.zeros(V)
    for _ in range(N):
        counts[accept_sampled(p, [d], g)[0]] += 1
    stat, pvalue = chisquare(counts.numpy(), (p[0] * N).numpy())
    assert pvalue > 1e-3, (counts / N, p[0])


def test_second_token_given_the_first_accepted_is_distributed_as_its_row():
    """Two drafts: the second emitted token, among draws whose first token was the first
    draft, follows row 1 (as plain decoding's second token would, given the first)."""
    p = _target(2, 3)
    d1, d2 = int(p[0].argmax()), int(p[1].argsort()[V // 2])
    g = torch.Generator().manual_seed(99)
    counts = torch.zeros(V)
    first_ok = 0
    N = 12000
    for _ in range(N):
        out = accept_sampled(p, [d1, d2], g)
        if out[0] == d1:
            first_ok += 1
            counts[out[1]] += 1
    assert abs(first_ok / N - float(p[0, d1])) < 0.02
    stat, pvalue = chisquare(counts.numpy(), (p[1] * first_ok).numpy())
    assert pvalue > 1e-3, (counts / first_ok, p[1])


def test_a_zero_probability_draft_is_always_rejected():
    p = _target(3, 2)
    p[0, 5] = 0.0
    p[0] /= p[0].sum()
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        out = accept_sampled(p, [5], g)
        assert out[0] != 5 and len(out) == 1


def test_a_certain_draft_is_accepted_with_its_bonus():
    p = torch.zeros(2, V)
    p[0, 4] = 1.0
    p[1, 6] = 1.0
    g = torch.Generator().manual_seed(0)
    assert accept_sampled(p, [4], g) == [4, 6]


def test_target_probs_follow_the_sampling_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 2)
    params = SamplingParams(temperature=0.5, top_k=2)
    probs = target_probs(logits, params)
    assert torch.all(probs[:, 2:] == 0)
    want = torch.softmax(torch.tensor([3.0, 2.0]) / 0.5, -1)
    assert torch.allclose(probs[0, :2], want)
    nan = target_probs(torch.tensor([[float("nan"), 1.0, 0.0]]), dataclasses.replace(params, top_k=0))
    assert nan.tolist() == [[0.0, 1.0, 0.0]]


def test_seeded_verification_emits_plain_seeded_decodings_draws():
    """A seeded row's verification draws at each output position with that position's
    seed: its tokens are the ones plain seeded decoding draws there, one a step, whatever
    the drafts were (the drafts only decide how many of them come out of this step)."""
    p = _target(4, 5)
    plain = [draw(p[i], torch.Generator(), 7, 5 + i) for i in range(5)]
    g = torch.Generator()
    for k in range(5):  # the first k drafts agree with plain, the next one (if any) does not
        drafts = plain[:k] + ([(plain[k] + 1) % V] if k < 4 else [])
        out = accept_sampled(p[: len(drafts) + 1], drafts, g, seed=7, position=5)
        assert out == plain[: len(out)] and len(out) == k + 1
    assert position_seed(7, 5) == position_seed(7, 5) != position_seed(7, 6) != position_seed(8, 6)
