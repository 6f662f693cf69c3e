"""The pipeline built from its parts (simulated stages): a clean end with exact accounting, a
failing stage ending everything quickly, the watchdog, and a shutdown safe to repeat."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from dflash_train.bench.sim import (
    Cost,
    SimulatedBuilder,
    SimulatedExtractor,
    SimulatedReplica,
    SleepClock,
    StepLog,
)
from dflash_train.data.buckets import Batching, bucket_weights, fit_bucket_lengths
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.prefetch import EpochPlans
from dflash_train.pipeline.workers import PipelineError

ROWS = 60


def parts(num_sources=2, num_replicas=3, epochs=2):
    lengths = np.random.default_rng(0).integers(20, 200, ROWS)
    buckets = fit_bucket_lengths(lengths, 4)
    plans = EpochPlans(lengths, buckets, Batching(4), 0, epochs)
    clock = SleepClock()
    sources = [SimulatedExtractor(clock, Cost(0.0)) for _ in range(num_sources)]
    replicas = [SimulatedReplica(clock, Cost(0.0)) for _ in range(num_replicas)]
    feed = TargetFeed(plans, SimulatedBuilder(lengths, buckets), sources)
    settings = PipelineSettings(
        total_steps=10_000,
        num_prefetchers=2,
        hs_queue_depth=8,
        hs_min_ready=4,
        bucket_weights=bucket_weights(plans.epoch(0)),
        stall_timeout_s=30.0,
    )
    return settings, feed, replicas


def alive_pipeline_threads() -> list[str]:
    prefixes = ("prefetch-", "target-", "drafter-", "watchdog")
    return [t.name for t in threading.enumerate() if t.name.startswith(prefixes)]


def test_a_target_feed_trains_every_sequence_of_every_epoch_exactly_once():
    settings, feed, replicas = parts()
    steps = StepLog()
    pipeline = Pipeline(settings, feed, replicas, listener=steps)
    pipeline.start()
    assert pipeline.wait(timeout_s=60)
    assert pipeline.shutdown() == [] and pipeline.shutdown() == []  # safe to repeat
    stats = pipeline.stats()
    assert stats.accounting == {"read": 2 * ROWS, "target": 2 * ROWS, "trained": 2 * ROWS}
    assert pipeline.accounting.problems(complete=True) == []
    assert stats.steps == len(steps.times) and sum(steps.batches) == stats.hidden_states.got_total
    assert len({r.step for r in replicas}) == 1  # lockstep: every replica applied every step
    assert alive_pipeline_threads() == []


def test_a_failing_stage_stops_the_pipeline_with_its_name_and_traceback():
    settings, feed, replicas = parts()

    class Broken:
        device = feed.sources[0].device

        def __call__(self, _input_ids):
            raise RuntimeError("injected target failure")

    feed.sources[1] = Broken()
    pipeline = Pipeline(settings, feed, replicas)
    t0 = time.monotonic()
    pipeline.start()
    with pytest.raises(PipelineError, match="worker 'target-1' failed: RuntimeError: injected"):
        pipeline.wait(timeout_s=30)
    assert time.monotonic() - t0 < 10
    assert pipeline.shutdown() == [] and alive_pipeline_threads() == []


def test_the_watchdog_declares_a_stall_and_logs_every_thread_stack():
    settings, feed, replicas = parts(num_sources=1)
    release = threading.Event()

    class Stuck:
        device = feed.sources[0].device

        def __call__(self, _input_ids):
            release.wait(30)  # never returns on its own within the test
            raise RuntimeError("released")

    feed.sources[0] = Stuck()
    logged: list[str] = []
    settings = PipelineSettings(
        total_steps=10_000, num_prefetchers=2, hs_queue_depth=8, hs_min_ready=4, stall_timeout_s=0.5
    )
    engine_note = "the engine (pid 7) still running; its last log lines:\nstep 3"
    pipeline = Pipeline(
        settings, feed, replicas, log=logged.append, describe_stall=lambda: engine_note
    )
    pipeline.start()
    with pytest.raises(PipelineError, match="watchdog.*no pipeline progress for 0s") as raised:
        pipeline.wait(timeout_s=30)
    assert engine_note in str(raised.value)  # what the pipeline cannot see is in the report
    release.set()
    assert pipeline.shutdown() == []
    assert len(logged) == 1 and "--- thread target-0 ---" in logged[0]
    assert "release.wait(30)" in logged[0]  # the stuck line itself is in the stack


def test_every_drafter_times_its_loop_part_by_part_and_rank_0_its_listener():
    """The drafters' own loop is timed whole (`bench gap` splits a run's step with it): one
    micro-step per batch, one rendezvous and one apply per step and replica, one listener call
    per step (rank 0's)."""
    settings, feed, replicas = parts(num_replicas=2, epochs=1)
    steps = StepLog()
    pipeline = Pipeline(settings, feed, replicas, listener=steps)
    pipeline.start()
    assert pipeline.wait(timeout_s=60)
    pipeline.shutdown()
    seconds, counts = pipeline.timers.snapshot()
    batches, applied = pipeline.stats().hidden_states.got_total, len(steps.times)
    assert counts["drafter_micro_step_s"] == batches
    assert counts["drafter_apply_s"] == 2 * applied
    assert counts["drafter_listener_s"] == applied
    assert counts["drafter_rendezvous_s"] >= 2 * applied  # the last, empty exchange too
    assert seconds["drafter_rendezvous_s"] >= seconds["grad_sync_s"]  # the reduce is inside


def test_a_schedule_shorter_than_the_data_reads_only_the_batches_it_trains():
    """With --max-steps before the data's end, the prefetchers and targets stop where the
    schedule does: every batch read is trained, none computed for nothing."""
    settings, feed, replicas = parts(num_replicas=2, epochs=1)
    settings = dataclasses.replace(settings, total_steps=3)
    steps = StepLog()
    pipeline = Pipeline(settings, feed, replicas, listener=steps)
    pipeline.start()
    assert pipeline.wait(timeout_s=60)
    pipeline.shutdown()
    stats = pipeline.stats()
    assert len(steps.times) == 3 and stats.hidden_states.put_total == 6  # 3 steps x 2 replicas
    assert stats.accounting["read"] == stats.accounting["target"] == stats.accounting["trained"]
    assert stats.accounting["trained"] < ROWS
    assert pipeline.accounting.problems(complete=False) == []


def test_a_consumed_batch_s_features_are_freed_before_the_step_is_applied():
    """Regression: a drafter held its last batch (features included) through the rendezvous,
    the optimizer and rank 0's listener, and a target worker held the features it had queued
    until its next forward returned: up to one batch per worker on the devices outside
    --hs-queue-bytes."""
    import gc
    import weakref

    settings, feed, _ = parts(num_sources=1, num_replicas=1, epochs=1)
    settings = dataclasses.replace(settings, hs_queue_depth=2, hs_min_ready=1)  # no buffer
    clock = SleepClock()
    forwards = threading.Condition()
    started = [0]

    class Target(SimulatedExtractor):
        def __call__(self, input_ids):
            with forwards:  # the worker is past the batch before: in its next forward
                started[0] += 1
                forwards.notify_all()
            return super().__call__(input_ids)

    feed.sources[0] = Target(clock, Cost(0.2))
    consumed: list[weakref.ref] = []
    held: list[bool] = []

    class Checks(SimulatedReplica):
        def micro_step(self, batch):
            consumed.append(weakref.ref(batch.features))
            return super().micro_step(batch)

        def apply(self, global_weight):
            with forwards:  # none after the last batch
                after = forwards.wait_for(lambda: started[0] > len(consumed), timeout=2.0)
            if after:
                gc.collect()
                held.append(consumed[-1]() is not None)
            return super().apply(global_weight)

    pipeline = Pipeline(settings, feed, [Checks(clock, Cost(0.0))])
    pipeline.start()
    assert pipeline.wait(timeout_s=60)
    assert pipeline.shutdown() == []
    assert len(held) > 5 and not any(held)
