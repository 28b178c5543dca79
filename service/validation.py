"""Every check of a generation request, each with its one message (``InvalidRequest``).

Two callers, one set of messages:

- the conversation (``Conversations.prepare``) checks a turn through two entry points:
  ``check_request`` before the session's lock, everything the request alone decides
  (``check_message_count`` first, so a huge list is refused before any of it is read;
  ``check_sampling``: every sampling field, the integers that reach a tensor or the
  seeded generator range-checked here, so no request can fail the engine step that
  serves every stream; ``check_stop_lists``, ``check_salt``, ``check_turn_options``: the
  input's text valid Unicode, ``check_input_text``, and the session options:
  require_existing_session, turn_mode, expected_turns; a resent history's and a fork's
  conditions; ``check_roles``), and ``check_prompt`` under the lock, around the input's
  tokenizing (text or chat input that cannot fit refused before it is tokenized,
  ``check_input_size``: it needs the transcript's length; then input token ids against
  the vocabulary, ``check_prompt_limit``, ``check_context``, which also fits an unset
  ``max_new_tokens`` to the context left);
- the engine (``LLMEngine.validate``) guards its own input with ``check_generation``:
  the same vocabulary, sampling and context checks by the same functions, and
  ``check_kv_capacity`` (whether the KV pool could ever hold the request), which only
  the engine knows enough to ask.

``service.wire`` maps ``InvalidRequest`` to INVALID_ARGUMENT (HTTP 400); the three
checks of the context and prompt limits raise its ``ContextOverflow`` (HTTP 400 with
OpenAI's code ``context_length_exceeded``). Imports no
torch and no gRPC.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .types import (
    MAX_RETAIN,
    ChatMessage,
    ContextOverflow,
    GenerationRequest,
    InvalidRequest,
    Retain,
    SamplingParams,
    TurnInput,
    TurnMode,
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits the front applies (0 = no limit). The stream limits are
    ``service.admission.Admission``'s."""

    max_prompt_tokens: int = 0  # transcript + new input
    max_cache_salt_chars: int = 256
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_chat_messages: int = 0  # messages in one request (the HTTP front also stops its parse there)


# The integer sampling fields that become tensors or seed a generator. Both fronts share
# these ranges (gRPC's fields are narrower by type: top_k int32, seed uint64).
MAX_TOP_K = 2**31 - 1  # the proto's int32; a top_k at or above the vocabulary size keeps every token
MIN_SEED, SEED_END = -(2**63), 2**64  # torch.Generator.manual_seed's [-2^63, 2^64): int64 or uint64

# A JSON "\ud800"-style escape of a surrogate: the only way a lone surrogate gets into
# the JSON text of a response_format (json.dumps writes non-ASCII as such escapes).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _shown(value: int) -> str:
    """An integer for a message: itself, or its first digits and its length when long."""
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"


def check_text(text: str, what: str) -> None:
    """``text`` must be valid Unicode, encodable as UTF-8: a JSON body's ``"\\ud800"``
    decodes to a lone surrogate, which no tokenizer, hash or store can take (gRPC's
    strings are UTF-8 by the wire format: its parser refuses the bytes)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{what}: character {e.start} is a lone surrogate (U+{ord(text[e.start]):04X}), "
            f"not valid Unicode text (UTF-8 cannot encode it)"
        ) from None


def _check_json_text(spec: str, what: str) -> None:
    """Every string (keys included) of the JSON text ``spec`` is valid Unicode: its
    escapes may spell a lone surrogate where the text itself is ASCII. Text that is not
    JSON is left to the grammar's compiler."""
    check_text(spec, what)
    if not _SURROGATE_ESCAPE.search(spec):
        return
    try:
        doc = json.loads(spec)
    except (ValueError, RecursionError):
        return
    stack: list[Any] = [doc]
    while stack:  # no recursion: a schema may nest as deep as json.loads allows
        node = stack.pop()
        if isinstance(node, str):
            check_text(node, f"{what} (a string in its JSON)")
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def check_vocabulary(ids: Sequence[int], vocab_size: int, what: str) -> None:
    """``what[i]`` for the first id outside ``[0, vocab_size)``: prompts, input tokens
    and stop token ids alike."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise InvalidRequest(f"{what}[{i}] = {t} is outside the vocabulary (ids must be < {vocab_size})")


def check_sampling(params: SamplingParams, *, vocab_size: int, max_new_tokens_limit: int) -> None:
    """Every sampling field (``SamplingParams.validate``; top_k's and seed's upper ranges
    and the text of stop strings and response_format here), then the token ids it names
    (stop token ids, logit_bias) against the vocabulary."""
    params.validate(max_new_tokens_limit)
    if params.top_k > MAX_TOP_K:
        raise InvalidRequest(
            f"top_k must be in [0, {MAX_TOP_K}] (0 = off; at or above the vocabulary size it keeps every "
            f"token), got {_shown(params.top_k)}"
        )
    if params.seed is not None and not MIN_SEED <= params.seed < SEED_END:
        raise InvalidRequest(
            f"seed must be a 64-bit integer, signed or unsigned: in [-2**63, 2**64), got {_shown(params.seed)}"
        )
    for i, stop in enumerate(params.stop):
        check_text(stop, f"sampling.stop[{i}]")
    if params.response_format is not None:
        _check_json_text(params.response_format.spec, f"response_format {params.response_format.kind}")
    check_vocabulary(params.stop_token_ids, vocab_size, "sampling.stop_token_ids")
    bad = next((t for t, _ in params.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_stop_lists(params: SamplingParams, limits: Limits) -> None:
    """The request-size limits of the stop lists (the front's)."""
    if len(params.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"sampling.stop has {len(params.stop)} strings; the limit is {limits.max_stop_strings}")
    for i, stop in enumerate(params.stop):
        if len(stop) > limits.max_stop_string_chars:
            raise InvalidRequest(
                f"sampling.stop[{i}] has {len(stop)} characters; the limit is {limits.max_stop_string_chars}"
            )
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"sampling.stop_token_ids has {len(params.stop_token_ids)} ids; the limit is {limits.max_stop_token_ids}"
        )


