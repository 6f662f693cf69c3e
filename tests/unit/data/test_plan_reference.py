"""The vectorised planning gives exactly the plans of the straightforward per-row one.

The reference below is the planning as it was written before it was vectorised (one Python
step per row): `plan_epoch`, `interleave`, the work cut, `auto_bucket_lengths` (a full plan per
bucket option) and `EpochPlans.stream_lengths` (every epoch planned and dealt). Determinism and
resume rest on the plans staying the same, batch for batch and in the same order, so every
comparison here is exact."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dflash_train.data.buckets import (
    Batching,
    BatchSpec,
    RowKinds,
    assign_buckets,
    batch_counts,
    bucket_weights,
    fit_bucket_lengths,
    fit_bucket_options,
    padding_fraction,
    plan_epoch,
    rows_within,
)
from dflash_train.objective import blocks_per_row, blocks_per_rows
from dflash_train.pipeline.mixing import MIX_TV_PLAN, window_mix_tv
from dflash_train.pipeline.prefetch import EpochPlans
from dflash_train.train.setup import AUTO_MAX_BUCKETS, PADDING_GOAL, auto_bucket_lengths


# ----------------------------------------------------------------------------- the reference
def ref_cut(rule: Batching, rows: np.ndarray, bucket_len: int, longest: int) -> list[tuple]:
    if rule.mode == "fixed":
        size = max(1, rule.batch_tokens // bucket_len) if rule.batch_tokens else rule.batch_size
        return [tuple(int(r) for r in rows[i : i + size]) for i in range(0, len(rows), size)]
    anchors = rule.anchors[rows]
    blocks = np.array([blocks_per_row(int(a), rule.num_anchors) for a in anchors])
    order = np.argsort(blocks, kind="stable")
    s = rule.token_share
    tokens_unit = s * bucket_len / longest

    def row_units(wide: int) -> float:
        return (1.0 - s) * wide / rule.num_anchors + tokens_unit

    max_rows = max(1, (rule.batch_tokens or rule.batch_size * longest) // bucket_len)
    out, batch, widest = [], [], 0
    for i in order:
        wide = max(widest, int(blocks[i]))
        if batch and (
            (len(batch) + 1) * row_units(wide) > rule.batch_size * (1 + 1e-9)
            or len(batch) + 1 > max_rows
        ):
            out.append(tuple(batch))
            batch, wide = [], int(blocks[i])
        batch.append(int(rows[i]))
        widest = wide
    if batch:
        out.append(tuple(batch))
    return out


def ref_interleave(counts: list[int], rng: np.random.Generator) -> list[tuple[int, int]]:
    due = []
    for b, n in enumerate(counts):
        picks = rng.permutation(n)
        times = (np.arange(n) + rng.random(n)) / max(1, n)
        due += [(float(t), b, int(j)) for t, j in zip(times, picks, strict=True)]
    due.sort()
    return [(b, j) for _, b, j in due]


def ref_plan(bucket_of, bucket_lengths, rule, seed, epoch) -> list[BatchSpec]:
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    order = rng.permutation(len(bucket_of))
    per_bucket = [
        ref_cut(rule, order[bucket_of[order] == b], blen, bucket_lengths[-1])
        for b, blen in enumerate(bucket_lengths)
    ]
    return [
        BatchSpec(epoch, i, b, per_bucket[b][j])
        for i, (b, j) in enumerate(ref_interleave([len(x) for x in per_bucket], rng))
    ]


def ref_auto(lengths, rule, seed, window_draws) -> list[int]:
    options = fit_bucket_options(lengths, AUTO_MAX_BUCKETS)
    rows = np.asarray(lengths)
    pads = [padding_fraction(rows, np.asarray(b)[assign_buckets(rows, b)]) for b in options]
    start = next((i for i, pad in enumerate(pads) if pad <= PADDING_GOAL), len(options) - 1)
    for b in options[start::-1]:
        weights = bucket_weights(ref_plan(assign_buckets(rows, b), b, rule, seed, 0))
        if window_mix_tv(weights, window_draws) <= MIX_TV_PLAN:
            return b
    return options[0]


def ref_stream_lengths(plans: EpochPlans) -> list[int]:
    counts = [0] * plans.nodes
    for e in range(plans.epochs):
        seen = [0] * len(plans.bucket_lengths)
        for spec in ref_plan(plans.bucket_of, plans.bucket_lengths, plans.batching, plans.seed, e):
            rank, seen[spec.bucket] = seen[spec.bucket], seen[spec.bucket] + 1
            done = plans.done is not None and plans.done[e][list(spec.seq_ids)].all()
            if not done:
                counts[rank % plans.nodes] += 1
    return counts


# ----------------------------------------------------------------------------- varied inputs
def case(k: int) -> tuple[np.ndarray, list[int], Batching]:
    """Case k: random lengths, anchor counts, buckets and batching settings."""
    rng = np.random.default_rng([k, 77])
    n = int(rng.choice([1, 2, 7, 60, 500, 3000]))
    lengths = np.clip(rng.lognormal(np.log(rng.integers(20, 400)), 0.8, n), 2, 3000).astype(int)
    num_anchors = int(rng.choice([1, 12, 16, 64, 100, 512]))
    anchors = np.minimum(rng.integers(0, lengths + 1), int(rng.choice([num_anchors, 10**6])))
    anchors[rng.random(n) < 0.1] = 0  # rows with no anchor at all
    if rng.random() < 0.3:
        buckets = sorted({int(lengths.max()), *rng.integers(1, lengths.max() + 1, 3).tolist()})
    else:
        buckets = fit_bucket_lengths(lengths, int(rng.integers(1, 10)))
    mode = "work" if k % 3 else "fixed"
    share = float(rng.choice([0.0, 1.0, 0.45, rng.random()]))
    tokens = None if rng.random() < 0.5 else int(rng.integers(1, 4 * buckets[-1]))
    rule = Batching(
        int(rng.integers(1, 9)),
        tokens,
        mode,
        anchors if mode == "work" else None,
        16,
        num_anchors,
        share if mode == "work" else 0.0,
    )
    return lengths, buckets, rule


CASES = range(60)


@pytest.mark.parametrize("k", CASES)
def test_plans_are_the_reference_plans_batch_for_batch(k):
    lengths, buckets, rule = case(k)
    bucket_of = assign_buckets(lengths, buckets)
    for seed, epoch in ((k, 0), (k + 1, 3)):
        got = plan_epoch(bucket_of, buckets, rule, seed, epoch)
        assert got == ref_plan(bucket_of, buckets, rule, seed, epoch)
        counts = [sum(s.bucket == b for s in got) for b in range(len(buckets))]
        assert batch_counts(bucket_of, buckets, rule) == counts
        assert RowKinds.of(lengths, rule).batch_counts(buckets, rule) == counts


@pytest.mark.parametrize("k", CASES)
def test_a_bucket_cut_is_the_reference_cut(k):
    lengths, buckets, rule = case(k)
    rows = np.random.default_rng(k).permutation(len(lengths))
    for blen in buckets:
        assert rule.cut(rows, blen, buckets[-1]) == ref_cut(rule, rows, blen, buckets[-1])


@pytest.mark.parametrize("k", range(0, 60, 4))
def test_auto_buckets_and_padding_are_the_references(k):
    lengths, _, rule = case(k)
    kinds = RowKinds.of(lengths, rule)
    for b in fit_bucket_options(lengths, 6):
        padded = np.asarray(b)[assign_buckets(lengths, b)]
        assert kinds.padding(b) == padding_fraction(lengths, padded)
    for window in (1, 30, 500):
        assert auto_bucket_lengths(lengths, rule, k, window) == ref_auto(lengths, rule, k, window)


@pytest.mark.parametrize("k", range(1, 60, 5))
@pytest.mark.parametrize("nodes", [1, 3])
def test_stream_lengths_are_the_references_fresh_and_resumed(k, nodes):
    lengths, buckets, rule = case(k)
    epochs = 3
    fresh = EpochPlans(lengths, buckets, rule, k, epochs, shard=(0, nodes))
    assert fresh.stream_lengths() == ref_stream_lengths(fresh)
    done = np.zeros((epochs, len(lengths)), dtype=bool)
    done[0] = True  # epoch 0 finished, some batches of epoch 1 trained, epoch 2 untouched
    for spec in ref_plan(fresh.bucket_of, buckets, rule, k, 1)[::3]:
        done[1, list(spec.seq_ids)] = True
    resumed = EpochPlans(lengths, buckets, rule, k, epochs, done, (nodes - 1, nodes))
    assert resumed.stream_lengths() == ref_stream_lengths(resumed)


def boundary_shares(size: int, wide: int, blen: int, longest: int) -> list[float]:
    """Token shares that make k rows `wide` blocks wide cost just under, at, or just over the
    budget of `size` (within its 1e-9 slack, or past it) for a few k."""
    blocks, tokens = wide / 512, blen / longest  # a row's units at share 0 and at share 1
    shares: list[float] = []
    if tokens == blocks:
        return shares  # every share costs the same
    for k in range(1, 40):
        for stretch in (-1e-12, 0.0, 5e-10, 1e-9, 2e-9):
            share = (size / k * (1 + stretch) - blocks) / (tokens - blocks)
            if 0.0 <= share <= 1.0:
                shares.append(share)
    return shares


def test_work_cuts_at_the_budgets_float_boundary_as_the_reference():
    """Shares whose row units multiply to just over or under the budget: the count of rows
    that fit is decided by the same float product as the reference's check."""
    rows = np.arange(400)
    rng = np.random.default_rng(5)
    anchors = rng.integers(0, 600, len(rows))
    settings = ((4, 3072, 64), (3, 1000, 1000), (7, 96, 8), (5, 300, 100))
    for size, longest, blen in settings:
        shares = [0.0, 1.0, 1 / 3, *rng.random(20).tolist()]
        shares += [s for wide in (16, 64, 512) for s in boundary_shares(size, wide, blen, longest)]
        for share in shares:
            rule = Batching(size, None, "work", anchors, 16, 512, share)
            assert rule.cut(rows, blen, longest) == ref_cut(rule, rows, blen, longest)


