"""Session operations through a live server: turn boundaries (GetSession include_turns),
RewindSession, ForkSession, regenerate and edit (Generate turn_mode), expected_turns;
their validation; their exclusion of a racing turn on one replica and across two; and
fork and rewind surviving a drain and resuming from Redis on another replica. Records
written before turn boundaries existed (codec version 1) still load and continue."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import zlib

import grpc
import pytest
import redis

from kvserve.clients import AsyncKVServeClient, KVServeClient, KVServeError
from kvserve.proto.kvserve.v1 import generation_pb2 as pb
from kvserve.proto.kvserve.v1 import generation_pb2_grpc as pb_grpc
from kvserve.service.auth import hash_key
from tests.fixtures.serving import BLOCK_SIZE, ServerThread, held_running, tiny_config, wait_until

MSGS = ["hello, tell me a short story about a fox", "what is the fox doing now", "and the dog?"]
KEY_A, KEY_B = "key-of-acme-0123456789", "key-of-bravo-0123456789"


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(KVServeError) as err:
        call()
    return err.value.code, err.value.details


def _cached_prefix(prompt_tokens: int) -> int:
    """The cached tokens of a prompt whose every full block is cached: its full blocks,
    less the last one when the prompt ends on a block boundary (the last prompt token
    is always computed)."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def _three_turns(c: KVServeClient, sid: str, n: int = 6) -> list:
    return [c.chat(sid, f"{m} ({sid})", max_new_tokens=n) for m in MSGS]


def _check_log(info) -> None:
    """The turn log tiles the transcript: contiguous, ending at its last token."""
    pos = info.turn_log[0].start_token if info.turn_log else info.token_count
    for i, t in enumerate(info.turn_log):
        assert t.start_token == pos and t.index == info.turn_log[0].index + i
        assert t.finish_reason in ("stop", "length") and t.started_at <= t.ended_at
        pos += t.input_tokens + t.output_tokens
    assert pos == info.token_count


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    keys = f"acme:{hash_key(KEY_A)}\nbravo:{hash_key(KEY_B)}\n"
    with ServerThread(tiny_config(tiny_llama_dir, api_keys=keys, max_sessions_per_tenant=6)) as s:
        yield s


@pytest.fixture()
def client(server):
    with KVServeClient(server.address, token=KEY_A, timeout=60) as c:
        yield c
        for s in list(c.iter_sessions()):
            c.delete_session(s.session_id)


# ----------------------------------------------------------------------------- turn boundaries


def test_get_session_returns_turn_boundaries_on_request(client, server):
    replies = _three_turns(client, "log")
    plain = client.get_session("log")
    assert plain.turn_log is None
    info = client.get_session("log", include_turns=True, include_token_ids=True)
    assert info.turns == 3 and [t.index for t in info.turn_log] == [0, 1, 2]
    _check_log(info)
    for t, r in zip(info.turn_log, replies):
        assert t.output_tokens == len(r.token_ids) and t.finish_reason == r.end.finish_reason
        assert info.token_ids[t.start_token + t.input_tokens : t.start_token + t.input_tokens + t.output_tokens] \
            == r.token_ids  # fmt: skip
        assert t.start_token + t.input_tokens == r.start.prompt_tokens
    # the default response carries no turn log on the wire
    with grpc.insecure_channel(server.address) as ch:
        raw = pb_grpc.GenerationServiceStub(ch).GetSession(
            pb.GetSessionRequest(session_id="log"), metadata=(("authorization", f"Bearer {KEY_A}"),)
        )
    assert raw.session.turns == 3 and len(raw.session.turn_log) == 0


# ----------------------------------------------------------------------------- rewind


