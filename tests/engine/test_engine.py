"""The engine on a random tiny Llama: continuous batching, prefix caching, preemption,
chunked prefill, cancellation. References are computed without the pool
(``forward_nocache``) so a wrong block table or a stale block cannot agree by accident."""

from __future__ import annotations

import pytest
import torch

from kvserve.service.types import (
    Delta,
    FinishReason,
    Finished,
    GenerationRequest,
    InvalidRequest,
    QueueFull,
    SamplingParams,
    Started,
    Tier,
)
from kvserve.service.models.loading import load_model
from kvserve.service.validation import check_context
from tests.fixtures.engine import BS, finished, greedy_reference, make_engine, prompts, req, run

@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def test_single_request_matches_uncached_reference(loaded):
    eng = make_engine(loaded)
    (p,) = prompts(loaded.config.vocab_size, [11])
    evs = run(eng, [req("a", p, n=12)])["a"]
    assert isinstance(evs[0], Started) and evs[0].prompt_tokens == 11 and evs[0].cached_tokens == 0
    deltas = [e for e in evs if isinstance(e, Delta)]
    fin = finished(evs)
    assert fin.output_token_ids == greedy_reference(loaded.model, p, 12)
    assert [t for d in deltas for t in d.token_ids] == fin.output_token_ids
    assert "".join(d.text for d in deltas) == fin.text
    assert fin.finish_reason is FinishReason.LENGTH
    assert eng.runner.num_prefill_tokens == 11 and eng.runner.num_decode_tokens == 11


def test_batched_requests_of_different_lengths_each_match_alone(loaded):
    ps = prompts(loaded.config.vocab_size, [3, 9, 14, 22], seed=1)
    alone = [finished(run(make_engine(loaded), [req("x", p)])["x"]).output_token_ids for p in ps]
    eng = make_engine(loaded)
    batch_sizes = []
    evs = run(
        eng,
        [req(f"r{i}", p) for i, p in enumerate(ps)],
        on_step=lambda i, e: batch_sizes.append(len(eng.scheduler.running)),
    )
    assert max(batch_sizes) == 4  # they really ran together
    for i, p in enumerate(ps):
        assert finished(evs[f"r{i}"]).output_token_ids == alone[i]


def test_chunked_prefill_gives_the_same_tokens(loaded):
    (p,) = prompts(loaded.config.vocab_size, [30], seed=2)
    ref = greedy_reference(loaded.model, p, 6)
    eng = make_engine(loaded, max_num_batched_tokens=7)
    assert finished(run(eng, [req("a", p, n=6)])["a"]).output_token_ids == ref


def test_shared_prefix_is_served_from_device_blocks(loaded):
    (system, q1, q2) = prompts(loaded.config.vocab_size, [12, 5, 6], seed=3)
    eng = make_engine(loaded)
    run(eng, [req("a", system + q1, n=4)])
    prefill_before = eng.runner.num_prefill_tokens
    evs = run(eng, [req("b", system + q2, n=6)])["b"]
    start = evs[0]
    assert start.cached_tokens == 12 and start.cached_tier is Tier.DEVICE
    assert eng.runner.num_prefill_tokens - prefill_before == len(q2)  # the 3 shared blocks were not rerun
    assert finished(evs).output_token_ids == greedy_reference(loaded.model, system + q2, 6)


def test_two_running_sequences_share_a_prefix_block(loaded):
    (system, q1, q2) = prompts(loaded.config.vocab_size, [8, 3, 7], seed=4)
    eng = make_engine(loaded)
    run(eng, [req("warm", system + [5], n=1)])
    seen_shared = []

    def check(i, events):
        if len(eng.scheduler.running) == 2:
            a, b = eng.scheduler.running
            ids_a = [blk.block_id for blk in a.blocks[:2]]
            seen_shared.append(ids_a == [blk.block_id for blk in b.blocks[:2]]
                               and all(blk.ref_count == 2 for blk in a.blocks[:2]))

    evs = run(eng, [req("a", system + q1), req("b", system + q2)], on_step=check)
    assert seen_shared and all(seen_shared)
    for rid, q in (("a", q1), ("b", q2)):
        assert evs[rid][0].cached_tokens == 8
        assert finished(evs[rid]).output_token_ids == greedy_reference(loaded.model, system + q, 8)


