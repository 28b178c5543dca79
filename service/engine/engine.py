"""The generation loop: continuous batching over a paged, prefix-cached KV pool.

``LLMEngine`` is synchronous and single-threaded: ``step()`` runs one scheduling
iteration and returns the events it produced. ``AsyncEngine`` (async_engine.py) runs
it on its own thread. Everything that other threads hand in (new requests, aborts)
goes through ``_inbox``; everything the engine hands out is the returned event list.

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

import array
import dataclasses
import enum
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvserve.cachestore.keys import BlockHash, block_hashes, make_namespace
from kvserve.cachestore.tiered import TieredStore
from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.grammar import GrammarCompiler, matcher_error
from kvserve.service.engine.output import TextStream
from kvserve.service.engine.sampling import RowState, make_generator, sample
from kvserve.service.types import (
    CacheScope,
    Delta,
    EngineStats,
    EngineStopped,
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    QueueFull,
    Started,
    Tier,
    Timings,
)
from kvserve.service.validation import check_generation
from kvserve.service.kv.block_manager import NULL_BLOCK, Block, BlockManager, NoFreeBlocks
from kvserve.service.kv.cache import BatchLayout, SeqSlice
from kvserve.service.kv.transfer import BlockTransfers

if TYPE_CHECKING:
    from kvserve.service.models.loading import LoadedModel

log = logging.getLogger(__name__)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RESTORING = "restoring"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: GenerationRequest
    namespace: bytes
    token_ids: list[int]  # prompt + output so far
    num_prompt: int
    arrival: float
    stream: TextStream
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    blocks: list[Block] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of full blocks of token_ids
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_registered: int = 0  # leading blocks registered under their hash
    num_released: int = 0  # leading blocks given back: outside every layer's sliding window
    cached_by_tier: dict[Tier, int] = field(default_factory=dict)
    long_rope: bool = False  # LongRoPE models: computed with the long factors (namespace follows)
    started: bool = False
    cancelled: bool = False
    index: int = 0  # which of the request's n sequences
    group: list["Sequence"] | None = None  # n > 1, once forked: every sequence of the request
    fork_blocks: list[Block] = field(default_factory=list)  # n > 1: reserved for the forks' partial block
    matcher: Any = None  # response_format: the llguidance matcher of this sequence's output
    restore: Future | None = None
    table: tuple[list[Block], int, array.array] | None = None  # (blocks, num_released, block table): _block_table
    t_admit: float = 0.0
    t_restore0: float = 0.0
    restore_s: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_by_tier.values())

    @property
    def fork_pending(self) -> bool:
        """n > 1 and not forked yet (the prompt is still being computed)."""
        return self.request.sampling.n > 1 and self.group is None


Emitted = list[tuple[str, Event]]


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig, store: TieredStore | None = None) -> None:
        self.cfg = cfg
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.mcfg = loaded.config
        self.device = loaded.device
        self.store = store
        self.block_size = cfg.block_size
        self.max_model_len = min(
            cfg.max_model_len or self.mcfg.max_position_embeddings,
            self.mcfg.max_position_embeddings,
        )
        self.pool = loaded.new_kv_pool(cfg.kv_cache_memory, cfg.block_size)
        self.blocks = BlockManager(self.pool.num_blocks, on_evict=self._on_evict)
        # restores into / demotions out of the pool (CUDA: streams, events, pinned staging)
        self.transfers = BlockTransfers.for_pool(self.pool, cfg.staging_memory)
        self.kv_dtype = self.pool.spec.dtype_name
        self.eos_ids = frozenset(loaded.eos_token_ids)
        # Embeddings are often padded past the tokenizer (e.g. to a multiple of 64):
        # ids beyond the tokenizer's vocabulary can never be sampled.
        self.sampleable_vocab = min(self.tokenizer.vocab_size, self.mcfg.vocab_size)
        self._namespaces: dict[tuple[CacheScope, bool], bytes] = {}  # (scope, LongRoPE long regime)
        self.longrope_threshold: int | None = self.mcfg.longrope_threshold
        # blocks outside every layer's window can be given back (when every layer has one)
        windows = [self.mcfg.layer_window(i) for i in range(self.mcfg.num_layers)]
        self.release_window: int | None = max(windows) if all(w is not None for w in windows) else None
        self.num_rope_switches = 0  # sequences recomputed on crossing the LongRoPE switch length

        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.restoring: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._calls: list[Callable[[], None]] = []  # run on the engine thread between steps
        self._lock = threading.Lock()
        self.work_ready = threading.Event()
        self._restorer = ThreadPoolExecutor(1, thread_name_prefix="kv-restore")
        self.accepting = True

        # counters: tokens actually run through the model
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.num_seal_tokens = 0
        self.num_preempted = 0
        self.num_restores_skipped = 0  # restores cut because recomputing was faster
        self.num_forked = 0  # sequences created by forking an n > 1 request
        self.grammars = GrammarCompiler(self.tokenizer, loaded.eos_token_ids)
        # measured prefill rate (tokens/s), for the restore-or-recompute decision
        self.prefill_tokens_per_s: float | None = None
        self._prefill_marks: deque[tuple[int, Any, Any]] = deque()  # (tokens, start, end) to read

        self.model_info = ModelInfo(
            architecture=self.mcfg.hf_architecture,
            model_type=self.mcfg.model_type,
            model_fingerprint=loaded.fingerprint,
            context_length=self.max_model_len,
            vocab_size=self.mcfg.vocab_size,
            block_size=self.block_size,
            dtype=self.kv_dtype,
            device=str(self.device),
            num_layers=self.mcfg.num_layers,
            num_kv_heads=self.mcfg.num_kv_heads,
            head_dim=self.mcfg.head_dim,
            bytes_per_token=self.pool.bytes_per_token,
            eos_token_ids=tuple(loaded.eos_token_ids),
            tiers=(Tier.DEVICE,) + (tuple(store.tiers) if store is not None else ()),
            shared_tier=store.shared_tier if store is not None else None,
        )

    # ---- called from other threads ---------------------------------------------------

    def is_long_rope(self, num_tokens: int) -> bool:
        """LongRoPE models: a sequence of ``num_tokens`` uses the long factors (transformers' switch)."""
        return self.longrope_threshold is not None and num_tokens > self.longrope_threshold

    def namespace(self, scope: CacheScope, num_tokens: int = 0) -> bytes:
        """The block namespace of a sequence of ``num_tokens`` tokens under ``scope``.

        LongRoPE models compute a sequence's KV with the short or the long factors by its
        length (as transformers), so the KV of a prefix is a function of the prefix *and*
        the regime: the long regime roots its own namespace (its fingerprint field is the
        model's plus "+rope=long", which no hex fingerprint can equal) and blocks never cross."""
        long = self.is_long_rope(num_tokens)
        ns = self._namespaces.get((scope, long))
        if ns is None:
            fingerprint = self.loaded.fingerprint + ("+rope=long" if long else "")
            ns = make_namespace(fingerprint, self.kv_dtype, self.block_size, scope.tenant, scope.salt)
            if len(self._namespaces) < 65536:
                self._namespaces[(scope, long)] = ns
        return ns

    def namespaces(self, scope: CacheScope) -> list[bytes]:
        """Every namespace a transcript under ``scope`` may have blocks in (both LongRoPE
        regimes), e.g. to forget them all."""
        out = [self.namespace(scope)]
        if self.longrope_threshold is not None:
            out.append(self.namespace(scope, self.longrope_threshold + 1))
        return out

    def validate(self, req: GenerationRequest) -> None:
        """Raise InvalidRequest with a precise message (``service.validation``, the
        front's messages); pure, thread-safe."""
        check_generation(
            req,
            vocab_size=self.mcfg.vocab_size,
            context_length=self.max_model_len,
            max_new_tokens_limit=self.cfg.max_new_tokens_limit,
            block_size=self.block_size,
            kv_blocks=self.blocks.num_usable,
        )
        if req.sampling.response_format is not None:
            self.grammars.compile(req.sampling.response_format)  # cached: the conversation compiled it

    def add_request(self, req: GenerationRequest) -> None:
        self.validate(req)
        if not self.accepting:
            raise EngineStopped("the server is shutting down")
        seq = Sequence(
            request=req,
            namespace=self.namespace(req.scope, len(req.prompt_token_ids)),
            long_rope=self.is_long_rope(len(req.prompt_token_ids)),
            token_ids=list(req.prompt_token_ids),
            num_prompt=len(req.prompt_token_ids),
            arrival=time.monotonic(),
            stream=TextStream(self.tokenizer.detokenizer(), req.sampling.stop),
            generator=make_generator(req.sampling, self.device),
        )
        if req.sampling.response_format is not None:
            seq.matcher = self.grammars.matcher(req.sampling.response_format)
        with self._lock:
            if len(self.waiting) + len(self._inbox) >= self.cfg.max_queue:
                raise QueueFull(
                    f"the queue is full ({self.cfg.max_queue} waiting requests); retry later"
                )
            self._inbox.append(seq)
        self.work_ready.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self.work_ready.set()

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.running) + len(self.restoring),
            waiting=len(self.waiting) + len(self._inbox),
            blocks_total=self.blocks.num_usable,
            blocks_free=self.blocks.num_free,
            blocks_cached=self.blocks.num_cached_idle,
            prefill_tokens=self.num_prefill_tokens,
            decode_tokens=self.num_decode_tokens,
        )

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread before the next step (the only safe place
        to touch block refcounts and pool contents)."""
        with self._lock:
            self._calls.append(fn)
        self.work_ready.set()

    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.restoring
            or self._inbox
            or self._aborts
            or self._calls
        )

    # ---- the loop --------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> Emitted:
        out: Emitted = []
        self.transfers.poll()
        self._poll_prefill_rate()
        self._drain_inbox(out)
        self._poll_restores(out)
        self._admit(out)
        if not self.running and self.restoring and not out:
            # Nothing to compute until a restore lands: sleep until one does (or new
            # work arrives) instead of spinning; the restore thread needs the GIL.
            self.work_ready.wait(0.01)
            self.work_ready.clear()
            return out
        self._run(out)
        return out

    def _drain_inbox(self, out: Emitted) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for fn in calls:
            try:
                fn()
            except Exception:
                log.exception("engine call failed")
        for seq in new:
            self._by_id[seq.request_id] = seq
            self.waiting.append(seq)
        for rid in aborts:
            first = self._by_id.get(rid)
            for seq in (first.group or [first]) if first is not None else []:
                if seq.status is SeqStatus.FINISHED:
                    continue
                if seq.status is SeqStatus.RESTORING:
                    seq.cancelled = True  # its blocks are being written; finished at poll time
                    continue
                if seq.status is SeqStatus.WAITING:
                    self.waiting.remove(seq)
                self._finish(seq, FinishReason.CANCELLED, out)

    # ---- admission -------------------------------------------------------------------

    def _admit(self, out: Emitted) -> None:
        while self.waiting and len(self.running) + len(self.restoring) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._try_allocate(seq):
                if not self.running and not self.restoring:
                    # nothing will ever free blocks for it (validate() should prevent this)
                    self.waiting.popleft()
                    self._finish(seq, FinishReason.ERROR, out, error="not enough KV blocks")
                    continue
                break
            self.waiting.popleft()
            if seq.restore is None:
                self._start_running(seq, out)

    def _try_allocate(self, seq: Sequence) -> bool:
        bs = self.block_size
        n_tokens = len(seq.token_ids)
        seq.hashes = block_hashes(seq.namespace, seq.token_ids, bs, seq.hashes)
        # the last token is always recomputed (its logits are needed)
        reusable = (n_tokens - 1) // bs
        device_hits = self.blocks.match_prefix(seq.hashes[:reusable])
        n_dev = len(device_hits)
        n_needed = -(-n_tokens // bs)
        # n > 1: one block per extra sequence for its copy of the partial last prompt block
        n_fork = seq.request.sampling.n - 1 if seq.fork_pending and n_tokens % bs else 0
        idle_hits = sum(1 for b in device_hits if b.ref_count == 0)
        if self.blocks.num_free - idle_hits < n_needed - n_dev + n_fork:
            return False
        self.blocks.touch(device_hits)
        fresh = self.blocks.allocate(n_needed - n_dev)
        seq.fork_blocks = self.blocks.allocate(n_fork)
        seq.blocks = device_hits + fresh
        seq.num_computed = n_dev * bs
        seq.num_registered = n_dev
        seq.cached_by_tier = {Tier.DEVICE: n_dev * bs} if n_dev else {}
        seq.t_admit = time.monotonic()
        if self.store is not None and n_dev < reusable:
            self._start_restore(seq, seq.hashes[n_dev:reusable], fresh[: reusable - n_dev])
        return True

    def _start_restore(self, seq: Sequence, hashes: list[BlockHash], blocks: list[Block]) -> None:
        """Look the blocks up in host/Redis and load the hits into ``blocks``, all on
        the restore thread: the decode loop never waits on the store. The loads land in
        the pool itself (CPU) or go through pinned staging buffers and the restore
        stream (CUDA; service/kv/transfer.py)."""
        seq.status = SeqStatus.RESTORING
        seq.t_restore0 = time.monotonic()
        after = self.transfers.begin_restore()
        block_ids = [b.block_id for b in blocks]
        seq.restore = self._restorer.submit(self._restore_job, seq.namespace, hashes, block_ids, after)
        seq.restore.add_done_callback(lambda _: self.work_ready.set())
        self.restoring.append(seq)

    def _restore_job(
        self, namespace: bytes, hashes: list[BlockHash], block_ids: list[int], after: Any
    ) -> tuple[list[str], Any]:
        """Runs on the restore thread. Returns the tier of each leading block that was
        loaded into the pool and verified, and the event of the last copy (CUDA)."""
        plan = self._plan_restore(namespace, hashes)
        if not plan:
            return [], None

        def load(targets: list[torch.Tensor], start: int) -> int:
            end = start + len(targets)
            return self.store.fetch_into(namespace, hashes[start:end], plan[start:end], targets)

        n_ok, event = self.transfers.restore_in_rounds(block_ids[: len(plan)], load, after)
        if n_ok < len(plan):
            self.store.note_load_failed(plan[n_ok:])
        return plan[:n_ok], event

    def _plan_restore(self, namespace: bytes, hashes: list[BlockHash]) -> list[str]:
        """Tiers of the leading blocks found in host/Redis, cut where restoring would be
        slower than recomputing those tokens (the store decides per tier from its
        measured rates and this engine's measured prefill rate; decisions counted)."""
        rate = self.prefill_tokens_per_s
        plan = self.store.plan_restore(
            namespace,
            hashes,
            None if rate is None else self.block_size / rate,
            always=self.cfg.restore_policy == "always",
            min_speedup=self.cfg.restore_min_speedup,
        )
        if plan.cut:
            self.num_restores_skipped += 1
        return plan.tiers

    def _poll_restores(self, out: Emitted) -> None:
        for seq in [s for s in self.restoring if s.restore is not None and s.restore.done()]:
            self.restoring.remove(seq)
            try:
                loaded, event = seq.restore.result()
            except Exception:
                log.exception("restore of %s failed; recomputing", seq.request_id)
                loaded, event = [], None
            seq.restore = None
            seq.restore_s = time.monotonic() - seq.t_restore0
            start = seq.num_registered
            self.transfers.finish_restore(event)
            for i, tier_name in enumerate(loaded):
                self.blocks.register(seq.blocks[start + i], seq.hashes[start + i], seq.namespace)
                tier = Tier(tier_name)  # the store reports names
                seq.cached_by_tier[tier] = seq.cached_by_tier.get(tier, 0) + self.block_size
            seq.num_registered = start + len(loaded)
            seq.num_computed = seq.num_registered * self.block_size
            if seq.cancelled:
                self._finish(seq, FinishReason.CANCELLED, out)
            else:
                self._start_running(seq, out)

    def _start_running(self, seq: Sequence, out: Emitted) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if not seq.started:
            seq.started = True
            slowest = next((t for t in reversed(self.model_info.tiers) if seq.cached_by_tier.get(t)), None)
            out.append(
                (
                    seq.request_id,
                    Started(
                        request_id=seq.request_id,
                        prompt_tokens=seq.num_prompt,
                        cached_tokens=seq.cached_tokens,
                        cached_tier=slowest,
                        cached_by_tier=dict(seq.cached_by_tier),
                    ),
                )
            )

    # ---- running ---------------------------------------------------------------------

    def _ensure_blocks(self, seq: Sequence, n_tokens: int) -> bool:
        need = -(-n_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        try:
            seq.blocks.extend(self.blocks.allocate(need))
            return True
        except NoFreeBlocks:
            return False

    def _preempt(self, victim: Sequence) -> None:
        """Free a running sequence's blocks and send it back to wait (recompute later)."""
        self.running.remove(victim)
        self._release_blocks(victim)
        victim.num_computed = 0
        victim.num_registered = 0
        victim.status = SeqStatus.WAITING
        self.waiting.appendleft(victim)
        self.num_preempted += 1

    def _switch_to_long_rope(self, seq: Sequence) -> None:
        """The sequence just grew past the LongRoPE switch length: as transformers does,
        its whole KV is recomputed with the long factors. Its short-regime blocks stay
        cached under the short namespace (still valid there); it waits to be admitted
        again under the long namespace, where earlier long-regime blocks may hit."""
        self.running.remove(seq)
        self._release_blocks(seq)
        seq.hashes = []
        seq.num_computed = seq.num_registered = 0
        seq.long_rope = True
        seq.namespace = self.namespace(seq.request.scope, len(seq.token_ids))
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_rope_switches += 1

    def _run(self, out: Emitted) -> None:
        if not self.running:
            return
        budget = self.cfg.max_num_batched_tokens
        decode: list[Sequence] = []
        prefill: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted below
                continue
            if not seq.long_rope and self.is_long_rope(len(seq.token_ids)):
                self._switch_to_long_rope(seq)
                continue
            pending = len(seq.token_ids) - seq.num_computed
            n = 1 if pending == 1 else min(pending, max(budget - len(decode), 0))
            if n == 0:
                continue
            while not self._ensure_blocks(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            if pending == 1:
                decode.append(seq)
                budget -= 1
            else:
                prefill.append((seq, n))
                budget -= n
        # a preemption may have removed a sequence scheduled earlier in this loop
        decode = [s for s in decode if s in self.running]
        prefill = [(s, n) for s, n in prefill if s in self.running]

        to_sample: list[tuple[Sequence, torch.Tensor]] = []
        decode_logits = None
        if decode:
            decode_logits = self._forward([(s, 1) for s in decode])
            self.num_decode_tokens += len(decode)
            to_sample.extend((s, decode_logits[i]) for i, s in enumerate(decode))
        ops = self.transfers.ops
        for seq, n in prefill:
            t0 = ops.mark()
            logits = self._forward([(seq, n)])
            self.num_prefill_tokens += n
            if n >= 32:  # timed for the prefill rate (restore-vs-recompute)
                self._prefill_marks.append((n, t0, ops.mark()))
            if seq.num_computed == len(seq.token_ids):
                to_sample.append((seq, logits[0]))
        self._poll_prefill_rate()
        if to_sample:
            # the decode rows alone: their (B, V) logits as they are, not stacked again row by row
            self._sample_and_emit(to_sample, out, decode_logits if len(to_sample) == len(decode) else None)

    def _poll_prefill_rate(self) -> None:
        """Fold timed prefill chunks into the EWMA of prefill tokens/s, in order, as far
        as their end marks completed (CPU: at once; CUDA: GPU time from timing events,
        read without waiting, so a chunk is counted a step or so later)."""
        while self._prefill_marks:
            n, t0, t1 = self._prefill_marks[0]
            dt = self.transfers.ops.seconds_between(t0, t1)
            if dt is None:
                return
            self._prefill_marks.popleft()
            if dt > 0:
                r = n / dt
                p = self.prefill_tokens_per_s
                self.prefill_tokens_per_s = r if p is None else 0.8 * p + 0.2 * r

    def _block_table(self, seq: Sequence) -> array.array:
        """The sequence's block table as the model reads it: int64 block ids, the released
        leading blocks as the null block. Kept on the sequence and extended by the blocks
        added since (O(new blocks) a step, not O(all)); made again when its block list is
        replaced or blocks are released."""
        blocks, released = seq.blocks, seq.num_released
        cached = seq.table
        if cached is not None and cached[0] is blocks and cached[1] == released and len(cached[2]) <= len(blocks):
            table = cached[2]
            if len(table) < len(blocks):
                table.extend(b.block_id for b in blocks[len(table) :])
        else:
            table = array.array("q", [NULL_BLOCK] * released)
            table.extend(b.block_id for b in blocks[released:])
        seq.table = (blocks, released, table)
        return table

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        slices = [
            SeqSlice(
                block_table=self._block_table(seq),
                start_pos=seq.num_computed,
                token_ids=seq.token_ids[seq.num_computed : seq.num_computed + n],
                long_rope=seq.long_rope if self.longrope_threshold is not None else None,
            )
            for seq, n in work
        ]
        layout = BatchLayout.build(slices, self.block_size, self.device)
        logits = self.model(layout, self.pool)
        for seq, n in work:
            seq.num_computed += n
            self._register_full_blocks(seq)
            self._release_outside_window(seq)
        return logits

    def _release_blocks(self, seq: Sequence) -> None:
        """Give back every block the sequence still holds."""
        self.blocks.free(seq.blocks[seq.num_released :])
        seq.blocks = []
        seq.num_released = 0
        if seq.fork_blocks:
            self.blocks.free(seq.fork_blocks)
            seq.fork_blocks = []

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """An n > 1 request's prompt is computed (its last token's logits are about to be
        sampled): make the other n - 1 sequences. Each takes a reference on the prompt's
        full blocks and gets one reserved block holding a copy of the partial last block
        (no recompute); its own generator (seed + index) and, with a response_format, a
        copy of the matcher at the grammar's start."""
        bs = self.block_size
        full = seq.num_computed // bs
        seq.group = [seq]
        reserved = seq.fork_blocks
        seq.fork_blocks = []
        p = seq.request.sampling
        for i in range(1, p.n):
            blocks = list(seq.blocks[:full])
            self.blocks.touch(blocks[seq.num_released :])
            if full < len(seq.blocks):  # the partial last block: a copy of its KV
                own = reserved.pop()
                self.pool.import_block(own.block_id, self.pool.block_view(seq.blocks[full].block_id))
                blocks.append(own)
            seed = None if p.seed is None else (p.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
            child = Sequence(
                request=seq.request,
                namespace=seq.namespace,
                token_ids=list(seq.token_ids),
                num_prompt=seq.num_prompt,
                arrival=seq.arrival,
                stream=TextStream(self.tokenizer.detokenizer(), p.stop),
                generator=make_generator(dataclasses.replace(p, seed=seed), self.device),
                status=SeqStatus.RUNNING,
                blocks=blocks,
                hashes=list(seq.hashes),
                num_computed=seq.num_computed,
                num_registered=seq.num_registered,
                num_released=seq.num_released,
                cached_by_tier=dict(seq.cached_by_tier),
                long_rope=seq.long_rope,
                started=True,
                t_admit=seq.t_admit,
                restore_s=seq.restore_s,
                index=i,
                group=seq.group,
                matcher=seq.matcher.deep_copy() if seq.matcher is not None else None,
            )
            seq.group.append(child)
            self.running.append(child)
        if reserved:  # not needed after all (cannot happen: reserved iff a partial block)
            self.blocks.free(reserved)
        self.num_forked += p.n - 1
        return seq.group[1:]

    def _release_outside_window(self, seq: Sequence) -> None:
        """Sliding-window models (every layer windowed): give back the leading blocks no
        later query can see. The query at position p sees keys p - W + 1 .. p, and every
        later query is at p >= num_computed, so block i is dead once
        (i + 1) * block_size <= num_computed - W + 1. The blocks are full and registered:
        freed, they stay cached (and demote to the host/Redis tiers when evicted), still
        valid for a later turn or another sequence sharing the prefix. The block table
        keeps their slots, pointing at the null block, which the window masks."""
        if self.release_window is None:
            return
        dead = min((seq.num_computed - self.release_window + 1) // self.block_size, seq.num_registered)
        if dead > seq.num_released:
            self.blocks.free(seq.blocks[seq.num_released : dead])
            seq.num_released = dead

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        if len(seq.hashes) < full:
            seq.hashes = block_hashes(
                seq.namespace, seq.token_ids[: full * self.block_size], self.block_size, seq.hashes
            )
        for i in range(seq.num_registered, full):
            self.blocks.register(seq.blocks[i], seq.hashes[i], seq.namespace)
        seq.num_registered = full

    def _sample_and_emit(self, rows: list[tuple[Sequence, torch.Tensor]], out: Emitted,
                         logits: torch.Tensor | None = None) -> None:
        """Sample a token for every row and emit it; ``logits``: the rows' logits as one
        (len(rows), V) tensor when the caller has it (else they are stacked)."""
        if any(s.fork_pending for s, _ in rows):  # n > 1: every sequence samples the prompt's logits
            rows = [(c, r) for s, r in rows for c in ([s] + self._fork(s) if s.fork_pending else [s])]
            logits = None
        logits = torch.stack([r for _, r in rows]).float() if logits is None else logits.float()
        if self.sampleable_vocab < logits.shape[-1]:
            logits[:, self.sampleable_vocab :] = float("-inf")
        seqs = [s for s, _ in rows]
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        masks = None
        if constrained:
            masks = (constrained, self.grammars.fill_masks([seqs[i].matcher for i in constrained]))
        sampled = sample(
            logits,
            [s.request.sampling for s in seqs],
            [s.generator for s in seqs],
            [RowState(s.token_ids, s.num_prompt, self._stop_ids(s)) for s in seqs],
            masks,
        )
        now = time.monotonic()
        finished: list[tuple[Sequence, FinishReason]] = []
        failed: list[tuple[Sequence, str]] = []  # a grammar that failed: the request's error, not a stop
        for seq, tok, lp in zip(seqs, sampled.tokens, sampled.logprobs):
            p = seq.request.sampling
            if seq.matcher is not None and (not seq.matcher.consume_token(tok) or seq.matcher.is_error()):
                # llguidance gave up (e.g. its lexer limits on a huge regex): the output can no
                # longer be guaranteed to match, so it is not ended as if the grammar had finished
                failed.append((seq, self._grammar_failure(seq)))
                continue
            seq.token_ids.append(tok)
            if not seq.t_first:
                seq.t_first = now
            seq.t_last = now
            is_stop_token = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
            grammar_end = False
            if seq.matcher is not None:
                grammar_end = seq.matcher.is_stopped()  # the grammar accepts nothing more
                is_stop_token = is_stop_token or (grammar_end and tok in self.eos_ids)
            text = "" if is_stop_token else seq.stream.push([tok])
            reason = None
            if is_stop_token or seq.stream.stopped or grammar_end:
                reason = FinishReason.STOP
            elif seq.num_output >= p.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                text += seq.stream.finish()  # "" when a stop string ended it
            out.append(
                (seq.request_id, Delta(token_ids=[tok], text=text, logprobs=[lp] if lp else [], index=seq.index))
            )
            if reason is not None:
                finished.append((seq, reason))
        if finished:
            self._seal([s for s, _ in finished])
            for seq, reason in finished:
                self._finish(seq, reason, out)
        for seq, error in failed:
            self._finish(seq, FinishReason.ERROR, out, error=error, rejected=True)

    def _grammar_failure(self, seq: Sequence) -> str:
        fmt = seq.request.sampling.response_format
        kind = fmt.kind if fmt is not None else "grammar"
        why = matcher_error(seq.matcher)
        log.warning("request %s: response_format %s failed after %d tokens: %s", seq.request_id, kind, seq.num_output, why)
        return (
            f"response_format {kind} could not be followed after {seq.num_output} output tokens: {why} "
            f"(the format is beyond llguidance's limits: simplify it)"
        )

    def _stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        """The ids min_new_tokens holds back: eos (unless ignored) and stop_token_ids;
        empty once the sequence has its minimum."""
        p = seq.request.sampling
        if seq.num_output >= p.min_new_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_ids)
        return eos + tuple(p.stop_token_ids)

    def _seal(self, seqs: list[Sequence]) -> None:
        """Compute the KV of a finished sequence's last token when that token completes
        a block, so the whole transcript is cached for the session's next turn."""
        work = [
            (s, 1)
            for s in seqs
            if len(s.token_ids) % self.block_size == 0
            and len(s.token_ids) - s.num_computed == 1
            and len(s.blocks) * self.block_size >= len(s.token_ids)
        ]
        if work:
            self._forward(work)
            self.num_seal_tokens += len(work)

    def _finish(
        self, seq: Sequence, reason: FinishReason, out: Emitted, error: str = "", rejected: bool = False
    ) -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        if seq.blocks or seq.fork_blocks:
            self._release_blocks(seq)
        if seq.group is None or all(s.status is SeqStatus.FINISHED for s in seq.group):
            self._by_id.pop(seq.request_id, None)
        now = time.monotonic()
        t_first = seq.t_first or now
        decode_s = (seq.t_last - seq.t_first) if seq.t_first else 0.0
        timings = Timings(
            queue_s=(seq.t_admit or now) - seq.arrival,
            restore_s=seq.restore_s,
            prefill_s=max(t_first - (seq.t_admit or t_first) - seq.restore_s, 0.0)
            if seq.t_first
            else 0.0,
            ttft_s=t_first - seq.arrival if seq.t_first else 0.0,
            decode_s=decode_s,
            decode_tokens_per_s=(seq.num_output - 1) / decode_s if decode_s > 0 else 0.0,
        )
        out.append(
            (
                seq.request_id,
                Finished(
                    finish_reason=reason,
                    prompt_tokens=seq.num_prompt,
                    completion_tokens=seq.num_output,
                    cached_tokens=seq.cached_tokens,
                    output_token_ids=seq.output_ids,
                    text=seq.stream.text,
                    timings=timings,
                    error=error,
                    rejected=rejected,
                    index=seq.index,
                ),
            )
        )
        if seq.fork_pending:  # n > 1 ended before forking: the other n - 1 end with it, empty
            for i in range(1, seq.request.sampling.n):
                out.append(
                    (
                        seq.request_id,
                        Finished(
                            finish_reason=reason,
                            prompt_tokens=seq.num_prompt,
                            completion_tokens=0,
                            cached_tokens=seq.cached_tokens,
                            output_token_ids=[],
                            text="",
                            timings=timings,
                            error=error,
                            rejected=rejected,
                            index=i,
                        ),
                    )
                )

    # ---- cache store hooks -----------------------------------------------------------

    def _on_evict(self, block: Block) -> None:
        """Device eviction demotes the block down the store's tiers instead of dropping
        it (``TieredStore.demote``: the store decides where it goes). On CUDA the device
        -> host copy runs on the demotion stream and the store receives it once it
        completed (service/kv/transfer.py); the block is reusable right away."""
        if self.store is None or block.block_hash is None or block.namespace is None:
            return
        ns, h, block_id = block.namespace, block.block_hash, block.block_id
        try:
            self.transfers.demote(block_id, lambda data: self.store.demote(ns, h, data))
        except Exception:
            log.exception("demoting block %d failed", block_id)

    def forget_device(self, token_ids: list[int], scope: CacheScope, *, keep_blocks: int = 0) -> int:
        """Drop the full blocks of ``token_ids`` in ``scope``'s namespace, past the first
        ``keep_blocks``, from the prefix map (engine thread only). A block a running sequence still uses keeps its KV until
        that sequence frees it, then it is a plain free block. Returns how many were dropped."""
        n = 0
        for ns in self.namespaces(scope):  # LongRoPE models: both regimes
            for h in block_hashes(ns, token_ids, self.block_size)[keep_blocks:]:
                block = self.blocks.lookup(h)
                if block is not None:
                    self.blocks.drop_hash(block)
                    n += 1
        return n

    def device_blocks_for(self, token_ids: list[int], scope: CacheScope) -> int:
        """How many leading full blocks of ``token_ids`` are on the device now."""
        ns = self.namespace(scope, len(token_ids))
        return len(self.blocks.match_prefix(block_hashes(ns, token_ids, self.block_size)))

    def spill(
        self,
        token_ids: list[int],
        scope: CacheScope,
        tiers: tuple[str, ...],
        done: Callable[[int, dict[str, int]], None],
    ) -> None:
        """Write every full block of this transcript to ``tiers`` in the background,
        from whichever tier holds it: device blocks from the pool, the others from the
        host tier (by the store's writer).

        Must run on the engine thread (use ``call_soon``). The device blocks are pinned
        (a reference is taken) until the store's writer has copied them, so they cannot
        be evicted or overwritten meanwhile. ``done(n_blocks, held)`` is called once the
        writer is through (on its thread) with the transcript's full blocks and how many
        of them each tier holds afterwards (``{}`` when nothing could be queued).
        """
        if self.store is None:
            done(0, {})
            return
        ns = self.namespace(scope, len(token_ids))  # the regime a next turn on it uses
        hashes = block_hashes(ns, token_ids, self.block_size)
        if not hashes:
            done(0, {})
            return
        on_device = [self.blocks.lookup(h) for h in hashes]
        pinned = [b for b in on_device if b is not None]
        self.blocks.touch(pinned)
        items = [(ns, h, self.pool.block_view(b.block_id) if b is not None else None) for h, b in zip(hashes, on_device)]

        def written(result) -> None:
            self.call_soon(lambda: self.blocks.free(pinned))
            done(len(hashes), dict(result.held))

        if not self.store.submit_spill(items, tiers, on_done=written):
            self.blocks.free(pinned)
            done(len(hashes), {})

    def fail_all(self, error: str) -> Emitted:
        """Finish every sequence with an error (the engine loop hit a bug)."""
        out: Emitted = []
        for seq in list(self.running) + list(self.waiting):
            self.waiting = deque(s for s in self.waiting if s is not seq)
            self._finish(seq, FinishReason.ERROR, out, error=error)
        return out

    def close(self) -> None:
        self._restorer.shutdown(wait=True, cancel_futures=True)
        self.transfers.drain()
        if self.store is not None:
            self.store.close()