def test_rows_within_is_the_row_by_row_check_where_the_division_misleads():
    """Units an ulp or a few from budget / k, where int(budget / unit) is off by one."""

    def by_rows(unit: float, budget: float, max_rows: int) -> int:
        rows = 1
        while rows + 1 <= max_rows and (rows + 1) * unit <= budget:
            rows += 1
        return rows

    for size in range(1, 9):
        budget = size * (1 + 1e-9)
        for k in range(1, 300):
            unit = budget / k
            for _ in range(4):
                for u in (unit, math.nextafter(unit, -math.inf), math.nextafter(unit, math.inf)):
                    for max_rows in (1, k - 1, k, k + 1, 10**6):
                        if max_rows >= 1:
                            assert rows_within(u, budget, max_rows) == by_rows(u, budget, max_rows)
                unit = math.nextafter(unit, math.inf)
    assert rows_within(3.0, 2.0, 5) == 1 and rows_within(0.0, 1.0, 7) == 7


def test_blocks_per_rows_is_blocks_per_row():
    counts = np.array(sorted({-3, 0, *(2**e + d for e in range(40) for d in (-1, 0, 1))}))
    for num_anchors in (1, 12, 16, 100, 512, 2**40):
        want = [blocks_per_row(int(c), num_anchors) for c in counts]
        assert blocks_per_rows(counts, num_anchors).tolist() == want


