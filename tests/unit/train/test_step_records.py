"""The step-records channel: a plain bounded FIFO whose bound follows the log interval, and a
producer that cannot block forever once the run stops."""

from __future__ import annotations

import threading
import time

import pytest

from dflash_train.pipeline.queue import QueueStopped
from dflash_train.train.step_records import EvalRecord, StepRecords


def test_the_bound_is_two_log_intervals_plus_slack_and_order_is_kept():
    records = StepRecords(log_every=5, stop=threading.Event())
    assert records.bound == 18
    for i in range(records.bound):
        records.put(EvalRecord(i, 1.0, 0.0))
    assert [records.get(timeout=0.1).step for _ in range(records.bound)] == list(range(18))
    assert records.get(timeout=0.01) is None


def test_a_full_channel_blocks_the_producer_until_the_run_stops():
    stop = threading.Event()
    records = StepRecords(log_every=1, stop=stop, poll_s=0.01)
    for i in range(records.bound):
        records.put(EvalRecord(i, 1.0, 0.0))
    raised = []

    def producer():
        try:
            records.put(EvalRecord(99, 1.0, 0.0))
        except QueueStopped as e:
            raised.append(e)

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()  # blocked: the main thread is behind
    stop.set()
    t.join(timeout=2)
    assert not t.is_alive() and len(raised) == 1
    with pytest.raises(QueueStopped):
        records.put(EvalRecord(100, 1.0, 0.0))


def test_a_stop_while_the_channel_is_full_keeps_the_last_record_for_the_main_thread():
    """Regression (issue 33, item 12): a SIGTERM while the main thread was behind dropped the
    record rank 0 was putting, so the last step never got its metric line."""
    stop = threading.Event()
    records = StepRecords(log_every=1, stop=stop, poll_s=0.01)
    for i in range(records.bound):
        records.put(EvalRecord(i, 1.0, 0.0))
    stop.set()
    with pytest.raises(QueueStopped):  # rank 0 stops at once, without waiting for room
        records.put(EvalRecord(records.bound, 1.0, 0.0))
    got = []
    while (rec := records.get(timeout=0.0)) is not None:
        got.append(rec.step)
    assert got == list(range(records.bound + 1))  # in order, the last one included
