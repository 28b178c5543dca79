"""Text <-> token ids for a model directory, chat templates, incremental detokenization.

One ``Tokenizer`` over whichever the checkpoint ships (first found wins):

- ``tokenizer.json``: a Hugging Face ``tokenizers`` tokenizer (Llama 3, Qwen2, GPT-2 ...);
- ``tokenizer.model``: sentencepiece (Llama 2, TinyLlama, Mistral), byte fallback included;
- ``vocab.json`` + ``merges.txt``: GPT-2 byte-level BPE.

``tokenizer_config.json`` supplies the bos/eos tokens, whether to add bos, added special
tokens and the ``chat_template`` (or a ``chat_template.jinja`` file next to it), rendered
in a sandboxed jinja2 environment. ``IncrementalDetokenizer`` streams text that is final:
never half a UTF-8 character, correct across sentencepiece word boundaries.

A session's turns (``encode_text_turn``, ``encode_chat_turn``) are appended to its token
transcript, never re-tokenized with it:

* Token ids: appended as given.
* Text: the first turn is encoded with BOS; later turns are encoded standalone
  without BOS and appended.
* Chat messages: the first turn renders the messages with the chat template and a
  generation prompt. Later turns render **only the new messages, as a continuation**:
  the template is applied to a fixed placeholder exchange (user, assistant) with and
  without the new messages, and the text the new messages add is taken as the
  difference. What the template writes after an assistant message (its end-of-turn
  marker) is added first unless the transcript already ends with an end-of-sequence
  token (the usual case: the model emitted it and it is in the transcript). The
  transcript therefore stays a strict prefix of the conversation, turn after turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

from .config import ModelLoadError

DEFAULT_ROLES = ("system", "user", "assistant")
# Used when the checkpoint has no chat template: "<role>: <content>" lines, then "assistant:".
BUILTIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
_PLACEHOLDER_USER = "kvserve placeholder user message"
_PLACEHOLDER_ASSISTANT = "kvserve placeholder assistant message"
# Tool-call markers (service/tools/): kept in decoded text even where the vocabulary makes
# them special tokens (which decoding skips), so that the tool-call parser sees them.
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>")


class ChatTemplateError(ValueError):
    """The chat template cannot render these messages (bad input, not a server fault)."""


class _Backend(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...


def _raw_decode_ids(sp: Any) -> Callable[[list[int]], str]:
    """``sp.decode`` for a list of ids: sentencepiece's C++ method itself where the
    installed version exposes it as 0.2 does (its Python ``decode`` works out the input's
    kind on every call: ~1.1 us of a ~1.6 us decode, and the output room decodes twice per
    streamed token), checked against ``decode`` once; else ``decode``."""
    raw = getattr(getattr(sp, "_processor", None), "_DecodeIds", None)
    probe = list(range(min(sp.get_piece_size(), 40)))
    try:
        if raw is not None and raw(probe) == sp.decode(probe) and raw([]) == sp.decode([]):
            return raw
    except Exception:  # another version's internals: the public method
        pass
    return sp.decode


class _SentencePieceBackend:
    """sentencepiece (a ``tokenizer.model``'s bytes); special token strings in text map to their ids."""

    def __init__(self, proto: bytes, special_tokens: Iterable[str]) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        # text that follows a special token gets no dummy "▁" prefix (HF's legacy=False)
        self.sp_cont = spm.SentencePieceProcessor(model_proto=_without_dummy_prefix(proto))
        self.vocab_size = self.sp.get_piece_size()
        self._decode_ids = _raw_decode_ids(self.sp)
        self._special = {t: i for t in special_tokens if t and (i := self.token_to_id(t)) is not None}
        self._special_re = (
            re.compile("(" + "|".join(re.escape(t) for t in sorted(self._special, key=len, reverse=True)) + ")")
            if self._special else None
        )

    def token_to_id(self, token: str) -> int | None:
        i = self.sp.piece_to_id(token)
        return i if (i != self.sp.unk_id() or token == self.sp.id_to_piece(i)) else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = [self.sp.bos_id()] if add_special_tokens and self.sp.bos_id() >= 0 else []
        parts = self._special_re.split(text) if self._special_re else [text]
        for i, part in enumerate(parts):
            if i % 2:  # a special token string
                ids.append(self._special[part])
            elif part:
                ids.extend((self.sp if i == 0 else self.sp_cont).encode(part))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._decode_ids(list(ids))  # control tokens (bos/eos) decode to ""

    def is_special(self, i: int) -> bool:
        return self.sp.is_control(i) or self.sp.is_unknown(i)


def _without_dummy_prefix(proto: bytes) -> bytes:
    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(proto)
    model.normalizer_spec.add_dummy_prefix = False
    return model.SerializeToString()


class _HFBackend:
    """A ``tokenizers.Tokenizer`` (from tokenizer.json, or GPT-2 vocab.json + merges.txt)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_json(cls, path: Path) -> "_HFBackend":
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    @classmethod
    def from_vocab_merges(cls, vocab: Path, merges: Path, special_tokens: Iterable[str]) -> "_HFBackend":
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        tok = HFTokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        present = [t for t in dict.fromkeys(special_tokens) if t and tok.token_to_id(t) is not None]
        tok.add_special_tokens(present)
        return cls(tok)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def is_special(self, i: int) -> bool:
        added = self.tok.get_added_tokens_decoder().get(i)
        return bool(added is not None and added.special)


# ---- a vocabulary as GGUF stores it (tokenizer.ggml.*; read by models/gguf.py) ------------

# token types (llama.cpp's, which are sentencepiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Byte-level BPE splitting rules (``tokenizer.ggml.pre``) -> (Unicode normalization, the
# regexes splitting the text in turn, BPE's ignore_merges): each one as the models that
# carry its name split text in their tokenizer.json (llama.cpp's src/llama-vocab.cpp
# lists the same regexes per name).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE = {
    "gpt2": (None, (_GPT2_SPLIT,), False),  # GPT-2 (llama.cpp: "gpt-2")
    "smollm": (None, (r"\p{N}", _GPT2_SPLIT), False),  # SmolLM, StarCoder: each digit alone
    "llama3": (None, (_LLAMA3_SPLIT,), True),  # Llama 3
    "qwen2": ("NFC", (_QWEN2_SPLIT,), False),  # Qwen2, Qwen2.5, Qwen3
}
BPE_PRE_TOKENIZERS: dict[str, tuple[str | None, tuple[str, ...], bool]] = {
    "gpt-2": _PRE["gpt2"], "phi-2": _PRE["gpt2"],
    "smollm": _PRE["smollm"], "starcoder": _PRE["smollm"], "refact": _PRE["smollm"],
    "llama-bpe": _PRE["llama3"], "llama3": _PRE["llama3"], "llama-v3": _PRE["llama3"],
    "qwen2": _PRE["qwen2"], "deepseek-r1-qwen": _PRE["qwen2"],
}  # fmt: skip
# tokens that end generation wherever a vocabulary has them (llama.cpp's end-of-generation list)
END_OF_GENERATION = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                     "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")  # fmt: skip


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer as a GGUF file stores it (``tokenizer.ggml.*``): ``model`` "llama"
    (sentencepiece: ``scores`` are the merge priorities) or "gpt2" (byte-level BPE:
    ``merges``, split by the ``pre`` rules); one type per token (NORMAL ... BYTE)."""

    model: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str = "default"
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None
    pad_id: int | None = None
    end_ids: tuple[int, ...] = ()  # besides eos: end-of-turn / end-of-message ids the file names
    add_bos: bool | None = None  # None: the model's default (sentencepiece yes, BPE no)
    add_space_prefix: bool = True  # sentencepiece: "▁" before the text (its dummy prefix)
    chat_template: str | None = None

    def end_of_generation(self) -> tuple[int, ...]:
        """eos first, then the other ids that end generation: those the file names and
        control or user-defined tokens spelled as one of ``END_OF_GENERATION``."""
        named = [i for i in (self.eos_id, *self.end_ids) if i is not None]
        spelled = [i for i, (t, k) in enumerate(zip(self.tokens, self.types))
                   if k in (CONTROL, USER_DEFINED) and t in END_OF_GENERATION]  # fmt: skip
        return tuple(dict.fromkeys(named + spelled))

    def special_tokens(self) -> list[str]:
        """Tokens that text spelling them encodes to (control, user-defined, unknown)."""
        return [t for t, k in zip(self.tokens, self.types) if k in (CONTROL, USER_DEFINED, UNKNOWN)]


def sentencepiece_proto(v: Vocabulary) -> bytes:
    """A sentencepiece model (BPE: pieces merged by score, as llama.cpp's tokenizer does)
    from a "llama" vocabulary: identity normalization, whitespace as "▁", the dummy
    prefix when ``add_space_prefix``, byte fallback when the vocabulary has byte pieces."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    if v.scores is None or len(v.scores) != len(v.tokens):
        raise ValueError("a sentencepiece vocabulary needs one score per token")
    m = pb.ModelProto()
    for piece, score, kind in zip(v.tokens, v.scores, v.types):
        m.pieces.add(piece=piece, score=score, type=kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)
                     else NORMAL)  # fmt: skip
    spec = m.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(v.tokens)
    spec.byte_fallback = BYTE in v.types
    unknown = v.unk_id if v.unk_id is not None else next((i for i, k in enumerate(v.types) if k == UNKNOWN), None)
    if unknown is None or not 0 <= unknown < len(v.tokens):
        raise ValueError("a sentencepiece vocabulary needs an unknown token")
    spec.unk_id = unknown
    for field, i in (("bos_id", v.bos_id), ("eos_id", v.eos_id), ("pad_id", v.pad_id)):
        setattr(spec, field, i if i is not None and 0 <= i < len(v.tokens) and i != unknown else -1)
    norm = m.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = v.add_space_prefix
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    return m.SerializeToString()


def byte_level_bpe(v: Vocabulary) -> Any:
    """A ``tokenizers.Tokenizer`` for a "gpt2" vocabulary: its BPE merges, the named
    pre-tokenizer (``BPE_PRE_TOKENIZERS``; ValueError for one not listed), control tokens
    as special added tokens, user-defined ones as plain added tokens, bos by the
    post-processor when ``add_bos``."""
    from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors

    rule = BPE_PRE_TOKENIZERS.get(v.pre)
    if rule is None:
        raise ValueError(f"tokenizer.ggml.pre {v.pre!r} is not supported; supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))}")
    normalization, splits, ignore_merges = rule
    vocab = {t: i for i, t in reversed(list(enumerate(v.tokens)))}  # a repeated string keeps its first id
    merges = [tuple(m.split(" ", 1)) for m in v.merges or ()]
    if any(len(m) != 2 for m in merges):
        raise ValueError("a BPE merge is not two tokens separated by a space")
    tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    if normalization:
        tok.normalizer = getattr(normalizers, normalization)()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(v.tokens, v.types) if k == CONTROL])  # fmt: skip
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(v.tokens, v.types) if k == USER_DEFINED])
    if v.add_bos and v.bos_id is not None:
        bos = v.tokens[v.bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, v.bos_id)])
    return tok


def _token_str(value: Any) -> str | None:
    """tokenizer_config stores tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read JSON ({e})") from None


class Tokenizer:
    """Encode/decode for one model, its special tokens and its chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_tokens: Sequence[str] = (),
        add_bos: bool = True,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.bos_token_id: int | None = backend.token_to_id(bos_token) if bos_token else None
        self._eos_text: dict[int, str] = {}  # id -> text of each end-of-sequence token, ``eos_token`` first
        for t in eos_tokens:
            if (i := backend.token_to_id(t)) is not None:
                self._eos_text.setdefault(i, t)
        self.eos_token_ids: tuple[int, ...] = tuple(self._eos_text)
        self.eos_token = eos_tokens[0] if eos_tokens else None
        # sentencepiece: we add bos; tokenizer.json: its post-processor adds it
        self._add_bos = add_bos and (self.bos_token_id is not None or isinstance(backend, _HFBackend))
        self.chat_template = chat_template
        self._template = _compile_template(chat_template or BUILTIN_CHAT_TEMPLATE)
        # special tokens that are tool-call markers: decoded as their text (TOOL_MARKERS)
        is_special = getattr(backend, "is_special", lambda i: False)
        self.kept_markers: dict[int, str] = {
            i: m for m in TOOL_MARKERS if (i := backend.token_to_id(m)) is not None and is_special(i)
        }

    # ---- construction ---------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load the tokenizer files of an HF model directory; ModelLoadError if none."""
        path = Path(path)
        cfg_path = path / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.exists() else {}
        bos = _token_str(cfg.get("bos_token"))
        eos = _token_str(cfg.get("eos_token"))
        unk = _token_str(cfg.get("unk_token"))
        added = [_token_str(v) for v in (cfg.get("added_tokens_decoder") or {}).values()]
        specials = [t for t in (bos, eos, unk, *added) if t]
        add_bos = cfg.get("add_bos_token")

        if (path / "tokenizer.json").exists():
            backend: _Backend = _HFBackend.from_json(path / "tokenizer.json")
            # its post-processor decides about bos (as HF fast tokenizers do); add_bos_token
            # only vetoes
            add_bos = add_bos is not False
        elif (path / "tokenizer.model").exists():
            backend = _SentencePieceBackend((path / "tokenizer.model").read_bytes(), specials)
            sp = backend.sp
            bos = bos or (sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None)
            eos = eos or (sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None)
            add_bos = add_bos is not False
        elif (path / "vocab.json").exists() and (path / "merges.txt").exists():
            bos = bos or "<|endoftext|>"
            eos = eos or "<|endoftext|>"
            backend = _HFBackend.from_vocab_merges(path / "vocab.json", path / "merges.txt", [bos, eos, *specials])
            add_bos = bool(add_bos)  # GPT-2 adds no bos unless told to
        else:
            raise ModelLoadError(
                f"{path}: no tokenizer (expected tokenizer.json, tokenizer.model, or vocab.json + merges.txt)"
            )
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        try:
            return cls(backend, bos_token=bos, eos_tokens=[eos] if eos else [], add_bos=add_bos,
                       chat_template=template)
        except Exception as e:  # a template that does not compile
            raise ModelLoadError(f"{cfg_path}: invalid chat_template ({e})") from None

    @classmethod
    def from_vocabulary(cls, v: Vocabulary, source: str = "GGUF") -> "Tokenizer":
        """The tokenizer a GGUF file describes (``Vocabulary``); ``source`` names the file in
        errors (ModelLoadError: an unknown tokenizer model or pre-tokenizer, a bad vocabulary,
        a chat template that does not compile)."""
        try:
            if v.model == "llama":
                backend: _Backend = _SentencePieceBackend(sentencepiece_proto(v), v.special_tokens())
                add_bos = v.add_bos is not False
            elif v.model == "gpt2":
                backend = _HFBackend(byte_level_bpe(v))
                add_bos = bool(v.add_bos)
            else:
                raise ValueError(f"tokenizer.ggml.model {v.model!r} is not supported; supported: llama (sentencepiece), "
                                 "gpt2 (byte-level BPE)")
        except ValueError as e:
            raise ModelLoadError(f"{source}: {e}") from None
        token = lambda i: v.tokens[i] if i is not None and 0 <= i < len(v.tokens) else None  # noqa: E731
        eos = [t for i in v.end_of_generation() if (t := token(i)) is not None]
        try:
            return cls(backend, bos_token=token(v.bos_id), eos_tokens=eos, add_bos=add_bos,
                       chat_template=v.chat_template)
        except Exception as e:  # a template that does not compile
            raise ModelLoadError(f"{source}: invalid tokenizer.chat_template ({e})") from None

    # ---- encode / decode ------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_bos``, the model's bos (if it uses one) first.

        Special token strings in ``text`` (bos, eos, added tokens) become their ids.
        """
        return self._backend.encode(text, add_special_tokens=add_bos and self._add_bos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens (bos, eos, ...) are skipped, except tool-call
        markers (``kept_markers``), which decode to their text."""
        kept = self.kept_markers
        if not kept or not any(i in kept for i in ids):
            return self._backend.decode(ids)
        out, run = [], []
        for i in ids:
            if i in kept:
                out.append(self._backend.decode(run) if run else "")
                out.append(kept[i])
                run = []
            else:
                run.append(i)
        if run:
            out.append(self._backend.decode(run))
        return "".join(out)

    def special_id(self, token: str) -> int | None:
        """The id of ``token`` when it is one special token of the vocabulary (a grammar
        names it by id), else None."""
        i = self._backend.token_to_id(token)
        return i if i is not None and getattr(self._backend, "is_special", lambda i: False)(i) else None

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list (transformers' ``apply_chat_template(tools=...)``)."""
        return bool(re.search(r"\btools\b", self.chat_template or ""))

    @property
    def template_takes_tool_calls(self) -> bool:
        """Whether the chat template renders assistant ``tool_calls`` itself."""
        return "tool_calls" in (self.chat_template or "")

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)

    # ---- the vocabulary as bytes (constrained decoding: service/engine/grammar.py) ----

    def hf_tokenizer_json(self) -> str | None:
        """The ``tokenizers`` serialization of an HF backend (None for sentencepiece)."""
        return self._backend.tok.to_str() if isinstance(self._backend, _HFBackend) else None

    def token_bytes(self) -> tuple[list[bytes], list[int]]:
        """Sentencepiece: every id's bytes as they appear in decoded text ("▁" is a space,
        ``<0xNN>`` the byte NN) and the ids of control/unknown pieces (no text)."""
        if not isinstance(self._backend, _SentencePieceBackend):
            raise TypeError("token_bytes is for sentencepiece tokenizers; use hf_tokenizer_json")
        sp = self._backend.sp
        out: list[bytes] = []
        special: list[int] = []
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                out.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i):
                out.append(piece.encode("utf-8"))
                special.append(i)
            else:
                out.append(piece.replace("\u2581", " ").encode("utf-8"))
        return out, special

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as it would continue a sequence: no bos, no sentencepiece dummy prefix."""
        if isinstance(self._backend, _SentencePieceBackend):
            return self._backend.sp_cont.encode(text)
        return self._backend.encode(text, add_special_tokens=False)

    # ---- chat -----------------------------------------------------------------------

    @property
    def known_roles(self) -> tuple[str, ...]:
        """Roles the chat template names explicitly (system/user/assistant if it names none)."""
        found = re.findall(r"role['\"]?\]?\s*==\s*['\"](\w+)['\"]", self.chat_template or "")
        return tuple(dict.fromkeys(found)) or DEFAULT_ROLES

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) as the prompt text; ``tools``
        (OpenAI's tool objects) is passed to the template as transformers does.

        A template's ``raise_exception(msg)`` surfaces as ValueError(msg).
        """
        extra = {"tools": tools} if tools is not None else {}
        return self._template.render(
            messages=messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            add_generation_prompt=add_generation_prompt,
            **extra,
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Render then encode; bos is added only if the rendered text does not start with it."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        starts_with_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        return self.encode(text, add_bos=not starts_with_bos)

    # ---- a session's turns (see the module docstring) -------------------------------

    def encode_text_turn(self, transcript: Sequence[int], text: str) -> list[int]:
        """Tokens of a text turn: with BOS on an empty transcript, standalone without BOS after."""
        return list(self.encode(text, add_bos=not transcript))

    def encode_chat_turn(
        self, transcript: Sequence[int], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Tokens of a chat turn. With an empty transcript the messages are the whole
        conversation so far; otherwise they are only the new messages, rendered as a
        continuation of it (``tools``, for a template that takes them, rendered into both
        sides, so they stay where the first turn put them). ``ChatTemplateError`` when
        the template cannot render them."""
        try:
            if not transcript:
                return list(self.encode_chat(messages, add_generation_prompt=True, tools=tools))
            before = [
                {"role": "user", "content": _PLACEHOLDER_USER},
                {"role": "assistant", "content": _PLACEHOLDER_ASSISTANT},
            ]
            base = self.apply_chat_template(before, add_generation_prompt=False, tools=tools)
            full = self.apply_chat_template(before + messages, add_generation_prompt=True, tools=tools)
        except Exception as e:  # a template may reject a message order (e.g. roles must alternate)
            raise ChatTemplateError(f"the chat template cannot render these messages: {e}") from None
        if not full.startswith(base) or _PLACEHOLDER_ASSISTANT not in base:
            raise ChatTemplateError("the chat template cannot render these messages as a continuation of the session")
        # what the template writes after an assistant message's content: its end-of-turn marker
        closing = base[base.rindex(_PLACEHOLDER_ASSISTANT) + len(_PLACEHOLDER_ASSISTANT) :]
        eos = self._eos_text.get(transcript[-1])  # the end-of-sequence token the model wrote last, if it did
        if eos and closing.startswith(eos):
            closing = closing[len(eos) :]  # the model already wrote it; keep what follows it
        # Special token strings (eos, bos, added tokens) in the text encode to their ids.
        return list(self.encode(closing + full[len(base) :], add_bos=False))


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Streams the text of a growing token sequence, emitting only final text.

    The prefix/read-offset method of vLLM and TGI: decode a window that starts at the
    previous emission (so a sentencepiece word boundary is decoded in context: both the
    window and its already-emitted part lose the same leading space) and emit what it
    adds beyond the already-emitted part, unless it ends in an incomplete UTF-8
    character (U+FFFD from the decoder), which waits for the next tokens. ``"".join(pushes) + flush() == tokenizer.decode(ids)``.
    """

    tokenizer: Tokenizer
    token_ids: list[int] = field(default_factory=list)  # everything pushed so far
    text: str = ""  # everything emitted so far
    _prefix: int = 0  # window start: the first token of the previous emission
    _read: int = 0  # tokens [_prefix, _read) decode to text already emitted

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is now final (may be "")."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: return whatever is left, incomplete characters included."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids = self.token_ids
        if self._read == len(ids):
            return ""
        prefix_text = self.tokenizer.decode(ids[self._prefix : self._read])
        window_text = self.tokenizer.decode(ids[self._prefix :])
        if not final and (len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or mid-character: wait for more tokens
        delta = window_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(ids)
        self.text += delta
        return delta
