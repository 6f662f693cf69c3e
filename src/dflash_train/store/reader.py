"""`StoreReader`: a feature reader that takes a target worker's place (`train --features`).

It has the shape of the pipeline's `FeatureReader`: a batch's row ids and padded token ids in,
the rows' stored features out, (batch, L, K * hidden), right-padded with zeros (padded positions
are never read: context is only what precedes an anchor, and anchors lie inside the row). Each
row is one contiguous read out of a memory-mapped shard, decoded on the reader's device.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.store.codec import decode_row
from dflash_train.store.store import FeatureStore


@dataclass
class ReadStats:
    """Bytes, batches and seconds of the reads so far (summed over reader threads)."""

    bytes: int = 0
    batches: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes += nbytes
            self.batches += 1
            self.seconds += seconds


class StoreReader:
    """Rows of `store`, the layers `layer_ids` of them (a subset of the stored ones, in this
    order), as `dtype` on `device`. One per reader thread; `stats` may be shared."""

    def __init__(
        self,
        store: FeatureStore,
        layer_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        stats: ReadStats | None = None,
    ) -> None:
        b = store.binding
        self.store, self.device, self.dtype = store, device, dtype
        self.num_layers, self.hidden = len(b.layer_ids), b.hidden_size
        self.width = len(layer_ids) * b.hidden_size
        self.columns: torch.Tensor | None = None  # None: every stored layer, in stored order
        if list(layer_ids) != list(b.layer_ids):
            picks = [b.layer_ids.index(i) for i in layer_ids]
            cols = [torch.arange(j * self.hidden, (j + 1) * self.hidden) for j in picks]
            self.columns = torch.cat(cols).to(device)
        self.stats = stats or ReadStats()

    def read(
        self,
        seq_ids: np.ndarray,
        input_ids: torch.Tensor,
        epoch: int = 0,
        stop: threading.Event | None = None,
    ) -> torch.Tensor:
        """(batch, L, K * hidden) features of rows `seq_ids`, L = input_ids' padded length (a
        captured store is read alike in every epoch and never waits: `epoch`, `stop` unused)."""
        t0 = time.perf_counter()
        rows, length = input_ids.shape
        out = torch.zeros(rows, length, self.width, dtype=self.dtype, device=self.device)
        nbytes = 0
        for r, sid in enumerate(seq_ids):
            n = int(self.store.tokens_of[sid])
            assert n <= length, f"row {sid} has {n} stored tokens, its batch {length}"
            # The read: one contiguous copy out of the mapped shard (page cache or disk).
            raw = torch.from_numpy(np.array(self.store.row_bytes(int(sid))))
            nbytes += raw.numel()
            feats = decode_row(
                raw.to(self.device),
                n,
                self.num_layers,
                self.hidden,
                self.store.binding.dtype,
                self.dtype,
            )
            out[r, :n] = feats if self.columns is None else feats.index_select(1, self.columns)
        self.stats.add(nbytes, time.perf_counter() - t0)
        return out
