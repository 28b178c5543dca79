"""The tool-call format of a checkpoint: which parser reads its calls, how a call is
written (the grammar of required and named calls, the fallback rendering of history),
the call ids it expects.

``detect(tokenizer)`` picks the family from the checkpoint, in this order: ``[TOOL_CALLS]``
in the chat template or the vocabulary -> ``mistral``; ``<tool_call>`` -> ``hermes``
(Hermes, Qwen 2.5 / 3); ``<|python_tag|>`` or an ``ipython`` role in the template ->
``llama3_json``; otherwise ``hermes``, which the fallback rendering then teaches
(``service/tools/render.py``). ``--tool-call-parser`` overrides it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, Sequence

from .parsers import PARSERS, ToolCallParser
from ..types import ToolCall, ToolSpec

FAMILIES = tuple(PARSERS)  # hermes, mistral, llama3_json
# the JSON the grammar writes: json.dumps' separators (what templates' tojson writes), no other whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ALNUM = string.ascii_letters + string.digits


def detect(tokenizer: Any) -> str:
    """The family of a checkpoint's tokenizer (see the module docstring)."""
    template = getattr(tokenizer, "chat_template", None) or ""

    def has(token: str) -> bool:
        return token in template or tokenizer.token_to_id(token) is not None

    if has("[TOOL_CALLS]"):
        return "mistral"
    if has("<tool_call>"):
        return "hermes"
    if has("<|python_tag|>") or "ipython" in template:
        return "llama3_json"
    return "hermes"


def arguments_value(arguments: str) -> Any:
    """A call's arguments for a template or a transcript: the JSON value when they parse
    (templates write ``arguments | tojson``), else the text as it is."""
    try:
        value = json.loads(arguments)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a "\ud800" escape: keep the text as it is
        return value
    except (ValueError, RecursionError):  # (UnicodeEncodeError is a ValueError)
        return arguments


def parameters_schema(spec: ToolSpec) -> dict[str, Any]:
    """The tool's parameter schema as a dict (an empty one: any object)."""
    schema = json.loads(spec.parameters) if spec.parameters else {}
    if not isinstance(schema, dict) or not schema:
        return {"type": "object"}
    return schema


def resolve_ref(root: Any, ref: str) -> Any:
    """What a local ``$ref`` (``#``, ``#/$defs/Addr``, ``#/definitions/A``: a JSON pointer
    into the schema's own document) points to in ``root``; None when it is not local or
    points nowhere."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def root_type(schema: dict[str, Any]) -> Any:
    """The ``type`` a schema gives its values: its own, or (where it has none) that of
    what its root ``$ref`` points to, followed a few hops (pydantic writes a recursive
    model as ``{"$defs": {...}, "$ref": "#/$defs/Model"}``); None when it says none."""
    node: Any = schema
    for _ in range(8):
        if not isinstance(node, dict):
            return None
        if "type" in node:
            return node["type"]
        ref = node.get("$ref")
        if not isinstance(ref, str):
            return None
        node = resolve_ref(schema, ref)
    return None


def arguments_schema(spec: ToolSpec) -> dict[str, Any]:
    """The schema a required or named call's arguments are generated under: the tool's
    own (its ``$defs``, ``definitions`` and ``$ref``s resolved against its own root, as it
    is the root of its grammar rule), always an object (``type: object`` where it names
    no type), and closed: every object schema that lists properties and says nothing of
    others (at the root, nested, in its definitions) gets ``additionalProperties:
    false``, so that a model writes only the named arguments (a subset of what the schema
    allows: still valid), and an object's length is bounded where its values are.
    Nothing is closed in a schema that combines object schemas (``allOf``, ``if``,
    ``dependentSchemas``, ``properties`` beside a ``$ref``): closing the parts would
    refuse the whole."""
    schema = dict(parameters_schema(spec))
    schema.setdefault("type", "object")
    if any(_mentions(schema, key) for key in _COMBINING):
        return schema
    return _closed(schema)


_COMBINING = ("allOf", "if", "dependentSchemas", "dependencies", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "additionalProperties", "propertyNames")


def _closed(node: Any) -> Any:
    """``node`` (a schema) with its object schemas closed (``arguments_schema``), a copy."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = [_closed(sub) for sub in out[key]] if isinstance(out[key], list) else _closed(out[key])
    if "properties" in out and "$ref" not in out and not any(k in out for k in ("additionalProperties", "patternProperties")):
        out["additionalProperties"] = False
    return out


def _mentions(node: Any, key: str) -> bool:
    if isinstance(node, dict):
        return key in node or any(_mentions(v, key) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, key) for v in node)
    return False


def _alnum(digest: bytes, n: int) -> str:
    """``n`` letters and digits from a digest (base 62)."""
    x = int.from_bytes(digest, "big")
    out = []
    for _ in range(n):
        x, r = divmod(x, len(_ALNUM))
        out.append(_ALNUM[r])
    return "".join(out)


