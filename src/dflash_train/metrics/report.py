"""`dflash-train report RUN_DIR`: a self-contained HTML page and PNG plots of a run.

Reads RUN_DIR/metrics.jsonl (and config.json for the queue's reference lines) and writes
RUN_DIR/report/index.html with every figure embedded as base64, plus the PNG files beside it.
Safe on a run that is still being written or that crashed: a cut-short line is skipped with a
note, and a figure whose metrics were never logged is left out with a note.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_train.metrics.plots import PLOTS, PlotSpec, build_figure
from dflash_train.metrics.runlog import CONFIG_FILE, RunLog, load_run

REPORT_SUBDIR = "report"
PNG_DPI = 110

# (key, label, which direction is better: "min", "max" or None for no "best" column)
SUMMARY_ROWS: list[tuple[str, str, str | None]] = [
    # No best: under D-PACE (the default) the loss is weighted by the drafter's own confidence,
    # so it rises as the drafter learns; its lowest value is no best.
    ("train/loss", "training loss (nats)", None),
    ("train/tau_est", "estimated tau (tokens)", "max"),
    ("eval/tau", "eval tau (tokens)", "max"),
    ("train/tokens_per_s", "trained tokens/s", "max"),
    ("train/seqs_per_s", "sequences/s", "max"),
    ("train/padding_frac", "padding fraction", "min"),
    ("train/lr", "learning rate", None),
    ("train/grad_norm", "gradient norm", None),
    ("train/epoch", "epoch", None),
    ("queue/depth", "queue depth (batches)", None),
    ("queue/producer_blocked_frac", "producers blocked (fraction)", "min"),
    ("queue/consumer_starved_frac", "drafters starved (fraction)", "min"),
    ("queue/hol_wait_frac", "drafters waiting for their planned batch (fraction)", "min"),
    ("queue/mix_tv", "length-mix TV distance", "min"),
    ("queue/put_total", "batches put into queue (since the last start)", None),
    ("queue/get_total", "batches taken from queue (since the last start)", None),
]


@dataclass
class RenderedPlot:
    """A drawn figure: its spec, PNG bytes and where the PNG was written."""

    spec: PlotSpec
    png: bytes
    path: Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train report`."""
    parser.add_argument(
        "run_dir", type=Path, metavar="RUN_DIR", help="run directory holding metrics.jsonl"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="directory for index.html and the PNGs (default: RUN_DIR/report)",
    )


def main(args: argparse.Namespace) -> int:
    """Render the report and print where it is."""
    page = render_report(args.run_dir, args.out)
    print(f"report written to {page}")
    return 0


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the report of `run_dir` and return the path of its index.html.

    Raises ValueError when `run_dir` does not exist or has no metrics.jsonl.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / REPORT_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    notes = list(run.notes) + _config_notes(run)
    rendered: list[RenderedPlot] = []
    for spec in PLOTS:
        path = out / f"{spec.stem}.png"
        if not run.matching(spec.requires):
            notes.append(f"{spec.title}: not drawn, no metric matching {spec.requires} logged")
            path.unlink(missing_ok=True)  # a PNG from an earlier render would be out of date
            continue
        png = _png_bytes(spec, run)
        path.write_bytes(png)
        rendered.append(RenderedPlot(spec, png, path))
    page = out / "index.html"
    # Write-then-rename so a browser reloading the page of a live run never sees half a file.
    tmp = page.with_suffix(".html.tmp")
    tmp.write_text(_html_page(run, rendered, notes), encoding="utf-8")
    tmp.replace(page)
    return page


def _config_notes(run: RunLog) -> list[str]:
    if not run.config:
        return []  # load_run already said why
    return [
        f"{CONFIG_FILE} has no {name}: its line on the queue-depth plot is left out"
        for name in ("pipeline.hs_queue_depth", "pipeline.hs_min_ready")
        if run.config_value(name) is None
    ]


def _png_bytes(spec: PlotSpec, run: RunLog) -> bytes:
    fig = build_figure(spec, run)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=PNG_DPI)
    return buf.getvalue()


# ----------------------------------------------------------------------------- summary table


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return "n/a"
    if x == int(x) and abs(x) < 1e9:
        return f"{int(x)}"
    return f"{x:.4g}"


def _fmt_duration(seconds: float) -> str:
    h, rem = divmod(round(seconds), 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s"


def _summary_rows(run: RunLog) -> list[list[str]]:
    rows = []
    for key, label, better in SUMMARY_ROWS:
        steps, values = run.series(key)
        finite = np.isfinite(values)
        if not finite.any():
            continue
        last = int(np.flatnonzero(finite)[-1])
        # The mean over the log steps too: a queue that drained at the end reads 0 last and best.
        row = [label, _fmt(values[last]), str(steps[last]), _fmt(np.nanmean(values)), "", ""]
        if better is not None:
            best = int(np.nanargmin(values) if better == "min" else np.nanargmax(values))
            row[4:] = [_fmt(values[best]), str(steps[best])]
        rows.append(row)
    return rows


def _run_facts(run: RunLog) -> list[tuple[str, str]]:
    facts = [("run directory", str(run.run_dir.resolve()))]
    if run.records:
        first, last = run.records[0]["step"], run.records[-1]["step"]
        facts.append(("steps logged", f"{first} .. {last} ({len(run.records)} log steps)"))
    if run.first_time is not None and run.last_time is not None:
        facts.append(
            ("wall time (first to last line)", _fmt_duration(run.last_time - run.first_time))
        )
        ago = _fmt_duration(max(0.0, time.time() - run.last_time))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(run.last_time))
        facts.append(("last line written", f"{stamp} ({ago} ago)"))
    facts.append(("report generated", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())))
    return facts


# ----------------------------------------------------------------------------- HTML

_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.7em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
th { background: #f0f0f0; }
img { max-width: 100%; border: 1px solid #ddd; }
.notes { background: #fff8e0; border: 1px solid #e8d48a; padding: 0.5em 1.5em; }
figure { margin: 1.5em 0; }
figcaption { color: #666; font-size: small; }
"""


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure_html(plot: RenderedPlot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    title = html.escape(plot.spec.title)
    # The title is drawn inside the PNG (so the file stands alone); no heading repeats it here.
    return (
        f'<figure id="{plot.spec.stem}">'
        f'<img alt="{title}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(plot.path.name)}</figcaption></figure>"
    )


def _html_page(run: RunLog, plots: list[RenderedPlot], notes: list[str]) -> str:
    name = html.escape(run.run_dir.resolve().name)
    facts = _table(["run", ""], [[k, v] for k, v in _run_facts(run)])
    header = ["metric", "last", "at step", "mean over the run", "best", "at step"]
    summary = _table(header, _summary_rows(run))
    notes_html = ""
    if notes:
        items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
        notes_html = f'<div class="notes"><h2>Notes</h2><ul>{items}</ul></div>'
    figures = "\n".join(_figure_html(p) for p in plots)
    links = " | ".join(f'<a href="#{p.spec.stem}">{html.escape(p.spec.title)}</a>' for p in plots)
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>dflash-train report: {name}</title><style>{_CSS}</style></head><body>"
        f"<h1>dflash-train report: {name}</h1>{facts}<h2>Summary</h2>{summary}"
        f"{notes_html}<h2>Plots</h2><p>{links}</p>\n{figures}\n</body></html>\n"
    )
