"""The CUDA step's Triton kernels (service/kernels/triton/) on the CPU, under Triton's
interpreter, against the project's own torch paths: the pool's writes (``KVPool.update``,
``write_int8``: the same bytes, int8 / fp8 values and per-row scales included), the
model's attention over the pool (``KVPool.update`` + ``BatchLayout.mask_for`` +
``layers.sdpa`` / Gemma's ``softcapped_attention``; int8 / fp8: ``paged_int8_attention``),
``RMSNorm`` with the families' residual adds, ``apply_rope_`` over ``Rotary``'s tables
(partial, LongRoPE, Gemma 3's local table, Qwen3 / Gemma 3 q/k norms) and the pool's
block import, on small shapes: every KV format, GQA ratios (MHA, 2, 3, MQA), windows,
soft-caps, head dims that are no power of two, odd lengths, block boundaries.

Triton reads ``TRITON_INTERPRET`` when it is imported and when a kernel is defined, which
the package does on its first call: the module sets it before either (and leaves it set:
see ``_interpreted_kernels``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.service.kernels import triton as tk
from kvserve.service.kv.block_manager import NULL_BLOCK
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice
from kvserve.service.models.gemma import softcapped_attention
from kvserve.service.models.layers import RMSNorm, paged_int8_attention, sdpa
from kvserve.service.models.rope import Rotary, apply_rope_

REPO = Path(__file__).resolve().parents[2]


def _interpreted_kernels() -> str:
    """"" when the kernels loaded under the interpreter, else why not. TRITON_INTERPRET
    stays set: Triton 3.9 reads it when triton is imported (its own library functions are
    defined then), when a kernel is defined, and again at the first launch (gluon's import
    asserts it), so it must hold for the process from before the import on."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if not tk.available():  # imports triton and defines the kernels
        return tk.reason()
    return "" if tk.interpreted() else "triton was imported before TRITON_INTERPRET was set"


_WHY = _interpreted_kernels()
needs_triton = pytest.mark.skipif(bool(_WHY), reason=f"triton kernels unavailable: {_WHY}")

FORMATS = {"exact": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8,
           "fp8": torch.float8_e4m3fn}


def raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes for exact comparisons (torch's CPU ``equal`` has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def make_pools(fmt: str, n: int = 2, blocks: int = 24, layers: int = 2, bs: int = 4, nkv: int = 2, hd: int = 16,
               model: torch.dtype = torch.float32, seed: int = 0) -> list[KVPool]:
    """``n`` identical pools of one format, their blocks holding garbage (a previous
    owner's bytes, as a reused pool's do: a kernel that reads past a context or keeps a
    stale scale shows)."""
    dtype = FORMATS[fmt] if fmt != "exact" else model
    pools = [KVPool(blocks, layers, bs, nkv, hd, dtype, compute_dtype=model) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    if pools[0].spec.quantized:
        junk = torch.randint(-100, 100, pools[0].data.shape, generator=g, dtype=torch.int8)
        if dtype == torch.float8_e4m3fn:
            junk = (junk.float() / 8).to(dtype)
        for p in pools:
            raw(p.data).copy_(raw(junk))
        for layer in range(layers):  # plausible old scales (the new rows' absmax / qmax is ~0.01-0.1)
            ks, vs = torch.rand(2, blocks, bs, nkv, generator=g) * 0.05
            for p in pools:
                p.k_scale(layer).copy_(ks)
                p.v_scale(layer).copy_(vs)
    else:
        junk = torch.randn(pools[0].data.shape, generator=g).to(dtype)
        for p in pools:
            p.data.copy_(junk)
    return pools


def packed_rows(layout: BatchLayout, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The layout's real rows of each (B, T, ...) tensor, packed in order (T', ...)."""
    B, T = layout.input_ids.shape
    idx = torch.tensor([b * T + t for b in range(B) for t in range(layout.num_new_tokens[b])])
    return tuple(x.reshape(B * T, *x.shape[2:]).index_select(0, idx) for x in tensors)


def slot_mapping(layout: BatchLayout) -> torch.Tensor:
    """Each real row's slot (block * bs + offset), packed as ``packed_rows``."""
    slots = (layout.slot_blocks * layout.block_size + layout.slot_offsets).view(*layout.input_ids.shape, 1)
    return packed_rows(layout, slots)[0].view(-1)


def scales(pool: KVPool, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (pool.k_scale(layer), pool.v_scale(layer)) if pool.spec.quantized else (None, None)


def kernel_write(pool: KVPool, layer: int, layout: BatchLayout, k: torch.Tensor, v: torch.Tensor,
                 padding: int = 0) -> None:
    """``write_kv`` of the layout's real rows of k, v (B, T, n_kv, hd), ``padding`` rows of
    slot -1 after each sequence's (the graph runner's padded rows: never written)."""
    kr, vr = packed_rows(layout, k, v)
    slots = slot_mapping(layout)
    if padding:
        def padded(x: torch.Tensor, fill: float) -> torch.Tensor:
            pad = torch.full((padding, *x.shape[1:]), fill, dtype=x.dtype)
            return torch.cat([torch.cat([rows, pad]) for rows in x.split(list(layout.num_new_tokens))])

        kr, vr, slots = padded(kr, 9.0), padded(vr, -9.0), padded(slots, -1)
    tk.write_kv(kr, vr, pool.k(layer), pool.v(layer), slots, *scales(pool, layer))


def same_pools(a: KVPool, b: KVPool) -> bool:
    """The pools' bytes equal, the null block aside (the reference's padding rows land there)."""
    keep = torch.arange(a.num_blocks) != NULL_BLOCK
    return torch.equal(raw(a.data)[keep], raw(b.data)[keep])


# ---- KV write ---------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_write_kv_writes_the_pools_bytes(fmt) -> None:
    """A prefill crossing blocks, decode steps whose rows grow (int8 / fp8: each at its own
    scale, the rows before it untouched), a chunk across a block boundary, and a block
    reused from offset 0 by a sequence of small values (int8 / fp8: their own scales, not
    the old owner's): ``write_kv`` leaves the pool byte for byte as ``KVPool.update`` does,
    padding rows (slot -1) writing nothing."""
    ref, kern = make_pools(fmt, nkv=2, hd=12)
    g = torch.Generator().manual_seed(1)
    tables = [[3, 5, 7, 11], [9, 2, 6]]

    def step(seqs: list[SeqSlice], magnitude: float = 1.0, padding: int = 0) -> None:
        layout = BatchLayout.build(seqs, 4)
        B, T = layout.input_ids.shape
        k, v = (magnitude * torch.randn(2, B, T, 2, 12, generator=g)).unbind(0)
        ref.update(1, layout, k, v)
        kernel_write(kern, 1, layout, k, v, padding)
        assert same_pools(ref, kern)

    step([SeqSlice(tables[0], 0, [1] * 7), SeqSlice(tables[1], 0, [1] * 5)], padding=2)
    for i, mag in enumerate((2.0, 0.5, 4.0)):  # decode rows; rows larger than the block's scale
        step([SeqSlice(tables[0], 7 + i, [1]), SeqSlice(tables[1], 5 + i, [1])], magnitude=mag, padding=1)
    step([SeqSlice(tables[0], 10, [1] * 4)], magnitude=3.0)  # a chunk over positions 10..13: blocks 2 and 3
    step([SeqSlice([7], 0, [1] * 3)], magnitude=0.01)  # block 7 reused from offset 0 by a new owner
    if ref.spec.quantized:
        assert ref.k_scale(1)[7, :3].max() < 0.01  # its rows' scales are theirs, not the old owner's


@needs_triton
@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
def test_write_kv_rounds_every_tie_as_torch(fmt) -> None:
    """Values exactly between two stored ones (bf16: the lower 16 bits 0x8000, both
    parities; int8: k + 0.5; e4m3: the midpoint of every pair of neighbours, subnormals and
    the step into the normals included), at a scale of exactly 1 (each row's head's absmax is
    the format's largest value): the kernel rounds each to the even neighbour, the same bytes as
    ``KVPool.update`` (``Tensor.to``, ``round``)."""
    bs, nkv, hd = 4, 2, 64
    ref, kern = make_pools(fmt, n=2, blocks=3, layers=1, bs=bs, nkv=nkv, hd=hd)
    n = bs * nkv * hd
    g = torch.Generator().manual_seed(4)
    if fmt == "bf16":
        bits = torch.randint(-(2**15), 2**15, (n,), generator=g, dtype=torch.int32) & ~0x8080
        vals = ((bits << 16) | 0x8000 | ((torch.arange(n, dtype=torch.int32) % 2) << 16)).view(torch.float32)
        vals = vals.masked_fill(~vals.isfinite(), 1.0)
    else:
        if fmt == "int8":
            mids = torch.arange(-127, 127) + 0.5
        else:
            grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
            mids = (grid[:-1] + grid[1:]) / 2
            mids = torch.cat([mids, -mids])
        vals = mids[torch.randint(0, len(mids), (n,), generator=g)]
        vals = vals.view(bs, nkv, hd)
        vals[:, :, 0] = 127.0 if fmt == "int8" else 448.0  # each row's head's absmax: a scale of exactly 1
        vals = vals.reshape(n)
    k = vals.view(1, bs, nkv, hd)
    v = -k
    layout = BatchLayout.build([SeqSlice([2], 0, [1] * bs)], bs)
    ref.update(0, layout, k, v)
    kernel_write(kern, 0, layout, k, v)
    if fmt != "bf16":
        assert torch.equal(ref.k_scale(0)[2], torch.ones(bs, nkv))
    assert same_pools(ref, kern)


@needs_triton
def test_write_kv_handles_a_verify_steps_rows_in_one_block() -> None:
    """A speculative step's rows: 3 consecutive rows of one sequence, two in one block and
    one opening the next, and a lone decode row, 5x the rows before them: each quantized
    alone, the rows already in their blocks untouched."""
    ref, kern = make_pools("int8", nkv=1, hd=8)
    g = torch.Generator().manual_seed(2)
    seqs = [SeqSlice([4, 8, 12], 0, [1] * 6), SeqSlice([5, 10], 0, [1] * 3)]
    layout = BatchLayout.build(seqs, 4)
    k, v = torch.randn(2, 2, 6, 1, 8, generator=g)
    ref.update(0, layout, k, v)
    kernel_write(kern, 0, layout, k, v)
    layout = BatchLayout.build([SeqSlice([4, 8, 12], 6, [1, 1, 1]), SeqSlice([5, 10], 3, [1])], 4)
    k, v = (5 * torch.randn(2, 2, 3, 1, 8, generator=g)).unbind(0)
    ref.update(0, layout, k, v)
    kernel_write(kern, 0, layout, k, v)
    assert same_pools(ref, kern)


# ---- attention --------------------------------------------------------------------------


def torch_attention(pool: KVPool, layer: int, layout: BatchLayout, q, k, v, scale, window, softcap) -> torch.Tensor:
    """``PagedAttention.forward``'s attention (after q/k/v): the new K/V written, then
    attention over the pool as the model runs it; (B, T, nh, hd)."""
    if pool.spec.quantized and not layout.fresh:
        pool.write_int8(layer, layout, k, v)
        mask, _ = layout.mask_for(torch.float32, window)
        return paged_int8_attention(q, pool, layer, layout, mask, scale, softcap, chunk_blocks=2)
    kc, vc = pool.update(layer, layout, k, v)
    mask, is_causal = layout.mask_for(q.dtype, window)
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    if softcap is not None:
        return softcapped_attention(qt, kt, vt, mask, is_causal, scale, softcap).transpose(1, 2)
    return sdpa(qt, kt, vt, mask, is_causal, scale).transpose(1, 2)


def fill_contexts(pools: list[KVPool], layer: int, tables: list[list[int]], lens: list[int], g: torch.Generator,
                  dtype: torch.dtype) -> None:
    """Each sequence's first lens[b] positions written by one prefill through the pools' own path."""
    for t, n in zip(tables, lens):
        layout = BatchLayout.build([SeqSlice(t, 0, [1] * n)], pools[0].block_size)
        k, v = torch.randn(2, 1, n, pools[0].num_kv_heads, pools[0].head_dim, generator=g).to(dtype).unbind(0)
        for p in pools:
            p.update(layer, layout, k, v)


def tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


DECODE_CASES = [  # fmt, model dtype, nh, nkv, hd, window, softcap, splits
    ("exact", torch.float32, 4, 4, 16, None, None, 1),  # MHA
    ("exact", torch.float32, 6, 2, 24, 5, None, 3),  # G = 3, hd no power of two, a window, 3 splits
    ("exact", torch.float32, 8, 1, 16, None, 5.0, 4),  # MQA, Gemma 2's soft-cap
    ("bf16", torch.float32, 4, 2, 16, 7, 5.0, 2),
    ("fp16", torch.float32, 4, 2, 16, None, None, 1),
    ("int8", torch.float32, 4, 2, 16, None, None, 3),
    ("int8", torch.float32, 6, 2, 24, 5, 5.0, 1),
    ("fp8", torch.float32, 4, 1, 16, 6, None, 2),
    ("exact", torch.bfloat16, 4, 2, 16, None, 5.0, 2),  # a bfloat16 model over its own KV
]


def tables_for(lens: list[int], bs: int, blocks: int, seed: int) -> list[list[int]]:
    """A block table per context length, distinct blocks drawn from 1..blocks - 1 in no order."""
    ids = (torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    out = []
    for n in lens:
        need = -(-n // bs)
        out.append(ids[:need])
        ids = ids[need:]
    return out


def check_decode(fmt: str, model: torch.dtype, nh: int, nkv: int, hd: int, window: int | None, softcap: float | None,
                 splits: int, lens: list[int], bs: int = 4, tile: int | None = 16, blocks: int = 24) -> None:
    """A decode step of a row per context length in ``lens`` (each row's own token
    included) over contexts written by the pools' own prefill, plus a padding row (context
    0: zeros): write_kv then decode_attention leave the pool as the model's torch path
    does and attend as it does."""
    ref, kern = make_pools(fmt, blocks=blocks, bs=bs, nkv=nkv, hd=hd, model=model, seed=nh + hd + bs)
    g = torch.Generator().manual_seed(nh * hd + bs)
    tables = tables_for(lens, bs, blocks, seed=hd)
    B = len(lens)
    fill_contexts([ref, kern], 1, tables, [n - 1 for n in lens], g, model)
    layout = BatchLayout.build([SeqSlice(t, n - 1, [5]) for t, n in zip(tables, lens)], bs)
    q = torch.randn(B, 1, nh, hd, generator=g).to(model)
    k, v = (2 * torch.randn(2, B, 1, nkv, hd, generator=g)).to(model).unbind(0)
    scale = hd**-0.5 if softcap is None else 0.7  # Gemma's query_pre_attn_scalar^-1/2 is no head_dim's
    expected = torch_attention(ref, 1, layout, q, k, v, scale, window, softcap)[:, 0]

    kernel_write(kern, 1, layout, k, v)
    assert same_pools(ref, kern)
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width], dtype=torch.int32)
    lens_t = torch.tensor(lens + [0], dtype=torch.int32)
    qp = torch.cat([q[:, 0], torch.randn(1, nh, hd, generator=g).to(model)])  # a padding row last
    out = torch.full((B + 1, nh, hd), float("nan"), dtype=model)
    ws = tk.attention_workspace(B + 1, nh, hd, splits, "cpu") if splits > 1 else None
    if ws is not None:
        ws[0].fill_(float("nan")), ws[1].fill_(float("nan"))  # every entry a split reads is written first
    tk.decode_attention(out, qp, kern.k(1), kern.v(1), tables_t, lens_t, ws, scale=scale, window=window,
                        softcap=softcap, k_scale=scales(kern, 1)[0], v_scale=scales(kern, 1)[1], tile=tile)
    torch.testing.assert_close(out[:B].float(), expected.float(), **tolerance(model))
    assert torch.equal(out[B], torch.zeros_like(out[B]))


@needs_triton
@pytest.mark.parametrize("fmt,model,nh,nkv,hd,window,softcap,splits", DECODE_CASES)
def test_decode_attention_matches_the_models_torch_path(fmt, model, nh, nkv, hd, window, softcap, splits) -> None:
    """Rows over contexts of 14, 9 and 2 positions (an open block, a new token opening a
    block, one block; blocks of 4, tiles of 16 keys) and a padding row."""
    check_decode(fmt, model, nh, nkv, hd, window, softcap, splits, [14, 9, 2])


@needs_triton
@pytest.mark.parametrize("fmt,bs,tile", [("exact", 3, 16), ("int8", 3, 16), ("fp8", 16, 32), ("bf16", 32, 16)])
def test_decode_attention_over_any_block_size_and_tile(fmt, bs, tile) -> None:
    """Blocks of an odd size (3: a tile spans five and a part), of a tile's size and of
    twice it (a block spans two tiles)."""
    check_decode(fmt, torch.float32, 4, 2, 16, None, None, 2, [3 * bs + 1, 2 * bs, bs - 1 or 1], bs, tile,
                 blocks=12)


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("fmt,model", [("exact", torch.bfloat16), ("int8", torch.float32), ("fp8", torch.bfloat16),
                                       ("fp16", torch.float32)])
def test_decode_attention_at_a_models_size(fmt, model) -> None:
    """head_dim 128, blocks of 16, the kernel's own tile, contexts of hundreds of positions
    (300 over 19 blocks), 4 q heads a kv head, 8 splits, a window of 64."""
    check_decode(fmt, model, 8, 2, 128, 64, None, 8, [300, 129, 17], 16, None, blocks=40)


@needs_triton
@pytest.mark.parametrize("fmt", ["exact", "int8"])
def test_verify_rows_decode_as_the_extend_attends(fmt) -> None:
    """A speculative step: a sequence's pending token and two drafts as three decode rows
    over one table (context lengths n, n + 1, n + 2) attend as the three new tokens of one
    extend over that table (the torch path's chunk), the window cutting in."""
    ref, kern = make_pools(fmt, nkv=2, hd=16, seed=3)
    g = torch.Generator().manual_seed(3)
    table, n = [6, 2, 9, 14], 11
    fill_contexts([ref, kern], 0, [table], [n - 1], g, torch.float32)
    layout = BatchLayout.build([SeqSlice(table, n - 1, [1, 2, 3])], 4)
    q = torch.randn(1, 3, 4, 16, generator=g)
    k, v = torch.randn(2, 1, 3, 2, 16, generator=g).unbind(0)
    expected = torch_attention(ref, 0, layout, q, k, v, 0.25, 6, None)[0]
    kernel_write(kern, 0, layout, k, v)
    out = torch.empty(3, 4, 16)
    tables_t = torch.tensor([table] * 3)
    lens_t = torch.tensor([n, n + 1, n + 2])
    ws = tk.attention_workspace(3, 4, 16, 2, "cpu")
    tk.decode_attention(out, q[0], kern.k(0), kern.v(0), tables_t, lens_t, ws, scale=0.25, window=6,
                        k_scale=scales(kern, 0)[0], v_scale=scales(kern, 0)[1], tile=16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def check_extend(fmt: str, model: torch.dtype, nh: int, nkv: int, hd: int, window: int | None, softcap: float | None,
                 block_q: int | None, splits: int, cached: list[int], new: list[int], bs: int = 4,
                 tile: int | None = 16, blocks: int = 32) -> None:
    """One packed step of sequences with ``cached`` positions in the pool and ``new`` new
    tokens each (0 cached: a fresh prefill), then two padding rows: write_kv then
    extend_attention leave the pool and attend as the model's torch path; the padding rows
    are not written."""
    ref, kern = make_pools(fmt, blocks=blocks, bs=bs, nkv=nkv, hd=hd, model=model, seed=nh + hd + 1)
    g = torch.Generator().manual_seed(nh * hd + 1)
    tables = tables_for([c + m for c, m in zip(cached, new)], bs, blocks, seed=hd + 1)
    fill_contexts([ref, kern], 1, [t for t, c in zip(tables, cached) if c], [c for c in cached if c], g, model)
    layout = BatchLayout.build([SeqSlice(t, c, [1] * m) for t, c, m in zip(tables, cached, new)], bs)
    B, T = layout.input_ids.shape
    q = torch.randn(B, T, nh, hd, generator=g).to(model)
    k, v = torch.randn(2, B, T, nkv, hd, generator=g).to(model).unbind(0)
    scale = 0.3
    expected, = packed_rows(layout, torch_attention(ref, 1, layout, q, k, v, scale, window, softcap))

    kernel_write(kern, 1, layout, k, v)
    assert same_pools(ref, kern)
    qp, = packed_rows(layout, q)
    total = qp.shape[0]
    qp = torch.cat([qp, torch.randn(2, nh, hd, generator=g).to(model)])  # two rows of padding after
    out = torch.full_like(qp, float("nan"))
    width = max(len(t) for t in tables)
    tables_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = torch.tensor([0, *new], dtype=torch.int32).cumsum(0).to(torch.int32)
    lens_t = torch.tensor([c + m for c, m in zip(cached, new)], dtype=torch.int32)
    ws = tk.attention_workspace(qp.shape[0], nh, hd, splits, "cpu") if splits > 1 else None
    tk.extend_attention(out, qp, kern.k(1), kern.v(1), tables_t, starts, lens_t, max(new), ws, scale=scale,
                        window=window, softcap=softcap, k_scale=scales(kern, 1)[0], v_scale=scales(kern, 1)[1],
                        tile=tile, block_q=block_q)
    torch.testing.assert_close(out[:total].float(), expected.float(), **tolerance(model))
    assert out[total:].isnan().all()


EXTEND_CASES = [  # fmt, model dtype, nh, nkv, hd, window, softcap, block_q, splits
    ("exact", torch.float32, 4, 2, 16, None, None, 4, 1),
    ("exact", torch.float32, 6, 2, 24, 5, None, 2, 1),  # G = 3: 2 tokens x 3 heads a block
    ("exact", torch.float32, 4, 1, 16, 4, 5.0, 3, 2),  # MQA, window, soft-cap, split keys
    ("bf16", torch.float32, 4, 4, 16, None, 5.0, 4, 1),
    ("fp16", torch.float32, 4, 2, 16, 5, None, 3, 1),
    ("int8", torch.float32, 4, 2, 16, 6, None, 4, 1),
    ("fp8", torch.float32, 6, 3, 16, None, 5.0, 3, 2),
    ("exact", torch.bfloat16, 4, 2, 16, 5, None, 4, 1),
]


@needs_triton
@pytest.mark.parametrize("fmt,model,nh,nkv,hd,window,softcap,block_q,splits", EXTEND_CASES)
def test_extend_attention_matches_the_models_torch_path(fmt, model, nh, nkv, hd, window, softcap, block_q,
                                                         splits) -> None:
    """A returning turn (5 new tokens over 6 cached), a fresh prefill of 9 (odd, across
    blocks), a chunk of 3 over 13 cached and a decode row, packed in one step."""
    check_extend(fmt, model, nh, nkv, hd, window, softcap, block_q, splits, [6, 0, 13, 5], [5, 9, 3, 1])


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("fmt,model", [("exact", torch.bfloat16), ("int8", torch.float32), ("fp8", torch.bfloat16)])
def test_extend_attention_at_a_models_size(fmt, model) -> None:
    """head_dim 128, blocks of 16, the kernel's own tile and query blocks: a prefill of 70
    and a chunk of 40 over 200 cached positions, a window of 64."""
    check_extend(fmt, model, 8, 2, 128, 64, None, None, 1, [0, 200], [70, 40], 16, None, blocks=24)


# ---- norms and RoPE ---------------------------------------------------------------------


def norm_module(D: int, offset: float, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    m = RMSNorm(D, 1e-6, offset)
    with torch.no_grad():
        m.weight.copy_((torch.randn(D, generator=g) * 0.3 + (0.0 if offset else 1.0)))
    return m.to(dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset,post", [(0.0, False), (1.0, False), (1.0, True)])
def test_rms_norm_with_the_families_residual_adds(dtype, offset, post) -> None:
    """Llama's pre-norm (x = x + h; norm(x)), Gemma's (1 + w) norm and its sandwich (x = x
    + post_norm(h); pre_norm(x)), and a plain norm: the fused kernel gives ``RMSNorm``'s
    rows (float32: to the last bits of the sum's order; bf16: within one bf16 step), the
    residual as the reference leaves it."""
    g = torch.Generator().manual_seed(int(offset) * 2 + post)
    R, D = 5, 48
    w, w_post = norm_module(D, offset, dtype, g), norm_module(D, offset, dtype, g)
    x = torch.randn(R, D, generator=g).to(dtype)
    res = torch.randn(R, D, generator=g).to(dtype)
    with torch.no_grad():
        added = res + (w_post(x) if post else x)
        expected, plain = w(added), w(x)
    out = torch.empty_like(x)
    tk.rms_norm(out, x, w.weight, 1e-6, offset)
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-7}
    torch.testing.assert_close(out, plain, **tol)
    got_res = res.clone()
    tk.rms_norm(out, x, w.weight, 1e-6, offset, residual=got_res, x_weight=w_post.weight if post else None)
    torch.testing.assert_close(out, expected, **tol)
    if post:
        torch.testing.assert_close(got_res, added, **tol)
    else:
        assert torch.equal(got_res, added)  # one rounding of one add: the same bits


def rope_tables(rotary: Rotary, n: int, dtype: torch.dtype, long: bool | None = None) -> tuple[torch.Tensor, ...]:
    """``Rotary``'s (cos, sin) rows for positions 0..n-1 in ``dtype``, as a forward makes them."""
    pos = torch.arange(n)[None, :]
    lt = None if long is None else torch.tensor([long])
    cos, sin = rotary(pos, dtype, lt)
    return cos.reshape(n, -1), sin.reshape(n, -1)


ROPE_CASES = {  # head_dim, rotary dim, theta, scaling, q/k norm offset (None: no norms)
    "llama": (16, 16, 10000.0, None, None),
    "phi3-partial": (32, 24, 10000.0, None, None),
    "phi3-longrope": (16, 16, 10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                        "long_factor": [1.0 + i for i in range(8)], "attention_factor": 1.19}, None),
    "qwen3-qk-norm": (16, 16, 1e6, None, 0.0),
    "gemma3-qk-norm-local": (24, 24, 10000.0, {"rope_type": "linear", "factor": 8.0}, 1.0),
}


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(ROPE_CASES))
def test_rope_with_the_families_tables_and_qk_norms(family, dtype) -> None:
    """q and k heads of a fused q/k/v output (a view), rows at scattered positions: the
    kernel rotates them as ``apply_rope_`` over ``Rotary``'s rows, after the per-head q/k
    RMSNorm where the family has one (Qwen3; Gemma 3: (1 + w)); partial rotary leaves the
    tail; LongRoPE's long rows (attention factor folded in) taken from a stacked table by
    offset positions. Without norms the same bits (each op rounded as torch's)."""
    hd, rot, theta, scaling, norm_offset = ROPE_CASES[family]
    g = torch.Generator().manual_seed(len(family))
    nh, nkv, T = 4, 2, 5
    rotary = Rotary(rot, theta, scaling)
    positions = torch.tensor([0, 3, 17, 18, 40])
    qkv = torch.randn(T, nh + 2 * nkv, hd, generator=g).to(dtype)
    x = qkv[:, : nh + nkv]
    expected = x.clone()
    long = scaling is not None and scaling["rope_type"] == "longrope"
    q_norm = k_norm = None
    if norm_offset is not None:
        q_norm, k_norm = norm_module(hd, norm_offset, dtype, g), norm_module(hd, norm_offset, dtype, g)
        with torch.no_grad():
            q_norm.forward_(expected[:, :nh])
            k_norm.forward_(expected[:, nh:])
    if long:  # short rows 0..63, long rows 64..127: a sequence in the long regime reads positions + 64
        cos, sin = (torch.cat(pair) for pair in zip(rope_tables(rotary, 64, dtype, False),
                                                    rope_tables(rotary, 64, dtype, True)))
        rows = positions + 64
    else:
        cos, sin = rope_tables(rotary, 64, dtype)
        rows = positions
    apply_rope_(expected[:, None], cos[rows][:, None, None], sin[rows][:, None, None])
    v_before = qkv[:, nh + nkv:].clone()
    tk.rope_(x, rows, cos, sin, nh, q_norm.weight if q_norm else None, k_norm.weight if k_norm else None, 1e-6,
             norm_offset or 0.0)
    if norm_offset is None:
        assert torch.equal(x, expected)
    else:
        tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 2**-7}
        torch.testing.assert_close(x, expected, **tol)
    assert torch.equal(qkv[:, nh + nkv:], v_before)  # v heads untouched


# ---- restores ---------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("fmt", ["exact", "bf16", "int8", "fp8"])
def test_scatter_blocks_equals_the_pools_block_import(fmt) -> None:
    """Staged blocks scattered into their pool slots in one launch equal
    ``KVPool.import_blocks`` (torch's index_copy_), padding ids (-1) skipped, every other
    block untouched."""
    ref, kern = make_pools(fmt, blocks=12, layers=2, bs=4, nkv=2, hd=6, seed=5)
    staged = make_pools(fmt, n=1, blocks=5, layers=2, bs=4, nkv=2, hd=6, seed=6)[0].data
    ids = [9, 2, 5, 11]
    ref.import_blocks(ids, staged[:4])
    tk.scatter_blocks(kern.data, staged, torch.tensor(ids + [-1]))
    assert torch.equal(raw(ref.data), raw(kern.data))


# ---- the package without triton, and its checks -----------------------------------------


def test_the_package_imports_nothing_of_the_models_and_no_triton_until_called() -> None:
    """service/kernels/triton/ knows tensors, not modules (imports nothing of kvserve
    outside service.kernels); without triton it imports, says why it cannot run, and an
    op refuses with that line."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from kvserve.service.kernels import triton as tk\n"
            "assert not tk.available() and 'triton is not importable' in tk.reason(), tk.reason()\n"
            "try:\n"
            "    tk.scatter_blocks(torch.zeros(2, 4), torch.zeros(1, 4), torch.zeros(1, dtype=torch.long))\n"
            "except tk.TritonUnavailable as e:\n"
            "    print('refused:', e)\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvserve.')\n"
            "             and not m.startswith('kvserve.service.kernels') and m != 'kvserve.service'))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: triton is not importable" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_decode_splits_fill_the_multiprocessors_without_empty_tiles() -> None:
    """One row over a long context takes many splits (its 4 kv heads alone would fill 4 of
    132 multiprocessors); 32 rows of 8 kv heads already give each two programs; a short
    context is never split finer than its tiles."""
    assert tk.decode_splits(1, 4, 8192) == 64
    assert tk.decode_splits(32, 8, 8192) == 2
    assert tk.decode_splits(64, 8, 8192) == 1
    assert tk.decode_splits(1, 4, 100) == 2  # two tiles of 64
    assert tk.decode_splits(4, 2, 8192, sm_count=16) == 4


@needs_triton
def test_bad_arguments_are_refused_by_shape_and_dtype() -> None:
    pool = KVPool(4, 1, 4, 2, 8, torch.int8, compute_dtype=torch.float32)
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        tk.write_kv(k, k, pool.k(0), pool.v(0), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="disagree"):
        tk.write_kv(k, k, pool.k(0), pool.v(0), torch.zeros(2, dtype=torch.long), pool.k_scale(0), pool.v_scale(0))
    q = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="not a multiple"):
        tk.decode_attention(torch.empty_like(q), q, pool.k(0), pool.v(0), torch.zeros(2, 1, dtype=torch.int32),
                            torch.ones(2, dtype=torch.int32), scale=1.0, k_scale=pool.k_scale(0),
                            v_scale=pool.v_scale(0))
    q = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="tile must be a power of two >= 16"):
        tk.decode_attention(torch.empty_like(q), q, pool.k(0), pool.v(0), torch.zeros(2, 1, dtype=torch.int32),
                            torch.ones(2, dtype=torch.int32), scale=1.0, k_scale=pool.k_scale(0),
                            v_scale=pool.v_scale(0), tile=24)
    with pytest.raises(ValueError, match="wider than q's"):
        wide = KVPool(4, 1, 4, 2, 8, torch.float32)
        tk.decode_attention(torch.empty_like(q).bfloat16(), q.bfloat16(), wide.k(0), wide.v(0),
                            torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32), scale=1.0)
    with pytest.raises(ValueError, match="rot even and <= 8"):
        tk.rope_(torch.zeros(2, 3, 8), torch.zeros(2, dtype=torch.long), torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="rot even and <= 8"):
        tk.rope_(torch.zeros(2, 3, 8), torch.zeros(2, dtype=torch.long), torch.zeros(4, 10), torch.zeros(4, 10))
