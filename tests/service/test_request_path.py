"""A request's path reads in one pass: a gRPC ``Generate`` and an HTTP chat completion,
each a session's turn and a one-off, traced call by call through a real server on
loopback (bench/request_path.py's tracer: ``sys.setprofile`` over service/'s files on
the event loop's thread and its worker threads) visit ``conversations.py`` exactly twice,
``prepare`` then ``stream``, both called by the fronts' prologue (``turns.py``), and
``validation.py`` at most twice (``check_request`` and ``check_prompt``). Counts of calls,
not of time."""

from __future__ import annotations

import pytest

from bench.request_path import trace_requests
from tests.fixtures.serving import tiny_config


@pytest.fixture(scope="module")
def paths(tiny_llama_dir):
    return {p.name: p for p in trace_requests(tiny_config(tiny_llama_dir))}


def test_every_request_is_traced(paths):
    assert sorted(paths) == sorted(["gRPC Generate, a session's turn", "gRPC Generate, one-off",
                                    "HTTP chat, X-Session-Id", "HTTP chat, one-off"])  # fmt: skip
    for p in paths.values():
        assert p.visits("turns.py") >= 1 and p.visits("engine/async_engine.py") >= 1, p.steps


@pytest.mark.parametrize("name", ["gRPC Generate, a session's turn", "gRPC Generate, one-off",
                                  "HTTP chat, X-Session-Id", "HTTP chat, one-off"])  # fmt: skip
def test_conversations_twice_and_validation_at_most_twice(paths, name):
    p = paths[name]
    into_conversations = [(caller, fn) for caller, callee, fn in p.steps if callee == "conversations.py"]
    assert into_conversations == [("turns.py", "Conversations.prepare"), ("turns.py", "Conversations.stream")], p.steps
    into_validation = [fn for _, callee, fn in p.steps if callee == "validation.py"]
    assert len(into_validation) <= 2 and into_validation == ["check_request", "check_prompt"], p.steps
    if name.endswith("session's turn") or name.endswith("X-Session-Id"):  # the session's lock, commit and end
        table = [fn for _, callee, fn in p.steps if callee == "sessions/table.py"]
        assert {"SessionManager.begin_turn", "SessionManager.commit_turn", "SessionManager.end_turn"} <= set(table)
