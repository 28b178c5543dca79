"""The draft pool in the engine (engine/draft_pool.py through the scheduler's drafter and the
engine's finished sequences): a repeated request drafts its earlier answer where the first
drafted nothing, greedy and seeded tokens stay plain decoding's, another tenant or cache
salt asking the same never gets a draft from it (counted in accepted drafts), a request's
recalled answers (a session's dropped ones) are drafted from on an engine that never saw
them, and --draft-pool-memory 0 has no pool."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.service.models.loading import load_model
from kvserve.service.types import CacheScope, Finished, InvalidRequest
from tests.fixtures.engine import finished, make_engine, prompts, req, run

N = 16


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompt(loaded) -> list[int]:
    """A prompt whose greedy output (N tokens) repeats nothing of its history: its own
    drafter never finds a candidate, so every draft it gets is the pool's."""
    return prompts(loaded.config.vocab_size, [20, 27, 33, 18, 25, 30, 22], seed=5)[6]


@pytest.fixture(scope="module")
def plain(loaded, prompt) -> Finished:
    return ask(make_engine(loaded, speculative="off"), "plain", prompt)


def ask(engine, rid: str, prompt: list[int], tenant: str = "a", scope: CacheScope | None = None, n: int = N,
        recall: tuple = (), **sp) -> Finished:  # fmt: skip
    r = dataclasses.replace(req(rid, prompt, n=n, **sp), tenant=tenant, scope=scope or CacheScope(tenant, ""),
                            recall=recall)  # fmt: skip
    return finished(run(engine, [r])[rid])


def test_a_repeated_request_drafts_its_earlier_answer_and_stays_plain_greedy(loaded, prompt, plain):
    engine = make_engine(loaded)
    first = ask(engine, "first", prompt)
    assert first.timings.draft_tokens == 0  # its own history never repeats
    again = ask(engine, "again", prompt)
    assert again.timings.accepted_draft_tokens > 0
    assert first.output_token_ids == again.output_token_ids == plain.output_token_ids
    assert again.timings.tokens_per_step > 1.0
    stats = engine.stats()  # the metrics' snapshot: two answers of one key, the same tokens kept once
    assert stats.spec_pool_tokens == min(len(prompt), 32) + N and stats.spec_pool_hits > 0
    assert 0 < stats.spec_pool_bytes <= engine.cfg.draft_pool_memory and stats.spec_pool_evictions == 0
    # no pool: the repeat drafts nothing either, and its tokens are the same
    engine = make_engine(loaded, draft_pool_memory=0)
    assert engine.scheduler.draft_pool is None and engine.stats().spec_pool_bytes == 0
    for rid in ("first", "again"):
        got = ask(engine, rid, prompt)
        assert got.timings.draft_tokens == 0 and got.output_token_ids == plain.output_token_ids


def test_the_pool_never_drafts_across_tenants_or_cache_salts(loaded, prompt, plain):
    engine = make_engine(loaded)
    ask(engine, "a", prompt, tenant="a")
    others = [
        ask(engine, "b", prompt, tenant="b"),  # another tenant, the same prompt
        ask(engine, "a-salted", prompt, tenant="a", scope=CacheScope("a", "s1")),  # the tenant under another salt
        ask(engine, "c-shared", prompt, tenant="c", scope=CacheScope.shared("pub")),  # a shared KV namespace
        ask(engine, "a-shared", prompt, tenant="a", scope=CacheScope.shared("pub")),  # c's salt shared, not c's drafts
    ]
    for got in others:
        assert got.timings.draft_tokens == 0 and got.output_token_ids == plain.output_token_ids
    assert engine.runner.num_draft_tokens == engine.runner.num_accepted_tokens == 0
    again = ask(engine, "a-again", prompt, tenant="a")
    assert again.timings.accepted_draft_tokens > 0  # the pool held a's answer all along
    assert engine.runner.num_accepted_tokens == again.timings.accepted_draft_tokens  # every accepted draft is a's
    assert again.output_token_ids == plain.output_token_ids


def test_seeded_sampling_with_pool_drafts_gives_plain_decodings_tokens(loaded, prompt):
    sp = dict(temperature=0.9, seed=1234)
    want = ask(make_engine(loaded, speculative="off"), "plain", prompt, **sp).output_token_ids
    engine = make_engine(loaded)
    first = ask(engine, "first", prompt, **sp)
    again = ask(engine, "again", prompt, **sp)
    assert first.output_token_ids == again.output_token_ids == want
    assert again.timings.draft_tokens > 0


def test_a_recalled_answer_is_drafted_on_an_engine_that_never_saw_it(loaded, prompt, plain):
    """A session's dropped answer comes with its next turn (GenerationRequest.recall): a
    fresh engine (another replica, a restart) drafts from it under the request's key."""
    engine = make_engine(loaded)
    recalled = tuple(prompt[-32:] + plain.output_token_ids)
    got = ask(engine, "regen", prompt, recall=(recalled,))
    assert got.timings.accepted_draft_tokens > 0 and got.output_token_ids == plain.output_token_ids
    other = ask(engine, "b", prompt, tenant="b")  # recalled under tenant a: nothing for b
    assert other.timings.draft_tokens == 0


def test_a_recalled_answer_outside_the_vocabulary_is_refused_before_it_runs(loaded, prompt):
    engine = make_engine(loaded)
    bad = dataclasses.replace(req("bad", prompt, n=N), tenant="a", recall=((1, 2, loaded.config.vocab_size),))
    with pytest.raises(InvalidRequest, match=r"recall\[2\] = 400 is outside the vocabulary"):
        engine.add_request(bad)
    assert engine.scheduler.draft_pool is not None and len(engine.scheduler.draft_pool) == 0
