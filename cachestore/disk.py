"""Disk tier: one checksummed block file per block under a directory, LRU by bytes.

Layout under ``root`` (``--disk-cache-dir``)::

    LOCK                          held with an exclusive flock while a tier uses the dir
    retained.log                  the retention journal: one record per pin (below)
    blocks/<h[:2]>/<h>.kvb        one file per block: exactly ``codec.encode`` of the block
                                  (header, safetensors payload, xxh3_128 checksum), the
                                  same verified bytes the Redis tier stores
    tmp/                          writes in flight (emptied at startup)

A file is named by the block hash alone (hex): the namespace is inside the hash chain
and inside the file's header, so a file is only ever decoded as the block it was
written for. Every read verifies: a missing, truncated, corrupted, swapped (another
block's file under this name) or foreign (other weights, shape, dtype, storage) file is
a miss with a counted reason (``codec.REASONS``), and a file that failed verification is
removed, so the next write of that block stores a good one. Never wrong KV.

Reads land in the destination: for a contiguous CPU destination the file's prefix is
compared with ``codec.plain_prefix`` and the tensor bytes are read straight into the
destination block (``readinto``), then the checksum is recomputed over prefix and
destination, as ``RedisTier``'s direct reads do; anything unexpected (another size or
prefix) is read whole and handed to ``codec.decode_into`` for its reason.

Crash safety: a write goes to ``tmp/`` and is renamed into place (``os.replace``, atomic
on POSIX), so a reader never sees a half-written file at a block's name, and a crash
mid-write leaves only a temporary, removed at the next start. ``fsync`` (default off,
``--disk-cache-fsync``): off, a power loss (not a process crash: the page cache
survives those) may leave a renamed file whose data never reached the disk; it then
fails its checksum or size and is a miss, removed. On, each file is fsynced before its
rename and its directory after, so a block acknowledged as stored survives a power loss,
at the cost of a device flush per block.

Bounded by ``capacity_bytes`` (``--disk-cache-size``): an LRU index in memory (hits
refresh a file's mtime, so the order survives a restart: at start the index is rebuilt
from the files' mtimes, oldest first, and trimmed to the capacity). The bound holds at
every moment, not only between writes: a write first reserves its file's bytes (the
indexed files plus the writes in flight never exceed the capacity; a write that finds the
capacity all reserved by writes and removals in flight is refused), evicts the least
recently used files the reservation displaces, and only then writes its temporary and
renames it into place; a file removed otherwise (``delete``, ``clear``, a file that failed
verification) keeps its bytes reserved until it is unlinked, so no write takes its room
while it is still there. A block the tier evicts is read back, verified, and handed to
``on_evict`` (the tiered store demotes it to the next tier, Redis) before its file is
removed.

Retention (``cachestore.base``): a pinned file is never evicted (the LRU skips it; a
write that only pinned files' room could take is refused) and its pin outlives the
process: every pin is appended to ``retained.log`` as one record, ``crc32 (4 bytes) ||
block hash (32) || until (float64, unix seconds) || owner length (uint16) || owner
(UTF-8)``, little-endian, written with the block files' ``fsync`` setting. At start the
journal is read up to its first torn or corrupt record, its pins are honoured before the
index is trimmed to the capacity, pins of files that are gone are dropped, and it is
rewritten compacted (as it is again whenever it holds more than twice the live records);
``retained_entries`` gives the store the pins and their owners to rebuild its book.

One process per directory: the tier holds an exclusive ``flock`` on ``LOCK`` for its
life (released by the kernel when the process dies, however it dies); a second tier on
the same directory, in this process or another, raises ``DiskCacheLocked`` naming the
holder's pid. Sharing one directory between processes would need a shared LRU index
and shared byte accounting; one directory per server process is simpler and cannot
overrun its bound.

Thread safety: the index is under one lock; file reads and writes are outside it
(a file being read stays readable after an eviction unlinks it; a rename replaces a
name atomically). A block whose file is on its way out (evicted, deleted) is not written
again until the file is gone: the write is refused, as the removal would take its new
file with it.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch
import xxhash

from kvserve.common.dirlock import hold_dir_lock
from kvserve.common.tiers import Tier

from . import codec
from .base import BACKEND_ERROR, NOT_FOUND, BlockRef, BlockTier, LayeredRead, TierCounters, TierObserver, TierStats

log = logging.getLogger(__name__)

EvictCallback = Callable[[BlockRef, torch.Tensor], None]

SUFFIX = ".kvb"
_HASH_AT = 4 + 2 + 2 + 32  # offset of the block hash in the codec header (magic, version, size, namespace)
# A hit refreshes the file's mtime (the LRU order a restart rebuilds) when it is older
# than this: one syscall fewer per block for blocks restored again soon.
_TOUCH_AFTER_S = 60.0
_HEX_LEN = 64
JOURNAL = "retained.log"
_RECORD = struct.Struct("<32sdH")  # hash, until, owner length (after a crc32 of it and the owner)


class DiskTier(BlockTier):
    """KV blocks in files under a directory. See the module docstring and ``cachestore.base``."""

    name = Tier.DISK
    durable = True  # outlives the process (this machine only: not ``shared``)
    batch_blocks = 64
    retains = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        block_shape: Sequence[int],
        dtype: torch.dtype,
        *,
        fsync: bool = False,
        read_threads: int = 2,
        on_evict: EvictCallback | None = None,
    ) -> None:
        """Creates ``root`` if needed and takes its lock (``DiskCacheLocked`` if taken;
        ``OSError`` if it cannot be created or written). ``read_threads``: files one
        restore reads at once (1: one after another)."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._init_block(block_shape, dtype)
        self._torch_shape = torch.Size(self.block_shape)
        self.root = Path(root)
        self.fsync = fsync
        self.read_threads = max(1, read_threads)
        self._readers: ThreadPoolExecutor | None = None
        self.file_nbytes = codec.encoded_size(self.block_shape, dtype)
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // self.file_nbytes
        self._on_evict = on_evict
        self._counters = TierCounters(self.name)
        self._lock = threading.Lock()
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file bytes, oldest first
        self._bytes = 0  # of the files in the index
        self._reserved = 0  # of the writes in flight (their temporaries, then their files) and of the
        # files on their way out (dropped from the index, not yet unlinked: ``_forget(going=True)``)
        self._going: set[bytes] = set()  # blocks whose files are on their way out (evicted, deleted):
        # not written again until they are gone (the unlink would remove the new file)
        self._seq = 0
        self._pins: dict[bytes, float] = {}  # retained block hash (all held) -> latest until
        self._entries: dict[tuple[bytes, str], float] = {}  # (hash, owner) -> until: the journal's live records
        self._journal_records = 0  # records in the journal file (live or not)
        self._journal_lock = threading.Lock()  # appends and rewrites of the journal, in order
        self._expired = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = hold_dir_lock(self.root)
        self._blocks_dir = self.root / "blocks"
        self._blocks_str = str(self._blocks_dir)
        self._prefixes: dict[bytes, tuple[bytes, bytes]] = {}
        self._tmp_dir = self.root / "tmp"
        self._journal = self.root / JOURNAL
        self._blocks_dir.mkdir(exist_ok=True)
        self._tmp_dir.mkdir(exist_ok=True)
        self._load_journal()
        self._rebuild_index()
        for digest in [d for d in self._pins if d not in self._lru]:  # pinned files that are gone
            self._unpin(digest)
        if self._journal.exists():
            self._rewrite_journal()

    # ---- plumbing ------------------------------------------------------------------

    def path(self, ref: BlockRef) -> Path:
        """The file holding ``ref``."""
        return Path(self._file(ref.block_hash))

    def _file(self, digest: bytes) -> str:
        h = digest.hex()
        return f"{self._blocks_str}/{h[:2]}/{h}{SUFFIX}"

    def _prefix(self, ref: BlockRef) -> bytes:
        """``codec.plain_prefix`` of ``ref``: the bytes before its tensor bytes, from a
        per-namespace template (only the block hash differs between blocks)."""
        parts = self._prefixes.get(ref.namespace)
        if parts is None:
            full = codec.plain_prefix(ref.namespace, ref.block_hash, self.block_shape, self.dtype)
            parts = self._prefixes[ref.namespace] = (full[:_HASH_AT], full[_HASH_AT + 32 :])
            if len(self._prefixes) > 1024:
                self._prefixes.clear()
                self._prefixes[ref.namespace] = parts
        return parts[0] + ref.block_hash + parts[1]

    def set_on_evict(self, on_evict: EvictCallback | None) -> None:
        self._on_evict = on_evict

    def set_observer(self, observer: TierObserver | None) -> None:
        """Report the blocks held now (the index rebuilt at start: what survived a restart)
        to ``observer``, oldest first, then every change (``cachestore.base``)."""
        with self._lock:
            self._observer = observer
            self._stored(list(self._lru))

    def __len__(self) -> int:
        with self._lock:
            return len(self._lru)

    def _rebuild_index(self) -> None:
        """The LRU from the files there (oldest mtime first): leftover temporaries and
        files of another size (a torn write, another geometry) are removed; the oldest
        beyond the capacity are dropped."""
        for tmp in self._tmp_dir.iterdir():
            _unlink(tmp)
        found: list[tuple[float, bytes, int]] = []
        for sub in self._blocks_dir.iterdir():
            if not sub.is_dir():
                _unlink(sub)
                continue
            for entry in os.scandir(sub):
                name = entry.name
                digest = _parse_name(name)
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if digest is None or not entry.is_file(follow_symlinks=False) or st.st_size != self.file_nbytes:
                    _unlink(Path(entry.path))
                    continue
                found.append((st.st_mtime, digest, st.st_size))
        found.sort()
        # over the capacity: the oldest unpinned files go (a pinned one is kept, as it
        # would be while serving)
        drop = max(0, len(found) - self.capacity_blocks)
        kept = []
        for entry in found:
            if drop and entry[1] not in self._pins:
                _unlink(self._path_of(entry[1]))
                drop -= 1
            else:
                kept.append(entry)
        drop = len(found) - len(kept)
        for _, digest, size in kept:
            self._lru[digest] = size
            self._bytes += size
        if found:
            log.info("disk tier %s: %d block(s) found, %d dropped over the size", self.root, len(found), drop)

    def _path_of(self, digest: bytes) -> Path:
        h = digest.hex()
        return self._blocks_dir / h[:2] / (h + SUFFIX)

    # ---- reads ---------------------------------------------------------------------

    def get_many_into(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> int:
        """Load ``refs[i]`` into ``outs[i]`` in order, each verified; returns how many
        leading blocks are good, stopping at the first miss or bad file (which is
        removed). Several blocks are read at once by ``read_threads`` threads (a read
        releases the GIL), in windows, so a miss early on reads little past it."""
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        if not all(out.is_contiguous() for out in outs[: len(refs)]):
            raise ValueError("destinations must be contiguous")
        t0 = time.perf_counter()
        n = 0
        failure: str | None = None
        pool = self._pool() if len(refs) > 1 else None
        window = 4 * self.read_threads
        for start in range(0, len(refs), window):
            batch = list(zip(refs[start : start + window], outs[start : start + window]))
            if pool is None:
                results = (self._read(ref, out, touch=True) for ref, out in batch)
            else:
                results = pool.map(lambda ro: self._read(ro[0], ro[1], touch=True), batch)
            for result in results:  # in order; a pool finishes the window's reads meanwhile
                if failure is None and result is None:
                    n += 1
                elif failure is None:
                    failure = result
            if failure is not None:
                break
        if failure is not None:
            self._counters.fail(failure)
        self._counters.add(hits=n, bytes_out=n * self.file_nbytes, misses=int(failure is not None))
        self._counters.add_seconds("read", time.perf_counter() - t0)
        return n

    def layered_read(self, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> LayeredRead | None:
        """Layer by layer out of the files: each ``read`` is one ``preadv`` per file of
        its layers (the prefix with the first, the checksum with the last), the checksum
        carried across reads; a file replaced or removed between two reads (an inode
        other than the first read's) ends the read there."""
        if len(refs) > len(outs):
            raise ValueError(f"{len(refs)} refs but only {len(outs)} destinations")
        if not all(o.is_cpu and o.dtype == self.dtype and o.shape == self._torch_shape and o.is_contiguous()
                   for o in outs[: len(refs)]):
            return None
        return _DiskLayers(self, refs, outs)

    def _pool(self) -> ThreadPoolExecutor | None:
        if self.read_threads <= 1:
            return None
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="disk-tier-read")
            return self._readers

    def get_into(self, ref: BlockRef, out: torch.Tensor) -> bool:
        return self.get_many_into([ref], [out]) == 1

    def get(self, ref: BlockRef) -> torch.Tensor | None:
        out = torch.empty(self.block_shape, dtype=self.dtype)
        return out if self.get_into(ref, out) else None

    def copy_out(self, ref: BlockRef, out: torch.Tensor) -> bool:
        """Read a verified copy to write it into another tier (the drain to Redis):
        counts no hit and keeps the LRU order."""
        failure = self._read(ref, out, touch=False)
        if failure not in (None, NOT_FOUND):
            self._counters.fail(failure)
        return failure is None

    def get_encoded(self, ref: BlockRef) -> bytes | None:
        """The raw file (unverified; for tools and tests)."""
        try:
            return self.path(ref).read_bytes()
        except OSError:
            return None

    def _read(self, ref: BlockRef, out: torch.Tensor, *, touch: bool) -> str | None:
        """Verify the file of ``ref`` into ``out``; the failure reason, or None if ok.
        A file that fails verification is removed (and dropped from the index)."""
        digest = bytes(ref.block_hash)
        with self._lock:
            if digest not in self._lru:
                return NOT_FOUND
            if touch:
                self._lru.move_to_end(digest)
        path = self._file(digest)
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                st = os.fstat(fd)
                failure = self._verify_into(fd, st.st_size, ref, out)
                if failure is not None:
                    self._drop_bad(ref, Path(path), st, failure)
                elif touch and time.time() - st.st_mtime > _TOUCH_AFTER_S:
                    os.utime(fd)  # the LRU order survives a restart
            finally:
                os.close(fd)
        except FileNotFoundError:  # removed meanwhile (evicted, deleted, by hand)
            self._forget(digest)
            return NOT_FOUND
        except OSError as e:
            self._counters.add(errors=1)
            log.warning("disk tier: reading %s failed: %r", path, e)
            return BACKEND_ERROR
        return failure

    def _verify_into(self, fd: int, size: int, ref: BlockRef, out: torch.Tensor) -> str | None:
        """Verify the open file ``fd`` (``size`` bytes) as ``ref`` into ``out``."""
        if size == self.file_nbytes and out.is_cpu and out.dtype == self.dtype and out.shape == self._torch_shape:
            # One preadv: the prefix, the tensor bytes straight into ``out``, the checksum.
            prefix = self._prefix(ref)
            head, tail = bytearray(len(prefix)), bytearray(codec.CHECKSUM_SIZE)
            data = memoryview(codec.byte_view(out))  # (nbytes,) of out
            if os.preadv(fd, [head, data, tail], 0) == size and head == prefix:
                h = xxhash.xxh3_128(prefix)
                h.update(data)
                return None if h.digest() == tail else codec.BAD_CHECKSUM
            value = _pread_all(fd, size)  # another block, a short read: the codec says why
        elif size > 2 * self.file_nbytes + 65536:  # not ours: do not read it whole
            return codec.BAD_LENGTH
        else:
            value = _pread_all(fd, size)
        result = codec.decode_into(value, ref.namespace, ref.block_hash, out)
        return None if result.ok else result.reason

    def _drop_bad(self, ref: BlockRef, path: Path, st: os.stat_result, reason: str) -> None:
        """Remove a file that failed verification, unless a good one replaced it meanwhile."""
        going = self._forget(bytes(ref.block_hash), going=True)
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev):
                os.unlink(path)
        except OSError:
            pass
        finally:
            self._gone([bytes(ref.block_hash)] if going else [], going)
        log.warning("disk block %s failed verification (%s): removed; the next write stores it again", path, reason)

    def _forget(self, digest: bytes, *, going: bool = False) -> int:
        """Drop ``digest`` from the index. ``going``: its file is still there, about to be
        removed; its bytes stay reserved, and it is not written again, until ``_gone``
        (the bytes returned: pass them there; 0 when it was not held)."""
        with self._lock:
            size = self._lru.pop(digest, None)
            if size is None:
                return 0
            self._bytes -= size
            self._removed([digest])
            self._unpin(digest)
            if not going:
                return 0
            self._reserved += size
            self._going.add(digest)
            return size

    def _gone(self, digests: Sequence[bytes], size: int) -> None:
        """The files of ``digests`` (``size`` reserved bytes) on their way out are removed
        (or failed to be): their room and their names are free again."""
        if digests or size:
            with self._lock:
                self._reserved -= size
                self._going.difference_update(digests)

    def contains(self, ref: BlockRef) -> bool:
        with self._lock:
            return bytes(ref.block_hash) in self._lru

    def contains_many(self, refs: Sequence[BlockRef]) -> list[bool]:
        with self._lock:
            return [bytes(r.block_hash) in self._lru for r in refs]

    # ---- writes --------------------------------------------------------------------

    def put(self, ref: BlockRef, value: torch.Tensor) -> bool:
        """Write the block's file (write a temporary, rename into place). Idempotent: a
        block already held is only refreshed in the LRU. The file's bytes are reserved
        first and the least recently used files beyond the capacity evicted (each demoted
        through ``on_evict``) before it is written, so the directory never holds more than
        the capacity; a pinned file is never one of them. False when the tier has no
        capacity, the capacity is all reserved by writes or removals in flight or pinned,
        or the write failed."""
        if tuple(value.shape) != self.block_shape or value.dtype != self.dtype:
            raise ValueError(f"value must be {self.block_shape} {self.dtype}, got {tuple(value.shape)} {value.dtype}")
        digest = bytes(ref.block_hash)
        n = self.file_nbytes
        victims: list[bytes] = []
        with self._lock:
            if digest in self._lru:
                self._lru.move_to_end(digest)
                self._counters.add(put_skips=1)
                return True
            if digest in self._going:  # its old file is being removed: this one would go with it
                return False
            if self._reserved + n + len(self._pins) * n > self.capacity_bytes:  # no room: all of it written or pinned
                return False
            self._reserved += n
            while self._bytes + self._reserved > self.capacity_bytes and (lru := self._victim()) is not None:
                victim, size = lru
                self._bytes -= size
                victims.append(victim)
            self._removed(victims)
            self._going.update(victims)
            self._seq += 1
            seq = self._seq
        try:
            for victim in victims:  # their files gone before this one is written
                self._evict(BlockRef(ref.namespace, victim))  # type: ignore[arg-type]
        finally:
            self._gone(victims, 0)  # (their room is this write's reservation)
        t0 = time.perf_counter()
        path = self.path(ref)
        tmp = self._tmp_dir / f"{digest.hex()}.{os.getpid()}.{seq}.tmp"
        try:
            self._write_file(tmp, ref, value)
            try:
                os.replace(tmp, path)
            except FileNotFoundError:  # first block of this subdirectory
                path.parent.mkdir(exist_ok=True)
                os.replace(tmp, path)
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError as e:
            _unlink(tmp)
            with self._lock:
                self._reserved -= n
            self._counters.add(errors=1)
            self._counters.fail(BACKEND_ERROR)
            log.warning("disk tier: writing %s failed: %r", path, e)
            return False
        with self._lock:
            self._reserved -= n
            if digest in self._lru:  # another thread stored it meanwhile (same bytes, the same file)
                self._counters.add(put_skips=1)
                return True
            self._lru[digest] = n
            self._bytes += n
            self._stored([digest])
        self._counters.add(puts=1, bytes_in=n)
        self._counters.add_seconds("write", time.perf_counter() - t0)
        return True

    def _write_file(self, tmp: Path, ref: BlockRef, value: torch.Tensor) -> None:
        src = codec.cpu_byte_view(value)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if src is not None:  # prefix, the block's own bytes, checksum: no encoded copy
                prefix = codec.plain_prefix(ref.namespace, ref.block_hash, self.block_shape, self.dtype)
                h = xxhash.xxh3_128(prefix)
                h.update(src)
                parts: list[memoryview] = [memoryview(prefix), memoryview(src), memoryview(h.digest())]
            else:
                parts = [memoryview(codec.encode(ref.namespace, ref.block_hash, value))]
            total = sum(p.nbytes for p in parts)
            written = 0
            while parts:
                n = os.writev(fd, parts)
                written += n
                while parts and n >= parts[0].nbytes:
                    n -= parts[0].nbytes
                    parts.pop(0)
                if parts and n:
                    parts[0] = parts[0][n:]
            assert written == total
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _evict(self, ref: BlockRef) -> None:
        """Hand an evicted block on (read back, verified against the namespace its
        checksummed header names) and remove its file; a file that fails is dropped,
        not demoted."""
        path = self.path(ref)
        self._counters.add(evictions=1)
        if self._on_evict is not None:
            scratch = torch.empty(self.block_shape, dtype=self.dtype)
            try:
                fd = os.open(path, os.O_RDONLY)
                try:
                    ns = os.pread(fd, 32, 8)  # the namespace the checksummed header names
                    ok = len(ns) == 32 and self._verify_into(fd, os.fstat(fd).st_size, BlockRef(ns, ref.block_hash), scratch) is None  # type: ignore[arg-type]
                finally:
                    os.close(fd)
                if ok:
                    self._on_evict(BlockRef(ns, ref.block_hash), scratch)  # type: ignore[arg-type]
            except OSError:
                pass
            except Exception:  # noqa: BLE001 - a demotion failure must not fail the put
                log.exception("disk tier on_evict callback failed")
                self._counters.fail("evict_callback")
        _unlink(path)

    def _victim(self) -> tuple[bytes, int] | None:
        """Under the lock: the least recently used file no retention pins, out of the LRU
        (pinned ones met on the way go to its back); None when there is none."""
        if len(self._pins) >= len(self._lru):
            return None
        while True:  # an unpinned one is met before the pinned ones come round again
            digest, size = self._lru.popitem(last=False)
            if digest not in self._pins:
                return digest, size
            self._lru[digest] = size

    def delete(self, ref: BlockRef) -> bool:
        """Remove the block's file, pinned or not (the tiered store does not delete
        retained blocks)."""
        digest = bytes(ref.block_hash)
        going = self._forget(digest, going=True)
        if not going:
            return False
        try:
            _unlink(self.path(ref))
        finally:
            self._gone([digest], going)  # its room (and name) another write may take only now
        return True

    def clear(self) -> None:
        """Remove every block file, pins included (no eviction callbacks)."""
        with self._lock:
            digests = list(self._lru)
            self._removed(digests)
            self._lru.clear()
            going, self._bytes = self._bytes, 0
            self._reserved += going  # the room is another write's once the files are gone
            self._going.update(digests)
            self._pins.clear()
            self._entries.clear()
        try:
            for d in digests:
                _unlink(self._path_of(d))
        finally:
            self._gone(digests, going)
        self._rewrite_journal()

    # ---- retention -----------------------------------------------------------------

    def retain(self, refs: Sequence[BlockRef], until: float, owner: str) -> list[bool]:
        """Pin the held files of ``refs`` until at least ``until``, each pin appended to
        the journal (fsynced with ``fsync``) before this returns."""
        out, records = [], []
        owner_bytes = owner.encode("utf-8", "surrogatepass")[:0xFFFF]
        with self._lock:
            for ref in refs:
                digest = bytes(ref.block_hash)
                held = digest in self._lru
                out.append(held)
                if not held or until <= self._entries.get((digest, owner), 0.0):
                    continue
                self._entries[(digest, owner)] = until
                self._pins[digest] = max(until, self._pins.get(digest, 0.0))
                body = _RECORD.pack(digest, until, len(owner_bytes)) + owner_bytes
                records.append(struct.pack("<I", zlib.crc32(body)) + body)
        if records:
            self._append_journal(records)
        return out

    def expire_retained(self, now: float) -> int:
        with self._lock:
            for key in [k for k, until in self._entries.items() if until <= now]:
                del self._entries[key]
            due = [d for d, until in self._pins.items() if until <= now]
            for digest in due:
                del self._pins[digest]
            self._expired += len(due)
            live = len(self._entries)
        if self._journal_records > 2 * live + 256:
            self._rewrite_journal()
        return len(due)

    def retained_entries(self) -> list[tuple[bytes, float, str]]:
        with self._lock:
            return [(h, until, owner) for (h, owner), until in self._entries.items()]

    def _unpin(self, digest: bytes) -> None:
        """Under the lock: the block is gone, its pins with it."""
        if self._pins.pop(digest, None) is not None:
            for key in [k for k in self._entries if k[0] == digest]:
                del self._entries[key]

    def _load_journal(self) -> None:
        """The journal's records up to the first torn or corrupt one."""
        try:
            data = self._journal.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("disk tier: cannot read the retention journal %s: %r; its pins are lost", self._journal, e)
            return
        at = n = 0
        head = 4 + _RECORD.size
        while at + head <= len(data):
            crc, = struct.unpack_from("<I", data, at)
            digest, until, olen = _RECORD.unpack_from(data, at + 4)
            end = at + head + olen
            if end > len(data) or zlib.crc32(data[at + 4 : end]) != crc:
                break
            owner = data[at + head : end].decode("utf-8", "surrogatepass")
            if until > self._entries.get((digest, owner), 0.0):
                self._entries[(digest, owner)] = until
                self._pins[digest] = max(until, self._pins.get(digest, 0.0))
            at, n = end, n + 1
        if at < len(data):
            log.warning("disk tier: the retention journal %s ends in %d bytes that are not a whole record "
                        "(a write torn by a crash): ignored", self._journal, len(data) - at)
        if n:
            log.info("disk tier %s: %d retained block(s) in the journal", self.root, len(self._pins))

    def _append_journal(self, records: list[bytes]) -> None:
        with self._journal_lock:
            try:
                fd = os.open(self._journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    _write_all(fd, b"".join(records))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                self._journal_records += len(records)
            except OSError as e:  # the pins hold while this process runs; a restart would lose them
                self._counters.add(errors=1)
                log.warning("disk tier: appending to the retention journal %s failed: %r", self._journal, e)

    def _rewrite_journal(self) -> None:
        """The live records alone, written to a temporary and renamed into place."""
        with self._journal_lock:
            entries = self.retained_entries()
            records = []
            for digest, until, owner in entries:
                ob = owner.encode("utf-8", "surrogatepass")[:0xFFFF]
                body = _RECORD.pack(digest, until, len(ob)) + ob
                records.append(struct.pack("<I", zlib.crc32(body)) + body)
            tmp = self._tmp_dir / f"{JOURNAL}.{os.getpid()}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    _write_all(fd, b"".join(records))
                    if self.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, self._journal)
                if self.fsync:
                    _fsync_dir(self.root)
                self._journal_records = len(records)
            except OSError as e:
                _unlink(tmp)
                log.warning("disk tier: rewriting the retention journal %s failed: %r", self._journal, e)

    # ---- stats and life ------------------------------------------------------------

    def stats(self) -> TierStats:
        with self._lock:
            n, b, pinned, expired = len(self._lru), self._bytes, len(self._pins), self._expired
        return self._counters.snapshot(blocks_held=n, bytes_held=b, blocks_retained=pinned,
                                       bytes_retained=pinned * self.file_nbytes, retention_expired=expired)

    def close(self) -> None:
        """Release the directory's lock (the files stay: a later tier finds them)."""
        with self._lock:
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the fd releases the flock


