"""Tool-call parsers: a model's output text -> content and tool calls, incrementally.

One parser per output sequence. ``push(text)`` takes the next piece of decoded text and
returns what is now certain, in order: content text (``str``) and ``ToolCallDelta``s
(the first of a call carries its id and name, the next ones argument text); ``finish()``
returns the rest at the end of the output. The whole result does not depend on how the
text was split: ``fold`` of the pieces of one push of the whole text equals that of any
split (tests/unit/test_tool_parsers.py splits recorded texts at every byte boundary).

Formats (``service/tools/formats.py`` picks one per checkpoint):

* ``hermes`` (Hermes, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, after optional content.
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects
  (v3 tokenizers), or ``[TOOL_CALLS]name[ARGS]{...}`` per call (v11 and later).
* ``llama3_json`` (Llama 3.1 / 3.2 JSON calls): the whole reply is ``{"name": ...,
  "parameters": {...}}`` (``arguments`` accepted too), optionally after
  ``<|python_tag|>``, several separated by ``;``. A reply that does not start with
  ``{`` (or the tag) is content; one that starts so but is not a call is content too
  (held until that is known).

Arguments stream as the model writes them (the raw JSON text of the value); a call
whose arguments are a JSON string (some models encode them) gets the decoded string.
A block that turns out not to be a call (no ``name``) is content, verbatim.
"""

from __future__ import annotations

import json
from typing import Callable, Iterable, Union

from ..types import ToolCall, ToolCallDelta

Piece = Union[str, ToolCallDelta]
_WS = " \t\r\n"


