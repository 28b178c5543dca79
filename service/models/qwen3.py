"""Qwen3 (dense), top to bottom: the Llama decoder with a per-head RMSNorm on q and k.

    x = embed(ids)
    for each layer:
        q, k, v = q_proj(h), k_proj(h), v_proj(h)        # h = RMSNorm(x); no bias by default
        q, k = RoPE(q_norm(q)), RoPE(k_norm(k))           # RMSNorm over head_dim, per head
        x = x + o_proj(attention(q, k, v))                # GQA, paged KV, optional window
        x = x + SwiGLU(RMSNorm(x))
    logits = lm_head(RMSNorm(x))

``head_dim`` is its own config entry (e.g. 128 with hidden 1024 and 16 heads), not
hidden / heads. Everything but the q/k norms is llama.py's (same maths, same
parameter names); the forward contract is llama.py's.
"""

from __future__ import annotations

from torch import Tensor

from kvserve.service.models import llama
from kvserve.service.models.config import ModelConfig
from kvserve.service.models.llama import RMSNorm, apply_rope


class Attention(llama.Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        if self.qkv_proj is not None:  # fused after loading (llama.Attention.fuse)
            qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
            q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=2)
            # in place in qkv: per-head norms, then q and k rotated together; k and v stay
            # side by side, so KVPool.update writes them with one op
            self.q_norm.forward_(q)
            self.k_norm.forward_(k)
            self.rope_(qkv[:, :, : self.n_heads + self.n_kv], cos, sin)
            return q, k, v
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, n_kv, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, n_kv, hd)
        q, k = self.q_norm(q), self.k_norm(k)  # per head, over head_dim
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class Qwen3ForCausalLM(llama.LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = Attention(config, i)
