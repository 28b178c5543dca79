"""Drafts that remember: a bounded pool of recent outputs that speculative decoding drafts
from across requests (as llama.cpp's ``ngram-mod`` and SuffixDecoding's global tree do).

The sequence's own history (engine/speculative.py) holds what a reply repeats from its
conversation; it does not hold an earlier reply to the same request: a regenerate (the
answer it replaces is out of its prompt), an agent step that repeats an earlier one, the
same question from many users. The pool keeps each finished sequence's output after the
last ``CONTEXT`` tokens of its prompt (so a repeated prompt's end matches it before the
first output token), and the drafter takes its continuation where it matches the
history's end for longer than the history itself does.

**Per tenant and cache salt.** Drafts change no output (verification keeps greedy tokens
plain decoding's and sampled ones its distribution), but how fast a reply comes would tell
whether another tenant's text continues the same way: the pool is keyed by the request's
tenant and ``cache_salt`` (``GenerationRequest.tenant``, ``CacheScope.salt``; a shared
salt's requests too, since only their KV namespace is shared), and a lookup reads its own
key's entries alone. What one key can learn of another is how much the pool holds in all
(its entries evicted sooner), as with the device KV pool.

**Bounded.** Every entry is charged ``TOKEN_BYTES`` per token it holds plus
``INDEX_BYTES`` per n-gram it indexes (``NGRAMS``: 8 and 16), upper bounds of what Python's
structures take for them (tests/unit/test_draft_pool.py measures them with tracemalloc);
past ``memory`` bytes the least recently added or repeated entries go first, whatever
their key. ``memory`` 0: no pool (service/config.py ``--draft-pool-memory``).

**The index.** Per key, a dict from the hash of each n-gram (n in ``NGRAMS``) of every
entry to where its most recent occurrence continues (entry, position); a lookup tries
the history's last n tokens from the longest n down, checks the tokens (a hash can
collide), measures the match (how many tokens before the continuation agree with the
history's end, up to speculative.MATCH_CAP) and returns the continuation when the match
is longer than the one the history's own index found. Matches shorter than the shortest
n (8) are not drafted from: a few tokens in common with another answer are weak evidence. An entry added again (the same
tokens under the same key: a repeated greedy answer) is not stored twice: it moves to the
back of the eviction order and its n-grams point at it again.

Plain Python, touched by the engine thread alone (the scheduler's drafts, the engine's
finished sequences).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from ..types import GenerationRequest
from .speculative import MATCH_CAP

# n-gram lengths indexed, longest first (the lookup's order); the shortest is the shortest
# match the pool drafts from: a few tokens in common with another answer (a common phrase,
# right after the sequence's own text diverged from what it repeats) are weak evidence,
# and cost the rows of a wrong draft where the sequence's own, shorter match was right
NGRAMS = (16, 8)
CONTEXT = 32  # prompt tokens kept before an output
MAX_ENTRY = 1 << 16  # tokens of one entry at most (an output past it is kept to its first ones)
TOKEN_BYTES = 4  # an entry's token (array('I'))
INDEX_BYTES = 160  # one n-gram's index slot: the dict's entry, the key and value ints (measured ~120)
ENTRY_BYTES = 512  # an entry's fixed cost (its array, the bookkeeping)
_POS = 1 << 17  # index value: serial * _POS + continuation position (> MAX_ENTRY)

Key = tuple[str, str]  # (tenant, cache salt)


def pool_key(request: GenerationRequest) -> Key:
    """The pool's key of a request: its tenant and its cache salt."""
    return (request.tenant, request.scope.salt)


def entry_cost(n_tokens: int) -> int:
    """What an entry of ``n_tokens`` tokens is charged: its tokens, one index slot per
    n-gram with a continuation, and the fixed cost."""
    grams = sum(max(n_tokens - n, 0) for n in NGRAMS)
    return ENTRY_BYTES + TOKEN_BYTES * n_tokens + INDEX_BYTES * grams


@dataclass(slots=True)
class _Scope:
    """One key's entries and index."""

    entries: dict[int, array] = field(default_factory=dict)  # serial -> tokens
    index: dict[int, int] = field(default_factory=dict)  # hash(n-gram) -> serial * _POS + continuation
    digests: dict[int, int] = field(default_factory=dict)  # hash(tokens) -> serial (the same tokens once)


