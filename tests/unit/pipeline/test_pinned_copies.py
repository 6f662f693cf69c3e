"""Host-to-device copies are asynchronous: jobs are pinned by the prefetchers when a CUDA device
takes part, and every copy of a job's tensors is `non_blocking` from pinned, contiguous memory.

Recorded on CPU, with pinning stood in for (`pin_memory` needs CUDA): a pinned tensor is one
whose storage the stand-in made; `tests/cuda` checks the real thing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dflash_train.model.target import TargetFeatureExtractor
from dflash_train.objective import DraftTargets
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch
from dflash_train.train import replica as replica_module
from dflash_train.train.models import build_replicas
from dflash_train.train.setup import TrainingData
from pipeline_helpers import tiny_train_config, write_random_dataset

CPU = torch.device("cpu")


@pytest.fixture
def pinned(monkeypatch):
    """Storage pointers of the tensors `pin_memory` made (it copies, as torch's does)."""
    made: set[int] = set()

    def pin_memory(self):
        out = self.clone()
        made.add(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(
        torch.Tensor, "is_pinned", lambda self: self.untyped_storage().data_ptr() in made
    )
    return made


@pytest.fixture
def copies(monkeypatch):
    """Every `tensor.to(device, ...)`: (pinned, contiguous, non_blocking, shape)."""
    log: list[tuple] = []
    real = torch.Tensor.to

    def to(self, *args, **kwargs):
        if any(isinstance(a, torch.device | str) for a in args) or "device" in kwargs:
            log.append(
                (self.is_pinned(), self.is_contiguous(), kwargs.get("non_blocking", False), self)
            )
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    return log


@pytest.fixture
def data(tiny_target, tmp_path):
    rows = write_random_dataset(tmp_path / "data", num_rows=16)
    cfg = tiny_train_config(tiny_target, rows, tmp_path / "run")
    return cfg, TrainingData.load(cfg)


class Source:
    """A target on `device` that records whether each batch's ids came pinned."""

    def __init__(self, device: torch.device, width: int) -> None:
        self.device, self.width, self.pinned = device, width, []

    def __call__(self, input_ids):
        self.pinned.append(input_ids.is_pinned())
        return torch.zeros(*input_ids.shape, self.width)


class Discard:
    def __init__(self) -> None:
        self.device, self.step, self.flat_grad = CPU, 0, torch.zeros(1)

    def micro_step(self, batch):
        return None

    def apply(self, global_weight):
        self.step += 1


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_prefetchers_pin_jobs_when_a_cuda_device_takes_part(data, pinned, device, monkeypatch):
    from dflash_train import devices
    from dflash_train.pipeline import target_worker

    _, d = data
    # The target worker's lane and clock on the CPU: only where its ids come from is checked.
    monkeypatch.setattr(target_worker, "enter_worker_thread", lambda _dev: devices.Lane(CPU))
    monkeypatch.setattr(target_worker, "SegmentClock", lambda _dev: devices.SegmentClock(CPU))
    source = Source(torch.device(device, 0), 4)
    settings = PipelineSettings(total_steps=1 << 30, num_prefetchers=2, hs_min_ready=1)
    pipe = Pipeline(settings, TargetFeed(d.plans, d.builder, [source]), [Discard()])
    pipe.start()
    try:
        assert pipe.wait(60)
    finally:
        pipe.shutdown()
    assert source.pinned and all(source.pinned) == (device == "cuda")
    assert bool(pinned) == (device == "cuda")  # nothing is pinned without CUDA


def test_every_copy_of_a_micro_step_is_async_from_pinned_contiguous_memory(
    data, pinned, copies, monkeypatch
):
    cfg, d = data
    (rep,) = build_replicas(cfg, d, [CPU], 10, StageTimers())
    monkeypatch.setattr(replica_module, "handover", lambda t, _dev, _ready=None: t)
    own = {t.untyped_storage().data_ptr() for t in (*rep.model.parameters(), *rep.model.buffers())}
    width = d.draft_config.num_features * d.draft_config.hidden_size
    spec = max(d.plans.epoch(0), key=lambda s: len(s.seq_ids))
    job = d.builder.build(spec).pinned()
    assert job.input_ids.shape[0] > 1  # several rows: a column slice is not contiguous
    copies.clear()
    rep.micro_step(HSBatch(job, torch.zeros(*job.input_ids.shape, width)))
    host = [c for c in copies if c[3].untyped_storage().data_ptr() not in own]
    assert host, "no copies recorded"
    for was_pinned, contiguous, non_blocking, t in host:
        assert was_pinned and contiguous and non_blocking, (tuple(t.shape), t.dtype)
    # One copy each of the block ids and the layout's three tensors, one per field of each
    # chunk's targets.
    fields = len(dataclasses.fields(DraftTargets))
    assert len(host) <= 4 + fields * len(job.layout.chunks)


def test_the_targets_input_copy_is_async(tiny_target, pinned, copies):
    ex = TargetFeatureExtractor(tiny_target, [1, 3], CPU, torch.float32)
    ids = torch.from_numpy(np.arange(32).reshape(2, 16)).pin_memory()
    copies.clear()
    ex(ids)
    assert [(p, nb) for p, _, nb, t in copies if t is ids] == [(True, True)]
