"""The parts of a timed check, each in its own process group, results on disk as they come.

A `Part` is a command with its own time limit, sized for its slowest honest run (a cold
compile). `PartRunner` runs the parts in order under one budget:

- a part starts only when at least its `min_s` is left of the budget, and runs for at most
  its `limit_s` or what is left, whichever is less, so the check never outlives its budget;
- every part runs in a new session (its own process group) with its output appended to the
  check's log file as it comes (nothing held in a pipe, so a killed part's output is all
  there); when it times out the whole group gets SIGTERM, then SIGKILL after `GRACE_S`, and
  after a normal exit any process still in the group (a child left behind, such as a
  `--worker` still compiling) is killed the same way; either way the processes killed are
  named in the part's record;
- after every part the summary (`summary.json`) is rewritten atomically: each part's status
  (`passed`, `failed`, `timed_out`, `skipped`), seconds, limit, exit code, the last lines of
  its output (all of it is in the log) and the figures it wrote (a JSON file);
- a rerun on the same folder reads the summary first and skips the parts that passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL for a part's process group."""
TAIL_LINES = 60
"""Lines of a part's output kept in the summary (the log keeps all of it)."""


@dataclass
class Part:
    """One command of the check.

    name: its key in the summary. cmd: the command (argv). limit_s: its own time limit,
    sized for a cold compile. min_s: the least time worth starting it with. figures: the JSON
    file the command writes its figures to (None: it writes none). judge: figures -> what is
    wrong with them (empty: the part passed), called only after a clean exit.
    """

    name: str
    cmd: list[str]
    limit_s: float
    min_s: float = 1.0
    figures: Path | None = None
    judge: Callable[[dict[str, Any]], list[str]] | None = None
    env: dict[str, str] | None = None


@dataclass
class Outcome:
    """How one run of a part's process group ended."""

    returncode: int | None
    timed_out: bool
    seconds: float
    killed: list[dict[str, Any]] = field(default_factory=list)


def wait_for_exit(proc: subprocess.Popen, limit_s: float) -> int:
    """The exit status of `proc`, or `subprocess.TimeoutExpired` after `limit_s`."""
    return proc.wait(timeout=max(0.0, limit_s))


class PartRunner:
    """Runs parts under one budget into a results folder (see the module docstring)."""

    def __init__(
        self,
        out: Path,
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[subprocess.Popen, float], int] = wait_for_exit,
    ) -> None:
        self.out, self.wait = out, wait
        self.out.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.deadline = clock() + budget_s
        self.log_path = out / "output.log"
        self.summary_path = out / "summary.json"
        self.summary: dict[str, Any] = _read_json(self.summary_path) or {}
        self.summary.setdefault("parts", {})

    def passed(self, name: str) -> bool:
        """Whether `name` passed in this run or an earlier one on this folder."""
        return self.summary["parts"].get(name, {}).get("status") == "passed"

    def run(self, part: Part) -> dict[str, Any]:
        """Run `part` (unless it passed before) and record it; its record."""
        parts = self.summary["parts"]
        if self.passed(part.name):
            return parts[part.name]
        runs = parts.get(part.name, {}).get("runs", 0) + 1
        left = self.deadline - self.clock()
        if left < part.min_s:
            why = f"not started: {max(0.0, left):.0f}s of the budget left, needs {part.min_s:.0f}s"
            return self.record(part.name, {"status": "skipped", "reason": why, "runs": runs - 1})
        limit = min(part.limit_s, left)
        if part.figures is not None:
            part.figures.unlink(missing_ok=True)
        start = self._log_offset()
        self._log(f"\n===== part {part.name}: limit {limit:.0f}s: {' '.join(part.cmd)}\n")
        outcome = run_group(part.cmd, limit, self.log_path, part.env, self.clock, self.wait)
        record = self._judge(part, outcome, limit)
        record.update(runs=runs, tail=self._tail(start) if record["status"] != "passed" else [])
        self._log(f"===== part {part.name}: {record['status']} after {outcome.seconds:.1f}s\n")
        return self.record(part.name, record)

    def record(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        """Store `record` as `name`'s and rewrite the summary."""
        self.summary["parts"][name] = record
        self.write()
        return record

    def write(self) -> None:
        """The summary, replaced atomically (a reader never sees half a file)."""
        write_json_atomic(self.summary_path, self.summary)

    def _judge(self, part: Part, outcome: Outcome, limit: float) -> dict[str, Any]:
        record: dict[str, Any] = {
            "limit_s": round(limit, 1),
            "seconds": round(outcome.seconds, 1),
            "exit": outcome.returncode,
            "killed": outcome.killed,
        }
        figures = _read_json(part.figures) if part.figures is not None else None
        if figures is not None:
            record["figures"] = figures
        if outcome.timed_out:
            return {**record, "status": "timed_out", "reason": f"timed out after {limit:.0f}s"}
        if outcome.returncode != 0:
            said = (figures or {}).get("error")
            why = f"exit {outcome.returncode}" + (f": {said}" if said else "")
            return {**record, "status": "failed", "reason": why}
        if part.figures is not None and figures is None:
            return {**record, "status": "failed", "reason": "no figures written"}
        problems = part.judge(figures or {}) if part.judge is not None else []
        if problems:
            return {**record, "status": "failed", "reason": "; ".join(problems)}
        return {**record, "status": "passed"}

    def _log(self, text: str) -> None:
        with self.log_path.open("a") as f:
            f.write(text)

    def _log_offset(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def _tail(self, offset: int) -> list[str]:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
        return text.splitlines()[-TAIL_LINES:]


def run_group(
    cmd: list[str],
    limit_s: float,
    log_path: Path,
    env: dict[str, str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[subprocess.Popen, float], int] = wait_for_exit,
) -> Outcome:
    """Run `cmd` in its own process group for at most `limit_s` (`wait`), its output appended
    to `log_path`; the group is killed when it times out and whatever of it outlives its
    leader is killed too."""
    t0 = clock()
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip
        try:
            returncode: int | None = wait(proc, limit_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
        except BaseException:  # Ctrl-C or an error here: take the part down with us
            kill_group(proc.pid)
            raise
        killed = kill_group(proc.pid)
        if timed_out:
            try:
                returncode = proc.wait(timeout=GRACE_S + 5.0)  # the group was just killed
            except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): said as None
                returncode = None
    return Outcome(returncode, timed_out, clock() - t0, killed)


def kill_group(pgid: int) -> list[dict[str, Any]]:
    """SIGTERM to every process of group `pgid`, SIGKILL to those left after `GRACE_S`; the
    processes that were still there (pid, command line), empty when the group was gone."""
    members = group_members(pgid)
    if not _signal_group(pgid, signal.SIGTERM):
        return members
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end and _alive(pgid):
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)
    return members


def group_members(pgid: int) -> list[dict[str, Any]]:
    """The live processes of group `pgid` (Linux /proc; empty elsewhere), zombies left out."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            state, _ppid, group = text.rsplit(")", 1)[1].split()[:3]
            if int(group) != pgid or state == "Z":
                continue
            raw = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone while we looked
        cmdline = raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()
        found.append({"pid": int(stat.parent.name), "cmd": cmdline[:300]})
    return sorted(found, key=lambda m: m["pid"])


def _alive(pgid: int) -> bool:
    return any(True for _ in group_members(pgid))


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _read_json(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def write_json_atomic(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, written to a temporary file and renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str) + "\n")
    os.replace(tmp, path)
