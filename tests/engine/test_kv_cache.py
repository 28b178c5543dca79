"""KVPool (allocation, views, export/import) and BatchLayout (slots, positions, masks)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.common.tiers import Tier
from kvserve.service.kv.cache import NULL_BLOCK, BatchLayout, KVCacheSpec, KVPool, SeqSlice
from kvserve.service.models.loading import load_model

ELEMENT_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


# ---- pool geometry ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layers,block_size,kv_heads,head_dim", [(2, 4, 2, 16), (3, 16, 1, 8), (1, 1, 4, 2)])
def test_pool_allocation_equals_bytes_per_token_formula(dtype, layers, block_size, kv_heads, head_dim) -> None:
    num_blocks = 7
    pool = KVPool(num_blocks, layers, block_size, kv_heads, head_dim, dtype)
    formula = 2 * layers * kv_heads * head_dim * ELEMENT_SIZE[dtype]
    assert pool.bytes_per_token == formula == KVCacheSpec(layers, kv_heads, head_dim, block_size, dtype).bytes_per_token
    assert pool.bytes_per_block == block_size * formula
    assert pool.nbytes == num_blocks * block_size * formula  # the real allocation, no overhead
    assert pool.data.untyped_storage().nbytes() == pool.nbytes


def test_pool_from_budget_fills_the_budget() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    per_block = spec.bytes_per_block
    pool = KVPool.from_spec(spec, 10 * per_block + per_block - 1)
    assert pool.num_blocks == 10 and pool.nbytes <= 11 * per_block - 1 and pool.spec == spec
    assert spec.dtype_name == "float32"
    with pytest.raises(ValueError, match="need >= 2"):
        KVPool.from_spec(spec, per_block)


def test_one_block_geometry_for_the_pool_and_the_store(tiny_llama_dir) -> None:
    from kvserve.service.engine.config import EngineConfig
    from kvserve.service.engine.store import build_store

    lm = load_model(tiny_llama_dir, progress=False)
    spec = lm.kv_spec(8)
    c = lm.config
    assert spec.block_shape == (c.num_layers, 2, 8, c.num_kv_heads, c.head_dim) and spec.dtype == lm.dtype
    pool = lm.new_kv_pool(1 << 20, 8)
    assert pool.spec == spec and pool.bytes_per_block == spec.bytes_per_block
    store = build_store(EngineConfig(block_size=8, host_cache_memory=1 << 20), lm)
    assert store is not None and store.block_shape == spec.block_shape and store.tier(Tier.HOST).block_shape == spec.block_shape
    store.close()


def test_k_and_v_are_views_of_the_one_tensor() -> None:
    pool = KVPool(5, 3, 4, 2, 8)
    assert pool.k(1).shape == pool.v(1).shape == (5, 4, 2, 8)
    pool.k(1)[3].fill_(1.0)
    pool.v(2)[4, 1].fill_(2.0)
    assert pool.data[3, 1, 0].eq(1.0).all() and pool.data[3, 1, 1].eq(0).all()
    assert pool.data[4, 2, 1, 1].eq(2.0).all()
    assert pool.data.sum() == 4 * 2 * 8 + 2 * 2 * 8  # nothing else was touched
    assert pool.data[3].is_contiguous()  # one block is one contiguous span


@pytest.mark.parametrize("B,T", [(1, 1), (3, 1), (2, 5)])
def test_update_writes_side_by_side_k_and_v_in_one_op_same_as_two(B: int, T: int) -> None:
    """k and v as adjacent heads of one fused q/k/v output take the one-index_put_ path;
    the same values as separate tensors take the two-op path; the pools end up equal."""
    from torch.profiler import profile

    n_kv, hd, bs, nh = 2, 8, 4, 3
    tables = [[1 + 3 * b, 2 + 3 * b, 3 + 3 * b] for b in range(B)]
    layout = BatchLayout.build([SeqSlice(t, 2 + b, list(range(T - (b % 2 if T > 1 else 0))))
                                for b, t in enumerate(tables)], bs)
    qkv = torch.randn(B, T, nh + 2 * n_kv, hd)
    q, k, v = qkv.split((nh, n_kv, n_kv), dim=2)  # views: v's heads follow k's
    one, two = KVPool(1 + 3 * B, 2, bs, n_kv, hd), KVPool(1 + 3 * B, 2, bs, n_kv, hd)
    with torch.inference_mode():
        with profile() as prof:
            got = one.update(1, layout, k, v)
        want = two.update(1, layout, k.clone(), v.clone())  # not adjacent: two writes
    writes = [e.name for e in prof.events() if e.name == "aten::index_put_"]
    assert writes == ["aten::index_put_"]
    assert torch.equal(one.data, two.data) and one.data.count_nonzero() > 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert one.data[:, 0].count_nonzero() == 0  # layer 0 untouched


# ---- export / import ----------------------------------------------------------------


def test_export_import_round_trip_single_and_batched() -> None:
    pool = KVPool(9, 2, 4, 2, 8)
    torch.manual_seed(0)
    pool.data.normal_()
    block = pool.export_block(3)
    assert block.shape == pool.block_shape and block.is_contiguous()
    assert block.data_ptr() != pool.data[3].data_ptr()  # a copy, not a view
    out = torch.empty(pool.block_shape)
    assert pool.export_block(4, out=out) is out and torch.equal(out, pool.data[4])

    other = KVPool(9, 2, 4, 2, 8)
    other.import_block(7, block)
    assert torch.equal(other.data[7], pool.data[3])
    many = pool.export_blocks([5, 1, 8])
    assert many.shape == (3, *pool.block_shape)
    other.import_blocks([2, 6, 1], many)
    for dst, src in [(2, 5), (6, 1), (1, 8)]:
        assert torch.equal(other.data[dst], pool.data[src])
    buf = torch.empty(3, *pool.block_shape)
    assert torch.equal(pool.export_blocks([5, 1, 8], out=buf), many)


def test_export_import_reject_bad_ids_and_shapes() -> None:
    pool = KVPool(4, 2, 4, 2, 8)
    for bad in (NULL_BLOCK, 4, -1):
        with pytest.raises(IndexError):
            pool.export_block(bad)
    with pytest.raises(ValueError, match="expected"):
        pool.import_block(1, torch.zeros(2, 2, 4, 2, 7))
    with pytest.raises(ValueError, match="expected"):
        pool.import_block(1, torch.zeros(pool.block_shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="expected"):
        pool.import_blocks([1, 2], torch.zeros(1, *pool.block_shape))


def test_export_then_import_into_other_blocks_gives_bit_identical_logits(tiny_llama_dir) -> None:
    lm = load_model(tiny_llama_dir, progress=False)
    cfg, bs = lm.config, 4
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, cfg.vocab_size, (13,), generator=g).tolist()  # 3 full blocks + 1 token
    src_table, dst_table = [2, 5, 3, 4], [8, 1, 6, 7]
    with torch.inference_mode():
        src = lm.new_kv_pool(1 << 20, bs)
        lm.model(BatchLayout.build([SeqSlice(src_table, 0, prompt[:12])], bs), src)
        want = lm.model(BatchLayout.build([SeqSlice(src_table, 12, prompt[12:])], bs), src)

        dst = lm.new_kv_pool(1 << 20, bs)
        dst.data.normal_()  # stale garbage everywhere: only imported blocks may matter
        exported = [src.export_block(b) for b in src_table[:3]]
        for b, t in zip(dst_table[:3], exported):
            dst.import_block(b, t)
        got = lm.model(BatchLayout.build([SeqSlice(dst_table, 12, prompt[12:])], bs), dst)
        # the batched form lands the same bytes
        dst2 = lm.new_kv_pool(1 << 20, bs)
        dst2.import_blocks(dst_table[:3], src.export_blocks(src_table[:3]))
        got2 = lm.model(BatchLayout.build([SeqSlice(dst_table, 12, prompt[12:])], bs), dst2)
    assert torch.equal(got, want)
    assert torch.equal(got2, want)


def test_padding_writes_only_into_the_null_block(tiny_llama_dir) -> None:
    lm = load_model(tiny_llama_dir, progress=False)
    bs = 4
    pool = lm.new_kv_pool(1 << 20, bs)
    tables = [[3, 4], [6, 7, 8]]
    with torch.inference_mode():
        lm.model(BatchLayout.build([SeqSlice(tables[0], 0, [5, 6]), SeqSlice(tables[1], 0, list(range(5, 16)))], bs),
                 pool)
    touched = {b for b in range(pool.num_blocks) if pool.data[b].abs().sum() > 0}
    assert touched - {NULL_BLOCK} == {3, 6, 7, 8}  # block 4 was in a table but no token reached it


# ---- batch layout -------------------------------------------------------------------


def _reference_slots(seqs: list[SeqSlice], bs: int) -> list[tuple[int, int, int]]:
    """(block, offset, position) of every real new token, computed token by token."""
    out = []
    for s in seqs:
        for i in range(len(s.token_ids)):
            pos = s.start_pos + i
            out.append((s.block_table[pos // bs], pos % bs, pos))
    return out


_seq = st.tuples(st.integers(0, 40), st.integers(1, 12), st.integers(0, 3))  # start, new tokens, spare blocks


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(_seq, min_size=1, max_size=5), bs=st.sampled_from([1, 2, 4, 16]))
def test_layout_slots_positions_and_last_index(specs, bs: int) -> None:
    seqs, nxt = [], 1
    for start, n, spare in specs:
        nb = math.ceil((start + n) / bs) + spare
        seqs.append(SeqSlice(list(range(nxt + nb - 1, nxt - 1, -1)), start, list(range(100, 100 + n))))
        nxt += nb
    lay = BatchLayout.build(seqs, bs)
    B, T = lay.input_ids.shape
    lens = [len(s.token_ids) for s in seqs]
    assert (B, T) == (len(seqs), max(lens))
    real = [(b, t) for b in range(B) for t in range(lens[b])]
    got = [(int(lay.slot_blocks[b * T + t]), int(lay.slot_offsets[b * T + t]), int(lay.positions[b, t])) for b, t in real]
    assert got == _reference_slots(seqs, bs)
    pads = [b * T + t for b in range(B) for t in range(lens[b], T)]
    assert all(int(lay.slot_blocks[i]) == NULL_BLOCK for i in pads)
    assert lay.last_index.tolist() == [b * T + lens[b] - 1 for b in range(B)]
    assert lay.seq_lens == tuple(s.start_pos + n for s, n in zip(seqs, lens)) and lay.num_tokens == sum(lens)
    assert lay.fresh == all(s.start_pos == 0 for s in seqs)
    if lay.attn_mask is not None:  # every real query sees exactly positions 0..its own
        allowed = lay.attn_mask[:, 0] == 0  # (B, T, C)
        for b, t in real:
            pos = int(lay.positions[b, t])
            if lay.fresh:
                assert allowed[b, t].nonzero().flatten().tolist() == list(range(t + 1))
            else:
                assert allowed[b, t].nonzero().flatten().tolist() == list(range(pos + 1))
        assert allowed.any(-1).all()  # no fully masked row (would be NaN), padding included


@settings(max_examples=100, deadline=None)
@given(specs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3), st.sampled_from([None, False, True])),
                      min_size=1, max_size=6),
       bs=st.sampled_from([1, 2, 4, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))  # fmt: skip
def test_decode_layout_is_every_field_of_the_general_one(specs, bs: int, dtype) -> None:
    """A decode step (one new token per sequence, some context: built from one tensor of
    views) has every field the general layout defines: ids, positions, slots, the
    context's blocks padded with the null block, lengths, last index, mask, LongRoPE."""
    if all(start == 0 for start, _, _ in specs):
        specs = [(1, *specs[0][1:]), *specs[1:]]
    seqs, nxt = [], 1
    for i, (start, spare, long) in enumerate(specs):
        nb = math.ceil((start + 1) / bs) + spare
        seqs.append(SeqSlice(list(range(nxt + nb - 1, nxt - 1, -1)), start, [100 + i], long))
        nxt += nb
    lay = BatchLayout.build(seqs, bs, dtype=dtype)
    B = len(seqs)
    totals = [s.start_pos + 1 for s in seqs]
    C, nb = max(totals), math.ceil(max(totals) / bs)
    assert lay.input_ids.tolist() == [[100 + i] for i in range(B)] and lay.positions.tolist() == [[s.start_pos] for s in seqs]
    got = [(int(b), int(o), int(p)) for b, o, p in zip(lay.slot_blocks, lay.slot_offsets, lay.positions[:, 0])]
    assert got == _reference_slots(seqs, bs)
    tables = [list(s.block_table[:nb]) + [NULL_BLOCK] * (nb - len(s.block_table[:nb])) for s in seqs]
    assert lay.ctx_blocks.tolist() == tables and lay.ctx_len == C
    assert lay.last_index.tolist() == list(range(B)) and lay.lens_tensor().tolist() == totals
    assert lay.seq_lens == tuple(totals) and lay.num_new_tokens == (1,) * B and lay.block_size == bs
    assert not lay.fresh and not lay.is_causal
    for t in (lay.input_ids, lay.positions, lay.slot_blocks, lay.slot_offsets, lay.ctx_blocks, lay.last_index,
              lay.lens_tensor()):
        assert t.dtype == torch.long and t.is_contiguous()
    assert (lay.slot_blocks.shape, lay.ctx_blocks.shape, lay.input_ids.shape) == ((B,), (B, nb), (B, 1))
    if B == 1:
        assert lay.attn_mask is None
    else:
        assert lay.attn_mask.shape == (B, 1, 1, C) and lay.attn_mask.dtype == dtype
        allowed = lay.attn_mask[:, 0, 0] == 0
        assert all(allowed[b].nonzero().flatten().tolist() == list(range(totals[b])) for b in range(B))
        assert torch.isneginf(lay.attn_mask[~(lay.attn_mask == 0)]).all()
    if all(long is None for _, _, long in specs):
        assert lay.long_rope is None
    else:
        assert lay.long_rope.tolist() == [bool(long) for _, _, long in specs]


