"""Bad input across the CLI, table-driven: each case gets ONE clear error line, a non-zero
exit and no Python traceback (unless --debug), before any work it could spoil."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dflash_train import cli, faults
from dflash_train.data.dataset import write_prepared
from dflash_train.data.synthetic import write_jsonl
from dflash_train.devices import check_device_roles
from dflash_train.export import export_draft
from dflash_train.model.checkpoint import save_draft
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import draft_config_from_target, load_target_config
from dflash_train.model.tiny import save_random_qwen3
from pipeline_helpers import chat_workspace, write_random_dataset


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    """A tiny target with a chat tokenizer, data prepared with it, and some broken inputs."""
    root = tmp_path_factory.mktemp("badinput")
    chat_workspace(
        root, conversations=12, prompts=2, seed=7, vocab_size=400, prepare_max_length=3072
    )
    # A target whose embedding is smaller than the tokenizer the data was prepared with.
    save_random_qwen3(root / "small_target", vocab_size=64, num_layers=6)
    # A model directory that is not a causal LM.
    (root / "bert").mkdir()
    (root / "bert" / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"], "hidden_size": 8})
    )
    write_prepared(root / "empty", [])
    write_random_dataset(root / "random_data", num_rows=8, vocab=60)
    # Conversations whose assistant turns are empty: nothing left to supervise.
    write_jsonl(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}]
        * 3,
        root / "nothing.jsonl",
    )
    (root / "a_file").write_text("not a directory")
    # A drafter built for another target (other width, vocabulary and layers): not a backbone
    # that --init-from can start this target's drafter from.
    other = draft_config_from_target(
        load_target_config(root / "small_target"), num_layers=2, block_size=8, mask_token_id=3
    )
    export_draft(DFlashDraftModel(other), root / "other_drafter")
    # A checkpoint to export, and a checkpoint and an export whose weights were cut short.
    save_draft(root / "ckpt", DFlashDraftModel(other))
    for src, dst in (("ckpt", "ckpt_trunc"), ("other_drafter", "drafter_trunc")):
        shutil.copytree(root / src, root / dst)
        weights = root / dst / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return root


def train(ws: Path, *extra: str, target: str = "target", data: str = "data") -> list[str]:
    return [
        "train",
        "--target",
        str(ws / target),
        "--data",
        str(ws / data),
        "--out",
        str(ws / "runs" / "r"),
        "--overwrite",
        "--target-devices",
        "cpu",
        "--drafter-devices",
        "cpu",
        "--draft-layers",
        "1",
        "--block-size",
        "8",
        "--num-target-features",
        "2",
        "--num-anchors",
        "8",
        "--batch-size",
        "2",
        "--epochs",
        "1",
        "--hs-queue-depth",
        "4",
        "--hs-min-ready",
        "2",
        "--num-prefetchers",
        "1",
        "--no-progress",
        "--cpu-threads",
        "1",
        "--log-every",
        "1",
        *extra,
    ]


CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("missing target", lambda w: train(w, target="nope"), "does not exist"),
    ("missing data", lambda w: train(w, data="nope"), "does not exist (run `dflash-train"),
    ("not a causal LM", lambda w: train(w, target="bert"), "not a causal language model"),
    ("empty dataset", lambda w: train(w, data="empty"), "has no rows"),
    (
        "data from another tokenizer",
        lambda w: train(w, "--mask-token-id", "3", target="small_target"),
        "prepared with another tokenizer than the target's",
    ),
    (
        "mask id beyond the embedding",
        lambda w: train(w, "--mask-token-id", "100000"),
        "is not a row of the target's embedding",
    ),
    (
        "all rows filtered out",
        lambda w: [
            "prepare",
            "--data",
            str(w / "nothing.jsonl"),
            "--tokenizer",
            str(w / "target"),
            "--out",
            str(w / "prep_none"),
        ],
        "no usable rows",
    ),
    (
        "missing prompts",
        lambda w: train(w, "--eval-every", "1", "--eval-prompts", str(w / "x")),
        "prompts file",
    ),
    ("missing config file", lambda w: train(w, "--config", str(w / "none.yaml")), "config file"),
    ("a GPU without CUDA", lambda w: train(w, "--drafter-devices", "cuda:0"), "CUDA"),
    ("CUDA graphs on CPU targets", lambda w: train(w, "--cuda-graphs"), "--cuda-graphs captures"),
    ("min_ready of zero", lambda w: train(w, "--hs-min-ready", "0"), "must be positive"),
    (
        "min_ready above the depth",
        lambda w: train(w, "--hs-min-ready", "9", "--hs-queue-depth", "4"),
        "must be <= hs_queue_depth",
    ),
    ("unreadable byte bound", lambda w: train(w, "--hs-queue-bytes", "12XB"), "cannot read"),
    ("negative keep-last", lambda w: train(w, "--keep-last", "-1"), "must be >= 0"),
    (
        "run directory under a file",
        lambda w: with_out(train(w), w / "a_file" / "run"),
        "cannot write the run directory",
    ),
    (
        "eval of a missing drafter",
        lambda w: [
            "eval",
            "--draft",
            str(w / "nope"),
            "--target",
            str(w / "target"),
            "--prompts",
            str(w / "prompts.jsonl"),
        ],
        "does not exist",
    ),
    (
        "export of a missing run",
        lambda w: ["export", str(w / "nope"), "--out", str(w / "e")],
        "does not exist",
    ),
    ("resume of a missing run", lambda w: ["train", "--resume", str(w / "nope")], "not exist"),
    (
        "resume with another --out",
        lambda w: ["train", "--resume", str(w / "ckpt"), "--out", str(w / "elsewhere")],
        "/ckpt, not in --out ",
    ),
    ("target that is a file", lambda w: train(w, target="a_file"), "a_file is a file, not a"),
    (
        "resume of a file",
        lambda w: ["train", "--resume", str(w / "a_file")],
        "a_file is a file, not a run directory",
    ),
    ("report of a file", lambda w: ["report", str(w / "a_file")], "is a file, not a run directory"),
    (
        "eval prompts that are a directory",
        lambda w: [
            "eval",
            "--draft",
            str(w / "other_drafter"),
            "--target",
            str(w / "target"),
            "--prompts",
            str(w / "data"),
        ],
        "/data is a directory, not a JSON-lines file",
    ),
    (
        "prepare data that is a directory, a tokenizer that is a file",
        lambda w: [
            "prepare",
            "--data",
            str(w / "data"),
            "--tokenizer",
            str(w / "target"),
            "--out",
            str(w / "p"),
        ],
        "/data is a directory, not a file",
    ),
    (
        "prepare with a tokenizer that is a file",
        lambda w: [
            "prepare",
            "--data",
            str(w / "prompts.jsonl"),
            "--tokenizer",
            str(w / "a_file"),
            "--out",
            str(w / "p"),
        ],
        "a_file is a file, not a directory",
    ),
    (
        "prepare with a chat template that is a directory",
        lambda w: [
            "prepare",
            "--data",
            str(w / "prompts.jsonl"),
            "--tokenizer",
            str(w / "target"),
            "--chat-template",
            str(w / "data"),
            "--out",
            str(w / "p"),
        ],
        "/data is a directory, not a file",
    ),
    (
        "dflash2 groups that do not divide the width",
        lambda w: train(w, "--arch", "dflash2", "--conv-group-size", "7"),
        "conv_group_size 7 does not divide hidden_size",
    ),
    (
        "dflash2 top K above the vocabulary",
        lambda w: train(w, "--arch", "dflash2", "--selector-top-k", "100000"),
        "selector_top_k 100000 is larger than the vocabulary",
    ),
    (
        "init-from a drafter of another backbone",
        lambda w: train(w, "--arch", "dflash2", "--init-from", str(w / "other_drafter")),
        "does not fit the target: vocab_size 64 != target vocab_size",
    ),
    (
        "export onto a file",
        lambda w: ["export", str(w / "ckpt"), "--out", str(w / "a_file")],
        "a_file: File exists (EEXIST); a file is in the way",
    ),
    (
        "export under a file",
        lambda w: ["export", str(w / "ckpt"), "--out", str(w / "a_file" / "sub")],
        "a_file/sub: Not a directory (ENOTDIR)",
    ),
    (
        "export of a truncated checkpoint",
        lambda w: ["export", str(w / "ckpt_trunc"), "--out", str(w / "e_trunc")],
        "ckpt_trunc/model.safetensors is truncated or corrupt",
    ),
    (
        "eval of a truncated drafter",
        lambda w: [
            "eval",
            "--draft",
            str(w / "drafter_trunc"),
            "--target",
            str(w / "target"),
            "--prompts",
            str(w / "prompts.jsonl"),
        ],
        "drafter_trunc/model.safetensors is truncated or corrupt",
    ),
    (
        "eval of a truncated checkpoint",
        lambda w: [
            "eval",
            "--draft",
            str(w / "ckpt_trunc"),
            "--target",
            str(w / "target"),
            "--prompts",
            str(w / "prompts.jsonl"),
        ],
        "ckpt_trunc/model.safetensors is truncated or corrupt",
    ),
    (
        "init-from a truncated checkpoint",
        lambda w: train(w, "--init-from", str(w / "ckpt_trunc")),
        "ckpt_trunc/model.safetensors is truncated or corrupt",
    ),
]


def with_out(argv: list[str], out: Path) -> list[str]:
    i = argv.index("--out")
    return [*argv[: i + 1], str(out), *argv[i + 2 :]]


def error_lines(err: str, command: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(f"dflash-train {command}: error:")]


@pytest.mark.parametrize(("case", "argv", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line_and_a_non_zero_exit(ws, case, argv, needle, capsys):
    args = argv(ws)
    code = cli.main(args)
    err = capsys.readouterr().err
    assert code == 2, (case, err[-1500:])
    lines = error_lines(err, args[0])
    assert len(lines) == 1 and needle in lines[0], (case, err[-1500:])
    assert "Traceback" not in err


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() == 0, reason="root writes through chmod 0o555"
)
def test_export_into_a_read_only_directory(ws, tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o555)
    try:
        code = cli.main(["export", str(ws / "ckpt"), "--out", str(tmp_path / "ro" / "e")])
    finally:
        os.chmod(tmp_path / "ro", 0o755)
    err = capsys.readouterr().err
    lines = error_lines(err, "export")
    assert code == 2 and len(lines) == 1, err[-1500:]
    assert f"{tmp_path / 'ro' / 'e'}: Permission denied (EACCES)" in lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("where", ["a directory", "under a file"])
def test_eval_refuses_an_unwritable_json_before_evaluating(ws, where, monkeypatch, capsys):
    """Regression: eval decoded every prompt, then crashed writing --json."""
    from dflash_train import evaluate

    def no_work(*args, **kwargs):
        raise AssertionError("eval loaded the drafter before checking --json")

    monkeypatch.setattr(evaluate, "load_draft", no_work)
    out = ws / "data" if where == "a directory" else ws / "a_file" / "sub" / "r.json"
    argv = ["eval", "--draft", str(ws / "other_drafter"), "--target", str(ws / "target")]
    code = cli.main([*argv, "--prompts", str(ws / "prompts.jsonl"), "--json", str(out)])
    captured = capsys.readouterr()
    lines = error_lines(captured.err, "eval")
    assert code == 2 and len(lines) == 1, captured.err[-1500:]
    assert f"--json {out}" in lines[0]
    assert ("is a directory" if where == "a directory" else "Not a directory") in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (ws / "a_file" / "sub").exists()


def test_a_flag_without_effect_in_its_combination_is_said_once(ws, capsys):
    """Regression: --batch-cost with --batching fixed was dropped without a word; an engine's
    --target-endpoint with the in-process target is said by its flag name."""
    flags = ["--batching", "fixed", "--batch-cost", "auto", "--mask-token-id", "3"]
    argv = train(ws, *flags, data="random_data")
    argv += ["--target-endpoint", "http://localhost:1", "--max-steps", "1"]
    assert cli.main(with_out(argv, ws / "runs" / "notes")) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    notes = [ln for ln in err.splitlines() if ln.startswith("note: ")]
    expected = [
        "note: --batch-cost auto has no effect with --batching fixed (it sizes work batches)",
        "note: --target-endpoint has no effect with --target-backend hf",
    ]
    assert sorted(n for n in notes if "--batch" in n or "--target-e" in n) == expected, err


def test_a_missing_metric_backend_stops_before_anything_is_loaded_or_written(
    ws, capsys, monkeypatch
):
    """Regression: --tensorboard without the extra stopped after both models had loaded, and
    left a run directory that refused the same command once the extra was installed."""
    import importlib.util

    find_spec = importlib.util.find_spec

    def without_tensorboard(name, *args):
        return None if name == "tensorboard" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", without_tensorboard)
    assert cli.main([*train(ws, "--mask-token-id", "3"), "--tensorboard"]) == 2
    err = capsys.readouterr().err
    (line,) = error_lines(err, "train")
    assert 'pip install "dflash-train[tensorboard]"' in line and "Loading" not in err
    assert not (ws / "runs" / "r").exists()


def test_a_reader_that_goes_away_ends_the_output_without_a_traceback(tmp_path):
    """Regression: `dflash-train recipes | head -1` ended in a BrokenPipeError traceback. Here
    the reader (`true`) is gone before the command writes anything."""
    import subprocess
    import sys

    cmd = f"{sys.executable} -m dflash_train recipes | true; echo ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "141"  # 128 + SIGPIPE, as a command killed by it
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


def test_the_projects_warnings_are_one_line_each():
    """Regression: eval's and export's warnings printed as Python shows them (the source file
    and line, then the code line), not the one line they are written as."""
    import warnings

    from dflash_train import evaluate

    shown = cli._one_line_warning("drafter trained otherwise", UserWarning, evaluate.__file__, 440)
    assert shown == "warning: drafter trained otherwise\n"
    other = cli._one_line_warning("x", UserWarning, warnings.__file__, 1)
    assert other.startswith(warnings.__file__) and "UserWarning: x" in other


def test_main_in_process_puts_pythons_warning_format_back(ws, capsys, monkeypatch):
    """Regression: main() set the one-line format for the whole process, so a test or a
    notebook that called it saw every later warning without its source location."""
    import warnings

    def before(*args, **kwargs):
        return "the caller's own format\n"

    monkeypatch.setattr(warnings, "formatwarning", before)
    assert cli.main(["recipes"]) == 0
    assert warnings.formatwarning is before
    assert cli.main(train(ws, target="nope")) == 2  # and after a failed command
    assert warnings.formatwarning is before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the recipe's GPUs exist here")
def test_a_recipes_gpu_on_a_cpu_machine_names_the_recipe(ws, capsys):
    """Regression: `--recipe qwen3-8b` on a CPU machine said "cuda:0 requested but CUDA is not
    available", a value the user never typed; now it says where it came from."""
    out = ws / "runs" / "recipe"
    args = ["train", "--recipe", "qwen3-8b", "--target", str(ws / "target"), "--data"]
    args += [str(ws / "data"), "--out", str(out), "--num-target-features", "1"]
    assert cli.main([*args, "--target-layer-ids", "0", "--mask-token-id", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "cuda:0 requested but CUDA is not available" in err
    assert "(--target-devices cuda:0: from recipe qwen3-8b; a flag overrides it" in err
    assert not out.exists()


def test_debug_shows_the_traceback(ws, capsys):
    assert cli.main([*train(ws, target="nope"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and len(error_lines(err, "train")) == 1


@pytest.mark.parametrize(
    ("fault", "needle"),
    [
        (
            {"stage": "drafter_forward", "at": 2, "action": "oom"},
            "out of memory on cpu in the drafter step (batch of ",
        ),
        (
            {"stage": "cost_probe", "at": 1, "action": "oom"},
            "out of memory on cpu in the drafter's cost probe (probe batch of ",
        ),
        (
            {"stage": "target", "at": 2, "action": "oom"},
            "out of memory on cpu in the target forward (batch of ",
        ),
        (
            {"stage": "checkpoint_write", "at": 1, "action": "disk_full"},
            "no space left on the device",
        ),
    ],
    ids=["drafter oom", "cost probe oom", "target oom", "disk full"],
)
def test_an_out_of_memory_or_a_full_disk_names_what_to_change(ws, fault, needle, capsys):
    faults.install([fault])
    probe = ["--batch-cost", "auto"] if fault["stage"] == "cost_probe" else []  # it times
    try:
        code = cli.main(
            train(ws, "--save-every", "1", "--mask-token-id", "3", *probe, data="random_data")
        )
    finally:
        faults.install(None)
    err = capsys.readouterr().err
    lines = error_lines(err, "train")
    assert code == 2 and len(lines) == 1 and needle in lines[0], err[-1500:]
    assert "Traceback" not in err
    if "cost probe" in needle:
        assert "lower --batch-size or --num-anchors, or --batch-cost flops" in lines[0]
    elif "memory" in needle:
        assert "lower --batch-size or --batch-tokens" in lines[0]
    else:
        assert "--keep-last" in lines[0] and "--resume" in lines[0]


def test_a_full_disk_found_by_the_final_save_is_the_same_one_line(ws, capsys):
    """Regression: a periodic checkpoint's write that failed for a full disk was found only
    by the final save (no later periodic save waited for it), on the main thread: a traceback
    and exit 1, not the one line saying what to free."""
    faults.install([{"stage": "checkpoint_write", "at": 1, "action": "disk_full"}])
    try:
        argv = train(ws, "--save-every", "2", "--max-steps", "3", "--mask-token-id", "3")
        code = cli.main(argv)
    finally:
        faults.install(None)
    err = capsys.readouterr().err
    lines = error_lines(err, "train")
    assert code == 2 and len(lines) == 1 and "no space left on the device" in lines[0], err
    assert "--keep-last" in lines[0] and "Traceback" not in err


def test_one_worker_per_gpu_and_role_and_sharing_only_when_asked():
    g0, g1, cpu = torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")
    check_device_roles([g0], [g1], share=False)
    check_device_roles([cpu, cpu], [cpu, cpu], share=False)  # CPU workers share the cores
    check_device_roles([g0], [g0, g1], share=True)
    with pytest.raises(ValueError, match="lists cuda:1 more than once"):
        check_device_roles([g0], [g1, g1], share=True)
    with pytest.raises(ValueError, match="cuda:0 is both a target and a drafter.*--share-device"):
        check_device_roles([g0], [g0, g1], share=False)


def test_more_than_one_process_per_node_with_gpus_is_refused(ws, monkeypatch, capsys):
    """Regression: torchrun --nproc-per-node 2 on a GPU node started two processes that each
    took every GPU of the device lists. CPU "nodes" on one machine stay allowed."""
    from dflash_train.pipeline.distributed import check_one_process_per_gpu_node

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    check_one_process_per_gpu_node([torch.device("cpu"), torch.device("cpu")])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    argv = train(ws, "--target-devices", "cuda:0", "--drafter-devices", "cuda:1")
    assert cli.main(argv) == 2
    lines = error_lines(capsys.readouterr().err, "train")
    assert len(lines) == 1 and "--nproc-per-node 2 with GPUs in the device lists" in lines[0]
    assert "(cuda:0, cuda:1)" in lines[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_one_process_per_gpu_node([torch.device("cuda", 0)])
