"""Shared fixtures: tiny random targets built from configs (no downloads)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.model.tiny import save_random_qwen3


@pytest.fixture(autouse=True)
def _few_threads():
    """Small CPU thread pools: the CI machine has 2 cores."""
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A random 6-layer Qwen3 (hidden 64, vocab 256) saved as a HF model directory."""
    return save_random_qwen3(tmp_path_factory.mktemp("targets") / "qwen3_tiny")
