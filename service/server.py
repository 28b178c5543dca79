"""Builds and runs everything: engine, session table, servicer, gRPC server, health,
reflection, metrics endpoint, signal handling and drain.

Two entries:

* ``async with serve(config) as running:`` runs a server in the current event loop
  (tests, benchmarks, embedding). ``running.port`` is the bound port (``port=0``
  picks a free one). Leaving the block drains and stops it.
* ``run(config)`` is what ``kvserve serve`` calls: serve until SIGTERM or SIGINT,
  then drain and return exit status 0 (3, ``EXIT_UNSAVED``, when the drain left
  acknowledged session changes in no durable place; a signal during startup: 128 + its
  number, before anything is served).

Drain (``RunningServer.shutdown``): health turns NOT_SERVING for every service, new
calls get UNAVAILABLE, in-flight streams get up to ``drain_timeout`` seconds to finish;
streams still running then are stopped and end with UNAVAILABLE ("the server shut
down before this stream finished"); the session store saves what it holds only in
memory (``SessionStore.flush``: Redis within the time left, what it did not take staying
in the journal; the record files), then the sessions' KV blocks are written out; then the engine stops and the
port closes.

Security (docs/security.md): API keys (``--api-keys-file`` / ``--api-keys``) are
checked by ``service.auth.AuthInterceptor`` before any handler runs, health and
reflection excepted; TLS (``--tls-cert``/``--tls-key``) and mutual TLS
(``--tls-client-ca``) secure the port; ``--max-message-size`` bounds messages both
ways; sessions unused for ``--session-ttl`` are reaped here, transcript and KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import signal
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.common.dirlock import DiskCacheLocked, hold_dir_lock

from .auth import Authenticator, AuthInterceptor, load_api_keys, tenant_map
from .config import ConfigError, ServerConfig, mask_url_password
from .admission import Admission
from .metrics import ServiceMetrics
from .models import catalog
from .conversations import Conversations
from .session_ops import SessionOps
from .servicer import SERVICE_NAME, GenerationServicer, add_to_server
from .sessions import (
    FallbackSessionStore,
    InMemorySessionStore,
    RedisSessionStore,
    SessionManager,
    SessionStore,
)
from .spill import SpillScheduler
from .tracing import Tracing
from .validation import Limits

if TYPE_CHECKING:
    from .engine import AsyncEngine

log = logging.getLogger(__name__)

# Handlers cancelled by server.stop() need a moment to send their final status.
_STOP_GRACE_S = 2.0
# The exit status of a drain that left acknowledged session changes in no durable place
# (Redis did not take them and there is no journal; record files that could not be written).
EXIT_UNSAVED = 3


@dataclass
class RunningServer:
    """A started server. ``address`` is ``host:port`` suitable for a client channel."""

    config: ServerConfig
    port: int
    address: str
    engine: AsyncEngine
    servicer: GenerationServicer
    admission: Admission  # both fronts' stream count and drain
    conversations: Conversations
    session_ops: SessionOps  # the session operations outside a turn (both fronts')
    sessions: SessionManager
    metrics: ServiceMetrics
    spill: SpillScheduler
    health: health.aio.HealthServicer
    server: grpc.aio.Server
    authenticator: Authenticator = field(default_factory=Authenticator)
    metrics_port: int | None = None
    http_port: int | None = None  # the OpenAI-compatible HTTP front's port (None: off)
    http_server: Any = field(default=None, repr=False)  # uvicorn.Server
    http_task: asyncio.Task | None = field(default=None, repr=False)
    owns_engine: bool = True
    reaper: asyncio.Task | None = field(default=None, repr=False)
    exit_status: int = 0  # after shutdown: EXIT_UNSAVED when session changes were left in no durable place
    events: Any = field(default=None, repr=False)  # the KV events publisher (service/kv_events.py; None: off)
    _stopped: bool = field(default=False, repr=False)

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Drain and stop (idempotent). Default timeout: ``config.drain_timeout``."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.drain_timeout if drain_timeout_s is None else drain_timeout_s
        self.metrics.ready.set(0)
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING
        if self.config.drain_delay:  # still serving while proxies and endpoints notice
            log.info("not ready: taking new calls for %.1f s more", self.config.drain_delay)
            await asyncio.sleep(self.config.drain_delay)
        admission = self.admission
        admission.start_draining()  # new calls: UNAVAILABLE
        if admission.inflight:
            log.info("draining %d stream(s) for up to %.1f s", admission.inflight, grace)
        t0 = time.monotonic()
        if not await admission.wait_idle(grace):
            log.warning("drain timeout: stopping %d stream(s) still in flight", admission.inflight)
            admission.abort_inflight(self.conversations.engine.abort)
            await admission.wait_idle(_STOP_GRACE_S)
        await self._stop_http()
        if self.reaper is not None:
            self.reaper.cancel()
            await asyncio.gather(self.reaper, return_exceptions=True)
        await self.spill.stop()
        # Session records first (what clients were told is saved), then KV blocks (a cache).
        await self._flush_sessions(max(grace - (time.monotonic() - t0), 1.0))
        # Write the blocks of sessions this replica served to Redis (or, with no Redis,
        # the disk tier), so another replica (or this one restarted) resumes them without
        # prefill; bounded by the time left.
        left = max(grace - (time.monotonic() - t0), 1.0)
        drain_tier = self.spill.shared_tier
        errors_before, t_persist = self._tier_errors(drain_tier), time.monotonic()
        report = await self.spill.persist_all(left)
        if report.sessions:
            log.log(
                logging.INFO if report.complete else logging.WARNING,
                "drain: %d session(s), %d full block(s): %d in %s (%d written now), %d left%s",
                report.sessions, report.blocks, report.held, report.where, report.written, report.left,
                "" if report.complete else _drain_shortfall(left, time.monotonic() - t_persist,
                                                            self._tier_errors(drain_tier) - errors_before,
                                                            report.where),
            )  # fmt: skip
        if self.owns_engine:
            await self.engine.shutdown(0.0)
        if self.events is not None:  # after the engine and its store: their last changes go out
            await asyncio.to_thread(self.events.close)
        await self.server.stop(_STOP_GRACE_S)
        self.metrics.stop_http()
        await self.sessions.store.close()
        log.info("stopped")


    async def _flush_sessions(self, timeout_s: float) -> None:
        """Save what the session store holds only in memory where it promises to (Redis,
        the journal, the record files): ``FlushReport``. Changes left in no durable place
        are one error line and ``exit_status`` EXIT_UNSAVED."""
        report = await self.sessions.store.flush(timeout_s)
        if report.lost:
            self.exit_status = EXIT_UNSAVED
            if report.where == "Redis":
                log.error(
                    "drain: %d session(s) with %d acknowledged turn(s) not in Redis after %.1f s (%s): they are lost "
                    "with this process; set --disk-cache-dir to keep them in a journal across restarts",
                    report.sessions, report.turns, report.waited_s, report.why,
                )  # fmt: skip
            else:
                log.error(
                    "drain: %d session record file(s) in %s could not be brought up to date (%s): a restart may find "
                    "those sessions as they were before their last change (a deleted or expired one back)",
                    report.sessions, report.where, report.why,
                )  # fmt: skip
        elif report.journaled:
            log.warning(
                "drain: %d session(s) with %d acknowledged turn(s) not yet in Redis (%s) stay in the session journal; "
                "the next start on this --disk-cache-dir replays them and writes them to Redis",
                report.journaled, report.journaled_turns, report.why,
            )  # fmt: skip
        elif report.written or report.restored:
            log.info("drain: %d session record(s) written back to Redis (%.1f s)", report.written + report.restored,
                     report.waited_s)  # fmt: skip

    def _tier_errors(self, tier: str | None) -> int:
        store = self.engine.cache_stats().store
        stats = store.tiers.get(tier) if store is not None and tier else None
        return stats.errors if stats is not None else 0

    async def _stop_http(self) -> None:
        if self.http_task is None:
            return
        self.http_server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.http_task), _STOP_GRACE_S + 3.0)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            self.http_task.cancel()
            await asyncio.gather(self.http_task, return_exceptions=True)
        self.http_task = None


def _drain_shortfall(budget_s: float, took_s: float, errors: int, where: str = "Redis") -> str:
    """Why the drain left blocks out of its tier (``where``: Redis, or the disk tier),
    for its log line: the time ran out, or the tier failed the writes or was not there
    (long before the time was up)."""
    if took_s >= 0.9 * budget_s:
        return f" (not all through within {budget_s:.1f} s)"
    if where != "Redis":
        if errors:
            return f" ({where} failed {errors} call(s) during the drain: the disk is full or failing)"
        return f" ({where} did not take them: full of blocks it would not evict, or failing writes)"
    if errors:
        return f" (Redis failed {errors} call(s) during the drain: it is down or refusing writes)"
    return " (Redis did not take them: it is unreachable or its circuit breaker is open)"


def bind_http_socket(host: str, port: int) -> socket.socket:
    """The HTTP front's listening socket, bound before the model loads (one clear line
    when it cannot be); ``port`` 0 picks a free one."""
    sock = _bind(host, port, "HTTP port", "--http-port (KVSERVE_HTTP_PORT)")
    try:
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen for HTTP on {_bind_address(host, port)}: {e.strerror or e}") from None
    sock.setblocking(False)
    return sock


def http_limits_of(config: ServerConfig, context_length: int) -> Any:
    """The HTTP front's limits (service.http.limits.HttpLimits) from the settings; any
    JSON array or object other than the messages may hold the context length's items
    (a token-id prompt), at least 65536."""
    from .http.limits import HttpLimits

    return HttpLimits(
        max_body_bytes=config.max_message_size,
        max_messages=config.max_chat_messages,
        max_items=max(context_length, 1 << 16),
        header_timeout_s=config.http_header_timeout,
        body_timeout_s=config.http_body_timeout,
        keep_alive_timeout_s=config.http_keep_alive_timeout,
        max_connections=config.http_max_connections,
    )


def http_ssl_options(config: ServerConfig) -> dict[str, Any]:
    """uvicorn's TLS options from the same certificates as the gRPC port."""
    if not config.tls_cert:
        return {}
    import ssl

    opts: dict[str, Any] = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key}
    if config.tls_client_ca:
        opts.update(ssl_ca_certs=config.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return opts


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _client_address(host: str, port: int) -> str:
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host in ("::", "[::]"):
        host = "[::1]"
    return _bind_address(host, port)


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``--tls-cert``/``--tls-key`` (None: plaintext); with
    ``--tls-client-ca`` clients must present a certificate that CA signed."""
    if not config.tls_cert:
        return None

    def read(path: str, what: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(f"cannot read the {what} {path!r}: {e.strerror or e}") from None

    assert config.tls_key is not None  # ServerConfig checks they come together
    chain, key = read(config.tls_cert, "TLS certificate (--tls-cert)"), read(config.tls_key, "TLS key (--tls-key)")
    client_ca = read(config.tls_client_ca, "client CA (--tls-client-ca)") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None)


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", config.max_message_size),
        ("grpc.max_send_message_length", config.max_message_size),
    ]


def build_session_store(config: ServerConfig) -> SessionStore:
    """Redis-backed (with this process as the fallback) when Redis is configured, else
    in files beside the disk tier's blocks (``--disk-cache-dir``), else in this
    process's memory; records expire after ``session_ttl``."""
    ttl = config.session_ttl or None
    if not config.redis_url and config.disk_cache_dir:  # sessions resume after a restart of this machine
        from .sessions.disk import DiskSessionStore

        journal_left_behind(Path(config.disk_cache_dir))
        return DiskSessionStore(Path(config.disk_cache_dir) / "sessions", ttl_s=ttl, fsync=config.disk_cache_fsync)
    if not config.redis_url:
        return InMemorySessionStore(ttl_s=ttl)
    journal = None
    if config.disk_cache_dir:  # what Redis has not confirmed outlives the process
        from .sessions.journal import SessionJournal

        journal = SessionJournal(Path(config.disk_cache_dir) / "journal", fsync=config.disk_cache_fsync)
    return FallbackSessionStore(
        RedisSessionStore.from_url(
            config.redis_connection_url() or config.redis_url,
            key_prefix=config.redis_key_prefix,
            ttl_s=ttl,
            cluster=config.redis_cluster,
        ),
        InMemorySessionStore(ttl_s=ttl),
        timeout_s=config.session_store_timeout,
        journal=journal,
    )


def journal_left_behind(disk_cache_dir: Path) -> None:
    """A server without Redis does not replay a session journal a server with Redis left
    in its directory (those records belong in that Redis): say so, once."""
    from .sessions.journal import FILE

    path = disk_cache_dir / "journal" / FILE
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size:
        log.warning("%s holds session changes a server with Redis could not write to it (%d bytes); they are "
                    "replayed when this directory is served with that --redis-url again", path, size)  # fmt: skip


async def _reap_sessions(session_ops: SessionOps, period_s: float) -> None:
    """Remove expired sessions and drop their KV blocks (``SessionOps.reap``), every ``period_s``."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await session_ops.reap()
        except Exception:
            log.exception("reaping expired sessions failed")


class StartupError(Exception):
    """The server cannot start. The message is one line: what failed, where, what to do."""


def check_device(config: ServerConfig) -> None:
    """``--device cuda`` on a machine without CUDA, or with a CPU-only weight format, fails
    here, before anything loads."""
    if config.device != "cuda":
        return
    if config.weight_format in ("w8a8", "q8_0", "q6_k", "q4_k_m", "q4_1", "q4_0"):
        raise StartupError(f"--weight-format {config.weight_format} (KVSERVE_WEIGHT_FORMAT) runs on the CPU only; "
                           "use int8 or bf16 with --device cuda")  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise StartupError(
            f"--device cuda: CUDA is not available ({why}, torch {torch.__version__}); "
            "use --device cpu or --device auto (KVSERVE_DEVICE), or install a CUDA build of torch"
        )


def check_port(host: str, port: int) -> None:
    """Fail with one line when ``host:port`` cannot be bound (in use, not an address of
    this machine, privileged), before the model loads."""
    if port == 0:
        return
    _bind(host, port, "port", "--port (KVSERVE_PORT)").close()


def _bind(host: str, port: int, what: str, flag: str) -> socket.socket:
    """A socket bound to ``host:port`` (SO_REUSEADDR, as grpc does), or a one-line
    StartupError saying why not; ``what`` and ``flag`` name the setting in the message."""
    fix = f"stop the process holding it or choose another {flag}"
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StartupError(f"--host {host!r}: cannot resolve it ({e.strerror}); use an address of this machine, e.g. 0.0.0.0") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"{what} {port} on {host} is already in use; {fix}") from None
        if e.errno == errno.EACCES:
            raise StartupError(f"{what} {port} on {host}: permission denied (ports below 1024 need privileges); "
                               f"choose another {flag}") from None  # fmt: skip
        if e.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"--host {host}: not an address of this machine; use one of its addresses, "
                               "or 0.0.0.0 for all (KVSERVE_HOST)") from None  # fmt: skip
        raise StartupError(f"cannot listen on {_bind_address(host, port)}: {e.strerror or e}; {fix}") from None
    return sock


def redis_problem(config: ServerConfig, timeout_s: float = 2.0) -> str | None:
    """None when ``--redis-url`` answers PING, else why not (one line)."""
    import redis
    import redis.cluster

    url = config.redis_connection_url()
    assert url is not None
    kwargs: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    client: Any = None
    try:
        if config.redis_cluster:
            client = redis.cluster.RedisCluster.from_url(url, **kwargs)
        else:
            client = redis.Redis.from_url(url, **kwargs)
        client.ping()
        return None
    except Exception as e:  # connection refused, DNS, TLS, auth, not a cluster, ...
        return f"{type(e).__name__}: {e}".splitlines()[0]
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


async def check_redis(config: ServerConfig) -> None:
    """Log when Redis does not answer at startup and serve degraded, or, with
    ``--redis-required``, refuse to start."""
    if not config.redis_url:
        return
    problem = await asyncio.to_thread(redis_problem, config)
    if problem is None:
        log.info("redis: %s answers", mask_url_password(config.redis_url))
        return
    where = f"Redis at {mask_url_password(config.redis_url)} (--redis-url)"
    if config.redis_required:
        raise StartupError(
            f"{where} does not answer ({problem}); start it or fix --redis-url (KVSERVE_REDIS_URL), "
            "or drop --redis-required to serve degraded"
        )
    log.warning(
        "%s does not answer (%s): serving DEGRADED: KV blocks stay on this replica and session transcripts in its "
        "memory until Redis answers; fix --redis-url, or set --redis-required to refuse to start",
        where, problem,
    )  # fmt: skip


def disk_cache_problem(config: ServerConfig) -> str | None:
    """None when ``--disk-cache-dir`` is off or usable (created, writable, no other
    server holding it), else why not (one line)."""
    if not config.disk_cache_dir:
        return None
    root = Path(config.disk_cache_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.close(hold_dir_lock(root))
    except DiskCacheLocked as e:
        return f"--disk-cache-dir (KVSERVE_DISK_CACHE_DIR): {e}; give each server its own directory"
    except OSError as e:
        return f"--disk-cache-dir (KVSERVE_DISK_CACHE_DIR) {root} cannot be used: {e.strerror or e}"
    return None


def build_kv_events(config: ServerConfig) -> Any:
    """The KV events publisher (``--kv-events-endpoint``; None: off), its sockets bound
    (or connected) now: a missing pyzmq or a port in use is one line, before the model loads."""
    if not config.kv_events_endpoint:
        return None
    from .kv_events import KVEvents, KVEventsUnavailable

    topic = config.kv_events_topic.replace("{hostname}", socket.gethostname()).replace("{model}", config.model or "kvserve-default")
    try:
        return KVEvents(
            config.kv_events_endpoint,
            block_size=config.block_size,
            topic=topic,
            replay_endpoint=config.kv_events_replay_endpoint,
            token_ids=config.kv_events_token_ids,
            tiers=config.kv_events_tiers,
            encoding=config.kv_events_encoding,
            replay_buffer_bytes=config.kv_events_replay_buffer,
            redis_ttl_s=config.redis_ttl if config.redis_url else 0.0,
            redis_max_blocks=config.kv_events_redis_blocks,
            journal_dir=config.disk_cache_dir,
        )
    except KVEventsUnavailable as e:
        raise StartupError(f"--kv-events-endpoint (KVSERVE_KV_EVENTS_ENDPOINT) needs pyzmq and msgpack ({e}): "
                           "pip install 'kvserve[events]', or leave it empty") from None  # fmt: skip
    except Exception as e:  # zmq.ZMQError: address in use, not an address of this machine, a bad endpoint
        raise StartupError(f"KV events on {config.kv_events_endpoint}"
                           + (f" / replay {config.kv_events_replay_endpoint}" if config.kv_events_replay_endpoint else "")
                           + f": {e}; fix --kv-events-endpoint / --kv-events-replay-endpoint "
                           "(KVSERVE_KV_EVENTS_ENDPOINT / KVSERVE_KV_EVENTS_REPLAY_ENDPOINT)") from None


async def _build_engine(config: ServerConfig, events: Any = None) -> Any:
    from .engine import build_engine
    from .engine.store import HostMemoryError
    from .models.config import ModelLoadError

    engine_config = config.engine_config()
    if config.model in catalog.MODELS:  # a name (a folder or file of that name: ./NAME)
        cache = Path(config.model_cache_dir) if config.model_cache_dir else catalog.default_cache_dir(os.environ)
        try:
            path = await asyncio.to_thread(catalog.fetch, config.model, cache)
        except catalog.ModelFetchError as e:
            raise StartupError(str(e)) from None
        engine_config = dataclasses.replace(engine_config, model_path=str(path))
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    try:
        return await build_engine(engine_config, events=events)
    except DiskCacheLocked as e:  # taken since disk_cache_problem looked
        raise StartupError(f"--disk-cache-dir (KVSERVE_DISK_CACHE_DIR): {e}; give each server its own directory") from None
    except HostMemoryError as e:
        raise StartupError(f"--host-cache-memory (KVSERVE_HOST_CACHE_MEMORY): {e}; lower it (0: no host tier)") from None
    except ModelLoadError as e:
        raise StartupError(
            f"cannot load the model: {e}; --model (KVSERVE_MODEL) takes a Hugging Face model directory "
            f"(config.json, *.safetensors, tokenizer) or a GGUF file of a supported family, or a model name "
            f"({', '.join(sorted(catalog.MODELS))})"
        ) from e


@dataclass
class _Startup:
    """What ``serve`` has set up so far (``_preflight``, then ``_build``): what its exit
    undoes when the start fails before a ``RunningServer`` owns it."""

    config: ServerConfig
    authenticator: Authenticator
    credentials: grpc.ServerCredentials | None
    metrics: ServiceMetrics
    tracing: Tracing
    owns_tracing: bool
    owns_engine: bool
    engine: Any  # given, or built by ``_build`` (None until then)
    server: grpc.aio.Server  # its port bound (held while the model loads), not started
    port: int
    http_socket: socket.socket | None = None
    http_ssl: dict[str, Any] = field(default_factory=dict)
    events: Any = None  # the KV events publisher (None: off)
    metrics_port: int | None = None
    reaper: asyncio.Task | None = None


@dataclass
class _Service:
    """What ``_build`` makes of the engine: the session table and everything over it."""

    sessions: SessionManager
    spill: SpillScheduler
    conversations: Conversations
    session_ops: SessionOps
    admission: Admission
    servicer: GenerationServicer
    default_max_new_tokens: int


@asynccontextmanager
async def serve(
    config: ServerConfig,
    *,
    engine: Any = None,
    session_store: SessionStore | None = None,
    metrics: ServiceMetrics | None = None,
    tracing: Tracing | None = None,
    http_port: int | None = None,
) -> AsyncIterator[RunningServer]:
    """Start a server for ``config`` in this event loop; drain and stop it on exit.

    ``engine``: an already built ``AsyncEngine`` to serve (it is not shut down on exit);
    by default one is built from ``config.engine_config()`` and owned by the server.
    ``session_store``: where sessions live (default: ``build_session_store(config)``).
    ``http_port``: the OpenAI-compatible HTTP front's port (default ``config.http_port``,
    where 0 is off); passed here, 0 binds a free port (tests).
    ``tracing``: OpenTelemetry spans of Generate calls (default: as the standard OTEL_*
    environment variables say, off when none is set; service/tracing.py).

    Three steps: ``_preflight`` checks everything that can be checked cheaply before the
    model loads (keys, TLS files, device, the ports, the disk directory, tracing) and
    binds the ports; ``_build`` loads the engine and builds the service over it;
    ``_start`` starts the fronts. A problem raises ``StartupError`` (or ``ConfigError`` /
    ``ApiKeysError``) with a one-line message, and what was set up is undone.
    """
    start = _preflight(config, engine=engine, metrics=metrics, tracing=tracing, http_port=http_port)
    running: RunningServer | None = None
    try:
        service = await _build(start, session_store)
        running = await _start(start, service)
        yield running
    finally:
        if running is not None:
            await running.shutdown()
        else:
            await _undo(start)
        if start.http_socket is not None:
            start.http_socket.close()
        if start.owns_tracing:
            await asyncio.to_thread(start.tracing.shutdown)  # flush buffered spans


def _preflight(
    config: ServerConfig, *, engine: Any, metrics: ServiceMetrics | None, tracing: Tracing | None, http_port: int | None
) -> _Startup:
    """The checks before the model loads (one-line errors), and the ports bound: gRPC's
    held by a server not yet started, HTTP's by a socket."""
    authenticator = Authenticator(load_api_keys(config.api_keys_file, config.api_keys))
    credentials = server_credentials(config)  # read before the model loads: fail fast
    owns_engine = engine is None
    if owns_engine:
        check_device(config)
    check_port(config.host, config.port)
    if config.metrics_port:
        _bind(config.host, config.metrics_port, "metrics port", "--metrics-port (KVSERVE_METRICS_PORT)").close()
    if owns_engine and (problem := disk_cache_problem(config)) is not None:
        raise StartupError(problem)
    want_http = http_port if http_port is not None else (config.http_port or None)
    http_socket = bind_http_socket(config.host, want_http) if want_http is not None else None
    http_ssl = http_ssl_options(config) if http_socket is not None else {}
    metrics = metrics or ServiceMetrics()
    owns_tracing = tracing is None
    if tracing is None:
        try:
            tracing = Tracing.from_environment(os.environ)
        except ValueError as e:
            raise StartupError(str(e)) from None
    interceptors = (
        [AuthInterceptor(authenticator, on_reject=lambda m: metrics.requests.labels(m, "UNAUTHENTICATED").inc())]
        if authenticator.enabled
        else []
    )
    server = grpc.aio.server(options=grpc_options(config), interceptors=interceptors)
    bind = _bind_address(config.host, config.port)
    try:  # hold the port while the model loads
        port = server.add_secure_port(bind, credentials) if credentials else server.add_insecure_port(bind)
    except RuntimeError:
        port = 0
    if port == 0:
        raise StartupError(f"cannot listen on {bind}; choose another --port (KVSERVE_PORT) or --host (KVSERVE_HOST)")
    return _Startup(
        config=config, authenticator=authenticator, credentials=credentials, metrics=metrics, tracing=tracing,
        owns_tracing=owns_tracing, owns_engine=owns_engine, engine=engine, server=server, port=port,
        http_socket=http_socket, http_ssl=http_ssl,
    )  # fmt: skip


