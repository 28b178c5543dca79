"""Builds the host/Redis cache store for a loaded model from the engine settings."""

from __future__ import annotations

from typing import Any

from cachestore.codec import STORAGE_FORMATS
from cachestore.host import HostTier
from cachestore.redis import RedisTier
from cachestore.tiered import TieredStore
from service.engine.config import EngineConfig


def build_store(cfg: EngineConfig, loaded: Any) -> TieredStore | None:
    """None when neither a host budget nor a Redis URL is configured."""
    if not cfg.host_cache_memory and not cfg.redis_url:
        return None
    block_shape = loaded.kv_spec(cfg.block_size).block_shape  # the pool's geometry, from one place
    on_cuda = loaded.device.type == "cuda"
    host = (
        HostTier(cfg.host_cache_memory, block_shape, loaded.dtype, pin_memory=on_cuda)
        if cfg.host_cache_memory
        else None
    )
    redis = (
        RedisTier(
            cfg.redis_url,
            block_shape=block_shape,
            dtype=loaded.dtype,
            cluster=cfg.redis_cluster,
            ttl_s=cfg.redis_ttl_s or None,
            key_prefix=cfg.redis_key_prefix,
            storage_dtype=STORAGE_FORMATS[cfg.redis_kv_format],
            compression=None if cfg.redis_compression == "none" else cfg.redis_compression,
        )
        if cfg.redis_url
        else None
    )
    return TieredStore(block_shape, loaded.dtype, host=host, redis=redis, device=loaded.device.type)
