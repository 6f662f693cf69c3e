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


@pytest.fixture
def one_thread():
    """One torch thread, for the modules that ask (`pytest.mark.usefixtures("one_thread")`):
    their small kernels run fastest on one of the machine's 2 shared cores."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A random 6-layer Qwen3 (hidden 64, vocab 256) saved as a HF model directory."""
    return save_random_qwen3(tmp_path_factory.mktemp("targets") / "qwen3_tiny")


@pytest.fixture(scope="session")
def tiny_lm(tiny_target):
    """`tiny_target` loaded as a causal LM (fp32, CPU), for the serving loop's tests; shared by
    every module that reads it, never modified."""
    from dflash_train.model.target import load_causal_lm

    torch.set_num_threads(1)  # session fixtures run before the function-scoped thread setting
    return load_causal_lm(tiny_target, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def tiny_continuations(tiny_lm):
    """`tiny_lm`'s greedy continuations of `drafter_fit`'s fitting prompts and its hidden
    states on them: what every fitted drafter of the session learns from."""
    from drafter_fit import greedy_continuations

    return greedy_continuations(tiny_lm)
