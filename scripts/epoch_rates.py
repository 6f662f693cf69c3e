"""A run's throughput in one epoch, and its feature reads, from its metrics.jsonl.

    python scripts/epoch_rates.py RUN_DIR [--epoch 2]

Training tokens per second over the log intervals that end inside the epoch (each interval's
rate weighted by its wall time), the mean stage times per batch of the target forward or the
feature read and of the drafters' wait for a batch, and with a feature store the bytes read per
batch and the read bandwidth (over wall time, all readers together; and per second a reader
was busy). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path


def mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return sum(values) / len(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--epoch", type=int, default=2, help="1-based epoch (default 2)")
    args = parser.parse_args()
    lines = (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    rows = [r for r in rows if "train/tokens_per_s" in r]
    picked, tokens, seconds = [], 0.0, 0.0
    for prev, row in itertools.pairwise(rows):
        if args.epoch - 1 < row["train/epoch"] <= args.epoch:
            dt = row["time"] - prev["time"]
            tokens += row["train/tokens_per_s"] * dt
            seconds += dt
            picked.append(row)
    out = {
        "run": args.run_dir,
        "epoch": args.epoch,
        "log_intervals": len(picked),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
    }
    for key in (
        "time/target_forward_s",
        "time/feature_read_s",
        "time/drafter_get_wait_s",
        "queue/consumer_starved_frac",
        "store/read_bytes_per_batch",
        "store/read_MiB_per_s",
        "store/read_MiB_per_busy_s",
    ):
        value = mean(picked, key)
        if value is not None:
            out[key] = round(value, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
