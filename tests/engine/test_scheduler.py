"""Many users at once (issue 29): a returning turn beside other sessions' decodes.

A returning turn whose prefix is cached on the device needs only its new tokens
prefilled: it must get its first token in the step it is admitted, while 8 other
sequences decode, with the host tier on (its new blocks are in no tier: no hop through
the restore thread) and with a long cold prompt admitted before it (chunked: the cold
prompt takes what is left of the step's token budget). A wave of returning turns is
computed in the batches that give the least sum of their first tokens' times, at the
step costs the engine measured (pinned here, so that the plans do not depend on how
loaded the machine is). Counted in engine steps, for the same reason. Outputs are
checked against an uncached reference."""

from __future__ import annotations

import itertools
import random

import pytest

from kvserve.service.engine.config import EngineConfig
from kvserve.service.engine.scheduler import PREFILL_MAX_WAITS, first_batch
from kvserve.service.engine.speculative import StepCost
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


class PinnedCost(StepCost):
    """A step's fixed cost, whatever the engine times."""

    def __init__(self, fixed_s: float) -> None:
        super().__init__()
        self.fixed_s = fixed_s

    def add(self, rows: int, seconds: float) -> None:
        pass

    def at(self, rows: int) -> float:
        return self.fixed_s


def pin_costs(engine, *, fixed_s: float, prefill_tokens_per_s: float) -> None:
    engine.scheduler.step_cost = PinnedCost(fixed_s)
    engine.scheduler.prefill_rate = lambda: prefill_tokens_per_s


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


def finish_and_check(loaded, engine, events: dict, turns: dict[str, list[int]], n: int) -> None:
    """Run to the end: each turn's n tokens are the uncached reference's, and every
    decoder made its 60."""
    finish_all(engine, events)
    for rid, prompt in turns.items():
        assert output_of(events[rid]) == greedy_reference(loaded.model, prompt, n)
    for i in range(N_DECODING):
        assert len(output_of(events[f"d{i}"])) == 60


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


def test_returning_turns_of_one_step_share_one_prefill_forward(loaded):
    """Three returning turns admitted together beside 8 decodes, their tokens cheap against
    a step's fixed cost: their prefill chunks run as one forward (one read of the weights,
    not three), each gets its first token in 1 step, and each output is the uncached
    reference's."""
    engine = engine_for(loaded, host_tier=True)
    # a step's fixed cost far above their tokens' (a ~1 ms step, 9 tokens at 1M tokens/s)
    pin_costs(engine, fixed_s=1e-3, prefill_tokens_per_s=1e6)
    try:
        transcripts = [cached_transcript(loaded, engine, seed=10 + i) for i in range(3)]
        events: dict = {}
        start_decoders(loaded, engine, events)
        new = [list(range(30 + 9 * i, 39 + 9 * i)) for i in range(3)]  # 9 new tokens each
        turns = {f"turn2-{i}": t + n for i, (t, n) in enumerate(zip(transcripts, new))}
        for rid, prompt in turns.items():
            engine.add_request(req(rid, prompt, n=5))
        forwards0 = engine.runner.num_prefill_forwards
        prefill0 = engine.runner.num_prefill_tokens
        assert steps_to_first_token(engine, "turn2-0", events) == 1
        assert all(any(isinstance(e, Delta) and e.token_ids for e in events[rid]) for rid in turns)
        assert engine.runner.num_prefill_forwards - forwards0 == 1
        cached = [events[rid][0].cached_tokens for rid in turns]
        assert engine.runner.num_prefill_tokens - prefill0 == sum(len(p) for p in turns.values()) - sum(cached)
        finish_and_check(loaded, engine, events, turns, 5)
    finally:
        engine.close()


def test_a_long_cold_chunk_runs_apart_from_a_returning_turn(loaded):
    """Padding decides the forwards: a 120-token cold chunk and a returning turn's few
    tokens would pad the short one to 120, so they run as two forwards in the same step;
    the returning turn still gets its first token in 1 step, both outputs the reference's."""
    engine = engine_for(loaded, host_tier=False)
    pin_costs(engine, fixed_s=1e-3, prefill_tokens_per_s=1e6)  # one step's batch: both
    try:
        transcript = cached_transcript(loaded, engine, seed=20)
        events: dict = {}
        start_decoders(loaded, engine, events)
        (cold,) = prompts(loaded.config.vocab_size, [120], seed=21)
        prompt = transcript + [40, 41, 42, 43, 44, 45, 46]
        engine.add_request(req("cold", cold, n=3))
        engine.add_request(req("turn2", prompt, n=3))
        forwards0 = engine.runner.num_prefill_forwards
        assert steps_to_first_token(engine, "turn2", events) == 1
        assert any(isinstance(e, Delta) and e.token_ids for e in events["cold"])  # whole in this step too
        assert engine.runner.num_prefill_forwards - forwards0 == 2
        finish_all(engine, events)
        assert output_of(events["turn2"]) == greedy_reference(loaded.model, prompt, 3)
        assert output_of(events["cold"]) == greedy_reference(loaded.model, cold, 3)
    finally:
        engine.close()


