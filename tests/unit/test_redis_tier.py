"""Redis tier against a real redis-server: round trips, TTLs, pipelines, verification
misses, eviction, the circuit breaker across a restart, timeouts, auth, TLS, cluster."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import redis
import torch

from kvserve.cachestore import codec
from kvserve.cachestore.base import BACKEND_ERROR, BREAKER_OPEN, NOT_FOUND, TIMEOUT, BlockRef
from kvserve.common.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.cachestore.redis import RedisTier

SHAPE = (2, 2, 4, 2, 8)  # (L, 2, B, n_kv, hd)
NS = make_namespace("weights-a", "float32", 4)
NS_OTHER = make_namespace("weights-b", "float32", 4)
REFS = [BlockRef(NS, h) for h in block_hashes(NS, list(range(4 * 40)), 4)]


def value(i: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(i))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_tier(url: str, **kw: Any) -> RedisTier:
    kw.setdefault("block_shape", SHAPE)
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("key_prefix", "test:")
    return RedisTier(url, **kw)


# ---- the breaker on its own ------------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_probes() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=3, reset_timeout_s=5.0, clock=clock)
    assert b.state == CLOSED and b.allow()
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the run of failures
    b.record_failure()
    b.record_failure()
    assert b.state == CLOSED
    b.record_failure()
    assert b.state == OPEN and b.opens == 1
    assert not b.allow()
    clock.t += 4.9
    assert not b.allow()
    clock.t += 0.2
    assert b.state == HALF_OPEN
    assert b.allow()  # the probe
    assert not b.allow()  # only one
    b.record_failure()  # probe failed: open again, timer restarted
    assert b.state == OPEN and b.opens == 2 and not b.allow()
    clock.t += 5.0
    assert b.allow()
    b.record_success()
    assert b.state == CLOSED and b.allow() and b.allow()


def test_breaker_recovers_from_a_lost_probe() -> None:
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=1.0, clock=clock)
    b.record_failure()
    clock.t += 1.0
    assert b.allow()  # probe sent, its caller never reports
    clock.t += 0.5
    assert not b.allow()
    clock.t += 0.5
    assert b.allow()  # a new probe
    b.record_success()
    assert b.state == CLOSED


def test_breaker_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_timeout_s=-1)


# ---- round trips, layout, TTL ------------------------------------------------------------


def test_round_trip_layout_and_ttl(redis_url: str, redis_server: Any) -> None:
    tier = make_tier(redis_url, ttl_s=60)
    assert tier.put(REFS[0], value(0))
    out = torch.empty(SHAPE)
    assert tier.get_into(REFS[0], out)
    assert torch.equal(out, value(0))
    got = tier.get(REFS[0])
    assert got is not None and torch.equal(got, value(0))
    with redis_server.client() as c:
        key = "test:blk:" + REFS[0].block_hash.hex()
        assert tier.key(REFS[0]) == key
        assert c.keys("test:*") == [key.encode()]  # one atomic value per block
        assert 0 < c.pttl(key) <= 60_000
        raw = c.get(key)
    assert raw == tier.get_encoded(REFS[0])
    check = torch.empty(SHAPE)
    assert codec.decode_into(raw, NS, REFS[0].block_hash, check).ok
    s = tier.stats()
    assert s.hits == 2 and s.puts == 1 and s.bytes_in == len(raw) and s.bytes_out == 2 * len(raw)
    assert s.breaker_state == CLOSED


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
def test_lossy_storage_formats_have_their_own_keys(redis_url: str, redis_server: Any, fmt: str) -> None:
    """A lossy format round trips within its error, under keys of its own: an exact
    reader (or one of another format) never sees it, and a value of the wrong format
    put under its keys is a miss (wrong_storage), deleted when read."""
    sdt = codec.STORAGE_FORMATS[fmt]
    lossy = make_tier(redis_url, storage_dtype=sdt)
    exact = make_tier(redis_url)
    assert lossy.storage_format == fmt and exact.storage_format == "exact"
    assert lossy.put_many(REFS[:3], [value(i) for i in range(3)]) == [True] * 3
    outs = [torch.empty(SHAPE) for _ in range(3)]
    assert lossy.get_many_into(REFS[:3], outs) == 3
    for i, out in enumerate(outs):
        assert not torch.equal(out, value(i)) and torch.allclose(out, value(i), atol=0.15)
    assert exact.contains_many(REFS[:3]) == [False] * 3
    assert exact.get_many_into(REFS[:3], outs) == 0
    with redis_server.client() as c:
        assert {k.decode() for k in c.keys("test:*")} == {f"test:blk.{fmt}:" + r.block_hash.hex() for r in REFS[:3]}
        # an exact value stored under the lossy key (a writer bug): a miss, and deleted
        c.set(lossy.key(REFS[5]), codec.encode(NS, REFS[5].block_hash, value(5)))
        assert lossy.get_into(REFS[5], outs[0]) is False
        assert lossy.stats().failures.get(codec.WRONG_STORAGE) == 1
        assert not c.exists(lossy.key(REFS[5]))
    lossy.close()
    exact.close()


def test_no_ttl(redis_url: str, redis_server: Any) -> None:
    tier = make_tier(redis_url, ttl_s=None)
    tier.put(REFS[0], value(0))
    with redis_server.client() as c:
        assert c.pttl(tier.key(REFS[0])) == -1
    # and an idempotent rewrite checks with EXISTS instead of PEXPIRE
    assert tier.put(REFS[0], value(0))
    assert tier.stats().put_skips == 1


@pytest.mark.parametrize(
    "options",
    [dict(compression="zstd"), dict(compression="lz4"), dict(storage_dtype=torch.bfloat16)],
)
def test_codec_options(redis_url: str, options: dict[str, Any]) -> None:
    tier = make_tier(redis_url, **options)
    tier.put_many(REFS[:3], [value(i) for i in range(3)])
    outs = [torch.empty(SHAPE) for _ in range(3)]
    assert tier.get_many_into(REFS[:3], outs) == 3
    expected = [value(i) for i in range(3)]
    if "storage_dtype" in options:  # lossy: exactly the rounded block
        expected = [e.to(torch.bfloat16).float() for e in expected]
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))


def test_miss_is_a_counted_none(redis_url: str) -> None:
    tier = make_tier(redis_url)
    out = torch.full(SHAPE, 7.0)
    assert tier.get(REFS[5]) is None
    assert not tier.get_into(REFS[5], out)
    assert torch.equal(out, torch.full(SHAPE, 7.0))
    assert not tier.contains(REFS[5]) and not tier.delete(REFS[5])
    s = tier.stats()
    assert s.misses == 2 and s.failures == {NOT_FOUND: 2} and s.errors == 0


# ---- batching ----------------------------------------------------------------------------


def test_batched_pipelines(redis_url: str, count_round_trips: Callable[[], int]) -> None:
    per_value = codec.encoded_size(SHAPE, torch.float32)
    tier = make_tier(redis_url, max_batch_bytes=3 * per_value)  # 3 blocks per round trip
    assert tier.batch_blocks == 3
    n = 10
    start = count_round_trips()
    assert tier.put_many(REFS[:n], [value(i) for i in range(n)]) == [True] * n
    assert count_round_trips() - start == 2 * 4  # per batch: PEXPIRE check + SET

    start = count_round_trips()
    assert tier.contains_many(REFS[: n + 2]) == [True] * n + [False, False]
    assert count_round_trips() - start == 1  # one round trip whatever the count

    start = count_round_trips()
    outs = [torch.empty(SHAPE) for _ in range(n)]
    assert tier.get_many_into(REFS[:n], outs) == n
    assert count_round_trips() == start  # reads are streamed, not batched pipelines
    assert all(torch.equal(outs[i], value(i)) for i in range(n))

    assert tier.delete_many(REFS[: n + 1]) == [True] * n + [False]
    assert tier.contains_many(REFS[:n]) == [False] * n


@pytest.fixture
def track_in_flight(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts GETs sent and replies read (by the direct reader or through redis-py's
    parser) and records the most replies ever outstanding (tests using it read on one
    connection at a time)."""
    stats = {"in_flight": 0, "max_in_flight": 0, "direct_replies": 0}
    Conn = redis.connection.Connection
    send = Conn.send_packed_command
    read_direct, read_parsed = RedisTier._read_direct, RedisTier._read_parsed

    def send_packed_command(self: Any, command: Any, *a: Any, **kw: Any) -> Any:
        chunks = command if isinstance(command, list) else [command]
        stats["in_flight"] += sum(bytes(c).count(b"\r\nGET\r\n") for c in chunks)
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        return send(self, command, *a, **kw)

    def direct(self: RedisTier, *a: Any) -> Any:
        stats["in_flight"] -= 1
        stats["direct_replies"] += 1
        return read_direct(self, *a)

    def parsed(self: RedisTier, *a: Any) -> Any:
        stats["in_flight"] -= 1
        return read_parsed(self, *a)

    monkeypatch.setattr(Conn, "send_packed_command", send_packed_command)
    monkeypatch.setattr(RedisTier, "_read_direct", direct)
    monkeypatch.setattr(RedisTier, "_read_parsed", parsed)
    return stats


