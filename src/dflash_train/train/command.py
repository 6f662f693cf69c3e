"""`dflash-train train`: config (YAML and/or flags) -> Trainer -> run -> close."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dflash_train.config import SECTIONS, TrainConfig
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import parsed_overrides
from dflash_train.metrics.logger import MetricsLogger, build_loggers
from dflash_train.train.run_dir import RESULT_FILE
from dflash_train.train.trainer import SinkFactory, Trainer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="YAML file of options (flat names or grouped by section); flags override it",
    )
    for name, section in SECTIONS.items():
        add_dataclass_arguments(parser, section, title=f"{name} options")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    flags: dict[str, Any] = {}
    for section in SECTIONS.values():
        flags.update(parsed_overrides(args, section))
    return TrainConfig.from_yaml_and_flags(args.config, flags)


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


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    trainer = Trainer(cfg, sink_factory=metrics_sink(cfg))
    try:
        trainer.build()
        result = trainer.run()
    finally:
        trainer.close()
    summary = {
        "run_dir": str(result.run_dir),
        "checkpoint": str(result.checkpoint),
        "steps": result.steps,
        "complete": result.complete,
        "wall_s": round(result.wall_s, 1),
        "accounting": result.accounting,
    }
    (result.run_dir / RESULT_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0
