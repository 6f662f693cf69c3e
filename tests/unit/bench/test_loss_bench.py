"""`bench loss` through the CLI without its measuring processes: the flags checked up front,
one anchor count (no growth to report), a failed worker as one line."""

from __future__ import annotations

import json
import subprocess

import pytest

from dflash_train.bench import loss as bench_loss
from dflash_train.cli import main

SMALL = ["bench", "loss", "--loss", "ce", "--vocab", "256", "--hidden", "16"]


def fake_workers(monkeypatch, returncode=0, stdout=None, stderr=""):
    """Every worker answers at once: a small peak growing with its anchors, or the failure."""
    calls = []

    def run(cmd, **kw):
        calls.append(cmd)
        anchors = int(cmd[cmd.index("--worker") + 3])
        out = json.dumps({"peak_growth_mb": 1.0 + anchors, "seconds": 0.01, "loss": 1.0})
        return subprocess.CompletedProcess(
            cmd, returncode, out if stdout is None else stdout, stderr
        )

    monkeypatch.setattr(bench_loss.subprocess, "run", run)
    return calls


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--anchors", "0"], "--anchors must be >= 1"),
        (["--anchors", "4", "-2"], "--anchors must be >= 1"),
        (["--anchors", "4", "--block-size", "1"], "--block-size must be >= 2"),
        (["--anchors", "4", "--vocab", "0"], "--vocab must be >= 1"),
        (["--anchors", "4", "--hidden", "0"], "--hidden must be >= 1"),
        (["--anchors", "4", "8", "--chunk", "-5"], "--chunk must be >= 0"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2_before_any_worker(monkeypatch, capsys, flags, says):
    calls = fake_workers(monkeypatch)
    assert main([*SMALL, *flags]) == 2
    assert says in one_line_error(capsys)
    assert calls == []  # checked up front, not in a worker


def test_one_anchor_count_measures_rows_but_no_growth(monkeypatch, capsys, tmp_path):
    fake_workers(monkeypatch)
    out = tmp_path / "loss.json"
    assert main([*SMALL, "--anchors", "4", "--json", str(out)]) == 0
    assert "ce: growth chunked not measured" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [r["anchors"] for r in result["rows"]] == [4]
    assert result["growth_mb"]["ce"] == {"chunked": None, "direct": None}


def test_two_anchor_counts_report_the_growth(monkeypatch, capsys, tmp_path):
    fake_workers(monkeypatch)
    out = tmp_path / "loss.json"
    assert main([*SMALL, "--anchors", "4", "8", "--json", str(out)]) == 0
    assert "ce: growth chunked 4 MB from 4 to 8 anchors" in capsys.readouterr().out
    assert json.loads(out.read_text())["growth_mb"]["ce"]["chunked"] == [4.0, 4, 8]


def test_a_failed_worker_is_one_line_naming_it(monkeypatch, capsys):
    stderr = "Traceback (most recent call last):\n  ...\nRuntimeError: out of memory\n"
    fake_workers(monkeypatch, returncode=-9, stdout="", stderr=stderr)
    assert main([*SMALL, "--anchors", "4"]) == 1
    err = one_line_error(capsys)
    assert "the ce chunked worker at 4 anchors failed (killed by signal 9)" in err
    assert "RuntimeError: out of memory" in err


def test_a_worker_refusing_its_input_is_a_user_error(monkeypatch, capsys):
    fake_workers(monkeypatch, 2, "", "dflash-train bench: error: something it checks\n")
    assert main([*SMALL, "--anchors", "4"]) == 2
    assert one_line_error(capsys).endswith(
        "the ce chunked worker at 4 anchors: something it checks"
    )


def test_a_worker_past_its_time_limit_is_one_line(monkeypatch, capsys):
    def run(cmd, **kw):
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(bench_loss.subprocess, "run", run)
    assert main([*SMALL, "--anchors", "4"]) == 1
    assert "the ce chunked worker at 4 anchors ran past 1800 s" in one_line_error(capsys)


def test_a_workers_peak_is_its_own_not_the_launching_processs():
    # On Linux ru_maxrss starts at the launcher's peak (kept across fork and exec): a worker
    # started by a process that once held 1 GB (a test suite) showed no growth below 1 GB, and
    # `bench loss` reported 0 MB for the direct CE loss's 700 MB.
    import resource
    import sys

    block = b"\x01" * (1 << 30)  # written, so resident: this process's peak passes 1 GB
    del block
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 1 << 20  # KB
    code = "from dflash_train.bench.loss import _peak_mb; print(_peak_mb())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout) < 800  # torch imported, nothing else