def test_streamed_reads_keep_a_bounded_window(redis_url: str, track_in_flight: dict[str, int]) -> None:
    per_value = codec.encoded_size(SHAPE, torch.float32)
    tier = make_tier(redis_url, max_batch_bytes=4 * per_value, read_connections=1)
    n = 30
    tier.put_many(REFS[:n], [value(i) for i in range(n)])
    outs = [torch.empty(SHAPE) for _ in range(n)]
    track_in_flight.update(in_flight=0, max_in_flight=0, direct_replies=0)
    assert tier.get_many_into(REFS[:n], outs) == n
    assert all(torch.equal(outs[i], value(i)) for i in range(n))
    assert 2 <= track_in_flight["max_in_flight"] <= 4
    assert track_in_flight["in_flight"] == 0
    assert track_in_flight["direct_replies"] == n  # the direct reader took every reply


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "parsed"])
def test_early_stop_leaves_no_stale_replies(redis_url: str, redis_server: Any, direct: bool) -> None:
    """A read that stops with replies still in flight must not hand them to the next
    read on a pooled connection."""
    per_value = codec.encoded_size(SHAPE, torch.float32)
    tier = make_tier(redis_url, max_batch_bytes=6 * per_value, direct_reads=direct)
    tier.put_many(REFS[:12], [value(i) for i in range(12)])
    with redis_server.client() as c:
        _corrupt(c, tier.key(REFS[2]), "flip")
    outs = [torch.empty(SHAPE) for _ in range(12)]
    assert tier.get_many_into(REFS[:12], outs) == 2
    for _ in range(3):  # later reads see their own replies, in order
        assert tier.get_many_into(REFS[5:12], outs[:7]) == 7
        assert all(torch.equal(outs[i], value(5 + i)) for i in range(7))
        assert tier.get_many_into(REFS[3:4], outs[:1]) == 1 and torch.equal(outs[0], value(3))


