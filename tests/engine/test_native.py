"""The native CPU decode kernels (service/kernels/): the libraries the build made (one per
ISA level, from the sources and header beside them), checked against float64
references, in the model against torch's kernels, and their absence (no library for
this CPU, a stale build) handled as a fallback or a one-line refusal."""

from __future__ import annotations

import array
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.service import kernels
from kvserve.service.kernels import build, ops
from kvserve.service.models.config import ModelLoadError
from kvserve.service.models.loading import load_model
from tests.fixtures.engine import BS, greedy_reference, make_engine, prompts, req, run, finished

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"native kernels unavailable: {kernels.reason()}")

REPO = Path(__file__).resolve().parents[2]


LEVELS = [name for name, _, _ in kernels.ISAS]


@pytest.fixture(params=LEVELS)
def isa(request):
    """Each ISA level the build made a library for (AVX-512, AVX2) that this CPU runs,
    selected for the test; the best level is selected again after."""
    if request.param not in kernels.cpu_isas():
        pytest.skip(f"this CPU does not run {request.param}")
    kernels.select(request.param)
    yield request.param
    kernels.select(kernels.cpu_isas()[0])


def test_the_build_made_every_level_and_the_best_this_cpu_runs_serves() -> None:
    assert kernels.built_isas() == LEVELS  # x86-64 with a compiler: every level, whatever this CPU runs
    assert kernels.isa() == kernels.cpu_isas()[0]
    assert kernels.load().path == kernels.library_path(kernels.isa())
    with pytest.raises(ValueError, match="unknown ISA"):
        kernels.library_path("sse2")


@pytest.fixture(scope="module")
def fresh_builds(tmp_path_factory) -> dict[str, Path]:
    """Every ISA level compiled afresh from the sources (``compile_sources``, what setup.py's
    build_ext runs), the levels' compiles side by side: each is one single-threaded
    compiler process, so on two cores they take the time of one."""
    from concurrent.futures import ThreadPoolExecutor

    out_dir = tmp_path_factory.mktemp("kernels")
    outs = {level: out_dir / build.library_name(level) for level in LEVELS}
    with ThreadPoolExecutor(len(LEVELS)) as pool:
        for done in [pool.submit(build.compile_sources, build.SRC, level, out) for level, out in outs.items()]:
            done.result()
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("level", LEVELS)
def test_each_level_compiles_from_the_sources_as_the_build_does(level, fresh_builds) -> None:
    """One compile per ISA level (what setup.py's build_ext runs): the library carries the
    digest of the sources and flags it was built from, the installed one the same; where
    this CPU runs the level, the fresh build computes the installed one's bits."""
    out = fresh_builds[level]
    digest = build.source_digest(level)
    assert build.build_id_of(out).split(" ")[0] == digest
    assert build.build_id_of(kernels.library_path(level)).split(" ")[0] == digest
    if level in kernels.cpu_isas():
        fresh = kernels.Library.open(out, level, check_sources=build.SRC)
        assert fresh.build_id == kernels.Library.open(kernels.library_path(level), level).build_id
        kernels.select(level)
        g = torch.Generator().manual_seed(1)
        x, w = torch.randn(3, 96, generator=g), torch.randn(40, 96, generator=g)
        want = ops.gemv(x, w)
        got = torch.empty(3, 40)
        fresh.lib.kv_gemv_f32(x.data_ptr(), 3, 96, 96, w.data_ptr(), 40, None, None, got.data_ptr(), 40, 0, 1)
        kernels.select(kernels.cpu_isas()[0])
        assert torch.equal(got, want)


def test_the_binding_is_the_headers_and_checked_against_the_library() -> None:
    """The ctypes binding is generated from kvkernels.h: every function the header
    declares is bound with its argument count, every struct has the library's size."""
    import ctypes
    import re

    from kvserve.service.kernels.binding import HEADER, header_binding

    b = header_binding()
    text = HEADER.read_text()
    declared = set(re.findall(r"\b(kv_\w+)\(", text))
    assert declared == set(b.functions) and len(declared) >= 11
    lib = kernels.load().lib
    assert [getattr(lib, name).argtypes for name in b.functions] == [a for a, _ in b.functions.values()]
    for which, struct in enumerate(b.structs.values()):
        assert lib.kv_struct_size(which) == ctypes.sizeof(struct) > 0
    for source in build.SOURCES:  # every source includes the one header
        assert '#include "kvkernels.h"' in (build.SRC / source).read_text(), source


def test_a_library_built_from_other_sources_is_refused_in_one_line(tmp_path) -> None:
    """A developer's edit after the build: the library beside the sources no longer
    matches them and is not served (rebuild), never silently run."""
    import shutil

    level = kernels.isa()
    src = tmp_path / "src"
    shutil.copytree(build.SRC, src)
    lib = tmp_path / build.library_name(level)
    shutil.copy(kernels.library_path(level), lib)
    assert kernels.Library.open(lib, level, check_sources=src).isa == level
    (src / "decode.cpp").write_text((src / "decode.cpp").read_text() + "\n// edited\n")
    with pytest.raises(RuntimeError, match="built from other sources") as e:
        kernels.Library.open(lib, level, check_sources=src)
    assert "\n" not in str(e.value) and "python -m kvserve.service.kernels" in str(e.value)
    with pytest.raises(RuntimeError, match=r"no libkvkernels-avx2.so in .* \(not built for this CPU"):
        kernels.Library.open(tmp_path / "empty" / "libkvkernels-avx2.so", "avx2")


def _weights(dtype: torch.dtype, N: int, K: int, g: torch.Generator):
    """(weight in ``dtype``, float32 scales or None, the float64 weight it stands for)."""
    if dtype == torch.int8:
        w = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
        s = torch.rand(N, generator=g) + 0.01
        return w, s, w.double() * s.double()[:, None]
    w = torch.randn(N, K, generator=g).to(dtype)
    return w, None, w.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 64])
