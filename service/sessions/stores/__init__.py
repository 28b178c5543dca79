"""Where session records live, one module each: ``protocol.py`` (the ``SessionStore``
protocol: get / put / conditional put / delete / list, plus the per-session turn lock;
the outcomes of a conditional write and their rule, ``cas_outcome``; ``Expect``,
``FlushReport``), ``memory.py`` (``InMemorySessionStore``: this process),
``redis.py`` (``RedisSessionStore``: one record per session, Lua compare-and-set on its
etag) and ``fallback.py`` (``FallbackSessionStore``: this process's memory behind Redis,
with per-call timeouts, a circuit breaker and the journal).

Sessions keep their own Redis client (``redis.asyncio``, their own timeouts, Lua
scripts, cluster hash tags) and their own breaker (``kvserve.common.breaker.CircuitBreaker``,
the class the KV tier uses, another instance): a session write is a small
compare-and-set the turn waits for, a KV block a large best-effort value written in the
background, so they fail, time out and recover separately. They share the URL, the TLS
files and the key prefix (``--redis-url``, ``--redis-tls-*``, ``--redis-key-prefix``).

The names below are re-exported so ``from kvserve.service.sessions.stores import X``
keeps working; ``copy_record`` lives beside the records (``records.py``).
"""

from ..records import copy_record
from .fallback import FallbackSessionStore
from .memory import InMemorySessionStore
from .protocol import (
    CONFLICT,
    DELETED,
    HEALED,
    KEPT_ETAG_PREFIX,
    LIMIT,
    REPLACED,
    RESTORED,
    UNKNOWN,
    WRITTEN,
    Expect,
    FlushReport,
    SessionStore,
    cas_outcome,
    fingerprint,
    new_etag,
)
from .redis import TOMBSTONE_PREFIX, RedisSessionStore, is_key_error, tombstone

__all__ = [
    "CONFLICT",
    "DELETED",
    "HEALED",
    "KEPT_ETAG_PREFIX",
    "LIMIT",
    "REPLACED",
    "RESTORED",
    "TOMBSTONE_PREFIX",
    "UNKNOWN",
    "WRITTEN",
    "Expect",
    "FallbackSessionStore",
    "FlushReport",
    "InMemorySessionStore",
    "RedisSessionStore",
    "SessionStore",
    "cas_outcome",
    "copy_record",
    "fingerprint",
    "is_key_error",
    "new_etag",
    "tombstone",
]