def test_rewrite_skips_the_transfer_and_refreshes_ttl(redis_url: str, redis_server: Any) -> None:
    tier = make_tier(redis_url, ttl_s=100)
    tier.put_many(REFS[:4], [value(i) for i in range(4)])
    with redis_server.client() as c:
        for r in REFS[:4]:
            c.pexpire(tier.key(r), 5_000)
        sets_before = _cmd_calls(c, "set")
        assert tier.put_many(REFS[:6], [value(i) for i in range(6)]) == [True] * 6
        assert _cmd_calls(c, "set") - sets_before == 2  # only the two new blocks
        assert all(c.pttl(tier.key(r)) > 50_000 for r in REFS[:6])  # TTL refreshed
    s = tier.stats()
    assert s.puts == 6 and s.put_skips == 4


def _cmd_calls(c: redis.Redis, cmd: str) -> int:
    return int(c.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))


# ---- verification: corrupted, truncated, foreign values are misses ----------------------


def _corrupt(c: redis.Redis, key: str, how: str) -> None:
    raw = bytearray(c.get(key))
    if how == "flip":
        raw[len(raw) // 2] ^= 0x10
    elif how == "truncate":
        raw = raw[: len(raw) - 100]
    elif how == "garbage":
        raw = bytearray(b"hello world")
    c.set(key, bytes(raw))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "parsed"])