def fold(pieces: Iterable[Piece]) -> tuple[str, list[ToolCall]]:
    """The content text and the complete calls of a parser's pieces."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for p in pieces:
        if isinstance(p, str):
            content.append(p)
        elif p.name or p.call_index not in calls:
            calls[p.call_index] = [p.id, p.name, p.arguments]
        else:
            calls[p.call_index][2] += p.arguments
    return "".join(content), [ToolCall(i, n, a) for _, (i, n, a) in sorted(calls.items())]


class _Value:
    """Finds where one JSON value ends, fed a character at a time (no validation
    beyond nesting and strings)."""

    __slots__ = ("raw", "depth", "in_str", "esc", "done", "started", "kind")

    def __init__(self) -> None:
        self.raw = ""  # the value's text so far (leading whitespace skipped)
        self.depth = 0
        self.in_str = self.esc = self.done = self.started = False
        self.kind = ""  # the first character: '{', '[', '"' or a primitive's

    def feed(self, ch: str) -> bool:
        """Take ``ch``; False when it is not part of the value (the value ended before it)."""
        if self.done:
            return False
        if not self.started:
            if ch in _WS:
                return True
            self.started, self.kind = True, ch
        if self.kind not in '{["':  # a number, true, false, null: ends at a delimiter
            if ch in ",}]" + _WS:
                self.done = True
                return False
            self.raw += ch
            return True
        self.raw += ch
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 0:
                    self.done = True
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True
        return True

    def end(self) -> None:
        """No more text: a primitive ends here."""
        if self.started and self.kind not in '{["':
            self.done = True


class _CallObject:
    """One call object ``{"name": ..., "arguments": ...}`` fed a character at a time:
    the name once its string is complete, the arguments' raw text as it grows."""

    def __init__(self, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.raw = ""  # every character fed (the verbatim text, for a block that is no call)
        self.state = "start"  # start, key, colon, value, comma, done
        self.key = _Value()
        self.value: _Value | None = None
        self.value_key = ""
        self.name: str | None = None
        self.args: _Value | None = None
        self.done = False
        self.bad = False  # not an object of this shape

    def feed(self, ch: str) -> bool:
        """False when ``ch`` is past the object's end (the object is done)."""
        if self.done:
            return False
        self.raw += ch
        st = self.state
        if st == "start":
            if ch in _WS:
                return True
            if ch != "{":
                self.bad = True
            self.state = "key"
            return True
        if st == "key":
            if not self.key.started and ch in _WS:
                return True
            if not self.key.started and ch == "}":
                self.state, self.done = "done", True
                return True
            self.key.feed(ch)
            if self.key.kind != '"':
                self.bad = True
            if self.key.done:
                self.state = "colon"
            return True
        if st == "colon":
            if ch in _WS:
                return True
            if ch != ":":
                self.bad = True
            try:
                self.value_key = json.loads(self.key.raw)
            except ValueError:
                self.bad, self.value_key = True, ""
            self.value = _Value()
            if self.value_key in self.args_keys and self.args is None:
                self.args = self.value
            self.state = "value"
            return True
        if st == "value":
            assert self.value is not None
            if self.value.feed(ch):
                if self.value.done:
                    self._value_done()
                return True
            self._value_done()  # a primitive ended at ch: ch is a delimiter
            return self._after_value(ch)
        if st == "comma":
            return self._after_value(ch)
        return False

    def _value_done(self) -> None:
        v = self.value
        assert v is not None
        if self.value_key == "name" and self.name is None:
            try:
                name = json.loads(v.raw)
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
            else:
                self.bad = True
        self.key = _Value()
        self.state = "comma"

    def _after_value(self, ch: str) -> bool:
        if ch in _WS:
            return True
        if ch == ",":
            self.state = "key"
        elif ch == "}":
            self.state, self.done = "done", True
        else:
            self.bad = True
            self.state = "key"
        return True

    def end(self) -> None:
        if self.state == "value" and self.value is not None:
            self.value.end()
            if self.value.done:
                self._value_done()


class _CallEmitter:
    """Turns a growing call (name, raw arguments) into ToolCallDeltas."""

    def __init__(self, index: int, new_id: Callable[[], str]) -> None:
        self.index = index
        self.new_id = new_id
        self.started = False
        self.sent = 0  # argument characters sent
        self.string_args = False

    def update(self, name: str | None, args: _Value | None, final: bool) -> list[Piece]:
        out: list[Piece] = []
        if name is None:
            return out
        if not self.started:
            self.started = True
            out.append(ToolCallDelta(self.index, self.new_id(), name, ""))
        if args is None or not args.started:
            if final and self.sent == 0:
                out.append(ToolCallDelta(self.index, arguments="{}"))
                self.sent = 2
            return out
        if args.kind == '"':  # JSON-encoded arguments: sent decoded, once complete
            if args.done and not self.sent:
                try:
                    text = json.loads(args.raw)
                except ValueError:
                    text = args.raw
                out.append(ToolCallDelta(self.index, arguments=text if isinstance(text, str) else args.raw))
                self.sent = max(1, len(args.raw))
            return out
        if len(args.raw) > self.sent:
            out.append(ToolCallDelta(self.index, arguments=args.raw[self.sent :]))
            self.sent = len(args.raw)
        return out


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolCallParser:
    """Base: content handling (whitespace between and after calls is dropped)."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.calls = 0  # calls begun
        self._ws = ""  # held whitespace-only content

    def _content(self, text: str) -> list[Piece]:
        """Content, its trailing whitespace held: dropped where a call follows (and at the
        end of a reply that made calls), sent when more content follows."""
        if not text:
            return []
        body = text.rstrip(_WS)
        if not body:
            self._ws += text
            return []
        out, self._ws = self._ws + body, text[len(body) :]
        return [out]

    def _call_begins(self) -> None:
        self._ws = ""

    def _end_content(self) -> list[Piece]:
        ws, self._ws = self._ws, ""
        return [ws] if ws and not self.calls else []  # (a reply of only whitespace stays as it is)

    def push(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return fold(self.push(text) + self.finish())


class HermesParser(ToolCallParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._buf = ""  # content not yet sent (a possible start of OPEN)
        self._obj: _CallObject | None = None
        self._emit: _CallEmitter | None = None
        self._tail = ""  # text after the object, before CLOSE

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for ch in text:
            out += self._feed(ch)
        if self._obj is None and self._buf:
            keep = _held_prefix(self._buf, self.OPEN)
            out += self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
        return out

    def _feed(self, ch: str) -> list[Piece]:
        if self._obj is None:
            self._buf += ch
            if self._buf.endswith(self.OPEN):
                out = self._content(self._buf[: -len(self.OPEN)])
                self._call_begins()
                self._buf = ""
                self._obj, self._tail = _CallObject(("arguments", "parameters")), ""
                self._emit = _CallEmitter(self.calls, self.new_id)
                return out
            return []
        obj, emit = self._obj, self._emit
        assert emit is not None
        if not obj.done and not obj.bad:
            obj.feed(ch)
            return emit.update(obj.name, obj.args, final=False) if not obj.bad else []
        self._tail += ch
        if self._tail.endswith(self.CLOSE):
            return self._close()
        return []

    def _close(self) -> list[Piece]:
        obj, emit = self._obj, self._emit
        assert obj is not None and emit is not None
        self._obj = self._emit = None
        obj.end()
        tail = self._tail[: -len(self.CLOSE)] if self._tail.endswith(self.CLOSE) else self._tail
        if obj.name is not None and not obj.bad or emit.started:
            out = emit.update(obj.name, obj.args, final=True)
            self.calls += 1
            return out
        verbatim = self.OPEN + obj.raw + tail + (self.CLOSE if self._tail.endswith(self.CLOSE) else "")
        return self._content(verbatim)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._obj is not None:
            out += self._close()
        elif self._buf:
            out += self._content(self._buf)
            self._buf = ""
        return out + self._end_content()


class MistralParser(ToolCallParser):
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._buf = ""
        self._mode = "content"  # content, after (the marker seen), array, named_name, named_args
        self._value: _Value | None = None  # array: the array; named_args: the arguments
        self._obj: _CallObject | None = None
        self._emit: _CallEmitter | None = None
        self._name = ""
        self._raw = ""  # text since the marker (content verbatim if it is no call)

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for ch in text:
            out += self._feed(ch)
        if self._mode == "content" and self._buf:
            keep = _held_prefix(self._buf, self.MARK)
            out += self._content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
        return out

    def _start_call(self) -> None:
        self._emit = _CallEmitter(self.calls, self.new_id)

    def _feed(self, ch: str) -> list[Piece]:
        mode = self._mode
        if mode == "content":
            self._buf += ch
            if self._buf.endswith(self.MARK):
                out = self._content(self._buf[: -len(self.MARK)])
                self._call_begins()
                self._buf, self._mode, self._raw = "", "after", ""
                return out
            return []
        self._raw += ch
        if mode == "after":
            if ch in _WS:
                return []
            if ch == "[":
                self._mode, self._obj = "array", None
                return []
            self._mode, self._name = "named_name", ch
            return []
        if mode == "named_name":
            self._name += ch
            if self._name.endswith(self.ARGS):
                self._name = self._name[: -len(self.ARGS)].strip()
                self._mode, self._value = "named_args", _Value()
                self._start_call()
                assert self._emit is not None
                return self._emit.update(self._name or None, self._value, final=False)
            return []
        if mode == "named_args":
            v, emit = self._value, self._emit
            assert v is not None and emit is not None
            if v.feed(ch):
                out = emit.update(self._name or None, v, final=False)
                if v.done:
                    out += emit.update(self._name or None, v, final=True)
                    self.calls += 1
                    self._mode = "named_next"
                return out
            self._mode = "named_next"
            return self._feed_next(ch)
        if mode == "named_next":
            return self._feed_next(ch)
        if mode == "array":
            return self._feed_array(ch)
        return []

    def _feed_next(self, ch: str) -> list[Piece]:
        """After a named call: whitespace, or the next [TOOL_CALLS]."""
        self._buf += ch
        if self._buf.endswith(self.MARK):
            self._buf, self._mode = "", "after"
        return []

    def _feed_array(self, ch: str) -> list[Piece]:
        if self._obj is None:
            if ch in _WS + ",":
                return []
            if ch == "]":
                self._mode = "named_next"  # the array ended; another marker may follow
                return []
            self._obj = _CallObject(("arguments", "parameters"))
            self._start_call()
        obj, emit = self._obj, self._emit
        assert emit is not None
        obj.feed(ch)
        if obj.bad:
            return []
        out = emit.update(obj.name, obj.args, final=False)
        if obj.done:
            out += emit.update(obj.name, obj.args, final=True)
            if emit.started:
                self.calls += 1
            self._obj = None
        return out

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "content":
            out += self._content(self._buf)
            self._buf = ""
        elif self._mode == "named_args" and self._emit is not None and self._value is not None:
            self._value.end()
            out += self._emit.update(self._name or None, self._value, final=True)
            self.calls += 1
        elif self._mode == "array" and self._obj is not None and self._emit is not None:
            self._obj.end()
            if self._emit.started:
                out += self._emit.update(self._obj.name, self._obj.args, final=True)
                self.calls += 1
        elif self._mode in ("after", "named_name") or (self._mode == "array" and not self.calls):
            out += self._content(self.MARK + self._raw)  # a marker with no call after it
        return out + self._end_content()


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self._mode = "start"  # start, content, calls
        self._lead = ""  # text before deciding
        self._obj: _CallObject | None = None
        self._emit: _CallEmitter | None = None
        self._held: list[Piece] = []  # while the first object may still turn out not to be a call
        self._raw = ""  # everything since the reply began (content if it is no call)

    def push(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for ch in text:
            out += self._feed(ch)
        return out

    def _feed(self, ch: str) -> list[Piece]:
        if self._mode == "content":
            return self._content(ch)
        self._raw += ch
        if self._mode == "start":
            self._lead += ch
            lead = self._lead.lstrip(_WS)
            if not lead or self.TAG.startswith(lead):
                return []
            if lead.startswith(self.TAG):
                lead = lead[len(self.TAG) :].lstrip(_WS)
                if not lead:
                    return []
            if lead[0] != "{":
                self._mode = "content"
                raw, self._raw = self._raw, ""
                return self._content(raw)
            self._mode = "calls"
            out: list[Piece] = []
            for c in lead:
                out += self._feed_calls(c)
            return out
        return self._feed_calls(ch)

    def _feed_calls(self, ch: str) -> list[Piece]:
        if self._obj is None:
            if ch in _WS + ";":
                return []
            self._obj = _CallObject(("parameters", "arguments"))
            self._emit = _CallEmitter(self.calls, self.new_id)
        obj, emit = self._obj, self._emit
        assert emit is not None
        obj.feed(ch)
        if obj.bad and not emit.started:
            return self._not_calls()
        out = emit.update(obj.name, obj.args, final=False) if not obj.bad else []
        if obj.done:
            out += emit.update(obj.name, obj.args, final=True)
            if not emit.started:
                return self._not_calls()
            self.calls += 1
            self._obj = None
        return self._release(out)

    def _release(self, out: list[Piece]) -> list[Piece]:
        return out

    def _not_calls(self) -> list[Piece]:
        """The reply is not a call after all: all of it is content (only before a call began)."""
        if self.calls:
            return []  # text after complete calls that is no call: dropped
        self._mode, self._obj = "content", None
        raw, self._raw = self._raw, ""
        return self._content(raw)

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._mode == "start":
            out += self._content(self._raw)
        elif self._mode == "calls" and self._obj is not None and self._emit is not None:
            self._obj.end()
            if self._emit.started:
                out += self._emit.update(self._obj.name, self._obj.args, final=True)
                self.calls += 1
            elif not self.calls:
                out += self._not_calls()
        return out + self._end_content()


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "mistral": MistralParser,
    "llama3_json": Llama3JsonParser,
}
