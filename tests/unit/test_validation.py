"""kvserve.service.validation: every request check's message, asserted here once. The front
(tests/service/test_service_errors.py, tests/service/test_limits.py) and the engine (tests/engine/test_engine.py)
raise these same messages through the same functions."""

from __future__ import annotations

import pytest

from kvserve.service.types import (
    ChatMessage,
    GenerationRequest,
    InvalidRequest,
    ResponseFormat,
    SamplingParams,
    TurnInput,
    TurnMode,
)
from kvserve.service.validation import (
    Limits,
    check_context,
    check_generation,
    check_input_size,
    check_kv_capacity,
    check_prompt,
    check_prompt_limit,
    check_salt,
    check_sampling,
    check_stop_lists,
    check_input_text,
    check_text,
    check_turn_options,
    check_vocabulary,
)


def message(fn, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequest) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_context_messages_and_the_room_left() -> None:
    assert check_context(10, 5, 64) == 49
    assert check_context(10, 5, 64, max_new_tokens=49) == 49
    assert message(check_context, 0, 70, 64) == (
        "prompt has 70 tokens; the context length is 64 (room for at least 1 new token needed)"
    )
    assert message(check_context, 0, 64, 64) == (
        "prompt has 64 tokens; the context length is 64 (room for at least 1 new token needed)"
    )
    assert message(check_context, 0, 40, 64, max_new_tokens=30) == (
        "prompt (40 tokens) + max_new_tokens (30) = 70 exceeds the context length 64"
    )
    assert message(check_context, 50, 10, 64, max_new_tokens=10, session_id="s") == (
        "session 's' would exceed the context: its transcript has 50 tokens, this turn adds 10 "
        "and asks for up to 10 new tokens: 70 > context length 64"
    )
    assert message(check_context, 60, 10, 64, session_id="s") == (
        "session 's' would exceed the context: its transcript has 60 tokens, this turn adds 10 "
        "and asks for at least 1 new token: 71 > context length 64"
    )


def test_kv_capacity_counts_blocks_up_to_the_context() -> None:
    check_kv_capacity(10, 1000, 64, 16, 4)  # capped at the context: 64 tokens, 4 blocks
    assert message(check_kv_capacity, 10, 60, 128, 16, 4) == (
        "prompt + max_new_tokens needs 5 KV blocks; the KV cache holds 4 "
        "(raise --kv-cache-memory or lower max_new_tokens)"
    )
    check_kv_capacity(20, 30, 128, 16, 7, n=2)  # 50 tokens: 4 blocks, 1 shared + 2 x 3
    assert message(check_kv_capacity, 20, 30, 128, 16, 9, n=3) == (
        "n = 3 sequences of prompt + max_new_tokens need 10 KV blocks at once (1 shared prompt blocks + 3 x 3); "
        "the KV cache holds 9 (lower n or max_new_tokens, or raise --kv-cache-memory)"
    )


def test_n_and_response_format() -> None:
    from kvserve.service.types import ResponseFormat

    limit = dict(vocab_size=100, max_new_tokens_limit=256)
    check_sampling(SamplingParams(n=16, response_format=ResponseFormat("json_object")), **limit)
    assert message(check_sampling, SamplingParams(n=0), **limit) == "n must be in [1, 16], got 0"
    assert message(check_sampling, SamplingParams(response_format=ResponseFormat("regex", "x" * 32769)), **limit) == (
        "response_format regex has 32769 characters; the limit is 32768"
    )
    assert message(check_sampling, SamplingParams(stop_token_ids=(5,), response_format=ResponseFormat("regex", "x")),
                   **limit) == (
        "stop_token_ids cannot be combined with response_format (the grammar ends the output)"
    )  # fmt: skip


def test_vocabulary_sampling_and_stop_lists() -> None:
    assert message(check_vocabulary, [1, 400], 400, "tokens.ids") == (
        "tokens.ids[1] = 400 is outside the vocabulary (ids must be < 400)"
    )
    assert message(check_sampling, SamplingParams(logit_bias=((4000, 1.0),)), vocab_size=400,
                   max_new_tokens_limit=128) == "logit_bias token id 4000 is outside the vocabulary [0, 400)"  # fmt: skip
    assert message(check_sampling, SamplingParams(stop_token_ids=(9999,)), vocab_size=400,
                   max_new_tokens_limit=128).startswith("sampling.stop_token_ids[0] = 9999")  # fmt: skip
    lim = Limits(max_stop_strings=1, max_stop_string_chars=3, max_stop_token_ids=1, max_cache_salt_chars=2)
    assert message(check_stop_lists, SamplingParams(stop=("a", "b")), lim) == "sampling.stop has 2 strings; the limit is 1"
    assert message(check_stop_lists, SamplingParams(stop=("abcd",)), lim) == (
        "sampling.stop[0] has 4 characters; the limit is 3"
    )
    assert message(check_stop_lists, SamplingParams(stop_token_ids=(1, 2)), lim) == (
        "sampling.stop_token_ids has 2 ids; the limit is 1"
    )
    assert message(check_salt, "abc", lim) == "cache_salt has 3 characters; the limit is 2"


