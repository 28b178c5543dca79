"""Plain domain types shared by the engine, the servicer and the metrics. Importing this
module imports no torch and no gRPC (tests/unit/test_imports.py keeps it so)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

from kvserve.common.tiers import Tier  # the tier names (device, host, disk, redis); no torch

if TYPE_CHECKING:
    from kvserve.cachestore.tiered import TieredStats


class EngineError(Exception):
    """Base of errors the engine reports for one request; the servicer maps them."""


class InvalidRequest(EngineError):
    """The request cannot be served as given (maps to INVALID_ARGUMENT)."""


class ContextOverflow(InvalidRequest):
    """The prompt (and the tokens asked for) do not fit the context or the prompt limit
    (INVALID_ARGUMENT; OpenAI's ``context_length_exceeded`` on the HTTP front)."""


class QueueFull(EngineError):
    """Admission refused: the waiting queue is at its limit (RESOURCE_EXHAUSTED)."""


class EngineStopped(EngineError):
    """The engine is draining or stopped (UNAVAILABLE)."""


class RetentionRefused(InvalidRequest):
    """A ``retain`` this server will not keep: past the tenant's bound of retained KV
    (``--retention-tenant-memory``), or with no cache tier to keep it in. Nothing of the
    request ran. RESOURCE_EXHAUSTED (HTTP 429) in the status table, ahead of its base
    InvalidRequest."""


# Bounds of the sampling controls (OpenAI's ranges for the penalties and biases).
MAX_PRESENCE_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2]
MAX_LOGIT_BIAS = 300  # entries in one request's logit_bias
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| <= 100
MAX_TOP_LOGPROBS = 20  # alternatives per token
MAX_N = 16  # sequences one request may ask for (SamplingParams.n)
MAX_SPEC_DRAFT = 32  # SamplingParams.spec_max_draft at most (drafts of one sequence in one step)
MAX_RESPONSE_FORMAT_CHARS = 32768  # a response_format's JSON schema, regex, choices or grammar
# choice: one of a list of strings exactly (spec: their JSON list), as vLLM's structured_outputs.choice;
# grammar: a client's context-free grammar, llguidance's lark or llama.cpp's GBNF (vLLM's EBNF)
RESPONSE_FORMAT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# "lark": a full llguidance lark grammar, built by the server itself (service/tools/grammar.py:
# tool_choice required or a named function); no front accepts it from a client
INTERNAL_FORMAT_KINDS = ("lark",)
MAX_TOOL_GRAMMAR_CHARS = 1 << 20  # a tool-call grammar (every tool's schema in it)
MAX_TOOLS = 128  # tool definitions in one request
MAX_TOOL_CALLS = 64  # tool calls in one assistant message
MAX_RETAIN = 4  # retention breakpoints in one request (Anthropic's cache_control limit)

# Sampling values beyond these overflow float32 logits (x / 1e-45 = inf -> NaN probabilities).
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_new_tokens or the context limit
    CANCELLED = "cancelled"  # client cancelled, disconnected or its deadline passed
    TOOL_CALLS = "tool_calls"  # the output called tools (service/tools: set on the way out, after the commit)
    ERROR = "error"  # internal error; the message is in Finished.error


