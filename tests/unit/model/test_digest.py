"""The target weights digest: the same weights digest the same wherever they are; other weights
(even with the same config and tensor layout) digest differently."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.model.digest import target_weights_digest
from dflash_train.model.tiny import save_random_qwen3


def test_a_moved_target_digests_the_same(tiny_target, tmp_path):
    moved = shutil.copytree(tiny_target, tmp_path / "elsewhere")
    assert target_weights_digest(moved) == target_weights_digest(tiny_target)


def test_one_changed_value_in_the_sampled_data_changes_the_digest(tmp_path):
    # Same config, same tensor names, shapes and dtypes: only values differ. The tiny target's
    # data is small enough to be digested whole, so one value anywhere changes it.
    path = save_random_qwen3(tmp_path / "a")
    before = target_weights_digest(path)
    weights = load_file(path / "model.safetensors")
    name = sorted(weights)[len(weights) // 2]
    weights[name] = weights[name].clone()
    weights[name].view(-1)[0] += 1.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert target_weights_digest(path) != before


def test_a_retrained_large_file_is_seen_by_the_sampled_blocks(tmp_path):
    # Above 16 x 64 KiB of data only sampled blocks are read: a retraining changes them.
    a, b = tmp_path / "a", tmp_path / "b"
    for d, seed in ((a, 0), (b, 1)):
        d.mkdir()
        (d / "config.json").write_text("{}")
        g = torch.Generator().manual_seed(seed)
        save_file({"w": torch.randn(1024, 1024, generator=g)}, d / "model.safetensors")
    assert target_weights_digest(a) != target_weights_digest(b)


def test_a_directory_without_config_or_weights_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        target_weights_digest(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no weight files"):
        target_weights_digest(tmp_path)
