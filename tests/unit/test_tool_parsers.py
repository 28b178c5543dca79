"""Tool-call parsers on recorded texts of each format (service/tools/parsers.py): the
whole text at once, and streamed split at every byte boundary (an incremental UTF-8
decoder in between, as the detokenizer streams), give the same content and calls; the
streamed pieces are OpenAI's order (id and name first, then argument fragments)."""

from __future__ import annotations

import codecs
import itertools
import json

import pytest

from kvserve.service.tools import PARSERS, ToolCalling, fold
from kvserve.service.tools.formats import ToolFormat, detect
from kvserve.service.types import ToolCall, ToolCallDelta, ToolSpec

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"tz": "Europe/Zürich"}'

# (family, model output, expected content, expected calls [(name, arguments JSON value)])
RECORDED = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', "",
     [("get_weather", WEATHER)]),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
     f'<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>', "Let me check.",
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("hermes", "No tools needed: 2 < 3 and <b>bold</b> é.", "No tools needed: 2 < 3 and <b>bold</b> é.", []),
    ("hermes", '<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', "",
     [("search", '{"q": "x"}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "", [("f", '{"a": 1}')]),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "get_time", "arguments": {TIME}}}]',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", f"Sure.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}", "Sure.",
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("mistral", "Plain [brackets] and [TOOL text.", "Plain [brackets] and [TOOL text.", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "get_time", "arguments": {TIME}}}',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", "The weather in Paris is {mild}.", "The weather in Paris is {mild}.", []),
    ("llama3_json", '{"answer": 42, "name_like": "x"}', '{"answer": 42, "name_like": "x"}', []),
]


def _ids() -> itertools.count:
    return itertools.count()


def _parse_whole(family: str, text: str) -> tuple[str, list[ToolCall]]:
    n = _ids()
    return PARSERS[family](lambda: f"id{next(n)}").parse(text)


def _streamed(family: str, data: bytes, cuts: tuple[int, ...]) -> list:
    n = _ids()
    p = PARSERS[family](lambda: f"id{next(n)}")
    dec = codecs.getincrementaldecoder("utf-8")()
    pieces = []
    prev = 0
    for c in cuts + (len(data),):
        pieces += p.push(dec.decode(data[prev:c]))
        prev = c
    pieces += p.push(dec.decode(b"", final=True))
    return pieces + p.finish()


def _check(calls: list[ToolCall], want: list[tuple[str, str]]) -> None:
    assert [c.name for c in calls] == [w[0] for w in want]
    for c, (_, args) in zip(calls, want):
        assert json.loads(c.arguments) == json.loads(args)
    assert [c.id for c in calls] == [f"id{i}" for i in range(len(calls))]


@pytest.mark.parametrize("family,text,content,calls", RECORDED)
def test_whole_text(family: str, text: str, content: str, calls: list) -> None:
    got_content, got_calls = _parse_whole(family, text)
    assert got_content == content
    _check(got_calls, calls)


@pytest.mark.parametrize("family,text,content,calls", RECORDED)
def test_split_at_every_byte_boundary(family: str, text: str, content: str, calls: list) -> None:
    data = text.encode()
    whole = _parse_whole(family, text)
    for cut in range(1, len(data)):
        assert fold(_streamed(family, data, (cut,))) == whole, f"split at byte {cut}"
    one_by_one = _streamed(family, data, tuple(range(1, len(data))))
    assert fold(one_by_one) == whole


@pytest.mark.parametrize("family,text,content,calls", [r for r in RECORDED if r[3]])
def test_streamed_pieces_come_in_openai_order(family: str, text: str, content: str, calls: list) -> None:
    data = text.encode()
    pieces = _streamed(family, data, tuple(range(1, len(data))))
    deltas = [p for p in pieces if isinstance(p, ToolCallDelta)]
    seen: set[int] = set()
    for d in deltas:
        if d.call_index not in seen:  # the first piece of a call: its id and name
            assert d.id and d.name, d
            seen.add(d.call_index)
        else:
            assert not d.id and not d.name and d.arguments
    assert sorted(seen) == list(range(len(calls)))
    assert [d.call_index for d in deltas] == sorted(d.call_index for d in deltas)  # calls one after another
    # arguments written after the name as an object arrive in fragments while streaming
    if '{"arguments"' not in text and '"arguments": "' not in text:
        assert max(sum(1 for d in deltas if d.call_index == i) for i in seen) > 2