@pytest.mark.parametrize("K", [64, 96, 771])  # 96: bf16 in blocks of 32 (not 64); 771: a tail past the last 16 and 8
def test_gemv_matches_float64_reference(isa, dtype, rows, K) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + K)
    N = 37
    w, s, ref_w = _weights(dtype, N, K, g)
    x = torch.randn(rows, K, generator=g)
    bias = torch.randn(N, generator=g)
    ref = x.double() @ ref_w.T + bias.double()
    got = ops.gemv(x, w, s, bias)
    assert got.shape == (rows, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
    # accumulate: out += x W^T + b in the same pass (a residual add)
    out = torch.randn(rows, N, generator=g)
    expect = out.double() + ref
    ops.gemv(x, w, s, bias, out=out, accumulate=True)
    torch.testing.assert_close(out.double(), expect, atol=1e-4 * expect.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_rows_result_does_not_depend_on_the_other_rows(isa, dtype) -> None:
    """Bit for bit: each output is one row's dot product, summed in the same order
    whatever the batch (a seeded request decodes the same tokens beside others)."""
    g = torch.Generator().manual_seed(7)
    w, s, _ = _weights(dtype, 50, 256, g)
    x = torch.randn(11, 256, generator=g)
    batch = ops.gemv(x, w, s)
    for i in range(11):
        assert torch.equal(ops.gemv(x[i : i + 1], w, s), batch[i : i + 1])
    # nor on the weight rows computed beside it (the tiles of output rows start elsewhere)
    for start in (1, 3, 5):
        part = ops.gemv(x, w[start:], None if s is None else s[start:])
        assert torch.equal(part, batch[:, start:])
    if dtype == torch.int8:
        batch = ops.gemv_q8(x, w, s)
        for i in range(11):
            assert torch.equal(ops.gemv_q8(x[i : i + 1], w, s), batch[i : i + 1])
        for start in (1, 3):
            assert torch.equal(ops.gemv_q8(x, w[start:], s[start:]), batch[:, start:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
# micro-kernel rows: 6 (AVX2), 12 (AVX-512): every remainder; 200 spans two row blocks (192)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 65, 200])
@pytest.mark.parametrize("K,N", [(64, 37), (771, 150), (600, 16)])  # tails past 8 and 16; two and three K blocks
def test_gemm_matches_float64_reference(isa, dtype, rows, K, N) -> None:
    """The prefill product (gemm.cpp): any rows, weight panels widened per block of K;
    N past one column chunk (128) and not a multiple of the panel's 16."""
    g = torch.Generator().manual_seed(rows * 1000 + K + N)
    w, s, ref_w = _weights(dtype, N, K, g)
    x = torch.randn(rows, K, generator=g)
    bias = torch.randn(N, generator=g)
    ref = x.double() @ ref_w.T + bias.double()
    got = ops.gemm(x, w, s, bias)
    assert got.shape == (rows, N) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=1e-5)
    out = torch.randn(rows, N, generator=g)
    expect = out.double() + x.double() @ ref_w.T
    ops.gemm(x, w, s, out=out, accumulate=True)
    torch.testing.assert_close(out.double(), expect, atol=1e-4 * expect.abs().max().item(), rtol=1e-5)
    # a strided input (a view into a wider tensor): rows read at their own stride
    wide = torch.randn(rows, K + 5, generator=g)
    torch.testing.assert_close(ops.gemm(wide[:, :K], w, s), ops.gemm(wide[:, :K].contiguous(), w, s), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_gemm_rows_result_does_not_depend_on_the_other_rows(isa, dtype) -> None:
    """Bit for bit, as gemv: a prompt row's product is the same whatever else is in the
    prefill chunk, and whatever columns are computed beside it."""
    g = torch.Generator().manual_seed(8)
    w, s, _ = _weights(dtype, 150, 520, g)
    x = torch.randn(77, 520, generator=g)
    batch = ops.gemm(x, w, s)
    for i in (0, 5, 6, 40, 76):
        assert torch.equal(ops.gemm(x[i : i + 1], w, s), batch[i : i + 1])
    assert torch.equal(ops.gemm(x[3:70], w, s), batch[3:70])
    for start in (1, 16, 17):
        assert torch.equal(ops.gemm(x, w[start:], None if s is None else s[start:]), batch[:, start:])


def _q8_reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What gemv_q8 computes, in float64: x quantized per block of 32 (scale amax / 127,
    round half to even), exact integer block products, times the block and row scales."""
    rows, K = x.shape
    xb = x.view(rows, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0  # (rows, nb) float32, as the kernel
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).to(torch.int64)  # torch.round: half to even
    wb = w.view(w.shape[0], K // 32, 32).to(torch.int64)
    block = torch.einsum("rbk,nbk->rnb", q, wb).double()  # exact integers
    return (block * d.double()[:, None, :]).sum(-1) * s.double()[None, :]


@pytest.mark.parametrize("rows", [1, 3, 8, 13])
@pytest.mark.parametrize("K", [256, 288])  # 288: an odd number of blocks (AVX-512 takes two at a time)
def test_gemv_q8_is_llama_cpp_q8_0_arithmetic(isa, rows, K) -> None:
    g = torch.Generator().manual_seed(rows)
    N = 45
    w, s, ref_w = _weights(torch.int8, N, K, g)
    x = torch.randn(rows, K, generator=g)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by zero
    got = ops.gemv_q8(x, w, s)
    ref = _q8_reference(x, w, s)  # float32 sums in the kernel: tolerance relative to the largest output
    torch.testing.assert_close(got.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    exact = x.double() @ ref_w.T
    err = (got.double() - exact).abs().max() / exact.abs().max()
    assert err < 0.02  # 8-bit activations: close to the exact product, not equal
    assert err > 0


def test_bad_arguments_raise_instead_of_reading_out_of_bounds() -> None:
    w = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="features"):
        ops.gemv(torch.zeros(1, 63), w)
    with pytest.raises(ValueError, match="rows"):
        ops.gemv(torch.zeros(ops.MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="scales"):
        ops.gemv(torch.zeros(1, 64), w.to(torch.int8))
    with pytest.raises(ValueError, match="bias"):
        ops.gemv(torch.zeros(1, 64), w, bias=torch.zeros(7))
    with pytest.raises(ValueError, match="out"):
        ops.gemv(torch.zeros(2, 64), w, out=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="multiple of 32"):
        ops.gemv_q8(torch.zeros(1, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="features"):
        ops.gemm(torch.zeros(100, 63), w)
    with pytest.raises(ValueError, match="scales"):
        ops.gemm(torch.zeros(100, 64), w.to(torch.int8))
    with pytest.raises(ValueError, match="out"):
        ops.gemm(torch.zeros(100, 64), w, out=torch.zeros(99, 8))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from tests.fixtures.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("native") / "m", hidden_size=128, intermediate_size=352)


@pytest.mark.parametrize("fmt", ["exact", "bf16", "int8", "w8a8"])
def test_model_with_native_kernels_is_at_least_as_close_to_exact(llama_dir, fmt) -> None:
    """Every weight format loads onto the native kernels by default and its logits are
    no further from the float32 checkpoint's than torch's kernels' (bf16/int8 keep float32
    activations; w8a8's per-32 activation scales beat fbgemm's per-row 7 bits)."""
    ref = load_model(llama_dir, dtype="float32", device="cpu", progress=False, native_kernels="off")
    on = load_model(llama_dir, dtype="float32", device="cpu", progress=False, weight_format=fmt)
    off = load_model(llama_dir, dtype="float32", device="cpu", progress=False, weight_format=fmt,
                     native_kernels="off")  # fmt: skip
    assert on.native == "on" and off.native is None
    assert all(getattr(m, "_packed", None) is None for m in on.model.modules())  # nothing packed
    assert any(getattr(m, "kernel", None) is not None for m in on.model.modules())
    assert all(getattr(m, "kernel", None) in (None, False) for m in off.model.modules())
    ids = torch.tensor([prompts(ref.config.vocab_size, [24])[0]])
    with torch.inference_mode():
        exact = ref.model.forward_nocache(ids)
        got_on, got_off = on.model.forward_nocache(ids), off.model.forward_nocache(ids)
    err_on = (got_on - exact).abs().max().item()
    err_off = (got_off - exact).abs().max().item()
    if fmt == "exact":
        assert err_on < 1e-4
    else:
        assert err_on <= err_off, (err_on, err_off)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_prefill_of_stored_weights_runs_the_native_gemm_as_the_widened_weight(llama_dir, fmt, monkeypatch) -> None:
    """Without AVX-512 BF16 (forced here), a bf16/int8 prompt of more than 64 tokens runs
    gemm.cpp on the stored weight; its logits are the widened float32 weight's product
    (torch's path) up to float32 rounding."""
    from kvserve.service.models import quant

    monkeypatch.setattr(quant, "BF16_GEMM", False)
    loaded = load_model(llama_dir, dtype="float32", device="cpu", progress=False, weight_format=fmt)
    ids = torch.tensor([prompts(loaded.config.vocab_size, [150])[0]])
    calls = []
    real_gemm = ops.gemm
    monkeypatch.setattr(ops, "gemm", lambda *a, **k: calls.append(a[0].shape) or real_gemm(*a, **k))
    with torch.inference_mode():
        got = loaded.model.forward_nocache(ids)
        assert calls and all(shape[-2] == 150 for shape in calls)
        monkeypatch.setattr(quant, "NATIVE_GEMM", False)
        widened = loaded.model.forward_nocache(ids)
    torch.testing.assert_close(got, widened, atol=1e-4 * widened.abs().max().item(), rtol=1e-4)


@pytest.mark.parametrize("fmt", ["exact", "w8a8"])
def test_engine_decodes_with_native_kernels_as_the_uncached_model(llama_dir, fmt) -> None:
    """The engine's cached one-row decode steps and the same model's uncached forward
    over the whole sequence agree on the greedy tokens."""
    loaded = load_model(llama_dir, dtype="float32", device="cpu", progress=False, weight_format=fmt)
    assert loaded.native == "on"
    prompt = prompts(loaded.config.vocab_size, [21])[0]
    events = run(make_engine(loaded), [req("a", prompt, n=12)])
    assert finished(events["a"]).output_token_ids == greedy_reference(loaded.model, prompt, 12)


@pytest.mark.parametrize("kv_format", ["exact", "bf16", "int8"])
def test_a_returning_turns_chunk_runs_as_decode_rows_as_the_padded_prefill(llama_dir, kv_format) -> None:
    """Chunks over a cached context, at most one native step's rows together (returning
    turns' new tokens), run as decode rows (in the step's decode forward): their logits and the KV
    they leave are the padded prefill forward's to rounding; more rows than one step takes,
    or a chunk with nothing cached, go padded."""
    from kvserve.service.engine.runner import Runner

    loaded = load_model(llama_dir, dtype="float32", device="cpu", progress=False)
    history, turn2, turn3 = prompts(loaded.config.vocab_size, [37, 9, 20], seed=5)
    engines, logits = {}, {}
    for path in ("rows", "padded"):
        eng = engines[path] = make_engine(loaded, kv_cache_format=kv_format)
        runner = eng.runner
        if path == "padded":  # the padded forward for every chunk
            runner._chunks_as_rows = lambda chunks, taken=0: ([], chunks)
        seen = []
        fwd = runner.decode_step
        runner.decode_step = lambda d, v, chunks=None, fwd=fwd: (chunks and seen.append([n for _, n in chunks])) or fwd(d, v, chunks)
        # two sessions' first turns, then both return at once: 9 + 20 new tokens, one step
        run(eng, [req("h1", history, n=1), req("h2", history[::-1], n=1)])
        events = run(eng, [req("r1", history + turn2, n=6), req("r2", history[::-1] + turn3, n=6)])
        logits[path] = (finished(events["r1"]).output_token_ids, finished(events["r2"]).output_token_ids)
        if path == "rows":
            cached = len(history) // BS * BS  # the history's full blocks
            # both returning chunks (their tokens past the cached blocks), one native step
            assert seen == [[len(history) + 9 - cached, len(history) + 20 - cached]]
        else:
            assert seen == []
    assert logits["rows"] == logits["padded"]
    for layer in range(loaded.config.num_layers):  # the KV both left, dequantized
        kv = [_pool_kv(engines[p].runner.pool, layer) for p in ("rows", "padded")]
        for a, b in zip(*kv):
            scale = b.abs().max().item()
            # bf16: the paths' float32 K/V differ in the last bits and may round to neighbouring bf16 values
            rtol = 2**-7 if kv_format == "bf16" else 1e-3
            torch.testing.assert_close(a, b, atol=(2e-2 if kv_format == "int8" else 1e-4) * scale, rtol=rtol)
    # a cold chunk, and cached chunks past one native step's rows, go padded
    r = engines["rows"].runner
    assert isinstance(r, Runner)

    class S:  # what _chunks_as_rows reads of a sequence
        def __init__(self, computed: int) -> None:
            self.num_computed = computed

    cold, warm = S(0), S(40)
    rows, padded = r._chunks_as_rows([(cold, 30), (warm, 10)])
    assert rows == [(warm, 10)] and padded == [(cold, 30)]
    cap = r.step.chunk_rows
    rows, padded = r._chunks_as_rows([(warm, cap), (S(8), 1)])
    assert rows == [] and [n for _, n in padded] == [cap, 1]
    # the step's decode rows count against the cap
    assert r._chunks_as_rows([(warm, cap - 3)], taken=3)[0] == [(warm, cap - 3)]
    assert r._chunks_as_rows([(warm, cap - 3)], taken=4)[0] == []


def test_decode_rows_and_a_returning_turns_rows_share_one_forward(llama_dir) -> None:
    """A returning turn arriving while another sequence decodes: its new tokens run in the
    step's one decode forward beside the decode row (one model call, one read of the
    weights), both get a token in that step, and both outputs are the uncached model's."""
    from kvserve.service.types import Delta

    loaded = load_model(llama_dir, dtype="float32", device="cpu", progress=False)
    history, turn2, other = prompts(loaded.config.vocab_size, [37, 21, 15], seed=8)
    eng = make_engine(loaded)
    run(eng, [req("h", history, n=1)])
    events: dict = {}
    eng.add_request(req("d", other, n=12))
    while not any(isinstance(e, Delta) for e in events.get("d", [])):
        for rid, ev in eng.step():
            events.setdefault(rid, []).append(ev)
    calls = []  # the model's forwards and its native steps (the decode step's one call)
    hook = loaded.model.register_forward_hook(lambda mod, args, out: calls.append(tuple(out.shape)))
    native = eng.runner.step
    assert native.name == "native"
    real = native.__class__.__call__
    native.__class__.__call__ = lambda self, *a: calls.append(tuple((out := real(self, *a)).shape)) or out
    try:
        eng.add_request(req("r", history + turn2, n=6))
        got = [rid for rid, ev in eng.step() if isinstance(ev, Delta) and ev.token_ids]
    finally:
        hook.remove()
        native.__class__.__call__ = real
    assert sorted(got) == ["d", "r"] and len(calls) == 1 and calls[0][0] == 2  # the decode row and r's last
    while eng.has_work():
        for rid, ev in eng.step():
            events.setdefault(rid, []).append(ev)
    assert finished(events["r"]).output_token_ids == greedy_reference(loaded.model, history + turn2, 6)
    assert finished(events["d"]).output_token_ids == greedy_reference(loaded.model, other, 12)


def test_without_a_library_for_this_cpu_auto_falls_back_and_on_refuses_in_one_line(tmp_path, llama_dir) -> None:
    """A wheel built without a compiler, or for another CPU, has no library for this one:
    auto serves with torch's kernels, on refuses in one line; neither compiles."""
    script = f"""
from pathlib import Path
from kvserve.service import kernels
kernels.library_path = lambda isa, directory=None: Path({str(tmp_path)!r}) / f"libkvkernels-{{isa}}.so"  # nothing built
from kvserve.service.models.config import ModelLoadError
from kvserve.service.models.loading import load_model
assert not kernels.available()
print("REASON", kernels.reason())
m = load_model({str(llama_dir)!r}, dtype="float32", device="cpu", progress=False)
print("AUTO", m.native, all(getattr(x, "kernel", None) in (None, False) for x in m.model.modules()))
try:
    load_model({str(llama_dir)!r}, dtype="float32", device="cpu", progress=False, native_kernels="on")
except ModelLoadError as e:
    print("ON", str(e).count(chr(10)), e)
"""
    env = dict(os.environ, PATH=str(tmp_path), PYTHONPATH=str(REPO))  # no compiler on PATH either
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert lines["REASON"].startswith("native kernels: no libkvkernels-") and "pip install -e ." in lines["REASON"]
    assert lines["AUTO"].startswith("native kernels: no libkvkernels-") and lines["AUTO"].endswith("True")
    assert lines["ON"].startswith("0 native_kernels=on: native kernels: no libkvkernels-")


def test_a_bfloat16_model_says_the_kernels_compute_in_float32(tiny_llama_dir) -> None:
    from kvserve.service.kv.cache import KVPool
    from kvserve.service.models.step import native_step

    m = load_model(tiny_llama_dir, dtype="bfloat16", device="cpu", progress=False)
    cfg = m.config
    pool = KVPool(8, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    assert m.native == "the native kernels compute in float32, the model in bfloat16"
    assert native_step(m.model.decoder(), pool) is None
    with pytest.raises(ModelLoadError, match="^native_kernels=on: the native kernels compute in float32"):
        load_model(tiny_llama_dir, dtype="bfloat16", device="cpu", progress=False, native_kernels="on")


def test_native_kernels_setting_reaches_the_engine_config() -> None:
    from kvserve.service.config import ServerConfig

    assert ServerConfig.from_args([], {}).engine_config().native_kernels == "auto"
    assert ServerConfig.from_args(["--native-kernels", "off"], {}).engine_config().native_kernels == "off"
    assert ServerConfig.from_args([], {"KVSERVE_NATIVE_KERNELS": "on"}).engine_config().native_kernels == "on"
    with pytest.raises(ValueError):
        load_model(REPO / "service" / "default_model", native_kernels="sometimes")


# ---- the decode step's other kernels: attention over the pool, norms, RoPE, gates ----------


def _ref_attention(q, k_ctx, v_ctx, lens, window, scale, softcap):
    """float64 attention of q (B, nh, hd) over k/v (B, C, n_kv, hd), sequence b's first
    lens[b] positions, the last ``window`` only when given."""
    B, nh, hd = q.shape
    nkv = k_ctx.shape[2]
    out = torch.zeros(B, nh, hd, dtype=torch.float64)
    for b in range(B):
        n = lens[b]
        start = max(0, n - window) if window else 0
        for h in range(nh):
            kk = k_ctx[b, start:n, h // (nh // nkv)].double()
            s = kk @ q[b, h].double() * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = torch.softmax(s, 0) @ v_ctx[b, start:n, h // (nh // nkv)].double()
    return out


def _pool_kv(pool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V of ``layer`` as float32 (int8: times their rows' scales)."""
    if pool.data.dtype == torch.int8:
        return (pool.k(layer).float() * pool.k_scale(layer)[..., None],
                pool.v(layer).float() * pool.v_scale(layer)[..., None])  # fmt: skip
    return pool.k(layer).float(), pool.v(layer).float()


def _attention_on_1_and_2_threads(q, k, v, pool, layout, window, softcap, hd, bs) -> list[torch.Tensor]:
    """ops.decode_attention of layer 1 with one thread and with two, each over the same
    context (the call writes the new K/V into its pool); the pool is left as the second
    call left it."""
    threads = torch.get_num_threads()
    outs = []
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            data = pool.data.clone()
            outs.append(ops.decode_attention(q, k, v, data, 1, layout.slot_blocks, layout.slot_offsets,
                                             layout.ctx_blocks, layout.lens_tensor(), window, hd**-0.5, softcap,
                                             block_size=bs))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    pool.data.copy_(data)
    return outs


# query heads per kv head: 2, 1, 3 (6 over 1 head, split in two slices for two threads), 5 (a group of 3 and one of 2)
@pytest.mark.parametrize("nh,nkv,window,softcap", [(4, 2, None, None), (4, 4, None, None), (6, 1, 5, None),
                                                    (4, 2, None, 30.0), (10, 2, None, None)])  # fmt: skip
# 96: past one 64-float chunk of the value sums; 40: a chunk and a tail; 12: not a multiple of 8
@pytest.mark.parametrize("hd", [32, 96, 40, 12])
def test_decode_attention_reads_the_pool_in_place(isa, nh, nkv, window, softcap, hd) -> None:
    """The new token's K/V land in their slot and the output is the float64 attention over
    each sequence's own blocks (scattered, different lengths, GQA, window, soft-cap)."""
    from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice

    g = torch.Generator().manual_seed(nh * 10 + nkv)
    bs, L = 4, 3
    pool = KVPool(40, L, bs, nkv, hd)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    tables = [[7, 3, 22, 9], [30, 1, 15], [12]]
    lens = [14, 9, 2]  # context before the new token: 13, 8, 1
    layout = BatchLayout.build([SeqSlice(t, n - 1, [5]) for t, n in zip(tables, lens)], bs)
    q = torch.randn(3, 1, nh, hd, generator=g)
    kv_new = torch.randn(3, 1, 2 * nkv, hd, generator=g)  # k and v side by side, as the fused projection
    k, v = kv_new.split(nkv, dim=2)
    layer = 1
    out = ops.decode_attention(q, k, v, pool.data, layer, layout.slot_blocks, layout.slot_offsets, layout.ctx_blocks,
                               layout.lens_tensor(), window, hd**-0.5, softcap)  # fmt: skip
    for b, (t, n) in enumerate(zip(tables, lens)):
        blk, off = t[(n - 1) // bs], (n - 1) % bs
        assert torch.equal(pool.k(layer)[blk, off], k[b, 0]) and torch.equal(pool.v(layer)[blk, off], v[b, 0])
    ids = layout.ctx_blocks.view(-1)
    k_ctx = pool.k(layer).index_select(0, ids).view(3, -1, nkv, hd)
    v_ctx = pool.v(layer).index_select(0, ids).view(3, -1, nkv, hd)
    ref = _ref_attention(q[:, 0], k_ctx, v_ctx, lens, window, hd**-0.5, softcap)
    torch.testing.assert_close(out.view(3, nh, hd).double(), ref, atol=2e-5, rtol=1e-5)


# The kernel splits a batch's contexts into spans (at block boundaries, about two per thread)
# only when it runs on more than one thread; each span's (max, sum, accumulator) is merged.
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("window,softcap", [(None, None), (400, None), (None, 30.0)])
@pytest.mark.parametrize("hd", [64, 12])
def test_decode_attention_over_long_contexts_split_into_spans(isa, pool_dtype, window, softcap, hd) -> None:
    """Contexts of hundreds of positions in 16-position blocks (lengths not a multiple of
    a block, a window starting inside one), scattered over the pool: with one thread (one
    pass over each context) and with two (the long contexts split into spans whose
    partial softmax states are merged) the output is the float64 attention."""
    from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice

    g = torch.Generator().manual_seed(hd + (window or 0))
    bs, L, nh, nkv = 16, 2, 12, 4
    lens = [601, 45, 300]  # context before the new token: 600, 44, 299 (window 400: from position 201)
    nbs = [-(-n // bs) for n in lens]
    ids = (torch.randperm(sum(nbs), generator=g) + 1).tolist()
    tables = [ids[sum(nbs[:b]) : sum(nbs[: b + 1])] for b in range(3)]
    kwargs = {"compute_dtype": torch.float32} if pool_dtype == torch.int8 else {}
    pool = KVPool(sum(nbs) + 1, L, bs, nkv, hd, pool_dtype, **kwargs)
    if pool_dtype == torch.int8:  # the context written by torch's path: values and scales as an engine's
        for t, n in zip(tables, lens):
            k, v = torch.randn(2, 1, n - 1, nkv, hd, generator=g)
            pool.update(1, BatchLayout.build([SeqSlice(t, 0, [1] * (n - 1))], bs), k, v)
    else:
        pool.data.copy_(torch.randn(pool.data.shape, generator=g))
    layout = BatchLayout.build([SeqSlice(t, n - 1, [5]) for t, n in zip(tables, lens)], bs)
    q = torch.randn(3, 1, nh, hd, generator=g)
    k, v = torch.randn(3, 1, 2 * nkv, hd, generator=g).split(nkv, dim=2)
    outs = _attention_on_1_and_2_threads(q, k, v, pool, layout, window, softcap, hd, bs)
    k_ctx, v_ctx = (x.index_select(0, layout.ctx_blocks.view(-1)) for x in _pool_kv(pool, 1))
    k_ctx, v_ctx = k_ctx.reshape(3, -1, nkv, hd), v_ctx.reshape(3, -1, nkv, hd)
    ref = _ref_attention(q[:, 0], k_ctx, v_ctx, lens, window, hd**-0.5, softcap)
    for out in outs:
        torch.testing.assert_close(out.view(3, nh, hd).double(), ref, atol=2e-5, rtol=1e-5)


def test_norm_rope_and_gates_match_torch(isa) -> None:
    import torch.nn.functional as F

    from kvserve.service.models.rope import Rotary, apply_rope_

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 1, 100, generator=g), torch.randn(100, generator=g)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-5), F.rms_norm(x, (100,), w, 1e-5), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6, offset=1.0), F.rms_norm(x, (100,), w + 1, 1e-6),
                               atol=1e-6, rtol=1e-6)  # fmt: skip
    for rot in (64, 32):  # full and partial rotary: bit for bit torch's in-place ops
        cos, sin = Rotary(rot, 10000.0, None)(torch.arange(6).view(2, 3) + 40, torch.float32)
        qkv = torch.randn(2, 3, 7, 64, generator=g)
        a, b = qkv.clone(), qkv.clone()
        apply_rope_(a[:, :, :5], cos, sin)
        ops.rope_(b[:, :, :5], cos, sin)
        assert torch.equal(a, b)
    gu = torch.randn(4, 2 * 300, generator=g) * 4
    gate, up = gu[:, :300], gu[:, 300:]
    torch.testing.assert_close(ops.act_mul(gu, "silu"), F.silu(gate) * up, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.act_mul(gu, "gelu_tanh"), F.gelu(gate, approximate="tanh") * up, atol=1e-5,
                               rtol=1e-5)  # fmt: skip
    torch.testing.assert_close(ops.act_mul(gu, "gelu"), F.gelu(gate) * up, atol=1e-5, rtol=1e-5)  # Gemma's exact gelu


FAMILIES = ["tiny_llama_dir", "tiny_qwen2_window_dir", "tiny_qwen3_dir", "tiny_gemma2_dir", "tiny_gemma3_dir",
            "tiny_phi3_dir", "tiny_phi4_mini_dir", "tiny_mistral_dir", "tiny_gpt2_dir"]  # fmt: skip


def _step_rows(bs, tables, seqs, verify=None):
    """DecodeRows of each sequence's last token (a decode row), then ``verify`` (table
    index, start, tokens): a verify sequence's pending token and drafts."""
    from kvserve.service.kv.cache import DecodeRows

    rows = DecodeRows(bs)
    for t, s in zip(tables, seqs):
        rows.add(t, len(s) - 1, [s[-1]])
    if verify is not None:
        i, start, tokens = verify
        rows.add(tables[i], start, tokens)
    return rows


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_steps_of_every_backend_on_the_cpu_match_torch_per_family(isa, family, request, monkeypatch) -> None:
    """Prefill two sequences of different lengths, then decode 6 tokens each, three ways:
    the engine's decode step backend with the kernels (the native step: one native call a
    step; GPT-2, which has none: the reference over the modules' kernels), the reference
    (``TorchStep``: the model's forward) over the same kernels-on model, and the reference
    over torch's kernels. Every step's logits agree with torch's (float32 tolerance) and
    the native step's K/V are torch's; each path really ran."""
    from kvserve.service.kernels import layer as kernel_layer
    from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice
    from kvserve.service.models.step import TorchStep, build_step

    path = request.getfixturevalue(family)
    fast = load_model(path, dtype="float32", device="cpu", progress=False)
    per_op = load_model(path, dtype="float32", device="cpu", progress=False)
    off = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    calls = {"step": 0, "product": 0}
    real_call, real_product = kernel_layer.NativeStep.__call__, ops.gemv

    def spy_call(step, *a, **kw):
        calls["step"] += 1
        return real_call(step, *a, **kw)

    def spy_product(*a, **kw):
        calls["product"] += 1
        return real_product(*a, **kw)

    monkeypatch.setattr(kernel_layer.NativeStep, "__call__", spy_call)
    monkeypatch.setattr(ops, "gemv", spy_product)
    cfg, bs = fast.config, 4
    runs = (fast, per_op, off)
    pools = [KVPool(32, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim) for _ in runs]
    steps = [build_step(fast.model, pools[0], torch.device("cpu"), max_context=64),
             TorchStep(per_op.model, pools[1], torch.device("cpu")), TorchStep(off.model, pools[2], torch.device("cpu"))]
    tables = [[3, 9, 4, 12, 5, 20], [7, 2, 17, 8, 11]]
    prompts_ = prompts(cfg.vocab_size, [11, 6], seed=5)
    seqs = [list(p) for p in prompts_]
    with torch.inference_mode():
        for m, pool in zip(runs, pools):
            m.model(BatchLayout.build([SeqSlice(t, 0, p) for t, p in zip(tables, prompts_)], bs), pool)
        for _ in range(6):
            a, b, c = (step(_step_rows(bs, tables, seqs)) for step in steps)
            torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(b, c, atol=1e-4, rtol=1e-4)
            for s, tok in zip(seqs, c.argmax(-1).tolist()):
                s.append(tok)
    torch.testing.assert_close(pools[0].data[1:], pools[2].data[1:], atol=1e-4, rtol=1e-4)  # block 0: the prefill's padding
    if family == "tiny_gpt2_dir":
        assert fast.model.decoder() is None and steps[0].name == "torch" and calls["step"] == 0
    else:
        assert steps[0].name == "native" and calls["step"] == 6
    assert calls["product"] > 0  # the reference over the kernels-on model ran the native products


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "tiny_gpt2_dir"])
@pytest.mark.parametrize("fmt", ["exact", "int8"])
def test_the_native_step_is_the_reference_and_each_rows_bits_are_its_own(isa, family, fmt, request) -> None:
    """The engine's decode step as one native call (``NativeStep`` over ``DecodeRows``):
    a decode row and a verify sequence's pending token and drafts (rows at consecutive
    positions over one table), the head on every row or on some, give the reference's
    logits (``TorchStep`` over torch's kernels; int8 weights: over the modules' native
    products of the same int8 weights; float32 tolerance) and K/V; and bit for bit the same logits and K/V when the rows run in
    separate steps, in any order of sequences (a row's result is its own, whatever else
    is in the step). Gemma 3's two RoPE tables, Gemma's softcaps and windows, Qwen3's q/k
    norms, LongRoPE's two factor sets (Phi-4-mini: the rows of a sequence past the switch
    length read the long factors) included. A token id outside the vocabulary is an
    IndexError before anything is written."""
    from kvserve.service.kv.cache import BatchLayout, DecodeRows, KVPool, SeqSlice
    from kvserve.service.models.step import TorchStep, native_step

    path = request.getfixturevalue(family)
    native = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=fmt)
    # the reference: torch's kernels (int8: the modules' own native products, which read the int8 weight
    # with float32 activations as the native step does, where torch's kernel rounds them to bfloat16)
    ref = load_model(path, dtype="float32", device="cpu", progress=False, weight_format=fmt,
                     native_kernels="off" if fmt == "exact" else "auto")  # fmt: skip
    cfg, bs = native.config, 4
    pools = [KVPool(32, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(3)]
    step = native_step(native.model.decoder(), pools[0])
    apart = native_step(native.model.decoder(), pools[2])  # the same rows, one sequence a step
    assert step is not None and apart is not None
    reference = TorchStep(ref.model, pools[1], torch.device("cpu"))
    long = cfg.longrope_threshold is not None
    tables = [[3, 9, 4, 12, 5, 20], [7, 2, 17, 8, 11]]
    lens = [11, 6] if not long else [cfg.longrope_threshold + 3, 6]  # Phi-4-mini: sequence 0 in the long regime
    prompts_ = prompts(cfg.vocab_size, lens, seed=9)
    regimes = [lens[0] > (cfg.longrope_threshold or 1 << 30), False]
    with torch.inference_mode():
        for m, pool in ((native, pools[0]), (ref, pools[1]), (native, pools[2])):
            for t, p, r in zip(tables, prompts_, regimes):
                m.model(BatchLayout.build([SeqSlice(t, 0, p, r if long else None)], bs), pool)
        decode_tok = 5
        verify = [7, 1, 30, 2]  # the pending token and three drafts
        for which in (None, [0, 4]):
            rows = DecodeRows(bs)
            rows.add(tables[0], lens[0], [decode_tok], regimes[0] if long else None)
            rows.add(tables[1], lens[1], verify, regimes[1] if long else None)
            w = None if which is None else array.array("q", which)
            got, want = step(rows, w), reference(rows, w)
            assert got.shape == (5 if which is None else 2, cfg.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(pools[0].data, pools[1].data, atol=1e-4, rtol=1e-4)
            parts = []
            for i in (1, 0):  # the verify sequence first, then the decode row, each its own step
                one = DecodeRows(bs)
                one.add(*((tables[0], lens[0], [decode_tok]) if i == 0 else (tables[1], lens[1], verify)),
                        regimes[i] if long else None)  # fmt: skip
                parts.append(apart(one))
            whole = torch.cat([parts[1], parts[0]])
            assert torch.equal(got, whole if which is None else whole[which])
            assert torch.equal(pools[0].data, pools[2].data)
        before = pools[0].data.clone()
        bad = DecodeRows(bs)
        bad.add(tables[0], lens[0] + 1, [cfg.vocab_size + 3])
        with pytest.raises(IndexError, match="outside the vocabulary"):
            step(bad)
        assert torch.equal(pools[0].data, before)
        with pytest.raises(ValueError, match="does not cover"):
            DecodeRows(bs).add(tables[1], 19, [1, 2])  # 5 blocks of 4 cover positions up to 20


def test_a_gpt2_model_has_no_native_step(tiny_gpt2_dir) -> None:
    from kvserve.service.kv.cache import KVPool
    from kvserve.service.models.step import build_step

    loaded = load_model(tiny_gpt2_dir, dtype="float32", device="cpu", progress=False)
    cfg = loaded.config
    pool = KVPool(8, cfg.num_layers, 4, cfg.num_kv_heads, cfg.head_dim)
    assert loaded.model.decoder() is None
    assert build_step(loaded.model, pool, torch.device("cpu"), max_context=32).name == "torch"


def test_concurrent_callers_from_several_threads_get_their_own_results(isa) -> None:
    """The kernels' thread pool runs one task at a time; callers on other threads (two
    engines in one process, a test beside a server) run theirs alone meanwhile. Every
    caller's result is its own, exactly as computed on one thread."""
    from concurrent.futures import ThreadPoolExecutor

    g = torch.Generator().manual_seed(11)
    w = torch.randn(3000, 256, generator=g)  # many output rows: chunks for every pool thread
    xs = [torch.randn(3, 256, generator=g) for _ in range(6)]
    want = [ops.gemv(x, w) for x in xs]

    def work(i: int) -> bool:
        return all(torch.equal(ops.gemv(xs[i], w), want[i]) for _ in range(40))

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(work, range(6)))


# A sequence's speculative verification is R decode rows over one block table at consecutive
# positions: the kernel reads their common context once for all R rows' heads, then each row
# its own last positions, and merges the two states.
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("nh,nkv,hd", [(12, 4, 64), (4, 2, 12), (6, 1, 40)])
def test_decode_attention_of_verify_rows_reads_their_context_once(isa, pool_dtype, nh, nkv, hd) -> None:
    """A batch of a plain row, a sequence's 9 verify rows (its pending token and 8 drafts)
    and another sequence's 2: with one thread and two (the long context split into spans)
    every row's output is the float64 attention over its own positions, each verify row
    seeing the rows before it (their K/V written by the same call) and none after."""
    from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice

    g = torch.Generator().manual_seed(nh + hd)
    bs, L = 16, 2
    ctx = [37, 350, 5]  # context before the step's rows
    rows = [1, 9, 2]  # rows per sequence
    nbs = [-(-(c + r) // bs) for c, r in zip(ctx, rows)]
    ids = (torch.randperm(sum(nbs), generator=g) + 1).tolist()
    tables = [ids[sum(nbs[:b]) : sum(nbs[: b + 1])] for b in range(3)]
    kwargs = {"compute_dtype": torch.float32} if pool_dtype != torch.float32 else {}
    pool = KVPool(sum(nbs) + 1, L, bs, nkv, hd, pool_dtype, **kwargs)
    for t, c in zip(tables, ctx):  # the contexts written by torch's path, as an engine's
        k, v = torch.randn(2, 1, c, nkv, hd, generator=g)
        pool.update(1, BatchLayout.build([SeqSlice(t, 0, [1] * c)], bs), k, v)
    slices = [SeqSlice(t, c + i, [5]) for t, c, r in zip(tables, ctx, rows) for i in range(r)]
    layout = BatchLayout.build(slices, bs)
    B = len(slices)
    q = torch.randn(B, 1, nh, hd, generator=g)
    k, v = torch.randn(B, 1, 2 * nkv, hd, generator=g).split(nkv, dim=2)
    outs = _attention_on_1_and_2_threads(q, k, v, pool, layout, None, None, hd, bs)
    k_ctx, v_ctx = (x.index_select(0, layout.ctx_blocks.view(-1)) for x in _pool_kv(pool, 1))
    k_ctx, v_ctx = k_ctx.reshape(B, -1, nkv, hd), v_ctx.reshape(B, -1, nkv, hd)
    lens = [c + i + 1 for c, r in zip(ctx, rows) for i in range(r)]
    ref = _ref_attention(q[:, 0], k_ctx, v_ctx, lens, None, hd**-0.5, None)
    for out in outs:
        torch.testing.assert_close(out.view(B, nh, hd).double(), ref, atol=2e-5, rtol=1e-5)


# ---- prefill attention (attention.cpp): causal, the work above the diagonal skipped ---------


def _ref_prefill_attention(q, k, v, kv_len, n_new, window, scale, softcap):
    """float64 causal attention: query t < n_new[b] at position kv_len[b] - n_new[b] + t over
    sequence b's keys at or before it (and after position - window when given)."""
    B, T, nh, hd = q.shape
    G = nh // k.shape[2]
    out = torch.zeros(B, T, nh, hd, dtype=torch.float64)
    for b in range(B):
        C, n = kv_len[b], n_new[b]
        kk = k[b, :C].double().repeat_interleave(G, 1).transpose(0, 1)  # (nh, C, hd)
        vv = v[b, :C].double().repeat_interleave(G, 1).transpose(0, 1)
        s = q[b, :n].double().transpose(0, 1) @ kk.transpose(1, 2) * scale  # (nh, n, C)
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos, c = torch.arange(C - n, C)[:, None], torch.arange(C)[None, :]
        visible = (c <= pos) & (c > pos - window if window else True)
        out[b, :n] = (s.masked_fill(~visible, float("-inf")).softmax(-1) @ vv).transpose(0, 1)
    return out


# query heads per kv head 2, 1, 6 (MQA), 5; a window shorter than a task's 24 rows and one longer
@pytest.mark.parametrize("nh,nkv,window,softcap", [(4, 2, None, None), (4, 4, None, None), (6, 1, 7, None),
                                                    (10, 2, 40, None), (4, 2, None, 30.0)])  # fmt: skip
# 64: whole panels; 96: three AVX-512 panels, six AVX2 ones; 40 and 12: a partial panel
@pytest.mark.parametrize("hd", [64, 96, 40, 12])
def test_prefill_attention_is_the_float64_causal_attention(isa, nh, nkv, window, softcap, hd) -> None:
    """Three sequences in one call, as a batched forward has them: a fresh prompt of all T
    rows, a returning turn's 30 new rows over a cached context (their positions start at
    70), a short prompt padded to T. Each real row is the float64 attention over the keys
    it can see (GQA, window, soft-cap), padding rows are zeros, and one thread and two
    compute the same bits (a row's sum does not depend on how the tasks are shared)."""
    g = torch.Generator().manual_seed(nh * 100 + hd)
    B, T, C = 3, 61, 100  # 61 rows: two whole tasks of 24 and a partial one
    kv_len, n_new = [61, 100, 9], [61, 30, 9]
    qkv = torch.randn(B, T, nh + 2 * nkv, hd, generator=g)  # q in one fused projection's output
    q = qkv[:, :, :nh]
    kv = torch.randn(B, C, 2, nkv, hd, generator=g)
    k, v = kv[:, :, 0], kv[:, :, 1]  # the context's K and V at one row stride
    args = (torch.tensor(kv_len), torch.tensor(n_new), window, hd**-0.5, softcap)
    threads = torch.get_num_threads()
    try:
        outs = []
        for nt in (1, 2):
            torch.set_num_threads(nt)
            outs.append(ops.prefill_attention(q, k, v, *args))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    ref = _ref_prefill_attention(q, k, v, kv_len, n_new, window, hd**-0.5, softcap)
    for b in range(B):
        torch.testing.assert_close(outs[0][b, : n_new[b]].double(), ref[b, : n_new[b]], atol=2e-6, rtol=1e-5)
        assert not outs[0][b, n_new[b] :].any()


def test_prefill_attention_refuses_bad_arguments() -> None:
    q, k = torch.randn(2, 8, 4, 16), torch.randn(2, 10, 2, 16)
    lens, new = torch.tensor([10, 5]), torch.tensor([8, 5])
    with pytest.raises(ValueError, match="n_kv"):
        ops.prefill_attention(q, k[:1], k[:1], lens, new, None, 0.25, None)
    with pytest.raises(ValueError, match="float32"):
        ops.prefill_attention(q.double(), k, k, lens, new, None, 0.25, None)
    with pytest.raises(ValueError, match="strides"):
        ops.prefill_attention(q, k, k.contiguous().transpose(0, 1).contiguous().transpose(0, 1), lens, new, None, 0.25, None)
    for bad_lens, bad_new in (([11, 5], [8, 5]), ([10, 5], [9, 5]), ([10, 5], [8, 6]), ([10, 5], [0, 5])):
        with pytest.raises(ValueError, match="n_new"):
            ops.prefill_attention(q, k, k, torch.tensor(bad_lens), torch.tensor(bad_new), None, 0.25, None)
    with pytest.raises(ValueError, match="int64"):
        ops.prefill_attention(q, k, k, lens.int(), new, None, 0.25, None)


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_mistral_dir", "tiny_gemma2_dir", "tiny_phi3_dir",
                                    "tiny_gpt2_dir"])  # fmt: skip
def test_prefill_forwards_with_native_attention_and_row_ops_match_torchs_kernels(family, request, monkeypatch) -> None:
    """A batched prefill of two prompts (2 x 40 rows with the padding: past the 64 rows
    of decode-sized work; one prompt padded; past Mistral's window; Gemma 2's soft-cap and
    sliding layers; Phi-3's fused projections), then a returning turn over the cached
    context: the native attention serves every layer of both forwards (and the norms,
    RoPE and gates run natively for all rows), and every real row's logits are those of
    the same model on torch's kernels (float32 tolerance)."""
    from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice

    path = request.getfixturevalue(family)
    native = load_model(path, dtype="float32", device="cpu", progress=False)
    off = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    calls = []
    real = ops.prefill_attention
    monkeypatch.setattr(ops, "prefill_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    cfg, bs = native.config, 4
    pools = [KVPool(64, cfg.num_layers, bs, cfg.num_kv_heads, cfg.head_dim) for _ in range(2)]
    tables = [list(range(1, 21)), list(range(21, 41))]
    first, second = prompts(cfg.vocab_size, [40, 23], seed=3)
    more = prompts(cfg.vocab_size, [17], seed=4)[0]
    with torch.inference_mode():
        for layout in (BatchLayout.build([SeqSlice(tables[0], 0, first), SeqSlice(tables[1], 0, second)], bs),
                       BatchLayout.build([SeqSlice(tables[0], len(first), more)], bs)):  # fmt: skip
            a, b = (m.model(layout, pool, all_logits=True) for m, pool in zip((native, off), pools))
            for i, n in enumerate(layout.num_new_tokens):
                torch.testing.assert_close(a[i, :n], b[i, :n], atol=1e-4, rtol=1e-4)
    assert len(calls) == 2 * cfg.num_layers
