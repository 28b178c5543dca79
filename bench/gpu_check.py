"""The device check's steps (bench/gpu_check.sh runs them, one process each), every figure
of issue 46 beside the physical limit it is measured against, in the same run.

    python bench/gpu_check.py limits parity graphs --device cuda     # any steps, in order
    python bench/gpu_check.py all --device cpu --quick               # every step at tiny sizes (the dry run)
    python bench/gpu_check.py summary --out DIR                      # the table of figures so far

Steps (one function each; ``STEPS``):

    limits       D2D copy bandwidth (bytes read + written), pinned host-to-device bandwidth,
                 the bf16 (CPU: float32) matmul peak; written to OUT/limits.json, which the
                 later steps read (measured again where it is missing)
    parity       kvserve vs transformers on tiny random Llama (GQA) and GPT-2, float32 and
                 bfloat16: the prefill's logits and the decode steps' (through the engine's
                 decode step backend), greedy tokens
    graphs       the CUDA step's graphs: for each bucket, a replay equals the same static
                 buffers run eagerly (bit for bit), and the eager step of exactly the rows
                 (tolerance); the reference's logits; tiny Llama, Gemma 2/3, Phi-4-mini,
                 float32 and bfloat16, exact / int8 / fp8 pools
    sessions     3-turn greedy sessions whose turns 2 and 3 are restored from the host tier
                 and from Redis: equal to cold
    decode       the 1.1B shape in bfloat16 through the engine: one stream and batch 32 tok/s
                 against the weight-read and weights-plus-KV-read limits; one stream also
                 on the eager CUDA step and on the torch reference
    prefill      prefill 512 / 2048 / 8192 against transformers (same weights, same
                 process), 8192 against its FLOP limit
    restore      the restore path at TinyLlama-1.1B's KV shape, 8k tokens (``restore_figures``):
                 the host tier's restore against pinned H2D (and a copy per block), Redis on
                 1 and 4 readers (the server with 1 and 4 I/O threads) against raw GETs on
                 as many threads and 3 GB/s, the int8 / fp8 formats decoded on the device
                 against exact, the engine's 8k returning turn from the host tier against cold
    speculative  the chat-editing workloads (bench_chat_edit's prompts) with and without
                 drafts: tok/s ratio, greedy tokens identical
    summary      every figure so far (OUT/figures.jsonl) as one table, with its goal

Each figure is one ``figure:`` line and one line of OUT/figures.jsonl: value, unit, the
limit it is measured against and the fraction, the goal and whether it was met. A step
that fails exits non-zero (gpu_check.sh records it and runs the others).

Sizes: ``--device cuda`` the issue's (1.1B shape, bfloat16, 8k contexts); ``--quick`` tiny
shapes, short contexts, one repetition (the CPU dry run that keeps the script from rotting:
tests/system/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server does, before torch loads
import torch  # noqa: E402

from kvserve.service.engine.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.engine.store import build_store  # noqa: E402
from kvserve.service.kv.cache import BatchLayout, DecodeRows, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.models.step import GraphConfig, TorchStep, build_step  # noqa: E402
from kvserve.service.types import CacheScope, Delta, Finished, GenerationRequest, SamplingParams  # noqa: E402
from tests.fixtures import models as fixtures  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

TOL = {torch.float32: 1e-3, torch.bfloat16: 0.15}  # parity: max |logit difference| (bf16: 8 bits of mantissa)
BS = 8  # parity and sessions' block size
BLOCK = 16  # the benches' (bench_restore's)


@dataclass(frozen=True)
class Sizes:
    """What each step runs at: the issue's (GPU) or the dry run's (``--quick``)."""

    shape: str  # bench_restore.SHAPES: the decode and prefill model (the restore's at GPU sizes)
    dtype: str
    prompt: int  # decode: each sequence's prompt
    tokens: int  # decode: tokens per sequence
    batch: int
    prefill: tuple[int, ...]
    repeats: int
    history: int  # restore: the tokens restored
    graph_rows: int  # graphs: the largest bucket
    spec_tokens: int
    limit_bytes: int  # limits: the copies' size
    matmul: int  # limits: the product's M = N = K


GPU = Sizes("tinyllama", "bfloat16", 512, 64, 32, (512, 2048, 8192), 3, 8192, 16, 128, 1 << 30, 8192)
QUICK = Sizes("tiny", "float32", 32, 8, 4, (16, 64), 1, 128, 8, 24, 32 << 20, 512)


# ---- figures ---------------------------------------------------------------------------------


class Report:
    """Figures of this run: printed, and appended to OUT/figures.jsonl."""

    def __init__(self, out: Path) -> None:
        self.path = out / "figures.jsonl"

    def figure(self, name: str, value: float, unit: str, *, limit: float | None = None, limit_name: str = "",
               goal: str = "", ok: bool | None = None, note: str = "") -> None:
        """One figure; ``limit`` in the same unit as ``value`` (its fraction printed:
        value / limit, or limit / value for a time)."""
        frac = None
        if limit:
            frac = limit / value if unit in ("ms", "s") else value / limit
        row = dict(figure=name, value=value, unit=unit, limit=limit, limit_name=limit_name, fraction=frac, goal=goal,
                   ok=ok, note=note)  # fmt: skip
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print("figure: " + _line(row), flush=True)


def _line(r: dict) -> str:
    s = f"{r['figure']} = {_num(r['value'])} {r['unit']}"
    if r.get("limit"):
        s += f" ({100 * r['fraction']:.0f}% of {r['limit_name']} {_num(r['limit'])} {r['unit']})"
    if r.get("goal"):
        s += f"; goal {r['goal']}: {'met' if r['ok'] else 'NOT met' if r['ok'] is not None else '-'}"
    if r.get("note"):
        s += f"; {r['note']}"
    return s


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- limits ----------------------------------------------------------------------------------


def limits(ctx: Ctx) -> bool:
    """The physical limits the figures are measured against, in this run."""
    dev, n = ctx.device, ctx.sizes.limit_bytes
    src = torch.randn(n // 4, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, 10)
    d2d = 2 * n / t / 1e9  # bytes read + written
    host = torch.randn(n // 4, pin_memory=dev.type == "cuda")
    t = timed(lambda: dst.copy_(host, non_blocking=True), dev, 5)
    h2d = n / t / 1e9
    m = ctx.sizes.matmul
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(m, m, device=dev, dtype=dtype), torch.randn(m, m, device=dev, dtype=dtype)
    t = timed(lambda: a @ b, dev, 10)
    flops = 2 * m**3 / t
    found = {"d2d_gbps": d2d, "h2d_gbps": h2d, "matmul_tflops": flops / 1e12, "matmul_dtype": str(dtype).removeprefix("torch."),
             "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}  # fmt: skip
    (ctx.out / "limits.json").write_text(json.dumps(found))
    print(f"limits: device memory copy {d2d:.1f} GB/s (read + written), {'pinned ' if dev.type == 'cuda' else ''}"
          f"host-to-device {h2d:.1f} GB/s, {found['matmul_dtype']} matmul {found['matmul_tflops']:.3g} TFLOP/s ({m}^3)")
    return True


def _limits(ctx: Ctx) -> dict:
    path = ctx.out / "limits.json"
    if not path.exists():
        limits(ctx)
    return json.loads(path.read_text())


# ---- parity ----------------------------------------------------------------------------------


def _paged_logits(loaded, ids: list[int], n_decode: int) -> tuple[torch.Tensor, list[int], torch.Tensor, str]:
    """All-position logits of ``ids`` (two prefill chunks), then ``n_decode`` greedy decode
    steps through the engine's decode step backend (``build_step``): (prefill logits,
    greedy tokens, the decode steps' logits, the backend's name)."""
    c = loaded.config
    total = len(ids) + n_decode
    nb = -(-total // BS)
    pool = KVPool(nb + 1, c.num_layers, BS, c.num_kv_heads, c.head_dim, loaded.dtype, loaded.device)
    table = list(range(1, nb + 1))
    half = len(ids) // 2
    parts = []
    for start, chunk in ((0, ids[:half]), (half, ids[half:])):
        layout = BatchLayout.build([SeqSlice(table, start, chunk)], BS, loaded.device, loaded.dtype)
        parts.append(loaded.model(layout, pool, all_logits=True)[0].float())
    logits = torch.cat(parts)  # (T, vocab)
    step = build_step(loaded.model, pool, loaded.device, max_context=c.max_position_embeddings,
                      graphs=GraphConfig(max_rows=4))  # fmt: skip
    out, steps, pos, last = [], [], len(ids), logits[-1]
    for _ in range(n_decode):
        tok = int(last.argmax())
        out.append(tok)
        rows = DecodeRows(BS)
        rows.add(table, pos, [tok])
        last = step(rows)[0].float()
        steps.append(last)
        pos += 1
    return logits, out, torch.stack(steps), step.name


@torch.inference_mode()
def parity(ctx: Ctx) -> bool:
    from transformers import AutoModelForCausalLM

    ok = True
    for family, make in (("llama-gqa", fixtures.make_tiny_llama), ("gpt2", fixtures.make_tiny_gpt2)):
        path = make(ctx.work / family)
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(path), dtype=dtype, device=ctx.device, progress=False)
            ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(ctx.device).eval()
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, loaded.config.vocab_size, (40,), generator=g).tolist()
            got, greedy, steps, backend = _paged_logits(loaded, ids, 8)
            full = ids + greedy
            want_all = ref(torch.tensor([full], device=ctx.device)).logits[0].float()
            diff = float((got - want_all[: len(ids)]).abs().max())
            step_diff = float((steps - want_all[len(ids) : len(full)]).abs().max())
            ref_ids = list(ids)
            for _ in range(8):
                ref_ids.append(int(ref(torch.tensor([ref_ids], device=ctx.device)).logits[0, -1].argmax()))
            agree = greedy == ref_ids[len(ids) :]
            passed = max(diff, step_diff) <= TOL[dtype] and (agree or dtype != torch.float32)
            name = f"parity.{family}.{str(dtype).removeprefix('torch.')}"
            print(f"{name}.max_logit_diff: {diff:.3g} prefill, {step_diff:.3g} decode ({backend} step; tolerance {TOL[dtype]})")
            print(f"{name}.greedy_8_agree: {agree}")
            ctx.report.figure(f"parity {family} {str(dtype).removeprefix('torch.')}", max(diff, step_diff), "logit",
                              goal=f"<= {TOL[dtype]}" + (", greedy equal" if dtype == torch.float32 else ""), ok=passed,
                              note=f"decode by the {backend} step")  # fmt: skip
            ok &= passed or dtype != torch.float32
            del loaded, ref
    return ok


# ---- graphs ----------------------------------------------------------------------------------


def _graph_rows(hist: list[list[int]], tables: list[list[int]], n: int, regimes: list[bool | None]) -> DecodeRows:
    """``n`` rows: a decode row per sequence, then the last sequence's pending token and
    drafts (verify rows) to fill up."""
    rows = DecodeRows(BLOCK)
    k = min(n, len(hist) - 1) if n > 1 else 1
    for i in range(k):
        rows.add(tables[i], len(hist[i]), [3 + i], regimes[i])
    if n > k:
        rows.add(tables[-1], len(hist[-1]), [5 + j for j in range(n - k)], regimes[-1])
    return rows


@torch.inference_mode()
def graphs(ctx: Ctx) -> bool:
    """Graph replay equals eager, per bucket, per family and pool format."""
    from kvserve.service.models import cuda_step as cs

    ops = _step_ops(ctx)
    if ops is None:
        return False
    cases = [("tiny_llama", fixtures.make_tiny_llama, {}), ("gemma2", fixtures.make_tiny_gemma, dict(version=2)),
             ("gemma3", fixtures.make_tiny_gemma, dict(version=3)),
             ("phi4-mini", fixtures.make_tiny_phi4_mini, dict(original=32))]  # fmt: skip
    formats = {"exact": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
    ok = True
    for name, make, kw in cases:
        path = ctx.work / f"graphs-{name}"
        if not (path / "config.json").exists():
            make(path, **kw)
        llama = name == "tiny_llama"  # float32 and the scaled KV formats on one family (their kernels know no family)
        for dtype in (torch.float32,) if ctx.quick else (torch.float32, torch.bfloat16) if llama else (torch.bfloat16,):
            loaded = load_model(str(path), dtype=dtype, device=ctx.device, progress=False, native_kernels="off")
            c = loaded.config
            for fmt, kv_dtype in formats.items():
                if fmt != "exact" and (ctx.quick or not llama or dtype != torch.bfloat16):
                    continue
                pools = [KVPool(48, c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, kv_dtype or dtype, ctx.device,
                                compute_dtype=dtype) for _ in range(3)]  # fmt: skip
                g = torch.Generator().manual_seed(2)
                hist = [torch.randint(3, c.vocab_size, (n,), generator=g).tolist() for n in (21, 9, 40)]
                tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(3)]
                th = c.longrope_threshold
                regimes = [None if th is None else len(h) + 8 > th for h in hist]
                for pool in pools:
                    for t, h, r in zip(tables, hist, regimes):
                        loaded.model(BatchLayout.build([SeqSlice(t, 0, h, r)], BLOCK, ctx.device, dtype), pool)
                max_ctx = 12 * BLOCK
                step = cs.CudaStep(loaded.model.decoder(), pools[0], max_context=max_ctx, ops=ops)
                runner = cs.CudaGraphStep(step, cs.graph_buckets(ctx.sizes.graph_rows), 1 << 30)
                eager = cs.CudaStep(loaded.model.decoder(), pools[1], max_context=max_ctx, ops=ops)
                ref = TorchStep(loaded.model, pools[2], ctx.device)
                worst_replay = worst_eager = worst_ref = 0.0
                for n in sorted({1, 3, 5, 8, ctx.sizes.graph_rows - 1, ctx.sizes.graph_rows}):
                    rows = _graph_rows(hist, tables, n, regimes)
                    g_ = runner.graphs[runner.bucket(n)]
                    before = pools[0].data.clone()
                    got = runner(rows)  # the replay
                    after = pools[0].data.clone()
                    pools[0].data.copy_(before)
                    step.fill(g_.buf, rows)
                    static = step.run(g_.buf)[:n]  # the same buffers, eagerly
                    worst_replay = max(worst_replay, _diff(got, static), _diff(after, pools[0].data))
                    worst_eager = max(worst_eager, _diff(got, eager(rows)))
                    worst_ref = max(worst_ref, _diff(got, ref(rows)))
                tol = TOL[dtype] if kv_dtype is None else 0.05 * max(1.0, float(got.abs().max()))
                passed = worst_replay == 0.0 and worst_eager <= tol and worst_ref <= tol
                label = f"graphs {name} {str(dtype).removeprefix('torch.')} {fmt}"
                print(f"{label}: buckets {runner.buckets}, replay vs eager over the same buffers {worst_replay:.3g}, "
                      f"vs the eager step {worst_eager:.3g}, vs the reference {worst_ref:.3g}")
                ctx.report.figure(label, worst_replay, "max diff", goal="replay == eager (bit for bit); eager and "
                                  f"reference within {tol:.3g}", ok=passed,
                                  note=f"eager {worst_eager:.3g}, reference {worst_ref:.3g}")  # fmt: skip
                ok &= passed
    return ok


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.dtype in (torch.int8, torch.float8_e4m3fn, torch.uint8):
        return 0.0 if torch.equal(a.view(torch.uint8), b.view(torch.uint8)) else float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _step_ops(ctx: Ctx) -> Any:
    """The CUDA step's kernels: kernels/triton on CUDA; on the CPU (the dry run) the tests'
    torch versions of them (the kernels themselves run under Triton's interpreter in
    tests/engine/test_step.py)."""
    if ctx.device.type != "cuda":
        from tests.fixtures import step_ops

        return step_ops
    from kvserve.service.kernels import triton as ops

    if not ops.available():
        print("graphs: the Triton kernels cannot run here:", ops.reason())
        return None
    return ops


# ---- sessions --------------------------------------------------------------------------------


def _engine(loaded, store=None) -> LLMEngine:
    cfg = EngineConfig(block_size=BS, kv_cache_memory=256 * BS * _bpt(loaded), restore_policy="always",
                       cuda_graph_max_rows=8)  # fmt: skip
    return LLMEngine(loaded, cfg, store=store)


def _bpt(loaded) -> int:
    c = loaded.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * loaded.dtype.itemsize


def _run(eng: LLMEngine, tokens: list[int], rid: str, n: int = 8) -> Finished:
    eng.add_request(GenerationRequest(rid, tokens, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    while True:
        for _, ev in eng.step():
            if isinstance(ev, Finished):
                return ev


def _spill(eng: LLMEngine, tokens: list[int], tier: str) -> None:
    eng.spill(tokens, CacheScope(), (tier,), lambda n, held: None)
    assert eng.store.flush(60)
    eng.step()


@torch.inference_mode()
def sessions(ctx: Ctx) -> bool:
    import redis

    from tests.fixtures.redis_server import start_redis_server

    path = fixtures.make_tiny_llama(ctx.work / "session-llama", max_position_embeddings=1024)
    server = start_redis_server(ctx.work / "redis")
    ok = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(path), dtype=dtype, device=ctx.device, progress=False)
            g = torch.Generator().manual_seed(1)
            new = [torch.randint(3, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (97, 40, 33)]
            host_cfg = EngineConfig(block_size=BS, host_cache_memory=512 * BS * _bpt(loaded))
            host_store = build_store(host_cfg, loaded)
            first = _engine(loaded, host_store)
            prompts, transcript = [], []
            for i, turn in enumerate(new):
                transcript = transcript + turn
                prompts.append(list(transcript))
                transcript += _run(first, transcript, f"t{i}").output_token_ids
            cold = _engine(loaded)
            want = [_run(cold, p, f"cold{i}").output_token_ids for i, p in enumerate(prompts)]
            cold.close()
            dname = str(dtype).removeprefix("torch.")
            mismatches = 0
            for tier in ("host", "redis"):
                for i in (1, 2):  # turns 2 and 3 restored into a new device pool
                    hist = prompts[i - 1] + want[i - 1]
                    if tier == "host":
                        _spill(first, hist, "host")
                        eng = _engine(loaded, host_store)
                    else:
                        redis.Redis.from_url(server.url).flushall()
                        rcfg = EngineConfig(block_size=BS, redis_url=server.url)
                        writer = _engine(loaded, build_store(rcfg, loaded))
                        _run(writer, hist, "w", n=1)
                        _spill(writer, hist, "redis")
                        writer.close()
                        eng = _engine(loaded, build_store(rcfg, loaded))
                    fin = _run(eng, prompts[i], f"{tier}{i}")
                    same = fin.output_token_ids == want[i]
                    mismatches += not same
                    print(f"sessions.{dname}.{tier}.turn{i + 1}: restored {fin.cached_tokens}/{len(prompts[i])} "
                          f"tokens, {'equal to cold' if same else 'DIFFERS from cold'}")
                    if tier == "redis":
                        eng.close()
            first.close()
            passed = mismatches == 0 or dtype != torch.float32
            ctx.report.figure(f"sessions restored = cold, {dname}", mismatches, "mismatches",
                              goal="0" if dtype == torch.float32 else "reported", ok=passed)  # fmt: skip
            ok &= passed
    finally:
        server.stop()
    return ok


# ---- decode ----------------------------------------------------------------------------------


def _checkpoint(ctx: Ctx) -> Path:
    """The shared random checkpoint of the decode, prefill and (on a GPU) restore steps
    (bench_restore's, kept under the work directory across the steps' processes)."""
    from bench import bench_restore

    return bench_restore.checkpoint(ctx.sizes.shape, max(*ctx.sizes.prefill, ctx.sizes.history) + 32, ctx.work / "models")


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter (each tensor once) but
    an embedding table the head does not share (a decode step gathers a row of it)."""
    ends = model.decoder().ends
    head = getattr(ends.head, "weight", None)
    skip = ends.embedding.data_ptr() if head is None or head.data_ptr() != ends.embedding.data_ptr() else None
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr != skip)


