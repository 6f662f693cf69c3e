"""Helpers shared by the vLLM-backend tests: the cached vLLM environment (`bench engine`'s),
a tiny target vLLM's CPU build can run, checks that no engine process (and nothing of it in
/dev/shm) outlives its run, and the real engine server around a fake engine (no vLLM)."""

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
    """What an engine may leave in /dev/shm: vLLM's message-queue segments (multiprocessing's
    psm_* names) and the hand-over directories (`protocol.HANDOVER_PREFIX`)."""
    import os

    from dflash_train.engine.protocol import HANDOVER_PREFIX

    return {n for n in os.listdir("/dev/shm") if n.startswith(("psm_", HANDOVER_PREFIX))}


def assert_no_engine_left(pgids: list[int], timeout_s: float = 15.0) -> None:
    """Not one process of those groups is alive (checked by pid in /proc)."""
    from dflash_train.engine.protocol import live_group_members

    assert pgids, "the run started no engine"
    deadline = time.monotonic() + timeout_s
    left = {g: live_group_members(g) for g in pgids}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {g: live_group_members(g) for g in pgids}
    assert not any(left.values()), f"engine processes left: {left}"


# ---------------------------------------------------------------------- a fake engine server
def fake_values(ids, layer_ids: list[int], hidden: int):
    """What the fake engine computes: value = token id + DFlash layer id / 10 + channel / 100,
    (rows, L, len(layer_ids) * hidden) for (rows, L) token ids."""
    import torch

    rows, length = ids.shape
    parts = [
        ids[..., None].float() + i / 10 + torch.arange(hidden).float() / 100 for i in layer_ids
    ]
    return torch.cat(parts, dim=-1).reshape(rows, length, len(layer_ids) * hidden)


class FakeOutput:
    def __init__(self, request_id: str, params: dict | None) -> None:
        self.request_id, self.finished, self.kv_transfer_params = request_id, True, params


class FakeEngine:
    """LLMEngine's calls the server's loop makes; `step` finishes every waiting row and writes
    its hand-over file first, as the project's connector does (raw (n, K, hidden) fp32 bytes,
    renamed into place), under the id vLLM 0.32 gives the request inside (`ID-XXXXXXXX`, 8
    random characters), while its output names the id the loop gave. `prompts` records every
    row it was given."""

    def __init__(
        self,
        directory: Path,
        served: list[int],
        hidden: int,
        die_at_step: int | None = None,
        per_step: int | None = None,
    ) -> None:
        self.dir, self.served, self.hidden = directory, served, hidden
        self.die_at_step = die_at_step
        self.per_step = per_step  # rows finished per step (None: all waiting)
        self.waiting: list[tuple[str, list[int]]] = []
        self.prompts: list[list[int]] = []
        self.steps, self.aborted = 0, []

    def add_request(self, rid: str, prompt: list[int], params) -> None:
        if max(prompt) >= 1000:
            raise ValueError(f"token id {max(prompt)} is out of vocabulary")
        self.waiting.append((rid, prompt))
        self.prompts.append(list(prompt))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def abort_request(self, rids: list[str]) -> None:
        self.aborted += rids
        self.waiting = [(r, p) for r, p in self.waiting if r not in rids]

    def step(self) -> list[FakeOutput]:
        import os
        import uuid

        import numpy as np
        import torch

        from dflash_train.engine.protocol import handover_path

        self.steps += 1
        if self.die_at_step is not None and self.steps >= self.die_at_step:
            raise RuntimeError("the engine core died")
        outs = []
        done = self.waiting[: self.per_step]
        self.waiting = self.waiting[len(done) :]
        for rid, prompt in done:
            states = fake_values(torch.tensor([prompt]), self.served, self.hidden)[0]
            path = handover_path(str(self.dir), f"{rid}-{uuid.uuid4().hex[:8]}")
            states.numpy().astype(np.float32).tofile(path + ".part")
            os.replace(path + ".part", path)
            outs.append(FakeOutput(rid, {"hidden_states_path": path, "num_tokens": len(prompt)}))
        return outs


