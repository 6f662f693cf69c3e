"""RunReporter: train/epoch counts what the whole job trained, once, across nodes and resumes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from dflash_train.pipeline.monitor import Accounting
from dflash_train.train.reporting import RunReporter

ROWS = 10


class OtherNodeTrained:
    """A two-node sum whose other node trained `other` sequences since the start."""

    world_size = 2

    def __init__(self, other: int) -> None:
        self.other = other

    def sum_metrics(self, values: np.ndarray) -> np.ndarray:
        return values + self.other


def reporter(accounting: Accounting, nodes) -> RunReporter:
    pipeline = SimpleNamespace(
        settings=SimpleNamespace(bucket_weights={0: 1.0}), replicas=[None], accounting=accounting
    )
    return RunReporter(
        pipeline, total_steps=10, log_every=1, num_rows=ROWS, num_targets=1, progress=False,
        say=lambda _m: None, nodes=nodes,
    )  # fmt: skip


def test_train_epoch_after_a_multi_node_resume_counts_the_restored_sequences_once():
    """Regression: rank 0 restores every node's trained ids and the metric multiplied its
    count by the number of nodes again (a resume of 1.5 epochs read as 3+)."""
    acc = Accounting(ROWS, 3)
    done = np.zeros((3, ROWS), dtype=bool)
    done[0] = True
    done[1, :5] = True  # 15 sequences trained before the stop, by both nodes together
    acc.restore(done)
    acc.add("trained", 1, [5, 6])  # rank 0 trained 2 more since the resume, rank 1 trained 3
    assert reporter(acc, OtherNodeTrained(3))._job_trained() == 20
    assert reporter(Accounting(ROWS, 3), None)._job_trained() == 0


def test_queue_age_is_logged_in_optimizer_steps():
    from dflash_train.pipeline.queue import BufferedHSQueue
    from dflash_train.train.interval import IntervalMetrics

    q = BufferedHSQueue(max_depth=50, min_ready=1, num_producers=1, bucket_weights={0: 1.0})
    for i in range(12):
        q.put(i, bucket=0)
    for _ in range(12):
        q.get()  # oldest first: the i-th waited i takes
    interval = IntervalMetrics({0: 1.0}, num_target_workers=1, num_drafters=2)
    interval.steps, interval.drawn = 6, {0: 12}  # 2 batches per step
    ages = interval._ages(q)
    assert ages == {"queue/age_steps_mean": 5.5 / 2, "queue/age_steps_max": 11 / 2}
    assert interval._ages(q) == {"queue/age_steps_mean": 0.0, "queue/age_steps_max": 0.0}
