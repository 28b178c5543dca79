"""LLMEngine.warm on the engine's CUDA code path (fake streams, tests/engine/test_transfer.py):
a warm-up's loads go through staging on the restore stream, the compute stream waits for
the last copy before the forward that reads them, and the turn after it finds every block
on the device and answers as recomputing does."""

from __future__ import annotations

from typing import Any

from tests.engine.test_transfer import _history_on_host, loaded  # noqa: F401 - the module fixture

__all__ = ["loaded"]


def _warm(engine: Any, tokens: list[int]) -> Any:
    from kvserve.service.types import CacheScope

    got: list[Any] = []
    engine.warm(tokens, CacheScope(), "", got.append)  # this test's thread is the engine thread
    for _ in range(10_000):
        if got:
            return got[0]
        engine.step()
        engine.wait_for_work(0.001)
    raise AssertionError("the warm-up never landed")


def test_a_warm_up_restores_through_staging_before_the_turn_and_the_turn_hits_the_device(loaded: Any) -> None:  # noqa: F811
    from kvserve.service.types import Tier
    from tests.fixtures.engine import BS, finished, greedy_reference, req, run

    a, b, ops, hist, hashes = _history_on_host(loaded, 21, seed=7)
    result = _warm(b, hist)
    assert (result.blocks, result.on_device, result.restored, result.missing) == (len(hashes), 0, len(hashes), 0)
    assert result.restored_by_tier == {Tier.HOST: len(hashes)}
    kinds = [e[0] for e in ops.log]
    assert kinds.count("copy") == len(hashes) and "kernel" not in kinds  # loaded before any forward
    last_copy_event = [e for e in ops.log if e[0] == "record" and e[1] == b.transfers.restore_stream][-1][2]

    turn = hist + [3, 4]
    evs = run(b, [req("b", turn, n=3)])["b"]
    start = evs[0]
    assert start.cached_by_tier == {Tier.DEVICE: len(hashes) * BS}
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, turn, 3)
    first_kernel = [e[0] for e in ops.log].index("kernel")
    assert ("wait_event", "compute", last_copy_event) in ops.log[:first_kernel]
    stats = b.cache_stats().warm
    assert (stats.hits, stats.claimed_blocks, stats.pinned_blocks) == (1, len(hashes), 0)
    b.close()
    assert b.transfers.staging.num_free == b.transfers.staging.capacity
    a.close()