def test_prefill_groups_join_chunks_while_padding_stays_within_the_slack():
    """The grouping rule itself, on stand-in sequences (num_computed is all it reads)."""
    from types import SimpleNamespace

    from kvserve.service.engine.runner import prefill_groups

    def s(computed: int) -> SimpleNamespace:
        return SimpleNamespace(num_computed=computed)

    a, b, c, d = s(100), s(104), s(96), s(0)
    # similar chunks over similar contexts: one forward, sorted by length
    assert [[(x, n) for x, n in g] for g in prefill_groups([(a, 70), (b, 66), (c, 72)])] == [[(b, 66), (a, 70), (c, 72)]]
    # a long cold chunk beside a short one: apart
    assert prefill_groups([(d, 400), (a, 70)]) == [[(a, 70)], [(d, 400)]]
    # the same lengths over very different contexts: apart (each would attend over the longest)
    far, near = s(2000), s(10)
    assert prefill_groups([(near, 16), (far, 16)]) == [[(near, 16)], [(far, 16)]]
    # every chunk in exactly one forward; one chunk: one forward
    assert prefill_groups([(a, 5)]) == [[(a, 5)]]
    assert prefill_groups([]) == []


def test_a_wave_of_returning_turns_whose_tokens_cost_more_than_a_step_gets_a_step_each(loaded):
    """Four returning turns arriving together beside 8 decodes, their new tokens costing
    far more than a step's fixed cost (the products of a compute-bound forward): one turn
    a step, fewest new tokens first, so each gets its first token as soon as its own
    tokens are done (steps 1..4) instead of all of them at the last one's time; the
    outputs are the uncached reference's. With the fixed cost far above the tokens' the
    same wave shares step 1."""
    for fixed_s, expect in ((1e-4, [1, 2, 3, 4]), (1.0, [1, 1, 1, 1])):
        engine = engine_for(loaded, host_tier=True)
        pin_costs(engine, fixed_s=fixed_s, prefill_tokens_per_s=1000.0)  # 1 ms a token
        try:
            transcripts = [cached_transcript(loaded, engine, seed=40 + i) for i in range(4)]
            events: dict = {}
            start_decoders(loaded, engine, events)
            # new tokens: 23, 5, 14 and 9 past each transcript (not in admission order)
            turns = {f"t{i}": t + list(range(50, 50 + k)) for i, (t, k) in enumerate(zip(transcripts, (23, 5, 14, 9)))}
            for rid, prompt in turns.items():
                engine.add_request(req(rid, prompt, n=4))
            first: dict[str, int] = {}
            for step in range(1, 10):
                for r, ev in engine.step():
                    events.setdefault(r, []).append(ev)
                    if r in turns and isinstance(ev, Delta) and ev.token_ids:
                        first.setdefault(r, step)
                if len(first) == len(turns):
                    break
            by_pending = sorted(turns, key=lambda r: len(turns[r]) - events[r][0].cached_tokens)
            assert [first[r] for r in by_pending] == expect
            finish_and_check(loaded, engine, events, turns, 4)
        finally:
            engine.close()


def test_a_long_prompt_progresses_while_short_prompts_keep_arriving(loaded):
    """Short prompts arriving every step, at costs that compute them one a step (the
    least-sum plan never puts a long prompt first): a long cold prompt, passed over by
    later prompts at every step, still gets a chunk at least every PREFILL_MAX_WAITS + 1
    steps (what is left of the budget after the step's short prompt) and ends with the
    uncached reference's output, instead of waiting for as long as short prompts arrive."""
    budget = 48
    engine = engine_for(loaded, host_tier=False, batched_tokens=budget)
    pin_costs(engine, fixed_s=1e-4, prefill_tokens_per_s=1000.0)
    try:
        (long,) = prompts(loaded.config.vocab_size, [160], seed=7)
        engine.add_request(req("long", long, n=3))
        events: dict = {}
        for r, ev in engine.step():  # alone: its first chunk; every short prompt starts after it
            events.setdefault(r, []).append(ev)
        computed = engine.scheduler._by_id["long"].num_computed
        assert 0 < computed < len(long)
        waited, longest = 0, 0
        for step in range(40):
            for k, n in enumerate((8, 9)):  # two new short prompts a step: always two waiting
                (p,) = prompts(loaded.config.vocab_size, [n], seed=100 + 2 * step + k)
                engine.add_request(req(f"s{step}-{k}", p, n=1))
            for r, ev in engine.step():
                events.setdefault(r, []).append(ev)
            seq = engine.scheduler._by_id.get("long")
            now = len(long) if seq is None else seq.num_computed
            waited = 0 if now > computed else waited + 1
            longest, computed = max(longest, waited), now
            if any(isinstance(e, Delta) and e.token_ids for e in events.get("long", [])):
                break
        assert computed == len(long), f"the long prompt computed {computed} of {len(long)} tokens in 40 steps"
        assert longest <= PREFILL_MAX_WAITS
        finish_all(engine, events)
        assert output_of(events["long"]) == greedy_reference(loaded.model, long, 3)
    finally:
        engine.close()


