"""`dflash-train bench queue`: what one item costs to pass through `BufferedHSQueue`, and that
none is lost or handed out twice, with 8 producers and 8 consumers hammering it.

Per item, overhead = wall time of the `put` call that added it + wall time of the `get` call that
returned it. So that this measures the queue's own work (locking, bookkeeping, the pull mode's
choice) and not waiting for data, the depth bound is off by default (`--depth` = items) and
consumers start once producers have a head start, then only call `get` while at least `--lag`
items are buffered (or the producers are done). The times still include waiting for the GIL and
the queue's lock behind the other 15 threads: that contention is part of the cost.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_train.bench.common import BenchReport, add_json_argument, add_seed_argument, emit
from dflash_train.pipeline.queue import END, MIX_MODES, BufferedHSQueue
from dflash_train.pipeline.workers import WorkerGroup

NUM_BUCKETS = 4


@dataclass
class QueueRun:
    """Timings and delivery counts of one mode's run."""

    mode: str
    put_ns: np.ndarray
    get_ns: np.ndarray
    delivered: np.ndarray
    wall_s: float
    starved_s: float
    blocked_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return int((self.delivered == 0).sum())

    @property
    def duplicated(self) -> int:
        """Extra deliveries: an item handed out k > 1 times counts k - 1."""
        return int(np.maximum(self.delivered - 1, 0).sum())

    def row(self) -> dict[str, Any]:
        total_us = (self.put_ns + self.get_ns) / 1000
        got = self.delivered > 0
        return {
            "mode": self.mode,
            "items": len(self.delivered),
            "overhead_us_p50": float(np.percentile(total_us[got], 50)) if got.any() else 0.0,
            "overhead_us_p99": float(np.percentile(total_us[got], 99)) if got.any() else 0.0,
            "put_us_p50": float(np.percentile(self.put_ns, 50) / 1000),
            "get_us_p50": float(np.percentile(self.get_ns[got], 50) / 1000) if got.any() else 0.0,
            "items_per_s": len(self.delivered) / self.wall_s,
            "lost": self.lost,
            "duplicated": self.duplicated,
            "consumer_starved_s": self.starved_s,
            "producer_blocked_s": self.blocked_s,
            "problems": self.problems,
        }


def run_mode(
    mode: str,
    items: int,
    producers: int,
    consumers: int,
    depth: int,
    lag: int,
    seed: int,
) -> QueueRun:
    """Pass `items` integers through one queue; time every put and get."""
    weights = {b: 1.0 / NUM_BUCKETS for b in range(NUM_BUCKETS)}
    group = WorkerGroup()
    q: BufferedHSQueue[int] = BufferedHSQueue(
        depth,
        1,
        producers,
        mix=mode,
        bucket_weights=weights,  # type: ignore[arg-type]
        stop_event=group.stop_event,
        seed=seed,
        name=f"bench queue ({mode})",
    )
    put_ns = np.zeros(items, dtype=np.int64)
    get_ns = np.zeros(items, dtype=np.int64)
    got: list[list[int]] = [[] for _ in range(consumers)]
    ended = [False] * consumers
    clock = time.perf_counter_ns

    def produce(rank: int) -> None:
        for item in range(rank, items, producers):
            t0 = clock()
            q.put(item, bucket=item % NUM_BUCKETS, seq=item)  # items are plan positions
            put_ns[item] = clock() - t0  # each item is written by exactly one thread

    def consume(rank: int) -> None:
        mine = got[rank]
        while True:
            if len(q) < lag and q.producers_alive > 0:
                time.sleep(0.0001)  # stay off the lock until enough is buffered: time work only
                continue
            t0 = clock()
            item = q.get()
            dt = clock() - t0
            if item is END:
                ended[rank] = True
                return
            get_ns[item] = dt  # a duplicate would overwrite; it is counted in `delivered`
            mine.append(item)

    t_start = time.perf_counter()
    for p in range(producers):
        group.spawn(f"producer-{p}", produce, p, on_exit=q.producer_done)
    head_start = min(items, 10 * lag)
    while q.stats().put_total < head_start and group.alive():
        time.sleep(0.001)
    for c in range(consumers):
        group.spawn(f"consumer-{c}", consume, c)
    left = group.join(timeout_s=120.0 + items / 1000)
    wall = time.perf_counter() - t_start
    problems = []
    if left:
        q.stop()
        problems.append(f"threads still running: {left}")
        group.join(timeout_s=10.0)
    if (err := group.first_error()) is not None:
        problems.append(str(err.to_exception()).splitlines()[0])
    all_got = np.fromiter((i for lst in got for i in lst), dtype=np.int64)
    delivered = np.bincount(all_got, minlength=items)[:items]
    stats = q.stats()
    if not all(ended):
        problems.append(f"{ended.count(False)} consumers never received END")
    if stats.put_total != items or stats.got_total != len(all_got):
        problems.append(
            f"counters: {stats.put_total} put, {stats.got_total} got, {len(all_got)} received, "
            f"{items} expected"
        )
    run = QueueRun(
        mode, put_ns, get_ns, delivered, wall, stats.consumer_starved_s, stats.producer_blocked_s
    )
    if run.lost or run.duplicated:
        problems.append(f"{run.lost} items lost, {run.duplicated} duplicated")
    run.problems = [f"{mode}: {p}" for p in problems]
    return run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--items", type=int, default=100_000, help="items per mode")
    parser.add_argument("--producers", type=int, default=8, help="producer threads")
    parser.add_argument("--consumers", type=int, default=8, help="consumer threads")
    parser.add_argument(
        "--depth",
        type=int,
        default=0,
        help="queue depth bound (default: 0 = the item count, so puts never block)",
    )
    parser.add_argument(
        "--lag",
        type=int,
        default=64,
        help="consumers call get only while this many items are buffered (default: 64)",
    )
    parser.add_argument(
        "--modes", default=",".join(reversed(MIX_MODES)), help="pull modes (default: %(default)s)"
    )
    add_seed_argument(parser)
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    for name in ("items", "producers", "consumers", "lag"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be positive")
    if args.depth < 0:
        raise ValueError("--depth must be >= 0")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MIX_MODES for m in modes):
        raise ValueError(f"--modes: choose from {', '.join(MIX_MODES)}, got {args.modes!r}")
    depth = args.depth or args.items
    runs = [
        run_mode(m, args.items, args.producers, args.consumers, depth, args.lag, args.seed)
        for m in modes
    ]
    rows = [r.row() for r in runs]
    report = BenchReport(
        title=(
            f"bench queue: {args.producers} producers x {args.consumers} consumers, "
            f"{args.items:,} items per mode through BufferedHSQueue (depth {depth}, min_ready 1)"
        ),
        columns=[
            "mode",
            "items",
            "overhead_us_p50",
            "overhead_us_p99",
            "put_us_p50",
            "get_us_p50",
            "items_per_s",
            "lost",
            "duplicated",
        ],
        rows=rows,
        problems=[p for r in runs for p in r.problems],
    )
    report.summary = {
        # Headline: the worst mode, so no pull mode hides behind a cheaper one.
        "overhead_us_p50": max(r["overhead_us_p50"] for r in rows),
        "overhead_us_p99": max(r["overhead_us_p99"] for r in rows),
        "lost": sum(r.lost for r in runs),
        "duplicated": sum(r.duplicated for r in runs),
        "items": args.items,
        "producers": args.producers,
        "consumers": args.consumers,
    }
    report.notes.append(
        "overhead = wall time of an item's put + its get, including waits for the GIL and the "
        "queue lock behind the other threads; headline figures are the worst mode's"
    )
    return emit(report, args.json)
