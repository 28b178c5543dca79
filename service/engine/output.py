"""The output room: what becomes of a step's logits (``Output``). It samples, streams
(each sequence's ``TextStream``, in ``sequence.py``), stops, forks n > 1 requests' output
state and builds the start and finish events.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .grammar import GrammarCompiler, matcher_error
from .sampling import (
    RowState,
    Sampled,
    apply_grammar_masks,
    apply_penalties,
    make_generator,
    needs_penalties,
    sample,
    token_logprobs,
)
from .speculative import accept
from .sequence import Emitted, Sequence, TextStream
from ..types import (
    Delta,
    Event,
    Finished,
    FinishReason,
    GenerationRequest,
    MAX_SPEC_DRAFT,
    InvalidRequest,
    SamplingParams,
    Started,
    Tier,
    Timings,
    TokenLogprob,
)

log = logging.getLogger(__name__)


# ---- the output room -------------------------------------------------------------------


def _merge_deltas(events: Emitted, start: int) -> None:
    """The deltas ``events[start:]`` (one sequence's, one verification's) as one delta."""
    if len(events) - start < 2:
        return
    rid, first = events[start]
    deltas = [ev for _, ev in events[start:]]
    if not all(isinstance(d, Delta) for d in deltas):
        return
    events[start:] = [
        (
            rid,
            Delta(
                token_ids=[t for d in deltas for t in d.token_ids],
                text="".join(d.text for d in deltas),
                logprobs=[lp for d in deltas for lp in d.logprobs],
                index=first.index,
            ),
        )
    ]

Sampler = Callable[..., Sampled]  # sampling.sample's signature: (logits, params, generators, states, masks)


@dataclass(slots=True)
class Emission:
    """What one ``emit`` produced: the deltas, the sequences that ended (to seal and finish)
    and those that failed alone: (sequence, error, rejected: INVALID_ARGUMENT rather than
    INTERNAL)."""

    events: Emitted = field(default_factory=list)
    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)
    failed: list[tuple[Sequence, str, bool]] = field(default_factory=list)
    # verify rows (``emit_verified``): (sequence, its drafts that became its tokens)
    verified: list[tuple[Sequence, int]] = field(default_factory=list)


class Output:
    """The output room: a sequence's output state (text stream, generator, grammar
    matcher), sampling (service/engine/sampling.py) with the grammar masks, the n > 1
    fork's output side, stops, and the start and finish events.

    One request's failure is its own: when sampling a batch raises (a request's logits
    processing, grammar mask or draw), the rows are sampled one at a time from the same
    logits and generator states, the rows that raise again fail alone (INTERNAL, or
    INVALID_ARGUMENT for an ``InvalidRequest``) and every other row gets the token the
    batch would have given it. ``sampler`` is ``sampling.sample`` unless a test passes
    another."""

    def __init__(
        self,
        tokenizer: Any,
        grammars: GrammarCompiler,
        *,
        eos_ids: frozenset[int],
        model_vocab: int,
        max_model_len: int,
        device: torch.device,
        tiers: tuple[Tier, ...],
        sampler: Sampler = sample,
    ) -> None:
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.eos_ids = eos_ids
        # Embeddings are often padded past the tokenizer (e.g. to a multiple of 64):
        # ids beyond the tokenizer's vocabulary can never be sampled.
        self.sampleable_vocab = min(tokenizer.vocab_size, model_vocab)
        self.max_model_len = max_model_len
        self.device = device
        self.tiers = tiers  # fastest first: the slowest that contributed is a start's cached_tier
        self._sampler = sampler
        self.num_forked = 0  # sequences created by forking an n > 1 request
        # entry n: sequence-steps that gave n output tokens (the last entry: that many or more)
        self.step_tokens = [0] * (MAX_SPEC_DRAFT + 2)

    # ---- sequences -------------------------------------------------------------------

    def new_sequence(self, req: GenerationRequest, namespace: bytes, long_rope: bool) -> Sequence:
        seq = Sequence(
            request=req,
            namespace=namespace,
            long_rope=long_rope,
            token_ids=list(req.prompt_token_ids),
            num_prompt=len(req.prompt_token_ids),
            arrival=time.monotonic(),
            stream=TextStream(self.tokenizer.detokenizer(), req.sampling.stop),
            generator=make_generator(req.sampling, self.device),
            seed=req.sampling.seed if req.sampling.temperature != 0.0 else None,
        )
        if req.sampling.response_format is not None:
            seq.matcher = self.grammars.matcher(req.sampling.response_format)
        return seq

    def fork(self, parent: Sequence) -> list[Sequence]:
        """An n > 1 request's prompt is computed (its last token's logits are about to be
        sampled): the other n - 1 sequences, each with its own generator (seed + index),
        text stream and, with a response_format, a copy of the matcher at the grammar's
        start. Their blocks are the scheduler's (``Scheduler.place_forks``)."""
        parent.group = [parent]
        p = parent.request.sampling
        for i in range(1, p.n):
            seed = None if p.seed is None else (p.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
            parent.group.append(
                Sequence(
                    request=parent.request,
                    namespace=parent.namespace,
                    token_ids=list(parent.token_ids),
                    num_prompt=parent.num_prompt,
                    arrival=parent.arrival,
                    stream=TextStream(self.tokenizer.detokenizer(), p.stop),
                    generator=make_generator(dataclasses.replace(p, seed=seed), self.device),
                    seed=seed if p.temperature != 0.0 else None,
                    hashes=list(parent.hashes),
                    num_computed=parent.num_computed,
                    num_registered=parent.num_registered,
                    num_released=parent.num_released,
                    cached_by_tier=dict(parent.cached_by_tier),
                    long_rope=parent.long_rope,
                    started=True,
                    t_admit=parent.t_admit,
                    restore_s=parent.restore_s,
                    index=i,
                    group=parent.group,
                    matcher=parent.matcher.deep_copy() if parent.matcher is not None else None,
                )
            )
        self.num_forked += p.n - 1
        return parent.group[1:]

    # ---- tokens ----------------------------------------------------------------------

    def emit(self, rows: list[tuple[Sequence, torch.Tensor]], logits: torch.Tensor | None = None) -> Emission:
        """Sample a token for every row, stream it and decide its stop; ``logits``: the
        rows' logits as one (len(rows), V) tensor when the caller has it (else stacked)."""
        logits = torch.stack([r for _, r in rows]).float() if logits is None else logits.float()
        if self.sampleable_vocab < logits.shape[-1]:
            logits[:, self.sampleable_vocab :] = float("-inf")
        seqs = [s for s, _ in rows]
        out = Emission()
        tokens, logprobs = self._sample(seqs, logits, out)
        now = time.monotonic()
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            if tok is None:  # failed in sampling
                continue
            seq.num_steps += 1
            self.step_tokens[1] += 1
            try:
                self._take(seq, tok, lp, now, out)
            except Exception as exc:  # a bug in one sequence's output: that request fails alone
                out.failed.append((seq, self._internal(seq, exc, "its output"), False))
        return out

    def emit_verified(self, rows: list[tuple[Sequence, torch.Tensor]]) -> Emission:
        """Verify rows (runner.verify): each sequence's drafts (``seq.drafts``) checked
        against its (1 + k, V) logits by engine/speculative.py's rule, the tokens taken one
        at a time as ``emit`` takes one (stop tokens and strings, max tokens, the context
        end: the first that ends the sequence drops the rest) and streamed as one delta.
        Row i's logits get the penalties plain decoding would apply after drafts[:i]
        (repetition, presence/frequency, min_new_tokens' held-back stop ids: those drafts
        are the tokens it would have had), so the tokens are plain greedy decoding's, and
        sampled tokens follow its distribution. A failure is the sequence's alone."""
        out = Emission()
        now = time.monotonic()
        for seq, logits in rows:
            drafts, seq.drafts = seq.drafts, []
            try:
                tokens, logprobs = self._verify(seq, drafts, logits)
            except Exception as exc:
                rejected = isinstance(exc, InvalidRequest)
                out.failed.append((seq, str(exc) if rejected else self._internal(seq, exc, "sampling"), rejected))
                out.verified.append((seq, 0))
                continue
            accepted = len(tokens) - 1  # the drafts taken; the last token is the target's own
            seq.drafter.record(len(drafts), accepted)
            seq.num_steps += 1
            before, first_event, ends = seq.num_output, len(out.events), len(out.finished) + len(out.failed)
            defer = seq.stream.can_defer  # the tokens' text decoded once, after them (they stream as one delta)
            try:
                for tok, lp in zip(tokens, logprobs):
                    self._take(seq, tok, lp, now, out, defer)
                    if len(out.finished) + len(out.failed) > ends:
                        break
                if defer and (text := seq.stream.release()) and len(out.events) > first_event:
                    out.events[-1][1].text += text
            except Exception as exc:
                out.failed.append((seq, self._internal(seq, exc, "its output"), False))
            _merge_deltas(out.events, first_event)
            taken = seq.num_output - before
            if taken:
                self.step_tokens[min(taken, len(self.step_tokens) - 1)] += 1
            out.verified.append((seq, min(accepted, taken)))
        return out

    def _verify(
        self, seq: Sequence, drafts: list[int], logits: torch.Tensor
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        p = seq.request.sampling
        penalties = needs_penalties(p)
        in_place = self.sampleable_vocab < logits.shape[-1] or penalties or seq.matcher is not None
        logits = logits.float().clone() if in_place else logits.float()  # (1 + k, V): processed in place, a copy
        if self.sampleable_vocab < logits.shape[-1]:
            logits[:, self.sampleable_vocab :] = float("-inf")
        rows = len(drafts) + 1
        if penalties:
            states = [
                RowState(seq.token_ids + drafts[:i], seq.num_prompt, self._stop_ids(seq, seq.num_output + i))
                for i in range(rows)
            ]
            apply_penalties(logits, [p] * rows, states)
        if seq.matcher is not None:  # row i: the grammar's mask after drafts[:i] (the scheduler checked them)
            apply_grammar_masks(logits, list(range(rows)), self.grammars.fill_draft_masks([(seq.matcher, drafts)]))
        tokens = accept(logits, drafts, p, seq.generator, seq.seed, seq.num_output)
        return tokens, token_logprobs(logits[: len(tokens)], tokens, [p.logprobs] * len(tokens))

    def _take(self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float, out: Emission,
              defer: bool = False) -> None:
        p = seq.request.sampling
        if seq.matcher is not None and (not seq.matcher.consume_token(tok) or seq.matcher.is_error()):
            # llguidance gave up (e.g. its lexer limits on a huge regex): the output can no
            # longer be guaranteed to match, so it is not ended as if the grammar had finished
            out.failed.append((seq, self._grammar_failure(seq), True))
            return
        seq.token_ids.append(tok)
        if not seq.t_first:
            seq.t_first = now
        seq.t_last = now
        is_stop_token = (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        grammar_end = False
        if seq.matcher is not None:
            grammar_end = seq.matcher.is_stopped()  # the grammar accepts nothing more
            is_stop_token = is_stop_token or (grammar_end and tok in self.eos_ids)
        if is_stop_token:
            text = ""
        elif defer:  # its text comes with the tokens after it (``TextStream.release``, or ``finish`` below)
            seq.stream.defer([tok])
            text = ""
        else:
            text = seq.stream.push([tok])
        reason = None
        if is_stop_token or seq.stream.stopped or grammar_end:
            reason = FinishReason.STOP
        elif seq.num_output >= p.max_new_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            text += seq.stream.finish()  # "" when a stop string ended it
        out.events.append(
            (seq.request_id, Delta(token_ids=[tok], text=text, logprobs=[lp] if lp else [], index=seq.index))
        )
        if reason is not None:
            out.finished.append((seq, reason))

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor, out: Emission
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """The batch at once; when that raises, row by row (see the class docstring).
        A failed row's token is None (and the row is in ``out.failed``)."""
        params = [s.request.sampling for s in seqs]
        gens = [s.generator for s in seqs]
        # what a retry row by row needs to give the batch's answer: the logits before the
        # in-place penalties (masks are idempotent) and the generators before their draws
        pristine = logits.clone() if any(map(needs_penalties, params)) else logits
        saved = [None if g is None else g.get_state() for g in gens]
        try:
            got = self._sample_rows(seqs, params, gens, logits)
            return got.tokens, got.logprobs
        except Exception:
            log.exception("sampling a batch of %d rows failed; sampling them one at a time", len(seqs))
        tokens: list[int | None] = []
        logprobs: list[TokenLogprob | None] = []
        for i, seq in enumerate(seqs):
            gen, state = gens[i], saved[i]
            if gen is not None and state is not None:
                gen.set_state(state)
            try:
                one = self._sample_rows([seq], [params[i]], [gen], pristine[i : i + 1])
            except Exception as exc:
                rejected = isinstance(exc, InvalidRequest)
                error = str(exc) if rejected else self._internal(seq, exc, "sampling")
                out.failed.append((seq, error, rejected))
                tokens.append(None)
                logprobs.append(None)
                continue
            tokens.append(one.tokens[0])
            logprobs.append(one.logprobs[0])
        return tokens, logprobs

    def _sample_rows(
        self,
        seqs: list[Sequence],
        params: list[SamplingParams],
        gens: list[torch.Generator | None],
        logits: torch.Tensor,  # (len(seqs), V) float32
    ) -> Sampled:
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        masks = None
        if constrained:
            masks = (constrained, self.grammars.fill_masks([seqs[i].matcher for i in constrained]))
        states = [RowState(s.token_ids, s.num_prompt, self._stop_ids(s), s.seed) for s in seqs]
        return self._sampler(logits, params, gens, states, masks)

    def _internal(self, seq: Sequence, exc: BaseException, where: str) -> str:
        log.error("request %s failed in %s after %d output tokens", seq.request_id, where, seq.num_output, exc_info=exc)
        return f"internal error in {where}: {type(exc).__name__}"

    def _grammar_failure(self, seq: Sequence) -> str:
        fmt = seq.request.sampling.response_format
        kind = fmt.kind if fmt is not None else "grammar"
        why = matcher_error(seq.matcher)
        log.warning("request %s: response_format %s failed after %d tokens: %s", seq.request_id, kind, seq.num_output, why)
        return (
            f"response_format {kind} could not be followed after {seq.num_output} output tokens: {why} "
            f"(the format is beyond llguidance's limits: simplify it)"
        )

    def _stop_ids(self, seq: Sequence, num_output: int | None = None) -> tuple[int, ...]:
        """The ids min_new_tokens holds back: eos (unless ignored) and stop_token_ids;
        empty once the sequence has its minimum (``num_output``: at that many outputs)."""
        p = seq.request.sampling
        if (seq.num_output if num_output is None else num_output) >= p.min_new_tokens:
            return ()
        eos = () if p.ignore_eos else tuple(self.eos_ids)
        return eos + tuple(p.stop_token_ids)

    # ---- events ----------------------------------------------------------------------

    def started(self, seq: Sequence) -> tuple[str, Event]:
        slowest = next((t for t in reversed(self.tiers) if seq.cached_by_tier.get(t)), None)
        return (
            seq.request_id,
            Started(
                request_id=seq.request_id,
                prompt_tokens=seq.num_prompt,
                cached_tokens=seq.cached_tokens,
                cached_tier=slowest,
                cached_by_tier=dict(seq.cached_by_tier),
                retain_tokens=seq.retention.tokens if seq.retention is not None else 0,
            ),
        )

    def finished(self, seq: Sequence, reason: FinishReason, error: str = "", rejected: bool = False) -> Emitted:
        """The sequence's Finished event (and, for an n > 1 request that ended before it
        forked, the other n - 1's, empty)."""
        now = time.monotonic()
        t_first = seq.t_first or now
        decode_s = (seq.t_last - seq.t_first) if seq.t_first else 0.0
        timings = Timings(
            queue_s=(seq.t_admit or now) - seq.arrival,
            restore_s=seq.restore_s,
            prefill_s=max(t_first - (seq.t_admit or t_first) - seq.restore_s, 0.0) if seq.t_first else 0.0,
            ttft_s=t_first - seq.arrival if seq.t_first else 0.0,
            decode_s=decode_s,
            decode_tokens_per_s=(seq.num_output - 1) / decode_s if decode_s > 0 else 0.0,
            draft_tokens=seq.drafter.drafted if seq.drafter is not None else 0,
            accepted_draft_tokens=seq.drafter.accepted if seq.drafter is not None else 0,
            tokens_per_step=seq.num_output / seq.num_steps if seq.num_steps else 0.0,
        )

        def event(index: int, tokens: list[int], text: str) -> tuple[str, Event]:
            return (
                seq.request_id,
                Finished(
                    finish_reason=reason,
                    prompt_tokens=seq.num_prompt,
                    completion_tokens=len(tokens),
                    cached_tokens=seq.cached_tokens,
                    output_token_ids=tokens,
                    text=text,
                    timings=timings,
                    error=error,
                    rejected=rejected,
                    index=index,
                ),
            )

        out = [event(seq.index, seq.output_ids, seq.stream.text)]
        if seq.fork_pending:  # n > 1 ended before forking: the other n - 1 end with it, empty
            out.extend(event(i, [], "") for i in range(1, seq.request.sampling.n))
        return out
