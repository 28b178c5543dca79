"""Chat messages with tools -> what the chat template renders.

Where the checkpoint's template takes them (it names ``tools``; it names ``tool_calls``),
the tools and the messages go to it as transformers' ``apply_chat_template(tools=...)``
passes them: ``tools`` as OpenAI's ``[{"type": "function", "function": {"name",
"description", "parameters"}}]``, an assistant message's calls as ``tool_calls: [{"id",
"type": "function", "function": {"name", "arguments"}}]`` (arguments as the parsed JSON
value, as vLLM passes them), a tool message with ``tool_call_id`` and ``name``.

The fallback, for a template that takes no tools (the default model's):

* the tools: on a conversation's first turn, the family's tools prompt
  (``ToolFormat.instructions``: the function signatures in ``<tools></tools>`` and how
  to call them) is the system message, after the client's own system message's text
  when the conversation starts with one;
* an assistant message's calls: appended to its content as the model writes them
  (``ToolFormat.render_calls``);
* a tool message, when the template knows no ``tool`` role: a ``user`` message whose
  content is the result in the family's wrapper (``<tool_response>...</tool_response>``
  for hermes).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from .formats import ToolFormat, arguments_value
from ..types import ChatMessage, ToolSpec


def tool_objects(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """OpenAI's tool objects (what templates iterate over)."""
    out = []
    for t in tools:
        fn: dict[str, Any] = {"name": t.name}
        if t.description:
            fn["description"] = t.description
        fn["parameters"] = json.loads(t.parameters) if t.parameters else {}
        out.append({"type": "function", "function": fn})
    return out


def template_messages(
    fmt: ToolFormat, tok: Any, messages: Sequence[ChatMessage], tools: Sequence[ToolSpec], first: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` for ``Tokenizer.encode_chat_turn``: ``first`` when the
    messages start the conversation (the fallback tools prompt goes there)."""
    takes_tools = tok.template_takes_tools
    takes_calls = tok.template_takes_tool_calls
    roles = tok.known_roles
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            if takes_calls:
                calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_value(c.arguments)}}
                         for c in m.tool_calls]  # fmt: skip
                out.append({"role": "assistant", "content": m.content, "tool_calls": calls})
            else:
                text = fmt.render_calls(m.tool_calls)
                out.append({"role": "assistant", "content": f"{m.content}\n{text}" if m.content else text})
        elif m.role == "tool" and "tool" not in roles and "ipython" not in roles:
            out.append({"role": "user", "content": fmt.render_result(m.content, m.name, m.tool_call_id)})
        elif m.role == "tool":
            d: dict[str, Any] = {"role": "tool", "content": m.content, "tool_call_id": m.tool_call_id}
            if m.name:
                d["name"] = m.name
            out.append(d)
        else:
            out.append({"role": m.role, "content": m.content})
    if not tools:
        return out, None
    objs = tool_objects(tools)
    if takes_tools:
        return out, objs
    if first:
        prompt = fmt.instructions(objs)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        elif "system" in roles:
            out.insert(0, {"role": "system", "content": prompt})
        elif out:  # no system role: the prompt leads the first message
            out[0] = {**out[0], "content": f"{prompt}\n\n{out[0]['content']}"}
    return out, None
