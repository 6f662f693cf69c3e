"""`FeatureStore`: a store directory opened to read rows and, when writable, to append them.

    FEATURES/manifest.json       binding (target digest, data identity, layers, dtype) + shards
    FEATURES/shard-00000.bin     values, append-only (`shards`, `codec`)
    FEATURES/shard-00000.idx     index records, append-only

Reading a row is one contiguous slice of a memory-mapped value file; nothing is unpickled. Each
writing session (a capture, a resumed capture, a hybrid run) appends to new shards of its own,
opened when the current one passes `shard_bytes`, and lists each in the manifest as it opens it,
so a committed shard is never written again; opening writable first cuts off what an
interrupted commit left (`shards.recover`) and removes shard files the manifest never listed.
A row is stored at most once: appending a row the store holds (or has pending) is a no-op, so
two workers that compute the same row write it once.
"""

from __future__ import annotations

import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_train.config import human_bytes
from dflash_train.store import shards
from dflash_train.store.codec import bytes_per_token
from dflash_train.store.manifest import Binding, Manifest, binding_problems, fsync_path

SHARD_PATTERN = re.compile(r"shard-\d{5}\.(bin|idx)")
DEFAULT_SHARD_BYTES = 4 * 2**30


class FeatureStore:
    """An opened store: `present()`, `row_bytes(row)`, and (writable) `append` / `commit`.

    Thread-safe: appends and commits are serialised by one lock; reads need none (a row's
    entry is published only once its bytes are durable).
    """

    def __init__(self, path: Path, manifest: Manifest, writable: bool, shard_bytes: int) -> None:
        self.path, self.manifest, self.writable = path, manifest, writable
        b = manifest.binding
        self.bytes_per_token = bytes_per_token(b.dtype, len(b.layer_ids), b.hidden_size)
        self.shard_bytes = shard_bytes
        self.shard_of = np.full(b.num_rows, -1, dtype=np.int32)  # -1: not stored
        self.offset_of = np.zeros(b.num_rows, dtype=np.int64)
        self.tokens_of = np.zeros(b.num_rows, dtype=np.int64)
        self._maps: dict[int, np.memmap] = {}
        self._lock = threading.Lock()
        self._writer: shards.ShardWriter | None = None
        self._pending: set[int] = set()
        for i, name in enumerate(manifest.shards):
            recs = shards.read_index(path, name, self.bytes_per_token, b.num_rows)
            if writable:
                shards.recover(path, name, recs, self.bytes_per_token)
            self._publish(i, recs)
        if writable:
            self._remove_unlisted()

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, path: str | Path) -> FeatureStore:
        """A store to read (a ValueError naming what is wrong when it is not one, or damaged)."""
        path = Path(path)
        return cls(path, Manifest.read(path), writable=False, shard_bytes=DEFAULT_SHARD_BYTES)

    @classmethod
    def open_for_append(
        cls,
        path: str | Path,
        binding: Binding,
        target: str,
        data: str,
        overwrite: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ) -> FeatureStore:
        """A store to write `binding`'s features into: the existing one at `path` when its
        binding is the same (appending resumes it), else a new one. A store of other features
        is refused in one line unless `overwrite` (which deletes it)."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise ValueError(f"feature store {path} is a file, not a directory")
        if path.exists() and overwrite:
            _remove_store(path)
        if path.exists() and any(path.iterdir()):
            manifest = Manifest.read(path)
            problems = binding_problems(manifest.binding, binding)
            if manifest.binding.dtype != binding.dtype:
                problems.append(f"it holds {manifest.binding.dtype}, not {binding.dtype}")
            if problems:
                raise ValueError(
                    f"feature store {path} holds other features: {'; '.join(problems)} (give "
                    "another directory, or --overwrite to replace it)"
                )
        else:
            path.mkdir(parents=True, exist_ok=True)
            manifest = Manifest(binding, target=target, data=data)
            manifest.write(path)
        return cls(path, manifest, writable=True, shard_bytes=shard_bytes)

    # ------------------------------------------------------------------ read
    @property
    def binding(self) -> Binding:
        return self.manifest.binding

    def present(self) -> np.ndarray:
        """(rows,) bool: which rows the store holds (committed)."""
        return self.shard_of >= 0

    def stored_bytes(self) -> int:
        """Bytes of every committed row's values."""
        return int(self.tokens_of.sum()) * self.bytes_per_token

    def row_bytes(self, row: int) -> np.ndarray:
        """Row `row`'s bytes (uint8, 1-D): a view of the memory-mapped value file."""
        shard = int(self.shard_of[row])
        if shard < 0:
            raise KeyError(f"row {row} is not in the feature store {self.path}")
        start = int(self.offset_of[row])
        end = start + int(self.tokens_of[row]) * self.bytes_per_token
        return self._map(shard, end)[start:end]

    def _map(self, shard: int, end: int) -> np.memmap:
        mm = self._maps.get(shard)
        if mm is None or len(mm) < end:  # the shard being written has grown since
            with self._lock:
                mm = self._maps.get(shard)
                if mm is None or len(mm) < end:
                    values, _ = shards.shard_paths(self.path, self.manifest.shards[shard])
                    mm = np.memmap(values, dtype=np.uint8, mode="r")
                    self._maps[shard] = mm
        return mm

    # ------------------------------------------------------------------ write
    def append(self, row: int, data: np.ndarray, tokens: int) -> None:
        """Append one row's bytes (`codec.encode_row`), unless the store holds it already or
        has it pending; it is in the store after the next `commit`."""
        assert self.writable, "append to a store opened for writing"
        assert data.nbytes == tokens * self.bytes_per_token, "a row's bytes are tokens x B/token"
        with self._lock:
            if self.shard_of[row] >= 0 or row in self._pending:
                return
            writer = self._writer
            if writer is not None and writer.size and writer.size + data.nbytes > self.shard_bytes:
                self._commit_locked()
                writer.close()
                writer = None
            if writer is None:
                writer = self._writer = self._new_shard()
            writer.append(row, data, tokens)
            self._pending.add(row)

    def commit(self) -> int:
        """Make every appended row durable and readable; how many rows it committed."""
        with self._lock:
            return self._commit_locked()

    def close(self) -> None:
        """Close the shard being written; rows appended since the last commit are dropped."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._pending.clear()

    def _commit_locked(self) -> int:
        if self._writer is None:
            return 0
        recs = self._writer.commit()
        self._publish(len(self.manifest.shards) - 1, recs)
        self._pending.difference_update(int(r) for r in recs["row"])
        return len(recs)

    def _new_shard(self) -> shards.ShardWriter:
        """The next shard's empty files, then its name in the manifest (a crash in between
        leaves unlisted files, removed when the store is next opened for writing)."""
        name = f"shard-{len(self.manifest.shards):05d}"
        writer = shards.ShardWriter(self.path, name)
        fsync_path(self.path)
        self.manifest.shards.append(name)
        self.manifest.write(self.path)
        return writer

    def _publish(self, shard: int, recs: np.ndarray) -> None:
        rows = recs["row"]
        if (self.shard_of[rows] >= 0).any() or len(np.unique(rows)) != len(rows):
            raise ValueError(f"feature store {self.path}: a row is stored twice (damaged store)")
        self.offset_of[rows] = recs["offset"]
        self.tokens_of[rows] = recs["tokens"]
        self.shard_of[rows] = shard  # last: a reader that sees it sees the rest

    def _remove_unlisted(self) -> None:
        listed = {f"{n}.{ext}" for n in self.manifest.shards for ext in ("bin", "idx")}
        for p in self.path.iterdir():
            if SHARD_PATTERN.fullmatch(p.name) and p.name not in listed:
                p.unlink()


def _remove_store(path: Path) -> None:
    """Delete a directory that is a feature store (refuse anything else)."""
    if any(path.iterdir()):
        Manifest.read(path)  # raises unless it is a store
    shutil.rmtree(path)


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `path`."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


@dataclass(frozen=True)
class SizeEstimate:
    """What a capture will write, before it starts."""

    bytes_per_token: int
    rows: int
    tokens: int
    rows_left: int
    tokens_left: int
    free: int

    @property
    def bytes_left(self) -> int:
        """Values and index records still to write."""
        return self.tokens_left * self.bytes_per_token + self.rows_left * shards.RECORD.itemsize

    @property
    def fits(self) -> bool:
        return self.bytes_left <= self.free

    def describe(self, binding: Binding) -> str:
        b = binding
        scales = f" + {len(b.layer_ids)} fp32 scales" if b.dtype == "fp8" else ""
        stored = self.rows - self.rows_left
        done = f", {stored} stored already" if stored else ""
        return (
            f"feature store estimate: {len(b.layer_ids)} layers x {b.hidden_size} hidden in "
            f"{b.dtype}{scales} = {self.bytes_per_token} bytes per token; {self.tokens} tokens "
            f"in {self.rows} rows{done}; {human_bytes(self.bytes_left)} to write "
            f"({self.bytes_left} bytes), {human_bytes(self.free)} free"
        )


def estimate(
    binding: Binding, lengths: np.ndarray, present: np.ndarray | None, out: str | Path
) -> SizeEstimate:
    """The size of `binding`'s store for rows of `lengths` tokens, the rows not yet `present`."""
    bpt = bytes_per_token(binding.dtype, len(binding.layer_ids), binding.hidden_size)
    left = lengths if present is None else lengths[~present]
    return SizeEstimate(
        bpt, len(lengths), int(lengths.sum()), len(left), int(left.sum()), free_bytes(out)
    )
