"""The storage protocol every cache tier follows (``Storage``) and the tiers' statistics.
The tier names (``Tier``) and the breaker states are kvserve.common's, shared with the
service. Importing this module imports no torch.

Contract (every tier, every method):

- ``get(ref) -> T | None``: the value, or None on a miss. Never raises for a miss or a
  backend failure (a down Redis is a miss). A stored value that fails verification is
  a miss and is counted under its reason in ``stats().failures``.
- ``put(ref, value) -> bool``: True when the tier holds ``ref`` afterwards (stored now,
  or already there: puts are idempotent, the same ref is stored once). False when it
  could not (no room, backend failure, breaker open). Never raises for those.
- ``contains(ref) -> bool``: whether a ``get`` would probably hit now (a later ``get``
  may still miss: eviction, TTL, corruption). False on backend failure.
- ``delete(ref) -> bool``: True when a value was removed. False on a miss or failure.
- The batched forms ``get_many / put_many / contains_many / delete_many`` answer one
  entry per ref, in order, with the same meaning. They are defined here from the
  single forms; tiers override them with real batching (one pipeline, one lock).

Block tiers (values are KV block tensors) add destination-passing reads, which is what
the engine uses to restore straight into device-pool blocks:

- ``get_into(ref, out) -> bool``: load and verify ``ref`` into ``out``; False on a miss
  (then ``out`` may have been partly written: a tier may receive straight into it and
  verify afterwards; it is only trusted when True).
- ``get_many_into(refs, outs) -> int``: load ``refs[i]`` into ``outs[i]`` in order and
  return how many leading blocks are loaded and verified, stopping at the first that
  is not. ``outs[i]`` for ``i >= returned`` (the failing block included) may be partly
  written and must not be used: restores are all-or-nothing per block.
- ``layered_read(refs, outs) -> LayeredRead | None``: the same load, layer by layer, so
  a restore's first layers can be attended over while its last ones are still on the
  way (the engine's overlapped restore, service/engine/restore.py). ``read(l0, l1)``
  loads layers ``l0 .. l1 - 1`` (called in order, covering every layer once) of the
  leading blocks still good and returns how many those are; ``finish()`` returns how
  many leading blocks are loaded whole and verified (never more than the last ``read``
  said), with the same all-or-nothing meaning. A layer a ``read`` loaded is unverified
  until ``finish``: what is computed over it is kept only for the blocks ``finish``
  returns. None: the tier reads whole blocks only (the store then loads them whole in
  the first stage).
- ``hold(refs) -> HeldBlocks | None``: the leading blocks the tier holds, read in place
  (the host tier's slots, pinned on CUDA: a restore copies them to the device without a
  staging copy); ``spans(a, b)`` gives blocks ``a:b`` as contiguous runs to copy out of,
  and ``release()``, called once the copies completed, how many leading blocks stayed
  intact throughout (the all-or-nothing count). None: the tier cannot hand out its
  memory (it loads into the caller's buffers).
- ``get_many_stored_into(refs, outs) -> int``: ``get_many_into`` without the decoding:
  each block's verified *stored form* (``codec.stored_nbytes`` bytes: a lossy format's
  compact bytes) into ``outs[i]``, a flat uint8 CPU tensor, for ``codec.expand_into`` to
  decode where the block lands (on the GPU after the copy). ``storage_dtype`` names the
  form (None: the block's own bytes, where this is ``get_many_into``).

Observers (``BlockTier.set_observer``): a tier tells a ``TierObserver`` (the KV events
publisher, service/kv_events.py) of every change of what it holds, by block hash:
``stored`` when it newly holds blocks (``set_observer`` first reports what it holds
already), ``removed`` when it no longer does (evicted, deleted, failed verification,
found missing). A tier with a lock calls it with that lock held, so the observer sees
the changes in the order the tier made them; the observer must be quick, never raise
and never call the tier back. Redis, which evicts and expires keys on its own, reports
the writes it made and the keys it found missing (``contains_many``, a failed read).

Retention (``cachestore/retention.py``; tiers with ``retains``): a block a client asked
to keep is *pinned* until a unix time:

- ``retain(refs, until, owner) -> list[bool]``: pin the blocks the tier holds until at
  least ``until`` (a pin's time only moves later); True for each block held and pinned,
  False for one the tier does not hold (nothing is stored here: the caller writes it
  first). ``owner`` is an opaque label a durable tier keeps with the pin, so that the
  store's ``RetentionBook`` can be rebuilt after a restart.
- A pinned block is never evicted to make room (the host and disk LRUs skip it; a tier
  full of pinned blocks refuses new ones) and survives whatever the tier survives.
- ``expire_retained(now) -> int``: release the pins whose time is ``now`` or earlier
  (the block stays, an ordinary cached block again); how many. The tier never reads a
  clock for this: the store says the time.
- ``retained_entries() -> list[(hash, until, owner)]``: the pins a durable tier kept
  across a restart (a tier that keeps none: ``[]``).

Thread safety: tiers are safe to call from several threads at once.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Generic, NamedTuple, Protocol, Sequence, TypeVar

from kvserve.common.breaker import CLOSED
from kvserve.common.tiers import Tier

from .keys import BlockHash, Namespace

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

# Failure reasons shared by tiers (the codec adds its own, see ``codec.REASONS``).
NOT_FOUND = "not_found"  # the block is not in the tier
BACKEND_ERROR = "backend_error"  # connection refused, reset, server error
TIMEOUT = "timeout"  # socket connect/read timeout
BREAKER_OPEN = "breaker_open"  # skipped: the circuit breaker is open


class BlockRef(NamedTuple):
    """The address of one block in every tier: the namespace and the chained hash."""

    namespace: Namespace
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class TierStats:
    """A point-in-time snapshot of one tier's counters (all cumulative since start,
    except ``blocks_held``, ``bytes_held`` and ``breaker_state``)."""

    name: str
    hits: int = 0  # blocks found (and verified) by get / get_into
    misses: int = 0  # blocks not found or failing verification
    puts: int = 0  # blocks newly stored
    put_skips: int = 0  # puts of blocks that were already there (idempotence)
    bytes_in: int = 0  # bytes written into the tier
    bytes_out: int = 0  # bytes read out of the tier (hits)
    read_seconds: float = 0.0  # wall time spent in reads
    write_seconds: float = 0.0  # wall time spent in writes
    errors: int = 0  # backend errors (connection, timeout, server error)
    evictions: int = 0  # blocks the tier dropped to make room
    failures: dict[str, int] = field(default_factory=dict)  # misses/errors by reason
    blocks_held: int | None = None  # None when the tier cannot know cheaply
    bytes_held: int | None = None
    breaker_state: str = CLOSED
    breaker_opens: int = 0
    blocks_retained: int | None = None  # pinned now by retentions (None: the tier cannot pin, or count)
    bytes_retained: int | None = None  # their bytes in the tier
    retention_expired: int = 0  # pins released because their time passed (cumulative)


class TierCounters:
    """Thread-safe mutable counters behind ``TierStats`` snapshots."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._n = Counter[str]()
        self._seconds = Counter[str]()
        self._failures = Counter[str]()

    def add(self, **counts: int) -> None:
        with self._lock:
            self._n.update(counts)

    def add_seconds(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._seconds[kind] += seconds

    def fail(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._failures[reason] += n

    def snapshot(self, **extra: object) -> TierStats:
        with self._lock:
            n, failures = dict(self._n), dict(self._failures)
            read_s, write_s = self._seconds["read"], self._seconds["write"]
        return TierStats(
            name=self.name,
            hits=n.get("hits", 0),
            misses=n.get("misses", 0),
            puts=n.get("puts", 0),
            put_skips=n.get("put_skips", 0),
            bytes_in=n.get("bytes_in", 0),
            bytes_out=n.get("bytes_out", 0),
            read_seconds=read_s,
            write_seconds=write_s,
            errors=n.get("errors", 0),
            evictions=n.get("evictions", 0),
            failures=failures,
            **extra,  # type: ignore[arg-type]
        )


class Storage(ABC, Generic[T]):
    """One storage tier. See the module docstring for the contract."""

    name: Tier

    @abstractmethod
    def get(self, ref: BlockRef) -> T | None: ...

    @abstractmethod
    def put(self, ref: BlockRef, value: T) -> bool: ...

    @abstractmethod
    def contains(self, ref: BlockRef) -> bool: ...

    @abstractmethod
    def delete(self, ref: BlockRef) -> bool: ...

    @abstractmethod
    def stats(self) -> TierStats: ...

    def get_many(self, refs: Sequence[BlockRef]) -> list[T | None]:
        return [self.get(r) for r in refs]

    def put_many(self, refs: Sequence[BlockRef], values: Sequence[T]) -> list[bool]:
        if len(refs) != len(values):
            raise ValueError(f"{len(refs)} refs but {len(values)} values")
        return [self.put(r, v) for r, v in zip(refs, values)]

    def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        return [self.contains(r) for r in refs]

    def delete_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        return [self.delete(r) for r in refs]


class TierObserver(Protocol):
    """Told of every change of what a block tier holds (see the module docstring):
    ``tier`` names the tier, ``hashes`` are the blocks' 32-byte hashes. Quick, never
    raising, never calling the tier back (it may be called with the tier's lock held)."""

    def tier_stored(self, tier: Tier, hashes: Sequence[bytes]) -> None: ...

    def tier_removed(self, tier: Tier, hashes: Sequence[bytes]) -> None: ...


class LayeredRead(ABC):
    """One layer-by-layer load (``BlockTier.layered_read``; the module docstring)."""

    @abstractmethod
    def read(self, l0: int, l1: int) -> int: ...

    @abstractmethod
    def finish(self) -> int: ...


class HeldBlocks(ABC):
    """Blocks a tier lends in place (``BlockTier.hold``; the module docstring)."""

    n: int  # leading blocks held

    @abstractmethod
    def spans(self, start: int, end: int) -> list["torch.Tensor"]: ...

    @abstractmethod
    def release(self) -> int: ...


class BlockTier(Storage["torch.Tensor"]):
    """A tier whose values are KV blocks ``(L, 2, block_size, n_kv, head_dim)``, with
    destination-passing reads (see the module docstring).

    What the tiered store (``cachestore.tiered``) asks of a tier beyond the contract,
    with the defaults of a remote tier (Redis) here and a memory tier (the host)
    overriding them:

    - ``writes_inline``: a put is a memcpy, done on the caller's thread (a demotion
      into it); False: puts do I/O and go through the store's writer thread.
    - ``batch_blocks``: how many blocks one batched call should carry.
    - ``copy_out(ref, out)``: copy a block out to write it into another tier (a spill
      of a block the caller no longer holds), counting no hit; False when the tier does
      not hold it or cannot hand copies out cheaply (a remote tier: the store asks
      ``contains_many`` instead).
    - ``set_on_evict(fn)``: ``fn(ref, block)`` is called with a block the tier drops to
      make room, before its space is reused (the store demotes it to the next tier);
      a tier that evicts on its own without telling (Redis' maxmemory) ignores it.
    - ``breaker_state``: ``OPEN`` while the tier refuses calls (demotions to it are
      dropped, counted, instead of queued).
    - ``shared``: the tier outlives this process and every replica reads it (Redis):
      the drain writes sessions' blocks there so another replica, or this one
      restarted, resumes them.
    - ``durable``: the tier outlives this process on this machine (disk; Redis, being
      shared, too): with no shared tier, the drain writes to the first durable one, so
      this server restarted resumes its sessions.
    - ``set_observer(observer)``: tell ``observer`` of every change of what the tier
      holds from now on, after reporting what it holds already (module docstring).
    - ``retains``: the tier can pin blocks for a retention (``retain``,
      ``expire_retained``, ``retained_entries``: the module docstring).
    - ``close()``: release connections (and locks).
    """

    block_shape: tuple[int, ...]
    dtype: torch.dtype
    block_nbytes: int  # bytes of one block in memory
    writes_inline: bool = False
    batch_blocks: int = 64
    shared: bool = False
    durable: bool = False
    storage_dtype: torch.dtype | None = None  # the stored form ``get_many_stored_into`` gives (None: exact)
    _observer: TierObserver | None = None  # set_observer's (None: nobody watches)
    retains: bool = False  # can pin blocks for retentions (module docstring)

    def copy_out(self, ref: BlockRef, out: torch.Tensor) -> bool:
        return False

    def hold(self, refs: Sequence[BlockRef]) -> HeldBlocks | None:
        """The leading held blocks of ``refs`` in place (see the module docstring); None
        when the tier cannot lend its memory."""
        return None

    def get_many_stored_into(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> int:
        """Each block's stored form into ``outs`` (module docstring). A tier that stores
        blocks as themselves loads them into ``outs`` viewed as blocks."""
        if self.storage_dtype is not None:
            raise NotImplementedError(f"{self.name} tier stores {self.storage_dtype} but reads no stored form")
        return self.get_many_into(refs, [o.view(self.dtype).view(self.block_shape) for o in outs])

    def layered_read(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> LayeredRead | None:
        """A layer-by-layer load of ``refs`` into ``outs`` (see the module docstring);
        None when the tier reads whole blocks only."""
        return None

    def set_on_evict(self, on_evict: Callable[[BlockRef, torch.Tensor], None] | None) -> None:
        pass

    def set_observer(self, observer: TierObserver | None) -> None:
        """Tell ``observer`` of every change of what the tier holds (module docstring). A
        tier that can list what it holds reports that first, under the same lock as the
        changes, so nothing falls between; this default (Redis) lists nothing."""
        self._observer = observer

    def _stored(self, hashes: Sequence[bytes]) -> None:
        if self._observer is not None and hashes:
            self._observer.tier_stored(self.name, hashes)

    def _removed(self, hashes: Sequence[bytes]) -> None:
        if self._observer is not None and hashes:
            self._observer.tier_removed(self.name, hashes)

    def retain(self, refs: Sequence[BlockRef], until: float, owner: str) -> list[bool]:
        """Pin the held blocks of ``refs`` until ``until`` (module docstring); a tier that
        cannot pin holds none of them so."""
        return [False] * len(refs)

    def expire_retained(self, now: float) -> int:
        """Release the pins whose time is ``now`` or earlier; how many."""
        return 0

    def retained_entries(self) -> list[tuple[bytes, float, str]]:
        """(hash, until, owner) of the pins kept across a restart."""
        return []

    @property
    def breaker_state(self) -> str:
        return CLOSED

    def close(self) -> None:
        pass

    def _init_block(self, block_shape: Sequence[int], dtype: torch.dtype) -> None:
        self.block_shape = tuple(int(d) for d in block_shape)
        self.dtype = dtype
        self.block_nbytes = math.prod(self.block_shape) * dtype.itemsize

    @abstractmethod
    def get_into(self, ref: BlockRef, out: torch.Tensor) -> bool: ...

    def get_many_into(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> int:
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        for i, (ref, out) in enumerate(zip(refs, outs)):
            if not self.get_into(ref, out):
                return i
        return len(refs)
