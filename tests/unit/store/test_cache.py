"""The hybrid's source rule on `CachingReader` itself: whether a row of a batch comes from the
store or from the target follows from the plan (the batch's epoch, the rows the store held when
the run first started, the rows admitted), never from the order batches arrive in or from what
an interrupted session committed. A lossy store (bf16 here) makes the source visible: a read row
is rounded, a computed one is not."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from dflash_train.store.cache import CachingReader, FeatureCache, RowClaims
from dflash_train.store.codec import encode_row
from dflash_train.store.manifest import Binding
from dflash_train.store.reader import StoreReader
from dflash_train.store.shards import RECORD
from dflash_train.store.store import FeatureStore

K, H, ROWS, L = 2, 4, 8, 8
LENGTHS = np.array([3, 8, 5, 2, 7, 4, 6, 1])
ADMIT = np.array([True, True, True, True, True, False, True, True])  # row 5: never stored
CPU = torch.device("cpu")
BINDING = Binding("t", "d", ROWS, (1, 2), H, "bf16")
# Two epochs of a plan: row 0 is in the store before the run; row 5 is not admitted.
PLAN = [
    (0, [1, 2]),
    (0, [3, 4, 5]),
    (0, [0, 6, 7]),
    (1, [2, 5, 0]),
    (1, [7, 1]),
    (1, [4, 6, 3]),
]


def row_features(row: int) -> torch.Tensor:
    """(n, K * H) values bf16 cannot hold exactly."""
    g = torch.Generator().manual_seed(row)
    return torch.randn(int(LENGTHS[row]), K * H, generator=g)


def rounded(row: int) -> torch.Tensor:
    return row_features(row).to(torch.bfloat16).to(torch.float32)


class Target:
    """Computes `row_features` from the token ids (row id in token 0); counts what it saw."""

    device = CPU

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.rows_seen: list[int] = []
        self.entered = threading.Event()
        self.gate = gate

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30), "the test never opened the gate"
        out = torch.zeros(input_ids.shape[0], L, K * H)
        for b, row in enumerate(input_ids[:, 0].tolist()):
            self.rows_seen.append(row)
            out[b, : LENGTHS[row]] = row_features(row)
        return out


def stored_rows(path) -> list[int]:
    """Every record's row, over every shard: a row stored twice shows twice."""
    recs = [np.fromfile(f, dtype=RECORD)["row"] for f in sorted(path.glob("shard-*.idx"))]
    return sorted(np.concatenate(recs).tolist())


def open_store(path) -> FeatureStore:
    return FeatureStore.open_for_append(path, BINDING, "t", "d")


def store_with_row_0(path) -> FeatureStore:
    store = open_store(path)
    store.append(0, encode_row(row_features(0), "bf16", K), int(LENGTHS[0]))
    store.commit()
    return store


def reader_of(cache: FeatureCache, target: Target | None = None) -> CachingReader:
    reader = StoreReader(cache.store, [1, 2], CPU, torch.float32)
    return CachingReader(target or Target(), cache, reader)


def batch(rows: list[int]) -> tuple[np.ndarray, torch.Tensor]:
    ids = np.array(rows)
    return ids, torch.tensor(ids)[:, None].expand(len(ids), L).contiguous()


def sources(out: torch.Tensor, rows: list[int]) -> list[str]:
    """Per row of a batch's features, where they came from (the store rounds to bf16)."""
    got = []
    for b, r in enumerate(rows):
        x = out[b, : LENGTHS[r]]
        if torch.equal(x, row_features(r)):
            got.append("target")
        else:
            assert torch.equal(x, rounded(r)), r
            got.append("store")
    return got


EXPECTED = {  # the rule: held at start -> store; epoch 0 -> target; admitted -> store
    (e, tuple(rows)): ["store" if r == 0 or (e >= 1 and ADMIT[r]) else "target" for r in rows]
    for e, rows in PLAN
}


def run(cache: FeatureCache, order: list[int]) -> dict:
    reader = reader_of(cache)
    out = {}
    for i in order:
        epoch, rows = PLAN[i]
        ids, input_ids = batch(rows)
        out[(epoch, tuple(rows))] = sources(reader.read(ids, input_ids, epoch), rows)
    return out


