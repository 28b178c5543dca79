"""What ``--kv-cache-format`` costs and buys: quality against the exact cache, and decode speed.

For each model (the packaged default model; random weights at the ~110M shape) and each
KV cache format (exact, bf16, fp16, int8, fp8):

- held-out loss: mean next-token cross-entropy over windows of ``--window`` tokens, each
  one paged prefill through a pool in the format (every attention reads the rounded K/V,
  as in serving). Text: the default model's held-out English (``--text``, default
  /usr/share/common-licenses/GPL-3, prose the model never saw) tokenized by its
  tokenizer; random ~110M: a seeded random token stream (loss ~ ln(vocab): the delta is
  what matters);
- decoded loss: the same windows, the first half of each one prefill and the second half
  teacher-forced decode steps (all windows one batch), scored on the second half: the
  serving path's KV writes (int8, fp8: each row quantized at its own scale as its token
  arrives) read by the decode attention (the native one where it
  loaded; fp8: torch's block-wise one, the native kernels decline it);
- greedy agreement: ``--prompts`` prompts of ``--prompt-len`` tokens (from the text /
  random), ``--greedy-tokens`` greedy tokens each through the paged decode path (the
  native decode layer where it loaded); the share of prompts whose continuation equals
  exact's, and the mean share of tokens before the first difference;
- bytes per token of the format, and decode tok/s of ``--batch`` sequences at a context
  of ``--context`` tokens: the formats' decode steps interleaved over ``--rounds`` rounds
  of ``--steps`` steps, the median step.

    python bench/bench_kv_format.py                          # both models
    python bench/bench_kv_format.py --models default --prompts 100
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server does, before torch loads: torch's idle threads sleep instead of spinning
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_engine import SHAPES  # noqa: E402
from kvserve.service.engine.config import DEFAULT_MODEL_DIR  # noqa: E402
from kvserve.service.kv.cache import KV_CACHE_FORMATS, BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402

BLOCK = 16


def new_pool(lm, fmt: str, blocks: int) -> KVPool:
    return KVPool.from_spec(lm.kv_spec(BLOCK, fmt), blocks * lm.kv_spec(BLOCK, fmt).bytes_per_block, lm.device)


@torch.inference_mode()
def held_out_loss(lm, fmt: str, stream: torch.Tensor, bos: int, window: int) -> float:
    pool = new_pool(lm, fmt, 1 + math.ceil(window / BLOCK))
    table = list(range(1, pool.num_blocks))
    total = 0.0
    for i in range(0, len(stream), window):
        y = stream[i : i + window]
        x = [bos] + y[:-1].tolist()
        logits = lm.model(BatchLayout.build([SeqSlice(table, 0, x)], BLOCK), pool, all_logits=True)[0]
        total += float(F.cross_entropy(logits.float(), y, reduction="sum"))
    return total / len(stream)


@torch.inference_mode()
def decoded_loss(lm, fmt: str, stream: torch.Tensor, bos: int, window: int) -> float:
    """Mean NLL of the second half of each whole ``window`` of ``stream``: the first half
    one prefill, the rest teacher-forced decode steps, every window one sequence of a batch."""
    wins = [stream[i : i + window] for i in range(0, len(stream) - window + 1, window)]
    per = math.ceil(window / BLOCK)
    pool = new_pool(lm, fmt, 1 + len(wins) * per)
    tables = [list(range(1 + b * per, 1 + (b + 1) * per)) for b in range(len(wins))]
    xs = [[bos] + w[:-1].tolist() for w in wins]
    ys = torch.stack(wins)  # (n, window)
    half = window // 2
    logits = lm.model(BatchLayout.build([SeqSlice(t, 0, x[:half]) for t, x in zip(tables, xs)], BLOCK), pool)
    total = 0.0
    for p in range(half, window):
        if p > half:
            logits = lm.model(BatchLayout.build([SeqSlice(t, p - 1, [x[p - 1]]) for t, x in zip(tables, xs)], BLOCK),
                              pool)  # fmt: skip
        total += float(F.cross_entropy(logits.float(), ys[:, p - 1], reduction="sum"))
    return total / (len(wins) * (window - half))


@torch.inference_mode()
def greedy(lm, fmt: str, prompts: list[list[int]], n: int, batch: int) -> list[list[int]]:
    per_seq = math.ceil((len(prompts[0]) + n) / BLOCK)
    pool = new_pool(lm, fmt, 1 + batch * per_seq)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        logits = lm.model(BatchLayout.build([SeqSlice(t, 0, p) for t, p in zip(tables, group)], BLOCK), pool)
        got: list[list[int]] = [[] for _ in group]
        for step in range(n):
            nxt = logits.argmax(-1).tolist()
            for g, t in zip(got, nxt):
                g.append(t)
            if step < n - 1:
                seqs = [SeqSlice(t, len(p) + step, [tok]) for t, p, tok in zip(tables, group, nxt)]
                logits = lm.model(BatchLayout.build(seqs, BLOCK), pool)
        outs += got
    return outs


@torch.inference_mode()
def decode_pools(lm, fmt: str, context: int, batch: int, steps: int):
    """A pool in ``fmt`` holding ``batch`` sequences of ``context`` cached tokens, and their tables."""
    per_seq = math.ceil((context + steps + 4) / BLOCK)
    pool = new_pool(lm, fmt, 1 + batch * per_seq)
    tables = [list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)) for b in range(batch)]
    g = torch.Generator().manual_seed(3)
    for t in tables:  # the context, in prefill chunks of 256
        ids = torch.randint(3, lm.config.vocab_size, (context,), generator=g).tolist()
        for s in range(0, context, 256):
            lm.model(BatchLayout.build([SeqSlice(t, s, ids[s : s + 256])], BLOCK), pool)
    return pool, tables


@torch.inference_mode()
def decode_times(lm, pool, tables, context: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps (after 2 warm-up steps) at ``context``."""
    times = []
    for step in range(steps + 2):
        layout = BatchLayout.build([SeqSlice(t, context + step, [5]) for t in tables], BLOCK)
        t0 = time.perf_counter()
        lm.model(layout, pool)
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return times


