"""`dflash-train bench NAME ...`: routes to one benchmark module, imported only when chosen.

Each benchmark module exposes `add_arguments(parser)` and `main(args) -> int`, like a top-level
command. Importing lazily keeps `bench queue` free of torch start-up it does not need, and lets
every other benchmark work when one module (e.g. `bench step`, written separately) is missing
or broken.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

BENCHMARKS: dict[str, tuple[str, str]] = {
    "pipeline": (
        "dflash_train.bench.pipeline",
        "achieved / ideal throughput of the real pipeline with simulated compute",
    ),
    "gap": (
        "dflash_train.bench.gap",
        "a whole training run's seconds per step, part by part, next to its step alone",
    ),
    "padding": (
        "dflash_train.bench.padding",
        "padded-token fraction: fitted buckets vs first-in-first-out batches",
    ),
    "mix": (
        "dflash_train.bench.mix",
        "length mix drawn by drafters when one bucket arrives faster (fifo/random/stratified)",
    ),
    "plan": (
        "dflash_train.bench.plan",
        "a prepared dataset as train plans it: padding, the mix per 50-step window, queue age",
    ),
    "queue": (
        "dflash_train.bench.queue",
        "BufferedHSQueue put+get overhead per item, 8 producers x 8 consumers, nothing lost",
    ),
    "loss": (
        "dflash_train.bench.loss",
        "peak memory of each LM-head loss (ce, kl, lk) vs anchors: fused chunked vs direct",
    ),
    "gpu": (
        "dflash_train.bench.gpu",
        "the one-GPU check: step MFU per kernel and compile, the full pipeline, CUDA tests",
    ),
    "scale": (
        "dflash_train.bench.scale",
        "projected step efficiency of 1-64 nodes x 8 devices (gradient + Muon all-reduces)",
    ),
    "engine": (
        "dflash_train.bench.engine",
        "vLLM's CPU build serves the exported drafter: greedy output and every cycle's acceptance",
    ),
    "target": (
        "dflash_train.bench.target",
        "target features from the hf backend vs a vLLM engine: tokens/s, wait per batch, MB cost",
    ),
    "optimizer": (
        "dflash_train.bench.optimizer",
        "Muon's step per replica: every replica orthogonalising all vs its share, summed",
    ),
    "dispatch": (
        "dflash_train.bench.dispatch",
        "ATen operations (kernel launches on a GPU) per drafter micro-step, by phase and name",
    ),
    "step": (
        "dflash_train.bench.step",
        "drafter training step: tokens/s and peak memory per attention path and chunk size",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    width = max(map(len, BENCHMARKS))
    listing = "\n".join(f"  {n:<{width}}  {desc}" for n, (_, desc) in BENCHMARKS.items())
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        f"benchmarks:\n{listing}\n\nRun `dflash-train bench NAME --help` for a benchmark's flags. "
        "Each prints a table, writes --json OUT, and exits 1 if its own invariants break."
    )
    parser.add_argument("benchmark", choices=list(BENCHMARKS), metavar="NAME", help="benchmark")
    # Everything after NAME belongs to that benchmark's own parser.
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


def load(name: str):
    """The benchmark module; a missing one is a user-facing error, not a traceback."""
    module_name = BENCHMARKS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # a dependency of the module is missing: show the real cause
        raise ValueError(f"benchmark {name!r} is not available in this installation") from e


def benchmark_parser(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of benchmark `name` and its parser (the docs' reference reads it too)."""
    module = load(name)
    parser = argparse.ArgumentParser(
        prog=f"dflash-train bench {name}", description=BENCHMARKS[name][1]
    )
    module.add_arguments(parser)
    return module, parser


def main(args: argparse.Namespace) -> int:
    module, parser = benchmark_parser(args.benchmark)
    return int(module.main(parser.parse_args(args.bench_args)) or 0)
