"""The tuner's arithmetic: role split from measured rates, the readiness gate from the length mix,
and the queue bounds from batch bytes against free memory."""

from __future__ import annotations

import pytest

from dflash_train.bench.sizing import recommend_depth, recommend_split
from dflash_train.pipeline.mixing import (
    MIN_READY_FLOOR,
    random_pull_tv,
    recommend_min_ready,
    window_mix_tv,
)


def test_split_of_alike_devices_balances_the_two_sides():
    # Targets 3x faster than drafters on 8 alike devices: 2 targets (6) feed 6 drafters (6).
    split = recommend_split([3.0] * 8, [1.0] * 8)
    assert split.targets == [0, 1]
    assert split.drafters == [2, 3, 4, 5, 6, 7]
    assert split.target_rate == 6.0 and split.drafter_rate == 6.0
    assert split.expected == 6.0 and split.bound == "balanced"


def test_split_puts_the_device_that_is_best_at_targets_on_targets():
    # Device 1 runs the target 5x faster than the others; everyone drafts at 3.
    split = recommend_split([1.0, 5.0, 1.0], [3.0, 3.0, 3.0])
    assert split.targets == [1]
    assert split.drafters == [0, 2]
    assert split.expected == 5.0 and split.bound == "targets"


def test_split_prefers_fewer_targets_when_options_tie():
    split = recommend_split([1.0, 1.0], [1.0, 1.0])
    assert split.targets == [0] and split.drafters == [1]


def test_split_of_one_device_time_shares_it():
    split = recommend_split([2.0], [2.0])
    assert split.shared and split.targets == split.drafters == [0]
    assert split.expected == pytest.approx(1.0)  # 1 / (1/2 + 1/2)


@pytest.mark.parametrize(("targets", "drafters"), [([], []), ([1.0], [1.0, 2.0]), ([0.0], [1.0])])
def test_split_rejects_missing_or_non_positive_rates(targets, drafters):
    with pytest.raises(ValueError):
        recommend_split(targets, drafters)


def test_min_ready_covers_two_lockstep_steps_of_draws_and_the_default_slack():
    rec = recommend_min_ready({0: 0.5, 1: 0.5}, draws_per_step=7)
    assert rec.for_step == 14 and rec.value == MIN_READY_FLOOR
    rec = recommend_min_ready({0: 0.5, 1: 0.5}, draws_per_step=40)
    assert rec.value == 80 and "--hs-min-ready 80" in rec.explanation


def test_min_ready_no_longer_grows_with_the_bucket_count():
    """Regression: 16 buckets asked for ~71 buffered batches (a random buffer's arithmetic);
    the plan now interleaves the buckets, so the mix needs no deep buffer."""
    weights = {b: 1 / 16 for b in range(16)}
    assert recommend_min_ready(weights, draws_per_step=1).value == MIN_READY_FLOOR


def test_min_ready_is_capped_at_one_epoch_of_batches():
    weights = {b: 1 / 16 for b in range(16)}
    capped = recommend_min_ready(weights, draws_per_step=1, epoch_batches=20)
    assert capped.value == 20 and "capped" in capped.explanation


def test_a_window_of_draws_follows_the_mix_as_closely_as_integers_allow():
    assert window_mix_tv({0: 0.5, 1: 0.5}, 50) == pytest.approx(0.0)
    many = {b: 1 / 16 for b in range(16)}
    # 16 buckets in 50 draws: 50 / 16 = 3.125 per bucket, so some get 3, some 4.
    assert 0.02 < window_mix_tv(many, 50) < 0.06
    assert window_mix_tv(many, 800) < 0.01


def test_depth_is_three_times_min_ready_when_memory_allows():
    sizing = recommend_depth(30, batch_bytes_max=100, batch_bytes_mean=50.0, budget_bytes=9000)
    assert (sizing.depth, sizing.min_ready, sizing.queue_bytes) == (90, 30, None)


def test_depth_beyond_memory_gets_a_byte_bound_at_the_budget():
    # 90 x 100 B = 9000 B > 5000 B, but 30 of the largest (3000 B) still fit.
    sizing = recommend_depth(30, batch_bytes_max=100, batch_bytes_mean=50.0, budget_bytes=5000)
    assert (sizing.depth, sizing.min_ready, sizing.queue_bytes) == (90, 30, 5000)


def test_min_ready_drops_to_what_memory_holds_of_the_largest_batches():
    sizing = recommend_depth(30, batch_bytes_max=100, batch_bytes_mean=50.0, budget_bytes=2000)
    assert sizing.min_ready == 20 and sizing.queue_bytes == 2000
    assert sizing.depth >= sizing.min_ready
    assert any("min_ready lowered 30 -> 20" in line for line in sizing.lines)


def test_unknown_free_memory_gives_no_byte_bound():
    sizing = recommend_depth(10, batch_bytes_max=100, batch_bytes_mean=50.0, budget_bytes=None)
    assert sizing.queue_bytes is None and sizing.depth == 30


def test_a_random_pull_strays_from_the_mix_less_as_the_window_grows():
    weights = {b: 1.0 for b in range(16)}
    small, large = random_pull_tv(weights, 100), random_pull_tv(weights, 10_000)
    assert 0.1 < small < 0.25 and large < 0.02 and large < small
    assert random_pull_tv({0: 1.0}, 50) == 0.0  # one bucket: every pull is the mix


def test_the_run_is_told_when_buckets_or_the_queue_cannot_keep_the_mix_fresh():
    from dflash_train.pipeline.mixing import mix_notes

    many = {0: 0.5, **{b: 0.5 / 15 for b in range(1, 16)}}  # 15 small buckets beside a big one
    assert mix_notes(many, draws_per_step=7, depth=90, epoch_batches=1000) == []
    (note,) = mix_notes(many, draws_per_step=1, depth=90, epoch_batches=1000)
    assert "16 buckets cannot follow the length mix" in note
    (note,) = mix_notes({0: 0.5, 1: 0.5}, draws_per_step=1, depth=90, epoch_batches=51)
    assert "holds 1.8 epochs" in note and "--hs-queue-depth 25" in note


def test_long_rows_get_smaller_batches_not_a_gate_the_buffer_cannot_reach():
    from dflash_train.bench.sizing import recommend_batch_tokens

    per_token = 40 * 2**10  # Qwen3-8B, K = 5, bf16: 40 KiB per token
    largest = 4 * 32768 * per_token  # 4 rows of 32K tokens: 5 GiB
    budget = 60 * 2**30
    cap = recommend_batch_tokens(30, largest, per_token, budget, longest_bucket=32768)
    assert cap is not None and 30 * cap.largest_bytes <= budget
    assert cap.batch_tokens == 60 * 2**30 // (30 * per_token)  # 52,428: one 32K row a batch
    assert "--batch-tokens 52428" in cap.line
    assert recommend_batch_tokens(30, largest, per_token, 10**15, 32768) is None
    assert recommend_batch_tokens(30, largest, per_token, None, 32768) is None
    # Never below one row of the longest bucket: the byte bound takes over from there.
    tiny = recommend_batch_tokens(30, largest, per_token, 2**30, 32768)
    assert tiny is not None and tiny.batch_tokens == 32768