def check_salt(salt: str, limits: Limits) -> None:
    if len(salt) > limits.max_cache_salt_chars:
        raise InvalidRequest(f"cache_salt has {len(salt)} characters; the limit is {limits.max_cache_salt_chars}")
    check_text(salt, "cache_salt")


def check_input_text(inp: TurnInput) -> None:
    """Every text of a turn's input is valid Unicode (``check_text``): the text, each chat
    message's role, content and tool-call fields, the tools' definitions, the session id."""
    if inp.text is not None:
        check_text(inp.text, "text")
    for i, m in enumerate(inp.messages or ()):
        check_text(m.role, f"chat.messages[{i}].role")
        check_text(m.content, f"chat.messages[{i}].content")
        check_text(m.tool_call_id, f"chat.messages[{i}].tool_call_id")
        check_text(m.name, f"chat.messages[{i}].name")
        for j, c in enumerate(m.tool_calls):
            for field in ("id", "name", "arguments"):
                check_text(getattr(c, field), f"chat.messages[{i}].tool_calls[{j}].{field}")
    for i, t in enumerate(inp.tools):
        for field in ("name", "description", "parameters"):
            check_text(getattr(t, field), f"tools[{i}].{field}")
    check_text(inp.session_id, "session_id")


def check_message_count(inp: TurnInput, limits: Limits) -> None:
    """A chat input holds at most ``limits.max_chat_messages`` messages: checked first, so a
    huge list is refused before any of it is read, checked or tokenized."""
    n = len(inp.messages) if inp.messages is not None else 0
    if limits.max_chat_messages and n > limits.max_chat_messages:
        raise InvalidRequest(
            f"messages: {n} messages, more than the {limits.max_chat_messages} one request may hold "
            f"(--max-chat-messages)"
        )


def check_turn_options(inp: TurnInput) -> None:
    """What a turn's input must be before any session is touched: its text valid Unicode
    (``check_input_text``), and the session options that need no session to check: they
    need a session_id, a regenerate takes no input, and n > 1 takes no session."""
    check_input_text(inp)
    if not inp.session_id:
        if inp.require_existing_session:
            raise InvalidRequest("require_existing_session needs a session_id")
        if inp.mode is not TurnMode.APPEND:
            raise InvalidRequest(f"turn_mode {inp.mode.name} needs a session_id")
        if inp.expected_turns is not None:
            raise InvalidRequest("expected_turns needs a session_id")
    if inp.sampling.n > 1 and inp.session_id:
        raise InvalidRequest(
            f"n = {inp.sampling.n} cannot be used with a session_id: a session keeps one transcript "
            f"(ask for n > 1 without a session)"
        )
    if inp.mode is TurnMode.REGENERATE and inp.kind is not None:
        raise InvalidRequest(
            f"turn_mode REGENERATE takes no input (it reuses the last turn's), got {inp.kind}; "
            f"use TURN_MODE_EDIT to replace the input"
        )


def check_roles(messages: Sequence[ChatMessage], roles: Sequence[str]) -> None:
    """Every role is one of the chat template's ``roles``, or ``tool`` (service/tools
    renders a tool result as the template takes it); ``developer`` counts as ``system``
    where the template has no such role (the conversation renames it so)."""
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" and "developer" not in roles else m.role
        if role not in roles and role != "tool":
            raise InvalidRequest(f"chat.messages[{i}].role {role!r} is unknown; use one of {', '.join(roles)}")