class FakeServer:
    """The real engine server (HTTP, loop, hand-over budget) around a `FakeEngine` (or what
    `engine(handover_dir)` makes), on a free port, its loop on a thread of its own; `target` is
    the directory whose weights it claims to serve (its digest goes in /health)."""

    def __init__(
        self,
        root: Path,
        target: Path,
        served: list[int],
        hidden: int,
        bound: int = 1 << 20,
        ttl_s: float = 60.0,
        clock=None,
        max_model_len: int = 64,
        engine=None,
        **fake,
    ) -> None:
        import os
        import threading
        import time

        from dflash_train.engine import jobs, protocol, server
        from dflash_train.model.digest import target_weights_digest

        self.dir = root / "handover"
        self.dir.mkdir(parents=True)
        (self.dir / protocol.TOKEN_FILE).write_text("t0k")
        info = {
            "target": str(target), "weights_digest": target_weights_digest(target),
            "target_layer_ids": served, "aux_layer_ids": [i + 1 for i in served],
            "hidden_size": hidden, "dtype": "float32", "max_model_len": max_model_len,
            "tensor_parallel_size": 1, "vllm_version": "fake", "pid": os.getpid(),
            "handover_dir": str(self.dir), "handover_token": "t0k", "handover_bytes": bound,
            "handover_ttl_s": ttl_s,
        }  # fmt: skip
        self.server = server.Server(("127.0.0.1", 0), info)
        self.server.budget = jobs.HandOverBudget(
            bound, str(self.dir), ttl_s, clock or time.monotonic
        )
        self.engine = engine(self.dir) if engine else FakeEngine(self.dir, served, hidden, **fake)
        self.server.loop = jobs.EngineLoop(
            self.engine, None, lambda prompt_token_ids: prompt_token_ids, str(self.dir)
        )
        self.info = info
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.stop = threading.Event()
        self.error: list[BaseException] = []
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        try:
            self.server.loop.run(self.stop)
        except BaseException as e:
            self.error.append(e)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[str]:
        import os

        from dflash_train.engine import protocol

        return sorted(set(os.listdir(self.dir)) - {protocol.TOKEN_FILE})


# ---------------------------------------------------------------------- a fake vLLM package
FAKE_VLLM = {
    "vllm/__init__.py": """
__version__ = "fake"


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw
""",
    "vllm/inputs.py": """
def TokensPrompt(prompt_token_ids):
    return prompt_token_ids
""",
    "vllm/config.py": """
class KVTransferConfig:
    def __init__(self, **kw):
        self.__dict__.update(kw)
""",
    "vllm/engine/__init__.py": "",
    "vllm/engine/arg_utils.py": """
class EngineArgs:
    def __init__(self, **kw):
        self.kw = kw
""",
    "vllm/v1/__init__.py": "",
    "vllm/v1/engine/__init__.py": "",
    "vllm/v1/engine/llm_engine.py": """
import json
import os
import types

STRAGGLER = '''
import mmap, os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(f"/dev/shm/fake-vllm-straggler-{os.getpgrp()}", "w+b") as f:  # as vLLM's broadcast
    f.truncate(4096)
    held = mmap.mmap(f.fileno(), 4096)
time.sleep(600)
'''


class LLMEngine:
    '''What the server uses of vLLM's engine: the config it runs with; no request ever
    finishes (the tests here are about starting and stopping).'''

    @classmethod
    def from_engine_args(cls, args):
        return cls(args.kw)

    def __init__(self, kw):
        config = json.loads(open(os.path.join(kw["model"], "config.json")).read())
        model = types.SimpleNamespace(
            dtype="torch." + kw["dtype"], max_model_len=kw["max_model_len"],
            get_hidden_size=lambda: config["hidden_size"],
        )
        parallel = types.SimpleNamespace(tensor_parallel_size=kw["tensor_parallel_size"])
        self.vllm_config = types.SimpleNamespace(model_config=model, parallel_config=parallel)
        self.engine_core = types.SimpleNamespace(shutdown=lambda: None)
        if os.environ.get("FAKE_VLLM_STRAGGLER"):  # an engine core that outlives its shutdown
            import subprocess
            import sys

            subprocess.Popen([sys.executable, "-c", STRAGGLER])


    def has_unfinished_requests(self):
        return False
""",
}
"""Just enough of vLLM for the engine server to start, serve /health and stop: no GPU, no
model loaded (`fake_vllm_python`)."""


def fake_vllm_python(root: Path, straggler: bool = False) -> Path:
    """An interpreter for `EngineSpec.python` whose environment has the fake vLLM above: this
    Python with the fake package put in front of the engine's PYTHONPATH. `straggler`: the
    engine starts a child in its process group that ignores SIGTERM and is never stopped."""
    import sys

    for name, text in FAKE_VLLM.items():
        path = root / "site" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    wrapper = root / "python"
    wrapper.write_text(
        f"#!/bin/sh\n{'export FAKE_VLLM_STRAGGLER=1' if straggler else ''}\n"
        f'PYTHONPATH="{root / "site"}:$PYTHONPATH" exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper
