"""Forgetting a session's KV: after DeleteSession or expiry its blocks are not found.

KV blocks are content-addressed (namespace + chained token hashes), so "the session's
blocks" are the full blocks of its transcript in its namespace (tenant + request salt).
``forget_blocks`` stops them from being found in every tier:

1. device: their entries leave the engine's prefix map (on the engine thread, between
   steps). A block some running sequence still uses keeps its KV until that sequence
   frees it, then it is a plain free block;
2. queued writes (idle spills, demotions) are flushed, so none lands afterwards;
3. host tier: deleted (its evictions demote to Redis through the writer: flushed again);
4. Redis: deleted.

The honest limit: another transcript of the *same namespace* (same tenant and salt)
with the same leading blocks loses those cache entries too; it recomputes them,
nothing worse. Blocks of other tenants are in other namespaces and are untouched.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cachestore.base import BlockRef
from cachestore.keys import block_hashes
from service.types import CacheScope, Tier


async def forget_blocks(
    engine: Any,  # service.engine.AsyncEngine
    token_ids: list[int],
    scope: CacheScope,
    *,
    timeout_s: float = 10.0,
) -> dict[str, int]:
    """Drop the full blocks of ``token_ids`` in ``scope``'s namespace from the device prefix
    map, the host tier and Redis; returns how many entries each tier dropped."""
    core = engine.engine  # the LLMEngine behind the asyncio front
    loop = asyncio.get_running_loop()
    dropped: asyncio.Future[int] = loop.create_future()

    def drop_device() -> None:  # runs on the engine thread
        n = 0
        try:
            for ns in core.namespaces(scope):  # LongRoPE models: both regimes
                for h in block_hashes(ns, token_ids, core.block_size):
                    block = core.blocks.lookup(h)
                    if block is not None:
                        core.blocks.drop_hash(block)
                        n += 1
        finally:
            loop.call_soon_threadsafe(lambda: dropped.done() or dropped.set_result(n))

    core.call_soon(drop_device)
    out = {Tier.DEVICE: await asyncio.wait_for(dropped, timeout_s)}
    store = core.store
    if store is None:
        return out
    refs = [BlockRef(ns, h) for ns in core.namespaces(scope) for h in block_hashes(ns, token_ids, core.block_size)]

    def drop_stored() -> dict[str, int]:
        got: dict[str, int] = {}
        store.flush(timeout_s)
        if store.host is not None:
            got[Tier.HOST] = sum(store.host.delete_many(refs))
            store.flush(timeout_s)
        if store.redis is not None:
            got[Tier.REDIS] = sum(store.redis.delete_many(refs))
        return got

    out.update(await asyncio.to_thread(drop_stored))
    return out