@pytest.mark.parametrize(
    "how, reason",
    [
        ("flip", codec.BAD_CHECKSUM),  # in the tensor bytes
        ("flip_header", codec.BAD_CHECKSUM),
        ("truncate", codec.TRUNCATED),
        ("garbage", codec.BAD_MAGIC),
        ("other_namespace", codec.WRONG_NAMESPACE),  # same length, other prefix
        ("compressed", None),  # another writer's options: a valid value, decoded
    ],
)
def test_corrupted_value_is_a_miss(
    redis_url: str, redis_server: Any, how: str, reason: str | None, direct: bool
) -> None:
    tier = make_tier(redis_url, direct_reads=direct, max_batch_bytes=2 * codec.encoded_size(SHAPE, torch.float32))
    tier.put_many(REFS[:6], [value(i) for i in range(6)])
    key = tier.key(REFS[2])
    with redis_server.client() as c:
        if how == "flip_header":
            raw = bytearray(c.get(key))
            raw[10] ^= 0x01
            c.set(key, bytes(raw))
        elif how == "other_namespace":
            c.set(key, codec.encode(NS_OTHER, REFS[2].block_hash, value(2)))
        elif how == "compressed":
            c.set(key, codec.encode(NS, REFS[2].block_hash, value(2), compression="lz4"))
        else:
            _corrupt(c, key, how)
    outs = [torch.empty(SHAPE) for _ in range(6)]
    good = tier.get_many_into(REFS[:6], outs)
    assert all(torch.equal(outs[i], value(i)) for i in range(good))
    if reason is None:
        assert good == 6
        return
    assert good == 2  # stops at the first bad block
    with redis_server.client() as c:
        assert not c.exists(key)  # deleted: the next write replaces it, not just its TTL
    assert tier.get(REFS[2]) is None
    assert tier.get_many_into(REFS[3:6], outs[:3]) == 3  # the others are fine, in step
    assert all(torch.equal(outs[i], value(3 + i)) for i in range(3))
    s = tier.stats()
    assert s.failures == {reason: 1, NOT_FOUND: 1}
    assert s.errors == 0 and s.breaker_state == CLOSED  # bad data is not a backend failure
    assert tier.put_many(REFS[:6], [value(i) for i in range(6)]) == [True] * 6
    assert tier.get_many_into(REFS[:6], outs) == 6 and torch.equal(outs[2], value(2))


@pytest.mark.parametrize("protocol", [2, 3], ids=["resp2", "resp3"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "parsed"])
def test_error_reply_mid_stream(redis_url: str, redis_server: Any, direct: bool, protocol: int) -> None:
    tier = make_tier(f"{redis_url}?protocol={protocol}", direct_reads=direct)
    tier.put_many(REFS[:4], [value(i) for i in range(4)])
    with redis_server.client() as c:
        c.delete(tier.key(REFS[1]))
        c.rpush(tier.key(REFS[1]), b"not a string")  # GET answers -WRONGTYPE
    outs = [torch.empty(SHAPE) for _ in range(4)]
    assert tier.get_many_into(REFS[:4], outs) == 1
    assert tier.get_many_into(REFS[2:4], outs[:2]) == 2
    assert all(torch.equal(outs[i], value(2 + i)) for i in range(2))
    assert tier.get_many_into([REFS[3], REFS[9], REFS[2]], outs[:3]) == 1  # nil mid-stream
    assert tier.get_many_into(REFS[2:4], outs[:2]) == 2
    assert all(torch.equal(outs[i], value(2 + i)) for i in range(2))
    s = tier.stats()
    assert s.failures == {BACKEND_ERROR: 1, NOT_FOUND: 1} and s.errors == 1 and s.breaker_state == CLOSED


