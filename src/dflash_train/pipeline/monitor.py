"""What the pipeline counts and watches: per-stage timings, exactly-once accounting of sequences,
and the stall watchdog."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable

import numpy as np

STAGES = (
    "prefetch_s",
    "target_forward_s",
    "target_put_wait_s",
    "drafter_get_wait_s",
    "drafter_forward_s",
    "drafter_backward_s",
    "optimizer_s",
    "grad_sync_s",
    "drafter_micro_step_s",
    "drafter_rendezvous_s",
    "drafter_apply_s",
    "drafter_listener_s",
)
"""The drafters' own loop is timed whole, on the host clock, part by part (`drafter_*_s` beside
the device stages inside them): a micro-step call (forward + backward + the host work around
them), the rendezvous (waiting for the other replicas + the reduce, `grad_sync_s`), the
optimizer call and rank 0's listener (step records, evaluation, checkpoints). With
`drafter_get_wait_s` they partition a drafter's wall time per step (`bench gap`)."""


class StageTimers:
    """Seconds and event counts per stage, summed over workers; read as deltas by the logger.

    The pipeline's own stages (`STAGES`) are always present; a caller may time more (the
    trainer's checkpoint copies and writes) under names of its own.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._counts = dict.fromkeys(STAGES, 0)

    def add(self, stage: str, seconds: float, count: int = 1) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds
            self._counts[stage] = self._counts.get(stage, 0) + count

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        with self._lock:
            return dict(self._seconds), dict(self._counts)


class Accounting:
    """Which (epoch, sequence id) pairs each stage handled, to prove nothing was lost or doubled.

    Stages: "read" (prefetchers), "target" (target workers), "trained" (committed optimizer
    steps). Counts per id are kept so a duplicate is visible, not absorbed.
    """

    STAGES = ("read", "target", "trained")

    def __init__(self, num_rows: int, epochs: int) -> None:
        self.num_rows, self.epochs = num_rows, epochs
        self._lock = threading.Lock()
        self._counts = {s: np.zeros((epochs, num_rows), dtype=np.uint16) for s in self.STAGES}

    def add(self, stage: str, epoch: int, seq_ids: Iterable[int]) -> None:
        ids = np.fromiter(seq_ids, dtype=np.int64)
        with self._lock:
            np.add.at(self._counts[stage][epoch], ids, 1)

    def totals(self) -> dict[str, int]:
        with self._lock:
            return {s: int(c.sum()) for s, c in self._counts.items()}

    def counts(self) -> np.ndarray:
        """A copy of every count, (stages, epochs, rows): what nodes sum into one accounting."""
        with self._lock:
            return np.stack([self._counts[s] for s in self.STAGES]).astype(np.int32)

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> Accounting:
        """An accounting holding `counts` (as from `counts()`, e.g. summed over nodes)."""
        _, epochs, rows = counts.shape
        acc = cls(rows, epochs)
        for s, c in zip(cls.STAGES, counts, strict=True):
            acc._counts[s] = c.astype(np.uint16)
        return acc

    def restore(self, done: np.ndarray) -> None:
        """Count the (epochs, rows) boolean `done` as read, processed and trained once each:
        what a run resumed from a checkpoint already did. Every id then still ends with exactly
        one count per stage."""
        assert done.shape == (self.epochs, self.num_rows), "done must be (epochs, rows)"
        with self._lock:
            for c in self._counts.values():
                c[...] = done

    def trained_bitmap(self, epoch: int) -> np.ndarray:
        """Ids trained in `epoch` (what a checkpoint stores for exact resume)."""
        with self._lock:
            return self._counts["trained"][epoch] > 0

    def problems(self, complete: bool) -> list[str]:
        """Duplicates anywhere; mismatches between stages; missing ids if the run `complete`d."""
        out = []
        with self._lock:
            for s, c in self._counts.items():
                dup = int((c > 1).sum())
                if dup:
                    out.append(f"{dup} sequences {s} more than once")
            if complete:
                for s, c in self._counts.items():
                    missing = int((c == 0).sum())
                    if missing:
                        out.append(f"{missing} (epoch, sequence) pairs never {s}")
        return out

    def per_epoch(self) -> list[dict[str, int | bool]]:
        """Numbers per epoch: sequences in the data, read, processed by targets, trained, and
        whether every sequence was trained exactly once."""
        with self._lock:
            return [
                {
                    "epoch": e,
                    "sequences": self.num_rows,
                    "read": int(self._counts["read"][e].sum()),
                    "target": int(self._counts["target"][e].sum()),
                    "trained": int(self._counts["trained"][e].sum()),
                    "trained_exactly_once": bool((self._counts["trained"][e] == 1).all()),
                }
                for e in range(self.epochs)
            ]

    def summary_line(self, complete: bool) -> str:
        t = self.totals()
        expected = self.num_rows * self.epochs
        status = "complete" if complete else "partial: the run ended before its data"
        line = (
            f"accounting ({status}): {t['read']} sequences read, {t['target']} processed by "
            f"targets, {t['trained']} trained"
        )
        if complete:
            line += f" (expected {expected})"
        problems = self.problems(complete)
        return line + ("; PROBLEMS: " + "; ".join(problems) if problems else "; all match")


class Watchdog:
    """Declares the pipeline hung when its progress marker has not moved for `timeout_s`.

    Runs on its own thread, so a stage stuck anywhere (a worker, or the main thread itself) is
    noticed. On a stall it logs every thread's stack once and calls `on_stall(message)` (which
    records the error and sets the stop event). Then, if `on_unresponsive` is set, it gives the
    caller `grace_s` to react (`stop()`); a caller that does not (its main thread is the stuck
    one) gets `on_unresponsive()` called from this thread, the last resort that saves and exits.
    """

    def __init__(
        self,
        timeout_s: float,
        marker: Callable[[], tuple],
        describe: Callable[[], str],
        on_stall: Callable[[str], None],
        log: Callable[[str], None] | None = None,
        poll_s: float = 0.25,
        on_unresponsive: Callable[[], None] | None = None,
        grace_s: float = 60.0,
    ) -> None:
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.marker, self.describe, self.on_stall = marker, describe, on_stall
        self.log = log
        self.on_unresponsive, self.grace_s = on_unresponsive, grace_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        last, since = self.marker(), time.monotonic()
        while not self._done.wait(self.poll_s):
            now, mark = time.monotonic(), self.marker()
            if mark != last:
                last, since = mark, now
            elif now - since > self.timeout_s:
                # Whatever fails in describing the stall, the stall is still declared: a
                # watchdog that died here would leave the hung run to hang.
                message = f"no pipeline progress for {self.timeout_s:.0f}s"
                try:
                    message += f" ({self.describe()})"
                except Exception as e:
                    message += f" (its state could not be described: {type(e).__name__}: {e})"
                if self.log is not None:
                    with contextlib.suppress(Exception):
                        self.log(f"watchdog: {message}; thread stacks:\n{thread_stacks()}")
                self.on_stall(message)
                if self.on_unresponsive is not None and not self._done.wait(self.grace_s):
                    self.on_unresponsive()
                return


def thread_stacks() -> str:
    """Every live thread's current stack, by name (for a hung run's log)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{stack}")
    return "\n".join(parts)