async def _build(start: _Startup, session_store: SessionStore | None) -> _Service:
    """The KV events publisher, the metrics endpoint, the Redis check, the engine (unless
    one was given), then the session table, spill, conversations, session operations, admission, the servicer
    and the reaper over it; each kept in ``start`` as it is made, for ``_undo``."""
    config, metrics = start.config, start.metrics
    start.events = build_kv_events(config) if start.owns_engine else None  # an engine passed in was built without it
    if config.metrics_port:  # served from now on (kvserve_ready is 0 until the model is loaded)
        try:
            start.metrics_port = metrics.serve_http(config.host, config.metrics_port)
        except OSError as e:
            raise StartupError(f"metrics port {config.metrics_port} on {config.host}: {e.strerror or e}; choose "
                               "another --metrics-port (KVSERVE_METRICS_PORT)") from None  # fmt: skip
    await check_redis(config)
    if start.engine is None:
        start.engine = await _build_engine(config, start.events)
    engine = start.engine
    metrics.watch_engine(engine.stats, model_name=config.model or "kvserve-default", block_size=engine.model_info.block_size)
    from .metrics import CacheStoreCollector, KVEventsCollector, SessionStoreCollector, SpillCollector

    if start.events is not None:
        metrics.register(KVEventsCollector(start.events.stats))
    if len(engine.model_info.tiers) > 1:  # a host or Redis tier besides the device
        metrics.register(CacheStoreCollector(engine.cache_stats))
    sessions = SessionManager(
        session_store or build_session_store(config),
        lock_ttl_s=config.session_lock_ttl,
        max_sessions_per_owner=config.max_sessions_per_tenant,
    )
    metrics.register(SessionStoreCollector(sessions))
    spill = SpillScheduler(engine, spill_after_s=config.spill_after, tiers=config.spill_to)
    metrics.register(SpillCollector(spill))
    spill.start()
    limits = Limits(
        max_prompt_tokens=config.max_prompt_tokens,
        max_chat_messages=config.max_chat_messages,
    )
    conversations = Conversations(
        engine,
        sessions,
        metrics,
        max_new_tokens_limit=config.max_new_tokens_limit,
        spill=spill,
        limits=limits,
        shared_cache_salts=config.shared_cache_salts,
        tool_call_parser=config.tool_call_parser,
        strip_volatile_system=config.strip_volatile_system,
    )
    session_ops = SessionOps(engine, sessions, metrics, spill=spill, shared_cache_salts=config.shared_cache_salts)
    admission = Admission(  # one count and one drain for the gRPC and the HTTP front
        max_streams=config.max_streams,
        max_streams_per_tenant=config.max_streams_per_tenant,
        gauge=metrics.active_streams,
    )
    default_max_new_tokens = min(config.default_max_new_tokens, config.max_new_tokens_limit)
    servicer = GenerationServicer(
        conversations,
        metrics,
        session_ops=session_ops,
        default_max_new_tokens=default_max_new_tokens,
        tenant_of=start.authenticator.tenant_of,
        admission=admission,
        tracing=start.tracing,
    )
    if config.session_ttl:
        start.reaper = asyncio.create_task(
            _reap_sessions(session_ops, min(max(config.session_ttl / 4, 0.05), 30.0)), name="kvserve-session-reaper"
        )
    return _Service(sessions, spill, conversations, session_ops, admission, servicer, default_max_new_tokens)


