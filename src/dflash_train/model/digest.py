"""`target_weights_digest`: which weights a target directory holds, without reading them all.

A feature store is only valid for the weights that computed it, and a resumed run only for the
target it trained on; a digest of config.json alone cannot tell two fine-tunes of one base model
apart. Reading every byte of a 16 GB checkpoint to hash it costs minutes, so the digest reads
what identifies the weights: config.json's bytes, then for every weight file (sorted by name)
its name, its size, its safetensors header (every tensor's name, dtype, shape and byte range)
and `SAMPLES` blocks of `SAMPLE_BYTES` spread evenly over its data. Any retraining changes
nearly every value, so a sampled block differs; a moved directory digests the same. Cost: about
1 MiB read per weight file.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024


def target_weights_digest(target_dir: str | Path) -> str:
    """sha256 hex of the target's config and weight files (see the module docstring); a
    ValueError naming the directory when it has no config.json or no weight file."""
    root = Path(target_dir)
    config = root / "config.json"
    if not config.is_file():
        raise ValueError(f"target directory {root} has no config.json")
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ValueError(f"target directory {root} holds no weight files (*.safetensors, *.bin)")
    h = hashlib.sha256(config.read_bytes())
    for path in files:
        h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode())
        _digest_file(path, h)
    return h.hexdigest()


def _digest_file(path: Path, h: hashlib._Hash) -> None:
    """The safetensors header (if the file is one) and evenly spaced blocks of the data."""
    size = path.stat().st_size
    with path.open("rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))  # little-endian u64, then JSON
            if 8 + header_len <= size:
                h.update(f.read(header_len))
                start = 8 + header_len
        span = size - start
        if span <= SAMPLES * SAMPLE_BYTES:
            f.seek(start)
            h.update(f.read())
            return
        stride = (span - SAMPLE_BYTES) // (SAMPLES - 1)
        for i in range(SAMPLES):
            f.seek(start + i * stride)
            h.update(f.read(SAMPLE_BYTES))
