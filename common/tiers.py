"""The names of the places KV blocks live (``Tier``): the cache store's tiers name
themselves with it, and the service names them in its events, metrics, settings and
logs. Standard library only."""

from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    """The name of a place KV blocks live, fastest first: the engine's device pool, the
    host tier (``HostTier``), local files (``DiskTier``), Redis (``RedisTier``). A ``str``:
    ``Tier.HOST == "host"``, and it formats as its value (metric labels, logs, settings)."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REDIS = "redis"


__all__ = ["Tier"]
