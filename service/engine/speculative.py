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
  ``max_ngram``) of the history to where its most recent occurrence continues. A draft is
  the continuation of the longest suffix of the history found earlier in it (n from the
  max down to the min), up to the sequence's current draft length, which adapts to what
  was accepted: up by one after a step that accepted every draft, down to one past what
  was accepted otherwise, and after a step that accepted nothing the drafter sits out a
  few steps (1, 2, 4 .. 16), so text that does not repeat costs little more than plain
  decoding. The match's own length (how far back the history agrees with the earlier
  occurrence, up to MAX_MATCH) bounds the draft too: a match shorter than ``max_ngram``
  drafts at most its length less one (a 2-token coincidence, one token), a longer one
  at least half its length, up to the cap (a long quoted run goes on for a while).

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

Grammar rows (a response_format) draft too: the scheduler cuts a draft before the first
token the grammar refuses (the matcher's ``validate_tokens``, which moves nothing), and
row i gets the grammar's mask after drafts[:i] (grammar.GrammarCompiler.fill_draft_masks),
the mask plain decoding would have used at that position.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .sampling import draw, filter_logits, greedy
from ..types import SamplingParams

MAX_SKIP = 16  # steps a drafter sits out at most after drafts that were all rejected
MAX_MATCH = 32  # how far back a match's length is counted
MAX_STEP_ROWS = 64  # decode-forward rows (sequences + drafts) a step's drafts may fill: kernels/ops.py's MAX_ROWS


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The engine's speculation settings (service/config.py: --speculative, --spec-max-draft).
    ``enabled``: the default of a request that does not say (SamplingParams.speculative)."""

    enabled: bool = True
    max_draft: int = 16  # drafts per step at most (the adaptive length's cap)
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
    draft_len: int = 0  # the next draft's length at most (0: not started, set to the cap's half)
    skip: int = 0  # steps left to sit out
    backoff: int = 1  # the next sit-out after a step that accepted nothing
    indexed: int = 0  # history positions p < indexed whose n-grams ending at p - 1 are in the index
    index: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)  # n -> n-gram -> continuation
    # figures of this sequence (the engine sums them): verification steps, drafted, accepted
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def _update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams of ``tokens`` that have a continuation: an n-gram ending at
        position p (p < len - 1) continues at p + 1; a later occurrence replaces an
        earlier one (the most recent wins)."""
        lo, hi = self.config.min_ngram, self.config.max_ngram
        if not self.index:
            self.index = {n: {} for n in range(lo, hi + 1)}
        end = len(tokens) - 1  # the last token has no continuation yet
        for p in range(self.indexed, end):
            for n in range(lo, min(hi, p + 1) + 1):
                self.index[n][tuple(tokens[p - n + 1 : p + 1])] = p + 1
        self.indexed = max(self.indexed, end)

    def propose(self, tokens: Sequence[int], limit: int | None = None) -> list[int]:
        """Up to ``min(draft_len, limit)`` tokens to follow ``tokens`` (the sequence's
        whole history), or [] (no match, or sitting out)."""
        self._update(tokens)
        if self.skip > 0:
            self.skip -= 1
            return []
        if self.draft_len == 0:
            self.draft_len = max(1, self.config.max_draft // 2)
        k = self.draft_len if limit is None else min(self.draft_len, limit)
        L = len(tokens)
        if k <= 0 or L < 2:
            return []
        for n in range(min(self.config.max_ngram, L - 1), self.config.min_ngram - 1, -1):
            c = self.index[n].get(tuple(tokens[L - n : L]))
            if c is not None:
                m = match_length(tokens, c, n)
                if m < self.config.max_ngram:  # a short match: as many drafts as it is long, less one
                    k = min(k, m - 1)
                else:  # a long one: at least half its length, within the cap
                    cap = self.config.max_draft if limit is None else min(self.config.max_draft, limit)
                    k = min(cap, max(k, m // 2))
                return list(tokens[c : min(c + max(k, 1), L)])
        return []

    def record(self, drafted: int, accepted: int) -> None:
        """Fold one verification (``drafted`` drafts, ``accepted`` of them taken) into the
        next draft length and the sit-out."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted >= drafted:
            self.draft_len = min(self.config.max_draft, self.draft_len + 1)
        else:
            self.draft_len = max(1, accepted + 1)
        if accepted == 0:
            self.skip = self.backoff
            self.backoff = min(MAX_SKIP, self.backoff * 2)
        else:
            self.backoff = 1


def match_length(tokens: Sequence[int], c: int, n: int) -> int:
    """How many tokens before position ``c`` equal the history's last ones, given that
    ``n`` do (the n-gram found), counted up to MAX_MATCH."""
    L = len(tokens)
    m = n
    while m < MAX_MATCH and c - m - 1 >= 0 and tokens[c - m - 1] == tokens[L - m - 1]:
        m += 1
    return m


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
