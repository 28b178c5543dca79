"""Builds the cache store (the tiers below the device) for a loaded model from the engine settings."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.cachestore.base import BlockTier
from kvserve.cachestore.codec import STORAGE_FORMATS
from kvserve.cachestore.disk import DiskTier
from kvserve.cachestore.host import HostTier, PinError
from kvserve.cachestore.tiered import TieredStore
from .config import EngineConfig

if TYPE_CHECKING:
    from ..models.loading import LoadedModel


class HostMemoryError(RuntimeError):
    """The host tier's memory could not be pinned for the device (a startup error)."""


def build_store(cfg: EngineConfig, loaded: LoadedModel) -> TieredStore | None:
    """The tiers below the device, fastest first: host memory (``--host-cache-memory``),
    files (``--disk-cache-dir``), then Redis (``--redis-url``), each holding blocks of the model's KV cache
    spec (the pool's geometry and KV format, from one place: every tier moves the pool's bytes as
    they are); retentions pin in those of ``--retain-to``, ``--retention-tenant-memory`` of
    device blocks per tenant at most. None when neither is configured. A narrower pool (``--kv-cache-format``)
    keeps Redis in that format: ``--redis-kv-format`` exact or the same format (the
    settings refuse any other), never re-encoded between tiers."""
    spec = loaded.kv_spec(cfg.block_size, cfg.kv_cache_format)
    if spec.format != "exact" and cfg.redis_kv_format not in ("exact", spec.format):
        raise ValueError(f"--redis-kv-format {cfg.redis_kv_format} would re-encode the {spec.format} KV cache; "
                         f"use exact (the pool's {spec.format} bytes as they are)")
    tiers: list[BlockTier] = []
    if cfg.host_cache_memory:
        try:  # pinned on CUDA: page-locked in chunks, with progress (cachestore/host.py)
            tiers.append(HostTier(cfg.host_cache_memory, spec.block_shape, spec.dtype, pin_memory=loaded.device.type == "cuda"))
        except PinError as e:
            raise HostMemoryError(str(e)) from None
    if cfg.disk_cache_dir:  # DiskCacheLocked when another server holds the directory
        tiers.append(DiskTier(cfg.disk_cache_dir, cfg.disk_cache_size, spec.block_shape, spec.dtype, fsync=cfg.disk_cache_fsync))
    if cfg.redis_url:
        from kvserve.cachestore.redis import RedisTier  # here: no Redis configured, redis-py never loads

        tiers.append(
            RedisTier(
                cfg.redis_url,
                block_shape=spec.block_shape,
                dtype=spec.dtype,
                cluster=cfg.redis_cluster,
                ttl_s=cfg.redis_ttl_s or None,
                key_prefix=cfg.redis_key_prefix,
                storage_dtype=STORAGE_FORMATS[cfg.redis_kv_format],  # the pool's own dtype: none (RedisTier)
                compression=None if cfg.redis_compression == "none" else cfg.redis_compression,
                read_connections=cfg.redis_read_connections,
            )
        )
    if not tiers:
        return None
    return TieredStore(
        tiers, device=loaded.device.type, retain_to=cfg.retain_to,
        max_retained_blocks_per_owner=cfg.retention_tenant_memory // spec.bytes_per_block,
    )  # fmt: skip
