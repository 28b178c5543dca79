"""Stream admission and the drain, one object for both fronts (gRPC and HTTP).

Every Generate stream, whichever front it came in by, is counted here: against
``max_streams`` (all tenants) and ``max_streams_per_tenant``, and so the drain can wait
for the streams in flight and, past its timeout, abort them. The fronts call:

- ``check_serving()`` at the start of every call: ``Draining`` (UNAVAILABLE) once the
  drain started;
- ``admit(owner, request_id)`` for a Generate stream: a ``Ticket``, or
  ``TooManyStreams`` (RESOURCE_EXHAUSTED) naming the limit it would pass;
- ``Ticket.release()`` when the stream ends, however it ends (idempotent).

The server drives the drain: ``start_draining``, ``wait_idle``, ``abort_inflight``.
Both errors map to statuses through ``service.wire``'s status table (HTTP: through the
same table). Imports no gRPC and no torch.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol


class Draining(Exception):
    """The server is draining: new calls are refused (UNAVAILABLE)."""


class TooManyStreams(Exception):
    """Admission refused: a stream limit is reached (RESOURCE_EXHAUSTED)."""


class _Gauge(Protocol):
    def inc(self) -> None: ...
    def dec(self) -> None: ...


class Ticket:
    """One admitted stream; ``release`` gives its place back (once, however often called)."""

    __slots__ = ("_admission", "owner", "request_id", "_released")

    def __init__(self, admission: Admission, owner: str, request_id: str) -> None:
        self._admission = admission
        self.owner = owner
        self.request_id = request_id
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self.owner, self.request_id)


class Admission:
    """Counts the Generate streams in flight and runs the drain's side of them."""

    def __init__(
        self,
        *,
        max_streams: int = 0,
        max_streams_per_tenant: int = 0,
        gauge: _Gauge | None = None,
    ) -> None:
        """``max_streams`` / ``max_streams_per_tenant``: 0 = no limit. ``gauge``
        (e.g. ``kvserve_active_streams``) follows the streams in flight."""
        self.max_streams = max_streams
        self.max_streams_per_tenant = max_streams_per_tenant
        self._gauge = gauge
        self._draining = False
        self._inflight: set[str] = set()  # request ids of streams being served
        self._by_tenant: dict[str, int] = {}  # tenants with streams in flight only
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- the fronts --------------------------------------------------------------

    def check_serving(self) -> None:
        if self._draining:
            raise Draining("the server is shutting down; retry on another replica")

    def admit(self, owner: str, request_id: str) -> Ticket:
        """Count a new stream in, or raise ``TooManyStreams`` naming the limit it would pass."""
        if self.max_streams and len(self._inflight) >= self.max_streams:
            raise TooManyStreams(
                f"too many streams: the server serves at most {self.max_streams} at once "
                f"(max_streams); retry later"
            )
        mine = self._by_tenant.get(owner, 0)
        if self.max_streams_per_tenant and mine >= self.max_streams_per_tenant:
            raise TooManyStreams(
                f"too many streams for this tenant: {mine} in flight, the limit is "
                f"{self.max_streams_per_tenant} per tenant (max_streams_per_tenant); retry when one ends"
            )
        self._by_tenant[owner] = mine + 1
        self._inflight.add(request_id)
        self._idle.clear()
        if self._gauge is not None:
            self._gauge.inc()
        return Ticket(self, owner, request_id)

    def _release(self, owner: str, request_id: str) -> None:
        left = self._by_tenant.get(owner, 1) - 1
        if left > 0:
            self._by_tenant[owner] = left
        else:
            self._by_tenant.pop(owner, None)
        self._inflight.discard(request_id)
        if not self._inflight:
            self._idle.set()
        if self._gauge is not None:
            self._gauge.dec()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def inflight(self) -> int:
        """Generate streams in flight, both fronts."""
        return len(self._inflight)

    def streams_of(self, owner: str) -> int:
        """Generate streams in flight for ``owner``."""
        return self._by_tenant.get(owner, 0)

    # ---- the drain ---------------------------------------------------------------

    def start_draining(self) -> None:
        """From now on new calls get ``Draining``; streams in flight continue."""
        self._draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no stream is in flight; False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    def abort_inflight(self, abort: Callable[[str], None]) -> None:
        """Call ``abort(request_id)`` (the engine's) for every stream in flight; while
        draining they end UNAVAILABLE."""
        for request_id in list(self._inflight):
            abort(request_id)