async def _start(start: _Startup, service: _Service) -> RunningServer:
    """The gRPC server (the servicer, health, reflection) started and SERVING, then the HTTP
    front; the ``RunningServer`` that owns them (and the reaper) from then on."""
    config, server, engine = start.config, start.server, start.engine
    add_to_server(service.servicer, server)  # unparsable requests: INVALID_ARGUMENT
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    start.metrics.ready.set(1)
    http_server, http_task, bound_http = await _start_http(start, service)
    running = RunningServer(
        config=config,
        port=start.port,
        address=_client_address(config.host, start.port),
        engine=engine,
        servicer=service.servicer,
        admission=service.admission,
        conversations=service.conversations,
        session_ops=service.session_ops,
        sessions=service.sessions,
        metrics=start.metrics,
        spill=service.spill,
        health=health_servicer,
        server=server,
        authenticator=start.authenticator,
        metrics_port=start.metrics_port,
        http_port=bound_http,
        http_server=http_server,
        http_task=http_task,
        owns_engine=start.owns_engine,
        reaper=start.reaper,
        events=start.events,
    )
    start.reaper = None  # owned by running now
    log.info(
        "serving %s on %s (model %s, %s, %s)%s",
        SERVICE_NAME, _bind_address(config.host, start.port), engine.model_info.architecture,
        engine.model_info.device, engine.model_info.dtype,
        (f"; metrics on :{start.metrics_port}/metrics" if start.metrics_port else "")
        + (f"; OpenAI-compatible HTTP on :{bound_http}" if bound_http else ""),
    )  # fmt: skip
    log.info(
        "security: %s; %s; shared cache salts: %s",
        "TLS" + (" with client certificates (mutual TLS)" if config.tls_client_ca else "") if start.credentials
        else "plaintext (no TLS)",
        f"API keys for {len(tenant_map(start.authenticator.keys))} tenant(s)" if start.authenticator.enabled
        else "no API keys (every caller is one tenant)",
        ", ".join(config.shared_cache_salts) or "none",
    )  # fmt: skip
    return running


