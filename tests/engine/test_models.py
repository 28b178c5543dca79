"""Our models against transformers on random tiny checkpoints, and paged vs uncached decoding.

Every checkpoint comes from tests/fixtures/models.py (transformers + save_pretrained,
safetensors). Parity: logits within 1e-4 (float32), 32-token greedy continuations
token-identical to ``generate()``. Then the paged KV paths: cached vs uncached greedy,
batched decode of sequences of different lengths vs each alone, a block shared by two
block tables, chunked prefill.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice
from kvserve.service.models.loading import LoadedModel, load_model

BLOCK = 4  # small blocks: every sequence spans several, partial last blocks everywhere
VARIANTS = [
    "tiny_llama_dir",
    "tiny_llama_mqa_dir",
    "tiny_llama3_rope_dir",
    "tiny_llama_linear_rope_dir",
    "tiny_qwen2_dir",
    "tiny_qwen2_window_dir",
    "tiny_mistral_dir",
    "tiny_qwen3_dir",
    "tiny_qwen3_bias_dir",
    "tiny_gemma2_dir",
    "tiny_gemma3_dir",
    "tiny_phi3_dir",
    "tiny_phi4_mini_dir",  # LongRoPE switching at 16: the 37-token logits use the long factors
    "tiny_gpt2_dir",
    "tiny_llama_sharded_dir",
]
# Greedy below runs 11 + 32 tokens through the paged model alone. LongRoPE's switch (a
# recompute of the whole sequence, as transformers' generate does) is the engine's job:
# test_model_families.py runs that one through the engine.
GREEDY_VARIANTS = [v for v in VARIANTS if v != "tiny_phi4_mini_dir"]


@pytest.fixture(scope="module")
def loaded(request: pytest.FixtureRequest):
    """Load a fixture checkpoint once per module: ours and transformers' reference."""
    cache: dict[str, tuple[LoadedModel, torch.nn.Module]] = {}

    def get(fixture_name: str) -> tuple[LoadedModel, torch.nn.Module]:
        if fixture_name not in cache:
            from transformers import AutoModelForCausalLM

            path = request.getfixturevalue(fixture_name)
            ours = load_model(path, dtype="float32", device="cpu", progress=False)
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            ref.generation_config.eos_token_id = None  # greedy runs their full length, eos or not
            cache[fixture_name] = (ours, ref)
        return cache[fixture_name]

    return get


def prompt_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (n,), generator=g).tolist()


def new_pool(lm: LoadedModel, num_blocks: int = 256) -> KVPool:
    c = lm.config
    return KVPool(num_blocks, c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, lm.dtype, lm.device)


def blocks_for(num_tokens: int) -> int:
    return math.ceil(num_tokens / BLOCK)


@torch.inference_mode()
def greedy_paged(model, kv: KVPool, prompts: list[list[int]], n: int, tables: list[list[int]]) -> list[list[int]]:
    """Greedy decode of several prompts together: one batched prefill, then batched decode steps."""
    seqs = [SeqSlice(t, 0, p) for t, p in zip(tables, prompts)]
    logits = model(BatchLayout.build(seqs, BLOCK), kv)  # (B, V)
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(n):
        nxt = logits.argmax(-1).tolist()
        for o, t in zip(out, nxt):
            o.append(t)
        if step == n - 1:
            break
        seqs = [SeqSlice(t, len(p) + step, [tok]) for t, p, tok in zip(tables, prompts, nxt)]
        logits = model(BatchLayout.build(seqs, BLOCK), kv)
    return out


