"""Retentions: blocks a client asked to keep restorable until a time, and who asked.

A retention pins blocks (by hash) in the tiers that hold them until a unix time: the
host and disk LRUs skip pinned blocks, Redis keeps them without a TTL
(``cachestore/redis.py``). The tiers keep one deadline per block, the latest any
retention asked for, and release what passed it when the store says the time
(``BlockTier.expire_retained``). This book keeps the other half: which blocks each
*owner* (an opaque label: the service's tenant) retains until when, so that an owner's
distinct retained blocks stay within ``max_blocks_per_owner``.

- ``reserve(owner, hashes)`` before the blocks are pinned: raises ``RetentionBudget``
  when the owner's live retained blocks, its reservations and these together (each block
  once) would pass the bound; a block the owner retains already costs nothing (a refresh).
- ``commit(reservation, untils)`` records the blocks that were pinned, each until its
  time (an owner's deadline for a block only ever moves later); ``cancel`` gives a
  reservation back unused.
- ``expire(now)`` drops the entries whose time passed (a heap: O(log n) each).
- ``load(owner, hash, until)`` is how a durable tier's journal rebuilds the book at start
  (``DiskTier.retained_entries``), so a restarted server bounds and honours what it
  acknowledged before.

Pure bookkeeping: no torch, no I/O, one lock (the engine thread reserves, the store's
writer commits and expires, metrics read ``stats``).
"""

from __future__ import annotations

import heapq
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

TENANT_BOUND = "tenant_bound"  # refusal reason: the owner's bound (RetentionBudget)


class RetentionBudget(Exception):
    """A reservation would take an owner past its bound of retained blocks."""

    def __init__(self, owner: str, retained: int, wanted: int, limit: int) -> None:
        self.owner, self.retained, self.wanted, self.limit = owner, retained, wanted, limit
        super().__init__(
            f"{owner!r} retains {retained} blocks; these would make {wanted}, over its bound of {limit}"
        )


@dataclass(frozen=True, slots=True, eq=False)
class Reservation:
    """Room held for one retention until it is committed or cancelled."""

    owner: str
    hashes: frozenset[bytes]


@dataclass(frozen=True, slots=True)
class RetentionStats:
    owners: int  # owners retaining at least one block
    blocks: int  # distinct blocks retained (any owner)
    entries: int  # (owner, block) pairs
    reserved_blocks: int  # blocks held by reservations in flight
    committed_blocks: int  # (owner, block) pins recorded (cumulative; a refresh counts again)
    expired_entries: int  # (owner, block) pairs whose time passed (cumulative)
    refusals: dict[str, int] = field(default_factory=dict)  # by reason (cumulative)


class RetentionBook:
    """Who retains which block until when; the per-owner bound. See the module docstring."""

    def __init__(self, max_blocks_per_owner: int) -> None:
        if max_blocks_per_owner < 0:
            raise ValueError(f"max_blocks_per_owner must be >= 0, got {max_blocks_per_owner}")
        self.max_blocks_per_owner = max_blocks_per_owner
        self._lock = threading.Lock()
        self._by_owner: dict[str, dict[bytes, float]] = {}
        self._owners_of: dict[bytes, set[str]] = {}
        self._heap: list[tuple[float, str, bytes]] = []  # (until, owner, hash); stale entries skipped
        self._reserved: dict[str, list[Reservation]] = {}
        self._committed = 0
        self._expired = 0
        self._refusals: Counter[str] = Counter({TENANT_BOUND: 0})

    # ---- reservations ----------------------------------------------------------------

    def reserve(self, owner: str, hashes: Iterable[bytes]) -> Reservation:
        """Hold room for ``hashes`` (raises ``RetentionBudget``): see the module docstring."""
        want = frozenset(bytes(h) for h in hashes)
        with self._lock:
            live = self._by_owner.get(owner, {})
            pending: set[bytes] = set()
            for r in self._reserved.get(owner, ()):
                pending |= r.hashes
            held = len(live) + len(pending - live.keys())
            total = held + len(want - live.keys() - pending)
            if total > self.max_blocks_per_owner and total > held:
                self._refusals[TENANT_BOUND] += 1
                raise RetentionBudget(owner, held, total, self.max_blocks_per_owner)
            res = Reservation(owner, want)
            self._reserved.setdefault(owner, []).append(res)
            return res

    def cancel(self, res: Reservation) -> None:
        with self._lock:
            self._drop_reservation(res)

    def commit(self, res: Reservation, untils: Mapping[bytes, float]) -> None:
        """Record the reservation's blocks that were pinned (``untils``: hash -> unix
        time) and give the reservation back."""
        with self._lock:
            self._drop_reservation(res)
            for h, until in untils.items():
                self._set(res.owner, bytes(h), until)
            self._committed += len(untils)

    def load(self, owner: str, block_hash: bytes, until: float) -> None:
        """An entry a durable tier kept across a restart."""
        with self._lock:
            self._set(owner, bytes(block_hash), until)

    def _set(self, owner: str, h: bytes, until: float) -> None:
        entries = self._by_owner.setdefault(owner, {})
        if until <= entries.get(h, 0.0):
            return
        entries[h] = until
        self._owners_of.setdefault(h, set()).add(owner)
        heapq.heappush(self._heap, (until, owner, h))

    def _drop_reservation(self, res: Reservation) -> None:
        mine = self._reserved.get(res.owner, [])
        if res in mine:
            mine.remove(res)
        if not mine:
            self._reserved.pop(res.owner, None)

    # ---- queries and expiry ----------------------------------------------------------

    def until(self, block_hash: bytes) -> float:
        """The latest time any owner retains the block until (0.0: none)."""
        h = bytes(block_hash)
        with self._lock:
            return max((self._by_owner[o][h] for o in self._owners_of.get(h, ())), default=0.0)

    def retained(self, hashes: Sequence[bytes], now: float) -> list[bool]:
        """Per block: whether a retention holds it past ``now``."""
        with self._lock:
            out = []
            for h in hashes:
                owners = self._owners_of.get(bytes(h), ())
                out.append(any(self._by_owner[o][bytes(h)] > now for o in owners))
            return out

    def owner_blocks(self, owner: str) -> int:
        with self._lock:
            return len(self._by_owner.get(owner, {}))

    def expire(self, now: float) -> int:
        """Drop every (owner, block) entry whose time is ``now`` or earlier; how many."""
        n = 0
        with self._lock:
            while self._heap and self._heap[0][0] <= now:
                until, owner, h = heapq.heappop(self._heap)
                entries = self._by_owner.get(owner)
                if entries is None or entries.get(h) != until:
                    continue  # extended (a later entry is in the heap) or gone
                del entries[h]
                if not entries:
                    del self._by_owner[owner]
                owners = self._owners_of[h]
                owners.discard(owner)
                if not owners:
                    del self._owners_of[h]
                n += 1
            self._expired += n
        return n

    def stats(self) -> RetentionStats:
        with self._lock:
            reserved = sum(len(r.hashes) for rs in self._reserved.values() for r in rs)
            return RetentionStats(
                owners=len(self._by_owner),
                blocks=len(self._owners_of),
                entries=sum(len(e) for e in self._by_owner.values()),
                reserved_blocks=reserved,
                committed_blocks=self._committed,
                expired_entries=self._expired,
                refusals=dict(self._refusals),
            )
