"""Every benchmark and the tuner through the real CLI with small arguments: the JSON keys they
promise, their own invariants, and a non-zero exit when those invariants break."""

from __future__ import annotations

import json

import pytest

from dflash_train.cli import main
from dflash_train.pipeline.queue import END, BufferedHSQueue
from pipeline_helpers import write_random_dataset


def run_json(tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "out.json"
    rc = main([*argv, "--json", str(out)])
    return rc, json.loads(out.read_text())


class LossyQueue(BufferedHSQueue):
    """Loses every 97th item it hands out (arrival-order pulls: the plan order's tickets name
    the item wanted): the benchmarks must notice."""

    def get(self, timeout=None, **kw):
        item = super().get(timeout, **kw)
        self._handed = getattr(self, "_handed", 0) + 1
        if item is not END and self._handed % 97 == 0:
            return super().get(timeout, **kw)
        return item


def test_bench_queue_reports_overhead_and_loses_nothing(tmp_path):
    rc, data = run_json(tmp_path, "bench", "queue", "--items", "3000", "--lag", "16")
    assert rc == 0
    assert data["lost"] == 0 and data["duplicated"] == 0
    assert 0 < data["overhead_us_p50"] <= data["overhead_us_p99"]
    assert {r["mode"] for r in data["rows"]} == {"plan", "fifo", "random", "stratified"}


def test_bench_queue_fails_when_items_are_lost(tmp_path, monkeypatch):
    monkeypatch.setattr("dflash_train.bench.queue.BufferedHSQueue", LossyQueue)
    rc, data = run_json(
        tmp_path, "bench", "queue", "--items", "2000", "--modes", "fifo", "--lag", "16"
    )
    assert rc == 1
    assert data["lost"] > 0 and data["problems"]


def test_bench_padding_on_a_prepared_dataset(tmp_path):
    data_dir = write_random_dataset(tmp_path / "data", num_rows=200, min_len=20, max_len=400)
    rc, data = run_json(tmp_path, "bench", "padding", "--data", str(data_dir), "--num-buckets", "8")
    assert rc == 0
    assert 0 <= data["padding_fraction"] < data["padding_fraction_fifo"] < 1
    assert data["rows_measured"] == 200 and data["num_buckets"] == 8


def test_bench_padding_on_synthetic_lengths(tmp_path):
    rc, data = run_json(tmp_path, "bench", "padding", "--synthetic", "3000", "--sweep", "4,32")
    assert rc == 0
    assert set(data["by_num_buckets"]) == {"4", "16", "32"}


def test_bench_mix_reports_tv_per_pull_mode(tmp_path):
    rc, data = run_json(
        tmp_path,
        "bench",
        "mix",
        "--batches",
        "240",
        "--drafters",
        "3",
        "--step-ms",
        "5",
        "--num-buckets",
        "3",
        "--window",
        "4",
        "--hs-queue-depth",
        "24",
        "--hs-min-ready",
        "8",
    )
    assert rc == 0, data["problems"]
    for key in ("tv_fifo", "tv_random", "tv_stratified"):
        assert 0 <= data[key] <= 1
    assert all(r["windows"] > 0 for r in data["rows"])


def test_bench_pipeline_measures_efficiency_and_accounts_every_batch(tmp_path):
    rc, data = run_json(
        tmp_path,
        "bench",
        "pipeline",
        "--cases",
        "1:1,2:6-small",
        "--seconds",
        "1.5",
        "--scale",
        "0.2",
    )
    assert rc == 0, data["problems"]
    assert data["accounting_ok"] is True
    assert [r["case"] for r in data["rows"]] == ["1:1", "2:6-small"]
    # A sanity range only: timing on a shared 2-core machine is too noisy for the 0.95 goal.
    assert 0.3 < data["efficiency"] <= 1.2
    assert data["efficiency"] == min(r["efficiency"] for r in data["rows"])


def test_bench_pipeline_fails_when_a_batch_is_lost(tmp_path, monkeypatch):
    monkeypatch.setattr("dflash_train.pipeline.build.BufferedHSQueue", LossyQueue)
    rc, data = run_json(
        tmp_path, "bench", "pipeline", "--cases", "1:1", "--seconds", "1.5", "--scale", "0.2",
        "--batch-cost", "blocks",  # a plan of more than 97 batches, however loaded the machine
        "--mix", "stratified",  # a pull that can hand out another item than the one asked for
    )  # fmt: skip
    assert rc == 1
    assert data["accounting_ok"] is False


def test_bench_rejects_an_unknown_case(capsys):
    assert main(["bench", "pipeline", "--cases", "9:9"]) == 2
    assert "unknown" in capsys.readouterr().err


def test_tune_recommends_a_split_and_queue_sizes(tiny_target, tmp_path):
    data_dir = write_random_dataset(tmp_path / "data", num_rows=40)
    rc, data = run_json(
        tmp_path,
        "tune",
        "--target",
        str(tiny_target),
        "--data",
        str(data_dir),
        "--devices",
        "cpu,cpu,cpu",
        "--seconds",
        "0.3",
        "--mask-token-id",
        "255",
        "--draft-layers",
        "1",
        "--block-size",
        "8",
        "--num-anchors",
        "16",
        "--num-target-features",
        "3",
    )
    assert rc == 0
    assert len(data["target_devices"]) + len(data["drafter_devices"]) == 3
    assert 0 <= data["token_share"] <= 1  # --batch-cost flops: as train plans
    assert data["target_devices"] and data["drafter_devices"]
    assert data["expected_tokens_per_s"] == pytest.approx(
        min(data["target_tokens_per_s"], data["drafter_tokens_per_s"])
    )
    assert 1 <= data["hs_min_ready"] <= data["hs_queue_depth"]
    assert f"--hs-min-ready {data['hs_min_ready']}" in " ".join(data["flags"])
    (dev,) = data["devices"]  # `cpu` three times is measured once
    assert dev["target_tokens_per_s"] > 0 and dev["drafter_tokens_per_s"] > 0


def test_tune_without_data_is_a_one_line_error(tiny_target, capsys):
    assert main(["tune", "--target", str(tiny_target), "--devices", "cpu,cpu"]) == 2
    assert "--data is required" in capsys.readouterr().err


def test_bench_loss_memory_stays_flat_when_chunked(tmp_path):
    out = tmp_path / "loss.json"
    argv = ["bench", "loss", "--anchors", "16", "512", "--vocab", "8192", "--chunk", "256"]
    assert main([*argv, "--loss", "ce", "lk_lambda", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # 7,680 rows x 8,192 vocab of fp32 logits is 240 MB; one chunk of 256 rows is 8 MB.
    for loss in ("ce", "lk_lambda"):
        chunked, direct = (
            result["growth_mb"][loss]["chunked"][0],
            result["growth_mb"][loss]["direct"][0],
        )
        assert direct > 150, (loss, direct)
        assert chunked < 0.25 * direct, (loss, chunked, direct)
    # The teacher's loss holds draft and teacher logits directly, so more than CE there.
    growth = result["growth_mb"]
    assert growth["lk_lambda"]["direct"][0] > growth["ce"]["direct"][0]
    assert all(row["lk_lambda_s"] > 0 for row in result["rows"])


def test_bench_loss_with_one_anchor_count_measures_it_without_a_growth(tmp_path, capsys):
    out = tmp_path / "loss.json"
    argv = ["bench", "loss", "--anchors", "4", "--loss", "ce", "--vocab", "256", "--hidden", "16"]
    assert main([*argv, "--json", str(out)]) == 0
    assert "ce: growth chunked not measured" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["rows"][0]["anchors"] == 4 and result["rows"][0]["ce_mb"] is not None
    assert result["growth_mb"]["ce"] == {"chunked": None, "direct": None}


STEP_ARGS = ("--num-anchors", "8", "--seq-len", "64", "--iters", "2", "--warmup", "1")


def test_bench_step_reports_the_promised_keys_for_each_kernel(tiny_target, tmp_path):
    rc, data = run_json(
        tmp_path, "bench", "step", "--target", str(tiny_target), *STEP_ARGS,
        "--attention", "blockwise", "dense",
    )  # fmt: skip
    assert rc == 0
    assert [r["attention"] for r in data["rows"]] == ["blockwise", "dense"]
    for r in data["rows"]:
        assert r["step_s"] > 0 and r["target_forward_s"] > 0 and r["peak_rss_mb"] > 100
        # Fully supervised random rows: 8 anchors x 15 offsets per row, less those past the end.
        assert 2 * 8 * 10 < r["supervised_per_step"] <= 2 * 8 * 15
        assert r["tokens_per_s"] == pytest.approx(r["supervised_per_step"] / r["step_s"])
        assert r["chunked_step"] is True
    best = max(data["rows"], key=lambda r: r["tokens_per_s"])
    assert data["attention"] == best["attention"] and data["tokens_per_s"] == best["tokens_per_s"]


def test_bench_step_on_a_random_target_shape_needs_no_model(tmp_path):
    rc, data = run_json(
        tmp_path, "bench", "step", "--random-target", "tiny", *STEP_ARGS, "--no-chunked-step"
    )
    assert rc == 0
    assert data["target"] == "random:tiny" and data["target_forward_s"] is None
    assert data["tokens_per_s"] > 0 and data["chunked_step"] is False


def test_bench_step_without_a_target_directory_is_a_one_line_error(tmp_path, capsys):
    assert main(["bench", "step", "--target", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_scale_projects_node_counts_and_the_ring_all_reduce(tmp_path):
    rc, data = run_json(
        tmp_path, "bench", "scale", "--nodes", "1,4,64", "--batches", "60", "--time-scale", "0.02"
    )
    assert rc == 0, data["problems"]
    rows = {r["nodes"]: r for r in data["rows"]}
    assert rows[1]["allreduce_s"] == 0 and rows[1]["projected"] == 1.0
    assert 0 < rows[4]["allreduce_s"] < rows[64]["allreduce_s"]
    assert rows[64]["projected"] <= rows[4]["projected"] <= 1.0
    assert data["grad_bytes"] > 4e9  # ~1B drafter parameters in fp32


def test_bench_scale_sleeps_and_projects_both_all_reduces_of_a_muon_step(tmp_path):
    # Muon (the default) over 2 nodes: the gradient's all-reduce and the update exchange's,
    # each ~0.84 s on a 40 Gb/s link, the drafters (2 targets : 6) the bottleneck.
    from dflash_train.bench.scale import ring_allreduce_s

    rc, data = run_json(
        tmp_path, "bench", "scale", "--nodes", "1,2", "--targets", "2", "--link-gbps", "40",
        "--batches", "40", "--time-scale", "0.02",
    )  # fmt: skip
    assert rc == 0, data["problems"]
    one, two = data["rows"]
    grad = ring_allreduce_s(data["grad_bytes"], 2, 40, 10)
    assert two["allreduce_s"] == pytest.approx(2 * grad, rel=1e-3)
    assert two["step_s"] - one["step_s"] == pytest.approx(two["allreduce_s"], rel=0.3)
    assert two["efficiency"] == pytest.approx(two["projected"], abs=0.08)


def test_ring_all_reduce_time_follows_bandwidth_and_latency():
    from dflash_train.bench.scale import ring_allreduce_s

    assert ring_allreduce_s(1e9, 1, 400, 10) == 0.0
    two = ring_allreduce_s(1e9, 2, 400, 0)
    assert two == pytest.approx(1e9 / 50e9)  # 2 (N-1)/N = 1 byte-time at 50 GB/s
    assert ring_allreduce_s(1e9, 64, 400, 0) == pytest.approx(2 * 63 / 64 * 1e9 / 50e9)
    assert ring_allreduce_s(0, 9, 400, 10) == pytest.approx(16 * 10e-6)


@pytest.mark.slow
def test_the_gpu_check_script_runs_end_to_end_on_cpu_and_a_rerun_skips_what_passed(tmp_path):
    # The one command the GPU machine runs, on CPU with tiny shapes: every part but the CUDA
    # kernels runs; the CUDA tests are collected from tests/cuda alone and skipped.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "check"
    cmd = [
        sys.executable, str(root / "scripts" / "gpu_check.py"), "--no-install", "--out",
        str(out), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--shapes",
        "tiny", "--steps", "4", "--seq-len", "96", "--batch-size", "2", "--num-anchors", "16",
        "--skip-compile",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["problems"] == []
    parts = summary["parts"]
    assert list(parts) == ["device", "cuda_tests", "pipeline", "step_blockwise"]
    assert parts["device"]["figures"]["matmul_tflops"] > 0
    assert parts["device"]["figures"]["unmet"] == []  # this venv is in the declared range
    tests = parts["cuda_tests"]["figures"]
    assert tests["skipped"] > 0 and tests["failed"] == 0 and tests["hung"] == []
    lines = [json.loads(x) for x in (out / "tests.jsonl").read_text().splitlines()]
    assert lines and all(x["nodeid"].startswith("tests/cuda/") for x in lines)
    step = parts["step_blockwise"]["figures"]
    assert step["step_s"] > 0 and step["tokens_per_s"] > 0 and step["attention"] == "blockwise"
    pipe = parts["pipeline"]["figures"]
    assert pipe["steps"] == 4 and pipe["target_tokens_per_s"] > 0
    assert pipe["drafter_supervised_tokens_per_s"] > 0 and pipe["flex_eager_calls"] == 0
    assert {f.name for f in out.iterdir()} == {
        "summary.json", "output.log", "tests.jsonl", "figures.md"
    }  # fmt: skip
    assert "| step_blockwise | passed |" in (out / "figures.md").read_text()
    # A rerun on the same folder runs nothing that passed.
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0
    rerun = json.loads((out / "summary.json").read_text())["parts"]
    assert all(r["runs"] == 1 for r in rerun.values())
