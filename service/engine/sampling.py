"""Next-token selection for a batch of rows, each with its own request's parameters.

The pipeline, row by row but as batched tensor ops over the rows that need each step:

1. penalties on the raw logits: repetition (prompt + output, CTRL-style), presence and
   frequency (output tokens only, OpenAI-style), logit_bias, and, until a row has
   ``min_new_tokens`` outputs, its stop token ids (eos + ``stop_token_ids``) at -inf.
   Then, for rows with a response_format, the grammar's token bitmask (computed on
   CPU by llguidance for every constrained row at once, service/engine/grammar.py):
   every token the grammar does not allow next is -inf.
   These are the *processed logits*; logprobs are ``log_softmax`` of them (after
   penalties and the grammar mask, before temperature and the top-k / top-p / min-p
   filters).
2. greedy rows (temperature 0): argmax of the processed logits.
3. sampled rows: divide by temperature, min_p (drop tokens under min_p x the top
   token's probability), top_k, top_p, softmax, and one draw with the request's own
   ``torch.Generator``, so a seeded request gives the same tokens whatever else is in
   the batch. The draw is the one per-row step: a generator is per request. A seeded
   row's generator is seeded again before each draw from the seed and the output
   position (``position_seed``): its draws depend on where a token is, never on how many
   draws came before, so speculative verification (engine/speculative.py), which draws
   at several positions in one step and drafts as many as the step allows, gives the
   very tokens plain decoding gives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch

from ..types import SamplingParams, TokenLogprob


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    gen.manual_seed(seed)
    return gen


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded row's draw at output ``position`` (splitmix64 of the pair):
    distinct positions get unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are < 2**63


def draw(probs: torch.Tensor, generator: torch.Generator | None, seed: int | None, position: int) -> int:
    """One token from ``probs`` (V,): a seeded row's generator is seeded for ``position``
    first (the module docstring)."""
    if seed is not None and generator is not None:
        generator.manual_seed(position_seed(seed, position))
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(slots=True)
class RowState:
    """What the sampler needs to know about one row beyond its parameters."""

    token_ids: Sequence[int]  # prompt + output so far
    num_prompt: int
    stop_ids: Sequence[int] = ()  # ids that end generation (masked while < min_new_tokens)
    seed: int | None = None  # a seeded sampled row's seed (its own: seed + index for n > 1)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt


def needs_penalties(p: SamplingParams) -> bool:
    """Whether ``sample`` changes this row's logits in place before drawing (penalties,
    logit_bias, min_new_tokens' mask), so a caller that may sample them again keeps a copy."""
    return (
        p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or bool(p.logit_bias)
        or p.min_new_tokens > 0
    )


def _rows_ids(rows: list[int], ids: list[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row id lists into (row index, id) tensors for one scatter."""
    r = [i for i, toks in zip(rows, ids) for _ in toks]
    t = [x for toks in ids for x in toks]
    return (
        torch.tensor(r, dtype=torch.long, device=device),
        torch.tensor(t, dtype=torch.long, device=device),
    )


def apply_penalties(
    logits: torch.Tensor,  # (B, V) float32, modified in place
    params: Sequence[SamplingParams],
    states: Sequence[RowState],
) -> None:
    B, V = logits.shape
    dev = logits.device
    # repetition: every distinct id of prompt + output, CTRL-style (as transformers)
    rep = [i for i in range(B) if params[i].repetition_penalty != 1.0 and states[i].token_ids]
    if rep:
        seen = torch.zeros(len(rep), V, dtype=torch.bool, device=dev)
        r, t = _rows_ids(list(range(len(rep))), [states[i].token_ids for i in rep], dev)
        seen[r, t] = True
        idx = torch.tensor(rep, device=dev)
        pen = torch.tensor([params[i].repetition_penalty for i in rep], device=dev).unsqueeze(1)
        sub = logits.index_select(0, idx)
        penalised = torch.where(sub > 0, sub / pen, sub * pen)
        logits.index_copy_(0, idx, torch.where(seen, penalised, sub))
    # presence / frequency: output tokens only, subtracted (OpenAI semantics)
    pf = [
        i
        for i in range(B)
        if (params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0)
        and states[i].num_output > 0
    ]
    if pf:
        counts = torch.zeros(len(pf), V, dtype=torch.float32, device=dev)
        outs = [states[i].token_ids[states[i].num_prompt :] for i in pf]
        r, t = _rows_ids(list(range(len(pf))), outs, dev)
        counts.index_put_((r, t), torch.ones(len(t), device=dev), accumulate=True)
        idx = torch.tensor(pf, device=dev)
        presence = torch.tensor([params[i].presence_penalty for i in pf], device=dev).unsqueeze(1)
        frequency = torch.tensor([params[i].frequency_penalty for i in pf], device=dev).unsqueeze(1)
        delta = counts * frequency + (counts > 0).float() * presence
        logits.index_copy_(0, idx, logits.index_select(0, idx) - delta)
    # logit_bias: added to the (row, id) pairs
    lb = [i for i in range(B) if params[i].logit_bias]
    if lb:
        r, t = _rows_ids(lb, [[tok for tok, _ in params[i].logit_bias] for i in lb], dev)
        b = torch.tensor(
            [bias for i in lb for _, bias in params[i].logit_bias], dtype=torch.float32, device=dev
        )
        logits.index_put_((r, t), b, accumulate=True)
    # min_new_tokens: no stop token before the row has that many outputs
    mn = [
        i
        for i in range(B)
        if states[i].num_output < params[i].min_new_tokens and states[i].stop_ids
    ]
    if mn:
        r, t = _rows_ids(mn, [[t for t in states[i].stop_ids if t < V] for i in mn], dev)
        logits[r, t] = float("-inf")


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """-inf (in place) for the tokens the grammar forbids: ``bitmask[j]`` (llguidance's
    int32 words, service/engine/grammar.py) is row ``rows[j]``'s; one batched op."""
    from .grammar import allowed_tokens

    V = logits.shape[-1]
    allowed = allowed_tokens(bitmask, V).to(logits.device, non_blocking=True)  # (R, V) bool
    idx = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, idx, logits.index_select(0, idx).masked_fill(~allowed, float("-inf")))


def filter_logits(
    logits: torch.Tensor,  # (R, V) temperature-scaled
    top_k: torch.Tensor,  # (R,) long, 0 = off
    top_p: torch.Tensor,  # (R,) float, 1 = off
    min_p: torch.Tensor,  # (R,) float, 0 = off
) -> torch.Tensor:
    """Mask (to -inf) what min_p, top-k and the top-p nucleus drop; each keeps >= 1 token."""
    V = logits.shape[-1]
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        floor = probs.max(-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0
    if not bool(use_k.any() or use_p.any()):
        return logits
    if bool(use_k.all()):
        # every row keeps at most its k: a top-k of the largest k replaces the full sort
        # (the sort of a 32k-150k vocabulary is most of a sampled step on a CPU)
        sorted_logits, sorted_idx = torch.topk(logits, int(top_k.max()), dim=-1)
    else:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, torch.full_like(top_k, V)).clamp(1, sorted_logits.shape[-1])
        kth = sorted_logits.gather(-1, (k - 1).unsqueeze(1))  # after a full sort, ties with the k-th stay
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if bool(use_p.any()):
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # drop a token when the mass before it already reaches top_p (keeps >= 1 token)
        remove = ((cum - probs) >= top_p.unsqueeze(1)) & use_p.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, sorted_idx, sorted_logits)


