"""Model configuration read from a checkpoint's ``config.json``.

One frozen dataclass, built by :meth:`ModelConfig.from_hf` from the parsed JSON
(meta-llama's ``ModelArgs(**params)`` manner): every field the models need, derived
fields computed in one place, never a guess from the folder name. Both the transformers
4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x spelling
(``rope_parameters``) of the RoPE settings are understood.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping


class ModelLoadError(Exception):
    """A model directory cannot be loaded; the message names the file and the problem."""


# HF ``architectures`` entry -> the model file (family) that implements it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "Phi3ForCausalLM": "phi3",
    "GPT2LMHeadModel": "gpt2",
}
# Fallback when ``architectures`` is absent: ``model_type`` -> HF architecture.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
_ARCH_MODEL_TYPES = {arch: model_type for model_type, arch in _MODEL_TYPES.items()}
LAYER_TYPES = ("full_attention", "sliding_attention")

# "freq_factors": each rotary pair's frequency divided by its factor, as a GGUF file stores Llama 3's
# scaling (its rope_freqs tensor, llama.cpp's freq_factors); not a config.json spelling
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "freq_factors")
_LLAMA_ACTS = ("silu", "swish")
_GEMMA_ACTS = ("gelu_pytorch_tanh", "gelu_new", "gelu")
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the model files need to build a network. Immutable; build with ``from_hf``."""

    architecture: str  # the model file (family): "llama" | "gpt2" | ...
    model_type: str  # config.json's model_type, e.g. "llama", "mistral", "qwen2", "gpt2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # == num_heads: MHA; 1: MQA; otherwise GQA
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    hidden_act: str  # "silu" (llama) | "gelu_new"/"gelu" (gpt2)
    rope_theta: float  # unused by gpt2
    rope_scaling: dict[str, Any] | None  # normalized: {"rope_type": "linear"|"llama3", ...}
    attention_bias: bool  # bias on q/k/v projections (Llama attention_bias, Qwen2, GPT-2)
    attention_out_bias: bool  # bias on the output projection (Llama attention_bias, GPT-2)
    mlp_bias: bool
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None  # window of the "sliding_attention" layers (None: no window)
    layer_types: tuple[str, ...] = ()  # per layer: "full_attention" | "sliding_attention"; (): all full
    hf_architecture: str = ""  # the HF ``architectures`` name, e.g. "MistralForCausalLM"
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    partial_rotary_factor: float = 1.0  # RoPE on the first head_dim * factor dims (Phi-4-mini)
    # Gemma 2/3
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim's)
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3; None: rope_theta)
    local_rope_scaling: dict[str, Any] | None = None  # ... and their scaling

    # ---- derived (one place) --------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Head dims that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def longrope_threshold(self) -> int | None:
        """LongRoPE: a sequence longer than this uses the long factors (None: no LongRoPE)."""
        if self.rope_scaling is None or self.rope_scaling["rope_type"] != "longrope":
            return None
        return int(self.rope_scaling["original_max_position_embeddings"])

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + generation) this config serves exactly (a sliding
        window limits what a layer attends to, not the context)."""
        return self.max_position_embeddings

    def layer_window(self, layer_idx: int) -> int | None:
        """The sliding window of layer ``layer_idx`` (keys older than it are masked); None: full attention."""
        if self.sliding_window is None or not self.layer_types:
            return None
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF ``config.json``; ``source`` names the file in errors.

        Raises ModelLoadError for an unknown architecture, a missing required key, an
        unsupported feature (RoPE type, activation, ...) or inconsistent sizes.
        """
        hf_arch = _hf_architecture(d, source) or _MODEL_TYPES.get(d.get("model_type", ""))
        arch = ARCHITECTURES.get(hf_arch) if hf_arch else None
        if arch is None:
            known = ", ".join(sorted(ARCHITECTURES))
            what = hf_arch or f"model_type {d.get('model_type')!r}"
            raise ModelLoadError(f"{source}: unknown architecture {what}; supported: {known}")
        if not d.get("model_type"):  # e.g. {"architectures": ["Qwen2ForCausalLM"], ...}
            d = {**d, "model_type": _ARCH_MODEL_TYPES[hf_arch]}
        build = {"gemma": _from_gemma, "gpt2": _from_gpt2}.get(arch, _from_llama)
        try:
            cfg = build(d, source, arch)
        except KeyError as e:
            raise ModelLoadError(f"{source}: missing required key {e.args[0]!r} for {arch}") from None
        cfg = replace(cfg, hf_architecture=hf_arch)
        cfg._check(source)
        return cfg

    def _check(self, source: str) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"{source}: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"{source}: head_dim {self.head_dim} must be even")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ModelLoadError(
                f"{source}: partial_rotary_factor {self.partial_rotary_factor} gives {self.rotary_dim} rotary dims "
                f"of head_dim {self.head_dim}; need an even number > 0"
            )
        per_pair = {"longrope": ("short_factor", "long_factor"), "freq_factors": ("factors",)}
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            for key in per_pair.get(scaling["rope_type"], ()) if scaling is not None else ():
                if len(scaling[key]) != self.rotary_dim // 2:
                    raise ModelLoadError(
                        f"{source}: rope_scaling {key} has {len(scaling[key])} entries; "
                        f"need rotary dims / 2 = {self.rotary_dim // 2}"
                    )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"{source}: sliding_window must be > 0, got {self.sliding_window}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"{source}: layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )


def _hf_architecture(d: Mapping[str, Any], source: str) -> str | None:
    archs = d.get("architectures")
    if not archs:
        return None
    if not isinstance(archs, list) or len(archs) != 1:
        raise ModelLoadError(f"{source}: expected one entry in 'architectures', got {archs!r}")
    return str(archs[0])


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(d: Mapping[str, Any], source: str, params: Mapping[str, Any] | None = None,
          default_theta: float = 10000.0) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from either config spelling.

    ``params``: one layer type's entry of a per-layer-type ``rope_parameters`` (Gemma 3)."""
    if params is None:
        params = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or None
        theta = float(d.get("rope_theta") or params.get("rope_theta") or default_theta)
    else:
        params, scaling = dict(params), None
        theta = float(params.get("rope_theta") or default_theta)
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return theta, None
    drop = ("rope_theta", "partial_rotary_factor")
    scaling = {k: v for k, v in dict(scaling).items() if k not in drop}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "su":  # Phi-3's first name for LongRoPE
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, _longrope(d, source, scaling)
    required = {"linear": ("factor",), "freq_factors": ("factors",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in required[rope_type]:
        if key not in scaling:
            raise ModelLoadError(f"{source}: rope_scaling type {rope_type!r} needs {key!r}")
    return theta, {"rope_type": rope_type, **scaling}


def _longrope(d: Mapping[str, Any], source: str, scaling: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE as transformers computes it: short/long factors, the switch length
    (``original_max_position_embeddings``) and the cos/sin scale (``attention_factor``,
    default sqrt(1 + ln(factor) / ln(original)) with factor = max / original positions)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise ModelLoadError(f"{source}: rope_scaling type 'longrope' needs {key!r} (a list)")
    # transformers' Phi3Config defaults: 4096 for both lengths
    original = int(scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
                   or 4096)
    factor = scaling.get("factor") or float(d.get("max_position_embeddings", 4096)) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", "short_factor": [float(f) for f in scaling["short_factor"]],
            "long_factor": [float(f) for f in scaling["long_factor"]],
            "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}


def _partial_rotary(d: Mapping[str, Any]) -> float:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for source in (d, params, scaling):
        if isinstance(source, Mapping) and source.get("partial_rotary_factor") is not None:
            return float(source["partial_rotary_factor"])
    return 1.0


def _from_llama(d: Mapping[str, Any], source: str, arch: str) -> ModelConfig:
    """Llama, Mistral, Qwen2 (llama.py), Qwen3 (qwen3.py) and Phi-3 (phi3.py) configs."""
    act = d.get("hidden_act", "silu")
    if act not in _LLAMA_ACTS:
        raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} for {arch}")
    num_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    theta, scaling = _rope(d, source)
    partial = _partial_rotary(d)
    if partial != 1.0 and arch != "phi3":
        raise ModelLoadError(f"{source}: partial_rotary_factor is not supported for {arch}")
    if scaling is not None and scaling["rope_type"] == "longrope" and arch != "phi3":
        raise ModelLoadError(f"{source}: rope_scaling type 'longrope' is only supported for Phi-3")
    model_type = str(d.get("model_type", "llama"))
    qwen2 = model_type == "qwen2" or d.get("architectures", [None])[0] == "Qwen2ForCausalLM"
    bias = bool(d.get("attention_bias", False))
    sliding, layer_types = _sliding(d, source, model_type, int(d["num_hidden_layers"]))
    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or hidden // num_heads),
        intermediate_size=int(d["intermediate_size"]),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096 if arch == "phi3" else 2048)),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        hidden_act="silu",
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bias or qwen2,  # Qwen2: q/k/v always carry a bias, o_proj never
        attention_out_bias=bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
        sliding_window=sliding,
        layer_types=layer_types,
        qk_norm=arch == "qwen3",
        partial_rotary_factor=partial,
    )


