"""The cross-request draft pool of service/engine/draft_pool.py, alone and under the n-gram
drafter: keys never read across, the longer match wins, the bound holds (entries evicted
oldest first, what it charges at least what Python holds for them)."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from kvserve.service.engine.draft_pool import NGRAMS, DraftPool, PoolView, entry_cost
from kvserve.service.engine.speculative import MATCH_CAP, MatchStats, NgramDrafter, SpecConfig

A, B = ("tenant-a", ""), ("tenant-b", "")


def text(seed: int, n: int = 200) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(1000, 60000) for _ in range(n)]


def drafter(pool: DraftPool | None, key=A, **kw) -> NgramDrafter:
    """A drafter on a server whose drafts have always been taken: it drafts its whole candidate."""
    stats = MatchStats()
    stats.hits = list(stats.seen)
    return NgramDrafter(SpecConfig(**kw), stats, pool=PoolView(pool, key) if pool is not None else None)


def test_a_repeated_prompt_drafts_the_earlier_answer_of_its_own_key_only():
    pool = DraftPool(1 << 20)
    answer = text(1)
    pool.add(A, answer)  # the earlier request's prompt end (its first 32 tokens here) and answer
    history = text(2, 50) + answer[:40]  # the same prompt end again, the answer 8 tokens in
    assert pool.lookup(A, history, 8) == (answer[40:48], 40)
    assert drafter(pool, A, max_draft=6).propose(history) == answer[40:46]
    # another tenant, or the same tenant under another cache salt: nothing, whatever it asks
    for key in (B, ("tenant-a", "salt"), ("", "")):
        assert pool.lookup(key, history, 8) is None
        assert drafter(pool, key, max_draft=6).propose(history) == []
        assert drafter(pool, key, max_draft=6).propose(answer) == []  # its own history has no repeat


def test_tenants_with_the_same_text_each_draft_their_own_continuation():
    pool = DraftPool(1 << 20)
    prefix = text(3, 40)
    a, b = prefix + text(4, 30), prefix + text(5, 30)
    pool.add(A, a)
    pool.add(B, b)  # the later one: the most recent occurrence in a shared index would be B's
    assert pool.lookup(A, prefix, 5) == (a[40:45], 40)
    assert pool.lookup(B, prefix, 5) == (b[40:45], 40)


def test_the_longer_match_wins_between_the_history_and_the_pool():
    pool = DraftPool(1 << 20)
    answer = text(6)
    pool.add(A, answer)
    # own history: the last 3 tokens occurred before (a match of 3); the pool matches 20
    own_repeat = answer[17:20] + [7, 7, 7]
    history = own_repeat + answer[:20]
    d = drafter(pool, max_draft=4)
    assert d.propose(history) == answer[20:24] and d.match == 20
    # own history repeats a longer stretch than the pool holds: its own continuation
    long_own = text(7, 30)
    history = long_own + [9, 9] + long_own[:25]
    d = drafter(pool, max_draft=4)
    assert d.propose(history) == long_own[25:29] and d.match == 25
    assert drafter(None, max_draft=4).propose(answer[:20]) == []  # no pool: no draft
    # both as long as measured (MATCH_CAP): the earlier answer's continuation
    long = text(9, 120)
    pool.add(A, long)
    history = long[:100] + [5, 5, 5] + long[:100]
    d = drafter(pool, max_draft=4)
    assert d.propose(history) == long[100:104] and d.match == MATCH_CAP
    assert drafter(None, max_draft=4).propose(history) == [5, 5, 5] + long[:1]
    # both past the cap: the longer measured further (here the sequence's own, 200 to 100)
    t = text(10, 300)
    pool.add(A, t[100:200] + text(11, 20))
    history = t[:200] + [5, 5] + t[:200]
    d = drafter(pool, max_draft=4)
    assert d.propose(history) == [5, 5] + t[:2] and d.match == MATCH_CAP


def test_the_match_is_measured_past_the_longest_ngram_and_capped():
    pool = DraftPool(1 << 20)
    answer = text(8, 300)
    pool.add(A, answer)
    assert pool.lookup(A, answer[:100], 4) == (answer[100:104], MATCH_CAP)
    assert pool.lookup(A, [1, 2] + answer[:23], 4) == (answer[23:27], 23)
    assert pool.lookup(A, answer[:23], 4, beat=23) is None  # no longer than the history's own match
    assert pool.lookup(A, answer[:1], 4) is None  # shorter than the shortest n-gram


def test_the_bound_evicts_the_oldest_entries_first():
    texts = [text(10 + i) for i in range(6)]
    pool = DraftPool(3 * entry_cost(200))
    for t in texts:
        pool.add(A if len(pool) % 2 else B, t)
        assert pool.bytes <= pool.memory
    assert len(pool) == 3 and pool.evictions == 3 and pool.tokens == 600
    keys = {}
    pool2 = DraftPool(3 * entry_cost(200))
    for i, t in enumerate(texts):  # the same adds, the keys they went to
        keys[i] = A if len(pool2) % 2 else B
        pool2.add(keys[i], t)
    for i, t in enumerate(texts):
        got = pool.lookup(keys[i], t[:50], 4)
        assert (got is None) == (i < 3), i
    # an entry repeated moves to the back: the next add evicts the one after it
    pool.add(keys[3], texts[3])
    assert len(pool) == 3 and pool.evictions == 3
    pool.add(A, text(99))
    assert pool.lookup(keys[3], texts[3][:50], 4) is not None
    assert pool.lookup(keys[4], texts[4][:50], 4) is None


def test_evicting_an_entry_keeps_the_ngrams_a_later_one_shares():
    shared = text(20, 40)
    first, second = shared + text(21, 40), shared + text(22, 40)
    pool = DraftPool(entry_cost(80) * 2 + 1)
    pool.add(A, first)
    pool.add(A, second)
    pool.add(A, text(23, 80))  # evicts ``first``
    assert pool.lookup(A, shared, 4) == (second[40:44], 40)


def test_the_same_text_is_kept_once_and_too_large_or_small_texts_not_at_all():
    pool = DraftPool(1 << 20)
    t = text(30)
    pool.add(A, t)
    pool.add(A, list(t))
    assert len(pool) == 1 and pool.bytes == entry_cost(200)
    pool.add(B, t)  # another key: its own entry
    assert len(pool) == 2
    small = DraftPool(entry_cost(100))
    small.add(A, text(31, 101))
    small.add(A, [1] * NGRAMS[-1])
    assert len(small) == 0 and small.bytes == 0
    with pytest.raises(ValueError):
        DraftPool(0)


@pytest.mark.parametrize("length", [40, 300, 2000])
def test_what_the_pool_charges_bounds_what_python_holds(length):
    """``entry_cost`` is an upper bound of the memory the entries and their index take
    (tracemalloc: every allocation the adds made and kept), so --draft-pool-memory bounds
    the pool's real size."""
    texts = [text(1000 + i, length) for i in range(max(40_000 // length, 4))]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = DraftPool(1 << 30)
        for i, t in enumerate(texts):
            pool.add((f"t{i % 3}", ""), t)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.3 * pool.bytes < held <= pool.bytes