def test_a_call_cut_short_keeps_what_was_written() -> None:
    content, calls = _parse_whole("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "" and calls[0].name == "get_weather" and calls[0].arguments == '{"city": "Pa'


def test_a_held_marker_prefix_that_is_not_a_marker_is_content() -> None:
    assert _parse_whole("hermes", "a <tool") == ("a <tool", [])
    assert _parse_whole("mistral", "x [TOOL_CALL") == ("x [TOOL_CALL", [])


@pytest.mark.parametrize("family", sorted(PARSERS))
def test_rendered_calls_parse_back(family: str) -> None:
    """What the fallback rendering writes for a call is what the parser reads."""
    calls = [ToolCall("a", "get_weather", WEATHER), ToolCall("b", "get_time", TIME)]
    for named in (False, True) if family == "mistral" else (False,):
        text = ToolFormat(family, mistral_named=named).render_calls(calls)
        content, got = _parse_whole(family, text)
        assert content == ""
        _check(got, [(c.name, c.arguments) for c in calls])


class _Tok:
    def __init__(self, template: str = "", vocab: tuple[str, ...] = ()) -> None:
        self.chat_template, self.vocab = template, vocab

    def token_to_id(self, t: str) -> int | None:
        return self.vocab.index(t) if t in self.vocab else None


def test_family_detection_from_template_and_vocabulary() -> None:
    assert detect(_Tok(vocab=("[TOOL_CALLS]",))) == "mistral"
    assert detect(_Tok("{{ '<tool_call>' }}")) == "hermes"
    assert detect(_Tok(vocab=("<|python_tag|>",))) == "llama3_json"
    assert detect(_Tok("{% if message.role == 'ipython' %}")) == "llama3_json"
    assert detect(_Tok("{{ messages }}")) == "hermes"  # nothing names a format: the fallback's


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city"]}


@pytest.fixture(scope="module")
def default_tok():
    from pathlib import Path

    from kvserve.service.models.tokenizer import Tokenizer

    return Tokenizer.from_dir(Path(__file__).resolve().parents[2] / "service" / "default_model")


@pytest.mark.parametrize("family,named", [("hermes", False), ("mistral", False), ("mistral", True), ("llama3_json", False)])
def test_grammar_accepts_the_family_format_and_refuses_other_arguments(default_tok, family: str, named: bool) -> None:
    """A required call's grammar (llguidance lark) accepts the family's own rendering of
    calls whose arguments fit the schema, and refuses arguments that do not."""
    import llguidance

    from kvserve.service.engine.grammar import GrammarCompiler

    tools = [ToolSpec("get_weather", "", json.dumps(SCHEMA)), ToolSpec("get_time", "", "{}")]
    fmt = ToolFormat(family, mistral_named=named)
    gc = GrammarCompiler(default_tok, default_tok.eos_token_ids)

    def accepts(text: str, parallel: bool) -> bool:
        from kvserve.service.types import ResponseFormat

        m = gc.matcher(ResponseFormat("lark", fmt.grammar(tools, parallel)))
        for t in default_tok.encode_plain(text):
            if not m.consume_token(t):
                return False
        return m.is_accepting()

    one = [ToolCall("a", "get_weather", '{"city": "Paris", "unit": "celsius"}')]
    two = one + [ToolCall("b", "get_time", '{"tz": "UTC"}')]
    assert accepts(fmt.render_calls(one), parallel=False)
    assert accepts(fmt.render_calls(two), parallel=True)
    assert not accepts(fmt.render_calls(two), parallel=False)  # parallel_tool_calls false: one call
    assert not accepts(fmt.render_calls([ToolCall("a", "get_weather", '{"unit": "celsius"}')]), parallel=True)  # city missing
    assert not accepts(fmt.render_calls([ToolCall("a", "nope", "{}")]), parallel=True)  # not a tool
