"""Fabricated run directories: metrics.jsonl and config.json shaped like the trainer's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from dflash_train.metrics.logger import JsonlLogger

BLOCK_SIZE = 8
MAX_DEPTH = 90
MIN_READY = 30


def fake_metrics(step: int, total: int, rng: np.random.Generator) -> dict[str, float]:
    """One log line's worth of every metric family, with plausible, slowly improving values."""
    progress = step / total
    m: dict[str, float] = {
        "train/loss": 6.0 * math.exp(-3 * progress) + 1.2 + 0.15 * rng.standard_normal(),
        "train/lr": 6e-4 * min(1.0, step / 40) * (1 - 0.9 * progress),
        "train/grad_norm": float(np.exp(rng.normal(0.0, 0.4))) * (2.0 - progress),
        "train/tokens_per_s": 9500 + 400 * rng.standard_normal(),
        "train/seqs_per_s": 18 + rng.standard_normal(),
        "train/padding_frac": 0.08 + 0.03 * rng.random(),
        "train/epoch": step / 150,
    }
    accs = [min(0.95, (0.2 + 0.6 * progress) * 0.85**k) for k in range(BLOCK_SIZE - 1)]
    m.update({f"train/acc_k{k + 1}": a for k, a in enumerate(accs)})
    m["train/tau_est"] = 1 + sum(np.cumprod(accs))
    stages = {
        "prefetch": 0.004, "target_forward": 0.060, "target_put_wait": 0.010,
        "drafter_get_wait": 0.005, "drafter_forward": 0.030, "drafter_backward": 0.055,
        "optimizer": 0.006, "grad_sync": 0.004,
    }  # fmt: skip
    m.update({f"time/{k}_s": v * (1 + 0.2 * rng.random()) for k, v in stages.items()})
    buckets = rng.multinomial(int(40 + 30 * math.sin(step / 30)), [0.4, 0.3, 0.2, 0.1])
    m.update({f"queue/bucket{b}_depth": int(d) for b, d in enumerate(buckets)})
    m["queue/depth"] = int(buckets.sum())
    m["queue/bytes"] = m["queue/depth"] * 3.2e7
    m["queue/producer_blocked_frac"] = float(np.clip(0.3 + 0.2 * math.sin(step / 30), 0, 1))
    m["queue/consumer_starved_frac"] = float(np.clip(0.05 * rng.random(), 0, 1))
    m["queue/hol_wait_frac"] = float(np.clip(0.02 * rng.random(), 0, 1))
    m["queue/mix_tv"] = 0.05 + 0.05 * rng.random()
    m["queue/put_total"] = 2 * step + 40
    m["queue/get_total"] = 2 * step
    for d in range(2):
        m[f"gpu/{d}/util_pct"] = 85 + 10 * rng.random()
        m[f"gpu/{d}/mem_used_gb"] = 60 + d * 10 + rng.random()
        m[f"gpu/{d}/power_w"] = 550 + 50 * rng.random()
        m[f"gpu/{d}/temp_c"] = 60 + 5 * rng.random() + progress * 5
    return m


def write_run(
    run_dir: Path,
    *,
    steps: int = 400,
    every: int = 10,
    eval_every: int = 100,
    drop: str | None = None,
    config: bool = True,
) -> Path:
    """Write a fake run; `drop` is a key prefix (e.g. "queue/") left out of every line."""
    rng = np.random.default_rng(0)
    logger = JsonlLogger(run_dir)
    for step in range(every, steps + 1, every):
        metrics = fake_metrics(step, steps, rng)
        if drop is not None:
            metrics = {k: v for k, v in metrics.items() if not k.startswith(drop)}
        logger.log(step, metrics)
        if step % eval_every == 0:
            logger.log(step, {"eval/tau": 1.5 + 2.5 * step / steps})
    logger.close()
    if config:
        resolved = {
            "pipeline": {"hs_queue_depth": MAX_DEPTH, "hs_min_ready": MIN_READY},
            "run": {"out_dir": str(run_dir)},
        }
        (run_dir / "config.json").write_text(json.dumps(resolved))
    return run_dir
