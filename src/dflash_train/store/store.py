"""`FeatureStore`: a store directory opened to read rows and, when writable, to append them.

    FEATURES/manifest.json       binding (target digest, data identity, layers, dtype) + shards
    FEATURES/shard-00000.bin     values, append-only (`shards`, `codec`)
    FEATURES/shard-00000.idx     index records, append-only
    FEATURES/writer.lock         held by the one process writing this directory (`lock`)
    FEATURES/readers.lock        held (shared) by every process reading the store, so that
                                 `capture --overwrite` is refused under them (`lock`)
    FEATURES/rank-00001/...      a part: the same files, written by another node (the hybrid
                                 on several nodes); the store is the union of its parts

Reading a row is one contiguous slice of a memory-mapped value file; nothing is unpickled; at
most `max_maps` shards are mapped at once (each map holds a file descriptor: the least recently
read is dropped first). Each writing session (a capture, a resumed capture, a hybrid run)
appends to new shards of its own part, opened when the current one passes `shard_bytes`, and
lists each in the part's manifest as it opens it, so a committed shard is never written again;
opening writable takes the part's writer lock first (a second writer is refused), then cuts off
what an interrupted commit left (`shards.recover`) and removes shard files the manifest never
listed. A row is stored at most once per part: appending a row the store holds (in any part it
has read) or has pending is a no-op, so two workers that compute the same row write it once.
The other parts are read as their writers commit (`refresh`): a record is whole only after its
values are durable, so what a part's index lists is readable.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash_train.config import human_bytes
from dflash_train.store import shards
from dflash_train.store.codec import bytes_per_token
from dflash_train.store.lock import LOCK_FILES, ReadLock, WriterLock, no_readers
from dflash_train.store.manifest import (
    MANIFEST_FILE,
    Binding,
    Manifest,
    binding_problems,
    fsync_path,
)

SHARD_PATTERN = re.compile(r"shard-\d{5}\.(bin|idx)", re.ASCII)
PART_PATTERN = re.compile(r"rank-(\d{5})", re.ASCII)
DEFAULT_SHARD_BYTES = 4 * 2**30
DEFAULT_MAX_MAPS = 64
"""Shards mapped at once (a file descriptor each); a store of 14K shards reads through 64."""


def part_dir(root: Path, part: int) -> Path:
    """The directory part `part` is written in: the store's own for part 0 (one node's)."""
    return root if part == 0 else root / f"rank-{part:05d}"


@dataclass
class _Part:
    """What the store has read of one part: its shards (store-wide ids, manifest order), the
    records read of its last shard and where their values end, its rows in commit order."""

    number: int
    dir: Path
    seen: np.ndarray
    """(rows,) bool: rows this part holds (a row twice in one part is a damaged store)."""
    shards: list[int] = field(default_factory=list)
    records: int = 0
    end: int = 0
    rows: list[np.ndarray] = field(default_factory=list)
    stamp: tuple[int, int, int] = (0, 0, 0)
    """The manifest's (inode, size, mtime) when last read: unchanged, it is not read again."""

    def committed(self) -> int:
        return sum(len(r) for r in self.rows)


