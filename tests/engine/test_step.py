"""The decode step's backends (models/step.py, models/cuda_step.py) against the reference
(``TorchStep``: the model's forward over a layout of the rows), and the CUDA step's graphs:
on the CPU, the CUDA step runs its own code (buffers, padding, the kernels' order, the
products) over torch's versions of the Triton kernels (tests/fixtures/step_ops.py), and
over the Triton kernels themselves under Triton's interpreter where triton imports. The
native CPU step's checks are in test_native.py."""

from __future__ import annotations

import array
import dataclasses

import pytest
import torch

from kvserve.service.kv.cache import BatchLayout, DecodeRows, KVPool, SeqSlice
from kvserve.service.models import cuda_step as cs
from kvserve.service.models.loading import load_model
from kvserve.service.models.step import TorchStep, build_step
from tests.fixtures import step_ops
from tests.fixtures.engine import finished, greedy_reference, make_engine, prompts, req, run

BS = 4
FAMILIES = ["tiny_llama_dir", "tiny_qwen2_window_dir", "tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
            "tiny_phi3_dir", "tiny_phi4_mini_dir", "tiny_mistral_dir"]  # fmt: skip
TABLES = [[3, 9, 4, 12, 5, 20], [7, 2, 17, 8, 11], [13, 14, 15, 16, 18, 19]]
CPU = torch.device("cpu")
# torch's CPU kernels in bfloat16 round each product's output; the two paths' products differ in
# shape (one row per sequence against rows of the padded layout), so their roundings differ
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.1, rtol=0.05)}


def _prefilled(loaded, pools, lens, seed=3):
    """Three prompts of ``lens`` tokens prefilled into each of ``pools`` (one forward per
    sequence, the layout's reference path): the histories."""
    hist = prompts(loaded.config.vocab_size, lens, seed=seed)
    threshold = loaded.config.longrope_threshold
    with torch.inference_mode():
        for pool in pools:
            for t, p in zip(TABLES, hist):
                long = None if threshold is None else len(p) + 16 > threshold
                loaded.model(BatchLayout.build([SeqSlice(t, 0, p, long)], BS, dtype=loaded.dtype), pool)
    return hist


def _rows(loaded, hist, decode=(0, 1), verify=2, drafts=(5, 6, 7)):
    """Decode rows of sequences ``decode`` (a new token each) and a verify sequence's
    pending token and drafts, as the runner packs them (each sequence's regime given)."""
    threshold = loaded.config.longrope_threshold
    rows = DecodeRows(BS)
    for i in decode:
        rows.add(TABLES[i], len(hist[i]), [1 + i], None if threshold is None else len(hist[i]) + 16 > threshold)
    if verify is not None:
        h = hist[verify]
        rows.add(TABLES[verify], len(h), [9, *drafts], None if threshold is None else len(h) + 16 > threshold)
    return rows


def _pools(loaded, n, dtype=None):
    c = loaded.config
    return [KVPool(24, c.num_layers, BS, c.num_kv_heads, c.head_dim, dtype or loaded.dtype, compute_dtype=loaded.dtype)
            for _ in range(n)]  # fmt: skip


def _cuda_step(loaded, pool, ops=step_ops):
    return cs.CudaStep(loaded.model.decoder(), pool, max_context=loaded.config.max_position_embeddings, ops=ops)


@pytest.mark.parametrize("family,dtype", [(f, torch.float32) for f in FAMILIES]
                         + [("tiny_llama_dir", torch.bfloat16), ("tiny_gemma3_dir", torch.bfloat16)])  # fmt: skip
