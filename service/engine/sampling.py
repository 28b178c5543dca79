"""Next-token selection: greedy, temperature, top-k, top-p, repetition penalty, seeds.

``sample`` takes one row of logits per sequence. Greedy rows are one batched argmax;
sampled rows are processed with each request's own ``torch.Generator``, so a request
with a seed produces the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from service.types import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    gen = torch.Generator(device=device)
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    gen.manual_seed(seed)
    return gen


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalty: float
) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): divide positive, multiply negative logits
    of every token id already in the prompt or output."""
    scores = logits.gather(-1, seen)
    scores = torch.where(scores > 0, scores / penalty, scores * penalty)
    return logits.scatter(-1, seen, scores)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) everything outside the top-k and the top-p nucleus. logits: (V,)"""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        # drop a token when the mass before it already reaches top_p (keeps >= 1 token)
        remove = (cum - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)
    return logits


def sample(
    logits: torch.Tensor,  # (B, V) float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen_tokens: Sequence[Sequence[int]],
) -> list[int]:
    """One token id per row."""
    B = logits.shape[0]
    out: list[int | None] = [None] * B
    plain_greedy = [
        i for i in range(B) if params[i].temperature == 0.0 and params[i].repetition_penalty == 1.0
    ]
    if plain_greedy:
        idx = torch.tensor(plain_greedy, device=logits.device)
        for i, tok in zip(plain_greedy, logits.index_select(0, idx).argmax(-1).tolist()):
            out[i] = tok
    for i in range(B):
        if out[i] is not None:
            continue
        p = params[i]
        row = logits[i]
        if p.repetition_penalty != 1.0 and seen_tokens[i]:
            seen = torch.tensor(sorted(set(seen_tokens[i])), device=row.device)
            row = apply_repetition_penalty(row, seen, p.repetition_penalty)
        if p.temperature == 0.0:
            out[i] = int(row.argmax())
            continue
        row = filter_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        if not bool(torch.isfinite(probs).all()):
            # extreme parameters (e.g. temperature 1e-45) overflow to NaN: this row
            # falls back to greedy rather than failing every stream in the batch
            out[i] = int(logits[i].nan_to_num(nan=float("-inf")).argmax())
            continue
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]))
    return out  # type: ignore[return-value]
