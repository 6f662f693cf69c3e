"""The engine process from the trainer's side: start it, know it is ready, stop it on every path.

`EngineProcess.start(spec)` runs `python -m dflash_train.engine.server` in the environment
`spec.python` names (vLLM pins its own torch and transformers, so it may be a venv of its own),
in a session of its own (its process group holds vLLM's engine core and workers too), with:
- PYTHONPATH = a directory holding only a link to this package, so the engine imports this
  package's engine modules (the server, the connector vLLM loads by module path) and nothing
  else of this environment;
- stdin a pipe the engine watches: when this process ends, however (even SIGKILL or the second
  Ctrl-C's immediate exit), the pipe closes and the engine ends its whole process group, so an
  engine never outlives its trainer;
- its log in a work directory of its own (kept with `stop(keep_log=...)`), the last lines of which
  every failure quotes;
- its hand-over directory (`--handover-dir`, under /dev/shm: memory), made here and removed by
  `stop` once the engine's group is gone, however the engine ended (SIGKILL after the grace, the
  OOM killer): the engine cannot remove it then, and it would hold up to --handover-bytes of
  memory until the next reboot. (If this process is killed first, the engine removes it before
  it ends its group; if both are, the next `new_handover_dir` does.)
Start-up waits for the server's ready file, the process's exit or `start_timeout_s`, whichever
comes first; a start-up failure is one `EngineStartError` line (a `ValueError`: the command exits
2). `stop()` sends SIGTERM to the group, waits, then SIGKILLs what is left, and checks by pid
that nothing of the group survives.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.engine import protocol

SERVER_MODULE = "dflash_train.engine.server"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../dflash_train
CPU_KV_CACHE_GIB = "2"
"""VLLM_CPU_KVCACHE_SPACE when unset: vLLM's CPU default reserves most of the memory and refuses
to start when less is free."""
ROOT_CAUSE = re.compile(r"Worker failed with error '(.+?)', please check")
EXCEPTION_LINE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)")
GENERIC = ("root cause above", "stack trace above")
"""vLLM's start-up errors that only point up the log: the line above them says what happened."""
STOP_GRACE_S = 20.0
LOG_TAIL_LINES = 12


class EngineStartError(ValueError):
    """The engine could not start (no vLLM there, a model it cannot load, no memory, a port in
    use, a time-out): one line naming the cause and the engine's log."""


class EngineError(RuntimeError):
    """The running engine failed, stopped answering or went away: the run cannot go on."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is started with (the server's command line, `server.py`)."""

    target: str
    layer_ids: list[int]
    """DFlash target layer ids (the server asks vLLM for ids + 1, `layers.py`)."""
    python: str
    """The interpreter of the environment with vLLM."""
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    tensor_parallel_size: int = 1
    cuda_devices: list[int] | None = None
    """The trainer's CUDA device indices the engine gets (as torch numbers them in the trainer:
    its CUDA_VISIBLE_DEVICES maps them, `engine_visible_devices`); None: it runs on CPU."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    start_timeout_s: float = 900.0
    port: int = 0
    """0: any free port (the server reports the one it bound)."""
    host: str = "127.0.0.1"

    def command(self, ready_file: Path, handover_dir: Path) -> list[str]:
        cmd = [self.python, "-m", SERVER_MODULE, "--target", self.target]
        cmd += ["--target-layer-ids", ",".join(map(str, self.layer_ids)), "--dtype", self.dtype]
        cmd += ["--max-model-len", str(self.max_model_len), "--host", self.host]
        cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size), "--port", str(self.port)]
        cmd += ["--ready-file", str(ready_file), "--exit-with-parent"]
        cmd += ["--handover-dir", str(handover_dir)]
        if self.cuda_devices is None:
            cmd.append("--enforce-eager")  # vLLM's CPU build: no graphs to capture
        if self.engine_args:
            cmd += ["--engine-args", json.dumps(self.engine_args)]
        return cmd

    def environment(self, package_path: Path) -> dict[str, str]:
        # PYTHONPATH: nothing of this environment there. PYTORCH_CUDA_ALLOC_CONF: the trainer's
        # allocator setting (expandable segments), which vLLM refuses beside a KV connector.
        dropped = ("PYTHONPATH", "PYTORCH_CUDA_ALLOC_CONF")
        env = {k: v for k, v in os.environ.items() if k not in dropped}
        env["PYTHONPATH"] = str(package_path)
        if self.cuda_devices is None:
            env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU engine takes no GPU (the drafters' least)
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
            if self.tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in env:
                env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(self.tensor_parallel_size)
        else:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(self.cuda_devices, visible)
        return env


def engine_visible_devices(indices: list[int], visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine on the trainer's CUDA devices `indices`, given the
    trainer's own `visible` setting: CUDA numbers the visible devices from 0, so under
    CUDA_VISIBLE_DEVICES=4,5,6,7 the trainer's cuda:0 is GPU 4, and a child handed "0" would
    take the machine's first GPU (another job's, or the drafters'). Entries are passed on as
    written (indices or UUIDs)."""
    if visible is None:
        return ",".join(map(str, indices))
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if missing := [i for i in indices if not 0 <= i < len(entries)]:
        raise EngineStartError(
            f"--target-devices cuda:{missing[0]} is not one of this process's GPUs "
            f"(CUDA_VISIBLE_DEVICES={visible})"
        )
    return ",".join(entries[i] for i in indices)


