"""The correctness part of bench/gpu_check.sh, runnable on any device.

    python bench/gpu_check.py parity   --device cuda   # kvserve vs transformers, fp32 and bf16
    python bench/gpu_check.py sessions --device cuda   # 3-turn sessions restored = cold

parity: tiny random Llama (GQA: 4 heads, 2 KV heads) and GPT-2, each in float32 and
bfloat16 on ``--device``: kvserve's paged forward (a prefill of the prompt in two chunks,
then decode steps through the block pool) against transformers' forward of the same
weights on the same device. Reports the max |logit difference| over every position, the
tolerance, and whether the greedy tokens agree. Tolerances: float32 1e-3, bfloat16 0.15
(bf16 keeps 8 bits of mantissa; logits of these random models are O(1-10)).

sessions: a 3-turn greedy session (tiny Llama, float32 and bfloat16) run on one engine;
then turns 2 and 3 replayed on a new engine (a new device pool) whose blocks come from
the host tier, and on another whose blocks come from Redis (a private redis-server),
each compared token for token with a cold engine (no cache) on the same device. A
mismatch is counted; float32 must have none. bfloat16 is reported (a cold prefill and a
restore + partial prefill run different kernels, so bf16 greedy ties may break
differently).

Every figure is printed as ``key: value`` lines; the exit status is 1 when a float32
check fails.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.service.engine.config import EngineConfig  # noqa: E402
from kvserve.service.engine.engine import LLMEngine  # noqa: E402
from kvserve.service.engine.store import build_store  # noqa: E402
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice  # noqa: E402
from kvserve.service.models.loading import load_model  # noqa: E402
from kvserve.service.types import CacheScope, Finished, GenerationRequest, SamplingParams  # noqa: E402
from tests.fixtures.models import make_tiny_gpt2, make_tiny_llama  # noqa: E402

TOL = {torch.float32: 1e-3, torch.bfloat16: 0.15}
BS = 8


def _paged_logits(loaded, ids: list[int], n_decode: int) -> tuple[torch.Tensor, list[int]]:
    """All-position logits of ``ids`` (two prefill chunks), then ``n_decode`` greedy steps."""
    c = loaded.config
    total = len(ids) + n_decode
    nb = -(-total // BS)
    pool = KVPool(nb + 1, c.num_layers, BS, c.num_kv_heads, c.head_dim, loaded.dtype, loaded.device)
    table = list(range(1, nb + 1))
    half = len(ids) // 2
    parts = []
    for start, chunk in ((0, ids[:half]), (half, ids[half:])):
        layout = BatchLayout.build([SeqSlice(table, start, chunk)], BS, loaded.device, loaded.dtype)
        parts.append(loaded.model(layout, pool, all_logits=True)[0].float())
    logits = torch.cat(parts)  # (T, vocab)
    out, pos, last = [], len(ids), logits[-1]
    for _ in range(n_decode):
        tok = int(last.argmax())
        out.append(tok)
        layout = BatchLayout.build([SeqSlice(table, pos, [tok])], BS, loaded.device, loaded.dtype)
        last = loaded.model(layout, pool)[0].float()
        pos += 1
    return logits, out


@torch.inference_mode()
def parity(device: str, tmp: Path) -> bool:
    from transformers import AutoModelForCausalLM

    ok = True
    for family, make in (("llama-gqa", make_tiny_llama), ("gpt2", make_tiny_gpt2)):
        path = make(tmp / family)
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(path), dtype=dtype, device=device)
            ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, loaded.config.vocab_size, (40,), generator=g).tolist()
            got, greedy = _paged_logits(loaded, ids, 8)
            want = ref(torch.tensor([ids], device=device)).logits[0].float()
            diff = float((got - want).abs().max())
            ref_ids = list(ids)
            for _ in range(8):
                ref_ids.append(int(ref(torch.tensor([ref_ids], device=device)).logits[0, -1].argmax()))
            agree = greedy == ref_ids[len(ids) :]
            passed = diff <= TOL[dtype] and (agree or dtype != torch.float32)
            name = f"parity.{family}.{str(dtype).removeprefix('torch.')}"
            print(f"{name}.max_logit_diff: {diff:.3g} (tolerance {TOL[dtype]})")
            print(f"{name}.greedy_8_agree: {agree}")
            print(f"{name}: {'PASS' if passed else 'FAIL'}")
            ok &= passed or dtype != torch.float32
            del loaded, ref
    return ok


def _engine(loaded, store=None) -> LLMEngine:
    cfg = EngineConfig(block_size=BS, kv_cache_memory=256 * BS * _bpt(loaded), restore_policy="always")
    return LLMEngine(loaded, cfg, store=store)


def _bpt(loaded) -> int:
    c = loaded.config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * loaded.dtype.itemsize


def _run(eng: LLMEngine, tokens: list[int], rid: str, n: int = 8) -> Finished:
    eng.add_request(GenerationRequest(rid, tokens, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    while True:
        for _, ev in eng.step():
            if isinstance(ev, Finished):
                return ev


def _spill(eng: LLMEngine, tokens: list[int], tier: str) -> None:
    eng.spill(tokens, CacheScope(), (tier,), lambda n, held: None)
    assert eng.store.flush(60)
    eng.step()


@torch.inference_mode()
def sessions(device: str, tmp: Path) -> bool:
    from tests.fixtures.redis_server import start_redis_server

    path = make_tiny_llama(tmp / "session-llama", max_position_embeddings=1024)
    server = start_redis_server(tmp / "redis")
    ok = True
    try:
        for dtype in (torch.float32, torch.bfloat16):
            loaded = load_model(str(path), dtype=dtype, device=device)
            g = torch.Generator().manual_seed(1)
            new = [torch.randint(3, loaded.config.vocab_size, (n,), generator=g).tolist() for n in (97, 40, 33)]
            # the session, turn by turn, on one engine with both tiers
            host_cfg = EngineConfig(block_size=BS, host_cache_memory=512 * BS * _bpt(loaded))
            host_store = build_store(host_cfg, loaded)
            first = _engine(loaded, host_store)
            prompts, transcript = [], []
            for i, turn in enumerate(new):
                transcript = transcript + turn
                prompts.append(list(transcript))
                transcript += _run(first, transcript, f"t{i}").output_token_ids
            cold = _engine(loaded)
            want = [_run(cold, p, f"cold{i}").output_token_ids for i, p in enumerate(prompts)]
            cold.close()
            dname = str(dtype).removeprefix("torch.")
            mismatches = 0
            for tier in ("host", "redis"):
                for i in (1, 2):  # turns 2 and 3 restored into a new device pool
                    hist = prompts[i - 1] + want[i - 1]
                    if tier == "host":
                        _spill(first, hist, "host")
                        eng = _engine(loaded, host_store)
                    else:
                        import redis

                        redis.Redis.from_url(server.url).flushall()
                        rcfg = EngineConfig(block_size=BS, redis_url=server.url)
                        writer = _engine(loaded, build_store(rcfg, loaded))
                        _run(writer, hist, "w", n=1)
                        _spill(writer, hist, "redis")
                        writer.close()
                        eng = _engine(loaded, build_store(rcfg, loaded))
                    fin = _run(eng, prompts[i], f"{tier}{i}")
                    same = fin.output_token_ids == want[i]
                    mismatches += not same
                    print(f"sessions.{dname}.{tier}.turn{i + 1}: restored {fin.cached_tokens}/{len(prompts[i])} "
                          f"tokens, {'equal to cold' if same else 'DIFFERS from cold'}")
                    if tier == "redis":
                        eng.close()
            first.close()
            print(f"sessions.{dname}.mismatches: {mismatches}")
            if dtype == torch.float32:
                ok &= mismatches == 0
    finally:
        server.stop()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("parity", "sessions"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ok = (parity if args.what == "parity" else sessions)(args.device, Path(tmp))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
