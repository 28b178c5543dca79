"""Every supported model family through the engine: a two-turn session whose second turn,
on a fresh engine (a new process), restores the first turn's blocks from a real
redis-server, and whose output equals transformers' greedy ``generate()`` over the whole
transcript. The per-family logits/greedy parity of the model files is in test_models.py."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.store import build_store
from kvserve.service.models.config import ModelConfig, ModelLoadError
from kvserve.service.models.loading import load_model
from kvserve.service.types import CacheScope, Tier
from tests.fixtures.engine import BS, bytes_per_token, finished, make_engine, prompts, req, run

FAMILIES = ["tiny_mistral_dir", "tiny_qwen2_window_dir", "tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
            "tiny_phi3_dir", "tiny_phi4_mini_dir"]


def _redis_engine(loaded, redis_url):
    store = build_store(EngineConfig(block_size=BS, redis_url=redis_url), loaded)
    return make_engine(loaded, store=store, restore_policy="always")


@functools.lru_cache(maxsize=2)
def _hf_model(path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # greedy runs their full length (the model's eos would stop them)
    return ref


def _hf_greedy(path, prompt: list[int], n: int) -> list[int]:
    from transformers import GenerationConfig

    ref = _hf_model(path)
    gen = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        return ref.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_session_restored_from_redis_equals_transformers(request, family: str, redis_url: str) -> None:
    path = request.getfixturevalue(family)
    loaded = load_model(path, dtype="float32", device="cpu")
    (p1,) = prompts(loaded.config.vocab_size, [13], seed=3)
    a = _redis_engine(loaded, redis_url)
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert a.model_info.architecture == arch  # the HF name, as GetModelInfo reports it
    fin1 = finished(run(a, [req("t1", p1, n=8)])["t1"])
    assert fin1.output_token_ids == _hf_greedy(path, p1, 8)
    transcript = p1 + fin1.output_token_ids  # 21 tokens: past every window of the fixtures
    got = []
    a.spill(transcript, CacheScope(), ("redis",), lambda n, held: got.append(n))
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



def test_longrope_regimes_never_share_blocks(tiny_phi4_mini_dir) -> None:
    """LongRoPE switching at 16 tokens. A short-regime prompt's blocks are not reused by a
    longer prompt (whose whole KV uses the long factors); a turn that grows past 16 tokens
    is recomputed in the long regime, as transformers' generate does; long-regime blocks
    are reused by the next long prompt. Every output equals transformers'."""
    loaded = load_model(tiny_phi4_mini_dir, dtype="float32", device="cpu")
    eng = make_engine(loaded)
    (short, extra) = prompts(loaded.config.vocab_size, [12, 8], seed=7)
    fin = finished(run(eng, [req("a", short, n=3)])["a"])  # 15 tokens: short regime throughout
    assert fin.output_token_ids == _hf_greedy(tiny_phi4_mini_dir, short, 3) and eng.scheduler.num_rope_switches == 0
    evs = run(eng, [req("b", short + extra, n=4)])["b"]  # 20 tokens: long from the start
    assert evs[0].cached_tokens == 0  # the short-regime blocks of the same tokens are not used
    assert finished(evs).output_token_ids == _hf_greedy(tiny_phi4_mini_dir, short + extra, 4)
    evs = run(eng, [req("c", short + extra + [9], n=4)])["c"]
    assert evs[0].cached_tokens == 20  # the long-regime blocks are
    assert finished(evs).output_token_ids == _hf_greedy(tiny_phi4_mini_dir, short + extra + [9], 4)
    evs = run(eng, [req("d", short, n=10)])["d"]  # crosses 16 while decoding: one switch
    assert eng.scheduler.num_rope_switches == 1
    assert finished(evs).output_token_ids == _hf_greedy(tiny_phi4_mini_dir, short, 10)
    scope = CacheScope()
    assert eng.keys.namespaces(scope) == [eng.keys.namespace(scope), eng.keys.namespace(scope, 17)]
    assert eng.keys.namespace(scope, 16) == eng.keys.namespace(scope) != eng.keys.namespace(scope, 17)
    eng.close()


