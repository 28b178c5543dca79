"""A turn's input as the model reads it, over the engine's tokenizer (``Prompts``): text
through the tokenizer's text turn, chat messages through its chat template (tool calls,
results and the tools rendered by ``service/tools``), token ids as they are
(``input_tokens``); the most bytes of text one token covers (``max_bytes_per_token``),
the bound that lets a turn refuse input that cannot fit before it is tokenized
(``validation.check_prompt``); and each token's text and bytes for logprobs
(``token_pieces``).

``Conversations.prepare`` hands ``input_tokens`` to ``validation.check_prompt``, which
calls it between the input's size check and the prompt's checks, in a worker thread
(a long text takes a while to tokenize).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .models.tokenizer import ChatTemplateError
from .tools import ToolCalling, uses_tools
from .types import InvalidRequest, TurnInput

if TYPE_CHECKING:
    from .engine import AsyncEngine


class Prompts:
    """The tokenizer's side of a turn (see the module docstring)."""

    def __init__(self, engine: AsyncEngine, tool_call_parser: str = "auto") -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        self._tools: ToolCalling | None = None
        self._max_bytes_per_token: int | None = None
        self._piece_bytes: list[bytes] | None = None  # token_pieces: sentencepiece's bytes per id, once

    @property
    def tools(self) -> ToolCalling:
        """Tool calling over the engine's tokenizer (``service/tools``), built on first use."""
        if self._tools is None or self._tools.tokenizer is not self.engine.tokenizer:
            self._tools = ToolCalling(self.engine.tokenizer, self.tool_call_parser)
        return self._tools

    def input_tokens(self, inp: TurnInput, transcript: list[int]) -> list[int]:
        """The new input as token ids (appended to ``transcript``); an empty one refused."""
        tok = self.engine.tokenizer
        if inp.text is not None:
            if not inp.text:
                raise InvalidRequest("empty input: text is empty")
            return tok.encode_text_turn(transcript, inp.text)
        if inp.messages is not None:
            if not inp.messages:
                raise InvalidRequest("empty input: chat.messages is empty")
            if uses_tools(inp):  # tool calls and results, the tools: service/tools renders them
                msgs, tools = self.tools.template_messages(inp.messages, inp.tools, first=not transcript)
            else:
                msgs, tools = [{"role": m.role, "content": m.content} for m in inp.messages], None
            try:
                return tok.encode_chat_turn(transcript, msgs, tools=tools)
            except ChatTemplateError as e:
                raise InvalidRequest(str(e)) from None
        if inp.token_ids is None:
            raise InvalidRequest("empty input: set one of text, chat or tokens")
        ids = list(inp.token_ids)
        if not ids:
            raise InvalidRequest("empty input: tokens.ids is empty")
        return ids  # checked against the vocabulary with the prompt (check_prompt)

    @property
    def bytes_per_token_known(self) -> int | None:
        """``max_bytes_per_token`` once computed (None before: it reads the whole vocabulary)."""
        return self._max_bytes_per_token

    def max_bytes_per_token(self) -> int:
        """An upper bound on the bytes of text one token covers: twice the longest
        decoded vocabulary entry plus one (a leading space a decoder drops, text that
        normalization shortens). Computed once."""
        if self._max_bytes_per_token is None:
            tok = self.engine.tokenizer
            n = int(getattr(tok, "vocab_size", 0) or self.engine.model_info.vocab_size)
            longest = 1
            for i in range(n):
                try:
                    longest = max(longest, len(tok.decode([i]).encode("utf-8", "surrogatepass")))
                except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode alone
                    continue
            self._max_bytes_per_token = 2 * (longest + 1)
        return self._max_bytes_per_token

    def token_pieces(self, ids: Sequence[int]) -> list[tuple[str, bytes]]:
        """Each token's text and bytes as it appears in decoded text (logprobs): a
        sentencepiece piece's own bytes (its leading space, a byte piece's one byte),
        else the token decoded alone."""
        tok = self.engine.tokenizer
        if self._piece_bytes is None:
            try:
                self._piece_bytes = tok.token_bytes()[0]
            except Exception:  # noqa: BLE001 - not sentencepiece: decode tokens alone
                self._piece_bytes = []
        out = []
        for i in ids:
            raw = self._piece_bytes[i] if i < len(self._piece_bytes) else tok.decode([i]).encode("utf-8", "replace")
            out.append((raw.decode("utf-8", "replace"), raw))
        return out