class FeatureStore:
    """An opened store: `present()`, `row_bytes(row)`, and (writable) `append` / `commit`.

    Thread-safe: appends and commits are serialised by one lock; reads need none (a row's
    entry is published only once its bytes are durable).
    """

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        *,
        part: int | None = None,
        lock: WriterLock | None = None,
        read_lock: ReadLock | None = None,
        world: int = 1,
        max_maps: int = DEFAULT_MAX_MAPS,
    ) -> None:
        """`part`: the part written (None: read-only), whose `lock` is held; `read_lock`: a
        reader's hold on the store (`open`); `world`: the parts other writers may create while
        this one is open (the job's nodes)."""
        self.path, self.manifest, self.writable = path, manifest, part is not None
        b = manifest.binding
        self.bytes_per_token = bytes_per_token(b.dtype, len(b.layer_ids), b.hidden_size)
        self.shard_bytes = shard_bytes
        self.shard_of = np.full(b.num_rows, -1, dtype=np.int32)  # -1: not stored
        self.offset_of = np.zeros(b.num_rows, dtype=np.int64)
        self.tokens_of = np.zeros(b.num_rows, dtype=np.int64)
        self._values: list[Path] = []  # each shard id's value file
        self._parts: dict[int, _Part] = {}
        self._maps = _ShardMaps(self._values, max_maps)
        self._lock = threading.Lock()  # appends and commits
        self._refresh_lock = threading.Lock()  # reading the other parts
        self._publish_lock = threading.Lock()  # shard ids and rows' entries, from either
        self._writer: shards.ShardWriter | None = None
        self._pending: set[int] = set()
        self._writer_lock, self._read_lock = lock, read_lock
        self._own = None if part is None else self._part(part)
        self._world = world
        if self._own is not None:
            self._load_own()
        self._found = sorted({0, *_part_numbers(path)})  # the parts there at open
        self.refresh()

    # ------------------------------------------------------------------ open
    @classmethod
    def open(cls, path: str | Path, max_maps: int = DEFAULT_MAX_MAPS) -> FeatureStore:
        """A store to read, every part of it (a ValueError naming what is wrong when it is not
        one, or damaged)."""
        path = Path(path)
        manifest = Manifest.read(path)
        held = ReadLock.acquire(path)
        try:
            return cls(path, manifest, max_maps=max_maps, read_lock=held)
        except BaseException:
            if held is not None:
                held.release()
            raise

    @classmethod
    def open_for_append(
        cls,
        path: str | Path,
        binding: Binding,
        target: str,
        data: str,
        overwrite: bool = False,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        part: int = 0,
        world: int = 1,
    ) -> FeatureStore:
        """A store to write `binding`'s features into, part `part` of it (node `part` of
        `world` writes its own): the existing one at `path` when its binding is the same
        (appending resumes it), else a new one. A store of other features is refused in one line
        unless `overwrite` (which deletes it, refused while another process reads it); so is a
        part another process is writing."""
        path = Path(path)
        own = part_dir(path, part)
        for d in {path, own}:
            if d.exists() and not d.is_dir():
                raise ValueError(f"feature store {d} is a file, not a directory")
        if own.exists() and (overwrite or not (own / MANIFEST_FILE).exists()):
            _check_is_store(own)  # before a lock file lands in a directory of other things
        own.mkdir(parents=True, exist_ok=True)
        lock = WriterLock.acquire(own)
        try:
            if overwrite:
                with no_readers(path):
                    _clear_store(own)
            for other in {0, *_part_numbers(path)} - {part}:  # before a new manifest is written
                _part_manifest(path, other, binding)
            manifest = _own_manifest(own, binding, target, data)
            return cls(path, manifest, shard_bytes, part=part, lock=lock, world=world)
        except BaseException:
            lock.release()
            raise

    # ------------------------------------------------------------------ read
    @property
    def binding(self) -> Binding:
        return self.manifest.binding

    def present(self) -> np.ndarray:
        """(rows,) bool: which rows the store holds (committed, in the parts read so far)."""
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
        return self._maps.get(shard, end)[start:end]

    def open_maps(self) -> int:
        """Shards mapped now (at most `max_maps`)."""
        return len(self._maps)

    def refresh(self) -> None:
        """Read what the other parts' writers committed since the last call (and parts that
        appeared); this store's own part is always up to date."""
        with self._refresh_lock:
            own = None if self._own is None else self._own.number
            for number in sorted({*self._found, *range(self._world)} - {own}):
                part = self._parts.get(number) or self._part(number)
                self._read_part(part)

    def committed_counts(self) -> dict[str, int]:
        """Per part, the rows committed so far: a mark in each part's commit order, so the set
        of rows the store holds now can be told apart later (`rows_held`)."""
        self.refresh()
        return {str(n): p.committed() for n, p in sorted(self._parts.items())}

    def rows_held(self, counts: dict[str, int]) -> np.ndarray:
        """(rows,) bool: the rows the store held when `committed_counts` returned `counts` (a
        ValueError when the store holds fewer now: it was changed or replaced since)."""
        self.refresh()
        held = np.zeros(self.binding.num_rows, dtype=bool)
        for key, n in counts.items():
            part = self._parts.get(int(key))
            have = 0 if part is None else part.committed()
            if have < n:
                raise ValueError(
                    f"feature store {self.path}: part {key} held {n} rows when this run started "
                    f"and holds {have} now: the store was changed or replaced since (give the "
                    "run its store back, or start the run again)"
                )
            if n:
                held[np.concatenate(part.rows)[:n]] = True
        return held

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
                writer = self._writer = None  # if the next shard fails, no append reuses it
            if writer is None:
                writer = self._writer = self._new_shard()
            writer.append(row, data, tokens)
            self._pending.add(row)

    def commit(self) -> int:
        """Make every appended row durable and readable; how many rows it committed."""
        with self._lock:
            return self._commit_locked()

    def close(self) -> None:
        """Close the shard being written and free the part for the next writer, or a reader's
        hold on the store; rows appended since the last commit are dropped."""
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._pending.clear()
            self._maps.clear()  # their descriptors: a closed store may be replaced or deleted
            for held in (self._writer_lock, self._read_lock):
                if held is not None:
                    held.release()

    def _commit_locked(self) -> int:
        if self._writer is None:
            return 0
        recs = self._writer.commit()
        self._publish(self._own, self._own.shards[-1], recs)
        self._pending.difference_update(int(r) for r in recs["row"])
        return len(recs)

    def _new_shard(self) -> shards.ShardWriter:
        """The next shard's empty files, then its name in the manifest (a crash in between
        leaves unlisted files, removed when the store is next opened for writing)."""
        own = self._own
        number = 1 + max((int(n.split("-")[1]) for n in self.manifest.shards), default=-1)
        if number > 99999:
            raise ValueError(f"feature store {own.dir} has 100000 shards: give a larger shard size")
        name = f"shard-{number:05d}"
        writer = shards.ShardWriter(own.dir, name)
        try:
            fsync_path(own.dir)
            self.manifest.shards.append(name)
            self.manifest.write(own.dir)
        except BaseException:
            # Listed nowhere: its empty files go now (or, failing that, when the store is next
            # opened for writing), so the next append starts the shard again.
            if self.manifest.shards[-1:] == [name]:
                self.manifest.shards.pop()
            writer.close()
            for path in shards.shard_paths(own.dir, name):
                with contextlib.suppress(OSError):
                    path.unlink()
            raise
        self._add_shard(own, name)
        return writer

    # ------------------------------------------------------------------ parts
    def _part(self, number: int) -> _Part:
        part = _Part(number, part_dir(self.path, number), np.zeros(len(self.shard_of), bool))
        self._parts[number] = part
        return part

    def _add_shard(self, part: _Part, name: str) -> int:
        """A store-wide id for shard `name` of `part`, whose records are read from the start."""
        with self._publish_lock:
            self._values.append(shards.shard_paths(part.dir, name)[0])
            part.shards.append(len(self._values) - 1)
            part.records = part.end = 0
            return part.shards[-1]

    def _load_own(self) -> None:
        """The written part's committed rows, its interrupted commits cut off, its unlisted
        shard files (a crash between creating one and listing it) removed."""
        own = self._own
        for name in self.manifest.shards:
            shard = self._add_shard(own, name)
            recs = shards.read_index(own.dir, name, self.bytes_per_token, len(self.shard_of))
            shards.recover(own.dir, name, recs, self.bytes_per_token)
            self._publish(own, shard, recs)
        listed = {f"{n}.{ext}" for n in self.manifest.shards for ext in ("bin", "idx")}
        for p in own.dir.iterdir():
            if SHARD_PATTERN.fullmatch(p.name) and p.name not in listed:
                p.unlink()

    def _read_part(self, part: _Part) -> None:
        """What another writer's part committed since it was last read: the rest of its last
        shard read, then the shards its manifest lists since (a writer lists a shard before it
        writes to it and never returns to an older one)."""
        try:
            st = (part.dir / MANIFEST_FILE).stat()
        except FileNotFoundError:
            return  # not created yet (or no such part): nothing committed
        names = [self._values[i].stem for i in part.shards]
        if (st.st_ino, st.st_size, st.st_mtime_ns) != part.stamp:
            manifest = _part_manifest(self.path, part.number, self.binding)
            part.stamp, names = (st.st_ino, st.st_size, st.st_mtime_ns), manifest.shards
        if part.shards:
            self._read_records(part, names[len(part.shards) - 1], part.shards[-1])
        for name in names[len(part.shards) :]:
            self._read_records(part, name, self._add_shard(part, name))

    def _read_records(self, part: _Part, name: str, shard: int) -> None:
        bpt, rows = self.bytes_per_token, len(self.shard_of)
        recs = shards.read_index(part.dir, name, bpt, rows, start=part.records, offset=part.end)
        if len(recs):
            self._publish(part, shard, recs)

    def _publish(self, part: _Part, shard: int, recs: np.ndarray) -> None:
        """Make `recs` of `part`'s `shard` readable; a row another part holds already keeps
        that part's copy (the same features)."""
        rows = recs["row"]
        if part.seen[rows].any() or len(np.unique(rows)) != len(rows):
            raise ValueError(f"feature store {part.dir}: a row is stored twice (damaged store)")
        part.seen[rows] = True
        part.rows.append(rows.copy())
        part.records += len(recs)
        part.end = shards.committed_bytes(recs, self.bytes_per_token)
        with self._publish_lock:  # a row two parts hold: one entry, whole, from one of them
            new = self.shard_of[rows] < 0
            rows, recs = rows[new], recs[new]
            self.offset_of[rows] = recs["offset"]
            self.tokens_of[rows] = recs["tokens"]
            self.shard_of[rows] = shard  # last: a reader that sees it sees the rest