_BASE = {"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 16}


@pytest.mark.parametrize(("config", "message"), [
    ({"architectures": ["Gemma3ForCausalLM"], "use_bidirectional_attention": True},
     "use_bidirectional_attention=true is not supported"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "unsupported hidden_activation 'relu'"),
    ({"architectures": ["Qwen3ForCausalLM"], "partial_rotary_factor": 0.5}, "partial_rotary_factor is not supported"),
    ({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     "unsupported rope_scaling type 'yarn'"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                                                              "long_factor": [1.0],
                                                              "original_max_position_embeddings": 8}},
     "'longrope' is only supported for Phi-3"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 4,
      "layer_types": ["full_attention", "chunked_attention"]}, "unsupported layer_types"),
    ({"architectures": ["Gemma2ForCausalLM"], "layer_types": ["full_attention"]}, "layer_types has 1 entries for 2"),
    ({"architectures": ["Phi3ForCausalLM"], "rope_scaling": {"type": "su", "short_factor": [1.0] * 2,
                                                             "long_factor": [1.0] * 3}},
     "long_factor has 3 entries; need rotary dims / 2 = 2"),
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.3}, "gives 1 rotary dims"),
])
def test_unimplemented_options_are_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(")):
        ModelConfig.from_hf({**_BASE, **config})


def test_layer_windows_follow_transformers_defaults() -> None:
    mistral = ModelConfig.from_hf({**_BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4})
    assert [mistral.layer_window(i) for i in range(2)] == [4, 4] and mistral.context_length == 2048
    gemma2 = ModelConfig.from_hf({**_BASE, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4})
    assert [gemma2.layer_window(i) for i in range(4)] == [4096, None, 4096, None]
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)
    gemma3 = ModelConfig.from_hf({**_BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6,
                                  "sliding_window": 16, "rope_theta": 1e6, "rope_local_base_freq": 1e4})
    assert [gemma3.layer_window(i) for i in range(6)] == [16] * 5 + [None]
    assert (gemma3.rope_theta, gemma3.local_rope_theta, gemma3.qk_norm) == (1e6, 1e4, True)
    qwen3 = ModelConfig.from_hf({**_BASE, "model_type": "qwen3", "head_dim": 6})
    assert qwen3.hf_architecture == "Qwen3ForCausalLM" and qwen3.head_dim == 6 and qwen3.layer_window(1) is None


def test_window_blocks_are_released_and_stay_valid(tiny_mistral_dir) -> None:
    """Mistral, window 8, blocks of 4: two 43-token sequences together need 22 blocks
    without releasing; the pool has 16, and neither is preempted because each gives back
    the blocks its window has passed. Outputs equal transformers; a next turn on one
    transcript still finds its leading blocks (released, evicted by the other sequence,
    demoted to the host tier: still valid) and is right."""
    loaded = load_model(tiny_mistral_dir, dtype="float32", device="cpu")
    store = build_store(EngineConfig(block_size=BS, host_cache_memory=64 * BS * bytes_per_token(loaded)), loaded)
    eng = make_engine(loaded, store=store, restore_policy="always",
                      kv_cache_memory=17 * BS * bytes_per_token(loaded))  # 16 usable + the null block
    assert eng.runner.release_window == 8 and eng.blocks.num_usable == 16
    p1, p2 = prompts(loaded.config.vocab_size, [13, 13], seed=11)
    held: list[int] = []
    evs = run(eng, [req("a", p1, n=30), req("b", p2, n=30)],
              on_step=lambda i, e: held.append(eng.blocks.num_usable - eng.blocks.num_free))
    assert eng.scheduler.num_preempted == 0 and max(held) < 16
    outs = {rid: finished(e).output_token_ids for rid, e in evs.items()}
    assert outs["a"] == _hf_greedy(tiny_mistral_dir, p1, 30)
    assert outs["b"] == _hf_greedy(tiny_mistral_dir, p2, 30)
    prompt2 = p1 + outs["a"] + [5, 6, 7]
    evs2 = run(eng, [req("a2", prompt2, n=6)])["a2"]
    assert evs2[0].cached_by_tier.get(Tier.HOST, 0) >= 8 * BS  # released, evicted, demoted, restored
    assert finished(evs2).output_token_ids == _hf_greedy(tiny_mistral_dir, prompt2, 6)
    eng.close()
