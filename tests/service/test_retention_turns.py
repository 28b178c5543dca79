"""Retention through the conversation, on a real server in this process: a session
turn's ``retain`` reaches the engine and its figures come back on the events; a turn
refused past the tenant's bound leaves its session exactly as it was (and a first turn
refused leaves none); a session's pin (``Conversations.retain``); the metrics."""

from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from kvserve.service.sessions import SessionNotFound
from kvserve.service.types import Finished, Retain, RetentionRefused, SamplingParams, Started, Tier, TurnInput
from tests.fixtures.redis_server import free_port
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, tiny_config

HOUR = 3600.0


def ask(ids: Any, n: int, **kw: Any) -> TurnInput:
    """A turn of token ids asking for ``n`` new tokens."""
    return TurnInput(token_ids=tuple(ids), sampling=SamplingParams(max_new_tokens=n), max_new_tokens=n, **kw)


async def turn(conv: Any, owner: str, inp: TurnInput, rid: str) -> list[Any]:
    return [ev async for ev in conv.run_turn(owner, inp, rid)]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    per_block = 512 * BLOCK_SIZE  # the tiny Llama's KV bytes per token x tokens per block
    cfg = tiny_config(tiny_llama_dir, host_cache_memory=64 * per_block, retention_tenant_memory=12 * per_block,
                      metrics_port=free_port())  # fmt: skip
    with ServerThread(cfg) as srv:
        yield srv


def test_a_session_turn_retains_and_reports(server: ServerThread) -> None:
    conv = server.running.conversations
    ids = list(range(5, 5 + 8 * BLOCK_SIZE + 3))  # 8 blocks and 3 tokens
    inp = ask(tuple(ids), 4, session_id="s1", retain=(Retain(HOUR),))
    evs = server.call(turn(conv, "acme", inp, "r1"))
    start, fin = evs[0], evs[-1]
    assert isinstance(start, Started) and start.retain_tokens == 8 * BLOCK_SIZE
    assert isinstance(fin, Finished)
    (kept,) = fin.retained
    assert kept.prefix_tokens == len(ids) and kept.retained_tokens == 8 * BLOCK_SIZE
    assert kept.created_tokens == 8 * BLOCK_SIZE and kept.tiers == (Tier.HOST,)
    rec, busy = server.call(server.running.sessions.get("acme", "s1"))
    assert not busy and rec.token_ids[: len(ids)] == ids
    # the next turn reads it back and refreshes it: nothing written anew
    more = ask((9, 9, 9), 2, session_id="s1", retain=(Retain(HOUR, len(ids)),))
    fin = server.call(turn(conv, "acme", more, "r2"))[-1]
    assert fin.cached_tokens >= 8 * BLOCK_SIZE and fin.cache_creation_tokens == 0
    assert fin.retained[0].retained_tokens == 8 * BLOCK_SIZE


def test_a_refused_turn_leaves_its_session_as_it_was(server: ServerThread) -> None:
    conv, sessions = server.running.conversations, server.running.sessions
    first = ask(tuple(range(100, 100 + 3 * BLOCK_SIZE)), 2, session_id="s2")
    server.call(turn(conv, "globex", first, "g1"))
    before, _ = server.call(sessions.get("globex", "s2"))
    big = ask(tuple(range(150, 150 + 14 * BLOCK_SIZE)), 2, session_id="s2",
                    retain=(Retain(HOUR),))  # fmt: skip
    with pytest.raises(RetentionRefused, match="tenant 'globex'.*bound of 12"):
        server.call(turn(conv, "globex", big, "g2"))
    after, busy = server.call(sessions.get("globex", "s2"))
    assert not busy and after.token_ids == before.token_ids and after.turns == before.turns
    new = ask(big.token_ids, 2, session_id="s3", retain=big.retain)
    with pytest.raises(RetentionRefused):
        server.call(turn(conv, "globex", new, "g3"))
    with pytest.raises(SessionNotFound):  # a first turn refused leaves no session behind
        server.call(sessions.get("globex", "s3"))


def test_a_session_pin(server: ServerThread) -> None:
    conv = server.running.conversations
    ids = tuple(range(50, 50 + 5 * BLOCK_SIZE + 1))
    server.call(turn(conv, "initech", ask(ids, 3, session_id="s4"), "i1"))
    kept = server.call(server.running.session_ops.retain("initech", "s4", HOUR))
    rec, _ = server.call(server.running.sessions.get("initech", "s4"))
    assert kept.retained_tokens == len(rec.token_ids) // BLOCK_SIZE * BLOCK_SIZE
    assert kept.created_tokens == 0 and kept.tiers == (Tier.HOST,)
    with pytest.raises(SessionNotFound):
        server.call(server.running.session_ops.retain("someone-else", "s4", HOUR))


def test_the_metrics_say_it(server: ServerThread) -> None:
    url = f"http://127.0.0.1:{server.running.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=30) as resp:
        scrape = resp.read().decode()
    assert 'kvserve_retention_refusals_total{reason="tenant_bound"}' in scrape
    assert 'kvserve_cache_retained_blocks{tier="host"}' in scrape
    line = next(ln for ln in scrape.splitlines() if ln.startswith("kvserve_retention_created_tokens_total "))
    assert float(line.split()[1]) >= 8 * BLOCK_SIZE
