"""kvserve.clients.build_request: the request built from a ``RequestOptions`` is the one the
same keywords build, keywords given with options win, and the checks hold either way."""

import dataclasses

import pytest

from kvserve.clients import RequestOptions, build_request

FIELDS = dict(
    messages=[("system", "be brief"), {"role": "user", "content": "hi"}], session_id="s1", cache_salt="salt",
    max_new_tokens=7, temperature=0.5, top_k=4, top_p=0.9, seed=3, stop=["END"], stop_token_ids=[2],
    logit_bias={5: -1.0}, min_new_tokens=1, logprobs=True, top_logprobs=2, require_existing_session=True,
    turn_mode="edit", expected_turns=2, n=2, regex="[a-z]+", tools=[{"name": "f", "parameters": {}}],
    tool_choice="f", parallel_tool_calls=False, speculative=True, speculative_max_draft=3,
)


def test_options_build_what_the_same_keywords_build():
    by_keywords = build_request(**FIELDS)
    assert build_request(RequestOptions(**FIELDS)) == by_keywords
    assert by_keywords.sampling.top_k == 4 and by_keywords.sampling.response_format.regex == "[a-z]+"
    assert [m.role for m in by_keywords.chat.messages] == ["system", "user"]
    assert by_keywords.tool_choice.function_name == "f" and by_keywords.expected_turns == 2


def test_keywords_override_the_options_and_unknown_ones_are_refused():
    base = RequestOptions(text="a", max_new_tokens=5, session_id="s")
    req = build_request(base, text=None, token_ids=[1, 2], max_new_tokens=9)
    assert req.tokens.ids == [1, 2] and req.sampling.max_new_tokens == 9 and req.session_id == "s"
    assert base.text == "a"  # the options are not changed
    assert build_request(dataclasses.replace(base, temperature=0.3)).sampling.temperature == pytest.approx(0.3)
    with pytest.raises(TypeError, match="max_tokens"):
        build_request(text="a", max_tokens=3)


def test_the_checks_hold_for_options_too():
    with pytest.raises(ValueError, match="exactly one of text, messages, token_ids"):
        build_request(RequestOptions(text="a", token_ids=[1]))
    with pytest.raises(ValueError, match="takes no input"):
        build_request(RequestOptions(text="a"), turn_mode="regenerate")
    with pytest.raises(ValueError, match="at most one of json_schema, json_object, regex"):
        build_request(RequestOptions(text="a", json_object=True, regex="x"))
