"""Fixtures for the metrics tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fake_run import write_run


@pytest.fixture
def make_run(tmp_path: Path) -> Callable[..., Path]:
    """Factory: `make_run(name, **write_run_kwargs)` -> a fabricated run directory."""

    def make(name: str = "run", **kwargs: object) -> Path:
        return write_run(tmp_path / name, **kwargs)  # type: ignore[arg-type]

    return make
