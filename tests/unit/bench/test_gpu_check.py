"""The GPU check's budget logic on CPU (`bench.parts`, `bench.gpu`, `bench.pytest_record`):
real parts that hang, crash and leave children behind, each in its own process group; a
time-out is decided by a stand-in for the wait, never by sleeping (the hung part is declared
timed out once it has started its child). Its real run on CPU is in
`tests/integration/test_bench_cli.py` (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from dflash_train.bench import gpu, gpu_expect, gpu_pipeline, parts
from dflash_train.bench.parts import Part, PartRunner

PY = sys.executable
MAX_FILES = 8


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return [PY, str(path)]


def spawn_child(pid_file: Path) -> str:
    """Python lines that start a sleeping grandchild (in the part's process group), write its
    pid to `pid_file`, then create `pid_file`.ready (the hung part's time-out marker)."""
    return f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open({str(pid_file)!r}, "w").write(str(child.pid))
    open({str(pid_file)!r} + ".ready", "w").close()
    """


def gone(pid: int) -> bool:
    """Whether `pid` no longer runs (gone, or a zombie awaiting its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


class TimesOutWhen:
    """Stands in for the wait: a part is timed out as soon as the marker file exists (the
    marker is then removed), every other part waited for normally (bounded)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __call__(self, proc: subprocess.Popen, limit_s: float) -> int:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            code = proc.poll()
            if code is not None:
                return code
            if self.marker.exists():
                self.marker.unlink()
                raise subprocess.TimeoutExpired(proc.args, limit_s)
            time.sleep(0.02)
        raise AssertionError("a fake part neither exited nor marked itself hung in 60 s")


@pytest.fixture
def fake_parts(tmp_path):
    hung_child, left_child = tmp_path / "hung_child.pid", tmp_path / "left_child.pid"
    hung_ready = tmp_path / "hung_child.pid.ready"
    figures = tmp_path / "ok.json"
    ok = script(tmp_path, "ok", f"""
        import json
        print("measuring")
        json.dump({{"tokens_per_s": 123.0}}, open({str(figures)!r}, "w"))
    """)  # fmt: skip
    crash = script(tmp_path, "crash", """
        for i in range(200):
            print(f"line {i} of a long compile log")
        raise RuntimeError("boom in the kernel")
    """)  # fmt: skip
    hang = script(tmp_path, "hang", """
    print("compiling forever", flush=True)
    """ + spawn_child(hung_child) + """
    time.sleep(600)
    """)  # fmt: skip
    leaves = script(tmp_path, "leaves", spawn_child(left_child) + """
    print("done, but my worker still runs")
    """)  # fmt: skip
    return {
        "parts": [
            Part("ok", ok, 60, figures=figures),
            Part("crash", crash, 60),
            Part("hang", hang, 60),
            Part("leaves", leaves, 60),
            Part("after", [PY, "-c", "print('still ran')"], 60),
        ],
        "hung_child": hung_child,
        "hung_ready": hung_ready,
        "left_child": left_child,
    }


def test_hung_crashed_and_leaky_parts_are_killed_reported_and_the_rest_still_runs(
    tmp_path, fake_parts
):
    out = tmp_path / "results"
    runner = PartRunner(out, 600, wait=TimesOutWhen(fake_parts["hung_ready"]))
    for part in fake_parts["parts"]:
        runner.run(part)
    summary = json.loads((out / "summary.json").read_text())["parts"]
    assert {k: v["status"] for k, v in summary.items()} == {
        "ok": "passed", "crash": "failed", "hang": "timed_out", "leaves": "passed",
        "after": "passed",
    }  # fmt: skip
    assert summary["ok"]["figures"] == {"tokens_per_s": 123.0}
    # The hung part and its child: both killed, both named.
    hung = int(fake_parts["hung_child"].read_text())
    killed = {k["pid"] for k in summary["hang"]["killed"]}
    assert hung in killed and len(killed) == 2 and gone(hung)
    # A part that exited with its worker still running: the worker is killed and named.
    left = int(fake_parts["left_child"].read_text())
    assert [k["pid"] for k in summary["leaves"]["killed"]] == [left] and gone(left)
    # The crash keeps its whole output: the log has every line, the summary the last ones.
    log = (out / "output.log").read_text()
    assert "line 0 of a long compile log" in log and "RuntimeError: boom in the kernel" in log
    assert summary["crash"]["reason"] == "exit 1"
    assert summary["crash"]["tail"][-1] == "RuntimeError: boom in the kernel"
    assert "compiling forever" in "\n".join(summary["hang"]["tail"])
    assert len(list(out.iterdir())) <= MAX_FILES


def test_a_rerun_on_the_same_folder_skips_what_passed_and_retries_the_rest(tmp_path, fake_parts):
    out = tmp_path / "results"
    first = PartRunner(out, 600, wait=TimesOutWhen(fake_parts["hung_ready"]))
    for part in fake_parts["parts"]:
        first.run(part)
    started = []

    def wait(proc, limit_s):
        started.append(proc.args[-1])
        return proc.wait(timeout=60)

    fixed = [Part("crash", [PY, "-c", "print('fixed')"], 60), Part("hang", [PY, "-c", ""], 60)]
    second = PartRunner(out, 600, wait=wait)
    for part in [fake_parts["parts"][0], *fixed, *fake_parts["parts"][3:]]:
        second.run(part)
    assert started == ["print('fixed')", ""]  # only what had not passed ran again
    summary = json.loads((out / "summary.json").read_text())["parts"]
    assert all(r["status"] == "passed" for r in summary.values())
    assert summary["crash"]["runs"] == 2 and summary["ok"]["runs"] == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limits_are_capped_by_the_budget_and_a_part_without_its_minimum_is_not_started(
    tmp_path, monkeypatch
):
    clock, ran = FakeClock(), []

    def run_group(cmd, limit_s, log_path, env, clock_, wait):
        took = min(limit_s, float(cmd[1]))  # cmd = [name, seconds it would take]
        clock.now += took
        ran.append((cmd[0], limit_s))
        timed_out = took >= limit_s
        return parts.Outcome(None if timed_out else 0, timed_out, took)

    monkeypatch.setattr(parts, "run_group", run_group)
    runner = PartRunner(tmp_path / "r", 300, clock=clock)
    plan = [("a", 100, 10, 50), ("b", 150, 30, 400), ("c", 120, 40, 10), ("d", 60, 20, 5)]
    for name, limit, least, takes in plan:
        runner.run(Part(name, [name, str(takes)], limit, least))
    # a: 50 s; b: its 150 s limit, then timed out (100 s left); c: 100 s of its 120 (the
    # budget), done in 10; d: 90 s left >= its 20 s minimum, limit 60.
    assert ran == [("a", 100), ("b", 150), ("c", 100), ("d", 60)]
    assert clock.now <= 1000 + 300
    runner2 = PartRunner(tmp_path / "r2", 100, clock=clock)
    runner2.run(Part("big", ["big", "5"], 120, min_s=0))
    record = runner2.run(Part("late", ["late", "5"], 60, min_s=200))
    assert record["status"] == "skipped" and "needs 200s" in record["reason"]


# ----------------------------------------------------------------------------- tests record
TESTS = """
import pathlib, time, pytest

def test_good():
    assert True

def test_bad():
    assert 1 == 2

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_hangs():
    pathlib.Path({marker!r}).write_text("started")
    time.sleep(600)
"""


def test_per_test_results_survive_a_killed_run_and_a_rerun_runs_only_what_did_not_pass(tmp_path):
    marker = tmp_path / "hanging"
    (tmp_path / "test_fake.py").write_text(TESTS.format(marker=str(marker)))
    record, skip = tmp_path / "tests.jsonl", tmp_path / "skip.txt"
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(gpu.__file__).parents[2]),
        "DFLASH_TEST_RECORD": str(record),
        "DFLASH_TEST_SKIP": str(skip),
    }
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
           "dflash_train.bench.pytest_record", "-o", "addopts=", str(tmp_path)]  # fmt: skip
    outcome = parts.run_group(cmd, 60, tmp_path / "log", env, wait=TimesOutWhen(marker))
    assert outcome.timed_out
    by_id = gpu.tests_by_id(record)
    short = {k.split("::")[-1]: v for k, v in by_id.items()}
    assert short == {
        "test_good": "passed", "test_bad": "failed", "test_skipped": "skipped",
        "test_hangs": "hung",
    }  # fmt: skip
    counts = gpu.test_counts(record)
    assert counts["hung"] == [n for n in by_id if n.endswith("test_hangs")]
    assert "assert 1 == 2" in record.read_text()  # the failure's report is kept
    # The rerun deselects what passed: test_good does not run again.
    skip.write_text("\n".join(gpu.tests_passed(record)))
    parts.run_group(cmd, 60, tmp_path / "log", env, wait=TimesOutWhen(marker))
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    starts = [x["nodeid"] for x in lines if x["when"] == "start"]
    assert sum(n.endswith("test_good") for n in starts) == 1  # its first run only
    assert sum(n.endswith("test_bad") for n in starts) >= 2


# ----------------------------------------------------------------------------- the check
def test_the_check_runs_its_parts_in_order_each_with_its_limit_in_a_shared_compile_cache(
    tmp_path, monkeypatch
):
    seen = []

    def run(self, part):
        seen.append(part)
        return self.record(part.name, {"status": "passed", "seconds": 1.0})

    monkeypatch.setattr(PartRunner, "run", run)
    argv = ["--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--install"]
    rc = gpu_main(argv)
    assert rc == 0
    assert [p.name for p in seen] == [
        "install", "device", "step_flex", "cuda_tests", "pipeline", "step_blockwise",
        "step_compile",
    ]  # fmt: skip
    assert all(p.limit_s == gpu.LIMITS[p.name][0] for p in seen)
    assert sum(gpu.LIMITS[n][1] for n in gpu.LIMITS) <= gpu.BUDGET_S  # every part can start
    caches = {p.env["TORCHINDUCTOR_CACHE_DIR"] for p in seen}
    assert caches == {str(tmp_path / "cache" / "inductor")}
    tests = next(p for p in seen if p.name == "cuda_tests")
    assert tests.cmd[-1].endswith(os.path.join("tests", "cuda"))  # nothing else collected
    files = list((tmp_path / "out").iterdir())
    assert {f.name for f in files} == {"summary.json", "figures.md"}


def test_on_a_gpu_a_part_not_run_fails_the_check_and_out_of_range_figures_are_flagged():
    names = ["device", "step_flex"]
    problems = gpu.verdict({"device": {"status": "passed"}}, names, None, cuda=True)
    assert problems == ["step_flex: not run"]
    assert gpu.verdict({"device": {"status": "passed"}}, names, {"device"}, cuda=True) == []
    records = {"step_flex": {"seconds": 50.0, "figures": {"step_s": 2.5, "tokens_per_s": 2e4}}}
    flags = gpu_expect.out_of_range(records, gpu_expect.EXPECTED_H200)
    assert flags == ["step_flex.step_s = 2.5 (HIGH, expected 0.4-1 s)"]
    text = gpu_expect.render({"parts": records, "gpu": "NVIDIA H200"}, gpu_expect.EXPECTED_H200)
    assert "| step_s | 2.5 | 0.4-1 s | HIGH |" in text


def gpu_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    gpu.add_arguments(parser)
    return gpu.main(parser.parse_args(argv))


def test_the_sync_counter_counts_sync_warnings_and_gives_the_filters_back():
    before = list(warnings.filters)
    with gpu_pipeline.SyncCounter() as syncs:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert syncs.count == 2
    assert warnings.filters == before