def check_request(
    inp: TurnInput, limits: Limits, *, vocab_size: int, max_new_tokens_limit: int, roles: Sequence[str],
    resent_history: bool = False, fork_from: str = "",
) -> None:  # fmt: skip
    """Every check of a turn's request that needs no session, in this order: the message
    count, the sampling fields and the stop lists, the cache salt, the input's text and
    the session options, a resent history's and a fork source's conditions, the roles."""
    check_message_count(inp, limits)
    check_sampling(inp.sampling, vocab_size=vocab_size, max_new_tokens_limit=max_new_tokens_limit)
    check_stop_lists(inp.sampling, limits)
    check_salt(inp.cache_salt, limits)
    check_turn_options(inp)
    if (resent_history or fork_from) and (inp.mode is not TurnMode.APPEND or not inp.session_id):
        raise InvalidRequest("a resent history or a fork source needs an appending session turn")
    if resent_history and inp.messages is None:
        raise InvalidRequest("a resent history needs chat messages")
    if inp.messages is not None:  # every message, before a history is matched (indexes as sent)
        check_roles(inp.messages, roles)


def check_prompt(
    inp: TurnInput, n_transcript: int, encode: Callable[[], Sequence[int]], limits: Limits, *, vocab_size: int,
    context_length: int, bytes_per_token: int = 0,
) -> tuple[list[int], SamplingParams]:  # fmt: skip
    """Every check of the prompt a turn builds (``n_transcript`` tokens + its new input),
    around its tokenizing: text or chat input that cannot fit the prompt limit refused
    before ``encode`` tokenizes it (``check_input_size``, at ``bytes_per_token``, the most
    one token covers), then the new tokens (``encode()``) checked: the request's own
    token ids against the vocabulary, the prompt limit, the context. Returns the new
    tokens and the turn's sampling, an unset ``max_new_tokens`` (the input's is None)
    fitted to the context left. Pure but for ``encode``: a caller may run it in a worker
    thread (a long text takes a while to tokenize)."""
    if inp.text is not None or inp.messages is not None:
        n_bytes = len(inp.text.encode("utf-8", "surrogatepass")) if inp.text is not None else sum(
            m.text_bytes() for m in inp.messages or ())
        limit = limits.max_prompt_tokens or context_length
        which = "max_prompt_tokens" if limits.max_prompt_tokens else "the context length"
        check_input_size(inp.kind or "", n_bytes, n_transcript, bytes_per_token, limit, which, inp.session_id)
    new_tokens = list(encode())
    if inp.kind == "tokens":
        check_vocabulary(new_tokens, vocab_size, "tokens.ids")
    check_prompt_limit(n_transcript, len(new_tokens), limits.max_prompt_tokens, inp.session_id)
    explicit = inp.max_new_tokens is not None
    want = inp.sampling.max_new_tokens
    room = check_context(n_transcript, len(new_tokens), context_length, want if explicit else None, inp.session_id)
    return new_tokens, dataclasses.replace(inp.sampling, max_new_tokens=want if explicit else min(want, room))