def token_logprobs(
    processed: torch.Tensor,  # (B, V) processed logits
    tokens: list[int],
    want: Sequence[int | None],  # per row: None = no logprobs, k = top-k alternatives
) -> list[TokenLogprob | None]:
    rows = [i for i, k in enumerate(want) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(want)
    if not rows:
        return out
    idx = torch.tensor(rows, device=processed.device)
    lp = torch.log_softmax(processed.index_select(0, idx), dim=-1)  # (R, V)
    tok = torch.tensor([tokens[i] for i in rows], device=processed.device)
    chosen = lp.gather(-1, tok.unsqueeze(1)).squeeze(1).tolist()
    kmax = max(want[i] for i in rows)  # type: ignore[type-var]
    top_v, top_i = (lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long()))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        k = want[i] or 0
        out[i] = TokenLogprob(
            token_id=tokens[i],
            logprob=chosen[j],
            # a token with no probability (masked by a grammar, or past the sampleable
            # vocabulary) is no alternative: top may hold fewer than k entries
            top=tuple((t, v) for t, v in zip(top_i[j][:k], top_v[j][:k]) if v != float("-inf")),
        )
    return out


def greedy(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: the first of equal maxima, NaN above everything (torch.argmax's
    rule). float32 on the CPU by numpy's, which is vectorized (torch's is a scalar loop:
    29 against 3 us a row at V = 32000)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


@dataclass(slots=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]


def sample(
    logits: torch.Tensor,  # (B, V) float32; may be modified in place
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    states: Sequence[RowState],
    masks: tuple[list[int], torch.Tensor] | None = None,  # (rows, their grammar bitmasks)
) -> Sampled:
    """One token id per row, plus its logprobs where the row asked for them."""
    B = logits.shape[0]
    dev = logits.device
    if any(needs_penalties(p) for p in params):
        apply_penalties(logits, params, states)
    if masks is not None:
        apply_grammar_masks(logits, *masks)
    tokens = greedy(logits)  # every greedy row; sampled rows overwritten
    hot = [i for i in range(B) if params[i].temperature != 0.0]
    if hot:
        idx = torch.tensor(hot, device=dev)
        temp = torch.tensor([params[i].temperature for i in hot], device=dev).unsqueeze(1)
        scaled = filter_logits(
            logits.index_select(0, idx) / temp,
            torch.tensor([params[i].top_k for i in hot], dtype=torch.long, device=dev),
            torch.tensor([params[i].top_p for i in hot], device=dev),
            torch.tensor([params[i].min_p for i in hot], device=dev),
        )
        probs = scaled.softmax(-1)
        finite = torch.isfinite(probs).all(-1).tolist()
        for j, i in enumerate(hot):
            # extreme parameters that overflow to NaN fall back to greedy for that row
            # rather than failing every stream in the batch
            if finite[j]:
                tokens[i] = draw(probs[j], generators[i], states[i].seed, states[i].num_output)
            else:
                tokens[i] = int(logits[i].nan_to_num(nan=float("-inf")).argmax())
    want = [p.logprobs for p in params]
    return Sampled(tokens, token_logprobs(logits, tokens, want))
