"""SIGINT / SIGTERM during a run: a request to stop gracefully; a second signal exits at once."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType, TracebackType

NAMES = {signal.SIGINT: "SIGINT", signal.SIGTERM: "SIGTERM"}


class StopSignals:
    """While active (a context manager, main thread only), the first SIGINT or SIGTERM is only
    recorded in `received` (the run's main loop polls it and stops in order); a second one
    exits the process at once with status 128 + signal number.

    The handler does nothing but set a field: the main thread may be inside a lock (a queue's,
    a logger's) when a signal arrives, so stopping happens in the main loop, not here.
    """

    def __init__(self) -> None:
        self.received: int | None = None
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
            os._exit(128 + signum)  # the second signal: no more waiting
        self.received = signum
