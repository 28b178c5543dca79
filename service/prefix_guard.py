"""Prefix guards: an agent client's request made to keep hitting the prefix cache.

A coding agent may put a block in its system prompt that changes on every request (a
billing or tracing header with a per-request value). The system prompt comes first in
the rendered prompt, so one changed character there misses every cached block after it:
the whole conversation is recomputed each turn. ``VolatileSystem`` is the opt-in
normalisation (``--strip-volatile-system REGEX``, docs/api.md "Prefix guards"): every
match of the operator's pattern in a system (or developer) message's text is removed
before the prompt is rendered, on every front (a Messages request's system blocks are
one system message). A message left empty stays, empty, where it was: message indexes
(a resent history's ``history_diverged_at``) keep meaning the client's. Off by default:
it changes the prompt the model sees, which is the operator's call.

The other guard needs no switch: system messages stay where the client put them. The
chat path hands the messages to the chat template in the client's order (a system
message in the middle of a conversation is not hoisted to the top, which would change
the prompt's prefix on every agent turn that adds one).
"""

from __future__ import annotations

import dataclasses
import re

from .types import TurnInput

SYSTEM_ROLES = ("system", "developer")


def compile_pattern(pattern: str) -> re.Pattern[str] | None:
    """The compiled pattern (None when empty); ValueError naming the setting for a bad one."""
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"--strip-volatile-system is not a valid regular expression: {e}") from None


class VolatileSystem:
    """Removes the matches of ``pattern`` from a turn's system messages (nothing when empty)."""

    def __init__(self, pattern: str = "") -> None:
        self.pattern = compile_pattern(pattern)

    def apply(self, inp: TurnInput) -> TurnInput:
        if self.pattern is None or not inp.messages:
            return inp
        changed = False
        out = []
        for m in inp.messages:
            if m.role in SYSTEM_ROLES:
                text = self.pattern.sub("", m.content)
                if text != m.content:
                    m, changed = dataclasses.replace(m, content=text), True
            out.append(m)
        return dataclasses.replace(inp, messages=tuple(out)) if changed else inp


__all__ = ["SYSTEM_ROLES", "VolatileSystem", "compile_pattern"]
