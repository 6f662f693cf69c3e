"""One shard of a feature store: an append-only value file and its append-only index.

  NAME.bin  rows' bytes back to back (`codec`: one contiguous range per row)
  NAME.idx  one record per committed row: (row id, byte offset in NAME.bin, tokens), three
            little-endian int64

A commit makes rows durable in this order: the values are written and fsynced, THEN their index
records are appended and fsynced. So every whole index record points at durable bytes, whatever
moment a crash (or a full disk) strikes: a row is in the store exactly when its record is. What a
crash can leave is an uncommitted tail (values past the last record, a partial last record,
records that read back as zeros), which readers ignore and `recover` cuts off before a shard is
appended to again. A write that fails part-way (a full disk after a short write) rolls its file
back to the last whole row or record before the error travels on, so the next row starts where
its index record says.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from dflash_train import faults

RECORD = np.dtype([("row", "<i8"), ("offset", "<i8"), ("tokens", "<i8")])
WRITE_CHUNK = 8 * 2**20
"""Bytes per write call: a row of a long sequence is several (each a fault point in tests)."""


def shard_paths(store_dir: Path, name: str) -> tuple[Path, Path]:
    return store_dir / f"{name}.bin", store_dir / f"{name}.idx"


def read_index(
    store_dir: Path,
    name: str,
    bytes_per_token: int,
    num_rows: int,
    start: int = 0,
    offset: int = 0,
) -> np.ndarray:
    """The committed records of shard `name` from record `start` on (whose first row begins at
    byte `offset`: a reader that has the records before it), checked against its value file: one
    ValueError naming the file when the index is missing, the records are inconsistent, or the
    value file is shorter than they say (a truncated shard)."""
    values, index = shard_paths(store_dir, name)
    for path, what in ((index, "index"), (values, "value file")):
        if not path.is_file():
            raise ValueError(
                f"feature store {store_dir}: the {what} {path.name} of shard {name} is missing "
                "(the store is damaged: capture it again with --overwrite)"
            )
    with index.open("rb") as f:
        f.seek(start * RECORD.itemsize)
        raw = np.frombuffer(f.read(), dtype=np.uint8)
    whole = len(raw) - len(raw) % RECORD.itemsize  # a partial last record: not committed
    recs = raw[:whole].copy().view(RECORD)
    recs = recs[: _before_zeroed_tail(recs)]
    if len(recs):
        ends = recs["offset"] + recs["tokens"] * bytes_per_token
        starts_ok = recs["offset"][0] == offset and np.array_equal(recs["offset"][1:], ends[:-1])
        rows_ok = ((recs["row"] >= 0) & (recs["row"] < num_rows)).all()
        if not (starts_ok and rows_ok and (recs["tokens"] > 0).all()):
            raise ValueError(f"feature store {store_dir}: {index.name} holds inconsistent records")
        size = values.stat().st_size
        if size < ends[-1]:
            raise ValueError(
                f"feature store {store_dir}: {values.name} is truncated ({size} bytes, its index "
                f"needs {int(ends[-1])}): capture it again with --overwrite"
            )
    return recs


def _before_zeroed_tail(recs: np.ndarray) -> int:
    """How many records precede the index's all-zero tail: records never written whose length
    reached the disk before their bytes did (a crash in an append's fsync, on a file system that
    orders no data: the index grows, reads back zeros). No committed record is all zero (every
    row has tokens), and a commit's records were synced before the next commit wrote, so the
    zeroed records are uncommitted, like a partial one: readers ignore them, `recover` cuts them.
    Zeros before a written record stay, and are refused as inconsistent."""
    written = np.flatnonzero(recs.view(np.int64).reshape(len(recs), 3).any(axis=1))
    return int(written[-1]) + 1 if len(written) else 0


def committed_bytes(recs: np.ndarray, bytes_per_token: int) -> int:
    """End of the last committed row in the value file (0 for an empty shard)."""
    if not len(recs):
        return 0
    return int(recs["offset"][-1] + recs["tokens"][-1] * bytes_per_token)


def recover(store_dir: Path, name: str, recs: np.ndarray, bytes_per_token: int) -> None:
    """Cut an interrupted commit's tail off both files, so appending resumes on a clean end."""
    values, index = shard_paths(store_dir, name)
    for path, end in (
        (values, committed_bytes(recs, bytes_per_token)),
        (index, len(recs) * RECORD.itemsize),
    ):
        if path.stat().st_size != end:
            os.truncate(path, end)


