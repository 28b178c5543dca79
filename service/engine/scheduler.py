"""The scheduler room: queues, admission, the token budget and preemption.

It owns where every sequence is (the inbox other threads hand work into, waiting,
restoring, running) and which device blocks each holds, and it decides each step's
work: ``admit`` takes waiting sequences in while blocks and sequence slots allow
(hashing the prompt's full blocks, sharing the device hits, naming the range a restore
may fill), ``plan`` splits the step's token budget into decode rows and prefill chunks,
preempting the most recently started sequence when one needs a block and none is free.
It touches no tensor and no store: restores, forwards and sampling are other rooms',
called by ``LLMEngine`` with what this one returns.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvserve.cachestore.keys import BlockHash
from .config import EngineConfig
from .sequence import Sequence, SeqStatus, StepPlan
from .draft_pool import CONTEXT as POOL_CONTEXT
from .draft_pool import DraftPool, PoolView, pool_key
from .speculative import MAX_STEP_ROWS, MatchStats, NgramDrafter, SpecConfig, StepCost
from ..kv.block_manager import Block, BlockManager, NoFreeBlocks
from ..kv.keys import BlockKeys
from ..types import QueueFull, Tier


@dataclass
class Admitted:
    """What one ``admit`` did: sequences now running (the engine emits their start), now
    restoring (the range a restore may load: hashes and the fresh blocks they go to), and
    refused (they can never fit: the engine fails them)."""

    running: list[Sequence] = field(default_factory=list)
    restoring: list[tuple[Sequence, list[BlockHash], list[Block]]] = field(default_factory=list)
    refused: list[Sequence] = field(default_factory=list)


# A prefill passed over by prefills that started running after it in this many steps
# (``first_batch`` puts short prompts first and never a prompt longer than the budget
# before them, and short prompts may keep arriving) is computed in the next one, with
# what the step's budget leaves after the planned batch: no prompt waits unbounded. The
# prefills of one wave (started in the same step) never count against each other, so a
# wave is still computed in first_batch's batches.
PREFILL_MAX_WAITS = 4


def first_batch(sizes: list[int], fixed: float, per_token: float, budget: int) -> int:
    """How many of the prefills ``sizes`` (pending tokens each, fewest first) this step
    should compute so that the sum of their first tokens' times is least, when a step of
    s prefill tokens takes ``fixed + per_token * s`` seconds and holds at most ``budget``
    tokens. Computing them together saves a step's fixed cost for every one after the
    first but makes the first wait for the others' tokens too: a wave of returning turns
    whose tokens cost far more than a step's fixed cost (the products of a compute-bound
    forward) is best computed one turn a step, each getting its first token as soon as its
    own tokens are done, where one step for all of them would give every turn the last
    one's time. Without the budget, batches of consecutive prefills in this order are
    optimal for the sum over every order and batching (Coffman, Yannakakis, Magazine and
    Santos, "Batch sizing and job sequencing on a single machine", 1990); within it, this
    is the best batching of this order. The first batch's end comes from their O(n^2)
    recursion over where the batches end: best(i) = min over j of (n - i) * (fixed +
    per_token * sum(sizes[i:j])) + best(j), the n - i prefills not yet done all waiting
    for the batch i..j. Ties go to the larger batch (fewer steps)."""
    n = len(sizes)
    best = [0.0] * (n + 1)  # best[i]: the least sum of the waits of prefills i.. once they start
    cut = [n] * (n + 1)  # cut[i]: where the first batch of that schedule ends
    for i in range(n - 1, -1, -1):
        best[i], tokens = float("inf"), 0
        for j in range(i, n):
            tokens += sizes[j]
            if j > i and tokens > budget:
                break
            cost = (n - i) * (fixed + per_token * tokens) + best[j + 1]
            if cost <= best[i]:
                best[i], cut[i] = cost, j + 1
    return cut[0]


class Scheduler:
    """The scheduling room (module docstring): the inbox, waiting / restoring / running,
    admission, each step's plan (decodes, drafts, prefill batches), preemption.

    Over 400 lines: one owner of the sequences' queues and blocks; admission, the plan, the drafts and preemption change the same lists together."""

    def __init__(
        self,
        cfg: EngineConfig,
        blocks: BlockManager,
        keys: BlockKeys,
        *,
        has_tiers: bool,
        may_hold: Callable[[bytes, list[BlockHash]], bool] | None = None,
        reclaim: Callable[[int], int] | None = None,
        warming: Callable[[], bool] | None = None,
        max_model_len: int | None = None,
        spec: SpecConfig | None = None,
        prefill_rate: Callable[[], float | None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.spec = spec or SpecConfig(enabled=False)  # enabled: the default of a request that does not say
        self.step_cost = StepCost()  # what a step and a draft row cost, from the engine's timed decode steps
        self.max_step_rows = MAX_STEP_ROWS  # decode rows + drafts of one step at most (drafts never pass it)
        self.match_stats = MatchStats()  # how often drafts continued, per match length: every sequence's drafter's
        # recent outputs per tenant and cache salt, drafted from across requests (None: --draft-pool-memory 0)
        self.draft_pool = DraftPool(cfg.draft_pool_memory) if cfg.draft_pool_memory > 0 else None
        # the measured prefill tokens/s (the runner's), for how many prefills share a step
        self.prefill_rate = prefill_rate or (lambda: None)
        self.block_size = cfg.block_size
        self.blocks = blocks
        self.keys = keys
        self.has_tiers = has_tiers  # a host/Redis tier exists: admission names restore ranges
        # (namespace, hashes) -> whether a tier below the device may hold the first of them
        # (the restore room's ``may_hold``: exact for the host tier, asked on this thread);
        # False: the sequence runs at once instead of waiting a step for the restore thread
        self.may_hold = may_hold or (lambda namespace, hashes: True)
        # n -> how many blocks held only for a coming turn (session warm-ups, engine/warm.py)
        # were let go to make room: asked before a sequence waits or another is preempted
        self.reclaim = reclaim or (lambda n: 0)
        # whether blocks are in flight to a warm-up (free or reclaimable when it lands)
        self.warming = warming or (lambda: False)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.restoring: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._inbox: list[Sequence] = []
        self._aborts: list[str] = []
        self._calls: list[Callable[[], None]] = []  # run on the engine thread between steps
        self._lock = threading.Lock()
        self.work_ready = threading.Event()
        self.num_preempted = 0
        self.num_plans = 0  # steps planned (a sequence's started_step: when it began running)
        self.num_rope_switches = 0  # sequences recomputed on crossing the LongRoPE switch length

    # ---- called from other threads ---------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) + len(self._inbox) >= self.cfg.max_queue:
                raise QueueFull(f"the queue is full ({self.cfg.max_queue} waiting requests); retry later")
            self._inbox.append(seq)
        self.work_ready.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self.work_ready.set()

    def call_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._calls.append(fn)
        self.work_ready.set()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring or self._inbox or self._aborts or self._calls)

    def wait_for_work(self, timeout_s: float) -> None:
        self.work_ready.wait(timeout_s)
        self.work_ready.clear()

    def counts(self) -> tuple[int, int]:
        """(running incl. restoring, waiting incl. the inbox)."""
        return len(self.running) + len(self.restoring), len(self.waiting) + len(self._inbox)

    # ---- the engine thread -----------------------------------------------------------

    def drain_inbox(self) -> tuple[list[Callable[[], None]], list[Sequence]]:
        """New requests join the waiting queue; returns the calls to run now and the
        sequences an abort ends now (a restoring one is marked and ends when it lands)."""
        with self._lock:
            new, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for seq in new:
            self._by_id[seq.request_id] = seq
            self.waiting.append(seq)
        cancelled: list[Sequence] = []
        for rid in aborts:
            first = self._by_id.get(rid)
            for seq in (first.group or [first]) if first is not None else []:
                if seq.status is SeqStatus.FINISHED:
                    continue
                if seq.status is SeqStatus.RESTORING:
                    seq.cancelled = True  # its blocks are being written; finished when it lands
                    continue
                if seq.status is SeqStatus.WAITING:
                    self.waiting.remove(seq)
                cancelled.append(seq)
        return calls, cancelled

    def admit(self) -> Admitted | None:
        """Take waiting sequences in while blocks and sequence slots allow (None: none waits)."""
        if not self.waiting:
            return None
        out = Admitted()
        while self.waiting and len(self.running) + len(self.restoring) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            restore = self._try_allocate(seq)
            if restore is None:
                if not self.running and not self.restoring and not self.warming():
                    # nothing will ever free blocks for it (validate() should prevent this;
                    # a warm-up's blocks in flight are reclaimable once they land: it waits)
                    self.waiting.popleft()
                    out.refused.append(seq)
                    continue
                break
            self.waiting.popleft()
            if restore[0] and self.may_hold(seq.namespace, restore[0]):
                seq.status = SeqStatus.RESTORING
                self.restoring.append(seq)
                out.restoring.append((seq, *restore))
            else:
                self.start_running(seq)
                out.running.append(seq)
        return out

    def _try_allocate(self, seq: Sequence) -> tuple[list[BlockHash], list[Block]] | None:
        """Blocks for the whole of ``seq``'s tokens (device hits shared), or None when they
        do not fit now; returns the range past the device hits a restore may fill."""
        bs = self.block_size
        n_tokens = len(seq.token_ids)
        seq.hashes = self.keys.chain(seq.namespace, seq.token_ids, seq.hashes)
        # the last token is always recomputed (its logits are needed)
        reusable = (n_tokens - 1) // bs
        device_hits = self.blocks.match_prefix(seq.hashes[:reusable])
        n_dev = len(device_hits)
        n_needed = -(-n_tokens // bs)
        # n > 1: one block per extra sequence for its copy of the partial last prompt block
        n_fork = seq.request.sampling.n - 1 if seq.fork_pending and n_tokens % bs else 0
        idle_hits = sum(1 for b in device_hits if b.ref_count == 0)
        short = n_needed - n_dev + n_fork - (self.blocks.num_free - idle_hits)
        if short > 0 and self.reclaim(short):
            idle_hits = sum(1 for b in device_hits if b.ref_count == 0)
        if self.blocks.num_free - idle_hits < n_needed - n_dev + n_fork:
            return None
        self.blocks.touch(device_hits)
        fresh = self.blocks.allocate(n_needed - n_dev)
        seq.fork_blocks = self.blocks.allocate(n_fork)
        seq.blocks = device_hits + fresh
        seq.num_computed = n_dev * bs
        seq.num_registered = n_dev
        seq.cached_by_tier = {Tier.DEVICE: n_dev * bs} if n_dev else {}
        seq.t_admit = time.monotonic()
        if self.has_tiers and n_dev < reusable:
            return seq.hashes[n_dev:reusable], fresh[: reusable - n_dev]
        return [], []

    def start_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        seq.started_step = self.num_plans
        self.running.append(seq)

    def restored(self, seq: Sequence) -> None:
        """Its restore landed (the restore room registered what it loaded)."""
        self.restoring.remove(seq)

    def plan(self) -> StepPlan:
        """Decode rows and prefill chunks for this step within ``max_num_batched_tokens``.

        Every decode row is planned first (one token each, never starved by a prefill);
        then the prefills, fewest pending tokens first: a returning turn whose prefix is
        cached has only its new tokens to compute and gets its first token this step,
        while a long cold prompt takes what is left of the budget (chunked across steps)
        instead of holding the budget while returning turns wait behind it. A sequence
        that needs a block when none is free preempts the most recently started one
        (itself last); one that grew past LongRoPE's switch length is re-admitted. A
        prefill passed over by later ones in ``PREFILL_MAX_WAITS`` steps takes what is
        left of the budget in the next."""
        for seq in list(self.running):
            if not seq.long_rope and self.keys.is_long(len(seq.token_ids)):
                self._switch_to_long_rope(seq)
        pending = {id(s): len(s.token_ids) - s.num_computed for s in self.running}
        # stable: decodes in running order, then prefills by pending tokens (ties: running order)
        order = sorted(self.running, key=lambda s: (pending[id(s)] != 1, pending[id(s)]))
        budget = self.cfg.max_num_batched_tokens
        decode: list[Sequence] = []
        prefill: list[tuple[Sequence, int]] = []
        verify: list[Sequence] = []
        # drafts are extra rows of the decode forward: no more rows than the native decode
        # step takes in one call (past it the whole step would run on torch's kernels)
        spare_rows = self.max_step_rows - len(self.running)
        row_cost = self.step_cost.share(len(self.running))  # a draft row's share of this step's cost
        batch: set[int] | None = None  # the prefills this step computes (first_batch), once the decode rows are planned
        for seq in order:
            if seq not in self.running:  # preempted below
                continue
            left = pending[id(seq)]
            if left != 1:
                if batch is None:
                    prefills = [s for s in order if pending[id(s)] != 1 and s in self.running]
                    batch = self._prefill_batch(prefills, pending, self.cfg.max_num_batched_tokens - budget, budget)
                if id(seq) not in batch and seq.prefill_waits < PREFILL_MAX_WAITS:
                    continue
            n = 1 if left == 1 else min(left, max(budget, 0))
            if n == 0:
                continue
            while not self._ensure_blocks(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            if left == 1:
                seq.drafts = self._draft(seq, min(budget - 1, spare_rows), row_cost)
                if seq.drafts:
                    verify.append(seq)
                    n += len(seq.drafts)
                    spare_rows -= len(seq.drafts)
                else:
                    decode.append(seq)
            else:
                prefill.append((seq, n))
                seq.prefill_waits = 0
            budget -= n
        self.num_plans += 1
        self._count_passed_over(prefill, pending)
        # a preemption may have removed a sequence scheduled earlier in this loop
        return StepPlan(
            decode=[s for s in decode if s in self.running],
            prefill=[(s, n) for s, n in prefill if s in self.running],
            verify=[s for s in verify if s in self.running],
        )

    def _count_passed_over(self, prefill: list[tuple[Sequence, int]], pending: dict[int, int]) -> None:
        """Each running prefill this step leaves out while it computes one that started
        running later has been passed over once more (``PREFILL_MAX_WAITS``). A step that
        computes no prefill (a decode step) passes nothing over."""
        if not prefill:
            return
        newest = max((s.started_step for s, _ in prefill if s in self.running), default=-1)
        chosen = {id(s) for s, _ in prefill}
        for seq in self.running:
            if pending.get(id(seq), 1) != 1 and id(seq) not in chosen and seq.started_step < newest:
                seq.prefill_waits += 1

    def _prefill_batch(self, prefills: list[Sequence], pending: dict[int, int], decode_rows: int, budget: int) -> set[int]:
        """Which of this step's prefills (fewest pending tokens first) it computes: of those
        that can end their prompt this step (pending within ``budget``), the first batch of
        ``first_batch``'s schedule, at a step's measured fixed cost (``step_cost.at`` the
        planned decode rows) and the runner's measured prefill seconds per token; when that
        batch is all of them, the longer prompts too (they take what is left of the budget,
        chunked). Every prefill before either cost is measured, or when fewer than two can
        end their prompt."""
        every = {id(s) for s in prefills}
        short = [s for s in prefills if pending[id(s)] <= budget]
        fixed, rate = self.step_cost.at(decode_rows), self.prefill_rate()
        if len(short) < 2 or fixed is None or not rate:
            return every
        k = first_batch([pending[id(s)] for s in short], fixed, 1.0 / rate, budget)
        return every if k == len(short) else {id(s) for s in short[:k]}

    def _draft(self, seq: Sequence, budget: int, row_cost: float) -> list[int]:
        """Drafts for a decode row (engine/speculative.py), within ``budget`` tokens, the
        request's max_new_tokens and the context (the bonus token counts too), the blocks
        it holds or free ones (a draft never preempts), the LongRoPE switch length (the
        tokens past it are computed in the other regime) and, with a response_format,
        the grammar: a draft ends before the first token the matcher refuses (its
        ``validate_tokens`` moves nothing). How many the drafter takes of its candidate
        is its cost decision (speculative.draft_length) at ``row_cost``, a draft row's
        share of this step's cost (``step_cost``). None when the request (SamplingParams.
        speculative) or else the server says off, or before an n > 1 request forks (it
        forks at its first sample, which a plain row makes). Seeded rows draft: their
        draws depend on the output position alone (sampling.position_seed), so what a
        step's budget or free blocks cut changes none of their tokens."""
        p = seq.request.sampling
        if not (self.spec.enabled if p.speculative is None else p.speculative) or seq.fork_pending:
            return []
        L = len(seq.token_ids)
        limit = min(budget, p.max_new_tokens - seq.num_output - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - L - 1)
        if limit <= 0:
            return []
        if seq.drafter is None:
            config = self.spec
            if p.spec_max_draft is not None:
                config = dataclasses.replace(config, max_draft=p.spec_max_draft)
            seq.drafter = NgramDrafter(config, self.match_stats, pool=self._pool_view(seq))
        drafts = seq.drafter.propose(seq.token_ids, limit, row_cost)
        while drafts and not seq.long_rope and self.keys.is_long(L + len(drafts)):
            drafts.pop()
        if drafts and seq.matcher is not None:
            del drafts[seq.matcher.validate_tokens(drafts) :]
        # a block for the drafts only while one stays free for every running sequence, so
        # that drafting never makes a later sequence of this step preempt another
        need = -(-(seq.num_computed + 1 + len(drafts)) // self.block_size) - len(seq.blocks)
        if drafts and need > 0 and (
            self.blocks.num_free - need < len(self.running)
            or not self._ensure_blocks(seq, seq.num_computed + 1 + len(drafts))
        ):
            room = len(seq.blocks) * self.block_size - seq.num_computed - 1
            del drafts[max(room, 0) :]
        return drafts

    def _pool_view(self, seq: Sequence) -> PoolView | None:
        """The draft pool's side of the sequence's tenant and cache salt, the request's
        recalled answers (a session's dropped ones) added to it first; None without a pool."""
        if self.draft_pool is None:
            return None
        key = pool_key(seq.request)
        for text in seq.request.recall:
            self.draft_pool.add(key, text)
        return PoolView(self.draft_pool, key)

    def remember(self, seq: Sequence) -> None:
        """A finished sequence's output, after its prompt's last tokens, joins the draft
        pool under its tenant and cache salt (nothing without a pool or an output)."""
        if self.draft_pool is not None and seq.num_output > 0:
            self.draft_pool.add(pool_key(seq.request), seq.token_ids[max(seq.num_prompt - POOL_CONTEXT, 0) :])

    def trim(self, seq: Sequence) -> None:
        """After a verification: the blocks past what the sequence's tokens need (they
        held rejected drafts' KV, never registered) are given back."""
        keep = -(-len(seq.token_ids) // self.block_size)
        if len(seq.blocks) > keep:
            self.blocks.free(seq.blocks[keep:])
            # a new list, not one cut in place: the runner's cached block table is keyed by
            # the list object, and a table kept past a cut would still name the freed block
            # (another sequence's once reallocated) where the next draft block goes
            seq.blocks = seq.blocks[:keep]

    def _ensure_blocks(self, seq: Sequence, n_tokens: int) -> bool:
        need = -(-n_tokens // self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.blocks.num_free:
            self.reclaim(need - self.blocks.num_free)
        try:
            seq.blocks.extend(self.blocks.allocate(need))
            return True
        except NoFreeBlocks:
            return False

    def _preempt(self, victim: Sequence) -> None:
        """Free a running sequence's blocks and send it back to wait (recompute later)."""
        self.running.remove(victim)
        self.release(victim)
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
        self.release(seq)
        seq.hashes = []
        seq.num_computed = seq.num_registered = 0
        seq.long_rope = True
        seq.namespace = self.keys.namespace(seq.request.scope, len(seq.token_ids))
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_rope_switches += 1

    def place_forks(self, parent: Sequence, children: list[Sequence]) -> list[tuple[int, int]]:
        """An n > 1 request forks at its first sample: each child takes a reference on the
        prompt's full blocks and one reserved block for its copy of the partial last block,
        and runs. Returns the (source, destination) block ids whose KV is to be copied."""
        full = parent.num_computed // self.block_size
        reserved = parent.fork_blocks
        parent.fork_blocks = []
        copies: list[tuple[int, int]] = []
        for child in children:
            blocks = list(parent.blocks[:full])
            self.blocks.touch(blocks[parent.num_released :])
            if full < len(parent.blocks):  # the partial last block: a copy of its KV
                own = reserved.pop()
                copies.append((parent.blocks[full].block_id, own.block_id))
                blocks.append(own)
            child.blocks = blocks
            child.status = SeqStatus.RUNNING
            self.running.append(child)
        if reserved:  # not needed after all (cannot happen: reserved iff a partial block)
            self.blocks.free(reserved)
        return copies

    def release(self, seq: Sequence) -> None:
        """Give back every block the sequence still holds."""
        self.blocks.free(seq.blocks[seq.num_released :])
        seq.blocks = []
        seq.num_released = 0
        if seq.fork_blocks:
            self.blocks.free(seq.fork_blocks)
            seq.fork_blocks = []

    def retire(self, seq: Sequence) -> None:
        """The sequence is finished: out of every queue, its blocks given back."""
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        if seq.blocks or seq.fork_blocks:
            self.release(seq)
        if seq.group is None or all(s.status is SeqStatus.FINISHED for s in seq.group):
            self._by_id.pop(seq.request_id, None)

    def take_all(self) -> list[Sequence]:
        """Every running and waiting sequence, the waiting ones taken off their queue (to
        fail them all)."""
        seqs = list(self.running) + list(self.waiting)
        self.waiting.clear()
        return seqs
