"""The request fields kvserve's peers define (vLLM, SGLang, llama.cpp's server) and the
routers in front of them add, in one table: what each one does here.

``sglang-router`` and ``vllm-router`` parse a request into their own typed form and
re-serialise it, so every request they forward carries their fields, at default values
unless the client set them (``no_stop_trim: false``, ``skip_special_tokens: true``,
``separate_reasoning: true``, ...; ``max_tokens`` becomes ``max_completion_tokens``).
A backend that refused unknown fields would refuse every request they forward. Each
field is one of:

* ``HONOURED``: it means here what it means there; ``service.http.openai`` parses it into
  the domain request (the row says into what).
* ``IGNORED``: any well-typed value is accepted because no value changes what kvserve
  returns (a reasoning-parser switch on a server without a reasoning parser, a router's
  routing key).
* ``DEFAULT_ONLY``: its default (or null) is accepted, as it asks for what kvserve does;
  another value would change the output in a way kvserve does not implement, so it is
  refused with 400 ``unsupported_parameter`` naming the field, never ignored.

``check(body, route)`` applies the table to a request body (types, and the refusal of a
non-default value: the error's param, message and code, which ``service.http.openai``
raises as a 400); ``names(route)`` is the set of fields a route accepts from it;
docs/api.md's "Peer fields" table lists the same rows (tests/unit/test_peer_fields.py
holds the two together). Pure: no I/O, no engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

HONOURED = "honoured"
IGNORED = "ignored"
DEFAULT_ONLY = "default only"
UNSUPPORTED = "unsupported_parameter"  # the error code of a refused value

CHAT = "chat"  # /v1/chat/completions
COMPLETIONS = "completions"  # /v1/completions
BOTH = (CHAT, COMPLETIONS)

_SGLANG_ROUTER = "sglang-router, SGLang"
_LLAMA = "llama.cpp"
_NUMBER = (int, float)
_VLLM = "vLLM"
_CONSTRAINT = "constrains the output as response_format does (service/engine/grammar.py, llguidance)"
_ROUTERS = "sglang-router, vllm-router, SGLang, vLLM"


@dataclass(frozen=True)
class PeerField:
    """One row: ``kind`` the JSON type(s) a value must have (``dict``: an object),
    ``default`` the value that asks for nothing kvserve does not do (null is always
    accepted). A name with a dot (``stream_options.continuous_usage_stats``) is a key
    inside a field: documented here, checked where that field is parsed."""

    name: str
    sent_by: str
    routes: tuple[str, ...]
    kind: type | tuple[type, ...]
    default: Any
    disposition: str
    meaning: str  # what kvserve does with it (docs/api.md's row says the same)


PEER_FIELDS: tuple[PeerField, ...] = (
    PeerField("max_completion_tokens", "sglang-router (from max_tokens), OpenAI", (CHAT,), int, None, HONOURED,
              "the reply's token limit (max_new_tokens)"),
    PeerField("ignore_eos", _ROUTERS, BOTH, bool, False, HONOURED,
              "generation goes on past the model's end-of-sequence token"),
    PeerField("no_stop_trim", _ROUTERS, BOTH, bool, False, DEFAULT_ONLY,
              "true keeps the matched stop string in the text; kvserve always trims it"),
    PeerField("skip_special_tokens", _ROUTERS, BOTH, bool, True, DEFAULT_ONLY,
              "false would put special tokens in the text; kvserve's detokenizer always skips them"),
    PeerField("continue_final_message", _ROUTERS, (CHAT,), bool, False, DEFAULT_ONLY,
              "true would continue the last assistant message instead of answering; not implemented"),
    PeerField("add_generation_prompt", "vllm-router, vLLM", (CHAT,), bool, True, DEFAULT_ONLY,
              "false would render the prompt without the assistant header; kvserve always adds it"),
    PeerField("return_hidden_states", _ROUTERS, BOTH, bool, False, DEFAULT_ONLY,
              "true would return the model's hidden states; not implemented"),
    PeerField("separate_reasoning", _SGLANG_ROUTER, (CHAT,), bool, True, IGNORED,
              "a switch of SGLang's reasoning parser; kvserve has none (reasoning stays in content), "
              "as SGLang run without a reasoning parser"),
    PeerField("stream_reasoning", _SGLANG_ROUTER, (CHAT,), bool, True, IGNORED,
              "as separate_reasoning: no reasoning parser here, so no value changes the reply"),
    PeerField("include_reasoning", "vllm-router, vLLM", (CHAT,), bool, True, IGNORED,
              "vLLM's reasoning-parser switch; no reasoning parser here, so no value changes the reply"),
    PeerField("session_params", "vllm-router (its routing key), SGLang", BOTH, dict, None, IGNORED,
              "only {\"session_id\": string}: vllm-router's consistent-hash key, which changes no output "
              "(SGLang's continual-prompting keys id, rid, offset, replace are refused)"),
    PeerField("lora_path", _ROUTERS, BOTH, str, None, DEFAULT_ONLY,
              "a LoRA adapter; kvserve serves no adapters (null only)"),
    PeerField("chat_template_kwargs", _ROUTERS, (CHAT,), dict, None, DEFAULT_ONLY,
              "extra chat-template variables would change the prompt; not implemented (null or {} only)"),
    PeerField("json_schema", "llama.cpp (an object), SGLang (a string)", BOTH, (dict, bool, str), None, HONOURED,
              f"a JSON schema the reply matches: {_CONSTRAINT}"),
    PeerField("grammar", _LLAMA, BOTH, str, None, HONOURED,
              f"a GBNF (or llguidance lark) grammar the reply is a sentence of: {_CONSTRAINT}"),
    PeerField("n_probs", _LLAMA, BOTH, int, 0, HONOURED,
              "N > 0: each token's logprob and its top N alternatives in the route's logprobs shape "
              "(chat: logprobs.content[].top_logprobs; completions: logprobs.top_logprobs), as llama.cpp's "
              "OpenAI endpoints; at most 20; one that differs from logprobs/top_logprobs is refused"),
    PeerField("cache_prompt", _LLAMA, BOTH, bool, True, DEFAULT_ONLY,
              "kvserve always reuses cached prefix blocks (true is what it does); false would recompute "
              "the whole prompt for bit-exact results, which is not implemented"),
    PeerField("structured_outputs", _VLLM, BOTH, dict, None, HONOURED,
              f"one of json (a schema), regex, choice (a list of strings), grammar (lark or EBNF/GBNF) or "
              f"json_object: true: {_CONSTRAINT}; disable_fallback and disable_any_whitespace accepted "
              "(JSON is compact either way); structural_tag, whitespace_pattern and "
              "disable_additional_properties: true refused"),
    PeerField("guided_json", "vLLM (before structured_outputs)", BOTH, (dict, bool, str), None, HONOURED,
              "structured_outputs.json"),
    PeerField("guided_regex", "vLLM (before structured_outputs)", BOTH, str, None, HONOURED,
              "structured_outputs.regex"),
    PeerField("guided_choice", "vLLM (before structured_outputs)", BOTH, list, None, HONOURED,
              "structured_outputs.choice"),
    PeerField("guided_grammar", "vLLM (before structured_outputs)", BOTH, str, None, HONOURED,
              "structured_outputs.grammar"),
    PeerField("guided_decoding_backend", "vLLM (before structured_outputs)", BOTH, str, None, IGNORED,
              "kvserve has one backend (llguidance), whatever is named"),
    PeerField("guided_whitespace_pattern", "vLLM (before structured_outputs)", BOTH, str, None, DEFAULT_ONLY,
              "a whitespace pattern for JSON; kvserve generates compact JSON (null only)"),
    PeerField("regex", "SGLang, sglang-router", BOTH, str, None, HONOURED, f"a regex the whole reply matches: {_CONSTRAINT}"),
    PeerField("ebnf", "SGLang, sglang-router", BOTH, str, None, HONOURED, "as grammar"),
    PeerField("typical_p", _LLAMA, BOTH, _NUMBER, 1.0, DEFAULT_ONLY, "locally typical sampling; not implemented (1: off)"),
    PeerField("mirostat", _LLAMA, BOTH, int, 0, DEFAULT_ONLY, "Mirostat sampling; not implemented (0: off)"),
    PeerField("dynatemp_range", _LLAMA, BOTH, _NUMBER, 0.0, DEFAULT_ONLY, "dynamic temperature; not implemented (0: off)"),
    PeerField("dry_multiplier", _LLAMA, BOTH, _NUMBER, 0.0, DEFAULT_ONLY, "the DRY penalty; not implemented (0: off)"),
    PeerField("xtc_probability", _LLAMA, BOTH, _NUMBER, 0.0, DEFAULT_ONLY, "the XTC sampler; not implemented (0: off)"),
    PeerField("t_max_predict_ms", _LLAMA, BOTH, int, 0, DEFAULT_ONLY, "a time limit on generation; not implemented (0: off)"),
    PeerField("return_tokens", _LLAMA, BOTH, bool, False, DEFAULT_ONLY, "true would add the token ids to the reply; not implemented"),
    PeerField("timings_per_token", _LLAMA, BOTH, bool, False, DEFAULT_ONLY,
              "true would add timings to every chunk; kvserve sends them once per choice (timings)"),
    PeerField("post_sampling_probs", _LLAMA, BOTH, bool, False, DEFAULT_ONLY,
              "true would report probabilities after the sampler chain; kvserve's are before it"),
    PeerField("id_slot", _LLAMA, BOTH, int, -1, IGNORED,
              "llama.cpp's slot; kvserve has no slots (its cache is shared by content), so no value changes the reply"),
    PeerField("stream_options.continuous_usage_stats", _VLLM, BOTH, bool, False, HONOURED,
              "with include_usage, every chunk carries usage (the prompt's tokens and cached tokens, the "
              "choice's completion tokens so far), as vLLM sends it"),
)  # fmt: skip
_BY_NAME: Mapping[str, PeerField] = {f.name: f for f in PEER_FIELDS}


def names(route: str) -> frozenset[str]:
    """The top-level peer fields ``route`` accepts."""
    return frozenset(f.name for f in PEER_FIELDS if route in f.routes and "." not in f.name)


def _typed(field: PeerField, value: Any) -> bool:
    if isinstance(value, bool):
        return field.kind is bool or (isinstance(field.kind, tuple) and bool in field.kind)
    return isinstance(value, field.kind)


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "a list"}  # fmt: skip


def _type_name(kind: type | tuple[type, ...]) -> str:
    if kind == _NUMBER:
        return "a number"
    return " or ".join(_TYPE_NAMES[k] for k in (kind if isinstance(kind, tuple) else (kind,)))


def check(body: Mapping[str, Any], route: str) -> tuple[str, str, str] | None:
    """The table applied to ``body``: a peer field of ``route`` has its type, an
    ``IGNORED`` one its accepted form, a ``DEFAULT_ONLY`` one its default (or null).
    The first field that does not: (its name, the message, the error code); None when
    all do. ``HONOURED`` values are parsed by ``service.http.openai``."""
    for name in sorted(names(route) & body.keys()):
        field, value = _BY_NAME[name], body[name]
        if value is None:
            continue
        if not _typed(field, value):
            return name, f"{name} must be {_type_name(field.kind)}, got {json.dumps(value)[:40]}", "invalid_type"
        if field.disposition == DEFAULT_ONLY and value != field.default and not (field.kind is dict and value == {}):
            return name, f"{name}: {field.meaning} (only {json.dumps(field.default)} is accepted)", UNSUPPORTED
        if name == "session_params" and (set(value) - {"session_id"} or not isinstance(value.get("session_id", ""), str)):
            return name, (f"{name}: kvserve takes only {{\"session_id\": string}} (vllm-router's routing key); "
                          "SGLang's continual prompting (id, rid, offset, replace) is not implemented"), UNSUPPORTED
    return None
