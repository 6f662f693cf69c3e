"""`bench gpu`'s pipeline part on CPU (tiny shapes): it runs as train does, the replica's own
objective and, once warmed up, torch.compile's stance that never traces in a worker thread;
its compile counts cover the run, not only the warm-up."""

from __future__ import annotations

import argparse
import time

import pytest
import torch

from dflash_train.bench import gpu_pipeline
from dflash_train.train import warm_up
from pipeline_helpers import record_replica_calls

CPU = torch.device("cpu")


@pytest.fixture
def drafter_calls(monkeypatch):
    return record_replica_calls(monkeypatch)


def run_tiny(steps: int = 3) -> dict:
    args = argparse.Namespace(steps=steps, seq_len=128, batch_size=2, num_anchors=16)
    return gpu_pipeline.run_pipeline(args, "tiny", CPU, time.monotonic() + 300)


def test_the_pipeline_part_runs_its_workers_under_the_stance_train_sets(drafter_calls, monkeypatch):
    # Flex compiles on CUDA only: stood in for here, so the part sets what it would there.
    monkeypatch.setattr(warm_up, "_uses_compiled_flex", lambda _replica: True)
    torch._dynamo.reset()
    out = run_tiny()
    in_workers = {(t, s) for t, s, _ in drafter_calls["steps"] if t != "MainThread"}
    assert in_workers == {("drafter-0", "eager_on_recompile")}
    assert torch._dynamo.eval_frame._stance.stance == "default"  # given back after the run
    assert out["flex_traces_in_run"] == 0 and out["graphs_compiled_in_run"] == 0


def test_the_pipeline_part_normalises_the_loss_as_the_replica_trains(drafter_calls):
    out = run_tiny()
    jobs = [job for t, _, job in drafter_calls["steps"] if t != "MainThread"]
    assert out["steps"] == len(drafter_calls["weights"]) and jobs
    # D-PACE, the replica's default: a batch's share of the divisor is its valid anchors.
    for job in jobs:
        assert job.weight_sum == float(job.layout.valid.sum())
    assert sum(drafter_calls["weights"]) == pytest.approx(sum(j.weight_sum for j in jobs))
