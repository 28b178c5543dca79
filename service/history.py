"""A resent chat history against a session's record: pure functions (no I/O, no
locks), used by ``Conversations.prepare`` under the session's turn lock.

OpenAI clients resend the whole history. ``plan_history`` walks the session's
transcript against it, turn by turn by the turn boundaries of the record
(``agreed_turns``): a turn is followed when its messages encode to exactly its input
tokens and the assistant message after them is what the model generated. When the
history follows every turn and only non-assistant messages come after, it extends the
session (``EXTEND``): those messages are the turn, the transcript's tokens are reused
exactly. Otherwise it diverges (an edited message, a changed reply, or the regenerate
pattern: the history resent without the last reply): ``REWIND`` to the last turn the
history follows, the rest of the history running as the next turn (the kept turns'
tokens are the new prompt's prefix, so their KV blocks are restored, not prefilled).
A record without turn boundaries (written before they were kept) is walked by
``match_history`` (reply ends found by where the next turn's tokens start) and cannot
be rewound: it extends the session only when it covers the whole transcript; any other
history (an edit, the regenerate pattern, a truncated history) is a ``RESET``: the
whole history becomes the session's first turn; so is a history that ends with a reply
the session has.

The plan changes nothing: the turn applies it to its own copy of the record and the
turn's commit writes it, so a turn refused, failed or cancelled after the plan leaves
the session exactly as it was.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from .sessions import SessionRecord
from .types import ChatMessage


class HistoryAction(str, enum.Enum):
    NEW = "new"  # the session has no transcript: the whole history is its first turn
    EXTEND = "extend"  # the history follows every turn: messages[first:] are the new turn
    REWIND = "rewind"  # keep ``keep_turns`` turns; messages[first:] are the next turn
    RESET = "reset"  # the session starts over: the whole history is its first turn


@dataclass(frozen=True, slots=True)
class HistoryPlan:
    action: HistoryAction
    first: int = 0  # messages[first:] are the turn's input
    keep_turns: int = 0  # REWIND: the completed turns kept
    diverged_at: int | None = None  # the first message the transcript did not match (None: it did not diverge)
    rewound_turns: int | None = None  # REWIND: the completed turns dropped


def plan_history(tok: Any, rec: SessionRecord | None, messages: tuple[ChatMessage, ...]) -> HistoryPlan:
    """What a resent ``messages`` does to the session ``rec`` (None or empty: NEW)."""
    if rec is None or not rec.token_ids:
        return HistoryPlan(HistoryAction.NEW)
    if rec.untracked_turns == 0:  # every turn's boundaries are known: walk them
        keep, first, stop = agreed_turns(tok, rec, messages)
        rest = messages[first:]
        if keep == rec.turns and first > 0 and rest and all(m.role != "assistant" for m in rest):
            return HistoryPlan(HistoryAction.EXTEND, first=first)
        if rest:
            return HistoryPlan(HistoryAction.REWIND, first=first, keep_turns=keep, diverged_at=stop,
                               rewound_turns=rec.turns - keep)  # fmt: skip
        return HistoryPlan(HistoryAction.RESET, diverged_at=stop)  # it ends with a reply the session has
    first_new, diverged = match_history(tok, rec.token_ids, messages)
    if diverged is None and first_new > 0:
        return HistoryPlan(HistoryAction.EXTEND, first=first_new)
    return HistoryPlan(HistoryAction.RESET, diverged_at=diverged)


def match_history(tok: Any, transcript: list[int], messages: tuple[ChatMessage, ...]) -> tuple[int, int | None]:
    """How far ``messages`` follow a session ``transcript``: ``(first_new, diverged_at)``.

    The transcript of a session served through this front is, per turn, the tokens of
    the turn's new messages (``encode_chat_turn``) then the generated tokens. Walk it:
    each run of non-assistant messages must encode to the next tokens; each assistant
    message must be what the model generated there: its decoded tokens begin with the
    message, and what follows the message up to the reply's end (where the next run's
    tokens start, or the transcript's end after the last reply) is too short to hold
    another turn (``_turn_floor``: a stop string or the eos may follow, a turn the
    history lacks may not). When everything matched and the transcript is used up,
    ``first_new`` is the index after the last assistant message and ``diverged_at``
    None; otherwise ``first_new`` is 0 and ``diverged_at`` the message where the
    transcript could no longer be followed: the first message of a turn whose tokens
    differ, or the assistant reply after which the transcript goes on differently (an
    edited next message, or turns the history lacks: the regenerate pattern, a
    truncated history). A history that does not cover the whole transcript is never
    taken as continuing it.
    """
    n = len(messages)
    pos = 0
    i = 0
    floor: list[int] = []  # _turn_floor, computed at the first reply
    while i < n:
        j = i
        while j < n and messages[j].role != "assistant":
            j += 1
        if j == n:  # the new messages
            return (i, None) if i > 0 and pos == len(transcript) else (0, i)
        group = messages[i:j]
        if not group:  # an assistant message first or two in a row: not a history of this session
            return 0, i
        try:
            seg = _encode(tok, transcript[:pos], group)
        except Exception:  # noqa: BLE001 - a template that cannot render it: no match
            return 0, i
        if transcript[pos : pos + len(seg)] != seg:
            return 0, i
        pos += len(seg)
        if not floor:
            floor.append(_turn_floor(tok, transcript))
        end = _assistant_end(tok, transcript, pos, messages, j, floor[0])
        if end is None:
            return 0, j
        pos = end
        i = j + 1
    return 0, n  # ends with an assistant message: nothing new to answer


def agreed_turns(tok: Any, rec: SessionRecord, messages: tuple[ChatMessage, ...]) -> tuple[int, int, int]:
    """How many of the session's completed turns ``messages`` follow, by the turn
    boundaries of its record: ``(turns, first, stop)``, ``messages[:first]`` being those
    turns and ``stop`` the message where the walk stopped.

    Turn ``t`` is followed when its run of non-assistant messages encodes to exactly the
    turn's input tokens and the assistant message after them is what the turn generated
    (its decoded tokens begin with the message, as in ``match_history``). The walk stops
    at the first turn not followed: ``stop`` is that turn's first message when its input
    differs or the history ends before its reply (the regenerate pattern), the reply
    when that differs, ``first`` when every turn was followed. Needs a record whose every
    turn has its boundaries (``untracked_turns == 0``)."""
    transcript = rec.token_ids
    n = len(messages)
    pos = i = t = 0
    while t < rec.turns:
        j = i
        while j < n and messages[j].role != "assistant":
            j += 1
        if j == n or j == i:  # no reply to compare (the history ends here) or two replies in a row
            break
        info = rec.turn_log[t]
        try:
            seg = _encode(tok, transcript[:pos], messages[i:j])
        except Exception:  # noqa: BLE001 - a template that cannot render it: not followed
            break
        if len(seg) != info.input_tokens or transcript[pos : pos + len(seg)] != seg:
            break
        out, end = pos + info.input_tokens, pos + info.tokens
        if not _reply_matches(tok, transcript[out:end], messages[j]):
            return t, i, j
        pos, i, t = end, j + 1, t + 1
    return t, i, i


def _encode(tok: Any, transcript: list[int], messages: tuple[ChatMessage, ...]) -> list[int]:
    """A run of messages as a continuation of ``transcript``, rendered as the conversation
    renders them: through tool calling's encoder (``ToolCalling.turn_encoder``, for a
    request with tools, tool calls or tool results), else as plain role and content."""
    encode = getattr(tok, "encode_messages", None)
    if encode is not None:
        return encode(transcript, messages)
    return tok.encode_chat_turn(transcript, [{"role": m.role, "content": m.content} for m in messages])


def _reply_matches(tok: Any, ids: list[int], message: ChatMessage) -> bool:
    """Whether a turn's generated ``ids`` are the assistant ``message``: its text begins
    with the message's content and, through tool calling's encoder
    (``TurnEncoder.reply_matches``), its calls are the message's calls."""
    check = getattr(tok, "reply_matches", None)
    if check is not None:
        return check(ids, message)
    return tok.decode(ids).strip().startswith(message.content.strip())


