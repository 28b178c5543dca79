"""GPT-2, top to bottom.

    x = wte(ids) + wpe(positions)
    for each block:
        x = x + Attention(LayerNorm(x))    # multi-head, paged KV
        x = x + MLP(LayerNorm(x))          # c_fc -> gelu_new -> c_proj
    logits = LayerNorm(x) @ wte.T          # tied lm_head

Names follow the HF checkpoint (``transformer.h.0.attn.c_attn``). HF stores GPT-2's
projections as ``Conv1D`` (weight (in, out)); here they are ``nn.Linear`` (weight
(out, in)), so the loader transposes the tensors listed in ``transposed`` (nanoGPT's
manner). Its learned positions and LayerNorms are what it has of its own; the forward and
the loader's contract are ``layers.CausalLM``'s (no RoPE, no native decoder stack: the
products run natively, attention in torch).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..kv.cache import BatchLayout, KVPool
from .config import ModelConfig
from .layers import CausalLM, Linear, UsesKernels, attend_natively, causal_mask, paged_int8_attention, sdpa


class Attention(nn.Module, UsesKernels):
    native_attention: bool = False  # attention by the native kernel (``layers.attend_natively``; ``use_kernels``)

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim = config.num_heads, config.head_dim
        d = config.hidden_size
        self.c_attn = Linear(d, 3 * d)  # q, k, v stacked
        self.c_proj = Linear(d, d)

    def use_kernels(self) -> None:
        self.native_attention = True

    def forward(self, x: Tensor, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim) for t in self.c_attn(x).split(D, dim=-1))
        if layout is not None and kv.spec.quantized and not layout.fresh:  # int8 / fp8 KV over a cached context
            kv.write_int8(self.layer_idx, layout, k, v)
            y = paged_int8_attention(q, kv, self.layer_idx, layout, layout.attn_bias(torch.float32), self.head_dim**-0.5)
            return self.c_proj(y.reshape(B, T, self.n_heads * self.head_dim))
        if layout is not None:
            k, v = kv.update(self.layer_idx, layout, k, v)  # (B, C, nh, hd)
        y = attend_natively(q, k, v, layout, None, self.head_dim**-0.5, None) if self.native_attention else None
        if y is not None:  # (B, T, nh, hd)
            return self.c_proj(y.reshape(B, T, self.n_heads * self.head_dim))
        if layout is not None:
            mask, is_causal = layout.attn_bias(q.dtype), layout.is_causal
        else:
            mask, is_causal = causal_mask(T, None, q.dtype, x.device)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T|C, hd)
        if T > 1:  # prefill: the flash kernel runs markedly faster on contiguous heads
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        y = sdpa(q, k, v, mask, is_causal)  # (B, nh, T, hd)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"  # gelu_new = tanh approximation

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, rope: None, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        x = x + self.attn(self.ln_1(x), layout, kv)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """The checkpoint's ``transformer.`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)


class GPT2LMHeadModel(CausalLM):
    # Conv1D weights, stored (in, out) in the checkpoint: transposed on load
    transposed: tuple[str, ...] = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    tied = ("lm_head.weight", "transformer.wte.weight")  # always
    # causal-mask buffers some checkpoints carry (h.0.attn.bias, h.0.attn.masked_bias): not weights
    _mask_buffer = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def checkpoint_name(self, key: str) -> str | None:
        """The original OpenAI-converted checkpoints omit the ``transformer.`` prefix."""
        if self._mask_buffer.match(key):
            return None
        return key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    def embed(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.transformer.wte(input_ids) + self.transformer.wpe(positions)  # (B, T, D): learned positions

    def head(self, x: Tensor) -> Tensor:
        return self.lm_head(self.transformer.ln_f(x)).float()
