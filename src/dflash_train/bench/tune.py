"""`dflash-train tune`: measure this machine, then size the pipeline for it.

1. Measure, per device, each role alone through the real pipeline (`Pipeline`, with the
   data set-up `train` uses): the target's tokens/s (prefetchers -> job queue -> one target
   worker on real batches in the epoch plan's order, so the length mix is the training mix; the
   drafter side discards) and the drafter's tokens/s (one drafter worker training on those
   batches' real features, computed first so the target never shares the device while the
   drafter is timed), each over about `--seconds` of steady steps after a warm-up step. Tokens
   are real (unpadded) tokens: what training gets through.
2. Split the devices into target and drafter roles to maximise min(target side, drafter side).
3. Size the hidden-state queue: `--hs-min-ready` so the buffered batches hold the length mix,
   `--hs-queue-depth` with room above it, both bounded by the bytes of a batch of hidden states
   against free memory where the features live (the target device; host memory on CPU).
4. Print the expected throughput with the arithmetic, and the flags to pass to `train`.

The arithmetic is in `bench.sizing` (pure functions, tested without models).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import add_json_argument, fmt, format_table, write_json
from dflash_train.bench.sizing import (
    QueueSizing,
    Split,
    human_bytes,
    recommend_batch_tokens,
    recommend_depth,
    recommend_split,
)
from dflash_train.config import ModelOptions, ObjectiveOptions, PipelineOptions, TrainConfig
from dflash_train.data.buckets import BatchSpec
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import field_docs, parsed_overrides
from dflash_train.devices import (
    configure_cpu_threads,
    default_cpu_threads,
    enter_worker_thread,
    marks_here,
    parse_devices,
    resolve_dtype,
    synchronize,
)
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import TargetFeatureExtractor, load_frozen_head
from dflash_train.pipeline.build import DirectFeed, Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.costing import CostFit
from dflash_train.pipeline.mixing import recommend_min_ready
from dflash_train.pipeline.records import HSBatch, Job
from dflash_train.pipeline.stages import Channels, Replica
from dflash_train.pipeline.sync import StepOutcome
from dflash_train.train.models import measure_batch_cost
from dflash_train.train.replica import DraftReplica
from dflash_train.train.setup import TrainingData
from dflash_train.train.warm_up import compiled_shapes_only, warm_up

MIN_BATCHES = 3  # timed batches per measurement at least, however long they take
REPLAY_BATCHES = 16  # distinct batches of precomputed features the drafter measurement cycles
NEVER = 1 << 62  # a schedule length no measurement reaches: the tuner stops the pipeline itself


@dataclass
class Rate:
    """One timed stretch: real and padded tokens over seconds, and how many batches."""

    tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class RateProbe:
    """The measurement's step listener: the rate between step completions, the first step left
    out (it carries the warm-up: lazy initialisation, allocator growth)."""

    def __init__(self) -> None:
        self.rate = Rate()
        self._last: float | None = None
        self._lock = threading.Lock()

    def on_step(self, outcome: StepOutcome, grad_norm: torch.Tensor | None) -> None:
        now = time.perf_counter()
        with self._lock:
            if self._last is not None:
                r = self.rate
                r.seconds += now - self._last
                r.batches += len(outcome.jobs)
                r.tokens += sum(j.num_tokens for j in outcome.jobs)
                r.padded_tokens += sum(j.num_tokens + j.num_padded for j in outcome.jobs)
            self._last = now

    def enough(self, seconds: float) -> bool:
        with self._lock:
            return self.rate.seconds >= seconds and self.rate.batches >= MIN_BATCHES


@dataclass
class RepeatingPlan:
    """One epoch's planned batches over and over, for as long as a measurement runs."""

    plan: list[BatchSpec]
    num_rows: int
    epochs: int = 1

    def iter_all(self) -> Iterator[BatchSpec]:
        return itertools.cycle(self.plan)


