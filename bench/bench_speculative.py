"""Speculative decoding drafted from the conversation (``--speculative ngram``) against plain
decoding (``off``): the same engine, weights and requests, in one process, greedy.

Workloads, built so that what the reply repeats is really in its context (the default
model, trained on one novel, follows no instructions, so "rewrite your last answer" is
played as the model being given its own earlier text again and going on from its start):

- ``restate``: the model's own greedy paragraph (from "The principal"), a blank line, then
  the paragraph's first 8 tokens: the reply goes on as the paragraph went (the previous
  answer restated, a quoted document continued);
- ``edit``: the same paragraph with a few words changed, then its start again: the reply
  repeats the text near the edits and leaves it where the model prefers its own words;
- ``chat``: a chat-template conversation (the default model's template) whose earlier
  assistant turn is the paragraph and whose new user turn quotes its first words;
- ``fresh``: "The" alone: nothing to draft from but the reply's own repetitions;
- ``json``: a grammar row: the paragraph as a JSON object ``{"quote": ...}``, a blank line,
  and the reply under a JSON-schema response_format of that shape (drafts are cut where
  the grammar refuses a token; each verify row gets the grammar's mask at its position).

On the ~110M random-weight shape (``--shapes 110m``) the random prompt is said twice and
then its start again, and the reply is the random model's (a random model's greedy output
rarely repeats its context, but falls into loops of its own), so acceptance there is what
that model gives, reported as measured.

Figures per workload: decode tok/s (output tokens after the first over the time from the
first token to the last, the median of ``--repeats`` runs after an untimed one, on the
process's CPU clock with one torch thread by default: fair on a machine shared with other
work), their ratio, the acceptance rate (drafts accepted / drafted), output tokens per
forward, and whether the speculative tokens equal plain decoding's.

    python bench/bench_speculative.py                       # default model, ~2 minutes
    python bench/bench_speculative.py --shapes default,110m --tokens 96
    python bench/bench_speculative.py --device cuda --dtype bfloat16 --clock wall --shapes default,1.1b

On a GPU (``--device cuda``, wall clock) a decode step of these models is bound by its
kernels' launches, not by the rows they compute, so a verify step of several rows costs
about one plain step; each row also prints the engine's measured step line (``step_ms``:
a decode step's fixed milliseconds, ``row_ms``: each row's), which the drafts' length is
sized from.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server does, before torch loads: torch's idle threads sleep instead of spinning
import torch  # noqa: E402

from kvserve.service.engine.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.types import Delta, Finished, GenerationRequest, ResponseFormat, SamplingParams  # noqa: E402
from bench.bench_engine import SHAPES  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

RANDOM_SHAPES = ("110m", "1.1b")  # bench_engine.SHAPES' dims, random weights, the 400-piece test tokenizer
QUOTE_SCHEMA = {"type": "object", "properties": {"quote": {"type": "string", "minLength": 160, "maxLength": 600}},
                "required": ["quote"], "additionalProperties": False}  # the json workload's response_format
EDITS = {" was ": " had been ", " the ": " that ", " not ": " never "}  # word swaps of the "edit" workload


def engine_for(loaded, spec: str, max_draft: int) -> LLMEngine:
    per_token = loaded.kv_spec(16).bytes_per_token
    cfg = EngineConfig(model_path="unused", device=str(loaded.device), dtype=str(loaded.dtype).removeprefix("torch."),
                       block_size=16,
                       kv_cache_memory=1024 * 16 * per_token, speculative=spec, spec_max_draft=max_draft)
    return LLMEngine(loaded, cfg)


def generate(engine: LLMEngine, prompt: list[int], tokens: int, rid: str, now,
             fmt: ResponseFormat | None = None) -> tuple[Finished, float]:  # fmt: skip
    """One greedy request alone: its Finished and its decode seconds on ``now``'s clock."""
    sp = SamplingParams(max_new_tokens=tokens, ignore_eos=True, response_format=fmt)
    engine.add_request(GenerationRequest(rid, list(prompt), sp))
    t_first = t_last = None
    while True:
        for _, ev in engine.step():
            if isinstance(ev, Delta) and t_first is None:
                t_first = now()
            elif isinstance(ev, Finished):
                t_last = now()
                return ev, t_last - (t_first if t_first is not None else t_last)


