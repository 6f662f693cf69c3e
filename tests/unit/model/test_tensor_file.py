"""Safetensors files written a chunk at a time: what safetensors reads back, the sha256 of the
bytes on disk, every byte counted, and a cancel that stops the writer at its next chunk."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_train.model import tensor_file
from dflash_train.model.tensor_file import (
    WriteCancelled,
    WriteMeter,
    file_sha256,
    tensors_nbytes,
    write_bytes,
    write_safetensors,
)


def mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 5, generator=g),
        "half": torch.randn(4, generator=g).to(torch.bfloat16),
        "count": torch.tensor(7, dtype=torch.int64),  # 0-d, as AdamW's step
        "flags": torch.tensor([True, False, True]),
        "bits": torch.arange(5, dtype=torch.uint8),  # odd sizes before wider dtypes
        "empty": torch.zeros(0, 3),
        "f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "strided": torch.randn(4, 6, generator=g).t(),  # not contiguous
    }


def test_what_safetensors_reads_back_is_what_was_written(tmp_path):
    tensors = mixed_tensors()
    meter = WriteMeter(total=tensors_nbytes(tensors))
    record = write_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"}, meter)
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    size = (tmp_path / "x.safetensors").stat().st_size
    assert record.size == size and record.sha256 == file_sha256(tmp_path / "x.safetensors")
    assert meter.done == size > meter.total  # the header counted too


def test_write_bytes_records_size_and_sha256(tmp_path):
    record = write_bytes(tmp_path / "a.json", b'{"a": 1}\n')
    assert (tmp_path / "a.json").read_bytes() == b'{"a": 1}\n'
    assert record.size == 9 and record.sha256 == file_sha256(tmp_path / "a.json")


def test_a_cancelled_write_stops_at_its_next_chunk_and_cannot_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(tensor_file, "CHUNK_BYTES", 64)
    meter = WriteMeter()
    original = meter.add

    def cancel_after_first_chunk(n: int) -> None:
        original(n)
        meter.cancel()

    meter.add = cancel_after_first_chunk
    with pytest.raises(WriteCancelled):
        write_safetensors(tmp_path / "x.safetensors", {"w": torch.zeros(1000)}, meter=meter)
    assert meter.done == 64  # one chunk, then it stopped
    with pytest.raises(WriteCancelled):
        meter.commit()
    committed = WriteMeter()
    committed.commit()
    assert committed.cancel() is False  # once committed, the write finishes
