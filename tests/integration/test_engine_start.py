"""`train --target-backend vllm` start-up errors that need no vLLM (default suite): an
environment without vLLM and an endpoint where no engine answers are one line and exit 2, before
the run directory exists, with no engine process left behind."""

from __future__ import annotations

import sys

from dflash_train import cli
from engine_helpers import assert_no_engine_left, engine_pgids
from pipeline_helpers import write_random_dataset


def argv(tiny_target, data, out, *extra: str) -> list[str]:
    return [
        "train", "--target", str(tiny_target), "--data", str(data), "--out", str(out),
        "--target-backend", "vllm", "--target-devices", "cpu", "--drafter-devices", "cpu",
        "--draft-layers", "1", "--block-size", "8", "--num-anchors", "16",
        "--mask-token-id", "255", "--batch-cost", "blocks", "--no-progress", *extra,
    ]  # fmt: skip


def one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_an_environment_without_vllm_is_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    data = write_random_dataset(tmp_path / "data", num_rows=8)
    # This project's own environment has no vLLM: it never enters it.
    code = cli.main(argv(tiny_target, data, tmp_path / "run", "--vllm-python", sys.executable))
    err = capsys.readouterr().err
    assert code == 2
    line = one_error_line(err)
    assert "the vLLM engine did not start (exit 3): no working vLLM in" in line
    assert "log: " in line
    assert not (tmp_path / "run").exists()
    assert_no_engine_left(engine_pgids(err))


def test_an_endpoint_with_no_engine_is_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    data = write_random_dataset(tmp_path / "data", num_rows=8)
    code = cli.main(
        argv(tiny_target, data, tmp_path / "run", "--target-endpoint", "http://127.0.0.1:9")
    )
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--target-endpoint: no engine answers at http://127.0.0.1:9" in line
    assert not (tmp_path / "run").exists()
