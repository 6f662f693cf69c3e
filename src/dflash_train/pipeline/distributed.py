"""More than one node: this process's place in a `torchrun` job and the collectives the pipeline
issues across nodes (torch.distributed; NCCL for CUDA gradients, gloo for host numbers and CPU).

One pipeline process per node. Each node trains its shard of every epoch's plan; once per
optimizer step the thread that completes the node's rendezvous all-reduces, across nodes, the
node-summed gradient buffer (on the device) and a few host numbers (weight sum, batches, replicas
not yet ended: the global loss normaliser needs no device sync). Every node then applies the same
update. Collectives of different threads go to different process groups, so they never
interleave on one group:

- `steps`: the rendezvous' reducer (gradients, loss statistics, host numbers), every step;
- `state`: rank 0's drafter at checkpoint steps and the main thread at the start (the checkpoint
  each rank resumes from) and at the end (trained-id counts for checkpoints and the accounting;
  never at the same time);
- `metrics`: the main thread at log steps (counters reduced to rank 0).

Every group has a timeout: a rank that fails or hangs ends every other rank's next collective
with an error within it, so no rank waits forever.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

NCCL_ERROR_HANDLING = "2"
"""TORCH_NCCL_ASYNC_ERROR_HANDLING unless the user set it: 2 aborts the communicators of a
collective that failed or timed out and lets the process live, so the rendezvous' next
collective raises in its thread and the run ends as on any worker error (one message, the
other threads stopped, the sinks closed). torch's default (3) ends the process from NCCL's
watchdog thread instead: no message from the run, nothing closed."""


def _nccl_settings(device: torch.device | None) -> dict[str, torch.device]:
    """Before the first NCCL group: the error handling (`NCCL_ERROR_HANDLING`), and the device
    the group is bound to (`device_id`: its communicator is created there and then, not
    lazily on whatever device is current when the first collective runs)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ERROR_HANDLING)
    return {} if device is None else {"device_id": device}


def world_size_from_env() -> int:
    """Nodes of the torchrun job this process belongs to (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_one_process_per_gpu_node(devices: list[torch.device]) -> None:
    """One process per node when the device lists name GPUs: the lists are per node, so every
    process of a node (torchrun --nproc-per-node > 1) would take every listed GPU. CPU "nodes"
    on one machine (the two-rank tests) may share it."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = sorted({str(d) for d in devices if d.type == "cuda"})
    if local > 1 and gpus:
        raise ValueError(
            f"torchrun --nproc-per-node {local} with GPUs in the device lists ({', '.join(gpus)}): "
            "every process of the node would take every listed GPU; run one process per node "
            "(--nproc-per-node 1), which runs the node's whole pipeline on all of them"
        )


@dataclass
class NodeGroup:
    """The job's ranks (one per node) and this process's rank; see the module docstring."""

    rank: int
    world_size: int
    device_backend: str
    timeout_s: float
    _steps: object = None
    _steps_host: object = None
    _state: object = None
    _metrics: object = None

    @staticmethod
    def launched() -> bool:
        """Whether this process is one rank of a torchrun job of more than one."""
        return int(os.environ.get("WORLD_SIZE", "1")) > 1

    @classmethod
    def from_env(
        cls, device_type: str, timeout_s: float, device: torch.device | None = None
    ) -> NodeGroup | None:
        """The group of a torchrun job (WORLD_SIZE > 1 in the environment), else None.

        `device_type` is where the drafters' gradients live ("cuda": NCCL, "cpu": gloo);
        `device`, the GPU whose gradient buffer crosses the nodes (the first drafter's): NCCL
        binds its communicator to it (see `_nccl_settings` for its error handling).
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        bound = _nccl_settings(device) if backend == "nccl" else {}
        if not dist.is_initialized():
            dist.init_process_group(backend=backend, timeout=timeout, **bound)
        group = cls(dist.get_rank(), dist.get_world_size(), backend, timeout_s)
        # Created in the same order on every rank (new_group is itself a collective).
        group._steps = dist.new_group(backend=backend, timeout=timeout, **bound)
        group._steps_host = dist.new_group(backend="gloo", timeout=timeout)
        group._state = dist.new_group(backend="gloo", timeout=timeout)
        group._metrics = dist.new_group(backend="gloo", timeout=timeout)
        return group

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, metrics and results; the others only train."""
        return self.rank == 0

    # ------------------------------------------------------------------ step collectives
    def sum_device(self, tensor: torch.Tensor) -> None:
        """All-reduce (sum) a device tensor in place: gradients, loss statistics."""
        dist.all_reduce(tensor, group=self._steps)

    def sum_step_numbers(self, values: list[float]) -> list[float]:
        """All-reduce (sum) a few host numbers of the step (no device involved)."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self._steps_host)
        return t.tolist()

    # ------------------------------------------------------------------ state and metrics
    def sum_counts(self, counts: np.ndarray) -> np.ndarray:
        """All-reduce (sum) an integer array over the state group: trained-id counts."""
        t = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int32))
        dist.all_reduce(t, group=self._state)
        return t.numpy()

    def gather_text(self, text: str) -> list[str]:
        """Every rank's `text` (any length), in rank order, over the state group."""
        data = list(text.encode())
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self._state)
        width = max(int(n) for n in sizes)
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.tensor(data, dtype=torch.uint8)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self._state)
        return [bytes(t[: int(n)].tolist()).decode() for t, n in zip(out, sizes, strict=True)]

    def sum_metrics(self, values: np.ndarray) -> np.ndarray:
        """All-reduce (sum) a float vector of metric counters over the metrics group."""
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        dist.all_reduce(t, group=self._metrics)
        return t.numpy()

    def share_from_main(self, value: float) -> float:
        """Rank 0's `value` on every rank (a broadcast over the state group)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.broadcast(t, src=0, group=self._state)
        return float(t.item())

    def close(self, finished: bool = False) -> None:
        """After an error (`finished` False): destroy the process groups, nobody waiting for
        the others. A finished run (it returned on every rank): the ranks meet, so none leaves
        while another still uses the groups (rank 0 is still writing the final checkpoint when
        the others are done), and the groups stay up for `leave`, which ends the process
        without tearing them down."""
        if not dist.is_initialized():
            return
        if not finished:
            dist.destroy_process_group()
            return
        # Within the groups' timeout; a peer already gone leaves this rank's run complete.
        with contextlib.suppress(RuntimeError, dist.DistBackendError):
            dist.barrier(group=self._state)

    @staticmethod
    def leave(status: int) -> NoReturn:
        """End a finished job's process with `status`, the output flushed, skipping the
        interpreter's teardown. Tearing gloo's groups down after the ranks met (by
        destroy_process_group, or by the interpreter's exit) still aborted a rank now and then
        (SIGABRT, "terminate called without an active exception": 2 of 30-odd 2-rank CPU
        jobs) and failed a job that had trained and saved everything; a process that leaves
        tears nothing down, and the system closes its sockets. Everything the run writes is
        closed before (Trainer.close)."""
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