class DraftPool:
    """The pool (module docstring): ``add`` an output under its key, ``lookup`` a
    continuation for a history under its key. ``memory``: bytes charged at most (> 0)."""

    def __init__(self, memory: int) -> None:
        if memory <= 0:
            raise ValueError(f"draft pool memory must be > 0, got {memory}")
        self.memory = memory
        self.bytes = 0  # charged now
        self.tokens = 0  # held now
        self.evictions = 0  # entries evicted (cumulative)
        self.hits = 0  # lookups that returned a continuation (cumulative)
        self._scopes: dict[Key, _Scope] = {}
        self._order: OrderedDict[int, tuple[Key, int]] = OrderedDict()  # serial -> (key, cost), oldest first
        self._serial = 0

    def __len__(self) -> int:
        return len(self._order)

    def add(self, key: Key, tokens: Sequence[int]) -> None:
        """Keep ``tokens`` (a prompt's last tokens and its output) under ``key``, evicting
        the oldest entries past the bound; the same tokens under the same key are kept
        once (moved to the back, re-indexed). Too few tokens to index, or more than the
        whole pool may hold: nothing."""
        tokens = tokens[:MAX_ENTRY]
        if len(tokens) <= NGRAMS[-1]:
            return
        cost = entry_cost(len(tokens))
        if cost > self.memory:
            return
        scope = self._scopes.get(key)
        digest = hash(tuple(tokens))
        if scope is not None:
            serial = scope.digests.get(digest)
            if serial is not None and scope.entries[serial].tolist() == list(tokens):
                self._order.move_to_end(serial)
                self._index(scope, serial, scope.entries[serial])
                return
        while self.bytes + cost > self.memory:
            self._evict()
        scope = self._scopes.setdefault(key, _Scope())
        self._serial += 1
        serial = self._serial
        ent = array("I", tokens)
        scope.entries[serial] = ent
        scope.digests[digest] = serial
        self._index(scope, serial, ent)
        self._order[serial] = (key, cost)
        self.bytes += cost
        self.tokens += len(ent)

    @staticmethod
    def _index(scope: _Scope, serial: int, ent: array) -> None:
        index, base, L = scope.index, serial * _POS, len(ent)
        toks = ent.tolist()
        for n in NGRAMS:
            for c in range(n, L):  # the n-gram ending at c - 1 continues at c
                index[hash(tuple(toks[c - n : c]))] = base + c

    def _evict(self) -> None:
        serial, (key, cost) = self._order.popitem(last=False)
        scope = self._scopes[key]
        ent = scope.entries.pop(serial)
        toks, base = ent.tolist(), serial * _POS
        for n in NGRAMS:
            for c in range(n, len(toks)):
                h = hash(tuple(toks[c - n : c]))
                if scope.index.get(h) == base + c:  # not pointing at a later occurrence
                    del scope.index[h]
        digest = hash(tuple(toks))
        if scope.digests.get(digest) == serial:
            del scope.digests[digest]
        if not scope.entries:
            del self._scopes[key]  # its dicts' tables go with it
        self.bytes -= cost
        self.tokens -= len(toks)
        self.evictions += 1

    def lookup(
        self, key: Key, history: Sequence[int], max_draft: int, beat: int = 0, cap: int = MATCH_CAP,
        count: bool = True,
    ) -> tuple[list[int], int] | None:  # fmt: skip
        """The continuation (up to ``max_draft`` tokens) of the longest n-gram of the
        history's end found in ``key``'s entries, and its match length (tokens before it
        agreeing with the history's end, up to ``cap``); None when nothing under ``key``
        matches for longer than ``beat`` tokens (or for NGRAMS[-1])."""
        scope = self._scopes.get(key)
        if scope is None or max_draft < 1:
            return None
        L = len(history)
        for n in NGRAMS:
            if n > L:
                continue
            tail = list(history[L - n :])
            v = scope.index.get(hash(tuple(tail)))
            if v is None:
                continue
            serial, c = divmod(v, _POS)
            ent = scope.entries.get(serial)
            if ent is None or ent[c - n : c].tolist() != tail:
                continue  # a hash collision
            m = _match(ent, c, history, n, cap)
            if m <= beat:  # the longest n-gram found matches no longer than the history's own
                return None
            out = ent[c : c + max_draft].tolist()
            if not out:
                return None
            self.hits += count
            return out, m
        return None


def _match(ent: array, c: int, history: Sequence[int], n: int, cap: int) -> int:
    """The longest m in [n, min(cap, c, len(history))] with ent[c - m : c] equal to the
    history's last m tokens (the last n agree): 16 tokens a comparison, then one by one."""
    L = len(history)
    hi = min(cap, c, L)
    m = n
    while m + 16 <= hi and ent[c - m - 16 : c - m].tolist() == list(history[L - m - 16 : L - m]):
        m += 16
    while m < hi and ent[c - m - 1] == history[L - m - 1]:
        m += 1
    return m


@dataclass(frozen=True, slots=True)
class PoolView:
    """One key's side of the pool, what a sequence's drafter holds."""

    pool: DraftPool
    key: Key

    def lookup(self, history: Sequence[int], max_draft: int, beat: int, cap: int = MATCH_CAP,
               count: bool = True) -> tuple[list[int], int] | None:  # fmt: skip
        return self.pool.lookup(self.key, history, max_draft, beat, cap, count)
