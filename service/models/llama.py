"""Llama-family decoder (Llama 2/3, TinyLlama, Mistral, Qwen2), top to bottom.

    x = embed(ids)
    for each layer:
        x = x + Attention(RMSNorm(x))      # RoPE on q/k, grouped-query attention, paged KV,
                                           # sliding window on the layers that have one
        x = x + SwiGLU(RMSNorm(x))
    logits = lm_head(RMSNorm(x))

Module and parameter names follow the HF checkpoint (``model.layers.0.self_attn.q_proj``,
...), so a state dict loads by name with no renaming. The forward contract shared with
gpt2.py::

    model(layout, kv, all_logits=False) -> logits (B, V) at each sequence's last new token
                                           ((B, T, V) when all_logits), float32
    model.forward_nocache(input_ids (B, T)) -> logits (B, T, V): plain causal attention
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.service.kv.cache import BatchLayout, KVPool
from kvserve.service.models import rope
from kvserve.service.models.config import ModelConfig
from kvserve.service.kernels import ops as kernel_ops
from kvserve.service.kernels.layer import MAX_ROWS, DecoderStack, LayerWeights, NormWeights, norm
from kvserve.service.models.layers import (Linear, PagedAttention, UsesKernels, decode_step, fuse_linears, last_tokens,
                                           layer_weights)


class RMSNorm(nn.Module, UsesKernels):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim.

    float32: the ops of torch's ``F.rms_norm`` (on the CPU it is not one kernel but ten:
    pow, sum, fill, div, add, rsqrt, two muls and two copies wrapping the Python scalars
    1/D and eps), bit for bit the same result, in eight: the scalars are 0-dim tensors
    made once per dtype and device, and the divide, add and rsqrt run in place."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self._consts: dict[tuple[torch.dtype, torch.device], tuple[Tensor, Tensor]] = {}  # (D, eps) as 0-dim

    kernel: NormWeights | None = None  # decode-sized rows by one native call (``use_kernels``)

    def use_kernels(self) -> None:
        self.kernel = NormWeights.of(self.weight, self.eps)

    def _scalars(self, x: Tensor) -> tuple[Tensor, Tensor]:
        key = (x.dtype, x.device)
        if key not in self._consts:
            with torch.inference_mode(False):  # plain tensors: usable with autograd too
                self._consts[key] = (
                    torch.tensor(float(x.shape[-1]), dtype=x.dtype, device=x.device),
                    torch.tensor(self.eps, dtype=x.dtype, device=x.device),
                )
        return self._consts[key]

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None and x.numel() <= MAX_ROWS * x.shape[-1]:
            return norm(self.kernel, x)
        if x.dtype == torch.float32 == self.weight.dtype:
            d, eps = self._scalars(x)
            inv = x.pow(2).sum(-1, keepdim=True).div_(d).add_(eps).rsqrt_()  # (..., 1)
            return torch.mul(x, inv).mul_(self.weight)
        # normalize in float32 (as the reference does), scale in the model dtype
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)

    def forward_(self, x: Tensor) -> Tensor:
        """``forward`` written into x itself (a view into a larger output: qwen3.py's
        per-head norms on the fused q/k/v); the same values."""
        if x.dtype == torch.float32 == self.weight.dtype:
            d, eps = self._scalars(x)
            inv = x.pow(2).sum(-1, keepdim=True).div_(d).add_(eps).rsqrt_()  # (..., 1)
            return x.mul_(inv).mul_(self.weight)
        return x.copy_(self(x))


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies (head_dim/2,) in float32, with rope_scaling applied (rope.py)."""
    return rope.inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)


