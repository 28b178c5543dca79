"""Bad model directories raise ModelLoadError naming the file and the problem; the
fingerprint is deterministic and covers config and weights; eos ids and dtypes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.service.models.config import ModelConfig, ModelLoadError
from kvserve.service.models.loading import load_model


@pytest.fixture
def llama_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(llama_copy)


def test_unparsable_config(llama_copy: Path) -> None:
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json: cannot parse JSON"):
        load_model(llama_copy)


def test_unknown_architecture(llama_copy: Path) -> None:
    _edit_config(llama_copy, architectures=["MambaForCausalLM"], model_type="mamba")
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown architecture MambaForCausalLM"):
        load_model(llama_copy)


def test_missing_required_config_key(llama_copy: Path) -> None:
    cfg = json.loads((llama_copy / "config.json").read_text())
    del cfg["hidden_size"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config\.json: missing required key 'hidden_size'"):
        load_model(llama_copy)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "unsupported rope_scaling type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}, "needs 'low_freq_factor'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ],
)
def test_unsupported_config_values(llama_copy: Path, changes: dict, match: str) -> None:
    _edit_config(llama_copy, **changes)
    with pytest.raises(ModelLoadError, match=match):
        load_model(llama_copy)


def test_missing_tensor(llama_copy: Path) -> None:
    _edit_weights(llama_copy, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: missing tensor\(s\) 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        load_model(llama_copy)


def test_unexpected_tensor(llama_copy: Path) -> None:
    _edit_weights(llama_copy, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.q_norm\.weight'"):
        load_model(llama_copy)


def test_wrong_shape(llama_copy: Path) -> None:
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:16].clone()

    _edit_weights(llama_copy, shrink)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[16, 64\], expected \[32, 64\]"):
        load_model(llama_copy)


def test_gpt2_wrong_shape_is_checked_in_checkpoint_layout(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "gpt2"
    shutil.copytree(tiny_gpt2_dir, dst)

    def transpose(t):  # a Conv1D weight stored the nn.Linear way round
        t["transformer.h.0.mlp.c_fc.weight"] = t["transformer.h.0.mlp.c_fc.weight"].t().contiguous()

    _edit_weights(dst, transpose)
    with pytest.raises(ModelLoadError, match=r"'transformer\.h\.0\.mlp\.c_fc\.weight' has shape \[256, 64\], expected \[64, 256\]"):
        load_model(dst)


def test_no_weights(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights: expected model.safetensors"):
        load_model(llama_copy)


def test_pytorch_bin_only_is_explained(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").rename(llama_copy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="only safetensors weights are supported"):
        load_model(llama_copy)


def test_corrupt_safetensors(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(llama_copy)


def test_index_names_a_missing_shard(tiny_llama_sharded_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "sharded"
    shutil.copytree(tiny_llama_sharded_dir, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (dst / victim).unlink()
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors\.index\.json: lists shard {victim}, which does not exist"):
        load_model(dst)


def test_no_tokenizer(llama_copy: Path) -> None:
    (llama_copy / "tokenizer.model").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_model(llama_copy)


def test_tokenizer_larger_than_the_embedding(llama_copy: Path) -> None:
    _edit_config(llama_copy, vocab_size=300)  # the fixture's tokenizer has 400 tokens
    with pytest.raises(ModelLoadError, match="tokenizer has 400 tokens but config.json's vocab_size is 300"):
        load_model(llama_copy)


def test_bad_dtype_and_device(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(tiny_llama_dir, dtype="int8")
    with pytest.raises(ValueError, match="unsupported device"):
        load_model(tiny_llama_dir, device="mps")


# ---- what a good load gives ---------------------------------------------------------


def test_fingerprint_is_deterministic_and_covers_config_and_weights(tiny_llama_dir: Path, llama_copy: Path) -> None:
    a = load_model(tiny_llama_dir).fingerprint
    assert a == load_model(llama_copy).fingerprint and len(a) == 64
    _edit_weights(llama_copy, lambda t: t["model.norm.weight"].__setitem__(0, 1.0 + 2**-20))
    b = load_model(llama_copy).fingerprint
    assert b != a
    _edit_config(llama_copy, rms_norm_eps=1e-6)
    assert load_model(llama_copy).fingerprint not in (a, b)


def test_fingerprint_ignores_the_writing_tool_version(llama_copy: Path) -> None:
    a = load_model(llama_copy).fingerprint
    _edit_config(llama_copy, transformers_version="0.0.1")
    assert load_model(llama_copy).fingerprint == a


def test_eos_ids_merge_config_and_generation_config(llama_copy: Path) -> None:
    (llama_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_model(llama_copy).eos_token_ids == (2, 7)
    (llama_copy / "generation_config.json").unlink()
    _edit_config(llama_copy, eos_token_id=None)
    assert load_model(llama_copy).eos_token_ids == (2,)  # from the tokenizer


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_loads_and_tracks_float32(tiny_llama_dir: Path, dtype: str) -> None:
    from kvserve.service.kv.cache import BatchLayout, SeqSlice

    ref = load_model(tiny_llama_dir)
    half = load_model(tiny_llama_dir, dtype=dtype)
    assert half.dtype == getattr(torch, dtype)
    assert all(p.dtype == half.dtype for p in half.model.parameters())
    assert half.model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = list(range(3, 40))
    with torch.inference_mode():
        want = ref.model.forward_nocache(torch.tensor([ids]))[0, -1]
        kv = half.new_kv_pool(1 << 20, 4)
        got = half.model(BatchLayout.build([SeqSlice(list(range(1, 11)), 0, ids)], 4), kv)[0]
        got_decode = half.model(BatchLayout.build([SeqSlice(list(range(1, 11)), 37, [5]),
                                                   SeqSlice([11], 0, [6, 7])], 4), kv)
    assert got.dtype == torch.float32 and torch.isfinite(got_decode).all()
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_config_from_hf_transformers4_spelling() -> None:
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 16, "rope_theta": 5e5,
         "rope_scaling": {"type": "linear", "factor": 2.0}, "eos_token_id": [3, 4]}
    c = ModelConfig.from_hf(d)
    assert (c.rope_theta, c.rope_scaling, c.num_kv_heads, c.head_dim, c.eos_token_ids) == (
        5e5, {"rope_type": "linear", "factor": 2.0}, 2, 4, (3, 4))
