"""What a speculative verify step costs by its rows: one sequence's decode forward with 0..k
drafts (its pending token and k drafted tokens, one row each, as the engine's verify step
runs them), against a plain decode row, the row counts taking turns step by step in one
process so the host's drift hits them alike.

The engine's own ``Runner.decode_step`` over a prefilled sequence of ``--context`` random
tokens (the default model unless ``--model``), nothing committed between steps, so every
step sees the same context. Per row count, the median over ``--steps`` steps of: the whole
``decode_step`` (block tables, the rows packed, the forward) and the model's native step
within it (``NativeStep``: the embedding rows, every decoder layer, the final norm and
head in one call). ``--empty-kernels`` runs the same steps with every native kernel an
empty C function (bench/profile_decode.py's): what is left is the Python and torch around
them.

    python bench/bench_verify_rows.py                         # default model, 322 positions
    python bench/bench_verify_rows.py --drafts 0,3,7,15 --context 1000
    python bench/bench_verify_rows.py --empty-kernels
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.service import kernels  # noqa: E402  torch-free

kernels.passive_openmp()  # as the server does, before torch loads
import torch  # noqa: E402

from kvserve.service.engine.config import DEFAULT_MODEL_DIR, EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.kernels import layer as native_layer  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.types import GenerationRequest, SamplingParams  # noqa: E402

PARTS = ("__call__",)  # NativeStep's call: the whole step natively (embedding, layers, head)
LABELS = ("native step",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--context", type=int, default=322, help="positions before the step's rows")
    ap.add_argument("--drafts", default="0,1,3,7", help="drafts per verify step (rows: 1 + drafts)")
    ap.add_argument("--steps", type=int, default=2000, help="timed steps per row count")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--empty-kernels", action="store_true", help="every native kernel an empty function")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    drafts = [int(d) for d in args.drafts.split(",")]

    loaded = load_model(args.model, dtype="float32", device="cpu")
    if loaded.native != "on":
        raise SystemExit(f"the native kernels are not serving: {loaded.native}")
    per_token = loaded.kv_spec(16).bytes_per_token
    need = args.context + max(drafts) + 2
    if need > loaded.config.max_position_embeddings:
        raise SystemExit(f"--context plus drafts exceed the model's {loaded.config.max_position_embeddings} positions")
    engine = LLMEngine(loaded, EngineConfig(model_path="unused", device="cpu", dtype="float32", block_size=16,
                                            kv_cache_memory=(need // 16 + 8) * 16 * per_token, speculative="off"))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, loaded.tokenizer.vocab_size, (args.context,), generator=g).tolist()
    engine.add_request(GenerationRequest("v", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True)))
    engine.step()  # the prefill; the sequence holds its first output token, pending
    seq = engine.scheduler.running[0]
    while len(seq.blocks) * 16 < seq.num_computed + max(drafts) + 1:  # room for the drafts' K/V
        seq.blocks.extend(engine.blocks.allocate(1))
    runner = engine.runner

    if args.empty_kernels:
        from bench.profile_decode import EmptyKernels

        served = kernels.load()
        empty = dataclasses.replace(served, lib=EmptyKernels(served.lib))
        kernels.load = lambda: empty  # what the model's native calls look up

    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    label = [""]
    for name in PARTS:
        real = getattr(native_layer.NativeStep, name)

        def timed(*a, _real=real, _name=name, **kw):
            t0 = time.perf_counter()
            out = _real(*a, **kw)
            times[(label[0], _name)].append(time.perf_counter() - t0)
            return out

        setattr(native_layer.NativeStep, name, timed)

    cases = [("plain", -1)] + [(f"verify {1 + k}", k) for k in drafts]
    with torch.inference_mode():
        for step in range(args.steps + 20):
            for name, k in cases:
                label[0] = name if step >= 20 else "warm-up"
                t0 = time.perf_counter()
                if k < 0:
                    seq.drafts = []
                    runner.decode_step([seq], [])
                    seq.num_computed -= 1  # the same position again next time
                else:
                    seq.drafts = prompt[:k]
                    runner.decode_step([], [seq])  # a verify step moves nothing until commit
                times[(label[0], "step")].append(time.perf_counter() - t0)

    def med(name: str, part: str) -> float:
        return statistics.median(times[(name, part)]) * 1e6

    base = med("plain", "step")
    print(f"# {Path(args.model).name}, {args.context} positions, {args.threads} threads, {args.steps} steps each"
          f"{', kernels emptied' if args.empty_kernels else ''}; medians in us")  # fmt: skip
    print("| step | rows | decode_step | x plain | " + " | ".join(LABELS) + " | rest (Python, torch) |")
    print("|---|---:|---:|---:|" + "---:|" * len(LABELS) + "---:|")
    for name, k in cases:
        total = med(name, "step")
        parts = [med(name, p) for p in PARTS]
        print(f"| {name} | {max(k, 0) + 1} | {total:.1f} | {total / base:.2f} | "
              + " | ".join(f"{p:.1f}" for p in parts) + f" | {total - sum(parts):.1f} |")  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
