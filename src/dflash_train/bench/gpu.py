"""`dflash-train bench gpu --out DIR`: the one-GPU check (`scripts/gpu_check.py` runs it first
on a GPU machine, after installing the package without network).

Parts, in this order, each a command of its own (`bench.parts`: its own process group and
time limit, killed with its children on time-out, its whole output in the log):

1. `install` (only from the script): `pip install --no-deps --no-build-isolation --no-index
   -e .` and any carried wheels; the children find the package on PYTHONPATH either way;
2. `device`: versions against the declared range, the GPU, and its measured peaks (bf16
   8K matmul, device copy, pinned and pageable host-to-device copies);
3. `step_flex`: the drafter step (`bench step --random-target SHAPE`) with flex attention:
   tokens/s, step seconds, MFU, peak memory, the warm-up's compile seconds; the first part
   that compiles, so it fills the inductor cache the later ones load from;
4. `cuda_tests`: pytest on `tests/cuda` only, one JSON line per test as it finishes
   (`tests.jsonl`, `bench.pytest_record`), so a time-out keeps every result and names the
   test that hung; a rerun runs only the tests that did not pass;
5. `pipeline`: the full pipeline on the one device as target and drafter (`bench.gpu_pipeline`);
6. `step_blockwise` and 7. `step_compile` (flex with `--compile`).

Results, at most 8 files under `--out`, rewritten as each part finishes: `summary.json`
(every part's status, limit, seconds, figures, the last lines of a failed part's output,
the processes killed), `output.log` (every part's whole output), `tests.jsonl` and
`figures.md` (each figure against its expected range, `bench.gpu_expect`). A rerun on the
same folder skips the parts that passed. Compiles are paid once: every part shares one
inductor and Triton cache on local disk (`--cache-dir`, kept between runs on one machine).
On CPU (`--device cpu --shapes tiny`, how the check is tested) flex and the CUDA tests'
kernels cannot run; the tests are collected and skipped, and the step rows are blockwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from dflash_train.bench import gpu_expect
from dflash_train.bench.common import write_json
from dflash_train.bench.parts import Part, PartRunner

ROOT = Path(__file__).resolve().parents[3]
"""The checkout (the device machine runs the check in the repository root)."""
LIMITS: dict[str, tuple[float, float]] = {
    "install": (90, 10),
    "device": (60, 10),
    "step_flex": (150, 60),
    "cuda_tests": (180, 45),
    "pipeline": (180, 80),
    "step_blockwise": (90, 30),
    "step_compile": (180, 90),
}
"""part -> (its time limit, sized for a cold compile; the least time worth starting it with).
The parts run in this order, each for at most its limit or what is left of `--budget-s`."""
BUDGET_S = 450.0
"""8 minutes of wall time for the whole check, less the parent's start and the last write."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="gpu-check", help="results folder (default: %(default)s)")
    parser.add_argument("--device", default="cuda:0", help="the device (default: cuda:0)")
    parser.add_argument(
        "--shapes", default="qwen3-8b", help="target shape of the step rows and the pipeline"
    )
    parser.add_argument("--steps", type=int, default=40, help="pipeline optimizer steps")
    parser.add_argument("--seq-len", type=int, default=2048, help="longest sequence (tokens)")
    parser.add_argument("--batch-size", type=int, default=4, help="drafter batch size")
    parser.add_argument("--num-anchors", type=int, default=256, help="anchors per sequence")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="wall time of the check")
    parser.add_argument("--install", action="store_true", help="install the package first")
    parser.add_argument("--wheels", default=None, help="a folder of carried wheels to install")
    parser.add_argument("--skip-compile", action="store_true", help="no --compile step row")
    parser.add_argument(
        "--only", default=None, help="comma-separated parts to run (default: all of them)"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="inductor and Triton caches and the parts' scratch files (default: "
        ".gpu-check-cache in the source checkout)",
    )
    # A child's own mode (`device` or `pipeline`) and where it writes its figures.
    parser.add_argument("--part", choices=["check", "device", "pipeline"], default="check",
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    from dflash_train.bench.step import RANDOM_TARGETS

    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if len(shapes) != 1 or shapes[0] not in RANDOM_TARGETS:
        raise ValueError(f"--shapes: one of {sorted(RANDOM_TARGETS)}, got {args.shapes!r}")
    if args.part == "device":
        write_json(args.json, measure_device(args.device))
        return 0
    if args.part == "pipeline":
        return _pipeline_child(args, shapes[0])
    return run_check(args, shapes[0])


def run_check(args: argparse.Namespace, shape: str) -> int:
    """Every part in order under the budget; 0 when all passed."""
    t0 = time.monotonic()
    out, cache = Path(args.out), Path(args.cache_dir or ROOT / ".gpu-check-cache")
    (cache / "scratch").mkdir(parents=True, exist_ok=True)
    runner = PartRunner(out, args.budget_s)
    cuda = args.device.startswith("cuda")
    runner.summary.update(
        device=args.device, shape=shape, budget_s=args.budget_s, started=time.time()
    )
    parts = check_parts(args, shape, out, cache, child_env(cache))
    only = set(args.only.split(",")) if args.only else None
    for part in parts:
        if only is None or part.name in only:
            runner.run(part)
            _after_part(runner, part.name, args, shape)
    problems = verdict(runner.summary["parts"], [p.name for p in parts], only, cuda)
    runner.summary.update(passed=not problems, problems=problems)
    runner.summary["seconds"] = time.monotonic() - t0
    _finish(runner, args, shape)
    for p in problems:
        print(f"[gpu-check] problem: {p}", file=sys.stderr, flush=True)
    print(f"[gpu-check] {'passed' if not problems else 'FAILED'}; results in {out}", flush=True)
    return 0 if not problems else 1


def check_parts(args, shape: str, out: Path, cache: Path, env: dict) -> list[Part]:
    """The check's parts, in order (`LIMITS`), for `args.device`."""
    py, scratch = sys.executable, cache / "scratch"
    cuda = args.device.startswith("cuda")

    def part(name: str, cmd: list[str], **kw: Any) -> Part:
        limit, least = LIMITS[name]
        return Part(name, cmd, limit, least, env=env, **kw)

    parts = []
    if args.install:
        parts.append(part("install", install_command(py, args.wheels)))
    device_json = scratch / "device.json"
    cmd = [py, "-m", "dflash_train", "bench", "gpu", "--part", "device", "--device", args.device]
    parts.append(part("device", [*cmd, "--json", str(device_json)], figures=device_json))
    kinds = [("flex", False)] if cuda else []
    kinds += [("blockwise", False)]
    if not args.skip_compile:
        kinds.append(("flex" if cuda else "blockwise", True))
    steps = {f"step_{'compile' if c else a}": (a, c) for a, c in kinds}
    for name, (attention, compiled) in steps.items():
        result = scratch / f"{name}.json"
        cmd = step_command(args, shape, attention, compiled, result)
        parts.append(part(name, cmd, figures=result, judge=_judge_step))
    tests = tests_part(py, out, scratch, env, cuda)
    pipe_json = scratch / "pipeline.json"
    pipeline = part("pipeline", pipeline_command(args, shape, pipe_json), figures=pipe_json,
                    judge=_judge_pipeline)  # fmt: skip
    order = ["install", "device", "step_flex", "cuda_tests", "pipeline", "step_blockwise"]
    by_name = {p.name: p for p in [*parts, tests, pipeline]}
    return [by_name[n] for n in [*order, "step_compile"] if n in by_name]


def install_command(py: str, wheels: str | None) -> list[str]:
    """The package from this checkout, no dependencies and no network (the GPU image has
    them; `--wheels` adds carried ones)."""
    cmd = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    carried = sorted(str(w) for w in Path(wheels).glob("*.whl")) if wheels else []
    return [*cmd, *carried, "-e", str(ROOT)]


def child_env(cache: Path) -> dict[str, str]:
    """Every part's environment: the package from this checkout, unbuffered output, and one
    inductor and Triton cache on local disk for all of them."""
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": src if not path else f"{src}{os.pathsep}{path}",
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }


