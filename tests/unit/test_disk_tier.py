"""Disk tier on a real directory: round trips, the file format, corrupted / truncated /
swapped / foreign files as misses (removed), crash leftovers, LRU by size across a
restart, demotion on eviction, the one-process lock (in this process and another), and
the tier inside the tiered store (order host -> disk -> redis, drain target, rates)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from kvserve.cachestore import codec
from kvserve.cachestore.base import NOT_FOUND, BlockRef
from kvserve.cachestore.disk import DiskTier
from kvserve.cachestore.host import HostTier
from kvserve.cachestore.keys import block_hashes, make_namespace
from kvserve.cachestore.tiered import DEFAULT_RESTORE_RATES, TieredStore
from kvserve.common.dirlock import DiskCacheLocked
from kvserve.common.tiers import Tier
from tests.fixtures.dir_events import DirEvents

SHAPE = (2, 2, 4, 2, 8)  # (L, 2, B, n_kv, hd)
NS = make_namespace("weights-a", "float32", 4)
NS_OTHER = make_namespace("weights-b", "float32", 4)
REFS = [BlockRef(NS, h) for h in block_hashes(NS, list(range(4 * 40)), 4)]
FILE = codec.encoded_size(SHAPE, torch.float32)


def value(i: int, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype)


def make_tier(root: Path, blocks: int = 100, **kw: Any) -> DiskTier:
    return DiskTier(root, blocks * FILE, SHAPE, torch.float32, **kw)


@pytest.fixture
def tier(tmp_path: Path):
    t = make_tier(tmp_path / "kv")
    yield t
    t.close()


def test_round_trip_and_file_is_the_codec_value(tier: DiskTier) -> None:
    assert tier.put_many(REFS[:3], [value(i) for i in range(3)]) == [True] * 3
    raw = tier.path(REFS[1]).read_bytes()
    assert raw == codec.encode(NS, REFS[1].block_hash, value(1))  # the bytes Redis stores
    out = torch.full(SHAPE, 7.0)
    assert tier.get_into(REFS[1], out) and torch.equal(out, value(1))
    outs = [torch.empty(SHAPE) for _ in range(3)]
    assert tier.get_many_into(REFS[:3], outs) == 3
    assert all(torch.equal(outs[i], value(i)) for i in range(3))
    assert tier.contains_many(REFS[:4]) == [True, True, True, False]
    s = tier.stats()
    assert (s.hits, s.puts, s.blocks_held, s.bytes_held) == (4, 3, 3, 3 * FILE)
    assert tier.put(REFS[0], value(0)) and tier.stats().put_skips == 1  # idempotent
    assert tier.delete(REFS[0]) and not tier.path(REFS[0]).exists() and not tier.delete(REFS[0])


def test_miss_is_a_counted_none(tier: DiskTier) -> None:
    assert tier.get(REFS[0]) is None
    assert tier.get_many_into(REFS[:2], [torch.empty(SHAPE)] * 2) == 0
    s = tier.stats()
    assert s.misses == 2 and s.failures == {NOT_FOUND: 2} and s.errors == 0


def test_a_file_removed_behind_its_back_is_a_miss(tier: DiskTier) -> None:
    tier.put_many(REFS[:2], [value(0), value(1)])
    tier.path(REFS[1]).unlink()
    assert tier.get_many_into(REFS[:2], [torch.empty(SHAPE) for _ in range(2)]) == 1
    assert not tier.contains(REFS[1]) and tier.stats().failures == {NOT_FOUND: 1}


# ---- verification: every kind of bad file is a miss, never wrong KV, and is removed ----


def _flip(raw: bytearray, at: int) -> bytes:
    raw[at] ^= 0x10
    return bytes(raw)


CORRUPTIONS: dict[str, tuple[Callable[[bytearray], bytes], str | None]] = {
    # name: (the file's new bytes from its old ones, the reason counted; None: a valid value)
    "flip_tensor": (lambda r: _flip(r, len(r) // 2), codec.BAD_CHECKSUM),
    "flip_header": (lambda r: _flip(r, 10), codec.BAD_CHECKSUM),
    "flip_safetensors_header": (lambda r: _flip(r, codec.HEADER_SIZE + 12), codec.BAD_CHECKSUM),
    "flip_checksum": (lambda r: _flip(r, len(r) - 1), codec.BAD_CHECKSUM),
    "flip_last_tensor_byte": (lambda r: _flip(r, len(r) - codec.CHECKSUM_SIZE - 1), codec.BAD_CHECKSUM),
    "truncate_tail": (lambda r: bytes(r[:-100]), codec.TRUNCATED),
    "truncate_to_header": (lambda r: bytes(r[: codec.HEADER_SIZE]), codec.TRUNCATED),
    "truncate_mid_header": (lambda r: bytes(r[:5]), codec.TRUNCATED),
    "empty": (lambda r: b"", codec.TRUNCATED),
    "trailing_bytes": (lambda r: bytes(r) + b"\0" * 8, codec.BAD_LENGTH),
    "garbage": (lambda r: b"hello world" * 10, codec.BAD_MAGIC),
    "bad_version": (lambda r: bytes(r[:4]) + b"\x09\x00" + bytes(r[6:]), codec.BAD_VERSION),
    "swapped": (lambda r: codec.encode(NS, REFS[3].block_hash, value(3)), codec.WRONG_HASH),
    "other_namespace": (lambda r: codec.encode(NS_OTHER, REFS[2].block_hash, value(2)), codec.WRONG_NAMESPACE),
    "other_shape": (lambda r: codec.encode(NS, REFS[2].block_hash, value(2, (2, 2, 4, 2, 4))), codec.WRONG_SHAPE),
    "other_dtype": (lambda r: codec.encode(NS, REFS[2].block_hash, value(2, dtype=torch.float16)), codec.WRONG_DTYPE),
    "lossy_storage": (
        lambda r: codec.encode(NS, REFS[2].block_hash, value(2), storage_dtype=torch.bfloat16),
        codec.WRONG_STORAGE,
    ),
    "huge": (lambda r: bytes(r) * 4, codec.BAD_LENGTH),  # not read whole
    "compressed": (lambda r: codec.encode(NS, REFS[2].block_hash, value(2), compression="lz4"), None),
}


@pytest.mark.parametrize("how", sorted(CORRUPTIONS))
def test_bad_file_is_a_miss_and_is_removed(tier: DiskTier, how: str) -> None:
    mutate, reason = CORRUPTIONS[how]
    tier.put_many(REFS[:6], [value(i) for i in range(6)])
    path = tier.path(REFS[2])
    path.write_bytes(mutate(bytearray(path.read_bytes())))
    outs = [torch.empty(SHAPE) for _ in range(6)]
    good = tier.get_many_into(REFS[:6], outs)
    assert all(torch.equal(outs[i], value(i)) for i in range(good))  # never wrong KV
    if reason is None:
        assert good == 6
        return
    assert good == 2  # stops at the bad block
    assert not path.exists() and not tier.contains(REFS[2])  # removed: the next write replaces it
    assert tier.get(REFS[2]) is None
    assert tier.get_many_into(REFS[3:6], outs[:3]) == 3  # the others are fine
    assert all(torch.equal(outs[i], value(3 + i)) for i in range(3))
    s = tier.stats()
    assert s.failures == {reason: 1, NOT_FOUND: 1} and s.errors == 0
    assert tier.put(REFS[2], value(2)) and tier.get_into(REFS[2], outs[0]) and torch.equal(outs[0], value(2))


@pytest.mark.parametrize("how", ["flip_tensor", "truncate_tail", "swapped"])
def test_bad_file_found_at_startup_is_a_miss_too(tmp_path: Path, how: str) -> None:
    """Corrupted while the server was down: the restarted tier indexes it (same size)
    or drops it (other size), and a read never returns it."""
    t = make_tier(tmp_path)
    t.put_many(REFS[:3], [value(i) for i in range(3)])
    t.close()
    path = t.path(REFS[1])
    path.write_bytes(CORRUPTIONS[how][0](bytearray(path.read_bytes())))
    t2 = make_tier(tmp_path)
    outs = [torch.empty(SHAPE) for _ in range(3)]
    assert t2.get_many_into(REFS[:3], outs) == 1 and torch.equal(outs[0], value(0))
    assert not path.exists()
    t2.close()


def test_a_cuda_like_destination_takes_the_decoding_path(tier: DiskTier) -> None:
    """A destination the direct read cannot fill (here: another dtype view is refused;
    a non-CPU one decodes whole) still gets verified KV: exercised with a bf16 block
    file read into a bf16 tier by the codec path."""
    t = DiskTier(tier.root.parent / "bf16", 10 * codec.encoded_size(SHAPE, torch.bfloat16), SHAPE, torch.bfloat16)
    v = value(4, dtype=torch.bfloat16)
    assert t.put(REFS[4], v)
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    assert t.get_into(REFS[4], out) and torch.equal(out, v)
    t.close()


# ---- crash safety, restart, LRU by size ------------------------------------------------


def test_restart_finds_the_blocks_and_removes_crash_leftovers(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    t.put_many(REFS[:4], [value(i) for i in range(4)])
    t.close()
    (tmp_path / "tmp" / "deadbeef.123.1.tmp").write_bytes(b"half a write")  # killed mid-write
    stray = t.path(REFS[0]).parent / ("ab" * 32 + ".kvb")
    stray.write_bytes(b"torn")  # a file of the wrong size: a power loss without fsync
    (t.path(REFS[0]).parent / "notes.txt").write_text("not ours")
    t2 = make_tier(tmp_path)
    assert len(t2) == 4 and t2.contains_many(REFS[:5]) == [True] * 4 + [False]
    assert list((tmp_path / "tmp").iterdir()) == [] and not stray.exists()
    outs = [torch.empty(SHAPE) for _ in range(4)]
    assert t2.get_many_into(REFS[:4], outs) == 4 and all(torch.equal(outs[i], value(i)) for i in range(4))
    t2.close()


def test_lru_by_size_and_the_order_survives_a_restart(tmp_path: Path) -> None:
    t = make_tier(tmp_path, blocks=4)
    evicted: list[BlockRef] = []
    t.set_on_evict(lambda ref, block: evicted.append(ref) or None)
    for i in range(4):
        t.put(REFS[i], value(i))
        os.utime(t.path(REFS[i]), (1000 + i, 1000 + i))  # distinct mtimes
    assert t.get(REFS[0]) is not None  # 0 is now the most recent (mtime refreshed)
    t.put(REFS[4], value(4))  # evicts 1, the least recently used
    assert evicted == [REFS[1]] and not t.path(REFS[1]).exists()
    s = t.stats()
    assert s.blocks_held == 4 and s.bytes_held == 4 * FILE <= t.capacity_bytes and s.evictions == 1
    t.close()
    t2 = make_tier(tmp_path, blocks=3)  # smaller now: the oldest by mtime (2) is dropped
    assert t2.contains_many([REFS[i] for i in (0, 2, 3, 4)]) == [True, False, True, True]
    assert t2.stats().bytes_held == 3 * FILE
    t2.close()


def _dir_bytes(root: Path) -> int:
    """Bytes of the block files and temporaries under a tier's directory: one subdirectory
    after another, so a moment's only while nothing writes there (``DirEvents`` otherwise)."""
    total = 0
    for sub in ("blocks", "tmp"):
        for dirpath, _dirs, files in os.walk(root / sub):
            for name in files:
                try:
                    total += os.stat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:  # removed while walking
                    pass
    return total