class DiscardingReplica:
    """A drafter that takes each batch and does nothing: the target side is timed alone."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.step = 0
        self.flat_grad = torch.zeros(1)

    def micro_step(self, batch: HSBatch) -> None:
        synchronize(self.device)  # the target's forward is done: time it, not its launch

    def apply(self, global_weight: float) -> None:
        self.step += 1


@dataclass
class DeviceRates:
    device: str
    target: Rate
    drafter: Rate
    free_bytes: int | None
    cpu_threads: int | None


class Measurer:
    """The data and drafter shape once (`TrainingData`, as `train` sets them up); then, one
    device at a time, each role timed alone through the real pipeline stages."""

    def __init__(self, cfg: TrainConfig, seconds: float, num_cpu_workers: int) -> None:
        self.cfg, self.seconds, self.num_cpu_workers = cfg, seconds, num_cpu_workers
        self.data = TrainingData.load(cfg, epochs=1)
        self.plan = self.data.plans.epoch(0)
        self.weights = self.data.weights
        self.cost_fit: CostFit | None = None
        """--batch-cost auto: the drafter's cost as train measures it, on the first device."""

    def _plan_as_train_will(self, replica: DraftReplica) -> None:
        """With --batch-cost auto, measure the drafter's cost on `replica` as train does at its
        start and plan with that token share, so the rates below are of train's batches."""
        p = self.cfg.pipeline
        if self.cost_fit is not None or p.batching != "work" or p.batch_cost != "auto":
            return
        self.cost_fit = measure_batch_cost(replica, self.data)
        share = f"{self.cost_fit.token_share:g}"
        self.cfg = dataclasses.replace(self.cfg, pipeline=dataclasses.replace(p, batch_cost=share))
        self.data = self.data.with_token_share(self.cost_fit.token_share)
        self.plan = self.data.plans.epoch(0)
        self.weights = self.data.weights

    @staticmethod
    def _say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def mean_tokens_per_batch(self) -> float:
        lengths = self.data.dataset.lengths
        return float(np.mean([lengths[list(s.seq_ids)].sum() for s in self.plan]))

    def batch_bytes(self, dtype: torch.dtype) -> tuple[int, float]:
        """(largest, mean) bytes of one planned batch of hidden states."""
        d = self.data
        sizes = [
            features_nbytes(
                len(s.seq_ids),
                d.bucket_lengths[s.bucket],
                len(d.feature_layer_ids),
                d.draft_config.hidden_size,
                dtype,
            )
            for s in self.plan
        ]
        return max(sizes), float(np.mean(sizes))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Hidden-state bytes of one padded token (K target layers, and the teacher's input for a
        loss on the target's distribution, x hidden size)."""
        d = self.data
        return features_nbytes(1, 1, len(d.feature_layer_ids), d.draft_config.hidden_size, dtype)

    def measure(self, device: torch.device) -> DeviceRates:
        """Target then drafter tokens/s on `device`, each for about `seconds` of steady work."""
        m = self.cfg.model
        threads = default_cpu_threads(self.num_cpu_workers) if device.type == "cpu" else None
        enter_worker_thread(device)
        configure_cpu_threads(threads or 0)
        dtype = resolve_dtype(m.dtype, device)
        extractor = TargetFeatureExtractor(
            m.target, self.data.feature_layer_ids, device, dtype, m.trust_remote_code
        )
        replica = self._replica(device, dtype)
        self._plan_as_train_will(replica)
        # As train does before its workers start: the drafter's compiled shapes traced here.
        warm_up([replica], self.data.plans, self.data.builder, 1, self._say)
        target = self._time_target(extractor)
        with compiled_shapes_only([replica]):  # as train: nothing traces in the drafter thread
            drafter = self._time_drafter(extractor, replica)
        free = free_memory_bytes(device)
        del extractor
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return DeviceRates(str(device), target, drafter, free, threads)

    def _replica(self, device: torch.device, dtype: torch.dtype) -> DraftReplica:
        model = DFlashDraftModel(self.data.draft_config)
        model.init_weights(seed=self.cfg.run.seed)
        head = load_frozen_head(self.cfg.model.target, self.cfg.model.trust_remote_code)
        return DraftReplica(
            model, head, device, dtype, self.cfg.objective, self.cfg.optim, total_steps=10_000
        )

    def _time_target(self, extractor: TargetFeatureExtractor) -> Rate:
        """Prefetchers -> job queue -> this target worker -> a drafter that discards."""
        plans = RepeatingPlan(self.plan, len(self.data.dataset))
        feed = TargetFeed(plans, self.data.builder, [extractor])
        return self._run(feed, DiscardingReplica(extractor.device))

    def _time_drafter(self, extractor: TargetFeatureExtractor, replica: DraftReplica) -> Rate:
        """This drafter worker on precomputed features (computed first, untimed, so the target
        never shares the device with the drafter while it is timed)."""
        specs = itertools.islice(itertools.cycle(self.plan), max(MIN_BATCHES + 1, REPLAY_BATCHES))
        batches = precomputed_batches(extractor, [self.data.builder.build(s) for s in specs])

        def replay(ch: Channels) -> None:
            for batch in itertools.cycle(batches):  # until the measurement stops the pipeline
                ch.hs_queue.put(batch, bucket=batch.job.bucket)

        return self._run(DirectFeed([replay], len(self.data.dataset), 1), replica)

    def _run(self, feed: TargetFeed | DirectFeed, replica: Replica) -> Rate:
        """Run a one-worker-per-side pipeline until the probe has `seconds` of steady steps."""
        probe = RateProbe()
        settings = PipelineSettings(
            total_steps=NEVER,
            num_prefetchers=self.cfg.pipeline.num_prefetchers,
            hs_queue_depth=2,
            hs_min_ready=1,
            mix="fifo",
            stall_timeout_s=self.cfg.pipeline.stall_timeout,
        )
        pipeline = Pipeline(settings, feed, [replica], listener=probe)
        deadline = time.monotonic() + 120 + 20 * self.seconds
        try:
            pipeline.start()
            while not probe.enough(self.seconds):
                pipeline.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tune: no steady measurement within {deadline:.0f}s "
                        f"({probe.rate.batches} batches timed)"
                    )
                time.sleep(0.05)
        finally:
            pipeline.shutdown(timeout_s=30.0)
        return probe.rate


