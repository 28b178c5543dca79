"""The restore room: the engine's one caller of the tiered store (cachestore/tiered.py).

Restores: admission names a range of blocks past the device hits (service/engine/
scheduler.py); ``start`` looks them up in host/Redis and loads the hits into the
sequence's fresh blocks, all on the ``kv-restore`` thread (plan: ``plan_restore`` cuts
where restoring would lose to recomputing, weighed with the runner's measured prefill
rate; fetch and verify: the plan's ``TieredStore.reads``, one per tier run, moved by
``BlockTransfers.restore``), so the decode loop never waits on the store. ``collect`` takes the landed ones on the engine thread and
registers what was loaded.

Overlapped restores (``restore_stages`` > 0, off by default; CPU pools): a returning turn's prefill need
not wait for the whole restore. The restore thread plans first and says how many blocks
it will load (``Landing.plan``), then loads them in ``restore_stages`` groups of layers
(``TieredStore.fetch_layered``: layer l of every block before layer l + 1 of any),
marking each group landed. When the engine has nothing else to compute, it runs the
turn's new tokens over the planned context at once (``LLMEngine._overlap``): each
layer's attention waits for its layer of the restored blocks (``Landing.wait_layer``,
through ``BatchLayout.landed``), so layer l computes while layer l + 1 is on the way and
the turn's TTFT tends to max(restore, prefill) instead of their sum. Nothing of that
forward is kept until the restore finished and verified every planned block: a block
that fails (missing, truncated, bad checksum) makes the whole forward void, and the
tokens from that block on are recomputed, as after any failed restore (never wrong KV).
On CUDA the restore goes through the staging rounds (service/kv/transfer.py: large
host-to-device copies, one scatter into the pool per round, lossy formats decoded on the
device) and is not overlapped.

Besides: device evictions demote down the tiers, spills write
a transcript's blocks out, retentions reserve room in a tenant's bound and pin a
prefix's blocks in the tiers (service/engine/retention.py), and a transcript's stored
blocks are located or forgotten, each keyed by ``BlockKeys`` (service/kv/keys.py).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from kvserve.cachestore.keys import BlockHash
from kvserve.cachestore.retention import Reservation
from kvserve.cachestore.tiered import RetainResult, TieredStore
from .sequence import Sequence
from ..kv.block_manager import Block, BlockManager
from ..kv.cache import KVPool
from ..kv.keys import BlockKeys
from ..kv.transfer import BlockTransfers
from ..types import CacheScope, Tier

log = logging.getLogger(__name__)


def layer_stages(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """``num_layers`` cut into ``stages`` consecutive groups, as even as they come:
    (first layer, end) each."""
    k = max(1, min(stages, num_layers))
    cuts = [round(i * num_layers / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


class Landing:
    """An overlapped restore's progress, written by the restore thread and waited on by
    the engine thread: the blocks planned (None until planned), how many layers of the
    leading blocks still good have landed, and whether the restore is over (then no
    wait blocks: a failed restore's forward runs on and is thrown away)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.planned: int | None = None
        self.layers = 0
        self.blocks = 0
        self.done = False
        self.t_done = 0.0  # monotonic time the restore was over

    def plan(self, n_blocks: int) -> None:
        with self._cv:
            self.planned = self.blocks = n_blocks
            self._cv.notify_all()

    def landed(self, layers: int, n_blocks: int) -> None:
        with self._cv:
            self.layers, self.blocks = layers, n_blocks
            self._cv.notify_all()

    def finish(self) -> None:
        with self._cv:
            self.done = True
            self.t_done = time.monotonic()
            self._cv.notify_all()

    def wait_layer(self, layer: int) -> None:
        """Return once ``layer`` of the planned blocks landed, or the restore is over."""
        with self._cv:
            while self.layers <= layer and not self.done:
                self._cv.wait()


class Restorer:
    def __init__(
        self,
        store: TieredStore | None,
        transfers: BlockTransfers,
        pool: KVPool,
        blocks: BlockManager,
        keys: BlockKeys,
        *,
        policy: str,
        min_speedup: float,
        wake: Callable[[], None],
        call_soon: Callable[[Callable[[], None]], None],
        stages: int = 0,
    ) -> None:
        self.store = store
        self.transfers = transfers
        self.pool = pool
        self.blocks = blocks
        self.keys = keys
        self.block_size = keys.block_size
        self.always = policy == "always"
        self.min_speedup = min_speedup
        self._wake = wake  # a restore landed: the engine thread should look
        self._call_soon = call_soon  # run on the engine thread between steps
        # layer groups of an overlapped restore (none: restores land whole before prefill);
        # only where restores write into the pool in place (the CPU)
        self.stages = layer_stages(pool.num_layers, stages) if stages > 0 and transfers.in_place else []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-restore")  # jobs through ``_submit``
        self.num_restores_skipped = 0  # restores cut because recomputing was faster
        self.num_overlapped = 0  # forwards run over a landing restore (LLMEngine._overlap)
        self.num_overlaps_voided = 0  # of those, thrown away: a planned block did not verify

    # ---- restores --------------------------------------------------------------------

    def start(self, seq: Sequence, hashes: list[BlockHash], blocks: list[Block], prefill_tokens_per_s: float | None) -> None:
        """Look the blocks up in host/Redis and load the hits into ``blocks``, all on
        the restore thread. The loads land in the pool itself (CPU) or go through the
        staging rounds on the restore stream (CUDA; service/kv/transfer.py)."""
        seq.t_restore0 = time.monotonic()
        after = self.transfers.begin_restore()
        block_ids = [b.block_id for b in blocks]
        s_per_block = None if prefill_tokens_per_s is None else self.block_size / prefill_tokens_per_s
        seq.landing = Landing() if self.stages else None
        seq.restore = self._submit(self._job, seq.namespace, hashes, block_ids, after, s_per_block, seq.landing)
        seq.restore.add_done_callback(lambda _: self._wake())

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the restore thread in torch's inference mode, as the engine's
        steps run: the pool may be an inference tensor (an engine built inside
        ``torch.inference_mode``), which only inference mode may write."""
        return self._pool.submit(torch.inference_mode()(fn), *args)

    def overlappable(self, restoring: list[Sequence], budget: int) -> Sequence | None:
        """Engine thread: a restoring sequence whose restore is planned and still
        landing, whose remaining prompt fits one forward of ``budget`` tokens (its first
        token comes from that forward), to compute over the landing context now."""
        for seq in restoring:
            landing = seq.landing
            if landing is None or landing.planned is None or landing.done or not landing.planned or seq.cancelled:
                continue
            if len(seq.token_ids) - self.overlap_start(seq) <= budget:
                return seq
        return None

    def overlap_start(self, seq: Sequence) -> int:
        """The first token an overlapped forward computes: past the planned blocks."""
        assert seq.landing is not None and seq.landing.planned is not None
        return (seq.num_registered + seq.landing.planned) * self.block_size

    def wait(self, seq: Sequence) -> None:
        """Blocking (engine thread): until the sequence's restore job returned."""
        if seq.restore is not None:
            try:
                seq.restore.exception()
            except Exception:  # noqa: BLE001 - cancelled: collect says so
                pass

    def may_hold(self, namespace: bytes, hashes: list[BlockHash]) -> bool:
        """Engine thread, before a restore is started: whether any tier may hold the
        first of ``hashes`` (a restore loads leading blocks only, so without it there is
        nothing to load). With only local tiers (host memory, disk: in-memory indexes)
        the answer is exact and cheap (a locked dict lookup): a miss (e.g. a returning turn's new tokens, past
        its device hits) then runs at once instead of a step later, after a hop through
        the restore thread. A shared tier (Redis) is a network round trip: the restore
        thread asks it, so the answer is True."""
        store = self.store
        if store is None or not hashes:
            return False
        if store.shared_tier is not None:
            return True
        return bool(store.match_prefix(namespace, hashes[:1]))

    def _job(
        self, namespace: bytes, hashes: list[BlockHash], block_ids: list[int], after: Any, s_per_block: float | None,
        landing: Landing | None,
    ) -> tuple[list[str], Any]:
        """Runs on the restore thread. Returns the tier of each leading block that was
        loaded into the pool and verified, and the event of the last copy (CUDA)."""
        try:
            return self._restore(namespace, hashes, block_ids, after, s_per_block, landing)
        finally:
            if landing is not None:
                landing.finish()

    def _restore(
        self, namespace: bytes, hashes: list[BlockHash], block_ids: list[int], after: Any, s_per_block: float | None,
        landing: Landing | None,
    ) -> tuple[list[str], Any]:
        assert self.store is not None
        plan = self.store.plan_restore(
            namespace, hashes, s_per_block, always=self.always, min_speedup=self.min_speedup
        )
        if plan.cut:
            self.num_restores_skipped += 1
        tiers = plan.tiers
        if landing is not None:
            landing.plan(len(tiers))
            if tiers:
                self._wake()  # the engine may compute over the landing blocks now
        if not tiers:
            return [], None
        if landing is not None:
            outs = [self.pool.block_view(b) for b in block_ids[: len(tiers)]]
            n_ok = self.store.fetch_layered(namespace, hashes[: len(tiers)], tiers, outs, self.stages, landing.landed)
            if n_ok < len(tiers):
                self.store.note_load_failed(tiers[n_ok:])
            return tiers[:n_ok], None

        reads = self.store.reads(namespace, hashes[: len(tiers)], tiers)
        n_ok, event = self.transfers.restore(reads, block_ids[: len(tiers)], after)
        if n_ok < len(tiers):
            self.store.note_load_failed(tiers[n_ok:])
        return tiers[:n_ok], event

    def collect(self, restoring: list[Sequence]) -> list[Sequence]:
        """The sequences of ``restoring`` whose restore landed, with what it loaded
        registered under their hashes and counted per tier (a failed job loaded nothing:
        those tokens are recomputed)."""
        if not restoring:
            return []
        landed = [s for s in restoring if s.restore is not None and s.restore.done()]
        for seq in landed:
            try:
                loaded, event = seq.restore.result()
            except Exception:
                log.exception("restore of %s failed; recomputing", seq.request_id)
                loaded, event = [], None
            # an overlapped restore's own time (its forward ran meanwhile: prefill_s has the rest)
            end = seq.landing.t_done if seq.landing is not None and seq.landing.t_done else time.monotonic()
            seq.restore = seq.landing = None
            seq.restore_s = end - seq.t_restore0
            start = seq.num_registered
            self.transfers.finish_restore(event)
            B = self.block_size
            for i, tier_name in enumerate(loaded):
                j = start + i
                self.blocks.register(seq.blocks[j], seq.hashes[j], seq.namespace,
                                     parent=seq.hashes[j - 1] if j else None, tokens=seq.token_ids[j * B : (j + 1) * B])
                tier = Tier(tier_name)  # the store reports names
                seq.cached_by_tier[tier] = seq.cached_by_tier.get(tier, 0) + self.block_size
            seq.num_registered = start + len(loaded)
            seq.num_computed = seq.num_registered * self.block_size
        return landed

    # ---- warm-ups (service/engine/warm.py holds what these load) ---------------------

    def locate_warm(self, namespace: bytes, hashes: list[BlockHash], then: Callable[[list[str]], None]) -> None:
        """A session warm-up: on the restore thread, the tier of each leading block of
        ``hashes`` that a store tier holds; ``then(tiers)`` there (``[]`` when the lookup
        fails: a warm-up that cannot look is a miss)."""
        assert self.store is not None
        store = self.store

        def job() -> None:
            try:
                tiers = list(store.match_prefix(namespace, hashes))
            except Exception:
                log.exception("warm-up lookup failed")
                tiers = []
            then(tiers)

        self._submit(job)

    def fetch_warm(
        self,
        namespace: bytes,
        hashes: list[BlockHash],
        tiers: list[str],
        blocks: list[Block],
        then: Callable[[list[str], Any], None],
    ) -> None:
        """A session warm-up: load ``hashes`` (held by ``tiers``) into ``blocks`` on the
        restore thread, each verified, as a turn's restore does (``BlockTransfers.restore``);
        ``then(loaded tiers, event)`` there, for the leading blocks that loaded."""
        assert self.store is not None
        store = self.store
        after = self.transfers.begin_restore()
        block_ids = [b.block_id for b in blocks]

        def job() -> None:
            try:
                n_ok, event = self.transfers.restore(store.reads(namespace, hashes, tiers), block_ids, after)
            except Exception:
                log.exception("warm-up restore failed")
                n_ok, event = 0, None
            if n_ok < len(tiers):
                store.note_load_failed(tiers[n_ok:])
            then(tiers[:n_ok], event)

        self._submit(job)

    # ---- demotions, spills, locations, forgetting ------------------------------------

    def demote(self, block: Block) -> None:
        """Device eviction demotes the block down the store's tiers instead of dropping
        it (``TieredStore.demote``: the store decides where it goes). On CUDA the device
        -> host copy runs on the demotion stream and the store receives it once it
        completed (service/kv/transfer.py); the block is reusable right away."""
        store = self.store
        if store is None or block.block_hash is None or block.namespace is None:
            return
        ns, h, block_id = block.namespace, block.block_hash, block.block_id
        try:
            self.transfers.demote(block_id, lambda data: store.demote(ns, h, data))
        except Exception:
            log.exception("demoting block %d failed", block_id)

    def spill(
        self,
        token_ids: list[int],
        scope: CacheScope,
        tiers: tuple[str, ...],
        done: Callable[[int, dict[str, int]], None],
    ) -> None:
        """Engine thread: write every full block of the transcript to ``tiers`` in the
        background, the device ones pinned (a reference) until the writer copied them."""
        if self.store is None:
            done(0, {})
            return
        ns, hashes = self.keys.of(token_ids, scope)
        if not hashes:
            done(0, {})
            return
        on_device = [self.blocks.lookup(h) for h in hashes]
        pinned = [b for b in on_device if b is not None]
        self.blocks.touch(pinned)
        items = [(ns, h, self.pool.block_view(b.block_id) if b is not None else None) for h, b in zip(hashes, on_device)]

        def written(result) -> None:
            self._call_soon(lambda: self.blocks.free(pinned))
            done(len(hashes), dict(result.held))

        if not self.store.submit_spill(items, tiers, on_done=written):
            self.blocks.free(pinned)
            done(len(hashes), {})

    # ---- retentions (service/engine/retention.py) ----------------------------------

    @property
    def can_retain(self) -> bool:
        """A configured tier can pin blocks for a retention (``--retain-to``)."""
        return self.store is not None and bool(self.store.retain_to)

    def now(self) -> float:
        """The unix time retentions run to (the store's clock)."""
        assert self.store is not None
        return self.store.now()

    def reserve_retention(self, owner: str, hashes: list[BlockHash]) -> Reservation:
        """Hold room in ``owner``'s bound for these blocks (raises
        ``cachestore.retention.RetentionBudget`` past it); any thread."""
        assert self.store is not None
        return self.store.reserve_retention(owner, hashes)

    def cancel_retention(self, reservation: Reservation) -> None:
        assert self.store is not None
        self.store.cancel_retention(reservation)

    def retain(
        self,
        namespace: bytes,
        hashes: list[BlockHash],
        untils: list[float],
        reservation: Reservation,
        done: Callable[[RetainResult], None],
    ) -> None:
        """Engine thread: pin these blocks until ``untils`` in the store's retain tiers
        (``TieredStore.submit_retain``), writing there first those they lack: device
        blocks from the pool, held (a reference each) until the writer copied them, the
        others from wherever the store holds them. ``done(result)`` on the writer's
        thread."""
        assert self.store is not None
        on_device = [self.blocks.lookup(h) for h in hashes]
        pinned = [b for b in on_device if b is not None]
        self.blocks.touch(pinned)
        items = [(namespace, h, self.pool.block_view(b.block_id) if b is not None else None)
                 for h, b in zip(hashes, on_device)]  # fmt: skip

        def written(result: RetainResult) -> None:
            self._call_soon(lambda: self.blocks.free(pinned))
            done(result)

        self.store.submit_retain(items, untils, reservation, written)

    def locations(self, token_ids: list[int], scope: CacheScope) -> dict[Tier, int]:
        """Blocking: how many of the transcript's full blocks each store tier holds."""
        if self.store is None:
            return {}
        ns, hashes = self.keys.of(token_ids, scope)
        return dict(self.store.location(ns, hashes))

    def forget(self, token_ids: list[int], scope: CacheScope, keep_blocks: int, timeout_s: float) -> dict[Tier, int]:
        """Blocking: delete the transcript's full blocks past ``keep_blocks`` from every
        store tier, in each namespace it may have them in; entries dropped per tier."""
        out: dict[Tier, int] = {}
        if self.store is None:
            return out
        for ns, hashes in self.keys.every_regime(token_ids, scope):  # LongRoPE models: both regimes
            for tier, n in self.store.delete_many(ns, hashes[keep_blocks:], timeout_s).items():
                out[tier] = out.get(tier, 0) + n
        return out

    def flush(self, timeout_s: float) -> bool:
        """Blocking: wait (bounded) for queued writes to reach their tiers."""
        return True if self.store is None else self.store.flush(timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.transfers.drain()
        if self.store is not None:
            self.store.close()
