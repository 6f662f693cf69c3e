"""Reading a run's metrics.jsonl back, tolerant of runs that are still going or that crashed."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dflash_train.metrics.logger import METRICS_FILE

CONFIG_FILE = "config.json"
"""The resolved run config, nested by section, written by `train` into the run directory."""


@dataclass
class RunLog:
    """A run's metrics, one merged record per step in ascending step order.

    Lines logged for the same step (e.g. train metrics and then `eval/tau`, or a resumed run
    re-logging steps after its last checkpoint) are merged, later values winning.
    """

    run_dir: Path
    records: list[dict[str, Any]]
    """Merged records `{"step": int, key: float | None, ...}`, ascending by step."""
    config: dict[str, Any]
    """config.json, or {} when it is missing or unreadable (see `notes`)."""
    notes: list[str] = field(default_factory=list)
    """Things a reader should know: skipped lines, missing files."""
    num_lines: int = 0
    """Valid JSON lines read."""
    first_time: float | None = None
    """Unix time of the earliest line."""
    last_time: float | None = None
    """Unix time of the latest line."""

    @cached_property
    def logged_keys(self) -> frozenset[str]:
        """Every metric key logged at least once."""
        return frozenset(k for r in self.records for k in r if k != "step")

    def matching(self, pattern: str) -> list[str]:
        """Logged keys matching the regex `pattern` (re.search), in natural order (k2 < k10)."""
        rx = re.compile(pattern)
        return sorted((k for k in self.logged_keys if rx.search(k)), key=_natural_key)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of the records holding `key`; null values come back as NaN."""
        rows = [(r["step"], r[key]) for r in self.records if key in r]
        steps = np.array([s for s, _ in rows], dtype=np.int64)
        values = np.array([np.nan if v is None else v for _, v in rows], dtype=np.float64)
        return steps, values

    def latest(self, keys: list[str]) -> tuple[int, list[float]] | None:
        """(step, values) of the last record that has all `keys`, or None."""
        for r in reversed(self.records):
            if all(k in r for k in keys):
                return r["step"], [np.nan if r[k] is None else float(r[k]) for k in keys]
        return None

    def config_value(self, dotted: str) -> Any | None:
        """A config entry by dotted path (`pipeline.hs_min_ready`), or None if absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


def _natural_key(key: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def _parse_lines(text: str, notes: list[str]) -> list[dict[str, Any]]:
    lines = text.split("\n")
    # A file that ends without "\n" was cut mid-write (a live or crashed run).
    last_index = len(lines) - 1 if lines[-1] else len(lines) - 2
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            where = "last line" if i == last_index else f"line {i + 1}"
            notes.append(f"{METRICS_FILE}: {where} is not valid JSON (cut short?); skipped")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            notes.append(f"{METRICS_FILE}: line {i + 1} has no integer 'step'; skipped")
            continue
        for key in [k for k, v in record.items() if k not in ("step", "time") and not _number(v)]:
            notes.append(f"{METRICS_FILE}: line {i + 1}: {key} is not a number; skipped")
            del record[key]
        out.append(record)
    return out


def _number(value: Any) -> bool:
    """A metric value the report can plot: a number, or null (a gap)."""
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _merge_by_step(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, its lines merged (a step's training line and its eval line). A
    resumed run logs again from its checkpoint's step: a line whose step goes back starts that
    timeline, and the abandoned one's records from that step on are dropped."""
    merged: dict[int, dict[str, Any]] = {}
    newest = None
    for line in lines:
        if newest is not None and line["step"] < newest:
            for step in [s for s in merged if s >= line["step"]]:
                del merged[step]
        newest = line["step"]
        record = merged.setdefault(line["step"], {"step": line["step"]})
        record.update((k, v) for k, v in line.items() if k not in ("step", "time"))
    return [merged[s] for s in sorted(merged)]


def _read_config(run_dir: Path, notes: list[str]) -> dict[str, Any]:
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        notes.append(f"{CONFIG_FILE} not found: queue reference lines are left out")
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        notes.append(f"{CONFIG_FILE} is not valid JSON ({e}); ignored")
        return {}
    return config if isinstance(config, dict) else {}


def load_run(run_dir: str | Path) -> RunLog:
    """Read RUN_DIR/metrics.jsonl (and config.json if present).

    Raises ValueError when the directory or its metrics.jsonl does not exist. Lines that are not
    valid JSON (typically the last one of a run being written or killed) are skipped with a note.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is a file, not a run directory")
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ValueError(
            f"{str(run_dir)!r} has no {METRICS_FILE}: is it a run directory of `dflash-train "
            "train`, and has the run reached its first log step?"
        )
    notes: list[str] = []
    lines = _parse_lines(path.read_text(encoding="utf-8", errors="replace"), notes)
    times = [float(t) for t in (line.get("time") for line in lines) if isinstance(t, int | float)]
    if not lines:
        notes.append(f"{METRICS_FILE} has no complete lines yet")
    return RunLog(
        run_dir=run_dir,
        records=_merge_by_step(lines),
        config=_read_config(run_dir, notes),
        notes=notes,
        num_lines=len(lines),
        first_time=min(times, default=None),
        last_time=max(times, default=None),
    )
