"""Prefix guards for agent clients (service/prefix_guard.py, docs/api.md "Prefix guards"),
against real servers on loopback: a system message in the middle of a conversation stays
where the client put it, so the next turn reads the previous turn's blocks from the
cache; and a per-request volatile system block (a coding agent's billing header, a new
value each request) makes the next turn a miss, unless ``--strip-volatile-system``
removes it, on the OpenAI and the Anthropic routes alike."""

from __future__ import annotations

import httpx
import pytest

from kvserve.service.prefix_guard import VolatileSystem
from kvserve.service.types import ChatMessage, TurnInput
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config

BILLING = r"x-anthropic-billing-header:[^\n]*\n?"
AGENT = ("You are a coding agent. Read the files, run the tests, and change only what the task needs. "
         "Answer briefly and say what you ran. ") * 3  # fmt: skip


def billing(n: int) -> str:
    return f"x-anthropic-billing-header: cc_version=2.0.{n}; cc_entrypoint=cli; cch={n:05x};\n"


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir), http_port=0) as s:
        with httpx.Client(base_url=f"http://127.0.0.1:{s.running.http_port}", timeout=60) as c:
            yield c


@pytest.fixture(scope="module")
def guarded(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir, strip_volatile_system=BILLING), http_port=0) as s:
        with httpx.Client(base_url=f"http://127.0.0.1:{s.running.http_port}", timeout=60) as c:
            yield c


def _chat(c, model, messages):
    r = c.post("/v1/chat/completions", json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def _agent_turns(c, model, system_of, task):
    """Two turns of an agent loop whose system text is ``system_of(turn)``; the second
    turn's usage."""
    msgs = [{"role": "user", "content": task}]
    reply, first = _chat(c, model, [{"role": "system", "content": system_of(1)}, *msgs])
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "now run the tests"}]
    _, second = _chat(c, model, [{"role": "system", "content": system_of(2)}, *msgs])
    return first, second


def test_a_mid_conversation_system_message_stays_in_place(plain, tiny_llama_dir):
    """Turn 2 adds a system message after turn 1's reply: its prompt begins with turn 1's
    prompt, so every full block of it is read from the cache (hoisted to the top, the
    system text would change the prefix and nothing would be)."""
    model = str(tiny_llama_dir)
    msgs = [{"role": "system", "content": AGENT}, {"role": "user", "content": "fix the parser"}]
    reply, first = _chat(plain, model, msgs)
    msgs += [{"role": "assistant", "content": reply}, {"role": "system", "content": "The tests now pass."},
             {"role": "user", "content": "what next?"}]  # fmt: skip
    _, second = _chat(plain, model, msgs)
    assert second["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE


def test_a_volatile_system_block_misses_without_the_guard_and_hits_with_it(plain, guarded, tiny_llama_dir):
    model = str(tiny_llama_dir)
    system_of = lambda turn: billing(turn) + AGENT  # noqa: E731
    first, second = _agent_turns(plain, model, system_of, "fix the tokenizer")
    # only the blocks before the header's changed value: the agent's text after it is recomputed
    assert second["prompt_tokens_details"]["cached_tokens"] < first["prompt_tokens"] // 2
    first_on, second_on = _agent_turns(guarded, model, system_of, "fix the tokenizer")
    assert second_on["prompt_tokens_details"]["cached_tokens"] >= first_on["prompt_tokens"] // BLOCK_SIZE * BLOCK_SIZE
    assert first_on["prompt_tokens"] < first["prompt_tokens"]  # the header is not in the guarded prompt


def _messages(c, model, system_blocks, task, history=()):
    body = {"model": model, "max_tokens": 4, "temperature": 0, "system": system_blocks,
            "messages": [*history, {"role": "user", "content": task}]}  # fmt: skip
    r = c.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_guard_on_anthropic_system_blocks(plain, guarded, tiny_llama_dir):
    """Claude Code's shape: the billing header is its own first system block."""
    model = str(tiny_llama_dir)
    for client, hit in ((plain, False), (guarded, True)):
        blocks = lambda turn: [{"type": "text", "text": billing(100 + turn)}, {"type": "text", "text": AGENT}]  # noqa: E731
        one = _messages(client, model, blocks(1), "list the files")
        history = [{"role": "user", "content": "list the files"}, {"role": "assistant", "content": one["content"]}]
        two = _messages(client, model, blocks(2), "open the first", history)
        read = two["usage"]["cache_read_input_tokens"]
        full = (one["usage"]["input_tokens"] + one["usage"]["cache_read_input_tokens"]) // BLOCK_SIZE * BLOCK_SIZE
        assert (read >= full) if hit else (read < full // 2), (client, two["usage"])


def test_volatile_system_strips_only_system_text():
    guard = VolatileSystem(BILLING)
    inp = TurnInput(messages=(ChatMessage("system", billing(7) + "rules"), ChatMessage("user", billing(8) + "hi"),
                              ChatMessage("developer", billing(9))))  # fmt: skip
    out = guard.apply(inp).messages
    assert [m.content for m in out] == ["rules", billing(8) + "hi", ""]  # an emptied message stays in its place
    assert VolatileSystem("").apply(inp) is inp
