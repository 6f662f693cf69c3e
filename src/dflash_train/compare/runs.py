"""The runs of a comparison: for each (seed, variant), train -> export -> evaluate.

Each step is a subprocess of this interpreter (`python -m dflash_train train ...`) whose
output goes to a log beside its outputs:

    OUT/compare.json                     the shared settings and the variants (a rerun checks them)
    OUT/results.jsonl                    one line per finished (variant, seed), appended
    OUT/runs/VARIANT/seedS/job.json       the train command line of this run
    OUT/runs/VARIANT/seedS/run/           the train run directory
    OUT/runs/VARIANT/seedS/export/        the exported drafter
    OUT/runs/VARIANT/seedS/eval.json      the evaluation's report (per-prompt taus)
    OUT/runs/VARIANT/seedS/{train,export,eval}.log

Runs go seed by seed, every variant at a seed before the next seed: the pairs a comparison
needs come first, and a variant whose flags the train command refuses fails in the first round.
A rerun skips every (variant, seed) in results.jsonl, and a run whose training finished but
whose evaluation did not is evaluated without training again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from dflash_train.data.dataset import PreparedDataset
from dflash_train.data.formats import file_digest
from dflash_train.metrics.intervals import standard_error
from dflash_train.model.digest import target_weights_digest

RESULTS_FILE = "results.jsonl"
SETTINGS_FILE = "compare.json"
EVAL_CLIENTS = ("project", "reference")
# Train flags compare sets itself, per run.
RESERVED_FLAGS = {
    "--seed": "--seeds / --first-seed",
    "--out": "--out",
    "--target": "--target",
    "--data": "--data",
    "--resume": "a rerun, which skips finished runs",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
RUN_REF = re.compile(r"\{run:([A-Za-z0-9][A-Za-z0-9._+-]*)\}")
"""`{run:NAME}` in a variant's flags: the train run of variant NAME at the same seed (e.g.
`--init-from {run:sft}`: a stage trained on from another variant's drafter)."""


class StepFailed(Exception):
    """A train, export or eval subprocess exited non-zero (or ran past its timeout)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# ============================================================================ variants


def parse_flags(text: str, where: str) -> tuple[str, ...]:
    """Train flags from a shell-quoted string; the flags compare sets itself are refused."""
    try:
        argv = shlex.split(text)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key in RESERVED_FLAGS:
            raise ValueError(f"{where}: {key} is set by compare (through {RESERVED_FLAGS[key]})")
    return tuple(argv)


@dataclass(frozen=True)
class Variant:
    """A named set of train flags, applied after the common ones (so they win)."""

    name: str
    flags: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """`NAME=FLAGS` (FLAGS shell-quoted, may be empty) or `NAME`."""
        name, _, text = spec.partition("=")
        name = name.strip()
        if not _NAME.match(name):
            raise ValueError(
                f"--variant {spec!r}: a variant is NAME=FLAGS with NAME of letters, digits and "
                "._+- (it names a directory)"
            )
        return cls(name, parse_flags(text, f"variant {name!r}"))

    @property
    def text(self) -> str:
        return shlex.join(self.flags)

    @property
    def needs(self) -> list[str]:
        """The variants whose runs this one's flags name (`{run:NAME}`), in order."""
        return list(dict.fromkeys(m for f in self.flags for m in RUN_REF.findall(f)))


def check_variants(variants: Sequence[Variant]) -> None:
    """At least one variant, no name twice, and a `{run:NAME}` only of a variant given before
    (at each seed the variants run in the order given)."""
    if not variants:
        raise ValueError("give at least one --variant NAME=FLAGS (the first is the baseline)")
    names = [r.name for r in variants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"variant names must differ; given more than once: {', '.join(twice)}")
    for i, variant in enumerate(variants):
        for need in variant.needs:
            if need not in names[:i]:
                raise ValueError(
                    f"variant {variant.name!r} names {{run:{need}}}: give variant {need!r} "
                    "before it (at each seed the variants run in the order given)"
                )


