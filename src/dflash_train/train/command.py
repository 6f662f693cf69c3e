"""`dflash-train train`: config (YAML and/or flags) -> Trainer -> run -> close."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import TrainConfig, add_train_arguments, recipe_note, train_flags
from dflash_train.devices import configure_allocator, default_devices
from dflash_train.metrics.logger import MetricsLogger, build_loggers, require_backends
from dflash_train.pipeline.distributed import NodeGroup, world_size_from_env
from dflash_train.train.recipe_command import listing
from dflash_train.train.resume import agree_on_checkpoint, resume_config
from dflash_train.train.run_dir import RESULT_FILE
from dflash_train.train.trainer import SinkFactory, Trainer, TrainResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options set on the command line (and in --config), by field name."""
    return train_flags(args)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_layers(flags_from_args(args))


def metrics_sink(cfg: TrainConfig) -> SinkFactory:
    """A factory building the configured metric loggers once the run directory exists."""

    def build(run_dir: Path, resolved: dict[str, Any]) -> MetricsLogger:
        m = cfg.metrics
        return build_loggers(
            run_dir,
            tensorboard=m.tensorboard,
            wandb_project=m.wandb_project,
            wandb_run_name=m.wandb_run_name,
            config=resolved,
        )

    return build


def result_summary(result: TrainResult) -> dict[str, Any]:
    """result.json: where the run is, how it ended, and its accounting as numbers."""
    trained = sum(e["trained"] for e in result.per_epoch)
    summary: dict[str, Any] = {
        "run_dir": str(result.run_dir),
        "checkpoint": str(result.checkpoint),
        "steps": result.steps,
        "complete": result.complete,
        "interrupted": result.interrupted,
        "wall_s": round(result.wall_s, 1),
        "accounting": {
            "line": result.accounting,
            "sequences_in_data": result.per_epoch[0]["sequences"] if result.per_epoch else 0,
            "epochs": len(result.per_epoch),
            "trained": trained,
            "per_epoch": result.per_epoch,
            "finished_epochs_trained_exactly_once": all(
                e["trained_exactly_once"]
                for e in result.per_epoch
                if e["trained"] >= e["sequences"]
            ),
            "cumulative_across_resumes": bool(result.resumed_from),
        },
        "resumed_from_steps": result.resumed_from,
        "world_size": result.world_size,
        "weights_digest": result.weights_digest,
    }
    if result.interrupted:
        summary["resume_command"] = (
            f"dflash-train train --resume {shlex.quote(str(result.run_dir))}"
        )
    return summary


def main(args: argparse.Namespace) -> int:
    configure_allocator()  # before anything touches CUDA
    flags = flags_from_args(args)
    if flags.get("recipe") == "list":
        print(listing())
        return 0
    if args.resume:
        cfg, resume = resume_config(args.resume, flags, world_size_from_env())
    else:
        cfg, resume = TrainConfig.from_layers(flags), None
    require_backends(cfg.metrics.tensorboard, cfg.metrics.wandb_project)
    notes = combination_notes(cfg, flags)
    nodes = None
    if NodeGroup.launched():  # a torchrun job: checks the device lists now, not at build
        with recipe_named(flags):
            drafter = first_drafter_device(cfg)
        nodes = NodeGroup.from_env(drafter.type, cfg.pipeline.stall_timeout, device=drafter)
    trainer = Trainer(cfg, sink_factory=metrics_sink(cfg), resume=resume, nodes=nodes)
    if nodes is None or nodes.is_main:
        for note in notes:
            trainer.say(note)
    finished = False
    try:
        agree_on_checkpoint(resume, nodes)  # before anything is written
        with recipe_named(flags):
            trainer.build()
        result = trainer.run()
        finished = True
    finally:
        trainer.close()
        if nodes is not None:
            nodes.close(finished=finished)
    if nodes is None:
        return _report(result)
    NodeGroup.leave(_report(result) if nodes.is_main else _exit_status(result, None))


@contextlib.contextmanager
def recipe_named(flags: dict[str, Any]) -> Iterator[None]:
    """A setting refused while the run is built (a device the machine lacks) that came from
    the recipe, not from the user, says so: `--recipe qwen3-8b` on a CPU machine names the
    recipe's `cuda:0`, and the flag that overrides it."""
    try:
        yield
    except ValueError as e:
        note = recipe_note(str(e), flags)
        if not note:
            raise
        raise ValueError(f"{e}{note}") from e


def combination_notes(cfg: TrainConfig, flags: dict[str, Any]) -> list[str]:
    """A flag given (on the command line or in --config) that the rest of the config makes
    ineffective, said once each."""
    notes = []
    pipeline = flags.get("pipeline")
    given = "batch_cost" in flags or (isinstance(pipeline, dict) and "batch_cost" in pipeline)
    if given and cfg.pipeline.batching == "fixed":
        notes.append(
            f"note: --batch-cost {cfg.pipeline.batch_cost} has no effect with --batching fixed "
            "(it sizes work batches)"
        )
    return notes


def _report(result: TrainResult) -> int:
    """The job's summary (written to the run and printed; rank 0's alone) -> exit status."""
    summary = result_summary(result)
    (result.run_dir / RESULT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print(summary_line(result))
    return _exit_status(result, summary)


def summary_line(result: TrainResult) -> str:
    """What train prints at its end: how the run ended and where everything is (the whole
    summary, accounting included, is in the run's result.json)."""
    if result.complete:
        ended = "every sequence of every epoch trained"
    elif result.interrupted:
        ended = f"interrupted by {result.interrupted}"
    else:
        ended = "its schedule (--max-steps) ended before its data"
    return (
        f"train: {result.steps} steps in {result.wall_s:.1f} s, {ended}; checkpoint "
        f"{result.checkpoint}; summary: {result.run_dir / RESULT_FILE}"
    )


def _exit_status(result: TrainResult, summary: dict[str, Any] | None) -> int:
    """0, or 128 + the signal that stopped the run (with the command that continues it)."""
    if not result.interrupted:
        return 0
    if summary is not None:
        print(
            f"dflash-train train: interrupted by {result.interrupted} at step {result.steps}; "
            f"checkpoint {result.checkpoint}; continue with: {summary['resume_command']}",
            file=sys.stderr,
        )
    return 128 + int(getattr(signal, result.interrupted))


def first_drafter_device(cfg: TrainConfig) -> torch.device:
    """The first drafter's device (where the gradient buffer that crosses nodes lives), as the
    trainer will choose it."""
    p = cfg.pipeline
    return default_devices(p.target_devices, p.drafter_devices, p.share_device)[1][0]