def _decode_rate(loaded, batch: int, prompt: int, tokens: int, **cfg) -> tuple[float, str, float]:
    """(tok/s of ``batch`` greedy sequences decoding together through the engine, the
    decode step's backend, the median step ms)."""
    per_token = loaded.kv_spec(BLOCK).bytes_per_token
    eng = LLMEngine(loaded, EngineConfig(block_size=BLOCK, max_num_seqs=max(batch, 1), speculative="off",
                                         kv_cache_memory=(batch + 1) * (prompt + tokens + 2 * BLOCK) * per_token,
                                         max_num_batched_tokens=max(512, batch * prompt), **cfg))  # fmt: skip
    backend = eng.runner.step.name
    g = torch.Generator().manual_seed(batch)
    for b in range(batch):
        p = torch.randint(3, loaded.config.vocab_size, (prompt,), generator=g).tolist()
        eng.add_request(GenerationRequest(f"d{b}", p, SamplingParams(max_new_tokens=tokens, ignore_eos=True)))
    started, done, n, steps = set(), 0, 0, []
    t0 = None
    while done < batch:
        t = time.perf_counter()
        events = eng.step()
        dt = time.perf_counter() - t
        if t0 is not None:
            n += sum(len(e.token_ids) for _, e in events if isinstance(e, Delta))
            steps.append(dt)
        for rid, e in events:
            if isinstance(e, Delta):
                started.add(rid)
            elif isinstance(e, Finished):
                done += 1
        if t0 is None and len(started) == batch:
            t0 = time.perf_counter()
    rate = n / (time.perf_counter() - t0)
    eng.close()
    return rate, backend, statistics.median(steps) * 1e3