class ShardWriter:
    """Appends rows to one new shard. Not thread-safe: the store serialises its callers.

    `size` and the index's length only ever name whole rows and records: a write that fails
    part-way is cut off again (`_AppendFile`), so after a full disk the next row (once space is
    free) starts at `size` and every committed record points at that record's own bytes.
    """

    def __init__(self, store_dir: Path, name: str) -> None:
        self.name = name
        values, index = shard_paths(store_dir, name)
        self._values = _AppendFile(values, fault="store_write")
        self._index = _AppendFile(index)
        self._pending: list[tuple[int, int, int]] = []
        self._failed: str | None = None  # why an earlier commit failed: none may follow

    @property
    def size(self) -> int:
        """Bytes of whole rows in the value file, committed or not."""
        return self._values.size

    def append(self, row: int, data: np.ndarray, tokens: int) -> None:
        """Write one row's bytes (uint8, 1-D); in the store once `commit` returns."""
        offset = self._values.size
        self._values.append(memoryview(data))
        self._pending.append((row, offset, tokens))

    def commit(self) -> np.ndarray:
        """Make the appended rows durable (values first, then their records); their records.

        A write of the records that fails (a full disk) is cut back whole and leaves the rows
        pending: a later commit may write them. A failed fsync instead leaves this writer
        refusing every later commit, with the records it wrote cut off the index again: the
        kernel may have dropped the pages it could not write and marked them clean, so a retry
        that succeeds proves nothing (and one that appended the same records again made the
        shard unreadable). Those rows were never committed: the next writer of the part (a
        capture run again, a resumed run) redoes them, after recovery cuts the shard back to
        its committed end."""
        if self._failed is not None:
            raise OSError(f"shard {self.name}: an earlier commit failed ({self._failed})")
        if not self._pending:
            return np.zeros(0, RECORD)
        recs = np.array(self._pending, dtype=RECORD)
        committed = self._index.size
        self._synced(self._values, committed)
        self._index.append(memoryview(recs.tobytes()))  # a failed write is cut back whole
        self._synced(self._index, committed)
        self._pending.clear()
        return recs

    def _synced(self, f: _AppendFile, committed_index: int) -> None:
        try:
            f.sync()
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"
            with contextlib.suppress(OSError):
                self._index.cut(committed_index)  # on disk, even unsynced, they would be read
            raise

    def close(self) -> None:
        """Close both files; rows appended since the last commit are not in the store."""
        for f in (self._values, self._index):
            f.close()


class _AppendFile:
    """A new file written at its end in whole pieces: `append` either writes all of a piece or,
    when a write fails part-way (a full disk, after a short write), cuts the file back to where
    the piece began and re-raises, so `size` is always the end of the last whole piece."""

    def __init__(self, path: Path, fault: str | None = None) -> None:
        # A new file, never reopened for writing; unbuffered: rows are large, and a close after
        # a failed write has nothing left to flush.
        self._f = path.open("xb", buffering=0)
        self._fault = fault  # the fault plan's stage before each write call (tests)
        self.size = 0

    def append(self, data: memoryview) -> None:
        total = data.nbytes
        try:
            while data.nbytes:
                if self._fault:
                    faults.point(self._fault)  # tests: a full disk in the middle of a row
                n = self._f.write(data[:WRITE_CHUNK])  # may be short (a disk filling up)
                data = data[n:]
        except BaseException:
            self._f.truncate(self.size)  # the partial piece, off again (or raises: no more rows)
            self._f.seek(self.size)
            raise
        self.size += total

    def sync(self) -> None:
        os.fsync(self._f.fileno())

    def cut(self, size: int) -> None:
        """Drop everything after `size` (whole pieces written since)."""
        self._f.truncate(size)
        self._f.seek(size)
        self.size = size

    def close(self) -> None:
        self._f.close()
