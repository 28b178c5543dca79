"""Redis tier: one atomic, self-verifying value per block, with a TTL.

Layout: key ``{key_prefix}blk:{block_hash hex}`` -> ``codec.encode(...)`` bytes, written
with ``SET key value PX ttl``. The namespace is inside the hash chain and inside the
value's header, so a value is only ever decoded as the block it was written for; any
doubt (missing key, corrupted bytes, other namespace or weights, evicted by
``maxmemory``) is a miss with a counted reason, never wrong KV.

Round trips: a restore of N blocks is streamed pipelines on ``read_connections``
connections at once (the blocks cut into that many consecutive runs, one reader thread
each, the calling thread one of them; one redis-py reader is bound by its own CPU, ~1.3
GB/s): on each, up to ``max_batch_bytes / readers`` of GET replies are in flight while
the reader verifies and copies the ones that arrived, so reading, checking and copying
overlap and memory stays bounded on both ends. The answer is still the leading run of
good blocks: a run after a failed block does not count, and stops early. Lookups (``EXISTS``) and writes (``PEXPIRE`` / ``SET``) are plain
pipelines of at most ``max_batch_bytes`` of values. In cluster mode reads are pipelined
batches too (``redis.cluster.RedisCluster`` groups their single-key commands by node),
and no multi-key command is ever sent, so batches work across hash slots.

Direct reads (standalone, uncompressed, CPU destinations; ``direct_reads=True``): the
stored bytes of each GET reply are received from the socket straight into the
destination block (exact) or its stored-form buffer (a lossy format: the compact bytes,
decoded by ``codec.expand_into`` on the CPU, or on the GPU after the copy when the restore
asks for the stored form: ``get_many_stored_into``, pinned staging) and verified there
(prefix compared, xxh3_128 recomputed), skipping the three copies of redis-py's reply
path and our own. Measured in
``bench/bench_cachestore.py`` against raw redis-py GETs. A block that fails is reported
as not loaded; its destination may hold a partial write (see ``cachestore.base``).

Sizing: the replies of a pipelined read sit in Redis' client output buffer, which
counts toward ``maxmemory``; under a tight ``maxmemory`` with ``allkeys-lru`` a big batch
makes Redis evict other blocks while it answers (clean misses, but misses). Keep
``max_batch_bytes`` well under the server's memory headroom.

Retention (``cachestore.base``): on a standalone server a retained block's key is kept
*without* a TTL (``PERSIST``) and listed in the sorted set ``{key_prefix}retained``
(member: the key, score: the unix time in ms it is retained until, only ever raised:
``ZADD GT``); ``expire_retained`` (any replica: the set is shared) gives the keys whose
time passed their ``--redis-ttl`` again and takes them out of the set, atomically in one
Lua script, as ``retain`` pins atomically in another, so a retention extended by one
replica while another releases it is never lost. A Redis under a ``volatile-*``
``maxmemory-policy`` (or ``noeviction``, or without ``maxmemory``) then never evicts a
retained block, while the others stay evictable (they have a TTL); under ``allkeys-*``
it may (``eviction_policy`` tells, the server logs it at start). Deleting a session's
blocks leaves those retained past now. A later write of a block refreshes its TTL only
upward (``PEXPIRE ... GT``), so it never takes a pin's persistence or a longer TTL away.
In cluster mode (no script may touch keys of several slots) a retention only extends
the key's TTL to its time (``PEXPIREAT ... GT``): it is kept that long unless Redis
evicts it for memory.

A value that fails verification is deleted when it is read, so the next write of that
block stores a good one.

Writes are idempotent and skip the transfer when the block is already there: one
pipelined ``PEXPIRE key ttl`` per batch answers "is it there?" and refreshes the TTL of
the blocks that are (a block being written again is in use); only the missing ones are
encoded and ``SET``. Measured in ``bench/bench_cachestore.py``: the check costs one
small round trip per batch of new blocks and saves the whole value for known ones.

Failures: sockets have connect and read timeouts (reads, which requests wait for, on
their own connections with ``read_timeout_s``, 0.5 s; writes ``socket_timeout_s``, 2 s),
redis-py's own retries are off, and
a circuit breaker (``kvserve.common.breaker``) opens after ``breaker_failures`` consecutive
errors: while open every call is an immediate miss / no-op; after ``breaker_reset_s`` one
call probes. No method raises for a Redis failure.

URLs: ``redis://[[user]:password@]host:port[/db]``, ``rediss://`` for TLS (pass
``ssl_ca_certs`` / ``ssl_certfile`` / ``ssl_keyfile`` / ``ssl_cert_reqs`` for a private CA
or client certificates), and ``cluster=True`` for Redis Cluster (any node's URL).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import redis
import redis.cluster
import redis.exceptions
import torch
import xxhash
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.common.breaker import CircuitBreaker
from kvserve.common.tiers import Tier

from . import codec
from .base import (
    BACKEND_ERROR,
    BREAKER_OPEN,
    NOT_FOUND,
    TIMEOUT,
    BlockRef,
    BlockTier,
    LayeredRead,
    TierCounters,
    TierStats,
)
from .keys import redis_key

log = logging.getLogger(__name__)

R = TypeVar("R")

# Retention scripts (standalone). KEYS[1]: the retained set; the block keys after it.
_RETAIN_LUA = """
local out = {}
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('PERSIST', KEYS[i])
    redis.call('ZADD', KEYS[1], 'GT', ARGV[1], KEYS[i])
    out[i - 1] = 1
  else
    out[i - 1] = 0
  end
