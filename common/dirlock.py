"""One process per directory: an exclusive ``flock`` on ``DIR/LOCK`` with the holder's pid
in it. The disk KV tier (kvserve.cachestore.disk) and the disk session store
(kvserve.service.sessions.disk) each hold their directory's; the server checks a
directory is free before it starts. Standard library only."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

class DiskCacheLocked(RuntimeError):
    """Another tier (this process or another) holds the directory's lock."""


def hold_dir_lock(root: Path) -> int:
    """An fd holding an exclusive flock on ``root/LOCK`` (our pid written in it; closing
    the fd, or the process ending, releases it). ``DiskCacheLocked`` when held."""
    path = root / "LOCK"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        finally:
            os.close(fd)
        raise DiskCacheLocked(f"{root} is in use by another kvserve process (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


__all__ = ["DiskCacheLocked", "hold_dir_lock"]
