#!/usr/bin/env python3
"""The GPU check, one command, run first whenever a GPU machine is available:

    python3 scripts/gpu_check.py --out $OUT/gpu-check [--previous gpu-check]

Installs the package from this checkout without network (`pip install --no-deps
--no-build-isolation --no-index -e .`, plus the wheels in `--wheels DIR` if given), then runs
`dflash-train bench gpu --out DIR` (see `dflash_train/bench/gpu.py`): the device's peaks, the
drafter step, the CUDA tests, the pipeline, within 8 minutes by design, results written as it
goes into at most 8 files in DIR. `--previous DIR` first copies an earlier run's results into
the results folder, so a rerun on a fresh folder skips what passed (copy the folder that came
back into the checkout, e.g. as `gpu-check/`, git-ignored, and carry it). Every other flag
goes to `bench gpu` (`--device cpu --shapes tiny` runs it on a CPU, as the tests do).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # the check runs before (and whether or not) it installs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--previous", type=Path, default=None)
    parser.add_argument("--no-install", action="store_true")
    ours, rest = parser.parse_known_args(argv)
    from dflash_train.cli import main as cli

    out = Path(_value(rest, "--out", "gpu-check"))
    if ours.previous is not None and ours.previous.is_dir() and not (out / "summary.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for f in ours.previous.iterdir():
            if f.is_file():
                shutil.copy2(f, out / f.name)
    install = [] if ours.no_install else ["--install"]
    return cli(["bench", "gpu", *install, *rest])


def _value(argv: list[str], flag: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
