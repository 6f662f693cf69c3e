"""How many buffered batches the stratified pull needs to follow the length mix, and how far
a random pull would stray from it: the arithmetic behind the readiness gate, used by the
trainer (to warn), the tuner (to recommend) and the metrics (a baseline beside queue/mix_tv)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MIX_TV_BUDGET = 0.02  # expected share of the mix missing from the buffer that min_ready allows


def missing_mix_share(weights: dict[int, float], buffered: int) -> float:
    """Expected share of the mix whose bucket has no batch among `buffered` batches drawn from
    the mix: sum_b w_b (1 - w_b)^m. A stratified pull can only follow the buckets it holds."""
    total = sum(weights.values())
    return sum((w / total) * (1 - w / total) ** buffered for w in weights.values())


@dataclass
class MinReady:
    value: int
    for_mix: int
    for_step: int
    explanation: str


def recommend_min_ready(
    weights: dict[int, float],
    draws_per_step: int,
    tv_budget: float = MIX_TV_BUDGET,
    epoch_batches: int | None = None,
) -> MinReady:
    """The readiness gate: enough buffered batches that (a) the length mix holds, i.e. the
    expected share of the mix with no batch buffered is <= tv_budget, and (b) one lockstep step
    (draws_per_step batches taken at once) still leaves a pool as large as what it took.

    Capped at `epoch_batches`: a gate above an epoch's batch count only delays the start.
    """
    if not weights or draws_per_step < 1 or not 0 < tv_budget < 1:
        raise ValueError("need bucket weights, draws_per_step >= 1 and 0 < tv_budget < 1")
    for_mix = 1
    while missing_mix_share(weights, for_mix) > tv_budget:
        for_mix += 1
    for_step = 2 * draws_per_step
    value = max(for_mix, for_step)
    text = (
        f"mix of {len(weights)} buckets: sum_b w_b (1 - w_b)^m <= {tv_budget:g} from m = "
        f"{for_mix}; one lockstep step draws {draws_per_step} batch"
        f"{'es' if draws_per_step != 1 else ''}, x2 = {for_step}"
    )
    if epoch_batches is not None and value > epoch_batches:
        value = max(1, epoch_batches)
        text += f"; capped at the {value} batches of one epoch"
    return MinReady(value, for_mix, for_step, text + f" -> --hs-min-ready {value}")


def random_pull_tv(weights: dict[int, float], draws: int, trials: int = 2000) -> float:
    """Expected total-variation distance from `weights` of the buckets of `draws` batches pulled
    at random from the mix (a multinomial sample): what queue/mix_tv would be without the
    stratified pull, for a window of `draws` batches."""
    if draws < 1 or not weights:
        return float("nan")
    keys = tuple(sorted(weights))
    return _random_pull_tv(tuple(weights[k] for k in keys), draws, trials)


@functools.lru_cache(maxsize=64)
def _random_pull_tv(weights: tuple[float, ...], draws: int, trials: int) -> float:
    p = np.asarray(weights, dtype=np.float64)
    p = p / p.sum()
    rng = np.random.default_rng(0)  # a fixed sample: the baseline of a window size is a number
    counts = rng.multinomial(draws, p, size=trials)
    return float(0.5 * np.abs(counts / draws - p).sum(axis=1).mean())
