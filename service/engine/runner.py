"""The runner room: block tables, the batch layout, the model's forward and its decode step
(models/step.py's ``DecodeStep``: the native CPU step, the CUDA step or the torch
reference, chosen once by the engine; the rows packed as ``DecodeRows``).

``run(plan)`` computes a step plan (service/engine/scheduler.py): one decode step over
the decode rows, the verify rows and the prefill chunks over a cached context that fit
the step's backend with them (``chunk_rows``: a returning turn's new tokens, a row per
token: the native layer reads the context in place, once per sequence, where the padded
forward gathers it, and the weights are read once for the decodes and the returning
turns), then the other
prefill chunks, batched into as few forwards as
padding allows (``prefill_groups``: chunks of similar length and context share one
forward, one read of the weights and larger products; a long cold chunk beside a returning
turn's few tokens runs on its own rather than padding the short one to its length), and
returns the rows to sample with their logits. Every forward advances its sequences' ``num_computed``,
registers the blocks it completed under their hashes (from then on any request in the
same namespace can share them) and, on sliding-window models, gives back the leading
blocks no later query can see. The runner also measures the prefill rate (tokens/s) that
the restore room weighs restoring against, and seals finished sequences (computes a last
token's KV when it completes a block).
"""

from __future__ import annotations

import array
from collections import deque
from typing import Any, Callable

import torch

from .sequence import Sequence, StepPlan
from ..kv.block_manager import NULL_BLOCK, BlockManager
from ..kv.cache import BatchLayout, DecodeRows, KVPool, SeqSlice
from ..kv.keys import BlockKeys
from ..kv.transfer import BlockTransfers
from ..models.step import DecodeStep, TorchStep

Row = tuple[Sequence, torch.Tensor]  # a sequence to sample and its (V,) logits

PREFILL_TIMED_MIN = 32  # prefill forwards of at least this many tokens are timed for the prefill rate
# a prefill forward is padded to (chunks, longest chunk) tokens and each chunk attends over
# the longest context of the forward: chunks join one forward while both padded sizes stay
# within this factor of the real ones
PREFILL_PAD_SLACK = 1.25


def prefill_groups(chunks: list[tuple[Sequence, int]], pad_slack: float = PREFILL_PAD_SLACK) -> list[list[tuple[Sequence, int]]]:
    """The step's prefill chunks ((sequence, tokens) each) as forwards: sorted by length
    (ties: plan order), a chunk joins the current forward while the forward's padded
    tokens (chunks x longest) and padded context (chunks x longest context) stay within
    ``pad_slack`` of the real ones; else it starts the next forward. Every chunk is in
    exactly one forward; one chunk alone is one forward (the layout of before)."""
    groups: list[list[tuple[Sequence, int]]] = []
    tokens = ctx = longest = widest = 0
    for seq, n in sorted(chunks, key=lambda c: c[1]):
        c = seq.num_computed + n  # the context this chunk attends over, itself included
        if groups:
            k = len(groups[-1]) + 1
            if k * max(longest, n) <= pad_slack * (tokens + n) and k * max(widest, c) <= pad_slack * (ctx + c):
                groups[-1].append((seq, n))
                tokens, ctx, longest, widest = tokens + n, ctx + c, max(longest, n), max(widest, c)
                continue
        groups.append([(seq, n)])
        tokens, ctx, longest, widest = n, c, n, c
    return groups


