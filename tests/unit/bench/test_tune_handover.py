"""The tuner's drafter measurement replays features it computed on the main thread: each batch
must carry that thread's mark after its forward (recorded on CPU; on CUDA the drafter's copy
waits for it, `devices.handover`)."""

from __future__ import annotations

import threading

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


def test_the_tuners_drafter_thread_runs_under_the_stance_train_sets(
    tiny_target, tmp_path, monkeypatch
):
    # After its warm-up, a shape missed must run eager in the drafter thread, not trace there.
    from dflash_train.train import warm_up
    from dflash_train.train.replica import DraftReplica
    from pipeline_helpers import tiny_train_config, write_random_dataset

    monkeypatch.setattr(warm_up, "_uses_compiled_flex", lambda _replica: True)  # flex on CUDA
    seen: set = set()
    step = DraftReplica.micro_step

    def recording(self, batch):
        seen.add((threading.current_thread().name, torch._dynamo.eval_frame._stance.stance))
        return step(self, batch)

    monkeypatch.setattr(DraftReplica, "micro_step", recording)
    rows = write_random_dataset(tmp_path / "data", num_rows=12)
    cfg = tiny_train_config(tiny_target, rows, tmp_path / "run", drafter_devices=["cpu"])
    tune.Measurer(cfg, 0.2, 1).measure(torch.device("cpu"))
    assert {s for t, s in seen if t != "MainThread"} == {"eager_on_recompile"}
    assert torch._dynamo.eval_frame._stance.stance == "default"
