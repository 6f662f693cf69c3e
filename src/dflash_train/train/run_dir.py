"""The run directory: refused when it holds another run (unless --overwrite, or --resume to
continue it), created with the resolved config, and reused by a resumed run."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dflash_train.metrics.logger import METRICS_FILE
from dflash_train.metrics.runlog import CONFIG_FILE
from dflash_train.model.checkpoint import FINAL_CHECKPOINT
from dflash_train.train.checkpoint import CHECKPOINTS_DIR, list_checkpoints

RESULT_FILE = "result.json"


def check_run_dir(path: str | Path, overwrite: bool) -> Path:
    """Refuse a non-empty run directory unless `overwrite`, and one that cannot be written
    (checked before any model loads; nothing is left behind)."""
    run_dir = Path(path)
    _check_writable(run_dir)
    if overwrite and _foreign_config(run_dir):
        # --overwrite writes the run's config.json: given a model's directory (the target's),
        # the model's was replaced.
        raise ValueError(
            f"{run_dir} holds a {CONFIG_FILE} that is not a training run's (a model's?); choose "
            "another --out (--overwrite replaces only an earlier run)"
        )
    if run_dir.exists() and any(run_dir.iterdir()) and not overwrite:
        found = list_checkpoints(run_dir)
        if found:
            raise ValueError(
                f"run directory {run_dir} holds checkpoints (newest: {found[0].name}); continue "
                f"it with `dflash-train train --resume {run_dir}`, or pass --overwrite to start "
                "over (its checkpoints are deleted)"
            )
        raise ValueError(
            f"run directory {run_dir} already exists and is not empty; pass --overwrite or "
            "choose another --out"
        )
    return run_dir


def _foreign_config(run_dir: Path) -> bool:
    """Whether `run_dir` holds a config.json that `train` did not write (its sections)."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return True
    return not (isinstance(config, dict) and {"model", "run"} <= config.keys())


def _check_writable(run_dir: Path) -> None:
    """Create (then remove) the directory or a probe file in it: the only reliable test of a
    read-only mount, a parent that is a file, or missing permissions."""
    try:
        if run_dir.is_dir():
            probe = run_dir / ".dflash-write-probe"
            probe.write_bytes(b"")
            probe.unlink()
            return
        missing = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
        run_dir.mkdir(parents=True)
        for p in missing:  # innermost first: leave the file system as it was
            p.rmdir()
    except OSError as e:
        raise ValueError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from None


def prepare_run_dir(path: str | Path, overwrite: bool, written: dict[str, Any]) -> Path:
    """Create the run directory and write its config.json; with `overwrite`, first delete the
    previous run's metrics, result and checkpoints (a resume must never mix two runs)."""
    run_dir = check_run_dir(path, overwrite)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (METRICS_FILE, RESULT_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    link = run_dir / FINAL_CHECKPOINT
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link)
    shutil.rmtree(run_dir / CHECKPOINTS_DIR, ignore_errors=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(written, indent=2) + "\n")
    return run_dir


def resume_run_dir(run_dir: Path, written: dict[str, Any]) -> Path:
    """A resumed run keeps its metrics (appended to) and checkpoints; its config.json is the
    config it now continues with."""
    (run_dir / CONFIG_FILE).write_text(json.dumps(written, indent=2) + "\n")
    return run_dir


def lock_run_dir(run_dir: Path) -> int | None:
    """Hold `run_dir` for this process (an exclusive flock on the directory itself, released
    when the returned descriptor closes or the process ends); None when it does not exist yet.
    A second trainer on it (a `--resume` of a run still training, an `--overwrite` of it)
    is refused: both would write checkpoints and metrics into it, and one would delete the
    other's."""
    if not run_dir.is_dir():
        return None
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ValueError(
            f"run directory {run_dir} is in use by another training process; wait for it to "
            "end (or stop it), or choose another --out"
        ) from None
    return fd
