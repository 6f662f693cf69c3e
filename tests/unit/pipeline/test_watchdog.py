"""The stall watchdog declares a stall whatever fails while it describes it."""

from __future__ import annotations

import threading

import pytest

from dflash_train.pipeline.monitor import Watchdog


@pytest.mark.parametrize("describe_fails, log_fails", [(True, False), (False, True), (True, True)])
def test_a_stall_is_declared_even_when_describing_it_or_logging_it_fails(describe_fails, log_fails):
    """Regression: an exception in `describe` (an engine's health answer that is not JSON) or
    in `log` (a closed stderr) ended the watchdog's thread before `on_stall`: hang detection
    was off for the rest of the run."""
    stalled = threading.Event()
    messages: list[str] = []

    def describe():
        if describe_fails:
            raise ValueError("health answer is not JSON")
        return "queues empty"

    def log(_line):
        if log_fails:
            raise BrokenPipeError("stderr closed")

    def on_stall(message):
        messages.append(message)
        stalled.set()

    dog = Watchdog(0.2, lambda: (0,), describe, on_stall, log=log, poll_s=0.02)
    dog.start()
    assert stalled.wait(10)
    dog.stop()
    assert messages[0].startswith("no pipeline progress for 0s")
    want = "could not be described: ValueError" if describe_fails else "(queues empty)"
    assert want in messages[0]