def test_direct_and_parsed_reads_agree(redis_url: str) -> None:
    direct, parsed = make_tier(redis_url), make_tier(redis_url, direct_reads=False)
    direct.put_many(REFS[:8], [value(i) for i in range(8)])
    a, b = torch.full((8, *SHAPE), 7.0), torch.full((8, *SHAPE), 8.0)
    assert direct.get_many_into(REFS[:10], list(a) + [torch.empty(SHAPE)] * 2) == 8
    assert parsed.get_many_into(REFS[:10], list(b) + [torch.empty(SHAPE)] * 2) == 8
    assert torch.equal(a, b)
    # A destination the direct path cannot take goes through the parser (here: a miss).
    assert not direct.get_into(REFS[0], torch.empty(SHAPE, dtype=torch.bfloat16))
    assert direct.stats().failures == {NOT_FOUND: 1, codec.WRONG_DTYPE: 1}
    with pytest.raises(ValueError):  # a caller bug, refused before any I/O
        direct.get_into(REFS[0], torch.empty(SHAPE[::-1]).permute(4, 3, 2, 1, 0))


def _clients(c: redis.Redis) -> int:
    return len(c.client_list())


def test_parallel_readers_read_what_one_reader_reads_on_several_connections(redis_url: str, redis_server: Any) -> None:
    """A restore of 40 blocks on 4 connections at once (runs of 10) loads exactly what one
    connection loads, leading blocks in order."""
    one = make_tier(redis_url, read_connections=1)
    # timeouts past the pause below (a read waiting it out is not a hung Redis here)
    four = make_tier(redis_url, read_connections=4, min_blocks_per_reader=4, read_timeout_s=5.0, socket_timeout_s=5.0)
    one.put_many(REFS[:40], [value(i) for i in range(40)])
    a, b = torch.full((40, *SHAPE), 7.0), torch.full((40, *SHAPE), 8.0)
    with redis_server.client() as c:
        before = _clients(c)
        # Redis holds every command for half a second: each run's first GET waits on its own
        # connection, so the four runs are in flight at once whatever the host's load
        # (without it a loaded host could finish one run before the next reader started
        # and reuse its connection)
        c.client_pause(500)
        assert four.get_many_into(REFS[:40], list(b)) == 40
        assert _clients(c) - before >= 4  # its read connections stay pooled
    assert one.get_many_into(REFS[:40], list(a)) == 40
    assert torch.equal(a, b) and all(torch.equal(b[i], value(i)) for i in range(40))
    assert four.stats().hits == 40 and four.stats().misses == 0
    assert four._runs(40) == [(0, 10), (10, 20), (20, 30), (30, 40)] and four._runs(7) == [(0, 7)]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "parsed"])
def test_parallel_readers_stop_at_the_first_bad_block_whichever_reader_has_it(
    redis_url: str, redis_server: Any, direct: bool
) -> None:
    """Only the leading good blocks count: a bad block in the third run ends the read
    there (the fourth run's good blocks do not count), one in the first run ends it
    earlier whatever the later runs found; the bad value is deleted; a missing block is
    a miss; the connections stay in step for the next reads."""
    tier = make_tier(redis_url, read_connections=4, min_blocks_per_reader=4, direct_reads=direct)
    tier.put_many(REFS[:40], [value(i) for i in range(40)])
    outs = [torch.empty(SHAPE) for _ in range(40)]
    with redis_server.client() as c:
        _corrupt(c, tier.key(REFS[25]), "flip")
        assert tier.get_many_into(REFS[:40], outs) == 25
        assert tier.stats().failures == {codec.BAD_CHECKSUM: 1} and not c.exists(tier.key(REFS[25]))
        _corrupt(c, tier.key(REFS[5]), "truncate")
        _corrupt(c, tier.key(REFS[33]), "garbage")
        assert tier.get_many_into(REFS[:40], outs) == 5
        assert tier.stats().failures == {codec.BAD_CHECKSUM: 1, codec.TRUNCATED: 1}
    assert tier.get_many_into(REFS[:40], outs) == 5  # block 5 was deleted: now a plain miss
    tier.put_many(REFS[:40], [value(i) for i in range(40)])  # the deleted ones stored again
    with redis_server.client() as c:
        c.delete(tier.key(REFS[33]))
        assert tier.get_many_into(REFS[:40], outs) == 33
    for _ in range(3):  # every connection in step
        assert tier.get_many_into(REFS[:33], outs) == 33
        assert all(torch.equal(outs[i], value(i)) for i in range(33))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "parsed"])