end
return out
"""
# ARGV: now (ms), the TTL (ms; 0: none) the keys get back, most keys per call. The keys
# come from the set itself (standalone only: they are not declared).
_RELEASE_LUA = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local ttl = tonumber(ARGV[2])
for _, k in ipairs(due) do
  redis.call('ZREM', KEYS[1], k)
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) end
end
return #due
"""
# ARGV[1]: now (ms). A key retained past now is left (-1); any other is deleted (1, or 0:
# it was not there).
_DELETE_LUA = """
local out = {}
for i = 2, #KEYS do
  local until_ms = redis.call('ZSCORE', KEYS[1], KEYS[i])
  if until_ms and tonumber(until_ms) > tonumber(ARGV[1]) then
    out[i - 1] = -1
  else
    if until_ms then redis.call('ZREM', KEYS[1], KEYS[i]) end
    out[i - 1] = redis.call('DEL', KEYS[i])
  end
end
return out
"""
_RELEASE_BATCH = 1000
# maxmemory policies under which Redis never evicts a key without a TTL
RETENTION_SAFE_POLICIES = ("noeviction", "volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl")

_BACKEND_ERRORS = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


def _recv_exact_into(sock: Any, buf: memoryview) -> None:
    while len(buf):
        n = sock.recv_into(buf)
        if n == 0:
            raise redis.exceptions.ConnectionError("connection closed by server")
        buf = buf[n:]