@torch.inference_mode()
def decode(ctx: Ctx) -> bool:
    lim, s = _limits(ctx), ctx.sizes
    loaded = load_model(str(_checkpoint(ctx)), dtype=s.dtype, device=ctx.device, progress=False)
    w = _weight_bytes(loaded.model)
    kv = loaded.kv_spec(BLOCK).bytes_per_token
    bw = lim["d2d_gbps"] / 2 * 1e9  # bytes read per second (the copy counted read + write)
    one, backend, step_ms = _decode_rate(loaded, 1, s.prompt, s.tokens)
    limit_one = bw / w
    ctx.report.figure("decode, one stream", one, "tok/s", limit=limit_one, limit_name="weight-read limit",
                      goal=">= 50% of the limit", ok=one >= 0.5 * limit_one,
                      note=f"{backend} step, {step_ms:.2f} ms a step, {w / 1e9:.2f} GB of weights")  # fmt: skip
    if ctx.device.type == "cuda":  # what the graphs and the kernels give: the same stream without them
        eager, b2, _ = _decode_rate(loaded, 1, s.prompt, s.tokens // 2, cuda_graphs=False)
        ctx.report.figure("decode, one stream, no graphs", eager, "tok/s", limit=limit_one,
                          limit_name="weight-read limit", note=f"{b2} step")  # fmt: skip
    ctx_avg = s.prompt + s.tokens / 2
    many, backend, step_ms = _decode_rate(loaded, s.batch, s.prompt, s.tokens // 2)
    limit_many = s.batch * bw / (w + s.batch * ctx_avg * kv)
    ctx.report.figure(f"decode, batch {s.batch}", many, "tok/s", limit=limit_many,
                      limit_name="weights + KV read limit", goal=">= 50% of the limit", ok=many >= 0.5 * limit_many,
                      note=f"{backend} step, {step_ms:.2f} ms a step, KV {s.batch * ctx_avg * kv / 1e9:.2f} GB")  # fmt: skip
    return True  # a figure short of its goal is reported (the summary's "met"), not a failure of the check


# ---- prefill ---------------------------------------------------------------------------------


@torch.inference_mode()
def prefill(ctx: Ctx) -> bool:
    from transformers import AutoModelForCausalLM

    from bench.bench_engine import Ours, Reference, timed_pair

    lim, s = _limits(ctx), ctx.sizes
    path = _checkpoint(ctx)
    dtype = getattr(torch, s.dtype)
    loaded = load_model(str(path), dtype=s.dtype, device=ctx.device, progress=False)
    ref = Reference(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(ctx.device).eval(), ctx.device)
    ours = Ours(loaded, max(s.prefill) + 16)
    c = loaded.config
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(3, c.vocab_size, (1, 32), generator=g).tolist()
    ours.prefill(warm), ref.prefill(warm)
    params = _weight_bytes(loaded.model) / dtype.itemsize
    for n in s.prefill:
        p = torch.randint(3, c.vocab_size, (1, n), generator=g).tolist()
        t_ours, t_ref = timed_pair(lambda _: ours.prefill(p), lambda _: ref.prefill(p), ctx.device, s.repeats)
        flops = 2 * params * n + 2 * c.num_layers * n * n * c.num_heads * c.head_dim  # products + causal attention
        limit_ms = flops / (lim["matmul_tflops"] * 1e12) * 1e3
        goal = "<= 40 ms and >= 1.0x transformers" if n == max(s.prefill) else ">= 1.0x transformers"
        met = t_ref >= t_ours and (n != max(s.prefill) or t_ours * 1e3 <= 40 or ctx.quick)
        ctx.report.figure(f"prefill {n}", t_ours * 1e3, "ms", limit=limit_ms, limit_name="FLOP limit", goal=goal,
                          ok=met, note=f"transformers {t_ref * 1e3:.1f} ms: {t_ref / t_ours:.2f}x")  # fmt: skip
    return True


# ---- restores --------------------------------------------------------------------------------


def restore(ctx: Ctx) -> bool:
    """The restore path's figures against their limits (``restore_figures``): the host
    tier vs pinned H2D, Redis on 1 and 4 readers vs raw GET and 3 GB/s, int8 / fp8 vs
    exact, the returning turn vs cold."""
    s = ctx.sizes
    return restore_figures(str(ctx.device), ctx.work, s.history, 5 if not ctx.quick else 2, ctx.work / "models",
                           ctx.report)  # fmt: skip


# ---- restore figures (the gpu-restore work: the staged host restore, Redis readers, device-side decode) ----------------------------------------------------------------

R_LAYERS, R_KV_HEADS, R_HEAD_DIM, R_BLOCK = 22, 4, 64, 16  # TinyLlama-1.1B's KV
TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000)


def _timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median wall seconds of ``fn`` (the device synchronized before and after)."""
    out = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _pinned_h2d_gbps(nbytes: int, device: str, reps: int) -> float:
    """One large copy from pinned host memory (the CPU: a memcpy), the limit of a host
    restore."""
    cuda = device.startswith("cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).pin_memory() if cuda else torch.randint(
        0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=cuda)
    return nbytes / _timed(lambda: dst.copy_(src, non_blocking=cuda), device, reps) / 1e9


def _raw_get_gbps(url: str, keys: list[str], threads: int, reps: int) -> float:
    """redis-py GETs, pipelined, on ``threads`` threads at once (no verification, no
    copy): the loopback limit as a client sees it."""
    import threading

    import redis

    clients = [redis.Redis.from_url(url) for _ in range(threads)]
    nbytes = sum(clients[0].strlen(k) for k in keys)

    def one(c: redis.Redis, part: list[str]) -> None:
        pipe = c.pipeline(transaction=False)
        for k in part:
            pipe.get(k)
        pipe.execute()

    def run() -> None:
        ts = [threading.Thread(target=one, args=(c, keys[i * len(keys) // threads : (i + 1) * len(keys) // threads]))
              for i, c in enumerate(clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    run()
    return nbytes / _timed(run, "cpu", reps) / 1e9


@torch.inference_mode()
def restore_figures(device: str, tmp: Path, tokens: int, reps: int, models: Path, report: Report) -> bool:
    """The restore path's figures at TinyLlama-1.1B's KV shape in bfloat16 (22 layers, 4
    kv heads of 64, blocks of 16: 360 KB), each beside its limit measured in the same run:
    pinned host -> device (one large copy) for the host tier's restore of an 8k history
    into a CUDA pool (``BlockTransfers.restore``, spans of pinned slots, one scatter a
    round; target >= 50%); the engine's 8k returning turn restored from the host tier
    against the same turn cold (a random TinyLlama-shaped checkpoint, ``models`` caches
    it; target <= 1/10); a Redis restore on 1 and 4 connections
    (``--redis-read-connections``) against redis-py GETs on as many threads and against
    3 GB/s (a private redis-server, with its default single I/O thread and with
    ``io-threads 4``); and the int8 / fp8 Redis formats, decoded on the device after the
    copy, against exact (target: faster). ``--restore-stages`` is CPU-only: the engine
    line says so. Each figure is a median of ``reps``; False when a restore loads fewer
    blocks than asked."""
    from kvserve.cachestore.host import HostTier
    from kvserve.cachestore.keys import block_hashes, make_namespace
    from kvserve.cachestore.redis import RedisTier
    from kvserve.cachestore.tiered import TieredStore
    from kvserve.service.kv.transfer import BlockTransfers
    from tests.fixtures.redis_server import start_redis_server

    dtype = torch.bfloat16
    cuda = device.startswith("cuda")
    n = tokens // R_BLOCK
    ns = make_namespace("gpu-check", "bfloat16", R_BLOCK)
    hashes = block_hashes(ns, list(range(n * R_BLOCK)), R_BLOCK)
    pool = KVPool(2 * n + 2, R_LAYERS, R_BLOCK, R_KV_HEADS, R_HEAD_DIM, dtype, device)
    ids = (torch.randperm(2 * n, generator=torch.Generator().manual_seed(0))[:n] + 1).tolist()  # scattered slots
    blocks = torch.randn(n, *pool.block_shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    nbytes = n * pool.bytes_per_block
    ok = True
    print(f"restore.shape: TinyLlama-1.1B KV, {tokens} tokens = {n} blocks of {pool.bytes_per_block} B "
          f"({nbytes / 1e6:.1f} MB), bfloat16, {device}")
    limit = _pinned_h2d_gbps(nbytes, device, reps)
    print(f"restore.limit.pinned_h2d_gbps: {limit:.2f}" + ("" if cuda else " (the CPU: memcpy)"))

    def check(got: int, what: str) -> None:
        nonlocal ok
        if got != n:
            print(f"restore.{what}: FAILED, {got} of {n} blocks loaded")
            ok = False

    def same() -> bool:
        return bool(torch.equal(pool.data[ids].cpu(), blocks))

    # the host tier: pinned slots, straight to the device by span, one scatter a round
    host = HostTier(nbytes, pool.block_shape, dtype, pin_memory=cuda)
    hstore = TieredStore([host], device=device.split(":")[0])
    for h, b in zip(hashes, blocks):
        hstore.put(ns, h, b, ("host",))
    tr = BlockTransfers.for_pool(pool, 256 << 20)
    run = lambda: check(tr.restore(hstore.reads(ns, hashes, ["host"] * n), ids, None)[0], "host")  # noqa: E731
    run()
    t = _timed(run, device, reps)
    print(f"restore.host.gbps: {nbytes / t / 1e9:.2f} ({nbytes / t / 1e9 / limit:.0%} of pinned H2D; target >= 50%), "
          f"{t * 1e3:.1f} ms, equal: {same()}")
    report.figure(f"host-tier restore {tokens}", nbytes / t / 1e9, "GB/s", limit=limit, limit_name="pinned H2D",
                  goal=">= 50% of pinned H2D", ok=nbytes / t / 1e9 >= 0.5 * limit, note=f"{t * 1e3:.1f} ms")  # fmt: skip
    held = host.hold(hstore.reads(ns, hashes, ["host"] * n)[0].refs)
    slots = [b for span in held.spans(0, held.n) for b in span.unbind(0)]
    held.release()
    t = _timed(lambda: [pool.data[i].copy_(b, non_blocking=cuda) for i, b in zip(ids, slots)], device, reps)
    print(f"restore.host.per_block_copies_gbps: {nbytes / t / 1e9:.2f} ({nbytes / t / 1e9 / limit:.0%} of pinned "
          f"H2D: a copy per block out of the same slots, for comparison)")
    del slots, held
    hstore.close()

    # Redis: 1 and 4 connections, each format, into the device (lossy: decoded there)
    for io_threads in (1, 4):
        server = start_redis_server(tmp / f"redis-io{io_threads}", io_threads=io_threads)
        try:
            times: dict[str, float] = {}
            keys: list[str] = []
            for fmt, sdt in (("exact", None), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
                for k in ((1, 4) if fmt == "exact" else (4,)):
                    tier = RedisTier(server.url, block_shape=pool.block_shape, dtype=dtype, storage_dtype=sdt,
                                     read_connections=k, key_prefix=f"{fmt}:")
                    store = TieredStore([tier], device=device.split(":")[0])
                    if k == (1 if fmt == "exact" else 4):
                        assert store.put_many(ns, hashes, list(blocks), ("redis",)) == [True] * n
                    if fmt == "exact":
                        keys = [tier.key(r) for r in store.reads(ns, hashes, ["redis"] * n)[0].refs]
                    run = lambda: check(tr.restore(store.reads(ns, hashes, ["redis"] * n), ids, None)[0],  # noqa: E731
                                        f"redis.{fmt}")
                    run()
                    times[f"{fmt}{k}"] = t = _timed(run, device, reps)
                    wire = n * tier.value_nbytes
                    print(f"restore.redis.io{io_threads}.{fmt}.readers{k}: {t * 1e3:.1f} ms, {wire / t / 1e9:.2f} GB/s "
                          f"on the wire, {nbytes / t / 1e9:.2f} GB/s of KV ({nbytes / t / 1e9 / 3:.0%} of the 3 GB/s goal)"
                          + (f", equal: {same()}" if fmt == "exact" else ""))
                    store.close()
            raw = {}
            for k in (1, 4):
                raw[k] = _raw_get_gbps(server.url, keys, k, reps)
                print(f"restore.redis.io{io_threads}.raw_get_threads{k}_gbps: {raw[k]:.2f}")
            print(f"restore.redis.io{io_threads}.readers4_vs_1: {times['exact1'] / times['exact4']:.2f}x")
            gbps = nbytes / times["exact4"] / 1e9
            report.figure(f"Redis restore {tokens}, 4 readers, io-threads {io_threads}", gbps, "GB/s", limit=raw[4],
                          limit_name="raw GET on 4 threads", goal=">= 3 GB/s", ok=gbps >= 3,
                          note=f"1 reader {nbytes / times['exact1'] / 1e9:.2f} GB/s")  # fmt: skip
            for fmt in ("int8", "fp8"):
                print(f"restore.redis.io{io_threads}.{fmt}_vs_exact: {times['exact4'] / times[f'{fmt}4']:.2f}x "
                      f"(> 1: faster than exact; target)")
                report.figure(f"{fmt} Redis restore {tokens}, io-threads {io_threads}", times[f"{fmt}4"] * 1e3, "ms",
                              limit=times["exact4"] * 1e3, limit_name="exact's restore", goal="faster than exact",
                              ok=times[f"{fmt}4"] < times["exact4"])  # fmt: skip
        finally:
            server.stop()
    del pool

    # the engine: an 8k returning turn restored from the host tier against cold
    from bench.bench_restore import checkpoint

    path = checkpoint("tinyllama", tokens + 32, models) if cuda else make_tiny_llama(tmp / "tiny-restore",
                                                                                     max_position_embeddings=tokens + 32)
    loaded = load_model(str(path), dtype=dtype if cuda else torch.float32, device=device)
    g = torch.Generator().manual_seed(2)
    vocab = loaded.config.vocab_size
    hist = torch.randint(3, vocab, (tokens,), generator=g).tolist()
    turns = [hist + torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(reps + 1)]
    cfg = EngineConfig(block_size=R_BLOCK, kv_cache_memory=(tokens + 64) * 2 * _bpt(loaded),
                       max_num_batched_tokens=tokens + 64, max_model_len=tokens + 32, restore_policy="always",
                       host_cache_memory=(tokens + 64) * _bpt(loaded))
    hstore = build_store(cfg, loaded)
    a = LLMEngine(loaded, cfg, store=hstore)
    _run(a, torch.randint(3, vocab, (tokens + 16,), generator=g).tolist(), "shapes", n=1)  # this length's first
    cold = [_run(a, torch.randint(3, vocab, (tokens + 16,), generator=g).tolist(), f"cold{r}", n=1).timings.ttft_s
            for r in range(reps)]
    _run(a, turns[0], "history", n=1)
    _spill(a, hist, "host")
    a.close()
    host_ttft, restore_s, cached = [], [], []
    for r in range(reps):
        b = LLMEngine(loaded, cfg, store=build_store_over(hstore))
        fin = _run(b, turns[1 + r], f"host{r}", n=1)
        host_ttft.append(fin.timings.ttft_s)
        restore_s.append(fin.timings.restore_s)
        cached.append(fin.cached_tokens)
        b.close()
    c, h = statistics.median(cold), statistics.median(host_ttft)
    print(f"restore.engine.cold_ms: {c * 1e3:.1f} ({tokens + 16} tokens)")
    print(f"restore.engine.host_ms: {h * 1e3:.1f} (restored {min(cached)} tokens; restore "
          f"{statistics.median(restore_s) * 1e3:.1f} ms)")
    print(f"restore.engine.host_vs_cold: 1/{c / h:.1f} (target <= 1/10)")
    report.figure(f"returning turn {tokens} from the host tier", h * 1e3, "ms", limit=c * 1e3, limit_name="cold",
                  goal="<= 1/10 of cold", ok=h <= c / 10, note=f"restored {min(cached)} tokens")  # fmt: skip
    print("restore.engine.restore_stages: " + ("not built on CUDA (the overlap is the CPU pools'): off = on"
                                              if cuda else "see bench_restore.py's overlap table"))
    if min(cached) < (tokens // R_BLOCK) * R_BLOCK - R_BLOCK:
        print(f"restore.engine: FAILED, only {min(cached)} tokens restored")
        ok = False
    hstore.close()
    return ok


def build_store_over(store):
    """A new store over the same host tier (a new device pool, the host memory kept)."""
    from kvserve.cachestore.tiered import TieredStore

    return TieredStore([store.tier("host")], device=store.device)


# ---- speculative -----------------------------------------------------------------------------


@torch.inference_mode()
def speculative(ctx: Ctx) -> bool:
    """The chat-editing workloads (bench_chat_edit's prompts, the default model) with and
    without drafts, through the engine on the device."""
    from bench.bench_chat_edit import build_workloads
    from bench.bench_speculative import engine_for, generate

    s = ctx.sizes
    work = build_workloads(str(DEFAULT_MODEL_DIR), s.spec_tokens)[0]  # one variant: the same prompts on both engines
    loaded = load_model(str(DEFAULT_MODEL_DIR), dtype="float32", device=ctx.device, progress=False)
    engines = {mode: engine_for(loaded, mode, 16) for mode in ("off", "ngram")}
    rates: dict[str, list[float]] = {}
    same = True
    for name, prompt in work.items():
        got = {}
        for r in range(s.repeats + 1):  # the first untimed
            for mode, eng in engines.items():
                fin, dt = generate(eng, prompt, s.spec_tokens, f"{name}{mode}{r}", time.perf_counter)
                got[mode] = fin.output_token_ids
                if r:
                    rates.setdefault(f"{name}.{mode}", []).append((len(fin.output_token_ids) - 1) / dt)
        same &= got["off"] == got["ngram"]
        plain, spec = (statistics.median(rates[f"{name}.{m}"]) for m in ("off", "ngram"))
        ctx.report.figure(f"speculative {name}", spec / plain, "x plain", goal=">= 1.5x, greedy identical",
                          ok=spec / plain >= 1.5 and got["off"] == got["ngram"],
                          note=f"{spec:.0f} vs {plain:.0f} tok/s, greedy {'identical' if got['off'] == got['ngram'] else 'DIFFERS'}")  # fmt: skip
    r = engines["ngram"].runner
    print(f"speculative: {r.num_verify_steps} verify steps, {r.num_accepted_tokens}/{r.num_draft_tokens} drafts accepted, "
          f"decode step: {r.step.name}")
    for eng in engines.values():
        eng.close()
    return same


# ---- summary ---------------------------------------------------------------------------------


def summary(ctx: Ctx) -> bool:
    path = ctx.out / "figures.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    lim = json.loads((ctx.out / "limits.json").read_text()) if (ctx.out / "limits.json").exists() else {}
    print()
    if lim:
        print(f"{lim['device']}: memory copy {lim['d2d_gbps']:.1f} GB/s (read + written), host-to-device "
              f"{lim['h2d_gbps']:.1f} GB/s, {lim['matmul_dtype']} matmul {lim['matmul_tflops']:.3g} TFLOP/s")
    print()
    print("| figure | value | limit | of limit | goal | met |")
    print("|---|---:|---:|---:|---|---|")
    for r in rows:
        limit = f"{_num(r['limit'])} {r['unit']} ({r['limit_name']})" if r.get("limit") else "-"
        frac = f"{100 * r['fraction']:.0f}%" if r.get("fraction") is not None else "-"
        met = "-" if r.get("ok") is None else ("yes" if r["ok"] else "NO")
        note = f" ({r['note']})" if r.get("note") else ""
        print(f"| {r['figure']} | {_num(r['value'])} {r['unit']}{note} | {limit} | {frac} | {r.get('goal') or '-'} | {met} |")
    return True


STEPS: dict[str, Callable[[Ctx], bool]] = {
    "limits": limits, "parity": parity, "graphs": graphs, "sessions": sessions, "decode": decode,
    "prefill": prefill, "restore": restore, "speculative": speculative, "summary": summary,
}  # fmt: skip


@dataclass
class Ctx:
    device: torch.device
    sizes: Sizes
    quick: bool
    out: Path
    work: Path
    report: Report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steps", nargs="+", help=f"steps to run, in order (all: every one): {', '.join(STEPS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CPU dry run)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"), help="where limits.json and figures.jsonl go")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "kvserve-gpu-check"),
                    help="checkpoints and scratch, shared by the steps' processes")
    args = ap.parse_args(argv)
    steps = list(STEPS) if args.steps == ["all"] else args.steps
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"unknown steps {unknown}; choose from {', '.join(STEPS)}")
    device = torch.device(args.device)
    out, work = Path(args.out), Path(args.work) / ("quick" if args.quick else "full")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(device, QUICK if args.quick or device.type == "cpu" else GPU, args.quick or device.type == "cpu", out, work,
              Report(out))  # fmt: skip
    failed = []
    for name in steps:
        if not STEPS[name](ctx):
            failed.append(name)
            print(f"{name}: FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
