"""Tool calling (OpenAI's ``tools``): definitions rendered through the chat template or
the fallback (``render``), tool-call parsers per model family (``parsers``), the family
of a checkpoint and its call format (``formats``), tool_choice -> grammar and the event
stream with calls parsed out (``calling``). Pure Python; no torch, no gRPC."""

from .calling import ToolCalling, check_tool_messages, check_tools, uses_tools
from .formats import FAMILIES, ToolFormat, detect
from .parsers import PARSERS, ToolCallParser, fold

__all__ = ["FAMILIES", "PARSERS", "ToolCallParser", "ToolCalling", "ToolFormat", "check_tool_messages", "check_tools", "detect", "fold", "uses_tools"]
