"""`dflash-train compare` through the CLI with real subprocesses on a tiny target: two variants at
two seeds (train, export, eval each), and a variant flag the train command refuses."""

from __future__ import annotations

import json

import pytest

from dflash_train import cli
from dflash_train.metrics.intervals import VERDICTS
from pipeline_helpers import chat_workspace

COMMON = (
    "--target-devices cpu --drafter-devices cpu --cpu-threads 1 --draft-layers 1 --block-size 8 "
    "--num-target-features 2 --num-anchors 8 --batch-size 2 --max-steps 3 --hs-queue-depth 4 "
    "--hs-min-ready 1 --log-every 1 --no-progress"
)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    chat_workspace(root, conversations=24, prompts=4, seed=5, prepare_max_length=128)
    return root


def compare_argv(ws, out, *variants, seeds=2):
    argv = [
        "compare",
        "--out",
        str(out),
        "--target",
        str(ws / "target"),
        "--data",
        str(ws / "data"),
    ]
    argv += ["--prompts", str(ws / "prompts.jsonl"), "--seeds", str(seeds), "--limit", "2"]
    argv += ["--max-new-tokens", "12", "--train-flags", COMMON]
    for r in variants:
        argv += ["--variant", r]
    return argv


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 12 subprocesses, each importing torch: ~10 min on a loaded 2-core CPU
def test_two_variants_at_two_seeds_end_to_end(workspace, capsys):
    out = workspace / "cmp"
    variants = ("decay=--position-weights decay --optimizer adamw", "dpace=--optimizer muon")
    assert cli.main(compare_argv(workspace, out, *variants)) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"]) for r in records] == [
        ("decay", 0),
        ("dpace", 0),
        ("decay", 1),
        ("dpace", 1),
    ]
    for r in records:
        assert r["steps"] == 3 and r["num_prompts"] == 2
        assert all(1.0 <= t <= 8.0 for t in r["prompt_taus"])
        assert r["tau"] == pytest.approx(sum(r["prompt_taus"]) / 2)
    # The seed reached training: four different drafters.
    assert len({r["weights_digest"] for r in records}) == 4
    run = out / "runs" / "dpace" / "seed1"
    assert (run / "export" / "config.json").is_file() and (run / "eval.json").is_file()
    assert "--seed 1" in (run / "train.log").read_text().splitlines()[0]
    summary = json.loads((out / "summary.json").read_text())
    (diff,) = summary["differences"]
    assert diff["n"] == 2 and diff["verdict"] in VERDICTS
    assert "| dpace | 2 |" in capsys.readouterr().out
    # Nothing left to do: a rerun runs nothing and writes the same summary.
    assert cli.main(compare_argv(workspace, out, *variants)) == 0
    assert json.loads((out / "summary.json").read_text()) == summary


def test_an_unknown_flag_of_any_variant_is_refused_before_the_first_trains(workspace, capsys):
    """Regression: a bad flag of a later variant was found only after the earlier trained."""
    out = workspace / "bad"
    code = cli.main(compare_argv(workspace, out, "ok=--lr 1e-3", "bad=--optimiser muon"))
    assert code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("dflash-train compare: error: variant 'bad': train refuses its")
    assert "unrecognized arguments: --optimiser muon" in lines[0]
    assert not (out / "results.jsonl").exists() and not (out / "runs").exists()


