"""Block keys: the chain follows the spec, is deterministic across processes, and
separates weights, dtypes, block sizes, tenants and request salts."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvserve.cachestore.keys import block_hashes, hash_block_tokens, make_namespace, redis_key

REPO = Path(__file__).resolve().parents[2]

# Computed once (format version 2) and frozen: a change here breaks every stored cache.
VECTOR_NS_ARGS = ("sha256:abc", "float32", 16, "tenant-a", "salt-1")
VECTOR_NS = "9a435b723ffeac6160042a6eb1fd0bea6ad0bedba39d81a83ff37de2f756189e"
VECTOR_TOKENS = list(range(1000, 1040))  # 2 full blocks of 16 and a tail of 8
VECTOR_HASHES = [
    "38fa18d3624054f983b7e1a7cb37b61b2b40d9c12aa152cde2203379ec0b8b51",
    "6bb0328d9d9ab5123dc80131e0ba006fd48f29dfb18b4d31eb4cd1e5607f2e7d",
]
VECTOR_NS_NO_SALT = "41ca12830723fc0ec3f29c163e9ce1d2daeda74e20bac61a31a5545ca0bdd92a"
VECTOR_MAX_TOKEN_H1 = "10d51f3dbb874bba9a81d151aff7eb6cabe7a47d19a296f21076e198915a5ce5"

_VECTOR_SCRIPT = """
import json
from kvserve.cachestore.keys import block_hashes, make_namespace
ns = make_namespace("sha256:abc", "float32", 16, "tenant-a", "salt-1")
ns2 = make_namespace("sha256:abc", "float32", 16)
print(json.dumps({
    "ns": ns.hex(),
    "hashes": [h.hex() for h in block_hashes(ns, list(range(1000, 1040)), 16)],
    "ns_no_salt": ns2.hex(),
    "max_token_h1": block_hashes(ns2, [0, 1, 2, 3, 2**32 - 1, 7, 8, 9], 4)[1].hex(),
}))
"""


def _vectors() -> dict[str, object]:
    ns = make_namespace(*VECTOR_NS_ARGS)
    ns2 = make_namespace("sha256:abc", "float32", 16)
    return {
        "ns": ns.hex(),
        "hashes": [h.hex() for h in block_hashes(ns, VECTOR_TOKENS, 16)],
        "ns_no_salt": ns2.hex(),
        "max_token_h1": block_hashes(ns2, [0, 1, 2, 3, 2**32 - 1, 7, 8, 9], 4)[1].hex(),
    }


def test_fixed_vectors() -> None:
    v = _vectors()
    assert v["ns"] == VECTOR_NS
    assert v["hashes"] == VECTOR_HASHES
    assert v["ns_no_salt"] == VECTOR_NS_NO_SALT
    assert v["max_token_h1"] == VECTOR_MAX_TOKEN_H1


@pytest.mark.parametrize("seed", ["0", "12345", "random"])
def test_same_vectors_in_another_process(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _VECTOR_SCRIPT], env=env, capture_output=True, text=True, check=True, cwd=REPO
    )
    assert json.loads(out.stdout) == _vectors()


def test_chain_follows_the_spec() -> None:
    """h_0 = sha256(ns || u32le(block 0)), h_i = sha256(h_{i-1} || u32le(block i))."""
    ns = make_namespace(*VECTOR_NS_ARGS)
    hashes = block_hashes(ns, VECTOR_TOKENS, 16)
    parent = ns
    for i, h in enumerate(hashes):
        block = struct.pack("<16I", *VECTOR_TOKENS[16 * i : 16 * (i + 1)])
        assert h == hashlib.sha256(parent + block).digest()
        assert hash_block_tokens(parent, VECTOR_TOKENS[16 * i : 16 * (i + 1)]) == h
        parent = h


def test_namespace_follows_the_spec() -> None:
    def field(s: str) -> bytes:
        return struct.pack("<I", len(s.encode())) + s.encode()

    expected = hashlib.sha256(
        b"kvserve-ns" + struct.pack("<I", 2) + field("sha256:abc") + field("float32")
        + struct.pack("<I", 16) + field("tenant") + field("tenant-a") + field("salt-1")
    ).digest()  # fmt: skip
    assert make_namespace(*VECTOR_NS_ARGS) == expected


def test_only_full_blocks_and_prefix_stability() -> None:
    ns = make_namespace("fp", "float32", 4)
    tokens = list(range(50, 73))  # 23 tokens: 5 full blocks of 4
    hashes = block_hashes(ns, tokens, 4)
    assert len(hashes) == 5
    assert all(len(h) == 32 for h in hashes)
    assert len(set(hashes)) == 5
    # Appending tokens never changes the hashes of earlier blocks.
    assert block_hashes(ns, tokens + [1, 2, 3, 4, 5], 4)[:5] == hashes
    assert block_hashes(ns, tokens[:3], 4) == []


def test_parent_hashes_are_reused_not_recomputed() -> None:
    ns = make_namespace("fp", "float32", 4)
    tokens = list(range(40))
    full = block_hashes(ns, tokens, 4)
    assert block_hashes(ns, tokens, 4, parent_hashes=full[:3]) == full
    assert block_hashes(ns, tokens[:8], 4, parent_hashes=full) == full[:2]
    # The given parents are trusted (that is what makes reuse cheap).
    fake = [bytes(32)]
    assert block_hashes(ns, tokens, 4, parent_hashes=fake)[0] == bytes(32)


def test_input_types_agree() -> None:
    ns = make_namespace("fp", "float32", 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    expected = block_hashes(ns, tokens, 4)
    assert block_hashes(ns, np.array(tokens, dtype=np.int32), 4) == expected
    assert block_hashes(ns, torch.tensor(tokens), 4) == expected
    assert block_hashes(ns, tuple(tokens), 4) == expected


@pytest.mark.parametrize(
    "other",
    [
        ("sha256:abd", "float32", 16, "tenant-a", "salt-1"),  # other weights
        ("sha256:abc", "bfloat16", 16, "tenant-a", "salt-1"),  # other KV dtype
        ("sha256:abc", "float32", 32, "tenant-a", "salt-1"),  # other block size
        ("sha256:abc", "float32", 16, "tenant-b", "salt-1"),  # other tenant
        ("sha256:abc", "float32", 16, "", "salt-1"),  # no tenant
        ("sha256:abc", "float32", 16, "tenant-a", "salt-2"),  # other request salt
        ("sha256:abc", "float32", 16, "tenant-a", ""),  # no request salt
        ("sha256:abc", "float32", 16, None, "salt-1"),  # the salt shared by every tenant
    ],
)
def test_namespace_separates(other: tuple) -> None:
    ns_a, ns_b = make_namespace(*VECTOR_NS_ARGS), make_namespace(*other)
    assert ns_a != ns_b
    tokens = list(range(64))
    assert not set(block_hashes(ns_a, tokens, 16)) & set(block_hashes(ns_b, tokens, 16))


def test_length_prefixed_fields_do_not_alias() -> None:
    # "ab"+"c" and "a"+"bc" must not collide.
    assert make_namespace("ab", "c", 16) != make_namespace("a", "bc", 16)
    # Tenant and request salt are separate fields: no character inside either can make
    # one (tenant, salt) pair alias another, NUL included.
    assert make_namespace("fp", "f", 16, "a\x00salt=b", "") != make_namespace("fp", "f", 16, "a", "b")
    assert make_namespace("fp", "f", 16, "ab", "c") != make_namespace("fp", "f", 16, "a", "bc")
    assert make_namespace("fp", "f", 16, "", "x") != make_namespace("fp", "f", 16, None, "x")


def test_token_order_and_values_matter() -> None:
    ns = make_namespace("fp", "float32", 4)
    assert block_hashes(ns, [1, 2, 3, 4], 4) != block_hashes(ns, [2, 1, 3, 4], 4)
    # 256 must not alias with (0, 1) the way a byte encoding would.
    assert block_hashes(ns, [256, 0, 0, 0], 4) != block_hashes(ns, [0, 1, 0, 0], 4)


@pytest.mark.parametrize("bad", [[-1, 0, 0, 0], [2**32, 0, 0, 0]])
def test_tokens_out_of_uint32_range_are_refused(bad: list[int]) -> None:
    with pytest.raises(ValueError):
        block_hashes(make_namespace("fp", "float32", 4), bad, 4)


def test_bad_block_size_is_refused() -> None:
    with pytest.raises(ValueError):
        make_namespace("fp", "float32", 0)
    with pytest.raises(ValueError):
        block_hashes(make_namespace("fp", "float32", 4), [1, 2, 3, 4], 0)


def test_redis_key() -> None:
    h = block_hashes(make_namespace("fp", "float32", 4), [1, 2, 3, 4], 4)[0]
    assert redis_key("kvserve:", h) == "kvserve:blk:" + h.hex()
    # a lossy storage format has keys of its own
    assert redis_key("kvserve:", h, "exact") == "kvserve:blk:" + h.hex()
    assert redis_key("kvserve:", h, "int8") == "kvserve:blk.int8:" + h.hex()
    assert len({redis_key("p:", h, f) for f in ("exact", "bf16", "fp16", "int8", "fp8")}) == 5
