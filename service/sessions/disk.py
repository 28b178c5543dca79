"""Session records in files, for a server with a disk tier and no Redis
(``--disk-cache-dir`` without ``--redis-url``): a session resumes after a restart of
that one machine, its blocks found in the disk tier beside it.

``DiskSessionStore`` is ``InMemorySessionStore`` (the same compare-and-set rule, locks,
TTL and paging, all in this process) with every change written through to one file per
session under ``root`` (``<disk-cache-dir>/sessions``)::

    LOCK                        exclusive flock while a store uses the directory
    <h[:2]>/<h>.kvss            h = sha256(owner NUL session_id): records.encode_record
    tmp/                        writes in flight (emptied at startup)

A write goes to ``tmp/`` and is renamed into place (atomic), so a crash leaves the old
record or the new one, never half of one; ``fsync`` as the disk tier's
(``--disk-cache-fsync``). At startup every record is read back; one that does not decode
(its CRC, a torn file) or is not the session its name says is removed and counted
(``unreadable``), so it is a missing session, never a wrong transcript. One process per
directory, as the disk tier (``DiskCacheLocked``).

A change is answered only once its file says it (durable acknowledgement): a write or a
``delete`` whose file cannot be written (the directory unwritable, the disk full or
failing) fails with ``SessionStoreUnavailable`` and the session stays as it was, in
memory and on disk, so a turn that could not be saved fails before its final event and
a client never holds a turn a restart would lose. What has no caller to fail (the removal
of an expired session or of a first turn that did not complete, and putting a failed
write's file back) is kept in a dirty set, retried before every later change and by
``flush`` (the drain), which reports what is still unwritten.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from kvserve.common.dirlock import hold_dir_lock

from .records import SessionRecord, SessionRecordError, SessionStoreUnavailable, decode_record, encode_record
from .stores.memory import InMemorySessionStore
from .stores.protocol import CONFLICT, LIMIT, FlushReport

log = logging.getLogger(__name__)

SUFFIX = ".kvss"


class NotDurable(OSError):
    """A record file was renamed into place but its directory could not be synced."""


class DiskSessionStore(InMemorySessionStore):
    """``InMemorySessionStore`` written through to files. See the module docstring."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        ttl_s: float | None = None,
        fsync: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(ttl_s=ttl_s, clock=clock)
        self.root = Path(root)
        self.fsync = fsync
        self.unreadable = 0  # record files removed at startup because they did not decode
        self.write_errors = 0  # record files that could not be written or removed (each failed its call or is dirty)
        self._dirty: set[tuple[str, str]] = set()  # files that may not say what memory says
        self._last_error = ""
        self._failing = 0  # writes failed since the last one that went through (logged once per outage)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = hold_dir_lock(self.root)
        self._tmp = self.root / "tmp"
        self._tmp.mkdir(exist_ok=True)
        self._seq = 0
        self._load()

    def path(self, owner: str, session_id: str) -> Path:
        h = hashlib.sha256(owner.encode() + b"\0" + session_id.encode()).hexdigest()
        return self.root / h[:2] / (h + SUFFIX)

    def _load(self) -> None:
        for tmp in self._tmp.iterdir():
            tmp.unlink(missing_ok=True)
        for sub in self.root.iterdir():
            if not sub.is_dir() or sub == self._tmp:
                continue
            for f in sub.glob("*" + SUFFIX):
                try:
                    rec = decode_record(f.read_bytes())
                    if self.path(rec.owner, rec.session_id) != f:
                        raise SessionRecordError("the record is another session's")
                except (OSError, SessionRecordError) as e:
                    self.unreadable += 1
                    log.warning("session record %s is unreadable (%s): removed", f, e)
                    f.unlink(missing_ok=True)
                    continue
                self._records[(rec.owner, rec.session_id)] = rec
        if self._records:
            log.info("sessions: %d record(s) found in %s", len(self._records), self.root)

    def _write(self, key: tuple[str, str]) -> None:
        """Make the file of ``key`` say what memory says (written, or removed). Raises OSError."""
        path = self.path(*key)
        rec = self._records.get(key)
        if rec is None:
            path.unlink(missing_ok=True)
            return
        self._seq += 1
        tmp = self._tmp / f"{path.stem}.{os.getpid()}.{self._seq}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                data = memoryview(encode_record(rec))
                while data:
                    data = data[os.write(fd, data) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            try:
                dfd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
            except OSError as e:
                raise NotDurable(e.errno, f"the record was renamed into place but its directory not synced: {e}") from e

    def _sync(self, key: tuple[str, str]) -> bool:
        """``_write``; a failure marks ``key`` dirty (retried later) instead of raising."""
        try:
            self._write(key)
        except OSError as e:
            self._failed(key, e)
            return False
        self._written(key)
        return True

    def _written(self, key: tuple[str, str]) -> None:
        self._dirty.discard(key)
        if self._failing:
            log.info("session records are written again in %s (%d write(s) failed meanwhile)", self.root,
                     self._failing)  # fmt: skip
            self._failing = 0

    def _error(self, key: tuple[str, str], e: OSError, what: str) -> None:
        """Count a failed write; log the first of an outage (the rest at debug level)."""
        self.write_errors += 1
        self._last_error = f"{type(e).__name__}: {e}"
        self._failing += 1
        level = logging.ERROR if self._failing == 1 else logging.DEBUG
        log.log(level, "session record %s could not be written (%r): %s; until they can, every change of a "
                "session fails with UNAVAILABLE", self.path(*key), e, what)  # fmt: skip

    def _failed(self, key: tuple[str, str], e: OSError) -> None:
        self._dirty.add(key)
        self._error(key, e, "retried")

    def _retry_dirty(self, limit: int = 64) -> None:
        """Try the dirty files again (at most ``limit``, stopping at the first failure)."""
        for key in list(self._dirty)[:limit]:
            try:
                self._write(key)
            except OSError as e:
                self._last_error = f"{type(e).__name__}: {e}"
                return
            self._written(key)

    def _save_or_undo(self, key: tuple[str, str], before: SessionRecord | None, what: str) -> None:
        """Write ``key``'s file; if that fails, put memory back to ``before`` (the file is
        put back too, or marked dirty) and raise SessionStoreUnavailable."""
        try:
            self._write(key)
        except OSError as e:
            if before is None:
                self._records.pop(key, None)
            else:
                self._records[key] = before
            if isinstance(e, NotDurable):  # the file may say the new version: put the old one back
                self._failed(key, e)
                self._retry_dirty()
            else:  # the file is as it was
                self._error(key, e, "the call fails")
            raise SessionStoreUnavailable(
                f"session {key[1]!r}: the session store could not save {what} (a disk error on the server); "
                f"nothing was recorded: retry"
            ) from None
        self._written(key)

    @property
    def dirty(self) -> int:
        """Record files that may not say what memory says (retried)."""
        return len(self._dirty)

    # Every change goes through one of these; each saves the key(s) it touched.

    async def put(self, rec: SessionRecord) -> None:
        self._retry_dirty()
        key = (rec.owner, rec.session_id)
        before = self._records.get(key)
        await super().put(rec)
        self._save_or_undo(key, before, "this change")

    async def put_if(self, rec: SessionRecord, *args: Any, **kwargs: Any) -> str:
        self._retry_dirty()
        key = (rec.owner, rec.session_id)
        before = self._records.get(key)
        outcome = await super().put_if(rec, *args, **kwargs)
        if outcome not in (CONFLICT, LIMIT):  # those wrote nothing
            self._save_or_undo(key, before, "this turn" if rec.turns else "this session")
        return outcome

    async def delete(self, owner: str, session_id: str) -> bool:
        self._retry_dirty()
        key = (owner, session_id)
        before = self._records.get(key)
        removed = await super().delete(owner, session_id)
        self._save_or_undo(key, before, "the delete")
        return removed

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        self._retry_dirty()
        removed = await super().delete_if(owner, session_id, etags)
        self._sync((owner, session_id))
        return removed

    async def expire(self) -> list[SessionRecord]:
        self._retry_dirty()
        gone = await super().expire()
        for rec in gone:
            self._sync((rec.owner, rec.session_id))
        return gone

    async def flush(self, timeout_s: float) -> FlushReport:
        """Write the dirty files (the drain), trying again until ``timeout_s``."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while self._dirty:
            self._retry_dirty(limit=len(self._dirty))
            if not self._dirty or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
        return FlushReport(sessions=len(self._dirty), waited_s=time.monotonic() - t0,
                           where=str(self.root), why=self._last_error if self._dirty else "")  # fmt: skip

    async def close(self) -> None:
        await super().close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)
