"""The feature stage alone: the target's forward vs reads from stores, batch by batch.

    python scripts/feature_stage_rates.py --target TARGET --data PREPARED \
        --store fp32=STORE --store fp8=STORE [--target-layer-ids 0] [--batches 200]

Plans the epoch-1 batches as `train` would (work batching by block positions, the defaults of
`--batch-size`, `--num-anchors` and buckets, or the flags given), then for each of `--batches`
of them runs every source once in turn, round robin on one thread (`torch` with 1 thread), so
load from other work on the machine falls on every source alike. Prints one JSON line per
source: tokens per second (the batches' real tokens over the seconds that source took), the
mean seconds per batch, and for a store the bytes read per batch and MiB per second.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_train.config import TrainConfig
from dflash_train.model.target import TargetFeatureExtractor
from dflash_train.store.reader import StoreReader
from dflash_train.store.store import FeatureStore
from dflash_train.train.setup import TrainingData


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--store", action="append", default=[], metavar="NAME=DIR")
    parser.add_argument("--target-layer-ids", default=None)
    parser.add_argument("--num-anchors", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    flags = {"target": args.target, "data": args.data, "batch_cost": "blocks"}
    flags |= {"num_anchors": args.num_anchors, "batch_size": args.batch_size}
    if args.target_layer_ids:
        flags["target_layer_ids"] = [int(i) for i in args.target_layer_ids.split(",")]
    cfg = TrainConfig.from_layers(flags)
    data = TrainingData.load(cfg, epochs=1)
    ids = data.draft_config.target_layer_ids
    cpu = torch.device("cpu")
    sources = {"online": TargetFeatureExtractor(args.target, ids, cpu, torch.float32)}
    readers = {}
    for spec in args.store:
        name, path = spec.split("=", 1)
        readers[name] = StoreReader(FeatureStore.open(path), ids, cpu, torch.float32)
    seconds = dict.fromkeys([*sources, *readers], 0.0)
    tokens = 0
    jobs = [data.builder.build(s) for s in data.plans.epoch(0)[: args.batches]]
    for job in jobs:
        tokens += job.num_tokens
        for name, source in sources.items():
            t0 = time.perf_counter()
            source(job.input_ids)
            seconds[name] += time.perf_counter() - t0
        for name, reader in readers.items():
            t0 = time.perf_counter()
            reader.read(job.seq_ids, job.input_ids)
            seconds[name] += time.perf_counter() - t0
    for name, s in seconds.items():
        out = {"source": name, "batches": len(jobs), "tokens_per_s": round(tokens / s, 1)}
        out["s_per_batch"] = round(s / len(jobs), 5)
        if name in readers:
            stats = readers[name].stats
            out["bytes_per_batch"] = round(stats.bytes / stats.batches)
            out["MiB_per_s"] = round(stats.bytes / stats.seconds / 2**20, 1)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
