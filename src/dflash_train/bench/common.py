"""What every benchmark shares: a report (table + JSON + invariant checks) and synthetic lengths.

A benchmark builds a `BenchReport`: rows for the table (also written to JSON under "rows"), the
headline figures (top-level JSON keys), notes, and the problems it found in its own invariants
(lost or duplicated items, a hang). `emit` prints it, writes `--json OUT`, and turns problems
into a non-zero exit status, so a benchmark that breaks its invariants fails loudly in CI.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

EXIT_OK = 0
EXIT_INVARIANT_BROKEN = 1


@dataclass
class BenchReport:
    """The outcome of one benchmark run.

    summary: headline figures, written as top-level JSON keys (e.g. "efficiency").
    rows: one dict per configuration / measurement; `columns` picks and orders what the table
        shows (JSON gets every key).
    problems: broken invariants; any makes the command exit non-zero.
    """

    title: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.summary,
            "rows": self.rows,
            "notes": self.notes,
            "problems": self.problems,
        }


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", metavar="OUT", default=None, help="also write the results to this JSON file"
    )


def add_seed_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=0, help="seed of every random choice")


def fmt(value: Any) -> str:
    """A table cell: floats with 4 decimals below 100 (ratios line up), fewer above."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        mag = abs(value)
        if mag >= 1000:
            return f"{value:,.0f}"
        return f"{value:.1f}" if mag >= 100 else f"{value:.4f}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10000 else str(value)
    return str(value)


def format_table(columns: list[str], rows: list[dict[str, Any]]) -> str:
    """A plain-text table (left-aligned first column, right-aligned numbers)."""
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        parts = [
            v.ljust(w) if i == 0 else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(columns), rule, *(line(r) for r in cells)])


def emit(report: BenchReport, json_path: str | None, stream: TextIO | None = None) -> int:
    """Print the report, write its JSON, and return the exit status (1 if an invariant broke)."""
    out = stream or sys.stdout
    print(report.title, file=out)
    print(format_table(report.columns, report.rows), file=out)
    if report.summary:
        print(file=out)
        for key, value in report.summary.items():
            if not isinstance(value, dict | list):
                print(f"{key}: {fmt(value)}", file=out)
    for note in report.notes:
        print(f"note: {note}", file=out)
    for problem in report.problems:
        print(f"INVARIANT BROKEN: {problem}", file=out)
    if json_path:
        write_json(json_path, report.to_json())
        print(f"wrote {json_path}", file=out)
    out.flush()
    return EXIT_INVARIANT_BROKEN if report.problems else EXIT_OK


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_jsonable(payload), indent=2) + "\n")


def _jsonable(value: Any) -> Any:
    """numpy scalars and int dict keys -> plain JSON types."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def synthetic_lengths(
    num_rows: int,
    seed: int = 0,
    *,
    median: float = 600.0,
    sigma: float = 0.8,
    min_len: int = 16,
    max_len: int = 3072,
) -> np.ndarray:
    """Sequence lengths shaped like chat SFT data: log-normal around `median`, a long tail cut at
    `max_len` (the default `prepare --max-length`), so the longest bucket holds a pile-up."""
    rng = np.random.default_rng([seed, 0x1E57])
    raw = rng.lognormal(np.log(median), sigma, size=num_rows)
    return np.clip(np.round(raw), min_len, max_len).astype(np.int64)


def synthetic_anchors(lengths: np.ndarray, seed: int = 0, num_anchors: int = 512) -> np.ndarray:
    """Anchors per row of chat-like rows: a supervised (assistant) share of 30-90% of each row,
    its valid anchor positions (supervised tokens - 1), at most `num_anchors`."""
    rng = np.random.default_rng([seed, 0xA4C])
    supervised = np.round(rng.uniform(0.3, 0.9, size=len(lengths)) * lengths).astype(np.int64)
    return np.clip(supervised - 1, 0, num_anchors)


def percentile(values: np.ndarray | list[float], q: float) -> float:
    arr = np.asarray(values, dtype=np.float64)
    return float(np.percentile(arr, q)) if arr.size else float("nan")
