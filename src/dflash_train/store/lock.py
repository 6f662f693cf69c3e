"""One writer per store directory, and no --overwrite under a reader: two flock(2) locks.

Two writers of one directory would each cut the other's live shard back to its last committed
row on open (`shards.recover`) and name their new shards alike, so rows would read back as
zeros or as another row's bytes. `WriterLock.acquire` takes `flock(LOCK_EX)` on the directory's
`writer.lock` without waiting and records who holds it (host, pid); a second writer is refused in
one line naming that holder. The kernel drops the lock when its holder exits, however it exits,
so a crashed writer never blocks the next one; the file itself stays (removing it would let two
writers lock two different files).

`ReadLock.acquire` takes `flock(LOCK_SH)` on the store's `readers.lock` for as long as a store is
open for reading (a run training from it, a capture checking what it holds); `no_readers` takes
the same file's `LOCK_EX` while `capture --overwrite` deletes the store, and refuses in one line
while any reader holds it. A reader maps shards by name and maps them again once it has let them
go, so a store deleted and captured again under it would hand it other rows under the same
names, silently. Both are best effort where locking is impossible (a read-only directory, a file
system without flock): a directory the reader cannot write, the capture cannot delete either.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "writer.lock"
READERS_FILE = "readers.lock"
LOCK_FILES = (LOCK_FILE, READERS_FILE)
"""What `capture --overwrite` leaves in a store it deletes (the locks it holds)."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN)


class _HeldLock:
    """A lock held through an open descriptor; `release()` (or the process ending) frees it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Free the lock (idempotent)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:  # a store dropped without close() frees its directory
        self.release()


class WriterLock(_HeldLock):
    """The held writer lock of one store directory."""

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
            if e.errno in _BUSY:
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


class ReadLock(_HeldLock):
    """A reader's shared hold on a store directory: `capture --overwrite` is refused under it."""

    @classmethod
    def acquire(cls, store_dir: Path) -> ReadLock | None:
        """Hold `store_dir` for reading (None where it cannot be locked: see the module's
        docstring); one ValueError while a capture is deleting it to capture it again."""
        fd = _open_lock_file(store_dir / READERS_FILE)
        if fd is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in _BUSY:
                raise ValueError(
                    f"feature store {store_dir} is being deleted by `capture --overwrite` to be "
                    "captured again: read it once that capture has finished"
                ) from None
            if e.errno in _NO_LOCKS:
                return None
            raise
        return cls(store_dir / READERS_FILE, fd)


@contextlib.contextmanager
def no_readers(store_dir: Path) -> Iterator[None]:
    """Hold off readers of `store_dir` while it is deleted; one ValueError while one reads it."""
    fd = _open_lock_file(store_dir / READERS_FILE)
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in _BUSY:
                raise ValueError(
                    f"feature store {store_dir} is open for reading (a run training from it, or a "
                    "capture checking it): --overwrite would delete its rows under it; wait for "
                    "it to finish, or capture into another directory"
                ) from None
            if e.errno not in _NO_LOCKS:
                raise
        yield
    finally:
        os.close(fd)


def _open_lock_file(path: Path) -> int | None:
    """A descriptor of `path`, created when missing (None: it cannot be opened, nor created)."""
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # flock needs no write access
        try:
            return os.open(path, flags | os.O_CLOEXEC, 0o644)
        except OSError:
            continue
    return None


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
