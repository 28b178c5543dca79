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
from kvserve.service.models.layers import Linear, PagedAttention, last_tokens
from kvserve.service.models.llama import RMSNorm
from kvserve.service.models.native import layer as native_layer
from kvserve.service.models.native import ops as native_ops
from kvserve.service.models.native.layer import LayerSpec, NativeStack
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


class MLP(nn.Module):
    """SwiGLU with gate and up fused: down(silu(gate) * up)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(d, 2 * h, bias=config.mlp_bias)
        self.down_proj = Linear(h, d, bias=config.mlp_bias)

    _native = False  # decode-sized float32 CPU rows: silu(gate) * up in one native call

    def forward(self, x: Tensor) -> Tensor:
        if self._native and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() <= 64 * x.shape[-1]:
            return self.down_proj(native_ops.act_mul(self.gate_up_proj(x), "silu"))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, h) each
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class Block(nn.Module):
    _native_layer = None  # native.layer.NativeLayer: the whole block in one call on decode steps

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def native_spec(self) -> LayerSpec:
        """This block for the native decode layer (q/k/v and gate/up are fused in the checkpoint)."""
        a, m = self.self_attn, self.mlp
        return LayerSpec(norm_in=self.input_layernorm, qkv=a.qkv_proj, o=a.o_proj, norm_mlp=self.post_attention_layernorm,
                         gate_up=m.gate_up_proj, down=m.down_proj, act="silu", attn=a)  # fmt: skip

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: BatchLayout, kv: KVPool) -> Tensor:
        if self._native_layer is not None and native_layer.applies(x, layout, kv):
            return native_layer.run_layer(self._native_layer, x, cos, sin, layout, kv)
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

    _native_stack = None  # native.layer.NativeStack: every block of a decode step natively (layers.enable_native)

    def native_stack(self) -> NativeStack | None:
        return NativeStack.of(self.model.layers)

    def forward(self, layout: BatchLayout, kv: KVPool, all_logits: bool = False) -> Tensor:
        x = self.model.embed_tokens(layout.input_ids)  # (B, T, D)
        cos, sin = self.model.rotary_emb(layout.positions, x.dtype, self._long(layout), signed=True)  # (B, T, 1, rot)
        stack = self._native_stack
        if stack is not None and native_layer.applies(x, layout, kv):
            x = stack.run(x, ((cos, sin),), layout, kv)  # a decode step: decided once, not per block
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
