"""Beyond one node: two torchrun ranks (gloo, CPU) train one drafter together.

Each rank is a node with one target and one drafter worker; the job must finish with the same
weights on both ranks, every sequence trained once across them (the reduced accounting in
result.json), and the losses of a single process that trains the same batches per step. A rank
that fails or hangs ends the whole job within a bound.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_train import cli
from dflash_train.store.shards import RECORD
from dflash_train.store.store import FeatureStore
from pipeline_helpers import logged_losses, write_random_dataset

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
                              "--drafter-devices", "cpu", "--batch-cost", "auto",
                              *extra))  # fmt: skip
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
    want, got = logged_losses(single), logged_losses(out)
    assert sorted(got) == sorted(want) and len(got) == ROWS // 2  # 12 batches per epoch / 2
    for step in want:  # summation order is the only difference: 1e-5 relative
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    assert (
        json.loads((single / "result.json").read_text())["weights_digest"]
        == (result["weights_digest"])
    )


def test_two_ranks_fill_one_feature_cache_each_writing_its_own_part(tiny_target, data, tmp_path):
    """Regression (item 4 of issue 33): both ranks opened the one cache directory to write, each
    cut the other's live shard, and rows read back as zeros while the store opened clean."""
    cache, out = tmp_path / "cache", tmp_path / "hybrid"
    flags = ("--target-devices", "cpu", "--batch-cost", "blocks")
    job = torchrun(train_args(tiny_target, data, out, *flags, "--drafter-devices", "cpu",
                              "--cache-features", str(cache), "--cache-dtype", "fp32"))  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["complete"] and result["accounting"]["finished_epochs_trained_exactly_once"]
    assert "node 1 writing part 1 of 2" in job.stderr
    parts = [cache, cache / "rank-00001"]
    stored = [np.fromfile(f, dtype=RECORD)["row"] for d in parts for f in d.glob("shard-*.idx")]
    assert all(len(r) for r in stored) and sorted(np.concatenate(stored)) == list(range(ROWS))

    # Every row as the target computes it: nothing cut, zeroed or mixed by another writer.
    captured = tmp_path / "captured"
    assert cli.main(["capture", "--target", str(tiny_target), "--data", str(data), "--out",
                     str(captured), "--num-target-features", "3", "--target-devices", "cpu",
                     "--cpu-threads", "1", "--dtype", "fp32"]) == 0  # fmt: skip
    union, want = FeatureStore.open(cache), FeatureStore.open(captured)
    assert union.present().all()
    for r in range(ROWS):
        got, ref = (np.array(s.row_bytes(r)).view(np.float32) for s in (union, want))
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)

    # And it trains what the online job trains: one process, two drafters, the same batches.
    single = tmp_path / "online"
    args = train_args(tiny_target, data, single, *flags, "--drafter-devices", "cpu,cpu")
    proc = subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True,
                          text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    want_losses, got_losses = logged_losses(single), logged_losses(out)
    assert sorted(got_losses) == sorted(want_losses)
    for step in want_losses:
        assert got_losses[step] == pytest.approx(want_losses[step], rel=1e-5), step


@pytest.mark.parametrize("action", ["raise", "hang"])
def test_a_failing_or_hanging_rank_ends_the_whole_job(tiny_target, data, tmp_path, action):
    """A rank whose drafter fails raises at once, and the others' next collective ends with
    it. Regression: the failed rank first entered the end's collectives, so the job waited for
    the group's timeout (--stall-timeout, 900 s by default)."""
    fault = {"stage": "drafter_forward", "at": 3, "action": action, "rank": 1, "seconds": 600}
    # A raise must not wait for the group's timeout: a long one shows it.
    stall = ["--stall-timeout", "300" if action == "raise" else "20"]
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
            *stall,
        ),
        faults=[fault],
        timeout=400,
    )
    elapsed = time.monotonic() - t0
    assert job.returncode != 0
    assert elapsed < 150, f"the job took {elapsed:.0f}s to end"
    if action == "raise":
        assert "injected fault in drafter_forward" in job.stderr
    else:
        assert "no pipeline progress" in job.stderr or "did not reach step" in job.stderr


def logged(run_dir: Path, key: str) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x]
    return {r["step"]: r[key] for r in rows if key in r}


