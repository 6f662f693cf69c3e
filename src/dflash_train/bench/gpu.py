"""`dflash-train bench gpu --json OUT`: the one-GPU check, prepared to run in a few minutes.

On one device, with random-weight targets of real shapes built from configs (no download):
1. the drafter step alone (`bench step --random-target SHAPE`, one process per configuration):
   supervised tokens/s, peak memory and MFU against the device's bf16 peak, for `--attention`
   flex and blockwise, without and with `--compile`;
2. the full pipeline on the same device as target and drafter (prefetchers, queue, target
   worker on a random Qwen3 of the shape, drafter worker): target tokens/s, drafter supervised
   tokens/s end to end, peak memory of each stage alone and of the whole run, and host syncs per
   optimizer step (torch's CUDA sync debug mode, counted);
3. the tests marked as needing CUDA (`pytest -m cuda`), as counts.
Everything goes to the JSON file; each part has a time budget so the whole check fits
`--budget-s`. On CPU (`--device cpu --shapes tiny`) the same code runs on tiny shapes: that is
how it is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import add_json_argument, synthetic_lengths, write_json
from dflash_train.bench.sim import StepLog
from dflash_train.bench.step import RANDOM_TARGETS
from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import Batching, bucket_weights, fit_bucket_lengths
from dflash_train.data.dataset import PreparedDataset, write_prepared
from dflash_train.devices import configure_allocator, parse_devices, resolve_dtype
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import FrozenHead, TargetFeatureExtractor, draft_config_from_target
from dflash_train.objective import default_gamma
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.prefetch import BatchBuilder, EpochPlans
from dflash_train.train.replica import DraftReplica

DRAFT_LAYERS, BLOCK, NUM_FEATURES = 5, 16, 5


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
    parser.add_argument("--skip-tests", action="store_true", help="do not run pytest -m cuda")
    parser.add_argument(
        "--skip-compile", action="store_true", help="measure the step without --compile only"
    )
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    configure_allocator()
    (device,) = parse_devices(args.device, "--device")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in RANDOM_TARGETS]
    if unknown or not shapes:
        raise ValueError(f"--shapes: unknown {unknown}; choose from {sorted(RANDOM_TARGETS)}")
    t0 = time.monotonic()
    out: dict[str, Any] = {"device": str(device), "gpu": _gpu_name(device), "shapes": {}}
    share = args.budget_s * (0.8 if args.skip_tests else 0.6) / len(shapes)
    for shape in shapes:
        start = time.monotonic()
        entry: dict[str, Any] = {"step": _step_rows(args, shape, device, share / 2)}
        entry["pipeline"] = _pipeline(args, shape, device, deadline=start + share)
        entry["seconds"] = time.monotonic() - start
        out["shapes"][shape] = entry
        print(f"[gpu] {shape}: {json.dumps(entry['pipeline'])}", flush=True)
    if not args.skip_tests:
        out["cuda_tests"] = _cuda_tests(args.budget_s - (time.monotonic() - t0))
    out["seconds"] = time.monotonic() - t0
    if args.json:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    failed = out.get("cuda_tests", {}).get("failed", 0)
    return (
        1 if failed or any("error" in r for e in out["shapes"].values() for r in e["step"]) else 0
    )


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ----------------------------------------------------------------------------- 1. the step
def _step_rows(
    args: argparse.Namespace, shape: str, device: torch.device, budget_s: float
) -> list[dict[str, Any]]:
    """`bench step` per (attention, compile), each in its own process (its own peak memory)."""
    kernels = ["flex", "blockwise"] if device.type == "cuda" else ["blockwise"]
    rows = []
    deadline = time.monotonic() + budget_s
    for compiled in (False,) if args.skip_compile else (False, True):
        for attention in kernels:
            if time.monotonic() > deadline:
                rows.append({"attention": attention, "compile": compiled, "skipped": "budget"})
                continue
            rows.append(_step_child(args, shape, device, attention, compiled))
    return rows


def _step_child(args, shape, device, attention, compiled) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [
            sys.executable, "-m", "dflash_train", "bench", "step", "--random-target", shape,
            "--device", str(device), "--attention", attention, "--draft-layers",
            str(DRAFT_LAYERS), "--num-target-features", str(NUM_FEATURES), "--batch-size",
            str(args.batch_size), "--seq-len", str(args.seq_len), "--num-anchors",
            str(args.num_anchors), "--warmup", "3" if compiled else "2", "--iters", "8",
            "--json", str(out),
        ]  # fmt: skip
        if compiled:
            cmd.append("--compile")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return {"attention": attention, "compile": compiled, "error": tail[0]}
        return json.loads(out.read_text())


# ----------------------------------------------------------------------------- 2. the pipeline
class SyncCounter:
    """Counts the host syncs torch reports in CUDA sync debug mode (warnings), by thread."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._show = warnings.showwarning

    def __enter__(self) -> SyncCounter:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        warnings.showwarning = self._record
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._show

    def _record(self, message, category, *args, **kwargs) -> None:
        if "synchroniz" in str(message):
            with self._lock:
                self.count += 1
        else:
            self._show(message, category, *args, **kwargs)


