"""Speculative decoding in the engine (engine/speculative.py through scheduler, runner and
output): greedy tokens identical to plain decoding on every model family and the default
model, with drafts actually accepted; the KV of rejected drafts never registered; stops,
max tokens, penalties, logprobs and n > 1 as plain decoding has them; sampled rows keep
their distribution; grammar rows (response_format) and seeded rows speculate and give
plain decoding's tokens; the per-request switch (SamplingParams.speculative,
spec_max_draft) overrides the server's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvserve.service.engine.config import DEFAULT_MODEL_DIR
from kvserve.service.kernels.layer import NativeStep
from kvserve.service.models.loading import load_model
from kvserve.service.types import Delta, Finished, FinishReason, ResponseFormat
from tests.fixtures.engine import BS, bytes_per_token, finished, make_engine, prompts, req, run

FAMILIES = [
    "tiny_llama_dir",
    "tiny_llama_mqa_dir",
    "tiny_llama3_rope_dir",
    "tiny_qwen2_dir",
    "tiny_qwen2_window_dir",
    "tiny_qwen3_dir",
    "tiny_gemma2_dir",
    "tiny_gemma3_dir",
    "tiny_phi3_dir",
    "tiny_phi4_mini_dir",
    "tiny_mistral_dir",
    "tiny_gpt2_dir",
]


def repeating_prompts(vocab: int) -> list[list[int]]:
    """Prompts that hold their own continuation: a random phrase said three times, then
    its start again (a random model's greedy output also falls into loops of its own)."""
    a, b, c = prompts(vocab, [6, 9, 4], seed=7)
    return [a * 3 + a[:2], b * 2 + b[:3], c + a + c + a + c]


def outputs(loaded, reqs, **kw):
    engine = make_engine(loaded, **kw)
    evs = run(engine, reqs)
    return {rid: finished(e) for rid, e in evs.items()}, evs, engine


def compare(loaded, reqs, **kw):
    """(plain, speculative finished events, the speculative engine)."""
    plain, _, _ = outputs(loaded, reqs, speculative="off", **kw)
    spec, evs, engine = outputs(loaded, reqs, speculative="ngram", **kw)
    return plain, spec, evs, engine


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_is_plain_greedy_on_every_family(family, request):
    loaded = load_model(str(request.getfixturevalue(family)), dtype="float32", device="cpu")
    reqs = [req(f"r{i}", p, n=40) for i, p in enumerate(repeating_prompts(loaded.config.vocab_size))]
    plain, spec, evs, engine = compare(loaded, reqs)
    for rid in plain:
        assert spec[rid].output_token_ids == plain[rid].output_token_ids, rid
        assert spec[rid].text == plain[rid].text
        # the deltas carry exactly the final tokens
        assert [t for e in evs[rid] if isinstance(e, Delta) for t in e.token_ids] == spec[rid].output_token_ids
    r = engine.runner
    assert r.num_accepted_tokens > 0 and r.num_verify_steps > 0
    assert r.num_accepted_tokens <= r.num_draft_tokens


def test_default_model_continuing_text_it_has_seen(tmp_path):
    """The default model (trained on a novel), asked to go on from the start of a
    passage it was given: most drafts are accepted and the tokens are plain greedy's."""
    loaded = load_model(str(DEFAULT_MODEL_DIR), dtype="float32", device="cpu")
    tok = loaded.tokenizer
    passage = (
        "It was the best of times, it was the worst of times, it was the age of wisdom, "
        "it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity."
    )
    ids = tok.encode(passage + "\n\n" + passage[:40])
    reqs = [req("novel", ids, n=48)]
    plain, spec, _, engine = compare(loaded, reqs, kv_cache_memory=256 * 16 * loaded.kv_spec(16).bytes_per_token,
                                     block_size=16)
    assert spec["novel"].output_token_ids == plain["novel"].output_token_ids
    r = engine.runner
    assert r.num_accepted_tokens >= 0.5 * r.num_draft_tokens > 0
    # fewer forwards than tokens: several tokens a step
    assert r.num_verify_steps < spec["novel"].completion_tokens / 2


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def test_drafts_never_take_a_step_past_its_row_limit(loaded):
    """A step's decode rows and drafts together stay within the scheduler's
    ``max_step_rows`` (by default the rows the native decode step takes in one call,
    kernels/layer.py STEP_ROWS: past them the whole step runs the torch reference); set
    to 5 here, so that three repeating sequences reach it. The tokens are plain decoding's."""
    assert make_engine(loaded).scheduler.max_step_rows == NativeStep.max_rows
    reqs = [req(f"r{i}", p, n=30) for i, p in enumerate(repeating_prompts(loaded.config.vocab_size))]
    plain, _, _ = outputs(loaded, reqs, speculative="off")
    engine = make_engine(loaded, speculative="ngram")
    engine.scheduler.max_step_rows = 5
    rows: list[int] = []
    plan = engine.scheduler.plan

    def planned():  # the scheduler's own plan, its decode-forward rows counted
        p = plan()
        rows.append(len(p.decode) + sum(1 + len(s.drafts) for s in p.verify))
        return p

    engine.scheduler.plan = planned
    spec = {rid: finished(e) for rid, e in run(engine, reqs).items()}
    assert {rid: f.output_token_ids for rid, f in spec.items()} == {rid: f.output_token_ids for rid, f in plain.items()}
    assert engine.runner.num_draft_tokens > 0 and max(rows) == 5


@pytest.mark.parametrize("fmt", ["exact", "bf16", "fp16", "int8",
                                 pytest.param("fp8", marks=pytest.mark.slow)])  # fp8: torch's attention, ~10x the time
def test_greedy_speculative_is_plain_greedy_and_deterministic_on_every_kv_format(loaded, fmt):
    """Every --kv-cache-format: greedy tokens with drafts are plain decoding's, and two
    identical speculative runs agree, whatever drafts each made and rejected (they are
    sized from timed steps, so the runs draft differently). A verify step writes its
    rejected drafts' KV into the open block beside the accepted rows: an int8 / fp8 row's
    scale must depend on that row alone, or a rejected draft's larger values would
    requantize accepted rows and change what later steps read."""
    v = loaded.config.vocab_size
    reqs = [req(f"r{i}", p, n=40) for i, p in enumerate(repeating_prompts(v) + prompts(v, [20, 31, 13], seed=3))]
    plain, _, _ = outputs(loaded, reqs, speculative="off", kv_cache_format=fmt)
    runs = []
    for _ in range(2):
        spec, _, engine = outputs(loaded, reqs, speculative="ngram", kv_cache_format=fmt)
        assert engine.runner.num_draft_tokens > engine.runner.num_accepted_tokens > 0  # some drafts rejected
        runs.append({rid: f.output_token_ids for rid, f in spec.items()})
    want = {rid: f.output_token_ids for rid, f in plain.items()}
    assert runs[0] == want and runs[1] == want


def test_penalties_and_min_new_tokens_match_plain(loaded):
    ps = repeating_prompts(loaded.config.vocab_size)
    _, base, _ = outputs(loaded, [req("a", ps[0], n=30)], speculative="off")
    out = finished(base["a"]).output_token_ids
    reqs = [
        req("rep", ps[0], n=30, repetition_penalty=1.05),
        req("pf", ps[1], n=30, presence_penalty=0.2, frequency_penalty=0.1),
        req("bias", ps[2], n=30, logit_bias=((out[4], 0.5),)),
        # its stop token held back until 20 outputs: the rows of one verification differ
        req("min", ps[0], n=30, min_new_tokens=20, stop_token_ids=(out[3],)),
    ]
    plain, spec, _, engine = compare(loaded, reqs)
    for rid in plain:
        assert spec[rid].output_token_ids == plain[rid].output_token_ids, rid
        assert spec[rid].finish_reason == plain[rid].finish_reason
    assert engine.runner.num_accepted_tokens > 0


def test_logprobs_match_plain(loaded):
    p = repeating_prompts(loaded.config.vocab_size)[0]
    _, pe, _ = outputs(loaded, [req("lp", p, n=24, logprobs=2)], speculative="off")
    _, se, engine = outputs(loaded, [req("lp", p, n=24, logprobs=2)], speculative="ngram")
    a = [lp for e in pe["lp"] if isinstance(e, Delta) for lp in e.logprobs]
    b = [lp for e in se["lp"] if isinstance(e, Delta) for lp in e.logprobs]
    assert len(a) == len(b) == 24
    for x, y in zip(a, b):
        assert x.token_id == y.token_id
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert engine.runner.num_accepted_tokens > 0


def test_stop_token_and_max_tokens_inside_a_draft(loaded):
    """A stop token id or max_new_tokens reached mid-verification ends the sequence
    there: the accepted drafts after it are dropped, as plain decoding never made them."""
    p = repeating_prompts(loaded.config.vocab_size)[0]
    _, base, _ = outputs(loaded, [req("a", p, n=30)], speculative="off")
    out = finished(base["a"]).output_token_ids
    stop_tok = out[12]
    reqs = [req("stop", p, n=30, stop_token_ids=(stop_tok,)), req("max", p, n=13)]
    plain, spec, _, _ = compare(loaded, reqs)
    assert spec["stop"].output_token_ids == plain["stop"].output_token_ids == out[: out.index(stop_tok) + 1]
    assert spec["stop"].finish_reason is FinishReason.STOP
    assert spec["max"].output_token_ids == out[:13] and spec["max"].finish_reason is FinishReason.LENGTH


def test_n_greater_than_one_matches_plain(loaded):
    """n = 3 greedy: each of the forked sequences drafts from its own history and gives
    plain decoding's tokens (its own blocks past the shared prompt)."""
    p = repeating_prompts(loaded.config.vocab_size)[1]
    r = req("n3", p, n=20)
    r = dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, n=3))

    def by_index(engine):
        evs = run(engine, [r])["n3"]
        out = {e.index: e.output_token_ids for e in evs if isinstance(e, Finished)}
        for i, toks in out.items():  # each sequence streamed its own tokens, from its first
            assert [t for e in evs if isinstance(e, Delta) and e.index == i for t in e.token_ids] == toks
        return out

    spec_engine = make_engine(loaded, speculative="ngram")
    got = by_index(spec_engine)
    assert got == by_index(make_engine(loaded, speculative="off"))
    assert len(got) == 3 and spec_engine.runner.num_accepted_tokens > 0
    # again on the same engine: every prompt block but the last token's is cached now, so
    # the prompt's last token is a decode row; the request still forks into three
    assert len(p) % BS == 1
    assert by_index(spec_engine) == got


