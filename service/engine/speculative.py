"""Speculative decoding drafted from the conversation itself (prompt lookup / n-gram).

A reply often repeats what its sequence already holds (an edited paragraph, corrected
code, a quoted document, a tool result echoed back): the sequence's whole token history
(the session's transcript, the new prompt and the output so far) is on the server, so
the next tokens can be drafted from it for free and checked several at a time. On a CPU
a decode step is bound by reading the weights (and, on small models, by the step's fixed
costs), so one forward over the last token plus k drafts costs little more than one
token's.

Two pure parts, no engine state:

- ``NgramDrafter``: per sequence, an index from each n-gram (n = ``min_ngram`` ..
  ``max_ngram``) of the history to where its most recent occurrence continues. The
  candidate is the continuation of the longest suffix of the history found earlier in it
  (n from the max down to the min), up to ``max_draft`` tokens; a continuation that runs
  into the present (the match is less than ``max_draft`` tokens back: the text repeats
  with that period) goes on as the period it found, the drafts repeating themselves (a
  list, a table row, a loop). How much of it is drafted is a cost decision
  (``draft_length``). Draft i is taken only if every one before it was, with the
  probability q_i that the text goes on as the candidate there, so a step with k drafts
  yields E(k) = 1 + q_1 + q_1 q_2 + .. + q_1 .. q_k tokens, and costs 1 + c k of a plain
  step (c: the caller's ``row_cost``, from the runner's timing of decode forwards); the
  draft is the k that maximizes E(k) / (1 + c k), none when no k beats plain decoding.
  q_i depends on how long the match it extends is (m + i - 1 tokens for draft i, m the
  match's length at the proposal: how many tokens before the candidate agree with the
  history's end, up to ``MATCH_CAP``): a continuation of a long verbatim repeat goes on
  far more often than one of a common bigram; and on whether the text went on the same
  way each time the draft's context came before (its last ``max_ngram`` tokens, drafts
  before it included): a draft where the history branched is a likelier miss (the
  frequency signal of SuffixDecoding, Oliaro et al. 2024). It is estimated per class of
  match length (``MATCH_CLASSES``) and of how the context went on (``FOLLOW_CLASSES``:
  every time of two or more as the draft; once, or never seen; as several tokens, the
  draft's the majority; the draft's half the times or fewer), the sequence's own rate
  shrunk toward the server's
  (``MatchStats``, shared by every sequence of an engine: q = (hits + W r) / (seen + W),
  the sequence's decayed counts, r the server's rate, W = ``SEQUENCE_WEIGHT``), so a
  new sequence drafts at once as the server's traffic has measured and a sequence whose
  text does not repeat stops drafting after a few misses. The drafter is scored on what
  the sequence did whether or not it drafted: each call compares the tokens added since
  the last call with the last candidate, token by token up to the first miss, each
  comparison counted in its match length's class, so a sequence that stopped drafting
  starts again as soon as its text repeats, at no cost, and a draft length follows the
  text's repetition and the hardware's cost of a row (a small model on a CPU pays for
  every row; a large one, bound by reading its weights, hardly at all).

- the verification rule, given the target's processed logits at every drafted position
  (row i: the logits after the history plus ``drafts[:i]``, penalties and masks applied
  as plain decoding would have applied them had those drafts been its tokens):

  greedy: accept the longest prefix of drafts equal to each row's argmax, then the
  argmax of the first row that disagreed (or, every draft accepted, of the last row:
  the bonus token). The tokens are exactly plain greedy decoding's.

  sampling: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023)
  with the drafter's distribution a point mass q = delta(d), drawn as its coupling with
  plain sampling: row i draws t ~ p_i as plain decoding would at that position; the draft
  is accepted when t == d (probability p(d) = min(1, p(d) / q(d))), otherwise t is the
  token (then distributed as p with d removed and renormalised: norm(max(0, p - q)));
  every draft accepted, the last row's draw is the bonus token. Each emitted token is
  distributed exactly as p given the tokens before it (the drafter is deterministic
  given the history, so its proposal carries no information the target does not
  condition on). A seeded row draws at each output position with that position's seed
  (sampling.position_seed): the emitted tokens are then plain seeded decoding's own,
  whatever was drafted, so seeded requests speculate and still give the same tokens
  whatever else is in the batch.

Drafts that remember (engine/draft_pool.py): besides the sequence's own history, a
bounded pool of recent outputs of the same tenant and cache salt (``NgramDrafter.pool``),
whose continuation is drafted where it matches the history's end for longer than the
history's own index does (a regenerate, a repeated agent step, the same question again);
its drafts are scored and sized like any other, by the length of their match.

Grammar rows (a response_format) draft too: the scheduler cuts a draft before the first
token the grammar refuses (the matcher's ``validate_tokens``, which moves nothing), and
row i gets the grammar's mask after drafts[:i] (grammar.GrammarCompiler.fill_draft_masks),
the mask plain decoding would have used at that position.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from .sampling import draw, filter_logits, greedy
from ..kernels.layer import STEP_ROWS
from ..types import SamplingParams

PRIOR = 0.5  # the rate of a match class no sequence has been scored in yet
DECAY = 0.9  # a sequence's counts per class: each scored token weighs 1, the ones before DECAY as much
DEFAULT_ROW_COST = 0.05  # a draft row's cost (of a plain step) before StepCost has measured one
# Decode-forward rows (sequences + drafts) a step's drafts may fill: the rows the native
# decode step takes in one call (kernels/layer.py STEP_ROWS; a step of more rows runs the
# torch reference, engine/runner.py). The scheduler's ``max_step_rows`` starts at it.
MAX_STEP_ROWS = STEP_ROWS
MATCH_CAP = 64  # longest match measured (tokens before the candidate agreeing with the history's end)
COMPARE_CAP = 1024  # longest measured to choose between the history's and the draft pool's candidates
MATCH_CLASSES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # the match-length classes' lower ends (bisect)
# How a draft's context (its last max_ngram tokens) went on where it came before in the history:
AGREED = 0  # two or more times, every one with the draft's token
ONCE = 1  # once, with the draft's token; or the context was not seen before
MAJORITY = 2  # with several tokens, the draft's more than half the times
MINORITY = 3  # with several tokens, the draft's half the times or fewer; or with another token alone
FOLLOW_CLASSES = 4
SEQUENCE_WEIGHT = 4.0  # the server's rate counts as this many of the sequence's own scored tokens


def match_class(m: int) -> int:
    """The class of a match of ``m`` tokens: the last of MATCH_CLASSES at or below it (0
    below the first)."""
    return max(bisect.bisect_right(MATCH_CLASSES, m) - 1, 0)


def rate_slot(cls: int, follow: int) -> int:
    """The counts' index of match class ``cls`` and follow class ``follow``."""
    return cls * FOLLOW_CLASSES + follow


