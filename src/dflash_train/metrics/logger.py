"""Metrics backends behind one small protocol: JSON lines (always on), TensorBoard, W&B.

A logger receives `log(step, {"train/loss": 2.3, ...})` at log steps only (the trainer has already
done its host syncs) and `close()` once at the end. Keys are namespaced `family/name`; the
families and their units are listed in `dflash_train.metrics.__init__`.

Loggers are not thread-safe: the trainer calls them from its main thread only, one call at a time.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO, runtime_checkable

from dflash_train import faults

METRICS_FILE = "metrics.jsonl"
"""Name of the JSON-lines file inside the run directory."""

TENSORBOARD_SUBDIR = "tensorboard"
"""TensorBoard event files go to RUN_DIR/tensorboard (point `tensorboard --logdir` there)."""

# Keys every JSON line carries; a metric with one of these names would overwrite them.
_RESERVED_KEYS = frozenset({"step", "time"})


@runtime_checkable
class MetricsLogger(Protocol):
    """Receives scalar metrics at log steps; `close()` releases files and network handles."""

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        """Record `metrics` (namespaced scalar values) for optimizer step `step`."""
        ...

    def close(self) -> None:
        """Flush and release resources; the logger must not be used afterwards."""
        ...


class NullLogger:
    """Discards everything: the default when a component is given no logger."""

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        pass

    def close(self) -> None:
        pass


def _json_value(value: float | int) -> float | int | None:
    """A JSON-safe scalar: ints stay ints, NaN and +-inf become null (strict JSON has neither)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    x = float(value)  # also accepts numpy scalars and 0-d tensors already on the host
    return x if math.isfinite(x) else None


