"""`bench optimizer`'s flags: checked up front, one line each; the smallest valid run."""

from __future__ import annotations

import json

import pytest

from dflash_train.bench import optimizer as bench_optimizer
from dflash_train.cli import main


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--warmup", "-1", "--steps", "1"], "--warmup must be >= 0, got -1"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--threads", "-3"], "--threads must be >= 1, got -3"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2_before_running(monkeypatch, capsys, flags, says):
    ran = []
    monkeypatch.setattr(bench_optimizer, "run", lambda args: ran.append(args))
    assert main(["bench", "optimizer", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(says), err
    assert ran == []


def test_no_warmup_and_one_step_is_a_valid_run(tmp_path):
    out = tmp_path / "opt.json"
    argv = ["bench", "optimizer", "--random-target", "tiny", "--warmup", "0", "--steps", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["identical"] and [r["way"] for r in data["rows"]] == ["whole", "split"]
