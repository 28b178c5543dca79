"""``ToolCalling``: the tools of one served checkpoint, for the conversation.

* ``prepare(inp)`` checks a turn's tools and tool_choice and, for ``required`` or a
  named function, sets the grammar (``ToolFormat.grammar``, compiled by
  ``service/engine/grammar.py`` as a ``ResponseFormat("lark", ...)``): the output is
  then one call (or, with ``parallel_tool_calls``, one or more) in the family's own
  format, whose arguments parse and validate against the tool's schema, whatever the
  model's weights.
* ``encode_turn(transcript, messages, tools)``: the turn's tokens, rendered by
  ``service/tools/render.py`` and ``Tokenizer.encode_chat_turn``.
* ``events(inp, events)``: the engine's events with each sequence's text run through
  the family's parser (``service/tools/parsers.py``): ``Delta.text`` becomes the
  content outside calls, ``ToolCallDelta``s carry the calls as they stream, and the
  ``Finished`` event carries the calls, the content as ``text`` and finish reason
  ``tool_calls`` when the output called tools (and was not cut by ``length``). Under
  ``tool_choice: none`` the text is left as it is.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, AsyncIterator, Sequence

from .formats import ToolFormat, arguments_value, root_type
from .parsers import Piece, ToolCallParser, fold
from .render import template_messages
from ..validation import check_text
from ..types import (
    MAX_TOOLS,
    ChatMessage,
    Delta,
    Event,
    Finished,
    FinishReason,
    InvalidRequest,
    ResponseFormat,
    ToolCallDelta,
    ToolChoice,
    TurnInput,
)

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def uses_tools(inp: TurnInput) -> bool:
    """Whether a turn has tools, a tool_choice, or tool calls or results in its messages."""
    if inp.tools or inp.tool_choice is not None:
        return True
    return any(m.tool_calls or m.role == "tool" for m in inp.messages or ())


def check_tools(inp: TurnInput) -> ToolChoice:
    """The turn's effective tool_choice; InvalidRequest for a bad combination."""
    tools = inp.tools
    choice = inp.tool_choice or ToolChoice("auto" if tools else "none")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} entries; the limit is {MAX_TOOLS}")
    names = set()
    for i, t in enumerate(tools):
        if not _NAME.fullmatch(t.name):
            raise InvalidRequest(f"tools[{i}].function.name {t.name[:80]!r} must be 1 to 64 of [A-Za-z0-9_.:-]")
        if t.name in names:
            raise InvalidRequest(f"tools[{i}].function.name {t.name!r} is defined twice")
        names.add(t.name)
        try:
            schema = json.loads(t.parameters) if t.parameters else {}
        except (ValueError, RecursionError):
            raise InvalidRequest(f"tools[{i}].function.parameters is not valid JSON") from None
        if not isinstance(schema, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        check_text(json.dumps(schema, ensure_ascii=False), f"tools[{i}].function.parameters")  # a "\ud800" escape
        kind = root_type(schema)
        if kind is not None and kind not in ("object", ["object"]):  # OpenAI's words for it
            raise InvalidRequest(f"tools[{i}].function.parameters: Invalid schema for function {t.name!r}: schema must "
                                 f"be a JSON Schema of 'type: \"object\"', got 'type: {json.dumps(kind)[:80]}' (a "
                                 f"function's arguments are an object)")  # fmt: skip
    if tools and inp.kind not in ("chat", None):
        raise InvalidRequest("tools need chat messages as input (not text or token ids)")
    if choice.kind in ("required", "function") and not tools:
        raise InvalidRequest(f"tool_choice {choice.kind} needs tools")
    if choice.kind == "function" and choice.name not in names:
        raise InvalidRequest(f"tool_choice names the function {choice.name[:80]!r}, which is not in tools")
    if choice.kind in ("required", "function"):
        s = inp.sampling
        for field, what in ((s.response_format, "response_format"), (s.stop, "stop"),
                            (s.stop_token_ids, "stop_token_ids"), (s.min_new_tokens, "min_new_tokens")):  # fmt: skip
            if field:
                raise InvalidRequest(f"{what} cannot be combined with tool_choice {choice.kind} (its grammar ends the output)")
    return choice


def check_tool_messages(messages: Sequence[ChatMessage], tools: Sequence[Any], *, continues: bool = False) -> None:
    """The tool-call bookkeeping of a turn's messages, as OpenAI checks it (InvalidRequest
    naming the message and the field):

    * an assistant's call names a function of ``tools`` (when the request has tools; a
      request without any may carry earlier calls) and its arguments are JSON;
    * a tool message answers a call of the assistant message it follows (only tool
      messages between them), by that call's id. With ``continues`` (a turn that extends
      a stored conversation with only its new messages: a gRPC session turn, a Responses
      follow-up) the tool messages that lead the input answer the previous turn's calls,
      which the request does not carry: those are not checked here (the Responses front
      checks them against the previous response's calls).

    It reads the messages only: it runs before the turn touches its session."""
    declared = {t.name for t in tools}
    answerable: set[str] | None = None if continues else set()  # None: the previous turn's calls (unknown here)
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            for j, c in enumerate(m.tool_calls):
                where = f"messages[{i}].tool_calls[{j}].function"
                if declared and c.name not in declared:
                    raise InvalidRequest(f"{where}.name: the function {c.name[:80]!r} is not in tools (a call of a "
                                         f"function the request does not declare)")  # fmt: skip
                try:
                    if c.arguments.strip():  # (blank: no arguments, as some clients send them)
                        json.loads(c.arguments)
                except (ValueError, RecursionError):
                    raise InvalidRequest(f"{where}.arguments: the arguments of call {c.id[:80]!r} are not valid JSON: "
                                         f"{c.arguments[:80]!r}") from None  # fmt: skip
            answerable = {c.id for c in m.tool_calls}
        elif m.role == "tool":
            if answerable is not None and m.tool_call_id not in answerable:
                raise InvalidRequest(f"messages[{i}].tool_call_id: {m.tool_call_id[:80]!r} answers no call of the "
                                     f"assistant message before it: a tool message must be a response to a preceding "
                                     f"message with tool_calls, naming one of its ids")  # fmt: skip
        else:
            answerable = set()


class ToolCalling:
    """See the module docstring; one per server, over the engine's tokenizer."""

    def __init__(self, tokenizer: Any, family: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.format = ToolFormat.for_tokenizer(tokenizer, family)

    @property
    def family(self) -> str:
        return self.format.family

    def prepare(self, inp: TurnInput, *, continues: bool = False) -> TurnInput:
        """``inp`` checked (its tools, tool_choice and the bookkeeping of its messages'
        calls: ``check_tool_messages``, ``continues`` as there), with the grammar of a
        required or named call set."""
        if inp.messages:
            check_tool_messages(inp.messages, inp.tools, continues=continues)
        if not inp.tools and inp.tool_choice is None:
            return inp
        choice = check_tools(inp)
        if choice.kind not in ("required", "function"):
            return inp
        tools = inp.tools if choice.kind == "required" else tuple(t for t in inp.tools if t.name == choice.name)
        grammar = self.format.grammar(tools, parallel=inp.parallel_tool_calls and choice.kind == "required")
        return dataclasses.replace(inp, sampling=dataclasses.replace(inp.sampling, response_format=ResponseFormat("lark", grammar)))

    def template_messages(self, messages: Sequence[ChatMessage], tools: Sequence[Any], first: bool
                          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:  # fmt: skip
        return template_messages(self.format, self.tokenizer, messages, tools, first)

    def encode_turn(self, transcript: Sequence[int], messages: Sequence[ChatMessage], tools: Sequence[Any] = ()) -> list[int]:
        """The tokens of a chat turn (``ChatTemplateError`` from the template)."""
        msgs, objs = self.template_messages(messages, tools, first=not transcript)
        return self.tokenizer.encode_chat_turn(list(transcript), msgs, tools=objs)

    def turn_encoder(self, tools: Sequence[Any]) -> TurnEncoder:
        """What history matching (service/http/app.py) encodes a request's messages with."""
        return TurnEncoder(self, tools)

    def parsing(self, inp: TurnInput) -> bool:
        """Whether the turn's output is read for calls."""
        return bool(inp.tools) and (inp.tool_choice is None or inp.tool_choice.kind != "none")

    async def events(self, inp: TurnInput, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """The turn's events with calls parsed out (see the module docstring)."""
        parse = self.parsed(inp)
        async for ev in events:
            for out in parse.feed(ev) if parse is not None else (ev,):
                yield out

    def parsed(self, inp: TurnInput) -> ToolEvents | None:
        """What parses the calls out of the turn's events, one at a time (``ToolEvents.feed``);
        None when its output is not read for calls."""
        return ToolEvents(self.format, inp) if self.parsing(inp) else None


class ToolEvents:
    """A turn's events with calls parsed out, fed one at a time: each ``Delta`` without its
    calls' text and with a ``ToolCallDelta`` per piece of a call, each completed
    ``Finished`` with its text, its calls and ``TOOL_CALLS`` as its reason when it stopped
    on calls (``ToolCalling.events``)."""

    def __init__(self, fmt: ToolFormat, inp: TurnInput) -> None:
        self.parsers: dict[int, ToolCallParser] = {}
        self.seen: dict[int, list[Piece]] = {}
        self.limit = 1 if not inp.parallel_tool_calls else None
        self.for_parser = fmt.parser

    def feed(self, ev: Event) -> list[Event]:
        """What ``ev`` becomes."""
        out: list[Event] = []
        if isinstance(ev, Delta):
            p = self.parsers.get(ev.index) or self.parsers.setdefault(ev.index, self.for_parser())
            pieces = _limit(p.push(ev.text), self.limit)
            self.seen.setdefault(ev.index, []).extend(pieces)
            out.append(Delta(ev.token_ids, "".join(x for x in pieces if isinstance(x, str)), ev.logprobs, ev.index))
            out.extend(self._calls(pieces, ev.index))
        elif isinstance(ev, Finished) and ev.finish_reason not in (FinishReason.ERROR, FinishReason.CANCELLED):
            p = self.parsers.pop(ev.index, None) or self.for_parser()
            pieces = _limit(p.finish(), self.limit)
            tail = "".join(x for x in pieces if isinstance(x, str))
            if tail:
                out.append(Delta([], tail, [], ev.index))
            out.extend(self._calls(pieces, ev.index))
            content, calls = fold(self.seen.pop(ev.index, []) + pieces)
            reason = FinishReason.TOOL_CALLS if calls and ev.finish_reason == FinishReason.STOP else ev.finish_reason
            out.append(dataclasses.replace(ev, text=content, tool_calls=tuple(calls), finish_reason=reason))
        else:
            out.append(ev)
        return out

    @staticmethod
    def _calls(pieces: list[Piece], index: int) -> list[ToolCallDelta]:
        calls = [x for x in pieces if isinstance(x, ToolCallDelta)]
        for x in calls:
            x.index = index
        return calls


class TurnEncoder:
    """The tokenizer as history matching uses it, with messages rendered as the
    conversation renders a turn with ``tools`` (``encode_messages``)."""

    def __init__(self, calling: ToolCalling, tools: Sequence[Any]) -> None:
        self._calling, self._tools = calling, tuple(tools)
        tok = calling.tokenizer
        self.eos_token_ids = tok.eos_token_ids
        self.decode = tok.decode
        self.encode_chat_turn = tok.encode_chat_turn

    def encode_messages(self, transcript: Sequence[int], messages: Sequence[ChatMessage]) -> list[int]:
        return self._calling.encode_turn(transcript, messages, self._tools)

    def reply_matches(self, ids: Sequence[int], message: ChatMessage) -> bool:
        """Whether generated ``ids`` are the assistant ``message``: the same calls (names,
        arguments as JSON values, in order) and text that begins with its content."""
        text = self.decode(ids)
        content, calls = self._calling.format.parser().parse(text)
        want = [(c.name, arguments_value(c.arguments)) for c in message.tool_calls]
        if want != [(c.name, arguments_value(c.arguments)) for c in calls]:
            return False
        if content.strip().startswith(message.content.strip()):
            return True
        return not want and text.strip().startswith(message.content.strip())  # a reply that was not parsed (none)


def _limit(pieces: list[Piece], limit: int | None) -> list[Piece]:
    """Without parallel_tool_calls only the first call is kept."""
    if limit is None:
        return pieces
    return [p for p in pieces if isinstance(p, str) or p.call_index < limit]