@torch.inference_mode()
def greedy_nocache(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.forward_nocache(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def trivial_tables(lengths: list[int], first: int = 1) -> list[list[int]]:
    tables, nxt = [], first
    for n in lengths:
        tables.append(list(range(nxt, nxt + blocks_for(n))))
        nxt += blocks_for(n)
    return tables


# ---- parity with transformers -------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(loaded, variant: str) -> None:
    ours, ref = loaded(variant)
    ids = torch.tensor([prompt_ids(ours.config.vocab_size, 37, seed=0), prompt_ids(ours.config.vocab_size, 37, seed=1)])
    with torch.inference_mode():
        want = ref(ids).logits.float()  # (B, T, V)
        got_nocache = ours.model.forward_nocache(ids)
        kv = new_pool(ours)
        seqs = [SeqSlice(t, 0, row.tolist()) for t, row in zip(trivial_tables([37, 37]), ids)]
        got_paged = ours.model(BatchLayout.build(seqs, BLOCK), kv, all_logits=True)
    assert want.abs().max() > 0.1  # the comparison is not between near-zero logits
    torch.testing.assert_close(got_nocache, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(got_paged, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", GREEDY_VARIANTS)
def test_greedy_matches_transformers_generate(loaded, variant: str) -> None:
    from transformers import GenerationConfig

    ours, ref = loaded(variant)
    prompt = prompt_ids(ours.config.vocab_size, 11, seed=2)
    gen = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()
    got = greedy_paged(ours.model, new_pool(ours), [prompt], 32, trivial_tables([len(prompt) + 32]))[0]
    assert len(want) == 32
    assert got == want


def test_sliding_window_past_the_window_equals_transformers_with_it(loaded) -> None:
    """Mistral, window 8: a 60-token greedy run (prompt 20) equals transformers with the
    window, and differs from full attention (so the window is really exercised)."""
    from transformers import GenerationConfig

    ours, ref = loaded("tiny_mistral_dir")
    assert ours.config.sliding_window == 8 and ours.config.context_length == 512
    prompt = prompt_ids(ours.config.vocab_size, 20, seed=5)
    gen = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        want = ref.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()
        ids = torch.tensor([prompt + want])
        windowed = ref(ids).logits
        ref.config.sliding_window = None  # the same weights with full attention
        try:
            full = ref(ids).logits
        finally:
            ref.config.sliding_window = 8
    assert (windowed[0, 9:] - full[0, 9:]).abs().max() > 1e-2  # keys past the window matter
    torch.testing.assert_close(windowed[0, :8], full[0, :8], atol=1e-5, rtol=0)
    got = greedy_paged(ours.model, new_pool(ours), [prompt], 40, trivial_tables([len(prompt) + 40]))[0]
    assert got == want


def test_sharded_checkpoint_loads_same_weights(loaded, tiny_llama_sharded_dir) -> None:
    import json

    index = json.loads((tiny_llama_sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    ours, ref = loaded("tiny_llama_sharded_dir")
    ref_sd = ref.state_dict()
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for name, p in ours.model.named_parameters():
        module, _, kind = name.rpartition(".")
        head, _, proj = module.rpartition(".")
        parts = [f"{head}.{src}.{kind}" for src in fused[proj]] if proj in fused else [name]
        assert torch.equal(p, torch.cat([ref_sd[n] for n in parts])), name


# ---- paged KV paths -----------------------------------------------------------------


@pytest.mark.parametrize("variant", ["tiny_llama_dir", "tiny_llama_mqa_dir", "tiny_gpt2_dir", "tiny_mistral_dir"])
def test_cached_and_uncached_greedy_agree(loaded, variant: str) -> None:
    ours, _ = loaded(variant)
    prompt = prompt_ids(ours.config.vocab_size, 9, seed=3)
    want = greedy_nocache(ours.model, prompt, 24)
    got = greedy_paged(ours.model, new_pool(ours), [prompt], 24, trivial_tables([len(prompt) + 24]))[0]
    assert got == want


@pytest.mark.parametrize("variant", ["tiny_llama_dir", "tiny_gpt2_dir", "tiny_qwen2_window_dir"])
def test_batched_decode_equals_each_alone(loaded, variant: str) -> None:
    ours, _ = loaded(variant)
    n = 16
    lengths = [3, 17, 8, 30]
    prompts = [prompt_ids(ours.config.vocab_size, k, seed=10 + i) for i, k in enumerate(lengths)]
    alone = [greedy_paged(ours.model, new_pool(ours), [p], n, trivial_tables([len(p) + n]))[0] for p in prompts]
    # scattered, non-monotonic block ids so no path relies on contiguous tables
    tables = [t[::-1] for t in trivial_tables([k + n for k in lengths], first=5)]
    together = greedy_paged(ours.model, new_pool(ours), prompts, n, tables)
    assert together == alone


def test_shared_prefix_block_serves_two_sequences(loaded) -> None:
    """Two sequences whose block tables share the prefix blocks written by a third."""
    ours, _ = loaded("tiny_llama_dir")
    vocab = ours.config.vocab_size
    prefix = prompt_ids(vocab, 2 * BLOCK, seed=20)  # exactly two full blocks
    tails = [prompt_ids(vocab, 5, seed=21), prompt_ids(vocab, 3, seed=22)]
    n = 12
    kv = new_pool(ours)
    shared = [7, 3]
    with torch.inference_mode():
        ours.model(BatchLayout.build([SeqSlice(shared + [9], 0, prefix)], BLOCK), kv)
        tables = [shared + [20, 21, 22, 23, 24], shared + [30, 31, 32, 33, 34]]
        # prefill only the tails, on top of the shared blocks; then decode both together
        seqs = [SeqSlice(t, len(prefix), tail) for t, tail in zip(tables, tails)]
        logits = ours.model(BatchLayout.build(seqs, BLOCK), kv)
        got: list[list[int]] = [[], []]
        for step in range(n):
            nxt = logits.argmax(-1).tolist()
            for g, t in zip(got, nxt):
                g.append(t)
            seqs = [SeqSlice(t, len(prefix) + len(tail) + step, [tok]) for t, tail, tok in zip(tables, tails, nxt)]
            logits = ours.model(BatchLayout.build(seqs, BLOCK), kv)
    for g, tail in zip(got, tails):
        assert g == greedy_nocache(ours.model, prefix + tail, n)


@pytest.mark.parametrize("variant", ["tiny_llama3_rope_dir", "tiny_mistral_dir"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_prefill_matches_full_prefill(loaded, chunk: int, variant: str) -> None:
    ours, _ = loaded(variant)
    prompt = prompt_ids(ours.config.vocab_size, 21, seed=30)
    table = trivial_tables([len(prompt)])[0]
    with torch.inference_mode():
        want = ours.model(BatchLayout.build([SeqSlice(table, 0, prompt)], BLOCK), new_pool(ours), all_logits=True)
        kv = new_pool(ours)
        parts = [
            ours.model(BatchLayout.build([SeqSlice(table, s, prompt[s : s + chunk])], BLOCK), kv, all_logits=True)
            for s in range(0, len(prompt), chunk)
        ]
    torch.testing.assert_close(torch.cat(parts, dim=1), want, atol=1e-5, rtol=0)


def test_mixed_prefill_and_decode_in_one_batch(loaded) -> None:
    """One forward carrying a decode step for one sequence and a prefill chunk for another."""
    ours, _ = loaded("tiny_llama_dir")
    vocab = ours.config.vocab_size
    a, b = prompt_ids(vocab, 10, seed=40), prompt_ids(vocab, 14, seed=41)
    ta, tb = trivial_tables([11, 14])
    with torch.inference_mode():
        kv = new_pool(ours)
        ours.model(BatchLayout.build([SeqSlice(ta, 0, a)], BLOCK), kv)
        ours.model(BatchLayout.build([SeqSlice(tb, 0, b[:6])], BLOCK), kv)
        nxt_a = 5
        logits = ours.model(BatchLayout.build([SeqSlice(ta, 10, [nxt_a]), SeqSlice(tb, 6, b[6:])], BLOCK), kv)
        want_a = ours.model.forward_nocache(torch.tensor([a + [nxt_a]]))[0, -1]
        want_b = ours.model.forward_nocache(torch.tensor([b]))[0, -1]
    torch.testing.assert_close(logits[0], want_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], want_b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 130])
def test_linear_fast_path_equals_nn_linear(rows: int, bias: bool, packed: bool) -> None:
    from kvserve.service.models.layers import PACKED_ROWS, SMALL_ROWS, Linear

    torch.manual_seed(rows)
    n_in, n_out = (48, 80) if not packed else (512, 640)  # packed: a weight above PACK_MIN_ELEMENTS
    ours = Linear(n_in, n_out, bias=bias)
    ref = torch.nn.Linear(n_in, n_out, bias=bias)
    ref.load_state_dict(ours.state_dict())
    if packed:
        if not torch.backends.mkldnn.is_available():
            pytest.skip("this torch build has no oneDNN")
        assert ours.pack() and ours._packed is not None
    x = torch.randn(1, rows, n_in)  # (B, T, D) as the models call it
    with torch.inference_mode():
        got, want = ours(x), ref(x)
    assert got.shape == want.shape == (1, rows, n_out) and got.is_contiguous()
    torch.testing.assert_close(got, want, atol=1e-4 if packed else 1e-5, rtol=1e-5)
    assert (rows in SMALL_ROWS) == (2 <= rows <= 64)
    assert (rows in PACKED_ROWS) == (2 <= rows <= 64)


@pytest.mark.parametrize("dim", [16, 64, 768])
def test_rmsnorm_float32_is_torch_rms_norm_bit_for_bit(dim: int) -> None:
    """layers.RMSNorm's float32 path (fewer kernels than F.rms_norm on the CPU) computes the
    same ops in the same order: equal bits, in and out of inference mode, written in place
    too (the per-head q/k norms), and a new weight is picked up."""
    import torch.nn.functional as F

    from kvserve.service.models.layers import RMSNorm

    torch.manual_seed(dim)
    norm = RMSNorm(dim, 1e-6)
    x = torch.randn(2, 5, dim) * 4
    for _ in range(2):
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim))
        want = F.rms_norm(x, (dim,), norm.weight, eps=1e-6)
        with torch.inference_mode():
            assert torch.equal(norm(x), want)
            y = x.clone()
            assert torch.equal(norm.forward_(y), want) and torch.equal(y, want)
        assert torch.equal(norm(x), want)


@pytest.mark.parametrize("variant", ["tiny_llama_dir", "tiny_gemma2_dir"])
def test_a_model_loaded_under_inference_mode_runs_torchs_path(variant: str, request) -> None:
    """A model loaded inside ``torch.inference_mode`` (its parameters inference tensors,
    which keep no version counter) runs the torch path, the one a GPU runs, with the same
    logits as one loaded outside it (the float32 norm's cached scalars were keyed by the
    weight's version: the first GPU run died there)."""
    path = request.getfixturevalue(variant)
    ids = [5, 9, 2, 7, 11, 3]

    def logits(ours: LoadedModel) -> torch.Tensor:
        c = ours.config
        pool = KVPool(4, c.num_layers, BLOCK, c.num_kv_heads, c.head_dim, ours.dtype, ours.device)
        with torch.inference_mode():
            return ours.model(BatchLayout.build([SeqSlice([1, 2, 3], 0, ids)], BLOCK, ours.device, ours.dtype), pool)

    plain = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    with torch.inference_mode():
        inside = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    assert next(inside.model.parameters()).is_inference()
    assert torch.equal(logits(inside), logits(plain))


@pytest.mark.parametrize("masked", [True, False])
def test_attention_over_expanded_kv_heads_is_grouped_query_attention(masked: bool) -> None:
    """layers.sdpa's CUDA choice for a masked grouped-query call (the kv heads expanded,
    so the memory-efficient kernel can take the mask) is the same attention as torch's
    GQA: query head h reads kv head h // (nh / n_kv); and a forward's SDPA kernels on CUDA
    leave cuDNN's out (its graph per new shape), on the CPU are torch's own."""
    import contextlib

    from torch.nn.attention import SDPBackend

    from kvserve.service.models.layers import CUDA_SDPA_BACKENDS, attention_backends, sdpa

    torch.manual_seed(3)
    q = torch.randn(2, 8, 5, 16)  # (B, nh, T, hd)
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)  # (B, n_kv, C, hd)
    mask = None
    if masked:  # a padded batch over a cached context: key c visible to query t iff c <= 4 + t (row 1: one shorter)
        limit = torch.tensor([[4], [3]])[:, :, None] + torch.arange(5)[None, :, None]  # (B, T, 1)
        allowed = torch.arange(9)[None, None, :] <= limit  # (B, T, C)
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None]  # (B, 1, T, C)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(sdpa(q, k, v, mask, False, expand_heads=True), want, atol=1e-6)
    assert torch.equal(sdpa(q, k, v, mask, False), want)  # the CPU: torch's own call
    assert SDPBackend.CUDNN_ATTENTION not in CUDA_SDPA_BACKENDS and SDPBackend.FLASH_ATTENTION in CUDA_SDPA_BACKENDS
    assert isinstance(attention_backends(torch.device("cpu")), contextlib.nullcontext)
    assert not isinstance(attention_backends(torch.device("cuda")), contextlib.nullcontext)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_rmsnorm_is_the_plain_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """layers.RMSNorm with Gemma's offset (fewer kernels, (1 + w) cached per weight
    version) equals F.rms_norm(x.float()) * (1 + w) in float32, cast back; a new weight is
    picked up; its weight starts at zero (the identity)."""
    import torch.nn.functional as F

    from kvserve.service.models.layers import RMSNorm

    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-6, offset=1.0)
    assert not norm.weight.any()
    x = (torch.randn(3, 2, 64) * 3).to(dtype)
    for _ in range(2):
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64))
        want = (F.rms_norm(x.float(), (64,), eps=1e-6) * (1.0 + norm.weight.float())).to(dtype)
        with torch.inference_mode():
            assert torch.equal(norm(x), want)
            y = x.clone()
            assert torch.equal(norm.forward_(y), want) and torch.equal(y, want)