def cpu_thread_binding(ranks: int, cores: list[int] | None = None) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers: the cores this process may use, split
    into `ranks` groups of consecutive ones ("0,1|2,3"). vLLM's CPU build binds each tensor
    parallel rank to a NUMA node by default and refuses more ranks than nodes (one node here);
    the groups bind them by hand. Fewer cores than ranks: one line saying so."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < ranks:
        raise EngineStartError(
            f"--target-tp {ranks} on CPU needs a core per rank; this process may use "
            f"{len(cores)} ({cores})"
        )
    per, extra = divmod(len(cores), ranks)
    groups, start = [], 0
    for r in range(ranks):
        n = per + (r < extra)
        group = cores[start : start + n]
        start += n
        groups.append(",".join(map(str, group)))
    return "|".join(groups)


class EngineProcess:
    """A running engine this process started (see the module docstring)."""

    def __init__(
        self, spec: EngineSpec, proc: subprocess.Popen, work_dir: Path, handover: tuple[Path, int]
    ) -> None:
        self.spec, self.proc, self.work_dir = spec, proc, work_dir
        self.handover_dir, self._handover_hold = handover
        self.log_path = work_dir / "engine.log"
        self.info: dict[str, Any] = {}
        self.pgid = proc.pid  # the leader of its own session
        self.shared_memory: set[str] = set()
        """vLLM's own /dev/shm segments (its processes' message queues), removed by `stop` if
        an engine that died or was killed left them behind."""
        self._stopped = False

    @property
    def url(self) -> str:
        return str(self.info["url"])

    @classmethod
    def start(cls, spec: EngineSpec, say: Callable[[str], None] = print) -> EngineProcess:
        work_dir = Path(tempfile.mkdtemp(prefix="dflash-engine-"))
        package_path = work_dir / "dflash-path"  # not an importable name: shadows nothing
        package_path.mkdir()
        (package_path / "dflash_train").symlink_to(PACKAGE_DIR, target_is_directory=True)
        ready = work_dir / "ready.json"
        if not Path(spec.python).exists() and shutil.which(spec.python) is None:
            shutil.rmtree(work_dir, ignore_errors=True)
            raise EngineStartError(f"--vllm-python {spec.python}: no such interpreter")
        handover = protocol.new_handover_dir()
        try:
            with open(work_dir / "engine.log", "wb") as log:
                proc = subprocess.Popen(
                    spec.command(ready, handover[0]),
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=work_dir,
                    env=spec.environment(package_path),
                    start_new_session=True,
                )
        except BaseException:
            protocol.remove_handover_dir(*handover)
            shutil.rmtree(work_dir, ignore_errors=True)
            raise
        engine = cls(spec, proc, work_dir, handover)
        say(f"vLLM engine starting (pid {proc.pid}, log {engine.log_path})")
        try:
            engine._wait_ready(ready)
        except BaseException:
            engine.stop(keep_log=engine.failed_log)  # the error names it: keep it
            raise
        return engine

    @property
    def failed_log(self) -> Path:
        """Where the log of an engine that failed to start is kept (beside its work directory,
        which is removed)."""
        return self.work_dir.parent / f"{self.work_dir.name}.log"

    def _wait_ready(self, ready: Path) -> None:
        deadline = time.monotonic() + self.spec.start_timeout_s
        while not ready.is_file():
            code = self.proc.poll()
            if code is not None:
                raise EngineStartError(
                    f"the vLLM engine did not start (exit {code}): {self.error_line()} "
                    f"(log: {self.failed_log})"
                )
            if time.monotonic() > deadline:
                raise EngineStartError(
                    f"the vLLM engine was not ready within {self.spec.start_timeout_s:.0f}s "
                    f"(--engine-start-timeout); its last line: {self.error_line()} "
                    f"(log: {self.failed_log})"
                )
            time.sleep(0.2)  # start-up takes tens of seconds: a coarse poll is enough
        self.info = json.loads(ready.read_text())
        self.shared_memory = protocol.mapped_shared_memory(self.group_pids())

    # ------------------------------------------------------------------ state
    def exit_code(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        kept = [x for x in text.splitlines() if x.strip()][-lines:]
        return "\n".join(kept) or "(empty log)"

    def error_line(self) -> str:
        """The server's start-up error line if it printed one (with the root cause when vLLM's
        own message only points up the log), else its last log line."""
        tail = self.log_tail(2000).splitlines()
        found = [x for x in tail if protocol.ERROR_PREFIX in x]
        if not found:
            return tail[-1].strip()[-400:] if tail else "(no output)"
        line = found[-1].split(protocol.ERROR_PREFIX, 1)[1].strip()
        if any(g in line for g in GENERIC) and (cause := root_cause(tail)) is not None:
            line = f"{line} (root cause: {cause})"
        return line

    def describe_failure(self) -> str:
        """What a failure message adds: whether the engine still runs, and its last log lines."""
        code = self.exit_code()
        state = "still running" if code is None else f"exited with code {code}"
        return f"the engine (pid {self.proc.pid}) {state}; its last log lines:\n{self.log_tail()}"

    def group_pids(self) -> list[int]:
        """Live processes of the engine's process group (Linux /proc; zombies left out)."""
        return protocol.live_group_members(self.pgid)

    # ------------------------------------------------------------------ stop
    def stop(self, keep_log: Path | None = None, grace_s: float = STOP_GRACE_S) -> None:
        """End the engine and everything it started; keep its log at `keep_log` if given.
        Safe on every path, more than once."""
        if not self._stopped:
            self._stopped = True
            self.shared_memory |= protocol.mapped_shared_memory(self.group_pids())
            try:
                # The server alone first: it shuts vLLM down in order (vLLM then stops its own
                # processes and removes its shared memory); a group-wide SIGTERM would end them
                # under it and leak their /dev/shm segments.
                _signal_group(self.pgid, signal.SIGTERM, leader_only=True)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=grace_s)
                _signal_group(self.pgid, signal.SIGKILL)  # what did not stop in time, children
                self.proc.wait(timeout=60)  # reaping a SIGKILLed child is prompt
                _wait_group_gone(self.pgid, timeout_s=10.0)
            finally:  # whatever did not end in time: what it held is removed all the same
                for path in self.shared_memory:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                protocol.remove_handover_dir(self.handover_dir, self._handover_hold)
                if self.proc.stdin is not None:
                    self.proc.stdin.close()
        if keep_log is not None and self.log_path.is_file():
            keep_log.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.log_path, keep_log)
        shutil.rmtree(self.work_dir, ignore_errors=True)


def root_cause(lines: list[str]) -> str | None:
    """The first error vLLM's log names that is not a pointer to another one."""
    for line in lines:
        if m := ROOT_CAUSE.search(line):
            return m.group(1)[:400]
    for line in lines:
        m = EXCEPTION_LINE.search(line)
        if m and not any(g in line for g in GENERIC):
            return f"{m.group(1)}: {m.group(2)}"[:400]
    return None


def _signal_group(pgid: int, sig: int, leader_only: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError):
        if leader_only:
            os.kill(pgid, sig)
        else:
            os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while protocol.live_group_members(pgid):
        if time.monotonic() > deadline:
            left = protocol.live_group_members(pgid)
            raise EngineError(f"engine processes {left} survived SIGKILL")
        time.sleep(0.05)
