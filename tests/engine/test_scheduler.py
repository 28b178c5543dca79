"""Many users at once (issue 29): a returning turn beside other sessions' decodes.

A returning turn whose prefix is cached on the device needs only its new tokens
prefilled: it must get its first token in the step it is admitted, while 8 other
sequences decode, with the host tier on (its new blocks are in no tier: no hop through
the restore thread) and with a long cold prompt admitted before it (chunked: the cold
prompt takes what is left of the step's token budget). Counted in engine steps, so the
figures do not depend on how loaded the machine is. Outputs are checked against an
uncached reference."""

from __future__ import annotations

import pytest

from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.store import build_store
from kvserve.service.models.loading import load_model
from kvserve.service.types import Delta, Finished, Tier
from tests.fixtures.engine import BS, bytes_per_token, finished, greedy_reference, make_engine, prompts, req, run

N_DECODING = 8


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def engine_for(loaded, *, host_tier: bool, batched_tokens: int = 512):
    store = None
    if host_tier:
        store = build_store(EngineConfig(block_size=BS, host_cache_memory=256 * BS * bytes_per_token(loaded)), loaded)
    return make_engine(
        loaded, store=store, kv_cache_memory=512 * BS * bytes_per_token(loaded),
        max_num_seqs=16, max_num_batched_tokens=batched_tokens,
    )  # fmt: skip


def cached_transcript(loaded, engine, seed: int) -> list[int]:
    """Turn 1 of a session, run alone: its transcript's blocks stay cached on the device."""
    (p1,) = prompts(loaded.config.vocab_size, [13], seed=seed)
    fin = finished(run(engine, [req("turn1", p1, n=6)])["turn1"])
    return p1 + fin.output_token_ids


def start_decoders(loaded, engine, events: dict) -> None:
    """N_DECODING sequences, stepped until every one of them decodes."""
    for i, p in enumerate(prompts(loaded.config.vocab_size, [11] * N_DECODING, seed=5)):
        engine.add_request(req(f"d{i}", p, n=60))
        events[f"d{i}"] = []
    while not all(any(isinstance(e, Delta) for e in evs) for evs in events.values()):
        for rid, ev in engine.step():
            events[rid].append(ev)


def steps_to_first_token(engine, rid: str, events: dict, limit: int = 50) -> int:
    for step in range(1, limit + 1):
        for r, ev in engine.step():
            events.setdefault(r, []).append(ev)
        if any(isinstance(e, Delta) and e.token_ids for e in events.get(rid, [])):
            return step
    raise AssertionError(f"{rid} got no token in {limit} steps")


def finish_all(engine, events: dict) -> None:
    for _ in range(2000):
        if not engine.has_work():
            return
        for r, ev in engine.step():
            events.setdefault(r, []).append(ev)
    raise AssertionError("the engine did not finish")


def output_of(evs) -> list[int]:
    fin = evs[-1]
    assert isinstance(fin, Finished) and not fin.error, fin
    return fin.output_token_ids


@pytest.mark.parametrize("host_tier", [False, True], ids=["device-only", "host-tier"])
def test_returning_turn_gets_its_first_token_in_the_step_it_is_admitted(loaded, host_tier):
    engine = engine_for(loaded, host_tier=host_tier)
    try:
        transcript = cached_transcript(loaded, engine, seed=1)
        events: dict = {}
        start_decoders(loaded, engine, events)
        prompt = transcript + [7, 8, 9, 10, 11, 12, 13, 14, 15]  # two new full blocks and a partial one
        prefill0 = engine.runner.num_prefill_tokens
        engine.add_request(req("turn2", prompt, n=5))
        assert steps_to_first_token(engine, "turn2", events) == 1
        started = events["turn2"][0]
        assert started.cached_tokens == (len(transcript) - 1) // BS * BS
        assert started.cached_by_tier == {Tier.DEVICE: started.cached_tokens}
        # only the new tokens (and the partial last cached block) were prefilled
        assert engine.runner.num_prefill_tokens - prefill0 == len(prompt) - started.cached_tokens
        finish_all(engine, events)
        assert output_of(events["turn2"]) == greedy_reference(loaded.model, prompt, 5)
    finally:
        engine.close()


def test_cold_long_prompt_is_chunked_and_does_not_delay_a_returning_turn(loaded):
    budget = 32
    engine = engine_for(loaded, host_tier=True, batched_tokens=budget)
    try:
        transcript = cached_transcript(loaded, engine, seed=2)
        events: dict = {}
        start_decoders(loaded, engine, events)
        (cold,) = prompts(loaded.config.vocab_size, [150], seed=3)
        engine.add_request(req("cold", cold, n=4))  # admitted first: earlier in the running list
        prompt = transcript + [21, 22, 23, 24, 25, 26, 27]
        engine.add_request(req("turn2", prompt, n=4))
        prefill0 = engine.runner.num_prefill_tokens
        assert steps_to_first_token(engine, "turn2", events) == 1
        # the step's prefill stayed within what the 8 decode rows left of the budget
        assert engine.runner.num_prefill_tokens - prefill0 <= budget - N_DECODING
        assert not any(isinstance(e, Delta) for e in events.get("cold", []))  # still being chunked
        steps = 0
        while not any(isinstance(e, Delta) for e in events.get("cold", [])):
            before = engine.runner.num_prefill_tokens
            for r, ev in engine.step():
                events.setdefault(r, []).append(ev)
            assert engine.runner.num_prefill_tokens - before <= budget
            steps += 1
            assert steps < 50
        assert steps >= len(cold) // budget  # it took several chunks
        finish_all(engine, events)
        assert output_of(events["turn2"]) == greedy_reference(loaded.model, prompt, 4)
        assert output_of(events["cold"]) == greedy_reference(loaded.model, cold, 4)
        for i in range(N_DECODING):
            assert len(output_of(events[f"d{i}"])) == 60
    finally:
        engine.close()


def test_decodes_are_planned_before_prefills_and_short_prefills_before_long(loaded):
    """The plan itself: decode rows first, then prefills by pending tokens, within the budget."""
    engine = engine_for(loaded, host_tier=False, batched_tokens=40)
    try:
        events: dict = {}
        start_decoders(loaded, engine, events)
        long_p, short_p = prompts(loaded.config.vocab_size, [100, 9], seed=4)
        engine.add_request(req("long", long_p, n=2))
        engine.add_request(req("short", short_p, n=2))
        engine.scheduler.drain_inbox()
        engine.scheduler.admit()
        plan = engine.scheduler.plan()
        assert [s.request_id for s in plan.decode] == [f"d{i}" for i in range(N_DECODING)]
        assert [(s.request_id, n) for s, n in plan.prefill] == [("short", 9), ("long", 40 - N_DECODING - 9)]
    finally:
        engine.close()
