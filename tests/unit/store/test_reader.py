"""Readers: a batch's rows from the store, padded to the batch length, the layers a drafter
asks for; the hybrid computes only the rows the store lacks and stores the chosen ones."""

from __future__ import annotations

import numpy as np
import torch

from dflash_train.store.cache import CachingReader, FeatureCache, rows_to_cache
from dflash_train.store.codec import encode_row
from dflash_train.store.manifest import Binding
from dflash_train.store.reader import StoreReader
from dflash_train.store.store import FeatureStore

K, H, ROWS, L = 3, 4, 6, 8
LENGTHS = np.array([3, 8, 5, 2, 7, 4])
CPU = torch.device("cpu")


def row_features(row: int) -> torch.Tensor:
    """(n, K * H): layer j of token t of row r holds 100 r + 10 j + t (easy to check)."""
    n = int(LENGTHS[row])
    t = torch.arange(n, dtype=torch.float32)[:, None, None]
    j = torch.arange(K, dtype=torch.float32)[None, :, None]
    return (100 * row + 10 * j + t).expand(n, K, H).reshape(n, K * H).clone()


def store_with(tmp_path, rows) -> FeatureStore:
    binding = Binding("t", "d", ROWS, (2, 5, 7), H, "fp32")
    store = FeatureStore.open_for_append(tmp_path / "f", binding, "t", "d")
    for r in rows:
        store.append(r, encode_row(row_features(r), "fp32", K), int(LENGTHS[r]))
    store.commit()
    return store


def test_a_batch_is_its_rows_padded_with_zeros_in_the_asked_layer_order(tmp_path):
    store = store_with(tmp_path, range(ROWS))
    ids = np.array([4, 0, 3])
    out = StoreReader(store, [7, 2], CPU, torch.float32).read(
        ids, torch.zeros(3, L, dtype=torch.long)
    )
    assert out.shape == (3, L, 2 * H)
    for b, r in enumerate(ids):
        n = int(LENGTHS[r])
        want = row_features(r).view(n, K, H)[:, [2, 0]].reshape(n, 2 * H)
        assert torch.equal(out[b, :n], want)
        assert not out[b, n:].any()


class CountingTarget:
    """A target that computes `row_features` from the token ids (row id in token 0)."""

    device = CPU

    def __init__(self) -> None:
        self.rows_seen: list[int] = []

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(input_ids.shape[0], input_ids.shape[1], K * H)
        for b, row in enumerate(input_ids[:, 0].tolist()):
            self.rows_seen.append(row)
            n = int(LENGTHS[row])
            out[b, :n] = row_features(row)
        return out


def test_the_hybrid_computes_only_missing_rows_and_stores_the_admitted_ones(tmp_path):
    store = store_with(tmp_path, [1])
    admit = np.array([True, True, False, True, True, True])
    target = CountingTarget()
    store_reader = StoreReader(store, [2, 5, 7], CPU, torch.float32)
    reader = CachingReader(target, FeatureCache.open(store, admit, LENGTHS), store_reader)
    ids = np.array([1, 2, 3])
    input_ids = torch.tensor(ids)[:, None].expand(3, L).contiguous()
    out = reader.read(ids, input_ids, epoch=0)
    assert target.rows_seen == [2, 3]  # row 1 came from the store
    for b, r in enumerate(ids):
        assert torch.equal(out[b, : LENGTHS[r]], row_features(r))
    assert np.flatnonzero(store.present()).tolist() == [1, 3]  # row 2 is not admitted
    target.rows_seen.clear()
    reader.read(np.array([3, 1]), input_ids[[2, 0]], epoch=1)
    assert target.rows_seen == []  # every row stored: no forward at all


def test_all_rows_are_kept_when_the_budget_holds_them():
    plan = rows_to_cache(LENGTHS, np.full(ROWS, L), 16, None)
    assert plan.admit.all() and "all 6 rows fit" in plan.reason
    plan = rows_to_cache(LENGTHS, np.full(ROWS, L), 16, 10**9)
    assert plan.admit.all()


def test_a_small_budget_keeps_the_rows_that_save_the_most_target_work_per_byte():
    padded = np.array([8, 8, 8, 4, 8, 4])  # two buckets
    # worth = padded / length: row 3 (4/2) = 2.0, row 0 (8/3), row 5 (4/4) = 1, row 2 (8/5),
    # row 4 (8/7), row 1 (8/8) = 1 -> order 0 (2.67), 3 (2.0), 2 (1.6), 4 (1.14), 1, 5 (ties by id)
    cost = LENGTHS * 16 + 24
    budget = int(cost[[0, 3, 2]].sum())
    plan = rows_to_cache(LENGTHS, padded, 16, budget)
    assert np.flatnonzero(plan.admit).tolist() == [0, 2, 3]
    assert (
        "holds 3 of 6 rows" in plan.reason and "the other 3 rows are computed online" in plan.reason
    )
