"""Paged KV storage on the device, and the batch layout the model attends with.

``KVPool`` holds every block of every layer in ONE tensor::

    data: (num_blocks, num_layers, 2, block_size, n_kv, head_dim)    # 2 = (K, V)
    data: (num_blocks, num_layers, 2, plane_bytes) int8 | e4m3        # int8 / fp8 KV: values, then each row's scales

Block-major, so one block (all layers, K and V) is one contiguous span: exporting or
importing a block is a single memcpy, the unit the cache store moves between tiers.
Block 0 is the null block: padding tokens write there and the block manager never
hands it out.

``BatchLayout`` is the attention metadata of one forward pass, built once and shared
by every layer: padded input ids, positions, where each new token's K/V goes, which
blocks hold each sequence's context, and the mask. The model calls
``KVPool.update(layer, layout, k, v)`` in each layer (the gpt-fast ``KVCache.update``
manner): it writes the new K/V into the pool and returns the K/V to attend over.

Nothing in the per-layer path reads a tensor back to the host: every index is built on
the target device when the layout is built.
"""

from __future__ import annotations

import array
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from .block_manager import NULL_BLOCK


# --kv-cache-format: the dtype the pool and every tier store KV in (None: the model's own);
# int8 and fp8 (e4m3) are stored with scales (``KVCacheSpec`` below: Int8 and fp8 KV)
KV_CACHE_FORMATS = {"exact": None, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
                    "fp8": torch.float8_e4m3fn}