def test_rejected_drafts_never_registered_and_blocks_given_back(loaded):
    """After every request ends, each cached block's hash is the hash of the tokens the
    sequence really has (a block with a rejected draft's KV would carry a wrong one): a
    second run of the same requests hits the cache and gives the same tokens."""
    reqs = [req(f"r{i}", p, n=40) for i, p in enumerate(repeating_prompts(loaded.config.vocab_size))]
    engine = make_engine(loaded, speculative="ngram")
    first = {rid: finished(e) for rid, e in run(engine, reqs).items()}
    assert engine.runner.num_draft_tokens > engine.runner.num_accepted_tokens  # some were rejected
    assert engine.blocks.num_free == engine.blocks.num_usable  # every block given back
    again = [req(f"again{i}", r.prompt_token_ids + first[r.request_id].output_token_ids, n=4)
             for i, r in enumerate(reqs)]
    plain = make_engine(loaded, speculative="off")
    want = {rid: finished(e) for rid, e in run(plain, again).items()}
    got = {rid: finished(e) for rid, e in run(engine, again).items()}
    for rid in want:
        assert got[rid].cached_tokens > 0
        assert got[rid].output_token_ids == want[rid].output_token_ids


def test_timings_and_stats_report_acceptance(loaded):
    p = repeating_prompts(loaded.config.vocab_size)[0]
    engine = make_engine(loaded, speculative="ngram")
    f = finished(run(engine, [req("a", p, n=40)])["a"])
    t = f.timings
    assert 0 < t.accepted_draft_tokens <= t.draft_tokens
    # tokens per step: 40 outputs over fewer forwards (the accepted drafts had none of their own)
    assert t.tokens_per_step == pytest.approx(40 / (40 - t.accepted_draft_tokens))
    s = engine.stats()
    assert (s.spec_draft_tokens, s.spec_accepted_tokens) == (t.draft_tokens, t.accepted_draft_tokens)
    assert s.spec_steps > 0
    from kvserve.service.metrics import EngineStatsCollector

    got = {m.name: m.samples[0].value for m in EngineStatsCollector(engine.stats).collect()}
    assert got["kvserve_spec_accepted_tokens"] == t.accepted_draft_tokens
    assert got["kvserve_spec_draft_tokens"] == t.draft_tokens
    assert got["kvserve_spec_verify_steps"] == s.spec_steps

    off = make_engine(loaded, speculative="off")
    f = finished(run(off, [req("a", p, n=40)])["a"])
    assert (f.timings.draft_tokens, f.timings.tokens_per_step) == (0, 1.0)
    assert off.stats().spec_steps == 0


