"""`dflash-train bench gpu --json OUT`: the one-GPU check, one command, within its budget.

On one device, with random-weight targets of real shapes built from configs (no download):
1. the drafter step alone (`bench step --random-target SHAPE`, one process per configuration):
   supervised tokens/s, peak memory and MFU against the device's bf16 peak, for `--attention`
   flex and blockwise, without and with `--compile`, and what its warm-up (compiles) cost;
2. the full pipeline on the same device as target and drafter (`bench.gpu_pipeline`, in a
   process of its own);
3. the tests marked as needing CUDA (`pytest -m cuda`), as counts.

Every part runs in a child process with its own time limit, and its error or time-out is
recorded as that part's failure; the JSON file is rewritten as each part finishes, so a check
cut short still says what it measured. The limits are set by design to fit `--budget-s`: the
tests get a fixed share, and every other part, when it starts, gets its weight's share of the
time left (`WEIGHTS`: a compiling step row pays its compile, the pipeline its target and its
warm-up), so a part that runs long is stopped at its limit and never starves the parts after
it. Compile time is counted where it is paid (`warmup_s` of each step row, `warm_up_s` of the
pipeline) and paid once: every child (the tests too) shares one inductor cache, so a kernel
compiled by one part (flex's above all) is loaded, not compiled again, by the next that needs
it.

On a GPU the check passes only with every figure measured and the CUDA tests run and passed
(`passed`, and `problems` says what is missing); on CPU (`--device cpu --shapes tiny`, which
is how it is tested without a GPU) the CUDA tests cannot run and are not required.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from dflash_train.bench.common import add_json_argument, write_json
from dflash_train.bench.gpu_pipeline import DRAFT_LAYERS, NUM_FEATURES, run_pipeline
from dflash_train.bench.step import RANDOM_TARGETS
from dflash_train.devices import configure_allocator, parse_devices

WEIGHTS = {"step": 1.0, "step_flex": 2.0, "step_compiled": 3.0, "pipeline": 4.0}
"""Relative time of each part: its limit is its weight's share of the time left when it starts.
A flex row compiles flex's kernel (the first one cold), a --compile row the drafter's layers
too, the pipeline builds its target and warms up."""
TESTS_SHARE, TESTS_MIN_S = 0.3, 60.0
"""The CUDA tests' share of the budget (at least TESTS_MIN_S): their flex compiles are cold."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda:0", help="the device (default: cuda:0)")
    parser.add_argument(
        "--shapes", default="qwen3-1.7b,qwen3-8b", help="target shapes (default: %(default)s)"
    )
    parser.add_argument("--steps", type=int, default=200, help="pipeline optimizer steps")
    parser.add_argument("--seq-len", type=int, default=2048, help="longest sequence (tokens)")
    parser.add_argument("--batch-size", type=int, default=4, help="drafter batch size")
    parser.add_argument("--num-anchors", type=int, default=256, help="anchors per sequence")
    parser.add_argument("--budget-s", type=float, default=420.0, help="time for the whole check")
    parser.add_argument(
        "--skip-tests",
        action="store_true",
        help="do not run pytest -m cuda (on a GPU the check then cannot pass)",
    )
    parser.add_argument(
        "--skip-compile", action="store_true", help="measure the step without --compile only"
    )
    parser.add_argument(  # the pipeline part's child process
        "--part", choices=["all", "pipeline"], default="all", help=argparse.SUPPRESS
    )
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    configure_allocator()
    (device,) = parse_devices(args.device, "--device")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in RANDOM_TARGETS]
    if unknown or not shapes:
        raise ValueError(f"--shapes: unknown {unknown}; choose from {sorted(RANDOM_TARGETS)}")
    if args.part == "pipeline":  # the child process of part 2
        result = run_pipeline(args, shapes[0], device, time.monotonic() + args.budget_s)
        write_json(args.json, result)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        # One inductor cache for every child: a kernel is compiled once in the whole check.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        check = Check(args, device, env)
        check.run(shapes)
    return 0 if check.out["passed"] else 1


