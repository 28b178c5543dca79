"""Phi-3 and Phi-4-mini, top to bottom: the Llama decoder with fused projections,
partial rotary and LongRoPE.

    x = embed(ids)
    for each layer:
        q, k, v = split(qkv_proj(RMSNorm(x)))              # one fused projection
        q, k = RoPE(q), RoPE(k)                            # on the first head_dim * partial_rotary_factor dims
        x = x + o_proj(attention(q, k, v))                 # GQA, paged KV, optional sliding window
        gate, up = split(gate_up_proj(RMSNorm(x)))         # one fused projection
        x = x + down_proj(silu(gate) * up)
    logits = lm_head(RMSNorm(x))

LongRoPE ("su"): two sets of frequency factors. transformers uses the long set when the
sequence is longer than ``original_max_position_embeddings`` and the short one
otherwise, and when a generation grows past that length it drops its cache and
recomputes the whole sequence with the long set. So a position's KV depends on the
regime as well as on the prefix: the engine keeps one regime per sequence, keys its
blocks under a namespace per regime, and re-prefills a sequence that crosses the switch
length (engine.py). The regime reaches the model as ``layout.long_rope`` (B,); without
it (tests, ``forward_nocache``) a forward picks it from its own length, as transformers.

Names follow the HF checkpoint (``model.layers.0.self_attn.qkv_proj``); blocks, norms and
the rest are llama.py's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kv.cache import BatchLayout
from .config import ModelConfig
from .layers import Rope, rope_span
from .llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    fused = True  # qkv_proj and gate_up_proj in the checkpoint

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.threshold = config.longrope_threshold  # None: no LongRoPE

    def ropes(self, positions: Tensor, dtype: torch.dtype, layout: BatchLayout | None) -> tuple[Rope, ...]:
        long = self._long(positions, layout)
        return (self.model.rotary_emb(positions, dtype, long, rope_span(positions, layout)),)  # (B, T, 1, rot)

    def _long(self, positions: Tensor, layout: BatchLayout | None) -> Tensor | None:
        """(B,) bool: which sequences use the long factors (the engine's choice, else by length)."""
        if self.threshold is None:
            return None
        if layout is None:  # forward_nocache: the whole sequence is the input
            B, T = positions.shape
            return torch.full((B,), T > self.threshold, dtype=torch.bool, device=positions.device)
        if layout.long_rope is not None:
            return layout.long_rope
        return torch.tensor([n > self.threshold for n in layout.seq_lens], device=layout.input_ids.device)
