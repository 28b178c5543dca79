"""Helpers for driving an LLMEngine synchronously in tests."""

from __future__ import annotations

import time

import torch

from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.engine import LLMEngine
from kvserve.service.types import Finished, GenerationRequest, SamplingParams

BS = 4


def bytes_per_token(loaded) -> int:
    return loaded.kv_spec(BS).bytes_per_token


def make_engine(loaded, store=None, *, engine_kw: dict | None = None, **kw) -> LLMEngine:
    """An LLMEngine over ``loaded`` with a 64-block pool; ``kw``: EngineConfig fields,
    ``engine_kw``: LLMEngine's own keywords (``transfers``, ``sampler``)."""
    base = dict(
        model_path="unused",
        device="cpu",
        dtype="float32",
        kv_cache_memory=64 * BS * bytes_per_token(loaded),  # 64 blocks
        block_size=BS,
    )
    base.update(kw)
    return LLMEngine(loaded, EngineConfig(**base), store=store, **(engine_kw or {}))


def run(engine: LLMEngine, reqs: list[GenerationRequest], timeout_s=120.0, on_step=None):
    """Step the engine until every request has finished; events per request id."""
    events: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    done: set[str] = set()
    deadline = time.monotonic() + timeout_s
    i = 0
    while time.monotonic() < deadline:
        i += 1
        for rid, ev in engine.step():
            events[rid].append(ev)
            if isinstance(ev, Finished):
                done.add(rid)
        if on_step:
            on_step(i, events)
        if done == set(events):
            return events
    raise AssertionError("engine did not finish")


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = model.forward_nocache(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def req(rid, prompt, n=8, **sp) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_new_tokens=n, ignore_eos=True, **sp),
    )


def finished(evs) -> Finished:
    assert isinstance(evs[-1], Finished)
    return evs[-1]


def prompts(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


