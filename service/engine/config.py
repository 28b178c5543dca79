"""Engine settings (the server's ServerConfig derives one of these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvserve.common.tiers import Tier

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None = the packaged default model
    device: str = "auto"  # cpu | cuda | auto
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (float32 on CPU, bfloat16 on CUDA)
    weight_format: str = "exact"  # exact | bf16 | int8 | w8a8 (service/models/quant.py)
    pack_weights: bool = True  # oneDNN-packed float32 copies for batched decode on CPU (models/layers.py)
    native_kernels: str = "auto"  # auto | on | off: native CPU decode kernels (service/kernels/)
    # the CUDA decode step's graphs (models/cuda_step.py): captured at start for row counts
    # up to cuda_graph_max_rows, within cuda_graph_memory bytes of device memory
    cuda_graphs: bool = True
    cuda_graph_max_rows: int = 64
    cuda_graph_memory: int = 512 << 20
    kv_cache_memory: int = 1 << 30  # bytes for the device block pool
    kv_cache_format: str = "exact"  # kv.cache.KV_CACHE_FORMATS: exact | bf16 | fp16 | int8 | fp8 (the pool and every tier)
    block_size: int = 16
    max_num_seqs: int = 32  # running sequences per step
    max_num_batched_tokens: int = 512  # tokens per step (decode rows + prefill chunks)
    max_model_len: int | None = None  # default: the model's context length
    max_new_tokens_limit: int = 4096
    max_queue: int = 256  # waiting requests before QueueFull
    # --- cache store (issue 4) ---
    host_cache_memory: int = 0  # bytes of host-memory tier; 0 = off
    disk_cache_dir: str | None = None  # directory of the disk tier (cachestore/disk.py); None = off
    disk_cache_size: int = 10 << 30
    disk_cache_fsync: bool = False
    redis_url: str | None = None
    redis_cluster: bool = False
    redis_ttl_s: float = 24 * 3600.0
    redis_key_prefix: str = "kvserve:"
    redis_kv_format: str = "exact"  # codec.STORAGE_FORMATS: exact | bf16 | fp16 | int8 | fp8
    redis_compression: str = "none"  # none | zstd | lz4
    redis_read_connections: int = 4  # connections one Redis restore reads on at once (cachestore/redis.py)
    spill_after_s: float = 30.0  # idle seconds before a session's blocks are written out
    stream_interval_s: float = 0.02  # least time between two deltas of one stream (AsyncEngine.generate)
    spill_to: tuple[Tier, ...] = (Tier.HOST, Tier.DISK, Tier.REDIS)
    # "auto": restore a tier's blocks only when the measured rates say it beats
    # recomputing them (by restore_min_speedup); "always": restore every hit.
    restore_policy: str = "auto"
    restore_min_speedup: float = 1.0
    # an overlapped restore's layer groups: a returning turn's prefill starts while its
    # restore lands, each layer waiting for its group (service/engine/restore.py); 0 = off
    # (the default: slower on the 2-core host it was measured on, docs/benchmarks.md)
    restore_stages: int = 0
    # pinned host buffers (CUDA) that restores land in and demotions leave through, half
    # each, and device staging of a quarter of it, allocated once (service/kv/transfer.py);
    # unused on the CPU
    staging_memory: int = 256 << 20
    # speculative decoding drafted from the sequence's own history (engine/speculative.py):
    # "ngram" or "off"; drafts per step at most
    speculative: str = "ngram"
    spec_max_draft: int = 16
    # drafts that remember (engine/draft_pool.py): bytes of recent outputs, per tenant and
    # cache salt, drafted from across requests; 0: none
    draft_pool_memory: int = 64 << 20
    # session warm-ups (engine/warm.py): shares of the device pool's blocks they may hold
    # at once, in all and per tenant, and how long a warmed block waits for its turn
    warm_pool_fraction: float = 0.25
    warm_tenant_fraction: float = 0.125
    warm_ttl_s: float = 30.0
    # retentions (engine/retention.py, docs/api.md): the tiers they pin in, each tenant's
    # bound of retained KV (bytes of device blocks; 0: retentions refused), the longest ttl
    retain_to: tuple[Tier, ...] = (Tier.HOST, Tier.DISK, Tier.REDIS)
    retention_tenant_memory: int = 1 << 30
    retention_max_ttl_s: float = 24 * 3600.0

    def resolved_model_path(self) -> Path:
        return Path(self.model_path) if self.model_path else DEFAULT_MODEL_DIR

