"""Same seed, same drafter: which batch each replica trains at each step follows from the data,
flags, seed and world size alone (`--mix plan`, the default), whatever the threads' timing.

Every test runs the real trainer twice with random delays injected into every pipeline stage
(the fault plan's "jitter" action, a different seed per run, so the threads interleave
differently) and asserts identical logged losses at every step and identical final weights;
the resume tests stop a run at a random step and assert the uninterrupted run's losses and
weights after it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from dflash_train import cli, faults
from dflash_train.train.command import metrics_sink
from dflash_train.train.resume import resume_config
from dflash_train.train.trainer import Trainer
from pipeline_helpers import (
    StopsAt,
    jitter,
    logged_losses,
    tiny_train_config,
    write_random_dataset,
)

ROWS = 30
K = 3  # target features of the 6-layer tiny target


@pytest.fixture(autouse=True)
def no_faults_after():
    yield
    faults.install(None)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_random_dataset(tmp_path_factory.mktemp("det") / "data", num_rows=ROWS)


def config(target, data, out, **overrides):
    """2 prefetchers, 2 target workers, 2 drafter replicas, the default plan order, two
    buckets (so the two kinds of batch cost differently and arrive out of order), a metric
    line every step."""
    base = dict(
        epochs=2,
        log_every=1,
        bucket_lengths=[64, 128],
        num_target_features=K,
        hs_queue_depth=6,
        hs_min_ready=2,
    )
    return tiny_train_config(target, data, out, **{**base, **overrides})


class ArrivalRecorder(Trainer):
    """Records the stream positions in the order they reached the hidden-state queue."""

    arrivals: list[int]

    def build(self) -> None:
        super().build()
        self.arrivals = []
        q = self.pipeline.hs_queue
        put = q.put

        def recording_put(item, **kw):
            self.arrivals.append(kw.get("seq", -1))
            return put(item, **kw)

        q.put = recording_put


def run(cfg, cls=Trainer, resume=None, seed: int | None = None, **kwargs):
    faults.install(None if seed is None else jitter(seed))
    trainer = cls(cfg, log=lambda _m: None, resume=resume, sink_factory=metrics_sink(cfg), **kwargs)
    trainer.build()
    result = trainer.run()
    faults.install(None)
    return trainer, result


def assert_same_run(a: Path, b: Path, ra, rb) -> None:
    la, lb = logged_losses(a), logged_losses(b)
    assert la and la.keys() == lb.keys()
    assert la == lb, [s for s in la if la[s] != lb[s]][:5]  # exact: the same floats
    assert ra.weights_digest == rb.weights_digest


def test_two_runs_with_random_stage_delays_train_the_same_drafter(tiny_target, data, tmp_path):
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"run{seed}"
        np.random.seed(100 + seed)  # as two processes find them: seeded from the OS
        random.seed(100 + seed)
        trainer, result = run(config(tiny_target, data, out), ArrivalRecorder, seed=seed)
        assert result.complete and "all match" in result.accounting
        runs.append((out, result, trainer.arrivals))
    (a, ra, arrived_a), (b, rb, arrived_b) = runs
    # The delays did reorder the batches' arrival (else this test could not fail) ...
    assert arrived_a != sorted(arrived_a) or arrived_b != sorted(arrived_b)
    # ... and the queue restored the plan's order: the same losses and weights.
    assert_same_run(a, b, ra, rb)
    # The same checkpoint too, its optimizer and recorded generators byte for byte (numpy's
    # and Python's were left unseeded, so two such runs' checkpoints differed).
    for name in ("model.safetensors", "optimizer.safetensors", "state.safetensors"):
        sa, sb = (r / "checkpoint" / name for r in (a, b))
        assert sa.read_bytes() == sb.read_bytes(), name
    states = [json.loads((r / "checkpoint" / "train_state.json").read_text()) for r in (a, b)]
    assert states[0]["python_random"] == states[1]["python_random"]


def test_an_arrival_order_pull_is_what_the_plan_order_replaces(tiny_target, data, tmp_path):
    """`--mix stratified` (the old default) keeps working and trains every row once; the
    batches a step trains then depend on arrival, which is why it is not the default."""
    cfg = config(tiny_target, data, tmp_path / "arrival", mix="stratified")
    _, result = run(cfg, seed=3)
    assert result.complete and "all match" in result.accounting


@pytest.mark.parametrize("batching", ["work", "fixed"])
def test_a_run_stopped_at_a_random_step_resumes_into_the_uninterrupted_run(
    tiny_target, data, tmp_path, batching
):
    full_out = tmp_path / "full"
    _, full = run(config(tiny_target, data, full_out, batching=batching), seed=1)
    assert full.complete
    stop_at = random.Random(batching).randrange(1, full.steps - 1)
    out = tmp_path / "stopped"
    _, first = run(
        config(tiny_target, data, out, batching=batching), StopsAt, seed=2, stop_at=stop_at
    )
    assert first.interrupted and first.steps == stop_at
    cfg, resume = resume_config(out, {})
    _, second = run(cfg, resume=resume, seed=3)
    assert second.complete and second.steps == full.steps and second.resumed_from == [stop_at]
    want, got = logged_losses(full_out), logged_losses(out)
    later = [s for s in want if s > stop_at]
    assert [got[s] for s in later] == [want[s] for s in later]
    assert second.weights_digest == full.weights_digest


# ---------------------------------------------------------------------- feature stores
def capture(tiny_target, data, out: Path, dtype: str = "fp32") -> Path:
    argv = [
        "capture", "--target", str(tiny_target), "--data", str(data), "--out", str(out),
        "--num-target-features", str(K), "--target-devices", "cpu", "--cpu-threads", "1",
        "--batch-size", "2", "--dtype", dtype,
    ]  # fmt: skip
    assert cli.main(argv) == 0
    return out


def test_two_readers_of_a_store_train_the_same_drafter_whatever_their_timing(
    tiny_target, data, tmp_path
):
    store = capture(tiny_target, data, tmp_path / "store")
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"run{seed}"
        cfg = config(tiny_target, data, out, features=str(store), num_readers=2)
        _, result = run(cfg, seed=seed)
        assert result.complete
        runs.append((out, result))
    (a, ra), (b, rb) = runs
    assert_same_run(a, b, ra, rb)


def test_a_run_from_a_store_resumes_into_the_uninterrupted_run(tiny_target, data, tmp_path):
    store = capture(tiny_target, data, tmp_path / "store")
    _, full = run(config(tiny_target, data, tmp_path / "full", features=str(store)), seed=1)
    out = tmp_path / "stopped"
    cfg = config(tiny_target, data, out, features=str(store))
    _, first = run(cfg, StopsAt, seed=2, stop_at=7)
    assert first.interrupted and first.steps == 7
    # The store moved (regression: a resume naming its new path was refused as a change of
    # what it trains): its binding and dtype say it holds the same features.
    moved = store.rename(tmp_path / "moved")
    other = capture(tiny_target, data, tmp_path / "bf16", dtype="bf16")
    with pytest.raises(ValueError, match=r"features: .*bf16 holds bf16 features, the run trained"):
        resume_config(out, {"features": str(other)})
    cfg, resume = resume_config(out, {"features": str(moved)})
    _, second = run(cfg, resume=resume, seed=3)
    assert second.complete and second.weights_digest == full.weights_digest
    want, got = logged_losses(tmp_path / "full"), logged_losses(out)
    assert all(got[s] == want[s] for s in want if s > 7)


def test_muon_split_over_the_replicas_trains_the_unsplit_runs_drafter(
    tiny_target, data, tmp_path, monkeypatch
):
    """Issue 36 item 2: each replica orthogonalises its share of Muon's matrices and the shares
    are summed; the run's losses and weights equal a run where every replica does all."""
    from dflash_train.train.replica import DraftReplica

    split = tmp_path / "split"
    trainer, a = run(config(tiny_target, data, split, optimizer="muon"), seed=1)
    assert all(r.update_share is not None for r in trainer.replicas)
    assert trainer.pipeline.channels.updates is not None
    monkeypatch.setattr(DraftReplica, "split_optimizer", lambda self, part, parts: None)
    whole = tmp_path / "whole"
    trainer, b = run(config(tiny_target, data, whole, optimizer="muon"), seed=2)
    assert trainer.pipeline.channels.updates is None
    assert_same_run(split, whole, a, b)