class _ShardMaps:
    """The shards' value files, mapped read-only on first read, at most `limit` at once (each
    map holds a file descriptor): the least recently read is dropped first, and unmapped (its
    descriptor closed) as soon as no read holds a view of it."""

    def __init__(self, paths: list[Path], limit: int) -> None:
        assert limit >= 1, "at least one shard mapped"
        self._paths, self.limit = paths, limit
        self._maps: OrderedDict[int, np.memmap] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._maps)

    def get(self, shard: int, end: int) -> np.memmap:
        """Shard `shard`'s values, mapped to at least byte `end`."""
        with self._lock:
            mm = self._maps.get(shard)
            if mm is None or len(mm) < end:  # not mapped, or the shard being written has grown
                mm = np.memmap(self._paths[shard], dtype=np.uint8, mode="r")
                self._maps[shard] = mm
            self._maps.move_to_end(shard)
            while len(self._maps) > self.limit:
                self._maps.popitem(last=False)
            return mm

    def clear(self) -> None:
        """Drop every map: each is unmapped (its descriptor closed) once no read holds a view."""
        with self._lock:
            self._maps.clear()


def _part_numbers(root: Path) -> list[int]:
    """The parts written by other nodes found in `root`."""
    if not root.is_dir():
        return []
    return [int(m[1]) for p in root.iterdir() if (m := PART_PATTERN.fullmatch(p.name))]


