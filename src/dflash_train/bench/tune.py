"""`dflash-train tune`: measure this machine, then size the pipeline for it.

1. Measure, per device, the target's tokens/s (`TargetFeatureExtractor` on real batches of the
   data's buckets, in the epoch plan's order, so the length mix is the training mix) and the
   drafter's tokens/s (`DraftReplica.micro_step` + `apply` on those batches' real features), for
   `--seconds` each. Tokens are real (unpadded) tokens: what training gets through.
2. Split the devices into target and drafter roles to maximise min(target side, drafter side).
3. Size the hidden-state queue: `--hs-min-ready` so the buffered batches hold the length mix,
   `--hs-queue-depth` with room above it, both bounded by the bytes of a batch of hidden states
   against free memory where the features live (the target device; host memory on CPU).
4. Print the expected throughput with the arithmetic, and the flags to pass to `train`.

The arithmetic is in `bench.sizing` (pure functions, tested without models).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dflash_train.bench.common import add_json_argument, fmt, format_table, write_json
from dflash_train.bench.sizing import (
    QueueSizing,
    Split,
    human_bytes,
    recommend_depth,
    recommend_min_ready,
    recommend_split,
)
from dflash_train.config import ModelOptions, ObjectiveOptions, PipelineOptions, TrainConfig
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import field_docs, parsed_overrides

MIN_BATCHES = 3  # timed batches per measurement at least, however long they take

if TYPE_CHECKING:  # torch and the pipeline records load only when a measurement runs
    import torch

    from dflash_train.pipeline.records import Job


@dataclass
class Rate:
    """One timed loop: real and padded tokens over seconds, and how many batches."""

    tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def add(self, job: Job, seconds: float) -> None:
        self.tokens += job.num_tokens
        self.padded_tokens += job.num_tokens + job.num_padded
        self.batches += 1
        self.seconds += seconds


@dataclass
class DeviceRates:
    device: str
    target: Rate
    drafter: Rate
    free_bytes: int | None
    cpu_threads: int | None


class Measurer:
    """Loads the target, the data and a drafter shape once; measures one device at a time."""

    def __init__(self, cfg: TrainConfig, seconds: float, num_cpu_workers: int) -> None:
        from dflash_train.data.buckets import bucket_weights, fit_bucket_lengths
        from dflash_train.data.dataset import PreparedDataset
        from dflash_train.model.target import draft_config_for
        from dflash_train.pipeline.prefetch import BatchBuilder, EpochPlans

        m, p, r = cfg.model, cfg.pipeline, cfg.run
        self.cfg, self.seconds, self.num_cpu_workers = cfg, seconds, num_cpu_workers
        self.dataset = PreparedDataset(p.data)
        if len(self.dataset) == 0:
            raise ValueError(f"prepared dataset {p.data} has no rows")
        self.bucket_lengths = p.bucket_lengths or fit_bucket_lengths(
            self.dataset.lengths, p.num_buckets
        )
        plans = EpochPlans(
            self.dataset.lengths, self.bucket_lengths, p.batch_size, p.batch_tokens, r.seed, 1
        )
        self.plan = plans.epoch(0)
        self.weights = bucket_weights(self.plan)
        self.draft_config, _ = draft_config_for(m)
        self.hidden_size = self.draft_config.hidden_size
        self.builder = BatchBuilder.for_run(
            self.dataset, self.bucket_lengths, cfg.objective, self.draft_config, r.seed
        )

    def mean_tokens_per_batch(self) -> float:
        lengths = self.dataset.lengths
        return float(np.mean([lengths[list(s.seq_ids)].sum() for s in self.plan]))

    def batch_bytes(self, dtype) -> tuple[int, float]:
        """(largest, plan-weighted mean) bytes of one batch of hidden states."""
        from dflash_train.data.buckets import batch_size_for
        from dflash_train.pipeline.target_worker import features_nbytes

        p, k = self.cfg.pipeline, len(self.draft_config.target_layer_ids)
        per_bucket = {
            b: features_nbytes(
                batch_size_for(length, p.batch_size, p.batch_tokens),
                length,
                k,
                self.hidden_size,
                dtype,
            )
            for b, length in enumerate(self.bucket_lengths)
        }
        mean = sum(w * per_bucket[b] for b, w in self.weights.items())
        return max(per_bucket[b] for b in self.weights), mean

    def measure(self, device: torch.device) -> DeviceRates:
        """Target then drafter tokens/s on `device`, each for about `seconds` of timed work.

        The drafter loop also runs the target to get each batch's features (untimed), so its
        wall time is longer than `seconds` when the target is the slower of the two.
        """
        import torch

        from dflash_train.devices import (
            configure_cpu_threads,
            default_cpu_threads,
            enter_worker_thread,
            resolve_dtype,
        )
        from dflash_train.model.target import TargetFeatureExtractor

        m = self.cfg.model
        threads = default_cpu_threads(self.num_cpu_workers) if device.type == "cpu" else None
        enter_worker_thread(device)
        configure_cpu_threads(threads or 0)
        dtype = resolve_dtype(m.dtype, device)
        extractor = TargetFeatureExtractor(
            m.target, self.draft_config.target_layer_ids, device, dtype, m.trust_remote_code
        )
        specs = itertools.cycle(self.plan)
        target = self._time_target(extractor, specs, device)
        replica = self._replica(device, dtype)
        drafter = self._time_drafter(extractor, replica, specs, device)
        free = free_memory_bytes(device)
        del extractor, replica
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return DeviceRates(str(device), target, drafter, free, threads)

    def _replica(self, device, dtype):
        from dflash_train.model.draft import DFlashDraftModel
        from dflash_train.model.target import load_frozen_head
        from dflash_train.train.replica import DraftReplica

        model = DFlashDraftModel(self.draft_config)
        model.init_weights(seed=self.cfg.run.seed)
        head = load_frozen_head(self.cfg.model.target, self.cfg.model.trust_remote_code)
        return DraftReplica(
            model, head, device, dtype, self.cfg.objective, self.cfg.optim, total_steps=10_000
        )

    def _time_target(self, extractor, specs, device) -> Rate:
        from dflash_train.devices import synchronize

        rate = Rate()
        extractor(self.builder.build(next(specs)).input_ids)  # warm-up: lazy init, allocator
        synchronize(device)
        while rate.seconds < self.seconds or rate.batches < MIN_BATCHES:
            job = self.builder.build(next(specs))
            t0 = time.perf_counter()
            extractor(job.input_ids)
            synchronize(device)
            rate.add(job, time.perf_counter() - t0)
        return rate

    def _time_drafter(self, extractor, replica, specs, device) -> Rate:
        from dflash_train.devices import synchronize
        from dflash_train.pipeline.records import HSBatch

        def batch() -> HSBatch:
            job = self.builder.build(next(specs))
            return HSBatch(job, extractor(job.input_ids), 0.0)  # features: untimed

        warm = batch()
        replica.micro_step(warm)
        replica.apply(warm.job.weight_sum)
        rate = Rate()
        while rate.seconds < self.seconds or rate.batches < MIN_BATCHES:
            hs = batch()
            synchronize(device)
            t0 = time.perf_counter()
            replica.micro_step(hs)
            replica.apply(hs.job.weight_sum)
            synchronize(device)
            rate.add(hs.job, time.perf_counter() - t0)
        return rate


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory where queued features of `device` live: CUDA free memory, or the host's
    MemAvailable (Linux) for CPU; None when unknown."""
    import torch

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
PIPELINE_FLAGS = ("data", "batch_size", "batch_tokens", "num_buckets", "bucket_lengths")


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


def parse_device_list(spec: str | None):
    import torch

    from dflash_train.devices import parse_devices

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
    from dflash_train.devices import resolve_dtype

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
    bmax, bmean = measurer.batch_bytes(resolve_dtype(cfg.model.dtype, target_devs[0]))
    sizing = recommend_depth(min_ready.value, bmax, bmean, budget)
    lines = _measure_lines(per_dev, devices)
    lines += _split_lines(split, devices, per_dev, tokens_per_batch)
    lines += ["", "hidden-state queue:", "  " + min_ready.explanation]
    where = "host" if target_devs[0].type == "cpu" else "target device"
    lines += [
        f"  features stay on the target device ({where} memory); budget = {memory_fraction:g} x "
        f"free {'unknown' if free is None else human_bytes(free)}"
    ]
    lines += ["  " + x for x in sizing.lines]
    flags = _flags(split, devices, sizing)
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