@pytest.mark.parametrize("fmt", ["int8", "fp8", "bf16"])
def test_stored_form_reads_give_the_verified_compact_bytes(redis_url: str, redis_server: Any, fmt: str,
                                                           direct: bool) -> None:
    """``get_many_stored_into`` (a GPU restore's load into pinned staging) gives each
    value's stored form, verified, not decoded; decoding it (``expand_into``) gives the
    bits ``get_many_into`` gives; direct and parsed reads of a lossy format agree; a bad
    value is a miss with its reason."""
    sdt = codec.STORAGE_FORMATS[fmt]
    tier = make_tier(redis_url, storage_dtype=sdt, direct_reads=direct, read_connections=2, min_blocks_per_reader=4,
                     key_prefix=f"sf-{direct}:")
    tier.put_many(REFS[:12], [value(i) * 3 for i in range(12)])
    n = codec.stored_nbytes(SHAPE, torch.float32, sdt)
    assert tier.stored_nbytes == n
    stored = torch.full((12, n), 7, dtype=torch.uint8)
    assert tier.get_many_stored_into(REFS[:12], list(stored)) == 12
    with redis_server.client() as c:
        for i in (0, 11):
            want = torch.empty(n, dtype=torch.uint8)
            raw = c.get(tier.key(REFS[i]))
            assert codec.decode_stored_into(raw, NS, REFS[i].block_hash, want.numpy(), SHAPE, torch.float32, sdt).ok
            assert torch.equal(stored[i], want)
    decoded = torch.empty(12, *SHAPE)
    codec.expand_into(stored, decoded, sdt)
    blocks = torch.full((12, *SHAPE), 9.0)
    assert tier.get_many_into(REFS[:12], list(blocks)) == 12
    assert torch.equal(decoded, blocks)
    parsed = make_tier(redis_url, storage_dtype=sdt, direct_reads=False, key_prefix=f"sf-{direct}:")
    other = torch.empty(12, *SHAPE)
    assert parsed.get_many_into(REFS[:12], list(other)) == 12 and torch.equal(other, blocks)
    with redis_server.client() as c:
        _corrupt(c, tier.key(REFS[6]), "flip")
    assert tier.get_many_stored_into(REFS[:12], list(stored)) == 6
    assert tier.stats().failures == {codec.BAD_CHECKSUM: 1}
    with pytest.raises(ValueError):  # a destination of another size: a caller bug
        tier.get_many_stored_into(REFS[:1], [torch.empty(n + 1, dtype=torch.uint8)])


def test_value_from_other_weights_is_a_miss(redis_url: str, redis_server: Any) -> None:
    tier = make_tier(redis_url)
    # Other weights hash the same tokens to other keys: a plain miss...
    other = [BlockRef(NS_OTHER, h) for h in block_hashes(NS_OTHER, list(range(8)), 4)]
    tier.put_many(other, [value(0), value(1)])
    assert tier.get_many_into(REFS[:2], [torch.empty(SHAPE)] * 2) == 0
    # ...and a foreign value planted under our key is refused by its header.
    with redis_server.client() as c:
        c.set(tier.key(REFS[0]), codec.encode(NS_OTHER, REFS[0].block_hash, value(0)))
        c.set(tier.key(REFS[1]), codec.encode(NS, REFS[2].block_hash, value(1)))
    assert tier.get(REFS[0]) is None
    assert tier.get(REFS[1]) is None
    assert tier.stats().failures == {NOT_FOUND: 1, codec.WRONG_NAMESPACE: 1, codec.WRONG_HASH: 1}


