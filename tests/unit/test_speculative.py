"""The n-gram drafter and the verification rule of service/engine/speculative.py, alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from kvserve.service.engine.speculative import (
    DECAY,
    DEFAULT_ROW_COST,
    AGREED,
    MAJORITY,
    MATCH_CLASSES,
    MINORITY,
    NUM_SLOTS,
    ONCE,
    PRIOR,
    SEQUENCE_WEIGHT,
    MatchStats,
    NgramDrafter,
    SpecConfig,
    StepCost,
    accept,
    accept_greedy,
    accept_sampled,
    draft_length,
    match_class,
    match_length,
    rate_slot,
    target_probs,
)
from kvserve.service.engine.sampling import draw, position_seed
from kvserve.service.types import SamplingParams


def drafter(**kw) -> NgramDrafter:
    """A drafter on a server whose drafts have always been taken: it drafts its whole candidate."""
    stats = MatchStats()
    stats.hits = list(stats.seen)
    return NgramDrafter(SpecConfig(**kw), stats)


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


def test_a_continuation_that_runs_into_the_present_goes_on_as_its_period():
    hist = [1, 2, 3, 1, 2]
    d = drafter(max_draft=8, max_ngram=2, min_ngram=2)
    # (1, 2) last continued with 3, two tokens before the end: the text repeats every 3
    assert d.propose(hist) == [3, 1, 2, 3, 1, 2, 3, 1]
    assert d.propose(hist, limit=1) == [3]
    assert d.propose(hist, limit=0) == []
    # a continuation that ends before the present is cut at max_draft alone
    assert drafter(max_draft=2, max_ngram=2, min_ngram=2).propose([7, 8, 9, 4, 5, 6, 7, 8]) == [9, 4]


def test_match_length_is_how_far_back_the_history_agrees():
    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        tokens = torch.randint(0, 3, (int(torch.randint(3, 90, (1,), generator=g)),), generator=g).tolist()
        L = len(tokens)
        for c in range(2, L):
            if tokens[c - 2 : c] != tokens[L - 2 :]:
                continue
            want = 2
            while want < min(64, c) and tokens[c - want - 1] == tokens[L - want - 1]:
                want += 1
            assert match_length(tokens, c, 2) == want, (tokens, c)
    assert match_length([5] * 200, 150, 4) == 64  # capped
    assert [match_class(m) for m in (0, 2, 3, 5, 8, 47, 48, 64)] == [0, 0, 1, 2, 4, 8, 9, 9]


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


def test_draft_length_is_the_argmax_of_expected_tokens_over_cost():
    def brute(rates: list[float], c: float) -> int:
        values = []
        for k in range(len(rates) + 1):
            e, term = 1.0, 1.0
            for q in rates[:k]:
                term *= q
                e += term
            values.append(e / (1 + c * k))
        return max(range(len(rates) + 1), key=lambda k: (values[k], -k))  # the shortest of equal ones

    for p in (0.0, 0.05, 0.2, 0.5, 0.7, 0.85, 0.95, 1.0):
        for c in (0.001, 0.01, 0.05, 0.2, 1.0):
            for kmax in (0, 1, 4, 16):
                assert draft_length([p] * kmax, c) == brute([p] * kmax, c), (p, c, kmax)
    g = torch.Generator().manual_seed(5)
    for _ in range(200):  # rates that change along the draft
        rates = torch.rand(int(torch.randint(0, 17, (1,), generator=g)), generator=g).tolist()
        c = float(torch.rand(1, generator=g)) * 0.3
        assert draft_length(rates, c) == brute(rates, c)
    assert draft_length([0.04] * 16, 0.05) == 0  # q <= c: no draft pays for its row
    assert draft_length([0.9] * 16, 0.05) > draft_length([0.5] * 16, 0.05) > draft_length([0.2] * 16, 0.05) > 0
    assert draft_length([0.8] * 16, 0.005) > draft_length([0.8] * 16, 0.05) > draft_length([0.8] * 16, 0.3)
    assert draft_length([1.0] * 5, 0.05) == 5  # bounded by what is there
    assert draft_length([0.95, 0.95, 0.05, 0.95], 0.05) == 2  # a likely miss ends it
    read: list[float] = []

    def lazy():
        for q in (0.9, 0.01, 0.9, 0.9):
            read.append(q)
            yield q

    # after a draft whose chain of rates falls to row_cost's share of the best, none is read
    assert draft_length(lazy(), 0.05) == 1 and read == [0.9, 0.01]


def test_rates_are_scored_per_match_class_on_every_token_drafted_or_not():
    # the candidate after (1, 2) is 3 4 5 ...; the history goes on with it: hits, drafted or not
    stats = MatchStats()
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    d = NgramDrafter(SpecConfig(max_draft=6, max_ngram=2, min_ngram=2), stats)
    assert d.rate(2) == PRIOR  # nothing scored anywhere yet
    d.propose(hist, row_cost=1.0)  # a row as dear as a step: nothing drafted, the candidate kept
    assert d.candidate == [3, 4, 5, 6, 7, 8] and d.match == 2
    hist += [3, 4, 5]
    d.propose(hist, row_cost=1.0)
    # three hits, extending matches of 2, 3 and 4 tokens: one in each of the first three
    # classes, each context seen once before (1 2 -> 3, 2 3 -> 4, 3 4 -> 5)
    slots = [rate_slot(c, ONCE) for c in range(3)]
    assert [d.hits[i] for i in slots] == [d.scored[i] for i in slots] == [1.0, 1.0, 1.0] and sum(d.scored) == 3
    assert stats.hits[slots[0]] == pytest.approx(MatchStats.DECAY * PRIOR * MatchStats.PRIOR_WEIGHT + 1)
    r = stats.rate(slots[0])
    assert d.rate(2) == pytest.approx((1 + SEQUENCE_WEIGHT * r) / (1 + SEQUENCE_WEIGHT)) and d.rate(2) > r > PRIOR
    # the candidate after (4, 5) continues a match of 5 tokens (1 2 3 4 5 again); 50 misses it
    assert d.match == 5
    hist += [50]
    d.propose(hist)
    slot = rate_slot(match_class(5), ONCE)
    assert d.hits[slot] == pytest.approx(DECAY * 1.0) and d.scored[slot] == pytest.approx(DECAY + 1.0)
    # a miss ends the scoring of a call: the candidate's later tokens are not counted
    d2 = NgramDrafter(SpecConfig(max_draft=6, max_ngram=2, min_ngram=2))
    h2 = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    d2.propose(h2)
    d2.propose(h2 + [9, 4, 5])  # 9 misses 3; 4 and 5 are not scored
    assert d2.scored[rate_slot(0, ONCE)] == 1.0 == sum(d2.scored) and d2.hits[rate_slot(0, ONCE)] == 0.0


def test_a_new_sequence_drafts_at_the_servers_rate_and_its_own_text_pulls_it_away():
    stats = MatchStats()
    cfg = SpecConfig(max_draft=8, max_ngram=2, min_ngram=2)
    # a sequence copying a long passage: its drafts' classes fill with hits, on the server too
    text = list(range(100, 140))
    first = NgramDrafter(cfg, stats)
    hist = text + text[:2]
    for tok in text[2:]:
        first.propose(hist)
        hist.append(tok)
    first.propose(hist)
    assert all(stats.rate(i) > 0.8 for i in range(NUM_SLOTS) if stats.seen[i] > 5)
    # a new sequence drafts as the server measured, before any token of its own is scored
    new = NgramDrafter(cfg, stats)
    assert new.rate(2) == pytest.approx(stats.rate(rate_slot(0, ONCE)))
    drafts = new.propose([7, 8, 9, 10, 11, 7, 8])
    assert drafts == [9, 10, 11, 7, 8, 9, 10, 11][: len(drafts)]
    assert len(drafts) > len(NgramDrafter(cfg).propose([7, 8, 9, 10, 11, 7, 8])) > 0  # more than on a new server
    # one whose text never goes on as it did: its own misses outweigh the server's rate
    other = NgramDrafter(cfg, stats)
    hist = []
    for t in range(30):
        hist += [1, 2]
        other.propose(hist)
        hist.append(300 + t)
    # (1 2 went on as a different token each time: the candidate is a minority's)
    assert other.rate(2, MINORITY) < DEFAULT_ROW_COST < stats.rate(rate_slot(0, ONCE))
    assert other.propose(hist + [1, 2]) == []


def test_a_drafter_stops_on_text_that_does_not_repeat_and_starts_again_when_it_does():
    d = NgramDrafter(SpecConfig(max_draft=8, max_ngram=2, min_ngram=2))
    hist: list[int] = []
    # 1 2 x: after each "1 2" the candidate is the last x, and the text goes on with a new one
    for t in range(30):
        hist += [1, 2]
        d.propose(hist)
        hist.append(100 + t)
        d.propose(hist)
    assert d.rate(2, MINORITY) < DEFAULT_ROW_COST  # thirty misses
    assert d.propose(hist + [1, 2]) == []  # drafting no longer pays
    # the text repeats again (1 2 7): scored while nothing is drafted, so drafts resume
    # without one wasted on the way
    for _ in range(3):
        for tok in (1, 2, 7):
            hist.append(tok)
            d.propose(hist)
    drafts = d.propose(hist + [1, 2])
    assert drafts and drafts == [7, 1, 2, 7, 1, 2, 7, 1][: len(drafts)] and d.drafted == 0


def test_follow_classes_say_how_each_drafts_context_went_on_before():
    d = drafter(max_draft=4, max_ngram=2, min_ngram=2)
    hist = [1, 2, 3, 9, 1, 2, 3, 8, 5, 6, 7, 5, 6, 4, 5, 6, 4, 5, 6]
    d.propose(hist)
    # (5, 6) went on as 7, 4, 4: the candidate's first token (4, the most recent) is the
    # majority's; then (6, 4) as 5 twice (agreed), (4, 5) as 6 twice (agreed), and
    # (5, 6) again, now followed by the candidate's period: 4 once more, the majority's
    assert d.candidate == [4, 5, 6, 4] and d.follow == [MAJORITY, AGREED, AGREED, MAJORITY]
    assert d.follow == d.follow_classes(hist, d.candidate)  # computed as read, the same classes
    # (2, 3) went on as 9 and 8: the most recent, 8, is half of them: a minority's; (3, 8) once
    d = drafter(max_draft=4, max_ngram=2, min_ngram=2)
    d.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3])
    assert d.candidate[:2] == [8, 1] and d.follow[:2] == [MINORITY, ONCE]
    # a context never seen before (a draft past the end of the history's repeats) is "once"
    d2 = drafter(max_draft=3, max_ngram=3, min_ngram=2)
    d2.propose([7, 1, 2, 3, 1, 2])  # (1, 2) -> 3 matched as a bigram; (7, 1, 2)'s trigram never recurred
    assert d2.candidate == [3, 1, 2] and d2.follow[0] == ONCE
    # the counts are incremental over a growing history, as a fresh drafter's
    grown = drafter(max_draft=4, max_ngram=2, min_ngram=2)
    grown.propose([1, 2, 3, 9]), grown.propose([1, 2, 3, 9, 1, 2, 3, 8]), grown.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3])
    assert (grown.contexts, grown.follows) == (d.contexts, d.follows) and grown.follow == d.follow


def test_a_draft_where_the_text_branched_before_is_drafted_shorter():
    # the server has measured drafts on agreed contexts taken, on split ones missed
    stats = MatchStats()
    for c in range(len(MATCH_CLASSES)):
        for _ in range(200):
            stats.add(rate_slot(c, AGREED), True)
            stats.add(rate_slot(c, MINORITY), False)
    cfg = SpecConfig(max_draft=8, max_ngram=2, min_ngram=2)
    # 1 2 3 4 5 twice: every context agreed; the draft runs on
    assert NgramDrafter(cfg, stats).propose([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]) == [3, 4, 5, 1, 2, 3, 4, 5]
    # the same, but (3, 4) went on as 5 and as 6: the draft stops before the branch
    assert NgramDrafter(cfg, stats).propose([1, 2, 3, 4, 6, 1, 2, 3, 4, 5, 1, 2]) == [3, 4]


def test_record_counts_the_figures():
    d = drafter(max_draft=4, max_ngram=2, min_ngram=2)
    d.record(4, 3), d.record(2, 0)
    assert (d.steps, d.drafted, d.accepted) == (2, 6, 3)


def test_step_cost_fits_the_line_of_the_timed_steps():
    c = StepCost()
    assert c.line() is None and c.share() == DEFAULT_ROW_COST
    for _ in range(50):
        c.add(1, 0.002)  # only plain steps: no spread to fit a slope on
    assert c.line() is None and c.share() == DEFAULT_ROW_COST
    for i in range(400):
        rows = 1 + i % 9
        c.add(rows, 0.001 + 0.0001 * rows)
    a, b = c.line()
    assert a == pytest.approx(0.001, rel=1e-6) and b == pytest.approx(0.0001, rel=1e-6)
    assert c.share(1) == pytest.approx(0.0001 / 0.0011)
    assert c.share(8) == pytest.approx(0.0001 / 0.0018)  # a row is a smaller share of a bigger batch
    c.add(0, 1.0), c.add(3, 0.0)  # nothing to learn from
    assert c.line() == pytest.approx((a, b))


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
