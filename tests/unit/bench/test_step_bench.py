"""`bench step` measures the step train runs: the replica's own objective and loss normaliser,
fp16 refused as train refuses it, and an MFU of the step's true FLOPs (torch's own count of
its matmuls) against a peak measured on the device."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash_train.bench import step
from dflash_train.cli import main
from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import BatchSpec
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import draft_config_from_target
from dflash_train.pipeline.prefetch import make_job
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.replica import DraftReplica
from pipeline_helpers import record_replica_calls

CPU = torch.device("cpu")


def worker_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    step.add_arguments(parser)
    return parser.parse_args(
        ["--random-target", "tiny", "--seq-len", "64", "--num-anchors", "16", "--warmup", "1",
         "--iters", "2", "--worker", *extra]
    )  # fmt: skip


def test_fp16_is_refused_in_one_line(capsys):
    assert main(["bench", "step", "--random-target", "tiny", "--dtype", "float16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "float16" in err[0] and "bfloat16" in err[0]


def test_the_step_normalises_its_loss_as_the_replica_trains_and_reports_mfu_both_ways(
    monkeypatch,
):
    log = record_replica_calls(monkeypatch)
    out = step.measure(worker_args())
    # D-PACE, the replica's default: the divisor is the batch's valid anchors, not sum(w).
    want = [float(job.layout.valid.sum()) for *_, job in log["steps"]]
    assert log["weights"] == want and len(want) == 3
    assert out["mfu"] == pytest.approx(out["model_tflops_per_s"] / out["peak_tflops_measured"])
    assert 0 < out["mfu"] < 1.5 and "mfu_spec" not in out  # no spec sheet for a CPU


@pytest.mark.parametrize("seq", [64, 128])
def test_the_steps_flops_are_torchs_own_count_of_its_matmuls(seq):
    # Dense attention (its FLOPs are counted apart): every other matmul of a micro-step, then
    # Muon's step, counted by torch, against `step_flop_parts`. At two lengths with the same
    # block positions: what grows with the tokens is the context's part and fc's (the split
    # `--batch-cost flops` budgets by), since the queries' part does not depend on `seq`.
    torch.manual_seed(0)
    tcfg = step._random_target_config("tiny")
    batch, anchors = 2, 16
    cfg = draft_config_from_target(tcfg, 2, 16, tcfg.vocab_size - 1, num_features=4)
    objective = ObjectiveOptions(num_anchors=anchors, attention="dense")
    head = step._random_head(tcfg, CPU, torch.float32)
    rep = DraftReplica(
        DFlashDraftModel(cfg), head, CPU, torch.float32, objective, OptimOptions(), 10
    )
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 255, seq), np.ones(seq, np.uint8)) for _ in range(batch)]
    job = make_job(BatchSpec(0, 0, 0, (0, 1)), rows, seq, block_size=16, num_anchors=anchors,
                   gamma=7.0, mask_token_id=255, seed=0)  # fmt: skip
    features = torch.randn(batch, seq, cfg.num_features * cfg.hidden_size)
    counted = []
    for run in (lambda: rep.micro_step(HSBatch(job, features)), lambda: rep.apply(1.0)):
        with FlopCounterMode(display=False) as counter:
            run()
        ops = counter.get_flop_counts()["Global"]
        counted.append(sum(n for op, n in ops.items() if str(op) in ("aten.mm", "aten.addmm")))
    muon = [p.shape for p in rep.muon.param_groups[0]["params"]]
    parts = step.step_flop_parts(cfg, batch, seq, anchors, job.num_supervised, muon)
    assert counted[0] == parts["queries"] + parts["context"] + parts["fc"] + parts["head"]
    assert counted[1] == parts["muon"] > 0


def test_the_mfu_counts_the_blocks_the_step_ran_not_the_flag(monkeypatch):
    """Regression: a row has at most as many anchors as its supervised positions allow, but the
    FLOPs counted --num-anchors blocks per row: 64-token rows at --num-anchors 256 reported an
    MFU of 1.13. The count now equals the one at the anchors the rows really had."""
    counted = []
    flops = step.step_flops

    def recording(cfg, batch, seq, anchors, supervised, muon_shapes=()):
        counted.append(anchors)
        return flops(cfg, batch, seq, anchors, supervised, muon_shapes)

    monkeypatch.setattr(step, "step_flops", recording)
    args = worker_args()
    args.num_anchors = [256]
    out = step.measure(args)
    (anchors,) = counted
    assert anchors <= 64  # at most one per supervised position of a 64-token row
    assert 0 < out["mfu"] < 1.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--iters", "0"], "--iters must be >= 1, got 0"),
        (["--num-anchors", "0"], "--num-anchors must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--block-size", "1"], "--block-size must be >= 2"),
    ],
)
def test_bad_counts_are_one_line_before_any_worker_starts(flags, message, capsys):
    """Regression: these reached the worker, which failed with its traceback (exit 1), or an
    error row whose exit status said an invariant broke."""
    assert main(["bench", "step", "--random-target", "tiny", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_every_configuration_failing_is_reported_not_a_crash(monkeypatch, tmp_path):
    """Regression: when every configuration failed, choosing the best one raised KeyError."""
    monkeypatch.setattr(
        step, "_run_child", lambda args, anchors, attention, chunk: {
            "attention": attention, "num_anchors": anchors, "loss_chunk_size": chunk,
            "error": "worker failed",
        }
    )  # fmt: skip
    argv = ["bench", "step", "--random-target", "tiny", "--attention", "dense", "blockwise"]
    assert main([*argv, "--json", str(tmp_path / "o.json")]) == 1
