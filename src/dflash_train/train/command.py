"""`dflash-train train`: config (YAML and/or flags) -> Trainer -> run -> close."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import SECTIONS, TrainConfig
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import load_yaml, parsed_overrides
from dflash_train.devices import configure_allocator, default_devices
from dflash_train.metrics.logger import MetricsLogger, build_loggers
from dflash_train.pipeline.distributed import NodeGroup, world_size_from_env
from dflash_train.train.recipe_command import listing
from dflash_train.train.resume import agree_on_checkpoint, resume_config
from dflash_train.train.run_dir import RESULT_FILE
from dflash_train.train.trainer import SinkFactory, Trainer, TrainResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="YAML file of options (flat names or grouped by section); flags override it",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest complete checkpoint, with its saved "
        "config; only settings that do not change what it trains may be given (queue sizes, "
        "prefetchers, devices with the same number of drafters, logging, evaluation, checkpoint "
        "cadence, metric backends, --max-steps to extend); others are refused, each listed",
    )
    for name, section in SECTIONS.items():
        add_dataclass_arguments(parser, section, title=f"{name} options")


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options set on the command line (and in --config), by field name."""
    flags: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for section in SECTIONS.values():
        flags.update(parsed_overrides(args, section))
    return flags


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
    nodes = None
    if NodeGroup.launched():  # a torchrun job: checks the device lists now, not at build
        drafter = first_drafter_device(cfg)
        nodes = NodeGroup.from_env(drafter.type, cfg.pipeline.stall_timeout, device=drafter)
    trainer = Trainer(cfg, sink_factory=metrics_sink(cfg), resume=resume, nodes=nodes)
    finished = False
    try:
        agree_on_checkpoint(resume, nodes)  # before anything is written
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


def _report(result: TrainResult) -> int:
    """The job's summary (written to the run and printed; rank 0's alone) -> exit status."""
    summary = result_summary(result)
    (result.run_dir / RESULT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return _exit_status(result, summary)


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