@pytest.mark.parametrize("rot_dim", [16, 8])  # full and partial rotary (Phi-3)
@pytest.mark.parametrize("longrope", [False, True])
def test_rope_in_place_with_signed_sin_is_rotate_half_bit_for_bit(rot_dim: int, longrope: bool) -> None:
    """rope.apply_rope_ with Rotary's signed sin gives exactly HF's x * cos +
    rotate_half(x) * sin on the first rot_dim dims (the rest pass), in place in a view."""
    from kvserve.service.models.rope import Rotary, apply_rope_, inv_freq

    torch.manual_seed(rot_dim)
    scaling = None
    if longrope:
        scaling = {"rope_type": "longrope", "short_factor": [1.0 + i / 10 for i in range(rot_dim // 2)],
                   "long_factor": [2.0 + i for i in range(rot_dim // 2)], "attention_factor": 1.19}
    rotary = Rotary(rot_dim, 10000.0, scaling)
    positions = torch.tensor([[0, 9, 40], [7, 8, 300]])
    long = torch.tensor([False, True]) if longrope else None
    cos, sin = rotary(positions, torch.float32, long)  # (B, T, 1, rot)
    freqs = torch.stack([positions[b, :, None].float() * inv_freq(rot_dim, 10000.0, scaling, long=bool(long is not None
                         and long[b])) for b in range(2)])  # (B, T, rot/2): HF's reference  # fmt: skip
    emb = torch.cat((freqs, freqs), -1)
    factor = 1.19 if longrope else 1.0
    ref_cos, ref_sin = (emb.cos() * factor)[:, :, None], (emb.sin() * factor)[:, :, None]
    assert torch.equal(cos, ref_cos)
    qkv = torch.randn(2, 3, 7, 16)
    x = qkv[:, :, :5].clone()
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    want = torch.cat((x_rot * ref_cos + torch.cat((-x2, x1), -1) * ref_sin, x_pass), -1)
    got = apply_rope_(qkv[:, :, :5], cos, sin)  # in place in the view
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(qkv[:, :, :5], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rows_from_the_table_are_the_computed_rows(dtype: torch.dtype) -> None:
    """Rotary's table (given a forward's span) gives exactly the rows computed for the
    positions themselves: for one sequence's run (a slice), a verify step's rows at
    consecutive positions, a batch of unrelated positions (a gather), past the first
    table's end (it doubles, keeping the rows it had) and for a cold prompt (no layout);
    LongRoPE's per-sequence factor sets keep the computed path. rope_span reads the
    layout's host-side lengths."""
    from kvserve.service.kv.cache import BatchLayout, SeqSlice
    from kvserve.service.models.layers import rope_span
    from kvserve.service.models.rope import TABLE_MIN, Rotary

    rotary = Rotary(16, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})  # fmt: skip
    table = list(range(1, 80))
    layouts = [
        ([SeqSlice(table, 30, list(range(20)))], (50, 30)),  # one sequence's new tokens: a run
        ([SeqSlice(table, 220 + j, [7]) for j in range(5)], (225, 220)),  # verify rows
        ([SeqSlice(table, 200, [7]), SeqSlice(table, 17, [3])], (201, None)),  # a decode batch
        ([SeqSlice(table, 10, [1, 2, 3]), SeqSlice(table, 90, [4])], (91, None)),  # padded chunks
        ([SeqSlice(table, TABLE_MIN + 700, [7])], (TABLE_MIN + 701, TABLE_MIN + 700)),  # the table doubles
    ]
    with torch.inference_mode():
        for slices, span in layouts:
            layout = BatchLayout.build(slices, 16, "cpu")
            assert rope_span(layout.positions, layout) == span
            got, want = rotary(layout.positions, dtype, span=span), rotary(layout.positions, dtype)
            assert got[0].shape == want[0].shape and got[0].dtype == dtype
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert rotary._table[1].shape[0] >= TABLE_MIN + 701 and rotary._table[1].shape[0] & (rotary._table[1].shape[0] - 1) == 0
        cold = torch.arange(40)[None, :]
        assert rope_span(cold, None) == (40, 0)
        assert torch.equal(rotary(cold, dtype, span=(40, 0))[1], rotary(cold, dtype)[1])
        longrope = Rotary(16, 10000.0, {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                        "attention_factor": 1.19})  # fmt: skip
        pos, long = torch.tensor([[5], [9]]), torch.tensor([False, True])
        assert torch.equal(longrope(pos, dtype, long, span=(10, None))[0], longrope(pos, dtype, long)[0])
        assert longrope._table is None  # per-sequence factor sets: computed, no table


def test_loader_packs_large_cpu_float32_linears_only(tiny_llama_dir) -> None:
    """The loader packs the float32 CPU projections big enough to gain (oneDNN layout for
    decode-sized products), not smaller ones, nor bfloat16 or quantized ones; the dense
    weights stay (state_dict). The tiny checkpoint's weights are all below the size."""
    from kvserve.service.models.layers import PACK_MIN_ELEMENTS, Linear, pack_linears

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    fp32 = load_model(tiny_llama_dir, dtype="float32", device="cpu", progress=False)
    linears = [m for m in fp32.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.numel() < PACK_MIN_ELEMENTS and m._packed is None for m in linears)
    big = Linear(512, PACK_MIN_ELEMENTS // 512)
    assert big.pack() and big._packed is not None
    fp32.model.lm_head = big
    assert pack_linears(fp32.model) == 1 and "lm_head.weight" in fp32.model.state_dict()
    bf16 = Linear(512, PACK_MIN_ELEMENTS // 512, dtype=torch.bfloat16)
    assert not bf16.pack() and bf16._packed is None


def test_pack_weights_off_leaves_one_dense_copy(tmp_path) -> None:
    """--no-pack-weights (EngineConfig.pack_weights, load_model(pack_weights=False)): a
    checkpoint whose fused gate/up weight is above the packing size loads packed by
    default and with no packed copy when asked, and both give the same logits. Packing
    is the torch path's: loaded with the native kernels off (with them on nothing is
    packed, test_native.py)."""
    from kvserve.service.models.layers import PACK_MIN_ELEMENTS, Linear
    from tests.fixtures.models import make_tiny_llama

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    path = make_tiny_llama(tmp_path / "m", hidden_size=256, intermediate_size=PACK_MIN_ELEMENTS // 256,
                           num_hidden_layers=1)  # fmt: skip
    on = load_model(path, dtype="float32", device="cpu", progress=False, native_kernels="off")
    off = load_model(path, dtype="float32", device="cpu", progress=False, pack_weights=False, native_kernels="off")
    packed = [m for m in on.model.modules() if isinstance(m, Linear) and m._packed is not None]
    assert packed, "gate/up (2 x 1024 x 256) should be packed by default"
    assert not [m for m in off.model.modules() if isinstance(m, Linear) and m._packed is not None]
    assert on.fingerprint == off.fingerprint  # the same weights: packing is a layout, not a format
    dense = [m for m in off.model.modules() if isinstance(m, Linear) and m.weight.numel() >= PACK_MIN_ELEMENTS]
    assert len(dense) == len(packed)
    with torch.inference_mode():
        for a, b in zip(packed, dense):
            x = torch.randn(1, 8, a.in_features)  # 8 rows: the packed path
            torch.testing.assert_close(a(x), b(x), atol=1e-4, rtol=1e-5)


def test_pack_weights_setting_reaches_the_engine_config() -> None:
    from kvserve.service.config import ServerConfig

    assert ServerConfig.from_args([], {}).engine_config().pack_weights is True
    assert ServerConfig.from_args(["--no-pack-weights"], {}).engine_config().pack_weights is False
    assert ServerConfig.from_args([], {"KVSERVE_PACK_WEIGHTS": "false"}).engine_config().pack_weights is False


def test_one_row_runs_on_the_packed_weight_only_with_more_than_one_thread() -> None:
    """One-row products (single-stream decode) take oneDNN's packed GEMM when torch runs
    more than one thread (MKL's GEMV barely gains from the second), MKL at one thread."""
    from torch.profiler import ProfilerActivity, profile

    from kvserve.service.models.layers import PACK_MIN_ELEMENTS, Linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    lin = Linear(512, PACK_MIN_ELEMENTS // 512)
    ref = torch.nn.Linear(512, PACK_MIN_ELEMENTS // 512)
    ref.load_state_dict(lin.state_dict())
    assert lin.pack()
    x = torch.randn(1, 1, 512)
    threads = torch.get_num_threads()
    try:
        for n, packed_op in ((1, False), (2, True)):
            torch.set_num_threads(n)
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                got = lin(x)
            names = {e.name for e in prof.events()}
            assert ("mkldnn::_linear_pointwise" in names) == packed_op, (n, sorted(names))
            with torch.inference_mode():
                torch.testing.assert_close(got, ref(x), atol=1e-4, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [3, 1 << 11])  # on this thread alone / past rope.SERIAL_MAX: torch's threads
def test_rope_cos_sin_on_one_thread_are_torchs_bit_for_bit(rows: int) -> None:
    """rope.cos_sin computes a small decode step's cos/sin on the calling thread alone
    (waking torch's other threads for two tiny ops cost more than the ops): the same values
    as torch's parallel ops, and the thread count is torch's again after."""
    from kvserve.service.models.rope import SERIAL_MAX, cos_sin

    threads = torch.get_num_threads()
    emb = torch.rand(rows, 1, 64) * 4000  # angles of positions up to ~4000
    assert (emb.numel() <= SERIAL_MAX) == (rows == 3)
    cos, sin = cos_sin(emb)
    assert torch.equal(cos, emb.cos()) and torch.equal(sin, emb.sin())
    assert torch.get_num_threads() == threads
