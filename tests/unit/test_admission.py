"""kvserve.service.admission: one stream count and one drain for both fronts (the servers'
side is in tests/service/test_limits.py, tests/system/test_sigterm.py and tests/service/test_http_api.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.service import wire
from kvserve.service.admission import Admission, Draining, TooManyStreams


def test_limits_count_per_tenant_and_in_all_and_a_ticket_releases_once() -> None:
    adm = Admission(max_streams=3, max_streams_per_tenant=2)
    a1, a2 = adm.admit("acme", "r1"), adm.admit("acme", "r2")
    with pytest.raises(TooManyStreams, match="2 in flight, the limit is 2 per tenant"):
        adm.admit("acme", "r3")
    b1 = adm.admit("bravo", "r4")
    with pytest.raises(TooManyStreams, match="at most 3 at once"):
        adm.admit("bravo", "r5")
    a1.release()
    a1.release()  # idempotent: the count does not go below what is in flight
    assert adm.inflight == 2 and adm.streams_of("acme") == 1 and adm.streams_of("bravo") == 1
    a2.release()
    b1.release()
    assert adm.inflight == 0 and adm.streams_of("acme") == 0


def test_errors_map_through_the_status_table() -> None:
    assert wire.status_of(TooManyStreams("x")).code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert wire.status_of(Draining("x")).code == grpc.StatusCode.UNAVAILABLE


def test_drain_refuses_new_calls_waits_for_streams_and_aborts_the_rest() -> None:
    async def main() -> None:
        adm = Admission()
        t1, t2 = adm.admit("", "r1"), adm.admit("", "r2")
        adm.start_draining()
        with pytest.raises(Draining, match="shutting down"):
            adm.check_serving()
        assert not await adm.wait_idle(0.01)
        aborted: list[str] = []
        adm.abort_inflight(aborted.append)
        assert sorted(aborted) == ["r1", "r2"]
        t1.release()
        t2.release()
        assert await adm.wait_idle(1.0)

    asyncio.run(main())
