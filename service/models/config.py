"""Model configuration read from a checkpoint's ``config.json``.

One frozen dataclass, built by :meth:`ModelConfig.from_hf` from the parsed JSON
(meta-llama's ``ModelArgs(**params)`` manner): every field the models need, derived
fields computed in one place, never a guess from the folder name. Both the transformers
4.x spelling (``rope_theta`` + ``rope_scaling``) and the 5.x spelling
(``rope_parameters``) of the RoPE settings are understood.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping


class ModelLoadError(Exception):
    """A model directory cannot be loaded; the message names the file and the problem."""


# HF ``architectures`` entry -> the model file (family) that implements it.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
}
# Fallback when ``architectures`` is absent: ``model_type`` -> HF architecture.
_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
LAYER_TYPES = ("full_attention", "sliding_attention")

ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA_ACTS = ("silu", "swish")
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

    # ---- derived (one place) --------------------------------------------------------

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

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
        build = _from_llama if arch == "llama" else _from_gpt2
        try:
            cfg = build(d, source)
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


def _rope(d: Mapping[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalized rope_scaling) from either config spelling."""
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or None
    theta = float(d.get("rope_theta") or params.get("rope_theta") or 10000.0)
    if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    if scaling is None:
        return theta, None
    scaling = {k: v for k, v in dict(scaling).items() if k != "rope_theta"}
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in required[rope_type]:
        if key not in scaling:
            raise ModelLoadError(f"{source}: rope_scaling type {rope_type!r} needs {key!r}")
    return theta, {"rope_type": rope_type, **scaling}


def _from_llama(d: Mapping[str, Any], source: str) -> ModelConfig:
    act = d.get("hidden_act", "silu")
    if act not in _LLAMA_ACTS:
        raise ModelLoadError(f"{source}: unsupported hidden_act {act!r} for a Llama-family model")
    num_heads = int(d["num_attention_heads"])
    hidden = int(d["hidden_size"])
    theta, scaling = _rope(d, source)
    if d.get("partial_rotary_factor", 1.0) != 1.0 or (scaling or {}).get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor is not supported")
    model_type = str(d.get("model_type", "llama"))
    qwen2 = model_type == "qwen2" or d.get("architectures", [None])[0] == "Qwen2ForCausalLM"
    bias = bool(d.get("attention_bias", False))
    sliding, layer_types = _sliding(d, source, model_type, int(d["num_hidden_layers"]))
    return ModelConfig(
        architecture="llama",
        model_type=model_type,
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(d["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
        head_dim=int(d.get("head_dim") or hidden // num_heads),
        intermediate_size=int(d["intermediate_size"]),
        max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
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


def _from_gpt2(d: Mapping[str, Any], source: str) -> ModelConfig:
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
