"""End to end over real gRPC on loopback: streaming, concurrency, cancellation, sessions."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

import grpc
import pytest
import torch

from kvserve.clients import AsyncKVServeClient, KVServeClient, KVServeError, StreamEnd, StreamStart, TextDelta
from kvserve.service.types import Finished, GenerationRequest, SamplingParams
from tests.fixtures.serving import BLOCK_SIZE, EngineHold, ServerThread, held_running, tiny_config, wait_until


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerThread(tiny_config(tiny_llama_dir)) as s:
        yield s


@pytest.fixture
def client(server):
    with KVServeClient(server.address, timeout=60) as c:
        yield c


def _idle_baseline(server: ServerThread) -> int:
    assert wait_until(lambda: server.engine.stats().running == 0 and server.engine.stats().waiting == 0)
    return server.engine.stats().blocks_free


def test_streamed_greedy_text_equals_the_engine_and_the_reference_model(server, client, tiny_llama_dir):
    prompt = "Once upon a time the quick brown fox"
    events = list(client.generate(text=prompt, max_new_tokens=24, ignore_eos=True))
    assert isinstance(events[0], StreamStart) and isinstance(events[-1], StreamEnd)
    deltas = [e for e in events[1:-1] if isinstance(e, TextDelta)]
    assert len(deltas) == len(events) - 2
    # streamed, not one lump: a stream long enough to outlast a 20 ms stream interval (the
    # tiny model can make 24 tokens before the first message goes out)
    longer = [e for e in client.generate(text=prompt, max_new_tokens=240, ignore_eos=True) if isinstance(e, TextDelta)]
    assert len(longer) > 1
    tokens = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert events[-1].completion_tokens == len(tokens) == 24
    assert events[-1].finish_reason == "length"

    # the same prompt through the engine in-process
    prompt_ids = server.engine.tokenizer.encode(prompt, add_bos=True)
    assert events[0].prompt_tokens == len(prompt_ids)

    async def direct() -> Finished:
        req = GenerationRequest("direct-1", prompt_ids, SamplingParams(max_new_tokens=24, ignore_eos=True))
        async for ev in server.engine.generate(req):
            if isinstance(ev, Finished):
                return ev
        raise AssertionError("no Finished event")

    fin = server.call(direct())
    assert tokens == fin.output_token_ids
    assert text == fin.text

    # and an independent reference: transformers greedy decoding, no KV pool
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(prompt_ids) :]


def test_two_concurrent_streams_both_progress_before_either_finishes(server, client):
    log: list[tuple[int, str]] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def consume(i: int) -> None:
        try:
            # long enough that neither can finish in one stream interval (20 ms) on a fast
            # host: the tiny model makes 40 tokens in a few milliseconds
            for ev in client.generate(text=f"stream number {i} says", max_new_tokens=480, ignore_eos=True):
                with lock:
                    log.append((i, type(ev).__name__))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    # both admitted in one step (EngineHold keeps the queue until both wait in it): on a
    # loaded host the second thread's call could otherwise arrive after the first ended
    with EngineHold(server):
        for t in threads:
            t.start()
        assert wait_until(lambda: server.engine.stats().waiting == 2)
    for t in threads:
        t.join(120)
    assert not errors
    first_end = next(k for k, (_, kind) in enumerate(log) if kind == "StreamEnd")
    before = log[:first_end]
    for i in range(2):
        assert sum(1 for j, kind in before if j == i and kind == "TextDelta") >= 2, log
    assert sum(1 for _, kind in log if kind == "StreamEnd") == 2


def test_cancelling_mid_stream_returns_free_blocks_to_baseline(server, client):
    baseline = _idle_baseline(server)
    engine = server.engine
    # the sequence is held running from its first step until the cancel has reached the
    # server (EngineHold: the tiny model makes its 400 tokens in ~30 ms, so a hold placed
    # at the stream's first text could come after its end)
    stream, running = held_running(
        server, lambda: client.generate(text="a long story about a server", max_new_tokens=400, ignore_eos=True))
    seen = 0
    try:
        for ev in stream:
            if isinstance(ev, TextDelta):
                seen += len(ev.token_ids)
                assert running.held.wait(60) and engine.stats().running == 1
                assert engine.stats().blocks_free < baseline  # the stream holds blocks
                stream.cancel()
                break
        assert wait_until(lambda: server.running.admission.inflight == 0)  # the server saw the cancel
    finally:
        running.release()
    assert 1 <= seen < 400
    assert wait_until(lambda: server.engine.stats().running == 0)
    assert wait_until(lambda: server.engine.stats().blocks_free == baseline)
    assert server.running.admission.inflight == 0
    # the server keeps serving
    assert client.complete(text="after cancel", max_new_tokens=4).end.completion_tokens == 4


DEADLINE_S = 2.0  # past a request's arrival on a loaded host (tens of ms); the stream is held longer


async def _until(predicate: Callable[[], bool]) -> bool:
    return await asyncio.to_thread(wait_until, predicate)


async def _held_running(server: ServerThread, start: Callable[[], asyncio.Task]) -> tuple[asyncio.Task, EngineHold]:
    """``start()`` a task that sends one stream; once its request waits in the engine's
    queue it is admitted, and its sequence then held running before its second step (its
    first token sent): it cannot end by itself before the test lets it go. The task and
    the hold (the caller releases it)."""
    with EngineHold(server):  # admitted only once the next hold is in place
        task = start()
        assert await _until(lambda: server.engine.stats().waiting == 1)  # the request reached the engine
        running = EngineHold(server, running=1)
    return task, running


def _seq_steps(server: ServerThread) -> int:
    """Sequence-steps that gave tokens, all sequences together."""
    return sum(server.engine.stats().step_tokens)


async def _ended_by_the_server(server: ServerThread) -> int:
    """The client's call has ended: wait until the server has ended it too (it queued the
    sequence's abort); the sequence-steps by then."""
    assert await _until(lambda: server.running.admission.inflight == 0)
    return _seq_steps(server)