@dataclass(frozen=True)
class ToolFormat:
    """One family's format for one tokenizer: ``markers`` are the ids of its markers
    where they are special tokens (a grammar must name those by id)."""

    family: str
    markers: tuple[tuple[str, int], ...] = ()
    mistral_named: bool = False  # [TOOL_CALLS]name[ARGS]{...} (v11+) rather than a JSON array

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, family: str = "auto") -> ToolFormat:
        fam = detect(tokenizer) if family == "auto" else family
        if fam not in FAMILIES:
            raise ValueError(f"unknown tool-call parser {family!r}; use auto or one of {', '.join(FAMILIES)}")
        ids = []
        for m in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"):
            i = tokenizer.special_id(m) if hasattr(tokenizer, "special_id") else None
            if i is not None:
                ids.append((m, i))
        named = fam == "mistral" and tokenizer.token_to_id("[ARGS]") is not None
        return cls(fam, tuple(ids), named)

    # ---- reading

    def parser(self) -> ToolCallParser:
        return PARSERS[self.family](self.new_id)

    def new_id(self) -> str:
        """A fresh call id: 9 letters and digits for Mistral (its templates require it), ``call_`` + 24 otherwise."""
        if self.family == "mistral":
            return "".join(secrets.choice(_ALNUM) for _ in range(9))
        return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))

    def stable_id(self, key: str) -> str:
        """A call id derived from ``key`` (a response id and the call's index), in
        ``new_id``'s shape: the same call gets the same id whenever it is read back (the
        Responses API's retrieve, and the check of a follow-up's ``function_call_output``)."""
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        if self.family == "mistral":
            return _alnum(digest, 9)
        return "call_" + _alnum(digest, 24)

    # ---- writing (fallback rendering of history; the model's own format)

    def render_calls(self, calls: Sequence[ToolCall]) -> str:
        """Calls as the model writes them."""
        if not calls:
            return ""
        args_key = "parameters" if self.family == "llama3_json" else "arguments"
        objs = [json.dumps({"name": c.name, args_key: arguments_value(c.arguments)}, ensure_ascii=False) for c in calls]
        if self.family == "hermes":
            return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
        if self.family == "mistral":
            if self.mistral_named:
                return "".join(f"[TOOL_CALLS]{c.name}[ARGS]{json.dumps(arguments_value(c.arguments), ensure_ascii=False)}"
                               for c in calls)  # fmt: skip
            return "[TOOL_CALLS][" + ", ".join(objs) + "]"
        return "; ".join(objs)

    def render_result(self, content: str, name: str, call_id: str) -> str:
        """A tool's result as a non-tool message (templates with no tool role)."""
        if self.family == "hermes":
            return f"<tool_response>\n{content}\n</tool_response>"
        if self.family == "mistral":
            return "[TOOL_RESULTS]" + json.dumps({"call_id": call_id, "content": content}, ensure_ascii=False) + "[/TOOL_RESULTS]"
        return json.dumps({"output": content}, ensure_ascii=False)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The fallback tools prompt (a template that takes no tools): the functions and
        how to call them, in this family's format."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        if self.family == "hermes":
            how = ('For each function call, return a json object with function name and arguments within '
                   '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                   '<args-json-object>}\n</tool_call>')  # fmt: skip
        elif self.family == "mistral":
            how = ('To call functions, reply with [TOOL_CALLS] and a JSON list: [TOOL_CALLS][{"name": '
                   '<function-name>, "arguments": <args-json-object>}]')  # fmt: skip
        else:
            how = ('To call a function, respond only with JSON in the format {"name": function name, '
                   '"parameters": dictionary of argument name and its value}.')  # fmt: skip
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\n{how}"
        )

    # ---- the grammar of a required or named call (llguidance lark)

    def _lit(self, marker: str) -> str:
        i = dict(self.markers).get(marker)
        return f"<[{i}]>" if i is not None else json.dumps(marker)

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool) -> str:
        """A lark grammar for one call (``parallel``: one or more) of one of ``tools``,
        in this family's format. Each tool's arguments are a rule of their own
        (``args_k: %json schema``, ``arguments_schema``): the tool's schema is the root
        of that rule, so its ``$ref``s (``#/$defs/...``, ``#/definitions/...``, ``#``)
        resolve in the tool's own schema, and the call's wrapper (``{"name": ...,
        "arguments": ``) is literal text around it, written as ``json.dumps`` writes it."""
        rules = []
        alts = []
        for k, t in enumerate(tools):
            params = {**arguments_schema(t), "x-guidance": JSON_STYLE}
            rules.append(f"args_{k}: %json {json.dumps(params)}")
            if self.family == "mistral" and self.mistral_named:
                rules.append(f"call_{k}: {json.dumps(t.name)} {self._lit('[ARGS]')} args_{k}")
            else:
                key = "parameters" if self.family == "llama3_json" else "arguments"
                head = "{" + f"{json.dumps('name')}: {json.dumps(t.name)}, {json.dumps(key)}: "
                rules.append(f'call_{k}: {json.dumps(head)} args_{k} "}}"')
            alts.append(f"call_{k}")
        lines = ["%llguidance {}", "one: " + " | ".join(alts)]
        if self.family == "hermes":
            lines.append(f'block: {self._lit("<tool_call>")} "\\n" one "\\n" {self._lit("</tool_call>")}')
            lines.append('start: block ("\\n" block)*' if parallel else "start: block")
        elif self.family == "mistral" and self.mistral_named:
            lines.append(f"block: {self._lit('[TOOL_CALLS]')} one")
            lines.append("start: block+" if parallel else "start: block")
        elif self.family == "mistral":
            more = ' (", " one)*' if parallel else ""
            lines.append(f'start: {self._lit("[TOOL_CALLS]")} "[" one{more} "]"')
        else:
            lines.append('start: one ("; " one)*' if parallel else "start: one")
        return "\n".join(lines + rules) + "\n"
