"""The run directory: refused when it holds another run (unless --overwrite), then created with
the resolved config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_train.metrics.logger import METRICS_FILE
from dflash_train.metrics.runlog import CONFIG_FILE

RESULT_FILE = "result.json"


def check_run_dir(path: str | Path, overwrite: bool) -> Path:
    """Refuse a non-empty run directory unless `overwrite` (checked before any model loads)."""
    run_dir = Path(path)
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        raise ValueError(
            f"run directory {run_dir} already exists and is not empty; pass --overwrite or "
            "choose another --out"
        )
    return run_dir


def prepare_run_dir(path: str | Path, overwrite: bool, resolved: dict[str, Any]) -> Path:
    """Create the run directory and write its config.json; with `overwrite`, drop the previous
    run's metrics and result (its checkpoints stay until replaced)."""
    run_dir = check_run_dir(path, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (METRICS_FILE, RESULT_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(resolved, indent=2) + "\n")
    return run_dir