def check_input_size(
    kind: str, n_bytes: int, n_transcript: int, bytes_per_token: int, limit: int, which: str, session_id: str = ""
) -> None:
    """Text or chat input of ``n_bytes`` cannot fit ``limit`` tokens (``which``: the name
    of the limit) when even at ``bytes_per_token`` (the most one token covers) it needs
    more tokens than the transcript leaves: refused before it is tokenized."""
    if n_bytes <= (limit - n_transcript) * bytes_per_token:
        return
    at_least = n_transcript + -(-n_bytes // bytes_per_token)
    where = f"session {session_id!r} has {n_transcript} tokens and " if session_id and n_transcript else ""
    raise ContextOverflow(
        f"input too long: {where}the new {kind} has {n_bytes} bytes, at least {at_least} tokens in all "
        f"(a token covers at most {bytes_per_token} bytes); the limit is {limit} ({which})"
    )


def check_prompt_limit(n_transcript: int, n_new: int, limit: int, session_id: str = "") -> None:
    """``max_prompt_tokens`` (``limit``; 0 = none) against the transcript + new input."""
    n = n_transcript + n_new
    if not limit or n <= limit:
        return
    if session_id and n_transcript:
        raise ContextOverflow(
            f"session {session_id!r} would exceed the prompt limit: its transcript has {n_transcript} "
            f"tokens and this turn adds {n_new}: {n} > max_prompt_tokens {limit}; start a new session"
        )
    raise ContextOverflow(f"prompt has {n} tokens; the limit is {limit} (max_prompt_tokens)")


def check_context(
    n_transcript: int, n_new: int, context_length: int, max_new_tokens: int | None = None, session_id: str = ""
) -> int:
    """The prompt (transcript + new tokens) must leave room for at least one new token,
    and for ``max_new_tokens`` when one is asked for (None: unset). Returns the room
    left (the most new tokens the context allows)."""
    n_prompt = n_transcript + n_new
    room = context_length - n_prompt
    explicit = max_new_tokens is not None
    if room >= 1 and not (explicit and max_new_tokens > room):
        return room
    asked = f"up to {max_new_tokens} new tokens" if explicit else "at least 1 new token"
    need = n_prompt + (max_new_tokens if explicit else 1)
    if session_id:
        raise ContextOverflow(
            f"session {session_id!r} would exceed the context: its transcript has {n_transcript} tokens, "
            f"this turn adds {n_new} and asks for {asked}: {need} > context length {context_length}"
        )
    if explicit:
        raise ContextOverflow(
            f"prompt ({n_prompt} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the context "
            f"length {context_length}"
        )
    raise ContextOverflow(
        f"prompt has {n_prompt} tokens; the context length is {context_length} (room for at least 1 new token needed)"
    )


def check_kv_capacity(
    n_prompt: int, max_new_tokens: int, context_length: int, block_size: int, kv_blocks: int, n: int = 1
) -> None:
    """Whether a KV pool of ``kv_blocks`` usable blocks could ever hold the request (the
    prompt and its new tokens, up to the context); with ``n`` > 1 sequences, all of them
    at once: the prompt's full blocks once (shared), each sequence's own blocks n times."""
    need = -(-min(n_prompt + max_new_tokens, context_length) // block_size)
    if need > kv_blocks:
        raise InvalidRequest(
            f"prompt + max_new_tokens needs {need} KV blocks; the KV cache holds "
            f"{kv_blocks} (raise --kv-cache-memory or lower max_new_tokens)"
        )
    if n > 1:
        shared = n_prompt // block_size
        group = shared + n * (need - shared)
        if group > kv_blocks:
            raise InvalidRequest(
                f"n = {n} sequences of prompt + max_new_tokens need {group} KV blocks at once "
                f"({shared} shared prompt blocks + {n} x {need - shared}); the KV cache holds "
                f"{kv_blocks} (lower n or max_new_tokens, or raise --kv-cache-memory)"
            )


def check_generation(
    req: GenerationRequest,
    *,
    vocab_size: int,
    context_length: int,
    max_new_tokens_limit: int,
    block_size: int,
    kv_blocks: int,
) -> None:
    """The engine's guard of its own input: a non-empty prompt (and the recalled answers
    it drafts from) inside the vocabulary, the sampling fields, the context, the KV
    pool's capacity."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty")
    check_vocabulary(req.prompt_token_ids, vocab_size, "prompt_token_ids")
    for text in req.recall:  # drafted, so run through the model as the prompt is
        check_vocabulary(text, vocab_size, "recall")
    check_sampling(req.sampling, vocab_size=vocab_size, max_new_tokens_limit=max_new_tokens_limit)
    check_context(0, n, context_length)
    check_kv_capacity(n, req.sampling.max_new_tokens, context_length, block_size, kv_blocks, req.sampling.n)


def check_retain(retain: Sequence[Retain], prompt_tokens: int, n: int, max_ttl_s: float) -> None:
    """A request's retentions (docs/api.md, Retention): at most ``MAX_RETAIN``, each a
    prefix of the prompt (1 token to all of it) kept for more than 0 seconds and at most
    ``max_ttl_s`` (``--retention-max-ttl``), and one sequence to keep it for."""
    if not retain:
        return
    if len(retain) > MAX_RETAIN:
        raise InvalidRequest(f"retain has {len(retain)} entries; the limit is {MAX_RETAIN}")
    if n > 1:
        raise InvalidRequest(f"retain cannot be combined with n = {n} (retain the prompt with n = 1)")
    for i, r in enumerate(retain):
        if not (r.ttl_s > 0 and math.isfinite(r.ttl_s)):  # also rejects NaN
            raise InvalidRequest(f"retain[{i}].ttl must be > 0 seconds, got {r.ttl_s}")
        if r.ttl_s > max_ttl_s:
            raise InvalidRequest(
                f"retain[{i}].ttl {r.ttl_s:g} s exceeds the longest retention this server keeps, {max_ttl_s:g} s"
            )
        if r.prefix_tokens is not None and not 1 <= r.prefix_tokens <= prompt_tokens:
            raise InvalidRequest(
                f"retain[{i}].prefix_tokens must be in [1, {prompt_tokens}] (the prompt's tokens), got {r.prefix_tokens}"
            )
