"""The drafter's measured cost: the fit, its token share, and the probe around a replica."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.model.flops import SHARE_STEP
from dflash_train.pipeline.costing import (
    ProbeShape,
    fit_cost,
    measure_drafter_cost,
    probe_shapes,
)

REF_T, REF_B = 4 * 3072, 4 * 512 * 16
SHAPES = [(REF_T, REF_B), (REF_T, REF_B // 8), (REF_T // 4, REF_B // 8), (REF_T // 2, REF_B // 2)]


def probes(per_token, per_block, overhead=1e-3, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (t, b, overhead + per_token * t + per_block * b + rng.normal(0, noise)) for t, b in SHAPES
    ]


@pytest.mark.parametrize(
    "per_token, per_block, share",
    [(1e-6, 0.0, 1.0), (0.0, 1e-6, 0.0), (1e-6, 1e-6 * REF_T / REF_B, 0.5), (3e-7, 1e-7, None)],
)
def test_the_fit_recovers_the_costs_and_the_reference_batchs_token_share(
    per_token, per_block, share
):
    fit = fit_cost(probes(per_token, per_block), REF_T, REF_B)
    assert fit.per_token_s == pytest.approx(per_token, abs=1e-12)
    assert fit.per_block_s == pytest.approx(per_block, abs=1e-12)
    assert fit.overhead_s == pytest.approx(1e-3, rel=1e-6)
    exact = per_token * REF_T / (per_token * REF_T + per_block * REF_B)
    expected = share if share is not None else exact
    assert fit.token_share == pytest.approx(expected, abs=SHARE_STEP / 2)
    assert fit.token_share == pytest.approx(round(fit.token_share / SHARE_STEP) * SHARE_STEP)


def test_noise_never_makes_a_cost_negative():
    # Tokens cost nothing; noise pulls the unconstrained per-token estimate below zero.
    for seed in range(20):
        fit = fit_cost(probes(0.0, 1e-6, noise=2e-3, seed=seed), REF_T, REF_B)
        assert fit.per_token_s >= 0 and fit.per_block_s >= 0
        assert 0.0 <= fit.token_share <= 1.0


def test_the_overhead_is_never_negative_either():
    # Probes whose times fit a negative intercept (a loaded machine slowed the small ones
    # least): the fit keeps every term >= 0 and still finds the block positions' cost.
    fit = fit_cost(probes(0.0, 1e-6, overhead=-5e-3), REF_T, REF_B)
    assert fit.overhead_s >= 0 and fit.per_token_s >= 0 and fit.per_block_s > 0
    assert "ns per block position, 0 ms per micro-step" in fit.describe()
    for seed in range(20):
        fit = fit_cost(probes(1e-7, 1e-6, overhead=0.0, noise=2e-3, seed=seed), REF_T, REF_B)
        assert min(fit.overhead_s, fit.per_token_s, fit.per_block_s) >= 0


def test_a_cost_that_does_not_grow_with_the_batch_plans_by_blocks():
    fit = fit_cost(probes(0.0, 0.0), REF_T, REF_B)
    assert fit.token_share == 0.0
    assert "no measurable cost" in fit.describe()


def test_the_probes_vary_tokens_and_supervision_independently():
    shapes = probe_shapes(3072, 4)
    tokens = [s.rows * s.length for s in shapes]
    supervised = [s.rows * s.supervised for s in shapes]
    assert shapes[0] == ProbeShape(4, 3072, 3072)  # the reference: a full batch, longest bucket
    assert tokens[0] == tokens[1] and supervised[1] < supervised[0]  # same tokens, fewer blocks
    assert supervised[2] == supervised[1] and tokens[2] < tokens[1]  # fewer tokens, same blocks
    x = np.array([[1, t, s] for t, s in zip(tokens, supervised, strict=True)], dtype=float)
    assert np.linalg.matrix_rank(x) == 3
    assert all(1 <= s.supervised <= s.length for s in probe_shapes(24, 2))  # tiny data too


class _FakeJob:
    def __init__(self, tokens: int, blocks: int) -> None:
        self.input_ids = torch.zeros(tokens)
        self.block_ids = torch.zeros(blocks)


class _FakeBatch:
    def __init__(self, tokens: int, blocks: int) -> None:
        self.job = _FakeJob(tokens, blocks)


class _TimedReplica:
    """A replica on a fake clock: a micro-step costs a x tokens + b x blocks; the first call
    of each batch also pays a warm-up (as a first CUDA call or a compile would)."""

    device = torch.device("cpu")

    def __init__(self, per_token: float, per_block: float) -> None:
        self.now = 0.0
        self.per_token, self.per_block = per_token, per_block
        self.flat_grad = torch.zeros(4)
        self.seen: set[int] = set()

    def clock(self) -> float:
        return self.now

    def micro_step(self, batch) -> None:
        job = batch.job
        self.now += self.per_token * job.input_ids.numel() + self.per_block * job.block_ids.numel()
        if id(batch) not in self.seen:
            self.seen.add(id(batch))
            self.now += 10.0
        self.flat_grad += 1.0


def test_the_probe_times_each_shape_after_a_warm_up_and_trains_nothing():
    rep = _TimedReplica(per_token=1e-6, per_block=1e-6 * REF_T / REF_B / 3)  # share 0.75

    def make_batch(shape: ProbeShape):
        anchors = min(shape.supervised, 512)  # at most --num-anchors per row
        return _FakeBatch(shape.rows * shape.length, shape.rows * anchors * 16)

    fit = measure_drafter_cost(rep, make_batch, probe_shapes(3072, 4), clock=rep.clock)
    assert fit.token_share == pytest.approx(0.75)
    assert max(s for _, _, s in fit.probes) < 1.0  # the warm-up calls were not timed
    assert not rep.flat_grad.any()
