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
`prepare` trains the last answer on them, since re-tokenising the decoded text need not give
them back), from the local back end and from a server that returns them (vLLM does, asked with
`return_token_ids`; not for a reasoning model whose server splits the reasoning out, since the
turn written is then reassembled: serve it without a reasoning parser to keep them), and
`regenerated_with` (the settings). An empty answer (the model ended its turn at once) is never
written: it fails its row, without a retry (a greedy target answers the same). Rows are
appended and flushed as they complete, in completion order; a run that leaves every input row
done (none failed, not interrupted) then rewrites the file in input order (`source_line`),
atomically, so a finished file is the same whatever the timing. A re-run with the same
settings skips the input lines already written, and drops a partly written last line first, so
an interrupted run loses nothing and never duplicates a row. One process at a time holds
`--out` (an exclusive flock): a second is refused before it sends any request. A thinking
model's reasoning returned separately by a server (`reasoning_content`) is written back inline
as `<think>\\n...\\n</think>\\n\\n` before the answer, the way the model generates it.

Exit status: 0 when every row is done; 1 when a row failed (under --on-error fail the run stops
at it at once: no new request, the answers already back written, those on the wire abandoned and
redone by the next run; under skip the run goes on and lists the failed rows at the end); 2 for
a user error, HTTP 401, 403 or 404 from the server among them (credentials, URL, model name: no
row could succeed); 130 on Ctrl-C, which writes the rows already answered and leaves at once
(the rows whose requests were in flight are redone by the next run).
"""

from __future__ import annotations

import argparse
import fcntl
import itertools
import json
import os
import stat
import sys
import tempfile
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
    ServerRefused,
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
MAX_LISTED = 10
"""Rows named one by one in the report (failed rows) or as written (rows with a warning)."""


@dataclass
class RegenerateConfig:
    """Settings of one `regenerate` run."""

    data: str
    """Input JSON-lines file: conversations (OpenAI or ShareGPT form) or {"prompt": ...} rows."""
    out: str
    """Output JSON-lines file; re-running with the same settings resumes it (one regenerate
    process at a time: a second one on the same file is refused)."""
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
    429 and 5xx, an answer whose finish_reason is not stop or length) before the row counts as
    failed (an empty answer fails its row at once)."""
    retry_delay: float = 1.0
    """Server back end: seconds before the first retry; doubled for each further retry, or
    longer when a 429 or 503 answer's Retry-After asks (at most 60 s)."""
    request_timeout: float = 600.0
    """Server back end: seconds one request may take, connecting and reading the whole answer
    (then it is retried)."""
    temperature: float = 0.0
    """Sampling temperature (0: greedy)."""
    max_new_tokens: int = 2048
    """Most tokens generated per assistant turn."""
    thinking: Literal["on", "off"] | None = None
    """Thinking mode where the chat template supports it (enable_thinking); unset: the
    template's default."""
    turns: Turns = "all"
    """Which assistant turns to regenerate: all (in order) or only the last (the earlier ones
    stay as in the input, and prepare keeps them as context: not the target's answers)."""
    on_error: Literal["fail", "skip"] = "fail"
    """A bad input line or a row that fails: stop (fail), or skip it and report it (skip: the
    run goes on, and exits with status 1 when a row failed); failed rows are retried by the next
    run."""
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


