"""What a lossy Redis storage format (``--redis-kv-format``) costs in output quality.

For each of ``sessions`` random sessions: prefill a history of ``history`` tokens (a
multiple of the block size) into a KV pool, make a second pool whose history blocks went
through ``codec.encode`` / ``codec.decode_into`` in the format (exactly what a restore
from Redis writes into the device pool), then run the same new turn and ``decode``
greedy tokens on both. Reported:

* ``max_logit_diff``: the largest |logit difference| at the new turn's first sampled
  token, over all sessions (logits of the model's own scale);
* ``first_token_agreement``: fraction of sessions whose first greedy token is the same;
* ``greedy_agreement``: fraction of sessions whose ``decode`` greedy tokens all agree;
* ``token_agreement``: mean fraction of the ``decode`` tokens before the first difference.

Used by ``bench/bench_restore.py --formats`` and by the tests (tests/engine/test_engine_tiers.py).
"""

from __future__ import annotations

import torch

from kvserve.cachestore import codec
from kvserve.service.kv.cache import BatchLayout, KVPool, SeqSlice

NS = b"\x01" * 32


def _forward(model, pool: KVPool, table: list[int], start: int, tokens: list[int], bs: int) -> torch.Tensor:
    layout = BatchLayout.build([SeqSlice(block_table=table, start_pos=start, token_ids=tokens)], bs, pool.device)
    return model(layout, pool)[0].float()  # (vocab,) logits of the last token


def _greedy(model, pool, table, start, turn, n, bs) -> tuple[torch.Tensor, list[int]]:
    first = logits = _forward(model, pool, table, start, turn, bs)
    out: list[int] = []
    pos = start + len(turn)
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = _forward(model, pool, table, pos, [tok], bs)
        pos += 1
    return first, out


@torch.inference_mode()
def measure_kv_error(
    loaded,
    storage_dtype: torch.dtype | None,
    *,
    sessions: int = 16,
    history: int = 64,
    new_turn: int = 8,
    decode: int = 8,
    block_size: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    if history % block_size:
        raise ValueError("history must be a multiple of block_size")
    model, c = loaded.model, loaded.config
    n_blocks = -(-(history + new_turn + decode) // block_size)
    table = list(range(1, n_blocks + 1))  # block 0 is the pool's null block
    exact = KVPool(n_blocks + 1, c.num_layers, block_size, c.num_kv_heads, c.head_dim, loaded.dtype, loaded.device)
    lossy = KVPool(n_blocks + 1, c.num_layers, block_size, c.num_kv_heads, c.head_dim, loaded.dtype, loaded.device)
    g = torch.Generator().manual_seed(seed)
    max_diff, first_agree, all_agree, prefix = 0.0, 0, 0, 0.0
    for _ in range(sessions):
        ids = torch.randint(3, c.vocab_size, (history + new_turn,), generator=g).tolist()
        exact.data.zero_()
        _forward(model, exact, table, 0, ids[:history], block_size)
        lossy.data.copy_(exact.data)
        for b in table[: history // block_size]:
            data = codec.encode(NS, NS, exact.data[b], storage_dtype=storage_dtype)
            assert codec.decode_into(data, NS, NS, lossy.data[b], storage_dtype).ok
        l_exact, t_exact = _greedy(model, exact, table, history, ids[history:], decode, block_size)
        l_lossy, t_lossy = _greedy(model, lossy, table, history, ids[history:], decode, block_size)
        max_diff = max(max_diff, float((l_exact - l_lossy).abs().max()))
        first_agree += t_exact[0] == t_lossy[0]
        all_agree += t_exact == t_lossy
        same = next((i for i, (a, b) in enumerate(zip(t_exact, t_lossy)) if a != b), decode)
        prefix += same / decode
    return dict(
        max_logit_diff=max_diff,
        first_token_agreement=first_agree / sessions,
        greedy_agreement=all_agree / sessions,
        token_agreement=prefix / sessions,
    )
