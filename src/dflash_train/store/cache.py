"""The hybrid (`train --cache-features DIR`): compute features online once, read them after.

`CachingReader` stands where a target worker's feature source would: for each batch the plan
alone decides which rows come from the store and which from the target (`FeatureCache.reads`),
never thread timing or what an interrupted session committed, because a lossy store (bf16,
fp8) rounds what it holds and so the source changes what is trained:

- a row the store held when the run first started (`FeatureCache.start`, kept by the run's
  checkpoints) is always read;
- otherwise, in the run's epoch 0 the row is computed (and stored when admitted and not yet
  stored); in epochs >= 1 an admitted row is read and a row not admitted is computed.

An epoch-1 batch may reach a worker before the epoch-0 batch holding one of its rows has been
stored (several workers and prefetchers, or on another node). Such a row is still read from the
store: when another worker of this node is storing it, the reader waits for that commit (with a
timeout and the stop event: `RowClaims`); when nobody is, it computes and stores the row itself
first (waiting there could deadlock: the epoch-0 batch may sit in a queue behind this one) and
reads it back, and the epoch-0 batch then computes it as the plan says, without storing it
again. `rows_to_cache` chooses the rows (`admit`) when `--cache-budget` cannot hold them all.

On a CUDA target the rows to store are encoded and copied to pinned host memory on a side lane
of the target's device, after the forward: the target's own stream carries only its work, and
the host waits for those copies alone (it writes the bytes next). Rows are picked and placed
by device copies, never through a host index copy that would wait for the forward.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from dflash_train.config import human_bytes
from dflash_train.devices import Lane, host_tensor, marks_here
from dflash_train.store.codec import encode_batch, row_records
from dflash_train.store.reader import StoreReader
from dflash_train.store.shards import RECORD
from dflash_train.store.store import FeatureStore

WAIT_SLICE_S = 0.5
"""A waiter re-checks the stop event this often (a stop does not notify the claims' condition)."""


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


class RowClaims:
    """Rows a worker of this node is computing in order to store them. A reader that must read
    such a row waits for it (`claim_missing`) instead of computing it a second time; a claim
    ends (`release`) once its rows are committed, or failed: then a waiter computes them."""

    def __init__(self) -> None:
        self._claimed: set[int] = set()
        self._cond = threading.Condition()

    def try_claim(self, rows: np.ndarray) -> list[int]:
        """Claim those of `rows` nobody has claimed; the ones claimed (without waiting)."""
        with self._cond:
            mine = [int(r) for r in rows if int(r) not in self._claimed]
            self._claimed.update(mine)
            return mine

    def release(self, rows: list[int]) -> None:
        if rows:
            with self._cond:
                self._claimed.difference_update(rows)
                self._cond.notify_all()

    def claim_missing(
        self,
        rows: np.ndarray,
        present: Callable[[], np.ndarray],
        timeout_s: float,
        stop: threading.Event | None,
    ) -> list[int] | None:
        """Of `rows`, the ones the store lacks, claimed for the caller to compute and store;
        first waits while another worker has a claim on one of them (its commit, or its
        failure, ends the wait). None: `stop` was set while waiting. TimeoutError after
        `timeout_s` (the other worker is stuck)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                missing = [int(r) for r in rows[~present()[rows]]]
                busy = [r for r in missing if r in self._claimed]
                if not busy:
                    self._claimed.update(missing)
                    return missing
                if stop is not None and stop.is_set():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"feature cache: rows {busy[:4]} were being stored by another worker and "
                        f"were not committed within {timeout_s:g}s"
                    )
                self._cond.wait(min(left, WAIT_SLICE_S))


@dataclass
class FeatureCache:
    """What the CachingReaders of a node share: the store, the rows it may keep (`admit`), the
    rows' lengths, the rows it held when the run first started and the claims in flight."""

    store: FeatureStore
    admit: np.ndarray
    lengths: np.ndarray
    start: dict[str, int]
    """`store.committed_counts()` when the run first started: its checkpoints keep it."""
    wait_timeout_s: float = 900.0
    held: np.ndarray = field(init=False)
    """(rows,) bool: the rows of `start`, always read."""
    claims: RowClaims = field(default_factory=RowClaims)

    def __post_init__(self) -> None:
        self.held = self.store.rows_held(self.start)

    @classmethod
    def open(
        cls,
        store: FeatureStore,
        admit: np.ndarray,
        lengths: np.ndarray,
        wait_timeout_s: float = 900.0,
        start: dict[str, int] | None = None,
    ) -> FeatureCache:
        """The cache of a run starting now (`start` None) or resumed (its first start's)."""
        start = store.committed_counts() if start is None else dict(start)
        return cls(store, admit, lengths, start, wait_timeout_s)

    def restart_from(self, start: dict[str, int]) -> None:
        """A resumed run: the rows held when its first session started are the ones read."""
        self.held = self.store.rows_held(start)
        self.start = dict(start)

    def reads(self, seq_ids: np.ndarray, epoch: int) -> np.ndarray:
        """(batch,) bool: which rows of a batch of epoch `epoch` come from the store (the rest
        from the target), by the module's rule: a function of the plan alone."""
        held = self.held[seq_ids]
        return held if epoch == 0 else held | self.admit[seq_ids]


class CachingReader:
    """A batch's features by `cache`'s rule: read from the store with `reader`, or computed by
    `target` (only those rows: a smaller forward); computed rows the cache admits and does not
    hold are stored (see the module docstring)."""

    def __init__(self, target: Target, cache: FeatureCache, reader: StoreReader) -> None:
        self.target, self.cache, self.reader = target, cache, reader
        self.device = target.device
        self._copies = Lane(target.device)  # where stored rows are encoded and copied out
        b = cache.store.binding
        self.dtype, self.num_layers = b.dtype, len(b.layer_ids)
        self.rows_computed = 0
        """Rows this reader ran through the target."""

    @property
    def admit(self) -> np.ndarray:
        return self.cache.admit

    def read(
        self,
        seq_ids: np.ndarray,
        input_ids: torch.Tensor,
        epoch: int = 0,
        stop: threading.Event | None = None,
    ) -> torch.Tensor:
        """(batch, L, K * hidden) features of rows `seq_ids` of a batch of epoch `epoch`."""
        c = self.cache
        from_store = c.reads(seq_ids, epoch)
        wanted = seq_ids[from_store]
        if not c.store.present()[wanted].all():
            c.store.refresh()  # another node's part may hold them by now
        to_store = c.claims.claim_missing(wanted, c.store.present, c.wait_timeout_s, stop)
        if to_store is None:  # stopped while waiting: the batch is never trained
            shape = (len(seq_ids), input_ids.shape[1], self.reader.width)
            return torch.zeros(shape, dtype=self.reader.dtype, device=self.reader.device)
        compute = ~from_store | np.isin(seq_ids, to_store)
        if epoch == 0:  # the rows computed now that the store should keep and lacks
            new = ~from_store & self.admit[seq_ids] & ~c.store.present()[seq_ids]
            to_store += c.claims.try_claim(seq_ids[new])
        try:
            computed = self._compute(seq_ids, input_ids, compute, to_store)
        finally:
            c.claims.release(to_store)
        unread = wanted[~c.store.present()[wanted]]
        if len(unread):
            raise RuntimeError(f"feature cache: rows {unread[:4].tolist()} were not stored")
        return self._assemble(seq_ids, input_ids, from_store, compute, computed)

    def _compute(
        self,
        seq_ids: np.ndarray,
        input_ids: torch.Tensor,
        compute: np.ndarray,
        to_store: list[int],
    ) -> torch.Tensor | None:
        """The target's features of the `compute` rows, (m, L, K * hidden); the ones in
        `to_store` are appended and committed."""
        idx = np.flatnonzero(compute)
        if not len(idx):
            return None
        computed = self.target(input_ids[torch.from_numpy(idx)])
        self.rows_computed += len(idx)
        chosen = np.flatnonzero(np.isin(seq_ids[idx], to_store))
        if len(chosen):
            ids = seq_ids[idx][chosen]
            lengths = [int(self.cache.lengths[sid]) for sid in ids]
            picked = torch.stack([computed[int(i)] for i in chosen])  # (m', L, K * hidden)
            rows = self._records(picked, lengths)
            for sid, data, n in zip(ids, rows, lengths, strict=True):
                self.cache.store.append(int(sid), data, n)
            self.cache.store.commit()
        return computed

    def _records(self, picked: torch.Tensor, lengths: list[int]) -> list[np.ndarray]:
        """The store records of `picked`'s rows: encoded and copied to the host (pinned with a
        CUDA target) on the side lane, after this thread's forward; the host waits for that
        lane's mark only, then splits the batch's bytes into rows."""
        (forward,) = marks_here([picked.device])
        with self._copies.active():
            forward.wait_here()
            encoded = [
                t for t in encode_batch(picked, self.dtype, self.num_layers) if t is not None
            ]
            host = [host_tensor(tuple(t.shape), t.dtype, self.reader.pinned) for t in encoded]
            for h, t in zip(host, encoded, strict=True):
                h.copy_(t, non_blocking=True)
            copied = self._copies.mark()
        copied.wait_host()  # the bytes are written next
        values, *scales = [h.numpy() for h in host]
        return row_records(values, scales[0] if scales else None, lengths)

    def _assemble(
        self,
        seq_ids: np.ndarray,
        input_ids: torch.Tensor,
        from_store: np.ndarray,
        compute: np.ndarray,
        computed: torch.Tensor | None,
    ) -> torch.Tensor:
        """The batch: the rows the plan computes from `computed`, the others read."""
        if not from_store.any():
            return computed
        read = self.reader.features(seq_ids[from_store], input_ids.shape[1])
        if from_store.all():
            return read
        out = torch.empty(
            (len(seq_ids), *read.shape[1:]), dtype=computed.dtype, device=computed.device
        )
        # Row by row, device copies: the batch's row r from computed's or read's row.
        source = np.where(from_store, np.cumsum(from_store) - 1, 0)
        within = np.searchsorted(np.flatnonzero(compute), np.arange(len(seq_ids)))
        for r in range(len(seq_ids)):
            out[r] = read[int(source[r])] if from_store[r] else computed[int(within[r])]
        return out
