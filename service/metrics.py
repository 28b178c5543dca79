"""Prometheus metrics of the service, on a registry of their own (no module globals).

``ServiceMetrics`` owns a ``CollectorRegistry``. Request-path metrics are counters and
histograms updated by the servicer; engine state (running/waiting sequences, KV
blocks, prefill/decode token counters) is read from ``engine.stats()`` at scrape time
by ``EngineStatsCollector``, so it is never stale and costs nothing between scrapes.

Other parts add theirs with ``metrics.register(collector)`` (any object with a
``collect()`` yielding metric families, e.g. the cache store's per-tier statistics in
issue 4) or by creating metrics with ``registry=metrics.registry``.

Cached prompt tokens are reported per tier next to the prompt-token total (the
denominator), so a hit rate is ``sum(cached_prompt_tokens) / prompt_tokens``.

The scheduler's figures are exported twice from the same snapshot: as kvserve's own and
under vLLM's names (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ...), the
ones the inference gateways' endpoint pickers and routers scrape (``GatewayCollector``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .types import CacheStats, EngineStats, Tier

if TYPE_CHECKING:
    from .kv_events import KVEventsStats

# seconds; TTFT spans sub-millisecond device hits to multi-second cold prefills
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class EngineStatsCollector:
    """Gauges and counters read from ``stats()`` (an ``EngineStats``) on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], prefix: str = "kvserve") -> None:
        self._stats = stats
        self._p = prefix

    def describe(self) -> Iterable[Metric]:
        return []  # families are created at collect time; nothing to pre-register

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        p = self._p
        yield GaugeMetricFamily(f"{p}_running_sequences", "Sequences in the running batch.", value=s.running)
        yield GaugeMetricFamily(f"{p}_waiting_sequences", "Requests waiting for admission.", value=s.waiting)
        blocks = GaugeMetricFamily(
            f"{p}_kv_blocks", "Device KV blocks by state (used: held by running sequences; "
            "free: allocatable now, including cached; cached: evictable blocks holding a hash).",
            labels=["state"],
        )  # fmt: skip
        blocks.add_metric(["used"], s.blocks_total - s.blocks_free)
        blocks.add_metric(["free"], s.blocks_free)
        blocks.add_metric(["cached"], s.blocks_cached)
        yield blocks
        yield GaugeMetricFamily(f"{p}_kv_blocks_total", "Device KV blocks in the pool.", value=s.blocks_total)
        yield CounterMetricFamily(
            f"{p}_engine_prefill_tokens", "Tokens run through the model as prompt.", value=s.prefill_tokens
        )
        yield CounterMetricFamily(
            f"{p}_engine_decode_tokens", "Tokens run through the model as decode steps (drafts verified included).",
            value=s.decode_tokens,
        )  # fmt: skip
        # speculative decoding: acceptance rate = accepted / draft; tokens per verify step =
        # (steps + accepted) / steps
        yield CounterMetricFamily(
            f"{p}_spec_verify_steps", "Speculative verify forwards, one per sequence (--speculative ngram).",
            value=s.spec_steps,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_spec_draft_tokens", "Tokens drafted (from the sequences' own history or the draft pool) and verified.",
            value=s.spec_draft_tokens,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_spec_accepted_tokens", "Drafted tokens accepted (each one an output token without a step of its own).",
            value=s.spec_accepted_tokens,
        )  # fmt: skip
        if s.step_tokens:
            yield step_tokens_histogram(f"{p}_spec_tokens_per_step", s.step_tokens)
        yield from self._draft_pool(p, s)

    @staticmethod
    def _draft_pool(p: str, s: EngineStats) -> Iterable[Metric]:
        """The draft pool's figures (engine/draft_pool.py; zeros with --draft-pool-memory 0)."""
        yield GaugeMetricFamily(f"{p}_spec_pool_bytes", "Bytes the draft pool charges now (--draft-pool-memory bounds it).",
                                value=s.spec_pool_bytes)  # fmt: skip
        yield GaugeMetricFamily(f"{p}_spec_pool_tokens", "Tokens the draft pool holds now.", value=s.spec_pool_tokens)
        yield CounterMetricFamily(f"{p}_spec_pool_evictions", "Draft pool entries evicted to stay within its memory.",
                                  value=s.spec_pool_evictions)  # fmt: skip
        yield CounterMetricFamily(f"{p}_spec_pool_hits", "Draft pool lookups that gave a candidate (longer than the "
                                  "sequence's own match).", value=s.spec_pool_hits)  # fmt: skip


class GatewayCollector:
    """The scheduler's figures under vLLM's names, labelled ``model_name`` and ``engine``
    as vLLM's are, read from the same ``EngineStats`` snapshot: what the Gateway API
    Inference Extension's endpoint picker (llm-d's included) and the vLLM routers scrape
    to balance load (its model server protocol: queued and running requests, KV cache
    utilization, the block size and pool size of ``vllm:cache_config_info``)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, block_size: int) -> None:
        self._stats = stats
        self._labels = (model_name, "0")
        self._block_size = block_size

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        s = self._stats()
        names = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            fam = GaugeMetricFamily(name, doc, labels=names)
            fam.add_metric(self._labels, value)
            return fam

        yield gauge("vllm:num_requests_running", "Sequences in the running batch (kvserve_running_sequences).", s.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting for admission (kvserve_waiting_sequences).", s.waiting)
        used = (s.blocks_total - s.blocks_free) / s.blocks_total if s.blocks_total else 0.0
        doc = "Fraction of the device KV pool's blocks held by running sequences, 0 to 1 (cached idle blocks are free)."
        yield gauge("vllm:kv_cache_usage_perc", doc, used)
        yield gauge("vllm:gpu_cache_usage_perc", doc + " The name before vLLM 0.10, which older endpoint pickers read.", used)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "The KV cache's configuration in labels (value 1): block size in tokens and "
            "blocks in the device pool, which the endpoint picker's prefix-cache scorer reads.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )  # fmt: skip
        info.add_metric([str(self._block_size), str(s.blocks_total), "True"], 1.0)
        yield info


class KVEventsCollector:
    """The KV events publisher's figures (service/kv_events.py), read at scrape time."""

    def __init__(self, stats: Callable[[], KVEventsStats], prefix: str = "kvserve") -> None:
        self._stats = stats
        self._p = prefix

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        p, s = self._p, self._stats()
        yield CounterMetricFamily(f"{p}_kv_events_batches", "KV events batches published (one ZMQ message each).", value=s.batches)
        events = CounterMetricFamily(f"{p}_kv_events", "KV events published, by type.", labels=["type"])
        for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
            events.add_metric([kind], s.events.get(kind, 0))
        yield events
        resyncs = CounterMetricFamily(
            f"{p}_kv_events_resyncs", "Resyncs published (AllBlocksCleared, then every block held), by reason: start "
            "(the first batch: what the durable tiers still hold), overflow (more changes queued than the publisher "
            "took: the queue was dropped).", labels=["reason"],
        )  # fmt: skip
        for reason, n in sorted(s.resyncs.items()):
            resyncs.add_metric([reason], n)
        yield resyncs
        replays = CounterMetricFamily(
            f"{p}_kv_events_replays", "Replay requests answered, by answer: buffered (the batches from the asked "
            "sequence number), snapshot (asked from before the buffer: one batch with the whole state).", labels=["answer"],
        )  # fmt: skip
        for answer, n in sorted(s.replays.items()):
            replays.add_metric([answer], n)
        yield replays
        blocks = GaugeMetricFamily(f"{p}_kv_events_blocks", "Blocks a subscriber holds now from the events, by medium.", labels=["medium"])
        for medium, n in sorted(s.blocks.items()):
            blocks.add_metric([medium], n)
        yield blocks


TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)


