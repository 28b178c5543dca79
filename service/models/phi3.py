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

Names follow the HF checkpoint (``model.layers.0.self_attn.qkv_proj``); the forward
contract is llama.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.service.kv.cache import BatchLayout, KVPool
from kvserve.service.models.config import ModelConfig
from kvserve.service.kernels import ops as kernel_ops
from kvserve.service.kernels.layer import MAX_ROWS, DecoderStack, LayerWeights
from kvserve.service.models.layers import Linear, PagedAttention, UsesKernels, decode_step, last_tokens, layer_weights
from kvserve.service.models.llama import RMSNorm
from kvserve.service.models.rope import Rotary


class Attention(PagedAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = self.head_dim**-0.5
        self.window = config.layer_window(layer_idx)
        d = config.hidden_size
        self.qkv_proj = Linear(d, config.q_size + 2 * config.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, d, bias=config.attention_out_bias)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
        self.rope_(qkv[:, :, : self.n_heads + self.n_kv], cos, sin)  # q and k heads rotated together, in place
        # k and v stay side by side in qkv: KVPool.update writes both with one index_put_
        return qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=2)  # (B, T, nh | n_kv | n_kv, hd)


class MLP(nn.Module, UsesKernels):
    """SwiGLU with gate and up fused: down(silu(gate) * up)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(d, 2 * h, bias=config.mlp_bias)
        self.down_proj = Linear(h, d, bias=config.mlp_bias)

    kernel: bool = False  # decode-sized rows: silu(gate) * up in one native call (``use_kernels``)

    def use_kernels(self) -> None:
        self.kernel = True

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel and x.numel() <= MAX_ROWS * x.shape[-1]:
            return self.down_proj(kernel_ops.act_mul(self.gate_up_proj(x), "silu"))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, h) each
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def kernel_layer(self) -> LayerWeights | None:
        """This block for the native decoder stack (q/k/v and gate/up are fused in the checkpoint)."""
        m = self.mlp
        return layer_weights(self.self_attn, self.input_layernorm, self.post_attention_layernorm, m.gate_up_proj,
                             m.down_proj, "silu")  # fmt: skip

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: BatchLayout, kv: KVPool) -> Tensor:
        # in place: x is the model's own running tensor (the embedding's output, never shared)
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, layout, kv))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))

    def forward_nocache(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn.forward_nocache(self.input_layernorm(x), cos, sin)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class Phi3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = Rotary(config.rotary_dim, config.rope_theta, config.rope_scaling)


class Phi3ForCausalLM(nn.Module):
    transposed: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Phi3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.threshold = config.longrope_threshold  # None: no LongRoPE
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        return None if key.endswith("rotary_emb.inv_freq") else key

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_buffers()

    def _long(self, layout: BatchLayout) -> Tensor | None:
        """(B,) bool: which sequences use the long factors (the engine's choice, else by length)."""
        if self.threshold is None:
            return None
        if layout.long_rope is not None:
            return layout.long_rope
        return torch.tensor([n > self.threshold for n in layout.seq_lens], device=layout.input_ids.device)

    stack: DecoderStack | None = None  # every block of a decode step natively (layers.use_kernels)

    def decoder_stack(self) -> DecoderStack | None:
        layers = [block.kernel_layer() for block in self.model.layers]
        return None if any(layer is None for layer in layers) else DecoderStack(layers)

    def forward(self, layout: BatchLayout, kv: KVPool, all_logits: bool = False) -> Tensor:
        x = self.model.embed_tokens(layout.input_ids)  # (B, T, D)
        cos, sin = self.model.rotary_emb(layout.positions, x.dtype, self._long(layout), signed=True)  # (B, T, 1, rot)
        stack = self.stack
        if stack is not None and stack.applies(x) and (step := decode_step(layout, kv)) is not None:
            x = stack.run(x, ((cos, sin),), step)  # a decode step: decided once, not per block
        else:
            for layer in self.model.layers:
                x = layer(x, cos, sin, layout, kv)
        if not all_logits:
            x = last_tokens(x, layout)  # (B, D)
        return self.lm_head(self.model.norm(x)).float()  # (B, V) or (B, T, V)

    def forward_nocache(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        x = self.model.embed_tokens(input_ids)  # (B, T, D)
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        long = None
        if self.threshold is not None:
            long = torch.full((B,), T > self.threshold, dtype=torch.bool, device=input_ids.device)
        cos, sin = self.model.rotary_emb(positions, x.dtype, long, signed=True)
        for layer in self.model.layers:
            x = layer.forward_nocache(x, cos, sin)
        return self.lm_head(self.model.norm(x)).float()  # (B, T, V)