async def _stopped(server: ServerThread, ended_at: int) -> None:
    """Let go after ``_ended_by_the_server``, the engine has run at most one more step of
    the sequence (a step that had taken its aborts before that one came: the one a hold
    holds) and has none of it left; a sequence left running would take hundreds of steps
    to its 480 tokens."""
    assert await _until(lambda: server.engine.stats().running == server.engine.stats().waiting == 0)
    assert _seq_steps(server) - ended_at <= 1


def test_deadline_and_async_task_cancellation_stop_the_engine(server):
    """A stream's deadline, the cancellation of the task reading it and ``stream.cancel()``
    each end the call and the engine stops the sequence. Each stream is held running
    (``_held_running``) until the call has ended: the tiny model makes its 480 tokens in
    tens of ms, so a stream could otherwise finish before its deadline or cancel."""
    baseline = _idle_baseline(server)

    async def scenario() -> None:
        async with AsyncKVServeClient(server.address) as c:
            # deadline: the call fails with DEADLINE_EXCEEDED (certain: the stream is held) and
            # the engine stops the sequence (held running, or still queued where the deadline
            # passed before the engine's next step)
            async def past_deadline() -> None:
                async for _ in c.generate(text="tell me everything", max_new_tokens=480, ignore_eos=True,
                                          timeout=DEADLINE_S):  # fmt: skip
                    pass

            task, running = await _held_running(server, lambda: asyncio.create_task(past_deadline()))
            try:
                with pytest.raises(KVServeError) as err:
                    await task
                assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
                ended_at = await _ended_by_the_server(server)
            finally:
                running.release()
            await _stopped(server, ended_at)

            # task cancellation of an async stream, its sequence held running
            got_token = asyncio.Event()

            async def consume() -> None:
                async for ev in c.generate(text="and more", max_new_tokens=480, ignore_eos=True):
                    if isinstance(ev, TextDelta) and ev.token_ids:
                        got_token.set()

            task, running = await _held_running(server, lambda: asyncio.create_task(consume()))
            try:
                await asyncio.wait_for(got_token.wait(), 60)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert await asyncio.to_thread(running.held.wait, 60) and server.engine.stats().running == 1
                ended_at = await _ended_by_the_server(server)
            finally:
                running.release()
            await _stopped(server, ended_at)

            # stream.cancel() inside the loop ends the stream; the task carries on
            stream = c.generate(text="and then", max_new_tokens=480, ignore_eos=True)
            tokens = 0

            async def read() -> None:
                nonlocal tokens
                async for ev in stream:
                    if isinstance(ev, TextDelta) and ev.token_ids:
                        if not tokens:
                            stream.cancel()
                        tokens += len(ev.token_ids)

            task, running = await _held_running(server, lambda: asyncio.create_task(read()))
            try:
                await task  # no error: the stream ended, the task goes on
                assert 1 <= tokens < 480
                assert await asyncio.to_thread(running.held.wait, 60) and server.engine.stats().running == 1
                ended_at = await _ended_by_the_server(server)
            finally:
                running.release()
            await _stopped(server, ended_at)

    asyncio.run(scenario())
    assert wait_until(lambda: server.engine.stats().running == 0)
    assert wait_until(lambda: server.engine.stats().blocks_free == baseline)