class OutputLock:
    """An exclusive flock on --out, held for the whole run (released when the process ends):
    two processes appending to one file would each write every row. Taken before any request,
    so a second `regenerate` on the same file is refused at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"--out {self.path} is a directory; name a JSON-lines file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ValueError(
                f"--out {self.path} is being written by another regenerate process; wait for "
                "it to end, or choose another --out"
            ) from None

    def hold(self, fd: int) -> None:
        """Hold `fd` (locked already) instead: the file renamed over --out."""
        os.close(self.fd)
        self.fd = fd

    def release(self) -> None:
        os.close(self.fd)


def rewrite_in_input_order(path: Path, lock: OutputLock) -> bool:
    """Rewrite the finished output with its rows in input order (`source_line`), so the file is
    the same whatever order the rows completed in. Atomic: a sibling temporary file, written,
    fsynced and renamed over `path` (locked before the rename, and held by `lock` after it).
    Returns whether the file was rewritten (not when already in order)."""
    index: list[tuple[int, int, int]] = []  # (source_line, offset, length) of each row
    offset = 0
    with path.open("rb") as f:
        for raw in f:
            index.append((json.loads(raw)["source_line"], offset, len(raw)))
            offset += len(raw)
    if all(a[0] < b[0] for a, b in itertools.pairwise(index)):
        return False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file: nobody else holds it
        os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode))  # mkstemp's is owner-only
        with path.open("rb") as src, os.fdopen(os.dup(fd), "wb") as dst:
            for _, start, length in sorted(index):
                src.seek(start)
                dst.write(src.read(length))
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    lock.hold(fd)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return True


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
            os.truncate(self.path, 0)  # not unlinked: the run's lock is on this file
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
    """Run `regenerate`; returns the exit code: 0 every row done, 1 a row failed (the run
    stopped at it under --on-error fail; under skip it went on). A refusal no row can get past
    (`ServerRefused`) is a ValueError, after the report."""
    out_stream = stream or sys.stdout
    bad_lines = BadLines()
    if Path(config.out).exists() and Path(config.out).resolve() == Path(config.data).resolve():
        raise ValueError(f"--out {config.out} is the input file (--data); choose another --out")
    sha256, _ = file_digest(config.data)
    total = _validate_input(config, bad_lines)
    lock = OutputLock(config.out)  # before any request (make_backend may list the models)
    try:
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
        fatal: RowFailure | None = None
        refused: ServerRefused | None = None
        writer: _RowWriter | None = None
        try:
            with Progress(total - already, "regenerate", unit="rows") as progress:
                writer = _RowWriter(output, settings, progress, config.data)
                fatal = backend.run(_pending_jobs(config, output.done), writer, failures)
        except ServerRefused as e:
            refused = e
        except KeyboardInterrupt:
            output.close()
            if writer is not None:
                _report(config, total, already, writer, failures, bad_lines, None, None, out_stream)
            raise
        finally:
            output.close()
        assert writer is not None
        if fatal is None and refused is None and not failures and len(output.done) == total:
            rewrite_in_input_order(output.path, lock)
        _report(config, total, already, writer, failures, bad_lines, fatal, refused, out_stream)
    finally:
        lock.release()
    if refused is not None:
        raise ValueError(str(refused))
    return 1 if fatal is not None or failures else 0


@dataclass
class _RowWriter:
    """Called by a back end with each finished row, on the run's main thread."""

    output: OutputFile
    settings: dict[str, Any]
    progress: Progress
    data: str
    """The input file, naming the rows in warnings."""
    written: int = 0
    truncated: int = 0
    """Answers that stopped at --max-new-tokens (finish_reason "length")."""
    warned: int = 0
    """Rows written with a warning (the first MAX_LISTED printed as they are written)."""

    def __call__(self, job: RowJob) -> None:
        self.output.write(job.output(self.settings))
        self.written += 1
        self.truncated += sum(r == "length" for r in job.finish_reasons)
        if job.warnings:
            self.warned += 1
            if self.warned <= MAX_LISTED:
                for warning in job.warnings:
                    self.progress.note(f"warning: {self.data}:{job.source_line}: {warning}")
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
    refused: ServerRefused | None,
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
    if writer.warned:
        shown = "" if writer.warned <= MAX_LISTED else f", the first {MAX_LISTED}"
        print(f"{writer.warned} row(s) written with a warning (printed above{shown})", file=stream)
    if bad_lines:
        print(bad_lines.summary(), file=stream)
    if failures:
        print(
            f"{len(failures)} row(s) failed and were not written (a re-run retries them):",
            file=stream,
        )
        listed = sorted(failures, key=lambda f: f.source_line)
        for f in listed[:MAX_LISTED]:
            print(f"  {config.data}:{f.source_line}: {f.reason}", file=stream)
        if len(listed) > MAX_LISTED:
            print(f"  ... and {len(listed) - MAX_LISTED} more", file=stream)
    if refused is not None:
        return  # the caller's one error line: no re-run can succeed until it is fixed
    if failures:
        print(
            f"dflash-train regenerate: error: {len(failures)} row(s) failed and were not "
            "written (listed above); re-run the same command to retry them",
            file=sys.stderr,
        )
    if fatal is not None:
        print(
            f"dflash-train regenerate: error: {config.data}:{fatal.source_line}: {fatal.reason}\n"
            "stopped; rows finished so far are saved: re-run the same command to resume",
            file=sys.stderr,
        )
