"""Session records (``encode_record`` / ``decode_record``) under random and mutated bytes:
the decoder raises SessionRecordError and nothing else, and never accepts a damaged
record; records read back from a (real) Redis that are damaged are misses, not crashes."""

from __future__ import annotations

import asyncio
import json
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.service.sessions import (
    SESSION_ID_RE,
    TurnInfo,
    RedisSessionStore,
    SessionRecord,
    SessionRecordError,
    decode_record,
    encode_record,
)
from kvserve.service.sessions.records import FINISH_REASONS

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

session_ids = st.from_regex(SESSION_ID_RE, fullmatch=True)
finite = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)


@st.composite
def records(draw) -> SessionRecord:
    """Any record the server may write: the turn log covers the transcript's tail and at
    most ``turns`` turns (the untracked rest is what records written before turn
    boundaries existed carry)."""
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), max_size=300))
    log, room = [], len(tokens)
    for _ in range(draw(st.integers(0, 6))):
        n_in, n_out = draw(st.integers(0, room)), 0
        n_out = draw(st.integers(0, room - n_in))
        log.append(TurnInfo(n_in, n_out, draw(st.sampled_from(FINISH_REASONS)), draw(finite), draw(finite)))
        room -= n_in + n_out
    return SessionRecord(
        session_id=draw(session_ids),
        owner=draw(st.text(max_size=40)),
        token_ids=tokens,
        created_at=draw(finite),
        last_used_at=draw(finite),
        turns=draw(st.integers(len(log), 2**32 - 1)),
        cache_salt=draw(st.text(max_size=40)),
        turn_log=log,
        forked_from=draw(st.sampled_from(["", "src"]) | session_ids),
    )


records = records()


def _reseal(body: bytes) -> bytes:
    """A body with a correct CRC: damage the checksum cannot catch (a buggy writer)."""
    return body + struct.pack("<I", zlib.crc32(body))


def _record_with_meta(meta_bytes: bytes, tokens: list[int] = (1, 2, 3)) -> bytes:
    body = struct.pack("<4sHI", b"KVSS", 1, len(meta_bytes)) + meta_bytes
    body += struct.pack("<I", len(tokens)) + struct.pack(f"<{len(tokens)}I", *tokens)
    return _reseal(body)


def _decode_or_error(data: bytes) -> SessionRecord | None:
    """Decode; only SessionRecordError may come out (anything else fails the test)."""
    try:
        rec = decode_record(data)
    except SessionRecordError:
        return None
    assert isinstance(rec, SessionRecord)
    assert SESSION_ID_RE.fullmatch(rec.session_id)
    assert all(isinstance(t, int) and 0 <= t < 2**32 for t in rec.token_ids)
    return rec


@FUZZ
@given(records)
def test_round_trip(rec):
    assert decode_record(encode_record(rec)) == rec


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_never_decode(data):
    assert _decode_or_error(data) is None


@FUZZ
@given(records, st.data())
def test_any_single_byte_change_is_caught(rec, data):
    good = bytearray(encode_record(rec))
    i = data.draw(st.integers(0, len(good) - 1), label="position")
    good[i] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(SessionRecordError):
        decode_record(bytes(good))


@FUZZ
@given(records, st.data())
def test_truncated_or_extended_records_are_caught(rec, data):
    good = encode_record(rec)
    cut = data.draw(st.integers(0, len(good) - 1), label="cut")
    with pytest.raises(SessionRecordError):
        decode_record(good[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=16), label="extra")
    with pytest.raises(SessionRecordError):
        decode_record(good + extra)