def precomputed_batches(extractor: TargetFeatureExtractor, jobs: list[Job]) -> list[HSBatch]:
    """The features of `jobs`, computed on this thread; each batch carries this thread's mark
    after its forward, which the drafter thread's copy waits for (`devices.handover`): the
    forward may still be running on this thread's stream when the drafter takes the batch."""
    out = []
    for job in jobs:
        features = extractor(job.input_ids)
        (ready,) = marks_here([extractor.device])
        out.append(HSBatch(job, features, ready))
    return out


def features_nbytes(
    batch: int, length: int, num_features: int, hidden: int, dtype: torch.dtype
) -> int:
    """Bytes of one batch of hidden states (for sizing --hs-queue-bytes)."""
    return batch * length * num_features * hidden * torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory where queued features of `device` live: CUDA free memory, or the host's
    MemAvailable (Linux) for CPU; None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------------- command
PIPELINE_FLAGS = (
    "data",
    "batch_size",
    "batch_tokens",
    "batching",
    "batch_cost",
    "num_buckets",
    "bucket_lengths",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="YAML", help="a training config (YAML); flags override it"
    )
    parser.add_argument(
        "--devices",
        help="every device to use, comma list, e.g. cuda:0,...,cuda:7 or cpu,cpu (default: all "
        "CUDA devices)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=5.0,
        help="seconds of each measurement (target, drafter) per device (default: 5)",
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.5,
        help="share of the free memory where features live that the queue may fill (default: 0.5)",
    )
    parser.add_argument(
        "--grad-accum", type=int, default=None, help="micro-batches per drafter per step"
    )
    add_json_argument(parser)
    add_dataclass_arguments(parser, ModelOptions, title="model options (as in train)")
    add_dataclass_arguments(parser, ObjectiveOptions, title="objective options (as in train)")
    group = parser.add_argument_group("data options (as in train)")
    docs = field_docs(PipelineOptions)
    types = {"batch_size": int, "batch_tokens": int, "num_buckets": int}
    for name in PIPELINE_FLAGS:
        kwargs: dict[str, Any] = {"help": docs[name], "default": argparse.SUPPRESS, "dest": name}
        if name == "bucket_lengths":
            kwargs["type"] = lambda s: [int(x) for x in s.split(",") if x.strip()]
        elif name in types:
            kwargs["type"] = types[name]
        group.add_argument("--" + name.replace("_", "-"), **kwargs)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    flags: dict[str, Any] = {}
    for section in (ModelOptions, ObjectiveOptions):
        flags.update(parsed_overrides(args, section))
    flags.update({n: getattr(args, n) for n in PIPELINE_FLAGS if hasattr(args, n)})
    if args.grad_accum is not None:
        flags["grad_accum"] = args.grad_accum
    cfg = TrainConfig.from_yaml_and_flags(args.config, flags)
    if not cfg.model.target:
        raise ValueError("--target is required (a Hugging Face model directory)")
    if not cfg.pipeline.data:
        raise ValueError("--data is required (a directory from `dflash-train prepare`)")
    return cfg


