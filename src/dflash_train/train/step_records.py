"""What rank 0's drafter hands the main thread after each applied step, through a bounded queue.

The main thread turns the records into metric lines (the only host syncs) and progress. The
bound follows from the log interval: the main thread drains the queue continuously except while
it writes a log step, so two intervals of records plus slack mean rank 0 never waits on a
healthy main thread, while a stuck one stops rank 0 within two intervals (and the watchdog then
sees no progress) instead of letting records pile up.
"""

from __future__ import annotations

import collections
import queue
import threading
from dataclasses import dataclass, field

import torch

from dflash_train.devices import Mark
from dflash_train.pipeline.queue import QueueStopped
from dflash_train.pipeline.sync import StepOutcome


@dataclass
class StepRecord:
    """One applied optimizer step: its reduced outcome (device tensors) and host numbers.

    `ready`: marks after rank 0's lane queued the step (the reduce it waited for, its update
    and grad norm): the device tensors are written by then, on that lane, so the main thread
    waits for them before it reads (see `IntervalMetrics.add`).
    """

    outcome: StepOutcome
    grad_norm: torch.Tensor | None
    step: int
    lr: float
    ready: list[Mark] = field(default_factory=list)


@dataclass
class EvalRecord:
    """One in-training evaluation."""

    step: int
    tau: float
    seconds: float


class StepRecords:
    """A bounded FIFO of `StepRecord` / `EvalRecord`, one producer (rank 0), one consumer.

    A stop never loses a record: `put` on a stopped run (the queue full because the main thread
    is behind, or not) keeps the record aside and raises `QueueStopped`, so rank 0 stops without
    waiting; `get` hands it out after the queued ones. Rank 0 stops at that raise, so at most
    one record is ever set aside, and it is the last step's: its metric line is always logged.
    """

    def __init__(self, log_every: int, stop: threading.Event, poll_s: float = 0.1) -> None:
        self.bound = 2 * log_every + 8
        self._queue: queue.Queue[StepRecord | EvalRecord] = queue.Queue(maxsize=self.bound)
        self._stop, self._poll_s = stop, poll_s
        self._aside: collections.deque[StepRecord | EvalRecord] = collections.deque()

    def put(self, record: StepRecord | EvalRecord) -> None:
        """Blocks while the queue is full; once the run is stopping, keeps `record` for `get`
        and raises `QueueStopped`."""
        while True:
            if self._stop.is_set():
                self._aside.append(record)
                raise QueueStopped("step records: stopped while the main thread was behind")
            try:
                self._queue.put(record, timeout=self._poll_s)
                return
            except queue.Full:
                continue

    def get(self, timeout: float) -> StepRecord | EvalRecord | None:
        """The next record (the queued ones, then one kept aside by a stop), or None after
        `timeout` seconds without one."""
        try:
            return self._queue.get(timeout=timeout if not self._aside else 0.0)
        except queue.Empty:
            pass
        try:
            return self._aside.popleft()
        except IndexError:
            return None
