"""What the engine server and its clients agree on: paths, fields, exit codes, sizes.

HTTP/1.1 with JSON bodies (keep-alive; one connection per target worker):
- `GET /health` -> the engine's description (`HEALTH_FIELDS`): its target's weights digest
  (`model.digest.target_weights_digest`, None when it cannot be read), the DFlash target layer
  ids it serves and vLLM's aux ids for them, and the hidden size, dtype, max_model_len and tensor
  parallel size vLLM actually runs with, vLLM version, pid, and its hand-over directory with a
  token file in it (a client that can read the token is on the same host and may take features
  from the directory), its bound in bytes and the seconds after which files nobody collected are
  deleted (`handover_ttl_s`).
- `POST /features` {"rows": [[token id, ...], ...], "handover": "shm" | "inline",
  "timeout_s": S} -> every row's features, (n_i, K, hidden) in the engine's dtype, C order:
  - "shm": JSON {"files": [path, ...], "num_tokens": [n_i, ...], "engine_s": seconds from
    admission to the last file written}; the files are complete when the answer comes; the
    client reads them and deletes them (the server counts the bytes it handed over against
    its bound until they are gone, and deletes what is still there after `handover_ttl_s`);
  - "inline": the bytes themselves, rows one after the other (`application/octet-stream`, the
    row lengths in the `X-Num-Tokens` header, comma separated): for clients on another host.
  Errors: JSON {"error": one line}; 400 bad request, 413 a batch larger than the hand-over
  bound, 503 the bound still full at the deadline, 504 no result by the deadline, 500 the
  engine failed (the server then exits).
Standard library only: the engine process imports it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

HEALTH = "/health"
FEATURES = "/features"
HEALTH_FIELDS = (
    "target",
    "weights_digest",
    "target_layer_ids",
    "aux_layer_ids",
    "hidden_size",
    "dtype",
    "max_model_len",
    "tensor_parallel_size",
    "vllm_version",
    "pid",
    "handover_dir",
    "handover_token",
    "handover_bytes",
    "handover_ttl_s",
)
TOKEN_FILE = "token"
NUM_TOKENS_HEADER = "X-Num-Tokens"

ERROR_PREFIX = "dflash-engine error: "
"""The one line the engine prints before exiting on a start-up failure (the launcher quotes it)."""
READY_PREFIX = "dflash-engine ready: "
"""Printed once the engine serves, followed by the health JSON."""

EXIT_BAD_ARGS = 2
EXIT_NO_VLLM = 3
EXIT_CANNOT_LOAD = 4
EXIT_PORT_IN_USE = 5
EXIT_ENGINE_DIED = 6

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per value of the dtypes the engine may compute in."""