def parse_device_list(spec: str | None) -> list[torch.device]:
    if spec is None:
        if not torch.cuda.is_available():
            raise ValueError("--devices is required without CUDA, e.g. --devices cpu,cpu")
        spec = ",".join(f"cuda:{i}" for i in range(torch.cuda.device_count()))
    return parse_devices(spec, "devices")


def main(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or not 0 < args.memory_fraction <= 1:
        raise ValueError("--seconds must be positive and --memory-fraction in (0, 1]")
    cfg = config_from_args(args)
    devices = parse_device_list(args.devices)
    num_cpu = sum(d.type == "cpu" for d in devices)
    measurer = Measurer(cfg, args.seconds, num_cpu)
    measured: dict[str, DeviceRates] = {}
    for dev in devices:
        if str(dev) not in measured:  # a repeated `cpu` is the same hardware: measure once
            measured[str(dev)] = measurer.measure(dev)
    result = recommend(cfg, devices, measured, measurer, args.memory_fraction)
    print(result["text"])
    if args.json:
        write_json(args.json, {k: v for k, v in result.items() if k != "text"})
        print(f"wrote {args.json}")
    return 0


def recommend(cfg, devices, measured, measurer, memory_fraction: float) -> dict[str, Any]:
    """The split, the queue sizing, the expected throughput, and the text that explains them."""
    per_dev = [measured[str(d)] for d in devices]
    split = recommend_split(
        [r.target.tokens_per_s for r in per_dev], [r.drafter.tokens_per_s for r in per_dev]
    )
    tokens_per_batch = measurer.mean_tokens_per_batch()
    draws = len(split.drafters) * cfg.optim.grad_accum
    min_ready = recommend_min_ready(measurer.weights, draws, epoch_batches=len(measurer.plan))
    target_devs = [devices[i] for i in split.targets]
    frees = [per_dev[i].free_bytes for i in split.targets]
    # Each target keeps the batches it produced; the tightest target device bounds the queue.
    free = None if any(f is None for f in frees) else min(f for f in frees if f is not None)
    budget = None if free is None else int(free * memory_fraction)
    dtype = resolve_dtype(cfg.model.dtype, target_devs[0])
    bmax, bmean = measurer.batch_bytes(dtype)
    cap = recommend_batch_tokens(
        min_ready.value,
        bmax,
        measurer.bytes_per_token(dtype),
        budget,
        measurer.data.bucket_lengths[-1],
    )
    if cap is not None:  # long rows: smaller batches, not a gate the buffer cannot reach
        bmean, bmax = bmean * cap.largest_bytes / bmax, cap.largest_bytes
    sizing = recommend_depth(min_ready.value, bmax, bmean, budget)
    if cap is not None:
        sizing.lines.insert(0, cap.line)
    lines = _measure_lines(per_dev, devices)
    lines += _split_lines(split, devices, per_dev, tokens_per_batch)
    if measurer.cost_fit is not None:
        lines += ["", f"batch cost (as train measures it): {measurer.cost_fit.describe()}"]
    lines += ["", "hidden-state queue:", "  " + min_ready.explanation]
    where = "host" if target_devs[0].type == "cpu" else "target device"
    lines += [
        f"  features stay on the target device ({where} memory); budget = {memory_fraction:g} x "
        f"free {'unknown' if free is None else human_bytes(free)}"
    ]
    lines += ["  " + x for x in sizing.lines]
    flags = _flags(split, devices, sizing)
    if cap is not None:
        flags.append(f"--batch-tokens {cap.batch_tokens}")
    lines += ["", "recommended flags for `dflash-train train`:", "  " + " ".join(flags)]
    return {
        "text": "\n".join(lines),
        "devices": [
            {
                "device": r.device,
                "target_tokens_per_s": r.target.tokens_per_s,
                "drafter_tokens_per_s": r.drafter.tokens_per_s,
                "target_batches_measured": r.target.batches,
                "drafter_batches_measured": r.drafter.batches,
                "free_bytes": r.free_bytes,
                "cpu_threads": r.cpu_threads,
            }
            for r in measured.values()
        ],
        "target_devices": [str(devices[i]) for i in split.targets],
        "drafter_devices": [str(devices[i]) for i in split.drafters],
        "shared_device": split.shared,
        "bound": split.bound,
        "target_tokens_per_s": split.target_rate,
        "drafter_tokens_per_s": split.drafter_rate,
        "expected_tokens_per_s": split.expected,
        "expected_batches_per_s": split.expected / tokens_per_batch,
        "mean_tokens_per_batch": tokens_per_batch,
        "hs_min_ready": sizing.min_ready,
        "hs_queue_depth": sizing.depth,
        "hs_queue_bytes": sizing.queue_bytes,
        "batch_bytes_max": bmax,
        "batch_bytes_mean": bmean,
        "batch_tokens": None if cap is None else cap.batch_tokens,
        "token_share": measurer.data.plans.batching.token_share,  # train's plan's
        "flags": flags,
    }


def _measure_lines(per_dev: list[DeviceRates], devices) -> list[str]:
    rows = []
    seen = set()
    for r in per_dev:
        if r.device in seen:
            continue
        seen.add(r.device)
        rows.append(
            {
                "device": r.device + (f" ({_threads(r.cpu_threads)})" if r.cpu_threads else ""),
                "target_tok_s": r.target.tokens_per_s,
                "target_batches": r.target.batches,
                "drafter_tok_s": r.drafter.tokens_per_s,
                "drafter_batches": r.drafter.batches,
                "target/drafter": r.target.tokens_per_s / r.drafter.tokens_per_s,
            }
        )
    lines = [
        "measured (real tokens/s; each role timed alone on its device):",
        format_table(list(rows[0]), rows),
    ]
    num_cpu = sum(d.type == "cpu" for d in devices)
    if num_cpu > 1:
        lines.append(
            f"note: `cpu` is listed {num_cpu} times: the rate is PER WORKER, measured alone with "
            f"{_threads(per_dev[0].cpu_threads or 1)} (the cores / CPU workers, as train uses); "
            "the workers share this machine's cores, so the sums below are upper bounds"
        )
    return lines


def _threads(n: int) -> str:
    return f"{n} intra-op thread" + ("s" if n != 1 else "")


def _split_lines(split: Split, devices, per_dev, tokens_per_batch: float) -> list[str]:
    def side(idx: list[int], attr: str) -> str:
        parts = [fmt(getattr(per_dev[i], attr).tokens_per_s) for i in idx]
        return " + ".join(parts) if len(set(parts)) > 1 else f"{len(idx)} x {parts[0]}"

    names = lambda idx: ",".join(str(devices[i]) for i in idx)  # noqa: E731
    lines = ["", "split:"]
    if split.shared:
        lines.append(
            f"  one device: target and drafter share {devices[0]}; expected 1 / (1 / "
            f"{fmt(split.target_rate)} + 1 / {fmt(split.drafter_rate)}) = "
            f"{fmt(split.expected)} tok/s"
        )
    else:
        lines += [
            f"  targets  {names(split.targets)}: {side(split.targets, 'target')} = "
            f"{fmt(split.target_rate)} tok/s",
            f"  drafters {names(split.drafters)}: {side(split.drafters, 'drafter')} = "
            f"{fmt(split.drafter_rate)} tok/s",
            f"  bound: {split.bound}; expected min({fmt(split.target_rate)}, "
            f"{fmt(split.drafter_rate)}) = {fmt(split.expected)} tok/s",
        ]
    lines.append(
        f"  = {fmt(split.expected / tokens_per_batch)} batches/s at {fmt(tokens_per_batch)} real "
        "tokens per batch (this data's plan), before pipeline losses (see `bench pipeline`)"
    )
    return lines


def _flags(split: Split, devices, sizing: QueueSizing) -> list[str]:
    flags = [
        "--target-devices " + ",".join(str(devices[i]) for i in split.targets),
        "--drafter-devices " + ",".join(str(devices[i]) for i in split.drafters),
        f"--hs-queue-depth {sizing.depth}",
        f"--hs-min-ready {sizing.min_ready}",
    ]
    if sizing.queue_bytes is not None:
        flags.append(f"--hs-queue-bytes {sizing.queue_bytes}")
    return flags