def test_sigterm_to_every_process_stops_both_ranks_at_one_step_and_resume_continues(
    tiny_target, data, tmp_path
):
    """Regression (items 1, 3 and 4 of issue 27): each node checked its stop flag on its own,
    so the nodes stopped at different steps, the final collective failed and nothing was
    saved; a resumed job's train/epoch counted the restored sequences once per node; a resume
    on another number of nodes kept the schedule under another global batch."""
    out = tmp_path / "run"
    args = train_args(tiny_target, data, out, "--target-devices", "cpu", "--drafter-devices",
                      "cpu", "--stop-timeout", "40")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_FAULTS"}
    slow = {"stage": "drafter_step", "action": "sleep", "seconds": 0.4, "every": True}
    env["DFLASH_FAULTS"] = json.dumps([slow])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--shutdown-timeout", "90", "-m", "dflash_train", *args]  # fmt: skip
    # A new session: the signal below reaches torchrun and both workers, as a scheduler's does
    # (each worker gets it twice: directly and forwarded by torchrun).
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while max(logged(out, "train/loss"), default=0) < 3:
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job did not reach step 3"
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    result = json.loads((out / "result.json").read_text())
    assert result["interrupted"] == "SIGTERM" and not result["complete"], stderr[-3000:]
    assert stderr.count("stopping after the step in flight on every node") == 2
    step = result["steps"]
    state = json.loads((out / "checkpoint" / "train_state.json").read_text())
    assert state["reason"] == "interrupted by SIGTERM" and state["step"] == step >= 3
    assert result["accounting"]["trained"] == 2 * 2 * step  # 2 ranks x 1 batch of 2 per step
    assert len(list((out / "checkpoints").iterdir())) == 1
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, symlinks=True)

    resumed = torchrun([*args[:1], "--resume", str(out)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    acc = result["accounting"]
    assert result["complete"] and acc["trained"] == 2 * ROWS
    assert acc["finished_epochs_trained_exactly_once"] and result["resumed_from_steps"] == [step]
    epochs = logged(out, "train/epoch")
    assert epochs[max(epochs)] == pytest.approx(2.0)  # 2 epochs, not inflated by the resume

    # Item 1: one process may continue the 2-node job with 2 drafters (the same global batch),
    # not with 1.
    single = [sys.executable, "-m", "dflash_train", "train", "--resume", str(copy)]
    refused = subprocess.run([*single, "--drafter-devices", "cpu"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2 and "2 -> 1 devices in all" in refused.stderr
    alone = subprocess.run([*single, "--drafter-devices", "cpu,cpu"], capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert "written by 2 node(s), this job has 1" in alone.stderr
    result = json.loads((copy / "result.json").read_text())
    assert result["complete"] and result["accounting"]["finished_epochs_trained_exactly_once"]
    assert result["accounting"]["trained"] == 2 * ROWS


def test_two_ranks_train_every_row_once_the_same_way_whatever_the_timing_and_resume(
    tiny_target, tmp_path
):
    """Issue 33 item 1 and issue 34: each bucket's batches are dealt to the nodes in turn, so
    node 0's stream is longer than the average; the schedule covers the longest stream (it
    used to end with node 0's last batches untrained, `complete: false` and exit status 0).
    Two jobs with random delays in every stage train the same drafter, and a job stopped by
    SIGTERM and resumed on 2 ranks continues the uninterrupted job's losses exactly."""
    import numpy as np

    from dflash_train.data.buckets import Batching
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.pipeline.prefetch import EpochPlans

    rows, buckets = 45, [48, 96, 128]
    data = write_random_dataset(tmp_path / "data", num_rows=rows, seed=0)
    lengths = PreparedDataset(data).lengths
    counts = EpochPlans(lengths, buckets, Batching(2), 0, 1, shard=(0, 2)).stream_lengths()
    assert max(counts) > -(-sum(counts) // 2), counts  # the case the old schedule cut short

    def job_args(out: Path) -> list[str]:
        return train_args(tiny_target, data, out, "--target-devices", "cpu", "--drafter-devices",
                          "cpu", "--mix", "plan", "--num-prefetchers", "2", "--epochs", "1",
                          "--batching", "fixed", "--bucket-lengths", ",".join(map(str, buckets)),
                          "--hs-queue-depth", "6", "--stop-timeout", "40")  # fmt: skip

    def jitter(seed: int) -> list[dict]:
        stages = ("prefetch", "target", "drafter_step", "rendezvous")
        return [{"stage": s, "action": "jitter", "seconds": 0.03, "every": True, "seed": seed}
                for s in stages]  # fmt: skip

    outs = [tmp_path / "a", tmp_path / "b"]
    for seed, out in enumerate(outs):
        job = torchrun(job_args(out), faults=jitter(seed))
        assert job.returncode == 0, job.stderr[-3000:]
        result = json.loads((out / "result.json").read_text())
        acc = result["accounting"]
        assert result["complete"] and acc["trained"] == rows, acc["line"]
        assert acc["finished_epochs_trained_exactly_once"]
        assert result["steps"] == max(counts)  # one batch per rank and step
    a, b = (json.loads((o / "result.json").read_text()) for o in outs)
    assert a["weights_digest"] == b["weights_digest"]
    assert logged_losses(outs[0]) == logged_losses(outs[1])

    # SIGTERM at step >= 3, then a resume on 2 ranks: the uninterrupted job's losses after it.
    out = tmp_path / "stopped"
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_FAULTS"}
    env["DFLASH_FAULTS"] = json.dumps(jitter(7))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--shutdown-timeout", "90", "-m", "dflash_train", *job_args(out)]  # fmt: skip
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    while max(logged(out, "train/loss"), default=0) < 3:
        assert job.poll() is None, job.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the job did not reach step 3"
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGTERM)
    job.communicate(timeout=120)
    step = json.loads((out / "result.json").read_text())["steps"]
    resumed = torchrun(["train", "--resume", str(out)], faults=jitter(8))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["complete"] and result["accounting"]["trained"] == rows
    assert result["weights_digest"] == a["weights_digest"]
    want, got = logged_losses(outs[0]), logged_losses(out)
    assert {s: got[s] for s in want if s > step} == {s: want[s] for s in want if s > step}
    assert np.isfinite(list(got.values())).all()


def test_ranks_that_would_resume_from_different_checkpoints_are_refused_in_one_line(
    tiny_target, data, tmp_path
):
    """Regression (issue 33, item 9): each rank resumed from the newest checkpoint it could
    read, so a rank whose view of the run directory differed trained on from another step,
    with other weights."""
    out = tmp_path / "run"
    # One process of 2 drafters (a resume may spread them over 2 ranks of 1): checkpoints at
    # steps 2 (periodic) and 4 (final).
    args = train_args(tiny_target, data, out, "--target-devices", "cpu", "--drafter-devices",
                      "cpu,cpu", "--save-every", "2", "--max-steps", "4")  # fmt: skip
    first = subprocess.run([sys.executable, "-m", "dflash_train", *args], capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    # Rank 1 sees the run directory through another path, where the newest checkpoint is
    # corrupt (as through a stale cache of the shared file system).
    view = tmp_path / "rank1_view"
    shutil.copytree(out, view, symlinks=True)
    weights = view / "checkpoints" / "step_0000004" / "model.safetensors"
    corrupt = bytearray(weights.read_bytes())
    corrupt[-4:] = bytes(b ^ 0xFF for b in corrupt[-4:])
    weights.write_bytes(bytes(corrupt))
    listing = sorted(p.name for p in (out / "checkpoints").iterdir())
    script = (
        'if [ "$RANK" = 1 ]; then d="$2"; else d="$1"; fi; '
        'exec "$0" -m dflash_train train --resume "$d" --target-devices cpu --drafter-devices cpu'
    )
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_FAULTS"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--no-python", "sh", "-c", script, sys.executable, str(out), str(view)]  # fmt: skip
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert job.returncode != 0
    said = [x for x in job.stderr.splitlines() if "resume from different checkpoints" in x]
    # Each rank says the one line and exits 2; torchrun stops the other rank as soon as the
    # first exits, so the second line may never be written.
    assert 1 <= len(said) <= 2, job.stderr[-3000:]
    for line in said:
        assert line.startswith("dflash-train train: error: --resume ")
        assert f"rank 0: {out / 'checkpoints' / 'step_0000004'} (step 4, weights " in line
        assert f"rank 1: {view / 'checkpoints' / 'step_0000002'} (step 2, weights " in line
        assert "it could not read step_0000004" in line
    assert "failed (exitcode: 2)" in job.stderr
    # Refused before anything was written: nothing set aside, no new checkpoint.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == listing
    assert os.readlink(out / "checkpoint") == "checkpoints/step_0000004"