def test_value_of_another_shape_is_a_miss(redis_url: str) -> None:
    deeper = make_tier(redis_url, block_shape=(3, 2, 4, 2, 8))
    deeper.put(REFS[0], value(0, (3, 2, 4, 2, 8)))
    reader = make_tier(redis_url)
    assert reader.get(REFS[0]) is None
    make_tier(redis_url, block_shape=(2, 2, 4, 2, 4)).put(REFS[1], value(1, (2, 2, 4, 2, 4)))
    assert reader.get(REFS[1]) is None
    make_tier(redis_url).put(REFS[2], value(2))
    assert make_tier(redis_url, dtype=torch.bfloat16).get(REFS[2]) is None
    assert reader.stats().failures == {codec.WRONG_LAYERS: 1, codec.WRONG_SHAPE: 1}


def test_maxmemory_eviction_is_a_clean_miss(make_redis_server: Callable[..., Any]) -> None:
    server = make_redis_server(maxmemory="4mb", maxmemory_policy="allkeys-lru")
    shape = (4, 2, 16, 4, 32)  # 256 KiB per block
    tier = make_tier(server.url, block_shape=shape)
    n = 40  # 10 MiB into a 4 MiB Redis
    for i in range(n):
        tier.put(REFS[i], value(i, shape))
    held = tier.contains_many(REFS[:n])
    assert not all(held) and any(held)
    # Redis' LRU is approximate, and the output buffers of a pipelined read count
    # toward maxmemory (so reading can evict more). Whichever keys went: a restore stops
    # at the first missing block, each miss is clean, each survivor intact.
    outs = [torch.empty(shape) for _ in range(n)]
    good = tier.get_many_into(REFS[:n], outs)
    assert good <= held.index(False)
    assert all(torch.equal(outs[i], value(i, shape)) for i in range(good))
    survivors = 0
    for i in reversed(range(n)):  # newest first: the most likely survivors
        got = tier.get(REFS[i])
        assert got is None or torch.equal(got, value(i, shape))
        survivors += got is not None
    assert survivors > 0
    s = tier.stats()
    assert s.errors == 0 and set(s.failures) == {NOT_FOUND}


def test_full_redis_without_eviction_refuses_writes_cleanly(make_redis_server: Callable[..., Any]) -> None:
    server = make_redis_server(maxmemory="4mb", maxmemory_policy="noeviction")
    shape = (4, 2, 16, 4, 32)
    tier = make_tier(server.url, block_shape=shape)
    held = tier.put_many(REFS[:40], [value(i, shape) for i in range(40)])
    assert any(held) and not all(held)  # OOM answers are per-command, not exceptions
    assert tier.stats().failures.get(BACKEND_ERROR, 0) >= 1
    assert tier.stats().breaker_state == CLOSED


# ---- failures: a stopped Redis, timeouts, nothing listening ------------------------------


def test_breaker_opens_when_redis_stops_and_closes_after_restart(redis_url: str, redis_server: Any) -> None:
    clock = FakeClock()
    tier = make_tier(redis_url, breaker_failures=2, breaker_reset_s=5.0, clock=clock, socket_timeout_s=1.0)
    tier.put_many(REFS[:3], [value(i) for i in range(3)])
    out = torch.empty(SHAPE)
    redis_server.stop()
    try:
        # Every kind of call answers a miss / False, never raises.
        assert tier.get(REFS[0]) is None
        assert not tier.get_into(REFS[0], out)
        assert tier.breaker_state == OPEN
        assert tier.contains_many(REFS[:3]) == [False] * 3
        assert tier.put_many(REFS[3:5], [value(3), value(4)]) == [False, False]
        assert tier.get_many_into(REFS[:3], [out] * 3) == 0
        assert tier.delete_many(REFS[:2]) == [False, False]
        assert not tier.ping()
        s = tier.stats()
        assert s.errors == 2 and s.failures[BACKEND_ERROR] == 2
        assert s.failures[BREAKER_OPEN] == 5  # refused without touching the network
        assert s.breaker_state == OPEN and s.breaker_opens == 1
        clock.t += 5.0  # still down: the probe fails and the breaker opens again
        assert tier.get(REFS[0]) is None
        assert tier.stats().breaker_opens == 2
    finally:
        redis_server.start()
    assert tier.get(REFS[0]) is None  # open until the timer runs out
    clock.t += 5.0
    assert tier.put(REFS[0], value(0))  # the probe succeeds: closed again
    assert tier.breaker_state == CLOSED
    assert tier.get_into(REFS[0], out) and torch.equal(out, value(0))  # a fresh server: re-put