class Runner:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        blocks: BlockManager,
        keys: BlockKeys,
        transfers: BlockTransfers,
        *,
        device: torch.device,
        release_window: int | None,
        step: DecodeStep | None = None,
    ) -> None:
        """``step``: the decode step's backend (models/step.py ``build_step``); None: the
        torch reference over ``model``."""
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self.keys = keys
        self.transfers = transfers
        self.device = device
        self.block_size = keys.block_size
        self.longrope = keys.longrope_threshold is not None  # the model reads each row's regime
        # blocks outside every layer's window can be given back (when every layer has one)
        self.release_window = release_window
        # a decode step's backend, and the reference for steps of more rows than it takes
        self.reference = TorchStep(model, pool, device)
        self.step = step or self.reference
        self.num_prefill_tokens = 0
        self.num_prefill_forwards = 0  # prefill forwards run (several chunks may share one)
        self.num_decode_tokens = 0
        self.num_seal_tokens = 0
        # speculative decoding: verify forwards (one per sequence), drafts run through them
        # (counted in num_decode_tokens too) and drafts accepted
        self.num_verify_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # measured prefill rate (tokens/s), for the restore-or-recompute decision
        self.prefill_tokens_per_s: float | None = None
        self._prefill_marks: deque[tuple[int, Any, Any]] = deque()  # (tokens, start, end) to read

    def run(self, plan: StepPlan) -> tuple[list[Row], torch.Tensor | None, list[Row]]:
        """Compute ``plan``; returns the rows whose next token is to be sampled (decode rows
        first), when they are the decode rows alone their (B, V) logits as one tensor, and
        the verify rows with their (1 + drafts, V) logits (``decode_step``)."""
        rows: list[Row] = []
        decode_logits = None
        verified: list[Row] = []
        done: dict[int, torch.Tensor] = {}  # id(seq) -> logits of a chunk that ended its prompt
        n_rows = len(plan.decode) + sum(1 + len(s.drafts) for s in plan.verify)
        as_rows, padded = self._chunks_as_rows(plan.prefill, n_rows)
        if n_rows or as_rows:
            t0 = self.transfers.ops.mark()
            logits = self.decode_step(plan.decode, plan.verify, as_rows)
            decode_logits = logits[: len(plan.decode)]
            rows.extend((s, decode_logits[i]) for i, s in enumerate(plan.decode))
            at = len(plan.decode)
            for seq in plan.verify:
                verified.append((seq, logits[at : at + 1 + len(seq.drafts)]))
                at += 1 + len(seq.drafts)
            if as_rows:
                self._prefilled(as_rows, logits[n_rows:], t0, done)
        for group in prefill_groups(padded):
            t0 = self.transfers.ops.mark()
            self._prefilled(group, self.forward(group), t0, done)
        rows.extend((seq, done[id(seq)]) for seq, _ in plan.prefill if id(seq) in done)  # in plan order
        self.poll_prefill_rate()
        return rows, decode_logits if len(rows) == len(plan.decode) else None, verified

    def _prefilled(self, group: list[tuple[Sequence, int]], logits: torch.Tensor, t0: Any, done: dict[int, torch.Tensor]) -> None:
        """A forward computed ``group``'s chunks ((len(group), V) logits of their last
        tokens): counted, timed for the prefill rate, and the logits of those that ended
        their prompt kept in ``done``."""
        n = sum(k for _, k in group)
        self.num_prefill_tokens += n
        self.num_prefill_forwards += 1
        if n >= PREFILL_TIMED_MIN:  # timed for the prefill rate (restore-vs-recompute)
            self._prefill_marks.append((n, t0, self.transfers.ops.mark()))
        for i, (seq, _) in enumerate(group):
            if seq.num_computed == len(seq.token_ids):
                done[id(seq)] = logits[i]

    def decode_step(
        self, decode: list[Sequence], verify: list[Sequence], chunks: list[tuple[Sequence, int]] | None = None
    ) -> torch.Tensor:
        """One batched forward of decode rows, (rows, V) logits: a row per decode sequence
        (its pending token), then for each verify sequence a row per position of its
        pending token and its drafts (``seq.drafts``), in order, all sharing its block
        table, then the logits of each of ``chunks``' last token ((sequence, tokens) over
        a cached context: a row per token, the head on the last alone). Each row is one
        new token at its own position, so the whole step is a decode step (the native
        decode layer where it applies: one read of the weights for the step's decodes and
        returning turns together, every row's K/V written before any row attends, a
        sequence's rows reading their context once), and a row sees the positions up to
        its own, so row i of a verify sequence is the target after its drafts[:i], as a
        prefill chunk of those tokens would give. Decode rows and chunks advance; a verify
        sequence's ``num_computed`` does not move until ``commit`` knows what its drafts'
        KV is worth, and nothing of it is registered."""
        chunks = chunks or []
        n_rows = len(decode) + sum(1 + len(seq.drafts) for seq in verify)
        rows = DecodeRows(self.block_size)
        for seq in decode:
            rows.add(self._block_table(seq), seq.num_computed, seq.token_ids[seq.num_computed : seq.num_computed + 1],
                     self._regime(seq))  # fmt: skip
        for seq in verify:
            rows.add(self._block_table(seq), seq.num_computed, [seq.token_ids[-1], *seq.drafts], self._regime(seq))
        which = None
        if chunks:  # the head on each chunk's last token alone
            which = array.array("q", range(len(rows)))
            for seq, n in chunks:
                rows.add(self._block_table(seq), seq.num_computed, seq.token_ids[seq.num_computed : seq.num_computed + n],
                         self._regime(seq))  # fmt: skip
                which.append(len(rows) - 1)
        step = self.step if len(rows) <= self.step.max_rows else self.reference
        logits = step(rows, which)
        for seq in decode:
            self._advance(seq, 1)
        for seq, n in chunks:
            self._advance(seq, n)
        self.num_decode_tokens += n_rows
        self.num_verify_steps += len(verify)
        self.num_draft_tokens += n_rows - len(decode) - len(verify)
        return logits

    def _regime(self, seq: Sequence) -> bool | None:
        """The sequence's LongRoPE factor set, for a model that reads it (else None)."""
        return seq.long_rope if self.longrope else None

    def _advance(self, seq: Sequence, n: int) -> None:
        """``n`` more of the sequence's tokens are computed KV: the blocks they complete
        registered, the ones no later query can see given back."""
        seq.num_computed += n
        self._register_full_blocks(seq)
        self._release_outside_window(seq)

    def commit(self, seq: Sequence, accepted: int) -> None:
        """A verified sequence kept ``accepted`` of its drafts (each one now a token of
        it): its pending token's and theirs are computed KV (registered when they complete
        a block); the rejected drafts' KV past them is stale and is overwritten when
        those positions are computed again."""
        self.num_accepted_tokens += accepted
        self._advance(seq, min(1 + accepted, len(seq.token_ids) - seq.num_computed))

    def poll_prefill_rate(self) -> None:
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

    def seal(self, seqs: list[Sequence]) -> None:
        """Compute the KV of a finished sequence's last token when that token completes
        a block, so the whole transcript is cached for the session's next turn."""
        work = [
            (s, 1)
            for s in seqs
            if len(s.token_ids) % self.block_size == 0
            and len(s.token_ids) - s.num_computed == 1
            and len(s.blocks) * self.block_size >= len(s.token_ids)
        ]
        if work:  # one decode step of those rows (their logits unused)
            rows = DecodeRows(self.block_size)
            for seq, _ in work:
                rows.add(self._block_table(seq), seq.num_computed, seq.token_ids[-1:], self._regime(seq))
            (self.step if len(rows) <= self.step.max_rows else self.reference)(rows)
            for seq, _ in work:
                self._advance(seq, 1)
            self.num_seal_tokens += len(work)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """(source, destination) block ids: the destination gets a copy of the source's KV."""
        for src, dst in copies:
            self.pool.import_block(dst, self.pool.block_view(src))

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

    def forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        """One forward over ``work`` ((sequence, tokens) each, from its ``num_computed``):
        (len(work), V) logits of each slice's last token."""
        slices = [
            SeqSlice(
                block_table=self._block_table(seq),
                start_pos=seq.num_computed,
                token_ids=seq.token_ids[seq.num_computed : seq.num_computed + n],
                long_rope=self._regime(seq),
            )
            for seq, n in work
        ]
        layout = BatchLayout.build(slices, self.block_size, self.device)
        logits = self.model(layout, self.pool)
        for seq, n in work:
            self._advance(seq, n)
        return logits

    def _chunks_as_rows(self, chunks: list[tuple[Sequence, int]], taken: int = 0) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """The step's prefill chunks split into those that run in the step's decode step
        as a row per token (``decode_step``: chunks over a cached context, together with
        the ``taken`` decode rows at most the backend's ``chunk_rows``: returning turns' new
        tokens; the native step's) and the rest, for ``prefill_groups``' padded forwards.
        More rows than one native step takes go padded too: there one forward of many rows
        runs compute-bound products (~110M, 256 tokens over 320 positions: 394-419 ms
        padded against 459-493 ms as rows; 80 tokens: 159-188 against 133-146 ms; 16 tokens
        over 2000: 65 against 45 ms)."""
        cap = self.step.chunk_rows - taken
        cached = [(seq, n) for seq, n in chunks if seq.num_computed > 0]
        if not cached or sum(n for _, n in cached) > cap:
            return [], chunks
        return cached, [(seq, n) for seq, n in chunks if seq.num_computed == 0]

    def forward_over_restore(self, seq: Sequence, start: int, landed: Callable[[int], None]) -> torch.Tensor:
        """An overlapped restore's forward (service/engine/restore.py): the rest of the
        prompt from ``start`` (past the blocks being restored), each layer's attention
        waiting for ``landed(layer)``. (1, V) logits of the last token. Advances and
        registers nothing: ``keep_over_restore`` does, once the restore verified every
        block it planned; otherwise the result is thrown away."""
        seq_slice = SeqSlice(
            block_table=self._block_table(seq),
            start_pos=start,
            token_ids=seq.token_ids[start:],
            long_rope=self._regime(seq),
        )
        layout = BatchLayout.build([seq_slice], self.block_size, self.device, landed=landed)
        return self.model(layout, self.pool)

    def keep_over_restore(self, seq: Sequence) -> None:
        """The overlapped forward stands (its restore verified whole; ``num_computed`` is
        the forward's start): its tokens are computed KV, registered as they complete
        blocks."""
        n = len(seq.token_ids) - seq.num_computed
        self.num_prefill_tokens += n
        self._advance(seq, n)

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        if len(seq.hashes) < full:
            seq.hashes = self.keys.chain(seq.namespace, seq.token_ids[: full * self.block_size], seq.hashes)
        B = self.block_size
        for i in range(seq.num_registered, full):
            self.blocks.register(seq.blocks[i], seq.hashes[i], seq.namespace,
                                 parent=seq.hashes[i - 1] if i else None, tokens=seq.token_ids[i * B : (i + 1) * B])
        seq.num_registered = full

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
