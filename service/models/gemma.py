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

Names follow the HF checkpoint (``model.layers.0.pre_feedforward_layernorm``, ...). The
forward contract is llama.py's. Attention soft-capping runs the scores explicitly (SDPA
has no soft-cap); without it, SDPA as in llama.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvserve.service.kv.cache import BatchLayout, KVPool
from kvserve.service.models.config import ModelConfig
from kvserve.service.kernels import ops as kernel_ops
from kvserve.service.kernels.layer import MAX_ROWS, DecoderStack, LayerWeights, NormWeights, norm
from kvserve.service.models.layers import (Linear, PagedAttention, UsesKernels, causal_mask, decode_step, fuse_linears,
                                           last_tokens, layer_weights)
from kvserve.service.models.rope import Rotary, apply_rope_


class RMSNorm(nn.Module, UsesKernels):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), all in float32 (w starts at zero).

    The ops of ``F.rms_norm`` without its two scalar copies (llama.RMSNorm), the divide,
    add and rsqrt in place, and (1 + w) made once per weight version: 8 kernels in
    float32 where the plain formula ran 13, the same bits."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self._cache: dict[object, Tensor] = {}  # (D, eps) per device; (1 + w) per weight version

    kernel: NormWeights | None = None  # decode-sized rows by one native call (``use_kernels``)

    def use_kernels(self) -> None:
        self.kernel = NormWeights.of(self.weight, self.eps, offset=1.0)

    def _consts(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        w = self.weight
        key = (w.device, w.data_ptr(), w._version)
        if key not in self._cache:
            with torch.inference_mode(False):  # plain tensors: usable with autograd too
                self._cache = {key: (
                    torch.tensor(float(x.shape[-1]), dtype=torch.float32, device=w.device),
                    torch.tensor(self.eps, dtype=torch.float32, device=w.device),
                    1.0 + w.detach().float(),
                )}
        return self._cache[key]

    def _inv(self, xf: Tensor) -> tuple[Tensor, Tensor]:
        d, eps, scale = self._consts(xf)
        return xf.pow(2).sum(-1, keepdim=True).div_(d).add_(eps).rsqrt_(), scale  # (..., 1), (D,)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel is not None and x.numel() <= MAX_ROWS * x.shape[-1]:
            return norm(self.kernel, x)
        xf = x.float()
        inv, scale = self._inv(xf)
        return torch.mul(xf, inv).mul_(scale).to(x.dtype)

    def forward_(self, x: Tensor) -> Tensor:
        """``forward`` written into x itself (per-head q/k norms on the fused q/k/v)."""
        if x.dtype != torch.float32:
            return x.copy_(self(x))
        inv, scale = self._inv(x)
        return x.mul_(inv).mul_(scale)


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
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.window = config.layer_window(layer_idx)  # None: a global layer
        d, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(d, config.q_size, bias=bias)
        self.k_proj = Linear(d, config.kv_size, bias=bias)
        self.v_proj = Linear(d, config.kv_size, bias=bias)
        self.o_proj = Linear(config.q_size, d, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.qk_norm = config.qk_norm
        self.qkv_proj: Linear | None = None  # q, k and v side by side: set by fuse() after loading

    def fuse(self) -> None:
        """One projection for q, k and v (as llama.Attention.fuse)."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim)
            q, k, v = qkv.split((self.n_heads, self.n_kv, self.n_kv), dim=2)  # (B, T, nh | n_kv, hd)
            # in place in qkv (norms, then q and k rotated together): k and v stay side by
            # side, so KVPool.update writes them with one op
            if self.qk_norm:
                self.q_norm.forward_(q)
                self.k_norm.forward_(k)
            self.rope_(qkv[:, :, : self.n_heads + self.n_kv], cos, sin)
            return q, k, v
        else:
            q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hd)
            k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, n_kv, hd)
            v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)  # (B, T, n_kv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope_(q, cos, sin), apply_rope_(k, cos, sin), v  # q, k: this call's own tensors

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
        if self.softcap is not None:  # SDPA has no soft-cap
            return softcapped_attention(q, k, v, mask, is_causal, self.scale, self.softcap)
        return super().sdpa(q, k, v, mask, is_causal)


class MLP(nn.Module, UsesKernels):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, h = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(d, h, bias=False)
        self.up_proj = Linear(d, h, bias=False)
        self.down_proj = Linear(h, d, bias=False)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"
        self.act = "gelu" if config.hidden_act == "gelu" else "gelu_tanh"  # the kernels' name
        self.gate_up_proj: Linear | None = None  # gate and up side by side: set by fuse() after loading

    def fuse(self) -> None:
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    kernel: bool = False  # decode-sized rows: gelu(gate) * up in one native call (``use_kernels``)

    def use_kernels(self) -> None:
        self.kernel = True

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            if self.kernel and x.numel() <= MAX_ROWS * x.shape[-1]:
                return self.down_proj(kernel_ops.act_mul(self.gate_up_proj(x), self.act))
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, h) each
            return self.down_proj(F.gelu(gate, approximate=self.approximate).mul_(up))
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate).mul_(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.norm_eps
        self.is_sliding = config.layer_window(layer_idx) is not None
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.mlp = MLP(config)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def kernel_layer(self) -> LayerWeights | None:
        """This block for the native decoder stack: (1 + w) norms, sandwich norms around
        attention and MLP, GeGLU."""
        a, m = self.self_attn, self.mlp
        if m.gate_up_proj is None:
            return None
        return layer_weights(a, self.input_layernorm, self.pre_feedforward_layernorm, m.gate_up_proj, m.down_proj, m.act,
                             norm_post_attn=self.post_attention_layernorm, norm_post_mlp=self.post_feedforward_layernorm,
                             q_norm=a.q_norm if a.qk_norm else None, k_norm=a.k_norm if a.qk_norm else None)  # fmt: skip

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        h = self.input_layernorm(x)
        if layout is None:
            h = self.self_attn.forward_nocache(h, cos, sin)
        else:
            h = self.self_attn(h, cos, sin, layout, kv)
        # in place: x is the model's own running tensor (the scaled embedding, never shared)
        x = x.add_(self.post_attention_layernorm(h))
        return x.add_(self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))))


class GemmaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.rotary_emb = Rotary(config.head_dim, config.rope_theta, config.rope_scaling)
        # Gemma 3: the sliding layers rotate with their own base (and scaling)
        local = config.local_rope_theta is not None
        self.rotary_emb_local = (
            Rotary(config.head_dim, config.local_rope_theta, config.local_rope_scaling) if local else None
        )


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM / Gemma3ForCausalLM."""

    transposed: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_scale = config.hidden_size**0.5
        self.final_softcap = config.final_logit_softcapping
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_weights(self) -> dict[str, str]:
        return {"lm_head.weight": "model.embed_tokens.weight"} if self.config.tie_word_embeddings else {}

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        return key

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_buffers()
        if self.model.rotary_emb_local is not None:
            self.model.rotary_emb_local.reset_buffers()

    stack: DecoderStack | None = None  # every block of a decode step natively (layers.use_kernels)

    def decoder_stack(self) -> DecoderStack | None:
        """The blocks' layers; the sliding ones rotate with the local pair (Gemma 3)."""
        local = self.model.rotary_emb_local is not None
        layers = [block.kernel_layer() for block in self.model.layers]
        if any(layer is None for layer in layers):
            return None
        return DecoderStack(layers, [int(local and block.is_sliding) for block in self.model.layers])

    def _embed(self, input_ids: Tensor) -> Tensor:
        x = self.model.embed_tokens(input_ids)  # (B, T, D)
        # the scale rounded to the model dtype first, as the reference does
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

    def _layers(self, x: Tensor, positions: Tensor, layout: BatchLayout | None, kv: KVPool | None) -> Tensor:
        cos, sin = self.model.rotary_emb(positions, x.dtype, signed=True)  # (B, T, 1, hd); sin signed (apply_rope_)
        local = self.model.rotary_emb_local
        cos_l, sin_l = local(positions, x.dtype, signed=True) if local is not None else (cos, sin)
        stack = self.stack
        if stack is not None and stack.applies(x) and (step := decode_step(layout, kv)) is not None:
            return stack.run(x, ((cos, sin), (cos_l, sin_l)), step)  # a decode step: decided once, not per block
        for layer in self.model.layers:
            if layer.is_sliding:
                x = layer(x, cos_l, sin_l, layout, kv)
            else:
                x = layer(x, cos, sin, layout, kv)
        return x

    def _logits(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.model.norm(x)).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def forward(self, layout: BatchLayout, kv: KVPool, all_logits: bool = False) -> Tensor:
        x = self._layers(self._embed(layout.input_ids), layout.positions, layout, kv)  # (B, T, D)
        if not all_logits:
            x = last_tokens(x, layout)  # (B, D)
        return self._logits(x)  # (B, V) or (B, T, V)

    def forward_nocache(self, input_ids: Tensor) -> Tensor:
        B, T = input_ids.shape
        positions = torch.arange(T, device=input_ids.device).expand(B, T)
        return self._logits(self._layers(self._embed(input_ids), positions, None, None))  # (B, T, V)
