"""`train --resume RUN_DIR`: the saved config, the flags that may change, and the checks that the
run continues on the same target, data and schedule.

A resumed run takes its config from the newest checkpoint (the config that run trained under)
and applies only the flags given now. Safe to change are the settings that decide how fast or how
visibly training runs, not what it computes: queue sizes and the mix, prefetchers, devices (with
the same number of drafters: that number sets the global batch per step), compilation, threads,
the stall and stop timeouts, logging, evaluation, metric backends, checkpoint cadence, the exact
attention and loss kernels' settings, and `--max-steps` to extend the schedule. Everything else
(model shape, block size, anchors, loss, optimizer, batching, epochs, seed, ...) is refused with
one message that lists each difference. The target and the data may move to another path, as
long as they are the same (their digests are compared, not their paths).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.config import SECTIONS, TrainConfig
from dflash_train.data.dataset import PreparedDataset
from dflash_train.train.checkpoint import ResumePoint, load_resume_point

SAFE_ON_RESUME: dict[str, frozenset[str]] = {
    "model": frozenset({"trust_remote_code"}),
    "objective": frozenset({"attention", "attention_chunks", "loss_chunk_size", "chunked_step"}),
    "optim": frozenset(),
    "pipeline": frozenset(
        {
            "target_devices",
            "drafter_devices",
            "share_device",
            "num_prefetchers",
            "job_queue_depth",
            "hs_queue_depth",
            "hs_min_ready",
            "hs_queue_bytes",
            "mix",
            "compile",
            "cuda_graphs",
            "cpu_threads",
            "stall_timeout",
        }
    ),
    "run": frozenset(
        {
            "log_every",
            "eval_every",
            "eval_prompts",
            "eval_num_prompts",
            "eval_max_new_tokens",
            "save_every",
            "keep_last",
            "stop_timeout",
        }
    ),
    "metrics": frozenset({"tensorboard", "wandb_project", "wandb_run_name", "progress"}),
}
"""Fields that may differ from the checkpointed run's (besides `max_steps`, `target` and `data`,
which have rules of their own, and `out` / `overwrite`, which a resume sets itself)."""


@dataclass
class Resume:
    """What a resumed run starts from: the checkpoint and the digests it was trained with."""

    run_dir: Path
    point: ResumePoint
    target_digest: str
    data_identity: str


def target_digest(target_dir: str | Path) -> str:
    """A digest of the target's config.json: the same model, wherever its directory is."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"target directory {target_dir} has no config.json")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resume_config(run_dir: str | Path, overrides: dict[str, Any]) -> tuple[TrainConfig, Resume]:
    """The config to continue `run_dir` with, given the options set on the command line now
    (flat names, as from flags or a YAML file), and the checkpoint to start from.

    Raises one `ValueError` listing every change that is not safe; nothing is written.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"--resume: run directory {run_dir} does not exist")
    point = load_resume_point(run_dir)
    saved_dict = point.state.get("config")
    if not isinstance(saved_dict, dict):
        raise ValueError(f"{point.path}: the training state holds no config to resume with")
    saved_dict = _with_old_objective(_with_old_defaults(saved_dict))
    saved = TrainConfig.from_dict(saved_dict)
    cfg = TrainConfig.from_layers(saved_dict, overrides, {"out": str(run_dir), "overwrite": False})
    resume = Resume(run_dir, point, point.state["target_digest"], point.state["data_identity"])
    problems = _unsafe_changes(saved, cfg, point) + _moved_inputs(saved, cfg, resume)
    if problems:
        raise ValueError(
            f"--resume {run_dir}: these settings differ from the checkpointed run and would "
            f"change what it trains: {'; '.join(problems)} (start a new run with --out, or keep "
            "them as they were)"
        )
    return cfg, resume


def _with_old_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A config saved before a setting existed trained with that setting's old behaviour:
    runs from before --batch-cost planned work batches by block positions alone."""
    pipeline = saved.get("pipeline")
    if isinstance(pipeline, dict) and "batch_cost" not in pipeline:
        return {**saved, "pipeline": {**pipeline, "batch_cost": "blocks"}}
    return saved


OLD_OBJECTIVE = {"objective": {"position_weights": "decay"}, "optim": {"optimizer": "adamw"}}
"""What runs saved before --position-weights and --optimizer existed trained with."""


def _with_old_objective(saved: dict[str, Any]) -> dict[str, Any]:
    """A run saved before these flags trained with the decay and AdamW, whatever the defaults
    are now; a change of them (or of --dpace-alpha, --muon-lr) on resume changes what is
    trained, so `_unsafe_changes` refuses it like any other objective or optimizer setting."""
    out = dict(saved)
    for section, old in OLD_OBJECTIVE.items():
        if isinstance(out.get(section), dict):
            out[section] = {**old, **out[section]}
    return out


def _unsafe_changes(saved: TrainConfig, cfg: TrainConfig, point: ResumePoint) -> list[str]:
    problems = []
    old, new = saved.to_dict(), cfg.to_dict()
    for section in SECTIONS:
        for name, was in old[section].items():
            now = new[section][name]
            if was == now or name in SAFE_ON_RESUME[section]:
                continue
            if name in ("out", "overwrite", "target", "data"):
                continue
            if name == "max_steps":
                problem = _max_steps_change(was, now, point)
                if problem:
                    problems.append(problem)
                continue
            problems.append(f"{name}: {was!r} -> {now!r}")
    old_drafters, new_drafters = _drafter_count(saved, point), _drafter_count(cfg, point)
    if old_drafters != new_drafters:
        problems.append(
            f"drafter_devices: {old_drafters} -> {new_drafters} devices (the number of drafters "
            "sets the global batch per step; keep it)"
        )
    return problems


def _max_steps_change(was: int | None, now: int | None, point: ResumePoint) -> str | None:
    """Only a longer schedule is a safe change of max_steps (on purpose, by a larger number)."""
    total = int(point.state["total_steps"])
    if now is not None and now > total:
        return None
    return f"max_steps: {was!r} -> {now!r} (the schedule of {total} steps may only be extended)"


def _drafter_count(cfg: TrainConfig, point: ResumePoint) -> int:
    devices = cfg.pipeline.drafter_devices
    if devices:
        return len(devices)
    return len(point.state["resolved"]["drafter_devices"])


def _moved_inputs(saved: TrainConfig, cfg: TrainConfig, resume: Resume) -> list[str]:
    problems = []
    if target_digest(cfg.model.target) != resume.target_digest:
        problems.append(
            f"target: {cfg.model.target} is not the model the run trained on "
            f"({saved.model.target}; its config.json differs)"
        )
    if PreparedDataset(cfg.pipeline.data).identity() != resume.data_identity:
        problems.append(
            f"data: {cfg.pipeline.data} is not the prepared dataset the run trained on "
            f"({saved.pipeline.data})"
        )
    return problems
