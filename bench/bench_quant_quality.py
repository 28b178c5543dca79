"""Quality of the served weight formats against exact float32 weights.

For each model (the packaged default model; random weights at the ~110M shape) and each
weight format:

- held-out loss: mean next-token cross-entropy over 512-token windows. Default model:
  the held-out 5% of the book it was trained on (tools/train_default_model.py's split;
  the corpus is fetched once into .corpus/ as that script does). Random ~110M: a seeded
  random token stream (its loss is ~ln(vocab); the delta is what matters);
- KL(exact || format) of the next-token distributions, averaged over those positions;
- greedy agreement: N prompts (held-out paragraph openings / random tokens), G greedy
  tokens each through the paged KV path; the share of prompts whose continuation is
  identical to exact's, and the mean share of tokens before the first difference.

    python bench/bench_quant_quality.py                      # both models, 100 prompts
    python bench/bench_quant_quality.py --models default --prompts 20
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_engine import SHAPES  # noqa: E402
from kvserve.service.engine.config import DEFAULT_MODEL_DIR  # noqa: E402
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.models.quant import WEIGHT_FORMATS  # noqa: E402

BLOCK = 16


def default_model_data(n_prompts: int, prompt_len: int) -> tuple[torch.Tensor, list[list[int]], int]:
    """(held-out token stream, prompts, bos) for the packaged default model."""
    sys.path.insert(0, str(ROOT / "tools"))
    import train_default_model as tdm
    import sentencepiece as spm

    raw = tdm.fetch_botchan(ROOT / ".corpus")
    paragraphs = tdm.paragraphs_from_gutenberg(raw, random.Random(tdm.TrainArgs.seed))
    n_val = max(1, round(len(paragraphs) * tdm.TrainArgs.val_fraction))
    sp = spm.SentencePieceProcessor(model_file=str(DEFAULT_MODEL_DIR / "tokenizer.model"))
    stream, starts = tdm.encode_paragraphs(sp, paragraphs[-n_val:])
    prompts = [[sp.bos_id()] + stream[s : s + prompt_len - 1].tolist() for s in starts]
    prompts = [p for p in prompts if len(p) == prompt_len]
    while len(prompts) < n_prompts:  # more prompts from later offsets in the stream
        s = random.Random(len(prompts)).randrange(len(stream) - prompt_len)
        prompts.append([sp.bos_id()] + stream[s : s + prompt_len - 1].tolist())
    return stream, prompts[:n_prompts], sp.bos_id()


@torch.inference_mode()
def window_logprobs(model, stream: torch.Tensor, bos: int, seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(0, len(stream), seq_len):
        y = stream[i : i + seq_len]  # (T,)
        x = torch.cat((torch.tensor([bos]), y[:-1]))[None]  # (1, T)
        out.append((model.forward_nocache(x)[0].log_softmax(-1), y))  # (T, V)
    return out


@torch.inference_mode()
def greedy(lm, prompts: list[list[int]], n: int, batch: int) -> list[list[int]]:
    c = lm.config
    per_seq = math.ceil((len(prompts[0]) + n) / BLOCK)
    pool = KVPool(1 + batch * per_seq, c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, lm.dtype, lm.device)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,110m")
    ap.add_argument("--formats", default=",".join(f for f in WEIGHT_FORMATS if f != "exact"))
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--loss-tokens", type=int, default=0, help="cap on held-out tokens scored (0: all)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvserve-quality-") as tmp:
        for name in args.models.split(","):
            t0 = time.perf_counter()
            if name == "default":
                path = DEFAULT_MODEL_DIR
                stream, prompts, bos = default_model_data(args.prompts, args.prompt_len)
            else:
                from tests.fixtures.models import make_tiny_llama

                path = make_tiny_llama(Path(tmp) / name, max_position_embeddings=1024, **SHAPES[name])
                vocab = SHAPES[name]["vocab_size"]
                g = torch.Generator().manual_seed(1)
                stream = torch.randint(3, vocab, (8192,), generator=g)
                prompts = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=g).tolist()
                bos = 1
            if args.loss_tokens:
                stream = stream[: args.loss_tokens]
            exact = load_model(path, progress=False)
            ref_lp = window_logprobs(exact.model, stream, bos, 512)
            ref_loss = sum(float(F.nll_loss(lp, y, reduction="sum")) for lp, y in ref_lp) / len(stream)
            ref_greedy = greedy(exact, prompts, args.greedy_tokens, batch=20)
            print(f"[{name}] exact: held-out loss {ref_loss:.4f} over {len(stream)} tokens "
                  f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
            for fmt in formats:
                lm = load_model(path, progress=False, weight_format=fmt)
                lp = window_logprobs(lm.model, stream, bos, 512)
                loss = sum(float(F.nll_loss(a, y, reduction="sum")) for a, y in lp) / len(stream)
                kl = sum(float(F.kl_div(a, r, log_target=True, reduction="sum")) for (a, _), (r, _) in zip(lp, ref_lp))
                kl /= len(stream)
                got = greedy(lm, prompts, args.greedy_tokens, batch=20)
                same = sum(a == b for a, b in zip(got, ref_greedy)) / len(prompts)
                prefix = []
                for a, b in zip(got, ref_greedy):
                    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    prefix.append(k / len(a))
                rows.append((name, fmt, ref_loss, loss, kl, same, sum(prefix) / len(prefix)))
                print(f"[{name}] {fmt}: loss {loss:.4f} ({(loss / ref_loss - 1) * 100:+.2f}%), KL {kl:.5f}, "
                      f"identical greedy {same:.0%}, tokens before first difference {sum(prefix) / len(prefix):.0%}",
                      file=sys.stderr)
    print(f"\n{args.prompts} prompts of {args.prompt_len} tokens, {args.greedy_tokens} greedy tokens each; "
          f"torch {torch.__version__}\n")
    print("| model | weights | held-out loss (exact) | held-out loss | delta | KL(exact‖format) per token "
          "| identical greedy continuations | greedy tokens before first difference |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, fmt, ref, loss, kl, same, prefix in rows:
        print(f"| {name} | {fmt} | {ref:.4f} | {loss:.4f} | {(loss / ref - 1) * 100:+.2f}% | {kl:.5f} | "
              f"{same:.0%} | {prefix:.0%} |")


if __name__ == "__main__":
    main()
