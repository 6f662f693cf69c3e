"""SIGINT / SIGTERM during a run: a request to stop gracefully; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType, TracebackType

import numpy as np

from dflash_train.pipeline.distributed import NodeGroup

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}
REPEAT_WINDOW_S = 5.0
"""Under torchrun, the same signal again within this many seconds is the same request arriving
twice: a scheduler (or a terminal's Ctrl-C) signals every process of a job, torchrun among
them, and torchrun forwards it to its workers, so each worker gets it twice within
milliseconds."""


def launched_by_torchrun() -> bool:
    """Whether this process is a torchrun worker (torchrun sets TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


class StopSignals:
    """While active (a context manager, main thread only), the first SIGINT or SIGTERM is only
    recorded in `received` (the run's main loop polls it and stops in order); a second one
    exits the process at once with status 128 + signal number, unless it is the same signal
    within `repeat_window_s` of the first (default: `REPEAT_WINDOW_S` under torchrun, else 0;
    the same request delivered twice, see there).

    The handler does nothing but set a field: the main thread may be inside a lock (a queue's,
    a logger's) when a signal arrives, so stopping happens in the main loop, not here.
    """

    def __init__(self, repeat_window_s: float | None = None) -> None:
        if repeat_window_s is None:
            repeat_window_s = REPEAT_WINDOW_S if launched_by_torchrun() else 0.0
        self.repeat_window_s = repeat_window_s
        self.received: int | None = None
        self._at = 0.0  # time.monotonic() of the first signal
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str | None:
        return None if self.received is None else NAMES.get(self.received, str(self.received))

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is not None:
            if signum == self.received and time.monotonic() - self._at < self.repeat_window_s:
                return  # the first request again (forwarded by a launcher): already stopping
            os._exit(128 + signum)  # the second signal: no more waiting
        self.received, self._at = signum, time.monotonic()


def job_signal(signals: StopSignals, nodes: NodeGroup | None) -> str | None:
    """The signal that stopped the job: this process's, or in a multi-node job any node's (a
    node that got none stopped at the agreed step too). Every node calls it at the same point:
    one small collective."""
    if nodes is None:
        return signals.name
    kinds = sorted(NAMES, reverse=True)  # SIGTERM (a scheduler's) before SIGINT
    mine = np.array([int(signals.received == k) for k in kinds], dtype=np.int32)
    counts = nodes.sum_counts(mine)
    return next((NAMES[k] for k, n in zip(kinds, counts, strict=True) if n), None)
