"""One KV block <-> one self-describing, verified byte string.

A block is a contiguous tensor ``(num_layers, 2, block_size, num_kv_heads, head_dim)``:
K and V of every layer for ``block_size`` tokens, exactly one block of the device pool.
The wire format of a block (all integers little-endian)::

    header   (fixed size, ``HEADER_SIZE`` bytes)
        magic          4s   b"KVSB"
        version        u16  FORMAT_VERSION
        header_size    u16  HEADER_SIZE (refuses a header of another layout)
        namespace      32s  the namespace the block was computed under
        block_hash     32s  the chained hash of its tokens (keys.py)
        dtype          u8   the block's dtype (what the pool holds)
        storage_dtype  u8   the payload's dtype (== dtype unless lossy storage)
        compression    u8   0 none, 1 zstd, 2 lz4
        ndim           u8   number of dims of the block (<= MAX_DIMS)
        num_layers     u32  == shape[0]
        shape          6 x u32, unused trailing dims 0
        payload_size   u64  stored payload bytes (after compression)
        raw_size       u64  safetensors bytes (before compression)
    payload  a safetensors file holding one tensor "kv" (optionally compressed)
    checksum 16 bytes: xxh3_128 over header || payload

The payload is byte-identical to ``safetensors.torch.save({"kv": block})`` (for the
storage dtype), so any safetensors reader can open it; we write and read it by hand to
avoid copies: ``encode`` makes exactly one copy of the tensor bytes (into the result),
``decode_into`` reads the tensor straight out of the received buffer into ``out``.
Nothing is ever unpickled: there is no pickle and no ``torch.load`` anywhere.

Why xxh3_128 and not SHA-256 for the checksum: the checksum guards against corruption
(a flipped bit, a truncated write, a torn value), not against an adversary. The
block's identity is already a SHA-256 chain, and the header names it (namespace and
block hash are checked against what the caller asked for). xxh3_128 runs at ~10 GB/s
on this machine against ~1.4 GB/s for SHA-256 (``bench/bench_cachestore.py``), and a
128-bit checksum misses a random corruption with probability 2**-128. A store that an
attacker can write to is out of scope for a checksum of any kind (they would recompute
it); that needs an authenticated store, not a slower hash.

Verification: ``decode_into`` never raises for bad data. It checks, in order, magic,
version, header layout, sizes (truncated / trailing bytes), checksum, namespace, block
hash, layers, dtype, shape, decompression, and the safetensors header, and answers
``DecodeResult(ok=False, reason=...)`` with one of ``REASONS`` on the first failure.
Only when everything holds does it write ``out``. (An ``out`` that is not a contiguous
tensor is a caller bug and raises ``ValueError``.)

Options, both off by default:

- ``compression="zstd" | "lz4"``: lossless. Random-weight KV barely compresses (~1.08x
  for float32) and compressing is slower than loopback Redis, so it only pays on slow
  links. Decompression needs one intermediate buffer.
- ``storage_dtype=torch.bfloat16 | torch.float16`` for a float32 block: LOSSY (the
  restored KV is the rounded KV, so restored outputs may differ from recomputed ones).
  It halves Redis memory and network. ``decode_into`` converts back to ``out.dtype``.
- ``storage_dtype=torch.int8 | torch.float8_e4m3fn`` for any float block: LOSSY, with
  scales: each (layer, K/V, token, head) row of ``head_dim`` values is stored as
  ``round(x / s)`` with ``s = absmax(row) / qmax`` (qmax 127 for int8, 448 for e4m3) and
  the scales as float32 beside it. The payload is then a safetensors file of two
  tensors, ``scale`` (float32, shape ``(*block_shape[:-1], 1)``) and ``kv``. About 1/4 of
  float32 (1/2 of bf16) plus 4 bytes per row; measured error in docs/benchmarks.md.

The storage format is a reader's setting too: ``decode_into`` takes the storage dtype
it expects (default: ``out.dtype``, exact) and a value stored otherwise is a miss
(``wrong_storage``), so lossy KV is never taken for exact KV, nor one lossy format
for another. ``STORAGE_FORMATS`` names the formats for settings and keys.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import warnings
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch
import xxhash

from .keys import BlockHash, Namespace

MAGIC: Final = b"KVSB"
FORMAT_VERSION: Final = 1
MAX_DIMS: Final = 6
CHECKSUM_SIZE: Final = 16
TENSOR_NAME: Final = "kv"

_HEADER = struct.Struct("<4sHH32s32sBBBBI6IQQ")
HEADER_SIZE: Final = _HEADER.size

# dtype <-> (wire code, safetensors name). Codes are part of the format: never reuse.
_DTYPES: Final[dict[torch.dtype, tuple[int, str]]] = {
    torch.float32: (1, "F32"),
    torch.float16: (2, "F16"),
    torch.bfloat16: (3, "BF16"),
    torch.float64: (4, "F64"),
    torch.float8_e4m3fn: (5, "F8_E4M3"),
    torch.float8_e5m2: (6, "F8_E5M2"),
    torch.int8: (7, "I8"),
}
# Storage dtypes stored with per-row scales (the largest representable magnitude).
_SCALED: Final[dict[torch.dtype, float]] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_NAME: Final = "scale"
# The setting's names -> storage dtype (None: the block's own dtype, exact).
STORAGE_FORMATS: Final[dict[str, torch.dtype | None]] = {
    "exact": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
_DTYPE_BY_CODE: Final = {code: dt for dt, (code, _) in _DTYPES.items()}
_NUMPY_DTYPES: Final = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64}
_COMPRESSION: Final[dict[str | None, int]] = {None: 0, "zstd": 1, "lz4": 2}
_COMPRESSION_BY_CODE: Final = {code: name for name, code in _COMPRESSION.items()}
_ZSTD_LEVEL: Final = 1
# A safetensors header for one tensor is ~100 bytes; anything far larger is garbage.
_MAX_ST_HEADER: Final = 4096

# Reasons a decode fails; stats count failures by these names.
OK: Final = "ok"
BAD_MAGIC: Final = "bad_magic"
BAD_VERSION: Final = "bad_version"
BAD_HEADER: Final = "bad_header"
TRUNCATED: Final = "truncated"
BAD_LENGTH: Final = "bad_length"
BAD_CHECKSUM: Final = "bad_checksum"
WRONG_NAMESPACE: Final = "wrong_namespace"
WRONG_HASH: Final = "wrong_hash"
WRONG_LAYERS: Final = "wrong_layers"
WRONG_DTYPE: Final = "wrong_dtype"
WRONG_SHAPE: Final = "wrong_shape"
WRONG_STORAGE: Final = "wrong_storage"
BAD_DECOMPRESS: Final = "bad_decompress"
BAD_PAYLOAD: Final = "bad_payload"
REASONS: Final = frozenset(
    {
        BAD_MAGIC, BAD_VERSION, BAD_HEADER, TRUNCATED, BAD_LENGTH, BAD_CHECKSUM,
        WRONG_NAMESPACE, WRONG_HASH, WRONG_LAYERS, WRONG_DTYPE, WRONG_SHAPE, WRONG_STORAGE,
        BAD_DECOMPRESS, BAD_PAYLOAD,
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """Outcome of ``decode_into``: ``ok`` and, when not ok, why (one of ``REASONS``)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


