"""Drafts that remember, through restarts: a session's answer that a regenerate replaces (or a
rewind drops) is kept with its record (SessionRecord.recall, in Redis or the disk store), so
a regenerate or a re-ask on a fresh server, whose draft pool never held it, still drafts from
it (accepted drafts where the first turn had none), with plain greedy's tokens; a server
without a pool (--draft-pool-memory 0) drafts nothing on the same turns."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.clients import KVServeClient
from tests.fixtures.engine import prompts
from tests.fixtures.serving import ServerThread, redis_session_config, tiny_config

N = 16
SAMPLING = dict(max_new_tokens=N, ignore_eos=True)


@pytest.fixture(params=["disk", "redis"])
def config(request, tiny_llama_dir, tmp_path):
    """Settings of one server of a line of them sharing the session records (and nothing else:
    no KV tier, so each starts with an empty draft pool and device cache)."""
    if request.param == "disk":
        root = tmp_path / "kv"
        return lambda **kw: tiny_config(tiny_llama_dir, disk_cache_dir=str(root), disk_cache_size=64 << 20,
                                        host_cache_memory=0, **kw)  # fmt: skip
    url = request.getfixturevalue("redis_url")
    return lambda **kw: redis_session_config(tiny_llama_dir, url, **kw)


def prompt() -> list[int]:
    """Token ids whose greedy answer repeats nothing of its own history (the tiny Llama's
    vocabulary of 400): the turn's own drafter never has a candidate."""
    return prompts(400, [20, 27, 33, 18, 25, 30, 22], seed=5)[6]


def turn(config, **kw):
    """One call on a fresh server (a restart between every two)."""
    pool = kw.pop("draft_pool_memory", None)
    cfg = config(**({} if pool is None else {"draft_pool_memory": pool}))
    with ServerThread(cfg) as s, KVServeClient(s.address, timeout=60) as c:
        if kw.pop("rewind", False):
            c.rewind_session("re", 1)
            return None
        if kw.pop("regenerate", False):
            return c.regenerate("re", **SAMPLING)
        return c.complete(session_id="re", **kw, **SAMPLING)


def test_a_regenerate_and_a_re_ask_after_restarts_draft_from_the_dropped_answer(config):
    first = turn(config, token_ids=prompt())
    assert first.end.timings.draft_tokens == 0  # its own history never repeats
    again = turn(config, regenerate=True)  # a new server: its pool is empty, the record has the answer
    assert again.token_ids == first.token_ids
    assert again.end.timings.accepted_draft_tokens > 0
    # no pool: the same regenerate drafts nothing (the drafts above were the recalled answer's)
    plain = turn(config, regenerate=True, draft_pool_memory=0)
    assert plain.token_ids == first.token_ids and plain.end.timings.draft_tokens == 0
    # a rewind drops the answer from the transcript; asked again on another server, it is drafted
    turn(config, rewind=True)
    asked = turn(config, token_ids=prompt())
    assert asked.token_ids == first.token_ids and asked.end.timings.accepted_draft_tokens > 0