@dataclass(frozen=True)
class Settings:
    """What every run of a comparison shares; a rerun into the same --out must give the same."""

    target: str
    data: str
    prompts: str
    train_flags: tuple[str, ...]
    eval: str
    max_new_tokens: int
    limit: int | None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["train_flags"] = shlex.join(self.train_flags)
        return out

    @cached_property
    def identity(self) -> dict[str, Any]:
        """What the runs depend on, the inputs by content: the target's weights digest, the
        prepared rows' identity, the prompts' sha256. A comparison moved to another directory
        (or another machine, its record kept in a repository) compares the same. Read once
        (the target's weights can be GiBs)."""
        out = self.to_dict()
        out["target"] = target_weights_digest(self.target)
        out["data"] = PreparedDataset(self.data).identity()
        out["prompts"] = file_digest(self.prompts)[0]
        return out


# ============================================================================ the record


def read_results(out: Path) -> list[dict[str, Any]]:
    """The lines of OUT/results.jsonl (none when it does not exist). A torn last line (the
    process died while appending it) is skipped: that run counts as not done."""
    path = out / RESULTS_FILE
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    records: list[dict[str, Any]] = []
    seen: dict[tuple[str, int], int] = {}  # (variant, seed) -> its line
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines):
                raise ValueError(f"{path}:{i} is not a JSON line; fix or remove it") from None
            print(f"compare: ignoring the torn last line of {path}", file=sys.stderr)
            continue
        key = (record.get("variant"), record.get("seed"))
        if key in seen:
            # One run counted twice would narrow its variant's interval as if it were a seed.
            raise ValueError(
                f"{path}:{i} records variant {key[0]!r} seed {key[1]} again (first on line "
                f"{seen[key]}): one run per variant and seed; remove one of the two lines"
            )
        seen[key] = i
        records.append(record)
    return records


def append_result(out: Path, record: dict[str, Any]) -> None:
    """One line, flushed to disk before the next run starts. A torn last line (a process that
    died while appending; `read_results` skips it) is cut off first: appended to, it would
    swallow this record too."""
    path = out / RESULTS_FILE
    with path.open("ab") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            data = path.read_bytes()
            if not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
        f.write((json.dumps(record) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def check_against_record(
    out: Path, settings: Settings, variants: Sequence[Variant], records: Sequence[dict[str, Any]]
) -> None:
    """Refuse a rerun whose shared settings or inputs, or a variant's flags, differ from what the
    runs already in OUT were made with. Inputs compare by content (`Settings.identity`), so
    moved ones are the same; a record written before it kept identities compares paths."""
    path = out / SETTINGS_FILE
    if path.is_file():
        doc = json.loads(path.read_text())
        saved, now = doc.get("identity"), settings.identity
        if saved is None:
            saved, now = doc["settings"], settings.to_dict()
        changed = sorted(k for k, v in now.items() if saved.get(k) != v)
        if changed:
            raise ValueError(
                f"{out} holds runs made with other {', '.join(changed)} "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}); use another --out"
            )
    flags = {r.name: r.text for r in variants}
    for rec in records:
        if rec["variant"] in flags and rec["flags"] != flags[rec["variant"]]:
            raise ValueError(
                f"variant {rec['variant']!r} ran with flags {rec['flags']!r} in {out}, now "
                f"{flags[rec['variant']]!r}; give the new flags another variant name"
            )


def write_settings(
    out: Path, settings: Settings, variants: Sequence[Variant], seeds: Sequence[int]
) -> None:
    """OUT/compare.json: the settings (the inputs' paths as given now) and their identity,
    this invocation's variants first (the first is the baseline), then any recorded before,
    and every seed asked for so far."""
    path = out / SETTINGS_FILE
    old = json.loads(path.read_text()) if path.is_file() else {"variants": {}, "seeds": []}
    merged = {r.name: r.text for r in variants}
    merged.update({k: v for k, v in old["variants"].items() if k not in merged})
    doc = {
        "settings": settings.to_dict(),
        "identity": settings.identity,
        "variants": merged,
        "seeds": sorted(set(old["seeds"]) | set(seeds)),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def read_settings(out: Path) -> dict[str, Any]:
    """OUT/compare.json, with a line saying what to do when it is missing."""
    path = out / SETTINGS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: run `dflash-train compare` without --report-only")
    return json.loads(path.read_text())


# ============================================================================ subprocesses

Runner = Callable[[Sequence[str], Path, float], int]
"""Runs `python ARGV...` with its stdout and stderr into the log file; returns the exit status
(raises StepFailed past the timeout, in seconds)."""


def subprocess_runner(argv: Sequence[str], log: Path, timeout_s: float) -> int:
    """A child of this interpreter; stopped (SIGTERM, then SIGKILL) past `timeout_s` and when
    this process is interrupted, so no run outlives the comparison."""
    cmd = [sys.executable, *argv]
    with log.open("w", encoding="utf-8") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            raise StepFailed(f"ran past --step-timeout {timeout_s:g} s; log: {log}", 1) from None
        except BaseException:
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)  # train saves a checkpoint on SIGTERM
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)


