"""`bench gpu`'s own logic on CPU, with its child processes and the clock stood in for: each
part's time limit, errors and time-outs as failures, the JSON written as parts finish, and on a
GPU no success without the CUDA tests and every figure (its real run on tiny shapes is in
`tests/integration/test_bench_cli.py`)."""

from __future__ import annotations

import json
import subprocess
import warnings

import pytest
import torch

from dflash_train.bench import gpu, gpu_pipeline
from dflash_train.cli import main

GPU = torch.device("cuda", 0)


class Children:
    """Stands in for `gpu._run`: the fake clock moves by what each child takes (`took`, by
    kind, default 1 s); `fail` makes a kind exit 1 or time out; every call is recorded."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.took: dict[str, float] = {}
        self.fail: dict[str, str] = {}
        self.calls: list[tuple[str, float, dict | None]] = []
        self.ends: list[float] = []  # the latest each child could have ended: start + limit
        self.on_pipeline = None

    def __call__(self, cmd, limit_s, env):
        kind = self.kind(cmd)
        self.calls.append((kind, limit_s, env))
        self.ends.append(self.clock[0] + limit_s)
        took = self.took.get(kind, 1.0)
        if self.fail.get(kind) == "timeout" or took > limit_s:
            self.clock[0] += limit_s
            raise subprocess.TimeoutExpired(cmd, limit_s)
        self.clock[0] += took
        if self.fail.get(kind) == "exit":
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nRuntimeError: boom")
        if kind == "tests":
            return subprocess.CompletedProcess(cmd, 0, "...\n11 passed in 40.0s\n", "")
        out = cmd[cmd.index("--json") + 1]
        if kind == "pipeline":
            if self.on_pipeline is not None:
                self.on_pipeline()
            result = {"steps": 12, "target_tokens_per_s": 1e5}
        else:
            result = {"tokens_per_s": 5e4, "step_s": 0.2, "warmup_s": 9.0}
        with open(out, "w") as f:
            json.dump(result, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    @staticmethod
    def kind(cmd) -> str:
        if "pytest" in cmd:
            return "tests"
        if "--part" in cmd:
            return "pipeline"
        attention = cmd[cmd.index("--attention") + 1]
        return f"step-{attention}" + ("-compiled" if "--compile" in cmd else "")


@pytest.fixture
def children(monkeypatch, tmp_path):
    clock = [1000.0]
    fake = Children(clock)
    monkeypatch.setattr(gpu, "_run", fake)
    monkeypatch.setattr(gpu.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gpu, "parse_devices", lambda spec, what: [GPU])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    (tmp_path / "tests").mkdir()
    monkeypatch.chdir(tmp_path)  # where the CUDA tests are looked for
    return fake


def check(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "gpu.json"
    rc = main(["bench", "gpu", "--shapes", "tiny", "--budget-s", "420", "--json", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_a_full_check_passes_within_its_budget_and_shares_one_compile_cache(children, tmp_path):
    rc, out = check(tmp_path)
    assert rc == 0 and out["passed"] and out["problems"] == []
    assert [k for k, *_ in children.calls] == [
        "step-flex", "step-blockwise", "step-flex-compiled", "step-blockwise-compiled",
        "pipeline", "tests",
    ]  # fmt: skip
    assert max(children.ends) <= 1000.0 + 420 + 1e-6  # no part could run past the budget
    caches = {env["TORCHINDUCTOR_CACHE_DIR"] for _, _, env in children.calls}
    assert len(caches) == 1  # every part compiles into (and loads from) one cache


def test_a_part_that_runs_long_is_stopped_at_its_limit_and_the_others_still_run(children, tmp_path):
    # A cold flex compile that would take ten minutes: its row times out at its own limit, and
    # every later row, the pipeline and the tests still get their time.
    children.took["step-flex-compiled"] = 600.0
    rc, out = check(tmp_path)
    assert rc == 1 and not out["passed"]
    rows = out["shapes"]["tiny"]["step"]
    assert [("error" in r) for r in rows] == [False, False, True, False]
    assert "timed out" in rows[2]["error"]
    assert out["shapes"]["tiny"]["pipeline"]["steps"] == 12
    assert out["cuda_tests"]["passed"] == 11
    assert any("step flex --compile" in p and "timed out" in p for p in out["problems"])
    assert max(children.ends) <= 1000.0 + 420 + 1e-6


def test_an_error_in_the_pipeline_part_keeps_every_other_figure(children, tmp_path):
    children.fail["pipeline"] = "exit"
    rc, out = check(tmp_path)
    assert rc == 1
    assert "RuntimeError: boom" in out["shapes"]["tiny"]["pipeline"]["error"]
    assert len(out["shapes"]["tiny"]["step"]) == 4 and out["cuda_tests"]["passed"] == 11


def test_the_json_is_written_as_each_part_finishes(children, tmp_path):
    seen = {}

    def look():
        seen.update(json.loads((tmp_path / "gpu.json").read_text()))

    children.on_pipeline = look
    check(tmp_path)
    assert len(seen["shapes"]["tiny"]["step"]) == 4  # on disk before the pipeline part ended


@pytest.mark.parametrize("how", ["timeout", "exit"])
def test_cuda_tests_that_time_out_or_give_no_summary_fail_the_check(children, tmp_path, how):
    children.fail["tests"] = how
    rc, out = check(tmp_path)
    assert rc == 1 and "error" in out["cuda_tests"]
    assert any(p.startswith("CUDA tests:") for p in out["problems"])


def test_on_a_gpu_the_check_cannot_pass_without_its_tests(children, tmp_path):
    rc, out = check(tmp_path, "--skip-tests")
    assert rc == 1 and out["problems"] == ["CUDA tests: not run (--skip-tests)"]


def test_the_sync_counter_counts_sync_warnings_and_gives_the_filters_back():
    before = list(warnings.filters)
    with gpu_pipeline.SyncCounter() as syncs:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    assert syncs.count == 2
    assert warnings.filters == before