@pytest.mark.parametrize(
    "order",
    [[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2], [5, 2, 3, 0, 4, 1]],
    ids=["plan order", "epoch 1 first", "mixed"],
)
def test_where_a_row_comes_from_follows_the_plan_whatever_order_batches_arrive_in(tmp_path, order):
    store = store_with_row_0(tmp_path / "f")
    cache = FeatureCache.open(store, ADMIT, LENGTHS)
    assert run(cache, order) == EXPECTED
    assert stored_rows(tmp_path / "f") == [0, 1, 2, 3, 4, 6, 7]  # each admitted row once


def test_a_resumed_run_computes_in_epoch_0_the_rows_its_interrupted_session_stored(tmp_path):
    store = store_with_row_0(tmp_path / "f")
    cache = FeatureCache.open(store, ADMIT, LENGTHS)
    start = cache.start  # what the run's checkpoints keep
    run(cache, [0, 1])  # the first session stores rows 1-4, then is interrupted
    store.close()
    resumed = open_store(tmp_path / "f")
    assert resumed.present()[[1, 2, 3, 4]].all()
    # The batches in flight at the stop are produced again: their rows still come from the
    # target, as in the uninterrupted run, and are not stored twice.
    assert run(FeatureCache.open(resumed, ADMIT, LENGTHS, start=start), range(6)) == EXPECTED
    resumed.close()
    assert stored_rows(tmp_path / "f") == [0, 1, 2, 3, 4, 6, 7]
    # Without the first session's start, its rows would be read in epoch 0: another training.
    again = FeatureCache.open(open_store(tmp_path / "f"), ADMIT, LENGTHS)
    assert run(again, [0]) == {(0, (1, 2)): ["store", "store"]}


class WatchedClaims(RowClaims):
    """Claims that say when a reader starts waiting on one."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def claim_missing(self, rows, present, timeout_s, stop):
        if any(r in self._claimed and not present()[r] for r in rows.tolist()):
            self.waiting.set()
        return super().claim_missing(rows, present, timeout_s, stop)


def test_an_epoch_1_read_waits_for_the_epoch_0_batch_storing_its_row(tmp_path):
    store = open_store(tmp_path / "f")
    cache = FeatureCache(store, ADMIT, LENGTHS, store.committed_counts(), 30.0, WatchedClaims())
    gate = threading.Event()
    first, second = Target(gate), Target()
    outs: dict[str, torch.Tensor] = {}

    def read(name, reader, rows, epoch):
        outs[name] = reader.read(*batch(rows), epoch)

    epoch0 = threading.Thread(target=read, args=("e0", reader_of(cache, first), [2, 3], 0))
    epoch0.start()
    assert first.entered.wait(30)  # the epoch-0 batch is computing rows 2 and 3 to store them
    epoch1 = threading.Thread(target=read, args=("e1", reader_of(cache, second), [3], 1))
    epoch1.start()
    assert cache.claims.waiting.wait(30)  # the epoch-1 batch waits for row 3's commit
    gate.set()
    epoch0.join(30)
    epoch1.join(30)
    assert sources(outs["e0"], [2, 3]) == ["target", "target"]
    assert sources(outs["e1"], [3]) == ["store"] and second.rows_seen == []  # not computed


def test_a_wait_ends_on_the_stop_event_and_on_its_timeout(tmp_path):
    store = open_store(tmp_path / "f")
    reader = reader_of(FeatureCache.open(store, ADMIT, LENGTHS, wait_timeout_s=0.05))
    reader.cache.claims.try_claim(np.array([3]))  # a worker storing row 3 that never finishes
    stop = threading.Event()
    stop.set()
    out = reader.read(*batch([3, 5]), 1, stop)  # stopped: never trained, nothing computed
    assert out.shape == (2, L, K * H) and reader.rows_computed == 0
    with pytest.raises(TimeoutError, match=r"rows \[3\] were being stored by another worker"):
        reader.read(*batch([3, 5]), 1, threading.Event())
    reader.cache.claims.release([3])  # its failure ends the claim: the reader stores it itself
    assert sources(reader.read(*batch([3, 5]), 1), [3, 5]) == ["store", "target"]
    assert store.present()[3]