def workloads(name: str, loaded, tokens: int) -> dict[str, list[int] | tuple[list[int], ResponseFormat]]:
    tok = loaded.tokenizer
    if name in RANDOM_SHAPES:
        g = torch.Generator().manual_seed(0)
        r = torch.randint(3, loaded.tokenizer.vocab_size, (64,), generator=g).tolist()
        return {"repeat-random": r + r + r[:8]}
    plain = engine_for(loaded, "off", 1)
    para, _ = generate(plain, tok.encode("The principal"), max(tokens, 96), "para", time.perf_counter)
    text = tok.decode(tok.encode("The principal") + para.output_token_ids)
    edited = text
    for a, b in EDITS.items():
        edited = edited.replace(a, b, 1)
    ids = tok.encode(text)  # bos first
    start = ids[1:9]
    out = {
        "restate": ids + tok.encode_plain("\n\n") + start,
        "edit": tok.encode(edited) + tok.encode_plain("\n\n") + start,
    }
    if tok.chat_template:
        msgs = [
            {"role": "user", "content": "Tell me about the principal."},
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Say that again, from {tok.decode(start)!r}."},
        ]
        out["chat"] = tok.encode_chat(msgs) + start
    out["fresh"] = tok.encode("The")
    quoted = json.dumps({"quote": text}, separators=(",", ":"))
    out["json"] = (tok.encode(quoted) + tok.encode_plain("\n\n"), ResponseFormat("json_schema", json.dumps(QUOTE_SCHEMA)))
    plain.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="default", help="default (the packaged model), 110m, 1.1b (random weights)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 (on a GPU)")
    ap.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-draft", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--json", action="store_true", help="one JSON line per row instead of the table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    now = time.process_time if args.clock == "cpu" else time.perf_counter

    rows = []
    for shape in args.shapes.split(","):
        if shape == "default":
            loaded = load_model(str(DEFAULT_MODEL_DIR), dtype=args.dtype, device=args.device)
        elif shape in RANDOM_SHAPES:
            ckpt = Path(tempfile.mkdtemp(prefix="kvserve-spec-"))
            make_tiny_llama(ckpt, max_position_embeddings=2048, **SHAPES[shape])
            loaded = load_model(str(ckpt), dtype=args.dtype, device=args.device)
        else:
            raise SystemExit(f"unknown shape {shape!r}: use default, 110m or 1.1b")
        n_out = min(args.tokens, loaded.config.max_position_embeddings // 4)
        for wname, work in workloads(shape, loaded, n_out).items():
            prompt, fmt = work if isinstance(work, tuple) else (work, None)
            n = min(n_out, loaded.config.max_position_embeddings - len(prompt) - 1)
            engines = {s: engine_for(loaded, s, args.max_draft) for s in ("off", "ngram")}
            rates: dict[str, list[float]] = {"off": [], "ngram": []}
            last: dict[str, Finished] = {}
            for rep in range(args.repeats + 1):
                for spec, eng in engines.items():  # in turn, so drift hits both alike
                    fin, dt = generate(eng, prompt, n, f"{wname}-{spec}-{rep}", now, fmt)
                    last[spec] = fin
                    if rep and dt > 0:
                        rates[spec].append((fin.completion_tokens - 1) / dt)
            t = last["ngram"].timings
            line = engines["ngram"].scheduler.step_cost.line() or (float("nan"), float("nan"))
            off, on = statistics.median(rates["off"]), statistics.median(rates["ngram"])
            rows.append(dict(
                shape=shape, workload=wname, prompt=len(prompt), tokens=last["ngram"].completion_tokens,
                plain_tok_s=round(off, 1), spec_tok_s=round(on, 1), ratio=round(on / off, 2),
                acceptance=round(t.accepted_draft_tokens / t.draft_tokens, 3) if t.draft_tokens else 0.0,
                tokens_per_step=round(t.tokens_per_step, 2),
                identical=last["ngram"].output_token_ids == last["off"].output_token_ids,
                step_ms=round(line[0] * 1e3, 3), row_ms=round(line[1] * 1e3, 3),
            ))  # fmt: skip
            for eng in engines.values():
                eng.close()
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    cols = list(rows[0])
    print(f"# device={args.device} dtype={args.dtype} threads={args.threads} clock={args.clock} max_draft={args.max_draft} repeats={args.repeats}")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