COLOURS = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 12, "maxItems": 12}


def colour_prompt(loaded) -> list[int]:
    """A prompt that holds arrays of the schema's kind: drafts from it are mostly grammatical."""
    text = json.dumps(["red", "green", "blue"] * 2, separators=(",", ":"))
    return loaded.tokenizer.encode(text + "\n" + text + "\n")


def test_grammar_rows_speculate_and_give_plain_greedy_tokens(loaded):
    """A JSON-schema response_format on a repetitive prompt: the drafts are cut where the
    grammar refuses a token and each verify row gets the mask it would have had, so the
    tokens and their logprobs (taken after the mask) are plain greedy decoding's, with
    drafts accepted; the output validates."""
    fmt = ResponseFormat("json_schema", json.dumps(COLOURS))
    reqs = [req("g", colour_prompt(loaded), n=120, response_format=fmt, logprobs=2),
            req("rx", repeating_prompts(loaded.config.vocab_size)[0], n=40,
                response_format=ResponseFormat("regex", "(ab|ba)+c"))]  # fmt: skip
    plain, spec, evs, engine = compare(loaded, reqs)
    for rid in plain:
        assert spec[rid].output_token_ids == plain[rid].output_token_ids, rid
        assert spec[rid].text == plain[rid].text and spec[rid].finish_reason == plain[rid].finish_reason
    assert json.loads(spec["g"].text) and len(json.loads(spec["g"].text)) == 12
    t = spec["g"].timings
    assert t.accepted_draft_tokens > spec["g"].completion_tokens / 2 and t.tokens_per_step > 2
    _, pe, _ = outputs(loaded, reqs[:1], speculative="off")
    a = [lp for e in pe["g"] if isinstance(e, Delta) for lp in e.logprobs]
    b = [lp for e in evs["g"] if isinstance(e, Delta) for lp in e.logprobs]
    assert [x.token_id for x in a] == [y.token_id for y in b] == spec["g"].output_token_ids
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        assert [tok for tok, _ in x.top] == [tok for tok, _ in y.top]  # masked tokens are no alternative
    assert engine.blocks.num_free == engine.blocks.num_usable


