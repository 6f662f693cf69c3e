"""`dflash-train bench scale`: the projected step efficiency of 1-64 nodes of 8 devices.

One node's real pipeline runs (prefetchers, queues, target workers, drafter workers, lockstep
rendezvous), its compute replaced by calibrated sleeps scaled from FLOPs, and the rendezvous'
cross-node step replaced by a simulated node group that sleeps for the all-reduce a ring of N
nodes would take. The nodes are assumed alike (no straggler node), so one node stands for all.

Costs, each stated and each a flag:
- drafter micro-step: `bench step`'s FLOPs of the Qwen3-8B drafter shape (5 layers, width 4096,
  block 16) on each planned batch's rows and blocks, at --mfu of --peak-tflops;
- target forward: 2 x --target-params x padded tokens, at --target-mfu of the same peak;
- all-reduce of the fp32 gradient buffer (drafter parameters x 4 bytes) across N nodes:
  ring, 2 (N - 1) / N x bytes / --link-gbps + 2 (N - 1) x --latency-us; within a node the sum
  over its drafters (already in every run, one node or many) is part of the measured step;
- with `--optimizer muon` (train's default) and more than one replica in all, a second ring
  all-reduce of that kind after the optimizer: the update exchange (`sync.UpdateExchange`),
  where the replicas sum their orthogonalised shares of Muon's matrices (fp32, the element
  count of the modelled drafter's Muon parameters, `optimizers.split_for_muon`: nearly all of
  its parameters, so about the gradient's size). The simulated replicas split the optimizer
  as train's do, so the pipeline's own exchange runs and its cross-node sum is slept. The
  optimizer's compute (each replica's share of Newton-Schulz, AdamW) is not modelled.
Then the pipeline runs `--time-scale` times faster than those costs (sleeps of milliseconds),
and every figure is scaled back.

"Hidden" means the all-reduces cost no throughput: while the targets are the bottleneck the
drafters wait for data anyway and the all-reduces fit in that wait. The first node count whose
projected efficiency (per-node batches/s against one node's) drops below --hidden-threshold is
where it stops hiding; the simulated pipeline measures the same beside it.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import BenchReport, add_json_argument, add_seed_argument, emit
from dflash_train.bench.pipeline import BLOCK_SIZE, Epoch, make_epoch
from dflash_train.bench.sim import Cost, SimulatedExtractor, SimulatedReplica, SleepClock, StepLog
from dflash_train.bench.step import RANDOM_TARGETS, step_flops
from dflash_train.config import OptimOptions, PipelineOptions
from dflash_train.data.buckets import bucket_weights
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import draft_config_from_target
from dflash_train.pipeline.build import Pipeline, PipelineSettings, TargetFeed
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.optimizers import split_for_muon

NODE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


class SimulatedNodes:
    """Stands in for `pipeline.distributed.NodeGroup` in the rendezvous and the update exchange:
    the other nodes are copies of this one (their host numbers add up N times), the gradient
    all-reduce costs a ring's time, slept, and so does the sum of `update_buffer` (the first
    replica's `update_share`, what `sync.UpdateExchange` sums across the nodes)."""

    def __init__(
        self,
        world_size: int,
        allreduce_s: float,
        clock: SleepClock,
        update_s: float = 0.0,
        update_buffer: torch.Tensor | None = None,
    ) -> None:
        self.world_size, self.rank, self.allreduce_s, self.clock = world_size, 0, allreduce_s, clock
        self.update_s, self.update_buffer = update_s, update_buffer

    @property
    def is_main(self) -> bool:
        return True

    def sum_step_numbers(self, values: list[float]) -> list[float]:
        # Once per step, like the gradient all-reduce that follows: its time is slept here.
        self.clock.sleep(self.allreduce_s)
        return [v * self.world_size for v in values]

    def sum_device(self, tensor: torch.Tensor) -> None:
        # The simulated replicas' buffers carry nothing. The gradient's time was slept above;
        # the update exchange's is slept here, when it sums its buffer.
        if self.update_buffer is not None and tensor is self.update_buffer:
            self.clock.sleep(self.update_s)


