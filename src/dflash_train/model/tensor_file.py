"""Safetensors files written a chunk at a time: hashed while written, counted, cancellable.

`safetensors.torch.save_file` writes a whole file in one call: nobody can see how far it is (a
12 GB checkpoint on storage at 100 MB/s takes two minutes), stop it, or checksum it without
reading it back. `write_safetensors` writes the same format (an 8-byte little-endian header
length, a JSON header padded with spaces to a multiple of 8, then the tensors' bytes back to
back at the header's offsets) in chunks: each chunk goes to the file and to a sha256, and is
counted in a `WriteMeter` that another thread may watch or cancel. The files read back with
`safetensors.torch.load_file` like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

CHUNK_BYTES = 16 << 20
"""Bytes per write and hash call (large enough that hashlib and write release the GIL)."""
SYNC_BYTES = 256 << 20
"""fdatasync this often: the bytes counted are (nearly) on the disk, not in the page cache, so
a watcher sees the storage's real rate and a whole file never sits dirty in memory."""

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class WriteCancelled(Exception):
    """Raised in the writing thread at its next chunk once its `WriteMeter` was cancelled."""


@dataclass
class WriteMeter:
    """One write's shared state: bytes expected and written (with when the count last moved),
    and whether it was cancelled or committed. The writer checks for a cancel at every chunk
    and claims the commit (`commit`) before it puts its result in place; a cancel after that
    claim fails, so the writer and a canceller never both win. Neither call blocks."""

    total: int = 0
    done: int = 0
    moved_at: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _cancelled: bool = False
    _committed: bool = False

    def add(self, nbytes: int) -> None:
        """`nbytes` more written (0: a step without bytes finished, e.g. an fsync)."""
        self.done += nbytes
        self.moved_at = time.monotonic()

    def check(self) -> None:
        """Raise `WriteCancelled` once the write was cancelled."""
        if self._cancelled:
            raise WriteCancelled("the write was cancelled")

    def commit(self) -> None:
        """The writer's claim, just before it puts its result in place; `WriteCancelled` if a
        cancel came first."""
        with self._lock:
            self.check()
            self._committed = True

    def cancel(self) -> bool:
        """Cancel the write unless its writer already committed; whether it was cancelled."""
        with self._lock:
            if not self._committed:
                self._cancelled = True
            return self._cancelled

    def describe(self, elapsed_s: float) -> str:
        """'3.20 of 12.00 GB written in 60 s (53.3 MB/s)' (MB below a GB)."""
        unit, scale = ("GB", 1e9) if self.total >= 1e9 else ("MB", 1e6)
        rate = self.done / max(elapsed_s, 1e-9) / 1e6
        return (
            f"{self.done / scale:.2f} of {self.total / scale:.2f} {unit} written in "
            f"{elapsed_s:.0f} s ({rate:.1f} MB/s)"
        )


@dataclass(frozen=True)
class FileRecord:
    """A written file's size in bytes and the sha256 of its bytes (hex)."""

    size: int
    sha256: str


def tensors_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """The tensor bytes a safetensors file of `tensors` holds (its header aside)."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _raw(t: torch.Tensor) -> memoryview:
    """A host tensor's bytes, without a copy when it is contiguous (little-endian hosts)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)  # 0-d tensors hold one element
    return memoryview(flat.view(torch.uint8).numpy())


def _header(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> tuple[bytes, list[str]]:
    """The header bytes (length prefix included) and the tensors' order in the file: widest
    dtype first, so every tensor starts at a multiple of its element size."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"tensor {name}: dtype {t.dtype} has no safetensors name here")
        end = offset + t.numel() * t.element_size()
        entries[name] = {
            "dtype": DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


class _HashedFile:
    """Writes to a file and a sha256 together, counting into a meter and syncing every
    `SYNC_BYTES`. A chunk's hash runs on a helper thread while the next chunk is written
    (write and hashlib both release the GIL), so a file costs max(write, hash), not their
    sum. A context manager: the helper thread ends with it."""

    def __init__(self, f: BinaryIO, meter: WriteMeter) -> None:
        self.f, self.meter, self.h = f, meter, hashlib.sha256()
        self.size, self._unsynced = 0, 0
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
        self._hashing: Future[None] | None = None

    def __enter__(self) -> _HashedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._hasher.shutdown(wait=True)  # at most one chunk's hash in flight

    def write(self, data: memoryview | bytes) -> None:
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_BYTES):
            self.meter.check()
            chunk = view[start : start + CHUNK_BYTES]
            self.f.write(chunk)
            self._hash(chunk)
            self.size += len(chunk)
            self._unsynced += len(chunk)
            if self._unsynced >= SYNC_BYTES:
                self.sync()
            self.meter.add(len(chunk))

    def _hash(self, chunk: memoryview) -> None:
        """Hash `chunk` once the previous chunk's hash is done (the order is the file's)."""
        if self._hashing is not None:
            self._hashing.result()
        self._hashing = self._hasher.submit(self.h.update, chunk)

    def sync(self) -> None:
        self.f.flush()
        os.fdatasync(self.f.fileno())
        self._unsynced = 0

    def record(self) -> FileRecord:
        self.sync()
        if self._hashing is not None:
            self._hashing.result()
        self.meter.add(0)
        return FileRecord(self.size, self.h.hexdigest())


def write_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    meter: WriteMeter | None = None,
) -> FileRecord:
    """`tensors` (host tensors) as a safetensors file at `path`, synced to the disk; its size
    and sha256. Raises `WriteCancelled` (the file left partial) once `meter` is cancelled."""
    head, order = _header(tensors, metadata)
    with open(path, "wb") as f, _HashedFile(f, meter or WriteMeter()) as out:
        out.write(head)
        for name in order:
            out.write(_raw(tensors[name]))
        return out.record()


def write_bytes(path: Path, data: bytes, meter: WriteMeter | None = None) -> FileRecord:
    """`data` as the file at `path`, synced to the disk; its size and sha256."""
    with open(path, "wb") as f, _HashedFile(f, meter or WriteMeter()) as out:
        out.write(data)
        return out.record()


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()