def test_three_turn_session_reuses_device_blocks_and_matches_a_cold_replay(server, client, tiny_llama_dir):
    engine = server.engine
    sid = "three-turns"
    messages = ["hello, tell me a short story", "what is the fox doing now", "thanks, and the dog?"]
    turns = []
    for k, msg in enumerate(messages):
        before = client.get_session(sid, include_token_ids=True).token_ids if k else []
        prefill_before = engine.stats().prefill_tokens
        reply = client.chat(sid, msg, max_new_tokens=12)
        prefilled = engine.stats().prefill_tokens - prefill_before
        after = client.get_session(sid, include_token_ids=True)
        prompt = after.token_ids[: len(after.token_ids) - len(reply.token_ids)]
        assert after.token_ids[len(prompt) :] == reply.token_ids
        assert prompt[: len(before)] == before  # the transcript only grows
        assert after.turns == k + 1 and not after.busy
        assert reply.start.prompt_tokens == len(prompt)
        full_blocks = len(before) // BLOCK_SIZE * BLOCK_SIZE
        if k == 0:
            assert reply.start.cached_tokens == 0 and reply.start.cached_tier == "none"
        else:
            assert reply.start.cached_tokens == full_blocks > 0
            assert reply.start.cached_tier == "device"
            assert reply.start.cached_by_tier == {"device": full_blocks, "host": 0, "disk": 0, "redis": 0}
        # the engine's prefill counter: the cached tokens were not recomputed
        assert prefilled == len(prompt) - reply.start.cached_tokens
        turns.append((prompt, reply.token_ids))

    # a fresh server replays each turn's whole prompt cold and generates the same tokens
    # (a cache salt per replay keeps the replays from sharing blocks with each other)
    with ServerThread(tiny_config(tiny_llama_dir)) as cold, KVServeClient(cold.address, timeout=60) as cold_client:
        for k, (prompt, output) in enumerate(turns):
            prefill_before = cold.engine.stats().prefill_tokens
            replay = cold_client.complete(token_ids=prompt, max_new_tokens=12, cache_salt=f"cold-{k}")
            assert replay.start.cached_tokens == 0
            assert cold.engine.stats().prefill_tokens - prefill_before == len(prompt)
            assert replay.token_ids == output


def test_text_turns_and_token_turns_append_to_the_transcript(client):
    sid = "mixed-input"
    first = client.complete(text="the cache model", session_id=sid, max_new_tokens=5)
    t1 = client.get_session(sid, include_token_ids=True).token_ids
    extra = [5, 6, 7]
    second = client.complete(token_ids=extra, session_id=sid, max_new_tokens=5)
    t2 = client.get_session(sid, include_token_ids=True).token_ids
    assert t2 == t1 + extra + second.token_ids
    assert t1[-len(first.token_ids) :] == first.token_ids


def test_a_cancelled_turn_leaves_the_transcript_as_before(server, client):
    """The turn is held running from its first step (``EngineHold``, in place before it
    starts) until the server has ended the cancelled call: its 400 tokens could otherwise
    end, and commit, before the cancel."""
    sid = "cancel-turn"
    client.chat(sid, "first message", max_new_tokens=6)
    before = client.get_session(sid, include_token_ids=True)
    engine = server.engine
    stream, running = held_running(server, lambda: client.generate(
        messages=[("user", "second message")], session_id=sid, max_new_tokens=400, ignore_eos=True))
    try:
        for ev in stream:
            if isinstance(ev, TextDelta) and ev.token_ids:
                assert running.held.wait(60) and engine.stats().running == 1  # the turn runs, held
                stream.cancel()
        assert wait_until(lambda: not client.get_session(sid).busy)  # the server ended the turn
    finally:
        running.release()
    after = client.get_session(sid, include_token_ids=True)
    assert after.token_ids == before.token_ids and after.turns == before.turns == 1
    # a retry works and finds the old transcript's full blocks on the device
    retry = client.chat(sid, "second message", max_new_tokens=6)
    assert retry.start.cached_tokens >= len(before.token_ids) // BLOCK_SIZE * BLOCK_SIZE


def test_list_and_delete_sessions(client):
    ids = [f"page-{i:02d}" for i in range(5)]
    for sid in ids:
        client.complete(token_ids=[10, 11, 12], session_id=sid, max_new_tokens=1)
    listed = [s.session_id for s in client.iter_sessions(page_size=2)]
    assert [s for s in listed if s.startswith("page-")] == ids
    page, token = client.list_sessions(page_size=2)
    assert len(page) == 2 and token
    client.delete_session(ids[0])
    with pytest.raises(KVServeError) as err:
        client.get_session(ids[0])
    assert err.value.code == grpc.StatusCode.NOT_FOUND
    info = client.get_session(ids[1])
    assert info.token_count == 4 and info.full_blocks == 0 and info.turns == 1


def test_model_info(server, client):
    info = client.model_info()
    m = server.engine.model_info
    assert info.vocab_size == m.vocab_size and info.context_length == m.context_length
    assert info.block_size == BLOCK_SIZE and info.model_fingerprint == m.model_fingerprint
    assert info.dtype == "float32" and info.device.startswith("cpu")
    assert info.max_new_tokens_limit == server.config.max_new_tokens_limit
