"""Beyond one node: two torchrun ranks (gloo, CPU) train one drafter together.

Each rank is a node with one target and one drafter worker; the job must finish with the same
weights on both ranks, every sequence trained once across them (the reduced accounting in
result.json), and the losses of a single process that trains the same batches per step. A rank
that fails or hangs ends the whole job within a bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_helpers import write_random_dataset

pytestmark = pytest.mark.slow  # torchrun starts two processes: ~15 s each time on 2 cores
ROWS = 24


def train_args(target, data, out, *extra: str) -> list[str]:
    return [
        "train", "--target", str(target), "--data", str(data), "--out", str(out),
        "--draft-layers", "1", "--block-size", "8", "--num-anchors", "16",
        "--num-target-features", "3", "--mask-token-id", "255", "--batch-size", "2",
        "--bucket-lengths", "128", "--epochs", "2", "--hs-queue-depth", "4",
        "--hs-min-ready", "1", "--num-prefetchers", "1", "--mix", "fifo", "--log-every", "1",
        "--no-progress", "--cpu-threads", "1", "--stall-timeout", "20", "--stop-timeout", "10",
        *extra,
    ]  # fmt: skip


def torchrun(args: list[str], faults=None, timeout=240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_FAULTS"}
    if faults:
        env["DFLASH_FAULTS"] = json.dumps(faults)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "dflash_train", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec["train/loss"]
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_random_dataset(tmp_path_factory.mktemp("nodes") / "data", num_rows=ROWS)


# D-PACE divides by the valid anchors of the whole step and Muon steps on the all-reduced
# gradient: the same update on every rank as in one process, like the defaults.
OBJECTIVES = {"defaults": [], "dpace_muon": ["--position-weights", "dpace", "--optimizer", "muon"]}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_two_ranks_train_one_drafter_like_one_process(tiny_target, data, tmp_path, objective):
    out = tmp_path / "two_ranks"
    extra = OBJECTIVES[objective]
    job = torchrun(train_args(tiny_target, data, out, "--target-devices", "cpu",
                              "--drafter-devices", "cpu", *extra))  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2 and result["complete"]
    acc = result["accounting"]
    assert acc["trained"] == 2 * ROWS and acc["finished_epochs_trained_exactly_once"]
    assert all(e["read"] == e["target"] == e["trained"] == ROWS for e in acc["per_epoch"])
    # The same updates everywhere (the run checks the digests of every rank and fails if not).
    assert len(result["weights_digest"]) == 64
    assert not (out / "rank1").exists() and sorted(p.name for p in out.iterdir()) == [
        "checkpoint", "checkpoints", "config.json", "metrics.jsonl", "result.json"
    ]  # fmt: skip

    # --batch-cost auto: rank 0 measured the drafter's cost, both ranks planned with its share
    # (a rank planning with another would break the accounting and the digests above).
    share = json.loads((out / "config.json").read_text())["pipeline"]["batch_cost"]
    assert 0 <= float(share) <= 1 and "batch cost (--batch-cost auto" in job.stderr

    # One process, two drafters, the same global batch: step k trains batches 2k and 2k+1 in
    # both (FIFO, one prefetcher, one target worker per node; the ranks' shards interleave).
    single = tmp_path / "one_process"
    args = train_args(tiny_target, data, single, "--target-devices", "cpu",
                      "--drafter-devices", "cpu,cpu", "--batch-cost", share, *extra)  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    want, got = losses(single), losses(out)
    assert sorted(got) == sorted(want) and len(got) == ROWS // 2  # 12 batches per epoch / 2
    for step in want:  # summation order is the only difference: 1e-5 relative
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert (
        json.loads((single / "result.json").read_text())["weights_digest"]
        == (result["weights_digest"])
    )


@pytest.mark.parametrize("action", ["raise", "hang"])
def test_a_failing_or_hanging_rank_ends_the_whole_job(tiny_target, data, tmp_path, action):
    fault = {"stage": "drafter_forward", "at": 3, "action": action, "rank": 1, "seconds": 600}
    t0 = time.monotonic()
    job = torchrun(
        train_args(
            tiny_target,
            data,
            tmp_path / "run",
            "--target-devices",
            "cpu",
            "--drafter-devices",
            "cpu",
        ),
        faults=[fault],
    )
    elapsed = time.monotonic() - t0
    assert job.returncode != 0
    assert elapsed < 150, f"the job took {elapsed:.0f}s to end"
    if action == "raise":
        assert "injected fault in drafter_forward" in job.stderr
    else:
        assert "no pipeline progress" in job.stderr or "did not reach step" in job.stderr