def _recv_exact(sock: Any, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_exact_into(sock, memoryview(buf))
    return buf


def _finish_line(sock: Any, start: bytearray, limit: int = 4096) -> tuple[bytearray, bytearray]:
    """Complete a RESP header line from its first bytes ``start``: (the line with its
    CRLF, any bytes of ``start`` past it). Reads byte by byte: never past the line."""
    line = bytearray(start)
    while (end := line.find(b"\r\n")) < 0:
        if len(line) >= limit:
            raise redis.exceptions.InvalidResponse(f"RESP line too long: {bytes(line[:32])!r}")
        line += _recv_exact(sock, 1)
    return line[: end + 2], line[end + 2 :]


@dataclass(slots=True)
class _Progress:
    """How far a multi-block read got: leading good blocks, their bytes, and why it
    stopped (a failure reason, or None)."""

    n: int = 0
    nbytes: int = 0
    failure: str | None = None


class _StopAt:
    """The first block a parallel read found bad (its index in the whole read): runs of
    blocks after it stop early, their blocks would not count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.at = 1 << 62

    def set(self, i: int) -> None:
        with self._lock:
            self.at = min(self.at, i)


def _is_timeout(e: BaseException) -> bool:
    return isinstance(e, (redis.exceptions.TimeoutError, TimeoutError))


class RedisTier(BlockTier):
    """KV blocks in Redis. See the module docstring and ``cachestore.base``."""

    name = Tier.REDIS
    shared = True  # outlives the process, read by every replica
    durable = True
    retains = True

    def __init__(
        self,
        url: str,
        *,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        cluster: bool = False,
        ttl_s: float | None = 24 * 3600.0,
        key_prefix: str = "kvserve:",
        socket_timeout_s: float = 2.0,
        socket_connect_timeout_s: float = 1.0,
        read_timeout_s: float = 0.5,
        compression: str | None = None,
        storage_dtype: torch.dtype | None = None,
        breaker_failures: int = 3,
        breaker_reset_s: float = 5.0,
        max_batch_bytes: int = 8 << 20,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        ssl_cert_reqs: str = "required",
        direct_reads: bool = True,
        read_connections: int = 4,
        min_blocks_per_reader: int = 8,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``ttl_s`` None means no expiry (rely on ``maxmemory``); ``compression`` and
        ``storage_dtype`` are the codec options (see ``cachestore.codec``: the latter is
        lossy, names its own keys, and only values stored so are read). The client connects lazily: a Redis that is down at startup is a miss,
        not an error. ``read_connections``: connections (and reader threads) one restore
        reads on at once, each taking at least ``min_blocks_per_reader`` blocks.
        ``wall_clock``: unix time, for what a delete treats as retained (the store's)."""
        self._init_block(block_shape, dtype)
        self._torch_shape = torch.Size(self.block_shape)
        self.url = url
        self.cluster = cluster
        self.key_prefix = key_prefix
        self.ttl_ms = int(ttl_s * 1000) if ttl_s else None
        self.compression = compression
        if storage_dtype == dtype:
            storage_dtype = None
        self.storage_dtype = storage_dtype
        # "exact", or the STORAGE_FORMATS name of a lossy format (part of the keys)
        self.storage_format = next(
            (name for name, sdt in codec.STORAGE_FORMATS.items() if sdt == storage_dtype), None
        )
        if self.storage_format is None:
            raise ValueError(f"unsupported storage dtype {storage_dtype}; use one of {list(codec.STORAGE_FORMATS)}")
        self.value_nbytes = codec.encoded_size(self.block_shape, dtype, storage_dtype)
        self.stored_nbytes = codec.stored_nbytes(self.block_shape, dtype, storage_dtype)
        self.batch_blocks = max(1, max_batch_bytes // self.value_nbytes)
        if read_connections < 1:
            raise ValueError(f"read_connections must be >= 1, got {read_connections}")
        self.read_connections = 1 if cluster else read_connections
        self.min_blocks_per_reader = max(1, min_blocks_per_reader)
        self._readers: ThreadPoolExecutor | None = None  # the extra readers, made at the first parallel read
        # Direct reads need an uncompressed value (any storage format): its prefix is known.
        self._direct_layout = direct_reads and not cluster and compression is None
        self._client_kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": socket_connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),  # the breaker decides when to try again
        }
        if url.startswith("rediss://"):
            self._client_kwargs.update(
                ssl_ca_certs=ssl_ca_certs,
                ssl_certfile=ssl_certfile,
                ssl_keyfile=ssl_keyfile,
                ssl_cert_reqs=ssl_cert_reqs,
            )
        # Reads (lookups, restores) are what a request waits for: their own connections
        # with a shorter timeout, so a hung Redis (SIGSTOP, a partition) costs a request
        # at most ``read_timeout_s`` before the breaker opens, not the write timeout.
        self._read_kwargs: dict[str, Any] = {
            **self._client_kwargs,
            "socket_timeout": min(read_timeout_s, socket_timeout_s),
            "socket_connect_timeout": min(read_timeout_s, socket_connect_timeout_s),
        }
        self._client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._read_client: redis.Redis | redis.cluster.RedisCluster | None = None
        self._client_lock = threading.Lock()
        self._breaker = CircuitBreaker(breaker_failures, breaker_reset_s, clock=clock)
        self._counters = TierCounters(self.name)
        self._wall = wall_clock
        self.retained_key = f"{key_prefix}retained"  # the sorted set of retained keys (standalone)
        self._retained_count: int | None = None if cluster else 0  # ZCARD at the last expire_retained
        self._pexpire_gt = True  # False: this Redis (older than 7.0) refuses PEXPIRE ... GT
        self._expired = 0

    # ---- plumbing ------------------------------------------------------------------

    def key(self, ref: BlockRef) -> str:
        """The Redis key holding ``ref`` (its storage format is part of the key)."""
        return redis_key(self.key_prefix, ref.block_hash, self.storage_format)

    def _get_client(self, read: bool = False) -> redis.Redis | redis.cluster.RedisCluster:
        with self._client_lock:
            client = self._read_client if read else self._client
            if client is None:
                kwargs = self._read_kwargs if read else self._client_kwargs
                if self.cluster:
                    # RedisCluster connects (fetches the slot map) right here.
                    client = redis.cluster.RedisCluster.from_url(self.url, **kwargs)
                else:
                    client = redis.Redis.from_url(self.url, **kwargs)
                if read:
                    self._read_client = client
                else:
                    self._client = client
            return client

    def _call(self, fn: Callable[[Any], R], what: str, *, read: bool = False) -> R | None:
        """Run ``fn(client)`` behind the breaker (``read``: on the read connections,
        with the short timeout). None when skipped or failed."""
        if not self._breaker.allow():
            self._counters.fail(BREAKER_OPEN)
            return None
        try:
            result = fn(self._get_client(read))
        except _BACKEND_ERRORS as e:
            self._breaker.record_failure()
            self._counters.add(errors=1)
            self._counters.fail(TIMEOUT if _is_timeout(e) else BACKEND_ERROR)
            log.debug("redis %s failed: %r (breaker %s)", what, e, self._breaker.state)
            return None
        self._breaker.record_success()
        return result

    def _pipeline(self, client: Any, command: str, keys: Sequence[str], *args: Any) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            getattr(pipe, command)(k, *args)
        return pipe.execute(raise_on_error=False)

    def _set_pipeline(self, client: Any, keys: Sequence[str], values: Sequence[bytes]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for k, v in zip(keys, values):
            pipe.set(k, v, px=self.ttl_ms)
        return pipe.execute(raise_on_error=False)

    def _batches(self, n: int) -> range:
        return range(0, n, self.batch_blocks)

    # ---- reads ---------------------------------------------------------------------

    def get_many_into(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> int:
        """Load ``refs[i]`` into ``outs[i]`` in order, each value verified before it is
        copied; stops at the first miss / error / bad value. Standalone: streamed
        pipelines on up to ``read_connections`` connections (see ``_stream_into``);
        cluster: pipelined batches of ``batch_blocks``."""
        return self._get_many(refs, outs, stored=False)

    def get_many_stored_into(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> int:
        """``get_many_into`` of each block's verified stored form (``stored_nbytes`` uint8
        bytes, not decoded: ``cachestore.base``), e.g. into pinned staging for the GPU."""
        for out in outs[: len(refs)]:
            if out.dtype != torch.uint8 or tuple(out.shape) != (self.stored_nbytes,) or not out.is_cpu:
                raise ValueError(f"stored-form destinations are {self.stored_nbytes} uint8 bytes on the CPU, "
                                 f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        return self._get_many(refs, outs, stored=True)

    def _get_many(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor], stored: bool) -> int:
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        if not all(out.is_contiguous() for out in outs[: len(refs)]):
            raise ValueError("destinations must be contiguous")
        t0 = time.perf_counter()
        progress = _Progress()
        complete = True
        if refs:
            if self.cluster:
                read: Callable[..., bool] = self._batches_into
            else:
                read = self._stream_into if len(self._runs(len(refs))) == 1 else self._parallel_into
            result = self._call(lambda c: read(c, refs, outs, progress, stored), "get", read=True)
            complete = bool(result)
            if result is False:  # stopped at a missing or bad value (errors: counted by _call)
                assert progress.failure is not None
                self._counters.fail(progress.failure)
                if progress.failure not in (NOT_FOUND, BACKEND_ERROR, TIMEOUT):
                    self._drop_bad(refs[progress.n], progress.failure)
        self._counters.add(hits=progress.n, bytes_out=progress.nbytes, misses=int(not complete))
        self._counters.add_seconds("read", time.perf_counter() - t0)
        return progress.n

    def _runs(self, n: int) -> list[tuple[int, int]]:
        """``n`` blocks cut into consecutive runs, one per reader: as many readers as
        ``read_connections`` allows with ``min_blocks_per_reader`` blocks each, and at
        least one reply in flight each within the ``batch_blocks`` they share."""
        k = max(1, min(self.read_connections, n // self.min_blocks_per_reader, self.batch_blocks))
        cuts = [n * i // k for i in range(k + 1)]
        return list(zip(cuts, cuts[1:]))

    def _parallel_into(
        self, client: redis.Redis, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor], progress: _Progress,
        stored: bool,
    ) -> bool:
        """``_stream_into`` over consecutive runs of the blocks at once, each on its own
        connection and thread (the first on this one). The leading good blocks are those
        of the runs before the first that stopped, plus that run's; a run past a stop
        ends early. A backend error in the run that decides is raised (once: one breaker
        failure), after every run returned."""
        runs = self._runs(len(refs))
        stop = _StopAt()
        pool = self._reader_pool()
        results: list[tuple[bool, _Progress] | BaseException] = []

        def one(a: int, b: int) -> tuple[bool, _Progress]:
            p = _Progress()
            try:
                with torch.inference_mode():  # destinations may be inference tensors (the restore thread's mode)
                    ok = self._stream_into(client, refs[a:b], outs[a:b], p, stored, stop=stop, base=a,
                                           readers=len(runs))
            except BaseException:
                stop.set(a + p.n)
                raise
            if not ok:
                stop.set(a + p.n)
            return ok, p

        futures = [pool.submit(one, a, b) for a, b in runs[1:]]
        try:
            results.append(one(*runs[0]))
        except _BACKEND_ERRORS as e:
            results.append(e)
        for f in futures:
            try:
                results.append(f.result())
            except _BACKEND_ERRORS as e:
                results.append(e)
        for (a, b), r in zip(runs, results):
            if isinstance(r, BaseException):
                raise r
            ok, p = r
            progress.n, progress.nbytes = a + p.n, progress.nbytes + p.nbytes
            if not ok:
                progress.failure = p.failure
                return False
        return True

    def _reader_pool(self) -> ThreadPoolExecutor:
        with self._client_lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.read_connections - 1, thread_name_prefix="redis-read")
            return self._readers

    def _stream_into(
        self, client: redis.Redis, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor], progress: _Progress,
        stored: bool = False, *, stop: _StopAt | None = None, base: int = 0, readers: int = 1,
    ) -> bool:
        """GETs streamed on one connection with up to ``batch_blocks`` replies in flight
        (``batch_blocks / readers`` in a parallel read): each reply is verified and copied
        while the next ones are on the wire, in one round trip, with bounded memory on
        both ends. A connection left with unread replies (early stop, error) is closed
        rather than returned to the pool. ``stop``/``base``: a parallel read's stop mark
        and this run's first index in it (a run past the mark ends; its result is not
        used)."""
        keys = [self.key(r) for r in refs]
        window = max(1, self.batch_blocks // readers)
        pool = client.connection_pool
        conn = pool.get_connection()
        clean = False
        try:
            sock = self._direct_socket(conn)
            scratch = None  # a lossy block read directly, decoded on the CPU: its stored bytes first
            sent = min(window, len(keys))
            conn.send_packed_command(conn.pack_commands([("GET", k) for k in keys[:sent]]))
            for i, (ref, out) in enumerate(zip(refs, outs)):
                if stop is not None and base + i > stop.at:
                    return False  # an earlier block failed: nothing from here counts
                if sent < len(keys) and sent - i <= window // 2:  # top the window up
                    more = keys[sent : sent + window - (sent - i)]
                    conn.send_packed_command(conn.pack_commands([("GET", k) for k in more]))
                    sent += len(more)
                if sock is not None and self._direct_target(out, stored):
                    if stored or self.storage_dtype is None:
                        nbytes, failure = self._read_direct(sock, ref, out, stored)
                    else:
                        if scratch is None:
                            scratch = torch.empty(self.stored_nbytes, dtype=torch.uint8)
                        nbytes, failure = self._read_direct(sock, ref, scratch, True)
                        if failure is None:
                            codec.expand_into(scratch.view(1, -1), out.view(1, *self.block_shape), self.storage_dtype)
                else:
                    nbytes, failure = self._read_parsed(conn, ref, out, stored)
                if failure is not None:
                    progress.failure = failure
                    clean = i + 1 == sent  # every reply sent for was read
                    return False
                progress.n += 1
                progress.nbytes += nbytes
            clean = True
            return True
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)

    def _read_parsed(self, conn: Any, ref: BlockRef, out: torch.Tensor, stored: bool) -> tuple[int, str | None]:
        """One GET reply through redis-py's parser, then the codec."""
        try:
            value = conn.read_response()
        except redis.exceptions.ResponseError:  # an error reply: the connection is fine
            self._counters.add(errors=1)
            return 0, BACKEND_ERROR
        return (len(value) if isinstance(value, bytes) else 0), self._load(ref, value, out, stored)

    # -- direct reads: the stored bytes go from the socket straight into ``out``
    #
    # For an uncompressed value everything before the stored bytes is known in advance
    # (``codec.stored_prefix``). We read the RESP bulk header and that prefix, compare,
    # ``recv_into`` the destination itself (the block, or a stored-form buffer), then read
    # the checksum and verify xxh3_128(prefix || those bytes). This skips the three copies
    # of redis-py's reply path (parser buffer, hiredis buffer, ``bytes``) and our own copy
    # out of the ``bytes``. A block that fails may be partly written (the
    # ``get_many_into`` contract). Anything unexpected (nil, an error reply, another
    # length or prefix) is read whole and handed to the codec for its reason, so the
    # connection stays in step with the protocol. Used with RESP2 or RESP3 on a
    # standalone server, for contiguous CPU destinations; a RESP3 push message in the
    # middle of the replies is a protocol error (the connection is dropped).

    def _direct_socket(self, conn: Any) -> Any:
        if not self._direct_layout or str(getattr(conn, "protocol", None)) not in ("2", "3"):
            return None
        return getattr(conn, "_sock", None)

    def _direct_target(self, out: torch.Tensor, stored: bool = False) -> bool:
        if stored:
            return out.is_cpu and out.dtype == torch.uint8 and out.numel() == self.stored_nbytes and out.is_contiguous()
        return out.is_cpu and out.dtype == self.dtype and out.shape == self._torch_shape and out.is_contiguous()

    def _read_direct(self, sock: Any, ref: BlockRef, out: torch.Tensor, stored: bool) -> tuple[int, str | None]:
        """One GET reply into ``out``: the block (exact) or, ``stored``, its stored form."""
        prefix = codec.stored_prefix(ref.namespace, ref.block_hash, self.block_shape, self.dtype, self.storage_dtype)
        value_len = len(prefix) + self.stored_nbytes + codec.CHECKSUM_SIZE
        expected = b"$%d\r\n" % value_len
        line = _recv_exact(sock, 3)  # the shortest reply, RESP3's null "_\r\n", is 3 bytes
        if line == expected[:3]:
            # "$" and two digits: the reply is longer than ``expected``, safe to read on.
            line += _recv_exact(sock, len(expected) - 3)
            if line == expected:
                head = _recv_exact(sock, len(prefix))
                if head != prefix:  # another block, namespace, layout: let the codec say
                    value = head + _recv_exact(sock, value_len - len(prefix) + 2)[:-2]
                    return value_len, self._load(ref, bytes(value), out, stored)
                data = memoryview(codec.byte_view(out))  # (stored_nbytes,) of out
                _recv_exact_into(sock, data)
                trailer = _recv_exact(sock, codec.CHECKSUM_SIZE + 2)
                if trailer[-2:] != b"\r\n":
                    raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")
                checksum = xxhash.xxh3_128(prefix)
                checksum.update(data)
                if checksum.digest() != trailer[: codec.CHECKSUM_SIZE]:
                    return value_len, codec.BAD_CHECKSUM
                if self.storage_dtype is not None and not codec.finite_scales(out, self.block_shape, self.dtype,
                                                                              self.storage_dtype):
                    return value_len, codec.BAD_PAYLOAD
                return value_len, None
        # Anything else: finish the header line and take the reply whole.
        line, payload = _finish_line(sock, line)
        if line in (b"$-1\r\n", b"_\r\n"):  # nil (RESP2), null (RESP3)
            return 0, NOT_FOUND
        kind, size = line[:1], line[1:-2]
        if kind in (b"$", b"!") and size.isdigit():  # a bulk string, a RESP3 blob error
            body = payload + _recv_exact(sock, int(size) + 2 - len(payload))
            if kind == b"$":
                return int(size), self._load(ref, bytes(body[:-2]), out, stored)
        elif kind != b"-":  # not a simple error either (e.g. a RESP3 push): out of step
            raise redis.exceptions.InvalidResponse(f"unexpected reply to GET: {line[:32]!r}")
        self._counters.add(errors=1)
        return 0, BACKEND_ERROR

    def layered_read(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> LayeredRead | None:
        """Layer by layer with ``GETRANGE``: each ``read(l0, l1)`` is one pipelined round
        of one range per leading block still good, its bytes received straight into the
        destination (the direct reads' path, below), the checksum (xxh3_128 of prefix ||
        tensor bytes, in order) carried from round to round and compared when the last
        round brings the stored one. Plain layout on a standalone server only (the
        ranges are the tensor's layers); None otherwise."""
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        if self.storage_dtype is not None or not self._direct_layout:
            return None  # (a lossy value's layers are not contiguous ranges: scales first)
        if not all(self._direct_target(o) for o in outs[: len(refs)]):
            return None
        return _RedisLayers(self, refs, outs)

    def _batches_into(
        self, client: Any, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor], progress: _Progress, stored: bool
    ) -> bool:
        """Pipelined GETs in batches of ``batch_blocks`` (cluster mode: each batch is
        split by node by redis-py)."""
        for start in self._batches(len(refs)):
            batch = refs[start : start + self.batch_blocks]
            values = self._pipeline(client, "get", [self.key(r) for r in batch])
            for ref, value, out in zip(batch, values, outs[start:]):
                progress.failure = self._load(ref, value, out, stored)
                if progress.failure is not None:
                    return False
                progress.n += 1
                progress.nbytes += len(value)
        return True

    def _load(self, ref: BlockRef, value: Any, out: torch.Tensor, stored: bool = False) -> str | None:
        """Verify ``value`` as ``ref`` into ``out`` (decoded, or ``stored``: its stored
        form); the failure reason, or None if ok."""
        if value is None:
            return NOT_FOUND
        if isinstance(value, Exception):
            self._counters.add(errors=1)
            return BACKEND_ERROR
        if stored:
            result = codec.decode_stored_into(value, ref.namespace, ref.block_hash, codec.byte_view(out),
                                              self.block_shape, self.dtype, self.storage_dtype)
        else:
            result = codec.decode_into(value, ref.namespace, ref.block_hash, out, self.storage_dtype)
        return None if result.ok else result.reason

    def _drop_bad(self, ref: BlockRef, reason: str) -> None:
        """A value that failed verification is deleted, so the next write of the block
        stores it again (a write only refreshes the TTL of a key that is there) instead
        of every restore on every replica stopping at it until the TTL runs out."""
        key = self.key(ref)
        if self._call(lambda c: c.delete(key), "delete") is not None:
            self._removed([ref.block_hash])
            log.warning("redis block %s failed verification (%s): deleted; the next write stores it again", key, reason)

    def get_into(self, ref: BlockRef, out: torch.Tensor) -> bool:
        return self.get_many_into([ref], [out]) == 1

    def get(self, ref: BlockRef) -> torch.Tensor | None:
        out = torch.empty(self.block_shape, dtype=self.dtype)
        return out if self.get_into(ref, out) else None

    def get_encoded(self, ref: BlockRef) -> bytes | None:
        """The raw stored value (unverified; for tools and tests)."""
        value = self._call(lambda c: c.get(self.key(ref)), "get")
        return value if isinstance(value, bytes) else None

    def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        """One pipelined EXISTS round trip for all refs (all False on failure)."""
        if not refs:
            return []
        keys = [self.key(r) for r in refs]
        found = self._call(lambda c: self._pipeline(c, "exists", keys), "exists", read=True)
        if found is None:
            return [False] * len(refs)
        held = [f is True or (isinstance(f, int) and f > 0) for f in found]
        if self._observer is not None:  # expired, evicted by maxmemory, deleted by another replica
            self._removed([r.block_hash for r, h in zip(refs, held) if not h])
        return held

    def contains(self, ref: BlockRef) -> bool:
        return self.contains_many([ref])[0]

    # ---- writes --------------------------------------------------------------------

    def put_many(
        self, refs: Sequence[BlockRef], values: Sequence[torch.Tensor], *, if_missing: bool = True
    ) -> list[bool]:
        """Store blocks; True for each block Redis holds afterwards. With ``if_missing``
        (default) blocks already there are not re-sent, only their TTL is refreshed."""
        if len(refs) != len(values):
            raise ValueError(f"{len(refs)} refs but {len(values)} values")
        return self._store(
            refs,
            lambda i: codec.encode(
                refs[i].namespace,
                refs[i].block_hash,
                values[i],
                compression=self.compression,
                storage_dtype=self.storage_dtype,
            ),
            if_missing,
        )

    def put_encoded_many(
        self, refs: Sequence[BlockRef], blobs: Sequence[bytes], *, if_missing: bool = True
    ) -> list[bool]:
        """Like ``put_many`` for values already encoded with ``codec.encode`` (the
        demotion path encodes when the host slot is evicted)."""
        if len(refs) != len(blobs):
            raise ValueError(f"{len(refs)} refs but {len(blobs)} values")
        return self._store(refs, lambda i: blobs[i], if_missing)

    def put(self, ref: BlockRef, value: torch.Tensor) -> bool:
        return self.put_many([ref], [value])[0]

    def _store(
        self, refs: Sequence[BlockRef], encode_at: Callable[[int], bytes], if_missing: bool
    ) -> list[bool]:
        held = [False] * len(refs)
        t0 = time.perf_counter()
        n_put = n_skip = nbytes = 0
        for start in self._batches(len(refs)):
            idx = range(start, min(start + self.batch_blocks, len(refs)))
            keys = [self.key(refs[i]) for i in idx]
            todo = list(idx)
            if if_missing:
                # a small round trip: on the read connections (short timeout), so a hung
                # Redis holds the writer (and the device blocks a spill pins) 0.5 s, not 2 s
                if self.ttl_ms is not None:  # refreshes the TTL of the blocks that are there, upward only
                    present = self._call(lambda c, ks=keys: self._exists_refresh(c, ks), "pexpire", read=True)
                else:
                    present = self._call(lambda c, ks=keys: self._pipeline(c, "exists", ks), "exists", read=True)
                if present is None:
                    break
                todo = []
                for i, p in zip(idx, present):
                    if p is True or (isinstance(p, int) and not isinstance(p, bool) and p > 0):
                        held[i] = True
                        n_skip += 1
                    else:
                        todo.append(i)
            if not todo:
                continue
            blobs = [encode_at(i) for i in todo]
            set_keys = [self.key(refs[i]) for i in todo]
            results = self._call(lambda c, ks=set_keys, vs=blobs: self._set_pipeline(c, ks, vs), "set")
            if results is None:
                break
            for i, b, r in zip(todo, blobs, results):
                if r is True:
                    held[i] = True
                    n_put += 1
                    nbytes += len(b)
                else:  # e.g. OOM with maxmemory-policy noeviction
                    self._counters.add(errors=1)
                    self._counters.fail(BACKEND_ERROR)
        self._counters.add(puts=n_put, put_skips=n_skip, bytes_in=nbytes)
        self._counters.add_seconds("write", time.perf_counter() - t0)
        if self._observer is not None:  # written now, or there already (its TTL refreshed)
            self._stored([r.block_hash for r, h in zip(refs, held) if h])
        return held

    def _exists_refresh(self, client: Any, keys: Sequence[str]) -> list[Any]:
        """Per key: whether it exists, its TTL raised to ``ttl_ms`` if lower (``GT``: a
        key without a TTL, a retained one, keeps none; one with a longer TTL keeps it).
        A Redis older than 7.0 refuses ``GT``: its TTLs are set as they were before
        retentions (plain ``PEXPIRE``), and retentions are not kept there
        (``keeps_retentions`` says so)."""
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
            if self._pexpire_gt:
                pipe.pexpire(k, self.ttl_ms, gt=True)
            else:
                pipe.pexpire(k, self.ttl_ms)
        got = pipe.execute(raise_on_error=False)
        if self._pexpire_gt and any(isinstance(r, redis.exceptions.ResponseError) for r in got[1::2]):
            self._pexpire_gt = False
            return self._exists_refresh(client, keys)
        return got[0::2]

    def delete_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        """Delete the blocks; on a standalone server, not those retained past now."""
        if not refs:
            return []
        keys = [self.key(r) for r in refs]
        if not self.cluster:
            now_ms = int(self._wall() * 1000)
            removed = self._call(
                lambda c: c.register_script(_DELETE_LUA)(keys=[self.retained_key, *keys], args=[now_ms]), "delete"
            )
            if removed is None:
                return [False] * len(refs)
            self._removed([r.block_hash for r, gone in zip(refs, removed) if gone != -1])  # deleted now, or not there
            return [isinstance(r, int) and r > 0 for r in removed]
        removed = self._call(lambda c: self._pipeline(c, "delete", keys), "delete")
        if removed is None:
            return [False] * len(refs)
        self._removed([r.block_hash for r in refs])  # deleted now, or not there
        return [isinstance(r, int) and r > 0 for r in removed]

    def delete(self, ref: BlockRef) -> bool:
        return self.delete_many([ref])[0]

    # ---- retention -----------------------------------------------------------------

    def retain(self, refs: Sequence[BlockRef], until: float, owner: str) -> list[bool]:
        """Pin the blocks Redis holds until at least ``until`` (module docstring): kept
        without a TTL and listed in the retained set (standalone), or their TTL extended
        to it (cluster). ``owner`` is the store's concern: Redis keeps none."""
        held = [False] * len(refs)
        until_ms = int(until * 1000)
        for start in self._batches(len(refs)):
            keys = [self.key(r) for r in refs[start : start + self.batch_blocks]]
            if self.cluster:
                got = self._call(lambda c, ks=keys: self._extend(c, ks, until_ms), "retain")
            else:
                got = self._call(
                    lambda c, ks=keys: c.register_script(_RETAIN_LUA)(keys=[self.retained_key, *ks], args=[until_ms]),
                    "retain",
                )
            if got is None:
                break
            for i, g in enumerate(got):
                held[start + i] = bool(g)
        return held

    def _extend(self, client: Any, keys: Sequence[str], until_ms: int) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
            pipe.pexpireat(k, until_ms, gt=True)
        return pipe.execute(raise_on_error=False)[0::2]

    def expire_retained(self, now: float) -> int:
        """Give the keys whose retention passed ``now`` their TTL back (standalone; any
        replica may: the set is shared); how many this call released."""
        if self.cluster:
            return 0
        n = 0
        now_ms, ttl = int(now * 1000), self.ttl_ms or 0
        while True:
            got = self._call(
                lambda c: c.register_script(_RELEASE_LUA)(keys=[self.retained_key], args=[now_ms, ttl, _RELEASE_BATCH]),
                "release",
            )
            if not isinstance(got, int):
                break
            n += got
            if got < _RELEASE_BATCH:
                break
        count = self._call(lambda c: c.zcard(self.retained_key), "zcard", read=True)
        if isinstance(count, int):
            self._retained_count = count
        self._expired += n
        return n

    def retained_until(self, ref: BlockRef) -> float | None:
        """The unix time the retained set holds ``ref`` until (None: not in it; for
        tools and tests)."""
        score = self._call(lambda c: c.zscore(self.retained_key, self.key(ref)), "zscore", read=True)
        return None if score is None else float(score) / 1000

    def eviction_policy(self) -> tuple[str, int] | None:
        """Redis' ``maxmemory-policy`` and ``maxmemory`` (bytes; 0: no limit), or None
        when it does not say (CONFIG disabled, as on some managed services; down)."""

        def ask(c: Any) -> tuple[str, int] | None:
            try:
                policy = c.config_get("maxmemory-policy").get("maxmemory-policy")
                limit = c.config_get("maxmemory").get("maxmemory")
            except redis.exceptions.ResponseError:  # CONFIG renamed or refused: Redis answers, not saying
                return None
            if policy is None:
                return None
            return str(policy.decode() if isinstance(policy, bytes) else policy), int(limit or 0)

        return self._call(ask, "config")

    def keeps_retentions(self) -> tuple[bool | None, str | None]:
        """Whether Redis' own eviction leaves retained blocks alone, and a line to log
        when it may not (or when it says nothing): True without ``maxmemory``, or under
        ``noeviction`` or a ``volatile-*`` policy (standalone: retained keys have no TTL);
        in cluster mode (their TTL is extended instead) only without ``maxmemory`` or
        under ``noeviction``. None: Redis does not say (CONFIG refused, down)."""
        version = self._call(lambda c: str(c.info("server").get("redis_version", "")), "info")
        if version and tuple(int(x) for x in version.split(".")[:1] if x.isdigit()) < (7,):
            return False, (f"is Redis {version}: retentions need 7.0 or later (PEXPIRE ... GT, so that a write never "
                           "takes a retained key's persistence away)")
        got = self.eviction_policy()
        if got is None:
            return None, ("does not say its maxmemory-policy (CONFIG refused, or not answering): retained blocks "
                          "stay there unless its own eviction drops them")
        policy, limit = got
        if limit and policy.startswith("volatile-") and self.ttl_ms is None:
            return True, (f"evicts only keys with a TTL ({policy}) and --redis-ttl is 0, so no block has one: "
                          "a full Redis refuses new blocks instead of evicting old ones")
        if limit == 0 or (policy == "noeviction" if self.cluster else policy in RETENTION_SAFE_POLICIES):
            return True, None
        how = "extends retained blocks' TTL (cluster mode)" if self.cluster else "keeps retained blocks without a TTL"
        return False, (f"may evict retained blocks under memory pressure (maxmemory-policy {policy}; kvserve {how}): "
                       f"use {'noeviction' if self.cluster else 'a volatile-* policy or noeviction'} there for the "
                       "retention guarantee")

    # ---- health and stats ----------------------------------------------------------

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def ping(self) -> bool:
        """True when Redis answers (goes through the breaker like every call)."""
        return bool(self._call(lambda c: c.ping(), "ping"))

    def stats(self) -> TierStats:
        return self._counters.snapshot(
            breaker_state=self._breaker.state, breaker_opens=self._breaker.opens,
            blocks_retained=self._retained_count, retention_expired=self._expired,
            bytes_retained=None if self._retained_count is None else self._retained_count * self.value_nbytes,
        )

    def close(self) -> None:
        """Close the connection pool (a later call reconnects)."""
        with self._client_lock:
            clients = [self._client, self._read_client]
            self._client = self._read_client = None
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)
        for client in clients:
            if client is not None:
                try:
                    client.close()
                except _BACKEND_ERRORS:
                    pass


class _RedisLayers(LayeredRead):
    """``RedisTier.layered_read``. A block stops the read (it and every later one are a
    miss) when its range comes back shorter or longer than the layout says (missing,
    truncated, another length), its prefix is not the expected one (then the whole
    value is fetched and the codec says why, or loads it whole when it is good in
    another layout) or its checksum fails; a value rewritten between two rounds fails
    the checksum over the mixed bytes. A round that errs ends the read (nothing whole)."""

    def __init__(self, tier: RedisTier, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> None:
        self.tier, self.refs = tier, list(refs)
        self.t0 = time.perf_counter()
        self.n = len(self.refs)
        self.L = tier.block_shape[0]
        self.layer_nbytes = tier.block_nbytes // self.L
        self.views = [memoryview(codec.byte_view(o)) for o in outs[: self.n]]
        self.outs = list(outs[: self.n])
        self.prefixes = [codec.plain_prefix(r.namespace, r.block_hash, tier.block_shape, tier.dtype) for r in self.refs]
        self.sums = [xxhash.xxh3_128(p) for p in self.prefixes]
        self.whole: set[int] = set()  # loaded whole by the codec (an unexpected layout that is good)
        self.failure: str | None = None
        self.errored = False
        self.nbytes = 0

    def _fail(self, i: int, reason: str) -> None:
        self.n, self.failure = i, reason

    def read(self, l0: int, l1: int) -> int:
        todo = [i for i in range(self.n) if i not in self.whole]
        if todo:
            if self.tier._call(lambda c: self._round(c, todo, l0, l1), "get", read=True) is None:
                self.n, self.errored = 0, True  # an error mid-read: no block is whole
        return self.n

    def _round(self, client: Any, todo: list[int], l0: int, l1: int) -> bool:
        t, LB, P = self.tier, self.layer_nbytes, len(self.prefixes[0])
        first, last = l0 == 0, l1 == self.L
        start = 0 if first else P + l0 * LB
        end = -1 if last else P + l1 * LB - 1
        want = (P if first else 0) + (l1 - l0) * LB + (codec.CHECKSUM_SIZE if last else 0)
        expected = b"$%d\r\n" % want
        pool = client.connection_pool
        conn = pool.get_connection()
        clean = False
        try:
            sock = conn._sock
            conn.send_packed_command(conn.pack_commands([("GETRANGE", t.key(self.refs[i]), start, end) for i in todo]))
            for k, i in enumerate(todo):
                line = _recv_exact(sock, 3)
                if line == expected[:3]:
                    line += _recv_exact(sock, len(expected) - 3)
                if line != expected:  # another length: missing, truncated, longer, not ours
                    line, payload = _finish_line(sock, line)
                    size = line[1:-2]
                    if line[:1] != b"$" or not size.isdigit():
                        raise redis.exceptions.InvalidResponse(f"unexpected reply to GETRANGE: {line[:32]!r}")
                    _recv_exact(sock, int(size) + 2 - len(payload))
                    clean = k + 1 == len(todo)
                    reason = codec.BAD_LENGTH if last and int(size) > want else codec.TRUNCATED
                    if first and int(size) == 0 and not client.exists(t.key(self.refs[i])):
                        reason = NOT_FOUND  # a missing key reads as an empty range; an empty value is not a miss
                    self._fail(i, reason)
                    return False
                if first:
                    head = _recv_exact(sock, P)
                    if head != self.prefixes[i]:  # another layout or block: the codec says why
                        _recv_exact(sock, want - P + 2)
                        if k + 1 < len(todo):
                            conn.disconnect()  # replies left unread: this connection is done
                        clean = True
                        value = client.get(t.key(self.refs[i]))
                        failure = t._load(self.refs[i], value, self.outs[i])
                        if failure is not None:
                            self._fail(i, failure)
                            return False
                        self.whole.add(i)  # good whole: skipped by later rounds
                        self.nbytes += len(value)
                        if k + 1 < len(todo):  # the rest of this round again, on a fresh connection
                            return self._round(client, todo[k + 1 :], l0, l1)
                        return True
                data = self.views[i][l0 * LB : l1 * LB]
                _recv_exact_into(sock, data)
                self.sums[i].update(data)
                tail = _recv_exact(sock, (codec.CHECKSUM_SIZE if last else 0) + 2)
                if tail[-2:] != b"\r\n":
                    raise redis.exceptions.InvalidResponse("bulk reply not terminated by CRLF")
                self.nbytes += want
                if last and self.sums[i].digest() != tail[: codec.CHECKSUM_SIZE]:
                    clean = k + 1 == len(todo)
                    self._fail(i, codec.BAD_CHECKSUM)
                    return False
            clean = True
            return True
        finally:
            if not clean:
                conn.disconnect()
            pool.release(conn)

    def finish(self) -> int:
        t = self.tier
        c = t._counters
        if self.failure is not None and not self.errored:
            c.fail(self.failure)
            if self.failure not in (NOT_FOUND, BACKEND_ERROR, TIMEOUT):
                t._drop_bad(self.refs[self.n], self.failure)
        c.add(hits=self.n, bytes_out=self.nbytes, misses=int(self.n < len(self.refs)))
        c.add_seconds("read", time.perf_counter() - self.t0)
        return self.n
