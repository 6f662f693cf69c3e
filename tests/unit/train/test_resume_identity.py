"""The target a run resumes on is the one it trained on: the same config.json is not enough
(another fine-tune has it too), so a digest of the weight files' sizes, headers and sampled
bytes is compared as well."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dflash_train.model.digest import target_weights_digest
from dflash_train.train.checkpoint import ResumePoint
from dflash_train.train.resume import (
    Resume,
    agree_on_checkpoint,
    checkpoint_choice,
    target_digest,
)
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


class FakeNodes:
    """Two ranks: this one's text, and `other` as rank 1's."""

    def __init__(self, other) -> None:
        self.other = other

    def gather_text(self, text: str) -> list[str]:
        return [text, self.other(text)]


def resume_at(run_dir, step: int, weights: str, skipped=()) -> Resume:
    state = {"step": step, "sha256": {"model.safetensors": weights}}
    path = run_dir / "checkpoints" / f"step_{step:07d}"
    point = ResumePoint(path, state, {}, {}, np.zeros((1, 4), bool), {}, list(skipped))
    return Resume(run_dir, point, "", "")


def test_nodes_resume_only_from_one_checkpoint(tmp_path):
    """Regression (issue 33, item 9): each node resumed from the newest checkpoint it could
    read; now they compare step and weights, and a difference names each rank's choice."""
    mine = resume_at(tmp_path, 4, "a" * 64)
    agree_on_checkpoint(mine, FakeNodes(lambda text: text))  # the same choice everywhere
    agree_on_checkpoint(mine, None)  # one node: nothing to compare
    newer = tmp_path / "checkpoints" / "step_0000004"
    theirs = resume_at(tmp_path, 2, "b" * 64, [(newer, "corrupt")])
    gathered = FakeNodes(lambda _t: json.dumps(checkpoint_choice(theirs.point)))
    with pytest.raises(ValueError) as refused:
        agree_on_checkpoint(mine, gathered)
    msg = str(refused.value)
    assert msg.startswith(f"--resume {tmp_path}: the nodes would resume from different")
    assert f"rank 0: {newer} (step 4, weights aaaaaaaaaaaa)" in msg
    assert (
        "rank 1: " in msg
        and "(step 2, weights bbbbbbbbbbbb; it could not read step_0000004)" in msg
    )
    other_weights = resume_at(tmp_path, 4, "c" * 64)  # the same step, other bytes: refused too
    with pytest.raises(ValueError, match="different checkpoints"):
        agree_on_checkpoint(
            mine, FakeNodes(lambda _t: json.dumps(checkpoint_choice(other_weights.point)))
        )