class ModelReplica(SimulatedReplica):
    """A drafter whose micro-step sleeps the cost model's time of that very batch; with `split`,
    a `stages.SplitReplica` as train's replicas are with Muon and more than one replica in all
    (the pipeline then runs its update exchange after `apply`, `finish` completing the step)."""

    def __init__(
        self, clock: SleepClock, seconds: dict[tuple[int, int], float], split: bool = False
    ) -> None:
        super().__init__(clock, Cost(0.0))
        self.seconds = seconds
        self.update_share: torch.Tensor | None = torch.zeros(8) if split else None

    def finish(self) -> None:
        pass  # the step was counted in `apply`

    def micro_step(self, batch: HSBatch) -> None:
        job = batch.job
        self.log.seconds.append(self.clock.sleep(self.seconds[(job.epoch, job.index)]))
        self.batches += 1


def ring_allreduce_s(nbytes: float, nodes: int, link_gbps: float, latency_us: float) -> float:
    """Seconds of a ring all-reduce of `nbytes` over `nodes` (bandwidth and latency terms)."""
    if nodes <= 1:
        return 0.0
    steps = 2 * (nodes - 1)
    return steps / nodes * nbytes / (link_gbps * 1e9 / 8) + steps * latency_us * 1e-6


@dataclass
class Model:
    """The costs of the drafter shape and its target, in real (unscaled) seconds."""

    drafter_params: int
    drafter_s_per_batch: np.ndarray  # per planned batch
    target_s_per_batch: np.ndarray
    muon_params: int = 0  # elements of Muon's matrices (its 2-D backbone weights)

    @property
    def grad_bytes(self) -> int:
        return 4 * self.drafter_params  # the flat fp32 gradient buffer

    @property
    def update_bytes(self) -> int:
        return 4 * self.muon_params  # `update_share`: the Muon matrices' slice of that buffer


def muon_exchanges(args: argparse.Namespace, nodes: int) -> bool:
    """Whether a step of `nodes` nodes has the update exchange: Muon, split over more than one
    replica in all (`DraftReplica.split_optimizer`)."""
    return args.optimizer == "muon" and nodes * (args.devices - args.targets) > 1


def allreduce_times(args: argparse.Namespace, model: Model, nodes: int) -> tuple[float, float]:
    """Seconds per step of the cross-node all-reduces: (the gradient's, the update exchange's;
    0 without Muon or with one replica in all)."""
    grad = ring_allreduce_s(model.grad_bytes, nodes, args.link_gbps, args.latency_us)
    update = (
        ring_allreduce_s(model.update_bytes, nodes, args.link_gbps, args.latency_us)
        if muon_exchanges(args, nodes)
        else 0.0
    )
    return grad, update


def drafter_parameters(cfg) -> tuple[int, int]:
    """(trainable parameters, Muon's share of them) of the drafter `cfg` describes: built on the
    meta device (no memory), split as train's optimizer splits it."""
    with torch.device("meta"):
        model = DFlashDraftModel(cfg)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon, _ = split_for_muon(named)
    return sum(p.numel() for _, p in named), sum(p.numel() for p in muon)


def cost_model(args: argparse.Namespace, epoch: Epoch) -> Model:
    target = RANDOM_TARGETS["qwen3-8b"]
    from transformers import Qwen3Config

    cfg = draft_config_from_target(Qwen3Config(**target), 5, BLOCK_SIZE, target["vocab_size"] - 1)
    params, muon = drafter_parameters(cfg)
    peak = args.peak_tflops * 1e12
    drafter, tgt = [], []
    builder = epoch.builder()
    for spec in epoch.plan:
        job = builder.build(spec)
        rows, length = job.input_ids.shape
        blocks = job.block_ids.shape[1] // BLOCK_SIZE
        flops = step_flops(cfg, rows, length, blocks, rows * blocks * (BLOCK_SIZE - 1))
        drafter.append(flops / (peak * args.mfu))
        tgt.append(2 * args.target_params * rows * length / (peak * args.target_mfu))
    return Model(int(params), np.array(drafter), np.array(tgt), int(muon))


