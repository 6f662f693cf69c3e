"""Work batching: each batch fills one budget of block positions, of tokens, or a measured mix."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.bench.common import synthetic_anchors, synthetic_lengths
from dflash_train.bench.sim import Cost, lockstep_bound
from dflash_train.data.buckets import Batching, assign_buckets, fit_bucket_lengths, plan_epoch
from dflash_train.objective import blocks_per_row

BATCH, BLOCK, ANCHORS = 4, 16, 512


def plan(token_share: float, seed: int = 0, rows: int = 4000):
    lengths = synthetic_lengths(rows, seed)
    anchors = synthetic_anchors(lengths, seed, ANCHORS)
    buckets = fit_bucket_lengths(lengths, 8)
    rule = Batching(BATCH, None, "work", anchors, BLOCK, ANCHORS, token_share)
    specs = plan_epoch(assign_buckets(lengths, buckets), buckets, rule, seed, 0)
    tokens = np.array([len(s.seq_ids) * buckets[s.bucket] for s in specs])
    blocks = np.array(
        [
            len(s.seq_ids) * blocks_per_row(int(anchors[list(s.seq_ids)].max()), ANCHORS) * BLOCK
            for s in specs
        ]
    )
    return specs, tokens, blocks, buckets, len(lengths)


@pytest.mark.parametrize("share", [0.0, 0.3, 1.0])
def test_every_row_is_planned_once_and_no_batch_exceeds_its_budget(share):
    specs, tokens, blocks, buckets, n = plan(share)
    ids = sorted(i for s in specs for i in s.seq_ids)
    assert ids == list(range(n))
    units = (1 - share) * blocks / (ANCHORS * BLOCK) + share * tokens / buckets[-1]
    multi = np.array([len(s.seq_ids) > 1 for s in specs])
    assert (units[multi] <= BATCH + 1e-9).all()  # a single row is planned whatever it costs


def test_share_zero_is_a_budget_of_block_positions_and_one_a_budget_of_tokens():
    _, tokens0, blocks0, buckets, _ = plan(0.0)
    _, tokens1, blocks1, _, _ = plan(1.0)
    assert blocks0.max() <= BATCH * ANCHORS * BLOCK
    assert tokens1.max() <= BATCH * buckets[-1]
    # Each budget balances what it counts, and only that: a lockstep step of 7 drafters whose
    # cost follows the budgeted unit loses little, the other unit loses much.
    bound = {
        (share, unit): lockstep_bound(Cost(0.1, per_unit=float(u.mean())), u, 7)
        for share, units in ((0.0, (tokens0, blocks0)), (1.0, (tokens1, blocks1)))
        for unit, u in zip(("tokens", "blocks"), units, strict=True)
    }
    assert bound[0.0, "blocks"] > 0.95 and bound[1.0, "tokens"] > 0.9
    assert bound[0.0, "tokens"] < 0.7 and bound[1.0, "blocks"] < 0.7


def test_a_token_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="token_share"):
        Batching(4, None, "work", np.ones(3, np.int64), token_share=1.5)