def test_the_cuda_steps_code_is_the_reference_per_family(family, dtype, request) -> None:
    """The CUDA step's composition (embedding and scale, fused residual norms, q/k norms
    with RoPE, Gemma 3's two tables, LongRoPE's two regimes and partial rotary, windows,
    softcaps, the head's softcap) over torch's kernels gives the reference's logits and
    K/V, for decode rows and a verify sequence's rows, the head on all rows or some."""
    loaded = load_model(request.getfixturevalue(family), dtype=dtype, device="cpu", progress=False, native_kernels="off")
    pools = _pools(loaded, 2)
    hist = _prefilled(loaded, pools, [11, 6, 9])
    step, ref = _cuda_step(loaded, pools[0]), TorchStep(loaded.model, pools[1], CPU)
    with torch.inference_mode():
        for which in (None, array.array("q", [1, 3])):
            rows = _rows(loaded, hist)
            got, want = step(rows, which), ref(rows, which)
            assert got.shape == want.shape == (len(rows) if which is None else 2, loaded.config.vocab_size)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, **TOL[dtype])
            torch.testing.assert_close(pools[0].data[1:].float(), pools[1].data[1:].float(), **TOL[dtype])


def test_the_graph_runners_static_buffers_equal_the_eager_step_for_every_bucket(tiny_gemma3_dir) -> None:
    """``CudaGraphStep`` on the CPU: for every row count (each bucket and those between),
    the step's rows copied into the smallest bucket that holds them and padded give the
    eager step's logits and K/V (rows of a verify sequence included), and the padding rows
    write nothing: every block but those the real rows write is as it was, the null block
    included. More rows than the largest bucket run the eager step."""
    loaded = load_model(tiny_gemma3_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    pools = _pools(loaded, 2)
    hist = _prefilled(loaded, pools, [10, 7, 13])
    eager = _cuda_step(loaded, pools[1])
    graphs = cs.CudaGraphStep(_cuda_step(loaded, pools[0]), cs.graph_buckets(8), memory=1 << 30)
    assert graphs.buckets == [1, 2, 4, 8] and all(g.graph is None for g in graphs.graphs.values())
    cases = [((0,), None, ()), ((0, 1), None, ()), ((1,), 2, ()), ((0,), 2, (5, 6)), ((0, 1), 2, (5, 6)),
             ((0, 1), 2, (5, 6, 7, 8)), ((0, 1), 2, (5, 6, 7, 8, 9, 10)), ((0, 1), 2, (5,) * 7)]  # 1..10 rows
    with torch.inference_mode():
        for decode, verify, drafts in cases:
            rows = _rows(loaded, hist, decode, verify, drafts)
            written = {t[p // BS] for t, p in zip(rows.tables, rows.positions)}
            before = pools[0].data.clone()
            got, want = graphs(rows), eager(rows)
            bucket = graphs.bucket(len(rows))
            assert bucket == (None if len(rows) > 8 else next(r for r in (1, 2, 4, 8) if r >= len(rows)))
            assert got.shape == (len(rows), loaded.config.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pools[0].data, pools[1].data, atol=1e-5, rtol=1e-5)
            untouched = [b for b in range(pools[0].num_blocks) if b not in written]
            assert 0 in untouched and torch.equal(pools[0].data[untouched], before[untouched])
            if bucket is not None:  # the bucket's padding rows: no slot, no context, no token
                buf = graphs.graphs[bucket].buf
                pad = slice(len(rows), bucket)
                assert (buf.slots[pad] == -1).all() and (buf.lens[pad] == 0).all() and (buf.ids[pad] == 0).all()
                assert ((buf.tables >= 0) & (buf.tables < pools[0].num_blocks)).all()  # unread, but valid ids


def test_graph_buckets_and_the_memory_budget(tiny_llama_dir) -> None:
    """The captured row counts (vLLM's: 1, 2, 4, 8, then multiples of 8), largest first
    within the memory budget: a bucket that would pass it is skipped, and a step of its
    row count runs in the next larger bucket or eagerly, with the same logits."""
    assert cs.graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert cs.graph_buckets(5) == [1, 2, 4, 5] and cs.graph_buckets(1) == [1]
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    pools = _pools(loaded, 2)
    hist = _prefilled(loaded, pools, [5, 9, 6])
    step = _cuda_step(loaded, pools[0])
    sizes = {r: step.buffers(r).nbytes for r in (1, 2, 4, 8)}
    graphs = cs.CudaGraphStep(step, [1, 2, 4, 8], memory=sizes[8] + sizes[2] + sizes[1])
    assert graphs.buckets == [1, 2, 8] and graphs.skipped == [4] and graphs.nbytes <= graphs.memory
    eager = _cuda_step(loaded, pools[1])
    with torch.inference_mode():
        rows = _rows(loaded, hist, (0, 1), None)  # 2 rows: bucket 2
        torch.testing.assert_close(graphs(rows), eager(rows), atol=1e-5, rtol=1e-5)
        rows = _rows(loaded, hist, (0,), 2, (4, 4))  # 4 rows: bucket 8
        assert graphs.bucket(4) == 8
        torch.testing.assert_close(graphs(rows), eager(rows), atol=1e-5, rtol=1e-5)
    small = cs.CudaGraphStep(_cuda_step(loaded, pools[0]), [1, 2, 4, 8], memory=sizes[1] - 1)
    assert small.buckets == [] and small.bucket(1) is None


def test_the_step_refuses_rows_past_its_context(tiny_llama_dir) -> None:
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    pool = _pools(loaded, 1)[0]
    step = cs.CudaStep(loaded.model.decoder(), pool, max_context=16, ops=step_ops)
    rows = DecodeRows(BS)
    rows.add(TABLES[0], 16, [3])
    with pytest.raises(ValueError, match="past the step's context"):
        step.fill(step.buffers(2), rows)
    with pytest.raises(ValueError, match="rows for a step of"):
        step.fill(step.buffers(1), _rows(loaded, [[1] * 5] * 3, (0, 1), None))


def test_an_engine_on_the_cuda_steps_graphs_decodes_as_the_reference_with_drafts(tiny_llama_dir, monkeypatch) -> None:
    """The engine with the CUDA step's graphs as its decode step (on the CPU, torch's
    kernels): decode rows and speculative verify rows go through the buckets, and the
    greedy tokens are the uncached model's."""
    from kvserve.service.engine import engine as engine_mod

    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    made = []

    def graph_step(model, pool, device, *, max_context, graphs):
        made.append(cs.CudaGraphStep(cs.CudaStep(model.decoder(), pool, max_context=max_context, ops=step_ops),
                                     cs.graph_buckets(graphs.max_rows), graphs.memory))  # fmt: skip
        return made[-1]

    monkeypatch.setattr(engine_mod, "build_step", graph_step)
    a, b = prompts(loaded.config.vocab_size, [6, 5], seed=4)
    ps = [a * 3 + a[:2], b * 2 + b[:2]]  # their own continuations: drafts
    eng = make_engine(loaded, cuda_graph_max_rows=16)
    assert eng.runner.step is made[0] and made[0].buckets == [1, 2, 4, 8, 16]
    events = run(eng, [req(f"r{i}", p, n=16) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert finished(events[f"r{i}"]).output_token_ids == greedy_reference(loaded.model, p, 16)
    assert eng.runner.num_verify_steps > 0


def test_a_step_of_more_rows_than_the_backend_takes_runs_the_reference(tiny_llama_dir) -> None:
    """The runner sends a step of more rows than its backend's ``max_rows`` to the
    reference; the tokens are the same."""
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False)
    eng = make_engine(loaded, speculative="off")
    assert eng.runner.step.name == "native"
    calls = []
    native, ref = eng.runner.step, eng.runner.reference
    eng.runner.step = type("Small", (), {"name": "small", "max_rows": 2, "chunk_rows": 0,
                                         "__call__": lambda self, rows, which=None: calls.append(len(rows)) or native(rows, which)})()  # fmt: skip
    eng.runner.reference = type("Ref", (), {"__call__": lambda self, rows, which=None: calls.append(-len(rows)) or ref(rows, which)})()
    ps = prompts(loaded.config.vocab_size, [7, 5, 9], seed=2)
    events = run(eng, [req("a", ps[0], n=6), req("b", ps[1], n=6), req("c", ps[2], n=6)])
    for rid, p in zip("abc", ps):
        assert finished(events[rid]).output_token_ids == greedy_reference(loaded.model, p, 6)
    assert -3 in calls and all(n <= 2 for n in calls if n > 0)


def test_build_step_picks_the_backend(tiny_llama_dir) -> None:
    on = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False)
    off = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    pool = _pools(on, 1)[0]
    assert build_step(on.model, pool, CPU, max_context=64).name == "native"
    assert build_step(off.model, pool, CPU, max_context=64).name == "torch"


# ---- the Triton kernels under the interpreter ------------------------------------------------


@pytest.fixture
def triton_ops():
    """``kernels.triton`` under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET
    before anything imports triton); skipped where triton does not import."""
    from kvserve.service.kernels import triton as ops

    if not ops.available():
        pytest.skip(ops.reason())
    if not ops.interpreted():
        pytest.skip("the Triton kernels were defined without the interpreter (TRITON_INTERPRET=0)")
    return ops


def _interpreted(loaded, ops, kv_dtype, lens, rows_of):
    pools = _pools(loaded, 2, kv_dtype)
    hist = _prefilled(loaded, pools, lens)
    step, ref = _cuda_step(loaded, pools[0], ops), TorchStep(loaded.model, pools[1], CPU)
    rows = rows_of(hist)
    with torch.inference_mode():
        got, want = step(rows), ref(rows)
    return got, want, pools


@pytest.mark.parametrize("kv", ["exact", "bf16"])
def test_the_cuda_step_under_tritons_interpreter_is_the_reference(tiny_llama_dir, triton_ops, kv) -> None:
    """The CUDA step with the Triton kernels themselves (the interpreter, on the CPU):
    the reference's logits and K/V within float32 tolerance (a bf16 pool: the reference
    reads the same rounded KV)."""
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    got, want, pools = _interpreted(loaded, triton_ops, torch.bfloat16 if kv == "bf16" else None, [9, 5, 6],
                                    lambda h: _rows(loaded, h, (0, 1), 2, (4, 5)))  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pools[0].data[1:].float(), pools[1].data[1:].float(), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_phi4_mini_dir", "tiny_mistral_dir"])
@pytest.mark.parametrize("kv", ["exact", "int8", "fp8"])
def test_the_cuda_step_under_tritons_interpreter_per_family_and_kv_format(family, kv, request, triton_ops) -> None:
    """Every family's options and the scaled KV formats through the Triton kernels:
    the reference's logits (int8 / fp8: the reference's own dequantizing attention over
    the same stored KV, to the formats' rounding)."""
    loaded = load_model(request.getfixturevalue(family), dtype="float32", device="cpu", progress=False,
                        native_kernels="off")  # fmt: skip
    dtype = {"exact": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    got, want, _ = _interpreted(loaded, triton_ops, dtype, [13, 6, 10], lambda h: _rows(loaded, h, (0, 1), 2, (4, 5)))
    tol = dict(atol=1e-4, rtol=1e-4) if kv == "exact" else dict(atol=2e-2 * want.abs().max().item(), rtol=0)
    torch.testing.assert_close(got, want, **tol)


def test_the_step_buffers_hold_every_input_in_one_tensor(tiny_llama_dir) -> None:
    """One host-to-device copy fills a step: ids, RoPE rows, slots, lengths and tables are
    views of one int64 tensor, in that order, padded."""
    loaded = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    step = _cuda_step(loaded, _pools(loaded, 1)[0])
    buf = step.buffers(4)
    rows = DecodeRows(BS)
    rows.add(TABLES[0], 5, [11, 12])
    assert step.fill(buf, rows) == 2
    assert buf.ids.tolist() == [11, 12, 0, 0] and buf.positions.tolist() == [5, 6, 0, 0]
    assert buf.slots.tolist() == [9 * BS + 1, 9 * BS + 2, -1, -1] and buf.lens.tolist() == [6, 7, 0, 0]
    assert buf.tables.shape == (4, step.width) and buf.tables[0, :2].tolist() == TABLES[0][:2]  # as far as position 6
    assert buf.tables[0, 2:].eq(0).all() and buf.tables[2:].eq(0).all()
    views = (buf.ids, buf.positions, buf.slots, buf.lens, buf.tables)
    assert all(v.untyped_storage().data_ptr() == buf.meta.untyped_storage().data_ptr() for v in views)
    dataclasses.replace(buf)  # a plain dataclass: copied as the graphs keep it