def test_prompt_limit_and_input_size() -> None:
    check_prompt_limit(10, 10, 0)  # no limit
    assert message(check_prompt_limit, 0, 41, 40) == "prompt has 41 tokens; the limit is 40 (max_prompt_tokens)"
    assert message(check_prompt_limit, 30, 11, 40, "s") == (
        "session 's' would exceed the prompt limit: its transcript has 30 tokens and this turn adds 11: "
        "41 > max_prompt_tokens 40; start a new session"
    )
    check_input_size("text", 100, 0, 10, 10, "the context length")  # 100 bytes may be 10 tokens
    assert message(check_input_size, "text", 101, 0, 10, 10, "the context length") == (
        "input too long: the new text has 101 bytes, at least 11 tokens in all (a token covers at most "
        "10 bytes); the limit is 10 (the context length)"
    )
    assert message(check_input_size, "chat", 50, 6, 10, 10, "max_prompt_tokens", "s") == (
        "input too long: session 's' has 6 tokens and the new chat has 50 bytes, at least 11 tokens in all "
        "(a token covers at most 10 bytes); the limit is 10 (max_prompt_tokens)"
    )


def test_check_prompt_refuses_what_cannot_fit_before_it_tokenizes() -> None:
    """``check_prompt`` brackets the tokenizing: text or chat that cannot fit is refused
    without ``encode`` being called; what it encodes is then checked and returned with
    ``max_new_tokens`` fitted to the context left."""
    encoded: list[str] = []

    def encode() -> list[int]:
        encoded.append("called")
        return [5] * 7

    text = TurnInput(text="x" * 101, session_id="s", sampling=SamplingParams(max_new_tokens=16))
    assert message(check_prompt, text, 3, encode, Limits(), vocab_size=10, context_length=12, bytes_per_token=10) == (
        "input too long: session 's' has 3 tokens and the new text has 101 bytes, at least 14 tokens in all "
        "(a token covers at most 10 bytes); the limit is 12 (the context length)"
    )
    chat = TurnInput(messages=(ChatMessage("user", "y" * 60),), sampling=SamplingParams(max_new_tokens=16))
    assert "the limit is 5 (max_prompt_tokens)" in message(check_prompt, chat, 0, encode, Limits(max_prompt_tokens=5),
                                                            vocab_size=10, context_length=12, bytes_per_token=10)  # fmt: skip
    assert encoded == []  # refused before tokenizing
    fits = TurnInput(text="x" * 20, sampling=SamplingParams(max_new_tokens=16))
    tokens, sampling = check_prompt(fits, 3, encode, Limits(), vocab_size=10, context_length=12, bytes_per_token=10)
    assert encoded == ["called"] and tokens == [5] * 7 and sampling.max_new_tokens == 2  # 12 - (3 + 7): fitted
    ids = TurnInput(token_ids=(1, 12), sampling=SamplingParams(max_new_tokens=16))
    assert message(check_prompt, ids, 0, lambda: [1, 12], Limits(), vocab_size=10, context_length=12) == (
        "tokens.ids[1] = 12 is outside the vocabulary (ids must be < 10)"
    )


def test_the_engine_guard_uses_the_same_checks() -> None:
    def gen(ids: list[int], **sampling) -> None:
        check_generation(GenerationRequest("r", ids, SamplingParams(**sampling)), vocab_size=400,
                         context_length=64, max_new_tokens_limit=128, block_size=16, kv_blocks=3)  # fmt: skip

    assert message(gen, []) == "the prompt is empty"
    assert message(gen, [1, 400]).startswith("prompt_token_ids[1] = 400 is outside the vocabulary")
    assert message(gen, [1] * 64) == message(check_context, 0, 64, 64)
    assert message(gen, [1] * 40, max_new_tokens=20) == message(check_kv_capacity, 40, 20, 64, 16, 3)
    gen([1] * 40, max_new_tokens=8)


