"""asyncio front of the engine: the LLMEngine runs on its own thread.

``generate()`` is an async generator of events (a request with n > 1 ends after its
n-th ``Finished``). A stream's tokens reach it at most once per ``stream_interval_s``
(the ``--stream-interval`` setting; ``STREAM_INTERVAL_S``, 20 ms, by default): the first
token goes at once, tokens generated within the interval after a delivery are held and delivered together in one ``Delta`` (one
message on the wire, not one per token), and the sequence's end ends the hold. A model
slower than one token per interval per stream gets each token as it comes; a fast one
(a tiny model, many streams on a CPU) sends a few tokens per message instead of paying
the per-message cost of gRPC or SSE per token. The engine thread keeps the deltas of an
interval too and wakes the event loop only for what someone waits on (a request's first
token, its end, any event that is not a delta) or once the interval is over: each wake
costs the engine thread the GIL and a context switch or two, which on a small model on a
CPU doubled the time of a decode step. Closing it early (the gRPC call was
cancelled, the client went away, the deadline passed) aborts the request: the engine
finishes it on its next step and releases its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, AsyncIterator

from .config import EngineConfig
from .engine import Emitted, LLMEngine
from .store import build_store
from ..models.tokenizer import Tokenizer
from ..types import (
    CacheScope,
    CacheStats,
    Delta,
    EngineStats,
    EngineStopped,
    Event,
    Finished,
    GenerationRequest,
    ModelInfo,
    ResponseFormat,
    RetainedPrefix,
    Tier,
    WarmResult,
)

if TYPE_CHECKING:
    from ..kv_events import KVEvents

log = logging.getLogger(__name__)

STREAM_INTERVAL_S = 0.020  # a stream's deltas are at least this far apart (see the module docstring)


class AsyncEngine:
    """The front's one typed seam to the engine: ``generate``, ``validate``, ``abort``, ``check_format``,
    ``stats``, ``cache_stats`` (a ``CacheStats`` snapshot), ``model_info``, ``tokenizer``,
    ``spill``, ``flush_store``, ``forget``, ``block_locations``, ``warm`` and ``retain``. The front (servicer,
    conversations, spill, metrics) uses nothing else; ``engine`` (the ``LLMEngine`` on its
    thread) is for this package and the engine's tests.

    It only hops threads: every call on the engine is one of ``LLMEngine``'s typed
    methods, run on the engine thread (``call_soon``), a worker thread (the blocking
    ones) or here (the thread-safe ones); it reads no engine attribute
    (tests/unit/test_imports.py keeps it so)."""

    def __init__(self, engine: LLMEngine, stream_interval_s: float = STREAM_INTERVAL_S) -> None:
        self.engine = engine
        self.stream_interval_s = stream_interval_s  # 0: every delta as it comes
        self.model_info: ModelInfo = engine.get_model_info()
        self.tokenizer: Tokenizer = engine.get_tokenizer()
        self._queues: dict[str, asyncio.Queue[Event]] = {}
        # streams holding deltas: the future that ends the hold, the loop time it may end
        self._holds: dict[str, tuple[asyncio.Future[None], float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.loop_error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        eng = self.engine
        pending: Emitted = []  # emitted, not yet handed to the event loop
        flush_at = 0.0  # monotonic time from which pending deltas go
        streaming: set[str] = set()  # requests whose first token was handed over

        def flush() -> None:
            nonlocal pending
            if pending:
                self._dispatch_threadsafe(pending)
                pending = []

        while not self._stop.is_set():
            if not eng.has_work():
                flush()
                eng.wait_for_work(0.05)
                continue
            try:
                emitted = eng.step()
            except Exception as exc:  # a bug in a step must not kill the server
                log.exception("engine step failed; failing the requests in flight")
                self.loop_error = exc
                emitted = eng.fail_all(f"internal engine error: {type(exc).__name__}")
            now = time.monotonic()
            if not emitted:
                if now >= flush_at:  # a step that emitted nothing (a preemption)
                    flush()
                continue
            pending.extend(emitted)
            # Waking the event loop costs the engine thread the GIL and a context switch
            # or two, so a step's events go to it at once only when someone waits on them
            # (a request's first token, its end, anything but a delta; every step with a
            # stream interval of 0), else the deltas of one interval go together: the
            # streams would hold them that long anyway (``generate``).
            urgent = self.stream_interval_s <= 0 or now >= flush_at
            for rid, event in emitted:
                if not isinstance(event, Delta):
                    urgent = True
                    streaming.discard(rid)
                elif rid not in streaming:
                    urgent = True
                    streaming.add(rid)
            if urgent:
                flush()
                flush_at = now + self.stream_interval_s
        flush()

    def _dispatch_threadsafe(self, emitted: Emitted) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._dispatch, emitted)
        except RuntimeError:  # the event loop is closed (process exiting)
            pass

    def _dispatch(self, emitted: Emitted) -> None:
        holds = self._holds
        now = self._loop.time() if holds and self._loop is not None else 0.0
        for rid, event in emitted:
            q = self._queues.get(rid)
            if q is not None:
                q.put_nowait(event)
                hold = holds.get(rid) if holds else None
                if hold is not None and (now >= hold[1] or not isinstance(event, Delta)):
                    _wake(hold[0])  # its interval is over (released with this step's token) or it ended

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to ``grace_s``, then stop."""
        self.engine.stop_accepting()
        deadline = time.monotonic() + grace_s
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for rid in list(self._queues):
            self.engine.abort(rid)
        t_end = time.monotonic() + 2.0
        while self._queues and time.monotonic() < t_end:
            await asyncio.sleep(0.01)
        self._stop.set()
        self.engine.wake()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        self.engine.close()

    # ---- requests --------------------------------------------------------------------

    def validate(self, req: GenerationRequest) -> None:
        self.engine.validate(req)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Event]:
        if self._stop.is_set() or not self.engine.is_accepting():
            raise EngineStopped("the server is shutting down")
        if req.request_id in self._queues:
            raise ValueError(f"duplicate request id {req.request_id}")
        q: asyncio.Queue[Event] = asyncio.Queue()
        self._queues[req.request_id] = q
        finished = False
        remaining = req.sampling.n  # the request ends with its n-th Finished
        ready: deque[Event] = deque()  # taken from the queue while merging deltas, yielded next
        interval = self.stream_interval_s
        loop = asyncio.get_running_loop()
        next_at = 0.0  # loop time before which a delta is held (the first is not)
        try:
            self.engine.add_request(req)  # raises InvalidRequest / QueueFull / EngineStopped
            while True:
                if not ready:
                    first = await q.get()
                    if interval > 0 and isinstance(first, Delta) and loop.time() < next_at:
                        await self._hold(req.request_id, q, next_at, interval)
                    ready.extend(_merge_deltas(first, q))
                event = ready.popleft()
                yield event
                if interval > 0 and isinstance(event, Delta):
                    next_at = loop.time() + interval
                if isinstance(event, Finished):
                    remaining -= 1
                    if remaining == 0:
                        finished = True
                        return
        finally:
            self._queues.pop(req.request_id, None)
            if not finished:
                self.engine.abort(req.request_id)

    async def _hold(self, rid: str, q: asyncio.Queue[Event], until: float, interval: float) -> None:
        """Hold ``rid``'s deltas until the first step that emits after loop time ``until``
        (``_dispatch`` ends the hold, so the streams of one step are released together, in
        one pass of the event loop) or until its sequence ends; the deltas queued meanwhile
        are then merged into one. A timer ends the hold one interval later if no step
        comes (a preempted sequence)."""
        if any(not isinstance(e, Delta) for e in q._queue):  # type: ignore[attr-defined]
            return  # the end is already there: deliver what is queued now
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        timer = loop.call_at(until + interval, _wake, fut)
        self._holds[rid] = (fut, until)
        try:
            await fut
        finally:
            timer.cancel()
            self._holds.pop(rid, None)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def check_format(self, fmt: ResponseFormat) -> None:
        """Compile a response_format's grammar (cached by hash) in a worker thread:
        InvalidRequest when it is invalid or unsupported."""
        await asyncio.to_thread(self.engine.compile_format, fmt)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def cache_stats(self) -> CacheStats:
        """A snapshot of the device pool and the store (see ``CacheStats``)."""
        return self.engine.cache_stats()

    # ---- the cache store -------------------------------------------------------------

    async def spill(
        self, token_ids: list[int], scope: CacheScope, tiers: tuple[str, ...]
    ) -> tuple[int, dict[str, int]]:
        """Write the device blocks of a transcript to ``tiers`` (by the store's background
        writer) and wait until it is through: (blocks, how many each tier now holds)."""
        if not self.engine.has_store():
            return 0, {}
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, dict[str, int]]] = loop.create_future()

        def done(n: int, held: dict[str, int]) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result((n, held)))

        self.engine.call_soon(lambda: self.engine.spill(token_ids, scope, tiers, done))
        return await fut

    async def flush_store(self, timeout_s: float) -> bool:
        """Wait for queued writes to reach their tiers (bounded)."""
        return await asyncio.to_thread(self.engine.flush_store, timeout_s)

    async def forget(
        self, token_ids: list[int], scope: CacheScope, timeout_s: float = 10.0, *, keep_blocks: int = 0
    ) -> dict[Tier, int]:
        """Stop the full blocks of a transcript from being found: the device prefix map
        (on the engine thread, between steps), then every store tier
        (``TieredStore.delete_many``). The first ``keep_blocks`` full blocks are left (a
        forked session's blocks shared with its source). Returns how many entries each
        tier dropped.

        KV blocks are content-addressed, so "a session's blocks" are the full blocks of
        its transcript in its namespace. Another transcript of the same namespace (same
        tenant and salt) with the same leading blocks loses those entries too and
        recomputes them, nothing worse; other tenants' blocks are in other namespaces."""
        loop = asyncio.get_running_loop()
        dropped: asyncio.Future[int] = loop.create_future()

        def drop_device() -> None:  # on the engine thread
            n = 0
            try:
                n = self.engine.forget_device(token_ids, scope, keep_blocks=keep_blocks)
            finally:
                loop.call_soon_threadsafe(lambda: dropped.done() or dropped.set_result(n))

        self.engine.call_soon(drop_device)
        out: dict[Tier, int] = {Tier.DEVICE: await asyncio.wait_for(dropped, timeout_s)}
        stored = await asyncio.to_thread(
            self.engine.forget_stored, token_ids, scope, keep_blocks=keep_blocks, timeout_s=timeout_s
        )
        out.update(stored)
        return out

    async def warm(self, token_ids: list[int], scope: CacheScope, tenant: str, timeout_s: float = 30.0) -> WarmResult:
        """Warm a transcript up for its next turn (``LLMEngine.warm``, on the engine
        thread, its loads on the restore thread) and wait until it is through: where
        its full blocks are now (``WarmResult``). ``tenant``: whose warm-up share it
        counts against."""
        if self._stop.is_set() or not self.engine.is_accepting():
            raise EngineStopped("the server is shutting down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[WarmResult] = loop.create_future()

        def done(result: WarmResult) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        def run() -> None:  # on the engine thread
            try:
                self.engine.warm(token_ids, scope, tenant, done)
            except BaseException as exc:
                loop.call_soon_threadsafe(lambda e=exc: fut.done() or fut.set_exception(e))  # exc: gone after except
                raise

        self.engine.call_soon(run)
        return await asyncio.wait_for(fut, timeout_s)

    async def retain(
        self, token_ids: list[int], scope: CacheScope, ttl_s: float, timeout_s: float = 30.0
    ) -> RetainedPrefix:
        """Retain a transcript's full blocks for ``ttl_s`` seconds (``LLMEngine.retain``:
        a session's pin; its tenant's bound, ``RetentionRefused`` past it) and wait until
        the store answered: what it kept."""
        if self._stop.is_set() or not self.engine.is_accepting():
            raise EngineStopped("the server is shutting down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RetainedPrefix] = loop.create_future()

        def done(kept: RetainedPrefix) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(kept))

        def run() -> None:  # on the engine thread
            try:
                self.engine.retain(token_ids, scope, ttl_s, done)
            except BaseException as exc:
                loop.call_soon_threadsafe(lambda e=exc: fut.done() or fut.set_exception(e))  # exc: gone after except
                if not isinstance(exc, Exception):
                    raise

        self.engine.call_soon(run)
        return await asyncio.wait_for(fut, timeout_s)

    async def block_locations(self, token_ids: list[int], scope: CacheScope) -> dict[Tier, int]:
        """How many of the transcript's full blocks each tier holds now."""
        return await asyncio.to_thread(self.engine.block_locations, token_ids, scope)


def _wake(fut: asyncio.Future[None] | None) -> None:
    if fut is not None and not fut.done():
        fut.set_result(None)


def _merge_deltas(first: Event, q: asyncio.Queue[Event]) -> list[Event]:
    """A consumer that lags behind the engine gets every queued token of a sequence in
    one event (one message on the wire instead of one per token): ``first`` and the
    deltas queued behind it, merged per sequence index (first-seen order; each index's
    tokens stay in order), then the first other event (a Finished) if one was reached."""
    if not isinstance(first, Delta):
        return [first]
    merged: dict[int, Delta] = {first.index: first}
    tail: list[Event] = []
    while not q.empty():
        nxt = q.get_nowait()
        if not isinstance(nxt, Delta):
            tail.append(nxt)
            break
        m = merged.get(nxt.index)
        merged[nxt.index] = nxt if m is None else Delta(
            m.token_ids + nxt.token_ids, m.text + nxt.text, m.logprobs + nxt.logprobs, m.index
        )  # fmt: skip
    return [*merged.values(), *tail]


async def build_engine(cfg: EngineConfig, events: KVEvents | None = None) -> AsyncEngine:
    """Load the model (off the event loop), build the engine and start its thread.
    ``events``: the KV events publisher (service/kv_events.py), attached to the store
    (what its durable tiers hold is announced first) and told of the device pool's
    changes."""
    from ..models.loading import load_model

    loaded = await asyncio.to_thread(
        load_model,
        str(cfg.resolved_model_path()),
        dtype=cfg.dtype,  # "auto" is resolved by the loader, as the device is
        device=cfg.device,
        weight_format=cfg.weight_format,
        pack_weights=cfg.pack_weights,
        native_kernels=cfg.native_kernels,
    )
    if loaded.native == "on":
        from .. import kernels

        log.info("decode products by the native CPU kernels (%s)", kernels.isa())
    elif loaded.native is not None:
        log.info("native CPU kernels unavailable (%s): torch's kernels serve decode", loaded.native)
    if loaded.weight_format != "exact":
        log.info("weights served as %s (quantized at load; fingerprint %s)", loaded.weight_format, loaded.fingerprint[:12])
    if cfg.kv_cache_format == "fp8" and loaded.device.type == "cpu":
        log.warning("--kv-cache-format fp8 on the CPU: torch's attention reads it; int8 takes the same bytes per "
                    "token, has less error, and the native kernels read it (1.2x to 27x faster decode: "
                    "docs/benchmarks.md, KV cache formats)")
    store = build_store(cfg, loaded)
    if events is not None:
        await asyncio.to_thread(events.attach, device=loaded.device.type, store=store)
    engine = LLMEngine(loaded, cfg, store=store, events=events)
    aengine = AsyncEngine(engine, stream_interval_s=cfg.stream_interval_s)
    aengine.start()
    return aengine