def step_command(args, shape: str, attention: str, compiled: bool, out: Path) -> list[str]:
    """`bench step` on the pipeline part's drafter shape."""
    from dflash_train.bench.gpu_pipeline import DRAFT_LAYERS, NUM_FEATURES

    cmd = [
        sys.executable, "-m", "dflash_train", "bench", "step", "--random-target", shape,
        "--device", args.device, "--attention", attention, "--draft-layers", str(DRAFT_LAYERS),
        "--num-target-features", str(NUM_FEATURES), "--batch-size", str(args.batch_size),
        "--seq-len", str(args.seq_len), "--num-anchors", str(args.num_anchors),
        "--warmup", "3" if compiled else "2", "--iters", "8", "--json", str(out),
        "--threads", str(_host_threads(args.device)),
    ]  # fmt: skip
    return [*cmd, "--compile"] if compiled else cmd


def _host_threads(device: str) -> int:
    """torch's host threads for a step row: on a GPU machine all its cores (they build the
    1B-parameter drafter before it moves to the device), on a CPU one (the row's own rule)."""
    return min(16, os.cpu_count() or 1) if device.startswith("cuda") else 1


def pipeline_command(args, shape: str, out: Path) -> list[str]:
    # The child stops stepping at 80% of its limit: the rest is for winding down.
    budget = 0.8 * LIMITS["pipeline"][0]
    return [
        sys.executable, "-m", "dflash_train", "bench", "gpu", "--part", "pipeline",
        "--shapes", shape, "--device", args.device, "--steps", str(args.steps), "--seq-len",
        str(args.seq_len), "--batch-size", str(args.batch_size), "--num-anchors",
        str(args.num_anchors), "--budget-s", f"{budget:.0f}", "--json", str(out),
    ]  # fmt: skip


