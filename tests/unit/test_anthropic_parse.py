"""service/http/anthropic.py's parsing, pure: a Messages request as chat messages and
tool bookkeeping, and its cache_control breakpoints as the one retention it asks for."""

from __future__ import annotations

import pytest

from kvserve.service.http.anthropic import parse
from kvserve.service.http.openai import HttpError
from kvserve.service.types import ToolChoice

CC_1H = {"type": "ephemeral", "ttl": "1h"}


def body(**kw):
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_blocks_become_chat_messages():
    req = parse(body(system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "w", "input": {"c": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "down", "is_error": True},
                                     {"type": "text", "text": "Retry?"}]},
    ], tools=[{"name": "w", "input_schema": {"type": "object"}}], tool_choice={"type": "any"}))  # fmt: skip
    m = req.inp.messages
    assert [x.role for x in m] == ["system", "user", "assistant", "tool", "user"]
    assert m[2].content == "Checking." and m[2].tool_calls[0].arguments == '{"c": "Oslo"}'
    assert (m[3].content, m[3].tool_call_id, m[3].name) == ("Error: down", "t1", "w")
    assert req.inp.tool_choice == ToolChoice("required") and req.breakpoint is None


def test_the_last_breakpoint_with_the_longest_ttl():
    req = parse(body(system=[{"type": "text", "text": "S", "cache_control": CC_1H}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "b"}]}]))  # fmt: skip
    bp = req.breakpoint
    assert (bp.part, bp.index, bp.block, bp.ttl_s, bp.last) == ("messages", 0, 0, 3600.0, False)
    assert parse(body(cache_control={"type": "ephemeral"})).breakpoint.last  # top level: the last block


@pytest.mark.parametrize("bad, words", [
    (body(cache_control={"type": "ephemeral", "ttl": "2h"}), "ttl"),
    (body(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": CC_1H}] * 5}]),
     "maximum of 4"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens: Field required"),
    (body(temperature=1.5), "temperature"),
    (body(frequency_penalty=1), "frequency_penalty"),
])  # fmt: skip
def test_refused(bad, words):
    with pytest.raises(HttpError, match=words) as e:
        parse(bad)
    assert e.value.status == 400
