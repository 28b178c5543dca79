"""The session journal: what Redis has not confirmed, in a file that outlives the process.

A server with Redis and a disk directory (``--redis-url`` with ``--disk-cache-dir``) keeps
here, for every session whose last change Redis may lack (a write that timed out or met
the open circuit breaker, a delete it never heard of), that change: the record as this
replica holds it, what a write-back of it may find in Redis (``Expect``), whether it is a
creation, and a pending delete. ``FallbackSessionStore`` appends to it before it answers
the write (so before the turn's final event), tells it when Redis has the change, and
replays it at startup: the records go back into this replica's copy and are written to
Redis when it answers, each by the same compare-and-set as any write-back, so a replayed
record never replaces a newer version (nor a tombstone) another replica wrote meanwhile.

The file, ``<root>/sessions.kvsj`` (``root`` = ``<disk-cache-dir>/journal``, held with an
exclusive flock on ``<root>/LOCK`` as the disk tier holds its directory), is a sequence
of frames, the last one of a session being what counts::

    b"KVSJ" | u32 n | n bytes body | u32 crc32 (of the magic, n and the body)
    body: u8 flags (1 delete pending, 2 record, 4 creation) | u16 + owner | u16 + session id
          [record: u32 m | m bytes JSON (etags, absent_ok, unreadable, base_turns) | encode_record]

A frame with no flag says Redis has everything of that session. A frame that fails its
length or checksum (a write torn by a crash, a flipped byte) is skipped: the reader looks
for the next magic, so one bad frame costs that frame only, and the count of bytes skipped
is logged. Appends go to the end of the file with ``write``; with ``fsync`` (the disk
tier's setting, ``--disk-cache-fsync``) each is followed by ``fdatasync``: without it a
process crash (SIGKILL, OOM) loses nothing appended (the page cache has it), a power loss
or kernel crash may lose the last appends; with it nothing acknowledged is lost to either.

Size: when no session is pending the file is emptied; when it holds more than twice the
bytes of its live frames (plus 1 MiB) it is rewritten with only those (to a temporary
file, renamed over it). At startup it is read and rewritten the same way.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.common.dirlock import hold_dir_lock

from .records import SessionRecord, SessionRecordError, decode_record, encode_record
from .stores.protocol import Expect  # not the package: its fallback store names the journal

log = logging.getLogger(__name__)

FILE = "sessions.kvsj"
MAGIC = b"KVSJ"
_HEAD = struct.Struct("<4sI")  # magic, body length
_CRC = struct.Struct("<I")
_FLAGS = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
DELETE, RECORD, CREATE = 1, 2, 4
MAX_BODY = 1 << 31  # larger is no frame of ours (a flipped length byte)
COMPACT_SLACK = 1 << 20

Key = tuple[str, str]  # (owner, session id)


@dataclass(frozen=True, slots=True)
class Pending:
    """What Redis may lack of one session: a delete it has not heard of (sent first) and/or
    the session's last record, with what a write-back of it may find there (``expect``),
    whether that write is a creation (it may replace a tombstone) and how many of its
    turns Redis was known to hold (``base_turns``: the others were acknowledged here)."""

    record: SessionRecord | None = None
    expect: Expect = field(default_factory=Expect)
    create: bool = False
    base_turns: int = 0
    delete: bool = False

    @property
    def turns(self) -> int:
        """Acknowledged turns only this replica (and this journal) holds."""
        return max(0, self.record.turns - self.base_turns) if self.record is not None else 0


class JournalError(Exception):
    """A frame that cannot be read (only raised inside the reader)."""


def encode_frame(key: Key, pending: Pending | None) -> bytes:
    owner, session_id = (s.encode() for s in key)
    flags = 0
    tail = b""
    if pending is not None:
        flags |= DELETE if pending.delete else 0
        if pending.record is not None:
            flags |= RECORD | (CREATE if pending.create else 0)
            e = pending.expect
            meta = json.dumps({"etags": sorted(e.etags), "absent_ok": e.absent_ok, "unreadable": e.unreadable,
                               "base_turns": pending.base_turns}, separators=(",", ":")).encode()  # fmt: skip
            tail = _U32.pack(len(meta)) + meta + encode_record(pending.record)
    body = _FLAGS.pack(flags) + _U16.pack(len(owner)) + owner + _U16.pack(len(session_id)) + session_id + tail
    head = _HEAD.pack(MAGIC, len(body))
    return head + body + _CRC.pack(zlib.crc32(head + body))


def decode_body(body: bytes) -> tuple[Key, Pending | None]:
    """The session and its pending state (None: nothing pending) of one frame's body;
    JournalError when it does not parse."""
    try:
        (flags,) = _FLAGS.unpack_from(body, 0)
        pos = _FLAGS.size
        (n,) = _U16.unpack_from(body, pos)
        owner = body[pos + 2 : pos + 2 + n].decode()
        pos += 2 + n
        (n,) = _U16.unpack_from(body, pos)
        session_id = body[pos + 2 : pos + 2 + n].decode()
        pos += 2 + n
        key = (owner, session_id)
        if not flags & (DELETE | RECORD):
            return key, None
        if not flags & RECORD:
            return key, Pending(delete=True)
        (n,) = _U32.unpack_from(body, pos)
        meta = json.loads(body[pos + 4 : pos + 4 + n])
        rec = decode_record(body[pos + 4 + n :])
        if (rec.owner, rec.session_id) != key:
            raise JournalError(f"the record is session {rec.session_id!r}'s, the frame names {session_id!r}")
        expect = Expect(frozenset(str(t) for t in meta["etags"]), bool(meta["absent_ok"]), unreadable=str(meta["unreadable"]))
        return key, Pending(rec, expect, bool(flags & CREATE), int(meta["base_turns"]), bool(flags & DELETE))
    except (struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError, SessionRecordError) as e:
        raise JournalError(f"{type(e).__name__}: {e}"[:200]) from None


def read_frames(data: bytes) -> tuple[list[tuple[Key, Pending | None, int, int]], int]:
    """Every good frame of ``data`` in order, as (session, pending state, offset, length),
    and how many bytes were skipped (torn or damaged frames: the reader goes on at the next
    magic)."""
    frames = []
    skipped = pos = 0
    while pos < len(data):
        try:
            if data[pos : pos + 4] != MAGIC or pos + _HEAD.size > len(data):
                raise JournalError("no frame here")
            (n,) = _U32.unpack_from(data, pos + 4)
            end = pos + _HEAD.size + n + _CRC.size
            if n > MAX_BODY or end > len(data):
                raise JournalError("the frame runs past the end")
            (crc,) = _CRC.unpack_from(data, end - _CRC.size)
            if zlib.crc32(data[pos : end - _CRC.size]) != crc:
                raise JournalError("checksum mismatch")
            key, pending = decode_body(data[pos + _HEAD.size : end - _CRC.size])
        except JournalError:
            nxt = data.find(MAGIC, pos + 1)
            nxt = len(data) if nxt < 0 else nxt
            skipped += nxt - pos
            pos = nxt
            continue
        frames.append((key, pending, pos, end - pos))
        pos = end
    return frames, skipped


class SessionJournal:
    """The journal file of one server. See the module docstring.

    ``pending`` is what the file said at startup (replayed by the store); ``put`` records
    a session's pending state now (None: nothing pending) and raises OSError when it could
    not be written, so the caller can fail the write it journals instead of acknowledging it.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = hold_dir_lock(self.root)
        self.path = self.root / FILE
        self.write_errors = 0  # appends that failed (the write they journaled failed too)
        self._fd: int | None = None
        self._size = 0
        self._live: dict[Key, tuple[int, int]] = {}  # session -> (offset, length) of its last frame
        self._live_bytes = 0
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        frames, self.skipped_bytes = read_frames(data)
        self.pending: dict[Key, Pending] = {}
        last: dict[Key, bytes] = {}
        for key, pending, offset, length in frames:
            if pending is None:
                self.pending.pop(key, None)
                last.pop(key, None)
            else:
                self.pending[key] = pending
                last[key] = data[offset : offset + length]
        if self.skipped_bytes:
            log.error("session journal %s: %d byte(s) of damaged or torn frames skipped (a crash mid-write, or "
                      "the disk); the sessions they held are replayed from their earlier frames, if any",
                      self.path, self.skipped_bytes)  # fmt: skip
        self._rewrite(last)

    @property
    def sessions(self) -> int:
        """Sessions with something pending."""
        return len(self._live)

    def put(self, key: Key, pending: Pending | None) -> None:
        """Append ``key``'s pending state (None: Redis has everything of it). Raises OSError
        (nothing of the frame is left behind)."""
        if pending is None and key not in self._live:
            return
        frame = encode_frame(key, pending)
        offset = self._append(frame)
        _, old = self._live.pop(key, (0, 0))
        self._live_bytes -= old
        if pending is not None:
            self._live[key] = (offset, len(frame))
            self._live_bytes += len(frame)
        if not self._live:
            self._truncate()
        elif self._size > 2 * self._live_bytes + COMPACT_SLACK:
            self._compact()

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            self._size = os.fstat(self._fd).st_size
        return self._fd

    def _append(self, frame: bytes) -> int:
        fd = self._open()
        offset = self._size
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(fd, view) :]
            if self.fsync:
                os.fdatasync(fd)
        except OSError:
            self.write_errors += 1
            try:  # no torn frame left for the next append to follow
                os.ftruncate(fd, offset)
            except OSError:
                pass
            raise
        self._size = offset + len(frame)
        return offset

    def _truncate(self) -> None:
        try:
            os.ftruncate(self._open(), 0)
            self._size = 0
        except OSError as e:  # the frames that say "nothing pending" are in it: harmless
            log.warning("session journal %s could not be emptied: %r", self.path, e)

    def _compact(self) -> None:
        fd = self._open()
        try:
            frames = {key: os.pread(fd, length, offset) for key, (offset, length) in self._live.items()}
            self._rewrite(frames)
        except OSError as e:  # it stays as it was (longer than it needs to be)
            log.warning("session journal %s could not be compacted: %r", self.path, e)

    def _rewrite(self, frames: dict[Key, bytes]) -> None:
        """Replace the file by ``frames`` (a temporary file renamed over it)."""
        tmp = self.root / (FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        live: dict[Key, tuple[int, int]] = {}
        offset = 0
        try:
            for key, frame in frames.items():
                view = memoryview(frame)
                while view:
                    view = view[os.write(fd, view) :]
                live[key] = (offset, len(frame))
                offset += len(frame)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        if self.fsync:
            dfd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._live, self._live_bytes = live, offset
        self._open()

    def close(self) -> None:
        for name in ("_fd", "_lock_fd"):
            fd = getattr(self, name)
            setattr(self, name, None)
            if fd is not None:
                os.close(fd)


__all__ = ["FILE", "Pending", "SessionJournal", "encode_frame", "read_frames"]