def _random_target(shape: str, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**RANDOM_TARGETS[shape])
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)  # random weights, built on the device
    return config, model.eval().requires_grad_(False)


def _dataset(tmp: Path, args: argparse.Namespace, vocab: int, rows: int) -> PreparedDataset:
    lengths = np.clip(synthetic_lengths(rows, 0, median=args.seq_len / 3), 64, args.seq_len)
    rng = np.random.default_rng(0)
    data = []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[int(n * rng.uniform(0.2, 0.6)) :] = 1  # a prompt, then the supervised answer
        data.append((rng.integers(0, vocab - 1, n), mask))
    write_prepared(tmp / "data", data)
    return PreparedDataset(tmp / "data")


def _pipeline(args, shape: str, device: torch.device, deadline: float) -> dict[str, Any]:
    """The full pipeline on one device for `args.steps` steps (or until the deadline)."""
    dtype = resolve_dtype("auto", device)
    config, model = _random_target(shape, device, dtype)
    draft = draft_config_from_target(config, DRAFT_LAYERS, BLOCK, config.vocab_size - 1)
    head = FrozenHead.of_model(model)
    memory = _stage_memory(device)
    with tempfile.TemporaryDirectory() as tmp:
        ds = _dataset(Path(tmp), args, config.vocab_size, args.steps * args.batch_size)
        buckets = fit_bucket_lengths(ds.lengths, 8)
        anchors = np.minimum(ds.anchor_counts(), args.num_anchors)
        batching = Batching(args.batch_size, None, "work", anchors, BLOCK, args.num_anchors)
        plans = EpochPlans(ds.lengths, buckets, batching, 0, 1)
        builder = BatchBuilder(ds, buckets, BLOCK, args.num_anchors, default_gamma(BLOCK),
                               draft.mask_token_id, 0)  # fmt: skip
        extractor = TargetFeatureExtractor("", draft.target_layer_ids, device, dtype, model=model)
        timers = StageTimers()
        replica = DraftReplica(
            DFlashDraftModel(draft),
            head,
            device,
            dtype,
            ObjectiveOptions(num_anchors=args.num_anchors),
            OptimOptions(),
            args.steps,
            timers,
        )
        memory["after_build"] = _peak(device)
        longest = plans.epoch(0)[int(np.argmax([buckets[b.bucket] for b in plans.epoch(0)]))]
        largest = builder.build(longest).input_ids
        extractor(largest)  # the target stage alone, largest batch
        memory["target_forward_largest_batch"] = _peak(device)
        graphs = _target_graphs(extractor, largest) if device.type == "cuda" else None
        steps = SupervisedLog()
        settings = PipelineSettings(
            total_steps=args.steps,
            num_prefetchers=2,
            hs_queue_depth=8,
            hs_min_ready=2,
            bucket_weights=bucket_weights(plans.epoch(0)),
            stall_timeout_s=600,
        )
        pipe = Pipeline(
            settings, TargetFeed(plans, builder, [extractor]), [replica], steps, timers=timers
        )
        t0 = time.monotonic()
        with SyncCounter() as syncs:
            pipe.start()
            while not pipe.drafters_done() and time.monotonic() < deadline:
                pipe.check()
                time.sleep(0.2)
            pipe.shutdown()
        wall = time.monotonic() - t0
        replica.flush_timers()
        pipe.check()
    memory["pipeline"] = _peak(device)
    seconds, counts = timers.snapshot()
    stats = pipe.stats()
    n = max(1, len(steps.times))
    trained = stats.accounting["trained"]
    processed = stats.accounting["target"]
    return {
        "steps": len(steps.times),
        "wall_s": wall,
        "target_tokens_per_s": _tokens(ds, processed) / max(1e-9, seconds["target_forward_s"]),
        "drafter_supervised_tokens_per_s": steps.supervised / max(1e-9, wall),
        "drafter_seqs_per_s": trained / max(1e-9, wall),
        "drafter_step_s": sum(
            seconds[k] for k in ("drafter_forward_s", "drafter_backward_s", "optimizer_s")
        )
        / n,
        "host_syncs_per_step": syncs.count / n if device.type == "cuda" else None,
        "target_cuda_graphs": graphs,
        "peak_memory_gb": memory,
        "stage_calls": counts,
    }