def run_nodes(
    args: argparse.Namespace, epoch: Epoch, model: Model, nodes: int, clock: SleepClock
) -> dict[str, Any]:
    """One node's pipeline as one of `nodes` alike nodes; steady batches/s, scaled back."""
    scale = args.time_scale
    allreduce, update = allreduce_times(args, model, nodes)
    # Costs scale with each batch's own size in the unit the real cost follows.
    t_mean = model.target_s_per_batch.mean()  # the target's FLOPs follow its padded tokens
    sources = [
        SimulatedExtractor(clock, Cost(t_mean * scale, 0, i, float(epoch.padded_tokens().mean())))
        for i in range(args.targets)
    ]
    per_batch = {
        (spec.epoch, spec.index): float(t) * scale
        for spec, t in zip(epoch.plan, model.drafter_s_per_batch, strict=True)
    }
    split = muon_exchanges(args, nodes)
    replicas = [ModelReplica(clock, per_batch, split) for _ in range(args.devices - args.targets)]
    opts = PipelineOptions()
    settings = PipelineSettings(
        total_steps=1 << 30,
        hs_queue_depth=opts.hs_queue_depth,
        hs_min_ready=opts.hs_min_ready,
        bucket_weights=bucket_weights(epoch.plan),
        stall_timeout_s=120.0,
    )
    group = SimulatedNodes(
        nodes, allreduce * scale, clock, update * scale, replicas[0].update_share
    )
    steps = StepLog()
    pipe = Pipeline(
        settings,
        TargetFeed(epoch.plans, epoch.builder(), sources),
        replicas,
        listener=steps,
        nodes=group,  # type: ignore[arg-type]  # duck-typed NodeGroup
    )
    pipe.start()
    pipe.wait(timeout_s=600)
    pipe.shutdown()
    n = len(steps.times)
    lo, hi = n // 5, n - max(1, n // 10)
    rate = sum(steps.batches[lo + 1 : hi + 1]) / (steps.times[hi] - steps.times[lo])
    return {
        "nodes": nodes,
        "allreduce_s": allreduce + update,
        "update_exchange_s": update,
        "batches_per_s_per_node": rate * scale,
        "step_s": statistics.median(np.diff(steps.times[lo:hi])) / scale,
    }