def _from_gemma(d: Mapping[str, Any], source: str, arch: str) -> ModelConfig:
    """Gemma 2 and Gemma 3 (text) configs; absent keys take transformers' defaults."""
    gemma3 = d.get("model_type") == "gemma3_text" or d.get("architectures", [None])[0] == "Gemma3ForCausalLM"
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GEMMA_ACTS:
        raise ModelLoadError(f"{source}: unsupported hidden_activation {act!r} for Gemma; supported: {_GEMMA_ACTS}")
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: Gemma option use_bidirectional_attention=true is not supported")
    if _partial_rotary(d) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor is not supported for Gemma")
    num_layers = int(d["num_hidden_layers"])
    num_heads = int(d.get("num_attention_heads", 8))
    layer_types = _layer_types(d, source, num_layers)
    if layer_types is None:
        pattern = int(d.get("sliding_window_pattern", 6)) if gemma3 else 2
        layer_types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    window = d.get("sliding_window", 4096)
    local_theta, local_scaling = None, None
    params = d.get("rope_parameters")
    if gemma3 and isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        theta, scaling = _rope(d, source, params.get("full_attention") or {}, default_theta=1_000_000.0)
        local_theta, local_scaling = _rope(d, source, params.get("sliding_attention") or {}, default_theta=10_000.0)
    elif gemma3:
        theta, scaling = _rope(d, source, default_theta=1_000_000.0)
        local_theta = float(d.get("rope_local_base_freq", 10_000.0))
    else:
        theta, scaling = _rope(d, source)
    for sc in (scaling, local_scaling):
        if sc is not None and sc["rope_type"] == "longrope":
            raise ModelLoadError(f"{source}: rope_scaling type 'longrope' is only supported for Phi-3")
    softcap_defaults = (None, None) if gemma3 else (50.0, 30.0)
    attn_cap = d.get("attn_logit_softcapping", softcap_defaults[0])
    final_cap = d.get("final_logit_softcapping", softcap_defaults[1])
    bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        model_type=str(d.get("model_type", "gemma3_text" if gemma3 else "gemma2")),
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or 4),
        head_dim=int(d.get("head_dim") or 256),
        intermediate_size=int(d["intermediate_size"]),
        max_position_embeddings=int(d.get("max_position_embeddings", 131_072 if gemma3 else 8192)),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        hidden_act=act,
        rope_theta=theta,
        rope_scaling=scaling,
        attention_bias=bias,
        attention_out_bias=bias,
        mlp_bias=False,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id", 2),
        eos_token_ids=_eos_ids(d.get("eos_token_id", 1)),
        sliding_window=int(window) if window else None,
        layer_types=layer_types if window else (),
        qk_norm=gemma3,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
        attn_logit_softcapping=float(attn_cap) if attn_cap else None,
        final_logit_softcapping=float(final_cap) if final_cap else None,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _layer_types(d: Mapping[str, Any], source: str, num_layers: int) -> tuple[str, ...] | None:
    """config.json's ``layer_types`` checked; None when absent."""
    types = d.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or any(t not in LAYER_TYPES for t in types):
        raise ModelLoadError(f"{source}: unsupported layer_types {types!r}; supported entries: {LAYER_TYPES}")
    if len(types) != num_layers:
        raise ModelLoadError(f"{source}: layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(types)


def _sliding(d: Mapping[str, Any], source: str, model_type: str, num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) of a Llama-family config, as transformers reads them.

    Mistral (and Phi-3): every layer slides when ``sliding_window`` is set. Qwen2/Qwen3:
    only with ``use_sliding_window``, on the layers ``layer_types`` marks (default: from
    ``max_window_layers`` on). Llama has no window.
    """
    window = d.get("sliding_window")
    if model_type in ("qwen2", "qwen3"):
        if not d.get("use_sliding_window", False):
            window = None
        types = _layer_types(d, source, num_layers)
        if types is None:
            first = int(d.get("max_window_layers", 28))
            types = tuple("sliding_attention" if window is not None and i >= first else "full_attention"
                          for i in range(num_layers))
    elif model_type in ("mistral", "phi3"):
        types = ("sliding_attention",) * num_layers
    else:
        window = None
        types = ()
    if window is None:
        return None, ()
    return int(window), types


def _from_gpt2(d: Mapping[str, Any], source: str, arch: str = "gpt2") -> ModelConfig:
    act = d.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTS:
        raise ModelLoadError(f"{source}: unsupported activation_function {act!r} for GPT-2")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if d.get(flag):
            raise ModelLoadError(f"{source}: GPT-2 option {flag}=true is not supported")
    if d.get("scale_attn_weights", True) is False:
        raise ModelLoadError(f"{source}: GPT-2 option scale_attn_weights=false is not supported")
    hidden = int(d["n_embd"])
    num_heads = int(d["n_head"])
    return ModelConfig(
        architecture="gpt2",
        model_type=str(d.get("model_type", "gpt2")),
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(d["n_layer"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        intermediate_size=int(d.get("n_inner") or 4 * hidden),
        max_position_embeddings=int(d.get("n_positions", 1024)),
        norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        hidden_act=act,
        rope_theta=0.0,
        rope_scaling=None,
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_eos_ids(d.get("eos_token_id")),
    )
