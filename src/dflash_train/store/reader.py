"""`StoreReader`: a feature reader that takes a target worker's place (`train --features`).

It has the shape of the pipeline's `FeatureReader`: a batch's row ids and padded token ids in,
the rows' stored features out, (batch, L, K * hidden), right-padded with zeros (padded positions
are never read: context is only what precedes an anchor, and anchors lie inside the row).

A batch is staged first (`StoredRows`): each row's stored bytes, the asked layers only, copied
once out of the memory-mapped shard into one host buffer per batch, in pinned memory when a
CUDA device reads it. Where it is decoded:
- a reader on the host for CUDA drafters (`train --features`) hands the staged bytes over
  undecoded (`codec.StagedRows`): each drafter copies them on its own stream, asynchronously,
  and decodes them on its device (fp8 is never expanded to float32 on the host, and the copy
  and the queue carry 1 byte a value);
- a reader on a CUDA device (the hybrid's, on its target's lane) copies the batch there in one
  asynchronous copy per tensor and decodes it there;
- without CUDA, the host decodes it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.devices import host_tensor
from dflash_train.store.codec import SCALE_BYTES, VALUE_BYTES, StagedRows
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
    order), as `dtype` on `device`; `pinned`: stage in page-locked memory (a CUDA device reads
    the batch: the reader's own, or, from a reader on the host, the drafters'). One per reader
    thread; `stats` may be shared."""

    def __init__(
        self,
        store: FeatureStore,
        layer_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        stats: ReadStats | None = None,
        pinned: bool = False,
    ) -> None:
        b = store.binding
        self.store, self.device, self.dtype, self.pinned = store, device, dtype, pinned
        self.num_layers, self.hidden = len(b.layer_ids), b.hidden_size
        self.width = len(layer_ids) * b.hidden_size
        # None: every stored layer, in stored order; else the stored positions of the asked.
        self.picks: list[int] | None = None
        if list(layer_ids) != list(b.layer_ids):
            self.picks = [b.layer_ids.index(i) for i in layer_ids]
        self.stats = stats or ReadStats()

    def read(
        self,
        seq_ids: np.ndarray,
        input_ids: torch.Tensor,
        epoch: int = 0,
        stop: threading.Event | None = None,
    ) -> torch.Tensor | StagedRows:
        """(batch, L, K * hidden) features of rows `seq_ids`, L = input_ids' padded length (a
        captured store is read alike in every epoch and never waits: `epoch`, `stop` unused);
        from a pinned reader on the host, the staged bytes (decoded by the drafter)."""
        staged = self.stage(seq_ids, input_ids.shape[1])
        if self.pinned and self.device.type == "cpu":
            return staged
        return staged.to_device(self.device)

    def features(self, seq_ids: np.ndarray, length: int) -> torch.Tensor:
        """Rows `seq_ids` padded to `length` tokens, decoded on this reader's device (copied
        there on the calling thread's stream, one copy per tensor, asynchronous if pinned)."""
        return self.stage(seq_ids, length).to_device(self.device)

    def stage(self, seq_ids: np.ndarray, length: int) -> StagedRows:
        """Rows `seq_ids` in their stored form, padded to `length` tokens, in one host buffer
        per tensor (pinned if `pinned`): one copy of each row's bytes out of the mapped shard
        (the read: page cache or disk)."""
        t0 = time.perf_counter()
        dtype, k = self.store.binding.dtype, len(self.picks or range(self.num_layers))
        vbytes = self.hidden * VALUE_BYTES[dtype]  # one layer of one token
        rows = len(seq_ids)
        values = host_tensor((rows, length, k * vbytes), torch.uint8, self.pinned)
        scales = None
        if dtype == "fp8":
            scales = host_tensor((rows, length, k * SCALE_BYTES), torch.uint8, self.pinned)
        v_out, s_out = values.numpy(), None if scales is None else scales.numpy()
        nbytes = 0
        for r, sid in enumerate(seq_ids):
            n = int(self.store.tokens_of[sid])
            assert n <= length, f"row {sid} has {n} stored tokens, its batch {length}"
            raw = self.store.row_bytes(int(sid))  # a view of the mapped shard: no copy yet
            nbytes += raw.size
            split = n * self.num_layers * vbytes
            v_out[r, :n] = self._layers(raw[:split], n, vbytes)
            if s_out is not None:
                s_out[r, :n] = self._layers(raw[split:], n, SCALE_BYTES)
        self.stats.add(nbytes, time.perf_counter() - t0)
        return StagedRows(values, scales, dtype, self.dtype)

    def _layers(self, raw: np.ndarray, n: int, per_layer: int) -> np.ndarray:
        """A row's bytes (n tokens x stored layers x `per_layer` bytes), the asked layers."""
        by_layer = raw.reshape(n, self.num_layers, per_layer)
        return (by_layer if self.picks is None else by_layer[:, self.picks]).reshape(n, -1)