def test_the_reference_client_module_decodes_the_prompts_eval_decodes(workspace, tmp_path):
    """Same prompts, chat mode, stop tokens and token limit: the same acceptance lengths, prompt
    by prompt, for a random drafter (full semantics parity: test_reference_client.py)."""
    pytest.importorskip("dflash", reason="install with pip install --no-deps dflash==0.1.0")
    import torch

    from dflash_train.model import compat

    need = compat.REFERENCE_CLIENT_MIN_TRANSFORMERS
    if compat.version_tuple(compat.transformers_version()) < compat.version_tuple(need):
        pytest.skip(f"the reference client dflash 0.1.0 needs transformers>={need}")
    from dflash_train.compare.reference import main as reference_main
    from dflash_train.export import export_draft
    from dflash_train.model.draft import DFlashDraftModel
    from dflash_train.model.target import draft_config_from_target, load_target_config

    torch.manual_seed(0)
    config = draft_config_from_target(
        load_target_config(workspace / "target"),
        num_layers=1,
        block_size=4,
        mask_token_id=workspace_mask_id(workspace),
        num_features=2,
    )
    export_draft(DFlashDraftModel(config), tmp_path / "export")
    common = ["--draft", str(tmp_path / "export"), "--target", str(workspace / "target")]
    common += ["--prompts", str(workspace / "prompts.jsonl"), "--max-new-tokens", "20"]
    assert reference_main([*common, "--limit", "3", "--json", str(tmp_path / "ref.json")]) == 0
    argv = ["eval", *common, "--limit", "3", "--json", str(tmp_path / "own.json")]
    assert cli.main([*argv, "--no-baseline"]) == 0
    ref = json.loads((tmp_path / "ref.json").read_text())
    own = json.loads((tmp_path / "own.json").read_text())
    assert ref["num_prompts"] == own["num_prompts"] == 3 and ref["num_cycles"] >= 3
    assert [r["acceptance_lengths"] for r in ref["responses"]] == [
        r["acceptance_lengths"] for r in own["responses"]
    ]
    assert ref["tau"] == pytest.approx(own["tau"])


def workspace_mask_id(workspace) -> int:
    from dflash_train.data.tokenizer import load_chat_tokenizer

    return load_chat_tokenizer(workspace / "target").convert_tokens_to_ids("<|MASK|>")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_an_on_policy_stage_from_each_seeds_sft_run_and_its_record_carried_elsewhere(
    workspace, tmp_path, capsys
):
    """`opd=--init-from {run:sft} --anchors on-policy`: each seed's stage starts from that seed's
    SFT drafter. Then only the record travels (compare.json, results.jsonl into an empty --out)
    with the stage of seed 1 missing: seed 1's SFT run is trained again, to the weights its
    record names (a real train subprocess reproduces), before the stage runs."""
    out = workspace / "staged"
    stage = "opd=--init-from {run:sft} --anchors on-policy --loss ce --max-steps 2"
    # Batches planned by block positions: --batch-cost auto's share is timed on the machine.
    variants = ("sft=--optimizer adamw --batch-cost blocks", f"{stage} --batch-cost blocks")
    assert cli.main(compare_argv(workspace, out, *variants)) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["seed"], r["steps"]) for r in records] == [
        ("sft", 0, 3), ("opd", 0, 2), ("sft", 1, 3), ("opd", 1, 2)
    ]  # fmt: skip
    for seed in (0, 1):
        first = (out / "runs" / "opd" / f"seed{seed}" / "train.log").read_text().splitlines()[0]
        assert f"--init-from {out / 'runs' / 'sft' / f'seed{seed}' / 'run'}" in first
    carried = tmp_path / "carried"
    carried.mkdir()
    (carried / "compare.json").write_text((out / "compare.json").read_text())
    lines = (out / "results.jsonl").read_text().splitlines()
    (carried / "results.jsonl").write_text("\n".join(lines[:3]) + "\n")
    capsys.readouterr()
    assert cli.main(compare_argv(workspace, carried, *variants)) == 0
    assert (carried / "runs" / "sft" / "seed1" / "run" / "result.json").is_file()
    assert not (carried / "runs" / "sft" / "seed0").exists()  # its stage was recorded
    again = [json.loads(line) for line in (carried / "results.jsonl").read_text().splitlines()]
    same = ("variant", "seed", "weights_digest", "tau", "prompt_taus")
    assert [again[3][k] for k in same] == [records[3][k] for k in same]  # the same stage again
