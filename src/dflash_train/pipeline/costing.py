"""What one drafter micro-step costs, measured (`--batch-cost auto`): how much of it grows
with the batch's padded tokens and how much with its block positions.

Work batching gives every batch one budget so that the batches of a lockstep step cost about
the same. Which budget balances depends on the drafter and the device: a DFlash drafter's FLOPs
are mostly its block positions (every block token runs every layer), but the context side (the
fused `fc`, the key/value projections, attention over the context) grows with the tokens, and
on a given device memory traffic can weigh more than FLOPs. The default budget counts FLOPs
(`--batch-cost flops`, `model.flops.token_share`: the same on every launch); `auto` measures
instead: a few probe batches of different (tokens, block positions) are timed on the first
drafter replica,

    seconds = overhead + per_token x tokens + per_block x block positions

is fitted by least squares, and the budget's token share is the part of a fully anchored batch
of the longest bucket's cost that `per_token` accounts for (`Batching.token_share`). The share
is rounded to `model.flops.SHARE_STEP` and recorded in the run's config, so a resumed run plans
with the same one; another launch can measure another share and plan other batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from dflash_train import faults
from dflash_train.devices import synchronize
from dflash_train.model.flops import rounded_share
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.stages import Replica
from dflash_train.pipeline.workers import out_of_memory_named

MEASURABLE = 0.1
"""Below this part of the reference batch's time, what grows with its size is taken for noise."""


@dataclass(frozen=True)
class ProbeShape:
    """A probe batch: `rows` rows of `length` tokens, `supervised` of them supervised."""

    rows: int
    length: int
    supervised: int


def probe_shapes(longest: int, batch_size: int) -> list[ProbeShape]:
    """Four probes around a full batch of the longest bucket: the full batch, the same tokens
    with an eighth of the supervision (fewer blocks), a quarter of the length with that
    supervision (fewer tokens, about the same blocks), and twice the rows at a quarter length
    fully supervised, so tokens and block positions vary independently of each other."""
    quarter = max(8, longest // 4)
    eighth = max(2, longest // 8)
    return [
        ProbeShape(batch_size, longest, longest),
        ProbeShape(batch_size, longest, eighth),
        ProbeShape(batch_size, quarter, min(eighth, quarter)),
        ProbeShape(2 * batch_size, quarter, quarter),
    ]


@dataclass(frozen=True)
class CostFit:
    """The fitted cost of a micro-step and the token share it gives the reference batch."""

    overhead_s: float
    per_token_s: float
    per_block_s: float
    token_share: float
    """Rounded to `model.flops.SHARE_STEP`; 0 when neither tokens nor blocks measurably cost
    anything."""
    probes: list[tuple[int, int, float]]
    """(tokens, block positions, seconds) of every probe."""

    def describe(self) -> str:
        if self.per_token_s == self.per_block_s == 0:
            return (
                f"no measurable cost per token or block position (about "
                f"{self.overhead_s * 1e3:.3g} ms per micro-step whatever its size)"
            )
        return (
            f"a full batch's cost is {self.token_share:.0%} tokens, "
            f"{1 - self.token_share:.0%} block positions (measured: "
            f"{self.per_token_s * 1e9:.3g} ns per token, {self.per_block_s * 1e9:.3g} ns per "
            f"block position, {self.overhead_s * 1e3:.3g} ms per micro-step)"
        )


def fit_cost(probes: list[tuple[int, int, float]], ref_tokens: int, ref_blocks: int) -> CostFit:
    """Least-squares fit of seconds = overhead + a x tokens + b x blocks with overhead, a, b >= 0
    (the best of the fits with any of the three terms that keep them non-negative)
    over `probes`, and the token share of a reference batch of (ref_tokens, ref_blocks); a and
    b are 0 when together they make less than MEASURABLE of the reference batch's time, or
    when the probes' times differ by less than MEASURABLE of the slowest."""
    x = np.array([[1.0, t, b] for t, b, _ in probes])
    y = np.array([s for _, _, s in probes])
    best: tuple[float, np.ndarray] | None = None
    # The overhead too: a loaded machine's probes can fit a negative one, which is no cost.
    for cols in ([0, 1, 2], [0, 1], [0, 2], [1, 2], [0], [1], [2]):
        scale = np.abs(x[:, cols]).max(axis=0)
        sub = np.linalg.lstsq(x[:, cols] / scale, y, rcond=None)[0] / scale
        if (sub < 0).any():
            continue
        coef = np.zeros(3)
        coef[cols] = sub
        residual = float(np.sum((x @ coef - y) ** 2))
        if best is None or residual < best[0] * (1 - 1e-9):
            best = (residual, coef)
    assert best is not None  # the overhead-only fit is the mean time: never negative
    overhead, per_token, per_block = (float(c) for c in best[1])
    token_part, block_part = per_token * ref_tokens, per_block * ref_blocks
    total = token_part + block_part
    spread = max(y) - min(y)
    if total < MEASURABLE * (overhead + total) or spread < MEASURABLE * max(y):
        per_token = per_block = 0.0  # the size barely matters: noise, not a cost
    share = 0.0 if per_token == per_block == 0 else token_part / total
    share = rounded_share(share)
    return CostFit(overhead, per_token, per_block, share, list(probes))


def measure_drafter_cost(
    replica: Replica,
    make_batch: Callable[[ProbeShape], HSBatch],
    shapes: list[ProbeShape],
    repeats: int = 2,
    clock: Callable[[], float] = time.perf_counter,
) -> CostFit:
    """Time `replica.micro_step` on each probe (one untimed warm-up, then the fastest of
    `repeats`; the device synchronised around each) and fit the cost. The replica's gradient
    buffer is zeroed afterwards: a probe trains nothing. The first shape is the reference, the
    largest batch the plan allows: a device out of memory on it says so and what to lower."""
    batches = [make_batch(s) for s in shapes]
    best = [float("inf")] * len(batches)
    for round_ in range(repeats + 1):
        for i, batch in enumerate(batches):
            synchronize(replica.device)
            t0 = clock()
            what = "drafter's cost probe"
            with out_of_memory_named(replica.device, what, partial(_shape, batch)):
                faults.point("cost_probe")
                with faults.outside_stages():
                    replica.micro_step(batch)
                synchronize(replica.device)
            if round_ > 0:
                best[i] = min(best[i], clock() - t0)
    replica.flat_grad.zero_()
    probes = [
        (batch.job.input_ids.numel(), batch.job.block_ids.numel(), s)
        for batch, s in zip(batches, best, strict=True)
    ]
    return fit_cost(probes, probes[0][0], probes[0][1])


def _shape(batch: HSBatch) -> str:
    """A probe batch, as an out-of-memory line names it, with what to lower."""
    rows, length = batch.job.input_ids.shape
    return (
        f"probe batch of {rows} x {length} tokens, {batch.job.block_ids.shape[1]} block "
        "positions per sequence; lower --batch-size or --num-anchors, or --batch-cost flops "
        "(the default) skips the probe"
    )
