"""A request's retentions in the engine: what to pin, until when, and what it kept.

A ``GenerationRequest.retain`` names prefixes of the prompt and how long each must stay
restorable (``types.Retain``; docs/api.md, Retention). The engine resolves them when the
request arrives (``plan``: whole blocks of each prefix, shortest first), reserves room in
the tenant's bound through the restore room (``Restorer.reserve_retention``: refused
past it, before anything runs), and once the prompt is computed (the turn's first
token) hands the longest prefix's blocks to the store to pin (``Restorer.retain``),
each until then plus the longest ttl of the prefixes that hold it (``block_untils``),
so the writes overlap the decode; the turn's end waits for the store's answer only if
it comes first. ``figures`` turns what the store pinned into the turn's
``RetainedPrefix`` list. Pure functions and plain data:
no tensors, no store.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from ..types import CacheScope, Retain, RetainedPrefix, RetentionCounts, Tier

TENANT_BOUND = "tenant_bound"  # refusal: past the tenant's bound (--retention-tenant-memory)
UNAVAILABLE = "unavailable"  # refusal: no tier to keep a retention in
REFUSALS = (TENANT_BOUND, UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """One prefix asked for: its tokens, the whole blocks they hold, its ttl."""

    prefix_tokens: int
    blocks: int
    ttl_s: float


@dataclass(slots=True)
class RetentionPlan:
    """A request's retentions (shortest prefix first) and the room held for them."""

    breakpoints: list[Breakpoint]
    owner: str
    block_size: int
    reservation: Any = None  # cachestore.retention.Reservation, until committed or cancelled
    started: bool = False  # the blocks were handed to the store (at the turn's first token)
    kept: tuple[RetainedPrefix, ...] | None = None  # the store's answer, once it came
    events: Any = None  # the turn's end, held until that answer (engine.Emitted)

    @property
    def blocks(self) -> int:
        """The leading blocks to pin: the longest prefix's."""
        return max((b.blocks for b in self.breakpoints), default=0)

    @property
    def tokens(self) -> int:
        """The prompt tokens those blocks hold (``Started.retain_tokens``)."""
        return self.blocks * self.block_size


def plan(retain: Sequence[Retain], prompt_tokens: int, block_size: int) -> list[Breakpoint]:
    """The breakpoints of ``retain`` (already checked: ``validation.check_retain``),
    shortest prefix first; a prefix of None is the whole prompt."""
    out = []
    for r in retain:
        n = prompt_tokens if r.prefix_tokens is None else r.prefix_tokens
        out.append(Breakpoint(n, n // block_size, r.ttl_s))
    return sorted(out, key=lambda b: (b.prefix_tokens, -b.ttl_s))


def block_untils(breakpoints: Sequence[Breakpoint], now: float) -> list[float]:
    """Per leading block of the longest prefix: until when it is pinned, ``now`` plus
    the longest ttl of the prefixes that hold it."""
    n = max((b.blocks for b in breakpoints), default=0)
    return [now + max(b.ttl_s for b in breakpoints if b.blocks > i) for i in range(n)]


def owner_of(scope: CacheScope) -> str:
    """Whose bound a retention counts against: the tenant; a shared cache salt's
    namespace (every tenant's) has a bound of its own."""
    return scope.tenant if scope.tenant is not None else f"\0shared:{scope.salt}"


def describe_owner(owner: str) -> str:
    if owner.startswith("\0shared:"):
        return f"the shared cache salt {owner.removeprefix(chr(0) + 'shared:')!r}"
    return f"tenant {owner!r}"


def figures(
    breakpoints: Sequence[Breakpoint],
    pinned: Sequence[tuple[str, ...]],
    untils: Sequence[float],
    cached_tokens: int,
    block_size: int,
) -> tuple[RetainedPrefix, ...]:
    """What each breakpoint kept, given the tiers pinning each leading block
    (``RetainResult.tiers``; a block pinned nowhere ends what any prefix keeps: a
    restore reads a prefix) and the prompt tokens the turn read from a cache."""
    leading = next((i for i, t in enumerate(pinned) if not t), len(pinned))
    out = []
    prev = 0  # tokens of the shorter prefixes before this one
    for b in breakpoints:
        kept = min(b.blocks, leading)
        tokens = kept * block_size
        created = max(0, tokens - max(prev, cached_tokens))
        tiers: set[str] = set(pinned[0]) if kept else set()
        for t in pinned[:kept]:
            tiers &= set(t)
        out.append(
            RetainedPrefix(
                prefix_tokens=b.prefix_tokens,
                retained_tokens=tokens,
                created_tokens=created,
                ttl_s=b.ttl_s,
                expires_at=min(untils[:kept]) if kept else 0.0,
                tiers=tuple(Tier(t) for t in (Tier.HOST, Tier.DISK, Tier.REDIS) if t in tiers),
            )
        )
        prev = max(prev, tokens)
    return tuple(out)


class RetentionCounters:
    """The engine's retention figures (``RetentionCounts`` snapshots). Counted on the
    event loop (a request's reservation) and the engine thread (what was kept): one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests = 0
        self._refusals: Counter[str] = Counter({r: 0 for r in REFUSALS})
        self._retained_tokens = self._created_tokens = self._failed_blocks = 0

    def asked(self) -> None:
        with self._lock:
            self._requests += 1

    def refused(self, reason: str) -> None:
        with self._lock:
            self._refusals[reason] += 1

    def kept(self, prefixes: Sequence[RetainedPrefix], asked_blocks: int, pinned_blocks: int) -> None:
        with self._lock:
            self._retained_tokens += max((p.retained_tokens for p in prefixes), default=0)
            self._created_tokens += sum(p.created_tokens for p in prefixes)
            self._failed_blocks += asked_blocks - pinned_blocks

    def snapshot(self) -> RetentionCounts:
        with self._lock:
            return RetentionCounts(
                requests=self._requests,
                refusals=dict(self._refusals),
                retained_tokens=self._retained_tokens,
                created_tokens=self._created_tokens,
                failed_blocks=self._failed_blocks,
            )