def test_seeded_rows_speculate_and_give_plain_tokens_whatever_the_batch(loaded):
    """Seeded sampled requests draft (their draws depend on the output position, never on
    how many draws came before): batched together in a speculative engine they give the
    tokens each gives alone in a plain one, with and without a grammar."""
    alpha = (11, 12, 13)
    prompt = [11, 12, 13, 11, 13, 12, 12, 11, 13, 13, 11, 12]
    kw = dict(temperature=1.0, logit_bias=tuple((t, 30.0) for t in alpha))
    fmt = ResponseFormat("json_schema", json.dumps(COLOURS))
    reqs = [req(f"s{i}", prompt, n=40, seed=i, **kw) for i in range(4)]
    reqs += [req(f"g{i}", colour_prompt(loaded), n=100, seed=i, temperature=1.0, response_format=fmt) for i in range(2)]
    alone = {}
    for r in reqs:
        alone.update(outputs(loaded, [r], speculative="off")[0])
    spec, _, engine = outputs(loaded, reqs, speculative="ngram", max_num_seqs=8,
                              kv_cache_memory=256 * BS * bytes_per_token(loaded))  # fmt: skip
    for rid in alone:
        assert spec[rid].output_token_ids == alone[rid].output_token_ids, rid
        assert spec[rid].timings.accepted_draft_tokens > 0, rid
    assert len({tuple(f.output_token_ids) for rid, f in spec.items() if rid.startswith("s")}) == 4  # seeds differ
    assert engine.runner.num_draft_tokens > engine.runner.num_accepted_tokens  # some rejected too


