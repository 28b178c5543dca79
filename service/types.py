"""Plain domain types shared by the engine, the servicer and the metrics. Importing this
module imports no torch and no gRPC (tests/test_imports.py keeps it so)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cachestore.base import Tier  # the tier names (device, host, redis); no torch


class EngineError(Exception):
    """Base of errors the engine reports for one request; the servicer maps them."""


class InvalidRequest(EngineError):
    """The request cannot be served as given (maps to INVALID_ARGUMENT)."""


class QueueFull(EngineError):
    """Admission refused: the waiting queue is at its limit (RESOURCE_EXHAUSTED)."""


class EngineStopped(EngineError):
    """The engine is draining or stopped (UNAVAILABLE)."""


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    CANCELLED = "cancelled"  # client cancelled, disconnected or its deadline passed
    ERROR = "error"  # internal error; the message is in Finished.error


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # same seed, same prompt -> same output
    stop: tuple[str, ...] = ()  # stop strings (not included in the text)
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's eos ids
    ignore_eos: bool = False

    def validate(self, max_new_tokens_limit: int) -> None:
        """Raise InvalidRequest with a precise message on any bad field."""
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequest(
                f"max_new_tokens {self.max_new_tokens} exceeds the limit {max_new_tokens_limit}"
            )
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequest(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Whose KV namespace a request's blocks are keyed in: a tenant's own (with the
    request's ``cache_salt``), or, for a salt the operator shares, every tenant's
    (``tenant`` None). The two go into the namespace as separate fields."""

    tenant: str | None = ""
    salt: str = ""

    @classmethod
    def shared(cls, salt: str) -> CacheScope:
        return cls(None, salt)

    @property
    def is_shared(self) -> bool:
        return self.tenant is None


@dataclass(slots=True)
class GenerationRequest:
    """One generation: a full prompt (the session transcript plus the new turn)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    scope: CacheScope = CacheScope()  # tenant + request salt: the block-hash namespace
    session_id: str | None = None


@dataclass(slots=True)
class Timings:
    queue_s: float = 0.0  # arrival -> admitted (blocks allocated)
    restore_s: float = 0.0  # host/Redis blocks copied into the device pool
    prefill_s: float = 0.0  # admitted -> first token sampled, minus restore
    ttft_s: float = 0.0  # arrival -> first token sampled
    decode_s: float = 0.0  # first token -> last token
    decode_tokens_per_s: float = 0.0


@dataclass(slots=True)
class Started:
    """First event of a stream: the prompt has been admitted and its cache looked up."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was not recomputed
    cached_tier: Tier | None  # slowest tier that contributed (None when cached_tokens == 0)
    cached_by_tier: dict[Tier, int] = field(default_factory=dict)


@dataclass(slots=True)
class Delta:
    """New tokens and the text they complete (text may be empty mid-character)."""

    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Finished:
    """Last event of a stream."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_ids: list[int]  # every generated token (the transcript gets these)
    text: str  # the full generated text, stop string removed
    timings: Timings = field(default_factory=Timings)
    error: str = ""


Event = Started | Delta | Finished


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_free: int  # allocatable now (free + evictable cached)
    blocks_cached: int  # hold a hash, refcount 0 (evictable)
    prefill_tokens: int  # tokens run through the model as prompt (cumulative)
    decode_tokens: int  # tokens run through the model as decode steps (cumulative)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    architecture: str
    model_type: str
    model_fingerprint: str
    context_length: int
    vocab_size: int
    block_size: int
    dtype: str
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_token: int
    eos_token_ids: tuple[int, ...]
    tiers: tuple[Tier, ...]  # configured cache tiers, fastest first, e.g. (DEVICE, HOST, REDIS)
