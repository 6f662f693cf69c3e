"""Reports, steady-state rates and the benchmark dispatcher."""

from __future__ import annotations

import argparse
import json

import pytest

from dflash_train.bench import command
from dflash_train.bench.common import BenchReport, emit, format_table
from dflash_train.bench.sim import steady_rate


def test_table_aligns_columns_and_formats_numbers():
    text = format_table(["case", "rate"], [{"case": "a", "rate": 1.23456}, {"case": "bb"}])
    lines = text.splitlines()
    assert lines[0].split() == ["case", "rate"]
    assert "1.2346" in lines[2]
    assert len({len(line) for line in lines[:3]}) == 1


def test_emit_writes_summary_keys_and_rows_and_fails_on_problems(tmp_path, capsys):
    report = BenchReport("t", ["k"], rows=[{"k": 1}], summary={"headline": 0.5})
    out = tmp_path / "r.json"
    assert emit(report, str(out)) == 0
    data = json.loads(out.read_text())
    assert data["headline"] == 0.5 and data["rows"] == [{"k": 1}] and data["problems"] == []
    report.problems.append("2 items lost")
    assert emit(report, None) == 1
    assert "INVARIANT BROKEN: 2 items lost" in capsys.readouterr().out


def test_steady_rate_counts_batches_between_step_completions():
    times = [float(t) for t in range(11)]
    assert steady_rate(times, [2] * 11)[0] == pytest.approx(2.0)
    # The slow start (fill-up) and the drain are left out.
    times = [0.0, 5.0, *[5.0 + t for t in range(1, 9)], 30.0]
    rate, _span, _steps = steady_rate(times, [1] * len(times))
    assert rate == pytest.approx(1.0)


def test_steady_rate_needs_a_few_steps():
    assert steady_rate([0.0, 1.0], [1, 1])[2] == 0


def test_a_missing_benchmark_module_is_a_user_error(monkeypatch):
    monkeypatch.setitem(command.BENCHMARKS, "step", ("dflash_train.bench._absent", "x"))
    with pytest.raises(ValueError, match="not available"):
        command.load("step")


def test_a_benchmark_whose_dependency_is_missing_shows_the_real_cause(monkeypatch):
    monkeypatch.setitem(command.BENCHMARKS, "step", ("no_such_package.bench", "x"))
    with pytest.raises(ModuleNotFoundError):
        command.load("step")


def test_dispatcher_hands_the_remaining_arguments_to_the_benchmark(monkeypatch):
    seen = {}

    class Fake:
        @staticmethod
        def add_arguments(parser):
            parser.add_argument("--n", type=int)

        @staticmethod
        def main(args):
            seen["n"] = args.n
            return 3

    monkeypatch.setattr(command, "load", lambda name: Fake)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    assert command.main(parser.parse_args(["queue", "--n", "7"])) == 3
    assert seen == {"n": 7}