def test_the_size_bound_holds_before_a_write_lands(tmp_path: Path) -> None:
    """--disk-cache-size is never exceeded, not even for a moment: a write evicts what it
    displaces before its file is written (measured in the directory at every eviction,
    when the displaced file is still there), and with four writers at once the directory
    never holds more than the capacity at any moment of its history (every file created,
    renamed or removed under it, in the kernel's order: ``DirEvents``; a temporary counted
    at its full size from its creation); writes that find the capacity all taken by writes
    in flight are refused, not overrun. (A walk of the directory during the writes is no
    measure of a moment: it reads one subdirectory after another and counted evicted
    files beside the files that replaced them, up to twice the capacity.)"""
    import threading

    t = make_tier(tmp_path, blocks=3)
    seen: list[int] = []
    t.set_on_evict(lambda ref, block: seen.append(_dir_bytes(tmp_path)))
    for i in range(6):
        assert t.put(REFS[i], value(i))
        seen.append(_dir_bytes(tmp_path))
    assert t.stats().evictions == 3 and max(seen) <= t.capacity_bytes == 3 * FILE, seen

    demoted: list[BlockRef] = []
    t.set_on_evict(lambda ref, block: demoted.append(ref))
    subdirs = sorted({t.path(ref).parent for ref in REFS})
    for d in subdirs:  # every block file's directory there (and watched) before the writes
        d.mkdir(exist_ok=True)
    results: list[bool] = []

    def write(k: int) -> None:
        results.extend(t.put(REFS[i], value(i)) for i in range(6 + k, 38, 4))

    with DirEvents([tmp_path / "tmp", *subdirs]) as events:
        assert events.counts() == [3]
        writers = [threading.Thread(target=write, args=(k,)) for k in range(4)]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        held = events.counts()
    s = t.stats()
    assert len(results) == 32 and sum(results) >= 8 and s.blocks_held <= 3 and s.bytes_held <= t.capacity_bytes
    assert len(demoted) == s.evictions - 3 > 0
    assert max(held) * FILE <= t.capacity_bytes, held
    # the record is whole: a temporary created, moved out and moved in per write, a removal
    # per eviction, and it ends where the directory is
    assert len(held) == 1 + 3 * sum(results) + len(demoted) and held[-1] * FILE == _dir_bytes(tmp_path) == s.bytes_held
    t.close()


