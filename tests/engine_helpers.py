"""Helpers shared by the vLLM-backend tests: the cached vLLM environment (`bench engine`'s),
a tiny target vLLM's CPU build can run, and checks that no engine process outlives its run."""

from __future__ import annotations

import re
import time
from pathlib import Path

ENGINE_PID = re.compile(r"vLLM engine starting \(pid (\d+),")
# Measured on 2 shared CPU cores: an engine starts in 30-55 s (three Python processes import
# vLLM); the bound leaves room for a loaded machine.
ENGINE_TEST_TIMEOUT_S = 900


def vllm_python() -> str:
    """The interpreter of the vLLM CPU environment `dflash-train bench engine` builds and caches
    (built here on first use: about 2-3 minutes once)."""
    from dflash_train.bench.engine import default_cache_dir, ensure_vllm_env

    return str(ensure_vllm_env(default_cache_dir(), log=lambda _m: None).python)


def save_vllm_target(path: Path) -> Path:
    """A random 6-layer Qwen3 (hidden 64, vocab 256) whose attention vLLM's CPU kernels take
    (head dim 32: they refuse 16, the default tiny target's)."""
    from dflash_train.model.tiny import save_random_qwen3

    return save_random_qwen3(path, num_heads=2, num_kv_heads=1, head_dim=32, initializer_range=0.1)


def engine_pgids(log_text: str) -> list[int]:
    """The process groups of the engines a run said it started (each is its own session)."""
    return [int(m) for m in ENGINE_PID.findall(log_text)]


def shared_memory_segments() -> set[str]:
    """vLLM's message-queue segments in /dev/shm (multiprocessing's psm_* names)."""
    import os

    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}


def assert_no_engine_left(pgids: list[int], timeout_s: float = 15.0) -> None:
    """Not one process of those groups is alive (checked by pid in /proc)."""
    from dflash_train.engine.process import live_group_members

    assert pgids, "the run started no engine"
    deadline = time.monotonic() + timeout_s
    left = {g: live_group_members(g) for g in pgids}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {g: live_group_members(g) for g in pgids}
    assert not any(left.values()), f"engine processes left: {left}"