def test_multi_turn_transcript_is_fully_cached_including_the_last_token(loaded):
    (turn1,) = prompts(loaded.config.vocab_size, [10], seed=5)
    eng = make_engine(loaded)
    for n_new in (6, 5, 7):  # 10 + 6 = 16 tokens: the last sampled token completes a block
        fin = finished(run(eng, [req("t1", turn1, n=n_new)])["t1"])
        transcript = turn1 + fin.output_token_ids
        nxt = transcript + [7, 8, 9]
        evs = run(eng, [req("t2", nxt, n=3)])["t2"]
        assert evs[0].cached_tokens == (len(transcript) // BS) * BS
        assert finished(evs).output_token_ids == greedy_reference(loaded.model, nxt, 3)


def test_preemption_under_a_small_pool_keeps_outputs_exact(loaded):
    ps = prompts(loaded.config.vocab_size, [10, 11, 12, 13], seed=6)
    alone = [greedy_reference(loaded.model, p, 12) for p in ps]
    bpt = loaded.config.num_layers * 2 * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    eng = make_engine(loaded, kv_cache_memory=15 * BS * bpt)  # 14 usable blocks, 24 wanted
    evs = run(eng, [req(f"r{i}", p, n=12) for i, p in enumerate(ps)])
    assert eng.scheduler.num_preempted > 0
    for i in range(4):
        assert finished(evs[f"r{i}"]).output_token_ids == alone[i]
    assert eng.blocks.num_free == eng.blocks.num_usable


def test_decode_batches_that_change_every_few_steps_keep_every_sequence_exact(loaded):
    """Sequences join while others decode and finish at different lengths, and a small
    pool preempts some (their blocks given back and taken again), so the decode batch
    changes size and members from step to step and each sequence's block table (kept on
    the sequence across steps) is extended, and made again after a preemption: every
    output equals the uncached reference."""
    ps = prompts(loaded.config.vocab_size, [5, 9, 13, 7, 3], seed=12)
    ns = [20, 6, 14, 9, 17]
    alone = [greedy_reference(loaded.model, p, n) for p, n in zip(ps, ns)]
    bpt = loaded.config.num_layers * 2 * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    eng = make_engine(loaded, kv_cache_memory=16 * BS * bpt)  # 15 usable blocks, 27 wanted
    joins = {0: [0, 1], 3: [2], 6: [3, 4]}  # step -> requests added before it
    outputs: dict[str, list[int]] = {}
    sizes = []
    for i in range(500):
        for r in joins.get(i, []):
            eng.add_request(req(f"r{r}", ps[r], n=ns[r]))
        sizes.append(len(eng.scheduler.running))
        for rid, ev in eng.step():
            if isinstance(ev, Finished):
                outputs[rid] = ev.output_token_ids
        if len(outputs) == len(ps):
            break
    assert eng.scheduler.num_preempted > 0 and len(set(sizes)) >= 4
    assert [outputs[f"r{i}"] for i in range(len(ps))] == alone
    assert eng.blocks.num_free == eng.blocks.num_usable


def test_abort_releases_every_block(loaded):
    eng = make_engine(loaded)
    ps = prompts(loaded.config.vocab_size, [9, 17], seed=7)
    for i, p in enumerate(ps):
        eng.add_request(req(f"r{i}", p, n=50))
    for _ in range(3):
        eng.step()
    assert eng.blocks.num_free < eng.blocks.num_usable
    eng.abort("r0")
    eng.abort("r1")
    out = eng.step()
    reasons = {rid: ev.finish_reason for rid, ev in out if isinstance(ev, Finished)}
    assert reasons == {"r0": FinishReason.CANCELLED, "r1": FinishReason.CANCELLED}
    assert eng.blocks.num_free == eng.blocks.num_usable and not eng.scheduler.running


def test_seeded_sampling_is_reproducible_through_the_engine(loaded):
    (p,) = prompts(loaded.config.vocab_size, [6], seed=8)
    outs = []
    for other in ([], [5, 6, 7]):  # with and without a neighbour in the batch
        eng = make_engine(loaded)
        reqs = [req("s", p, n=16, temperature=1.0, top_p=0.9, seed=42)]
        if other:
            reqs.append(req("o", other, n=16, temperature=1.0))
        outs.append(finished(run(eng, reqs)["s"]).output_token_ids)
    assert outs[0] == outs[1]


def test_eos_and_stop_token_ids_end_generation(loaded):
    (p,) = prompts(loaded.config.vocab_size, [6], seed=9)
    ref = greedy_reference(loaded.model, p, 8)
    eng = make_engine(loaded)
    r = GenerationRequest("a", p, SamplingParams(max_new_tokens=8, stop_token_ids=(ref[3],)))
    fin = finished(run(eng, [r])["a"])
    assert fin.finish_reason is FinishReason.STOP
    assert fin.output_token_ids == ref[: ref.index(ref[3]) + 1]


def test_invalid_requests_are_rejected_with_precise_messages(loaded):
    eng = make_engine(loaded)
    V = loaded.config.vocab_size
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        eng.add_request(req("a", []))
    with pytest.raises(InvalidRequest, match=rf"prompt_token_ids\[1\] = {V} is outside the vocabulary \(ids must be < {V}\)"):
        eng.add_request(req("a", [1, V]))
    ctx = eng.max_model_len
    with pytest.raises(InvalidRequest) as e:  # the front's message (tests/unit/test_validation.py)
        eng.add_request(req("a", [3] * ctx))
    with pytest.raises(InvalidRequest) as front:
        check_context(0, ctx, ctx)
    assert str(e.value) == str(front.value)


def test_queue_full(loaded):
    eng = make_engine(loaded, max_queue=2)
    eng.add_request(req("a", [3, 4]))
    eng.add_request(req("b", [3, 4]))
    with pytest.raises(QueueFull, match="queue is full"):
        eng.add_request(req("c", [3, 4]))


def test_ids_past_the_tokenizer_are_never_sampled(tmp_path):
    """A model whose embedding is padded past its tokenizer (vocab 4096 vs 400 pieces)
    never emits an id the tokenizer cannot decode, greedy or sampled."""
    from tests.fixtures.models import make_tiny_llama

    path = make_tiny_llama(tmp_path / "padded", vocab_size=4096, seed=3)
    padded = load_model(str(path), dtype="float32", device="cpu")
    assert padded.tokenizer.vocab_size < padded.config.vocab_size
    eng = make_engine(padded)
    reqs = [req("g", [5, 6, 7], n=24), req("s", [5, 6, 7], n=24, temperature=1.5, seed=1)]
    evs = run(eng, reqs)
    for rid in ("g", "s"):
        fin = finished(evs[rid])
        assert len(fin.output_token_ids) == 24
        assert max(fin.output_token_ids) < padded.tokenizer.vocab_size


def test_a_lagging_consumer_gets_the_queued_tokens_in_one_delta(loaded):
    import asyncio

    from kvserve.service.engine.async_engine import AsyncEngine
    from kvserve.service.types import Delta, Started

    async def main():
        aeng = AsyncEngine(make_engine(loaded))
        aeng.start()
        try:
            (p,) = prompts(loaded.config.vocab_size, [6])
            events = []
            async for ev in aeng.generate(req("lag", p, n=12, logprobs=1)):
                events.append(ev)
                if isinstance(ev, Started):  # lag: let the whole request reach this stream's queue first
                    queued = aeng._queues["lag"]._queue  # the engine thread hands events over after its step
                    for _ in range(2000):
                        if any(isinstance(e, Finished) for e in queued):
                            break
                        await asyncio.sleep(0.01)
            return events
        finally:
            await aeng.shutdown()

    events = asyncio.run(main())
    deltas = [e for e in events if isinstance(e, Delta)]
    done = finished(events)
    assert isinstance(events[0], Started) and len(deltas) == 1  # 12 tokens, one event
    assert deltas[0].token_ids == done.output_token_ids and len(done.output_token_ids) == 12
    assert deltas[0].text == done.text
    assert [lp.token_id for lp in deltas[0].logprobs] == done.output_token_ids  # merged alongside


def test_a_refused_retain_reaches_its_caller_at_once(loaded):
    """AsyncEngine.retain runs LLMEngine.retain on the engine thread: what that raises
    (here RetentionRefused: an engine with no tier below the device keeps no retention) is
    the caller's error, not the call's timeout."""
    import asyncio

    from kvserve.service.engine.async_engine import AsyncEngine
    from kvserve.service.types import CacheScope, RetentionRefused

    async def main():
        aeng = AsyncEngine(make_engine(loaded))
        aeng.start()
        try:
            (p,) = prompts(loaded.config.vocab_size, [3 * BS])
            with pytest.raises(RetentionRefused, match="no cache tier"):
                await aeng.retain(p, CacheScope(), 60.0, timeout_s=20.0)
        finally:
            await aeng.shutdown()

    asyncio.run(main())
