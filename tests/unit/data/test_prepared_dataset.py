"""A damaged prepared dataset is refused in one line naming the file and what to do."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_train.data.dataset import PreparedDataset, write_prepared


@pytest.fixture
def good(tmp_path) -> Path:
    rows = [(np.arange(n, dtype=np.int32), np.ones(n, dtype=np.uint8)) for n in (5, 7, 3)]
    write_prepared(tmp_path / "good", rows)
    return tmp_path / "good"


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _swap_offsets(f: Path) -> None:
    o = np.load(f)
    o[1], o[2] = o[2], o[1]
    o[0] = 3
    np.save(f, o)


@pytest.mark.parametrize(
    ("file", "damage"),
    [
        ("input_ids.npy", lambda f: f.write_bytes(b"garbage")),
        ("input_ids.npy", _truncate),
        ("loss_mask.npy", lambda f: f.write_bytes(b"")),
        ("summary.json", lambda f: f.write_text("[oops")),
        ("summary.json", lambda f: f.write_text("[1, 2]")),
        ("offsets.npy", _swap_offsets),
        ("offsets.npy", lambda f: np.save(f, np.array([[0, 1]], dtype=np.int64))),
    ],
    ids=["garbage", "truncated", "empty", "bad json", "json list", "offsets", "2-d offsets"],
)
def test_a_damaged_file_is_named_with_what_to_do(good, tmp_path, file, damage):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    damage(bad / file)
    with pytest.raises(ValueError) as e:
        PreparedDataset(bad)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{bad / file} is damaged" in msg
    assert "re-run `dflash-train prepare` with --overwrite" in msg


def test_an_intact_dataset_loads(good):
    ds = PreparedDataset(good)
    assert len(ds) == 3 and ds.row(1)[0].tolist() == list(range(7))
