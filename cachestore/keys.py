"""Namespaces and chained block hashes: the address of every KV block in every tier.

    namespace = sha256(b"kvserve-ns" || format_version || model_fingerprint || kv_dtype
                       || block_size || scope || tenant || salt)   (length-prefixed fields;
                       scope is "tenant", or "shared" with an empty tenant)
    h_0 = sha256(namespace || uint32_le(tokens[0:B]))
    h_i = sha256(h_{i-1}  || uint32_le(tokens[i*B:(i+1)*B]))

Only full blocks are keyed. Everything here is deterministic across processes and
machines: no ``hash()``, no seeds. A match is decided by digest equality alone, so the
hash is cryptographic (SHA-256), and the namespace covers the weights, the tenant and
the request's salt, each its own field (no separator inside a value can make two
namespaces alias), so KV from other weights or another tenant can never be addressed.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType, Sequence

import numpy as np

FORMAT_VERSION = 2  # 2: tenant and salt are separate fields (1 took one joined string)

Namespace = NewType("Namespace", bytes)  # 32 bytes
BlockHash = NewType("BlockHash", bytes)  # 32 bytes


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def make_namespace(
    model_fingerprint: str,
    kv_dtype: str,
    block_size: int,
    tenant: str | None = "",
    salt: str = "",
    format_version: int = FORMAT_VERSION,
) -> Namespace:
    """The root of every block chain for one (weights, dtype, block size, tenant, salt).
    ``tenant`` None: a namespace shared by every tenant (an operator-listed salt)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    h = hashlib.sha256(b"kvserve-ns")
    h.update(struct.pack("<I", format_version))
    h.update(_field(model_fingerprint.encode()))
    h.update(_field(kv_dtype.encode()))
    h.update(struct.pack("<I", block_size))
    h.update(_field(b"shared" if tenant is None else b"tenant"))
    h.update(_field((tenant or "").encode()))
    h.update(_field(salt.encode()))
    return Namespace(h.digest())


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """``tokens`` as little-endian uint32, refusing ids that do not fit."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4").tobytes()


def hash_block_tokens(parent: bytes, tokens: Sequence[int]) -> BlockHash:
    """One link of the chain: sha256(parent || uint32_le(tokens))."""
    return BlockHash(hashlib.sha256(parent + _token_bytes(tokens)).digest())


def block_hashes(
    namespace: Namespace,
    tokens: Sequence[int],
    block_size: int,
    parent_hashes: Sequence[BlockHash] = (),
) -> list[BlockHash]:
    """Hashes of every full block of ``tokens``.

    ``parent_hashes`` may hold hashes already computed for a prefix of ``tokens``
    (e.g. the previous turn of a session); they are reused, not recomputed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_full = len(tokens) // block_size
    out = list(parent_hashes[:n_full])
    if len(out) == n_full:
        return out
    # Convert the not-yet-hashed full blocks once, then slice bytes per block.
    stride = 4 * block_size
    data = _token_bytes(tokens[len(out) * block_size : n_full * block_size])
    parent: bytes = out[-1] if out else namespace
    for off in range(0, len(data), stride):
        parent = BlockHash(hashlib.sha256(parent + data[off : off + stride]).digest())
        out.append(parent)
    return out


def redis_key(prefix: str, block_hash: BlockHash, storage_format: str = "exact") -> str:
    """The Redis key of a block. The namespace is already inside the hash chain; a
    lossy storage format (``codec.STORAGE_FORMATS``) gets keys of its own, so replicas
    storing the same block in different formats never overwrite or read each other's."""
    if storage_format == "exact":
        return f"{prefix}blk:{block_hash.hex()}"
    return f"{prefix}blk.{storage_format}:{block_hash.hex()}"