def step_tokens_histogram(name: str, counts: tuple[int, ...]) -> HistogramMetricFamily:
    """``counts[n]``: sequence-steps that gave n output tokens (EngineStats.step_tokens) as
    a histogram over TOKENS_PER_STEP_BUCKETS (cumulative buckets, the sum of tokens)."""
    buckets = []
    for le in TOKENS_PER_STEP_BUCKETS:
        buckets.append((str(float(le)), sum(counts[1 : le + 1])))
    buckets.append(("+Inf", sum(counts[1:])))
    total = sum(n * c for n, c in enumerate(counts))
    return HistogramMetricFamily(
        name, "Output tokens one sequence got from one step (a decode row 1; a speculative verification 1 + "
        "its accepted drafts).", buckets=buckets, sum_value=total,
    )  # fmt: skip


class CacheStoreCollector:
    """Per-tier cache statistics read from the engine and its store at scrape time:
    lookups and hits (the denominator is ``kvserve_prompt_tokens``), restore bytes and
    seconds, writes, spills, evictions, failures by reason, Redis errors and breaker
    state, and what each tier holds."""

    def __init__(self, cache_stats: Callable[[], CacheStats], prefix: str = "kvserve") -> None:
        self._cache_stats = cache_stats  # AsyncEngine.cache_stats
        self._p = prefix

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        snap = self._cache_stats()
        yield from self._tiers(snap)
        yield from self._store(snap)
        yield from self._warm(snap)
        yield from self._retention(snap)

    def _tiers(self, snap: CacheStats) -> Iterable[Metric]:
        """Per tier: lookups, restores, writes, evictions, errors, failures, what it holds."""
        p, st = self._p, snap.store
        tiers = st.tiers if st is not None else {}

        def family(kind, name, doc, extra_labels=()):
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            return cls(f"{p}_{name}", doc, labels=["tier", *extra_labels])

        hits = family("counter", "cache_tier_hit_blocks", "Blocks found (and verified) in a tier.")
        misses = family("counter", "cache_tier_miss_blocks", "Blocks looked for and not usable in a tier.")
        read_b = family("counter", "cache_restore_bytes", "Bytes restored from a tier.")
        read_s = family("counter", "cache_restore_seconds", "Seconds spent restoring from a tier.")
        write_b = family("counter", "cache_write_bytes", "Bytes written into a tier.")
        puts = family("counter", "cache_put_blocks", "Blocks newly stored in a tier.")
        evict = family("counter", "cache_evicted_blocks", "Blocks a tier dropped to make room (the device and host demote them).")
        errors = family("counter", "cache_tier_errors", "Backend errors (connection, timeout, server error).")
        fails = family("counter", "cache_restore_failures", "Blocks that could not be used, by reason.", ["reason"])
        held_b = family("gauge", "cache_bytes_held", "Bytes of KV held by a tier (where known cheaply).")
        held_n = family("gauge", "cache_blocks_held", "KV blocks held by a tier (where known cheaply).")
        rate = family("gauge", "cache_restore_rate_bytes_per_second", "Measured restore rate (EWMA) per tier.")

        held_n.add_metric([Tier.DEVICE], snap.device_blocks_held)
        held_b.add_metric([Tier.DEVICE], snap.device_bytes_held)
        evict.add_metric([Tier.DEVICE], snap.device_evictions)
        for name, t in tiers.items():
            hits.add_metric([name], t.hits)
            misses.add_metric([name], t.misses)
            read_b.add_metric([name], t.bytes_out)
            read_s.add_metric([name], t.read_seconds)
            write_b.add_metric([name], t.bytes_in)
            puts.add_metric([name], t.puts)
            evict.add_metric([name], t.evictions)
            errors.add_metric([name], t.errors)
            for reason, n in sorted(t.failures.items()):
                fails.add_metric([name, reason], n)
            if t.bytes_held is not None:
                held_b.add_metric([name], t.bytes_held)
            if t.blocks_held is not None:
                held_n.add_metric([name], t.blocks_held)
            if name in st.restore_rates:
                rate.add_metric([name], st.restore_rates[name])
        yield from (hits, misses, read_b, read_s, write_b, puts, evict, errors, fails, held_b, held_n, rate)

    def _store(self, snap: CacheStats) -> Iterable[Metric]:
        """The store's writer, Redis' breaker, the restore decisions, demotions, skips."""
        p, st = self._p, snap.store
        tiers = st.tiers if st is not None else {}
        if st is not None:
            w = st.writer
            yield GaugeMetricFamily(f"{p}_cache_writer_queued_blocks", "Blocks waiting for the background writer.", value=w.queued_blocks)
            yield CounterMetricFamily(f"{p}_cache_spilled_blocks", "Blocks accepted for background spill (idle sessions, drain).", value=w.submitted_blocks)
            yield CounterMetricFamily(f"{p}_cache_spill_dropped_blocks", "Blocks not spilled because the writer queue was full.", value=w.dropped_blocks)
            yield CounterMetricFamily(f"{p}_cache_demoted_blocks", "Evicted blocks queued for Redis (host evictions; device evictions when there is no host tier).", value=w.demoted_blocks)
            yield CounterMetricFamily(f"{p}_cache_demotions_dropped_blocks", "Evicted blocks not queued for Redis: no staging buffer free, writer queue full or Redis' breaker open.", value=w.demotions_dropped)
            redis = tiers.get(Tier.REDIS)
            if redis is not None:
                breaker = GaugeMetricFamily(f"{p}_redis_breaker_open", "1 while the Redis circuit breaker skips Redis.", labels=["state"])
                for state in ("closed", "open", "half_open"):
                    breaker.add_metric([state], 1.0 if redis.breaker_state == state else 0.0)
                yield breaker
                yield CounterMetricFamily(f"{p}_redis_breaker_opens", "Times the Redis breaker opened.", value=redis.breaker_opens)
        decisions = CounterMetricFamily(
            f"{p}_cache_restore_decision_blocks",
            "Blocks found in a tier, by what the restore-or-recompute decision did with them and why.",
            labels=["tier", "decision", "reason"],
        )
        for (tier, decision, reason), n in sorted((st.decisions if st is not None else {}).items()):
            decisions.add_metric([tier, decision, reason], n)
        yield decisions
        yield CounterMetricFamily(
            f"{p}_cache_demotion_sync_copies",
            "Device demotions copied synchronously: no pinned staging buffer was free (CUDA; 0 on the CPU).",
            value=snap.sync_demotions,
        )
        yield CounterMetricFamily(
            f"{p}_cache_restores_skipped", "Restores cut because recomputing was estimated faster.",
            value=snap.restores_skipped,
        )

    def _warm(self, snap: CacheStats) -> Iterable[Metric]:
        """Session warm-ups (WarmSession; service/engine/warm.py), when the engine has them."""
        p, warm = self._p, snap.warm
        if warm is not None:
            yield CounterMetricFamily(f"{p}_warm_requests", "Session warm-ups asked for (WarmSession, POST /v1/sessions/{id}/warm).", value=warm.requests)
            restored = CounterMetricFamily(f"{p}_warm_restored_blocks", "Blocks session warm-ups restored into the device pool, by the tier they came from.", labels=["tier"])
            for tier in (Tier.HOST, Tier.DISK, Tier.REDIS):
                restored.add_metric([tier], warm.blocks_restored.get(tier, 0))
            yield restored
            yield GaugeMetricFamily(f"{p}_warm_held_blocks", "Device blocks held now for a warmed session's coming turn.", value=warm.pinned_blocks)
            yield CounterMetricFamily(f"{p}_warm_hits", "Turns admitted with warmed blocks among their device hits.", value=warm.hits)
            yield CounterMetricFamily(f"{p}_warm_claimed_blocks", "Warmed blocks a turn used.", value=warm.claimed_blocks)
            wasted = CounterMetricFamily(f"{p}_warm_wasted_blocks", "Warmed blocks let go unused: expired (--warm-ttl passed), reclaimed (a sequence needed the block), forgotten (the session was deleted).", labels=["reason"])
            for reason, n in sorted(warm.wasted_blocks.items()):
                wasted.add_metric([reason], n)
            yield wasted

    def _retention(self, snap: CacheStats) -> Iterable[Metric]:
        """Retentions (docs/api.md, Retention): what each tier pins, what expired, what
        the engine was asked, refused and kept."""
        p, st = self._p, snap.store
        tiers = st.tiers if st is not None else {}
        blocks = GaugeMetricFamily(f"{p}_cache_retained_blocks", "KV blocks a retention pins in a tier now (Redis: "
                                   "every replica's, in its retained set).", labels=["tier"])  # fmt: skip
        nbytes = GaugeMetricFamily(f"{p}_cache_retained_bytes", "Bytes of the KV blocks a retention pins in a tier now.",
                                   labels=["tier"])  # fmt: skip
        expired = CounterMetricFamily(f"{p}_retention_expired_blocks", "Pins a tier released because their "
                                      "retention's time passed (Redis: those this replica released).", labels=["tier"])  # fmt: skip
        safe = GaugeMetricFamily(f"{p}_retention_eviction_safe", "1 when a tier's own eviction leaves retained "
                                 "blocks alone (Redis: its maxmemory-policy), 0 when it may evict them; absent "
                                 "when it does not say.", labels=["tier"])  # fmt: skip
        for name, t in tiers.items():
            if t.blocks_retained is not None:
                blocks.add_metric([name], t.blocks_retained)
            if t.bytes_retained is not None:
                nbytes.add_metric([name], t.bytes_retained)
            if name in (st.retain_to if st is not None else ()):
                expired.add_metric([name], t.retention_expired)
        for name, ok in (st.retention_safe if st is not None else {}).items():
            if ok is not None:
                safe.add_metric([name], 1.0 if ok else 0.0)
        yield from (blocks, nbytes, expired, safe)
        book = st.retention if st is not None else None
        if book is not None:
            yield GaugeMetricFamily(f"{p}_retention_tenants", "Tenants retaining KV blocks now.", value=book.owners)
            yield GaugeMetricFamily(f"{p}_retention_reserved_blocks", "Blocks held in tenants' bounds for "
                                    "retentions being written.", value=book.reserved_blocks)  # fmt: skip
        counts = snap.retention
        if counts is None:
            return
        yield CounterMetricFamily(f"{p}_retention_requests", "Requests and session pins that asked for a retention.",
                                  value=counts.requests)  # fmt: skip
        refusals = CounterMetricFamily(f"{p}_retention_refusals", "Retentions refused before anything ran, by reason: "
                                       "tenant_bound (past --retention-tenant-memory), unavailable (no tier to keep "
                                       "them, or retentions off).", labels=["reason"])  # fmt: skip
        for reason, n in sorted(counts.refusals.items()):
            refusals.add_metric([reason], n)
        yield refusals
        yield CounterMetricFamily(f"{p}_retention_retained_tokens", "Prompt tokens retentions kept (refreshes included).",
                                  value=counts.retained_tokens)  # fmt: skip
        yield CounterMetricFamily(f"{p}_retention_created_tokens", "Prompt tokens turns computed and retained "
                                  "(cache creation).", value=counts.created_tokens)  # fmt: skip
        yield CounterMetricFamily(f"{p}_retention_failed_blocks", "Blocks a retention asked for that no tier kept "
                                  "(a tier down or full of pinned blocks).", value=counts.failed_blocks)  # fmt: skip


