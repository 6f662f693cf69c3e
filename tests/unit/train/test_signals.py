"""StopSignals: the first signal asks for a graceful stop, a second exits at once, and under
torchrun the same signal delivered twice (the scheduler's and torchrun's forward) is one."""

from __future__ import annotations

import signal

import pytest

from dflash_train.train import signals as signals_module
from dflash_train.train.signals import StopSignals


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch):
    def fake_exit(code):
        raise Exited(code)

    monkeypatch.setattr(signals_module.os, "_exit", fake_exit)


def test_a_second_signal_exits_at_once_outside_torchrun(exits, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    s = StopSignals()
    s._handle(signal.SIGTERM, None)
    assert s.name == "SIGTERM"
    with pytest.raises(Exited, match="143"):
        s._handle(signal.SIGTERM, None)


def test_under_torchrun_the_same_signal_twice_is_one_request(exits, monkeypatch):
    """Regression: torchrun forwards the scheduler's SIGTERM to workers that already got it, so
    every worker exited at once instead of saving."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    s = StopSignals()
    s._handle(signal.SIGTERM, None)
    s._handle(signal.SIGTERM, None)  # the forwarded copy: still stopping in order
    assert s.received == signal.SIGTERM
    with pytest.raises(Exited, match="130"):
        s._handle(signal.SIGINT, None)  # another signal is a second request


def test_the_same_signal_after_the_window_exits(exits, monkeypatch):
    clock = iter([100.0, 100.0 + signals_module.REPEAT_WINDOW_S + 1])
    monkeypatch.setattr(signals_module.time, "monotonic", lambda: next(clock))
    s = StopSignals(repeat_window_s=signals_module.REPEAT_WINDOW_S)
    s._handle(signal.SIGTERM, None)
    with pytest.raises(Exited, match="143"):
        s._handle(signal.SIGTERM, None)