def test_a_changed_plan_fails_the_comparison():
    """The comparison sees one batch moved, one row swapped between two batches, or two
    batches' order swapped."""
    lengths, buckets, rule = case(5)
    bucket_of = assign_buckets(lengths, buckets)
    plan = plan_epoch(bucket_of, buckets, rule, 0, 0)
    want = ref_plan(bucket_of, buckets, rule, 0, 0)
    assert plan == want
    a, b = plan[0], plan[1]
    moved = [*plan[1:], plan[0]]
    swapped_rows = [
        dataclasses.replace(a, seq_ids=(b.seq_ids[0], *a.seq_ids[1:])),
        dataclasses.replace(b, seq_ids=(a.seq_ids[0], *b.seq_ids[1:])),
        *plan[2:],
    ]
    swapped_order = [dataclasses.replace(b, index=0), dataclasses.replace(a, index=1), *plan[2:]]
    for wrong in (moved, swapped_rows, swapped_order):
        assert wrong != want


def test_a_cut_one_row_short_fails_the_comparison(monkeypatch):
    """A work cut that holds one row fewer per batch than the budget allows is caught."""
    lengths, buckets, rule = case(5)
    bucket_of = assign_buckets(lengths, buckets)
    want = ref_plan(bucket_of, buckets, rule, 0, 0)
    fitting = Batching._rows_fitting
    monkeypatch.setattr(Batching, "_rows_fitting", lambda self, *a: max(1, fitting(self, *a) - 1))
    assert plan_epoch(bucket_of, buckets, rule, 0, 0) != want