@pytest.mark.parametrize("how", ["delete", "clear"])
def test_a_removed_file_keeps_its_room_until_it_is_gone(tmp_path: Path, how: str) -> None:
    """A block deleted (``delete``; every block: ``clear``) leaves the index before its
    file is unlinked; until the unlink its bytes stay reserved, so a write meanwhile
    evicts another file (delete) or is refused (clear: the capacity all on its way out)
    rather than landing beside it. The removing thread is held at the unlink by a trace
    function (as a debugger's breakpoint) while the write runs; nothing else moves, so a
    walk of the directory then is a moment."""
    import threading

    from kvserve.cachestore import disk

    t = make_tier(tmp_path, blocks=3)
    for i in range(3):
        assert t.put(REFS[i], value(i))
    at_unlink, go = threading.Event(), threading.Event()

    def hold(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is disk._unlink.__code__:
            at_unlink.set()
            go.wait(60)

    def remove() -> None:
        sys.settrace(hold)
        try:
            t.delete(REFS[0]) if how == "delete" else t.clear()
        finally:
            sys.settrace(None)

    remover = threading.Thread(target=remove)
    remover.start()
    try:
        assert at_unlink.wait(60), "the removal never reached its unlink"
        assert t.path(REFS[0]).exists() and not t.contains(REFS[0])  # out of the index, the file still there
        wrote = t.put(REFS[3], value(3))
        assert _dir_bytes(tmp_path) <= t.capacity_bytes
    finally:
        go.set()
        remover.join()
    s = t.stats()
    if how == "delete":
        assert wrote and t.contains_many(REFS[:4]) == [False, False, True, True] and s.evictions == 1
    else:
        assert not wrote and len(t) == 0 and t.put(REFS[3], value(3)) and s.evictions == 0
    assert _dir_bytes(tmp_path) == t.stats().bytes_held <= t.capacity_bytes
    t.close()


def test_a_block_written_again_while_its_eviction_runs_is_not_lost(tmp_path: Path) -> None:
    """Block 0 is evicted (its copy handed to ``on_evict``, its file removed after); a
    write of block 0 from another thread while that runs is refused (False: not held),
    as its file would go with the old one's removal and the index would hold a block with
    no file; once the eviction is done the block is written again and read back."""
    import threading

    t = make_tier(tmp_path, blocks=2)
    for i in range(2):
        assert t.put(REFS[i], value(i))
    again: list[bool] = []

    def on_evict(ref: BlockRef, block: torch.Tensor) -> None:
        if ref == REFS[0] and not again:  # (the write's own eviction, of block 1, passes through)
            writer = threading.Thread(target=lambda: again.append(t.put(REFS[0], value(0))))
            writer.start()
            writer.join()

    t.set_on_evict(on_evict)
    assert t.put(REFS[2], value(2))  # evicts 0
    assert again == [False] and not t.contains(REFS[0]) and not t.path(REFS[0]).exists()
    assert t.contains_many(REFS[1:3]) == [True, True] and t.stats().evictions == 1
    t.set_on_evict(None)
    out = torch.empty(SHAPE)
    assert t.put(REFS[0], value(0)) and t.get_into(REFS[0], out) and torch.equal(out, value(0))
    assert _dir_bytes(tmp_path) == t.stats().bytes_held <= t.capacity_bytes
    t.close()


def test_eviction_hands_a_verified_copy_on(tmp_path: Path) -> None:
    t = make_tier(tmp_path, blocks=2)
    got: list[tuple[BlockRef, torch.Tensor]] = []
    t.set_on_evict(lambda ref, block: got.append((ref, block.clone())))
    for i in range(3):
        t.put(REFS[i], value(i))
    assert [r for r, _ in got] == [REFS[0]] and got[0][0].namespace == NS and torch.equal(got[0][1], value(0))
    t.close()


def test_write_failure_is_false_not_raised(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    (tmp_path / "tmp").rmdir()
    (tmp_path / "tmp").write_text("a file where the tmp dir was")
    assert t.put(REFS[0], value(0)) is False
    s = t.stats()
    assert s.errors == 1 and s.blocks_held == 0 and not t.contains(REFS[0])
    t.close()


def test_zero_size_holds_nothing(tmp_path: Path) -> None:
    t = DiskTier(tmp_path, 0, SHAPE, torch.float32)
    assert t.put(REFS[0], value(0)) is False and not t.contains(REFS[0])
    t.close()


def test_fsync_policy_writes_the_same_file(tmp_path: Path) -> None:
    t = make_tier(tmp_path, fsync=True)
    assert t.put(REFS[0], value(0))
    assert t.path(REFS[0]).read_bytes() == codec.encode(NS, REFS[0].block_hash, value(0))
    t.close()


# ---- one process per directory ---------------------------------------------------------


def test_a_second_tier_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    t = make_tier(tmp_path)
    with pytest.raises(DiskCacheLocked, match=f"pid {os.getpid()}"):
        make_tier(tmp_path)
    t.close()
    make_tier(tmp_path).close()  # released on close


def test_another_process_is_refused_and_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    code = (
        "import sys, torch\n"
        "from kvserve.cachestore.disk import DiskTier\nfrom kvserve.common.dirlock import DiskCacheLocked\n"
        f"try:\n    DiskTier({str(tmp_path)!r}, 1 << 20, {SHAPE!r}, torch.float32)\n"
        "except DiskCacheLocked as e:\n    print(e); sys.exit(3)\n"
        "print('locked'); sys.stdout.flush(); sys.stdin.read()\n"
    )
    run = lambda: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])  # noqa: E731
    t = make_tier(tmp_path)
    r = run()
    assert r.returncode == 3 and "in use by another kvserve process" in r.stdout, r.stderr
    t.close()
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(DiskCacheLocked, match=f"pid {holder.pid}"):
            make_tier(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    make_tier(tmp_path).close()  # a killed holder's lock is gone


# ---- inside the tiered store -----------------------------------------------------------


def test_store_orders_host_disk_and_demotes_down_the_list(tmp_path: Path) -> None:
    host = HostTier(2 * math.prod(SHAPE) * 4, SHAPE, torch.float32)  # 2 blocks
    disk = make_tier(tmp_path)
    store = TieredStore([host, disk])
    assert store.tiers == (Tier.HOST, Tier.DISK)
    assert store.shared_tier == Tier.DISK  # no Redis: the drain writes to disk
    hashes = [r.block_hash for r in REFS[:5]]
    for i, h in enumerate(hashes):
        store.demote(NS, h, value(i))  # host evicts 0, 1, 2 -> disk, through the writer
    assert store.flush(10)
    assert store.match_prefix(NS, hashes) == [Tier.DISK] * 3 + [Tier.HOST] * 2
    outs = [torch.empty(SHAPE) for _ in range(5)]
    assert store.fetch_into(NS, hashes, store.match_prefix(NS, hashes), outs) == 5
    assert all(torch.equal(outs[i], value(i)) for i in range(5))
    assert store.restore_rate(Tier.DISK) == DEFAULT_RESTORE_RATES[Tier.DISK]
    assert store.estimated_restore_seconds(Tier.DISK, 4) > store.estimated_restore_seconds(Tier.HOST, 4)
    # a spill of blocks no longer on the device: copied out of the host to the disk
    done: list[Any] = []
    assert store.submit_spill([(NS, h, None) for h in hashes], [Tier.DISK], on_done=done.append)
    assert store.flush(10) and done[0].held == {Tier.DISK: 5}
    store.close()


def test_drain_from_disk_to_redis(tmp_path: Path, redis_url: str) -> None:
    from kvserve.cachestore.redis import RedisTier

    disk = make_tier(tmp_path)
    redis_tier = RedisTier(redis_url, block_shape=SHAPE, dtype=torch.float32, key_prefix=f"disk{time.time_ns()}:")
    store = TieredStore([disk, redis_tier])
    assert store.shared_tier == Tier.REDIS  # Redis, when there is one
    hashes = [r.block_hash for r in REFS[:3]]
    store.put_many(NS, hashes, [value(i) for i in range(3)], [Tier.DISK])
    done: list[Any] = []
    assert store.submit_spill([(NS, h, None) for h in hashes], [Tier.REDIS], on_done=done.append)
    assert store.flush(10) and done[0].held == {Tier.REDIS: 3}  # copied out of the disk files
    assert disk.stats().hits == 0  # a copy out is not a restore
    out = torch.empty(SHAPE)
    assert redis_tier.get_into(REFS[1], out) and torch.equal(out, value(1))
    store.close()
