"""`dflash-train report`: renders from fabricated runs, including live, crashed and partial ones."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from fake_run import BLOCK_SIZE, MAX_DEPTH, MIN_READY

from dflash_train.cli import main as cli_main
from dflash_train.metrics.plots import PLOTS
from dflash_train.metrics.report import render_report
from dflash_train.metrics.runlog import load_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL_STEMS = {spec.stem for spec in PLOTS}


def _embedded_pngs(page: Path) -> dict[str, bytes]:
    """Figure id -> decoded PNG of every image embedded in the page."""
    found = re.findall(
        r'<figure id="(\w+)"><img [^>]*src="data:image/png;base64,([^"]+)"', page.read_text()
    )
    return {stem: base64.b64decode(data) for stem, data in found}


def test_full_run_renders_every_plot_embedded_and_beside_the_page(
    make_run: Callable[..., Path],
) -> None:
    run_dir = make_run()
    page = render_report(run_dir)
    assert page == run_dir / "report" / "index.html"
    embedded = _embedded_pngs(page)
    assert set(embedded) == ALL_STEMS
    for stem, png in embedded.items():
        assert png.startswith(PNG_MAGIC)
        assert (page.parent / f"{stem}.png").read_bytes() == png
    text = page.read_text()
    # Self-contained: no image, script or stylesheet is fetched from anywhere.
    assert not re.search(r'(src|href)="(?!data:|#)', text)
    assert "Notes" not in text  # nothing was skipped or missing
    assert text.isascii()


def test_summary_table_shows_last_mean_and_best_values(make_run: Callable[..., Path]) -> None:
    run_dir = make_run(steps=100, every=10, eval_every=50)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    taus = [x["eval/tau"] for x in lines if "eval/tau" in x]
    losses = [x["train/loss"] for x in lines if "train/loss" in x]
    text = render_report(run_dir).read_text()
    assert "10 .. 100 (10 log steps)" in text
    mean = f"{sum(taus) / len(taus):.4g}"
    row = f"<td>eval tau (tokens)</td><td>4</td><td>100</td><td>{mean}</td><td>4</td><td>100</td>"
    assert row in text
    # The loss has no best (under D-PACE it rises as the drafter learns): last, mean, nothing.
    loss_mean = f"{sum(losses) / len(losses):.4g}"
    assert f"<td>{losses[-1]:.4g}</td><td>100</td><td>{loss_mean}</td><td></td><td></td>" in text


def test_values_that_are_not_numbers_are_skipped_with_a_note(tmp_path: Path) -> None:
    """Regression: a string or list value stopped the report with numpy's own message, naming
    neither the file nor the key."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "train/loss": 3.0, "train/lr": "oops"}\n'
        '{"step": 2, "train/loss": [1, 2], "train/lr": 0.1}\n'
    )
    run = load_run(tmp_path)
    assert run.records == [{"step": 1, "train/loss": 3.0}, {"step": 2, "train/lr": 0.1}]
    assert any("line 1: train/lr is not a number" in n for n in run.notes)
    assert any("line 2: train/loss is not a number" in n for n in run.notes)


def test_a_resumed_runs_lines_replace_the_abandoned_timeline(tmp_path: Path) -> None:
    """Regression: a run resumed from step 4 after logging step 6 merged the abandoned step 6
    into the new one (keys only the old line had survived)."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 4, "train/loss": 4.0}\n{"step": 6, "train/loss": 6.0, "time/x_s": 9.0}\n'
        '{"step": 6, "eval/tau": 2.0}\n'
        '{"step": 5, "train/loss": 5.5}\n{"step": 6, "train/loss": 6.5}\n'
    )
    run = load_run(tmp_path)
    assert run.records == [
        {"step": 4, "train/loss": 4.0}, {"step": 5, "train/loss": 5.5},
        {"step": 6, "train/loss": 6.5},
    ]  # fmt: skip


def test_truncated_last_line_is_skipped_with_a_note(make_run: Callable[..., Path]) -> None:
    run_dir = make_run(steps=100)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 110, "time": 1.0, "train/lo')  # the writer died mid-line
    run = load_run(run_dir)
    assert run.records[-1]["step"] == 100
    text = render_report(run_dir).read_text()
    assert "last line is not valid JSON" in text
    assert set(_embedded_pngs(run_dir / "report" / "index.html")) == ALL_STEMS


def test_corrupt_middle_line_is_skipped_and_the_rest_is_kept(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "time": 1.0, "train/loss": 3.0}\n'
        "garbage\n"
        '{"step": 2, "time": 2.0, "train/loss": null}\n'
        '{"step": 2, "time": 2.5, "eval/tau": 2.0}\n'
    )
    run = load_run(tmp_path)
    assert any("line 2 is not valid JSON" in n for n in run.notes)
    # Lines of the same step merge; a null (NaN at log time) stays a gap, not an error.
    assert run.records == [
        {"step": 1, "train/loss": 3.0},
        {"step": 2, "train/loss": None, "eval/tau": 2.0},
    ]
    page = render_report(tmp_path)
    assert {"loss_tau", "eval_tau"} <= set(_embedded_pngs(page))


def test_missing_metric_family_skips_its_plots_with_a_note(make_run: Callable[..., Path]) -> None:
    run_dir = make_run(steps=60, eval_every=30, drop="queue/")
    stale = run_dir / "report" / "queue_depth.png"
    stale.parent.mkdir()
    stale.write_bytes(PNG_MAGIC)  # left by an earlier render, when the family was there
    text = render_report(run_dir).read_text()
    drawn = set(_embedded_pngs(run_dir / "report" / "index.html"))
    assert drawn == ALL_STEMS - {"queue_depth", "bucket_depth", "queue_stalls"}
    assert "Hidden-state queue depth: not drawn" in text
    assert "Producers blocked and drafters starved: not drawn" in text
    assert not stale.exists()


def test_queue_reference_lines_come_from_config(make_run: Callable[..., Path]) -> None:
    run = load_run(make_run(steps=20))
    assert run.config_value("pipeline.hs_queue_depth") == MAX_DEPTH
    assert run.config_value("pipeline.hs_min_ready") == MIN_READY
    assert run.config_value("pipeline.nothing") is None


def test_missing_config_is_a_note_not_an_error(make_run: Callable[..., Path]) -> None:
    run_dir = make_run(steps=20, config=False)
    text = render_report(run_dir, run_dir / "elsewhere").read_text()
    assert "config.json not found" in text
    assert (run_dir / "elsewhere" / "queue_depth.png").exists()
    assert not (run_dir / "report").exists()


def test_accuracy_plot_uses_every_block_position(make_run: Callable[..., Path]) -> None:
    run = load_run(make_run(steps=20))
    keys = run.matching(r"^train/acc_k\d+$")
    assert keys == [f"train/acc_k{k}" for k in range(1, BLOCK_SIZE)]  # natural order, k2 < k10


def test_empty_metrics_file_renders_a_page_saying_so(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("")
    text = render_report(tmp_path).read_text()
    assert "no complete lines yet" in text
    assert _embedded_pngs(tmp_path / "report" / "index.html") == {}


def test_missing_run_dir_or_metrics_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        render_report(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no metrics\.jsonl"):
        render_report(tmp_path)


def test_cli_report_writes_the_page_and_returns_0(
    make_run: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = make_run(steps=30, drop="time/")
    assert cli_main(["report", str(run_dir)]) == 0
    assert (run_dir / "report" / "index.html").is_file()
    assert "report written to" in capsys.readouterr().out


def test_cli_report_on_a_missing_run_dir_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash-train report: error:") and "\n" not in err
