"""One writer per store directory: an exclusive lock held for as long as a writer has it open.

Two writers of one directory would each cut the other's live shard back to its last committed
row on open (`shards.recover`) and name their new shards alike, so rows would read back as
zeros or as another row's bytes. `WriterLock.acquire` takes `flock(LOCK_EX)` on the directory's
`writer.lock` without waiting and records who holds it (host, pid); a second writer is refused in
one line naming that holder. The kernel drops the lock when its holder exits, however it exits,
so a crashed writer never blocks the next one; the file itself stays (removing it would let two
writers lock two different files).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
from pathlib import Path

LOCK_FILE = "writer.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class WriterLock:
    """The held lock of one store directory; `release()` (or the process ending) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, store_dir: Path) -> WriterLock:
        """Lock `store_dir` for writing, or raise one ValueError: another writer holds it (who,
        when it said), or the file system cannot lock (then two writers could not be told apart)."""
        path = store_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ValueError(
                f"feature store {store_dir} cannot be written: {LOCK_FILE}: {e.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(
                    f"feature store {store_dir} is being written by {holder}: one writer at a "
                    "time (wait for it to finish, or give another directory)"
                ) from None
            if e.errno in _NO_LOCKS:
                raise ValueError(
                    f"feature store {store_dir}: its file system cannot lock {LOCK_FILE} "
                    f"({e.strerror}), so a second writer could not be refused: put the store on a "
                    "file system with flock"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Free the lock (idempotent)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:  # a writer dropped without close() frees its directory
        self.release()


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it ("another process" while it has not yet)."""
    try:
        d = json.loads(os.pread(fd, 4096, 0) or b"{}")
        host, pid = str(d["host"]), int(d["pid"])
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"
    if host == socket.gethostname() and pid == os.getpid():
        return f"this process (pid {pid}: the store is already open for writing)"
    return f"another process (host {host}, pid {pid})"
