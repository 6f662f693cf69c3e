"""Build a venv at the lowest versions pyproject.toml declares, and run the default suite there.

    python3 scripts/lowest_versions.py [--venv .venv-lowest] [--log lowest_versions.log]

Every runtime dependency is pinned at its declared lower bound (`name>=X` -> `name==X`;
torch is installed first, alone, at its bound: on PyPI that is the CUDA build, large, which
runs on a CPU), then the package with its dev extras (latest test tools) and the reference
client (`dflash==0.1.0 --no-deps`, as the README installs it), then `lint-imports` and
`pytest -q` (the default suite). The pins and the versions really installed are printed
first; the exit status is the suite's. Run it whenever the declared range or a
version-sensitive path (`dflash_train.model.compat`) changes, and say in the README's
"Versions" when it last passed. Slow on a 2-core machine (an hour or more): run it in the
background with its output to a file.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORTED = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "huggingface-hub")


def lower_bounds(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """name -> the lower bound of each runtime dependency declared with `>=`."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    bounds = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", dep)
        if m is None:
            raise SystemExit(f"pyproject.toml: {dep!r} has no `>=` lower bound to test")
        bounds[m.group(1).lower()] = m.group(2)
    return bounds


def run(cmd: list[str], log) -> int:
    """Run `cmd`, its output into `log` as it comes; its exit status."""
    print("$", " ".join(cmd), file=log, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return proc.returncode


def build(venv: Path, bounds: dict[str, str], log) -> Path:
    """The venv at the lowest versions; its python."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pins = venv / "lowest-constraints.txt"
    pins.write_text("".join(f"{name}=={v}\n" for name, v in sorted(bounds.items())))
    pip = [str(py), "-m", "pip", "install", "-q"]
    steps = [
        [*pip, f"torch=={bounds['torch']}"],
        [*pip, "-c", str(pins), "-e", ".[dev]"],
        [*pip, "--no-deps", "dflash==0.1.0"],
    ]
    for cmd in steps:
        if run(cmd, log) != 0:
            raise SystemExit(f"install failed: {' '.join(cmd)} (see the log)")
    return py


def installed(py: Path) -> dict[str, str]:
    """The versions the venv really has, for the packages the README reports."""
    code = f"import importlib.metadata as m\nfor n in {REPORTED!r}:\n    print(n, m.version(n))\n"
    out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, check=True)
    return dict(line.split() for line in out.stdout.splitlines())


def _release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) from "2.11", "2.11.0" or "2.11.0+cu130"."""
    numbers = [int(x) for x in version.split("+")[0].split(".") if x.isdigit()]
    return tuple(numbers + [0] * (3 - len(numbers)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-lowest")
    parser.add_argument("--log", type=Path, default=ROOT / "lowest_versions.log")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    bounds = lower_bounds()
    with args.log.open("a") as log:
        py = build(args.venv, bounds, log)
        versions = installed(py)
        print("lowest versions:", " ".join(f"{k}=={v}" for k, v in versions.items()), flush=True)
        for name, want in bounds.items():
            got = versions.get(name)
            if got is not None and _release(got) != _release(want):
                raise SystemExit(f"{name}: {got} installed, {want} pinned")
        bin_dir = py.parent
        rc = run([str(bin_dir / "lint-imports")], log)
        rc = rc or run([str(py), "-m", "pytest", "-q", *args.pytest_args], log)
    tail = args.log.read_text().strip().splitlines()[-1:]
    print(f"default suite at the lowest versions: exit {rc}; {tail[0] if tail else ''}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
