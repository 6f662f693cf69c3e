"""A test-only fault plan: make a chosen stage raise, hang or slow down at a chosen call.

Off and free in normal runs: the plan is read once from the `DFLASH_FAULTS` environment variable,
which only tests set, and `point()` returns at once when it is empty. A plan is a JSON list of
faults, each
    {"stage": "checkpoint_write", "at": 2, "action": "hang", "seconds": 60}
- stage: where (`point(stage)` calls name their stage; see `STAGES`);
- at: which call of that stage, counted from 1 in this process (default 1); "every": true
  applies the fault to every call from `at` on;
- rank: only in that torchrun rank's process (default: every process);
- action: "raise" (`InjectedFault`, a RuntimeError), "hang" (sleep `seconds`, default 3600),
  "sleep" (the same, for a slow but alive stage), "jitter" (sleep a random time up to
  `seconds`, drawn from a generator seeded by `seed`: two runs with other seeds interleave
  their threads differently), "oom" (torch.OutOfMemoryError, as a device out of memory raises
  it), "disk_full" (OSError ENOSPC, as a full disk does).
Tests in the same process may also call `install(plan)`.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ENV = "DFLASH_FAULTS"
STAGES = (
    "prefetch",  # a prefetcher, before it builds a batch
    "target",  # a target worker, before its forward
    "engine",  # the vLLM engine process (--target-backend vllm), as it admits a batch: raise
    # ends the engine (it dies), hang stops it answering, sleep slows it down
    "reader",  # a feature reader (train --features, --cache-features), before a batch
    "store_write",  # a feature store writer, before each row (capture, --cache-features)
    "cost_probe",  # the trainer's drafter cost probe (--batch-cost auto), before each call
    "drafter_step",  # a drafter worker, before a micro-step
    "drafter_forward",  # the replica's forward (first thing of a micro-step)
    "drafter_backward",  # the replica's backward (before each backward call)
    "rendezvous",  # a drafter arriving at the step's rendezvous
    "eval",  # the in-loop evaluation
    "checkpoint_write",  # the checkpoint writer, between the tensor files
    "metrics_backend",  # an optional metric backend (TensorBoard, W&B) logging a line
    "telemetry",  # a GPU telemetry sample
)
ACTIONS = ("raise", "hang", "sleep", "jitter", "oom", "disk_full")


class InjectedFault(RuntimeError):
    """The error a "raise" fault raises."""


@dataclass(frozen=True)
class Fault:
    stage: str
    at: int = 1
    action: str = "raise"
    seconds: float = 3600.0
    every: bool = False
    rank: int | None = None
    """Only in the process of this torchrun rank (RANK); every process when None."""
    seed: int = 0
    """The "jitter" action's generator seed."""

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fault:
        fault = cls(**d)
        if fault.stage not in STAGES or fault.action not in ACTIONS or fault.at < 1:
            raise ValueError(f"{ENV}: bad fault {d} (stages {STAGES}, actions {ACTIONS})")
        return fault


_plan: list[Fault] = []
_jitter: dict[int, random.Random] = {}  # per fault of the plan (by position), for "jitter"
_calls: dict[str, int] = {}
_lock = threading.Lock()
_outside = threading.local()


def install(plan: list[dict[str, Any]] | None) -> None:
    """Replace the plan (None or [] turns faults off) and reset the call counters."""
    global _plan
    rank = int(os.environ.get("RANK", "0"))
    with _lock:
        faults = [Fault.from_dict(d) for d in plan or []]
        _plan = [f for f in faults if f.rank is None or f.rank == rank]
        _jitter.clear()
        _jitter.update({i: random.Random(f.seed) for i, f in enumerate(_plan)})
        _calls.clear()


@contextlib.contextmanager
def outside_stages() -> Iterator[None]:
    """Calls this thread makes into the stages' code outside the pipeline (the trainer's cost
    probe before the workers start) are not those stages' calls: no fault counts or fires."""
    _outside.on = True
    try:
        yield
    finally:
        _outside.on = False


def point(stage: str) -> None:
    """A place where a fault may strike; free when no plan is installed."""
    if not _plan or getattr(_outside, "on", False):
        return
    with _lock:
        n = _calls[stage] = _calls.get(stage, 0) + 1
        hits = [
            (f, _jitter[i].uniform(0.0, f.seconds) if f.action == "jitter" else f.seconds)
            for i, f in enumerate(_plan)
            if f.stage == stage and (n == f.at or (f.every and n > f.at))
        ]
    for fault, seconds in hits:
        if fault.action == "raise":
            raise InjectedFault(f"injected fault in {stage} (call {n})")
        if fault.action == "oom":
            import torch  # only when a test asks for it

            raise torch.OutOfMemoryError(f"injected: out of memory in {stage} (call {n})")
        if fault.action == "disk_full":
            raise OSError(errno.ENOSPC, f"No space left on device (injected in {stage})")
        time.sleep(seconds)


install(json.loads(os.environ[ENV]) if os.environ.get(ENV) else None)