def tests_part(py: str, out: Path, scratch: Path, env: dict, cuda: bool) -> Part:
    """pytest on tests/cuda alone, one line per test into `tests.jsonl`, the tests that
    passed in an earlier run deselected."""
    record, skip = out / "tests.jsonl", scratch / "tests_passed.txt"
    skip.write_text("\n".join(sorted(tests_passed(record))) + "\n")
    cmd = [
        py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
        "dflash_train.bench.pytest_record", "--rootdir", str(ROOT), "-c",
        str(ROOT / "pyproject.toml"), str(ROOT / "tests" / "cuda"),
    ]  # fmt: skip
    test_env = {**env, "DFLASH_TEST_RECORD": str(record), "DFLASH_TEST_SKIP": str(skip)}
    return Part(
        "cuda_tests", cmd, *LIMITS["cuda_tests"], env=test_env,
        judge=lambda _figures: _judge_tests(record, cuda),
    )  # fmt: skip


# ----------------------------------------------------------------------------- judging
def tests_by_id(record: Path) -> dict[str, str]:
    """nodeid -> its latest outcome in `record`: passed, failed, skipped, or `hung` for a
    test that started and has no result (the run was killed inside it)."""
    outcome: dict[str, str] = {}
    if not record.is_file():
        return outcome
    for line in record.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        node, when = row.get("nodeid"), row.get("when")
        if when == "start":
            outcome[node] = "hung"
        elif row.get("outcome") == "failed":
            outcome[node] = "failed"
        elif outcome.get(node) != "failed":
            outcome[node] = row.get("outcome", "?")
    return outcome


def tests_passed(record: Path) -> set[str]:
    return {n for n, o in tests_by_id(record).items() if o == "passed"}


def test_counts(record: Path) -> dict[str, Any]:
    by_id = tests_by_id(record)
    counts = {k: sum(o == k for o in by_id.values()) for k in ("passed", "failed", "skipped")}
    counts["hung"] = [n for n, o in by_id.items() if o == "hung"]
    counts["failed_tests"] = [n for n, o in by_id.items() if o == "failed"]
    return counts


def _judge_tests(record: Path, cuda: bool) -> list[str]:
    counts = test_counts(record)
    problems = [f"failed: {n}" for n in counts["failed_tests"]]
    problems += [f"hung: {n}" for n in counts["hung"]]
    if cuda and not counts["passed"]:
        problems.append("no CUDA test passed")
    return problems


def _judge_step(figures: dict[str, Any]) -> list[str]:
    if not figures.get("tokens_per_s"):
        return [figures.get("error") or "no tokens/s measured"]
    return []


def _judge_pipeline(figures: dict[str, Any]) -> list[str]:
    return [] if figures.get("steps") else ["no optimizer step in the pipeline's time"]


def verdict(parts: dict[str, dict], names: list[str], only: set[str] | None, cuda: bool) -> list:
    """What keeps the check from passing: every part that ran must have passed, and on a GPU
    every part must have run."""
    problems = []
    for name in names:
        record = parts.get(name)
        if record is None:
            if cuda and (only is None or name in only):
                problems.append(f"{name}: not run")
            continue
        if record.get("status") != "passed":
            problems.append(f"{name}: {record.get('status')}: {record.get('reason', '')}")
    return problems


