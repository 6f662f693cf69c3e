"""`target_weights_digest`: which weights a target directory holds, without reading them all.

A feature store is only valid for the weights that computed it, and a resumed run only for the
target it trained on; a digest of config.json alone cannot tell two fine-tunes of one base model
apart, and reading every byte of a 70 GB checkpoint to hash it costs minutes. So the digest
reads what identifies the weights: config.json's bytes, then per weight file (by name) its size
and safetensors header (every tensor's name, dtype, shape and offsets), and the first and last
`SAMPLE_BYTES` of every tensor. Sizes and headers tell another architecture or precision; the
samples tell another fine-tune of the same config: a full fine-tune or a merged LoRA changes
every element of the tensors it touches, and rows added at the end (new token embeddings) fall
in the last bytes. A weight file of another format is sampled at `OTHER_SAMPLES` evenly spread
spots. A moved directory digests the same. Cost: a 70B target (~720 tensors) reads about 6 MiB
(README, Stopping and resuming).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import BinaryIO

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth")
SAMPLE_BYTES = 4096
"""Bytes read at the start and at the end of every tensor (safetensors), and of each of
`OTHER_SAMPLES` spots in a weight file of another format."""
OTHER_SAMPLES = 64


def target_weights_digest(target_dir: str | Path) -> str:
    """sha256 hex of the target's config and weights (see the module docstring); a ValueError
    naming the directory when it has no config.json or no weight file."""
    root = Path(target_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"target directory {root} has no config.json")
    files = sorted({p for pattern in WEIGHT_FILES for p in root.glob(pattern) if p.is_file()})
    if not files:
        raise ValueError(f"target directory {root} holds no weight files (*.safetensors, *.bin)")
    h = hashlib.sha256(config.read_bytes())
    for path in files:
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            header = _safetensors_header(f, size)
            h.update(header)
            for begin, end in _sample_spans(header, size):
                f.seek(begin)
                h.update(f.read(end - begin))
    return h.hexdigest()


def _safetensors_header(f: BinaryIO, size: int) -> bytes:
    """The JSON header of a safetensors file (8-byte little-endian length, then the JSON), or
    nothing for another format."""
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else 0
    return f.read(n) if 0 < n <= min(size - 8, 100 * 2**20) else b""


def _sample_spans(header: bytes, size: int) -> list[tuple[int, int]]:
    """Byte ranges to read: each tensor's first and last `SAMPLE_BYTES` (file offsets), or
    `OTHER_SAMPLES` evenly spread ones where there is no safetensors header."""
    try:
        tensors = json.loads(header) if header else None
    except ValueError:
        tensors = None
    if not isinstance(tensors, dict):
        last = max(0, size - SAMPLE_BYTES)
        return [
            (last * i // (OTHER_SAMPLES - 1), last * i // (OTHER_SAMPLES - 1) + SAMPLE_BYTES)
            for i in range(OTHER_SAMPLES)
        ]
    base = 8 + len(header)
    spans = []
    for name in sorted(k for k in tensors if k != "__metadata__"):
        begin, end = (base + x for x in tensors[name]["data_offsets"])
        spans.append((begin, min(end, begin + SAMPLE_BYTES)))
        spans.append((max(begin, end - SAMPLE_BYTES), end))
    return spans
