"""A cold turn's time to first token through the engine, turn after turn, on any device.

Loads a random checkpoint at one of bench_engine.py's shapes into an ``LLMEngine`` (no
store) and sends fresh prompts of the given lengths one after another (random tokens, so
nothing is cached), each a cold prefill and ``--decode`` greedy tokens: prints each
turn's TTFT and decode tok/s. A length seen before shows the steady cost; a new length
shows what the first use of a shape costs (kernel selection, a backend's graph build:
every session's history is a new length). ``--sdpa`` runs the same turns with the CUDA
forwards' scaled-dot-product attention kernels set (``layers.CUDA_SDPA_BACKENDS``), an A/B
in one process; ``--profile`` profiles the last turn (CPU and, on CUDA, device time per op).

    python bench/profile_engine.py --device cuda --dtype bfloat16 --shape 1.1b --prompts 8192,8192,8000,2048,2048
    python bench/profile_engine.py --device cuda --shape 1.1b --sdpa kvserve --sdpa all --profile
    python bench/profile_engine.py --shape 110m --prompts 512,512,500 --decode 32
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's kvserve, not an installed one

import torch  # noqa: E402

from bench.bench_engine import SHAPES  # noqa: E402
from kvserve.service.engine.config import EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.models.layers import CUDA_SDPA_BACKENDS as KVSERVE_BACKENDS  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.types import Finished, GenerationRequest, SamplingParams  # noqa: E402
from tests.fixtures.models import make_tiny_llama  # noqa: E402

BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION", "math": "MATH"}


def use_backends(spec: str) -> None:
    """The SDPA kernels a CUDA forward may use (``layers.CUDA_SDPA_BACKENDS``, read by each
    forward): ``kvserve``, the module's own list; ``all``, every kernel (torch's own choice,
    cuDNN's included); or a comma list of BACKENDS."""
    from torch.nn.attention import SDPBackend

    from kvserve.service.models import layers

    if spec == "kvserve":
        layers.CUDA_SDPA_BACKENDS = list(KVSERVE_BACKENDS)
    else:
        names = BACKENDS if spec == "all" else spec.split(",")
        layers.CUDA_SDPA_BACKENDS = [getattr(SDPBackend, BACKENDS[b]) for b in names]


def turn(eng: LLMEngine, tokens: list[int], rid: str, decode: int) -> Finished:
    eng.add_request(GenerationRequest(rid, tokens, SamplingParams(max_new_tokens=1 + decode, ignore_eos=True)))
    while True:
        for _, ev in eng.step():
            if isinstance(ev, Finished):
                return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="110m", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (bf16 on CUDA)")
    ap.add_argument("--prompts", default="2048,2048,2000,512,512", help="prompt lengths, one cold turn each, in order")
    ap.add_argument("--decode", type=int, default=16, help="greedy tokens after the first, per turn")
    ap.add_argument("--chunk", type=int, default=4096, help="max_num_batched_tokens (the prefill chunk)")
    ap.add_argument("--sdpa", action="append", default=None,
                    help="CUDA SDPA kernels for one pass over the turns: kvserve (its own list, the default), all "
                         f"(torch's choice), or a comma list of {','.join(BACKENDS)} (repeatable: one pass each)")
    ap.add_argument("--profile", action="store_true", help="profile the last turn of the last pass")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    lens = [int(x) for x in args.prompts.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvserve-prof-") as tmp:
        t0 = time.perf_counter()
        path = make_tiny_llama(Path(tmp) / args.shape, max_position_embeddings=max(lens) + args.decode + 64,
                               **SHAPES[args.shape])
        loaded = load_model(str(path), dtype=args.dtype, device=args.device, progress=False)
        print(f"{args.shape}: built and loaded in {time.perf_counter() - t0:.1f} s, {loaded.dtype} on {loaded.device}, "
              f"torch {torch.__version__}", flush=True)
        if loaded.device.type == "cuda":
            b = torch.backends.cuda
            print(f"sdpa backends enabled: flash {b.flash_sdp_enabled()}, efficient {b.mem_efficient_sdp_enabled()}, "
                  f"cudnn {b.cudnn_sdp_enabled()}, math {b.math_sdp_enabled()}")
        per_token = loaded.kv_spec(16).bytes_per_token
        cfg = EngineConfig(block_size=16, kv_cache_memory=per_token * (max(lens) + args.decode + 64) * 2,
                           max_num_batched_tokens=args.chunk, max_model_len=max(lens) + args.decode + 64,
                           speculative="off")
        g = torch.Generator().manual_seed(0)
        passes = args.sdpa or ["kvserve"]
        summary = []
        for p, spec in enumerate(passes):
            use_backends(spec)
            eng = LLMEngine(loaded, cfg)
            print(f"\n== sdpa {spec}")
            print("| turn | prompt | TTFT ms | decode tok/s |")
            print("|---:|---:|---:|---:|")
            ttfts = []
            for i, n in enumerate(lens):
                tokens = torch.randint(3, loaded.config.vocab_size, (n,), generator=g).tolist()
                prof = None
                if args.profile and p == len(passes) - 1 and i == len(lens) - 1:
                    from torch.profiler import ProfilerActivity, profile

                    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if loaded.device.type == "cuda" else [])
                    prof = profile(activities=acts)
                with prof or contextlib.nullcontext():
                    fin = turn(eng, tokens, f"{p}-{i}", args.decode)
                t = fin.timings
                ttfts.append(t.ttft_s * 1e3)
                print(f"| {i + 1} | {n} | {t.ttft_s * 1e3:.1f} | {t.decode_tokens_per_s:.1f} |", flush=True)
                if prof is not None:
                    key = "self_cuda_time_total" if loaded.device.type == "cuda" else "self_cpu_time_total"
                    print(f"\nprofile of turn {i + 1} (by {key}):")
                    print(prof.key_averages().table(sort_by=key, row_limit=args.top))
                    if loaded.device.type == "cuda":
                        print("(by self_cpu_time_total):")
                        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
            eng.close()
            summary.append((spec, ttfts))
        if len(summary) > 1:
            print("\n| sdpa | " + " | ".join(f"turn {i + 1} ({n})" for i, n in enumerate(lens)) + " | median |")
            print("|---|" + "---:|" * (len(lens) + 1))
            for spec, ttfts in summary:
                print(f"| {spec} | " + " | ".join(f"{x:.1f}" for x in ttfts) + f" | {statistics.median(ttfts):.1f} |")


if __name__ == "__main__":
    main()