def test_the_request_switch_overrides_the_servers(loaded):
    p = repeating_prompts(loaded.config.vocab_size)[0]
    plain = finished(run(make_engine(loaded, speculative="off"), [req("a", p, n=40)])["a"])
    # on for one request on a server started with --speculative off
    off = make_engine(loaded, speculative="off")
    evs = run(off, [req("on", p, n=40, speculative=True), req("dflt", p, n=40)])
    on, dflt = finished(evs["on"]), finished(evs["dflt"])
    assert on.output_token_ids == dflt.output_token_ids == plain.output_token_ids
    assert on.timings.accepted_draft_tokens > 0 and dflt.timings.draft_tokens == 0
    # off for one request on a speculating server; a cap of 2 drafts a step for another
    eng = make_engine(loaded, speculative="ngram")
    evs = run(eng, [req("off", p, n=40, speculative=False)])
    assert finished(evs["off"]).timings.draft_tokens == 0 and eng.runner.num_verify_steps == 0
    capped = finished(run(eng, [req("cap", p, n=40, spec_max_draft=2)])["cap"])
    assert capped.output_token_ids == plain.output_token_ids
    assert 0 < capped.timings.draft_tokens <= 2 * eng.runner.num_verify_steps
    assert capped.timings.tokens_per_step <= 3.0
    # the tokens-per-step counts add up to every output token of the engine's life
    counts = eng.stats().step_tokens
    assert sum(n * c for n, c in enumerate(counts)) == 80 and max(n for n, c in enumerate(counts) if c) <= 3


def test_server_switches():
    from kvserve.service.config import ConfigError, ServerConfig

    e = ServerConfig.from_args(["--speculative", "off", "--spec-max-draft", "3"]).engine_config()
    assert (e.speculative, e.spec_max_draft) == ("off", 3)
    assert ServerConfig.from_args([], {"KVSERVE_SPECULATIVE": "ngram"}).engine_config().speculative == "ngram"
    with pytest.raises(ConfigError, match="--spec-max-draft / KVSERVE_SPEC_MAX_DRAFT must be >= 1"):
        ServerConfig.from_args(["--spec-max-draft", "0"])
    with pytest.raises(ConfigError, match="KVSERVE_SPECULATIVE"):
        ServerConfig.from_args([], {"KVSERVE_SPECULATIVE": "eagle"})


