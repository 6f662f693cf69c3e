"""Padding figures of `bench padding`, checked against hand-computed cases."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_train.bench.common import synthetic_lengths
from dflash_train.bench.padding import (
    bucketed_padding,
    fifo_padding,
    measure,
    padding_in_order,
    rounding_floor,
)


def test_bucketed_padding_by_hand():
    # Rows 3 and 5 go to bucket 5, both 8s to bucket 8: padded 5+5+8+8 = 26, real 24.
    frac, problems = bucketed_padding(np.array([3, 5, 8, 8]), [5, 8], batch_size=2, seed=0)
    assert frac == pytest.approx(2 / 26)
    assert problems == []


def test_fifo_batches_pad_to_their_longest_row_by_hand():
    # [2, 6] -> 6, 6; [4, 4] -> 4, 4: padded 20, real 16.
    frac, shapes = padding_in_order(np.array([2, 6, 4, 4]), batch_size=2)
    assert frac == pytest.approx(4 / 20) and shapes == 2
    # A short last batch pads to its own longest row: [2, 6] -> 12, [4] -> 4.
    frac, _ = padding_in_order(np.array([2, 6, 4]), batch_size=2)
    assert frac == pytest.approx(4 / 16)


def test_rounding_floor_by_hand():
    assert rounding_floor(np.array([1, 8])) == pytest.approx(1 - 9 / 16)


def test_bucketed_padding_does_not_depend_on_batch_size_but_fifo_does():
    lengths = synthetic_lengths(2000, seed=1)
    buckets = [256, 512, 1024, 3072]
    small, _ = bucketed_padding(lengths, buckets, batch_size=2, seed=0)
    large, _ = bucketed_padding(lengths, buckets, batch_size=32, seed=0)
    assert small == pytest.approx(large)
    fifo_small, _ = fifo_padding(lengths, 2, seed=0)
    fifo_large, _ = fifo_padding(lengths, 32, seed=0)
    assert fifo_large > fifo_small


def test_more_buckets_never_pad_more():
    report = measure(synthetic_lengths(3000, seed=2), 4, 16, seed=0, sweep=(1, 2, 4, 8, 16, 32))
    by_k = report.summary["by_num_buckets"]
    fractions = [by_k[k] for k in sorted(by_k)]
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(fractions))
    assert report.summary["padding_fraction"] == by_k[16]
    assert report.summary["padding_fraction"] < report.summary["padding_fraction_fifo"]
    assert by_k[32] >= report.summary["rounding_floor"]
    assert report.problems == []