def test_rewind_drops_turns_and_a_re_ask_restores_instead_of_prefilling(client, server):
    replies = _three_turns(client, "rw")
    before = client.get_session("rw", include_turns=True, include_token_ids=True)
    end2 = before.turn_log[2].start_token
    info, dropped = client.rewind_session("rw", 1)
    assert info.turns == 2 and info.token_count == end2 and dropped == before.token_count - end2
    assert info.turn_log == before.turn_log[:2]
    assert client.get_session("rw", include_token_ids=True).token_ids == before.token_ids[:end2]
    # the same question again: its KV is still cached (the whole prompt up to the last
    # block, the dropped turn's input included), and greedy gives the same answer
    device_hits = server.running.metrics.cached_prompt_tokens.labels("device")
    hits_before = device_hits._value.get()
    again = client.chat("rw", f"{MSGS[2]} (rw)", max_new_tokens=6)
    assert device_hits._value.get() - hits_before == again.start.cached_tokens  # the metrics say so too
    assert again.start.prompt_tokens == replies[2].start.prompt_tokens
    assert again.start.cached_tokens == _cached_prefix(again.start.prompt_tokens) > end2 // BLOCK_SIZE * BLOCK_SIZE
    assert again.start.cached_by_tier["device"] == again.start.cached_tokens
    assert again.token_ids == replies[2].token_ids
    assert client.get_session("rw", include_token_ids=True).token_ids == before.token_ids
    # all the way back: an empty session that still exists
    info, dropped = client.rewind_session("rw", 3)
    assert (info.turns, info.token_count, info.turn_log, dropped) == (0, 0, [], before.token_count)
    code, msg = _code(lambda: client.regenerate("rw"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "no completed turn" in msg


def test_rewind_and_fork_validation(client, server):
    _three_turns(client, "v", n=2)
    bad = [
        (lambda: client.rewind_session("v", 0), "turns must be at least 1"),
        (lambda: client.rewind_session("v", 4), "has 3 completed turns; cannot rewind 4"),
        (lambda: client.rewind_session("", 1), "session_id must be 1 to 128 characters"),
        (lambda: client.rewind_session("x" * 129, 1), "session_id must be 1 to 128 characters"),
        (lambda: client.rewind_session("bad id", 1), "session_id must be 1 to 128 characters"),
        (lambda: client.fork_session("v", ""), "new_session_id must be 1 to 128 characters"),
        (lambda: client.fork_session("v", "y" * 129), "new_session_id must be 1 to 128 characters"),
        (lambda: client.fork_session("", "w"), "session_id must be 1 to 128 characters"),
        (lambda: client.fork_session("v", "w", at_turn=4), "at_turn is 4 but session 'v' has 3 completed turns"),
        (lambda: client.regenerate("v", text="no input allowed"), None),
        (lambda: client.complete(text="x", turn_mode="regenerate"), None),
        (lambda: client.complete(text="x", turn_mode="edit"), "turn_mode EDIT needs a session_id"),
        (lambda: client.complete(text="x", expected_turns=1), "expected_turns needs a session_id"),
    ]
    for call, expect in bad:
        try:
            code, msg = _code(call)
        except ValueError:  # the client refuses some before sending (regenerate with input)
            continue
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, msg)
        assert expect is None or expect in msg, msg
    # the server refuses them too when a client sends them anyway
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.GenerationServiceStub(ch)
        md = (("authorization", f"Bearer {KEY_A}"),)
        for req, expect in (
            (pb.GenerateRequest(session_id="v", text="x", turn_mode=pb.TURN_MODE_REGENERATE), "takes no input"),
            (pb.GenerateRequest(session_id="v", text="x", turn_mode=99), "turn_mode 99 is not a known TurnMode"),
        ):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=md, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expect in err.value.details()
    for call, code in (
        (lambda: client.rewind_session("nope", 1), grpc.StatusCode.NOT_FOUND),
        (lambda: client.fork_session("nope", "w"), grpc.StatusCode.NOT_FOUND),
        (lambda: client.regenerate("nope"), grpc.StatusCode.NOT_FOUND),
        (lambda: client.edit("nope", "hi"), grpc.StatusCode.NOT_FOUND),
        (lambda: client.rewind_session("v", 1, expected_turns=2), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: client.regenerate("v", expected_turns=5), grpc.StatusCode.FAILED_PRECONDITION),
        (lambda: client.chat("v", "more", expected_turns=2), grpc.StatusCode.FAILED_PRECONDITION),
    ):
        assert _code(call)[0] == code
    assert client.get_session("v").turns == 3  # nothing above changed it
    assert client.rewind_session("v", 1, expected_turns=3)[0].turns == 2


# ----------------------------------------------------------------------------- fork


def test_fork_shares_the_transcript_and_its_blocks(client):
    _three_turns(client, "src")
    src = client.get_session("src", include_turns=True, include_token_ids=True)
    end2 = src.turn_log[2].start_token
    child = client.fork_session("src", "child", at_turn=2)
    assert (child.turns, child.token_count, child.turn_log) == (2, end2, src.turn_log[:2])
    # no KV copied: the child's full blocks are the source's, already on the device
    assert child.full_blocks == end2 // BLOCK_SIZE and child.cached_blocks["device"] == child.full_blocks
    assert client.get_session("child", include_token_ids=True).token_ids == src.token_ids[:end2]
    # the branch goes its own way; its first turn finds every full block of the shared part
    r = client.chat("child", "a different question", max_new_tokens=4)
    assert r.start.cached_tokens >= end2 // BLOCK_SIZE * BLOCK_SIZE > 0 and not r.start.session_created
    assert client.get_session("src", include_token_ids=True).token_ids == src.token_ids  # the source is untouched
    whole = client.fork_session("src", "whole")  # at_turn unset: every turn
    assert whole.turns == 3 and whole.token_count == src.token_count
    assert client.fork_session("src", "empty", at_turn=0).token_count == 0
    code, msg = _code(lambda: client.fork_session("src", "child"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "'child' already exists" in msg
    assert _code(lambda: client.fork_session("src", "src"))[0] == grpc.StatusCode.ALREADY_EXISTS
    # forks count toward the tenant's session limit (6): src, child, whole, empty + 2
    client.fork_session("src", "f5")
    client.fork_session("src", "f6")
    code, msg = _code(lambda: client.fork_session("src", "f7"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions_per_tenant" in msg


def test_deleting_a_fork_leaves_the_blocks_it_shares_with_its_source(client):
    _three_turns(client, "keep-src", n=8)
    src = client.get_session("keep-src", include_token_ids=True)
    assert src.cached_blocks["device"] == src.full_blocks >= 4
    fork = client.fork_session("keep-src", "keep-fork", at_turn=2)
    client.chat("keep-fork", "a question of the branch alone, long enough to fill a block or two", max_new_tokens=8)
    grown = client.get_session("keep-fork", include_token_ids=True)
    assert grown.full_blocks > fork.full_blocks
    client.delete_session("keep-fork")
    # the source keeps every block; the branch's own blocks (past what it has in common
    # with the source: the fork point and the chat template's framing after it) are gone
    assert client.get_session("keep-src").cached_blocks["device"] == src.full_blocks
    common = next(i for i, (a, b) in enumerate(zip(grown.token_ids, src.token_ids)) if a != b)
    assert common >= fork.token_count and grown.full_blocks > common // BLOCK_SIZE
    assert client.complete(token_ids=grown.token_ids, max_new_tokens=1).start.cached_tokens \
        == common // BLOCK_SIZE * BLOCK_SIZE  # fmt: skip
    # a session that is not a fork drops all its blocks when deleted, as before
    client.delete_session("keep-src")
    assert client.complete(token_ids=src.token_ids, max_new_tokens=1).start.cached_tokens == 0


def test_another_tenants_session_is_not_found(client, server):
    _three_turns(client, "mine", n=2)
    with KVServeClient(server.address, token=KEY_B, timeout=60) as other:
        for call in (
            lambda: other.fork_session("mine", "stolen"),
            lambda: other.rewind_session("mine", 1),
            lambda: other.regenerate("mine"),
            lambda: other.edit("mine", "hi"),
        ):
            assert _code(call)[0] == grpc.StatusCode.NOT_FOUND
        assert list(other.iter_sessions()) == []
    assert client.get_session("mine").turns == 3


# ----------------------------------------------------------------------------- regenerate, edit


def test_regenerate_replaces_the_last_answer_from_the_same_input(client):
    first = client.chat("re", MSGS[0], max_new_tokens=8)
    second = client.chat("re", MSGS[1], max_new_tokens=8)
    before = client.get_session("re", include_turns=True, include_token_ids=True)
    last = before.turn_log[1]
    prefix = before.token_ids[: last.start_token + last.input_tokens]
    # greedy again: the same answer, every full block of the prompt cached
    r = client.regenerate("re", max_new_tokens=8)
    assert r.start.prompt_tokens == len(prefix) == second.start.prompt_tokens
    assert r.start.cached_tokens == _cached_prefix(len(prefix))
    assert r.token_ids == second.token_ids
    # sampled: a new answer replaces the old one; the turn count and the input stay
    r = client.regenerate("re", max_new_tokens=8, temperature=1.5, seed=7, expected_turns=2)
    after = client.get_session("re", include_turns=True, include_token_ids=True)
    assert after.turns == 2 and after.token_ids == prefix + r.token_ids
    assert after.turn_log[0] == before.turn_log[0]
    assert after.turn_log[1].input_tokens == last.input_tokens
    assert after.turn_log[1].output_tokens == len(r.token_ids)
    _check_log(after)
    # seeded sampling is reproducible through regenerate too
    assert client.regenerate("re", max_new_tokens=8, temperature=1.5, seed=7).token_ids == r.token_ids
    del first


def test_completed_operations_are_counted(client, server):
    ops = server.running.metrics.session_operations
    before = {op: ops.labels(op)._value.get() for op in ("rewind", "fork", "regenerate", "edit")}
    _three_turns(client, "count", n=2)
    client.regenerate("count", max_new_tokens=2)
    client.edit("count", "changed", max_new_tokens=2)
    client.fork_session("count", "count-2")
    client.rewind_session("count", 1)
    _code(lambda: client.rewind_session("count", 9))  # refused: not counted
    _code(lambda: client.regenerate("count", expected_turns=0))
    assert {op: ops.labels(op)._value.get() - n for op, n in before.items()} == \
        {"rewind": 1, "fork": 1, "regenerate": 1, "edit": 1}  # fmt: skip


def test_edit_replaces_the_last_message_like_a_session_that_asked_it(client):
    client.chat("ed", MSGS[0], max_new_tokens=6)
    client.chat("ed", MSGS[1], max_new_tokens=6)
    r = client.edit("ed", "where is the dog?", max_new_tokens=6)
    client.chat("ref", MSGS[0], max_new_tokens=6)
    ref = client.chat("ref", "where is the dog?", max_new_tokens=6)
    assert r.token_ids == ref.token_ids
    ed, want = (client.get_session(s, include_turns=True, include_token_ids=True) for s in ("ed", "ref"))
    assert ed.token_ids == want.token_ids and ed.turns == 2
    assert [(t.input_tokens, t.output_tokens) for t in ed.turn_log] == \
        [(t.input_tokens, t.output_tokens) for t in want.turn_log]  # fmt: skip
    # the edited turn's prompt is the transcript before it: its blocks were cached
    assert r.start.cached_tokens >= ed.turn_log[1].start_token // BLOCK_SIZE * BLOCK_SIZE > 0


def test_regenerate_and_edit_of_a_first_text_turn(client):
    first = client.complete(text="Once upon a time", session_id="t1", max_new_tokens=6)
    again = client.regenerate("t1", max_new_tokens=6)
    assert again.token_ids == first.token_ids and again.start.prompt_tokens == first.start.prompt_tokens
    client.complete(text="The teacher said", session_id="t1", turn_mode="edit", max_new_tokens=6)  # any input kind
    ref = client.complete(text="The teacher said", session_id="t1-ref", max_new_tokens=6)
    got, want = (client.get_session(s, include_token_ids=True, include_turns=True) for s in ("t1", "t1-ref"))
    assert got.token_ids == want.token_ids and got.turns == 1  # BOS and all, as a first turn
    assert got.turn_log[0].input_tokens == want.turn_log[0].input_tokens == ref.start.prompt_tokens
    client.rewind_session("t1", 1)
    r = client.complete(text="Once upon a time", session_id="t1", max_new_tokens=6)
    assert not r.start.session_created and r.token_ids == first.token_ids


def test_a_cancelled_regenerate_keeps_the_old_answer(server, client):
    """The regenerate is held running (``held_running``) until the server has ended the
    cancelled call: its 200 tokens could otherwise end, and commit, before the cancel."""
    client.chat("keep", MSGS[0], max_new_tokens=6)
    before = client.get_session("keep", include_token_ids=True).token_ids
    stream, running = held_running(
        server, lambda: client.generate(session_id="keep", turn_mode="regenerate", max_new_tokens=200, ignore_eos=True))
    try:
        next(iter(stream))  # the start: the turn holds the lock
        assert running.held.wait(60) and server.engine.stats().running == 1  # the regenerate runs, held
        stream.cancel()
        assert wait_until(lambda: server.running.admission.inflight == 0)  # the server ended the call
    finally:
        running.release()
    assert wait_until(lambda: not client.get_session("keep").busy, timeout=30)
    assert client.get_session("keep", include_token_ids=True).token_ids == before


def test_the_async_client_has_every_operation(client, server):
    async def run() -> None:
        async with AsyncKVServeClient(server.address, token=KEY_A, timeout=60) as c:
            first = await c.chat("aio", MSGS[0], max_new_tokens=6)
            second = await c.chat("aio", MSGS[1], max_new_tokens=6)
            info = await c.get_session("aio", include_turns=True)
            assert [t.output_tokens for t in info.turn_log] == [len(first.token_ids), len(second.token_ids)]
            again = await c.regenerate("aio", max_new_tokens=6, expected_turns=2)
            assert again.token_ids == second.token_ids  # greedy: the same answer
            edited = await c.edit("aio", "where is the dog?", max_new_tokens=6)
            assert (await c.get_session("aio", include_token_ids=True)).token_ids[-len(edited.token_ids):] \
                == edited.token_ids  # fmt: skip
            fork = await c.fork_session("aio", "aio-b", at_turn=1)
            assert fork.turns == 1 and fork.turn_log == info.turn_log[:1]
            rewound, dropped = await c.rewind_session("aio", 1)
            assert rewound.turns == 1 and rewound.token_count == fork.token_count and dropped > 0
            with pytest.raises(KVServeError) as err:
                await c.fork_session("aio", "aio-b")
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS

    asyncio.run(run())


# ----------------------------------------------------------------------------- races


# The held turn's length: the server does not wait for the client to read a stream, so
# the turn is held running (EngineHold) while the racing calls come; its tokens are the
# hundreds of steps it would still take if a hold let it go early.
HOLD_TOKENS = 200



def _racing(holder: KVServeClient, other: KVServeClient, sid: str, hold: dict, race, server: ServerThread) -> None:
    """Start ``hold`` (a Generate) on ``holder``, and while its turn is in flight run each
    of ``race`` on ``other``: every one gets FAILED_PRECONDITION. Then let ``hold`` finish.
    ``server``: the holder's, whose engine holds the turn's sequence running from its first
    step until the race is over, asserted still running then (the tiny model's HOLD_TOKENS
    take only some tens of ms: a hold placed after the turn's first event could come after
    its end, and a call on either replica then is rightly served)."""
    stream, running = held_running(
        server, lambda: holder.generate(session_id=sid, max_new_tokens=HOLD_TOKENS, ignore_eos=True, **hold))
    try:
        events = iter(stream)
        assert type(next(events)).__name__ == "StreamStart"  # the turn lock is held from here on
        assert running.held.wait(60)  # the turn's sequence running, held before its second step
        for call in race:
            code, msg = _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "in flight" in msg, msg
        assert server.engine.stats().running == 1 and holder.get_session(sid).busy  # the turn still ran
    finally:
        running.release()
    for _ in events:
        pass


def test_regenerate_racing_a_new_turn_is_refused_and_the_transcript_stays_whole(server, client):
    client.chat("race", MSGS[0], max_new_tokens=6)
    base = client.get_session("race", include_token_ids=True).token_ids
    # a new turn in flight: regenerate, edit, rewind and another turn are refused
    _racing(client, client, "race", {"text": " more"}, [
        lambda: client.regenerate("race", max_new_tokens=4),
        lambda: client.edit("race", "changed", max_new_tokens=4),
        lambda: client.rewind_session("race", 1),
        lambda: client.chat("race", "also", max_new_tokens=4),
    ], server)  # fmt: skip
    after = client.get_session("race", include_turns=True, include_token_ids=True)
    assert after.turns == 2 and after.token_ids[: len(base)] == base and after.turn_log[1].output_tokens == HOLD_TOKENS
    _check_log(after)
    # a regenerate in flight: a new turn and a rewind are refused
    _racing(client, client, "race", {"turn_mode": "regenerate"}, [
        lambda: client.chat("race", "again", max_new_tokens=4),
        lambda: client.rewind_session("race", 1),
    ], server)  # fmt: skip
    final = client.get_session("race", include_turns=True, include_token_ids=True)
    assert final.turns == 2 and final.token_ids[: after.turn_log[1].start_token + after.turn_log[1].input_tokens] \
        == after.token_ids[: after.turn_log[1].start_token + after.turn_log[1].input_tokens]  # fmt: skip
    _check_log(final)


def test_many_racing_operations_never_corrupt_the_transcript(client):
    client.chat("storm", MSGS[0], max_new_tokens=4)
    ok: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()

    def op(kind: str, i: int) -> None:
        try:
            if kind == "append":
                client.chat("storm", f"turn {i}", max_new_tokens=4)
            elif kind == "regenerate":
                client.regenerate("storm", max_new_tokens=4, temperature=1.0, seed=i)
            else:
                client.edit("storm", f"edit {i}", max_new_tokens=4)
            with lock:
                ok.append(kind)
        except KVServeError as e:
            assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
            with lock:
                refused.append(kind)

    threads = [threading.Thread(target=op, args=(k, i)) for i in range(4) for k in ("append", "regenerate", "edit")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(ok) + len(refused) == 12 and ok
    info = client.get_session("storm", include_turns=True, include_token_ids=True)
    assert info.turns == 1 + ok.count("append")
    _check_log(info)


# ----------------------------------------------------------------------------- replicas, restart


def _replica(model_dir, url):
    return ServerThread(tiny_config(model_dir, redis_url=url, host_cache_memory=0, spill_after=3600,
                                    restore_policy="always"))  # fmt: skip


def test_a_regenerate_on_another_replica_is_refused_while_a_turn_runs(tiny_llama_dir, redis_url):
    with _replica(tiny_llama_dir, redis_url) as sa, _replica(tiny_llama_dir, redis_url) as sb, \
            KVServeClient(sa.address, timeout=60) as a, KVServeClient(sb.address, timeout=60) as b:  # fmt: skip
        a.chat("two", MSGS[0], max_new_tokens=6)
        _racing(a, b, "two", {"text": " go on"}, [
            lambda: b.regenerate("two", max_new_tokens=4),
            lambda: b.edit("two", "changed", max_new_tokens=4),
            lambda: b.rewind_session("two", 1),
        ], sa)  # fmt: skip
        _racing(b, a, "two", {"turn_mode": "regenerate"}, [lambda: a.chat("two", "and?", max_new_tokens=4)], sb)
        info = b.get_session("two", include_turns=True)
        assert info.turns == 2
        _check_log(info)


def test_fork_and_rewind_survive_a_drain_and_resume_from_redis_on_another_replica(tiny_llama_dir, redis_url):
    with _replica(tiny_llama_dir, redis_url) as sa, KVServeClient(sa.address, timeout=60) as a:
        replies = _three_turns(a, "trunk")
        full = a.get_session("trunk", include_turns=True, include_token_ids=True)
        a.fork_session("trunk", "branch", at_turn=2)
        a.rewind_session("trunk", 1)
    # the drain wrote both sessions' blocks to Redis; a fresh replica has none on its device
    end2 = full.turn_log[2].start_token
    with _replica(tiny_llama_dir, redis_url) as sb, KVServeClient(sb.address, timeout=60) as b:
        for sid in ("trunk", "branch"):
            info = b.get_session(sid, include_turns=True, include_token_ids=True)
            assert info.turns == 2 and info.token_ids == full.token_ids[:end2] and info.turn_log == full.turn_log[:2]
            assert info.cached_blocks["redis"] == info.full_blocks == end2 // BLOCK_SIZE
        again = b.chat("trunk", f"{MSGS[2]} (trunk)", max_new_tokens=6)  # the rewound question, re-asked
        assert again.start.cached_by_tier["redis"] >= end2 // BLOCK_SIZE * BLOCK_SIZE > 0
        assert again.token_ids == replies[2].token_ids
        r = b.chat("branch", "something else entirely", max_new_tokens=4)
        assert r.start.cached_tokens >= end2 // BLOCK_SIZE * BLOCK_SIZE and not r.start.session_created
        regen = b.regenerate("branch", max_new_tokens=4)
        assert regen.token_ids == r.token_ids and b.get_session("branch").turns == 3


# ----------------------------------------------------------------------------- records before turn boundaries


def _v1_record(sid: str, owner: str, tokens: list[int], turns: int) -> bytes:
    """A session record as the server wrote it before turn boundaries (codec version 1)."""
    meta = json.dumps({"session_id": sid, "owner": owner, "created_at": 1.0, "last_used_at": 2.0, "turns": turns,
                       "cache_salt": "", "etag": "old"}, separators=(",", ":")).encode()  # fmt: skip
    body = struct.pack("<4sHI", b"KVSS", 1, len(meta)) + meta
    body += struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens)
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_record_without_turn_boundaries_loads_and_continues(tiny_llama_dir, redis_url):
    with _replica(tiny_llama_dir, redis_url) as sa, KVServeClient(sa.address, timeout=60) as a:
        a.chat("probe", "hello", max_new_tokens=4)
        old = a.get_session("probe", include_token_ids=True).token_ids
        r = redis.Redis.from_url(redis_url)
        keys = [k for k in r.keys("*sess:*") if k.endswith(b":probe")]
        assert len(keys) == 1
        key = keys[0][: -len(b"probe")] + b"legacy"
        r.set(key, _v1_record("legacy", "", old, turns=2))
        r.zadd(keys[0].replace(b"sess:", b"sess-ids:")[: -len(b":probe")], {"legacy": 0})
        info = a.get_session("legacy", include_turns=True)
        assert (info.turns, info.token_count, info.turn_log) == (2, len(old), [])
        reply = a.chat("legacy", "and then?", max_new_tokens=4)
        info = a.get_session("legacy", include_turns=True)
        assert info.turns == 3 and [(t.index, t.start_token) for t in info.turn_log] == [(2, len(old))]
        assert info.turn_log[0].output_tokens == len(reply.token_ids)
        for call in (lambda: a.rewind_session("legacy", 2), lambda: a.fork_session("legacy", "lf", at_turn=1)):
            code, msg = _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "before turn" in msg, msg
        assert a.fork_session("legacy", "lf", at_turn=2).token_count == len(old)
        assert a.rewind_session("legacy", 1)[0].token_count == len(old)
        code, msg = _code(lambda: a.regenerate("legacy"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "before turn boundaries" in msg
