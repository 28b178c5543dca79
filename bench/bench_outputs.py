"""n > 1 and structured output on the packaged default model (CPU, float32, one engine
stepped in this process):

1. n = 8 sequences of one prompt vs 8 separate requests of it submitted together:
   prompt tokens run through the model and wall time to finish all 8;
2. a JSON-schema response_format: compile time (cold, then from the cache), and decode
   throughput of 8 free rows (48 tokens each) vs 8 constrained rows (same seeds, up to 128
   tokens: each ends where its JSON does);
3. the grammar mask alone: CPU ms per step for 8 constrained rows (llguidance's
   bitmask + the sampler's masking), mean over the steps of (2).

    PYTHONPATH=$PWD python bench/bench_outputs.py
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.engine import LLMEngine
from kvserve.service.engine.sampling import apply_grammar_masks
from kvserve.service.models.loading import load_model
from kvserve.service.types import Finished, GenerationRequest, ResponseFormat, SamplingParams

MODEL = str(Path(__file__).resolve().parents[1] / "service" / "default_model")
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "sunny": {"type": "boolean"},
        "temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
        "tags": {"type": "array", "items": {"enum": ["warm", "cold", "wet", "dry"]}, "maxItems": 3},
    },
    "required": ["city", "sunny", "temp_c", "tags"],
    "additionalProperties": False,
}


def engine(loaded) -> LLMEngine:
    cfg = EngineConfig(model_path=MODEL, device="cpu", dtype="float32", kv_cache_memory=64 << 20, block_size=16,
                       max_num_seqs=16)  # fmt: skip
    return LLMEngine(loaded, cfg)


def drain(eng: LLMEngine, reqs: list[GenerationRequest]) -> tuple[float, dict[str, list[Finished]]]:
    ends: dict[str, list[Finished]] = {r.request_id: [] for r in reqs}
    want = sum(r.sampling.n for r in reqs)
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    while sum(len(v) for v in ends.values()) < want:
        for rid, ev in eng.step():
            if isinstance(ev, Finished):
                ends[rid].append(ev)
    return time.perf_counter() - t0, ends


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model(MODEL, dtype="float32", device="cpu")
    prompt = loaded.tokenizer.encode("The weather report for the coming week, region by region: " * 6)
    base = SamplingParams(max_new_tokens=48, temperature=1.0, seed=1, ignore_eos=True)

    eng = engine(loaded)
    t_n, _ = drain(eng, [GenerationRequest("n8", prompt, dataclasses.replace(base, n=8))])
    pre_n = eng.runner.num_prefill_tokens
    eng = engine(loaded)
    t_sep, _ = drain(eng, [GenerationRequest(f"r{i}", prompt, dataclasses.replace(base, seed=i)) for i in range(8)])
    pre_sep = eng.runner.num_prefill_tokens
    print(f"prompt {len(prompt)} tokens, 48 new tokens each")
    print("| 8 sequences | prompt tokens computed | wall s |")
    print("| --- | ---: | ---: |")
    print(f"| n = 8 (one request) | {pre_n} | {t_n:.2f} |")
    print(f"| 8 requests at once | {pre_sep} | {t_sep:.2f} |")

    eng = engine(loaded)
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    eng.grammars.compile(fmt)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.grammars.compile(fmt)
    warm = time.perf_counter() - t0
    print(f"\nschema compile: {cold * 1e3:.1f} ms cold (includes the vocabulary, once per engine), "
          f"{warm * 1e3:.3f} ms cached")  # fmt: skip

    # mask cost: wrap fill_masks to time it (and the sampler's masking) per step
    spent: list[float] = []
    fill = eng.grammars.fill_masks

    def timed(matchers):  # type: ignore[no-untyped-def]
        c0 = time.process_time()
        mask = fill(matchers)
        logits = torch.randn(len(matchers), loaded.config.vocab_size)
        apply_grammar_masks(logits, list(range(len(matchers))), mask)
        spent.append(time.process_time() - c0)
        return mask

    eng.grammars.fill_masks = timed  # type: ignore[method-assign]
    free = [GenerationRequest(f"f{i}", prompt, dataclasses.replace(base, seed=i)) for i in range(8)]
    t_free, _ = drain(eng, free)
    tok_free = sum(r.sampling.max_new_tokens for r in free)
    constrained = [
        GenerationRequest(f"c{i}", prompt, dataclasses.replace(base, max_new_tokens=128, seed=i, ignore_eos=False, response_format=fmt))
        for i in range(8)
    ]  # fmt: skip
    t_con, ends = drain(eng, constrained)
    tok_con = sum(e.completion_tokens for v in ends.values() for e in v)
    parsed = sum(1 for v in ends.values() for e in v if e.finish_reason.value == "stop" and json.loads(e.text))
    print("\n| 8 rows | tokens | wall s | tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    print(f"| free text | {tok_free} | {t_free:.2f} | {tok_free / t_free:.0f} |")
    print(f"| JSON schema | {tok_con} | {t_con:.2f} | {tok_con / t_con:.0f} |")
    print(f"\nconstrained outputs that finished and parsed: {parsed}/8")
    print(f"grammar mask, 8 rows, V={loaded.config.vocab_size}: {1e3 * sum(spent) / len(spent):.2f} CPU ms per step "
          f"(mean of {len(spent)} steps)")  # fmt: skip


if __name__ == "__main__":
    main()
