"""`dflash-train regenerate`: rewrite a conversation file's responses with the target itself.

A drafter learns what the target says, so the training responses should be the target's own,
in the chat mode it will be served with. The prompts are kept; the assistant turns are written
by the target, through one of two back ends:

- local (`--target DIR`): transformers, batched generation with left padding, CPU or CUDA;
- server (`--endpoint http://host:port/v1`): any OpenAI-compatible chat-completions server
  (vLLM, SGLang), `--concurrency` requests in flight, retries with exponential back-off.

Multi-turn (`--turns`): "all" (default) regenerates every assistant turn in order, each answer
conditioned on the regenerated answers before it; the system and user turns are kept as they
are. An assistant turn that does not directly follow a user turn is dropped, and a conversation
that ends with a user turn gets an answer. "last" keeps the history up to the last user turn
verbatim (earlier assistant turns included) and regenerates only the final answer.

Output rows are OpenAI-form conversations plus `source_line` (the 1-based line of the input
row), `finish_reasons` (one per generated turn: "stop" or "length"), `token_ids` (one list per
generated turn: the ids the target generated, through the stop token that ended the turn;
`prepare` trains the last answer on them, since re-tokenising the decoded text need not give them
back), from the local back end and from a server that returns them (vLLM does, asked with
`return_token_ids`; not for a reasoning model whose server splits the reasoning out, since the
turn written is then reassembled: serve it without a reasoning parser to keep them), and
`regenerated_with` (the settings). Rows are appended and flushed as they complete, in
completion order. A re-run with the same settings skips the input lines already written, and
drops a partly written last line first, so an interrupted run loses nothing and never duplicates
a row. A thinking model's reasoning returned separately by a server (`reasoning_content`) is
written back inline as `<think>\\n...\\n</think>\\n\\n` before the answer, the way the model
generates it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

from dflash_train.config import NON_NEGATIVE, POSITIVE, check_floats
from dflash_train.data.formats import (
    BadLine,
    BadLines,
    ConversationError,
    file_digest,
    read_conversations,
)
from dflash_train.data.generation import (
    Backend,
    GenerationSettings,
    LocalBackend,
    RowFailure,
    RowJob,
    ServerBackend,
    Turns,
)
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import build, parsed_overrides
from dflash_train.progress import Progress

_FLOAT_BOUNDS = {
    "retry_delay": NON_NEGATIVE,
    "request_timeout": POSITIVE,
    "temperature": NON_NEGATIVE,
}
"""The range of each float option of `RegenerateConfig` (`config.check_floats` also holds any
other float option finite)."""


@dataclass
class RegenerateConfig:
    """Settings of one `regenerate` run."""

    data: str
    """Input JSON-lines file: conversations (OpenAI or ShareGPT form) or {"prompt": ...} rows."""
    out: str
    """Output JSON-lines file; re-running with the same settings resumes it."""
    target: str | None = None
    """Local back end: the target model directory (transformers)."""
    endpoint: str | None = None
    """Server back end: base URL of an OpenAI-compatible API, e.g. http://localhost:8000/v1
    (an OPENAI_API_KEY environment variable is sent as a bearer token)."""
    model: str | None = None
    """Server back end: model name to request; unset: the server's only model."""
    tokenizer: str | None = None
    """Local back end: tokenizer directory; unset: the target directory."""
    chat_template: str | None = None
    """Local back end: a Jinja chat template file instead of the tokenizer's own."""
    device: str = "cpu"
    """Local back end: cpu or cuda:N."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Local back end: weights dtype (auto: bfloat16 on CUDA, float32 on CPU)."""
    batch_size: int = 8
    """Local back end: conversations generated together (left-padded)."""
    concurrency: int = 8
    """Server back end: requests in flight at once."""
    max_retries: int = 5
    """Server back end: retries of a failed request (connection errors, timeouts, HTTP 408,
    429 and 5xx) before the row counts as failed."""
    retry_delay: float = 1.0
    """Server back end: seconds before the first retry; doubled for each further retry (at
    most 60 s)."""
    request_timeout: float = 600.0
    """Server back end: seconds to wait on the server for one request."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""
    max_new_tokens: int = 2048
    """Most tokens generated per assistant turn."""
    thinking: Literal["on", "off"] | None = None
    """Thinking mode where the chat template supports it (enable_thinking); unset: the
    template's default."""
    turns: Turns = "all"
    """Which assistant turns to regenerate: all (in order) or only the last."""
    on_error: Literal["fail", "skip"] = "fail"
    """A bad input line or a row that fails: stop (fail), or skip it and report it (skip);
    failed rows are retried by the next run."""
    overwrite: bool = False
    """Start --out afresh when it holds rows written with other settings or inputs."""
    seed: int = 0
    """Local back end: random seed for sampling."""

    def __post_init__(self) -> None:
        if (self.target is None) == (self.endpoint is None):
            raise ValueError("give exactly one back end: --target DIR (local) or --endpoint URL")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise ValueError(f"endpoint must be an http(s) URL, got {self.endpoint!r}")
        positive = {"batch_size": self.batch_size, "concurrency": self.concurrency}
        positive |= {"max_new_tokens": self.max_new_tokens}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        # NaN passes every `< 0` test: each float must hold its bounds (finite included).
        check_floats(self, _FLOAT_BOUNDS)
        if self.turns not in ("all", "last"):
            raise ValueError(f"turns must be 'all' or 'last', got {self.turns!r}")
        if self.on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {self.on_error!r}")

    @property
    def enable_thinking(self) -> bool | None:
        return None if self.thinking is None else self.thinking == "on"


