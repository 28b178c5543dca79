"""The generation loop: continuous batching over a paged, prefix-cached KV pool.

``LLMEngine`` composes four rooms, as vLLM v1 splits scheduler, runner and output
processing, over the KV objects they share (``KVPool``, ``BlockManager``,
``BlockTransfers``) and the one ``BlockKeys`` that derives every block key:

- ``Scheduler`` (scheduler.py): the inbox, the queues, admission, the token budget and
  preemption; ``plan()`` returns a step's decode rows and prefill chunks;
- ``Restorer`` (restore.py): the tiered store's one caller: restores (plan, fetch,
  verify on the ``kv-restore`` thread), demotions, spills, locations, forgetting;
- ``Runner`` (runner.py): block tables, the batch layout, the forward; registers the
  blocks a forward completed and measures the prefill rate;
- ``Output`` (output.py): sampling with grammar masks, the n > 1 fork's output side,
  streaming, stops and the start/finish events; a failure in one request's sampling or
  output fails that request alone.

A request with ``retain`` (retention.py) reserves room in its tenant's bound when it
arrives (refused past it, before anything runs); at its first token (its prompt
computed) its retained prefix goes to the store to be pinned (``Restorer.retain``),
and its ``Finished`` leaves once the store answered, so what it reports was kept.

Beside them ``Warmer`` (warm.py) keeps the blocks that session warm-ups (``warm``) hold
for a coming turn: the restore room loads them, the scheduler asks it to let go of some
when a sequence needs blocks, an admitted sequence's device hits claim them.

No room imports another (they share ``sequence.py``'s data, ``config.py`` and ``kv/``);
this class calls them in order. It is synchronous
and single-threaded: ``step()`` runs one scheduling iteration and returns the events it
produced. ``AsyncEngine`` (async_engine.py) runs it on its own thread and calls only the
public methods below. Everything that other threads hand in (new requests, aborts, calls)
goes through the scheduler's inbox; everything the engine hands out is the returned
event list.

One step:

1. drain the inbox (new requests join the waiting queue, aborts finish sequences),
2. finish restores whose host/Redis loads completed on the restore thread,
3. admit waiting requests while blocks and sequence slots allow: hash the prompt's
   full blocks, share the device hits, start loading host/Redis hits off this thread,
4. run one batched decode forward for sequences with one pending token, and prefill
   chunks (within ``max_num_batched_tokens``) for the rest,
5. sample, detokenize, stop, register newly full blocks under their hashes, finish.

A request with ``n > 1`` is one sequence until its prompt is computed; at its first
sample it forks (``_fork``) into n sequences that share the prompt's full blocks
(a reference each) and each own a copy of its partial last block (reserved when the
request was admitted); from then on they run, stream (``index`` on every event) and
finish as independent sequences. A request ends after n ``Finished`` events.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import torch

from kvserve.cachestore.keys import BlockHash
from kvserve.cachestore.retention import Reservation, RetentionBudget
from kvserve.cachestore.tiered import RetainResult, TieredStore
from . import retention
from .config import EngineConfig
from .grammar import GrammarCompiler
from .output import Output, Sampler
from .restore import Restorer
from .runner import Row, Runner
from .sampling import sample
from .scheduler import Scheduler
from .speculative import SpecConfig
from .sequence import Emitted, Sequence, SeqStatus
from .warm import Warmer, WarmJob
from ..kv.block_manager import Block, BlockEvents, BlockManager
from ..kv.cache import KVPool
from ..kv.keys import BlockKeys
from ..kv.transfer import BlockTransfers
from ..models.step import GraphConfig, build_step
from ..types import (
    CacheScope,
    CacheStats,
    EngineStats,
    EngineStopped,
    FinishReason,
    Finished,
    GenerationRequest,
    ModelInfo,
    ResponseFormat,
    Retain,
    RetainedPrefix,
    RetentionRefused,
    Tier,
    WarmResult,
)
from ..validation import check_generation, check_retain

if TYPE_CHECKING:
    from ..models.loading import LoadedModel
    from ..models.tokenizer import Tokenizer

log = logging.getLogger(__name__)

__all__ = ["Emitted", "LLMEngine", "SeqStatus", "Sequence"]


def _model_info(loaded: LoadedModel, max_model_len: int, block_size: int, bytes_per_token: int,
                store: TieredStore | None) -> ModelInfo:  # fmt: skip
    """What the engine serves, as ``AsyncEngine.model_info`` reports it."""
    mcfg = loaded.config
    return ModelInfo(
        architecture=mcfg.hf_architecture,
        model_type=mcfg.model_type,
        model_fingerprint=loaded.fingerprint,
        context_length=max_model_len,
        vocab_size=mcfg.vocab_size,
        block_size=block_size,
        dtype=str(loaded.dtype).removeprefix("torch."),  # compute; the KV's format: bytes_per_token
        device=str(loaded.device),
        num_layers=mcfg.num_layers,
        num_kv_heads=mcfg.num_kv_heads,
        head_dim=mcfg.head_dim,
        bytes_per_token=bytes_per_token,
        eos_token_ids=tuple(loaded.eos_token_ids),
        tiers=(Tier.DEVICE,) + (tuple(store.tiers) if store is not None else ()),
        shared_tier=store.shared_tier if store is not None else None,
    )


class LLMEngine:
    """``transfers``: builds the pool's ``BlockTransfers`` (tests pass fake streams);
    ``sampler``: the output room's sampler (``sampling.sample``; tests inject faults);
    ``events``: told of every hash the device pool starts or stops holding (the KV events
    publisher, service/kv_events.py; ``BlockManager``'s ``BlockEvents``).

    Over 400 lines: the typed API every caller goes through (each method a few lines over a room) and the step calling the rooms in order; the work is in the rooms."""

    def __init__(
        self,
        loaded: LoadedModel,
        cfg: EngineConfig,
        store: TieredStore | None = None,
        *,
        transfers: Callable[[KVPool], BlockTransfers] | None = None,
        sampler: Sampler = sample,
        events: BlockEvents | None = None,
    ) -> None:
        self.cfg = cfg
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        mcfg = loaded.config
        self.block_size = cfg.block_size
        self.max_model_len = min(cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings)
        # the KV objects the rooms share
        self.pool = loaded.new_kv_pool(cfg.kv_cache_memory, cfg.block_size, cfg.kv_cache_format)
        self.blocks = BlockManager(self.pool.num_blocks, on_evict=self._demote, events=events)
        # restores into / demotions out of the pool (CUDA: streams, events, pinned staging)
        self.transfers = (transfers or (lambda pool: BlockTransfers.for_pool(pool, cfg.staging_memory)))(self.pool)
        self.store = store
        self.keys = BlockKeys(loaded.fingerprint, self.pool.spec.namespace_field, cfg.block_size, mcfg.longrope_threshold)
        self.grammars = GrammarCompiler(self.tokenizer, loaded.eos_token_ids)
        self.accepting = True

        self.model_info = _model_info(loaded, self.max_model_len, self.block_size, self.pool.bytes_per_token, store)

        # the rooms
        if cfg.speculative not in ("ngram", "off"):
            raise ValueError(f"speculative must be ngram or off, got {cfg.speculative!r}")
        # off: requests draft only when they ask to (SamplingParams.speculative)
        self.spec = SpecConfig(enabled=cfg.speculative == "ngram", max_draft=cfg.spec_max_draft)
        usable = self.blocks.num_usable
        self.warmer = Warmer(
            self.blocks, max_blocks=int(cfg.warm_pool_fraction * usable),
            max_blocks_per_tenant=int(cfg.warm_tenant_fraction * usable), ttl_s=cfg.warm_ttl_s,
            block_size=cfg.block_size,
        )  # fmt: skip
        self.scheduler = Scheduler(
            cfg, self.blocks, self.keys, has_tiers=store is not None,
            may_hold=lambda namespace, hashes: self.restorer.may_hold(namespace, hashes),
            reclaim=self.warmer.reclaim, warming=self.warmer.loading,
            max_model_len=self.max_model_len, spec=self.spec,
            prefill_rate=lambda: self.runner.prefill_tokens_per_s,
        )  # fmt: skip
        self.restorer = Restorer(
            store, self.transfers, self.pool, self.blocks, self.keys,
            policy=cfg.restore_policy, min_speedup=cfg.restore_min_speedup,
            wake=self.scheduler.work_ready.set, call_soon=self.scheduler.call_soon, stages=cfg.restore_stages,
        )  # fmt: skip
        windows = [mcfg.layer_window(i) for i in range(mcfg.num_layers)]
        step = build_step(loaded.model, self.pool, loaded.device, max_context=self.max_model_len,
                          graphs=GraphConfig(cfg.cuda_graphs, cfg.cuda_graph_max_rows, cfg.cuda_graph_memory))  # fmt: skip
        self.runner = Runner(
            loaded.model, self.pool, self.blocks, self.keys, self.transfers, device=loaded.device,
            release_window=max(windows) if all(w is not None for w in windows) else None,  # type: ignore[type-var]
            step=step,
        )  # fmt: skip
        self.output = Output(
            self.tokenizer, self.grammars, eos_ids=frozenset(loaded.eos_token_ids), model_vocab=mcfg.vocab_size,
            max_model_len=self.max_model_len, device=loaded.device, tiers=self.model_info.tiers, sampler=sampler,
        )  # fmt: skip
        self.retention = retention.RetentionCounters()
        self._late: Emitted = []  # events a retention held until the store answered (emitted by the next step)
        self._late_sent = 0  # of those, put in the current step's events

    # ---- the typed API (AsyncEngine calls these and nothing else) --------------------
    # Any thread unless marked: "engine thread" (through call_soon) or "blocking".

    def get_model_info(self) -> ModelInfo:
        return self.model_info

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def validate(self, req: GenerationRequest) -> None:
        """Raise InvalidRequest with a precise message (``service.validation``, the
        front's messages); pure, thread-safe."""
        check_generation(
            req,
            vocab_size=self.loaded.config.vocab_size,
            context_length=self.max_model_len,
            max_new_tokens_limit=self.cfg.max_new_tokens_limit,
            block_size=self.block_size,
            kv_blocks=self.blocks.num_usable,
        )
        check_retain(req.retain, len(req.prompt_token_ids), req.sampling.n, self.cfg.retention_max_ttl_s)
        if req.sampling.response_format is not None:
            self.grammars.compile(req.sampling.response_format)  # cached: the conversation compiled it

    def compile_format(self, fmt: ResponseFormat) -> None:
        """Blocking: compile a response_format's grammar (cached by hash); InvalidRequest
        when it is invalid or unsupported."""
        self.grammars.compile(fmt)

    def add_request(self, req: GenerationRequest) -> None:
        self.validate(req)
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        n = len(req.prompt_token_ids)
        seq = self.output.new_sequence(req, self.keys.namespace(req.scope, n), self.keys.is_long(n))
        if req.retain:
            try:
                seq.retention = self._reserve(req, seq)  # RetentionRefused past the tenant's bound
            except RetentionRefused:
                if not all(r.hint for r in req.retain):
                    raise
                # Only protocols' cache hints: the turn runs as if none was asked (counted refused).
        try:
            self.scheduler.submit(seq)  # QueueFull past --max-queue
        except BaseException:
            if seq.retention is not None:
                self.restorer.cancel_retention(seq.retention.reservation)
            raise

    def _reserve(self, req: GenerationRequest, seq: Sequence) -> retention.RetentionPlan:
        """A request's retentions resolved, and room held for them in its tenant's
        bound (the prefix's hashes kept for admission)."""
        self.retention.asked()
        owner = retention.owner_of(req.scope)
        plan = retention.RetentionPlan(retention.plan(req.retain, len(req.prompt_token_ids), self.block_size), owner,
                                       self.block_size)  # fmt: skip
        self._check_retainable()
        seq.hashes = self.keys.chain(seq.namespace, req.prompt_token_ids[: plan.tokens])
        plan.reservation = self._reserve_blocks(owner, seq.hashes)
        return plan

    def _check_retainable(self) -> None:
        if not self.restorer.can_retain:
            self.retention.refused(retention.UNAVAILABLE)
            raise RetentionRefused(
                "retain: this server has no cache tier to keep a retention in (--host-cache-memory, "
                "--disk-cache-dir or --redis-url, named by --retain-to)"
            )
        if self.cfg.retention_tenant_memory <= 0:
            self.retention.refused(retention.UNAVAILABLE)
            raise RetentionRefused("retain: retentions are off on this server (--retention-tenant-memory 0)")

    def _reserve_blocks(self, owner: str, hashes: list[BlockHash]) -> Reservation:
        try:
            return self.restorer.reserve_retention(owner, hashes)
        except RetentionBudget as e:
            self.retention.refused(retention.TENANT_BOUND)
            per_block = self.pool.bytes_per_block
            raise RetentionRefused(
                f"retain: {retention.describe_owner(owner)} retains {e.retained} blocks of KV "
                f"({e.retained * per_block} bytes); this request would make {e.wanted} ({e.wanted * per_block} bytes), "
                f"over its bound of {e.limit} ({e.limit * per_block} bytes, --retention-tenant-memory); retain a "
                "shorter prefix, or retry when its retentions expire"
            ) from None

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread before the next step (the only safe place
        to touch block refcounts and pool contents)."""
        self.scheduler.call_soon(fn)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.warmer.due()

    def wait_for_work(self, timeout_s: float) -> None:
        """Sleep until work is handed in (or ``timeout_s``)."""
        self.scheduler.wait_for_work(timeout_s)

    def wake(self) -> None:
        self.scheduler.work_ready.set()

    def stop_accepting(self) -> None:
        self.accepting = False

    def is_accepting(self) -> bool:
        return self.accepting

    def stats(self) -> EngineStats:
        running, waiting = self.scheduler.counts()
        return EngineStats(
            running=running,
            waiting=waiting,
            blocks_total=self.blocks.num_usable,
            blocks_free=self.blocks.num_free,
            blocks_cached=self.blocks.num_cached_idle,
            prefill_tokens=self.runner.num_prefill_tokens,
            decode_tokens=self.runner.num_decode_tokens,
            spec_steps=self.runner.num_verify_steps,
            spec_draft_tokens=self.runner.num_draft_tokens,
            spec_accepted_tokens=self.runner.num_accepted_tokens,
            step_tokens=tuple(self.output.step_tokens),
            **self._pool_stats(),
        )

    def _pool_stats(self) -> dict[str, int]:
        """The draft pool's figures for EngineStats (none without a pool)."""
        pool = self.scheduler.draft_pool
        if pool is None:
            return {}
        return dict(spec_pool_bytes=pool.bytes, spec_pool_tokens=pool.tokens, spec_pool_evictions=pool.evictions,
                    spec_pool_hits=pool.hits)  # fmt: skip

    def cache_stats(self) -> CacheStats:
        """A snapshot of the device pool and the store (see ``CacheStats``)."""
        held = self.blocks.num_usable - self.blocks.num_free + self.blocks.num_cached_idle
        return CacheStats(
            device_blocks_held=held,
            device_bytes_held=held * self.pool.bytes_per_block,
            device_evictions=self.blocks.num_evicted,
            restores_skipped=self.restorer.num_restores_skipped,
            sync_demotions=self.transfers.num_sync_demotions,
            store=self.store.stats() if self.store is not None else None,
            warm=self.warmer.stats(),
            retention=self.retention.snapshot(),
        )

    def has_store(self) -> bool:
        return self.store is not None

    def spill(
        self,
        token_ids: list[int],
        scope: CacheScope,
        tiers: tuple[str, ...],
        done: Callable[[int, dict[str, int]], None],
    ) -> None:
        """Engine thread: write every full block of this transcript to ``tiers`` in the
        background, from whichever tier holds it: device blocks from the pool, the others
        from the host tier (by the store's writer). The device blocks are pinned (a
        reference is taken) until the store's writer has copied them, so they cannot be
        evicted or overwritten meanwhile. ``done(n_blocks, held)`` is called once the
        writer is through (on its thread) with the transcript's full blocks and how many
        of them each tier holds afterwards (``{}`` when nothing could be queued)."""
        self.restorer.spill(token_ids, scope, tiers, done)

    def flush_store(self, timeout_s: float) -> bool:
        """Blocking: wait (bounded) for queued writes to reach their tiers."""
        return self.restorer.flush(timeout_s)

    def forget_device(self, token_ids: list[int], scope: CacheScope, *, keep_blocks: int = 0) -> int:
        """Engine thread: drop the full blocks of ``token_ids`` in ``scope``'s namespaces,
        past the first ``keep_blocks``, from the prefix map. A block a running sequence
        still uses keeps its KV until that sequence frees it, then it is a plain free
        block. Returns how many were dropped."""
        n = 0
        for _, hashes in self.keys.every_regime(token_ids, scope):  # LongRoPE models: both regimes
            dropped = [b for b in (self.blocks.lookup(h) for h in hashes[keep_blocks:]) if b is not None]
            self.warmer.forget(set(hashes[keep_blocks:]), dropped)  # held for a turn: let go
            for block in dropped:
                self.blocks.drop_hash(block)
            n += len(dropped)
        return n

    def warm(self, token_ids: list[int], scope: CacheScope, tenant: str, done: Callable[[WarmResult], None]) -> None:
        """Engine thread: warm a transcript up for its next turn (service/engine/warm.py):
        hold its leading device blocks, restore the leading ones a store tier holds into
        free or evictable device blocks, within the warm-up caps, and hold those too for
        ``--warm-ttl``. ``done(result)`` is called once it is through, on this thread."""
        ns, hashes = self.keys.of(token_ids, scope)
        job = self.warmer.begin(ns, hashes, tenant, token_ids)
        if not job.rest or self.store is None:
            done(self.warmer.landed(job, []))
            return
        self.restorer.locate_warm(
            ns, job.rest, lambda tiers: self.call_soon(lambda: self._warm_located(job, tiers, done))
        )

    def _warm_located(self, job: WarmJob, tiers: list[str], done: Callable[[WarmResult], None]) -> None:
        blocks = self.warmer.allocate(job, len(tiers))
        if not blocks:
            done(self.warmer.landed(job, []))
            return

        def fetched(loaded: list[str], event: object) -> None:  # the restore thread
            self.call_soon(lambda: self._warm_landed(job, loaded, event, done))

        self.restorer.fetch_warm(job.namespace, job.rest[: len(blocks)], tiers[: len(blocks)], blocks, fetched)

    def _warm_landed(self, job: WarmJob, loaded: list[str], event: object, done: Callable[[WarmResult], None]) -> None:
        self.transfers.finish_restore(event)
        done(self.warmer.landed(job, loaded))

    def retain(
        self, token_ids: list[int], scope: CacheScope, ttl_s: float, done: Callable[[RetainedPrefix], None]
    ) -> None:
        """Engine thread: retain a transcript's full blocks for ``ttl_s`` seconds (a
        session's pin): reserve room in its tenant's bound (``RetentionRefused`` past it,
        or with no tier to keep it), pin the blocks in the store's retain tiers, writing
        there first those only on the device; ``done(kept)`` once the store answered, on
        this thread (``created_tokens`` is 0: the call computes nothing)."""
        check_retain((Retain(ttl_s),), len(token_ids), 1, self.cfg.retention_max_ttl_s)
        self.retention.asked()
        self._check_retainable()
        ns, hashes = self.keys.of(token_ids, scope)
        bps = [retention.Breakpoint(len(token_ids), len(hashes), ttl_s)]
        reservation = self._reserve_blocks(retention.owner_of(scope), hashes)
        untils = retention.block_untils(bps, self.restorer.now())
        n = len(hashes) * self.block_size

        def kept(result: RetainResult) -> None:  # the writer's thread
            def on_engine() -> None:
                prefixes = retention.figures(bps, result.tiers, result.untils, n, self.block_size)
                self.retention.kept(prefixes, len(hashes), result.leading)
                done(prefixes[0])

            self.call_soon(on_engine)

        self.restorer.retain(ns, hashes, untils, reservation, kept)

    def forget_stored(
        self, token_ids: list[int], scope: CacheScope, *, keep_blocks: int = 0, timeout_s: float = 10.0
    ) -> dict[Tier, int]:
        """Blocking: the same blocks out of every store tier (``TieredStore.delete_many``,
        after flushing queued writes); entries dropped per tier."""
        return self.restorer.forget(token_ids, scope, keep_blocks, timeout_s)

    def device_blocks_for(self, token_ids: list[int], scope: CacheScope) -> int:
        """How many leading full blocks of ``token_ids`` are on the device now."""
        return len(self.blocks.match_prefix(self.keys.of(token_ids, scope)[1]))

    def block_locations(self, token_ids: list[int], scope: CacheScope) -> dict[Tier, int]:
        """Blocking: how many of the transcript's full blocks each tier holds now."""
        out: dict[Tier, int] = {Tier.DEVICE: self.device_blocks_for(token_ids, scope)}
        out.update(self.restorer.locations(token_ids, scope))
        return out

    def fail_all(self, error: str) -> Emitted:
        """Finish every running and waiting sequence with an error (the engine loop hit a bug)."""
        out: Emitted = self._late  # turns whose retention the store answered: their ends stand
        self._late, self._late_sent = [], 0
        for seq in self.scheduler.take_all():
            self._finish(seq, FinishReason.ERROR, out, error=error)
        return out

    def close(self) -> None:
        self.restorer.close()

    # ---- the loop --------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Emitted:
        out: Emitted = []
        self._step(out)
        del self._late[: self._late_sent]  # emitted: only now, so a step that raised leaves them for the next
        self._late_sent = 0
        return out

    def _step(self, out: Emitted) -> None:
        self._late_sent = 0
        self.transfers.poll()
        self.runner.poll_prefill_rate()
        calls, cancelled = self.scheduler.drain_inbox()
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("engine call failed")
        for seq in cancelled:
            self._finish(seq, FinishReason.CANCELLED, out)
        if self._late:  # finished turns whose retention the store answered
            out.extend(self._late)
            self._late_sent = len(self._late)
        if self.warmer.due():
            self.warmer.expire()
        for seq in self.restorer.collect(self.scheduler.restoring):
            self.scheduler.restored(seq)
            if seq.cancelled:
                self._finish(seq, FinishReason.CANCELLED, out)
            else:
                self.scheduler.start_running(seq)
                self._started(seq, out)
        admitted = self.scheduler.admit()
        if admitted is not None:
            if self.warmer.holds_any():  # a turn the warm-up was for: it holds its own references now
                for seq in admitted.running + [s for s, _, _ in admitted.restoring]:
                    self.warmer.claim(seq.blocks[: seq.num_registered])
            for seq in admitted.refused:
                self._finish(seq, FinishReason.ERROR, out, error="not enough KV blocks")
            for seq, hashes, blocks in admitted.restoring:
                self.restorer.start(seq, hashes, blocks, self.runner.prefill_tokens_per_s)
            for seq in admitted.running:
                self._started(seq, out)
        if not self.scheduler.running and self.scheduler.restoring:
            seq = self.restorer.overlappable(self.scheduler.restoring, self.cfg.max_num_batched_tokens)
            if seq is not None:
                self._overlap(seq, out)
                return
        if not self.scheduler.running and self.scheduler.restoring and not out:
            # Nothing to compute until a restore lands: sleep until one does (or new
            # work arrives) instead of spinning; the restore thread needs the GIL.
            self.scheduler.wait_for_work(0.01)
            return
        if self.scheduler.running:
            t0 = time.perf_counter()
            plan = self.scheduler.plan()
            decode_rows = len(plan.decode) + sum(1 + len(s.drafts) for s in plan.verify)
            rows, logits, verified = self.runner.run(plan)
            if verified:
                self._verify_and_emit(verified, out)
            if rows:
                self._sample_and_emit(rows, out, logits)
            if decode_rows and not plan.prefill:  # a decode step alone: what its rows cost, for the drafts
                self.scheduler.step_cost.add(decode_rows, time.perf_counter() - t0)

    def _overlap(self, seq: Sequence, out: Emitted) -> None:
        """Nothing else to compute while ``seq``'s restore lands: run its new tokens over
        the planned context now, each layer waiting for its layer of the restored blocks
        (service/engine/restore.py), then wait for the restore to finish. The forward's
        first token is kept only when every planned block was loaded and verified;
        otherwise the sequence runs on from what was (those tokens recomputed)."""
        start = self.restorer.overlap_start(seq)
        logits = self.runner.forward_over_restore(seq, start, seq.landing.wait_layer)
        self.restorer.wait(seq)
        for landed in self.restorer.collect([seq]):
            self.scheduler.restored(landed)
        if seq.cancelled:
            self._finish(seq, FinishReason.CANCELLED, out)
            return
        self.scheduler.start_running(seq)
        self._started(seq, out)
        self.restorer.num_overlapped += 1
        if seq.num_computed == start:  # verified whole: the forward stands
            self.runner.keep_over_restore(seq)
            self._sample_and_emit([(seq, logits[0])], out, None)
        else:
            self.restorer.num_overlaps_voided += 1

    def _verify_and_emit(self, rows: list[Row], out: Emitted) -> None:
        """Speculative rows: the output room takes the accepted drafts and the next token,
        the runner keeps their KV (registering completed blocks), the scheduler gives back
        the blocks past the sequence's tokens, then stops and failures as ``emit``'s."""
        emitted = self.output.emit_verified(rows)
        out.extend(emitted.events)
        for seq, accepted in emitted.verified:
            self.runner.commit(seq, accepted)
            self.scheduler.trim(seq)
        if emitted.finished:
            self.runner.seal([s for s, _ in emitted.finished])
            for seq, reason in emitted.finished:
                self._finish(seq, reason, out)
        for seq, error, rejected in emitted.failed:
            self._finish(seq, FinishReason.ERROR, out, error=error, rejected=rejected)

    def _started(self, seq: Sequence, out: Emitted) -> None:
        if not seq.started:
            seq.started = True
            out.append(self.output.started(seq))

    def _sample_and_emit(self, rows: list[Row], out: Emitted, logits: torch.Tensor | None) -> None:
        if any(s.fork_pending for s, _ in rows):  # n > 1: every sequence samples the prompt's logits
            rows = [(c, r) for s, r in rows for c in ([s] + self._fork(s) if s.fork_pending else [s])]
            logits = None
        emitted = self.output.emit(rows, logits)
        out.extend(emitted.events)
        for seq, _ in rows:  # a first token: the prompt is computed, its retained prefix can go to the store
            plan = seq.retention
            if plan is not None and not plan.started and plan.blocks and seq.num_output:
                self._start_retention(seq, plan)
        if emitted.finished:
            self.runner.seal([s for s, _ in emitted.finished])
            for seq, reason in emitted.finished:
                self._finish(seq, reason, out)
        for seq, error, rejected in emitted.failed:
            self._finish(seq, FinishReason.ERROR, out, error=error, rejected=rejected)

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """The n > 1 fork: the output room makes the sequences, the scheduler gives them
        their blocks, the runner copies the partial last block's KV into each one's own."""
        children = self.output.fork(seq)
        self.runner.copy_blocks(self.scheduler.place_forks(seq, children))
        return children

    def _finish(
        self, seq: Sequence, reason: FinishReason, out: Emitted, error: str = "", rejected: bool = False
    ) -> None:
        plan: retention.RetentionPlan | None = seq.retention
        seq.retention = None
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)
        if plan is not None and completed and plan.blocks and not plan.started:
            self._start_retention(seq, plan)  # before retire: the sequence still holds the blocks
        self.scheduler.retire(seq)
        if completed or reason is FinishReason.CANCELLED:  # a stopped answer is often regenerated
            self.scheduler.remember(seq)
        events = self.output.finished(seq, reason, error, rejected)
        if plan is not None and plan.started:
            if completed and plan.kept is None:  # the store has not answered: the end waits (_late)
                plan.events = events
                return
            if completed:
                self._set_retained(events, plan.kept)
            # a turn that did not complete reports nothing: what the store pins expires with its time
        elif plan is not None:  # nothing to pin: the turn did not complete, or its prefixes hold no whole block
            self.restorer.cancel_retention(plan.reservation)
            if completed:
                self._set_retained(events, retention.figures(plan.breakpoints, [], [], seq.cached_tokens, self.block_size))
        out.extend(events)

    def _start_retention(self, seq: Sequence, plan: retention.RetentionPlan) -> None:
        """Hand the turn's retained prefix to the store to pin (its prompt is computed);
        the answer lands on this thread, and releases the turn's end if it waits."""
        plan.started = True

        def kept(result: RetainResult) -> None:  # the writer's thread
            def on_engine() -> None:
                plan.kept = retention.figures(plan.breakpoints, result.tiers, result.untils, seq.cached_tokens,
                                              self.block_size)  # fmt: skip
                self.retention.kept(plan.kept, plan.blocks, result.leading)
                if plan.events is not None:
                    self._set_retained(plan.events, plan.kept)
                    self._late.extend(plan.events)

            self.call_soon(on_engine)

        untils = retention.block_untils(plan.breakpoints, self.restorer.now())
        self.restorer.retain(seq.namespace, seq.hashes[: plan.blocks], untils, plan.reservation, kept)

    @staticmethod
    def _set_retained(events: Emitted, kept: tuple[RetainedPrefix, ...]) -> None:
        for _, ev in events:
            if isinstance(ev, Finished):
                ev.retained = kept

    def _demote(self, block: Block) -> None:
        self.restorer.demote(block)  # the block manager is built before the restorer
