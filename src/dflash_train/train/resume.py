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

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.config import SECTIONS, TrainConfig
from dflash_train.data.dataset import PreparedDataset
from dflash_train.devices import default_devices
from dflash_train.model.digest import target_weights_digest
from dflash_train.pipeline.distributed import NodeGroup
from dflash_train.store.manifest import Manifest
from dflash_train.train.checkpoint import ResumePoint, load_resume_point

SAFE_ON_RESUME: dict[str, frozenset[str]] = {
    "model": frozenset({"trust_remote_code"}),
    "objective": frozenset(
        {"attention", "attention_chunks", "loss_chunk_size", "chunked_step", "whole_step_tokens"}
    ),
    "optim": frozenset(),
    "pipeline": frozenset(
        {
            "target_devices",
            "drafter_devices",
            "share_device",
            "num_prefetchers",
            "num_readers",
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
    # Where the features come from, not what they are: both backends compute the same target's
    # features (equal to fp32 rounding, tested), so a run may move between them.
    "engine": frozenset(
        {
            "target_backend",
            "target_endpoint",
            "vllm_python",
            "target_tp",
            "target_workers",
            "engine_args",
            "engine_start_timeout",
        }
    ),
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

    @property
    def target_weights(self) -> str | None:
        """The target's weights digest (None in checkpoints from before it was recorded)."""
        return self.point.state.get("target_weights_digest")


def target_digest(target_dir: str | Path) -> str:
    """A digest of the target's config.json: the same model, wherever its directory is."""
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"target directory {target_dir} has no config.json")
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resume_config(
    run_dir: str | Path, overrides: dict[str, Any], world_size: int = 1
) -> tuple[TrainConfig, Resume]:
    """The config to continue `run_dir` with, given the options set on the command line now
    (flat names, as from flags or a YAML file) and the nodes of the job now (`world_size`),
    and the checkpoint to start from.

    Raises one `ValueError` listing every change that is not safe; nothing is written.
    """
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--resume: {run_dir} is a file, not a run directory")
    if not run_dir.is_dir():
        raise ValueError(f"--resume: run directory {run_dir} does not exist")
    out = overrides.get("out")
    if out is not None and Path(out).resolve() != run_dir.resolve():
        raise ValueError(
            f"--resume {run_dir} continues the run in {run_dir}, not in --out {out}: drop "
            f"--out to resume, or start a new run in {out} without --resume"
        )
    point = load_resume_point(run_dir)
    saved_dict = point.state.get("config")
    if not isinstance(saved_dict, dict):
        raise ValueError(f"{point.path}: the training state holds no config to resume with")
    saved_dict = _with_old_objective(_with_old_defaults(saved_dict))
    saved = TrainConfig.from_dict(saved_dict)
    cfg = TrainConfig.from_layers(saved_dict, overrides, {"out": str(run_dir), "overwrite": False})
    cfg = _with_recorded_share(cfg, saved, point)
    resume = Resume(run_dir, point, point.state["target_digest"], point.state["data_identity"])
    problems = _unsafe_changes(saved, cfg, point) + _moved_inputs(saved, cfg, resume)
    problems += _global_batch_change(saved, cfg, point, world_size)
    problems += _other_target_weights(saved, cfg, resume)
    if problems:
        raise ValueError(
            f"--resume {run_dir}: these settings differ from the checkpointed run and would "
            f"change what it trains: {'; '.join(problems)} (start a new run with --out, or keep "
            "them as they were)"
        )
    return _with_recorded_buckets(cfg, point), resume


def _with_recorded_share(cfg: TrainConfig, saved: TrainConfig, point: ResumePoint) -> TrainConfig:
    """`--batch-cost flops` or `auto` given again (the run's own command line, or its --config,
    repeated with --resume) keeps the share the run settled on and recorded: it is the same
    setting, not a change."""
    decided_by = point.state.get("resolved", {}).get("batch_cost_from")
    if decided_by is None or cfg.pipeline.batch_cost != decided_by:
        return cfg
    pipeline = dataclasses.replace(cfg.pipeline, batch_cost=saved.pipeline.batch_cost)
    return dataclasses.replace(cfg, pipeline=pipeline)


def _with_recorded_buckets(cfg: TrainConfig, point: ResumePoint) -> TrainConfig:
    """The bucket lengths the checkpointed run planned with, when it chose them from the data.
    The fit is by block positions whatever the batch cost's share (setup.py), so the same job
    fits the same buckets again; what still moves them is the job's draws per step (a resume
    on another number of nodes or replicas), and other buckets would plan other batches than
    those the checkpoint's resume state names."""
    recorded = point.state.get("resolved", {}).get("bucket_lengths")
    if cfg.pipeline.bucket_lengths is not None or not recorded:
        return cfg  # set by the user (a change refused above), or a checkpoint without them
    pipeline = dataclasses.replace(cfg.pipeline, bucket_lengths=[int(n) for n in recorded])
    return dataclasses.replace(cfg, pipeline=pipeline)


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
            if name in MOVABLE_STORES and was is not None and now is not None:
                continue  # the store moved: `_moved_inputs` checks what it holds
            if name == "max_steps":
                problem = _max_steps_change(was, now, point)
                if problem:
                    problems.append(problem)
                continue
            problems.append(f"{name}: {was!r} -> {now!r}")
    return problems


def saved_world_size(point: ResumePoint) -> int:
    """Nodes (torchrun ranks) of the job that wrote the checkpoint (1 before it was recorded)."""
    return int(point.state["resolved"].get("world_size", 1))


def fallback_note(point: ResumePoint) -> list[str]:
    """Newer checkpoints that could not be read, so the run resumes from an older one."""
    return [
        f"note: {path} cannot be read ({why}); resuming from the newest checkpoint that can, "
        f"{point.path.name} (set aside as {path.parent / ('.' + path.name + '.corrupt')})"
        for path, why in point.skipped
    ]


def node_count_note(point: ResumePoint, world_size: int) -> list[str]:
    """A resume on another number of nodes (with the same drafters in all), said once."""
    was = saved_world_size(point)
    if was == world_size:
        return []
    return [
        f"the checkpoint was written by {was} node(s), this job has {world_size}: the sequences "
        f"left are sharded over {world_size} (each bucket's batches dealt in turn), each trained "
        "once, with the same global batch per step"
    ]


def checkpoint_choice(point: ResumePoint) -> dict[str, Any]:
    """What a node tells the others about the checkpoint it would resume from."""
    return {
        "step": point.step,
        "weights": point.weights_digest(),
        "path": str(point.path),
        "unreadable": [p.name for p, _ in point.skipped],
    }


def agree_on_checkpoint(resume: Resume | None, nodes: NodeGroup | None) -> None:
    """Every node of a resumed job must start from the same checkpoint. Each one loaded the
    newest it could read, so a node whose view of the run directory differs (another path, a
    stale cache of the shared file system, a file corrupt on its side) would train on from
    another step with other weights. A collective, right after the group starts, before
    anything is written: each rank's step and weights digest compared; a difference is one
    `ValueError` (the same line on every rank) naming each rank's choice."""
    if resume is None or nodes is None:
        return
    mine = json.dumps(checkpoint_choice(resume.point))
    ranks = [json.loads(text) for text in nodes.gather_text(mine)]
    if len({(r["step"], r["weights"]) for r in ranks}) == 1:
        return
    choices = []
    for rank, r in enumerate(ranks):
        why = f"; it could not read {', '.join(r['unreadable'])}" if r["unreadable"] else ""
        choices.append(
            f"rank {rank}: {r['path']} (step {r['step']}, weights {r['weights'][:12]}{why})"
        )
    raise ValueError(
        f"--resume {resume.run_dir}: the nodes would resume from different checkpoints ("
        + "; ".join(choices)
        + "): every node must see the same run directory (one shared file system), and the "
        "checkpoint one node cannot read must be repaired or moved away on all of them"
    )


def _global_batch_change(
    saved: TrainConfig, cfg: TrainConfig, point: ResumePoint, world_size: int
) -> list[str]:
    """The drafters of every node together set the global batch per step, so the schedule's
    length and the learning rate per sequence: their total must stay. How they are spread over
    nodes may change (2 nodes x 4 drafters -> 1 x 8): every node plans the same epochs and
    trains its shard of what is left (each bucket's batches dealt in turn), so the rest is trained
    exactly once whatever the node count."""
    old_nodes, new_nodes = saved_world_size(point), world_size
    old_local = _drafter_count(saved, point)
    # Unset, the drafters are this machine's default (every GPU but the target's): another
    # node with other GPUs (or CUDA_VISIBLE_DEVICES) resolves another count.
    p = cfg.pipeline
    new_local = len(default_devices(p.target_devices, p.drafter_devices, p.share_device)[1])
    old_total, new_total = old_nodes * old_local, new_nodes * new_local
    if old_total == new_total:
        return []
    return [
        f"drafter_devices: {old_total} -> {new_total} devices in all ({old_nodes} node(s) x "
        f"{old_local} -> {new_nodes} x {new_local}; the drafters of every node together set "
        f"the global batch per step and the schedule: keep {old_total} in all)"
    ]


def _max_steps_change(was: int | None, now: int | None, point: ResumePoint) -> str | None:
    """Only a longer schedule is a safe change of max_steps (on purpose, by a larger number)."""
    total = int(point.state["total_steps"])
    if now is not None and now > total:
        return None
    return f"max_steps: {was!r} -> {now!r} (the schedule of {total} steps may only be extended)"


def _drafter_count(saved: TrainConfig, point: ResumePoint) -> int:
    """The drafters per node the checkpoint's run trained with: its list, or what its
    defaults resolved to on its machine."""
    devices = saved.pipeline.drafter_devices
    if devices:
        return len(devices)
    return len(point.state["resolved"]["drafter_devices"])


def _other_target_weights(saved: TrainConfig, cfg: TrainConfig, resume: Resume) -> list[str]:
    """Another fine-tune with the same config.json passes the config's digest: compare the
    weights' digest too (when the checkpoint recorded one, and the configs agree)."""
    if resume.target_weights is None or target_digest(cfg.model.target) != resume.target_digest:
        return []
    if target_weights_digest(cfg.model.target) == resume.target_weights:
        return []
    return [
        f"target: {cfg.model.target} holds other weights than the model the run trained on "
        f"({saved.model.target}; the same config.json, but the weight files' sizes, headers or "
        "sampled bytes differ)"
    ]


MOVABLE_STORES = ("features", "cache_features")
"""Feature stores a resume may find elsewhere (another path, or the same one written otherwise):
what a store holds is checked by its binding when it is opened (target, data, layers), and its
dtype here (`features`) or by `--cache-dtype` (`cache_features`, compared as any setting)."""


def _moved_inputs(saved: TrainConfig, cfg: TrainConfig, resume: Resume) -> list[str]:
    problems = []
    was, now = saved.pipeline.features, cfg.pipeline.features
    recorded = resume.point.state.get("resolved", {}).get("features_dtype")
    if was is not None and now is not None and was != now and recorded is not None:
        dtype = Manifest.read(Path(now)).binding.dtype
        if dtype != recorded:
            problems.append(
                f"features: {now} holds {dtype} features, the run trained on {recorded} ones "
                f"({was})"
            )
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