def test_a_wave_longer_than_prefill_max_waits_is_still_computed_a_prompt_a_step(loaded):
    """The prompts of one wave (arriving together) never count as passing each other
    over: 8 of them at the one-a-step costs get their first tokens at steps 1..8,
    shortest first, the last ones long past PREFILL_MAX_WAITS steps."""
    engine = engine_for(loaded, host_tier=False)
    pin_costs(engine, fixed_s=1e-4, prefill_tokens_per_s=1000.0)
    try:
        lengths = [12, 5, 9, 7, 11, 6, 10, 8]
        wave = {f"w{n}": p for n, p in zip(lengths, prompts(loaded.config.vocab_size, lengths, seed=60))}
        for rid, p in wave.items():
            engine.add_request(req(rid, p, n=2))
        events: dict = {}
        first: dict[str, int] = {}
        for step in range(1, 20):
            for r, ev in engine.step():
                events.setdefault(r, []).append(ev)
                if isinstance(ev, Delta) and ev.token_ids:
                    first.setdefault(r, step)
            if len(first) == len(wave):
                break
        assert [first[f"w{n}"] for n in sorted(lengths)] == list(range(1, 9))
        assert len(wave) > PREFILL_MAX_WAITS + 1
        finish_all(engine, events)
        for rid, p in wave.items():
            assert output_of(events[rid]) == greedy_reference(loaded.model, p, 2)
    finally:
        engine.close()


def _sum_of_waits(batches: list[list[int]], fixed: float, per_token: float) -> float:
    t = total = 0.0
    for batch in batches:
        t += fixed + per_token * sum(batch)
        total += t * len(batch)
    return total


def _schedule(sizes: list[int], fixed: float, per_token: float, budget: int) -> list[list[int]]:
    """first_batch applied step after step: the batches the scheduler would run."""
    out, rest = [], list(sizes)
    while rest:
        k = first_batch(rest, fixed, per_token, budget)
        assert 1 <= k <= len(rest)
        out.append(rest[:k])
        rest = rest[k:]
    return out


def _batchings(order: tuple[int, ...]):
    """Every split of ``order`` into consecutive batches."""
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        batches, cur = [], [order[0]]
        for size, cut in zip(order[1:], cuts):
            if cut:
                batches.append(cur)
                cur = []
            cur.append(size)
        batches.append(cur)
        yield batches


def test_first_batch_gives_the_least_sum_of_first_token_times():
    """Against brute force. With no budget: over every order of the prefills and every
    split of it into batches, none has a smaller sum of completion times than the
    schedule first_batch gives step after step (fewest tokens first). Within a budget:
    none of the splits of that order that keep to it has."""
    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 5)
        sizes = sorted(rng.randint(1, 40) for _ in range(n))
        fixed, per_token = rng.choice([0.0, 0.5, 5.0, 50.0]), rng.choice([0.1, 1.0])
        got = _sum_of_waits(_schedule(sizes, fixed, per_token, 10**9), fixed, per_token)
        best = min(_sum_of_waits(b, fixed, per_token) for o in set(itertools.permutations(sizes)) for b in _batchings(o))
        assert got == pytest.approx(best), (sizes, fixed, per_token)
        budget = rng.randint(40, 90)
        schedule = _schedule(sizes, fixed, per_token, budget)
        assert all(sum(b) <= budget for b in schedule)
        got = _sum_of_waits(schedule, fixed, per_token)
        best = min(
            _sum_of_waits(b, fixed, per_token) for b in _batchings(tuple(sizes)) if all(sum(x) <= budget for x in b)
        )
        assert got == pytest.approx(best), (sizes, fixed, per_token, budget)


def test_first_batch_on_a_wave_of_equal_turns():
    """Eight 64-token turns: one a step when a token costs far more than a step's fixed
    cost, all in one step when the fixed cost dominates, and never past the budget."""
    assert first_batch([64] * 8, 0.001, 0.0015, 512) == 1  # ~110M on 2 cores: compute-bound
    assert first_batch([64] * 8, 1.0, 0.0015, 512) == 8
    assert first_batch([64] * 8, 1.0, 0.0015, 200) == 3  # 3 x 64 <= 200
    assert first_batch([70], 0.0, 1.0, 512) == 1
