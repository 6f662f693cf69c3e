"""`dflash-train`: parse -> build -> run -> close.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`;
only the chosen one is imported. User errors (`ValueError` and subclasses) print one line and exit
2; set DFLASH_DEBUG=1 to see their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from dflash_train import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("dflash_train.data.prepare", "tokenise conversations into a training dataset"),
    "regenerate": ("dflash_train.data.regenerate", "rewrite responses with the target model"),
    "train": ("dflash_train.train.command", "train a drafter through the full pipeline"),
    "eval": ("dflash_train.evaluate", "speculative decoding: acceptance length and speedup"),
    "export": ("dflash_train.export", "write the checkpoint format SGLang / vLLM load"),
    "report": ("dflash_train.metrics.report", "HTML page and plots of a run"),
    "bench": ("dflash_train.bench.command", "benchmarks: pipeline, padding, mix, queue, step"),
    "tune": ("dflash_train.bench.tune", "size the pipeline for your models and devices"),
    "demo": ("dflash_train.demo", "the whole product end to end on a tiny embedded example"),
}


def _top_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash block-diffusion draft models for speculative decoding.",
        epilog=f"commands:\n{listing}\n\nRun `dflash-train COMMAND --help` for a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"dflash-train {__version__}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    module_name, desc = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"dflash-train {name}", description=desc)
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.main(args) or 0)
    except ValueError as e:
        if os.environ.get("DFLASH_DEBUG"):
            traceback.print_exc()
        print(f"dflash-train {name}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"dflash-train {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
