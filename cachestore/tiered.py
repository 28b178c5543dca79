"""The tiered store the engine talks to: an ordered list of block tiers behind one object.

The engine keeps the device tier itself (its block pool); this store holds the tiers
below it, fastest first (as configured: host memory, then local disk, then Redis; any
of them alone). It
answers, for the blocks past the device hits, where each one is (``match_prefix``),
loads them into device blocks (``fetch_into``), stores copies (``put`` / ``put_many``
synchronously, ``submit_spill`` in the background), takes the blocks the device evicts
(``demote``), and says how fast each tier restores so the engine can skip a tier that
would lose to recomputing (``estimated_restore_seconds``). Nothing outside this store
needs to know which tiers exist: the engine demotes, restores and spills by this
interface, whatever the list holds.

Guarantees:

- No wrong KV: every Redis value and disk file is verified (``cachestore.codec``); host blocks are
  copies made under their address and never handed out while being rewritten.
  ``fetch_into`` returns the number of leading blocks loaded and verified; a block
  that fails ends the restore there and never counts, even if partly written.
- Stored once: the same ``(namespace, block_hash)`` is one host slot and one Redis key
  whichever session made it; writing a block Redis already holds only refreshes its TTL.
- Never blocks decoding: ``submit_spill`` and demotions into a tier that does I/O go
  through one bounded queue drained by one writer thread; a full queue drops (counted)
  instead of waiting. ``match_prefix`` / ``fetch_into`` / ``put`` do I/O and are meant
  for a worker thread, not the decode loop.
- Demotion, down the list: ``demote`` puts a device-evicted block into the first tier,
  and each tier's own evictions go on to the next one. A tier whose puts are a memcpy
  (``BlockTier.writes_inline``: the host) is written on the evicting thread; into any
  other (disk, Redis) the block is copied into one of ``demotion_buffers`` staging buffers (the
  source is reused right after: a memcpy on the evicting thread) and queued; the writer
  encodes it and the tier stores it only if it is not there yet. A tier that cannot
  take the block (a host tier whose every slot is pinned) passes it to the next one.
- Observable: ``observe`` hands every tier an observer told of every block it newly
  holds or no longer holds (``cachestore.base``), whatever moved it.
- Retention (``cachestore/retention.py``): ``reserve_retention`` holds room in an
  owner's bound, ``submit_retain`` (ahead of every other write) stores the blocks in each
  tier of ``retain_to`` that does not hold them yet and pins them there until their
  times, then records them in the ``RetentionBook``; the writer thread releases what
  expired every ``retention_tick_s`` (``expire_retentions``: the book and every tier, at
  ``wall_clock``'s time), and ``delete_many`` leaves retained blocks alone. At start the
  book is rebuilt from the pins a durable tier kept (disk's journal).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Mapping, Self, Sequence

import torch

from kvserve.common.breaker import OPEN
from kvserve.common.tiers import Tier

from . import codec
from .base import BlockRef, BlockTier, HeldBlocks, LayeredRead, TierObserver, TierStats
from .codec import copy_block
from .keys import BlockHash, Namespace
from .retention import Reservation, RetentionBook, RetentionStats

log = logging.getLogger(__name__)

TIER_NAMES = tuple(t for t in Tier if t is not Tier.DEVICE)  # the tiers a store may hold

# Optimistic until measured, so that a tier is tried (and measured) at least once.
# Disk: page-cache reads of recent files run near memcpy; cold reads at the device's rate.
DEFAULT_RESTORE_RATES: Mapping[str, float] = {Tier.HOST: 5e9, Tier.DISK: 2e9, Tier.REDIS: 1e9}  # bytes/s, CPU pool
# Into a CUDA pool: pinned host -> device is DMA (PCIe 5 ~50 GB/s, C2C more); Redis is
# bounded by its network link and the client, not by the device.
DEVICE_RESTORE_RATES: Mapping[str, Mapping[str, float]] = {
    "cpu": DEFAULT_RESTORE_RATES,
    "cuda": {Tier.HOST: 20e9, Tier.DISK: 2e9, Tier.REDIS: 1e9},
}

# Restore decisions, counted in blocks by (tier, decision, reason).
RESTORED = "restored"
RECOMPUTED = "recomputed"
REASON_ALWAYS = "policy_always"  # --restore-policy always
REASON_UNMEASURED = "prefill_unmeasured"  # no prefill rate yet to compare with
REASON_FASTER = "faster"  # estimated restore time below the estimated prefill time
REASON_PROBE = "probe"  # a slower tier's rate is stale: a few blocks restored to re-measure it
REASON_SLOWER = "slower"  # recomputing was estimated faster
REASON_LOAD_FAILED = "load_failed"  # planned, but missing or failed verification on load
DECISION_REASONS: Mapping[str, tuple[str, ...]] = {
    RESTORED: (REASON_ALWAYS, REASON_UNMEASURED, REASON_FASTER, REASON_PROBE),
    RECOMPUTED: (REASON_SLOWER, REASON_LOAD_FAILED),
}


@dataclass(frozen=True, slots=True)
class SpillResult:
    """What a background spill achieved: per requested tier, how many of its
    ``n_blocks`` blocks the tier holds afterwards."""

    n_blocks: int
    held: dict[str, int]


@dataclass(frozen=True, slots=True)
class RetainResult:
    """What one ``submit_retain`` did: per block, the tiers that pin it now (empty: held
    nowhere by the retention), and the unix time it is pinned until."""

    tiers: list[tuple[str, ...]]
    untils: list[float]

    @property
    def leading(self) -> int:
        """How many leading blocks some tier pins (a restore reads a prefix: the
        retention holds this many)."""
        return next((i for i, t in enumerate(self.tiers) if not t), len(self.tiers))


@dataclass(frozen=True, slots=True)
class WriterStats:
    queued_blocks: int  # waiting or being written now
    submitted_blocks: int  # accepted by submit_spill
    dropped_blocks: int  # refused by submit_spill (queue full or closed)
    demoted_blocks: int  # demotions queued for a tier that does I/O (Redis)
    demotions_dropped: int  # demotions not queued (no staging buffer, queue full, breaker open)
    written_blocks: int  # blocks the writer processed
    errors: int  # unexpected exceptions in the writer (bugs; logged)


@dataclass(frozen=True, slots=True)
class TieredStats:
    tiers: dict[str, TierStats]
    restore_rates: dict[str, float]  # bytes/s, EWMA of measured restores (or the prior)
    writer: WriterStats
    # blocks by (tier, decision, reason): see RESTORED / RECOMPUTED and the REASON_* names
    decisions: dict[tuple[str, str, str], int]
    retention: RetentionStats | None = None  # the retention book
    retain_to: tuple[str, ...] = ()  # the tiers retentions pin in
    # per retain tier whose own eviction may drop what it holds (Redis): whether it keeps
    # retentions (check_retention_safety; None: it does not say)
    retention_safe: dict[str, bool | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """``plan_restore``'s answer: the tier to restore each leading block from, and how
    many leading blocks the tiers hold (``found - len(tiers)`` were left to recompute)."""

    tiers: list[str]
    found: int

    @property
    def cut(self) -> bool:
        return len(self.tiers) < self.found


@dataclass(slots=True)
class _Pinning:
    """A retain job's own part: each block's time, the room it holds, its callback."""

    untils: list[float]
    reservation: Reservation
    on_done: Callable[[RetainResult], None]


@dataclass(slots=True)
class _Job:
    refs: list[BlockRef]
    tiers: tuple[str, ...]
    blocks: list[torch.Tensor | None]  # read by the writer; None: wherever the store holds it
    on_done: Callable[[SpillResult], None] | None = None
    staging: list[torch.Tensor] | None = None  # a demotion's buffers, freed when written
    pinning: _Pinning | None = None  # a retention: pin what was written (``submit_retain``)


class TierRead:
    """One tier's share of a restore: blocks ``hashes`` (in order), all held by ``tier``,
    as the device transfers read them (service/kv/transfer.py), in rounds, from
    ``start``:

    - ``load(start, outs)``: into block tensors, verified and decoded (``fetch_into``);
    - ``load_stored(start, outs)``: each block's verified stored form into flat uint8
      buffers of ``stored_nbytes`` (a lossy format's compact bytes), for ``expand`` to
      decode where the blocks land (on the GPU after the copy);
    - ``hold(start, end)`` / ``release(held)``: the blocks lent in place (the host tier's
      pinned slots; None for tiers that cannot), their hits counted at the release.

    Each load of at least ``min_rate_blocks`` blocks, and each hold to its release, is a
    sample of the tier's restore rate."""

    def __init__(self, store: TieredStore, tier: BlockTier, namespace: Namespace, hashes: Sequence[BlockHash]) -> None:
        self.store, self.tier = store, tier
        self.name = tier.name
        self.refs = [BlockRef(namespace, h) for h in hashes]
        self.storage_dtype = tier.storage_dtype
        self.stored_nbytes = codec.stored_nbytes(tier.block_shape, tier.dtype, tier.storage_dtype)
        self._held_t0 = 0.0

    def __len__(self) -> int:
        return len(self.refs)

    def load(self, start: int, outs: Sequence[torch.Tensor]) -> int:
        refs = self.refs[start : start + len(outs)]
        return self._timed(len(refs), lambda: self.tier.get_many_into(refs, outs))

    def load_stored(self, start: int, outs: Sequence[torch.Tensor]) -> int:
        refs = self.refs[start : start + len(outs)]
        return self._timed(len(refs), lambda: self.tier.get_many_stored_into(refs, outs))

    def expand(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``stored`` (n, stored_nbytes) uint8 into ``out`` (n, *block_shape), on
        their device (``codec.expand_into``)."""
        codec.expand_into(stored, out, self.storage_dtype)

    def hold(self, start: int, end: int) -> HeldBlocks | None:
        self._held_t0 = time.perf_counter()
        return self.tier.hold(self.refs[start:end])

    def release(self, held: HeldBlocks) -> int:
        n = held.release()
        if n >= self.store.min_rate_blocks:
            self.store.record_restore(self.name, n * self.store.block_nbytes, time.perf_counter() - self._held_t0)
        return n

    def _timed(self, n: int, read: Callable[[], int]) -> int:
        t0 = time.perf_counter()
        got = read()
        if got >= self.store.min_rate_blocks:  # tiny restores measure latency, not rate
            self.store.record_restore(self.name, got * self.store.block_nbytes, time.perf_counter() - t0)
        return got


class _WholeBlocks(LayeredRead):
    """A tier without ``layered_read``: its blocks loaded whole at the first read."""

    def __init__(self, tier: BlockTier, refs: list[BlockRef], outs: Sequence[torch.Tensor]) -> None:
        self.tier, self.refs, self.outs = tier, refs, outs
        self.n: int | None = None

    def read(self, l0: int, l1: int) -> int:
        if self.n is None:
            self.n = self.tier.get_many_into(self.refs, self.outs)
        return self.n

    def finish(self) -> int:
        return self.n or 0


class _Ewma:
    """Exponentially weighted mean of measured rates, starting from a prior. The first
    ``warmup`` samples are not counted: they pay one-time costs (the connection
    set-up, first-touch page faults) that later restores do not, and one slow first
    sample would otherwise make a tier look slower than recomputing for a long time
    (an auto policy that skips the tier then never measures it again)."""

    def __init__(self, prior: float, alpha: float, warmup: int = 1) -> None:
        self.value = prior
        self.alpha = alpha
        self.warmup = warmup
        self.samples = 0  # counted ones
        self.seen = 0  # all, warm-up included
        self.last_t: float | None = None  # clock time of the last sample

    @property
    def measured(self) -> bool:
        return self.samples > 0

    def update(self, rate: float, now: float) -> None:
        self.seen += 1
        self.last_t = now
        if self.seen <= self.warmup:
            return
        self.value = rate if not self.measured else self.alpha * rate + (1 - self.alpha) * self.value
        self.samples += 1


class TieredStore:
    """Host and Redis tiers behind one interface. See the module docstring."""

    def __init__(
        self,
        tiers: Sequence[BlockTier],
        *,
        max_pending_blocks: int = 4096,
        rate_alpha: float = 0.3,
        initial_restore_rates: Mapping[str, float] | None = None,
        min_rate_blocks: int = 4,
        demotion_buffers: int = 64,
        device: str = "cpu",
        warmup_samples: int = 1,
        probe_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        retain_to: Sequence[str] | None = None,
        max_retained_blocks_per_owner: int = 0,
        wall_clock: Callable[[], float] = time.time,
        retention_tick_s: float = 5.0,
    ) -> None:
        """``tiers``: fastest first, each a different ``Tier``, all holding blocks of one
        shape and dtype (the KV cache spec's); the store's geometry is theirs.
        ``max_pending_blocks`` bounds the writer queue (in blocks); ``rate_alpha`` is
        the EWMA weight of each new restore measurement; restores of fewer than
        ``min_rate_blocks`` blocks do not update the rates (their time is mostly the
        round trip, which would make a tier look slower than it is for long restores);
        ``demotion_buffers`` is how many demoted blocks can wait for a tier that does
        I/O at once (staging copies, allocated here; more demotions meanwhile are
        dropped, counted).

        Restore rates are this store's: one store serves one engine, so they are
        measured for its ``device`` (the device type its restores land on: "cpu" or
        "cuda"), whose priors are ``DEVICE_RESTORE_RATES`` unless
        ``initial_restore_rates`` says otherwise. The first ``warmup_samples`` samples
        of each tier are not counted (connection set-up). A tier that ``plan_restore``
        skips as slower is probed again (a few blocks restored) once its last sample is
        ``probe_after_s`` old, so a rate measured on a bad moment does not stick.

        Retention: ``retain_to`` names the tiers a retention pins in (None: every
        configured tier that can); each owner retains at most
        ``max_retained_blocks_per_owner`` distinct blocks (0: none); ``wall_clock`` is
        the unix time retentions run to, ``retention_tick_s`` how often the writer
        releases what expired."""
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names) or not set(names) <= set(TIER_NAMES):
            raise ValueError(f"tiers must be distinct ones of {[str(t) for t in TIER_NAMES]}, got {names}")
        self.block_shape = tuple(tiers[0].block_shape)
        self.dtype = tiers[0].dtype
        for tier in tiers[1:]:
            if tier.block_shape != self.block_shape or tier.dtype != self.dtype:
                raise ValueError(
                    f"{tier.name} tier holds {tier.block_shape} {tier.dtype}, "
                    f"{tiers[0].name} tier holds {self.block_shape} {self.dtype}"
                )
        self._order: tuple[BlockTier, ...] = tuple(tiers)
        self._tiers: dict[str, BlockTier] = {t.name: t for t in tiers}
        self.block_nbytes = int(torch.Size(self.block_shape).numel()) * self.dtype.itemsize
        self.device = device
        priors = DEVICE_RESTORE_RATES.get(device, DEFAULT_RESTORE_RATES)
        if initial_restore_rates is not None:
            priors = {**priors, **initial_restore_rates}
        self._clock = clock
        self.probe_after_s = probe_after_s
        self._rates_lock = threading.Lock()
        self._rates = {name: _Ewma(priors[name], rate_alpha, warmup_samples) for name in self._tiers}
        self._decisions: Counter[tuple[str, str, str]] = Counter()

        # Retention: the tiers it pins in, the book of who retains what, rebuilt from
        # what the durable tiers kept.
        wanted = self._check_tiers(retain_to) if retain_to is not None else tuple(self._tiers)
        self.retain_to: tuple[str, ...] = tuple(t for t in wanted if t in self._tiers and self._tiers[t].retains)
        self.retentions = RetentionBook(max_retained_blocks_per_owner)
        self._wall = wall_clock
        self.retention_tick_s = retention_tick_s
        self.retention_safe: dict[str, bool | None] = {}
        for name in self.retain_to:
            for h, until, owner in self._tiers[name].retained_entries():
                self.retentions.load(owner, h, until)
        self._next_tick = 0.0  # monotonic time of the writer's next expiry pass (the first: at once)

        # The writer: a bounded deque of jobs, counted in blocks.
        self.min_rate_blocks = min_rate_blocks
        self.max_pending_blocks = max_pending_blocks
        self._cv = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._pending_blocks = 0
        self._closed = False
        self._w = dict(submitted=0, dropped=0, demoted=0, demotions_dropped=0, written=0, errors=0)
        self._writer = threading.Thread(target=self._writer_loop, name="cachestore-writer", daemon=True)
        self._writer.start()

        # Demotions into a tier that does I/O wait in staging copies: a memcpy on the
        # evicting thread, the encoding on the writer's. Each tier's evictions go on to
        # the next tier down.
        self._staging_free: list[torch.Tensor] = []
        if any(not t.writes_inline for t in self._order):
            self._staging_free = [torch.empty(self.block_shape, dtype=self.dtype) for _ in range(demotion_buffers)]
        for i, tier in enumerate(self._order[:-1]):
            tier.set_on_evict(functools.partial(self._demote_into, i + 1))

    @property
    def tiers(self) -> tuple[str, ...]:
        """Names of the configured tiers, fastest first."""
        return tuple(self._tiers)

    @property
    def shared_tier(self) -> str | None:
        """Where the drain writes: the first tier that outlives this process and every
        replica reads (``BlockTier.shared``: Redis), or, with none, the first that
        outlives this process on this machine (``BlockTier.durable``: disk, so this
        server restarted resumes its sessions); None without either."""
        return next((t.name for t in self._order if t.shared), None) or next(
            (t.name for t in self._order if t.durable), None
        )

    def tier(self, name: str) -> BlockTier | None:
        """The configured tier of that name (None: not configured)."""
        return self._tiers.get(name)

    def observe(self, observer: TierObserver | None, recall: Mapping[str, Sequence[bytes]] | None = None) -> None:
        """Tell ``observer`` what each tier holds now and every change from now on, tier by
        tier (``BlockTier.set_observer``): the KV events publisher (service/kv_events.py)
        watches the store so. A tier that cannot list what it holds (Redis) is asked about
        the blocks ``recall`` names for it (by hash alone, as disk and Redis address
        blocks; one pipelined round trip per batch), and those it holds are reported."""
        for tier in self._order:
            tier.set_observer(observer)
            hashes = (recall or {}).get(tier.name)
            if observer is None or not hashes:
                continue
            for start in range(0, len(hashes), tier.batch_blocks):
                batch = hashes[start : start + tier.batch_blocks]
                held = tier.contains_many([BlockRef(Namespace(bytes(32)), BlockHash(h)) for h in batch])
                observer.tier_stored(tier.name, [h for h, ok in zip(batch, held) if ok])

    # ---- lookups and restores (blocking: call from a worker thread) ------------------

    def match_prefix(self, namespace: Namespace, hashes: Sequence[BlockHash]) -> list[str]:
        """For each leading block, the fastest tier that holds it, stopping at the first
        block no tier holds. Each tier is asked once, in one batched call (Redis: one
        pipelined round trip), about the blocks the tiers before it do not hold, from
        the first of those on."""
        refs = [BlockRef(namespace, h) for h in hashes]
        where: list[str | None] = [None] * len(refs)
        for tier in self._order:
            first = next((i for i, w in enumerate(where) if w is None), len(refs))
            ask = [i for i in range(first, len(refs)) if where[i] is None]
            if not ask:
                break
            for i, held in zip(ask, tier.contains_many([refs[i] for i in ask])):
                if held:
                    where[i] = tier.name
        n = next((i for i, w in enumerate(where) if w is None), len(refs))
        return [w for w in where[:n] if w is not None]

    def fetch_into(
        self,
        namespace: Namespace,
        hashes: Sequence[BlockHash],
        tiers: Sequence[str],
        outs: Sequence[torch.Tensor],
    ) -> int:
        """Load ``hashes[i]`` from ``tiers[i]`` into ``outs[i]``, in order, verifying
        each; return how many leading blocks are good. Stops at the first block that
        misses, errs or fails verification; ``outs`` from there on must not be used."""
        if not len(hashes) == len(tiers) <= len(outs):
            raise ValueError(f"{len(hashes)} hashes, {len(tiers)} tiers, {len(outs)} destinations")
        done = 0
        for read in self.reads(namespace, hashes, tiers):
            got = read.load(0, outs[done : done + len(read)])
            done += got
            if got < len(read):
                break
        return done

    def reads(self, namespace: Namespace, hashes: Sequence[BlockHash], tiers: Sequence[str]) -> list[TierRead]:
        """``hashes[i]`` from ``tiers[i]`` (a plan's), as one ``TierRead`` per run of one
        tier, in order; a tier that is not configured ends the list (its blocks and
        those after it are not loaded)."""
        if len(hashes) != len(tiers):
            raise ValueError(f"{len(hashes)} hashes, {len(tiers)} tiers")
        out: list[TierRead] = []
        i = 0
        while i < len(hashes):
            j = i
            while j < len(hashes) and tiers[j] == tiers[i]:
                j += 1
            tier = self._tiers.get(tiers[i])
            if tier is None:
                break
            out.append(TierRead(self, tier, namespace, hashes[i:j]))
            i = j
        return out

    def fetch_layered(
        self,
        namespace: Namespace,
        hashes: Sequence[BlockHash],
        tiers: Sequence[str],
        outs: Sequence[torch.Tensor],
        stages: Sequence[tuple[int, int]],
        on_stage: Callable[[int, int], None],
    ) -> int:
        """``fetch_into`` layer by layer: for each ``(l0, l1)`` of ``stages`` (in order,
        covering the layers), load those layers of every leading block still good, from
        each tier's ``layered_read`` (a tier without one loads its blocks whole in the
        first stage), then call ``on_stage(l1, n)``: layers below ``l1`` of the first
        ``n`` blocks are in ``outs``, unverified. Returns how many leading blocks are
        loaded whole and verified (``fetch_into``'s meaning); the layers of later blocks,
        and anything computed over them, must not be used."""
        if not len(hashes) == len(tiers) <= len(outs):
            raise ValueError(f"{len(hashes)} hashes, {len(tiers)} tiers, {len(outs)} destinations")
        t0 = time.perf_counter()
        groups: list[tuple[int, int, str, LayeredRead]] = []  # (first block, end, tier, its read)
        i = 0
        while i < len(hashes):
            name = tiers[i]
            j = i
            while j < len(hashes) and tiers[j] == name:
                j += 1
            tier = self._tiers.get(name)
            if tier is None:
                break
            refs = [BlockRef(namespace, h) for h in hashes[i:j]]
            groups.append((i, j, name, tier.layered_read(refs, outs[i:j]) or _WholeBlocks(tier, refs, outs[i:j])))
            i = j
        n = i  # blocks a configured tier was asked for
        for l0, l1 in stages:
            for start, end, _, reader in groups:
                if start >= n:
                    break
                got = reader.read(l0, l1)
                if got < end - start:
                    n = min(n, start + got)
            on_stage(l1, n)
        n_ok = n
        for start, end, _, reader in groups:
            got = reader.finish()  # every read finished (counters, files)
            if got < end - start:
                n_ok = min(n_ok, start + got)
        seconds = time.perf_counter() - t0
        for start, end, name, _ in groups:  # one rate sample per tier, its share of the time by bytes
            got = min(n_ok, end) - start
            if got >= self.min_rate_blocks:
                self.record_restore(name, got * self.block_nbytes, seconds * got / n_ok)
        return n_ok

    def location(self, namespace: Namespace, hashes: Sequence[BlockHash]) -> dict[str, int]:
        """How many of these blocks each configured tier holds (one Redis round trip)."""
        refs = [BlockRef(namespace, h) for h in hashes]
        return {name: sum(t.contains_many(refs)) for name, t in self._tiers.items()}

    def delete_many(self, namespace: Namespace, hashes: Sequence[BlockHash], timeout: float = 10.0) -> dict[str, int]:
        """Stop these blocks from being found in any tier, but those a retention holds
        (they go when it expires); how many each tier dropped.
        Queued writes are flushed first (so none lands afterwards), then each tier
        deletes, fastest first, with the writes its deletions queued (demotions to the
        next tier) flushed before the next tier deletes."""
        kept = self.retentions.retained(hashes, self._wall())
        refs = [BlockRef(namespace, h) for h, k in zip(hashes, kept) if not k]  # a retention outlives a delete
        dropped: dict[str, int] = {}
        self.flush(timeout)
        for tier in self._order:
            dropped[tier.name] = sum(tier.delete_many(refs))
            self.flush(timeout)
        return dropped

    # ---- restore rates -----------------------------------------------------------------

    def record_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        """Feed one measured restore into the tier's rate (done by ``fetch_into``; the
        engine adds its device copy time on CUDA)."""
        if seconds > 0 and nbytes > 0 and tier in self._rates:
            now = self._clock()
            with self._rates_lock:
                self._rates[tier].update(nbytes / seconds, now)

    def restore_rate(self, tier: str) -> float:
        """Bytes/s the tier restores at (EWMA of measurements; the prior until then)."""
        with self._rates_lock:
            return self._rates[tier].value

    def estimated_restore_seconds(self, tier: str, n_blocks: int) -> float:
        """Expected seconds to restore ``n_blocks`` from ``tier`` (inf if not
        configured). The engine compares this with its prefill time for those tokens."""
        if tier not in self._rates:
            return float("inf")
        return n_blocks * self.block_nbytes / self.restore_rate(tier)

    # ---- restore or recompute -------------------------------------------------------

    def plan_restore(
        self,
        namespace: Namespace,
        hashes: Sequence[BlockHash],
        recompute_block_s: float | None,
        *,
        always: bool = False,
        min_speedup: float = 1.0,
    ) -> RestorePlan:
        """Where the leading blocks are (``match_prefix``), cut where restoring stops
        paying: the plan kept is the prefix, ending at a tier boundary, that saves the
        most time, saving = recompute time of its tokens - ``min_speedup`` x its
        estimated restore time (per tier, from that tier's measured rate). So a slow
        tier's blocks are recomputed while a fast tier's before them are restored.

        ``recompute_block_s`` is the estimated prefill time of one block's tokens
        (None: not measured yet, restore everything); ``always`` restores every hit.
        Counts every block by (tier, decision, reason); blocks that then fail to load
        are reported with ``note_load_failed``."""
        where = self.match_prefix(namespace, hashes)
        if always or recompute_block_s is None:
            reason = REASON_ALWAYS if always else REASON_UNMEASURED
            self._count(where, 0, len(where), RESTORED, reason)
            return RestorePlan(where, len(where))
        # segment ends: [(end, tier)] for runs of one tier
        ends = [i + 1 for i in range(len(where)) if i + 1 == len(where) or where[i + 1] != where[i]]
        best_k, best_saving = 0, 0.0
        restore_s = 0.0
        start = 0
        for end in ends:
            restore_s += self.estimated_restore_seconds(where[start], end - start)
            saving = end * recompute_block_s - min_speedup * restore_s
            if saving >= best_saving:
                best_k, best_saving = end, saving
            start = end
        keep = best_k
        reasons = [(0, keep, RESTORED, REASON_FASTER)]
        if keep < len(where) and self._stale(where[keep]):
            end = keep
            while end < len(where) and where[end] == where[keep] and end - keep < self.min_rate_blocks:
                end += 1
            reasons.append((keep, end, RESTORED, REASON_PROBE))
            keep = end
        reasons.append((keep, len(where), RECOMPUTED, REASON_SLOWER))
        for a, b, decision, reason in reasons:
            self._count(where, a, b, decision, reason)
        return RestorePlan(where[:keep], len(where))

    def note_load_failed(self, tiers: Sequence[str]) -> None:
        """Blocks a plan kept that did not load (missing, failed verification): counted
        as recomputed, reason ``load_failed``. Their restored counts stay (they were
        decided for restore)."""
        self._count(list(tiers), 0, len(tiers), RECOMPUTED, REASON_LOAD_FAILED)

    def _stale(self, tier: str) -> bool:
        """True when the tier was sampled, but not in the last ``probe_after_s`` (a tier
        never sampled is slower by its configured prior: not probed)."""
        with self._rates_lock:
            r = self._rates.get(tier)
            return r is not None and r.last_t is not None and self._clock() - r.last_t >= self.probe_after_s

    def _count(self, where: Sequence[str], a: int, b: int, decision: str, reason: str) -> None:
        if a >= b:
            return
        with self._rates_lock:
            for tier, n in Counter(where[a:b]).items():
                self._decisions[(tier, decision, reason)] += n

    # ---- synchronous writes -----------------------------------------------------------

    def put(self, namespace: Namespace, block_hash: BlockHash, block: torch.Tensor, tiers: Sequence[str]) -> bool:
        """Store a copy of one block in each of ``tiers`` now; True if all hold it."""
        return self.put_many(namespace, [block_hash], [block], tiers)[0]

    def put_many(
        self,
        namespace: Namespace,
        hashes: Sequence[BlockHash],
        blocks: Sequence[torch.Tensor],
        tiers: Sequence[str],
    ) -> list[bool]:
        """Store copies of blocks in each of ``tiers`` now (idempotent); per block, True
        if every requested tier holds it afterwards."""
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes but {len(blocks)} blocks")
        refs = [BlockRef(namespace, h) for h in hashes]
        held = self._write(refs, list(blocks), self._check_tiers(tiers))
        return [all(held[t][i] for t in held) for i in range(len(refs))]

    def demote(self, namespace: Namespace, block_hash: BlockHash, block: torch.Tensor) -> None:
        """A block the device pool evicts (``block`` is valid only during the call): into
        the first tier, from which the tiers' own evictions carry it down the list. Never
        waits on I/O and never raises for a tier's failure (drops are counted)."""
        if tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"block must be {self.block_shape} {self.dtype}, got {tuple(block.shape)} {block.dtype}")
        self._demote_into(0, BlockRef(namespace, block_hash), block)

    # ---- background writes ------------------------------------------------------------

    def submit_spill(
        self,
        items: Sequence[tuple[Namespace, BlockHash, torch.Tensor | None]],
        tiers: Sequence[str],
        on_done: Callable[[SpillResult], None] | None = None,
    ) -> bool:
        """Queue ``(namespace, block_hash, block)`` items to be stored in ``tiers`` by the
        writer thread. Never blocks: False (and the blocks counted as dropped) when the
        queue is full or the store is closed; then ``on_done`` is never called.

        A ``block`` of None is a block the caller does not hold (no longer on the
        device): the writer copies it from the host tier to the other tiers, or, when
        the host does not hold it either, only checks which tiers already do. So a spill
        covers every block of a session whichever tier holds it.

        The writer reads each ``block`` later: the caller keeps those tensors unchanged
        until ``on_done`` runs (e.g. holds a reference on the device blocks), or passes
        copies. ``on_done`` runs on the writer thread and must be quick.
        """
        job = _Job(
            refs=[BlockRef(ns, h) for ns, h, _ in items],
            tiers=self._check_tiers(tiers),
            blocks=[b for _, _, b in items],
            on_done=on_done,
        )
        for b in job.blocks:
            if b is not None and (tuple(b.shape) != self.block_shape or b.dtype != self.dtype):
                raise ValueError(f"block must be {self.block_shape} {self.dtype}, got {tuple(b.shape)} {b.dtype}")
        if self._enqueue(job):
            self._bump(submitted=len(job.refs))
            return True
        self._bump(dropped=len(job.refs))
        return False

    # ---- retention ----------------------------------------------------------------------

    def now(self) -> float:
        """The unix time retentions run to (``wall_clock``)."""
        return self._wall()

    def reserve_retention(self, owner: str, hashes: Sequence[BlockHash]) -> Reservation:
        """Hold room in ``owner``'s bound for these blocks (``RetentionBook.reserve``:
        raises ``RetentionBudget``); ``submit_retain`` uses it, ``cancel_retention``
        gives it back."""
        return self.retentions.reserve(owner, hashes)

    def cancel_retention(self, reservation: Reservation) -> None:
        self.retentions.cancel(reservation)

    def submit_retain(
        self,
        items: Sequence[tuple[Namespace, BlockHash, torch.Tensor | None]],
        untils: Sequence[float],
        reservation: Reservation,
        on_done: Callable[[RetainResult], None],
    ) -> None:
        """Retain ``items`` (``submit_spill``'s, a ``block`` of None found in the host
        tier or wherever a tier holds it) until ``untils`` (unix times, per block): the
        writer, before any other queued write, stores each block in every ``retain_to``
        tier that lacks it, pins it in each that holds it, records the pinned ones in the
        book under ``reservation`` and calls ``on_done(RetainResult)`` on its thread. The
        caller keeps the given tensors unchanged until then. Never blocks; a full queue
        or a closed store calls ``on_done`` at once with nothing pinned (and gives the
        reservation back)."""
        if len(untils) != len(items):
            raise ValueError(f"{len(items)} blocks but {len(untils)} times")
        job = _Job(
            refs=[BlockRef(ns, h) for ns, h, _ in items],
            tiers=self.retain_to,
            blocks=[b for _, _, b in items],
            pinning=_Pinning(list(untils), reservation, on_done),
        )
        if not self.retain_to or not self._enqueue(job, front=True):
            self._finish_pinning(job, {})

    def expire_retentions(self) -> int:
        """Release every retention whose time passed (the book, then each tier's pins:
        Redis' shared set only while this store retains, else another replica's
        business); how many tier pins were released. The writer calls it every
        ``retention_tick_s``."""
        now = self._wall()
        self.retentions.expire(now)
        n = 0
        for tier in self._order:
            if not tier.retains or (tier.shared and not self.retaining):
                continue
            try:
                n += tier.expire_retained(now)
            except Exception:  # noqa: BLE001 - a tier's failure must not stop the others' expiry
                log.exception("releasing expired retentions in the %s tier failed", tier.name)
        return n

    @property
    def retaining(self) -> bool:
        """Retentions may be made here: a retain tier, and a bound above 0."""
        return bool(self.retain_to) and self.retentions.max_blocks_per_owner > 0

    def check_retention_safety(self) -> dict[str, bool | None]:
        """Ask each retain tier that evicts on its own (Redis: ``keeps_retentions``)
        whether its eviction leaves retained blocks alone, and say in one line where it
        may not; kept for ``stats``. The writer asks at its first pass, off the start's
        path (a Redis that is down costs it a timeout, not the start)."""
        out: dict[str, bool | None] = {}
        for name in self.retain_to:
            ask = getattr(self._tiers[name], "keeps_retentions", None)
            if ask is None:
                continue
            out[name], warning = ask()
            if warning:
                log.warning("retention: the %s tier %s (docs/api.md, Retention)", name, warning)
        self.retention_safe = out
        return out

    def _pin(self, job: _Job, held: dict[str, list[bool]]) -> dict[str, list[bool]]:
        """A retain job's blocks are written: pin them where they are, until their times;
        per tier, which it pins."""
        assert job.pinning is not None
        p = job.pinning
        n = len(job.refs)
        pinned: dict[str, list[bool]] = {}
        for name in job.tiers:
            tier, there = self._tiers[name], held.get(name, [False] * n)
            flags = [False] * n
            for until in sorted(set(p.untils)):  # one call per time (a retention has at most a few)
                idx = [i for i in range(n) if p.untils[i] == until and there[i]]
                if idx:
                    for i, ok in zip(idx, tier.retain([job.refs[i] for i in idx], until, p.reservation.owner)):
                        flags[i] = ok
            pinned[name] = flags
        return pinned

    def _finish_pinning(self, job: _Job, pinned: dict[str, list[bool]]) -> None:
        assert job.pinning is not None
        p = job.pinning
        tiers = [tuple(t for t in job.tiers if pinned.get(t, [False] * len(job.refs))[i]) for i in range(len(job.refs))]
        self.retentions.commit(
            p.reservation, {bytes(job.refs[i].block_hash): p.untils[i] for i, t in enumerate(tiers) if t}
        )
        try:
            p.on_done(RetainResult(tiers, list(p.untils)))
        except Exception:  # noqa: BLE001
            log.exception("retain callback failed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done; False if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._pending_blocks > 0:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
        return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Drain the queue (up to ``timeout``), stop the writer and close Redis. Writes
        still queued after the timeout are dropped. True if everything was written."""
        drained = self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout)
        for tier in self._order:
            tier.close()
        return drained

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> TieredStats:
        with self._cv:
            w = dict(self._w)
            queued = self._pending_blocks
        with self._rates_lock:
            rates = {name: r.value for name, r in self._rates.items()}
            decisions = dict(self._decisions)
        return TieredStats(
            retention=self.retentions.stats(),
            retain_to=self.retain_to,
            retention_safe=dict(self.retention_safe),
            decisions=decisions,
            tiers={name: t.stats() for name, t in self._tiers.items()},
            restore_rates=rates,
            writer=WriterStats(
                queued_blocks=queued,
                submitted_blocks=w["submitted"],
                dropped_blocks=w["dropped"],
                demoted_blocks=w["demoted"],
                demotions_dropped=w["demotions_dropped"],
                written_blocks=w["written"],
                errors=w["errors"],
            ),
        )

    # ---- internals ------------------------------------------------------------------

    def _check_tiers(self, tiers: Sequence[str]) -> tuple[str, ...]:
        """Validate names; the configured ones in the store's order, then the others
        (a tier asked for but not configured holds nothing)."""
        if isinstance(tiers, str):
            raise TypeError("tiers must be a sequence of names, e.g. ('host', 'redis')")
        unknown = set(tiers) - set(TIER_NAMES)
        if unknown:
            raise ValueError(f"unknown tiers {sorted(unknown)}; known: {TIER_NAMES}")
        configured = tuple(t for t in self._tiers if t in tiers)
        return configured + tuple(t for t in TIER_NAMES if t in tiers and t not in self._tiers)

    def _write(
        self, refs: list[BlockRef], blocks: list[torch.Tensor], tiers: tuple[str, ...]
    ) -> dict[str, list[bool]]:
        held: dict[str, list[bool]] = {}
        for name in tiers:
            tier = self._tiers.get(name)
            held[name] = tier.put_many(refs, blocks) if tier is not None else [False] * len(refs)
        return held

    def _write_job(self, job: _Job) -> dict[str, list[bool]]:
        """Write a job's blocks. A block given as None is copied out of the fastest tier
        that hands copies out (``BlockTier.copy_out``: the host) and written into the
        other tiers asked for, in batches through one scratch buffer per block of the
        batch; where no tier hands it out, the tiers asked for are only asked whether
        they hold it."""
        refs, blocks, tiers = job.refs, job.blocks, job.tiers
        given = [i for i, b in enumerate(blocks) if b is not None]
        if len(given) == len(refs):
            return self._write(refs, blocks, tiers)  # type: ignore[arg-type]
        held = {t: [False] * len(refs) for t in tiers}

        def scatter(idx: list[int], sub: dict[str, list[bool]]) -> None:
            for t, flags in sub.items():
                for i, f in zip(idx, flags):
                    held[t][i] = f

        if given:
            scatter(given, self._write([refs[i] for i in given], [blocks[i] for i in given], tiers))  # type: ignore[misc]
        missing = [i for i, b in enumerate(blocks) if b is None]
        batch = min((self._tiers[t].batch_blocks for t in tiers if t in self._tiers), default=64)
        scratch: list[torch.Tensor] = []
        for start in range(0, len(missing), batch):
            idx = missing[start : start + batch]
            while len(scratch) < len(idx):
                scratch.append(torch.empty(self.block_shape, dtype=self.dtype))
            copied: dict[str, list[tuple[int, torch.Tensor]]] = {}  # source tier -> (block, its copy)
            for i in idx:
                buf = scratch[sum(len(v) for v in copied.values())]
                src = next((t.name for t in self._order if t.copy_out(refs[i], buf)), None)
                if src is not None:
                    copied.setdefault(src, []).append((i, buf))
            for src, pairs in copied.items():
                ids = [i for i, _ in pairs]
                if src in tiers:
                    scatter(ids, {src: [True] * len(ids)})
                others = tuple(t for t in tiers if t != src)
                if others:
                    scatter(ids, self._write([refs[i] for i in ids], [b for _, b in pairs], others))
            done = {i for pairs in copied.values() for i, _ in pairs}
            absent = [i for i in idx if i not in done]
            for t in tiers:
                tier = self._tiers.get(t)
                if absent and tier is not None:
                    scatter(absent, {t: tier.contains_many([refs[i] for i in absent])})
        return held

    def _demote_into(self, i: int, ref: BlockRef, block: torch.Tensor) -> None:
        """Put an evicted block (valid only during the call) into tier ``i``: inline
        when its puts are a memcpy (its own evictions then come back here for tier
        ``i + 1``), else copied into a staging buffer and queued for the writer, which
        stores it only if the tier does not hold it yet. Never waits: an open breaker,
        no staging buffer free or a full queue drops it (counted)."""
        tier = self._order[i]
        if tier.writes_inline:
            if not tier.put(ref, block) and i + 1 < len(self._order):  # full of pinned blocks
                self._demote_into(i + 1, ref, block)
            return
        if tier.breaker_state == OPEN:
            self._bump(demotions_dropped=1)
            return
        with self._cv:
            staging = self._staging_free.pop() if self._staging_free else None
        if staging is None:
            self._bump(demotions_dropped=1)
            return
        copy_block(staging, block)
        if self._enqueue(_Job(refs=[ref], tiers=(tier.name,), blocks=[staging], staging=[staging])):
            self._bump(demoted=1)
        else:
            with self._cv:
                self._staging_free.append(staging)
            self._bump(demotions_dropped=1)

    def _enqueue(self, job: _Job, front: bool = False) -> bool:
        with self._cv:
            if self._closed or self._pending_blocks + len(job.refs) > self.max_pending_blocks:
                return False
            if front:
                self._jobs.appendleft(job)
            else:
                self._jobs.append(job)
            self._pending_blocks += len(job.refs)
            self._cv.notify_all()
        return True

    def _bump(self, **counts: int) -> None:
        with self._cv:
            for k, v in counts.items():
                self._w[k] += v

    def _next_job(self) -> _Job | bool | None:
        """The next job, with consecutive demotions merged into one pipeline; False when
        retentions are due to expire first (every ``retention_tick_s``); None when
        closed and empty."""
        dropped_pinnings: list[_Job] = []
        with self._cv:
            while not self._jobs and not self._closed and time.monotonic() < self._next_tick:
                self._cv.wait(self._next_tick - time.monotonic())
            if self._closed:  # close() already waited for the drain: drop the rest
                dropped = sum(len(j.refs) for j in self._jobs)
                for j in self._jobs:
                    self._staging_free.extend(j.staging or ())
                dropped_pinnings = [j for j in self._jobs if j.pinning is not None]
                self._jobs.clear()
                self._pending_blocks -= dropped
                self._w["dropped"] += dropped
                self._cv.notify_all()
                job = None
            elif time.monotonic() >= self._next_tick:
                return False
            else:
                job = self._jobs.popleft()
                if job.staging is not None:  # batch consecutive demotions into one tier
                    limit = self._tiers[job.tiers[0]].batch_blocks
                    while (
                        self._jobs
                        and self._jobs[0].staging is not None
                        and self._jobs[0].tiers == job.tiers
                        and len(job.refs) < limit
                    ):
                        nxt = self._jobs.popleft()
                        job = _Job(
                            refs=job.refs + nxt.refs,
                            tiers=job.tiers,
                            blocks=job.blocks + nxt.blocks,
                            staging=job.staging + (nxt.staging or []),
                        )
        for j in dropped_pinnings:  # their callers wait for an answer: nothing was pinned
            self._finish_pinning(j, {})
        return job

    def _writer_loop(self) -> None:
        with torch.inference_mode():  # the tiers' buffers may be inference tensors (a store built under it)
            self._write_jobs()

    def _write_jobs(self) -> None:
        while (job := self._next_job()) is not None:
            if job is False:  # retentions' tick
                first, self._next_tick = self._next_tick == 0.0, time.monotonic() + self.retention_tick_s
                try:
                    if first and self.retaining:
                        self.check_retention_safety()
                    self.expire_retentions()
                except Exception:  # noqa: BLE001 - the writer must outlive any one tick
                    log.exception("releasing expired retentions failed")
                continue
            pinned: dict[str, list[bool]] = {}
            try:
                held = self._write_job(job)
                if job.pinning is not None:
                    pinned = self._pin(job, held)
                if job.on_done is not None:
                    job.on_done(SpillResult(len(job.refs), {t: sum(h) for t, h in held.items()}))
            except Exception:  # noqa: BLE001 - the writer must outlive any one job
                log.exception("cachestore writer job failed")
                self._bump(errors=1)
            finally:
                if job.pinning is not None:  # its caller waits for the answer, whatever happened
                    self._finish_pinning(job, pinned)
                with self._cv:
                    self._staging_free.extend(job.staging or ())
                    self._pending_blocks -= len(job.refs)
                    self._w["written"] += len(job.refs)
                    self._cv.notify_all()
