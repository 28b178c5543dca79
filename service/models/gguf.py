"""A GGUF file (llama.cpp's and Ollama's checkpoint format) as kvserve serves a Hugging Face directory.

    ck = GGUFCheckpoint.open("SmolLM2-135M-Instruct.Q4_1.gguf")  # metadata only: no tensor read
    ck.config, ck.tokenizer, ck.eos_token_ids                      # as loading.py gets them from a directory
    ck.load_weights(model, progress, blocks)                       # every tensor into the model (``blocks``: kept as stored)
    ck.fingerprint(progress)                                       # sha256 of the tensors as stored

The file is memory-mapped and its header parsed here (``GGUFFile``: the metadata and the
tensor index; a tensor's bytes are read when it is copied or fingerprinted): gguf's own
``GGUFReader`` makes numpy arrays per string, 12-21 s for SmolLM2's 49k-token vocabulary
and merges on this project's busy 2-core host against 0.3-0.5 s here in the same runs,
and the tests check that both read the same. ggml's types, block sizes and dequantization are gguf's (``gguf.quants``). What
llama.cpp's ``convert_hf_to_gguf.py`` wrote is undone here, family by family, so the
families' model files take the file unchanged:

- the configuration: ``{arch}.*`` metadata -> the ``config.json`` the family's HF checkpoint
  has (``hf_config``), read by ``ModelConfig.from_hf`` like any other; per-layer facts the
  metadata leaves out are llama.cpp's (Gemma's sliding-window pattern and attention
  scale); facts stored as tensors are read from them (Llama 3's RoPE frequency factors,
  ``rope_freqs``; Phi-3's LongRoPE factors; a tied head: no ``output`` tensor; biases:
  their tensors);
- the tensor names (``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight``,
  the names gguf's ``TENSOR_NAMES`` gives each family);
- the ``llama`` architecture's Q and K rows, which the converter permutes for ggml's
  interleaved RoPE (``LlamaModel.permute``): put back (``unpermute``), rows only, so the
  same works on quantized blocks;
- Gemma's norm weights, stored as (1 + w): w again;
- the tokenizer: ``tokenizer.ggml.*`` -> ``tokenizer.Vocabulary`` (sentencepiece or
  byte-level BPE, control and user-defined tokens, bos and end-of-generation ids, the chat
  template).

Tensor types: ``TENSOR_TYPES`` says how each ggml type loads; a type it lacks is refused
naming the tensor. F32/F16/BF16 load as the model's dtype. Q8_0, Q4_0, Q4_1, Q5_0, Q4_K
and Q6_K product weights stay in their stored blocks (``quant.QuantLinear.from_blocks``,
the rows as the file has them; a q/k/v or gate/up group only when all its members do, a
tied head from the embedding's blocks) where the native kernels read that block type
(``kernel_block_types``, asked of ``QuantLinear.kernel_weights``); elsewhere, and for the
embedding, they are dequantized by ``gguf.quants.dequantize`` (ggml's own, bit-exact) into
the model's dtype. The fingerprint is over the tensors as stored, so it names the file's
weights whatever serves them; how the loader serves each type is mixed in, so KV computed
one way is never restored for the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import mmap
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from .config import ModelConfig, ModelLoadError
from .tokenizer import Tokenizer, Vocabulary

__all__ = ["GGUFCheckpoint", "GGUFFile", "TENSOR_TYPES", "TensorInfo", "is_gguf", "kernel_block_types", "read_tokenizer",
           "unpermute"]

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
_FINGERPRINT_VERSION = b"kvserve-gguf-fingerprint-v1"
_CHUNK = 8 << 20

# general.architecture -> (HF architectures entry, config.json model_type)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),  # Llama 2/3, TinyLlama, Mistral (written as llama by the converter)
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gpt2": ("GPT2LMHeadModel", "gpt2"),
}
# tensors that carry configuration (read into the config, not loaded as weights)
CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _float32_list(f: "GGUFFile", t: "TensorInfo") -> list[float]:
    """A small F32 tensor's values, each as the shortest decimal that rounds to it (as ``_Cursor.scalar``)."""
    return [float(str(v)) for v in f.raw(t).view(np.float32)]