def feature_bytes(num_tokens: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of one request's hand-over: (num_tokens, num_layers, hidden_size) values."""
    return num_tokens * num_layers * hidden_size * ITEMSIZE[dtype]


FREE_SPACE_SHARE = 0.9
"""The hand-over bound is --handover-bytes, at most this share of the directory's free space."""


def describe_bound(info: dict[str, object]) -> str:
    """The engine's hand-over bound as a refusal names it: the figure, its flag, and where it
    can be raised (an engine's /dev/shm in a container is 64 MB unless given more)."""
    return (
        f"the engine's hand-over bound of {info['handover_bytes']} bytes (--handover-bytes, at "
        f"most {FREE_SPACE_SHARE:.0%} of the free space of {info['handover_dir']}: give the "
        "engine's host a larger /dev/shm, e.g. docker run --shm-size=16g, or start the engine "
        "with --handover-dir on a larger memory-backed filesystem)"
    )


# ---------------------------------------------------------------------- engine arguments
ENGINE_ARGS_OWNED = {
    "model": "--target",
    "revision": "--target (a local directory holds one revision)",
    "hf_overrides": "--target (another config computes other features)",
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "tensor_parallel_size": "--tensor-parallel-size",
    "speculative_config": "--target-layer-ids",
    "kv_transfer_config": "none: the engine's hand-over connector",
    "enable_prefix_caching": "none: every row is computed, never read back from a cache",
    "load_format": "--target (another format, e.g. dummy, loads other weights than /health names)",
    "hf_config_path": "--target (another config computes other features)",
    "quantization": "--dtype (quantized weights compute other features than the target's)",
}
"""vLLM engine arguments the server sets itself (its flags, which /health reports), each with
what to use instead."""


def engine_args_problem(args: dict[str, object]) -> str | None:
    """One line if `args` (--engine-args) sets what the server sets from its own flags."""
    owned = [k for k in args if k in ENGINE_ARGS_OWNED]
    if not owned:
        return None
    use = "; ".join(f"{k}: {ENGINE_ARGS_OWNED[k]}" for k in owned)
    return f"--engine-args may not set {', '.join(owned)} (use instead: {use})"


# ---------------------------------------------------------------------- the hand-over directory
FILE_SUFFIX = ".bin"
PART_SUFFIX = ".part"
HANDOVER_PREFIX = "dflash-handover-"
LOCK_FILE = "owner.lock"
"""Each process using a hand-over directory holds a shared lock on this file while it lives
(the kernel drops it when the process ends, however): a directory nobody holds it on is left
over from processes that were killed."""


def handover_path(directory: str, request_id: str) -> str:
    """Where a request's features are handed over (request ids may hold any character)."""
    return os.path.join(directory, re.sub(r"[^A-Za-z0-9_.-]", "_", request_id) + FILE_SUFFIX)


def request_files(directory: str, request_ids: Collection[str]) -> list[str]:
    """The hand-over files of `request_ids` in `directory` (whole ones: not `.part`). vLLM
    0.32 renames every request it is given to `ID-XXXXXXXX` (8 random characters) before the
    connector sees it, so a file is `handover_path(ID)` itself (a vLLM that does not rename)
    or that name with the suffix before its extension."""
    stems = {
        os.path.basename(handover_path(directory, r))[: -len(FILE_SUFFIX)] for r in request_ids
    }
    if not stems:
        return []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [
        os.path.join(directory, n)
        for n in names
        if n.endswith(FILE_SUFFIX)
        and ((stem := n[: -len(FILE_SUFFIX)]) in stems or stem.rsplit("-", 1)[0] in stems)
    ]


def hold_handover_dir(directory: Path) -> int:
    """Take this process's shared lock on `directory` (the descriptor: keep it open)."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def new_handover_dir() -> tuple[Path, int]:
    """A new hand-over directory under /dev/shm (memory; the system's temporary directory where
    there is none), held by this process (`hold_handover_dir`); directories there that no live
    process holds (left by an engine and its launcher both killed) are removed first."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    remove_abandoned_handover_dirs(Path(base))
    path = Path(tempfile.mkdtemp(prefix=HANDOVER_PREFIX, dir=base))
    return path, hold_handover_dir(path)


def remove_abandoned_handover_dirs(base: Path) -> list[Path]:
    """Remove the hand-over directories under `base` that no live process holds (see
    `LOCK_FILE`); those of other users, or being created, are left alone."""
    removed = []
    for path in base.glob(HANDOVER_PREFIX + "*"):
        try:
            fd = os.open(path / LOCK_FILE, os.O_RDWR)
        except OSError:
            continue  # not ours to open, or being created (the lock comes right after)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live process holds it
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_handover_dir(path: Path, fd: int | None) -> None:
    """Remove a hand-over directory and let go of this process's lock on it."""
    shutil.rmtree(path, ignore_errors=True)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


# ------------------------------------------------------------------ the engine's processes
def live_group_members(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes whose process group is `pgid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def mapped_shared_memory(pids: list[int]) -> set[str]:
    """The /dev/shm files that these processes map (Linux /proc)."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith("/dev/shm/"):
                found.add(path.removesuffix(" (deleted)"))
    return found
