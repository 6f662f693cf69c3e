"""The tuner's arithmetic: role split from measured rates and the hidden-state queue's bounds
from batch bytes against free memory (the readiness gate from the length mix is
`pipeline.mixing`, which the trainer uses too).

Pure functions of numbers, so they are tested without models; `bench.tune` measures the
numbers and explains these results.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from dflash_train.config import human_bytes

DEPTH_PER_MIN_READY = 3  # room above the readiness gate, as in the defaults (90 / 30)
BRUTE_FORCE_DEVICES = 16  # up to 2**16 role assignments are tried exactly


@dataclass
class Split:
    """Which devices (indices into the device list) take which role, and what each side does.

    With a single device both roles share it (time-sliced): `shared` is True and the expected
    rate is 1 / (1 / target + 1 / drafter).
    """

    targets: list[int]
    drafters: list[int]
    target_rate: float
    drafter_rate: float
    shared: bool = False

    @property
    def expected(self) -> float:
        if self.shared:
            return 1.0 / (1.0 / self.target_rate + 1.0 / self.drafter_rate)
        return min(self.target_rate, self.drafter_rate)

    @property
    def bound(self) -> str:
        if self.shared:
            return "shared device"
        if math.isclose(self.target_rate, self.drafter_rate, rel_tol=0.02):
            return "balanced"
        return "targets" if self.target_rate < self.drafter_rate else "drafters"


def recommend_split(target_rates: list[float], drafter_rates: list[float]) -> Split:
    """The role assignment maximising min(sum of target rates, sum of drafter rates).

    rates[i]: device i's throughput in each role (same unit, e.g. tokens/s). Every assignment
    with at least one device per role is tried (up to 16 devices; beyond, devices are assumed
    alike and only the number of target devices is chosen). Ties go to fewer target devices,
    then to the earlier devices as targets (cuda:0 first, as users expect).
    """
    n = len(target_rates)
    if n != len(drafter_rates) or n == 0:
        raise ValueError("need one target rate and one drafter rate per device")
    if any(r <= 0 for r in (*target_rates, *drafter_rates)):
        raise ValueError("rates must be positive")
    if n == 1:
        return Split([0], [0], target_rates[0], drafter_rates[0], shared=True)
    best: Split | None = None
    for k in range(1, n):
        combos = itertools.combinations(range(n), k) if n <= BRUTE_FORCE_DEVICES else [range(k)]
        for chosen in combos:
            targets = list(chosen)
            drafters = [i for i in range(n) if i not in chosen]
            split = Split(
                targets,
                drafters,
                sum(target_rates[i] for i in targets),
                sum(drafter_rates[i] for i in drafters),
            )
            if best is None or split.expected > best.expected * (1 + 1e-9):
                best = split
    assert best is not None
    return best


@dataclass
class QueueSizing:
    """Recommended queue bounds. queue_bytes is None when the depth bound alone is safe."""

    depth: int
    min_ready: int
    queue_bytes: int | None
    lines: list[str] = field(default_factory=list)


def recommend_depth(
    min_ready: int,
    batch_bytes_max: int,
    batch_bytes_mean: float,
    budget_bytes: int | None,
    ratio: int = DEPTH_PER_MIN_READY,
) -> QueueSizing:
    """Depth = ratio x min_ready, bounded by memory.

    Safe by count if depth batches of the LARGEST bucket fit the budget. Otherwise the depth
    stays and a byte bound (--hs-queue-bytes = budget) keeps memory safe; min_ready is lowered if
    even min_ready of the largest batches would not fit (a byte bound that binds below min_ready
    makes drafters wait for a gate the buffer cannot reach).
    """
    if min_ready < 1 or ratio < 1 or batch_bytes_max <= 0:
        raise ValueError("min_ready, ratio and batch_bytes_max must be positive")
    depth = ratio * min_ready
    lines = [f"depth: {ratio} x min_ready {min_ready} = {depth} batches"]
    need = depth * batch_bytes_max
    lines.append(
        f"memory: {depth} x {human_bytes(batch_bytes_max)} (largest batch) = "
        f"{human_bytes(need)}; mean batch {human_bytes(batch_bytes_mean)}"
    )
    if budget_bytes is None:
        lines.append("free memory unknown: no byte bound recommended; check it yourself")
        return QueueSizing(depth, min_ready, None, lines)
    if need <= budget_bytes:
        lines.append(f"fits the budget of {human_bytes(budget_bytes)}: no byte bound needed")
        return QueueSizing(depth, min_ready, None, lines)
    fit_max = max(1, budget_bytes // batch_bytes_max)
    lines.append(
        f"exceeds the budget of {human_bytes(budget_bytes)} (fits {fit_max} of the largest, "
        f"~{int(budget_bytes // batch_bytes_mean)} average batches): bound the bytes with "
        f"--hs-queue-bytes {budget_bytes}"
    )
    if min_ready > fit_max:
        lines.append(
            f"min_ready lowered {min_ready} -> {fit_max}: more of the largest batches would not "
            "fit, and a gate the buffer cannot reach stalls the drafters"
        )
        min_ready = int(fit_max)
    return QueueSizing(max(depth, min_ready), min_ready, budget_bytes, lines)


@dataclass
class BatchCap:
    """A --batch-tokens cap that lets `min_ready` of the largest batches fit the budget."""

    batch_tokens: int
    largest_bytes: int
    line: str


def recommend_batch_tokens(
    min_ready: int,
    batch_bytes_max: int,
    bytes_per_token: int,
    budget_bytes: int | None,
    longest_bucket: int,
) -> BatchCap | None:
    """Long rows: when even `min_ready` of the largest batches exceed the memory budget, a
    smaller --batch-tokens (padded tokens per batch) is what fits, not a lower gate (a gate of
    one or two batches is a FIFO: no mix, no slack). Never below one row of the longest
    bucket (a batch holds whole rows, and a single row is always admitted). None: no cap
    needed, or free memory unknown."""
    if budget_bytes is None or min_ready * batch_bytes_max <= budget_bytes:
        return None
    tokens = max(longest_bucket, budget_bytes // (min_ready * bytes_per_token))
    largest = min(batch_bytes_max, tokens * bytes_per_token)
    return BatchCap(
        tokens,
        largest,
        f"batches: {min_ready} x {human_bytes(batch_bytes_max)} (largest batch) exceeds the "
        f"budget: --batch-tokens {tokens} makes the largest {human_bytes(largest)}",
    )