# ----------------------------------------------------------------------------- records
def _after_part(runner: PartRunner, name: str, args, shape: str) -> None:
    """Test counts and the MFU against the measured peak added to the records; figures.md
    rewritten."""
    parts = runner.summary["parts"]
    record = parts.get(name, {})
    if name == "cuda_tests":
        record.setdefault("figures", {}).update(test_counts(Path(args.out) / "tests.jsonl"))
    peak = (parts.get("device", {}).get("figures") or {}).get("matmul_tflops")
    figures = record.get("figures") or {}
    if name.startswith("step_") and peak and figures.get("model_tflops_per_s"):
        figures["mfu_of_measured_peak"] = figures["model_tflops_per_s"] / peak
    if name == "device":
        runner.summary["gpu"] = figures.get("gpu")
        runner.summary["versions"] = figures.get("versions")
    _finish(runner, args, shape)


def _finish(runner: PartRunner, args, shape: str) -> None:
    expected = gpu_expect.expected_for(str(runner.summary.get("gpu")), _default_shapes(args))
    runner.summary["out_of_range"] = gpu_expect.out_of_range(runner.summary["parts"], expected)
    runner.write()
    text = gpu_expect.render(runner.summary, expected)
    write_text_atomic(Path(args.out) / "figures.md", text)


def _default_shapes(args) -> bool:
    return (args.shapes, args.seq_len, args.batch_size, args.num_anchors) == (
        "qwen3-8b", 2048, 4, 256
    )  # fmt: skip


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- children
def _pipeline_child(args: argparse.Namespace, shape: str) -> int:
    import torch

    from dflash_train.bench.gpu_pipeline import run_pipeline
    from dflash_train.devices import configure_allocator, parse_devices

    configure_allocator()
    (device,) = parse_devices(args.device, "--device")
    if device.type == "cpu":
        torch.set_num_threads(2)
    result = run_pipeline(args, shape, device, time.monotonic() + args.budget_s)
    write_json(args.json, result)
    return 0


def measure_device(spec: str) -> dict[str, Any]:
    """Versions (and whether they are in the declared range), the device, and its measured
    peaks: matmul TFLOP/s (bf16 8192^3 on CUDA, fp32 512^3 on CPU), device copy TB/s (bytes
    read + written), host-to-device GB/s from pinned and from pageable memory."""
    import torch

    from dflash_train.devices import configure_allocator, parse_devices

    configure_allocator()
    (device,) = parse_devices(spec, "--device")
    out: dict[str, Any] = {"versions": versions(), "unmet": unmet_requirements()}
    cuda = device.type == "cuda"
    if cuda:
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, memory_gb=props.total_memory / 1e9, cuda=torch.version.cuda)
    else:
        out["gpu"] = "cpu"
    n, dtype = (8192, torch.bfloat16) if cuda else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    out["matmul_tflops"] = 2 * n**3 / _seconds(lambda: a @ b, device) / 1e12
    nbytes = 2**31 if cuda else 2**26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    out["copy_tb_s"] = 2 * nbytes / _seconds(lambda: dst.copy_(src), device) / 1e12
    if cuda:
        host = torch.empty(2**30, dtype=torch.uint8)
        pinned = host.pin_memory()
        out["h2d_pinned_gb_s"] = 2**30 / _seconds(lambda: pinned.to(device, non_blocking=True),
                                                 device) / 1e9  # fmt: skip
        out["h2d_pageable_gb_s"] = 2**30 / _seconds(lambda: host.to(device), device) / 1e9
    return out


def _seconds(work, device, reps: int = 10) -> float:
    """Median seconds of `work()` on `device` after two warm-up calls."""
    import statistics

    from dflash_train.devices import synchronize

    for _ in range(2):
        work()
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        work()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


REPORTED = ("torch", "transformers", "triton", "tokenizers", "safetensors", "numpy")


def versions() -> str:
    """`python 3.12.3, torch 2.11.0+cu130, ...`: what the check ran with."""
    import importlib.metadata as md
    import platform

    found = [f"python {platform.python_version()}"]
    for name in REPORTED:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            found.append(f"{name} -")
    return ", ".join(found)


def unmet_requirements() -> list[str]:
    """The runtime requirements of pyproject.toml the installed packages do not meet."""
    import importlib.metadata as md
    import tomllib

    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    unmet = []
    for dep in deps:
        req = Requirement(dep)
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            unmet.append(f"{dep} (not installed)")
            continue
        if not req.specifier.contains(have.split("+")[0], prereleases=True):
            unmet.append(f"{dep} (installed {have})")
    return unmet
