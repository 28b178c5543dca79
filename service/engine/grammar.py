"""Structured output: a ``ResponseFormat`` (JSON schema, any JSON object, a regex, one of
a list of strings, a client's lark or GBNF grammar, or the lark grammar of a required
or named tool call that service/tools builds)
compiled by llguidance into a matcher that gives, at every step, the bitmask of the
tokens that keep the output inside the grammar (computed on CPU).

``GrammarCompiler`` is the engine's one place for it:

* ``compile(fmt)`` checks and compiles a format (InvalidRequest with llguidance's
  message for an invalid or unsupported schema or regex) and keeps the compiled
  matcher in a bounded LRU keyed by the format's SHA-256: the conversation compiles
  in a worker thread before the request reaches the engine, the engine's own check
  then hits the cache.
* ``matcher(fmt)`` is a fresh matcher for one sequence: a copy of the cached one.
* ``fill_masks`` computes the masks of a batch's constrained rows in one call
  (llguidance's executor, in parallel), the sampler applies them
  (``service/engine/sampling.py``); ``fill_draft_masks`` the masks of a speculative
  verify row at each drafted position (engine/speculative.py).

JSON is generated compact (no whitespace between tokens): a model cannot then spend
its tokens on whitespace, and an object whose strings, arrays and numbers are bounded
is bounded. When the grammar can accept nothing more the sequence ends (finish reason
``stop``) without waiting for an end-of-sequence token; before that, the model's
end-of-sequence token is allowed only where the output is complete.

The vocabulary is given to llguidance as bytes: an HF ``tokenizers`` tokenizer as its
own JSON, a sentencepiece one piece by piece (``Tokenizer.token_bytes``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from ..types import InvalidRequest, ResponseFormat

GRAMMAR_CACHE_SIZE = 64  # compiled grammars kept (LRU)
_JSON_OPTIONS = {"whitespace_flexible": False}
_MAX_ERROR_CHARS = 400


class _SentencePieceVocab:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    def __init__(self, tokenizer: Any, eos: int, bos: int | None) -> None:
        self.tokens, self.special_token_ids = tokenizer.token_bytes()
        self.eos_token_id = eos
        self.bos_token_id = bos
        self._encode = tokenizer.encode_plain

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._encode(text)


def _llg_tokenizer(tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    import llguidance

    eos = list(eos_ids) or None
    src = tokenizer.hf_tokenizer_json()
    if src is not None:
        return llguidance.LLTokenizer(src, eos_token=eos)
    vocab = _SentencePieceVocab(tokenizer, eos[0] if eos else 0, tokenizer.bos_token_id)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocab), eos_token=eos)


def matcher_error(matcher: Any) -> str:
    """llguidance's error of a matcher, on one line and bounded."""
    why = " ".join(line.strip() for line in matcher.get_error().splitlines() if line.strip())
    why = why.replace("<non-verbose/>", "").strip()
    return why[:_MAX_ERROR_CHARS] or "invalid"


def format_key(fmt: ResponseFormat) -> str:
    return hashlib.sha256(f"{fmt.kind}\0{fmt.spec}".encode("utf-8", "surrogatepass")).hexdigest()


