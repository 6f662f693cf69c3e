"""How many file descriptors reading a feature store of many shards holds open.

    python scripts/store_fds.py --shards 14000 [--out DIR]

Writes a store of SHARDS shards of one 64-byte row each (files written directly, not fsynced:
a store's layout, made fast), opens it, reads every row once in order and prints one JSON line:
the peak of this process's open descriptors above the count before the open (/proc/self/fd),
the shards mapped at the end and the seconds the reads took.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash_train.store.manifest import Binding, Manifest
from dflash_train.store.shards import RECORD, shard_paths
from dflash_train.store.store import FeatureStore

ROW = 64  # bytes: one token of 16 fp32 values


def write_store(path: Path, shards: int) -> None:
    """`shards` shards, row r alone in shard r (its bytes all r % 256)."""
    path.mkdir(parents=True)
    names = [f"shard-{i:05d}" for i in range(shards)]
    for r, name in enumerate(names):
        values, index = shard_paths(path, name)
        np.full(ROW, r % 256, np.uint8).tofile(values)
        np.array([(r, 0, 1)], dtype=RECORD).tofile(index)
    binding = Binding("t" * 64, "d" * 64, shards, (1,), ROW // 4, "fp32")
    Manifest(binding, shards=names).write(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=14000)
    parser.add_argument("--out", default=None, help="where to write it (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp) / "store"
        write_store(root, args.shards)
        print(json.dumps(measure(root, args.shards)))


def measure(root: Path, shards: int) -> dict[str, float]:
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    before = fds()
    store = FeatureStore.open(root)
    peak, t0 = 0, time.perf_counter()
    for r in range(shards):
        assert np.array(store.row_bytes(r))[0] == r % 256
        if r % 100 == 0 or r == shards - 1:
            peak = max(peak, fds() - before)
    seconds = round(time.perf_counter() - t0, 2)
    maps = getattr(store, "open_maps", lambda: len(store._maps))()  # (main has no open_maps)
    return {"shards": shards, "peak_extra_fds": peak, "maps_open": maps, "read_s": seconds}


if __name__ == "__main__":
    main()