@FUZZ
@given(records, st.data())
def test_damage_behind_a_valid_checksum_never_crashes_the_decoder(rec, data):
    body = bytearray(encode_record(rec)[:-4])
    for _ in range(data.draw(st.integers(1, 8), label="changes")):
        i = data.draw(st.integers(0, len(body) - 1), label="position")
        body[i] = data.draw(st.integers(0, 255), label="byte")
    _decode_or_error(_reseal(bytes(body)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=20,
)
meta_keys = st.sampled_from(["session_id", "owner", "created_at", "last_used_at", "turns", "cache_salt", "x"])


@FUZZ
@given(st.dictionaries(meta_keys, json_values, max_size=7) | json_values)
def test_any_json_metadata_is_decoded_or_refused_precisely(meta):
    _decode_or_error(_record_with_meta(json.dumps(meta).encode()))


GOOD_META = {"session_id": "s", "owner": "", "created_at": 1.0, "last_used_at": 2.0, "turns": 1}


@pytest.mark.parametrize(
    "meta,why",
    [
        (b"[" * 30000 + b"]" * 30000, "RecursionError"),  # deep nesting inside the 64 KiB bound
        (json.dumps({**GOOD_META, "turns": 1e308}).encode(), "turns"),
        (json.dumps({**GOOD_META, "turns": True}).encode(), "turns"),
        (json.dumps({**GOOD_META, "turns": -1}).encode(), "turns"),
        (json.dumps({**GOOD_META, "created_at": float("nan")}).encode(), "created_at"),
        (json.dumps({**GOOD_META, "last_used_at": "yesterday"}).encode(), "last_used_at"),
        (json.dumps({**GOOD_META, "owner": 5}).encode(), "owner"),
        (json.dumps({**GOOD_META, "session_id": "bad id!"}).encode(), "bad session id"),
        (json.dumps({k: v for k, v in GOOD_META.items() if k != "turns"}).encode(), "turns"),
        (b"\xff\xfe not utf-8", "bad metadata"),
        (b'"just a string"', "not an object"),
    ],
)  # fmt: skip
def test_hostile_metadata_is_refused_with_a_reason(meta, why):
    with pytest.raises(SessionRecordError, match=why):
        decode_record(_record_with_meta(meta))


def test_records_written_by_an_older_version_still_decode():
    """Version 1 records from before ``cache_salt`` existed: the salt defaults to ""."""
    rec = decode_record(_record_with_meta(json.dumps(GOOD_META).encode(), [7, 8]))
    assert rec == SessionRecord("s", "", [7, 8], 1.0, 2.0, 1, "")


def test_damaged_records_in_redis_are_misses(redis_url):
    import redis.asyncio as aioredis

    good = SessionRecord("s1", "acme", [1, 2, 3], 1.0, 2.0, 1)
    wrong_session = SessionRecord("s2", "acme", [4], 1.0, 2.0, 1)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        store = RedisSessionStore(client, key_prefix="fuzz:")
        try:
            await store.put(good)
            assert await store.get("acme", "s1") == good
            key = "fuzz:sess:acme:s1"
            raw = encode_record(good)
            for damaged in (raw[:-1], raw[:10], b"", b"garbage", bytes([raw[0] ^ 1]) + raw[1:],
                            encode_record(wrong_session)):  # fmt: skip
                await client.set(key, damaged)
                assert await store.get("acme", "s1") is None
            # another tenant's key never answers for this one
            await store.put(good)
            assert await store.get("bravo", "s1") is None
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_write_that_missed_redis_never_rolls_a_session_back(redis_url):
    """Redis keeps the older record when one put fails (timeout, blip); the replica that
    wrote the newer one must not read the older one back (the transcript would lose turns)."""
    import redis.asyncio as aioredis

    from kvserve.service.sessions import FallbackSessionStore

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url)
        primary = RedisSessionStore(client, key_prefix="fb:")
        store = FallbackSessionStore(primary)
        try:
            v1 = SessionRecord("s", "acme", [1, 2], created_at=10.0, last_used_at=11.0, turns=1)
            await store.put(v1)
            real_put = primary.put

            async def failing_put(rec: SessionRecord) -> None:
                raise ConnectionError("simulated: the write never reached Redis")

            primary.put = failing_put  # type: ignore[method-assign]
            v2 = SessionRecord("s", "acme", [1, 2, 3, 4], created_at=10.0, last_used_at=12.0, turns=2)
            await store.put(v2)
            primary.put = real_put  # type: ignore[method-assign]
            assert await primary.get("acme", "s") == v1  # Redis is behind
            assert await store.get("acme", "s") == v2  # but this replica reads its own newer record
            # a session deleted and created again elsewhere (another created_at) is Redis's
            other = SessionRecord("s", "acme", [9], created_at=20.0, last_used_at=20.0, turns=1)
            await primary.put(other)
            assert await store.get("acme", "s") == other
        finally:
            await client.aclose()

    asyncio.run(scenario())
