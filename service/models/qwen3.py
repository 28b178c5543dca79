"""Qwen3 (dense), top to bottom: the Llama decoder with a per-head RMSNorm on q and k.

    x = embed(ids)
    for each layer:
        q, k, v = q_proj(h), k_proj(h), v_proj(h)        # h = RMSNorm(x); no bias by default
        q, k = RoPE(q_norm(q)), RoPE(k_norm(k))           # RMSNorm over head_dim, per head
        x = x + o_proj(attention(q, k, v))                # GQA, paged KV, optional window
        x = x + SwiGLU(RMSNorm(x))
    logits = lm_head(RMSNorm(x))

``head_dim`` is its own config entry (e.g. 128 with hidden 1024 and 16 heads), not
hidden / heads. The q/k norms are the config's (``qk_norm``, set for this family) and
``layers.PagedAttention`` makes them; everything else is llama.py's (same maths, same
parameter names).
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