class RotaryEmbedding(nn.Module):
    """cos and signed sin for given positions; computed per forward (once per step, shared
    by every layer), so no max-length table."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)

    _rows: tuple[Tensor, Tensor, Tensor] | None = None  # (inv_freq, rope.doubled(inv_freq)): remade when it changes

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) (B, T, 1, hd): cos = [cos f, cos f], sin = [-sin f, sin f] (the sign
        of ``rotate_half`` folded in, so ``apply_rope`` needs no negation per layer)."""
        inv = self.inv_freq
        rows = self._rows
        if rows is None or rows[0] is not inv:
            rows = self._rows = (inv, *rope.doubled(inv))
        emb = positions[..., None].float() * rows[1]  # (B, T, hd): [freqs, freqs]
        cos = emb.cos().to(dtype)  # (B, T, hd)
        sin = emb.sin().mul_(rows[2]).to(dtype)  # (B, T, hd)
        return cos[:, :, None, :], sin[:, :, None, :]  # (B, T, 1, hd): broadcast over heads


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, T, nh, hd) rotated: x * cos + rotate_half(x) * sin with ``RotaryEmbedding``'s
    signed sin, where rotate_half(x) = [-x2, x1] becomes roll(x) = [x2, x1] (bit for bit the
    same products: (-a) * b == a * (-b))."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def apply_rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``apply_rope`` in place on x (a view into the fused q/k/v output): 4 kernels (the
    roll's copy, two multiplies, one add), no new (B, T, nh, hd) result."""
    rot = x.roll(x.shape[-1] // 2, -1).mul_(sin)  # (B, T, nh, hd)
    return x.mul_(cos).add_(rot)


class Attention(PagedAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = self.head_dim**-0.5
        self.window = config.layer_window(layer_idx)  # None: full attention; else sliding window
        d = config.hidden_size
        self.q_proj = Linear(d, config.q_size, bias=config.attention_bias)
        self.k_proj = Linear(d, config.kv_size, bias=config.attention_bias)
        self.v_proj = Linear(d, config.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(config.q_size, d, bias=config.attention_out_bias)
        self.qkv_proj: Linear | None = None  # q, k and v side by side: set by fuse() after loading

    def fuse(self) -> None:
        """One projection for q, k and v (one weight read, one kernel call per step)."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
            self.rope_(qkv[:, :, : self.n_heads + self.n_kv], cos, sin)  # q and k heads rotated together, in place
            # k and v stay side by side in qkv: KVPool.update writes both with one index_put_
            return qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=2)  # (B, T, nh | n_kv | n_kv, hd)
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)  # (B, T, nh, hd)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv, self.head_dim), cos, sin)  # (B, T, n_kv, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, n_kv, hd)
        return q, k, v


class MLP(nn.Module, UsesKernels):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = Linear(d, h, bias=bias)
        self.up_proj = Linear(d, h, bias=bias)
        self.down_proj = Linear(h, d, bias=bias)
        self.gate_up_proj: Linear | None = None  # gate and up side by side: set by fuse() after loading

    kernel: bool = False  # decode-sized rows: silu(gate) * up in one native call (``use_kernels``)

    def use_kernels(self) -> None:
        self.kernel = True

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        # in place: no extra (B, T, intermediate) temporaries (each a page-faulting allocation when large)
        if self.gate_up_proj is not None:
            if self.kernel and x.numel() <= MAX_ROWS * x.shape[-1]:
                return self.down_proj(kernel_ops.act_mul(self.gate_up_proj(x), "silu"))
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, h) each
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config)

    def kernel_layer(self) -> LayerWeights | None:
        """This block for the native decoder stack (after fusing); Qwen3's per-head norms included."""
        a, m = self.self_attn, self.mlp
        if m.gate_up_proj is None:
            return None
        return layer_weights(a, self.input_layernorm, self.post_attention_layernorm, m.gate_up_proj, m.down_proj,
                             "silu", q_norm=getattr(a, "q_norm", None), k_norm=getattr(a, "k_norm", None))  # fmt: skip

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: BatchLayout, kv: KVPool) -> Tensor:
        # in place: x is the model's own running tensor (the embedding's output, never shared)
        x = x.add_(self.self_attn(self.input_layernorm(x), cos, sin, layout, kv))
        return x.add_(self.mlp(self.post_attention_layernorm(x)))

    def forward_nocache(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.self_attn.forward_nocache(self.input_layernorm(x), cos, sin)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor names that the loader must transpose (none: HF Linear layout)
    transposed: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        """Parameter names that share storage with another one (alias -> source)."""
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        """Our parameter name for a checkpoint tensor name (identical); None to skip it."""
        return None if key.endswith("rotary_emb.inv_freq") else key  # old checkpoints saved it

    def reset_buffers(self) -> None:
        """Recompute non-persistent buffers (after construction on the meta device)."""
        self.model.rotary_emb.reset_buffers()

    stack: DecoderStack | None = None  # every block of a decode step natively (layers.use_kernels)

    def decoder_stack(self) -> DecoderStack | None:
        layers = [block.kernel_layer() for block in self.model.layers]
        return None if any(layer is None for layer in layers) else DecoderStack(layers)

    def forward(self, layout: BatchLayout, kv: KVPool, all_logits: bool = False) -> Tensor:
        x = self.model.embed_tokens(layout.input_ids)  # (B, T, D)
        cos, sin = self.model.rotary_emb(layout.positions, x.dtype)  # (B, T, 1, hd)
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
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for layer in self.model.layers:
            x = layer.forward_nocache(x, cos, sin)
        return self.lm_head(self.model.norm(x)).float()  # (B, T, V)
