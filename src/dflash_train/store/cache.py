"""The hybrid (`train --cache-features DIR`): compute features online once, read them after.

`CachingReader` stands where a target worker's feature source would: for a batch, the rows the
store holds are read; the others go through the target (only those rows: a smaller forward) and,
if they are among the rows chosen for the store, are appended and committed. The first epoch
therefore computes every row and writes the chosen ones; later epochs read those and compute
the rest. The store is keyed by row, not by epoch, so a resumed run (in either phase) reads what
any earlier session committed and writes what is missing.

`rows_to_cache` chooses the rows when `--cache-budget` cannot hold them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from dflash_train.config import human_bytes
from dflash_train.store.codec import encode_rows
from dflash_train.store.reader import StoreReader
from dflash_train.store.shards import RECORD
from dflash_train.store.store import FeatureStore


class Target(Protocol):
    """A target's feature source (the pipeline's `FeatureSource`)."""

    device: torch.device

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class CachePlan:
    """Which rows the store keeps: `admit[row]`, and why, in one line."""

    admit: np.ndarray
    reason: str


def rows_to_cache(
    lengths: np.ndarray, padded: np.ndarray, bytes_per_token: int, budget: int | None
) -> CachePlan:
    """Every row when the budget holds them (or there is none); else the rows that save the
    most target work per stored byte, until the budget is spent.

    A cached row saves, every later epoch, the target forward of its padded length (its batch's
    bucket; the forward runs on the rows not cached) and costs its own length in store bytes, so
    its worth per byte is padded / own length: the short rows of each bucket come first (ties:
    lower row id). `padded`: each row's bucket length.
    """
    cost = lengths.astype(np.int64) * bytes_per_token + RECORD.itemsize
    total = int(cost.sum())
    if budget is None or total <= budget:
        why = f"all {len(lengths)} rows fit ({human_bytes(total)})"
        return CachePlan(np.ones(len(lengths), dtype=bool), why)
    worth = padded / lengths
    order = np.lexsort((np.arange(len(lengths)), -worth))  # best first, then by id
    k = int(np.searchsorted(np.cumsum(cost[order]), budget, side="right"))
    admit = np.zeros(len(lengths), dtype=bool)
    admit[order[:k]] = True
    kept = int(lengths[admit].sum())
    why = (
        f"--cache-budget {human_bytes(budget)} holds {k} of {len(lengths)} rows "
        f"({kept} of {int(lengths.sum())} tokens, {human_bytes(int(cost[admit].sum()))} of "
        f"{human_bytes(total)}): those saving the most target work per stored byte (bucket length "
        f"/ row length, so the short rows of each bucket); the other {len(lengths) - k} rows are "
        "computed online every epoch"
    )
    return CachePlan(admit, why)


class CachingReader:
    """A batch's features from the store where it has them, from `target` where not; computed
    rows that `admit` chooses are written to the store (see the module docstring)."""

    def __init__(
        self,
        target: Target,
        store: FeatureStore,
        reader: StoreReader,
        admit: np.ndarray,
        lengths: np.ndarray,
    ) -> None:
        self.target, self.store, self.reader = target, store, reader
        self.device = target.device
        self.admit, self.lengths = admit, lengths
        b = store.binding
        self.dtype, self.num_layers = b.dtype, len(b.layer_ids)
        self.rows_computed = 0
        """Rows this reader ran through the target."""

    def read(self, seq_ids: np.ndarray, input_ids: torch.Tensor) -> torch.Tensor:
        have = self.store.present()[seq_ids]
        if have.all():
            return self.reader.read(seq_ids, input_ids)
        miss = np.flatnonzero(~have)
        computed = self.target(input_ids[torch.from_numpy(miss)])  # (m, L, K * hidden)
        self.rows_computed += len(miss)
        self._write(seq_ids[miss], computed)
        if not have.any():
            return computed
        hit = np.flatnonzero(have)
        out = torch.empty(
            (len(seq_ids), *computed.shape[1:]), dtype=computed.dtype, device=computed.device
        )
        out[torch.from_numpy(miss).to(out.device)] = computed
        out[torch.from_numpy(hit).to(out.device)] = self.reader.read(
            seq_ids[hit], input_ids[torch.from_numpy(hit)]
        ).to(out.device, out.dtype)
        return out

    def _write(self, ids: np.ndarray, computed: torch.Tensor) -> None:
        """Append the chosen rows (their own tokens, not the padding) and commit them."""
        chosen = np.flatnonzero(self.admit[ids])
        if not len(chosen):
            return
        lengths = [int(self.lengths[sid]) for sid in ids[chosen]]
        picked = computed[torch.from_numpy(chosen).to(computed.device)]
        rows = encode_rows(picked, lengths, self.dtype, self.num_layers)
        for sid, data, n in zip(ids[chosen], rows, lengths, strict=True):
            self.store.append(int(sid), data, n)
        self.store.commit()
