"""The target a run resumes on is the one it trained on: the same config.json is not enough
(another fine-tune has it too), so a digest of the weight files' sizes, headers and sampled
bytes is compared as well."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from dflash_train.model.digest import target_weights_digest
from dflash_train.train.resume import target_digest
from pipeline_helpers import fine_tune


def test_the_weights_digest_tells_a_fine_tune_with_the_same_config(tiny_target, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(tiny_target, moved)
    assert target_weights_digest(moved) == target_weights_digest(tiny_target)
    for where, part in (("start", "layers.3.mlp.down_proj"), ("end", "embed_tokens")):
        other = tmp_path / f"tuned_{where}"
        fine_tune(tiny_target, other, part, where)
        assert target_digest(other) == target_digest(tiny_target)  # the old check passed it
        assert target_weights_digest(other) != target_weights_digest(tiny_target), where


def test_a_weights_digest_reads_a_few_kib_per_tensor(tiny_target, monkeypatch):
    from dflash_train.model import digest

    reads: list[int] = []
    real_open = digest.Path.open

    def counting_open(self, *args, **kwargs):
        f = real_open(self, *args, **kwargs)
        real_read = f.read

        def read(n=-1):
            data = real_read(n)
            reads.append(len(data))
            return data

        f.read = read
        return f

    monkeypatch.setattr(digest.Path, "open", counting_open)
    digest.target_weights_digest(tiny_target)
    tensors = len(load_file(tiny_target / "model.safetensors"))
    assert sum(reads) <= 2 * tensors * digest.SAMPLE_BYTES + 2**20
    # config.json, then the weights file's length, header and two samples per tensor.
    assert torch.tensor(reads).numel() == 1 + 2 + 2 * tensors