def _turn_floor(tok: Any, transcript: list[int]) -> int:
    """The fewest tokens one more turn adds to a session's transcript: its input (a
    message rendered as a continuation; an empty one of the shortest role, after the
    eos or not) and at least one generated token. Never below 2."""
    eos = set(getattr(tok, "eos_token_ids", ()) or ())
    other = next(t for t in range(len(eos) + 1) if t not in eos)
    lengths = []
    for ctx in [[other]] + ([[min(eos)]] if eos else []):
        for role in ("user", "system", "tool", "developer"):
            try:
                lengths.append(len(tok.encode_chat_turn(ctx, [{"role": role, "content": ""}])))
            except Exception:  # noqa: BLE001 - a template that refuses the role
                pass
    return max(2, min(lengths, default=1) + 1)


def _spelled_end(tok: Any, transcript: list[int], pos: int, want: str) -> int | None:
    """The first ``end`` where ``transcript[pos:end]`` decodes to text that begins with
    ``want`` (stripped), or None when its text stops agreeing with ``want`` first."""
    if not want:
        return pos
    for end in range(pos + 1, len(transcript) + 1):
        text = tok.decode(transcript[pos:end]).strip()
        if text.startswith(want):
            return end
        if not want.startswith(text.rstrip("\ufffd")):  # (an incomplete UTF-8 character decodes to U+FFFD)
            return None
    return None


def _assistant_end(tok: Any, transcript: list[int], pos: int, messages: tuple[ChatMessage, ...], j: int,
                   floor: int) -> int | None:  # fmt: skip
    """Where the generated tokens of assistant message ``j`` (from ``pos``) end, or None.

    Past the tokens that spell the message, the reply may hold fewer than ``floor - 1``
    more (a stop string, the eos; one below the floor for tokenization's slack): more
    could be a turn the history lacks."""
    want = messages[j].content.strip()
    spelled = _spelled_end(tok, transcript, pos, want)
    if spelled is None:
        return None
    last = min(len(transcript), spelled + floor - 2)  # the reply's end is at most here
    k = j + 1
    while k < len(messages) and messages[k].role != "assistant":
        k += 1
    if k == len(messages):  # the messages after j are the new ones: the transcript ends here
        return len(transcript) if len(transcript) <= last else None
    nxt = messages[j + 1 : k]
    if not nxt:
        return None
    eos = set(getattr(tok, "eos_token_ids", ()) or ())
    segs: dict[bool, list[int]] = {}
    for end in range(max(spelled, pos + 1), last + 1):
        after_eos = transcript[end - 1] in eos
        if after_eos not in segs:
            try:
                segs[after_eos] = _encode(tok, transcript[end - 1 : end], nxt)
            except Exception:  # noqa: BLE001
                return None
        seg = segs[after_eos]
        if transcript[end : end + len(seg)] == seg and tok.decode(transcript[pos:end]).strip().startswith(want):
            return end
    return None
