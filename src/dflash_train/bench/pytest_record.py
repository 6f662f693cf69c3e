"""A pytest plugin for the GPU check: one JSON line per test phase, written as it happens.

Loaded with `-p dflash_train.bench.pytest_record`. `DFLASH_TEST_RECORD` names the file the
lines are appended to (flushed one by one, so a run killed at its time limit keeps every
result it had, and a `start` line with no result names the test that hung);
`DFLASH_TEST_SKIP` names a file of node ids (one per line) to deselect: the tests that passed
in an earlier run of the check."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

LONGREPR_CHARS = 6000
"""Characters of a failure's report kept per line (the check's log has the whole run)."""


def _append(line: dict[str, Any]) -> None:
    path = os.environ.get("DFLASH_TEST_RECORD")
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()


def pytest_collection_modifyitems(config, items) -> None:
    """Deselect the tests an earlier run recorded as passed."""
    path = os.environ.get("DFLASH_TEST_SKIP")
    if not path or not Path(path).is_file():
        return
    done = set(Path(path).read_text().split())
    kept = [item for item in items if item.nodeid not in done]
    deselected = [item for item in items if item.nodeid in done]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_runtest_logstart(nodeid, location) -> None:
    _append({"nodeid": nodeid, "when": "start"})


def pytest_runtest_logreport(report) -> None:
    """A line for the call phase, and for setup or teardown when they did not pass."""
    if report.when != "call" and report.passed:
        return
    line = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "duration_s": round(report.duration, 3),
    }
    if report.failed or report.skipped:
        line["longrepr"] = str(report.longrepr)[-LONGREPR_CHARS:]
    _append(line)