async def _start_http(start: _Startup, service: _Service) -> tuple[Any, asyncio.Task | None, int | None]:
    """The OpenAI-compatible HTTP front on the socket ``_preflight`` bound, once uvicorn
    has started: (its server, its task, its port); (None, None, None) when it is off."""
    if start.http_socket is None:
        return None, None, None
    from .http.app import HttpFront, make_uvicorn_server

    config = start.config
    http_limits = http_limits_of(config, start.engine.model_info.context_length)
    front = HttpFront(
        service.conversations,
        service.admission,
        start.authenticator,
        start.metrics,
        session_ops=service.session_ops,
        model_id=config.model or "kvserve-default",
        max_body_bytes=config.max_message_size,
        default_max_new_tokens=service.default_max_new_tokens,
        tracing=start.tracing,
        limits=http_limits,
    )
    http_server = make_uvicorn_server(
        front.app, ssl=start.http_ssl, log_level=config.log_level, limits=http_limits, metrics=start.metrics
    )
    bound_http = start.http_socket.getsockname()[1]
    http_task = asyncio.create_task(http_server.serve(sockets=[start.http_socket]), name="kvserve-http")
    while not http_server.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http_task.done():
        http_task.result()  # raises what stopped it
        raise StartupError(f"the HTTP front on port {bound_http} stopped at startup")
    return http_server, http_task, bound_http