_LOCAL_ONLY = ("tokenizer", "chat_template", "device", "dtype", "batch_size", "seed")
_SERVER_ONLY = ("model", "concurrency", "max_retries", "retry_delay", "request_timeout")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train regenerate`; help texts are the RegenerateConfig field docs."""
    add_dataclass_arguments(parser, RegenerateConfig, title="regenerate")


def main(args: argparse.Namespace) -> int:
    overrides = parsed_overrides(args, RegenerateConfig)
    for required in ("data", "out"):
        if required not in overrides:
            raise ValueError(f"--{required} is required")
    config = build(RegenerateConfig, overrides)
    unused = _LOCAL_ONLY if config.endpoint is not None else _SERVER_ONLY
    for name in unused:
        if name in overrides:
            print(
                f"warning: --{name.replace('_', '-')} has no effect with this back end",
                file=sys.stderr,
            )
    return regenerate(config)


# ============================================================================ output file


class OutputFile:
    """The append-only output: knows which input lines are done, appends and flushes rows.

    Opening it repairs an interrupted run's partial last line (truncates it; that row is
    regenerated) and refuses rows written with other settings unless `overwrite`.
    """

    def __init__(self, path: str | Path, settings: dict[str, Any], *, overwrite: bool) -> None:
        self.path = Path(path)
        self.done: set[int] = set()
        if overwrite and self.path.exists():
            self._check_replaceable()
            self.path.unlink()
        if self.path.exists():
            self._scan(settings)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def _check_replaceable(self) -> None:
        """--overwrite replaces what `regenerate` wrote (its first row says so), or an empty
        file: another file (a dataset given as --out) is refused, not deleted."""
        if self.path.is_dir():
            raise ValueError(f"--out {self.path} is a directory; name a JSON-lines file")
        with self.path.open("rb") as f:
            first = f.readline()
        if not first.strip():
            return
        try:
            row = json.loads(first)
            ours = isinstance(row, dict) and "regenerated_with" in row and "source_line" in row
        except (json.JSONDecodeError, UnicodeDecodeError):
            ours = False
        if not ours:
            raise ValueError(
                f"--out {self.path} is not a file `regenerate` wrote; --overwrite replaces only "
                "those: choose another --out"
            )

    def _scan(self, settings: dict[str, Any]) -> None:
        good_bytes = 0
        with self.path.open("rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    break  # the partial row of an interrupted write: drop it below
                self._check_row(n, raw, settings)
                good_bytes += len(raw)
        if good_bytes < self.path.stat().st_size:
            with self.path.open("r+b") as f:
                f.truncate(good_bytes)

    def _check_row(self, n: int, raw: bytes, settings: dict[str, Any]) -> None:
        where = f"{self.path}:{n}"
        try:
            row = json.loads(raw)
            line = row["source_line"]
            written_with = row["regenerated_with"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise ValueError(
                f"{where} is not a row written by `regenerate`; pass --overwrite to replace "
                "the file or choose another --out"
            ) from None
        if written_with != settings:
            changed = sorted(k for k in settings if written_with.get(k) != settings[k])
            raise ValueError(
                f"{self.path} was written with other settings or inputs ({', '.join(changed)} "
                "differ); pass --overwrite to start it afresh or choose another --out"
            )
        if line in self.done:
            raise ValueError(f"{where} repeats input line {line}: the file is corrupt")
        self.done.add(line)

    def write(self, row: dict[str, Any]) -> None:
        # One write per row, then flush: a crash leaves at most one partial last line.
        self._file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self._file.flush()
        self.done.add(row["source_line"])

    def close(self) -> None:
        self._file.close()


# ============================================================================ run


def make_backend(config: RegenerateConfig) -> Backend:
    """The back end `config` names: the server at --endpoint, else the local --target."""
    generation = GenerationSettings(
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        enable_thinking=config.enable_thinking,
        on_error=config.on_error,
    )
    if config.endpoint is not None:
        return ServerBackend(
            config.endpoint,
            generation,
            model=config.model,
            concurrency=config.concurrency,
            max_retries=config.max_retries,
            retry_delay=config.retry_delay,
            request_timeout=config.request_timeout,
        )
    assert config.target is not None  # __post_init__: exactly one back end is given
    return LocalBackend(
        config.target,
        generation,
        tokenizer=config.tokenizer,
        chat_template=config.chat_template,
        device=config.device,
        dtype=config.dtype,
        batch_size=config.batch_size,
        seed=config.seed,
    )


def regenerate(config: RegenerateConfig, *, stream: TextIO | None = None) -> int:
    """Run `regenerate`; returns the exit code (0 done, 1 stopped by a failed row)."""
    out_stream = stream or sys.stdout
    bad_lines = BadLines()
    if Path(config.out).exists() and Path(config.out).resolve() == Path(config.data).resolve():
        raise ValueError(f"--out {config.out} is the input file (--data); choose another --out")
    sha256, _ = file_digest(config.data)
    total = _validate_input(config, bad_lines)
    backend = make_backend(config)
    settings = {
        "input_sha256": sha256[:16],
        "backend": backend.name,
        "model": backend.model,
        "temperature": config.temperature,
        "max_new_tokens": config.max_new_tokens,
        "thinking": config.thinking,
        "turns": config.turns,
    }
    output = OutputFile(config.out, settings, overwrite=config.overwrite)
    already = len(output.done)
    failures: list[RowFailure] = []
    try:
        with Progress(total - already, "regenerate", unit="rows") as progress:
            writer = _RowWriter(output, settings, progress)
            fatal = backend.run(_pending_jobs(config, output.done), writer, failures)
    finally:
        output.close()
    _report(config, total, already, writer, failures, bad_lines, fatal, out_stream)
    return 1 if fatal is not None else 0


@dataclass
class _RowWriter:
    """Called by a back end with each finished row, on the run's main thread."""

    output: OutputFile
    settings: dict[str, Any]
    progress: Progress
    written: int = 0
    truncated: int = 0
    """Answers that stopped at --max-new-tokens (finish_reason "length")."""

    def __call__(self, job: RowJob) -> None:
        self.output.write(job.output(self.settings))
        self.written += 1
        self.truncated += sum(r == "length" for r in job.finish_reasons)
        self.progress.update(1, truncated=self.truncated)


def _validate_input(config: RegenerateConfig, bad_lines: BadLines) -> int:
    """Read every input row once before generating anything: a bad line under --on-error fail
    stops the run before it spends any generation. Returns the number of usable rows."""
    total = 0
    for _ in _jobs(config, bad_lines):
        total += 1
    if total == 0:
        raise ValueError(f"{config.data} holds no usable conversations")
    return total


def _jobs(config: RegenerateConfig, bad_lines: BadLines) -> Iterator[RowJob]:
    rows = read_conversations(
        [config.data], require_assistant=False, on_error=config.on_error, bad_lines=bad_lines
    )
    for row in rows:
        try:
            job = RowJob.from_messages(row.line, row.messages, config.turns)
        except ConversationError as e:
            bad = BadLine(row.path, row.line, e.kind, str(e))
            if config.on_error == "fail":
                raise ConversationError(str(bad), kind=e.kind) from None
            bad_lines.add(bad)
            continue
        yield job


def _pending_jobs(config: RegenerateConfig, done: set[int]) -> Iterator[RowJob]:
    for job in _jobs(config, BadLines()):
        if job.source_line not in done:
            yield job


def _report(
    config: RegenerateConfig,
    total: int,
    already: int,
    writer: _RowWriter,
    failures: list[RowFailure],
    bad_lines: BadLines,
    fatal: RowFailure | None,
    stream: TextIO,
) -> None:
    print(
        f"{config.out}: {already + writer.written}/{total} rows done ({writer.written} written "
        f"now, {already} by earlier runs)",
        file=stream,
    )
    if writer.truncated:
        print(
            f"{writer.truncated} answer(s) stopped at --max-new-tokens {config.max_new_tokens} "
            '(finish_reason "length")',
            file=stream,
        )
    if bad_lines:
        print(bad_lines.summary(), file=stream)
    if failures:
        print(
            f"{len(failures)} row(s) failed and were not written (a re-run retries them):",
            file=stream,
        )
        for f in failures[:10]:
            print(f"  {config.data}:{f.source_line}: {f.reason}", file=stream)
    if fatal is not None:
        print(
            f"dflash-train regenerate: error: {config.data}:{fatal.source_line}: {fatal.reason}\n"
            "stopped; rows finished so far are saved: re-run the same command to resume",
            file=sys.stderr,
        )
