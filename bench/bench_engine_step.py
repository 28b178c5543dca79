"""Decode through the whole engine: tokens/s of ``LLMEngine.step`` (scheduler, block
tables, the batched forward, sampling, detokenizing, events) for B greedy sequences.

bench_engine.py times the model over a KV pool alone; this times what the engine adds
around it, so a change to the engine's Python (not the model's) shows here. Figures, over
the decode steps only (after every sequence's prompt is computed), of ``--repeats`` runs
after an untimed one, on the process's CPU clock (``--clock cpu``, with one torch thread:
fair on a machine shared with other jobs) or the wall clock:

- ``decode_bB_tok_s``: tokens/s, the median run;
- ``step_bB_us``: the fastest decode step (min is what contention cannot inflate);
- ``engine_bB_us``: the fastest step's time outside the model's forward or native step (the scheduler,
  block tables, layout, sampling, detokenizing, events), min over steps.

``--repo DIR`` runs another checkout's engine (e.g. ``git archive REV | tar -x -C DIR``)
with this script, so two revisions can be timed in turn:

    python bench/bench_engine_step.py --shape tiny --batches 1,8
    python bench/bench_engine_step.py --shape 110m --batches 1,8 --repo /tmp/base
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=["tiny", "110m"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens per sequence")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the checkout to run")
    ap.add_argument("--checkpoint", default="", help="directory for the random checkpoint (kept; default: a temp dir)")
    args = ap.parse_args()

    sys.path.insert(0, args.repo)
    import torch

    from kvserve.service.engine.config import EngineConfig
    from kvserve.service.engine.engine import LLMEngine
    from kvserve.service.models.loading import load_model
    from kvserve.service.types import Delta, Finished, GenerationRequest, SamplingParams
    from tests.fixtures.models import make_tiny_llama

    torch.set_num_threads(args.threads)
    shapes = {
        "tiny": dict(),
        "110m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                     num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),  # tokenizer: 400 pieces
    }
    ckpt = Path(args.checkpoint or tempfile.mkdtemp(prefix="kvserve-step-"))
    if not (ckpt / "config.json").exists():
        make_tiny_llama(ckpt, **shapes[args.shape])
    loaded = load_model(str(ckpt), dtype="float32", device="cpu")
    now = time.process_time if args.clock == "cpu" else time.perf_counter
    model = loaded.model
    in_model = [0.0]  # seconds inside the model's forward, this step

    def timed_call(call):
        def timed(*a):
            t = now()
            try:
                return call(*a)
            finally:
                in_model[0] += now() - t

        return timed

    class TimedStep:  # the runner's decode step backend (models/step.py), timed as the model's forward
        def __init__(self, step):
            self.step, self.call = step, timed_call(step)

        def __call__(self, *a):
            return self.call(*a)

        def __getattr__(self, name):
            return getattr(self.step, name)

    class Timed:  # the model, its forward timed (the engine calls model(layout, pool, ...); a checkout
        # before models/step.py also model.native_step(pool)(rows...)); the rest passed through
        def __call__(self, layout, pool, **kw):
            t = now()
            try:
                return model(layout, pool, **kw)
            finally:
                in_model[0] += now() - t

        def native_step(self, kv):  # the decode step as one native call: timed the same
            step = model.native_step(kv)
            if step is None:
                return None

            def timed(*a):
                t = now()
                try:
                    return step(*a)
                finally:
                    in_model[0] += now() - t

            return timed

        def __getattr__(self, name):
            return getattr(model, name)

    loaded = dataclasses.replace(loaded, model=Timed())
    batches = [int(b) for b in args.batches.split(",")]
    per_token = loaded.kv_spec(16).bytes_per_token
    out: dict[str, float] = {}
    for batch in batches:
        cfg = EngineConfig(model_path="unused", device="cpu", dtype="float32", block_size=16,
                           kv_cache_memory=(batch + 1) * (args.prompt + args.tokens + 32) * per_token,
                           max_num_batched_tokens=max(512, args.prompt * batch))
        eng = LLMEngine(loaded, cfg)
        if hasattr(eng.runner, "step"):  # the decode step's backend (its reference calls the timed forward)
            eng.runner.step = TimedStep(eng.runner.step) if eng.runner.step is not eng.runner.reference else eng.runner.step
        g = torch.Generator().manual_seed(0)
        rates, steps, outside = [], [], []
        for rep in range(args.repeats + 1):
            for b in range(batch):
                prompt = torch.randint(3, loaded.config.vocab_size, (args.prompt,), generator=g).tolist()
                eng.add_request(GenerationRequest(f"r{rep}-{b}", prompt,
                                                  SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)))
            started: set[str] = set()
            done = 0
            t0 = None
            n_tokens = 0
            while done < batch:
                in_model[0] = 0.0
                t = now()
                events = eng.step()
                dt_step = now() - t
                if t0 is not None:
                    n_tokens += sum(len(e.token_ids) for _, e in events if isinstance(e, Delta))
                    if rep and len(started) == batch and done == 0:  # a full decode step
                        steps.append(dt_step)
                        outside.append(dt_step - in_model[0])
                for rid, e in events:
                    if isinstance(e, Delta):
                        started.add(rid)
                    elif isinstance(e, Finished):
                        done += 1
                if t0 is None and len(started) == batch:
                    t0 = now()  # every prompt computed: the decode steps from here
            dt = now() - t0
            if rep:  # the first run is untimed (warm-up)
                rates.append(n_tokens / dt)
        eng.close()
        out[f"decode_b{batch}_tok_s"] = round(statistics.median(rates), 1)
        out[f"step_b{batch}_us"] = round(min(steps) * 1e6, 1)
        out[f"engine_b{batch}_us"] = round(min(outside) * 1e6, 1)
    print(json.dumps({"repo": args.repo, "shape": args.shape, "clock": args.clock, **out}))


if __name__ == "__main__":
    main()