class TurnMode(str, enum.Enum):
    """What a session turn does to the transcript."""

    APPEND = "append"  # a new turn: input and output appended
    REGENERATE = "regenerate"  # the last turn's output generated again from its input, replacing it
    EDIT = "edit"  # the new input replaces the last turn's input; the output is generated anew


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A constraint on the generated text (service/engine/grammar.py compiles it):
    ``json_schema`` (``spec``: the schema as JSON text), ``json_object`` (any JSON
    object; ``spec`` empty), ``regex`` (``spec``: the pattern the whole output matches),
    ``choice`` (``spec``: a JSON list of strings, the output one of them exactly) or
    ``grammar`` (``spec``: a lark or GBNF grammar, the output a sentence of it)."""

    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in RESPONSE_FORMAT_KINDS + INTERNAL_FORMAT_KINDS:
            raise InvalidRequest(
                f"response_format kind {self.kind!r} is unknown; use one of {', '.join(RESPONSE_FORMAT_KINDS)}"
            )
        limit = MAX_TOOL_GRAMMAR_CHARS if self.kind in INTERNAL_FORMAT_KINDS else MAX_RESPONSE_FORMAT_CHARS
        if len(self.spec) > limit:
            raise InvalidRequest(
                f"response_format {self.kind} has {len(self.spec)} characters; the limit is {limit}"
            )
        if self.kind == "json_object" and self.spec:
            raise InvalidRequest("response_format json_object takes no schema (use json_schema)")
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequest(f"response_format {self.kind} is empty")
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequest("response_format choice must be a non-empty list of non-empty strings")


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
    min_p: float = 0.0  # 0 = off; drop tokens under min_p x the top token's probability
    presence_penalty: float = 0.0  # 0 = off; subtracted once from every generated id's logit
    frequency_penalty: float = 0.0  # 0 = off; subtracted per occurrence in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_new_tokens: int = 0  # no eos / stop token id before this many outputs
    logprobs: int | None = None  # None = off; k = the sampled token's logprob + top-k
    n: int = 1  # sequences sampled from the one prompt (sharing its KV blocks)
    response_format: ResponseFormat | None = None  # None = unconstrained text
    # speculative decoding for this request (engine/speculative.py): None = the server's
    # --speculative; spec_max_draft: its drafts per step at most (None = --spec-max-draft)
    speculative: bool | None = None
    spec_max_draft: int | None = None

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
        # Extreme values overflow float32 logits (x / 1e-45 = inf -> NaN probabilities).
        if self.temperature and not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(
                f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}], got {self.temperature}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequest(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}"
            )
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidRequest(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must not be empty")
        self._validate_controls()

    def _validate_controls(self) -> None:
        """min_p, presence/frequency penalties, logit_bias, min_new_tokens, logprobs."""
        if not 0.0 <= self.min_p <= 1.0:  # also rejects NaN
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -MAX_PRESENCE_PENALTY <= v <= MAX_PRESENCE_PENALTY:
                raise InvalidRequest(
                    f"{name} must be in [-{MAX_PRESENCE_PENALTY:g}, {MAX_PRESENCE_PENALTY:g}], got {v}"
                )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                f"logit_bias has {len(self.logit_bias)} entries; the limit is {MAX_LOGIT_BIAS}"
            )
        for tok, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE:
                raise InvalidRequest(
                    f"logit_bias[{tok}] must be in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], got {bias}"
                )
        if len({tok for tok, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequest("logit_bias names a token id twice")
        if self.min_new_tokens < 0:
            raise InvalidRequest(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                f"min_new_tokens {self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"
            )
        self._validate_outputs()

    def _validate_outputs(self) -> None:
        """n and response_format (its grammar is compiled, and checked, by the engine)."""
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}], got {self.n}")
        if self.spec_max_draft is not None and not 1 <= self.spec_max_draft <= MAX_SPEC_DRAFT:
            raise InvalidRequest(f"speculative_max_draft must be in [1, {MAX_SPEC_DRAFT}], got {self.spec_max_draft}")
        fmt = self.response_format
        if fmt is None:
            return
        fmt.validate()
        # the grammar decides where the output ends: nothing else may end it early or hold it back
        if self.stop:
            raise InvalidRequest("stop strings cannot be combined with response_format (the grammar ends the output)")
        if self.stop_token_ids:
            raise InvalidRequest("stop_token_ids cannot be combined with response_format (the grammar ends the output)")
        if self.min_new_tokens:
            raise InvalidRequest("min_new_tokens cannot be combined with response_format (the grammar ends the output)")


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

    @classmethod
    def of(cls, owner: str, salt: str, shared_salts: frozenset[str]) -> CacheScope:
        """A request's namespace: ``owner``'s own with its ``salt``, or every tenant's for a
        salt the operator listed in ``shared_salts`` (``--shared-cache-salts``)."""
        return cls.shared(salt) if salt and salt in shared_salts else cls(owner, salt)


@dataclass(frozen=True, slots=True)
class Retain:
    """A retention the request asks for (docs/api.md, Retention): keep the KV of the
    prompt's first ``prefix_tokens`` tokens (the session's transcript included; None:
    the whole prompt) restorable for at least ``ttl_s`` seconds from the turn's first
    token (its prompt computed), in the cache tiers of ``--retain-to``. Whole blocks only: the tokens of a
    partial last block are not kept. Asking again for a prefix that is retained extends
    its time (a refresh).

    ``hint``: a protocol's cache hint (Anthropic's ``cache_control``, OpenAI's
    ``prompt_cache_retention``), which those APIs never refuse a request for: where this
    server cannot keep it (no tier, retentions off, past the tenant's bound) the turn runs
    without it and reports nothing retained. A retention asked for outright (gRPC
    ``retain``) is refused instead (``RetentionRefused``)."""

    ttl_s: float
    prefix_tokens: int | None = None
    hint: bool = False


@dataclass(frozen=True, slots=True)
class RetainedPrefix:
    """What a turn's retention kept (``Finished.retained``, one per ``Retain`` asked,
    shortest prefix first): of the ``prefix_tokens`` asked for, the leading
    ``retained_tokens`` (whole blocks) are pinned in ``tiers`` until ``expires_at`` (unix
    seconds; 0 when nothing was kept); ``created_tokens`` of them are this prefix's own
    share (past the shorter prefixes before it) that the turn computed rather than read
    from a cache: written to the cache by this turn (Anthropic's cache creation, per
    ``ttl_s``)."""

    prefix_tokens: int
    retained_tokens: int
    created_tokens: int
    ttl_s: float
    expires_at: float
    tiers: tuple[Tier, ...] = ()


@dataclass(slots=True)
class GenerationRequest:
    """One generation: a full prompt (the session transcript plus the new turn)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    scope: CacheScope = CacheScope()  # tenant + request salt: the block-hash namespace
    session_id: str | None = None
    retain: tuple[Retain, ...] = ()  # retentions of prefixes of the prompt (``Retain``)
    # who asked: with scope.salt, the draft pool's key (engine/draft_pool.py; a shared
    # salt's scope names no tenant, its drafts still stay the tenant's own)
    tenant: str = ""
    # earlier answers of the request's session it may draft from (each after the last
    # tokens of its prompt): the ones a regenerate, edit or rewind dropped (SessionRecord.recall)
    recall: tuple[tuple[int, ...], ...] = ()