def _dense(f: "GGUFFile", t: "TensorInfo") -> torch.Tensor:
    """F32 / F16 / BF16 values as stored (rows first)."""
    raw = f.raw(t)
    if t.type == "BF16":
        return torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(t.shape)
    return torch.from_numpy(raw.view(np.float32 if t.type == "F32" else np.float16).reshape(t.shape).copy())


def _dequantized(f: "GGUFFile", t: "TensorInfo") -> torch.Tensor:
    """A quantized tensor's values in float32, by ggml's dequantization (gguf.quants)."""
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(quants.dequantize(f.raw(t), GGMLQuantizationType[t.type]).reshape(t.shape))


# ggml type -> (the values a float parameter receives, the block type quant.QuantLinear keeps
# it in as stored (None: none)). A quantized product weight stays in its blocks where the
# native kernels read that block type (``kernel_block_types``); otherwise (and for the
# embedding and norms) it is dequantized by ggml's own code into the model's dtype.
TENSOR_TYPES: dict[str, tuple[Callable[["GGUFFile", "TensorInfo"], torch.Tensor], str | None]] = {
    "F32": (_dense, None),
    "F16": (_dense, None),
    "BF16": (_dense, None),
    "Q8_0": (_dequantized, "q8_0"),
    "Q4_0": (_dequantized, "q4_0"),
    "Q4_1": (_dequantized, "q4_1"),
    "Q5_0": (_dequantized, "q5_0"),  # llama-quantize's Q4_K on rows of no whole 256-value blocks
    "Q4_K": (_dequantized, "q4_k"),
    "Q6_K": (_dequantized, "q6_k"),
}


def kernel_block_types() -> frozenset[str]:
    """The block types (quant.BLOCK_TYPES) whose products the native kernels read as stored
    (``QuantLinear.kernel_weights``): GGUF weights of these types are served in their blocks."""
    from ..kernels.ops import BLOCK_FORMATS
    from .quant import BLOCK_TYPES, QuantLinear

    readable = set()
    for fmt in BLOCK_TYPES:
        values, size = BLOCK_FORMATS[fmt]
        probe = QuantLinear.from_blocks(fmt, torch.zeros(1, size, dtype=torch.uint8), (1, values))
        if probe.kernel_weights() is not None:
            readable.add(fmt)
    return frozenset(readable)