def _is_store_entry(p: Path) -> bool:
    """What a store directory holds besides a manifest: its locks, a part, a manifest's
    temporary file (a crash while creating it)."""
    return p.name in (*LOCK_FILES, f".{MANIFEST_FILE}.tmp") or bool(PART_PATTERN.fullmatch(p.name))


def _check_is_store(d: Path) -> None:
    """Refuse (one line) a directory that holds anything but a feature store or its parts."""
    if (d / MANIFEST_FILE).exists() or not all(_is_store_entry(p) for p in d.iterdir()):
        Manifest.read(d)  # raises unless it is a store


def _problems(manifest: Manifest, binding: Binding) -> list[str]:
    """How the features of `manifest` differ from `binding`'s, its dtype included."""
    problems = binding_problems(manifest.binding, binding)
    if manifest.binding.dtype != binding.dtype:
        problems.append(f"it holds {manifest.binding.dtype}, not {binding.dtype}")
    return problems


def _part_manifest(root: Path, number: int, binding: Binding) -> Manifest | None:
    """Part `number`'s manifest (None: not written yet), refused in one line when it holds
    other features than `binding`'s."""
    d = part_dir(root, number)
    if not (d / MANIFEST_FILE).exists():
        return None
    manifest = Manifest.read(d)
    if problems := _problems(manifest, binding):
        raise ValueError(
            f"feature store {root}: its part {number} ({d}) holds other features: "
            f"{'; '.join(problems)}"
        )
    return manifest


def _own_manifest(own: Path, binding: Binding, target: str, data: str) -> Manifest:
    """The manifest of the part about to be written (its writer lock held): the existing one
    when it holds `binding`'s features (refused in one line when not), else a new one."""
    if (own / MANIFEST_FILE).exists():
        manifest = Manifest.read(own)
        if problems := _problems(manifest, binding):
            raise ValueError(
                f"feature store {own} holds other features: {'; '.join(problems)} (give "
                "another directory, or --overwrite to replace it)"
            )
        return manifest
    _check_is_store(own)
    manifest = Manifest(binding, target=target, data=data)
    manifest.write(own)
    return manifest


def _clear_store(d: Path) -> None:
    """Delete what a store directory holds (checked to be one), but its locks, held by us."""
    _check_is_store(d)
    for p in d.iterdir():
        if p.name in LOCK_FILES:
            continue
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


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
