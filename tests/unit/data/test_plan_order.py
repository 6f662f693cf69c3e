"""The epoch plan's order: every stretch of an epoch follows the bucket shares (the producers
emit the length mix), each node's shard does too, and --num-buckets auto trades padding
against how closely a short window can follow the mix."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.bench.common import synthetic_anchors, synthetic_lengths
from dflash_train.data.buckets import (
    Batching,
    assign_buckets,
    fit_bucket_lengths,
    fit_bucket_options,
    interleave,
    padding_fraction,
    plan_epoch,
)
from dflash_train.pipeline.prefetch import EpochPlans


def test_every_window_of_the_interleaved_order_holds_each_bucket_by_its_share():
    """Regression: the plan was a shuffle, so a 50-batch stretch of 16 buckets strayed from the
    mix as far as a random pull and the queue had to buffer ~70 batches to correct it."""
    counts = [3, 40, 7, 150, 1, 19]
    order = interleave(counts, np.random.default_rng(0))
    assert sorted(order) == sorted((b, j) for b, n in enumerate(counts) for j in range(n))
    buckets = np.array([b for b, _ in order])
    total = sum(counts)
    for length in (10, 37, 50):
        for start in range(0, total - length + 1):
            window = buckets[start : start + length]
            for b, n in enumerate(counts):
                # +-1 in due time, plus how far the other buckets' jitter moves the stretch
                slack = 2 + len(counts) * n / total
                assert abs((window == b).sum() - length * n / total) < slack, (length, start, b)

    # A shuffle of the same counts strays further in some window.
    def worst(order):
        return max(abs((order[s : s + 50] == 1).sum() - 50 * 40 / total) for s in range(total - 49))

    assert worst(np.random.default_rng(0).permutation(buckets)) > worst(buckets) + 2


def test_within_a_bucket_the_order_is_shuffled():
    order = interleave([200], np.random.default_rng(1))
    picks = [j for _, j in order]
    assert sorted(picks) == list(range(200)) and picks != list(range(200))


def test_each_nodes_shard_follows_the_shares_and_the_shards_partition_the_epoch():
    lengths = synthetic_lengths(3000, 0)
    buckets = fit_bucket_lengths(lengths, 8)
    rule = Batching(4)
    shards = [EpochPlans(lengths, buckets, rule, 0, 1, shard=(k, 3)) for k in range(3)]
    whole = shards[0].epoch(0)
    got = [list(s.iter_all()) for s in shards]
    keys = sorted((b.epoch, b.index) for g in got for b in g)
    assert keys == sorted((b.epoch, b.index) for b in whole)
    for g in got:
        for b in range(len(buckets)):
            n = sum(s.bucket == b for s in whole)
            assert abs(sum(s.bucket == b for s in g) - n / 3) <= 1
        first = np.array([s.bucket for s in g[:60]])
        share = {b: sum(s.bucket == b for s in whole) / len(whole) for b in range(len(buckets))}
        assert all(abs((first == b).sum() - 60 * w) < 3 for b, w in share.items())


def test_fit_bucket_options_is_fit_bucket_lengths_at_every_count():
    lengths = synthetic_lengths(2000, 3)
    options = fit_bucket_options(lengths, 12)
    assert [len(o) for o in options] == list(range(1, 13))
    for k in (1, 5, 12):
        assert options[k - 1] == fit_bucket_lengths(lengths, k)


@pytest.mark.parametrize("draws_per_step", [1, 7])
def test_auto_buckets_pad_little_where_the_window_allows_and_mix_where_it_does_not(
    draws_per_step,
):
    from dflash_train.data.buckets import bucket_weights
    from dflash_train.pipeline.mixing import MIX_TV_PLAN, MIX_WINDOW_STEPS, window_mix_tv
    from dflash_train.train.setup import PADDING_GOAL, auto_bucket_lengths

    lengths = synthetic_lengths(4000, 0)
    rule = Batching(4, None, "work", synthetic_anchors(lengths, 0, 512), 16, 512, 0.0)
    window = MIX_WINDOW_STEPS * draws_per_step
    chosen = auto_bucket_lengths(lengths, rule, 0, window)
    weights = bucket_weights(plan_epoch(assign_buckets(lengths, chosen), chosen, rule, 0, 0))
    assert window_mix_tv(weights, window) <= MIX_TV_PLAN
    pad = padding_fraction(lengths, np.asarray(chosen)[assign_buckets(lengths, chosen)])
    if draws_per_step == 7:  # enough draws per window: the fewest buckets that pad <= 5%
        assert pad <= PADDING_GOAL
        fewer = fit_bucket_lengths(lengths, len(chosen) - 1)
        assert padding_fraction(lengths, np.asarray(fewer)[assign_buckets(lengths, fewer)]) > pad
    else:  # one batch per step: fewer buckets than padding alone would take
        assert len(chosen) < len(auto_bucket_lengths(lengths, rule, 0, 7 * MIX_WINDOW_STEPS))


def test_stream_lengths_count_each_nodes_stream_and_the_longest_outgrows_the_average():
    """Issue 33 item 1: dealing each bucket's batches in turn gives node 0 up to one batch
    more per bucket and epoch, so the nodes' streams differ in length; the schedule must
    cover the longest (the average of the epoch's batches over the nodes left rows out)."""
    lengths = synthetic_lengths(300, 1)
    buckets = fit_bucket_lengths(lengths, 8)
    shards = [EpochPlans(lengths, buckets, Batching(3), 0, 2, shard=(k, 2)) for k in range(2)]
    counts = shards[0].stream_lengths()
    assert counts == shards[1].stream_lengths()  # every node knows every node's count
    assert counts == [len(list(s.iter_all())) for s in shards]
    assert max(counts) > -(-sum(counts) // 2)  # the old ceil(total / nodes) is too short
    done = np.zeros((2, len(lengths)), dtype=bool)
    first = next(iter(shards[1].iter_all()))
    done[first.epoch, list(first.seq_ids)] = True  # a resumed run trained node 1's first batch
    resumed = EpochPlans(lengths, buckets, Batching(3), 0, 2, done=done, shard=(0, 2))
    assert resumed.stream_lengths() == [counts[0], counts[1] - 1]