@dataclass(slots=True)
class Timings:
    queue_s: float = 0.0  # arrival -> admitted (blocks allocated)
    restore_s: float = 0.0  # host/Redis blocks copied into the device pool
    prefill_s: float = 0.0  # admitted -> first token sampled, minus restore
    ttft_s: float = 0.0  # arrival -> first token sampled
    decode_s: float = 0.0  # first token -> last token
    decode_tokens_per_s: float = 0.0
    # speculative decoding (engine/speculative.py): tokens drafted for this sequence, how
    # many of them became its tokens, and its output tokens per forward that made them
    # (1.0 without speculation); on the wire in FinalEvent.timings and HTTP's ``timings``
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    tokens_per_step: float = 0.0


@dataclass(slots=True)
class Started:
    """First event of a stream: the prompt has been admitted and its cache looked up."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was not recomputed
    cached_tier: Tier | None  # slowest tier that contributed (None when cached_tokens == 0)
    cached_by_tier: dict[Tier, int] = field(default_factory=dict)
    session_created: bool = False  # set by the conversation: this turn created its session (or started it over)
    # set by the conversation for a resent history (Conversations.prepare(resent_history=True)):
    history_diverged_at: int | None = None  # the first message the session's transcript did not match
    history_rewound_turns: int | None = None  # the completed turns the divergence dropped
    # with ``retain``: the prompt's tokens the turn will retain (whole blocks of its longest
    # prefix); what was kept and written is in ``Finished.retained``
    retain_tokens: int = 0


@dataclass(slots=True)
class Delta:
    """New tokens and the text they complete (text may be empty mid-character)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked
    index: int = 0  # which of the request's n sequences


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's log-probability and the most likely alternatives, from the
    processed logits (after penalties and logit_bias, before temperature and filters)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


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
    rejected: bool = False  # with ERROR: the request's own fault (INVALID_ARGUMENT with ``error``), not the server's
    index: int = 0  # which of the request's n sequences (a request ends after n of these)
    tool_calls: tuple[ToolCall, ...] = ()  # with tools: the calls parsed from the output (text: the rest)
    # with ``retain``: per prefix asked for, what was kept (empty when the turn did not
    # complete: nothing is retained then)
    retained: tuple[RetainedPrefix, ...] = ()

    @property
    def cache_read_tokens(self) -> int:
        """Prompt tokens read from a cache tier instead of computed (OpenAI's
        ``cached_tokens``, Anthropic's ``cache_read_input_tokens``)."""
        return self.cached_tokens

    @property
    def cache_creation_tokens(self) -> int:
        """Prompt tokens this turn computed and retained (Anthropic's
        ``cache_creation_input_tokens``; per ``ttl_s`` in ``retained``)."""
        return sum(r.created_tokens for r in self.retained)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call of an assistant message: ``arguments`` is JSON text (OpenAI's
    ``function.arguments``), as the model wrote it or the client sent it."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of a tool call while it streams (service/tools/stream.py): the first one
    of call ``call_index`` carries its ``id`` and ``name`` (``arguments`` may be empty),
    the next ones only argument text; joined they are the call's ``arguments``."""

    call_index: int
    id: str = ""
    name: str = ""
    arguments: str = ""
    index: int = 0  # which of the request's n sequences


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call: ``parameters`` is its JSON schema as JSON text
    (``{}`` when the client gave none); ``strict`` is the client's flag (arguments of
    required and named calls are constrained by the schema either way)."""

    name: str
    description: str = ""
    parameters: str = "{}"
    strict: bool = False


TOOL_CHOICE_KINDS = ("none", "auto", "required", "function")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """OpenAI's tool_choice: none (no call is parsed), auto (the model decides),
    required (at least one call, by grammar) or function (a call of ``name``, by grammar)."""

    kind: str = "auto"
    name: str = ""


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message. ``tool_calls``: an assistant message's calls; ``tool_call_id``
    (and the function's ``name``): a ``tool`` message's result of one call."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def text_bytes(self) -> int:
        """UTF-8 bytes of the text it carries (content and call arguments)."""
        n = len(self.content.encode("utf-8", "surrogatepass"))
        for c in self.tool_calls:
            n += len(c.name.encode("utf-8", "surrogatepass")) + len(c.arguments.encode("utf-8", "surrogatepass"))
        return n


Event = Started | Delta | ToolCallDelta | Finished


@dataclass(frozen=True, slots=True)
class TurnInput:
    """One Generate call in domain terms (``service.wire.turn_input`` builds it).

    At most one of ``text``, ``messages`` and ``token_ids`` is set (none: the input is
    empty). ``max_new_tokens`` None: the conversation fits the server's default to the
    context left; ``sampling.max_new_tokens`` is then a placeholder."""

    text: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int | None = None
    session_id: str = ""
    require_existing_session: bool = False
    cache_salt: str = ""
    mode: TurnMode = TurnMode.APPEND  # with session_id
    expected_turns: int | None = None  # with session_id: the turn runs only if the session has this many
    tools: tuple[ToolSpec, ...] = ()  # chat: functions the model may call (service/tools)
    tool_choice: ToolChoice | None = None  # None: auto with tools, none without
    parallel_tool_calls: bool = True  # False: at most one call per reply
    retain: tuple[Retain, ...] = ()  # retentions of prefixes of the prompt (``Retain``; docs/api.md)

    @property
    def kind(self) -> str | None:
        """"text", "chat", "tokens" or None (empty)."""
        if self.text is not None:
            return "text"
        if self.messages is not None:
            return "chat"
        if self.token_ids is not None:
            return "tokens"
        return None


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_free: int  # allocatable now (free + evictable cached)
    blocks_cached: int  # hold a hash, refcount 0 (evictable)
    prefill_tokens: int  # tokens run through the model as prompt (cumulative)
    decode_tokens: int  # tokens run through the model as decode steps (cumulative; drafts verified included)
    # speculative decoding (cumulative): verify forwards per sequence, drafts checked, drafts accepted
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # the draft pool (engine/draft_pool.py; zeros without one): bytes charged and tokens
    # held now, entries evicted and lookups that gave a candidate (cumulative)
    spec_pool_bytes: int = 0
    spec_pool_tokens: int = 0
    spec_pool_evictions: int = 0
    spec_pool_hits: int = 0
    # output tokens per sequence-step: entry n counts the steps (a decode row, a prompt's
    # last chunk, a verification) that gave one sequence n tokens (entry 0 unused; the
    # last entry counts that many or more): the kvserve_spec_tokens_per_step histogram
    step_tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class CacheStats:
    """What the KV cache holds and has done, read at once (``AsyncEngine.cache_stats``):
    the device pool and, with a store, every tier, its restore rates and its writer.
    The metrics read this snapshot, never the engine or the store."""

    device_blocks_held: int  # blocks holding KV: in use by sequences or cached
    device_bytes_held: int
    device_evictions: int  # cached blocks evicted to make room (cumulative)
    restores_skipped: int  # restores cut because recomputing was estimated faster (cumulative)
    sync_demotions: int  # device demotions copied synchronously, no staging buffer free (CUDA; cumulative)
    store: TieredStats | None = None  # per tier (TierStats), restore rates, writer; None: no store
    warm: WarmStats | None = None  # session warm-ups (service/engine/warm.py)
    retention: RetentionCounts | None = None  # retentions asked of the engine (service/engine/retention.py)


@dataclass(frozen=True, slots=True)
class RetentionCounts:
    """Retentions so far (cumulative): refused by reason (``tenant_bound``: past the
    tenant's bound; ``unavailable``: no tier to keep them), and of those run, the
    prompt tokens kept (``retained_tokens``, refreshes included), the tokens written by
    the turns that kept them (``created_tokens``), and the blocks asked for that no
    tier could pin (``failed_blocks``)."""

    requests: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    retained_tokens: int = 0
    created_tokens: int = 0
    failed_blocks: int = 0


@dataclass(frozen=True, slots=True)
class WarmResult:
    """What one warm-up of a session did (``AsyncEngine.warm``, WarmSession): of the
    transcript's full ``blocks``, how many were on the device already (``on_device``),
    were restored into it from a store tier (``restored``, per tier in
    ``restored_by_tier``), are in no tier or failed to load (``missing``: the next turn
    computes them), or were left where they are by the warm-up caps (``over_cap``: no
    free device block, or the tenant's or the server's warm-up share is taken). The
    blocks on the device are held for ``ttl_s`` seconds unless a turn uses them first."""

    blocks: int
    on_device: int
    restored: int
    missing: int
    over_cap: int
    restored_by_tier: dict[Tier, int] = field(default_factory=dict)
    ttl_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WarmStats:
    """Session warm-ups so far (cumulative but ``pinned_blocks``)."""

    requests: int = 0  # warm-ups asked for
    blocks_restored: dict[Tier, int] = field(default_factory=dict)  # loaded into the device pool, per tier
    pinned_blocks: int = 0  # device blocks held for a coming turn now
    hits: int = 0  # turns whose device hits included warmed blocks
    claimed_blocks: int = 0  # warmed blocks a turn used
    wasted_blocks: dict[str, int] = field(default_factory=dict)  # let go unused: expired, reclaimed, forgotten


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
    shared_tier: Tier | None = None  # the one every replica reads (REDIS), where the drain writes


class SessionTurnView(Protocol):
    """What the fronts read of one completed turn of a session (``sessions.TurnInfo``)."""

    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def ended_at(self) -> float: ...
    @property
    def tokens(self) -> int: ...


class SessionView(Protocol):
    """What the fronts read of a session's record (``sessions.SessionRecord`` is one), so
    they name it without importing the session table."""

    @property
    def session_id(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def created_at(self) -> float: ...
    @property
    def last_used_at(self) -> float: ...
    @property
    def turns(self) -> int: ...
    @property
    def forked_from(self) -> str: ...
    @property
    def turn_log(self) -> Sequence[SessionTurnView]: ...
    @property
    def untracked_turns(self) -> int: ...
    @property
    def untracked_tokens(self) -> int: ...