FLAGS: tuple[tuple[str, type, Any, str], ...] = (
    ("--devices", int, 8, "devices per node"),
    ("--targets", int, 1, "target devices per node (the rest train drafters)"),
    ("--peak-tflops", float, 989.0, "bf16 dense peak per device (H100 / H200)"),
    ("--mfu", float, 0.45, "drafter step MFU (the GPU issue's target)"),
    ("--target-mfu", float, 0.5, "target forward MFU"),
    ("--target-params", float, 8.2e9, "target parameters (Qwen3-8B)"),
    ("--link-gbps", float, 400.0, "inter-node bandwidth per node, Gb/s"),
    ("--latency-us", float, 10.0, "per-hop latency of the ring, us"),
    ("--nodes", str, ",".join(map(str, NODE_COUNTS)), "node counts"),
    ("--batches", int, 300, "planned batches per simulated run"),
    ("--time-scale", float, 0.05, "simulated seconds per real second"),
    ("--hidden-threshold", float, 0.97, "efficiency below which the all-reduces show"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    default = OptimOptions().optimizer
    parser.add_argument(
        "--optimizer",
        choices=("muon", "adamw"),
        default=default,
        help="train's optimizer: with muon and more than one replica in all, each step also "
        "sums the replicas' orthogonalised shares of Muon's matrices across the nodes (the "
        f"update exchange, a second all-reduce) (default: {default})",
    )
    add_seed_argument(parser)
    add_json_argument(parser)


def projected_efficiency(args: argparse.Namespace, epoch: Epoch, model: Model, nodes: int) -> float:
    """The same question answered by arithmetic: a step lasts as long as the slower of the
    targets producing its batches and the slowest drafter plus the all-reduces (the
    gradient's, and with Muon the update exchange's)."""
    drafters = args.devices - args.targets
    rng = np.random.default_rng(args.seed)
    draws = rng.choice(model.drafter_s_per_batch, size=(2000, drafters))
    compute = float(draws.max(axis=1).mean())  # lockstep: the slowest replica of the step
    produce = drafters * float(model.target_s_per_batch.mean()) / args.targets
    allreduce = sum(allreduce_times(args, model, nodes))
    return max(produce, compute) / max(produce, compute + allreduce)


def main(args: argparse.Namespace) -> int:
    counts = sorted({int(x) for x in args.nodes.split(",") if x.strip()})
    if not counts or counts[0] < 1 or not 0 < args.targets < args.devices:
        raise ValueError("--nodes must be positive and 0 < --targets < --devices")
    if min(args.mfu, args.target_mfu, args.time_scale, args.link_gbps) <= 0:
        raise ValueError("--mfu, --target-mfu, --time-scale and --link-gbps must be positive")
    epoch = make_epoch(args.batches, args.seed, "work")
    model = cost_model(args, epoch)
    clock = SleepClock.calibrate()
    base = run_nodes(args, epoch, model, 1, clock) if counts[0] != 1 else None
    rows = [run_nodes(args, epoch, model, n, clock) for n in counts]
    one = base or rows[0]
    for r in rows:
        r["efficiency"] = r["batches_per_s_per_node"] / one["batches_per_s_per_node"]
        r["projected"] = projected_efficiency(args, epoch, model, r["nodes"])
        r["job_batches_per_s"] = r["batches_per_s_per_node"] * r["nodes"]
    stops = next((r["nodes"] for r in rows if r["projected"] < args.hidden_threshold), None)
    simulated = next((r["nodes"] for r in rows if r["efficiency"] < args.hidden_threshold), None)
    drafters = args.devices - args.targets
    report = BenchReport(
        title=(
            f"bench scale: {args.devices} devices per node ({args.targets} target : {drafters} "
            f"drafters), Qwen3-8B drafter shape ({model.drafter_params / 1e9:.2f}B params, "
            f"{model.grad_bytes / 2**30:.1f} GiB fp32 gradients), {args.optimizer}, ring "
            f"all-reduce at {args.link_gbps:g} Gb/s + {args.latency_us:g} us per hop"
        ),
        columns=[
            "nodes",
            "allreduce_s",
            "update_exchange_s",
            "step_s",
            "batches_per_s_per_node",
            "efficiency",
            "projected",
            "job_batches_per_s",
        ],
        rows=rows,
    )
    report.summary = {
        "drafter_s_per_batch": float(model.drafter_s_per_batch.mean()),
        "target_s_per_batch": float(model.target_s_per_batch.mean()),
        "grad_bytes": model.grad_bytes,
        "optimizer": args.optimizer,
        "muon_params": model.muon_params,
        "update_bytes": model.update_bytes if args.optimizer == "muon" else 0,
        "stops_hiding_at_nodes": stops,
        "stops_hiding_at_nodes_simulated": simulated,
        "hidden_threshold": args.hidden_threshold,
    }
    report.notes += [
        f"mean drafter micro-step {model.drafter_s_per_batch.mean():.3f} s, target forward "
        f"{model.target_s_per_batch.mean():.3f} s per batch (FLOPs at the stated MFU)",
        "allreduce_s = the cross-node all-reduces of a step: the fp32 gradient "
        f"({model.grad_bytes / 2**30:.2f} GiB) and "
        + (
            f"Muon's update exchange (update_exchange_s: the replicas' orthogonalised shares of "
            f"Muon's matrices, {model.muon_params / 1e9:.4f}B of the drafter's "
            f"{model.drafter_params / 1e9:.4f}B parameters, {model.update_bytes / 2**30:.2f} GiB "
            "fp32, summed after the optimizer; only with more than one replica in all)"
            if args.optimizer == "muon"
            else "no update exchange (AdamW: every replica steps whole)"
        ),
        "efficiency = N nodes' per-node batches/s over one node's (the simulated pipeline); "
        "projected = the same by arithmetic (slower of production and the slowest drafter plus "
        "the all-reduces); "
        + (
            f"the all-reduces stop hiding at {stops} nodes (projected)"
            if stops
            else "the all-reduces stay hidden at every node count (projected)"
        ),
        "assumed: alike nodes (no straggler), neither all-reduce overlapped with compute; "
        "not modelled: the optimizer's compute (Newton-Schulz of each replica's share, AdamW)",
    ]
    if any(math.isnan(r["batches_per_s_per_node"]) for r in rows):
        report.problems.append("a run finished too few steps to measure")
    return emit(report, args.json)
