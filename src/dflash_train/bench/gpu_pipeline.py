"""`bench gpu`'s second part, run in a child process of its own (its own time limit and peak
memory): the full pipeline on one device as target and drafter, with a random-weight target of
a real shape (prefetchers, queue, target worker, drafter worker), after the drafter's warm-up
as train does it. Figures: target tokens/s, drafter supervised tokens/s end to end, peak memory
of each stage alone and of the whole run, host syncs per optimizer step (torch's CUDA sync debug
mode, counted), the target's CUDA-graph replay against eager, and the warm-up's compile cost."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import synthetic_lengths
from dflash_train.bench.sim import StepLog
from dflash_train.bench.step import RANDOM_TARGETS
from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import Batching, bucket_weights, fit_bucket_lengths
from dflash_train.data.dataset import PreparedDataset, write_prepared
from dflash_train.devices import resolve_dtype
from dflash_train.model import flex
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import FrozenHead, TargetFeatureExtractor, draft_config_from_target
from dflash_train.objective import loss_gamma
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.prefetch import BatchBuilder, EpochPlans
from dflash_train.train.replica import DraftReplica
from dflash_train.train.warm_up import compiled_shapes_only, warm_up

DRAFT_LAYERS, BLOCK, NUM_FEATURES = 5, 16, 5


class SyncCounter:
    """Counts the host syncs torch reports in CUDA sync debug mode (warnings), by thread."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._show = warnings.showwarning
        self._saved: Any = None

    def __enter__(self) -> SyncCounter:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        # Every sync warning shown (not once per place), and the filters and the hook given
        # back as they were on the way out.
        self._saved = warnings.catch_warnings()
        self._saved.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(0)
        self._saved.__exit__(*exc)

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


def run_pipeline(args, shape: str, device: torch.device, deadline: float) -> dict[str, Any]:
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
        # The replica's own objective, its loss normaliser included (D-PACE's by default).
        objective = ObjectiveOptions(num_anchors=args.num_anchors)
        builder = BatchBuilder(ds, buckets, BLOCK, args.num_anchors,
                               loss_gamma(BLOCK, objective.gamma), draft.mask_token_id, 0,
                               position_weights=objective.position_weights)  # fmt: skip
        extractor = TargetFeatureExtractor("", draft.target_layer_ids, device, dtype, model=model)
        timers = StageTimers()
        replica = DraftReplica(
            DFlashDraftModel(draft),
            head,
            device,
            dtype,
            objective,
            OptimOptions(),
            args.steps,
            timers,
        )
        memory["after_build"] = _peak(device)
        # As train does: every planned shape class compiled on this (main) thread first.
        compiles = flex.timed_compiles()
        warm_up([replica], plans, builder, 1, lambda m: print(f"[gpu] {m}", flush=True))
        traces, warm_s = compiles()
        eager_before, graphs_before = flex.eager_calls(), flex.graphs_compiled()
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
        # As train does: a shape the warm-up missed runs eager (counted), never traced in the
        # drafter thread.
        with SyncCounter() as syncs, compiled_shapes_only([replica]):
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
        "warm_up_s": warm_s,
        "flex_traces": traces,
        # Both 0 when the warm-up covered the run: traced after it, or sent to the unfused path.
        "flex_traces_in_run": compiles()[0] - traces,
        "graphs_compiled_in_run": flex.graphs_compiled() - graphs_before,
        "flex_eager_calls": flex.eager_calls() - eager_before,
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