_OK_RESULT: Final = DecodeResult(True, OK)


def _fail(reason: str) -> DecodeResult:
    return DecodeResult(False, reason)


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], 1)


def _scale_nbytes(dtype: torch.dtype, storage_dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of the per-row float32 scales a block of ``dtype`` stored as
    ``storage_dtype`` carries (0 unless quantized: a scaled storage dtype, not its own)."""
    return math.prod(_scale_shape(shape)) * 4 if storage_dtype in _SCALED and storage_dtype != dtype else 0


@functools.lru_cache(maxsize=64)
def _st_header(storage_dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, scaled: bool = False) -> bytes:
    """The safetensors prefix (u64 length + JSON, space-padded to 8 bytes) for one tensor,
    formatted exactly as ``safetensors.torch.save`` formats it; for a scaled storage
    dtype, two tensors: ``scale`` (float32) first, then ``kv`` (``nbytes`` is the kv's)."""
    kv = {"dtype": _DTYPES[storage_dtype][1], "shape": list(shape)}
    if scaled:
        sn = math.prod(_scale_shape(shape)) * 4
        meta = {
            SCALE_NAME: {"dtype": "F32", "shape": list(_scale_shape(shape)), "data_offsets": [0, sn]},
            TENSOR_NAME: {**kv, "data_offsets": [sn, sn + nbytes]},
        }
    else:
        meta = {TENSOR_NAME: {**kv, "data_offsets": [0, nbytes]}}
    js = json.dumps(meta, separators=(",", ":")).encode()
    js += b" " * (-(8 + len(js)) % 8)
    return struct.pack("<Q", len(js)) + js


def encoded_size(
    block_shape: tuple[int, ...], dtype: torch.dtype, storage_dtype: torch.dtype | None = None
) -> int:
    """Size in bytes of an uncompressed encoded block of this shape (for batch sizing)."""
    sdt = storage_dtype or dtype
    nbytes = math.prod(block_shape) * sdt.itemsize
    extra = _scale_nbytes(dtype, sdt, tuple(block_shape))
    return HEADER_SIZE + len(_st_header(sdt, tuple(block_shape), nbytes, extra > 0)) + extra + nbytes + CHECKSUM_SIZE


def stored_nbytes(
    block_shape: tuple[int, ...], dtype: torch.dtype, storage_dtype: torch.dtype | None = None
) -> int:
    """Bytes of a block's *stored form*: what an uncompressed payload holds after its
    safetensors header (for int8 / fp8 storage the per-row float32 scales, then the
    values; otherwise the values in the storage dtype). A restore may move these bytes
    as they are and decode them where the block lands (``expand_into``), e.g. on the GPU
    after the host-to-device copy."""
    sdt = storage_dtype or dtype
    return _scale_nbytes(dtype, sdt, tuple(block_shape)) + math.prod(block_shape) * sdt.itemsize


def stored_prefix(
    namespace: Namespace,
    block_hash: BlockHash,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    storage_dtype: torch.dtype | None = None,
) -> bytes:
    """The exact bytes that precede the stored form (``stored_nbytes``) in ``encode(namespace,
    block_hash, block, storage_dtype=storage_dtype)`` of an uncompressed block (after it
    come ``CHECKSUM_SIZE`` bytes: xxh3_128 of prefix || stored bytes). Lets a reader
    receive the stored bytes straight into their destination and verify afterwards
    (``RedisTier``'s direct reads, ``DiskTier``'s reads)."""
    sdt = storage_dtype or dtype
    n_stored = stored_nbytes(shape, dtype, sdt)
    scaled = _scale_nbytes(dtype, sdt, tuple(shape)) > 0
    st_header = _st_header(sdt, tuple(shape), math.prod(shape) * sdt.itemsize, scaled)
    header = _HEADER.pack(
        MAGIC, FORMAT_VERSION, HEADER_SIZE, namespace, block_hash,
        _DTYPES[dtype][0], _DTYPES[sdt][0], _COMPRESSION[None], len(shape), shape[0],
        *shape, *([0] * (MAX_DIMS - len(shape))), len(st_header) + n_stored, len(st_header) + n_stored,
    )  # fmt: skip
    return header + st_header


def plain_prefix(
    namespace: Namespace, block_hash: BlockHash, shape: tuple[int, ...], dtype: torch.dtype
) -> bytes:
    """``stored_prefix`` of a block stored in its own dtype (the tensor bytes follow)."""
    return stored_prefix(namespace, block_hash, shape, dtype)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (any dtype, bf16 included).
    Copies between such views are plain memcpy: they skip torch's intra-op thread pool
    (slower than one thread for blocks of a few hundred KB, and far slower when the cores
    are busy) and release the GIL."""
    return t.reshape(-1).view(torch.uint8).numpy()


def cpu_byte_view(t: torch.Tensor) -> np.ndarray | None:
    """``byte_view(t)``, or None when ``t`` is not a contiguous CPU tensor."""
    return byte_view(t) if t.is_cpu and t.is_contiguous() else None


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for two blocks of the same shape and dtype: one memcpy between
    contiguous CPU tensors (see ``byte_view``), torch's copy otherwise."""
    d, s = cpu_byte_view(dst), cpu_byte_view(src)
    if d is not None and s is not None and dst.dtype == src.dtype:
        np.copyto(d, s)
    else:
        dst.copy_(src)


def encode(
    namespace: Namespace,
    block_hash: BlockHash,
    block: torch.Tensor,
    *,
    compression: str | None = None,
    storage_dtype: torch.dtype | None = None,
) -> bytes:
    """Serialize one block (on any device) under its address.

    ``compression`` is None, "zstd" or "lz4" (lossless); ``storage_dtype`` stores the
    payload in another dtype (lossy when narrower; int8 and float8_e4m3fn with per-row
    scales). Raises ValueError on bad arguments (wrong address length, unsupported
    dtype, too many dims).
    """
    if len(namespace) != 32 or len(block_hash) != 32:
        raise ValueError("namespace and block_hash must be 32-byte digests")
    if block.dtype not in _DTYPES:
        raise ValueError(f"unsupported block dtype {block.dtype}")
    if not 1 <= block.dim() <= MAX_DIMS:
        raise ValueError(f"block must have 1..{MAX_DIMS} dims, got {block.dim()}")
    if compression not in _COMPRESSION:
        raise ValueError(f"unknown compression {compression!r}; use None, 'zstd' or 'lz4'")
    sdt = storage_dtype or block.dtype
    if sdt not in _DTYPES:
        raise ValueError(f"unsupported storage dtype {sdt}")
    if block.dtype in _SCALED and sdt != block.dtype:  # (an int8 KV pool's blocks: values and scales as bytes)
        raise ValueError(f"a {block.dtype} block can only be stored as itself")

    data = block.detach()
    scale_parts: list[np.ndarray] = []
    if sdt in _SCALED and sdt != data.dtype:
        data, scale = _quantize(data, sdt)
        scale_parts = [byte_view(scale)]
    elif sdt != data.dtype:
        data = data.to(sdt)
    data = data.contiguous().cpu()  # no-ops for a contiguous CPU block
    shape = tuple(data.shape)
    tensor_bytes = byte_view(data)  # (nbytes,) uint8, shares memory with the block
    st_header = _st_header(sdt, shape, tensor_bytes.nbytes, bool(scale_parts))
    raw_size = len(st_header) + sum(p.nbytes for p in scale_parts) + tensor_bytes.nbytes

    if compression is None:
        parts: list[bytes | np.ndarray] = [st_header, *scale_parts, tensor_bytes]
        payload_size = raw_size
    else:
        raw = st_header + b"".join(p.tobytes() for p in scale_parts) + tensor_bytes.tobytes()
        if compression == "zstd":
            import zstandard

            compressed = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(raw)
        else:
            import lz4.frame

            compressed = lz4.frame.compress(raw)
        parts = [compressed]
        payload_size = len(compressed)

    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        HEADER_SIZE,
        namespace,
        block_hash,
        _DTYPES[block.dtype][0],
        _DTYPES[sdt][0],
        _COMPRESSION[compression],
        len(shape),
        shape[0],
        *shape,
        *([0] * (MAX_DIMS - len(shape))),
        payload_size,
        raw_size,
    )
    h = xxhash.xxh3_128(header)
    for part in parts:
        h.update(part)
    # bytes.join takes buffer objects: one copy of the tensor bytes, straight into the result.
    return b"".join([header, *parts, h.digest()])


def _quantize(x: torch.Tensor, sdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) with x ~= q * scale per row of the last dim; q in ``sdt`` and scale
    float32 of shape (..., 1), both contiguous on the CPU. Rows of zeros get scale 1."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # (..., 1)
    scale = torch.where(amax > 0, amax / _SCALED[sdt], torch.ones_like(amax))
    q = xf / scale
    if sdt == torch.int8:
        q = q.round_().clamp_(-127, 127)
    return q.to(sdt).contiguous().cpu(), scale.contiguous().cpu()


def _readonly_tensor(buf: memoryview | bytes, dtype: torch.dtype, offset: int, count: int) -> torch.Tensor:
    """A tensor viewing ``buf`` (read-only; we only ever read from it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset)


def _decompress(name: str, payload: memoryview, raw_size: int) -> bytes | None:
    """Decompress at most ``raw_size`` bytes; None on any failure or size mismatch."""
    try:
        if name == "zstd":
            import zstandard

            out = zstandard.ZstdDecompressor().decompress(payload, max_output_size=raw_size)
        else:
            import lz4.frame

            d = lz4.frame.LZ4FrameDecompressor()
            out = d.decompress(payload, max_length=raw_size)
            if not d.eof or d.unused_data:
                return None
    except Exception:  # noqa: BLE001 - any decompressor complaint is a miss
        return None
    return out if len(out) == raw_size else None


def _parse_st_header(
    raw: memoryview, storage_dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
) -> int | None:
    """Offset of the tensor bytes in a one-tensor safetensors buffer, or None if the
    buffer is not exactly the tensor we expect."""
    if len(raw) < 8:
        return None
    (n,) = struct.unpack_from("<Q", raw, 0)
    if n > _MAX_ST_HEADER or 8 + n + nbytes != len(raw):
        return None
    try:
        meta = json.loads(bytes(raw[8 : 8 + n]))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    meta.pop("__metadata__", None)
    entry = meta.get(TENSOR_NAME)
    if len(meta) != 1 or not isinstance(entry, dict):
        return None
    if (
        entry.get("dtype") != _DTYPES[storage_dtype][1]
        or entry.get("shape") != list(shape)
        or entry.get("data_offsets") != [0, nbytes]
    ):
        return None
    return 8 + n


def _verify(
    data: bytes | bytearray | memoryview,
    namespace: Namespace,
    block_hash: BlockHash,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    storage_dtype: torch.dtype | None,
) -> tuple[memoryview, int, torch.dtype] | DecodeResult:
    """Every check of ``decode_into``, in its order: the payload (decompressed), the
    offset of its stored form, and the storage dtype; or why not."""
    try:
        buf = memoryview(data).cast("B")
    except TypeError:
        return _fail(BAD_HEADER)
    size = len(buf)
    if size < 4:
        return _fail(TRUNCATED)
    if buf[:4] != MAGIC:
        return _fail(BAD_MAGIC)
    if size < 6:
        return _fail(TRUNCATED)
    (version,) = struct.unpack_from("<H", buf, 4)
    if version != FORMAT_VERSION:
        return _fail(BAD_VERSION)
    if size < HEADER_SIZE + CHECKSUM_SIZE:
        return _fail(TRUNCATED)
    (
        _magic, _version, header_size, ns, bh, dtype_code, sdtype_code, comp_code,
        ndim, num_layers, *dims, payload_size, raw_size,
    ) = _HEADER.unpack_from(buf, 0)  # fmt: skip
    if header_size != HEADER_SIZE:
        return _fail(BAD_HEADER)
    expected = HEADER_SIZE + payload_size + CHECKSUM_SIZE
    if size < expected:
        return _fail(TRUNCATED)
    if size > expected:
        return _fail(BAD_LENGTH)
    body = buf[: size - CHECKSUM_SIZE]
    if xxhash.xxh3_128_digest(body) != buf[size - CHECKSUM_SIZE :]:
        return _fail(BAD_CHECKSUM)

    # The bytes are what the encoder wrote. Now: is it the block we asked for?
    if ns != namespace:
        return _fail(WRONG_NAMESPACE)
    if bh != block_hash:
        return _fail(WRONG_HASH)
    if not 1 <= ndim <= MAX_DIMS or any(dims[ndim:]):
        return _fail(BAD_HEADER)
    stored_shape = tuple(dims[:ndim])
    if num_layers != stored_shape[0]:
        return _fail(BAD_HEADER)
    if len(shape) < 1 or num_layers != shape[0]:
        return _fail(WRONG_LAYERS)
    stored_dtype = _DTYPE_BY_CODE.get(dtype_code)
    sdtype = _DTYPE_BY_CODE.get(sdtype_code)
    if stored_dtype is None or sdtype is None:
        return _fail(BAD_HEADER)
    if stored_dtype != dtype:
        return _fail(WRONG_DTYPE)
    if stored_shape != tuple(shape):
        return _fail(WRONG_SHAPE)
    if sdtype != (storage_dtype or dtype):
        return _fail(WRONG_STORAGE)
    comp = _COMPRESSION_BY_CODE.get(comp_code, "?")
    if comp == "?":
        return _fail(BAD_HEADER)

    nbytes = math.prod(shape) * sdtype.itemsize
    scale_nbytes = _scale_nbytes(dtype, sdtype, tuple(shape))
    if raw_size > 8 + _MAX_ST_HEADER + scale_nbytes + nbytes:
        return _fail(BAD_PAYLOAD)
    payload = buf[HEADER_SIZE : HEADER_SIZE + payload_size]
    if comp is not None:
        decompressed = _decompress(comp, payload, raw_size)
        if decompressed is None:
            return _fail(BAD_DECOMPRESS)
        payload = memoryview(decompressed)
    elif raw_size != payload_size:
        return _fail(BAD_HEADER)
    # The safetensors header we write is a pure function of (dtype, shape): compare
    # bytes (fast); anything else (another writer's formatting) is parsed strictly.
    st_expected = _st_header(sdtype, tuple(shape), nbytes, scale_nbytes > 0)
    if len(payload) == len(st_expected) + scale_nbytes + nbytes and payload[: len(st_expected)] == st_expected:
        offset: int | None = len(st_expected)
    elif scale_nbytes:  # only our own two-tensor layout is accepted
        return _fail(BAD_PAYLOAD)
    else:
        offset = _parse_st_header(payload, sdtype, tuple(shape), nbytes)
        if offset is None:
            return _fail(BAD_PAYLOAD)
    if scale_nbytes:
        scale = _readonly_tensor(payload, torch.float32, offset, scale_nbytes // 4)
        if not torch.isfinite(scale).all():
            return _fail(BAD_PAYLOAD)
    return payload, offset, sdtype


def decode_into(
    data: bytes | bytearray | memoryview,
    namespace: Namespace,
    block_hash: BlockHash,
    out: torch.Tensor,
    storage_dtype: torch.dtype | None = None,
) -> DecodeResult:
    """Verify ``data`` as the block ``(namespace, block_hash)`` shaped like ``out``,
    stored as ``storage_dtype`` (None: ``out.dtype``, exact), and, only if everything
    checks, copy it into ``out`` (any device, contiguous), decoded (``expand_into``).

    Never raises for bad data: answers ``DecodeResult(False, reason)`` and leaves ``out``
    untouched. Raises ValueError only for a non-contiguous ``out`` (a caller bug).
    """
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    shape = tuple(out.shape)
    checked = _verify(data, namespace, block_hash, shape, out.dtype, storage_dtype)
    if isinstance(checked, DecodeResult):
        return checked
    payload, offset, sdtype = checked
    numel = out.numel()
    if sdtype != out.dtype:
        n = stored_nbytes(shape, out.dtype, sdtype)
        expand_into(_readonly_tensor(payload, torch.uint8, offset, n).view(1, n), out.view(1, *shape), sdtype)
        return _OK_RESULT
    # Verified. Copy straight from the received buffer into the destination.
    np_dtype = _NUMPY_DTYPES.get(sdtype)
    if np_dtype is not None and out.device.type == "cpu":
        src = np.frombuffer(payload, dtype=np_dtype, count=numel, offset=offset).reshape(shape)
        np.copyto(out.numpy(), src)
    else:
        out.copy_(_readonly_tensor(payload, sdtype, offset, numel).view(shape))
    return _OK_RESULT


def decode_stored_into(
    data: bytes | bytearray | memoryview,
    namespace: Namespace,
    block_hash: BlockHash,
    out: np.ndarray,
    block_shape: tuple[int, ...],
    dtype: torch.dtype,
    storage_dtype: torch.dtype | None = None,
) -> DecodeResult:
    """``decode_into`` without the decoding: verify ``data`` as the block of that shape and
    dtype stored as ``storage_dtype`` and copy its stored form (``stored_nbytes`` bytes)
    into ``out`` (a flat uint8 array), for ``expand_into`` to decode where the block
    lands. The same checks and reasons; ``out`` untouched unless ok."""
    n = stored_nbytes(block_shape, dtype, storage_dtype)
    if out.dtype != np.uint8 or out.shape != (n,):
        raise ValueError(f"out must be {n} uint8 bytes, got {out.shape} {out.dtype}")
    checked = _verify(data, namespace, block_hash, tuple(block_shape), dtype, storage_dtype)
    if isinstance(checked, DecodeResult):
        return checked
    payload, offset, _ = checked
    np.copyto(out, np.frombuffer(payload, dtype=np.uint8, count=n, offset=offset))
    return _OK_RESULT


def finite_scales(stored: torch.Tensor, block_shape: tuple[int, ...], dtype: torch.dtype,
                  storage_dtype: torch.dtype | None) -> bool:
    """Whether a stored form's scales (int8 / fp8; none otherwise) are all finite: the
    check ``decode_into`` makes, for a reader that received the stored bytes itself."""
    s = _scale_nbytes(dtype, storage_dtype or dtype, tuple(block_shape))
    return not s or bool(np.isfinite(byte_view(stored)[:s].view(np.float32)).all())


def _typed(stored: torch.Tensor, a: int, b: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes ``a:b`` of each row of ``stored`` (n, S) uint8 as (n, *shape) of ``dtype``: a
    view where the rows' stride allows one, else a copy."""
    part = stored[:, a:b]
    try:
        typed = part.view(dtype)
    except RuntimeError:  # a row stride the wider dtype cannot step by
        typed = part.contiguous().view(dtype)
    return typed.view(stored.shape[0], *shape)


def expand_into(stored: torch.Tensor, out: torch.Tensor, storage_dtype: torch.dtype | None) -> None:
    """Decode blocks from their stored form: ``stored`` (n, ``stored_nbytes``) uint8 into
    ``out`` (n, *block_shape) of the block's dtype, both on one device (the CPU, or the
    GPU after a host-to-device copy of the compact bytes). int8 / fp8: ``q.float() *
    scale`` per row, then ``out``'s dtype (one float32 multiply, rounded once: the same
    bits on any device); bf16 / fp16: a cast; exact: a copy."""
    n, shape = out.shape[0], tuple(out.shape[1:])
    sdt = storage_dtype or out.dtype
    s = _scale_nbytes(out.dtype, sdt, shape)
    if stored.dtype != torch.uint8 or tuple(stored.shape) != (n, stored_nbytes(shape, out.dtype, sdt)):
        raise ValueError(f"stored must be ({n}, {stored_nbytes(shape, out.dtype, sdt)}) uint8, got "
                         f"{tuple(stored.shape)} {stored.dtype}")
    q = _typed(stored, s, stored.shape[1], sdt, shape)
    if s:
        scale = _typed(stored, 0, s, torch.float32, _scale_shape(shape))
        out.copy_(q.float().mul_(scale))  # one temporary float32 block, then into out's dtype
    else:
        out.copy_(q)
