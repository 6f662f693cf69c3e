"""Simulated stage costs and the lockstep bound they imply."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.bench.sim import Cost, SleepClock, lockstep_bound


class VirtualClock(SleepClock):
    """Time that passes exactly as slept: the fit sees the simulated costs, not the machine's
    load."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> float:
        self.t += max(0.0, seconds)
        return max(0.0, seconds)


def test_token_scaled_cost_is_nominal_at_the_mean_batch():
    cost = Cost(0.1, per_unit=1000.0)
    assert cost.draw(1000) == pytest.approx(0.1)
    assert cost.draw(3000) == pytest.approx(0.3)


def test_jitter_stays_within_its_band():
    cost = Cost(1.0, jitter=0.1, seed=3)
    draws = [cost.draw(1) for _ in range(200)]
    assert min(draws) >= 0.9 and max(draws) <= 1.1 and len(set(draws)) > 100


@pytest.mark.parametrize("jitter", [-0.1, 1.0])
def test_jitter_outside_zero_to_one_is_refused(jitter):
    with pytest.raises(ValueError):
        Cost(1.0, jitter=jitter)


def test_constant_costs_lose_nothing_to_lockstep():
    assert lockstep_bound(Cost(0.1), np.array([100, 900]), drafters=7) == pytest.approx(1.0)


def test_unequal_batches_make_every_step_wait_for_its_slowest():
    tokens = np.array([100, 100, 100, 900])
    bound = lockstep_bound(Cost(0.1, per_unit=300.0), tokens, drafters=4)
    # Mean cost 300 tokens; a step of 4 holds a 900-token batch with probability 1 - 0.75^4.
    expected_max = 900 * (1 - 0.75**4) + 100 * 0.75**4
    assert bound == pytest.approx(300 / expected_max, rel=0.05)


@pytest.mark.parametrize(
    ("cost_model", "share"), [("tokens", 1.0), ("work", 0.0), ("constant", 0.0)]
)
def test_the_measured_token_share_follows_the_simulated_drafters_cost(cost_model, share):
    from dflash_train.bench.pipeline import DEFAULT_CASES, make_epoch, measure_simulated_cost

    case = DEFAULT_CASES[0]
    fast = type(case)(case.key, case.targets, case.drafters, 5.0, 5.0)  # 5 ms per mean batch
    fit = measure_simulated_cost(fast, make_epoch(40, 0), VirtualClock(), cost_model, 0, 0)
    assert fit.token_share == share
