"""Gemma 2 and Gemma 3 (text), top to bottom.

    x = embed(ids) * sqrt(hidden)
    for each layer (sliding-window and global layers interleaved, per ``layer_types``):
        h = RMSNorm(x)                                     # every RMSNorm here scales by (1 + w)
        q, k, v = q_proj(h), k_proj(h), v_proj(h)
        q, k = q_norm(q), k_norm(k)                        # Gemma 3: per-head RMSNorm
        q, k = RoPE(q), RoPE(k)                            # Gemma 3: local base on sliding layers
        s = q k^T * query_pre_attn_scalar^-1/2             # Gemma 2: s = cap * tanh(s / cap)
        x = x + RMSNorm(o_proj(softmax(s + mask) v))       # post-attention norm
        x = x + RMSNorm(down(gelu_tanh(gate(h')) * up(h')))  # h' = RMSNorm(x): pre/post-FF norms
    logits = lm_head(RMSNorm(x))                           # tied; Gemma 2: cap * tanh(logits / cap)

Names follow the HF checkpoint (``model.layers.0.pre_feedforward_layernorm``, ...). What
is Gemma's own is here: the sandwich norms, the embedding scale, the soft-caps (attention
soft-capping runs the scores explicitly: SDPA has no soft-cap) and the local RoPE;
attention, the (1 + w) RMSNorm, GeGLU and the contracts are ``layers``'.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..kv.cache import BatchLayout, KVPool
from .config import ModelConfig
from .layers import CausalLM, DecoderEnds, DecoderLayer, GatedMLP, Linear, PagedAttention, Rope, RMSNorm, rope_span
from .rope import Rotary


def softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool,
                         scale: float, cap: float) -> Tensor:
    """softmax(cap * tanh(q k^T * scale / cap) + mask) v, grouped-query.

    q (B, nh, T, hd), k/v (B, n_kv, C, hd) -> (B, nh, T, hd)."""
    B, nh, T, hd = q.shape
    n_kv, C = k.shape[1], k.shape[2]
    qg = q.reshape(B, n_kv, nh // n_kv, T, hd)  # (B, n_kv, g, T, hd): the heads sharing each kv head
    scores = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale  # (B, n_kv, g, T, C)
    scores = torch.tanh(scores / cap) * cap
    if is_causal:
        mask = torch.zeros(T, C, dtype=q.dtype, device=q.device).masked_fill_(
            torch.ones(T, C, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    if mask is not None:
        scores = scores + (mask[:, :, None] if mask.dim() == 4 else mask)  # (B, 1, 1, T, C) or (T, C)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v[:, :, None]).reshape(B, nh, T, hd)  # (B, nh, T, hd)


class Attention(PagedAttention):
    """``layers.PagedAttention`` scaled by query_pre_attn_scalar^-1/2, (1 + w) q/k norms
    (Gemma 3) and Gemma 2's soft-capped scores."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx, scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
                         norm_offset=1.0)  # fmt: skip
        self.softcap = config.attn_logit_softcapping

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        if self.softcap is not None:  # SDPA has no soft-cap
            return softcapped_attention(q, k, v, mask, is_causal, self.scale, self.softcap)
        return super().sdpa(q, k, v, mask, is_causal)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.norm_eps
        # Gemma 3's sliding layers rotate with the local RoPE pair
        self.rope_group = int(config.local_rope_theta is not None and config.layer_window(layer_idx) is not None)
        self.input_layernorm = RMSNorm(d, eps, offset=1.0)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(d, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, offset=1.0)
        act = "gelu" if config.hidden_act == "gelu" else "gelu_tanh"  # gelu_pytorch_tanh, gelu_new
        self.mlp = GatedMLP(d, config.intermediate_size, False, act)
        self.post_feedforward_layernorm = RMSNorm(d, eps, offset=1.0)

    def decoder_layer(self) -> DecoderLayer:
        """This block for the decode step backends: sandwich norms around attention and MLP."""
        return DecoderLayer(self.self_attn, self.input_layernorm, self.pre_feedforward_layernorm, self.mlp,
                            self.post_attention_layernorm, self.post_feedforward_layernorm, self.rope_group)  # fmt: skip

    def forward(self, x: Tensor, rope: Rope, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, layout, kv)
        # in place: x is the model's own running tensor (the scaled embedding, never shared)
        x = x.add_(self.post_attention_layernorm(h))
        return x.add_(self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))


class GemmaModel(nn.Module):
    """The checkpoint's ``model.`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, offset=1.0)
        self.rotary_emb = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        # Gemma 3: the sliding layers rotate with their own base (and scaling)
        local = config.local_rope_theta is not None
        self.rotary_emb_local = (
            Rotary(config.head_dim, config.local_rope_theta, config.local_rope_scaling) if local else None
        )


class GemmaForCausalLM(CausalLM):
    """Gemma2ForCausalLM / Gemma3ForCausalLM."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model = GemmaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_logit_softcapping
        self.tied = ("lm_head.weight", "model.embed_tokens.weight") if config.tie_word_embeddings else None
        self.tie_weights()

    def checkpoint_name(self, key: str) -> str | None:
        return key

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)  # (B, T, D)
        # the scale rounded to the model dtype first, as the reference does
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

    def ropes(self, positions: Tensor, dtype: torch.dtype, layout: BatchLayout | None) -> tuple[Rope, ...]:
        """(global, local) pairs, (B, T, 1, hd) each; local is global without a local base."""
        n = rope_span(positions, layout)
        cos_sin = self.model.rotary_emb(positions, dtype, span=n)
        local = self.model.rotary_emb_local
        return cos_sin, local(positions, dtype, span=n) if local is not None else cos_sin

    def rope_tables(self, length: int, dtype: torch.dtype = torch.float32,
                    device: torch.device = torch.device("cpu")) -> tuple[Rope, ...]:
        local = self.model.rotary_emb_local
        rotaries = (self.model.rotary_emb,) if local is None else (self.model.rotary_emb, local)
        return tuple(r.table(length, dtype, device) for r in rotaries)

    def head(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.model.norm(x)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def decoder_ends(self) -> DecoderEnds:
        return DecoderEnds(self.model.embed_tokens.weight, self.embed_scale, self.model.norm, self.lm_head, self.final_softcap)
