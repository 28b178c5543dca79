"""The one place a replica derives block keys: a request's namespace and its block chain.

``BlockKeys`` holds what every key of this model's KV depends on (the model fingerprint,
the KV format (``KVCacheSpec.namespace_field``), the block size, and LongRoPE's switch length) and answers the engine's
rooms and its store side alike: admission hashes a prompt, a forward registers the
blocks it completed, a restore looks them up, a spill, a forget or a location query
hashes a transcript, all by asking it, so the derivation is written out once
(``cachestore/keys.py`` holds the hash functions themselves).

LongRoPE models compute a sequence's KV with the short or the long factors by its
length (as transformers), so the KV of a prefix is a function of the prefix *and* the
regime: the long regime roots its own namespace (its fingerprint field is the model's
plus ``+rope=long``, which no hex fingerprint can equal) and blocks never cross.
"""

from __future__ import annotations

from typing import Sequence

from kvserve.cachestore.keys import BlockHash, block_hashes, make_namespace
from ..types import CacheScope

_MAX_CACHED_NAMESPACES = 65536


class BlockKeys:
    """Namespaces (per scope and LongRoPE regime, memoized) and block chains. Thread-safe:
    the memo is a dict written whole-entry (the engine thread and the event loop both ask)."""

    def __init__(self, fingerprint: str, kv_dtype: str, block_size: int, longrope_threshold: int | None) -> None:
        self.fingerprint = fingerprint
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.longrope_threshold = longrope_threshold  # None: one regime
        self._namespaces: dict[tuple[CacheScope, bool], bytes] = {}  # (scope, long regime)

    def is_long(self, num_tokens: int) -> bool:
        """LongRoPE models: a sequence of ``num_tokens`` uses the long factors (transformers' switch)."""
        return self.longrope_threshold is not None and num_tokens > self.longrope_threshold

    def namespace(self, scope: CacheScope, num_tokens: int = 0) -> bytes:
        """The block namespace of a sequence of ``num_tokens`` tokens under ``scope``."""
        long = self.is_long(num_tokens)
        ns = self._namespaces.get((scope, long))
        if ns is None:
            fingerprint = self.fingerprint + ("+rope=long" if long else "")
            ns = make_namespace(fingerprint, self.kv_dtype, self.block_size, scope.tenant, scope.salt)
            if len(self._namespaces) < _MAX_CACHED_NAMESPACES:
                self._namespaces[(scope, long)] = ns
        return ns

    def namespaces(self, scope: CacheScope) -> list[bytes]:
        """Every namespace a transcript under ``scope`` may have blocks in (both LongRoPE
        regimes), e.g. to forget them all."""
        out = [self.namespace(scope)]
        if self.longrope_threshold is not None:
            out.append(self.namespace(scope, self.longrope_threshold + 1))
        return out

    def chain(self, namespace: bytes, token_ids: Sequence[int], prior: Sequence[BlockHash] = ()) -> list[BlockHash]:
        """The hashes of every full block of ``token_ids`` in ``namespace``; ``prior``: those
        already computed for a prefix of them (reused, not recomputed)."""
        return block_hashes(namespace, token_ids, self.block_size, prior)

    def of(self, token_ids: Sequence[int], scope: CacheScope) -> tuple[bytes, list[BlockHash]]:
        """A transcript's namespace (the regime of its length: a next turn on it is at
        least as long) and its full blocks' hashes."""
        ns = self.namespace(scope, len(token_ids))
        return ns, self.chain(ns, token_ids)

    def every_regime(self, token_ids: Sequence[int], scope: CacheScope) -> list[tuple[bytes, list[BlockHash]]]:
        """The transcript's full blocks in each namespace it may have them in (forgetting)."""
        return [(ns, self.chain(ns, token_ids)) for ns in self.namespaces(scope)]
