"""`bench scale`'s cost model: both cross-node all-reduces of a multi-node step (the gradient's
and, with Muon, the update exchange's), counted in what it sleeps and what it projects."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from dflash_train.bench import scale
from dflash_train.bench.pipeline import make_epoch
from dflash_train.bench.sim import SleepClock


def flags(**kw) -> argparse.Namespace:
    args = argparse.Namespace(
        **{f[0][2:].replace("-", "_"): f[2] for f in scale.FLAGS}, seed=0, optimizer="muon"
    )
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.fixture(scope="module")
def modelled():
    epoch = make_epoch(40, 0, "work")
    return epoch, scale.cost_model(flags(), epoch)


def test_the_muon_matrices_are_counted_from_the_modelled_drafter(modelled):
    _, model = modelled
    # The Qwen3-8B drafter shape: ~1.05B parameters, all but its norms in Muon's matrices.
    assert 1.0e9 < model.drafter_params < 1.1e9
    assert 0.999 * model.drafter_params < model.muon_params < model.drafter_params
    assert model.update_bytes == 4 * model.muon_params


def test_a_muon_step_of_several_nodes_all_reduces_twice(modelled):
    _, model = modelled
    ring = scale.ring_allreduce_s
    grad, update = scale.allreduce_times(flags(), model, 8)
    assert grad == ring(model.grad_bytes, 8, 400.0, 10.0)
    assert update == ring(model.update_bytes, 8, 400.0, 10.0)
    assert update == pytest.approx(grad, rel=1e-3)  # Muon's matrices: ~all the parameters
    assert scale.allreduce_times(flags(optimizer="adamw"), model, 8) == (grad, 0.0)
    assert scale.allreduce_times(flags(), model, 1) == (0.0, 0.0)


def test_the_update_exchange_needs_more_than_one_replica_in_all():
    one_drafter = flags(devices=2, targets=1)
    assert not scale.muon_exchanges(one_drafter, 1)
    assert scale.muon_exchanges(one_drafter, 2)  # one drafter per node, two nodes
    assert scale.muon_exchanges(flags(), 1)  # seven drafters: split within the node
    assert not scale.muon_exchanges(flags(optimizer="adamw"), 8)


def test_the_projection_counts_the_update_exchange(modelled):
    epoch, model = modelled
    # 2 targets : 6 drafters: the drafters are the bottleneck, every all-reduce shows.
    muon, adamw = flags(targets=2), flags(targets=2, optimizer="adamw")
    drafters = 6
    draws = np.random.default_rng(0).choice(model.drafter_s_per_batch, size=(2000, drafters))
    compute = float(draws.max(axis=1).mean())
    produce = drafters * float(model.target_s_per_batch.mean()) / 2
    for nodes in (2, 64):
        grad, update = scale.allreduce_times(muon, model, nodes)
        want = max(produce, compute) / max(produce, compute + grad + update)
        assert scale.projected_efficiency(muon, epoch, model, nodes) == pytest.approx(want)
        without = max(produce, compute) / max(produce, compute + grad)
        assert scale.projected_efficiency(adamw, epoch, model, nodes) == pytest.approx(without)
        assert want < without


def test_the_simulated_nodes_sleep_the_update_exchange_on_its_buffer():
    class Clock(SleepClock):
        def __init__(self):
            super().__init__(0.0)
            self.slept: list[float] = []

        def sleep(self, seconds):
            self.slept.append(seconds)
            return seconds

    clock = Clock()
    share, grad = torch.zeros(8), torch.zeros(8)
    group = scale.SimulatedNodes(2, 0.5, clock, update_s=0.25, update_buffer=share)
    assert group.sum_step_numbers([1.0, 2.0]) == [2.0, 4.0]
    group.sum_device(grad)  # the gradient's time was slept with the step's numbers
    group.sum_device(share)
    assert clock.slept == [0.5, 0.25]


def test_a_simulated_muon_step_takes_the_update_exchange_longer(modelled):
    # A slow link (40 Gb/s: ~0.8 s per all-reduce at 2 nodes) so the exchange dominates noise.
    epoch, model = modelled
    clock = SleepClock.calibrate()
    kw = dict(targets=2, link_gbps=40.0, time_scale=0.02, batches=40)
    muon = scale.run_nodes(flags(**kw), epoch, model, 2, clock)
    adamw = scale.run_nodes(flags(**kw, optimizer="adamw"), epoch, model, 2, clock)
    assert muon["update_exchange_s"] > 0.7 and adamw["update_exchange_s"] == 0.0
    assert muon["allreduce_s"] == pytest.approx(adamw["allreduce_s"] + muon["update_exchange_s"])
    slower = muon["step_s"] - adamw["step_s"]
    assert slower == pytest.approx(muon["update_exchange_s"], rel=0.3)
