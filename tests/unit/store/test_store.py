"""The feature store on disk: append-only shards, exactly-once rows, crash recovery, and one
clear error for each way a store can be damaged or be of other features."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from dflash_train.store.codec import decode_row, encode_row
from dflash_train.store.manifest import MANIFEST_FILE, Binding
from dflash_train.store.shards import RECORD
from dflash_train.store.store import FeatureStore, estimate

K, H, ROWS = 2, 8, 10
LENGTHS = np.array([3, 5, 2, 7, 4, 6, 1, 8, 3, 5])
BINDING = Binding("t" * 64, "d" * 64, ROWS, (1, 3), H, "fp32")


def feats(row: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(row)
    return torch.randn(int(LENGTHS[row]), K * H, generator=g)


def write(store: FeatureStore, rows) -> None:
    for r in rows:
        store.append(r, encode_row(feats(r), "fp32", K), int(LENGTHS[r]))


def read(store: FeatureStore, row: int) -> torch.Tensor:
    raw = torch.from_numpy(np.array(store.row_bytes(row)))
    return decode_row(raw, int(LENGTHS[row]), K, H, "fp32", torch.float32)


def new_store(path, **kw) -> FeatureStore:
    return FeatureStore.open_for_append(path, BINDING, "target", "data", **kw)


def test_committed_rows_read_back_and_uncommitted_ones_are_not_in_the_store(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0, 3, 5])
    assert not store.present().any()  # appended, not committed
    assert store.commit() == 3
    write(store, [7])
    store.close()  # row 7 was never committed
    again = FeatureStore.open(tmp_path / "f")
    assert np.flatnonzero(again.present()).tolist() == [0, 3, 5]
    for r in (0, 3, 5):
        assert torch.equal(read(again, r), feats(r))


def test_a_row_is_written_once_however_often_it_is_appended(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [2, 2])
    store.commit()
    write(store, [2])
    assert store.commit() == 0
    store.close()
    idx = np.fromfile(tmp_path / "f" / "shard-00000.idx", dtype=RECORD)
    assert idx["row"].tolist() == [2]


def test_a_resumed_session_writes_new_shards_and_cuts_an_interrupted_commits_tail(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0, 1])
    store.commit()
    write(store, [2])  # bytes written, never committed: a crash before the commit
    store._writer._values.close()  # (the process died: nothing else happens)
    with open(tmp_path / "f" / "shard-00000.idx", "ab") as f:
        f.write(b"\x01\x02\x03")  # and a partial index record from a commit cut short
    resumed = new_store(tmp_path / "f")
    values = tmp_path / "f" / "shard-00000.bin"
    assert values.stat().st_size == (3 + 5) * K * H * 4  # rows 0 and 1 only
    assert (tmp_path / "f" / "shard-00000.idx").stat().st_size == 2 * RECORD.itemsize
    write(resumed, [2, 3])
    resumed.commit()
    resumed.close()
    store = FeatureStore.open(tmp_path / "f")
    assert store.manifest.shards == ["shard-00000", "shard-00001"]
    assert np.flatnonzero(store.present()).tolist() == [0, 1, 2, 3]
    assert all(torch.equal(read(store, r), feats(r)) for r in range(4))


def test_shards_rotate_at_shard_bytes_and_every_row_stays_one_contiguous_read(tmp_path):
    store = new_store(tmp_path / "f", shard_bytes=10 * K * H * 4)  # ~10 tokens per shard
    write(store, range(ROWS))
    store.commit()
    store.close()
    store = FeatureStore.open(tmp_path / "f")
    assert len(store.manifest.shards) > 3
    assert store.present().all()
    assert all(torch.equal(read(store, r), feats(r)) for r in range(ROWS))


def test_unlisted_shard_files_from_a_crash_are_removed_before_writing(tmp_path):
    new_store(tmp_path / "f").close()
    stray = tmp_path / "f" / "shard-00000.bin"
    stray.write_bytes(b"x" * 100)  # created, then the process died before listing it
    store = new_store(tmp_path / "f")
    assert not stray.exists()
    write(store, [4])
    store.commit()
    assert FeatureStore.open(tmp_path / "f").present()[4]


def test_a_store_of_other_features_is_refused_and_overwrite_replaces_only_a_store(tmp_path):
    new_store(tmp_path / "f").close()
    other = Binding("x" * 64, "d" * 64, ROWS, (1, 3), H, "fp32")
    with pytest.raises(ValueError, match="another target"):
        FeatureStore.open_for_append(tmp_path / "f", other, "t", "d")
    fp8 = Binding("t" * 64, "d" * 64, ROWS, (1, 3), H, "fp8")
    with pytest.raises(ValueError, match="holds fp32, not fp8"):
        FeatureStore.open_for_append(tmp_path / "f", fp8, "t", "d")
    FeatureStore.open_for_append(tmp_path / "f", other, "t", "d", overwrite=True).close()
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "precious.txt").write_text("not a store")
    with pytest.raises(ValueError, match="not a feature store"):
        FeatureStore.open_for_append(tmp_path / "g", other, "t", "d", overwrite=True)
    assert (tmp_path / "g" / "precious.txt").exists()


def test_damaged_stores_are_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        FeatureStore.open(tmp_path / "nowhere")
    store = new_store(tmp_path / "f")
    write(store, [0, 1, 2])
    store.commit()
    store.close()
    values, index = tmp_path / "f" / "shard-00000.bin", tmp_path / "f" / "shard-00000.idx"
    os.truncate(values, values.stat().st_size - 1)
    with pytest.raises(ValueError, match="shard-00000.bin is truncated"):
        FeatureStore.open(tmp_path / "f")
    index.unlink()
    with pytest.raises(ValueError, match="index shard-00000.idx of shard shard-00000 is missing"):
        FeatureStore.open(tmp_path / "f")
    (tmp_path / "f" / MANIFEST_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a readable feature store manifest"):
        FeatureStore.open(tmp_path / "f")
    (tmp_path / "f" / MANIFEST_FILE).unlink()
    with pytest.raises(ValueError, match="not a feature store: it has no manifest.json"):
        FeatureStore.open(tmp_path / "f")


def test_inconsistent_index_records_are_refused(tmp_path):
    store = new_store(tmp_path / "f")
    write(store, [0, 1])
    store.commit()
    store.close()
    index = tmp_path / "f" / "shard-00000.idx"
    recs = np.fromfile(index, dtype=RECORD)
    recs["row"][1] = 0  # the same row twice
    recs.tofile(index)
    with pytest.raises(ValueError, match="stored twice"):
        FeatureStore.open(tmp_path / "f")
    recs["row"][1], recs["offset"][1] = 1, 12345  # a hole in the value file
    recs.tofile(index)
    with pytest.raises(ValueError, match="inconsistent records"):
        FeatureStore.open(tmp_path / "f")


def test_the_estimate_counts_the_rows_left_and_their_index_records(tmp_path):
    present = np.zeros(ROWS, dtype=bool)
    present[:4] = True
    est = estimate(BINDING, LENGTHS, present, tmp_path / "new" / "dir")
    assert est.bytes_per_token == K * H * 4
    left = int(LENGTHS[4:].sum())
    assert est.bytes_left == left * K * H * 4 + 6 * RECORD.itemsize
    assert est.free > 0 and est.fits
    assert "64 bytes per token" in est.describe(BINDING) and "4 stored already" in est.describe(
        BINDING
    )