class SessionStoreCollector:
    """The session table's reliability figures, read at scrape time: records Redis lost
    that this replica wrote back, turns refused because another replica wrote the
    session meanwhile, and the session store's Redis errors, skipped calls and breaker."""

    def __init__(self, sessions, prefix: str = "kvserve") -> None:  # sessions: SessionManager
        self._sessions = sessions
        self._p = prefix

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        p, m = self._p, self._sessions
        yield CounterMetricFamily(
            f"{p}_session_records_lost", "Session records the session store had lost (Redis restarted, was flushed, "
            "evicted them) while this replica held them; this replica's copy was written back.", value=m.records_lost,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_session_conflicts", "Turns refused at commit (FAILED_PRECONDITION) because another replica wrote "
            "the session while they ran.", value=m.conflicts,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_session_deleted_turns", "Turns that ended NOT_FOUND, nothing recorded, because their session was "
            "deleted while they ran (through another replica, after Redis lost the turn lock).", value=m.deleted_turns,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_session_unconfirmed_writes", "Session record writes Redis did not confirm (down, hung, breaker "
            "open): kept on this replica and written back later.", value=m.unconfirmed_writes,
        )  # fmt: skip
        yield CounterMetricFamily(
            f"{p}_session_records_healed", "Unreadable session records (corrupt, truncated, another session's, a key "
            "of another Redis type) that a write of this replica replaced.", value=m.records_healed,
        )  # fmt: skip
        yield GaugeMetricFamily(f"{p}_session_turns_in_flight", "Session turns in flight on this replica.", value=m.turns_in_flight)
        store = m.store
        yield CounterMetricFamily(
            f"{p}_session_store_write_errors", "Writes of session record files (no Redis, --disk-cache-dir) or of the "
            "session journal (Redis away) that failed: each failed its call (UNAVAILABLE) or is retried.",
            value=getattr(store, "write_errors", 0),
        )  # fmt: skip
        breaker = getattr(store, "breaker", None)
        if breaker is not None:
            yield CounterMetricFamily(
                f"{p}_session_store_errors", "Session-store calls to Redis that failed (Redis itself: connection, "
                "server state) or timed out; these count against the breaker.",
                value=store.primary_errors,
            )  # fmt: skip
            yield CounterMetricFamily(
                f"{p}_session_records_unreadable", "Session records Redis held that failed to decode or verify, or "
                "whose key is of another type (each distinct value once): read as absent, replaced by the next write.",
                value=store.unreadable_records,
            )  # fmt: skip
            yield CounterMetricFamily(
                f"{p}_session_store_key_errors", "Session-store calls that failed for their key alone (a key of another "
                "type): that call fell back to this replica's copy; never counted against the breaker.",
                value=store.key_errors,
            )  # fmt: skip
            yield CounterMetricFamily(
                f"{p}_session_store_skipped", "Session-store calls answered from this replica's copy without asking "
                "Redis (its circuit breaker was open).", value=store.primary_skipped,
            )  # fmt: skip
            state = GaugeMetricFamily(
                f"{p}_session_store_breaker_open", "1 for the session store's Redis circuit breaker state.", labels=["state"]
            )
            now = breaker.state
            for name in ("closed", "open", "half_open"):
                state.add_metric([name], 1.0 if now == name else 0.0)
            yield state
            yield GaugeMetricFamily(
                f"{p}_session_records_unsynced", "Session records whose last write may not have reached Redis yet.",
                value=store.unsynced,
            )  # fmt: skip
            yield GaugeMetricFamily(
                f"{p}_session_records_journaled", "Sessions whose last change Redis may lack, kept in the session "
                "journal (--disk-cache-dir): replayed at the next start. 0 without a journal.", value=store.journaled,
            )  # fmt: skip


class SpillCollector:
    """What the idle spill and the shutdown drain wrote, read at scrape time."""

    def __init__(self, spill, prefix: str = "kvserve") -> None:  # spill: SpillScheduler
        self._spill = spill
        self._p = prefix

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        p, s = self._p, self._spill
        fam = CounterMetricFamily(
            f"{p}_drain_blocks", "Full KV blocks of this replica's sessions at the shutdown drain, by outcome: "
            "held (by the drain's tier, Redis or else the disk tier: written or already there), left (not in it "
            "when the drain ended).", labels=["outcome"],
        )  # fmt: skip
        fam.add_metric(["held"], s.drained_blocks)
        fam.add_metric(["left"], s.drain_left_blocks)
        yield fam


class ServiceMetrics:
    """The service's metrics. Create one per server; pass it to the servicer."""

    def __init__(self, registry: CollectorRegistry | None = None, prefix: str = "kvserve") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, p = self.registry, prefix
        self.requests = Counter(
            f"{p}_requests", "Finished RPCs by method and gRPC status code.", ["method", "code"], registry=r
        )
        self.active_streams = Gauge(f"{p}_active_streams", "Generate streams in flight.", registry=r)
        self.ready = Gauge(f"{p}_ready", "1 while the server serves and is not draining, 0 from the start of a drain (what a proxy's health check reads).", registry=r)
        self.time_to_first_token = Histogram(
            f"{p}_time_to_first_token_seconds", "Arrival at the server to the first generated token sent.",
            buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            f"{p}_inter_token_latency_seconds", "Time between consecutive generated tokens sent to a client.",
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.generated_tokens = Counter(f"{p}_generated_tokens", "Tokens generated and sent.", registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.cached_prompt_tokens = Counter(
            f"{p}_cached_prompt_tokens", "Prompt tokens served from a cache tier instead of recomputed.",
            ["tier"], registry=r,
        )  # fmt: skip
        for tier in Tier:
            self.cached_prompt_tokens.labels(tier)  # export zeros so rates exist from the start
        self.finished = Counter(f"{p}_finished_streams", "Generate streams by finish reason.", ["reason"], registry=r)
        self.session_operations = Counter(
            f"{p}_session_operations", "Session operations that completed: rewind, fork, regenerate, edit.",
            ["operation"], registry=r,
        )  # fmt: skip
        for op in ("rewind", "fork", "regenerate", "edit"):
            self.session_operations.labels(op)
        self.http_connections_closed = Counter(
            f"{p}_http_connections_closed", "HTTP connections the front closed itself, by reason: connection_limit "
            "(past --http-max-connections: 503), headers_timeout (--http-header-timeout: 408), body_timeout "
            "(--http-body-timeout: 408).", ["reason"], registry=r,
        )  # fmt: skip
        for reason in ("connection_limit", "headers_timeout", "body_timeout"):
            self.http_connections_closed.labels(reason)
        self._http: tuple[object, threading.Thread] | None = None

    def register(self, collector: object) -> None:
        """Add a collector (an object with ``collect()``) to this registry."""
        self.registry.register(collector)  # type: ignore[arg-type]

    def watch_engine(self, stats: Callable[[], EngineStats], model_name: str = "kvserve-default", block_size: int = 16) -> None:
        """Export the engine's running/waiting/KV-block figures, read at scrape time, as
        kvserve's own and under vLLM's names (``GatewayCollector``)."""
        self.register(EngineStatsCollector(stats))
        self.register(GatewayCollector(stats, model_name, block_size))

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics returns)."""
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> int:
        """Serve /metrics on ``host:port`` from a daemon thread; returns the bound port."""
        from prometheus_client import start_http_server

        httpd, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (httpd, thread)
        return httpd.server_address[1]

    def stop_http(self) -> None:
        if self._http is not None:
            httpd, thread = self._http
            httpd.shutdown()  # type: ignore[attr-defined]
            httpd.server_close()  # type: ignore[attr-defined]
            thread.join(timeout=5)
            self._http = None
