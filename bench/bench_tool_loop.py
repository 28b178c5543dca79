"""Tool loops: per-step time to first token of an agent's tool loop, in a session or not (issue 25).

An agent calls a tool, gets its result (``--tool-result-tokens`` tokens of text) and goes
on, ``--steps`` times; every step's prompt is the previous one plus the call and its
result, so the context grows by about a tool result a step. This bench runs that loop
against a real kvserve server (a subprocess: ``python -m kvserve.service`` with its
OpenAI-compatible HTTP front), through the official ``openai`` package, streaming, with
``tools`` and a named ``tool_choice`` (grammar-constrained: every step yields one call,
whatever the random weights), in three modes:

- ``session``: an ``X-Session-Id`` header; the whole history is resent each step (as
  OpenAI clients do) and the front matches it against the session's turns, so only the
  new tool result is rendered and prefilled; the bench checks that
  ``kvserve.history_diverged_at`` stays null (the history extended the session);
- ``plain``: no session, the same history resent each step: prefix caching by content
  only (the engine finds the previous step's device blocks by their hashes);
- ``cold``: the same requests with a distinct ``cache_salt`` per step, so no tier holds any
  of its blocks: every step prefills its whole context.

The session loop runs first; ``plain`` and ``cold`` replay its exact messages (its calls
and the same tool results), so every mode's step N sends the same context. Each mode has
its own ``cache_salt`` (``cold``: one per step), so no mode finds another's blocks.
TTFT is the wall time from sending the request to the first chunk carrying content or
a tool-call delta; ``cached`` is ``usage.prompt_tokens_details.cached_tokens``.

    python bench/bench_tool_loop.py                       # ~110M random shape, 10 steps
    python bench/bench_tool_loop.py --shape tiny --steps 4  # a quick check
    python bench/bench_tool_loop.py --model default       # the packaged default model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.serving import start_server_process  # noqa: E402

# LlamaConfig overrides; the random models keep the test tokenizer's 400-token vocabulary
# (as bench/bench_service.py's), so the ~110M shape's transformer stack is the real one.
SHAPES: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=8192),
    "110m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, max_position_embeddings=8192),
}  # fmt: skip
BLOCK_SIZE = 16
KV_CACHE = "1GiB"
TOOLS = [{"type": "function", "function": {
    "name": "find", "description": "Search the docs.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}, "required": ["q"],
                   "additionalProperties": False}}}]  # fmt: skip
TOOL_CHOICE = {"type": "function", "function": {"name": "find"}}
ASK = [{"role": "system", "content": "You are a research agent. Use the tools, then answer."},
       {"role": "user", "content": "Find out how the KV cache tiers work and summarise them."}]  # fmt: skip
WORDS = ("the cache block tier host device redis session prefix hash token page spill restore "
         "evict latency transcript turn engine prefill decode scheduler batch pool").split()  # fmt: skip


@dataclass
class Step:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    finish: str | None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tool_result(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """Random prose of about ``n_tokens`` tokens of the served tokenizer."""
    words: list[str] = []
    while True:
        words.append(rng.choice(WORDS))
        text = " ".join(words)
        if len(tokenizer.encode(text, add_special_tokens=False)) >= n_tokens:
            return text


def stream_step(client, model: str, messages: list, args, salt: str, session: str | None) -> tuple[Step, dict, dict]:
    """One streamed request; returns its figures, the assistant message and the kvserve object."""
    headers = {"X-Session-Id": session} if session else None
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=TOOL_CHOICE, parallel_tool_calls=False,
        max_tokens=args.max_new_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_headers=headers, extra_body={"cache_salt": salt},
    )  # fmt: skip
    ttft = None
    usage = None
    finish = None
    kv: dict = {}
    content = ""
    calls: dict[int, dict] = {}
    for chunk in stream:
        extra = getattr(chunk, "model_extra", None) or {}
        kv = extra.get("kvserve") or kv
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            d = choice.delta
            if ttft is None and (d.content or d.tool_calls):
                ttft = time.perf_counter() - t0
            content += d.content or ""
            for tc in d.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})  # fmt: skip
                if tc.id:
                    call["id"] = tc.id
                if tc.function and tc.function.name:
                    call["function"]["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["function"]["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    assert usage is not None, "no usage chunk"
    msg: dict = {"role": "assistant", "content": content or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return Step(usage.prompt_tokens, cached or 0, ttft if ttft is not None else float("nan"), finish), msg, kv


def run(args, model_dir: str) -> tuple[dict[str, list[Step]], list[int]]:
    import openai
    from transformers import AutoTokenizer

    http_port = free_port()
    flags = ["--model", model_dir, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory", KV_CACHE,
             "--block-size", str(BLOCK_SIZE), "--host", "127.0.0.1", "--port", "0", "--http-port", str(http_port),
             "--log-level", "info", "--drain-timeout", "5"]  # fmt: skip
    proc, _, _log = start_server_process(flags, timeout=600)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="bench", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        # the served tokenizer sizes the tool results (for --model default: one word a token, roughly)
        tokenizer = AutoTokenizer.from_pretrained(model_dir) if Path(model_dir).is_dir() else None
        rng = random.Random(0)
        # warm-up (its own salt): the grammar, the first forward passes
        stream_step(client, model, list(ASK), args, "warmup", None)

        # (a) the session loop; it fixes the messages the other modes replay
        out: dict[str, list[Step]] = {"session": [], "plain": [], "cold": []}
        messages = list(ASK)
        histories: list[list] = []
        for i in range(args.steps):
            histories.append(list(messages))
            step, msg, kv = stream_step(client, model, messages, args, "session", "tool-loop")
            if i and kv.get("history_diverged_at") is not None:
                raise RuntimeError(f"step {i + 1}: the history diverged from the session: {kv}")
            out["session"].append(step)
            if not msg.get("tool_calls") or step.finish != "tool_calls":
                raise RuntimeError(f"step {i + 1}: no tool call ({step.finish}); raise --max-new-tokens")
            messages.append(msg)
            call = msg["tool_calls"][0]
            text = (tool_result(tokenizer, args.tool_result_tokens, rng) if tokenizer
                    else " ".join(rng.choice(WORDS) for _ in range(args.tool_result_tokens)))  # fmt: skip
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": text})
        # (b) no session: the same histories, prefix caching by content; (c) cold: a salt per step
        for hist in histories:
            out["plain"].append(stream_step(client, model, hist, args, "plain", None)[0])
        for i, hist in enumerate(histories):
            out["cold"].append(stream_step(client, model, hist, args, f"cold-{i}", None)[0])
        added = [b.prompt_tokens - a.prompt_tokens for a, b in zip(out["session"], out["session"][1:])]
        return out, added
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except Exception:
            proc.kill()


def table(out: dict[str, list[Step]]) -> str:
    head = ("| step | context tokens | TTFT session ms | TTFT no session ms | TTFT cold ms | cached session | "
            "cached no session | cached cold | cold/session | no session/session |")  # fmt: skip
    rows = [head, "|" + "---:|" * 10]
    for i, (s, p, c) in enumerate(zip(out["session"], out["plain"], out["cold"])):
        ctx = str(s.prompt_tokens) if s.prompt_tokens == p.prompt_tokens == c.prompt_tokens else \
            f"{s.prompt_tokens}/{p.prompt_tokens}/{c.prompt_tokens}"
        rows.append(f"| {i + 1} | {ctx} | {1000 * s.ttft_s:.0f} | {1000 * p.ttft_s:.0f} | "
                    f"{1000 * c.ttft_s:.0f} | {s.cached_tokens} | {p.cached_tokens} | {c.cached_tokens} | "
                    f"{c.ttft_s / s.ttft_s:.1f}x | {p.ttft_s / s.ttft_s:.2f}x |")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="110m", help="the random model's shape")
    p.add_argument("--model", default=None, help="a model directory or 'default' (instead of a random --shape model)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tool-result-tokens", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="the cap per step (the constrained call ends earlier; a cut call is reported)")
    args = p.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from tests.fixtures.models import make_tiny_llama

            model_dir = str(make_tiny_llama(Path(tmp) / args.shape, **SHAPES[args.shape]))
        t0 = time.perf_counter()
        out, added = run(args, model_dir)
        wall = time.perf_counter() - t0
    s = [x.ttft_s for x in out["session"][1:]]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\n{args.steps}-step tool loop, {args.model or args.shape} model, tool results of ~{args.tool_result_tokens} "
          f"tokens (context +{statistics.median(added) if added else 0:.0f} tokens a step, median), "
          f"max_tokens {args.max_new_tokens}, blocks of {BLOCK_SIZE}; CPU float32, torch {torch.__version__}, "
          f"{os.cpu_count()} cores; {wall:.0f} s in all; load average at the end {load}\n")  # fmt: skip
    print(table(out))
    if len(s) > 1:
        print(f"\nsession TTFT, steps 2..{args.steps}: min {1000 * min(s):.0f} ms, median {1000 * statistics.median(s):.0f} ms, "
              f"max {1000 * max(s):.0f} ms")  # fmt: skip
    print(json.dumps({k: [vars(x) for x in v] for k, v in out.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()
