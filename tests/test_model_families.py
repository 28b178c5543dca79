"""Every supported model family through the engine: a two-turn session whose second turn,
on a fresh engine (a new process), restores the first turn's blocks from a real
redis-server, and whose output equals transformers' greedy ``generate()`` over the whole
transcript. The per-family logits/greedy parity of the model files is in test_models.py."""

from __future__ import annotations

import pytest
import torch

from service.engine.config import EngineConfig
from service.engine.store import build_store
from service.engine.types import Tier
from service.models.loading import load_model
from tests.engine_util import BS, bytes_per_token, finished, make_engine, prompts, req, run

FAMILIES = ["tiny_mistral_dir", "tiny_qwen2_window_dir"]


def _redis_engine(loaded, redis_url):
    store = build_store(EngineConfig(block_size=BS, redis_url=redis_url), loaded)
    return make_engine(loaded, store=store, restore_policy="always")


def _hf_greedy(path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        return ref.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_session_restored_from_redis_equals_transformers(request, family: str, redis_url: str) -> None:
    path = request.getfixturevalue(family)
    loaded = load_model(path, dtype="float32", device="cpu")
    (p1,) = prompts(loaded.config.vocab_size, [13], seed=3)
    a = _redis_engine(loaded, redis_url)
    fin1 = finished(run(a, [req("t1", p1, n=8)])["t1"])
    assert fin1.output_token_ids == _hf_greedy(path, p1, 8)
    transcript = p1 + fin1.output_token_ids  # 21 tokens: past every window of the fixtures
    got = []
    a.spill(transcript, "", ("redis",), lambda n, held: got.append(n))
    assert a.store.flush(30)
    a.step()
    assert got == [len(transcript) // BS]
    a.close()

    b = _redis_engine(loaded, redis_url)  # a new process: nothing on the device
    prompt2 = transcript + [5, 6, 7]
    evs = run(b, [req("t2", prompt2, n=12)])["t2"]
    start, fin2 = evs[0], finished(evs)
    assert start.cached_by_tier.get(Tier.REDIS, 0) == (len(transcript) // BS) * BS
    assert fin2.output_token_ids == _hf_greedy(path, prompt2, 12)
    b.close()