def decode_speeds(lm, formats: list[str], context: int, batch: int, steps: int, rounds: int) -> dict[str, float]:
    """tok/s per format: the formats' steps interleaved over ``rounds`` rounds (a shared
    machine's load hits every format alike), the median step of all rounds."""
    pools = {fmt: decode_pools(lm, fmt, context, batch, steps) for fmt in formats}
    times: dict[str, list[float]] = {fmt: [] for fmt in formats}
    for _ in range(rounds):
        for fmt in formats:
            times[fmt] += decode_times(lm, *pools[fmt], context, steps)
    return {fmt: batch / statistics.median(t) for fmt, t in times.items()}


def default_model_data(text: Path, n_prompts: int, prompt_len: int) -> tuple[torch.Tensor, list[list[int]], int]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(DEFAULT_MODEL_DIR / "tokenizer.model"))
    paragraphs = [" ".join(p.split()) for p in text.read_text().split("\n\n") if len(p.split()) > 8]
    stream = torch.tensor([t for p in paragraphs for t in sp.encode(p)])
    step = max(1, (len(stream) - prompt_len) // n_prompts)
    prompts = [[sp.bos_id()] + stream[s : s + prompt_len - 1].tolist() for s in range(0, step * n_prompts, step)]
    return stream, prompts[:n_prompts], sp.bos_id()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,110m")
    ap.add_argument("--formats", default=",".join(KV_CACHE_FORMATS))
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--loss-tokens", type=int, default=0, help="cap on held-out tokens scored (0: all)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batch", default="1,8", help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds per format")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-kvformat-") as tmp:
        for name in args.models.split(","):
            if name == "default":
                path = DEFAULT_MODEL_DIR
                stream, prompts, bos = default_model_data(args.text, args.prompts, args.prompt_len)
                context = min(args.context, 512 - args.steps - 8)  # its context length is 512
            else:
                from tests.fixtures.models import make_tiny_llama

                path = make_tiny_llama(Path(tmp) / name, max_position_embeddings=4096, **SHAPES[name])
                g = torch.Generator().manual_seed(1)
                stream = torch.randint(3, SHAPES[name]["vocab_size"], (8192,), generator=g)
                prompts = torch.randint(3, SHAPES[name]["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
                bos, context = 1, args.context
            if args.loss_tokens:
                stream = stream[: args.loss_tokens]
            lm = load_model(path, progress=False)
            ref_loss = ref_greedy = None
            for fmt in formats:
                t0 = time.perf_counter()
                loss = held_out_loss(lm, fmt, stream, bos, args.window)
                dloss = decoded_loss(lm, fmt, stream, bos, args.window)
                got = greedy(lm, fmt, prompts, args.greedy_tokens, batch=20)
                if fmt == "exact":
                    ref_loss, ref_dloss, ref_greedy = loss, dloss, got
                same = sum(a == b for a, b in zip(got, ref_greedy)) / len(prompts)
                prefix = statistics.mean(
                    next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a)
                    for a, b in zip(got, ref_greedy))  # fmt: skip
                bpt = lm.kv_spec(BLOCK, fmt).bytes_per_token
                rows.append([name, fmt, bpt, ref_loss, loss, ref_dloss, dloss, same, prefix, context, []])
                print(f"[{name}] {fmt}: {bpt} B/token, loss {loss:.4f} ({(loss / ref_loss - 1) * 100:+.4f}%), "
                      f"decoded {dloss:.4f} ({(dloss / ref_dloss - 1) * 100:+.4f}%), "
                      f"identical greedy {same:.0%}, prefix {prefix:.0%} ({time.perf_counter() - t0:.0f}s; "
                      f"native {lm.native})", file=sys.stderr)
            for b in batches:
                speeds = decode_speeds(lm, formats, context, b, args.steps, args.rounds)
                for row in rows[-len(formats):]:
                    row[-1].append(speeds[row[1]])
                print(f"[{name}] decode at {context}, B={b}: "
                      + ", ".join(f"{f} {s:.1f} tok/s" for f, s in speeds.items()), file=sys.stderr)
    print(f"\n{args.prompts} prompts of {args.prompt_len} tokens, {args.greedy_tokens} greedy tokens each; "
          f"loss over {args.window}-token windows; torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| model | KV format | bytes/token | held-out loss (exact) | held-out loss | delta | decoded loss (exact) "
          "| decoded loss | delta | identical greedy continuations | greedy tokens before first difference | context | "
          + " | ".join(f"decode tok/s B={b}" for b in batches) + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(batches))
    for name, fmt, bpt, ref, loss, dref, dloss, same, prefix, context, speeds in rows:
        print(f"| {name} | {fmt} | {bpt} | {ref:.5f} | {loss:.5f} | {(loss / ref - 1) * 100:+.4f}% | {dref:.5f} | "
              f"{dloss:.5f} | {(dloss / dref - 1) * 100:+.4f}% | {same:.0%} | {prefix:.0%} | {context} | "
              + " | ".join(f"{s:.1f}" for s in speeds) + " |")


if __name__ == "__main__":
    main()
