"""`prepare` -> `train` (with in-training eval and TensorBoard) -> `eval` -> `export` -> `report`
through the CLI on a tiny target with a real chat tokenizer, and the metric families a run logs."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train import cli
from pipeline_helpers import chat_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("traincli")
    chat_workspace(
        root, conversations=48, prompts=8, seed=3, initializer_range=0.1, prepare_max_length=256
    )
    return root


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_logs_every_metric_family_with_sane_values(workspace):
    torch.set_num_threads(1)
    run_dir = workspace / "run"
    code = cli.main(
        [
            "train",
            "--target",
            str(workspace / "target"),
            "--data",
            str(workspace / "data"),
            "--out",
            str(run_dir),
            "--target-devices",
            "cpu,cpu",
            "--drafter-devices",
            "cpu,cpu",
            "--draft-layers",
            "1",
            "--block-size",
            "8",
            "--num-target-features",
            "2",
            "--num-anchors",
            "16",
            "--batch-size",
            "2",
            "--epochs",
            "2",
            "--hs-queue-depth",
            "6",
            "--hs-min-ready",
            "3",
            "--num-prefetchers",
            "2",
            "--log-every",
            "2",
            "--eval-every",
            "5",
            "--eval-prompts",
            str(workspace / "prompts.jsonl"),
            "--eval-num-prompts",
            "2",
            "--eval-max-new-tokens",
            "12",
            "--tensorboard",
            "--no-progress",
            "--cpu-threads",
            "1",
        ]
    )
    assert code == 0
    lines = read_metrics(run_dir)
    train = [m for m in lines if "train/loss" in m]
    assert len(train) >= 3
    seen = set().union(*train)  # stage timings appear in the intervals where the stage ran
    for key in (
        "train/loss",
        "train/tau_est",
        "train/lr",
        "train/grad_norm",
        "train/tokens_per_s",
        "train/seqs_per_s",
        "train/padding_frac",
        "train/acc_k1",
        "train/acc_k7",
        "train/pos_weight_k1",
        "train/pos_weight_k7",
        "time/prefetch_s",
        "time/target_forward_s",
        "time/drafter_forward_s",
        "time/drafter_backward_s",
        "time/optimizer_s",
        "queue/depth",
        "queue/producer_blocked_frac",
        "queue/consumer_starved_frac",
        "queue/hol_wait_frac",
        "queue/mix_tv",
        "queue/bucket0_depth",
    ):
        assert key in seen, key
    for m in train:
        assert 0 <= m["queue/depth"] <= 6
        for frac in (
            "queue/producer_blocked_frac",
            "queue/consumer_starved_frac",
            "queue/hol_wait_frac",
            "train/padding_frac",
            "queue/mix_tv",
            "train/acc_k1",
        ):
            assert 0.0 <= m[frac] <= 1.0, (frac, m[frac])
        assert 1.0 <= m["train/tau_est"] <= 8.0
        assert m["train/tokens_per_s"] > 0 and m["train/loss"] > 0
    evals = [m for m in lines if "eval/tau" in m]
    assert evals and all(1.0 <= m["eval/tau"] <= 8.0 for m in evals)
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    result = json.loads((run_dir / "result.json").read_text())
    assert result["complete"] and "all match" in result["accounting"]["line"]
    acc = result["accounting"]
    assert acc["sequences_in_data"] == 40 and acc["epochs"] == 2 and acc["trained"] == 80
    assert acc["finished_epochs_trained_exactly_once"] and result["interrupted"] is None
    assert [e["trained"] for e in acc["per_epoch"]] == [40, 40]


def test_eval_export_and_report_take_the_run(workspace, tmp_path):
    run_dir = workspace / "run"
    if not (run_dir / "checkpoint").is_dir():
        pytest.skip("needs the training test's run")
    out = tmp_path / "eval.json"
    assert (
        cli.main(
            [
                "eval",
                "--draft",
                str(run_dir),
                "--target",
                str(workspace / "target"),
                "--prompts",
                str(workspace / "prompts.jsonl"),
                "--limit",
                "2",
                "--max-new-tokens",
                "12",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2 and 1.0 <= report["tau"] <= 8.0
    assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 8
    assert cli.main(["report", str(run_dir)]) == 0
    assert (run_dir / "report" / "index.html").is_file()


def test_a_dflash2_run_warm_started_from_the_dflash1_run_logs_and_ships(workspace, tmp_path):
    # Trains on from the first test's DFlash 1 run (same backbone), with D-PACE and Muon; eval,
    # export and report take the DFlash 2 run as they take a DFlash 1 one.
    dflash1 = workspace / "run"
    if not (dflash1 / "checkpoint").is_dir():
        pytest.skip("needs the training test's run")
    torch.set_num_threads(1)
    run_dir, target = tmp_path / "run2", str(workspace / "target")
    common = ["--target-devices", "cpu", "--drafter-devices", "cpu", "--draft-layers", "1"]
    common += ["--block-size", "8", "--num-target-features", "2", "--num-anchors", "16"]
    common += ["--hs-queue-depth", "4", "--hs-min-ready", "2", "--num-prefetchers", "1"]
    dflash2 = ["--arch", "dflash2", "--selector-rank", "16", "--selector-top-k", "8"]
    dflash2 += ["--position-weights", "dpace", "--optimizer", "muon"]
    argv = ["train", "--target", target, "--data", str(workspace / "data"), "--out", str(run_dir)]
    argv += [*common, *dflash2, "--init-from", str(dflash1), "--epochs", "1", "--log-every", "2"]
    assert cli.main([*argv, "--no-progress", "--cpu-threads", "1"]) == 0
    train = [m for m in read_metrics(run_dir) if "train/loss" in m]
    seen = set().union(*train)
    for key in ("train/topk_recall_k1", "train/selector_acc_k7", "train/selector_loss"):
        assert key in seen, key
    for m in train:
        assert 0.0 <= m["train/selector_acc_k1"] <= m["train/topk_recall_k1"] <= 1.0
        assert 1.0 <= m["train/tau_est"] <= 8.0 and 1.0 <= m["train/tau_est_unary"] <= 8.0
        # D-PACE's credit falls along the block, for both terms (alpha 0.5: w_1 >= 0.5).
        assert m["train/pos_weight_k1"] >= m["train/pos_weight_k7"] > 0
        assert m["train/pos_weight_k1"] >= 0.5
        assert m["train/selector_pos_weight_k1"] >= m["train/selector_pos_weight_k7"] >= 0
    out = tmp_path / "eval.json"
    prompts = str(workspace / "prompts.jsonl")
    evaluate = ["eval", "--draft", str(run_dir), "--target", target, "--prompts", prompts]
    assert cli.main([*evaluate, "--limit", "2", "--max-new-tokens", "12", "--json", str(out)]) == 0
    assert 1.0 <= json.loads(out.read_text())["tau"] <= 8.0
    assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert cli.main(["report", str(run_dir)]) == 0


def test_an_on_policy_run_warm_started_from_a_trained_drafter_logs_its_rounds_and_ships(
    workspace, tmp_path
):
    # Draft-OPD's post-training stage: --init-from the first test's run, --anchors on-policy
    # (ce and the rejected stream by default); its rounds' metrics are logged, and eval and
    # export take the run as any other.
    trained = workspace / "run"
    if not (trained / "checkpoint").is_dir():
        pytest.skip("needs the training test's run")
    torch.set_num_threads(1)
    run_dir, target = tmp_path / "opd", str(workspace / "target")
    argv = ["train", "--target", target, "--data", str(workspace / "data"), "--out", str(run_dir)]
    argv += ["--target-devices", "cpu", "--drafter-devices", "cpu", "--num-target-features", "2"]
    argv += ["--hs-queue-depth", "4", "--hs-min-ready", "2", "--num-prefetchers", "1"]
    argv += ["--init-from", str(trained), "--anchors", "on-policy", "--epochs", "1"]
    assert cli.main([*argv, "--log-every", "2", "--no-progress", "--cpu-threads", "1"]) == 0
    config = json.loads((run_dir / "config.json").read_text())
    assert config["objective"]["anchors"] == "on-policy" and config["objective"]["loss"] == "ce"
    train = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert train
    for m in train:
        assert 1.0 <= m["train/opd_tau"] <= 8.0 and m["train/opd_rejected_per_row"] > 0
        shares = m["train/opd_response_loss"] + m["train/opd_rejected_loss"]
        assert shares == pytest.approx(m["train/loss"], rel=1e-5)
        assert m["time/drafter_rounds_s"] > 0
    out = tmp_path / "eval.json"
    prompts = str(workspace / "prompts.jsonl")
    evaluate = ["eval", "--draft", str(run_dir), "--target", target, "--prompts", prompts]
    assert cli.main([*evaluate, "--limit", "2", "--max-new-tokens", "12", "--json", str(out)]) == 0
    assert 1.0 <= json.loads(out.read_text())["tau"] <= 8.0
    assert cli.main(["export", str(run_dir), "--out", str(tmp_path / "export")]) == 0
