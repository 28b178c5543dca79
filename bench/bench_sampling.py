"""The sampler's CPU time per step: one batch of rows (B = 32, V = 32000, one thread),
for greedy, temperature + top_p, and temperature + top_k + top_p + repetition and
presence penalties, plus the same with logprobs (top 5). Process CPU time, mean of 10
steps, so a shared machine's other load counts less than on a wall clock.

    python bench/bench_sampling.py
"""

from __future__ import annotations

import time

import torch

from kvserve.service.engine.sampling import RowState, make_generator, sample
from kvserve.service.types import SamplingParams

B, V, STEPS = 32, 32000, 10

CASES = {
    "greedy": SamplingParams(),
    "temperature + top_p": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "temperature + top_k 50 + top_p + penalties": SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5, seed=1
    ),
    "greedy + logprobs (top 5)": SamplingParams(logprobs=5),
}


def main() -> None:
    torch.set_num_threads(1)
    logits = torch.randn(B, V)
    states = [RowState(list(range(i, i + 300)), 200) for i in range(B)]
    print(f"| rows (B={B}, V={V}) | CPU ms per step |")
    print("| --- | ---: |")
    for label, p in CASES.items():
        params = [p] * B

        def step() -> None:
            gens = [make_generator(q, torch.device("cpu")) for q in params]
            sample(logits.clone(), params, gens, states)

        step()
        t = time.process_time()
        for _ in range(STEPS):
            step()
        print(f"| {label} | {(time.process_time() - t) / STEPS * 1000:.1f} |")


if __name__ == "__main__":
    main()