def test_layout_fast_paths() -> None:
    one = BatchLayout.build([SeqSlice([1, 2], 0, [5, 6, 7])], 4)
    assert one.fresh and one.is_causal and one.attn_mask is None and one.ctx_blocks is None
    decode = BatchLayout.build([SeqSlice([1, 2], 5, [9])], 4)
    assert not decode.fresh and decode.attn_mask is None and decode.ctx_len == 6
    batch_decode = BatchLayout.build([SeqSlice([1, 2], 5, [9]), SeqSlice([3], 2, [9])], 4)
    assert batch_decode.attn_mask.shape == (2, 1, 1, 6)


def test_layout_mask_dtype_follows_the_model() -> None:
    lay = BatchLayout.build([SeqSlice([1, 2], 5, [9]), SeqSlice([3], 2, [9])], 4)
    assert lay.attn_mask.dtype == torch.float32
    bf = lay.attn_bias(torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and lay.attn_bias(torch.bfloat16) is bf
    assert torch.equal(bf.float(), lay.attn_mask)


def test_layout_rejects_short_block_tables_and_empty_input() -> None:
    with pytest.raises(ValueError, match="covers 4 positions, needs 6"):
        BatchLayout.build([SeqSlice([1], 3, [1, 2, 3])], 4)
    with pytest.raises(ValueError, match=">= 1 new token"):
        BatchLayout.build([SeqSlice([1], 0, [])], 4)
    with pytest.raises(ValueError):
        BatchLayout.build([], 4)
