"""Block codec: exact round trips, a real safetensors payload, every verification
failure named, and fuzzing that never crashes the decoder nor decodes to a block."""

from __future__ import annotations

import struct

import pytest
import safetensors.torch
import torch
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvserve.cachestore import codec
from kvserve.cachestore.keys import block_hashes, make_namespace

SHAPE = (3, 2, 4, 2, 8)  # (L, 2, block_size, n_kv, head_dim), small for speed
NS = make_namespace("weights-a", "float32", 4)
NS_OTHER = make_namespace("weights-b", "float32", 4)  # other weights
H0, H1 = block_hashes(NS, list(range(8)), 4)


def block(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def sentinel_out(dtype: torch.dtype = torch.float32, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.full(shape, 7.0).to(dtype)


def assert_untouched(out: torch.Tensor) -> None:
    assert torch.equal(out, torch.full(out.shape, 7.0).to(out.dtype))


def rechecksum(body: bytes) -> bytes:
    """``body`` (header || payload) with a valid checksum: what a buggy writer or an
    attacker could produce. Verification past the checksum must still hold."""
    return body + xxhash.xxh3_128_digest(body)


def with_header(data: bytes, **fields: object) -> bytes:
    """Re-pack the header of ``data`` with some fields replaced, checksum recomputed."""
    names = [
        "magic", "version", "header_size", "namespace", "block_hash", "dtype", "storage_dtype",
        "compression", "ndim", "num_layers", "d0", "d1", "d2", "d3", "d4", "d5", "payload_size", "raw_size",
    ]  # fmt: skip
    values = dict(zip(names, codec._HEADER.unpack_from(data, 0)))
    values.update(fields)
    header = codec._HEADER.pack(*[values[n] for n in names])
    return rechecksum(header + data[codec.HEADER_SIZE : -codec.CHECKSUM_SIZE])


# ---- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_round_trip_is_exact(dtype: torch.dtype, compression: str | None) -> None:
    b = block(dtype)
    data = codec.encode(NS, H0, b, compression=compression)
    assert isinstance(data, bytes)
    out = sentinel_out(dtype)
    assert codec.decode_into(data, NS, H0, out) == codec.DecodeResult(True, codec.OK)
    assert torch.equal(out, b)


def test_payload_is_a_safetensors_file() -> None:
    b = block()
    data = codec.encode(NS, H0, b)
    payload = data[codec.HEADER_SIZE : -codec.CHECKSUM_SIZE]
    assert payload == safetensors.torch.save({"kv": b})  # byte for byte
    assert torch.equal(safetensors.torch.load(payload)["kv"], b)
    assert len(data) == codec.encoded_size(SHAPE, torch.float32)


def test_header_names_the_block() -> None:
    data = codec.encode(NS, H0, block())
    fields = codec._HEADER.unpack_from(data, 0)
    assert fields[0] == codec.MAGIC
    assert fields[1] == codec.FORMAT_VERSION
    assert fields[3] == NS and fields[4] == H0
    assert fields[9] == SHAPE[0]  # num_layers
    assert tuple(fields[10:15]) == SHAPE


@pytest.mark.parametrize("storage_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_lower_storage_dtype_is_the_rounded_block(storage_dtype: torch.dtype, compression: str | None) -> None:
    b = block()
    data = codec.encode(NS, H0, b, storage_dtype=storage_dtype, compression=compression)
    assert len(data) < codec.encoded_size(SHAPE, torch.float32)
    out = sentinel_out()
    assert codec.decode_into(data, NS, H0, out, storage_dtype).ok
    assert out.dtype == torch.float32
    assert torch.equal(out, b.to(storage_dtype).to(torch.float32))  # lossy, and exactly so


@pytest.mark.parametrize(
    ("storage_dtype", "bound"), [(torch.int8, 0.5 / 127), (torch.float8_e4m3fn, 1 / 16)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_scaled_storage_round_trip(
    storage_dtype: torch.dtype, bound: float, dtype: torch.dtype, compression: str | None
) -> None:
    """int8 / fp8 with a scale per (layer, K/V, token, head) row: every value within
    half a quantization step of that row's absmax (int8), or fp8 e4m3's relative
    precision (3 mantissa bits: 1/16) of it; a row of zeros stays zeros."""
    b = (block() * torch.linspace(0.01, 100, SHAPE[-1])).to(dtype)  # rows of mixed magnitudes
    b[0, 1, 2] = 0
    data = codec.encode(NS, H0, b, storage_dtype=storage_dtype, compression=compression)
    exact_size = codec.encoded_size(SHAPE, dtype)
    if compression is None:
        assert len(data) == codec.encoded_size(SHAPE, dtype, storage_dtype) < exact_size
    out = sentinel_out(dtype=dtype)
    assert codec.decode_into(data, NS, H0, out, storage_dtype).ok
    err = (out.float() - b.float()).abs()
    row_max = b.float().abs().amax(dim=-1, keepdim=True)
    rounding = 2.0 ** -7 if dtype != torch.float32 else 0.0  # out's own rounding
    assert (err <= (bound + rounding) * row_max + 1e-12).all()
    assert torch.equal(out[0, 1, 2], torch.zeros_like(out[0, 1, 2]))
    # the payload is a safetensors file of two tensors any reader can open
    from safetensors.torch import load

    payload = data[codec.HEADER_SIZE : -codec.CHECKSUM_SIZE]
    if compression is None:
        tensors = load(bytes(payload))
        assert set(tensors) == {"kv", "scale"} and tensors["kv"].dtype == storage_dtype


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("bf16", torch.float32), ("fp16", torch.float32), ("int8", torch.float32), ("fp8", torch.float32),
     ("int8", torch.bfloat16), ("fp8", torch.bfloat16)],
)
def test_the_stored_form_decoded_after_a_copy_is_bit_identical_to_the_cpu_decode(fmt: str, dtype: torch.dtype) -> None:
    """What a GPU restore does (verify, take the compact stored bytes, copy them as they
    are, decode several blocks at once with ``expand_into`` where they land) writes the
    bits ``decode_into`` writes, and those are the safetensors payload's tensors decoded
    by the format's rule (read with safetensors' own reader: q * scale in float32, then
    the block's dtype). The value is the stored prefix, the stored form, the checksum."""
    sdt = codec.STORAGE_FORMATS[fmt]
    blocks = [(block(seed=i) * torch.linspace(0.01, 50, SHAPE[-1])).to(dtype) for i in range(3)]
    hashes = block_hashes(NS, list(range(12)), 4)
    values = [codec.encode(NS, h, b, storage_dtype=sdt) for h, b in zip(hashes, blocks)]
    n = codec.stored_nbytes(SHAPE, dtype, sdt)
    stored = torch.empty(3, n, dtype=torch.uint8)
    for v, h, row in zip(values, hashes, stored):
        assert codec.decode_stored_into(v, NS, h, row.numpy(), SHAPE, dtype, sdt).ok
        prefix = codec.stored_prefix(NS, h, SHAPE, dtype, sdt)
        assert v == prefix + row.numpy().tobytes() + xxhash.xxh3_128_digest(v[: -codec.CHECKSUM_SIZE])
    batched = torch.empty(3, *SHAPE, dtype=dtype)
    codec.expand_into(stored, batched, sdt)
    raw = lambda t: t.reshape(-1).view(torch.uint8)  # noqa: E731
    for v, h, b, got in zip(values, hashes, blocks, batched):
        one = sentinel_out(dtype)
        assert codec.decode_into(v, NS, h, one, sdt).ok
        assert torch.equal(raw(got), raw(one))
        st = safetensors.torch.load(bytes(v[codec.HEADER_SIZE : -codec.CHECKSUM_SIZE]))
        ref = (st["kv"].float() * st["scale"]).to(dtype) if "scale" in st else st["kv"].to(dtype)
        assert torch.equal(raw(got), raw(ref))


def test_decode_stored_into_verifies_as_decode_into_and_leaves_out_untouched() -> None:
    b = block()
    good = codec.encode(NS, H0, b, storage_dtype=torch.int8)
    n = codec.stored_nbytes(SHAPE, torch.float32, torch.int8)
    assert n == 3 * 2 * 4 * 2 * (8 + 4)  # one int8 per value, a float32 scale per row of 8
    for bad, reason in [
        (good[:-1], codec.TRUNCATED),
        (good[:200] + bytes([good[200] ^ 1]) + good[201:], codec.BAD_CHECKSUM),
        (codec.encode(NS, H1, b, storage_dtype=torch.int8), codec.WRONG_HASH),
        (codec.encode(NS, H0, b), codec.WRONG_STORAGE),
    ]:
        out = torch.full((n,), 7, dtype=torch.uint8)
        assert codec.decode_stored_into(bad, NS, H0, out.numpy(), SHAPE, torch.float32, torch.int8).reason == reason
        assert bool((out == 7).all())
    # scales that are not finite (a writer's bug, checksummed): a miss, whoever decodes
    inf = good[:-codec.CHECKSUM_SIZE]
    at = len(codec.stored_prefix(NS, H0, SHAPE, torch.float32, torch.int8))
    inf = rechecksum(inf[:at] + struct.pack("<f", float("inf")) + inf[at + 4 :])
    out = torch.empty(n, dtype=torch.uint8)
    assert codec.decode_stored_into(inf, NS, H0, out.numpy(), SHAPE, torch.float32, torch.int8).reason == codec.BAD_PAYLOAD
    fixed = torch.empty(n, dtype=torch.uint8)
    assert codec.decode_stored_into(good, NS, H0, fixed.numpy(), SHAPE, torch.float32, torch.int8).ok
    assert codec.finite_scales(fixed, SHAPE, torch.float32, torch.int8)
    fixed[:4] = torch.tensor(list(struct.pack("<f", float("nan"))), dtype=torch.uint8)
    assert not codec.finite_scales(fixed, SHAPE, torch.float32, torch.int8)


@pytest.mark.parametrize("written", sorted(codec.STORAGE_FORMATS))
def test_a_reader_takes_only_its_storage_format(written: str) -> None:
    """A value stored in one format is a miss (wrong_storage) for a reader of any other,
    so lossy KV is never taken for exact KV or for another lossy format."""
    b = block()
    data = codec.encode(NS, H0, b, storage_dtype=codec.STORAGE_FORMATS[written])
    for reader, sdt in codec.STORAGE_FORMATS.items():
        out = sentinel_out()
        result = codec.decode_into(data, NS, H0, out, sdt)
        if reader == written:
            assert result.ok
        else:
            assert result.reason == codec.WRONG_STORAGE
            assert_untouched(out)


def test_decode_reads_from_memoryview_and_bytearray() -> None:
    b = block()
    data = codec.encode(NS, H0, b)
    for buf in (memoryview(data), bytearray(data), memoryview(b"xx" + data)[2:]):
        out = sentinel_out()
        assert codec.decode_into(buf, NS, H0, out).ok
        assert torch.equal(out, b)


def test_encode_takes_views_of_a_pool() -> None:
    pool = torch.randn(5, *SHAPE)  # (num_blocks, L, 2, B, n_kv, hd)
    data = codec.encode(NS, H1, pool[3])
    out = sentinel_out()
    assert codec.decode_into(data, NS, H1, out).ok
    assert torch.equal(out, pool[3])
    # A non-contiguous block is encoded as its values.
    t = torch.randn(SHAPE[::-1]).permute(4, 3, 2, 1, 0)
    assert not t.is_contiguous()
    out = sentinel_out()
    assert codec.decode_into(codec.encode(NS, H1, t), NS, H1, out).ok
    assert torch.equal(out, t)


# ---- every verification failure ------------------------------------------------------


@pytest.fixture(scope="module")
def good() -> bytes:
    return codec.encode(NS, H0, block())


def check_miss(data: bytes, reason: str, *, ns: bytes = NS, h: bytes = H0, out: torch.Tensor | None = None) -> None:
    out = sentinel_out() if out is None else out
    result = codec.decode_into(data, ns, h, out)
    assert not result.ok and not result
    assert result.reason == reason
    assert reason in codec.REASONS
    assert_untouched(out)


def test_bad_magic(good: bytes) -> None:
    check_miss(b"XXXX" + good[4:], codec.BAD_MAGIC)
    check_miss(b"not a block at all, just some text padding it out" * 4, codec.BAD_MAGIC)


def test_other_version(good: bytes) -> None:
    check_miss(good[:4] + struct.pack("<H", codec.FORMAT_VERSION + 1) + good[6:], codec.BAD_VERSION)
    check_miss(with_header(good, version=codec.FORMAT_VERSION + 1), codec.BAD_VERSION)


def test_other_header_layout(good: bytes) -> None:
    check_miss(with_header(good, header_size=codec.HEADER_SIZE + 8), codec.BAD_HEADER)


def test_other_namespace_or_weights() -> None:
    data = codec.encode(NS_OTHER, H0, block())  # same hash, written under other weights
    check_miss(data, codec.WRONG_NAMESPACE)


def test_other_block_hash(good: bytes) -> None:
    check_miss(good, codec.WRONG_HASH, h=H1)


def test_wrong_layers_dtype_shape(good: bytes) -> None:
    check_miss(good, codec.WRONG_LAYERS, out=sentinel_out(shape=(SHAPE[0] + 1, *SHAPE[1:])))
    check_miss(good, codec.WRONG_DTYPE, out=sentinel_out(dtype=torch.bfloat16))
    check_miss(good, codec.WRONG_SHAPE, out=sentinel_out(shape=(SHAPE[0], 2, 4, 2, 4)))
    check_miss(good, codec.WRONG_SHAPE, out=sentinel_out(shape=(SHAPE[0], 2, 64)))


def test_truncated_at_every_length(good: bytes) -> None:
    for n in [0, 1, 3, 4, 5, 6, 50, codec.HEADER_SIZE, codec.HEADER_SIZE + 20, len(good) - 17, len(good) - 1]:
        check_miss(good[:n], codec.TRUNCATED)


def test_trailing_bytes(good: bytes) -> None:
    check_miss(good + b"\0", codec.BAD_LENGTH)


@pytest.mark.parametrize("where", ["header", "payload", "checksum", "last"])
def test_flipped_byte(good: bytes, where: str) -> None:
    pos = {"header": 40, "payload": codec.HEADER_SIZE + 200, "checksum": len(good) - 8, "last": len(good) - 1}[where]
    bad = bytearray(good)
    bad[pos] ^= 0x01
    check_miss(bytes(bad), codec.BAD_CHECKSUM)


def test_corrupt_compressed_payload() -> None:
    data = codec.encode(NS, H0, block(), compression="zstd")
    body = bytearray(data[: -codec.CHECKSUM_SIZE])
    body[codec.HEADER_SIZE + 4 :] = bytes(len(body) - codec.HEADER_SIZE - 4)  # zero the frame
    check_miss(rechecksum(bytes(body)), codec.BAD_DECOMPRESS)
    # A compressed payload that inflates to another size than announced.
    check_miss(with_header(data, raw_size=codec._HEADER.unpack_from(data, 0)[-1] - 8), codec.BAD_DECOMPRESS)


def test_inconsistent_payload_with_valid_checksum(good: bytes) -> None:
    """Past the checksum the payload is still parsed strictly: a writer bug or a
    crafted value must not copy anything but the exact expected tensor."""
    payload = good[codec.HEADER_SIZE : -codec.CHECKSUM_SIZE]
    header = good[: codec.HEADER_SIZE]
    f16 = safetensors.torch.save({"kv": block(torch.float16)})
    other_name = safetensors.torch.save({"kx": block()})
    other_shape = safetensors.torch.save({"kv": block().reshape(SHAPE[0], 2, 4, 16)})
    for bad_payload in [f16, other_name, other_shape]:
        n = len(bad_payload)
        hdr = with_header(header + bad_payload + bytes(16), payload_size=n, raw_size=n)
        check_miss(hdr, codec.BAD_PAYLOAD)
    # Header length field pointing past the end, and JSON garbage.
    garbage = struct.pack("<Q", 10**9) + payload[8:]
    check_miss(rechecksum(header + garbage), codec.BAD_PAYLOAD)
    (n,) = struct.unpack_from("<Q", payload, 0)
    for js in [
        b"{" * n,
        b"[]",
        b'{"kv":{"dtype":"F32","shape":[3,2,4,2,8],"data_offsets":[0,4]}}',
        b'{"kv":{"dtype":"F32","shape":[3,2,4,2,8],"data_offsets":[4,1540]}}',
        b'{"kv":{"dtype":"F16","shape":[3,2,4,2,8],"data_offsets":[0,1536]}}',
        b'{"kv":{"dtype":"F32","shape":[3,2,4,16],"data_offsets":[0,1536]}}',
        b'{"kv":1}',
        b'{"kx":{"dtype":"F32","shape":[3,2,4,2,8],"data_offsets":[0,1536]}}',
    ]:
        assert len(js) <= n
        same_length = payload[:8] + js.ljust(n) + payload[8 + n :]
        check_miss(rechecksum(header + same_length), codec.BAD_PAYLOAD)
    # The control: the same construction with the original JSON decodes.
    ok = payload[:8] + payload[8 : 8 + n].rstrip().ljust(n) + payload[8 + n :]
    assert codec.decode_into(rechecksum(header + ok), NS, H0, sentinel_out()).ok


def test_header_inconsistencies_with_valid_checksum(good: bytes) -> None:
    check_miss(with_header(good, num_layers=SHAPE[0] + 1), codec.BAD_HEADER)
    check_miss(with_header(good, ndim=0), codec.BAD_HEADER)
    check_miss(with_header(good, ndim=7), codec.BAD_HEADER)
    check_miss(with_header(good, d5=3), codec.BAD_HEADER)
    check_miss(with_header(good, dtype=99), codec.BAD_HEADER)
    check_miss(with_header(good, compression=9), codec.BAD_HEADER)
    check_miss(with_header(good, raw_size=5), codec.BAD_HEADER)
    check_miss(with_header(good, storage_dtype=2), codec.WRONG_STORAGE)  # says f16: not what we read
    f16 = with_header(good, storage_dtype=2)
    assert codec.decode_into(f16, NS, H0, sentinel_out(), torch.float16).reason == codec.BAD_PAYLOAD  # holds f32


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        codec.encode(NS[:16], H0, block())
    with pytest.raises(ValueError):
        codec.encode(NS, H0, block().to(torch.int32))
    with pytest.raises(ValueError):
        codec.encode(NS, H0, block(), compression="gzip")
    with pytest.raises(ValueError):
        codec.encode(NS, H0, torch.zeros(1, 1, 1, 1, 1, 1, 1))
    out = torch.zeros(SHAPE[::-1]).permute(4, 3, 2, 1, 0)
    with pytest.raises(ValueError):
        codec.decode_into(codec.encode(NS, H0, block()), NS, H0, out)


def test_non_buffer_input_is_a_miss() -> None:
    out = sentinel_out()
    assert codec.decode_into("a string", NS, H0, out).reason == codec.BAD_HEADER  # type: ignore[arg-type]
    assert_untouched(out)


# ---- fuzzing -----------------------------------------------------------------------------

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes_never_decode(data: bytes) -> None:
    out = sentinel_out()
    assert not codec.decode_into(data, NS, H0, out).ok
    assert_untouched(out)


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_behind_a_valid_prefix(tail: bytes) -> None:
    good = codec.encode(NS, H0, block())
    out = sentinel_out()
    assert not codec.decode_into(good[: codec.HEADER_SIZE] + tail, NS, H0, out).ok
    assert_untouched(out)


@st.composite
def mutations(draw: st.DrawFn, data: bytes, limit: int | None = None) -> bytes:
    """One random edit of ``data`` that changes no byte at or past ``limit`` (default:
    anywhere); insertions and deletions before it still shift what follows."""
    kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete", "splice"]))
    n = len(data)
    hi = min(n, limit or n)
    pos = draw(st.integers(0, hi - 1))
    if kind == "flip":
        bit = draw(st.integers(0, 7))
        return data[:pos] + bytes([data[pos] ^ (1 << bit)]) + data[pos + 1 :]
    if kind == "set":
        chunk = draw(st.binary(min_size=1, max_size=64))[: hi - pos]
        return data[:pos] + chunk + data[pos + len(chunk) :]
    if kind == "truncate":
        return data[:pos]
    if kind == "insert":
        return data[:pos] + draw(st.binary(min_size=1, max_size=64)) + data[pos:]
    if kind == "delete":
        k = draw(st.integers(1, 64))
        return data[:pos] + data[pos + k :]
    end = draw(st.integers(pos, hi))
    return data[:pos] + data[pos:end][::-1] + data[end:]


_VARIANTS = {
    "plain": dict(),
    "zstd": dict(compression="zstd"),
    "lz4": dict(compression="lz4"),
    "bf16": dict(storage_dtype=torch.bfloat16),
    "int8": dict(storage_dtype=torch.int8),
    "fp8": dict(storage_dtype=torch.float8_e4m3fn),
}


@FUZZ
@given(st.sampled_from(sorted(_VARIANTS)), st.data())
def test_fuzz_mutated_values_never_decode(variant: str, draw: st.DataObject) -> None:
    good = codec.encode(NS, H0, block(), **_VARIANTS[variant])
    bad = draw.draw(mutations(good))
    out = sentinel_out()
    result = codec.decode_into(bad, NS, H0, out, _VARIANTS[variant].get("storage_dtype"))
    if bad == good:
        assert result.ok
    else:
        assert not result.ok
        assert result.reason in codec.REASONS
        assert_untouched(out)


@FUZZ
@given(st.sampled_from(sorted(_VARIANTS)), st.data())
def test_fuzz_mutations_with_recomputed_checksum_never_give_wrong_kv(variant: str, draw: st.DataObject) -> None:
    """A value whose metadata was mutated and whose checksum was then recomputed (a
    writer bug) never raises and never decodes to anything but the original block.
    (Mutated tensor bytes under a recomputed checksum are simply other KV: nothing
    can tell, which is why only the writer computes checksums.)"""
    b = block()
    good = codec.encode(NS, H0, b, **_VARIANTS[variant])
    meta_end = codec.HEADER_SIZE  # compressed: the safetensors header is mixed with data
    if _VARIANTS[variant].get("compression") is None:
        meta_end = codec.HEADER_SIZE + 8 + struct.unpack_from("<Q", good, codec.HEADER_SIZE)[0]
    body = draw.draw(mutations(good[: -codec.CHECKSUM_SIZE], limit=meta_end))
    out = sentinel_out()
    sdt = _VARIANTS[variant].get("storage_dtype")
    result = codec.decode_into(rechecksum(body), NS, H0, out, sdt)
    if result.ok:
        expected = sentinel_out()
        assert codec.decode_into(good, NS, H0, expected, sdt).ok
        assert torch.equal(out, expected)
    else:
        assert result.reason in codec.REASONS
        assert_untouched(out)


@settings(max_examples=60, deadline=None)
@given(
    dims=st.tuples(st.integers(1, 4), st.just(2), st.integers(1, 8), st.integers(1, 3), st.integers(1, 16)),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    compression=st.sampled_from([None, "zstd", "lz4"]),
    seed=st.integers(0, 2**16),
)
def test_fuzz_round_trip_any_shape(
    dims: tuple[int, ...], dtype: torch.dtype, compression: str | None, seed: int
) -> None:
    b = block(dtype, dims, seed)
    data = codec.encode(NS, H1, b, compression=compression)
    out = torch.empty(dims, dtype=dtype)
    assert codec.decode_into(data, NS, H1, out).ok
    assert torch.equal(out, b)
    assume(dims != SHAPE)
    assert not codec.decode_into(data, NS, H1, sentinel_out(dtype)).ok