def test_the_hybrid_cache_trains_the_same_drafter_and_resumes_into_it(tiny_target, data, tmp_path):
    """--cache-features: whether a row's features come from the (bf16, lossy) store or from
    the target is a function of the plan (epoch 0 computes, later epochs read), never of
    which batch reached a worker first or of what an interrupted session stored."""
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"run{seed}"
        cfg = config(tiny_target, data, out, cache_features=str(tmp_path / f"cache{seed}"))
        _, result = run(cfg, seed=seed)
        assert result.complete
        runs.append((out, result))
    (a, ra), (b, rb) = runs
    assert_same_run(a, b, ra, rb)
    out = tmp_path / "stopped"
    cfg = config(tiny_target, data, out, cache_features=str(tmp_path / "cache3"))
    _, first = run(cfg, StopsAt, seed=3, stop_at=5)  # in epoch 0: some rows stored, untrained
    assert first.interrupted and first.steps == 5
    cfg, resume = resume_config(out, {})
    _, second = run(cfg, resume=resume, seed=4)
    assert second.complete and second.weights_digest == ra.weights_digest
    want, got = logged_losses(a), logged_losses(out)
    assert [got[s] for s in want if s > 5] == [want[s] for s in want if s > 5]


# ---------------------------------------------------------------------- on-policy anchors
def test_on_policy_runs_with_random_stage_delays_train_the_same_drafter(
    tiny_target, data, tmp_path
):
    """--anchors on-policy: the rounds are recomputed by each replica at step time and its loss
    divisor reaches the rendezvous from there; still the same losses and weights whatever the
    threads' timing."""
    runs = []
    for seed in (1, 2):
        out = tmp_path / f"run{seed}"
        cfg = config(tiny_target, data, out, anchors="on-policy", loss="kl", epochs=1)
        _, result = run(cfg, seed=seed)
        assert result.complete and "all match" in result.accounting
        runs.append((out, result))
    (a, ra), (b, rb) = runs
    assert_same_run(a, b, ra, rb)
    # The rounds' own metrics: a tau of the rounds, rejections, the two streams' shares.
    lines = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    stats = [x for x in lines if "train/opd_tau" in x]
    assert len(stats) == len(logged_losses(a))
    for x in stats:
        assert 1.0 <= x["train/opd_tau"] <= 8.0 and x["train/opd_rejected_per_row"] > 0
        both = x["train/opd_response_loss"] + x["train/opd_rejected_loss"]
        assert both == pytest.approx(x["train/loss"], rel=1e-5)
        assert x["train/opd_rejected_loss"] > 0


def test_an_on_policy_run_stopped_at_a_random_step_resumes_into_the_uninterrupted_run(
    tiny_target, data, tmp_path
):
    cfg = dict(anchors="on-policy", loss="kl", opd_rejected_weight=2.0)
    _, full = run(config(tiny_target, data, tmp_path / "full", **cfg), seed=1)
    assert full.complete
    stop_at = random.Random(5).randrange(1, full.steps - 1)
    out = tmp_path / "stopped"
    _, first = run(config(tiny_target, data, out, **cfg), StopsAt, seed=2, stop_at=stop_at)
    assert first.interrupted and first.steps == stop_at
    cfg, resume = resume_config(out, {})
    assert cfg.objective.anchors == "on-policy" and cfg.objective.loss == "kl"
    _, second = run(cfg, resume=resume, seed=3)
    assert second.complete and second.steps == full.steps and second.resumed_from == [stop_at]
    want, got = logged_losses(tmp_path / "full"), logged_losses(out)
    later = [s for s in want if s > stop_at]
    assert [got[s] for s in later] == [want[s] for s in later]
    assert second.weights_digest == full.weights_digest