# products that fuse_projections joins into one: each group is kept in blocks only if all are
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` of a Q or K projection's rows
    (weights (rows, ...) of any dtype, a bias (rows,)): per head, ggml's interleaved
    rotary pairs back to the HF halves (as transformers' ``reverse_permute_weights``)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- the file ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the index: ggml type name ("F32", "Q4_K", ...), shape rows first
    (ggml's order reversed), where its bytes are."""

    name: str
    type: str
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file
    n_bytes: int


# GGUF value types -> (struct format, size) of the scalar ones (8: string, 9: array)
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}  # fmt: skip
_ARRAYS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


class _Cursor:
    """Reads GGUF's little-endian values off a buffer, front to back."""

    def __init__(self, buf: Any) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, kind: int) -> Any:
        fmt, size = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        # a float32 as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06):
        # the value the converter was given, as config.json spells it
        return float(str(np.float32(value))) if kind == 6 else value

    def string(self) -> str:
        n = self.scalar(10)
        if self.pos + n > len(self.buf):
            raise EOFError
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind != 9:
            return self.scalar(kind)
        item, n = self.scalar(4), self.scalar(10)
        if item == 8:
            return [self.string() for _ in range(n)]
        if item not in _ARRAYS:
            raise ValueError(f"arrays of value type {item} are not supported")
        dtype = np.dtype(_ARRAYS[item])
        if self.pos + n * dtype.itemsize > len(self.buf):
            raise EOFError
        values = np.frombuffer(self.buf, dtype, n, self.pos).tolist()
        self.pos += n * dtype.itemsize
        return values


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's metadata and tensor index, the file memory-mapped (``raw``: a
    tensor's bytes, read when used)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order
    buffer: Any  # the mmap

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Parse the header; ModelLoadError (naming the file) for a file that is not GGUF
        version 2 or 3, ends early (truncated), or names a tensor type ggml lacks."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        path = Path(path)
        try:
            with open(path, "rb") as fh:
                buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file
            raise ModelLoadError(f"{path}: cannot read the GGUF file ({e})") from None
        c = _Cursor(buf)
        try:
            if bytes(buf[:4]) != MAGIC:
                raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
            c.pos = 4
            version = c.scalar(4)
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
            n_tensors, n_kv = c.scalar(10), c.scalar(10)
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = c.string()
                metadata[key] = c.value(c.scalar(4))
            index = []
            for _ in range(n_tensors):
                name = c.string()
                dims = [c.scalar(10) for _ in range(c.scalar(4))]
                index.append((name, dims, c.scalar(4), c.scalar(10)))
        except (EOFError, struct.error, IndexError):
            raise ModelLoadError(f"{path}: truncated: the file ends inside its metadata") from None
        except (UnicodeDecodeError, KeyError, ValueError) as e:
            raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-c.pos // alignment) * alignment  # the tensor data, aligned
        tensors: dict[str, TensorInfo] = {}
        for name, dims, kind, offset in index:
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise ModelLoadError(f"{path}: tensor {name!r} has ggml type {kind}, which gguf does not know") from None
            block, size = GGML_QUANT_SIZES[qtype]
            elements = math.prod(dims)
            shape = tuple(int(d) for d in reversed(dims))
            if dims and dims[0] % block:
                raise ModelLoadError(f"{path}: tensor {name!r}: rows of {dims[0]} values are not whole {qtype.name} blocks")
            info = TensorInfo(name, qtype.name, shape, start + offset, elements // block * size)
            if info.offset + info.n_bytes > len(buf):
                raise ModelLoadError(f"{path}: truncated: tensor {name!r} ends at byte {info.offset + info.n_bytes}, "
                                     f"the file has {len(buf)}")  # fmt: skip
            if name in tensors:
                raise ModelLoadError(f"{path}: tensor {name!r} appears twice")
            tensors[name] = info
        return cls(path, version, metadata, tensors, buf)

    def raw(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as stored, (rows, bytes per row) uint8 (a view of the map)."""
        data = np.frombuffer(self.buffer, np.uint8, t.n_bytes, t.offset)
        return data.reshape(math.prod(t.shape[:-1]), -1) if len(t.shape) > 1 else data


# ---- metadata -------------------------------------------------------------------------


class _Meta:
    """A file's key/value metadata: reads, one-line errors naming the key."""

    def __init__(self, metadata: dict[str, Any], source: str) -> None:
        self.metadata, self.source = metadata, source

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key)
        if value is None:
            raise ModelLoadError(f"{self.source}: missing metadata {key!r}")
        return value


def hf_config(f: GGUFFile, meta: _Meta, arch: str) -> dict[str, Any]:
    """The HF ``config.json`` of the checkpoint this file was converted from, as far as
    the family's model needs it (ModelConfig.from_hf reads and checks it)."""
    a, tensors = arch, f.tensors
    hf_arch, model_type = ARCHITECTURES[arch]
    n_embd = int(meta.require(f"{a}.embedding_length"))
    n_head = int(meta.require(f"{a}.attention.head_count"))
    n_layer = int(meta.require(f"{a}.block_count"))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"{meta.source}: missing tensor 'token_embd.weight'")
    vocab = int(meta.get(f"{a}.vocab_size") or embd.shape[0])
    d: dict[str, Any] = {
        "architectures": [hf_arch], "model_type": model_type, "vocab_size": vocab,
        "max_position_embeddings": int(meta.require(f"{a}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"), "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }  # fmt: skip
    if arch == "gpt2":
        return {**d, "n_embd": n_embd, "n_head": n_head, "n_layer": n_layer, "n_positions": d["max_position_embeddings"],
                "n_inner": int(meta.get(f"{a}.feed_forward_length") or 4 * n_embd), "activation_function": "gelu_new",
                "layer_norm_epsilon": float(meta.get(f"{a}.attention.layer_norm_epsilon", 1e-5))}  # fmt: skip
    head_dim = int(meta.get(f"{a}.attention.key_length") or n_embd // n_head)
    d.update({
        "hidden_size": n_embd, "num_hidden_layers": n_layer, "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv") or n_head), "head_dim": head_dim,
        "intermediate_size": int(meta.require(f"{a}.feed_forward_length")),
        "rms_norm_eps": float(meta.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        # config.json's attention_bias puts a bias on the output projection too (Qwen2's q/k/v have one always)
        "attention_bias": "blk.0.attn_output.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    })  # fmt: skip
    theta = float(meta.get(f"{a}.rope.freq_base", 10_000.0))
    scaling = _rope_scaling(f, meta, a)
    window = int(meta.get(f"{a}.attention.sliding_window") or 0) or None
    if arch in ("gemma2", "gemma3"):
        # llama.cpp's: the window on all layers but every 2nd (Gemma 2) / 6th (Gemma 3), or
        # as the file says; attention scaled by head_dim^-1/2, by (hidden / heads)^-1/2 on
        # the 27B shapes (46 and 62 layers), or by the file's attention.scale
        pattern = meta.get(f"{a}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        sliding = pattern if isinstance(pattern, list) else [i % int(pattern) < int(pattern) - 1 for i in range(n_layer)]
        scale = meta.get(f"{a}.attention.scale")
        big = n_layer == (46 if arch == "gemma2" else 62)
        d.update({
            "hidden_activation": "gelu_pytorch_tanh", "sliding_window": window,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "query_pre_attn_scalar": float(scale) ** -2 if scale else (n_embd // n_head if big else head_dim),
            "attn_logit_softcapping": meta.get(f"{a}.attn_logit_softcapping"),
            "final_logit_softcapping": meta.get(f"{a}.final_logit_softcapping"),
        })  # fmt: skip
        if arch == "gemma3":
            full = {"rope_type": "default", "rope_theta": theta, **(scaling or {})}
            local = {"rope_type": "default", "rope_theta": float(meta.get(f"{a}.rope.freq_base_swa", 10_000.0))}
            d["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        else:
            d.update(rope_theta=theta, rope_scaling=scaling)
        return d
    d.update(rope_theta=theta, rope_scaling=scaling)
    if arch == "phi3":
        d["partial_rotary_factor"] = int(meta.get(f"{a}.rope.dimension_count") or head_dim) / head_dim
        d["sliding_window"] = window
        d["original_max_position_embeddings"] = int(meta.get(f"{a}.rope.scaling.original_context_length")
                                                    or d["max_position_embeddings"])  # fmt: skip
    elif int(meta.get(f"{a}.rope.dimension_count") or head_dim) != head_dim:
        raise ModelLoadError(f"{meta.source}: {a}.rope.dimension_count is not head_dim {head_dim}; partial rotary "
                             f"is supported for phi3 only")  # fmt: skip
    return d


def _rope_scaling(f: GGUFFile, meta: _Meta, a: str) -> dict[str, Any] | None:
    kind, tensors = meta.get(f"{a}.rope.scaling.type", "none"), f.tensors
    if "rope_factors_long.weight" in tensors:  # Phi-3's LongRoPE: the factors are tensors
        long, short = (_float32_list(f, tensors[f"rope_factors_{n}.weight"]) for n in ("long", "short"))
        scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                                   "original_max_position_embeddings": meta.get(f"{a}.rope.scaling.original_context_length")}
        if (attn := meta.get(f"{a}.rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = float(attn)
        return scaling
    if "rope_freqs.weight" in tensors:  # Llama 3's scaled frequencies, as factors per rotary pair
        return {"rope_type": "freq_factors", "factors": _float32_list(f, tensors["rope_freqs.weight"])}
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.require(f"{a}.rope.scaling.factor"))}
    raise ModelLoadError(f"{meta.source}: {a}.rope.scaling.type {kind!r} is not supported (none, linear; "
                         "Llama 3 and LongRoPE factors as tensors)")  # fmt: skip


# ---- tensor names ---------------------------------------------------------------------

# GGUF name (outside the blocks, and inside a block after "blk.N.") -> the family's parameter,
# by architecture family; ".weight" / ".bias" carry over
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_PHI3_BLOCK = {**_LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GEMMA_BLOCK = {**_LLAMA_BLOCK, "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}  # fmt: skip
_GPT2_TOP = {"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
             "output": "lm_head"}  # fmt: skip
_GPT2_BLOCK = {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
               "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}  # fmt: skip
# architecture -> (top-level names, block names, the blocks' parameter prefix)
TENSOR_NAMES: dict[str, tuple[dict[str, str], dict[str, str], str]] = {
    "llama": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
    "qwen2": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
    "qwen3": (_LLAMA_TOP, _LLAMA_BLOCK, "model.layers"),
    "phi3": (_LLAMA_TOP, _PHI3_BLOCK, "model.layers"),
    "gemma2": (_LLAMA_TOP, _GEMMA_BLOCK, "model.layers"),
    "gemma3": (_LLAMA_TOP, _GEMMA_BLOCK, "model.layers"),
    "gpt2": (_GPT2_TOP, _GPT2_BLOCK, "transformer.h"),
}


def parameter_name(arch: str, name: str) -> str | None:
    """The family's parameter for GGUF tensor ``name`` (None: not one this family has)."""
    top, block, prefix = TENSOR_NAMES[arch]
    stem, dot, kind = name.rpartition(".")
    if not dot or kind not in ("weight", "bias"):
        return None
    if stem.startswith("blk."):
        _, index, rest = stem.split(".", 2) if stem.count(".") >= 2 else ("", "", "")
        ours = block.get(rest)
        return f"{prefix}.{index}.{ours}.{kind}" if ours and index.isdigit() else None
    ours = top.get(stem)
    return f"{ours}.{kind}" if ours else None


# ---- the tokenizer --------------------------------------------------------------------


def vocabulary(meta: _Meta) -> Vocabulary:
    """``tokenizer.ggml.*`` (and the chat template) as a ``tokenizer.Vocabulary``."""
    tokens = meta.require("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    if len(types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
        raise ModelLoadError(f"{meta.source}: tokenizer.ggml.token_type / scores do not have one entry per token")
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding", "eot", "eom")}
    for key, i in ids.items():
        if i is not None and not 0 <= int(i) < len(tokens):
            raise ModelLoadError(f"{meta.source}: tokenizer.ggml.{key}_token_id {i} is not a token id")
    return Vocabulary(
        model=meta.require("tokenizer.ggml.model"),
        tokens=tokens,
        types=[int(t) for t in types],
        scores=scores,
        merges=meta.get("tokenizer.ggml.merges"),
        pre=meta.get("tokenizer.ggml.pre", "default"),
        bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"], pad_id=ids["padding"],
        end_ids=tuple(i for i in (ids["eot"], ids["eom"]) if i is not None),
        add_bos=meta.get("tokenizer.ggml.add_bos_token"),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
        chat_template=meta.get("tokenizer.chat_template"),
    )  # fmt: skip


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer a GGUF file describes (a vocabulary-only file too)."""
    f = GGUFFile.open(path)
    return Tokenizer.from_vocabulary(vocabulary(_Meta(f.metadata, str(f.path))), str(f.path))


# ---- the checkpoint -------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFCheckpoint:
    """One GGUF file, its metadata read: what loading.py needs of a checkpoint."""

    file: GGUFFile
    arch: str
    raw_config: dict[str, Any]  # the HF config.json this file stands for (hf_config)
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]

    @property
    def path(self) -> Path:
        return self.file.path

    @classmethod
    def open(cls, path: str | Path) -> "GGUFCheckpoint":
        """Read ``path``'s metadata and tensor index (no tensor data); ModelLoadError (one
        line, naming the file) for a file that is not GGUF, a truncated one, an unknown
        architecture or tokenizer, or metadata a supported family cannot have."""
        f = GGUFFile.open(path)
        source = str(f.path)
        meta = _Meta(f.metadata, source)
        arch = meta.require("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{source}: unknown architecture {arch!r}; supported: {', '.join(sorted(ARCHITECTURES))}")
        raw = hf_config(f, meta, arch)
        config = ModelConfig.from_hf(raw, source=source)
        tokenizer = Tokenizer.from_vocabulary(vocabulary(meta), source)
        if tokenizer.vocab_size > config.vocab_size:
            raise ModelLoadError(f"{source}: the tokenizer has {tokenizer.vocab_size} tokens but token_embd.weight "
                                 f"has {config.vocab_size} rows")  # fmt: skip
        eos = tokenizer.eos_token_ids or config.eos_token_ids
        return cls(f, arch, raw, config, tokenizer, tuple(eos))

    # ---- weights ----------------------------------------------------------------------

    def load_weights(self, model: nn.Module, progress: bool = False, blocks: frozenset[str] = frozenset()) -> None:
        """Fill ``model`` from the file: every tensor into the parameter of the same meaning
        (``TENSOR_TYPES``' values; the llama Q/K rows unpermuted, Gemma's norms as w), and a
        product whose weight is stored in one of the ``blocks`` types replaced by a
        ``QuantLinear`` over its stored rows (a tied head too, from the embedding's rows);
        ModelLoadError for a tensor of a type not served, of no parameter, of the wrong
        shape, or a parameter no tensor fills."""
        from tqdm import tqdm

        from .layers import Linear
        from .quant import QuantLinear

        params = dict(model.named_parameters())  # tied aliases appear once, under their source name
        aliases = model.tied_weights
        linears = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Linear)}
        path, source = self.path, dict(self._tensor_of)
        if "lm_head.weight" in aliases:  # a tied head is the embedding, whatever else the file holds
            source["lm_head.weight"] = "token_embd.weight"
        kept = self._kept_in_blocks(linears, blocks, source)
        found: set[str] = set()
        for name, t in tqdm(self.file.tensors.items(), desc="loading tensors", unit="tensor", disable=not progress):
            if name in CONFIG_TENSORS:
                continue
            if t.type not in TENSOR_TYPES:
                raise ModelLoadError(f"{path}: tensor {name!r} is stored as {t.type}, which kvserve does not serve "
                                     f"(served: {', '.join(TENSOR_TYPES)})")  # fmt: skip
            ours = parameter_name(self.arch, name)
            if ours in aliases:  # e.g. an output.weight written next to a tied embedding
                continue
            if ours is None or ours not in params:
                raise ModelLoadError(f"{path}: unexpected tensor {name!r} (no such parameter in the {self.arch} model)")
            want = tuple(params[ours].shape)
            if t.shape != want:
                raise ModelLoadError(f"{path}: tensor {name!r} has shape {list(t.shape)}, expected {list(want)}")
            if ours in kept:  # the stored rows (the bias, if any, is another tensor, loaded as values)
                rows = torch.from_numpy(self.file.raw(t).copy())
                found.add(ours)
                kept[ours] = self._unpermute(ours, rows)
                continue
            values = self._unpermute(ours, TENSOR_TYPES[t.type][0](self.file, t))
            if self.arch in ("gemma2", "gemma3") and ours.endswith("norm.weight"):
                values = values.float() - 1.0  # the file's (1 + w); exact for stored values in [0.5, 2]
            params[ours].data.copy_(values)
            found.add(ours)
        missing = [n for n in params if n not in found]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ModelLoadError(f"{path}: missing tensor(s) for {shown}")
        if "lm_head.weight" in kept and "lm_head.weight" in aliases:  # a tied head reads the embedding's blocks
            kept["lm_head.weight"] = torch.from_numpy(self.file.raw(self.file.tensors["token_embd.weight"]).copy())
            model.tied = None  # no alias any more: the embedding keeps its values, the head the blocks
        for weight, rows in kept.items():
            module = weight.removesuffix(".weight")
            old = model.get_submodule(module)
            fmt = TENSOR_TYPES[self.file.tensors[source[weight]].type][1]
            bias = None if old.bias is None else old.bias.detach().clone()
            parent, _, attr = module.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr,
                    QuantLinear.from_blocks(fmt, rows, (old.out_features, old.in_features), bias))  # fmt: skip

    def _unpermute(self, ours: str, values: torch.Tensor) -> torch.Tensor:
        """The llama architecture's Q / K rows (weights, biases, stored blocks) in HF's order."""
        if self.arch == "llama" and ours.endswith(("q_proj.weight", "q_proj.bias")):
            return unpermute(values, self.config.num_heads)
        if self.arch == "llama" and ours.endswith(("k_proj.weight", "k_proj.bias")):
            return unpermute(values, self.config.num_kv_heads)
        return values

    @functools.cached_property
    def _tensor_of(self) -> dict[str, str]:
        """Parameter -> the GGUF tensor it is read from (a tied head: the embedding)."""
        names = {ours: n for n in self.file.tensors if (ours := parameter_name(self.arch, n)) is not None}
        if "output.weight" not in self.file.tensors and "token_embd.weight" in self.file.tensors:
            names.setdefault("lm_head.weight", "token_embd.weight")
        return names

    def _kept_in_blocks(self, linears: set[str], blocks: frozenset[str], source: dict[str, str]) -> dict[str, Any]:
        """The product weights to serve in their stored blocks (the values: filled by
        load_weights): those stored (``source``: parameter -> tensor) in a ``blocks`` type
        whose fused siblings are too; a tied head when the embedding is."""
        def in_blocks(weight: str) -> bool:
            name = source.get(weight)
            return name is not None and TENSOR_TYPES.get(self.file.tensors[name].type, (None, None))[1] in blocks

        kept = {w: None for w in linears if in_blocks(w)}
        for w in list(kept):
            parent, _, leaf = w.removesuffix(".weight").rpartition(".")
            group = next((g for g in _FUSED if leaf in g), (leaf,))
            if any(f"{parent}.{s}.weight" in linears and f"{parent}.{s}.weight" not in kept for s in group):
                kept.pop(w)
        return kept

    def served_as(self, blocks: frozenset[str] = frozenset()) -> dict[str, str]:
        """ggml type -> how this file's tensors of that type are served: "values" (as the
        model's dtype) or "blocks" (product weights kept as stored, where ``blocks`` has the
        type's block type)."""
        types = sorted({t.type for t in self.file.tensors.values() if t.type in TENSOR_TYPES})
        return {name: "blocks" if TENSOR_TYPES[name][1] in blocks else "values" for name in types}

    def fingerprint(self, progress: bool | None = None, blocks: frozenset[str] = frozenset()) -> str:
        """Hex sha256 over the config (``raw_config``), how each type is served
        (``served_as(blocks)``), and every tensor's name, type, shape and bytes as stored
        (streamed: ``progress`` shows them; None: on a TTY). Any byte of any tensor changes it."""
        from tqdm import tqdm

        if progress is None:
            progress = sys.stderr.isatty()
        h = hashlib.sha256(_FINGERPRINT_VERSION)
        for part in (self.raw_config, self.served_as(blocks)):
            canonical = json.dumps(part, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
            h.update(len(canonical).to_bytes(8, "little") + canonical)
        tensors = self.file.tensors.values()
        with tqdm(total=sum(t.n_bytes for t in tensors), desc="fingerprinting weights", unit="B", unit_scale=True,
                  disable=not progress) as bar:  # fmt: skip
            for t in tensors:
                head = f"{t.name}:{t.type}:{list(t.shape)}:{t.n_bytes}".encode()
                h.update(len(head).to_bytes(8, "little") + head)
                for start in range(t.offset, t.offset + t.n_bytes, _CHUNK):
                    end = min(start + _CHUNK, t.offset + t.n_bytes)
                    h.update(self.file.buffer[start:end])
                    bar.update(end - start)
        return h.hexdigest()