def _target_graphs(extractor: TargetFeatureExtractor, ids: torch.Tensor) -> dict[str, Any]:
    """The target forward on the largest batch, eager against a CUDA-graph replay (train
    --cuda-graphs): seconds per call, whether the features agree, the capture's memory."""
    device = extractor.device

    def per_call(reps: int = 5) -> float:
        extractor(ids)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            extractor(ids)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps

    out: dict[str, Any] = {"eager_s": per_call()}
    want = extractor(ids)
    before = torch.cuda.memory_reserved(device)
    try:
        extractor.capture_graphs({ids.shape[1]: ids.shape[0]})
    except Exception as e:  # reported: train --cuda-graphs falls back to eager the same way
        return {**out, "error": f"{type(e).__name__}: {e}"[:300]}
    out["capture_gb"] = (torch.cuda.memory_reserved(device) - before) / 1e9
    out["graph_s"] = per_call()
    out["max_abs_diff"] = float((extractor(ids).float() - want.float()).abs().max())
    out["speedup"] = out["eager_s"] / max(1e-12, out["graph_s"])
    extractor.drop_graphs()
    return out


def _tokens(ds: PreparedDataset, sequences: int) -> float:
    return float(ds.lengths.mean()) * sequences  # the mean row: a whole number of epochs


class SupervisedLog(StepLog):
    """StepLog that also sums the supervised block positions of every applied step."""

    def __init__(self) -> None:
        super().__init__()
        self.supervised = 0

    def on_step(self, outcome, grad_norm) -> None:
        super().on_step(outcome, grad_norm)
        self.supervised += sum(j.num_supervised for j in outcome.jobs)


def _stage_memory(device: torch.device) -> dict[str, float | None]:
    return {"target_weights": _peak(device)}


def _peak(device: torch.device) -> float | None:
    """Peak allocated GB on the device since the last reading, then reset."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / 1e9
    torch.cuda.reset_peak_memory_stats(device)
    return peak


# ----------------------------------------------------------------------------- 3. CUDA tests
def _cuda_tests(budget_s: float) -> dict[str, Any]:
    """`pytest -m cuda` from the checkout (the device machine runs in the repository root)."""
    tests = Path.cwd() / "tests"
    if not tests.is_dir():
        return {"skipped": "no tests directory here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(tests), "-p", "no:cacheprovider"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, int(budget_s)))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {budget_s:.0f}s"}
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    for number, key in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary):
        counts["errors" if key.startswith("error") else key] += int(number)
    counts["failed"] += counts["errors"]
    return {**counts, "summary": summary, "tail": proc.stdout[-3000:]}
