"""Training checkpoints: everything an exact resume needs, written atomically off the training
threads, and read back safely.

    RUN_DIR/checkpoints/step_0000120/   one directory per checkpoint, never changed once in place
      draft_config.json, model.safetensors   the drafter (`model/checkpoint.py`: eval and export
                                             read these, from here or through RUN_DIR/checkpoint)
      optimizer.safetensors   AdamW state per parameter name (`fc.weight.exp_avg`, `...step`)
      state.safetensors       ids trained per epoch (bit-packed), RNG states
      train_state.json        step, epoch, schedule length, accounting, the resolved config, why
                              it was written, and the size and sha256 of every file above (the
                              manifest)
    RUN_DIR/checkpoint -> checkpoints/step_0000120   the newest complete checkpoint (a symlink)

Writing: the training thread copies the tensors to host memory (`take_snapshot`); a writer thread
writes `checkpoints/.step_N.tmp/` a chunk at a time (`model.tensor_file`: each file's sha256
computed from the bytes as they are written, its progress counted, syncing as it goes), fsyncs
the directory, renames it to `step_N` (atomic) and fsyncs `checkpoints/`, repoints the
`checkpoint` symlink (an atomic replace) and prunes old ones to `keep_last`. A crash at any
moment leaves the previous checkpoints as they were: a `.tmp` directory is never read (and is
removed by the next write). A final save at a step that already has a checkpoint only replaces
its train_state.json (same weights), also atomically.

Reading: safetensors for tensors, JSON for the rest; nothing is unpickled. `verify` checks the
manifest (sizes, and the sha256 of every file where it was recorded), so a truncated or corrupt
file is named instead of loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train import faults
from dflash_train.model.checkpoint import (
    CONFIG_FILE,
    FINAL_CHECKPOINT,
    STATE_FILE,
    WEIGHTS_FILE,
    draft_tensors,
    write_draft,
)
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.serving import load_safetensors
from dflash_train.model.tensor_file import (
    WriteCancelled,
    WriteMeter,
    file_sha256,
    tensors_nbytes,
    write_bytes,
    write_safetensors,
)
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.queue import QueueStopped
from dflash_train.store.manifest import fsync_path

OPTIMIZER_FILE = "optimizer.safetensors"
TENSORS_FILE = "state.safetensors"
CHECKPOINTS_DIR = "checkpoints"
_STEP_DIR = re.compile(r"step_(\d+)")
FORMAT_VERSION = 3  # 3: the manifest holds each file's sha256 besides its size
MANIFEST_KEYS = ("files", "sha256")
"""train_state.json's manifest: each file's size, and (from format 3) the sha256 of its bytes."""
PROGRESS_EVERY_S = 15.0
"""A progress line this often while a run waits for a long checkpoint write."""


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


@dataclass
class Snapshot:
    """Host copies of one moment of training, safe to write while training goes on."""

    step: int
    config: DFlashConfig
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]


def take_snapshot(
    model: DFlashDraftModel,
    optimizer: torch.optim.Optimizer,
    step: int,
    done: np.ndarray,
    state: dict[str, Any],
) -> Snapshot:
    """Copy what a checkpoint holds (on the training thread: the copies are what gets written).

    done: (epochs, rows) boolean, the ids trained in each epoch up to and including `step`.
    """
    tensors = {"trained": torch.from_numpy(np.packbits(done, axis=-1).copy())}
    tensors.update(_rng_tensors())
    state = {**state, "step": step, "format": FORMAT_VERSION, "rows": int(done.shape[1])}
    state["python_random"] = _python_random_state()
    return Snapshot(
        step,
        model.config,
        draft_tensors(model),
        optimizer_tensors(model, optimizer),
        tensors,
        state,
    )


def weights_digest(model: DFlashDraftModel) -> str:
    """A sha256 of the drafter's trainable weights (to check that replicas agree)."""
    h = hashlib.sha256()
    for name, t in sorted(model.trainable_state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def optimizer_tensors(
    model: DFlashDraftModel, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """`{param_name}.{state_key}` -> a host copy (scalars such as AdamW's step as 0-d tensors)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{names[id(p)]}.{key}"] = t.detach().to("cpu", copy=True).contiguous()
    return out


def restore_optimizer(
    model: DFlashDraftModel, optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Put saved per-parameter state back (moments on the parameter's device; AdamW keeps its
    `step` counter on the host). A checkpoint from before the first step holds no state: the
    optimizer stays fresh."""
    if not tensors:
        return
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        keys = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        keys = {k: v for k, v in keys.items() if "." not in k}  # not a child parameter's state
        if not keys:
            raise ValueError(f"the checkpoint has no optimizer state for {name}")
        optimizer.state[p] = {
            k: v.clone() if k == "step" else v.to(p.device, copy=True) for k, v in keys.items()
        }


# ----------------------------------------------------------------------------- writing
def write_snapshot(
    snap: Snapshot, run_dir: Path, keep_last: int, meter: WriteMeter | None = None
) -> Path:
    """Write `snap` as `RUN_DIR/checkpoints/step_N` (see the module docstring); its path.
    `meter` counts the bytes written and may cancel the write before it is put in place."""
    meter = meter or WriteMeter()
    root = run_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(snap.step)
    if final.is_dir() and (final / STATE_FILE).is_file():
        # Same step, same weights (nothing trained since): only why and how it ended changes.
        old = json.loads((final / STATE_FILE).read_text())
        manifest = {k: old[k] for k in MANIFEST_KEYS if k in old}
        meter.commit()
        _write_json_atomic(final / STATE_FILE, {**snap.state, **manifest})
    else:
        tmp = root / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _write_files(snap, tmp, meter)
            meter.commit()
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing half-written
            raise
        fsync_path(root)
    _point_latest(run_dir, final)
    _prune(root, keep_last, keep=final)
    meter.add(0)
    return final


def _write_files(snap: Snapshot, tmp: Path, meter: WriteMeter) -> None:
    """Every file of the checkpoint into `tmp`, synced, the manifest (sizes and sha256 of the
    bytes as they were written) last."""
    records = write_draft(tmp, snap.config, snap.weights, meter)
    records[OPTIMIZER_FILE] = write_safetensors(tmp / OPTIMIZER_FILE, snap.optimizer, meter=meter)
    faults.point("checkpoint_write")  # tests: a crash, a full disk or slow storage mid-save
    records[TENSORS_FILE] = write_safetensors(tmp / TENSORS_FILE, snap.tensors, meter=meter)
    manifest = {
        "files": {name: r.size for name, r in sorted(records.items())},
        "sha256": {name: r.sha256 for name, r in sorted(records.items())},
    }
    write_bytes(tmp / STATE_FILE, json.dumps({**snap.state, **manifest}, indent=2).encode(), meter)
    fsync_path(tmp)


def snapshot_bytes(snap: Snapshot) -> int:
    """The tensor bytes a checkpoint of `snap` writes (its JSON aside)."""
    return sum(tensors_nbytes(t) for t in (snap.weights, snap.optimizer, snap.tensors))


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def _point_latest(run_dir: Path, target: Path) -> None:
    """RUN_DIR/checkpoint -> target, replaced atomically (a relative link: the run directory
    may be moved or copied)."""
    link = run_dir / FINAL_CHECKPOINT
    if link.exists() and not link.is_symlink():
        shutil.rmtree(link)  # a checkpoint directory from an older layout
    tmp = run_dir / f".{FINAL_CHECKPOINT}.link"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.relative_to(run_dir))
    os.replace(tmp, link)
    fsync_path(run_dir)


def _prune(root: Path, keep_last: int, keep: Path) -> None:
    for stale in root.glob(".step_*.tmp"):
        if stale != keep:
            shutil.rmtree(stale, ignore_errors=True)
    if keep_last <= 0:
        return
    for old in list_checkpoints(root.parent)[keep_last:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


class CheckpointWriter:
    """Writes snapshots on a background thread, one at a time.

    `submit` waits for the previous write (so at most one is in flight and its host copy is the
    only one held) and re-raises its error on the caller's thread; `wait` returns the last path
    written; `abandon` cancels the write in flight (its partial files removed, nothing put in
    place). The thread is a daemon, so every path that ends a run must wait for it or abandon
    it, said in a line (`train.saving.RunSaver`): the process never ends silently mid-write.
    Seconds spent writing go to `timers` as `checkpoint_write_s`.
    """

    def __init__(self, run_dir: Path, keep_last: int, timers: StageTimers) -> None:
        self.run_dir, self.keep_last, self.timers = run_dir, keep_last, timers
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._last: Path | None = None
        self.meter = WriteMeter()
        """The write in flight (or the last one): bytes expected and written so far."""
        self.step = -1
        """The step of the write in flight (or the last one)."""
        self._started = time.monotonic()

    def submit(self, snap: Snapshot, stop: threading.Event | None = None) -> None:
        """Start writing `snap` once the previous write is done (see `wait` for `stop`)."""
        self.wait(stop=stop)
        self.meter, self.step = WriteMeter(total=snapshot_bytes(snap)), snap.step
        self._started = time.monotonic()
        self._thread = threading.Thread(
            target=self._write, args=(snap, self.meter), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def wait(
        self,
        timeout_s: float | None = None,
        stop: threading.Event | None = None,
        stall_s: float | None = None,
        say: Callable[[str], None] | None = None,
    ) -> Path | None:
        """Block until the write in flight is done and return the last path written; raise its
        error if it failed, `TimeoutError` after `timeout_s` in all or after `stall_s` without
        a byte written, `QueueStopped` once `stop` is set (a training thread must not wait on a
        writer stuck on a dead disk past a stop). `say` gets a progress line every
        `PROGRESS_EVERY_S`."""
        t0 = time.monotonic()
        reported = t0
        while self.busy():
            now = time.monotonic()
            if stop is not None and stop.is_set():
                raise QueueStopped("stopped while a checkpoint was being written")
            if timeout_s is not None and now - t0 > timeout_s:
                raise TimeoutError(f"not written within {timeout_s:g}s ({self.progress(now)})")
            if stall_s is not None and now - self.meter.moved_at > stall_s:
                raise TimeoutError(f"no byte written for {stall_s:g}s ({self.progress(now)})")
            if say is not None and now - reported >= PROGRESS_EVERY_S:
                say(f"checkpoint of step {self.step}: {self.progress(now)}, still writing")
                reported = now
            assert self._thread is not None
            self._thread.join(0.05)
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing a checkpoint failed: {err}") from err
        return self._last

    def progress(self, now: float | None = None) -> str:
        """How far the write in flight is: '3.2 of 12.0 GB written in 60 s (53 MB/s)'."""
        return self.meter.describe((now or time.monotonic()) - self._started)

    def abandon(self) -> bool:
        """Cancel the write in flight unless it is already being put in place; True when it
        was cancelled (its thread removes its partial files at its next chunk, and nothing of
        it is put in place), False when none is in flight or it is finishing (`wait` for it)."""
        if not self.busy() or not self.meter.cancel():
            return False
        self._thread = None  # never waited for again; a daemon, it cannot hold the exit
        return True

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _write(self, snap: Snapshot, meter: WriteMeter) -> None:
        t0 = time.perf_counter()
        try:
            self._last = write_snapshot(snap, self.run_dir, self.keep_last, meter)
        except WriteCancelled:
            return  # abandoned, and said so by whoever abandoned it
        except BaseException as e:  # reaches the caller at its next submit or wait
            self._error = e
        self.timers.add("checkpoint_write_s", time.perf_counter() - t0)


# ----------------------------------------------------------------------------- reading
def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint directories, newest first (`.tmp` ones never count)."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def verify(ckpt: Path) -> dict[str, Any]:
    """The checkpoint's train_state, after checking every file its manifest names: its size,
    and the sha256 of its bytes where the manifest holds one (checkpoints from before format
    3 have sizes only). A missing, truncated or corrupt file is a `ValueError` naming it."""
    state = _read_state(ckpt)
    for name, size in state["files"].items():
        path = ckpt / name
        if not path.is_file():
            raise ValueError(f"{path} is missing from the checkpoint")
        if path.stat().st_size != size:
            raise ValueError(
                f"{path} is truncated or corrupt ({path.stat().st_size} bytes, the checkpoint "
                f"recorded {size})"
            )
    for name in (CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, TENSORS_FILE):
        if name not in state["files"]:
            raise ValueError(f"{ckpt} holds no {name}: not a resumable training checkpoint")
    for name, want in state.get("sha256", {}).items():
        got = file_sha256(ckpt / name)
        if got != want:
            raise ValueError(
                f"{ckpt / name} is corrupt: its bytes are not those written (sha256 "
                f"{got[:12]}..., the checkpoint recorded {want[:12]}...; same size)"
            )
    return state


def _read_state(ckpt: Path) -> dict[str, Any]:
    """train_state.json, parsed; a `ValueError` when it is missing or not one."""
    state_path = ckpt / STATE_FILE
    if not state_path.is_file():
        raise ValueError(f"{state_path} is missing: the checkpoint is incomplete")
    try:
        state = json.loads(state_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{state_path} is not valid JSON (truncated?): {e}") from None
    if not isinstance(state, dict) or "files" not in state or "step" not in state:
        raise ValueError(f"{state_path} is not a dflash-train training state")
    return state


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, with its name in the error when it cannot be read."""
    try:
        return load_safetensors(path)  # a file cut short or garbage: "truncated or corrupt"
    except OSError as e:
        raise ValueError(f"{path} cannot be read as safetensors: {e}") from None


@dataclass
class ResumePoint:
    """A verified checkpoint, loaded on the host."""

    path: Path
    state: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    done: np.ndarray
    """(epochs, rows) boolean: the ids trained in each epoch."""
    rng: dict[str, torch.Tensor]
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    """Newer checkpoints that could not be read (path, why), newest first: the run falls back
    past them (`set_aside` moves them out of the way once the run starts)."""

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def drafter_changes(self, config: DFlashConfig) -> list[str]:
        """How `config`, the drafter this run builds, differs from the one the checkpoint
        trained (its draft_config.json), field by field: the weights would load into another
        architecture (a tokenizer with another mask id, a changed --init-from source, code
        that derives a field otherwise). The chat mode is the data's, checked with it."""
        saved = DFlashConfig.from_dict(json.loads((self.path / CONFIG_FILE).read_text()))
        was, now = saved.to_dict(), config.to_dict()
        return [
            f"{k}: {was.get(k)!r} -> {now.get(k)!r}"
            for k in sorted(set(was) | set(now))
            if k != "chat_thinking" and was.get(k) != now.get(k)
        ]

    def weights_digest(self) -> str:
        """A sha256 naming these weights: the one of model.safetensors recorded when it was
        written (and checked by `verify`), or for an older checkpoint one of the tensors."""
        recorded = self.state.get("sha256", {}).get(WEIGHTS_FILE)
        if recorded:
            return recorded
        h = hashlib.sha256()
        for name, t in sorted(self.weights.items()):
            h.update(name.encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def load_resume_point(run_dir: Path) -> ResumePoint:
    """The newest checkpoint of `run_dir` that verifies and loads, and the newer ones that do
    not (a crash or a bad disk can leave the newest one corrupt: the one before it still holds
    a consistent pair of weights and data position). None readable: the newest one's error."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(
            f"{run_dir} has no checkpoint to resume from (no {CHECKPOINTS_DIR}/step_* directory)"
        )
    skipped: list[tuple[Path, str]] = []
    for ckpt in found:
        try:
            point = _load_point(ckpt)
        except ValueError as e:
            skipped.append((ckpt, str(e)))
            continue
        point.skipped = skipped
        return point
    if len(skipped) == 1:
        raise ValueError(skipped[0][1])
    raise ValueError(
        f"no checkpoint of {run_dir} can be read: " + "; ".join(why for _, why in skipped)
    )


def set_aside(run_dir: Path, point: ResumePoint) -> list[Path]:
    """Move the checkpoints `point` skipped out of `checkpoints/step_*` (to `.step_N.corrupt`,
    kept for a look, never read) and point RUN_DIR/checkpoint at `point`: the resumed run will
    save those steps again, and a save at a step whose directory exists would keep its files.
    Their new paths."""
    moved = []
    for path, _ in point.skipped:
        dest = path.with_name(f".{path.name}.corrupt")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(path, dest)
        moved.append(dest)
    if moved:
        fsync_path(moved[0].parent)
        _point_latest(Path(run_dir), point.path)
    return moved


def _load_point(ckpt: Path) -> ResumePoint:
    """One checkpoint, verified and loaded; a `ValueError` naming what is wrong."""
    state = verify(ckpt)
    tensors = read_tensors(ckpt / TENSORS_FILE)
    if "trained" not in tensors:
        raise ValueError(f"{ckpt / TENSORS_FILE} holds no trained-id bitmap")
    bits = tensors.pop("trained").numpy()
    done = np.unpackbits(bits, axis=-1, count=int(state["rows"])).astype(bool)
    return ResumePoint(
        ckpt,
        state,
        read_tensors(ckpt / WEIGHTS_FILE),
        read_tensors(ckpt / OPTIMIZER_FILE),
        done,
        tensors,
    )


# ----------------------------------------------------------------------------- RNG states
def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    out["rng.numpy.keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    out["rng.numpy.rest"] = torch.tensor([pos, has_gauss, gauss], dtype=torch.float64)
    return out


def _python_random_state() -> list[Any]:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def restore_rng(point: ResumePoint) -> None:
    """Put the global RNGs back as they were at the checkpoint (torch, CUDA, numpy, random)."""
    rng = point.rng
    torch.set_rng_state(rng["rng.torch"])
    cuda = [rng[k] for k in sorted(rng) if k.startswith("rng.cuda.")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    pos, has_gauss, gauss = rng["rng.numpy.rest"].tolist()
    keys = rng["rng.numpy.keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, int(pos), int(has_gauss), float(gauss)))
    version, internal, py_gauss = point.state["python_random"]
    random.setstate((version, tuple(internal), py_gauss))
