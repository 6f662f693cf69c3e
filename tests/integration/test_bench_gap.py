"""`bench gap` through the real CLI on the tiny target: the run's step split into parts that
add up, next to the same batches' step alone, every row trained exactly once."""

from __future__ import annotations

import json

import pytest

from dflash_train.bench.gap import RUN_PARTS
from dflash_train.cli import main


def test_bench_gap_splits_the_runs_step_into_parts_that_add_up(tiny_target, tmp_path):
    out = tmp_path / "gap.json"
    argv = [
        "bench", "gap", "--target", str(tiny_target), "--rows", "40", "--steps", "5",
        "--skip", "1", "--draft-layers", "1", "--num-anchors", "16", "--threads", "1",
        "--log-every", "2", "--mask-token-id", "255", "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["problems"] == [] and data["steps"] == 5 and data["window_steps"] == 4
    rows = {r["part"]: r for r in data["rows"]}
    assert set(rows) == {name for name, _, _ in RUN_PARTS} | {"unattributed", "total"}
    parts = [r for name, r in rows.items() if name != "total"]
    assert sum(r["run_s"] for r in parts) == pytest.approx(rows["total"]["run_s"])
    assert sum(r["step_s"] for r in parts) == pytest.approx(rows["total"]["step_s"])
    assert rows["drafter forward + backward"]["run_s"] > 0
    assert rows["drafter forward + backward"]["step_s"] > 0
    assert data["run_steps_per_s"] == pytest.approx(1 / rows["total"]["run_s"])
    assert data["first_step_s"] > 0 and data["end_s"] > 0


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--steps", "3", "--skip", "2"], "--skip must be in 1..1 (--steps 3)"),
        (["--steps", "5", "--skip", "0"], "--skip must be in 1..3 (--steps 5)"),
        (["--steps", "2", "--skip", "1"], "--steps must be >= 3"),
    ],
)
def test_bench_gap_refuses_a_skip_that_leaves_nothing_to_measure_or_holds_step_1(
    capsys, flags, says
):
    assert main(["bench", "gap", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
