"""A circuit breaker: stop calling a backend that keeps failing, probe it now and then.

    closed --(failure_threshold consecutive failures)--> open
    open   --(reset_timeout_s elapsed)-----------------> half_open
    half_open: one caller is let through as a probe; every other caller is refused
        probe succeeds --> closed          probe fails --> open (timer restarts)

Callers ask ``allow()`` before each operation and report ``record_success()`` or
``record_failure()`` after it. A refused call should be a fast miss / no-op, never an
error. A probe whose caller never reports (it died) is given up after another
``reset_timeout_s`` and a new probe is let through, so the breaker cannot wedge.

Used by the Redis KV tier (kvserve.cachestore.redis) and the Redis session store
(kvserve.service.sessions.stores), one breaker each.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

# The breaker's states (also what a tier without a breaker reports: "closed").
CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 3,
        reset_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if reset_timeout_s < 0:
            raise ValueError(f"reset_timeout_s must be >= 0, got {reset_timeout_s}")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0  # consecutive, while closed
        self._opened_at = 0.0
        self._probe_started_at: float | None = None
        self.opens = 0  # how many times the breaker opened

    @property
    def state(self) -> str:
        """"closed", "open" or "half_open" (an open breaker whose timer ran out reads
        as half_open: the next ``allow()`` is a probe)."""
        with self._lock:
            if self._state == OPEN and self._clock() - self._opened_at >= self.reset_timeout_s:
                return HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """May the caller go to the backend now? Exactly one caller is let through per
        probe window while half-open."""
        with self._lock:
            if self._state == CLOSED:
                return True
            now = self._clock()
            if self._state == OPEN:
                if now - self._opened_at < self.reset_timeout_s:
                    return False
                self._state = HALF_OPEN
                self._probe_started_at = now
                return True
            # HALF_OPEN: a probe is out; let another through only if it went missing.
            assert self._probe_started_at is not None
            if now - self._probe_started_at >= self.reset_timeout_s:
                self._probe_started_at = now
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._state = CLOSED
            self._failures = 0
            self._probe_started_at = None

    def record_failure(self) -> None:
        with self._lock:
            if self._state == CLOSED:
                self._failures += 1
                if self._failures < self.failure_threshold:
                    return
            elif self._state == OPEN:
                return  # a straggler that was let through before the breaker opened
            self._state = OPEN
            self._opened_at = self._clock()
            self._failures = 0
            self._probe_started_at = None
            self.opens += 1


__all__ = ["CircuitBreaker", "CLOSED", "OPEN", "HALF_OPEN"]
