"""AsyncEngine's stream interval: a stream's deltas are at least ``stream_interval_s``
apart; the first token goes at once, the tokens generated meanwhile go together in one
delta, released by the first step after the interval or by the sequence's end."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.service.engine.async_engine import STREAM_INTERVAL_S, AsyncEngine
from kvserve.service.models.loading import load_model
from kvserve.service.types import Delta, Finished, GenerationRequest, SamplingParams, Started
from tests.fixtures.engine import finished, make_engine, prompts, req

LONG = 3600.0  # an interval no test waits out: only the sequence's end can release the hold
GUARD_S = 300  # a hang guard, not a speed assertion


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def collect(loaded, request, interval: float, on_event=None) -> list:
    async def main():
        aeng = AsyncEngine(make_engine(loaded), stream_interval_s=interval)
        aeng.start()
        try:
            events = []
            async for ev in aeng.generate(request):
                events.append(ev)
                if on_event is not None:
                    await on_event(aeng, ev)
            assert not aeng._holds and not aeng._queues
            return events
        finally:
            await aeng.shutdown()

    return asyncio.run(asyncio.wait_for(main(), GUARD_S))


def test_the_first_delta_goes_at_once_and_the_end_releases_the_held_rest(loaded):
    (p,) = prompts(loaded.config.vocab_size, [7])
    events = collect(loaded, req("held", p, n=200, logprobs=1), LONG)
    deltas = [e for e in events if isinstance(e, Delta)]
    done = finished(events)
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    # the first goes at once (with any token queued behind it while this consumer was
    # not reading yet), every later token in one delta released by the end
    assert len(deltas) == 2 and len(done.output_token_ids) == 200
    assert [t for d in deltas for t in d.token_ids] == done.output_token_ids
    assert "".join(d.text for d in deltas) == done.text
    assert [lp.token_id for d in deltas for lp in d.logprobs] == done.output_token_ids


def test_without_an_interval_the_same_tokens_come(loaded):
    (p,) = prompts(loaded.config.vocab_size, [7])
    held = finished(collect(loaded, req("a", p, n=16), LONG))
    plain = collect(loaded, req("b", p, n=16), 0.0)
    assert [t for e in plain if isinstance(e, Delta) for t in e.token_ids] == held.output_token_ids
    assert finished(plain).output_token_ids == held.output_token_ids


def test_n_sequences_are_held_and_released_each_in_order(loaded):
    (p,) = prompts(loaded.config.vocab_size, [5], seed=3)
    sampling = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, seed=4, n=3)
    events = collect(loaded, GenerationRequest("n3", list(p), sampling), LONG)
    ends = {e.index: e for e in events if isinstance(e, Finished)}
    assert sorted(ends) == [0, 1, 2]
    for i, end in ends.items():
        got = [t for e in events if isinstance(e, Delta) and e.index == i for t in e.token_ids]
        assert got == end.output_token_ids and len(got) == 10


def test_closing_a_held_stream_aborts_it_and_drops_the_hold(loaded):
    (p,) = prompts(loaded.config.vocab_size, [7])

    async def main():
        aeng = AsyncEngine(make_engine(loaded), stream_interval_s=LONG)
        aeng.start()
        try:
            gen = aeng.generate(req("gone", p, n=240))  # as long as the pool allows: long enough to be held before its end
            assert isinstance(await gen.__anext__(), Started)
            assert isinstance(await gen.__anext__(), Delta)
            nxt = asyncio.ensure_future(gen.__anext__())  # held: the interval has not passed
            # held while the engine goes on (its tokens kept on the engine thread or here)
            while aeng.engine.runner.num_decode_tokens < 20:
                assert not nxt.done()
                await asyncio.sleep(0.001)
            assert not nxt.done()
            nxt.cancel()
            with pytest.raises(asyncio.CancelledError):
                await nxt
            await gen.aclose()
            assert not aeng._holds and not aeng._queues
            while aeng.engine.has_work():  # the abort reaches the engine on its next step
                await asyncio.sleep(0.01)
        finally:
            await aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), GUARD_S))


def test_the_engine_thread_wakes_the_loop_once_per_interval_not_once_per_step(loaded):
    """Within an interval the engine thread keeps a stream's deltas (waking the event loop
    costs it the GIL): the first token and the end go at once, the tokens between them in
    far fewer hand-overs than steps, all of them, in order."""
    (p,) = prompts(loaded.config.vocab_size, [7])

    async def main():
        aeng = AsyncEngine(make_engine(loaded), stream_interval_s=LONG)
        calls = []
        dispatch = aeng._dispatch
        aeng._dispatch = lambda emitted: (calls.append(list(emitted)), dispatch(emitted))
        aeng.start()
        try:
            events = [ev async for ev in aeng.generate(req("few", p, n=100))]
        finally:
            await aeng.shutdown()
        return events, calls

    events, calls = asyncio.run(asyncio.wait_for(main(), GUARD_S))
    handed = [ev for batch in calls for _, ev in batch]
    deltas = [ev for ev in handed if isinstance(ev, Delta)]
    assert sum(len(d.token_ids) for d in deltas) == 100  # a delta per step, every one handed over
    assert len(calls) < len(deltas)
    assert len(calls) <= 3  # the start with the first token (one step), then the end with the rest
    assert isinstance(calls[-1][-1][1], Finished) and isinstance(calls[0][0][1], Started)
    assert [t for d in deltas for t in d.token_ids] == finished(events).output_token_ids


def test_a_step_after_the_interval_releases_the_hold_a_step_before_does_not(loaded):
    async def main():
        aeng = AsyncEngine(make_engine(loaded))  # not started: _dispatch is driven by hand
        aeng._loop = loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        aeng._queues["s"] = q
        later = loop.create_future()
        aeng._holds["s"] = (later, loop.time() + LONG)
        aeng._dispatch([("s", Delta([1], "a"))])
        assert not later.done()  # within the interval: held
        due = loop.create_future()
        aeng._holds["s"] = (due, loop.time())
        aeng._dispatch([("s", Delta([2], "b"))])
        assert due.done()  # the step after the interval releases it
        ended = loop.create_future()
        aeng._holds["s"] = (ended, loop.time() + LONG)
        aeng._dispatch([("s", Finished("stop", 3, 2, 0, [1, 2], "ab"))])
        assert ended.done()  # the end releases it whatever the time
        assert q.qsize() == 3

    asyncio.run(main())


def test_stream_interval_setting_reaches_the_engine_config() -> None:
    """--stream-interval / KVSERVE_STREAM_INTERVAL (a duration; 0 sends every token as it
    comes) is what build_engine hands AsyncEngine; out of range is refused in one line."""
    from kvserve.service.config import ConfigError, ServerConfig

    assert ServerConfig.from_args([], {}).engine_config().stream_interval_s == STREAM_INTERVAL_S == 0.02
    assert ServerConfig.from_args(["--stream-interval", "0"], {}).engine_config().stream_interval_s == 0.0
    assert ServerConfig.from_args([], {"KVSERVE_STREAM_INTERVAL": "50ms"}).engine_config().stream_interval_s == 0.05
    with pytest.raises(ConfigError, match="--stream-interval .* between 0 and 10 seconds"):
        ServerConfig.from_args(["--stream-interval", "11"], {})