class JsonlLogger:
    """Appends one JSON object per `log` call to RUN_DIR/metrics.jsonl.

    Each line is `{"step": int, "time": unix_seconds, **metrics}`; non-finite values are written as
    null so every line stays valid JSON. The file is opened in append mode (a resumed run continues
    the same file) and flushed after every line, so a crashed run keeps everything it logged; at
    worst the last line is cut short, which the report skips.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        clash = _RESERVED_KEYS.intersection(metrics)
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved in {METRICS_FILE}")
        record: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        record.update((k, _json_value(v)) for k, v in metrics.items())
        # One write per line keeps a line whole unless the process dies inside the write itself.
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardLogger:
    """Writes each metric as a TensorBoard scalar (tag = metric key) under `log_dir`."""

    def __init__(self, log_dir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch re-raises a missing `tensorboard` as ImportError
            raise ValueError(
                'TensorBoard logging needs the tensorboard package: pip install "dflash-train'
                '[tensorboard]"'
            ) from e
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=int(step))
        # Log steps are rare; flushing here keeps a live `tensorboard` (and a crashed run) current
        # instead of waiting for SummaryWriter's 2-minute timer.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


# Config keys whose names say they hold a credential. Deliberately narrower than "token" alone so
# that settings such as `max_tokens` or `pad_token` survive.
_SECRET_KEY_RE = re.compile(
    r"(api[_-]?key|secret|passw(or)?d|credential|private[_-]?key|access[_-]?key"
    r"|(^|[_-])(auth|access|api|bearer|hf|wandb|hub)[_-]?token$)",
    re.IGNORECASE,
)
# Environment variables that hold credentials; a config value equal to one of them is dropped too,
# whatever its key is called.
_SECRET_ENV_RE = re.compile(r"(API_KEY|TOKEN|SECRET|PASSWORD)", re.IGNORECASE)


def _secret_env_values() -> set[str]:
    return {v for k, v in os.environ.items() if _SECRET_ENV_RE.search(k) and v and len(v) >= 8}


def strip_secrets(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a (nested) config without entries that look like credentials.

    An entry is dropped when its key names a credential (`api_key`, `hf_token`, `password`, ...)
    or when its value equals a credential held in the environment (e.g. WANDB_API_KEY).
    """
    secrets = _secret_env_values()

    def clean(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {
                k: clean(v)
                for k, v in node.items()
                if not _SECRET_KEY_RE.search(str(k)) and not (isinstance(v, str) and v in secrets)
            }
        if isinstance(node, list | tuple):
            return [clean(v) for v in node if not (isinstance(v, str) and v in secrets)]
        return node

    return clean(dict(config))


class WandbLogger:
    """Logs to Weights & Biases; honours WANDB_MODE (e.g. `offline`, which needs no network).

    The run's files go under `dir/wandb/`. Only `strip_secrets(config)` is sent as the run config;
    the API key stays with wandb's own login machinery and is never passed, logged or written here.
    """

    def __init__(
        self,
        project: str,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        dir: str | Path | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ValueError(
                'W&B logging needs the wandb package: pip install "dflash-train[wandb]"'
            ) from e
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                project=project,
                name=run_name,
                config=strip_secrets(config or {}),
                dir=None if dir is None else str(dir),
                # Source files may hold anything; the run directory only needs the metrics.
                settings=wandb.Settings(save_code=False, disable_code=True),
            )
        except wandb.errors.UsageError as e:
            raise ValueError(
                f"W&B could not start ({e}); run `wandb login`, set WANDB_API_KEY, or set "
                "WANDB_MODE=offline to log locally and `wandb sync` later"
            ) from e

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        self._run.log(dict(metrics), step=int(step))

    def close(self) -> None:
        self._run.finish()


class GuardedLogger:
    """An optional backend (TensorBoard, W&B) that must not stop training: its first failure is
    reported once and the backend is off for the rest of the run (metrics.jsonl, unguarded,
    stays complete)."""

    def __init__(self, logger: MetricsLogger, name: str, stream: TextIO | None = None) -> None:
        self.logger, self.name = logger, name
        self._stream = stream or sys.stderr
        self.failed: BaseException | None = None

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        if self.failed is not None:
            return
        try:
            faults.point("metrics_backend")
            self.logger.log(step, metrics)
        except Exception as e:  # reported once; training goes on without this backend
            self.failed = e
            print(
                f"metrics: the {self.name} backend failed at step {step} ({type(e).__name__}: "
                f"{e}); it is off for the rest of the run, {METRICS_FILE} stays complete",
                file=self._stream,
                flush=True,
            )

    def close(self) -> None:
        try:
            self.logger.close()
        except Exception as e:  # closing a failed backend must not fail the run
            print(f"metrics: closing the {self.name} backend failed: {e}", file=self._stream)


class MultiLogger:
    """Forwards every call to several loggers, in order."""

    def __init__(self, loggers: Sequence[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, step: int, metrics: Mapping[str, float | int]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def close(self) -> None:
        # Close every backend even if one fails, so no file or wandb process is left open; the
        # first failure is re-raised afterwards.
        first_error: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error


BACKEND_PACKAGES = {"TensorBoard": ("tensorboard", "tensorboard"), "W&B": ("wandb", "wandb")}
"""Each optional metric backend: (the package it imports, the extra that installs it)."""


def require_backends(tensorboard: bool, wandb_project: str | None) -> None:
    """The metric backends asked for are installed: one ValueError naming the extra otherwise,
    checked before anything loads or a run directory exists (a run stopped for it later left
    a directory that refused the same command once the extra was installed)."""
    asked = [name for name, on in (("TensorBoard", tensorboard), ("W&B", wandb_project)) if on]
    for name in asked:
        package, extra = BACKEND_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ValueError(
                f'{name} logging needs the {package} package: pip install "dflash-train[{extra}]"'
            )


def build_loggers(
    run_dir: str | Path,
    *,
    tensorboard: bool = False,
    wandb_project: str | None = None,
    wandb_run_name: str | None = None,
    config: dict[str, Any] | None = None,
) -> MetricsLogger:
    """The run's loggers: JSON lines in RUN_DIR always, plus TensorBoard and/or W&B if asked.

    TensorBoard writes to RUN_DIR/tensorboard, W&B to RUN_DIR/wandb. `config` (the resolved run
    config) is sent to W&B only, minus anything that looks like a credential.
    """
    if wandb_project is None and wandb_run_name is not None:
        warnings.warn("wandb_run_name has no effect without wandb_project", stacklevel=2)
    run_dir = Path(run_dir)
    loggers: list[MetricsLogger] = [JsonlLogger(run_dir)]
    backends: list[tuple[str, Callable[[], MetricsLogger]]] = []
    if tensorboard:
        backends.append(("TensorBoard", lambda: TensorBoardLogger(run_dir / TENSORBOARD_SUBDIR)))
    if wandb_project is not None:
        backends.append(
            ("W&B", lambda: WandbLogger(wandb_project, wandb_run_name, config, dir=run_dir))
        )
    for name, make in backends:
        try:
            loggers.append(GuardedLogger(make(), name))
        except ValueError:
            # Our own clear configuration errors (a missing package): the user asked for the
            # backend, so say so before any work is done.
            MultiLogger(loggers).close()
            raise
        except Exception as e:  # W&B unreachable, a TensorBoard write error: train on without
            print(
                f"metrics: the {name} backend could not start ({type(e).__name__}: {e}); "
                f"training goes on with {METRICS_FILE} only for it",
                file=sys.stderr,
                flush=True,
            )
    return loggers[0] if len(loggers) == 1 else MultiLogger(loggers)
