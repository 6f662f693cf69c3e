"""The tuner's drafter measurement replays features it computed on the main thread: each batch
must carry that thread's mark after its forward (recorded on CPU; on CUDA the drafter's copy
waits for it, `devices.handover`)."""

from __future__ import annotations

import torch

from dflash_train.bench import tune
from dflash_train.devices import Mark


class Extractor:
    device = torch.device("cpu")

    def __init__(self, log: list) -> None:
        self.log = log

    def __call__(self, input_ids):
        self.log.append(("forward", input_ids.shape[0]))
        return torch.zeros(*input_ids.shape, 4)


class Job:
    def __init__(self, rows: int) -> None:
        self.input_ids = torch.zeros(rows, 8, dtype=torch.long)


def test_each_precomputed_batch_carries_the_mark_after_its_own_forward(monkeypatch):
    log: list = []

    def marks_here(devices):
        log.append(("mark", len(log)))
        return [Mark(d) for d in devices]

    monkeypatch.setattr(tune, "marks_here", marks_here)
    batches = tune.precomputed_batches(Extractor(log), [Job(2), Job(3)])
    assert [op for op, _ in log] == ["forward", "mark", "forward", "mark"]
    assert all(isinstance(b.ready, Mark) for b in batches)
    assert [b.features.shape[0] for b in batches] == [2, 3]