async def _undo(start: _Startup) -> None:
    """A start that failed (or was cancelled) before a ``RunningServer`` owned it: stop what
    ``start`` holds (the reaper, an engine it built, the KV events, the port, metrics)."""
    if start.reaper is not None:
        start.reaper.cancel()
    if start.owns_engine and start.engine is not None:
        await start.engine.shutdown(0.0)
    if start.events is not None:
        await asyncio.to_thread(start.events.close)
    await start.server.stop(None)  # releases the port
    start.metrics.stop_http()


async def run(config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT, drain for ``config.drain_timeout``, return 0 (or
    ``EXIT_UNSAVED``: the drain left acknowledged session changes in no durable place).

    A signal during startup (the model loading) stops it there, before anything is
    served ("serving ..." is never logged): 128 + the signal's number (130 for Ctrl-C)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    got: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop, got)
    started = asyncio.Event()

    status: list[int] = []

    async def serving() -> None:
        async with serve(config) as running:
            started.set()
            await stop.wait()
            log.info("shutting down: draining for up to %.1f s", config.drain_timeout)
            await running.shutdown()
            status.append(running.exit_status)

    main = asyncio.create_task(serving(), name="kvserve-serve")
    signalled = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({main, signalled}, return_when=asyncio.FIRST_COMPLETED)
        if main.done() or started.is_set():  # startup failed, or the signal came while serving: the drain ran
            await main
            return status[0] if status else 0
        log.info("%s during startup: stopping before serving", got[0].name)
        main.cancel()
        try:
            await main
        except asyncio.CancelledError:
            pass
        return 128 + int(got[0])
    finally:
        signalled.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _on_signal(sig: signal.Signals, stop: asyncio.Event, got: list[signal.Signals]) -> None:
    if stop.is_set():
        log.info("%s again: already stopping", sig.name)
    else:
        log.info("received %s", sig.name)
        got.append(sig)
    stop.set()