INT8_MAX = 127.0  # int8 KV: q = round(x / s) in [-127, 127], s = absmax / 127
FP8_MAX = 448.0  # fp8 KV: q = e4m3(x / s) in [-448, 448], s = absmax / 448
QUANT_MAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: FP8_MAX}  # the scaled formats: their largest value


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The geometry of every KV block, built once from the model config
    (``LoadedModel.kv_spec``): the pool allocates blocks of it and the store's tiers hold
    blocks of exactly this shape and dtype.

    ``dtype`` is the stored one (``--kv-cache-format``); ``compute_dtype`` the model's,
    which attention widens the stored KV to. They differ only for a narrower format
    (float32 compute, bf16 or fp16 KV; int8 KV): then ``format`` names it and the
    namespace field says both, so KV rounded to one format is never read as another's,
    nor as exact.

    Int8 KV: symmetric absmax scales per (block, layer, K|V, row, kv head): one float32
    per ``head_dim`` values, as llama.cpp's Q8_0 has one per 32. Each (layer, K|V) plane
    of a block is ``plane_bytes`` int8: the ``block_size * n_kv * hd`` quantized values
    (bs, n_kv, hd), zero padding to a multiple of 4, then the ``block_size * n_kv``
    float32 scales (bs, n_kv) (little-endian, as the host stores them). A block is still
    one contiguous span ``(L, 2, plane_bytes)`` of int8, so every tier and the codec move
    it, scales included, as they move any block: the same bytes, never re-encoded.
    x ~= q * s, with q = round(x / s) (to nearest even, clamped to +-127) and
    s = absmax / 127 of the row's kv head alone. A row's bytes depend on that row and
    nothing else: not on the rows written beside it in the same forward (a verify step's
    rejected drafts), nor on how its block was filled (token by token, or by one prefill),
    so speculative decoding, chunked prefill and a cache hit all read what plain decoding
    wrote (a scale per block would have to grow with the rows after it and requantize the
    rows before).

    Fp8 KV (e4m3): the same planes and scales, the values float8_e4m3fn (one
    byte each; the scales' bytes are elements of the plane too, read as float32):
    q = e4m3(x / s) (the cast rounds to nearest even) with s = absmax / 448. Scaled, not
    plain e4m3: a head's values fill the format's range whatever their magnitude (plain
    e4m3 keeps 3 mantissa bits only above 2^-6 and flushes below 2^-9, where small V
    heads live, and clips past 448), for 4 bytes per row, head and plane."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    compute_dtype: torch.dtype | None = None  # None: dtype (exact)

    @classmethod
    def for_model(cls, config, block_size: int, dtype: torch.dtype, kv_format: str = "exact") -> KVCacheSpec:
        """From a ``ModelConfig``: its layers, kv heads and head dim; ``dtype`` the model's,
        ``kv_format`` one of ``KV_CACHE_FORMATS`` (a format as wide as the model's dtype
        or wider is the model's dtype: exact)."""
        if kv_format not in KV_CACHE_FORMATS:
            raise ValueError(f"unknown KV cache format {kv_format!r} (choose from {', '.join(KV_CACHE_FORMATS)})")
        stored = KV_CACHE_FORMATS[kv_format] or dtype
        if stored.itemsize >= dtype.itemsize:
            stored = dtype
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, stored, dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one exported block: (L, 2, block_size, n_kv, hd)."""
        if self.quantized:
            return (self.num_layers, 2, self.plane_bytes)
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def quantized(self) -> bool:
        """True for int8 and fp8 KV (values and scales in each plane: ``plane_bytes``)."""
        return self.dtype in QUANT_MAX

    @property
    def values_per_plane(self) -> int:
        """Values of one (layer, K|V) plane of a block: block_size * n_kv * hd."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def scale_offset(self) -> int:
        """Int8 / fp8 KV: the byte offset of a plane's float32 scales (after its values, 4-aligned)."""
        return -(-self.values_per_plane // 4) * 4

    @property
    def plane_bytes(self) -> int:
        """Int8 / fp8 KV: bytes of one (layer, K|V) plane: the values, padding, block_size * n_kv float32 scales."""
        return self.scale_offset + 4 * self.block_size * self.num_kv_heads

    @property
    def format(self) -> str:
        """The ``KV_CACHE_FORMATS`` name served: "exact" when the pool holds the model's dtype."""
        if self.compute_dtype is None or self.compute_dtype == self.dtype:
            return "exact"
        return next(name for name, dt in KV_CACHE_FORMATS.items() if dt == self.dtype)

    @property
    def dtype_name(self) -> str:
        """The stored dtype's short name ("float32", "bfloat16", ...)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def namespace_field(self) -> str:
        """The KV dtype field of the block key namespace: the dtype for exact KV
        ("float32"), the model's dtype and the format for narrower KV ("float32/kv=bf16":
        float32-computed KV rounded to bf16, which no exact namespace equals); int8 and fp8
        name their scales' layout too ("float32/kv=int8/rows": a scale per row, so blocks
        of the earlier layout, a scale per block, are never addressed)."""
        if self.format == "exact":
            return self.dtype_name
        rows = "/rows" if self.quantized else ""
        return f"{str(self.compute_dtype).removeprefix('torch.')}/kv={self.format}{rows}"

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) * layers * kv heads * head_dim * element size; int8 and fp8 KV: a
        block's bytes (its scales included) over its tokens, rounded up."""
        return -(-self.bytes_per_block // self.block_size)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize


class KVPool:
    """The device block pool: ``data`` of shape (num_blocks, L, 2, block_size, n_kv, hd).

    ``k(layer)`` / ``v(layer)`` are views of shape (num_blocks, block_size, n_kv, hd).
    The pool knows nothing of which block belongs to whom (that is the block manager's
    job); it stores, gathers and copies blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"a KV pool needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
        if min(num_layers, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("num_layers, block_size, num_kv_heads and head_dim must be >= 1")
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # the block geometry; compute_dtype: the model's, when the pool stores a narrower format
        self.spec = KVCacheSpec(num_layers, num_kv_heads, head_dim, block_size, dtype, compute_dtype)
        # zeros, not empty: every page is touched now, so nbytes is the real footprint
        # and the first forward pays no page faults.
        self.data = torch.zeros(num_blocks, *self.spec.block_shape, dtype=dtype, device=self.device)
        # (N, L, 2, bs, n_kv, hd); int8 / fp8 KV: (N, L, 2, plane_bytes), values then scales per plane
        # ``_rows``: the data as torch indexes it: fp8's bytes as uint8 (torch's CPU index_copy_
        # has no float8 kernel), any other dtype itself
        self._rows = _rows_of(self.data)
        if self.spec.quantized:
            n_val, at = self.spec.values_per_plane, self.spec.scale_offset
            shape = (num_blocks, block_size, num_kv_heads, head_dim)
            self._k = [self.data[:, layer, 0, :n_val].view(shape) for layer in range(num_layers)]  # (N, bs, n_kv, hd) int8 | e4m3
            self._v = [self.data[:, layer, 1, :n_val].view(shape) for layer in range(num_layers)]
            # (N, bs, n_kv) float32 views of the scales' bytes (a little-endian host): one per row and kv head
            scales = (num_blocks, block_size, num_kv_heads)
            self._k_scale = [self.data[:, layer, 0, at:].view(torch.float32).view(scales) for layer in range(num_layers)]
            self._v_scale = [self.data[:, layer, 1, at:].view(torch.float32).view(scales) for layer in range(num_layers)]
            self._kv = []
        else:
            self._k = [self.data[:, layer, 0] for layer in range(num_layers)]  # (N, bs, n_kv, hd) views
            self._v = [self.data[:, layer, 1] for layer in range(num_layers)]
            self._kv = [self.data[:, layer] for layer in range(num_layers)]  # (N, 2, bs, n_kv, hd) views

    @classmethod
    def from_spec(cls, spec: KVCacheSpec, budget_bytes: int, device: torch.device | str = "cpu") -> "KVPool":
        """As many blocks of ``spec`` as fit in ``budget_bytes`` (including the null block)."""
        num_blocks = budget_bytes // spec.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {spec.bytes_per_block} bytes; need >= 2"
            )
        return cls(num_blocks, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim, spec.dtype, device,
                   spec.compute_dtype)

    # ---- geometry -------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_block

    @property
    def nbytes(self) -> int:
        """Bytes really allocated for the pool's storage."""
        return self.data.untyped_storage().nbytes()

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one exported block: (L, 2, block_size, n_kv, hd)."""
        return self.spec.block_shape

    def block_view(self, block_id: int) -> Tensor:
        """One block in place, (L, 2, bs, n_kv, hd): a view, no copy. What a spill reads
        and a CPU restore loads into (``service/kv/transfer.py``); valid only while the
        caller holds the block (a reference taken on the engine thread). For copies:
        ``export_block`` / ``import_block``."""
        self._check_id(block_id)
        return self.data[block_id]

    def k(self, layer: int) -> Tensor:
        return self._k[layer]  # (N, bs, n_kv, hd)

    def v(self, layer: int) -> Tensor:
        return self._v[layer]  # (N, bs, n_kv, hd)

    def k_scale(self, layer: int) -> Tensor:
        """Int8 / fp8 KV: the K scales of ``layer``, (N, bs, n_kv) float32 (a view into the blocks)."""
        return self._k_scale[layer]

    def v_scale(self, layer: int) -> Tensor:
        return self._v_scale[layer]  # (N, bs, n_kv) float32

    # ---- the model's per-layer call -------------------------------------------------

    def update(self, layer: int, layout: "BatchLayout", k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write the new K/V of ``layer`` at the layout's slots; return the K/V to attend over.

        k, v: (B, T, n_kv, hd) for the batch's new tokens. Returns (k_ctx, v_ctx) of shape
        (B, C, n_kv, hd) in k's dtype: the new K/V themselves when the layout is ``fresh``
        (no cached context), else each sequence's gathered context (C = ``layout.ctx_len``).

        A pool narrower than k (``--kv-cache-format`` bf16/fp16) stores k, v rounded, and
        what is returned is the stored KV widened back: a fresh prefill attends over the
        same rounded KV a later step reads from the pool, so a cache hit and a recompute
        agree. The widened context is this layer's alone (freed when its attention has run).

        When v directly follows k in memory (the heads of one fused q/k/v output, as
        llama.py leaves them), K and V are written by one ``index_put_``; else by two.
        """
        if layout.landed is not None:
            layout.landed(layer)  # this layer of the restored context is in the pool before it is read
        if self.spec.quantized:
            return self._update_int8(layer, layout, k, v)
        k_cache, v_cache = self._k[layer], self._v[layer]
        narrow = k.dtype != self.dtype
        pair = _side_by_side(k, v)
        if pair is not None:  # one write for K and V: (B*T, 2, n_kv, hd) at (block, K|V, offset)
            pair = pair.reshape(-1, 2, self.num_kv_heads, self.head_dim)
            self._kv[layer].index_put_(layout.kv_slots(), pair.to(self.dtype) if narrow else pair)
        else:
            k_rows = k.reshape(-1, self.num_kv_heads, self.head_dim)
            v_rows = v.reshape(-1, self.num_kv_heads, self.head_dim)
            if narrow:
                k_rows, v_rows = k_rows.to(self.dtype), v_rows.to(self.dtype)
            k_cache.index_put_((layout.slot_blocks, layout.slot_offsets), k_rows)
            v_cache.index_put_((layout.slot_blocks, layout.slot_offsets), v_rows)
        if layout.fresh:
            if narrow:  # the KV as stored (rounded), in k's dtype
                return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(k.dtype)
            return k, v
        # index_select over the flat block list (several times faster on CPU than
        # advanced indexing): (B*nb, bs, n_kv, hd) -> (B, nb*bs, n_kv, hd) -> (B, C, n_kv, hd)
        B = layout.ctx_blocks.shape[0]
        ids = layout.ctx_blocks.view(-1)
        k_ctx = k_cache.index_select(0, ids).view(B, -1, self.num_kv_heads, self.head_dim)[:, : layout.ctx_len]
        v_ctx = v_cache.index_select(0, ids).view(B, -1, self.num_kv_heads, self.head_dim)[:, : layout.ctx_len]
        if narrow:  # widened once here, for this layer's attention
            k_ctx, v_ctx = k_ctx.to(k.dtype), v_ctx.to(k.dtype)
        return k_ctx, v_ctx

    def write_int8(self, layer: int, layout: "BatchLayout", k: Tensor, v: Tensor) -> None:
        """Int8 / fp8 KV: write the new K/V (B, T, n_kv, hd) of ``layer`` at the layout's slots
        (``_write_int8``) and return nothing: the attention reads the context from the
        pool a chunk of blocks at a time (``dequantized``; models/layers.py
        ``paged_int8_attention``), never as one widened copy."""
        self._write_int8(self._k[layer], self._k_scale[layer], layout, k)
        self._write_int8(self._v[layer], self._v_scale[layer], layout, v)

    def dequantized(self, layer: int, block_ids: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """Int8 / fp8 KV: the K and V of ``layer`` in ``block_ids`` (n,), dequantized:
        (n, bs, n_kv, hd) each, in ``dtype``."""
        return (dequantize(_select(self._k[layer], block_ids), self._k_scale[layer].index_select(0, block_ids), dtype),
                dequantize(_select(self._v[layer], block_ids), self._v_scale[layer].index_select(0, block_ids), dtype))

    def _update_int8(self, layer: int, layout: "BatchLayout", k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """``update`` for int8 / fp8 KV: each plane's new rows quantized at their own scales
        (``_write_int8``); the KV to attend over dequantized (in k's dtype). The model's
        layers call it for a fresh prefill only (the new K/V as stored); with a cached
        context they call ``write_int8`` and attend block by block."""
        kq = self._write_int8(self._k[layer], self._k_scale[layer], layout, k)
        vq = self._write_int8(self._v[layer], self._v_scale[layer], layout, v)
        if layout.fresh:  # the KV as stored (quantized), so a cache hit and a recompute agree
            return kq.to(k.dtype).view(k.shape), vq.to(k.dtype).view(v.shape)
        B = layout.ctx_blocks.shape[0]
        k_ctx, v_ctx = self.dequantized(layer, layout.ctx_blocks.view(-1), k.dtype)
        shape = (B, -1, self.num_kv_heads, self.head_dim)  # (B*nb, bs, n_kv, hd) -> (B, C, n_kv, hd)
        return k_ctx.view(shape)[:, : layout.ctx_len], v_ctx.view(shape)[:, : layout.ctx_len]

    def _write_int8(self, q_cache: Tensor, s_cache: Tensor, layout: "BatchLayout", x: Tensor) -> Tensor:
        """Write the new rows ``x`` (B, T, n_kv, hd) into one int8 / fp8 plane of the pool:
        q_cache (N, bs, n_kv, hd) int8 | e4m3, s_cache (N, bs, n_kv) float32; return the
        stored rows dequantized, (B*T, n_kv, hd) float32.

        Each row's scale per kv head is its own absmax / qmax (127; e4m3: 448), written
        beside its values at its slot: nothing else in the block is read or changes (the
        native kernels write a row alike, ``write_row_i8``: the same bits)."""
        rows = x.reshape(-1, self.num_kv_heads, self.head_dim).float()  # (B*T, n_kv, hd)
        scale = rows.abs().amax(-1) / QUANT_MAX[self.dtype]  # (B*T, n_kv)
        inv = torch.where(scale > 0, 1.0 / scale, 0.0)  # a row of zeros: scale 0, values 0
        q = quantize(rows, inv, self.dtype)  # (B*T, n_kv, hd) int8 | e4m3
        slots = (layout.slot_blocks, layout.slot_offsets)
        _rows_of(q_cache).index_put_(slots, _rows_of(q))
        s_cache.index_put_(slots, scale)
        return dequantize(q, scale)

    # ---- export / import (the cache store's unit) -----------------------------------

    def export_block(self, block_id: int, out: Tensor | None = None) -> Tensor:
        """A contiguous copy of one block, shape (L, 2, bs, n_kv, hd).

        With ``out`` (e.g. pinned host memory) the copy goes there (non-blocking from a
        CUDA pool into pinned memory: synchronize before reading it).
        """
        self._check_id(block_id)
        src = self.data[block_id]
        if out is None:
            return src.clone()
        self._check_tensor(out, self.block_shape, "out")
        out.copy_(src, non_blocking=self._async(out))
        return out

    def import_block(self, block_id: int, tensor: Tensor) -> None:
        """Copy one block's K/V (L, 2, bs, n_kv, hd) into ``block_id``.

        Non-blocking when the source is pinned and the pool is on CUDA; the copy is
        ordered before any later kernel on the current stream, but the caller must not
        overwrite the source until the stream has passed it.
        """
        self._check_id(block_id)
        self._check_tensor(tensor, self.block_shape, "tensor")
        self.data[block_id].copy_(tensor, non_blocking=self._async(tensor))

    def export_blocks(self, block_ids: Sequence[int], out: Tensor | None = None) -> Tensor:
        """Contiguous copies of several blocks, shape (n, L, 2, bs, n_kv, hd)."""
        idx = self._index(block_ids)
        if out is None:
            return _select(self.data, idx)
        self._check_tensor(out, (len(block_ids), *self.block_shape), "out")
        if out.device == self.device:
            torch.index_select(self._rows, 0, idx, out=_rows_of(out))
        else:
            out.copy_(_select(self.data, idx), non_blocking=self._async(out))
        return out

    def import_blocks(self, block_ids: Sequence[int], tensor: Tensor) -> None:
        """Copy (n, L, 2, bs, n_kv, hd) into the given blocks, in order."""
        idx = self._index(block_ids)
        self._check_tensor(tensor, (len(block_ids), *self.block_shape), "tensor")
        if tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=self._async(tensor))
        self._rows.index_copy_(0, idx, _rows_of(tensor))

    def scatter(self, block_ids: Tensor, blocks: Tensor) -> None:
        """``blocks`` (n, L, 2, bs, n_kv, hd), on the pool's device, into the pool blocks
        ``block_ids`` (an int64 tensor there, ids unchecked: the caller's own blocks): one
        ``index_copy_``, a restore's scatter out of device staging (service/kv/transfer.py)."""
        self._rows.index_copy_(0, block_ids, _rows_of(blocks))

    def _async(self, host: Tensor) -> bool:
        return self.device.type == "cuda" and host.device.type == "cpu" and host.is_pinned()

    def _index(self, block_ids: Sequence[int]) -> Tensor:
        for b in block_ids:
            self._check_id(b)
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def _check_id(self, block_id: int) -> None:
        if not 0 < block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside 1..{self.num_blocks - 1} (0 is the null block)")

    def _check_tensor(self, t: Tensor, shape: tuple[int, ...], name: str) -> None:
        if tuple(t.shape) != tuple(shape) or t.dtype != self.dtype:
            raise ValueError(f"{name}: expected {tuple(shape)} {self.dtype}, got {tuple(t.shape)} {t.dtype}")


def quantize(x: Tensor, inv_scale: Tensor, dtype: torch.dtype = torch.int8) -> Tensor:
    """Int8 KV: round(x * inv_scale) (to nearest even) clamped to +-127, int8; inv_scale
    (..., n_kv) broadcast over x's last dim (hd). The native kernels round alike. Fp8 KV
    (``dtype`` float8_e4m3fn): x * inv_scale clamped to +-448, cast to e4m3 (to nearest even)."""
    y = x.float() * inv_scale[..., None]
    if dtype == torch.float8_e4m3fn:
        return y.clamp_(-FP8_MAX, FP8_MAX).to(dtype)
    return y.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)


def _rows_of(t: Tensor) -> Tensor:
    """``t`` as torch's index ops take it on every device: an e4m3 tensor's bytes (uint8;
    torch's CPU ``index_copy_`` has no float8 kernel), else ``t``."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _select(t: Tensor, index: Tensor) -> Tensor:
    """``t.index_select(0, index)`` through ``_rows_of`` (e4m3 selected as bytes), in t's dtype."""
    return _rows_of(t).index_select(0, index).view(t.dtype)


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Int8 / fp8 KV: q (..., n_kv, hd) int8 | e4m3 with scale (..., n_kv), one per row and
    kv head: q * scale, in ``dtype``."""
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


def _side_by_side(k: Tensor, v: Tensor) -> Tensor | None:
    """A (B, T, 2, n_kv, hd) view over k and v (each (B, T, n_kv, hd)) when v's heads follow
    k's in the same storage with the same strides; else None. Reads no data."""
    if k.dim() != 4 or k.shape != v.shape or k.stride() != v.stride() or k.dtype != v.dtype:
        return None
    B, T, n, hd = k.shape
    sb, st, sh, sd = k.stride()
    if v.storage_offset() - k.storage_offset() != n * sh:
        return None
    if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
        return None
    return k.as_strided((B, T, 2, n, hd), (sb, st, n * sh, sh, sd))


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """Run ``token_ids`` at positions ``start_pos .. start_pos + len - 1``.

    The KV of positions < ``start_pos`` is already in the pool, in ``block_table``'s
    blocks; ``block_table`` covers at least ``start_pos + len(token_ids)`` positions.
    """

    block_table: Sequence[int]
    start_pos: int
    token_ids: Sequence[int]
    long_rope: bool | None = None  # LongRoPE models: this sequence's factor set (None: by this forward's length)


class DecodeRows:
    """A decode step's rows, what every decode step backend takes (models/step.py
    ``DecodeStep``): one new token per row at its position over a block table (a
    sequence's pending token and drafts are rows at consecutive positions over one
    table), and its LongRoPE regime (None: none given). ``pack`` lays them out as one
    int64 array in the order the native kernel reads: ids, positions, the block and
    offset where each row's K/V goes, context lengths (the row's token included), then
    the tables cut or padded with the null block to the step's longest context. The
    layout ``BatchLayout.build`` makes of the same rows, without its tensors."""

    __slots__ = ("block_size", "ids", "positions", "tables", "long_rope")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.tables: list[Sequence[int]] = []
        self.long_rope: list[bool | None] = []

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, table: Sequence[int], start: int, tokens: Sequence[int], long_rope: bool | None = None) -> None:
        """``tokens`` as rows at positions start, start + 1, ... over ``table`` (ValueError
        when the table does not cover them)."""
        if start < 0 or len(table) * self.block_size < start + len(tokens):
            raise ValueError(f"a block table of {len(table)} blocks does not cover positions up to {start + len(tokens)}")
        self.ids.extend(tokens)
        self.positions.extend(range(start, start + len(tokens)))
        self.tables.extend([table] * len(tokens))
        self.long_rope.extend([long_rope] * len(tokens))

    def pack(self) -> tuple[array.array, int, int, int]:
        """(the int64 array, rows B, blocks per table nb, the longest context)."""
        bs, pos, tables = self.block_size, self.positions, self.tables
        longest = max(pos) + 1
        nb = -(-longest // bs)
        buf = array.array("q", self.ids)
        buf.extend(pos)
        buf.extend([t[p // bs] for t, p in zip(tables, pos)])
        buf.extend([p % bs for p in pos])
        buf.extend([p + 1 for p in pos])
        for t in tables:
            cut = t[:nb]
            buf.extend(cut)
            if len(cut) < nb:
                buf.extend([NULL_BLOCK] * (nb - len(cut)))
        return buf, len(pos), nb, longest


def _check_slices(seqs: Sequence[SeqSlice], block_size: int) -> tuple[list[int], list[int], list[int]]:
    """(new tokens, start positions, ends) of ``seqs``; ValueError for a slice with no new
    token, a negative start or a block table too short for its end."""
    lens = [len(s.token_ids) for s in seqs]
    starts = [int(s.start_pos) for s in seqs]
    totals = [s + n for s, n in zip(starts, lens)]
    for i, s in enumerate(seqs):
        if lens[i] < 1 or starts[i] < 0:
            raise ValueError(f"sequence {i}: needs >= 1 new token and start_pos >= 0")
        if len(s.block_table) * block_size < totals[i]:
            raise ValueError(
                f"sequence {i}: block table of {len(s.block_table)} blocks covers "
                f"{len(s.block_table) * block_size} positions, needs {totals[i]}"
            )
    return lens, starts, totals


@dataclass(frozen=True, slots=True, eq=False)
class BatchLayout:
    """Attention metadata of one forward pass over B sequences of up to T new tokens.

    Padding (sequences shorter than T) repeats the sequence's last position, writes its
    K/V into the null block and is never attended to by real tokens.
    """

    input_ids: Tensor  # (B, T) long, padded with 0
    positions: Tensor  # (B, T) long
    slot_blocks: Tensor  # (B*T,) long: block receiving each new token's K/V (padding: NULL_BLOCK)
    slot_offsets: Tensor  # (B*T,) long: offset inside that block
    ctx_blocks: Tensor | None  # (B, nb) long: blocks holding each sequence's context; None if fresh
    ctx_len: int  # C: key length attended over (T when fresh)
    _mask: Tensor | None  # ``attn_mask`` as built (a batched decode step's is made on first use instead)
    is_causal: bool  # use SDPA's causal mask (fresh, equal lengths, T > 1)
    fresh: bool  # every start_pos == 0: attend over the new K/V directly, no gather
    last_index: Tensor  # (B,) long: flat index (b*T + t) of each sequence's last new token
    seq_lens: tuple[int, ...]  # start_pos + new tokens, per sequence
    num_new_tokens: tuple[int, ...]  # new (real) tokens per sequence
    block_size: int
    long_rope: Tensor | None = None  # (B,) bool: LongRoPE long factors per sequence; None: none was given
    _deferred_mask: torch.dtype | None = None  # a batched decode step: ``attn_mask``'s dtype, made on first use
    # an overlapped restore (service/engine/restore.py): landed(layer) returns once that
    # layer of the context being restored is in the pool; None: the context is all there
    landed: Callable[[int], None] | None = None
    _bias: dict[object, object] = field(default_factory=dict, repr=False)  # per-layout cache: masks per dtype (and window), kv_slots

    @property
    def attn_mask(self) -> Tensor | None:
        """(B, 1, T, C) additive (0 / -inf) in the model dtype; None: no mask. A batched
        decode step's is made on first use (the native decode layer never reads it)."""
        if self._deferred_mask is None:
            return self._mask
        if "decode_mask" not in self._bias:
            c_idx = torch.arange(self.ctx_len, device=self.positions.device)
            allowed = c_idx[None, None, :] <= self.positions[:, :, None]  # (B, 1, C)
            mask = torch.zeros(allowed.shape, dtype=self._deferred_mask, device=allowed.device)
            self._bias["decode_mask"] = mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)  # (B, 1, 1, C)
        return self._bias["decode_mask"]

    def attn_bias(self, dtype: torch.dtype) -> Tensor | None:
        """``attn_mask`` in ``dtype`` (converted once per layout, then shared by every layer)."""
        mask = self.attn_mask
        if mask is None or mask.dtype == dtype:
            return mask
        if dtype not in self._bias:
            self._bias[dtype] = mask.to(dtype)
        return self._bias[dtype]

    def kv_slots(self) -> tuple[Tensor, Tensor, Tensor]:
        """Indices of a one-op K and V write into a layer's (N, 2, bs, n_kv, hd) pool view:
        (block (B*T, 1), K|V (1, 2), offset (B*T, 1)); built once per layout, shared by
        every layer."""
        if "kv_slots" not in self._bias:
            kv = torch.arange(2, device=self.slot_blocks.device)[None, :]  # (1, 2)
            self._bias["kv_slots"] = (self.slot_blocks[:, None], kv, self.slot_offsets[:, None])
        return self._bias["kv_slots"]

    def mask_for(self, dtype: torch.dtype, window: int | None) -> tuple[Tensor | None, bool]:
        """(additive mask or None, is_causal) for a layer whose queries see only the last
        ``window`` positions (themselves included), as HF's sliding-window mask:
        key c is visible to the query at position p iff p - window < c <= p.

        ``window`` None, or no sequence longer than the window: the layout's own mask.
        Key index c is the key's position in both layouts (fresh: the new tokens from
        position 0; otherwise the gathered context), so one formula covers both."""
        if window is None or max(self.seq_lens) <= window:
            return self.attn_bias(dtype), self.is_causal
        key = (dtype, window)
        if key not in self._bias:
            c_idx = torch.arange(self.ctx_len, device=self.positions.device)  # (C,)
            q_pos = self.positions[:, :, None]  # (B, T, 1)
            allowed = (c_idx <= q_pos) & (c_idx > q_pos - window)  # (B, T, C)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            self._bias[key] = bias.unsqueeze(1)  # (B, 1, T, C)
        return self._bias[key], False

    def lens_tensor(self) -> Tensor:
        """``seq_lens`` as a (B,) int64 tensor (built once per layout): the context length
        of each sequence, new tokens included."""
        if "lens" not in self._bias:
            self._bias["lens"] = torch.tensor(self.seq_lens, dtype=torch.long, device=self.slot_blocks.device)
        return self._bias["lens"]

    def new_tokens_tensor(self) -> Tensor:
        """``num_new_tokens`` as a (B,) int64 tensor (built once per layout)."""
        if "new_tokens" not in self._bias:
            self._bias["new_tokens"] = torch.tensor(self.num_new_tokens, dtype=torch.long, device=self.slot_blocks.device)
        return self._bias["new_tokens"]

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        """Real tokens run through the model by this forward (padding excluded)."""
        return sum(self.num_new_tokens)

    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqSlice],
        block_size: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        landed: Callable[[int], None] | None = None,
    ) -> "BatchLayout":
        """Lay out ``seqs`` for one forward; ``dtype`` is the model's (for the additive mask);
        ``landed``: the layout's field (an overlapped restore's per-layer wait)."""
        if not seqs:
            raise ValueError("BatchLayout.build needs at least one sequence")
        device = torch.device(device)
        lens, starts, totals = _check_slices(seqs, block_size)
        B, T = len(seqs), max(lens)
        num_blocks = max(math.ceil(t / block_size) for t in totals)
        if T == 1 and any(starts):
            layout = cls._build_decode(seqs, starts, totals, num_blocks, block_size, device, dtype)
            return layout if landed is None else dataclasses.replace(layout, landed=landed)
        ids = [list(s.token_ids) + [0] * (T - n) for s, n in zip(seqs, lens)]
        tables = [list(s.block_table[:num_blocks]) + [NULL_BLOCK] * (num_blocks - len(s.block_table[:num_blocks]))
                  for s in seqs]

        input_ids = torch.tensor(ids, dtype=torch.long, device=device)  # (B, T)
        table = torch.tensor(tables, dtype=torch.long, device=device)  # (B, nb)
        start_t = torch.tensor(starts, dtype=torch.long, device=device)  # (B,)
        len_t = torch.tensor(lens, dtype=torch.long, device=device)  # (B,)
        t_idx = torch.arange(T, device=device)  # (T,)
        real = t_idx[None, :] < len_t[:, None]  # (B, T)
        positions = start_t[:, None] + torch.minimum(t_idx[None, :], len_t[:, None] - 1)  # (B, T)
        blocks = table.gather(1, positions // block_size)  # (B, T)
        slot_blocks = torch.where(real, blocks, NULL_BLOCK).reshape(-1)
        slot_offsets = (positions % block_size).reshape(-1)
        last_index = torch.arange(B, device=device) * T + len_t - 1

        fresh = all(s == 0 for s in starts)
        ctx_blocks = None
        mask = None
        is_causal = False
        if fresh:
            ctx_len = T
            if all(n == T for n in lens):
                is_causal = T > 1
            else:  # causal within each sequence, cut at its length
                allowed = (t_idx[None, None, :] <= t_idx[None, :, None]) & (t_idx[None, None, :] < len_t[:, None, None])
                mask = allowed  # (B, T, T)
        else:
            ctx_len = max(totals)
            ctx_blocks = table[:, : math.ceil(ctx_len / block_size)].contiguous()
            if not (B == 1 and T == 1):  # a lone decode token sees its whole (sliced) context
                c_idx = torch.arange(ctx_len, device=device)
                mask = c_idx[None, None, :] <= positions[:, :, None]  # (B, T, C)
        attn_mask = None
        if mask is not None:
            attn_mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))
            attn_mask = attn_mask.unsqueeze(1)  # (B, 1, T, C)
        long_rope = None
        if any(s.long_rope is not None for s in seqs):
            long_rope = torch.tensor([bool(s.long_rope) for s in seqs], dtype=torch.bool, device=device)
        return cls(
            input_ids=input_ids,
            positions=positions,
            slot_blocks=slot_blocks,
            slot_offsets=slot_offsets,
            ctx_blocks=ctx_blocks,
            ctx_len=ctx_len,
            _mask=attn_mask,
            is_causal=is_causal,
            fresh=fresh,
            last_index=last_index,
            seq_lens=tuple(totals),
            num_new_tokens=tuple(lens),
            block_size=block_size,
            long_rope=long_rope,
            landed=landed,
        )

    @classmethod
    def _build_decode(cls, seqs: Sequence[SeqSlice], starts: list[int], totals: list[int], num_blocks: int,
                      block_size: int, device: torch.device, dtype: torch.dtype) -> "BatchLayout":
        """``build`` for a decode step (one new token per sequence, some cached context):
        the same layout, its integer tensors views of one tensor made from one Python list
        (one host-to-device copy), not a dozen small ops, and its mask made only if read.
        Block tables given as int64 arrays (the engine's) are copied whole, not id by id."""
        B = len(seqs)
        flat = [s.token_ids[0] for s in seqs]  # input_ids
        flat += starts  # positions: the new token's
        flat += [s.block_table[p // block_size] for s, p in zip(seqs, starts)]  # slot_blocks
        flat += [p % block_size for p in starts]  # slot_offsets
        flat += totals  # lens_tensor()
        flat += range(B)  # last_index: one token per sequence
        # int64 through an array: several times faster than torch.tensor(list)
        buf = array.array("q", flat)
        for s in seqs:  # ctx_blocks (B, num_blocks): each table cut or padded with the null block
            t = s.block_table[:num_blocks]
            buf.extend(t.tolist() if isinstance(t, array.array) and t.typecode != "q" else t)
            if len(t) < num_blocks:
                buf.extend([NULL_BLOCK] * (num_blocks - len(t)))
        data = torch.frombuffer(buf, dtype=torch.long)  # shares the array's memory (kept alive)
        if device.type != "cpu":
            data = data.to(device)
        input_ids, positions, slot_blocks, slot_offsets, lens, last_index, table = data.split_with_sizes(
            (B, B, B, B, B, B, B * num_blocks))
        positions = positions.view(B, 1)
        ctx_len = max(totals)
        long_rope = None
        if any(s.long_rope is not None for s in seqs):
            long_rope = torch.tensor([bool(s.long_rope) for s in seqs], dtype=torch.bool, device=device)
        layout = cls(
            input_ids=input_ids.view(B, 1),
            positions=positions,
            slot_blocks=slot_blocks,
            slot_offsets=slot_offsets,
            ctx_blocks=table.view(B, num_blocks),  # num_blocks covers ctx_len = max(totals) exactly
            ctx_len=ctx_len,
            _mask=None,  # a lone decode token sees its whole (sliced) context; a batch's mask: on first use
            is_causal=False,
            fresh=False,
            last_index=last_index,
            seq_lens=tuple(totals),
            num_new_tokens=(1,) * B,
            block_size=block_size,
            long_rope=long_rope,
            _deferred_mask=dtype if B > 1 else None,
        )
        layout._bias["lens"] = lens
        return layout