class _DiskLayers(LayeredRead):
    """``DiskTier.layered_read``. A file of another size, prefix or checksum stops the
    read there and is removed (``_drop_bad``); a file of another size is first given to
    the codec whole (``_read``: it says why)."""

    def __init__(self, tier: DiskTier, refs: Sequence[BlockRef], outs: Sequence[torch.Tensor]) -> None:
        self.tier, self.refs, self.outs = tier, list(refs), list(outs[: len(refs)])
        self.t0 = time.perf_counter()
        self.L = tier.block_shape[0]
        self.layer_nbytes = tier.block_nbytes // self.L
        # (path, its stat at the start) per leading block; None: loaded whole by the codec. Each
        # read opens the file again (no descriptor held across reads: a long restore would
        # hold thousands) and goes on only if it is the same file (inode and device).
        self.files: list[tuple[str, os.stat_result] | None] = []
        self.failure: str | None = None
        self.n = 0
        for ref, out in zip(self.refs, self.outs):
            digest = bytes(ref.block_hash)
            with tier._lock:
                held = digest in tier._lru
                if held:
                    tier._lru.move_to_end(digest)
            if not held:
                self.failure = NOT_FOUND
                break
            path = tier._file(digest)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                tier._forget(digest)
                self.failure = NOT_FOUND
                break
            except OSError:
                tier._counters.add(errors=1)
                self.failure = BACKEND_ERROR
                break
            if st.st_size != tier.file_nbytes:  # not the plain layout: the codec reads it whole
                failure = tier._read(ref, out, touch=False)
                if failure is not None:
                    self.failure = failure
                    break
                self.files.append(None)
            else:
                self.files.append((path, st))
            self.n += 1
        self.sums = [xxhash.xxh3_128(tier._prefix(r)) for r in self.refs[: self.n]]
        self.views = [memoryview(codec.byte_view(o)) for o in self.outs[: self.n]]

    def read(self, l0: int, l1: int) -> int:
        t, LB = self.tier, self.layer_nbytes
        first, last = l0 == 0, l1 == self.L
        P = t.file_nbytes - t.block_nbytes - codec.CHECKSUM_SIZE
        for i in range(self.n):
            f = self.files[i]
            if f is None:
                continue
            head = bytearray(P) if first else None
            tail = bytearray(codec.CHECKSUM_SIZE) if last else None
            data = self.views[i][l0 * LB : l1 * LB]
            bufs = [b for b in (head, data, tail) if b is not None]
            want = sum(len(b) for b in bufs)
            try:
                fd = os.open(f[0], os.O_RDONLY)
                try:
                    now = os.fstat(fd)
                    same = (now.st_ino, now.st_dev) == (f[1].st_ino, f[1].st_dev)
                    got = os.preadv(fd, bufs, 0 if first else P + l0 * LB) if same else 0
                finally:
                    os.close(fd)
            except FileNotFoundError:  # evicted or deleted since: a miss from here
                same = False
            except OSError:
                t._counters.add(errors=1)
                self._stop(i, BACKEND_ERROR)
                break
            if not same:  # replaced or removed since the first read: its earlier layers may differ
                self.n, self.failure = i, NOT_FOUND
                break
            if got != want:
                self._stop(i, codec.TRUNCATED)
                break
            if head is not None and head != t._prefix(self.refs[i]):  # another block or layout: the codec says why
                self.files[i] = None
                failure = t._read(self.refs[i], self.outs[i], touch=False)  # removes a bad file itself
                if failure is not None:
                    self.n, self.failure = i, failure
                    break
                continue  # good in another layout: loaded whole
            self.sums[i].update(data)
            if tail is not None and self.sums[i].digest() != tail:
                self._stop(i, codec.BAD_CHECKSUM)
                break
        return self.n

    def _stop(self, i: int, reason: str) -> None:
        f = self.files[i]
        if f is not None and reason != BACKEND_ERROR:
            self.tier._drop_bad(self.refs[i], Path(f[0]), f[1], reason)
        self.n, self.failure = i, reason

    def finish(self) -> int:
        self.files = []
        c = self.tier._counters
        if self.failure is not None:
            c.fail(self.failure)
        c.add(hits=self.n, bytes_out=self.n * self.tier.file_nbytes, misses=int(self.failure is not None))
        c.add_seconds("read", time.perf_counter() - self.t0)
        return self.n


def _parse_name(name: str) -> bytes | None:
    if not name.endswith(SUFFIX) or len(name) != _HEX_LEN + len(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[:_HEX_LEN])
    except ValueError:
        return None


def _pread_all(fd: int, size: int) -> bytes:
    """The file's bytes from 0: ``size`` of them, plus at most one more chunk if it grew
    meanwhile (enough for the codec to call it too long)."""
    out = bytearray()
    while len(out) <= size and (chunk := os.pread(fd, max(size - len(out), 65536), len(out))):
        out += chunk
    return bytes(out)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        if path.is_dir() and not path.is_symlink():
            for child in path.iterdir():
                _unlink(child)
            path.rmdir()
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("disk tier: cannot remove %s: %r", path, e)