def last_line(log: Path) -> str:
    """The log's last non-empty line (a command's error line is its last)."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


# ============================================================================ one run


@dataclass(frozen=True)
class RunPaths:
    """Where one (variant, seed) keeps its files."""

    root: Path

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def export(self) -> Path:
        return self.root / "export"

    @property
    def eval_json(self) -> Path:
        return self.root / "eval.json"

    @property
    def job(self) -> Path:
        return self.root / "job.json"

    def log(self, step: str) -> Path:
        return self.root / f"{step}.log"


def run_paths(out: Path, variant: str, seed: int) -> RunPaths:
    return RunPaths(out / "runs" / variant / f"seed{seed}")


def train_argv(out: Path, settings: Settings, variant: Variant, seed: int) -> list[str]:
    """The common flags, then the variant's (the later of two equal flags wins; `{run:NAME}`
    the run directory of variant NAME at this seed), then the seed."""
    flags = [
        RUN_REF.sub(lambda m: str(run_paths(out, m.group(1), seed).run), f) for f in variant.flags
    ]
    argv = ["-m", "dflash_train", "train", "--target", settings.target, "--data", settings.data]
    argv += ["--out", str(run_paths(out, variant.name, seed).run), "--overwrite"]
    return [*argv, *settings.train_flags, *flags, "--seed", str(seed)]


def eval_argv(settings: Settings, paths: RunPaths) -> list[str]:
    """`dflash-train eval` (no plain-decoding baseline: tau needs none) or the reference
    client, both writing per-prompt taus to eval.json."""
    module = ["dflash_train", "eval"]
    if settings.eval == "reference":
        module = ["dflash_train.compare.reference"]
    argv = ["-m", *module, "--draft", str(paths.export), "--target", settings.target]
    argv += ["--prompts", settings.prompts, "--max-new-tokens", str(settings.max_new_tokens)]
    argv += ["--json", str(paths.eval_json)]
    if settings.eval == "project":
        argv.append("--no-baseline")
    if settings.limit is not None:
        argv += ["--limit", str(settings.limit)]
    return argv


def trained(paths: RunPaths, argv: Sequence[str]) -> dict[str, Any] | None:
    """The train result of this very command line when it ran to its end (exit 0, not
    stopped by a signal), else None."""
    result = paths.run / "result.json"
    if not (paths.job.is_file() and result.is_file()):
        return None
    if json.loads(paths.job.read_text()).get("train_argv") != list(argv):
        return None
    summary = json.loads(result.read_text())
    return summary if summary.get("interrupted") is None else None


def make_record(
    variant: Variant, seed: int, settings: Settings, train: dict[str, Any], report: dict[str, Any]
) -> dict[str, Any]:
    """One results.jsonl line. A response without a verify round (the target's first token
    ends it) has no tau: it is left out of the per-prompt taus, counted apart (the same
    prompts in every run: the target's greedy output does not depend on the drafter).
    prompt_se is None with one prompt (`--limit 1`): the spread of one tau is unknown."""
    taus = [float(r["tau"]) for r in report["responses"] if r["tau"] is not None]
    if not taus:
        raise StepFailed(
            f"eval of variant {variant.name!r} seed {seed}: no prompt had a verify round (every "
            "response ended at its first token), so tau was not measured; use prompts whose "
            "answers are longer, or a larger --max-new-tokens",
            2,
        )
    return {
        "variant": variant.name,
        "seed": seed,
        "flags": variant.text,
        "tau": float(report["tau"]),
        "prompt_taus": taus,
        "num_prompts": len(taus),
        "prompts_without_rounds": len(report["responses"]) - len(taus),
        "prompt_se": standard_error(taus),
        "eval": settings.eval,
        "steps": train.get("steps"),
        "train_wall_s": train.get("wall_s"),
        "weights_digest": train.get("weights_digest"),
    }
