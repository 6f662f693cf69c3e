"""The length mix's arithmetic: how closely a window of draws can follow the data's bucket
shares (the bucket count's side of it: --num-buckets auto, the trainer's note), the readiness
gate the tuner recommends, and how far a random pull would stray (a baseline beside
queue/mix_tv)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

MIX_WINDOW_STEPS = 50
"""The window of optimizer steps over which the drawn length mix is judged (queue/mix_tv)."""
MIX_TV_GOAL = 0.05
"""The total-variation distance from the data's mix a run's windows should stay within."""
MIX_TV_PLAN = 0.03
"""What --num-buckets auto allows the ideal pull, leaving the pipeline's reordering room."""
MIN_READY_FLOOR = 30
"""The least readiness gate recommended: the default, at which `bench pipeline` measured its
efficiency (a shallower buffer absorbs less of the stages' jitter)."""


@dataclass
class MinReady:
    value: int
    for_step: int
    explanation: str


def recommend_min_ready(
    weights: dict[int, float], draws_per_step: int, epoch_batches: int | None = None
) -> MinReady:
    """The readiness gate: one lockstep step (draws_per_step batches taken at once) leaves a pool
    as large as what it took, and at least `MIN_READY_FLOOR`; capped at `epoch_batches` (a gate
    above an epoch's batch count only delays the start).

    The length mix asks for no more: the epoch plan interleaves the buckets (`interleave`), so
    the batches arrive in the mix and the stratified pull follows it from a small buffer
    (measured: queue/mix_tv at its window floor from --hs-min-ready 4, README, Length mixing).
    """
    if not weights or draws_per_step < 1:
        raise ValueError("need bucket weights and draws_per_step >= 1")
    for_step = 2 * draws_per_step
    value = max(for_step, MIN_READY_FLOOR)
    text = (
        f"{len(weights)} buckets, interleaved by the plan (the mix needs no deep buffer); one "
        f"lockstep step draws {draws_per_step} batch{'es' if draws_per_step != 1 else ''}, x2 = "
        f"{for_step}; at least {MIN_READY_FLOOR} for the pipeline's slack"
    )
    if epoch_batches is not None and value > epoch_batches:
        value = max(1, epoch_batches)
        text += f"; capped at the {value} batches of one epoch"
    return MinReady(value, for_step, text + f" -> --hs-min-ready {value}")


def window_mix_tv(weights: dict[int, float], draws: int, windows: int = 20) -> float:
    """The mean total-variation distance from `weights` of windows of `draws` batches drawn by
    the stratified pull when every bucket is at hand (smooth weighted round robin): the best a
    pull can do in such a window, integer counts being what they are (16 buckets in 50 draws:
    about 0.06 however the batches arrive)."""
    if draws < 1 or not weights:
        return float("nan")
    keys = sorted(weights)
    w = np.array([weights[k] for k in keys], dtype=np.float64)
    w = w / w.sum()
    credit = np.zeros(len(w))
    counts = np.zeros((windows, len(w)))
    for i in range(windows * draws):
        credit += w
        pick = int(np.argmax(credit))  # ties: the lowest bucket, as any fixed rule
        credit[pick] -= 1.0
        counts[i // draws, pick] += 1
    return float(0.5 * np.abs(counts / draws - w).sum(axis=1).mean())


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


def mix_notes(
    weights: dict[int, float],
    draws_per_step: int,
    depth: int,
    epoch_batches: int,
    arrival: bool = True,
) -> list[str]:
    """What a run should be told about its mix and its queue: a bucket count too high for the
    length mix to hold in a `MIX_WINDOW_STEPS`-step window (integer counts: 16 buckets in 50
    draws stray about 0.06 whatever the pull), and, with an `arrival`-order pull, a queue deep
    enough to hold more than half an epoch of this node's batches (a full queue's batches wait
    about its depth in draws, so a run stopped at --max-steps leaves that many of the epoch
    before untrained; the plan order trains them in order, whatever the depth)."""
    notes = []
    tv = window_mix_tv(weights, MIX_WINDOW_STEPS * draws_per_step) if len(weights) > 1 else 0.0
    if tv > MIX_TV_GOAL:
        notes.append(
            f"note: {len(weights)} buckets cannot follow the length mix within {MIX_TV_GOAL:g} "
            f"(total variation) in a {MIX_WINDOW_STEPS}-step window of {draws_per_step} "
            f"batch(es) per step: at best {tv:.3f}; --num-buckets auto (the default) chooses a "
            "count that can"
        )
    if arrival and 2 * depth > epoch_batches:
        notes.append(
            f"note: --hs-queue-depth {depth} holds {depth / max(1, epoch_batches):.1f} epochs "
            f"of this node's {epoch_batches} batches: a batch may wait about that long before it "
            f"trains; --hs-queue-depth {max(1, epoch_batches // 2)} keeps it within half an epoch"
        )
    return notes
