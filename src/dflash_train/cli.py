"""`dflash-train`: parse -> build -> run -> close.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`;
only the chosen one is imported. User errors (`ValueError` and subclasses, also when a worker
raised them, such as a device out of memory) print one line and exit 2; a worker's failure prints
its message with the worker's traceback and exits 1 (124 when the watchdog declared the run hung);
a full disk is one line and exit 1; any other OSError on a path (read-only, occupied by a file,
a directory where a file goes) is one line naming the path and exit 2. `--debug` (or
DFLASH_DEBUG=1) also shows the traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from types import ModuleType

from dflash_train import __version__

# Light imports only (no torch): the chosen command's module brings the rest.
from dflash_train.pipeline.workers import EXIT_HUNG, DeviceOutOfMemory, PipelineError, causes

COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("dflash_train.data.prepare", "tokenise conversations into a training dataset"),
    "regenerate": ("dflash_train.data.regenerate", "rewrite responses with the target model"),
    "capture": ("dflash_train.train.capture", "store the target's features of a prepared dataset"),
    "train": ("dflash_train.train.command", "train a drafter through the full pipeline"),
    "recipes": ("dflash_train.train.recipe_command", "train's recipes for the targets users bring"),
    "eval": ("dflash_train.evaluate", "speculative decoding: acceptance length and speedup"),
    "export": ("dflash_train.export", "write the checkpoint format SGLang / vLLM load"),
    "compare": ("dflash_train.compare.command", "flag variants at N seeds: tau, 95% intervals"),
    "report": ("dflash_train.metrics.report", "HTML page and plots of a run"),
    "bench": ("dflash_train.bench.command", "benchmarks: step, gap, pipeline, gpu and more"),
    "tune": ("dflash_train.bench.tune", "size the pipeline for your models and devices"),
    "demo": ("dflash_train.demo", "the whole product end to end on a tiny embedded example"),
}


def _top_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {desc}" for name, (_, desc) in COMMANDS.items())
    return argparse.ArgumentParser(
        prog="dflash-train",
        usage="dflash-train COMMAND [FLAGS]  (or -h, --version)",
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
    module, parser = command_parser(name)
    args = parser.parse_args(argv[1:])
    debug = args.debug or bool(os.environ.get("DFLASH_DEBUG"))
    previous = warnings.formatwarning
    if not debug:
        warnings.formatwarning = _one_line_warning
    try:
        return _run(name, module, args, debug)
    finally:
        warnings.formatwarning = previous  # main() called in process (tests, notebooks)


def _run(name: str, module: ModuleType, args: argparse.Namespace, debug: bool) -> int:
    """The command, its failures as the user's one line and exit status."""
    try:
        code = int(module.main(args) or 0)
        sys.stdout.flush()  # here, not at exit: a reader gone by then is handled below
        return code
    except BrokenPipeError:
        # The reader went away (`dflash-train recipes | head -1`): nothing more to say to it.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except ValueError as e:
        return _fail(name, str(e), 2, debug)
    except PipelineError as e:
        if (line := user_error_line(e)) is not None:
            return _fail(name, line, 2, debug)
        # A worker's failure: its message already carries the worker's own traceback.
        return _fail(name, str(e), EXIT_HUNG if e.worker == "watchdog" else 1, debug)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return _fail(name, no_space_line(e), 2, debug)
        if (line := path_error_line(e)) is not None:
            return _fail(name, line, 2, debug)
        raise  # an internal failure, not a path the user named: keep its traceback
    except RuntimeError as e:
        # A full disk met by a background writer and raised from a wait on it (the final
        # save finding a periodic checkpoint's failed write) is the user's to fix too.
        full = next((c for c in causes(e) if _is_full_disk(c)), None)
        if full is None:
            raise
        return _fail(name, no_space_line(full), 2, debug)
    except KeyboardInterrupt:
        print(f"dflash-train {name}: interrupted", file=sys.stderr)
        return 130


_format_warning = warnings.formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """This project's warnings as the one line they are written to be (`warning: ...`, as its
    other notes), without Python's source location; other packages' as Python shows them."""
    if "dflash_train" in Path(filename).parts:
        return f"warning: {message}\n"
    return _format_warning(message, category, filename, lineno, line)


def command_parser(name: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The module of command `name` and its full parser (the docs' reference reads it too)."""
    module_name, desc = COMMANDS[name]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"dflash-train {name}", description=desc)
    module.add_arguments(parser)
    parser.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an error"
    )
    return module, parser


def _fail(name: str, message: str, code: int, debug: bool) -> int:
    if debug:
        traceback.print_exc()
    print(f"dflash-train {name}: error: {message}", file=sys.stderr)
    return code


def user_error_line(err: PipelineError) -> str | None:
    """One line for a worker failure the user can fix by a setting: a device out of memory
    (with the knob that sets the batch), a full disk, a user error raised inside a worker."""
    for cause in causes(err):
        if isinstance(cause, DeviceOutOfMemory):
            knobs = (
                "--batch-size or --batch-tokens (or --hs-queue-bytes: the queued hidden states "
                "live on the target device)"
                if "target" in cause.where
                else "--batch-size or --batch-tokens, --num-anchors, or --attention-chunks"
            )
            return f"{cause} in worker {err.worker!r}: lower {knobs}"
        if _is_full_disk(cause):
            return no_space_line(cause)
        if isinstance(cause, ValueError):
            return f"{cause} (in worker {err.worker!r})"
    return None


def _is_full_disk(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno == errno.ENOSPC


def no_space_line(err: BaseException) -> str:
    return (
        f"no space left on the device ({err}); free some space or lower --keep-last, then "
        "continue with --resume (the newest complete checkpoint stands)"
    )


_PATH_HINTS = {
    errno.EACCES: "fix its permissions or choose another path",
    errno.EPERM: "fix its permissions (or attributes) or choose another path",
    errno.EROFS: "choose a path on a writable file system",
    errno.EEXIST: "a file is in the way: remove it or choose another path",
    errno.ENOTDIR: "a file is in the way of a directory: choose another path",
    errno.EISDIR: "name a file, not a directory",
}


def path_error_line(err: OSError) -> str | None:
    """One line for an OSError on a path (a read-only or occupied output, a file where a
    directory goes): the path, what the system said and what to do; None without a path."""
    if err.filename is None:
        return None
    path = str(err.filename)
    if err.filename2 is not None:
        path += f" -> {err.filename2}"
    reason = err.strerror or (os.strerror(err.errno) if err.errno else str(err))
    code = errno.errorcode.get(err.errno or 0)
    hint = _PATH_HINTS.get(err.errno or 0, "check the path")
    return f"{path}: {reason}{f' ({code})' if code else ''}; {hint}"


if __name__ == "__main__":
    raise SystemExit(main())