NUM_SLOTS = len(MATCH_CLASSES) * FOLLOW_CLASSES


class MatchStats:
    """How often the history went on as the drafter's candidate, per class of the length of
    the match the token extended and class of how its context went on before (``rate_slot``):
    every sequence's drafter of an engine scores into one (the scheduler's), decayed counts
    (each scored token weighs 1, the ones before ``DECAY`` as much: a window of
    ~1 / (1 - DECAY) tokens per class) from PRIOR_WEIGHT tokens at PRIOR. Plain Python
    floats: the engine thread alone touches it."""

    DECAY = 0.999
    PRIOR_WEIGHT = 2.0

    def __init__(self) -> None:
        self.hits = [PRIOR * self.PRIOR_WEIGHT] * NUM_SLOTS
        self.seen = [self.PRIOR_WEIGHT] * NUM_SLOTS

    def rate(self, slot: int) -> float:
        return self.hits[slot] / self.seen[slot]

    def add(self, slot: int, hit: bool) -> None:
        self.hits[slot] = self.DECAY * self.hits[slot] + hit
        self.seen[slot] = self.DECAY * self.seen[slot] + 1.0


def match_length(tokens: Sequence[int], c: int, n: int, cap: int = MATCH_CAP) -> int:
    """The longest m in [n, min(cap, c)] with tokens[c - m : c] == tokens[-m:], given that
    the last n tokens match (n <= c): doubling, then bisection, over slice comparisons."""
    L = len(tokens)
    hi = min(cap, c)
    if hi <= n:
        return n

    def agree(m: int) -> bool:
        return tokens[c - m : c] == tokens[L - m : L]

    k = n
    while k < hi:
        nk = min(2 * k, hi)
        if not agree(nk):
            lo, top = k, nk - 1  # k agrees, nk does not
            while lo < top:
                mid = (lo + top + 1) // 2
                if agree(mid):
                    lo = mid
                else:
                    top = mid - 1
            return lo
        k = nk
    return k


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The engine's speculation settings (service/config.py: --speculative, --spec-max-draft).
    ``enabled``: the default of a request that does not say (SamplingParams.speculative)."""

    enabled: bool = True
    max_draft: int = 16  # drafts per step at most (draft_length's cap)
    max_ngram: int = 4  # longest suffix matched
    min_ngram: int = 2  # shortest suffix matched: shorter ones match too often to pay

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError(f"speculative max draft must be >= 1, got {self.max_draft}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"speculative n-gram range must be 1 <= min <= max, got {self.min_ngram}..{self.max_ngram}")


@dataclass(slots=True)
class NgramDrafter:
    """One sequence's drafter over its token history (see the module docstring)."""

    config: SpecConfig
    stats: MatchStats = field(default_factory=MatchStats)  # the engine's, shared by its sequences
    seen: int = 0  # len(tokens) at the last propose
    candidate: list[int] = field(default_factory=list)  # the last propose's candidate, drafted or not
    match: int = 0  # the length of the match the candidate continues (its first token extends it)
    indexed: int = 0  # history positions p < indexed whose n-grams ending at p - 1 are in the index
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)  # n -> n-gram -> continuation
    # the max_ngram-grams' occurrences with a continuation, and those grams with each continuation appended
    contexts: dict[tuple[int, ...], int] = field(default_factory=dict)
    follows: dict[tuple[int, ...], int] = field(default_factory=dict)
    # the candidate's follow classes, computed as read (``follow_at``) from the context the
    # candidate was proposed in: the history's last max_ngram tokens, then the candidate
    computed: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    # this sequence's decayed counts per rate_slot: tokens scored, and how many the candidate predicted
    hits: list[float] = field(default_factory=lambda: [0.0] * NUM_SLOTS)
    scored: list[float] = field(default_factory=lambda: [0.0] * NUM_SLOTS)
    # the cross-request pool's view for the sequence's tenant and salt (draft_pool.PoolView), or None
    pool: Any = None
    _own_at: int = 0  # where the own candidate continues the history (own_candidate)
    # figures of this sequence (the engine sums them): verification steps, drafted, accepted
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def _update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` that have a continuation: an n-gram ending at
        position p (p < len - 1) continues at p + 1; a later occurrence replaces an
        earlier one (the most recent wins). The max_ngram-grams' occurrences are counted
        too, and each with its continuation (``contexts``, ``follows``)."""
        lo, hi = self.config.min_ngram, self.config.max_ngram
        if not self.index:
            self.index = {n: {} for n in range(lo, hi + 1)}
        end = len(tokens) - 1  # the last token has no continuation yet
        index, contexts, follows = self.index, self.contexts, self.follows
        for p in range(self.indexed, end):
            if p + 1 < hi:  # the history's first tokens: the n-grams that fit
                for n in range(lo, p + 2):
                    index[n][tuple(tokens[p - n + 1 : p + 1])] = p + 1
                continue
            gram = tuple(tokens[p - hi + 1 : p + 2])  # the max_ngram-gram ending at p and its continuation
            for n in range(lo, hi + 1):
                index[n][gram[hi - n : hi]] = p + 1
            context = gram[:hi]
            contexts[context] = contexts.get(context, 0) + 1
            follows[gram] = follows.get(gram, 0) + 1
        self.indexed = max(self.indexed, end)

    def follow_classes(self, tokens: Sequence[int], candidate: list[int]) -> list[int]:
        """The follow class of each token of ``candidate`` (the continuation proposed for
        ``tokens``): how its context, the last max_ngram tokens of the history and the
        candidate before it, went on where it came before in the history."""
        tail = self._tail(tokens, candidate)
        return [self._follow_class(tail, len(candidate), i) for i in range(len(candidate))]

    def _tail(self, tokens: Sequence[int], candidate: list[int]) -> list[int]:
        """The candidate's contexts: the history's last (up to) max_ngram tokens, then it."""
        return list(tokens[max(len(tokens) - self.config.max_ngram, 0) :]) + candidate

    def _follow_class(self, tail: list[int], k: int, i: int) -> int:
        """Candidate token i's follow class, ``tail`` the history's last (up to) max_ngram
        tokens and the k candidate tokens; a token whose context reaches before a history
        shorter than max_ngram is "once"."""
        n = self.config.max_ngram
        j = i - (k - (len(tail) - n))  # the context's start in tail
        if j < 0:
            return ONCE
        gram = tuple(tail[j : j + n])
        seen = self.contexts.get(gram, 0)
        if not seen:
            return ONCE
        same = self.follows.get(gram + (tail[j + n],), 0)
        if same == seen:
            return AGREED if seen >= 2 else ONCE
        return MAJORITY if 2 * same > seen else MINORITY

    def follow_at(self, i: int) -> int:
        """The last candidate's token i's follow class, from the counts as they were when
        it was proposed (``propose`` scores before it counts the new tokens), computed
        once, when first read: a step reads the classes of its drafts and of the tokens
        scored at the next, not all max_draft of them."""
        got = self.computed
        while len(got) <= i:
            got.append(self._follow_class(self.tail, len(self.candidate), len(got)))
        return got[i]

    @property
    def follow(self) -> list[int]:
        """Every follow class of the last candidate."""
        return [self.follow_at(i) for i in range(len(self.candidate))]

    def _score(self, tokens: Sequence[int]) -> None:
        """Count the tokens added since the last call against the last candidate, in the
        class of the match each extended (the sequence's and the server's): each one it
        predicted a hit, the first one it did not a miss (the candidate's later tokens
        continued a history that did not happen: not scored)."""
        for j, (tok, want) in enumerate(zip(tokens[self.seen :], self.candidate)):
            hit = tok == want
            slot = rate_slot(match_class(self.match + j), self.follow_at(j))
            self.hits[slot] = DECAY * self.hits[slot] + hit
            self.scored[slot] = DECAY * self.scored[slot] + 1.0
            self.stats.add(slot, hit)
            if not hit:
                break
        self.seen = len(tokens)

    def rate(self, m: int, follow: int = ONCE) -> float:
        """The probability that the history goes on as the candidate at a match of ``m``
        tokens where the draft's context went on as ``follow`` before: the sequence's
        rate in that class shrunk toward the server's."""
        slot = rate_slot(match_class(m), follow)
        return (self.hits[slot] + SEQUENCE_WEIGHT * self.stats.rate(slot)) / (self.scored[slot] + SEQUENCE_WEIGHT)

    def candidate_for(self, tokens: Sequence[int]) -> list[int]:
        """The continuation of the longest suffix of ``tokens`` found earlier in them
        (``own_candidate``), or, with a ``pool`` (engine/draft_pool.py: recent outputs of
        the request's tenant and cache salt), the pool's continuation where its match is
        longer (both at MATCH_CAP, the longest measured for the rates: the longer measured
        up to COMPARE_CAP, the pool's on a tie there; a regenerate's earlier answer matches
        back into its prompt, an older part of the sequence's own history it repeats back to
        its last edit). Sets ``match``: how long the match is (up to MATCH_CAP)."""
        out = self.own_candidate(tokens)
        if self.pool is not None:
            beat = min(self.match, MATCH_CAP - 1)
            got = self.pool.lookup(tokens, self.config.max_draft, beat)
            if got is not None and got[1] >= MATCH_CAP and self.match >= MATCH_CAP:
                own = match_length(tokens, self._own_at, MATCH_CAP, COMPARE_CAP)
                if self.pool.lookup(tokens, self.config.max_draft, own - 1, COMPARE_CAP, count=False) is None:
                    got = None  # the sequence's own match is the longer
            if got is not None:
                out, self.match = got[0], min(got[1], MATCH_CAP)
        return out

    def own_candidate(self, tokens: Sequence[int]) -> list[int]:
        """The continuation of the longest suffix of ``tokens`` found earlier in them, up
        to ``max_draft`` tokens, past the end of the history as the period the match
        found (the continuation at c of a suffix ending at L - 1 repeats every L - c
        tokens); [] when none is. Sets ``match``: how long the match is."""
        L = len(tokens)
        for n in range(min(self.config.max_ngram, L - 1), self.config.min_ngram - 1, -1):
            c = self.index[n].get(tuple(tokens[L - n : L]))
            if c is not None and c < L:  # (c >= L: indexed from a longer history than this one)
                self.match = match_length(tokens, c, n)
                self._own_at = c
                out = list(tokens[c : min(c + self.config.max_draft, L)])
                period = L - c
                while len(out) < self.config.max_draft:
                    out.append(out[len(out) - period])
                return out
        self.match = 0
        return []

    def propose(self, tokens: Sequence[int], limit: int | None = None, row_cost: float = DEFAULT_ROW_COST) -> list[int]:
        """The drafts to follow ``tokens`` (the sequence's whole history): the candidate
        cut to ``draft_length`` of its drafts' rates (``rate`` at the match length each
        extends) and ``row_cost`` (a draft row's cost as a share of the step's), at most
        ``limit``; [] when drafting does not pay or nothing matches."""
        self._score(tokens)  # before the new tokens are counted: the classes the candidate was proposed with
        self._update(tokens)
        self.candidate = self.candidate_for(tokens)
        self.tail = self._tail(tokens, self.candidate)
        self.computed = []
        kmax = len(self.candidate) if limit is None else min(len(self.candidate), limit)
        rates = (self.rate(self.match + i, self.follow_at(i)) for i in range(kmax))  # read as far as they matter
        return self.candidate[: draft_length(rates, row_cost)]

    def record(self, drafted: int, accepted: int) -> None:
        """Count one verification (``drafted`` drafts, ``accepted`` of them taken) in the
        sequence's figures (the draft length follows the rates scored in ``propose``)."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted


def draft_length(rates: Iterable[float], row_cost: float) -> int:
    """The k in 0..len(rates) that maximizes E(k) / (1 + row_cost k), E(k) = 1 + q_1 +
    q_1 q_2 + .. + q_1 .. q_k (q_i = rates[i - 1] in [0, 1], draft i's probability of
    being taken given the ones before it): the expected tokens of a step with k drafts
    over that step's cost as a share of a plain step's. 0 when no draft pays (the first
    shorter of equal values). ``rates`` is read lazily, and no further once no longer
    draft can win: after draft k, E(k') <= E(k) + (k' - k) t_k (t_k = q_1 .. q_k, the
    terms do not grow), which beats best (1 + c k') >= E(k) + best c (k' - k) only if
    t_k > best c."""
    best, best_k, e, term = 1.0, 0, 1.0, 1.0
    for k, q in enumerate(rates, 1):
        term *= q
        e += term
        v = e / (1.0 + row_cost * k)
        if v > best:
            best, best_k = v, k
        if term <= best * row_cost:
            break
    return best_k


class StepCost:
    """What a step and a draft row cost, measured: a decode step's seconds against its rows (the
    sequences' pending tokens and their drafts), an exponentially weighted least-squares
    line a + b rows over the steps the engine timed (``add``: steps with no prefill chunk,
    from the plan to the emitted tokens, so the fixed cost a is the whole step's: the
    Python around the forward, sampling, the output). ``share(rows)``: one more row's cost
    as a share of a step of ``rows`` rows, b / (a + b rows); DEFAULT_ROW_COST until the
    steps timed spread over enough row counts to fit a line. ``at(rows)``: a decode step's
    seconds, the fixed cost a prefill batch adds a step to (scheduler.first_batch)."""

    WEIGHT = 0.05  # each timed step's weight in the moments
    MIN_SPREAD = 0.25  # the rows' variance the fit needs

    def __init__(self) -> None:
        self._m = [0.0] * 5  # weighted sums of 1, x, y, x^2, x y (x: rows, y: seconds)

    def add(self, rows: int, seconds: float) -> None:
        if rows < 1 or not seconds > 0.0:
            return
        w, m = self.WEIGHT, self._m
        for i, v in enumerate((1.0, rows, seconds, rows * rows, rows * seconds)):
            m[i] += w * (v - m[i])

    def line(self) -> tuple[float, float] | None:
        """(a, b) seconds, or None before the fit is possible."""
        n, x, y, xx, xy = self._m
        if n <= 0.0:
            return None
        mx, my = x / n, y / n
        var = xx / n - mx * mx
        if var < self.MIN_SPREAD:
            return None
        b = max((xy / n - mx * my) / var, 0.0)
        a = my - b * mx
        return (a, b) if a > 0.0 else None

    def at(self, rows: int) -> float | None:
        """A decode step's predicted seconds at ``rows`` rows (0: the fixed cost a): the
        line once it fits, before then the mean timed step (more than a), None before any
        step was timed."""
        fit = self.line()
        if fit is not None:
            return fit[0] + fit[1] * rows
        n, _, y, _, _ = self._m
        return y / n if n > 0.0 else None

    def share(self, rows: int = 1) -> float:
        fit = self.line()
        if fit is None:
            return DEFAULT_ROW_COST
        a, b = fit
        return min(max(b / (a + b * max(rows, 1)), 1e-3), 1.0)


# ---- verification ----------------------------------------------------------------------


def accept_greedy(drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
    """``targets``: each row's argmax (len(drafts) + 1 rows). The tokens plain greedy
    decoding emits: the drafts up to the first disagreement, then that row's target."""
    out: list[int] = []
    for d, t in zip(drafts, targets):
        if d != t:
            out.append(t)
            return out
        out.append(d)
    out.append(targets[len(drafts)])
    return out


def target_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(R, V) processed logits -> (R, V) the sampling distribution plain decoding draws
    from at each row (temperature, min_p, top_k, top_p, softmax: sampling.sample's rule).
    A row that overflows to NaN is a point mass on its argmax (sample's fallback)."""
    R = processed.shape[0]
    dev = processed.device
    scaled = filter_logits(
        processed / params.temperature,
        torch.full((R,), params.top_k, dtype=torch.long, device=dev),
        torch.full((R,), params.top_p, device=dev),
        torch.full((R,), params.min_p, device=dev),
    )
    probs = scaled.softmax(-1)
    bad = ~torch.isfinite(probs).all(-1)
    if bool(bad.any()):
        top = processed.nan_to_num(nan=float("-inf")).argmax(-1)
        probs[bad] = 0.0
        probs[bad, top[bad]] = 1.0
    return probs


def accept_sampled(
    probs: torch.Tensor,  # (k + 1, V): row i the target distribution after drafts[:i]
    drafts: Sequence[int],
    generator: torch.Generator | None,
    seed: int | None = None,  # a seeded row's seed: row i draws with position_seed(seed, position + i)
    position: int = 0,  # the output position of row 0 (the sequence's output tokens so far)
) -> list[int]:
    """Speculative rejection sampling with a point-mass drafter, as the coupling of the
    module docstring: the accepted drafts, then the first draw that differed from its
    draft (the rejected draft's replacement) or the bonus token."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        t = draw(probs[i], generator, seed, position + i)
        out.append(t)
        if t != d:
            return out
    out.append(draw(probs[len(drafts)], generator, seed, position + len(drafts)))
    return out


def accept(
    processed: torch.Tensor,  # (k + 1, V) float32 processed logits
    drafts: Sequence[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    seed: int | None = None,
    position: int = 0,
) -> list[int]:
    """The tokens a verification emits: ``accept_greedy`` at temperature 0, else
    ``accept_sampled`` over ``target_probs``. 1 .. k + 1 tokens."""
    if params.temperature == 0.0:
        return accept_greedy(drafts, greedy(processed))
    return accept_sampled(target_probs(processed, params), drafts, generator, seed, position)