class GrammarCompiler:
    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = tuple(eos_ids)
        self._llg: Any = None  # llguidance.LLTokenizer, built on first use (~0.1-1 s)
        self._executor: Any = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses that compiled (for tests)

    @property
    def llg_tokenizer(self) -> Any:
        with self._lock:
            if self._llg is None:
                self._llg = _llg_tokenizer(self._tokenizer, self._eos_ids)
            return self._llg

    @property
    def vocab_size(self) -> int:
        return self.llg_tokenizer.vocab_size

    def _grammar(self, fmt: ResponseFormat) -> str:
        import llguidance

        if fmt.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(fmt.spec)
        if fmt.kind == "lark":  # the server's own (service/tools: a required or named tool call)
            return llguidance.LLMatcher.grammar_from_lark(fmt.spec)
        if fmt.kind == "choice":  # one of the strings (validated: a list of them), as lark alternatives
            return llguidance.grammar_from("choice", fmt.spec)
        if fmt.kind == "grammar":  # a client's: lark, or GBNF (llama.cpp's, vLLM's EBNF) converted to lark
            try:
                return llguidance.grammar_from("grammar", fmt.spec)
            except (ValueError, RecursionError) as e:
                raise InvalidRequest(f"response_format grammar: {str(e)[:_MAX_ERROR_CHARS]}") from None
        if fmt.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        try:
            schema = json.loads(fmt.spec)
        except ValueError as e:
            raise InvalidRequest(f"response_format json_schema is not valid JSON: {e}") from None
        except RecursionError:
            raise InvalidRequest("response_format json_schema is nested too deeply to parse") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(
                f"response_format json_schema must be a JSON object (or boolean), got {type(schema).__name__}"
            )
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema) if isinstance(schema, bool) else schema, overrides=_JSON_OPTIONS
            )
        except ValueError as e:
            raise InvalidRequest(f"response_format json_schema: {str(e)[:_MAX_ERROR_CHARS]}") from None

    def compile(self, fmt: ResponseFormat) -> Any:
        """The cached, pristine matcher of ``fmt`` (never to be advanced): InvalidRequest
        when the format is invalid or uses something llguidance does not support."""
        import llguidance

        key = format_key(fmt)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        fmt.validate()
        grammar = self._grammar(fmt)
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0, limits=limits)
        what = "tools (the grammar of a required or named call)" if fmt.kind == "lark" else f"response_format {fmt.kind}"
        if matcher.is_error():
            raise InvalidRequest(f"{what} cannot be used: {matcher_error(matcher)}")
        probe = matcher.deep_copy()  # the first step's mask: a grammar that matches no string fails here
        probe.compute_bitmask()  # on this (worker) thread, not through the engine's executor
        if probe.is_error():
            raise InvalidRequest(
                f"{what} matches no output (the grammar cannot start): {matcher_error(probe)}"
            )
        self.num_compiled += 1
        with self._lock:
            self._cache[key] = matcher
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def matcher(self, fmt: ResponseFormat) -> Any:
        """A fresh matcher (at the grammar's start) for one sequence."""
        return self.compile(fmt).deep_copy()

    def fill_masks(self, matchers: Sequence[Any]) -> torch.Tensor:
        """(len(matchers), ceil(V / 32)) int32 bitmasks: bit j of word w allows token 32w + j."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
        B, W = len(matchers), (self.vocab_size + 31) // 32
        mask = torch.full((B, W), -1, dtype=torch.int32)  # contiguous, written in place by llguidance
        self._executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), W * 4, B)
        return mask


    def fill_draft_masks(self, items: Sequence[tuple[Any, Sequence[int]]]) -> torch.Tensor:
        """Speculative verify rows: for each (matcher, drafts), 1 + len(drafts) bitmasks in
        order, row i the mask after drafts[:i] (llguidance advances the matcher through
        the drafts and rolls it back: the matcher is where it was). The drafts must be
        ones the matcher accepts (``validate_tokens``: the scheduler cuts a draft there)."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, (os.cpu_count() or 2) // 2)))
        W = (self.vocab_size + 31) // 32
        B = sum(1 + len(d) for _, d in items)
        mask = torch.zeros((B, W), dtype=torch.int32)  # a row llguidance leaves is all refused
        work, at = [], 0
        for m, drafts in items:
            work.append((m, at, list(drafts)))
            at += 1 + len(drafts)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(work, mask.data_ptr(), W * 4, B)
        return mask


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R, W) int32 bitmasks -> (R, vocab) bool; ids past the mask's width are not allowed."""
    R, W = bitmask.shape
    bits = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(R, W * 32)
    if W * 32 >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, torch.zeros(R, vocab - W * 32, dtype=torch.bool)], dim=1)
