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
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from kvserve.common.dirlock import hold_dir_lock

from .records import SessionRecord, SessionRecordError, decode_record, encode_record
from .stores import InMemorySessionStore

log = logging.getLogger(__name__)

SUFFIX = ".kvss"


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
        self.write_errors = 0
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

    def _sync(self, key: tuple[str, str]) -> None:
        """Make the file of ``key`` say what memory says (written, or removed)."""
        path = self.path(*key)
        rec = self._records.get(key)
        try:
            if rec is None:
                path.unlink(missing_ok=True)
                return
            self._seq += 1
            tmp = self._tmp / f"{path.stem}.{os.getpid()}.{self._seq}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
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
            if self.fsync:
                dfd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as e:  # the record stays in memory: served until the restart
            self.write_errors += 1
            log.warning("session record %s could not be written: %r", path, e)

    # Every change goes through one of these; each syncs the key(s) it touched.

    async def put(self, rec: SessionRecord) -> None:
        await super().put(rec)
        self._sync((rec.owner, rec.session_id))

    async def put_if(self, rec: SessionRecord, *args: Any, **kwargs: Any) -> str:
        outcome = await super().put_if(rec, *args, **kwargs)
        self._sync((rec.owner, rec.session_id))
        return outcome

    async def delete(self, owner: str, session_id: str) -> bool:
        removed = await super().delete(owner, session_id)
        self._sync((owner, session_id))
        return removed

    async def delete_if(self, owner: str, session_id: str, etags: frozenset[str]) -> bool:
        removed = await super().delete_if(owner, session_id, etags)
        self._sync((owner, session_id))
        return removed

    async def expire(self) -> list[SessionRecord]:
        gone = await super().expire()
        for rec in gone:
            self._sync((rec.owner, rec.session_id))
        return gone

    async def close(self) -> None:
        await super().close()
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)
