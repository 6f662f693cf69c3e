"""`dflash-train bench optimizer`: Muon's step per replica, whole vs split over the replicas.

Every replica of a step computes the same update. Unsplit, each one orthogonalises every
matrix (Newton-Schulz, five bf16 iterations per matrix); split (what `train` does with more
than one replica), each orthogonalises its share (`optimizers.balanced_shares`), the shares are
summed over the replicas (the pipeline's update exchange, here `sync.sum_into_all`) and each
applies every update. The replicas run in threads as the drafter workers do, and the two ways
alternate step by step in one process (a loaded machine slows both alike); the report gives the
median wall time of the optimizer phase, each replica's share of the Newton-Schulz FLOPs and
the two ways' results compared bit for bit.

The matrices are a drafter's Muon parameters at a target's shape (`--random-target`, as
`bench step`: `fc` and each draft layer's q, k, v, o, gate, up, down projections).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from dflash_train.bench.common import BenchReport, add_json_argument, emit
from dflash_train.bench.step import RANDOM_TARGETS
from dflash_train.devices import parse_devices, synchronize
from dflash_train.pipeline.sync import sum_into_all
from dflash_train.train.optimizers import Muon, balanced_shares, orthogonalise_flops


def drafter_matrices(shape: dict, layers: int, features: int) -> list[tuple[int, int]]:
    """The (rows, cols) of a drafter's Muon matrices at a target's shape."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]
    return [(h, features * h), *(per_layer * layers)]


class Replicas:
    """N copies of the matrices with their Muon, on `devices`, and one way of stepping them."""

    def __init__(self, shapes, devices: list[torch.device], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        base = [torch.randn(s, generator=g) * 0.02 for s in shapes]
        self.devices = devices
        self.params = [[torch.nn.Parameter(t.to(d, copy=True)) for t in base] for d in devices]
        self.optims = [Muon(ps, lr=1e-3) for ps in self.params]
        owners = balanced_shares(shapes, len(devices))
        self.owned = [[o == r for o in owners] for r in range(len(devices))]

    def set_grads(self, step: int) -> None:
        g = torch.Generator().manual_seed(1000 + step)
        grads = [torch.randn(p.shape, generator=g) for p in self.params[0]]
        for ps in self.params:
            for p, gr in zip(ps, grads, strict=True):
                p.grad = gr.to(p.device, copy=True)  # each replica its own buffer

    def step(self, split: bool) -> float:
        """One optimizer phase on every replica, in threads; its wall seconds."""
        barrier = threading.Barrier(len(self.devices))
        shares = [torch.empty(0)] * len(self.devices)

        def work(r: int) -> None:
            ps, opt = self.params[r], self.optims[r]
            if not split:
                opt.step()
            else:
                opt.begin(self.owned[r], [p.grad for p in ps])
                shares[r] = torch.cat([p.grad.flatten() for p in ps])
                if barrier.wait() == 0:  # the last to arrive sums, as the exchange does
                    sum_into_all(shares)
                barrier.wait()
                offset = 0
                for p in ps:
                    p.grad.copy_(shares[r][offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
                opt.finish([p.grad for p in ps])
            synchronize(self.devices[r])

        threads = [threading.Thread(target=work, args=(r,)) for r in range(len(self.devices))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0


def run(args: argparse.Namespace) -> BenchReport:
    devices = parse_devices(args.devices, "--devices")
    torch.set_num_threads(args.threads)
    shapes = drafter_matrices(RANDOM_TARGETS[args.random_target], args.draft_layers, args.features)
    whole, split = Replicas(shapes, devices, args.seed), Replicas(shapes, devices, args.seed)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(args.warmup + args.steps):
        for mode, reps in ((False, whole), (True, split)):
            reps.set_grads(step)
            seconds = reps.step(mode)
            if step >= args.warmup:
                times[mode].append(seconds)
    same = all(
        torch.equal(a.cpu(), b.cpu())
        for ra, rb in zip(whole.params, split.params, strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    total = sum(orthogonalise_flops(s) for s in shapes)
    mine = [
        sum(orthogonalise_flops(s) for s, own in zip(shapes, owned, strict=True) if own)
        for owned in split.owned
    ]
    t_whole, t_split = statistics.median(times[False]), statistics.median(times[True])
    report = BenchReport(
        title=(
            f"bench optimizer: Muon over {len(shapes)} matrices of a {args.draft_layers}-layer "
            f"drafter at {args.random_target}'s shape, {len(devices)} replicas on "
            f"{', '.join(map(str, devices))}, median of {args.steps} steps"
        ),
        columns=["way", "step_s", "ns_tflop_per_replica", "share_of_whole"],
        rows=[
            {
                "way": "whole",
                "step_s": t_whole,
                "ns_tflop_per_replica": total / 1e12,
                "share_of_whole": 1.0,
            },
            {
                "way": "split",
                "step_s": t_split,
                "ns_tflop_per_replica": max(mine) / 1e12,
                "share_of_whole": max(mine) / total,
            },
        ],
    )
    report.summary = {
        "split_vs_whole": t_split / t_whole,
        "replicas": len(devices),
        "ns_tflop_per_step": total / 1e12,
        "max_share_of_whole": max(mine) / total,
        "identical": same,
    }
    if not same:
        report.problems.append("the split step's weights differ from the whole step's")
    return report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--random-target",
        choices=sorted(RANDOM_TARGETS),
        default="qwen3-1.7b",
        help="the target shape the drafter's matrices follow (default: %(default)s)",
    )
    parser.add_argument("--draft-layers", type=int, default=1, help="draft layers (default: 1)")
    parser.add_argument(
        "--features", type=int, default=5, help="target layers fused by fc (default: 5)"
    )
    parser.add_argument(
        "--devices", default="cpu,cpu", help="one replica per device (default: cpu,cpu)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default: 1)"
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per way (default: 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default: 1)")
    parser.add_argument("--seed", type=int, default=0)
    add_json_argument(parser)


def _check(args: argparse.Namespace) -> None:
    """The flags' ranges, up front: one line each."""
    for name in ("draft_layers", "features", "steps", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")


def main(args: argparse.Namespace) -> int:
    _check(args)
    return emit(run(args), args.json)