class Check:
    """The check's parts, their limits, and the JSON rewritten after each."""

    def __init__(self, args: argparse.Namespace, device: torch.device, env: dict) -> None:
        self.args, self.device, self.env = args, device, env
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        tests_s = 0.0 if args.skip_tests else max(TESTS_MIN_S, TESTS_SHARE * args.budget_s)
        self.parts_deadline = self.deadline - tests_s
        self.out: dict[str, Any] = {
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "budget_s": args.budget_s,
            "tests_limit_s": tests_s,
            "shapes": {},
        }

    def run(self, shapes: list[str]) -> None:
        units = [(shape, kind) for shape in shapes for kind in self._kinds()]
        left = [WEIGHTS[_weight_key(kind)] for _, kind in units]
        for i, (shape, kind) in enumerate(units):
            limit = self._share(left[i], sum(left[i:]))
            entry = self.out["shapes"].setdefault(shape, {"step": []})
            t0 = time.monotonic()
            if kind == "pipeline":
                entry["pipeline"] = self._pipeline(shape, limit)
                print(f"[gpu] {shape}: {json.dumps(entry['pipeline'])}", flush=True)
            else:
                attention, compiled = kind
                entry["step"].append(self._step(shape, attention, compiled, limit))
            entry["seconds"] = entry.get("seconds", 0.0) + time.monotonic() - t0
            self._write()
        if not self.args.skip_tests:
            limit = max(1.0, self.deadline - time.monotonic())
            self.out["cuda_tests"] = cuda_tests(limit, env=self.env)
        self.finish()

    def _kinds(self) -> list[Any]:
        kernels = ["flex", "blockwise"] if self.device.type == "cuda" else ["blockwise"]
        compiles = (False,) if self.args.skip_compile else (False, True)
        return [(a, c) for c in compiles for a in kernels] + ["pipeline"]

    def _share(self, weight: float, weights_left: float) -> float:
        left = max(0.0, self.parts_deadline - time.monotonic())
        return max(1.0, left * weight / weights_left)

    def _step(self, shape: str, attention: str, compiled: bool, limit: float) -> dict[str, Any]:
        row: dict[str, Any] = {"attention": attention, "compile": compiled, "limit_s": limit}
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "step.json"
            cmd = step_command(self.args, shape, self.device, attention, compiled, out)
            error = run_child(cmd, limit, self.env)
            if error is None and not out.is_file():
                error = "no result written"
            if error is not None:
                return {**row, "error": error}
            return {**row, **json.loads(out.read_text())}

    def _pipeline(self, shape: str, limit: float) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "pipeline.json"
            # The child stops its steps at 80% of its limit: the rest is for winding down.
            cmd = pipeline_command(self.args, shape, self.device, 0.8 * limit, out)
            error = run_child(cmd, limit, self.env)
            if error is None and not out.is_file():
                error = "no result written"
            if error is not None:
                return {"error": error, "limit_s": limit}
            return {**json.loads(out.read_text()), "limit_s": limit}

    def _write(self) -> None:
        self.out["seconds"] = time.monotonic() - self.t0
        if self.args.json:
            write_json(self.args.json, self.out)

    def finish(self) -> None:
        problems = verdict(self.out, self.device, self.args.skip_tests)
        self.out["passed"], self.out["problems"] = not problems, problems
        self._write()
        if self.args.json:
            print(f"wrote {self.args.json}")
        for p in problems:
            print(f"[gpu] problem: {p}", file=sys.stderr, flush=True)


def _weight_key(kind: Any) -> str:
    if kind == "pipeline":
        return "pipeline"
    attention, compiled = kind
    return "step_compiled" if compiled else "step_flex" if attention == "flex" else "step"


def verdict(out: dict[str, Any], device: torch.device, skipped_tests: bool) -> list[str]:
    """What keeps the check from passing: an error or missing figure in any part; on a GPU
    also CUDA tests that did not run, failed, or timed out."""
    problems = []
    for shape, entry in out["shapes"].items():
        for row in entry.get("step", []):
            name = f"{shape} step {row['attention']}{' --compile' if row['compile'] else ''}"
            if "error" in row or not row.get("tokens_per_s"):
                problems.append(f"{name}: {row.get('error', 'no figures')}")
        pipe = entry.get("pipeline")
        if pipe is None or "error" in pipe or not pipe.get("steps"):
            why = "not run" if pipe is None else pipe.get("error", "no steps")
            problems.append(f"{shape} pipeline: {why}")
    if device.type == "cuda":
        tests = out.get("cuda_tests")
        if skipped_tests or tests is None:
            problems.append("CUDA tests: not run (--skip-tests)")
        elif "error" in tests:
            problems.append(f"CUDA tests: {tests['error']}")
        elif tests.get("failed", 0) or not tests.get("passed", 0):
            problems.append(f"CUDA tests: {tests.get('summary', 'no summary')}")
    return problems


def step_command(args, shape: str, device, attention: str, compiled: bool, out: Path) -> list:
    cmd = [
        sys.executable, "-m", "dflash_train", "bench", "step", "--random-target", shape,
        "--device", str(device), "--attention", attention, "--draft-layers",
        str(DRAFT_LAYERS), "--num-target-features", str(NUM_FEATURES), "--batch-size",
        str(args.batch_size), "--seq-len", str(args.seq_len), "--num-anchors",
        str(args.num_anchors), "--warmup", "3" if compiled else "2", "--iters", "8",
        "--json", str(out),
    ]  # fmt: skip
    return [*cmd, "--compile"] if compiled else cmd


def pipeline_command(args, shape: str, device, budget_s: float, out: Path) -> list:
    return [
        sys.executable, "-m", "dflash_train", "bench", "gpu", "--part", "pipeline",
        "--shapes", shape, "--device", str(device), "--steps", str(args.steps), "--seq-len",
        str(args.seq_len), "--batch-size", str(args.batch_size), "--num-anchors",
        str(args.num_anchors), "--budget-s", f"{budget_s:.1f}", "--json", str(out),
    ]  # fmt: skip


def run_child(cmd: list[str], limit_s: float, env: dict | None = None) -> str | None:
    """Run `cmd` for at most `limit_s` seconds; None on success, else why not (one line)."""
    try:
        proc = _run(cmd, limit_s, env)
    except subprocess.TimeoutExpired:
        return f"timed out after {limit_s:.0f}s"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return f"exit {proc.returncode}: {tail[0]}"
    return None


def _run(cmd: list[str], limit_s: float, env: dict | None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, env=env)


# ----------------------------------------------------------------------------- 3. CUDA tests
def cuda_tests(budget_s: float, env: dict | None = None) -> dict[str, Any]:
    """`pytest -m cuda` from the checkout (the device machine runs in the repository root):
    counts, or an `error` (no tests directory, a time-out, no summary line)."""
    tests = Path.cwd() / "tests"
    if not tests.is_dir():
        return {"error": "no tests directory here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(tests), "-p", "no:cacheprovider"]
    try:
        proc = _run(cmd, budget_s, env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {budget_s:.0f}s"}
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    found = re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary)
    for number, key in found:
        counts["errors" if key.startswith("error") else key] += int(number)
    counts["failed"] += counts["errors"]
    out = {**counts, "summary": summary, "tail": proc.stdout[-3000:]}
    if not found:
        out["error"] = f"pytest exited {proc.returncode} without a summary: {summary[:200]}"
    return out
