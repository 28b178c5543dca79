"""kvserve's model + paged KV cache vs transformers, same random weights, same process.

For each shape a random LlamaForCausalLM is written with transformers' save_pretrained,
loaded by kvserve's loader, and both run greedy decoding in float32:

- prefill: one forward over a prompt of 128 / 512 / 2048 tokens, logits of the last
  token only (transformers: ``logits_to_keep=1``, with its DynamicCache);
- single-stream decode: tokens/s over N greedy steps after a 128-token prompt
  (transformers: a forward loop with its DynamicCache, which is what ``generate`` runs
  minus its logits processors);
- batched decode: aggregate tokens/s of B sequences decoding together (B = 1/4/8/16,
  each after its own 128-token prompt).

Ours drives ``model(layout, kv)`` with ``KVPool`` + ``BatchLayout`` directly (trivial
block tables), the layout build included in every step's time.

    python bench/bench_engine.py --quick            # tiny shape, seconds
    python bench/bench_engine.py                     # tiny, ~110M, TinyLlama-1.1B (10+ min on 2 cores)
    python bench/bench_engine.py --device cuda --shapes 110m,1.1b
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from service.models.loading import load_model  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=400),
    "110m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000),
}
BLOCK_SIZE = 16


@dataclass
class Row:
    shape: str
    metric: str
    unit: str
    ours: float
    ref: float
    higher_is_better: bool

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

    def __init__(self, loaded, max_tokens: int) -> None:
        self.model, self.device = loaded.model, loaded.device
        cfg = loaded.config
        self.blocks_per_seq = math.ceil(max_tokens / BLOCK_SIZE)
        self.cfg, self.dtype = cfg, loaded.dtype
        self.pool: KVPool | None = None

    def _pool(self, batch: int) -> KVPool:
        need = 1 + batch * self.blocks_per_seq
        if self.pool is None or self.pool.num_blocks < need:
            self.pool = None
            self.pool = KVPool(need, self.cfg.num_layers, BLOCK_SIZE, self.cfg.num_kv_heads, self.cfg.head_dim,
                               self.dtype, self.device)
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
        pool, tables = self._pool(len(prompts)), self.tables(len(prompts))
        nxt = first.argmax(-1).tolist()
        out = [[t] for t in nxt]
        for step in range(steps):
            seqs = [SeqSlice(tb, len(p) + step, [t]) for tb, p, t in zip(tables, prompts, nxt)]
            nxt = self.model(BatchLayout.build(seqs, BLOCK_SIZE, self.device, self.dtype), pool).argmax(-1).tolist()
            for o, t in zip(out, nxt):
                o.append(t)
        return out


class Reference:
    """transformers: forward with logits_to_keep=1 and its DynamicCache."""

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]):
        ids = torch.tensor(prompts, device=self.device)
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1], out.cache

    @torch.inference_mode()
    def decode(self, first, steps: int) -> list[list[int]]:
        logits, past = first
        nxt = logits.argmax(-1)
        out = [nxt]
        for _ in range(steps):
            o = self.model(nxt[:, None], cache=past, use_cache=True, logits_to_keep=1)
            past = o.cache
            nxt = o.logits[:, -1].argmax(-1)
            out.append(nxt)
        return torch.stack(out, 1).tolist()


def bench_shape(name: str, args, device: torch.device, workdir: Path) -> list[Row]:
    from transformers import AutoModelForCausalLM

    shape = dict(SHAPES[name])
    prompt_lens = [n for n in args.prompt_lens]
    max_pos = max(max(prompt_lens), args.decode_prompt + args.decode_tokens + 1)
    t0 = time.perf_counter()
    path = make_tiny_llama(workdir / name, max_position_embeddings=max(max_pos, 512),
                           **shape)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    loaded = load_model(path, dtype="float32", device=device, progress=False)
    print(f"[{name}] built, saved and loaded in {time.perf_counter() - t0:.1f}s "
          f"({sum(p.numel() for p in loaded.model.parameters()) / 1e6:.0f}M params)", file=sys.stderr)
    vocab = loaded.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts(batch: int, n: int) -> list[list[int]]:
        return torch.randint(3, vocab, (batch, n), generator=g).tolist()

    ours = Ours(loaded, max(max(prompt_lens), args.decode_prompt + args.decode_tokens + 1))
    ref = Reference(ref_model, device)
    repeats = args.repeats if args.repeats else (1 if name == "1.1b" else 5)
    now = CLOCKS[args.clock]
    rows: list[Row] = []

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
    print(f"\ndevice {device}, float32, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"clock {args.clock}, "
          f"block size {BLOCK_SIZE}, decode: {args.decode_tokens} steps after a {args.decode_prompt}-token prompt\n")
    print("| shape | metric | kvserve | transformers | ratio (>1: kvserve better) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.shape} | {r.metric} | {r.ours:.1f} {r.unit} | {r.ref:.1f} {r.unit} | {r.ratio:.2f}x |")
    for shape in dict.fromkeys(r.shape for r in rows):
        single = next((r.ours for r in rows if r.shape == shape and r.metric == "decode single-stream"), None)
        b8 = next((r.ours for r in rows if r.shape == shape and r.metric == "decode batch 8"), None)
        if single and b8:
            print(f"\n{shape}: batch-8 aggregate decode = {b8 / single:.2f}x single-stream (kvserve)", end="")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shape, short prompts: a smoke run")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    ap.add_argument("--shapes", default="tiny,110m,1.1b")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        for name in args.shapes.split(","):
            rows += bench_shape(name, args, device, Path(tmp))
    print_table(rows, args, device)


if __name__ == "__main__":
    main()