def test_sampled_tokens_keep_their_distribution(loaded):
    """Unseeded sampled requests speculate; over many requests the joint distribution of
    two late tokens matches plain decoding's (chi-square on the two samples). A strong
    logit_bias on three tokens makes every output a random string over them (so n-gram
    drafts come often and are accepted about as often as a guess of one of three), with
    the model's own context-dependent odds among them, and a presence penalty that
    changes with each draft before it."""
    from scipy.stats import chi2_contingency

    alpha = (11, 12, 13)
    prompt = [11, 12, 13, 11, 13, 12, 12, 11, 13, 13, 11, 12]
    N, POS = 200, 10
    kw = dict(temperature=1.0, logit_bias=tuple((t, 30.0) for t in alpha), presence_penalty=0.3)

    def sample(spec: str):
        engine = make_engine(loaded, speculative=spec, max_num_seqs=16, max_queue=N,
                             kv_cache_memory=2048 * BS * bytes_per_token(loaded))
        evs = run(engine, [req(f"r{i}", prompt, n=POS + 1, **kw) for i in range(N)])
        return [finished(e).output_token_ids for e in evs.values()], engine.runner

    a, _ = sample("off")
    b, runner = sample("ngram")
    assert runner.num_accepted_tokens > 60 and runner.num_draft_tokens > 2 * runner.num_accepted_tokens
    assert {t for o in a + b for t in o} <= set(alpha)
    pairs = [(x, y) for x in alpha for y in alpha]
    table = [[sum(1 for o in outs if (o[POS - 1], o[POS]) == c) for c in pairs] for outs in (a, b)]
    assert chi2_contingency(table).pvalue > 1e-4, table


def test_drafts_never_cost_a_preemption(loaded):
    """A pool nearly filled by four sequences' own tokens: drafts take a block only while
    one stays free for every running sequence, so speculation preempts no more than
    plain decoding and gives its tokens."""
    ps = repeating_prompts(loaded.config.vocab_size) + [prompts(loaded.config.vocab_size, [21], seed=9)[0]]
    reqs = [req(f"r{i}", p, n=40) for i, p in enumerate(ps)]
    need = sum(-(-(len(p) + 40) // BS) for p in ps)
    kw = dict(kv_cache_memory=(need + 2) * BS * bytes_per_token(loaded))
    plain, pe = outputs(loaded, reqs, speculative="off", **kw)[::2]
    spec, se = outputs(loaded, reqs, speculative="ngram", **kw)[::2]
    assert se.scheduler.num_preempted == pe.scheduler.num_preempted
    assert {r: f.output_token_ids for r, f in spec.items()} == {r: f.output_token_ids for r, f in plain.items()}
    assert se.runner.num_accepted_tokens > 0


def test_a_trimmed_sequences_block_table_names_only_its_own_blocks(loaded):
    """After a verification gives back the blocks of rejected drafts, the next block the
    sequence takes is in its block table, never the freed one (which another sequence may
    hold by then: drafts written through a stale table would land in its KV)."""
    engine = make_engine(loaded)
    seq = engine.output.new_sequence(req("t", list(range(3, 3 + 2 * BS))), b"ns", False)
    seq.blocks = engine.blocks.allocate(3)  # two for its tokens, one taken for drafts
    engine.runner._block_table(seq)  # the runner's table of the three
    trimmed = seq.blocks[2]
    engine.scheduler.trim(seq)  # the drafts were rejected: the third goes back
    assert len(seq.blocks) == 2
    other = engine.blocks.allocate(engine.blocks.num_free)  # another sequence takes every free block...
    assert trimmed in other
    spare = next(b for b in other if b is not trimmed)
    engine.blocks.free([spare])  # ...but one, which the next draft step takes
    seq.blocks.extend(engine.blocks.allocate(1))
    assert list(engine.runner._block_table(seq)) == [b.block_id for b in seq.blocks]
    assert trimmed.block_id not in engine.runner._block_table(seq)
