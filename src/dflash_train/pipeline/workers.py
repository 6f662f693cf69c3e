"""Named worker threads whose failures travel to the main thread.

Every worker runs inside `WorkerGroup.spawn`: it catches everything, records the error with the
worker's name and traceback, sets the shared stop event (so every other wait wakes up and exits),
runs its `on_exit` (e.g. a producer's `producer_done()`), and returns. `QueueStopped` after a stop
is a normal exit, not an error. The main thread polls `first_error()` and re-raises it as a
`PipelineError` naming the worker.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflash_train.devices import is_out_of_memory
from dflash_train.pipeline.queue import QueueStopped

if TYPE_CHECKING:
    import torch


EXIT_HUNG = 124
"""Exit status of a run the watchdog declared hung (as `timeout` reports a command it ended)."""


class DeviceOutOfMemory(ValueError):
    """A device ran out of memory on a batch: which device, where, and the batch's shape, so the
    user can lower the knob that sets it (a user error, not a bug: `ValueError`)."""

    def __init__(self, device: torch.device, where: str, shape: str) -> None:
        super().__init__(f"out of memory on {device} in the {where} ({shape})")
        self.device, self.where, self.shape = device, where, shape


@contextmanager
def out_of_memory_named(
    device: torch.device, where: str, shape: Callable[[], str]
) -> Iterator[None]:
    """Turns a device out of memory inside the block (CUDA's, or the host allocator's failure:
    `devices.is_out_of_memory`) into `DeviceOutOfMemory` naming `where` and `shape()`."""
    try:
        yield
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(e):
            raise
        raise DeviceOutOfMemory(device, where, shape()) from e


def causes(err: BaseException) -> list[BaseException]:
    """`err` and the errors it was raised from or while handling, outermost first (a worker's
    failure reaches the main thread as a `PipelineError` raised from it)."""
    out, seen = [], set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


class PipelineError(RuntimeError):
    """A worker failed; the message names it and carries its traceback; `worker` is its name."""

    worker: str = ""


@dataclass
class WorkerError:
    worker: str
    error: BaseException
    traceback: str

    def to_exception(self) -> PipelineError:
        err = PipelineError(
            f"worker {self.worker!r} failed: {type(self.error).__name__}: {self.error}\n"
            f"--- traceback of {self.worker} ---\n{self.traceback}"
        )
        err.__cause__ = self.error
        err.worker = self.worker
        return err


class WorkerGroup:
    """Threads sharing one stop event; the first error wins and stops the rest."""

    def __init__(self, stop_event: threading.Event | None = None) -> None:
        self.stop_event = stop_event or threading.Event()
        self.threads: list[threading.Thread] = []
        self._errors: list[WorkerError] = []
        self._lock = threading.Lock()

    def spawn(
        self,
        name: str,
        fn: Callable[..., Any],
        *args: Any,
        on_exit: Callable[[], None] | None = None,
    ) -> threading.Thread:
        t = threading.Thread(
            target=self._run, args=(name, fn, args, on_exit), name=name, daemon=True
        )
        self.threads.append(t)
        t.start()
        return t

    def _run(self, name, fn, args, on_exit) -> None:
        try:
            fn(*args)
        except QueueStopped:
            if not self.stop_event.is_set():  # a stop we did not ask for is a bug
                self._record(name, RuntimeError("queue stopped without a stop request"))
        except BaseException as e:  # a worker must never die silently
            self._record(name, e)
        finally:
            if on_exit is not None:
                try:
                    on_exit()
                except BaseException as e:  # on_exit failing is an error of its own
                    self._record(name, e)

    def _record(self, name: str, error: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        with self._lock:
            self._errors.append(WorkerError(name, error, tb))
        self.stop_event.set()

    def fail(self, name: str, error: BaseException) -> None:
        """Record an error found outside a worker (e.g. the watchdog) and stop everything."""
        self._record(name, error)

    def first_error(self) -> WorkerError | None:
        with self._lock:
            return self._errors[0] if self._errors else None

    def alive(self) -> list[str]:
        return [t.name for t in self.threads if t.is_alive()]

    def join(self, timeout_s: float) -> list[str]:
        """Join every thread within a shared deadline; returns the names still alive."""
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        return self.alive()