def test_nothing_listening_at_construction(redis_server: Any) -> None:
    from tests.fixtures.redis_server import free_port

    tier = make_tier(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout_s=0.5)
    assert tier.get(REFS[0]) is None
    assert not tier.put(REFS[0], value(0))
    assert tier.contains_many(REFS[:2]) == [False, False]
    assert tier.stats().errors >= 1


def test_read_timeout_is_a_miss(redis_url: str, redis_server: Any) -> None:
    tier = make_tier(redis_url, socket_timeout_s=0.1, breaker_failures=5)
    tier.put(REFS[0], value(0))
    with redis_server.client() as admin:
        admin.execute_command("CLIENT", "PAUSE", "500", "ALL")  # answers nothing for 0.5 s
        assert tier.get(REFS[0]) is None
        admin.ping()  # returns once the pause is over
    s = tier.stats()
    assert s.failures.get(TIMEOUT) == 1 and s.errors == 1
    out = torch.empty(SHAPE)
    assert tier.get_into(REFS[0], out) and torch.equal(out, value(0))  # and it recovers


# ---- URLs: password, TLS, cluster --------------------------------------------------------


def test_password_url(make_redis_server: Callable[..., Any]) -> None:
    server = make_redis_server(password="s3cret")
    tier = make_tier(server.url)
    assert "s3cret@" in server.url
    assert tier.put(REFS[0], value(0)) and tier.get(REFS[0]) is not None
    wrong = make_tier(server.url.replace("s3cret", "wrong"))
    assert wrong.get(REFS[0]) is None
    assert wrong.stats().errors == 1


def test_tls_url(make_redis_server: Callable[..., Any]) -> None:
    server = make_redis_server(tls=True)
    assert server.url.startswith("rediss://")
    tier = make_tier(server.url, ssl_ca_certs=str(server.tls.ca_cert))
    assert tier.put(REFS[0], value(0))
    out = torch.empty(SHAPE)
    assert tier.get_into(REFS[0], out) and torch.equal(out, value(0))
    untrusted = make_tier(server.url)  # the system CAs do not know this server
    assert untrusted.get(REFS[0]) is None and untrusted.stats().errors == 1


def test_cluster(make_redis_cluster: Callable[..., Any]) -> None:
    cluster = make_redis_cluster(masters=3)
    per_value = codec.encoded_size(SHAPE, torch.float32)
    tier = make_tier(cluster.url, cluster=True, max_batch_bytes=8 * per_value)
    n = 24
    assert tier.put_many(REFS[:n], [value(i) for i in range(n)]) == [True] * n
    keys_per_node = []
    for node in cluster.nodes:
        with node.client() as c:
            keys_per_node.append(c.dbsize())
    assert sum(keys_per_node) == n and sum(k > 0 for k in keys_per_node) >= 2  # across slots
    assert tier.contains_many(REFS[: n + 1]) == [True] * n + [False]
    outs = [torch.empty(SHAPE) for _ in range(n)]
    assert tier.get_many_into(REFS[:n], outs) == n
    assert all(torch.equal(outs[i], value(i)) for i in range(n))
    assert tier.put_many(REFS[:n], [value(i) for i in range(n)]) == [True] * n
    assert tier.stats().put_skips == n
    assert tier.delete_many(REFS[:n]) == [True] * n
    assert tier.contains_many(REFS[:n]) == [False] * n