def test_turn_options() -> None:
    check_turn_options(TurnInput(text="x"))
    check_turn_options(TurnInput(session_id="s", mode=TurnMode.REGENERATE, expected_turns=2))
    assert message(check_turn_options, TurnInput(text="x", require_existing_session=True)) == (
        "require_existing_session needs a session_id"
    )
    assert message(check_turn_options, TurnInput(text="x", mode=TurnMode.EDIT)) == "turn_mode EDIT needs a session_id"
    assert message(check_turn_options, TurnInput(text="x", expected_turns=0)) == "expected_turns needs a session_id"
    assert message(check_turn_options, TurnInput(session_id="s", text="x", sampling=SamplingParams(n=3))) == (
        "n = 3 cannot be used with a session_id: a session keeps one transcript (ask for n > 1 without a session)"
    )
    assert message(check_turn_options, TurnInput(session_id="s", text="x", mode=TurnMode.REGENERATE)) == (
        "turn_mode REGENERATE takes no input (it reuses the last turn's), got text; use TURN_MODE_EDIT to replace the input"
    )


def test_integers_that_reach_a_tensor_or_the_generator() -> None:
    limit = dict(vocab_size=400, max_new_tokens_limit=128)
    for ok in (SamplingParams(top_k=2**31 - 1), SamplingParams(seed=2**64 - 1), SamplingParams(seed=-(2**63))):
        check_sampling(ok, **limit)
    assert message(check_sampling, SamplingParams(temperature=1.0, top_k=2**63), **limit) == (
        "top_k must be in [0, 2147483647] (0 = off; at or above the vocabulary size it keeps every token), "
        "got 9223372036854775808"
    )
    seed = "seed must be a 64-bit integer, signed or unsigned: in [-2**63, 2**64), got "
    assert message(check_sampling, SamplingParams(seed=2**64), **limit) == seed + "18446744073709551616"
    assert message(check_sampling, SamplingParams(seed=-(2**63) - 1), **limit) == seed + "-9223372036854775809"
    assert message(check_sampling, SamplingParams(seed=7**99), **limit) == seed + f"{str(7**99)[:20]}... (84 digits)"
    # the engine's guard is the same check
    assert message(check_generation, GenerationRequest("r", [1], SamplingParams(seed=2**64)), vocab_size=400,
                   context_length=64, max_new_tokens_limit=128, block_size=16, kv_blocks=3) == seed + str(2**64)  # fmt: skip


def test_text_must_be_valid_unicode() -> None:
    def lone(what: str, at: int, code: str = "D800") -> str:
        return f"{what}: character {at} is a lone surrogate (U+{code}), not valid Unicode text (UTF-8 cannot encode it)"

    check_text("plain \U0001f600 \ud83d\ude00".encode("utf-16", "surrogatepass").decode("utf-16"), "text")  # a pair: one char
    assert message(check_text, "ab\udfff", "text") == lone("text", 2, "DFFF")
    assert message(check_salt, "\ud800", Limits()) == lone("cache_salt", 0)
    assert message(check_input_text, TurnInput(text="x\ud800")) == lone("text", 1)
    msgs = (ChatMessage("user", "ok"), ChatMessage("user\ud800", "ok"))
    assert message(check_input_text, TurnInput(messages=msgs)) == lone("chat.messages[1].role", 4)
    msgs = (ChatMessage("user", "ok \udbff"),)
    assert message(check_turn_options, TurnInput(messages=msgs)) == lone("chat.messages[0].content", 3, "DBFF")
    assert message(check_turn_options, TurnInput(session_id="s\ud800")) == lone("session_id", 1)
    limit = dict(vocab_size=400, max_new_tokens_limit=128)
    assert message(check_sampling, SamplingParams(stop=("a", "b\ud800")), **limit) == lone("sampling.stop[1]", 1)
    # a schema's JSON text may be ASCII and still spell a lone surrogate in an escape
    schema = ResponseFormat("json_schema", '{"properties": {"a": {"enum": ["x\\ud800"]}}}')
    assert message(check_sampling, SamplingParams(response_format=schema), **limit) == lone(
        "response_format json_schema (a string in its JSON)", 1)
    pair = ResponseFormat("json_schema", '{"enum": ["\\ud83d\\ude00", "\\\\ud800"]}')  # a pair; an escaped backslash
    check_sampling(SamplingParams(response_format=pair), **limit)
    check_sampling(SamplingParams(response_format=ResponseFormat("json_schema", '["\\ud800"')), **limit)  # not JSON: the grammar's to refuse
    assert message(check_sampling, SamplingParams(response_format=ResponseFormat("regex", "a\ud800")), **limit) == lone(
        "response_format regex", 1)
