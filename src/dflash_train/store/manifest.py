"""The store's manifest (`manifest.json`): what the features are of, and the shards holding them.

The binding fields say which features these are: the target's weights digest
(`model.digest.target_weights_digest`), the prepared data's identity
(`PreparedDataset.identity()`: its fingerprint, row lengths and token counts), the target layer
ids in their stored order, the hidden size, the dtype and the number of rows. A reader compares
them with what it needs (`binding_problems`) and refuses a store that differs, in one line. Paths
are recorded for the message only: a store, its target and its data may move.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_FILE = "manifest.json"
FORMAT = "dflash-train feature store"
FORMAT_VERSION = 1
SHARD_NAME = re.compile(r"shard-\d{5}", re.ASCII)
"""A shard's name: a plain file name in the store's own directory (no separator, no '..')."""


@dataclass(frozen=True)
class Binding:
    """What a store's features are of; two stores with equal bindings hold the same values."""

    target_digest: str
    data_identity: str
    num_rows: int
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str


@dataclass
class Manifest:
    """`manifest.json`, read and written whole (atomically: a temporary file, then a rename)."""

    binding: Binding
    target: str = ""
    data: str = ""
    shards: list[str] = field(default_factory=list)
    """Shard names in creation order (`NAME.bin` values, `NAME.idx` index)."""

    def to_json(self) -> dict[str, Any]:
        b = asdict(self.binding)
        b["layer_ids"] = list(self.binding.layer_ids)
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            **b,
            "target": self.target,
            "data": self.data,
            "shards": list(self.shards),
        }

    @classmethod
    def read(cls, store_dir: Path) -> Manifest:
        """The manifest of `store_dir`; one ValueError when it is missing or not a store's."""
        path = store_dir / MANIFEST_FILE
        if not store_dir.is_dir():
            raise ValueError(
                f"feature store {store_dir} does not exist (run `dflash-train capture` first)"
            )
        if not path.is_file():
            raise ValueError(f"{store_dir} is not a feature store: it has no {MANIFEST_FILE}")
        try:
            d = json.loads(path.read_text())
            if d.get("format") != FORMAT or d.get("version") != FORMAT_VERSION:
                raise ValueError(f"format {d.get('format')!r} version {d.get('version')!r}")
            binding = Binding(
                str(d["target_digest"]),
                str(d["data_identity"]),
                int(d["num_rows"]),
                tuple(int(i) for i in d["layer_ids"]),
                int(d["hidden_size"]),
                str(d["dtype"]),
            )
            shards = [str(s) for s in d["shards"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}: not a readable feature store manifest ({e})") from e
        check_shard_names(path, shards)
        return cls(binding, str(d["target"]), str(d["data"]), shards)

    def write(self, store_dir: Path) -> None:
        tmp = store_dir / f".{MANIFEST_FILE}.tmp"
        with tmp.open("w") as f:
            f.write(json.dumps(self.to_json(), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, store_dir / MANIFEST_FILE)
        fsync_path(store_dir)


def check_shard_names(path: Path, shards: list[str]) -> None:
    """Refuse, in one line, a manifest whose shard list names anything but this store's own
    shard files, once each: opening a store to write cuts its shards' tails, so a crafted name
    (a path, '..') would reach files outside it."""
    for name in shards:
        if not SHARD_NAME.fullmatch(name):
            raise ValueError(
                f"{path}: shard name {name!r} is not one of a feature store's (shard-NNNNN, a "
                "file in the store's own directory): the manifest is damaged; capture the store "
                "again with --overwrite"
            )
    if len(set(shards)) != len(shards):
        raise ValueError(f"{path}: a shard is listed twice: the manifest is damaged")


def binding_problems(have: Binding, want: Binding, subset_layers: bool = False) -> list[str]:
    """How a store's binding `have` differs from the one a reader needs, `want` (its dtype is
    the store's own choice, never a difference). With `subset_layers` the store may hold more
    layers than wanted, in any order (a reader picks the ones it needs)."""
    problems = []
    if have.target_digest != want.target_digest:
        problems.append("it was captured from another target (its weights digest differs)")
    if have.data_identity != want.data_identity or have.num_rows != want.num_rows:
        problems.append("it was captured from other data (the prepared dataset's identity differs)")
    missing = [i for i in want.layer_ids if i not in have.layer_ids]
    if missing if subset_layers else have.layer_ids != want.layer_ids:
        problems.append(
            f"it holds target layers {list(have.layer_ids)}, the drafter reads "
            f"{list(want.layer_ids)}"
        )
    if have.hidden_size != want.hidden_size:
        problems.append(f"its hidden size is {have.hidden_size}, the target's {want.hidden_size}")
    return problems


def fsync_path(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (a rename, a new file), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
