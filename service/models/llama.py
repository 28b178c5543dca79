"""Llama-family decoder (Llama 2/3, TinyLlama, Mistral, Qwen2; Qwen3 and Phi-3 build on
it), top to bottom.

    x = embed(ids)
    for each layer:
        x = x + Attention(RMSNorm(x))      # RoPE on q/k, grouped-query attention, paged KV,
                                           # sliding window on the layers that have one
        x = x + SwiGLU(RMSNorm(x))
    logits = lm_head(RMSNorm(x))

Module and parameter names follow the HF checkpoint (``model.layers.0.self_attn.q_proj``,
...), so a state dict loads by name with no renaming; q/k/v and gate/up are fused into
one product each after loading (``fuse``). The forward and the loader's contract are
``layers.CausalLM``'s.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kv.cache import BatchLayout, KVPool
from .config import ModelConfig
from .layers import CausalLM, DecoderEnds, DecoderLayer, GatedMLP, Linear, PagedAttention, Rope, RMSNorm, rope_span
from .rope import Rotary


class Block(nn.Module):
    rope_group = 0

    def __init__(self, config: ModelConfig, layer_idx: int, fused: bool = False) -> None:
        super().__init__()
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.norm_eps)
        self.self_attn = PagedAttention(config, layer_idx, fused=fused)
        self.post_attention_layernorm = RMSNorm(d, config.norm_eps)
        self.mlp = GatedMLP(d, config.intermediate_size, config.mlp_bias, "silu", fused=fused)

    def decoder_layer(self) -> DecoderLayer:
        """This block for the decode step backends (Qwen3's per-head norms are its attention's)."""
        return DecoderLayer(self.self_attn, self.input_layernorm, self.post_attention_layernorm, self.mlp)

    def forward(self, x: Tensor, rope: Rope, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        # in place: x is the model's own running tensor (the embedding's output, never shared)
        x = x.add_(self.self_attn(self.input_layernorm(x), rope, layout, kv))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    """The checkpoint's ``model.`` prefix."""

    def __init__(self, config: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, fused) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = Rotary(config.rotary_dim, config.rope_theta, config.rope_scaling)


class LlamaForCausalLM(CausalLM):
    fused = False  # q/k/v and gate/up stored as one product each in the checkpoint (Phi-3)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config, self.fused)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied = ("lm_head.weight", "model.embed_tokens.weight") if config.tie_word_embeddings else None
        self.tie_weights()

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)  # (B, T, D)

    def ropes(self, positions: Tensor, dtype: torch.dtype, layout: BatchLayout | None) -> tuple[Rope, ...]:
        return (self.model.rotary_emb(positions, dtype, span=rope_span(positions, layout)),)  # (cos, sin) (B, T, 1, rot)

    def rope_tables(self, length: int, dtype: torch.dtype = torch.float32,
                    device: torch.device = torch.device("cpu")) -> tuple[Rope, ...]:
        return (self.model.rotary_emb.table(length, dtype, device),)  # LongRoPE (Phi-3): short rows, then long

    def head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(x)).float()

    def decoder_ends(self) -> DecoderEnds:
        return DecoderEnds(self.model.embed_tokens.weight, 1.0, self.model.norm, self.lm_head)
