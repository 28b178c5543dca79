"""One sequence's state, shared by the engine's rooms (scheduler, restore, runner, output),
and its text stream (``TextStream``).

A ``Sequence`` is plain data: each room reads and writes the fields of its own concern
(the scheduler its status, blocks and queue place; the runner ``num_computed`` and the
registered/released counts; the output room its tokens, stream, generator and matcher)
and none imports another room to do it.
"""

from __future__ import annotations

import array
import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from kvserve.cachestore.keys import BlockHash
from ..kv.block_manager import Block
from ..types import Event, GenerationRequest, Tier


class TextStream:
    """Incremental detokenization plus stop strings (a sequence's ``stream``): text that
    could still turn out to be the start of a stop string is held back until it can be
    decided, so a client never receives text that is later retracted."""

    def __init__(self, detokenizer, stop: Iterable[str] = ()) -> None:
        self._detok = detokenizer
        self._stop = tuple(stop)
        self._max_hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""  # decoded, not yet emitted
        self._held: list[int] = []  # tokens taken by ``defer``, not yet decoded
        self.text = ""  # emitted so far (the final text once finished)
        self.stopped = False

    @property
    def can_defer(self) -> bool:
        """Whether ``defer`` may be used: no stop strings (their check needs each token's text)."""
        return not self._stop

    def defer(self, token_ids: list[int]) -> None:
        """Take tokens whose text the next ``release``, ``push`` or ``finish`` returns:
        a verification's several tokens decoded once, not once each. The same text in the
        end however the tokens are grouped (a group that ends mid-character holds its
        text, as one token that does, until the character is whole)."""
        if self._stop:
            raise ValueError("a stream with stop strings checks each token's text: push, not defer")
        self._held.extend(token_ids)

    def release(self) -> str:
        """The text the deferred tokens completed ("" when none are held)."""
        return self.push([]) if self._held else ""

    def push(self, token_ids: list[int]) -> str:
        """Feed new tokens; return the text that became final. Sets ``stopped`` when a
        stop string appears (the stop string and everything after it are dropped)."""
        if self._held:
            token_ids, self._held = self._held + token_ids, []
        if self.stopped:
            return ""
        return self._emit(self._pending + self._detok.push(token_ids), final=False)

    def finish(self) -> str:
        """End of generation: emit whatever is left (deferred tokens included)."""
        text = self.release()
        if self.stopped:
            return text
        return text + self._emit(self._pending + self._detok.flush(), final=True)

    def _emit(self, candidate: str, final: bool) -> str:
        if self._stop:
            # search from where a stop string could start (it may straddle the boundary)
            start = max(0, len(self.text) - self._max_hold)
            window = self.text[start:] + candidate
            cut = min(
                (i for i in (window.find(s) for s in self._stop) if i >= 0), default=-1
            )
            if cut >= 0:
                keep = start + cut - len(self.text)  # chars of candidate before the stop
                out = candidate[: max(keep, 0)]
                self.text += out
                self._pending = ""
                self.stopped = True
                return out
            if not final:
                hold = self._held_suffix(candidate)
                self._pending = candidate[len(candidate) - hold :] if hold else ""
                candidate = candidate[: len(candidate) - hold]
        else:
            self._pending = ""
        self.text += candidate
        return candidate

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


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
    seed: int | None = None  # a seeded sampled sequence's own seed (seed + index for n > 1): per-position draws
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
    drafter: Any = None  # speculative.NgramDrafter over token_ids, made at the first decode step that drafts
    drafts: list[int] = field(default_factory=list)  # this step's drafted tokens (scheduler -> runner -> output)
    num_steps: int = 0  # forwards whose logits gave output tokens (a verification's several count once)
    started_step: int = 0  # the scheduler's step count when it began running
    prefill_waits: int = 0  # steps its pending prompt was passed over by later ones (scheduler.PREFILL_MAX_WAITS)
    restore: Future | None = None
    retention: Any = None  # retention.RetentionPlan of a request with ``retain`` (engine)
    landing: Any = None  # restore.Landing of an overlapped restore (restore room -> engine)
    table: tuple[list[Block], int, array.array] | None = None  # (blocks, num_released, block table): Runner
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


Emitted = list[tuple[str, Event]]  # (request id, event), in order


@dataclass
class StepPlan:
    """One step's forward work: decode rows (one pending token each, one batched forward),
    prefill chunks (sequence, tokens) and verify rows (a decode row with drafts in its
    ``drafts``: its pending token plus the drafts, logits at every position, one batched
    forward), within the token budget."""

    decode: list[Sequence]
    prefill: list[tuple[Sequence, int]]
    verify: list[Sequence] = field(default_factory=list)
