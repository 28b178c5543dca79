"""GGUF files (tests/fixtures/gguf_files.py: written by the ``gguf`` package as llama.cpp's
converter writes them) against the Hugging Face checkpoints they were written from.

- F32 files of every family: the loaded model's weights are the directory's bit for bit
  (the llama Q/K permutation undone; Gemma's norms scale by the (1 + w) the file stores),
  its config is the directory's, and its logits equal transformers' within 1e-4 (as
  test_models.py's).
- Quantized files (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, and a Q4_K_M-like mix): every weight the
  model multiplies by is gguf's own ``dequantize`` of the stored blocks, bit for bit, and
  the logits equal transformers' on the checkpoint with those dequantized weights.
- The header parser reads what gguf's ``GGUFReader`` reads; the fingerprint is over the
  tensors as stored; bad files are refused in one line (an unsupported tensor type, a
  truncated file, an unknown architecture).
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.service.models.config import ModelLoadError
from kvserve.service.models.gguf import GGUFCheckpoint, GGUFFile
from kvserve.service.models.layers import RMSNorm
from kvserve.service.models.loading import load_model
from kvserve.service.models.quant import BLOCK_TYPES, QuantLinear
from tests.fixtures import models as tiny
from tests.fixtures.gguf_files import dequantized_state_dict, write_gguf

# fixtures of models.py that GGUF can hold as they are
# (Llama 3's RoPE scaling: test_llama3_rope_factors_are_read_from_the_rope_freqs_tensor)
STORED_AS_IS = ["tiny_llama_dir", "tiny_llama_mqa_dir", "tiny_llama_linear_rope_dir",
                "tiny_qwen2_dir", "tiny_qwen3_bias_dir", "tiny_phi3_dir", "tiny_phi4_mini_dir", "tiny_gpt2_dir"]
# the rest, in the shapes GGUF holds: its metadata has no per-layer window list for Qwen (and
# llama.cpp applies none to Mistral, written as llama), Gemma's attention scale is head_dim's
# (or hidden / heads on the 27B shapes) and Gemma 3's windows every 6th layer off
MADE_HERE = {
    "mistral": lambda d: tiny.make_tiny_mistral(d, seed=7, sliding_window=None),
    "qwen3": lambda d: tiny.make_tiny_qwen3(d, seed=9, use_sliding_window=False),
    "gemma2": lambda d: tiny.make_tiny_gemma(d, version=2, seed=11, query_pre_attn_scalar=16),
    "gemma3": lambda d: tiny.make_tiny_gemma(d, version=3, seed=12, query_pre_attn_scalar=16, num_hidden_layers=6,
                                             layer_types=None),
}  # fmt: skip
FAMILIES = STORED_AS_IS + list(MADE_HERE)
RENAMED = {"mistral": {"hf_architecture": "LlamaForCausalLM", "model_type": "llama"}}  # the converter writes Mistral as llama
QUANTIZED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q4_K_M"]
# llama.cpp's Q4_K_M: Q4_K, with attn_v, ffn_down and the embedding in Q6_K
Q4_K_M = {f"blk.{i}.{n}.weight": "Q6_K" for i in range(2) for n in ("attn_v", "ffn_down")} | {"token_embd.weight": "Q6_K"}


@pytest.fixture(scope="module")
def hf_dir(request, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name in MADE_HERE:
            if name not in made:
                made[name] = MADE_HERE[name](tmp_path_factory.mktemp(f"gguf_src_{name}"))
            return made[name]
        return request.getfixturevalue(name)

    return get


@pytest.fixture(scope="module")
def k_quant_llama(tmp_path_factory) -> Path:
    """The Llama shape with rows of 256 values: whole K-quant blocks everywhere."""
    return tiny.make_tiny_llama(tmp_path_factory.mktemp("gguf_llama256"), seed=21, hidden_size=256,
                                intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def _float32(value):
    """``value`` with every float rounded to float32 (a file stores float32; a config's
    float64 computations, e.g. LongRoPE's attention factor, round to the same)."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, (list, tuple)):
        return [_float32(v) for v in value]
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    return value


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What each parameter holds, each product multiplies by and each norm scales by
    (Gemma's: 1 + w, which the file stores), float32."""
    out = {n: p.detach().float() for n, p in model.named_parameters()}
    out |= {alias: out[source] for alias, source in model.tied_weights.items()}
    for n, m in model.named_modules():
        if isinstance(m, QuantLinear) and ".parts." not in n:  # a mixed product's parts: in its dequantized()
            out[f"{n}.weight"] = m.dequantized()
        elif isinstance(m, RMSNorm) and m.offset:
            out[f"{n}.weight"] = m.offset + m.weight.detach().float()
    return out


def _logits_against_transformers(loaded, ref_dir: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32).eval()
    if state is not None:
        missing, unexpected = ref.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
        ref.tie_weights()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, loaded.config.vocab_size, (2, 37), generator=g)
    native = [m for m in loaded.model.modules() if isinstance(m, QuantLinear) and m.kernel is not None]
    with torch.inference_mode():
        want = ref(ids).logits.float()
        got = loaded.model.forward_nocache(ids)
        if native:  # blocks on the native kernels: their inputs rounded to 8 bits per block (test_qblocks.py)
            rel = float((got - want).norm() / want.norm())
            assert rel < 0.06 and float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.85, rel
            for m in native:  # the same blocks through torch: their dequantized weights, exactly
                m.kernel = None
            got = loaded.model.forward_nocache(ids)
    assert want.abs().max() > 0.1  # not a comparison of near-zero logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_file_loads_the_checkpoint_it_was_written_from(hf_dir, family: str, tmp_path: Path) -> None:
    src = hf_dir(family)
    path = write_gguf(src, tmp_path / "model.gguf")
    ours, direct = load_model(path, progress=False), load_model(src, progress=False)
    want = asdict(direct.config) | RENAMED.get(family, {})
    assert _float32(asdict(ours.config)) == _float32(want)  # every field read from the file
    assert ours.tokenizer.vocab_size == direct.tokenizer.vocab_size
    assert set(ours.eos_token_ids) >= set(direct.eos_token_ids)
    got, want = _weights(ours.model), _weights(direct.model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    _logits_against_transformers(ours, src)


def test_llama3_rope_factors_are_read_from_the_rope_freqs_tensor(tiny_llama3_rope_dir, tmp_path: Path) -> None:
    """Llama 3's scaling reaches a GGUF file as per-pair factors (``rope_freqs``), which
    llama.cpp divides the frequencies by; transformers computes the same frequencies
    another way, so they agree to float32 rounding, not bit for bit."""
    ours = load_model(write_gguf(tiny_llama3_rope_dir, tmp_path / "m.gguf"), progress=False)
    direct = load_model(tiny_llama3_rope_dir, progress=False)
    assert ours.config.rope_scaling["rope_type"] == "freq_factors"
    a, b = ours.model.model.rotary_emb.inv_freq, direct.model.model.rotary_emb.inv_freq
    torch.testing.assert_close(a, b, atol=0, rtol=1e-6)
    plain = 1.0 / 500_000.0 ** (torch.arange(0, 2 * a.numel(), 2).float() / (2 * a.numel()))
    assert not torch.allclose(a, plain)  # the factors were applied
    _logits_against_transformers(ours, tiny_llama3_rope_dir)


@pytest.mark.parametrize("served", ["dequantized", "blocks"])
@pytest.mark.parametrize("qtype", [q if q in ("Q4_1", "Q4_K_M") else pytest.param(q, marks=pytest.mark.slow)
                                   for q in QUANTIZED])  # fmt: skip
def test_quantized_file_serves_ggmls_dequantization(k_quant_llama: Path, qtype: str, served: str, tmp_path: Path) -> None:
    """Dequantized into float32 parameters, or kept in the stored blocks (QuantLinear.from_blocks:
    where the native kernels read them; forced here), the weights are ggml's."""
    path = write_gguf(k_quant_llama, tmp_path / "model.gguf", "Q4_K" if qtype == "Q4_K_M" else qtype,
                      types=Q4_K_M if qtype == "Q4_K_M" else None)  # fmt: skip
    stored = {t.type for t in GGUFFile.open(path).tensors.values()}
    assert stored == ({"F32", "Q4_K", "Q6_K"} if qtype == "Q4_K_M" else {"F32", qtype})
    ours = load_model(path, progress=False, keep_blocks=BLOCK_TYPES if served == "blocks" else frozenset())
    blocks = [m for n, m in ours.model.named_modules() if isinstance(m, QuantLinear) and ".parts." not in n]
    assert len(blocks) == (9 if served == "blocks" else 0)  # 2 x (q/k/v, o, gate/up, down) and the head
    if qtype == "Q4_K_M" and served == "blocks":  # q/k (Q4_K) and v (Q6_K) rows in one product
        assert ours.model.model.layers[0].self_attn.qkv_proj.fmt == "mixed"
    state = dequantized_state_dict(k_quant_llama, path)  # gguf.quants.dequantize of each stored weight
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(k_quant_llama, ref_dir)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    direct = load_model(ref_dir, progress=False)
    got, want = _weights(ours.model), _weights(direct.model)
    assert got.keys() == want.keys()
    for name in want:  # bit for bit: the served weights are ggml's dequantization of the blocks
        assert torch.equal(got[name], want[name]), name
    original = load_model(k_quant_llama, progress=False)
    assert not torch.equal(_weights(original.model)["lm_head.weight"], got["lm_head.weight"])  # it was quantized
    _logits_against_transformers(ours, k_quant_llama, state)


def test_a_tied_head_is_served_from_the_embeddings_blocks(tiny_llama_mqa_dir, tmp_path: Path) -> None:
    """llama.cpp multiplies by the stored token_embd for a tied head; so does the head kept
    in blocks, while the embedding's rows are its dequantized values."""
    path = write_gguf(tiny_llama_mqa_dir, tmp_path / "m.gguf", "Q8_0")
    ours = load_model(path, progress=False, keep_blocks=frozenset({"q8_0"}))
    head, embedding = ours.model.lm_head, ours.model.model.embed_tokens.weight
    assert isinstance(head, QuantLinear) and head.fmt == "q8_0" and ours.model.tied_weights == {}
    assert torch.equal(head.dequantized(), embedding)
    _logits_against_transformers(ours, tiny_llama_mqa_dir, dequantized_state_dict(tiny_llama_mqa_dir, path))


# ---- the file -----------------------------------------------------------------------


def test_header_parser_reads_what_ggufs_reader_reads(k_quant_llama: Path, tiny_gpt2_dir, tmp_path: Path) -> None:
    from gguf import GGUFReader

    for src, qtype in ((k_quant_llama, "Q4_K"), (tiny_gpt2_dir, "F16")):
        path = write_gguf(src, tmp_path / f"{src.name}.gguf", qtype)
        ours, theirs = GGUFFile.open(path), GGUFReader(str(path))
        want = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata.keys() == want.keys()
        for key, value in want.items():  # float32 scalars: the same float32 (ours spelled as its shortest decimal)
            mine = ours.metadata[key]
            assert mine == value or (isinstance(value, float) and np.float32(mine) == np.float32(value)), key
        assert list(ours.tensors) == [t.name for t in theirs.tensors]
        for t in theirs.tensors:
            mine = ours.tensors[t.name]
            assert (mine.type, mine.offset, mine.n_bytes) == (t.tensor_type.name, t.data_offset, t.n_bytes)
            assert mine.shape == tuple(reversed(t.shape.tolist()))
            assert np.array_equal(ours.raw(mine).reshape(-1), np.asarray(t.data).reshape(-1).view(np.uint8))


def test_fingerprint_is_over_the_tensors_as_stored(tiny_llama_dir, tmp_path: Path, capsys) -> None:
    path = write_gguf(tiny_llama_dir, tmp_path / "a.gguf", "Q8_0")
    ck = GGUFCheckpoint.open(path)
    first = ck.fingerprint(progress=True)
    assert "fingerprinting weights" in capsys.readouterr().err  # streamed with progress
    assert GGUFCheckpoint.open(shutil.copy(path, tmp_path / "b.gguf")).fingerprint(False) == first  # the bytes, not the name
    flipped = bytearray(path.read_bytes())
    t = ck.file.tensors["blk.1.ffn_down.weight"]
    flipped[t.offset + t.n_bytes // 2] ^= 1
    (tmp_path / "c.gguf").write_bytes(flipped)
    assert GGUFCheckpoint.open(tmp_path / "c.gguf").fingerprint(False) != first
    assert load_model(path, progress=False, keep_blocks=frozenset()).fingerprint == first  # exact adds nothing
    assert load_model(path, progress=False, keep_blocks=BLOCK_TYPES).fingerprint != first  # served another way
    assert GGUFCheckpoint.open(write_gguf(tiny_llama_dir, tmp_path / "d.gguf", "F32")).fingerprint(False) != first


# ---- refusals: one line naming the problem --------------------------------------------


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


def test_an_unsupported_tensor_type_is_refused_naming_the_tensor(tiny_llama_dir, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", "Q8_0", types={"blk.0.ffn_up.weight": "Q5_1"})
    with pytest.raises(ModelLoadError) as e:
        load_model(path, progress=False)
    assert _one_line(e) == (f"{path}: tensor 'blk.0.ffn_up.weight' is stored as Q5_1, which kvserve does not serve "
                            "(served: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K)")  # fmt: skip


def test_a_truncated_file_is_refused(tiny_llama_dir, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError) as e:
        load_model(cut, progress=False)
    assert _one_line(e).startswith(f"{cut}: truncated: tensor '") and f"the file has {len(data) - 100}" in str(e.value)
    cut.write_bytes(data[:2000])  # inside the vocabulary
    with pytest.raises(ModelLoadError) as e:
        load_model(cut, progress=False)
    assert _one_line(e) == f"{cut}: truncated: the file ends inside its metadata"


def test_an_unknown_architecture_is_refused(tiny_llama_dir, tmp_path: Path) -> None:
    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ModelLoadError) as e:
        load_model(path, progress=False)
    assert _one_line(e) == (f"{path}: unknown architecture 'mamba'; supported: gemma2, gemma3, gpt2, llama, phi3, "
                            "qwen2, qwen3")  # fmt: skip


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match="is a file, not a model directory or a GGUF file"):
        load_model(path, progress=False)
    path.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(100))
    with pytest.raises(ModelLoadError, match=r"GGUF version 1 is not supported \(2 and 3 are\)"):
        load_model(path, progress=False)


def test_missing_metadata_is_named(tiny_llama_dir, tmp_path: Path) -> None:
    import gguf

    src = write_gguf(tiny_llama_dir, tmp_path / "m.gguf")
    f = GGUFFile.open(src)
    w = gguf.GGUFWriter(tmp_path / "n.gguf", "llama")
    for key, value in f.metadata.items():
        if key not in ("general.architecture", "llama.attention.head_count", "GGUF.version"):
            _copy_key(w, key, value)
    for t in f.tensors.values():
        w.add_tensor(t.name, f.raw(t).view(np.float32).reshape(t.shape))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ModelLoadError) as e:
        load_model(tmp_path / "n.gguf", progress=False)
    assert _one_line(e) == f"{tmp_path / 'n.gguf'}: missing metadata 'llama.attention.head_count'"


def _copy_key(w, key: str, value) -> None:
    if isinstance(value, list):
        w.add_array(key, value)
    elif isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, value)


def test_the_engine_serves_a_gguf_file(tiny_llama_dir, tmp_path: Path) -> None:
    """Greedy through the engine (paged KV, the native decode step) from a Q8_0 file equals
    greedy from the directory holding its dequantized weights."""
    from tests.fixtures.engine import finished, make_engine, req, run

    path = write_gguf(tiny_llama_dir, tmp_path / "m.gguf", "Q8_0")
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(tiny_llama_dir, ref_dir)
    from safetensors.torch import save_file

    save_file(dequantized_state_dict(tiny_llama_dir, path), str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    outs = []
    for src in (path, ref_dir):
        engine = make_engine(load_model(src, progress=False))
        outs.append(finished(run(engine, [req("a", [1, 5, 9, 33, 7, 81, 4], n=16)])["a"]).output_token_ids)
        engine.close()
    assert outs[0] == outs[1] and len(outs[0]) == 16
