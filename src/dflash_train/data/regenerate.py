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
row), `finish_reasons` (one per generated turn: "stop" or "length") and `regenerated_with` (the
settings). Rows are appended and flushed as they complete, in completion order. A re-run with
the same settings skips the input lines already written, and drops a partly written last line
first, so an interrupted run loses nothing and never duplicates a row. A thinking model's
reasoning returned separately by a server (`reasoning_content`) is written back inline as
`<think>\\n...\\n</think>\\n\\n` before the answer, the way the model generates it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

from dflash_train.data.formats import (
    BadLine,
    BadLines,
    ConversationError,
    Message,
    file_digest,
    prompt_messages,
    read_conversations,
)
from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import build, parsed_overrides
from dflash_train.progress import Progress

Turns = Literal["all", "last"]
MAX_BACKOFF_S = 60.0  # longest single back-off sleep between retries


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
        if self.max_retries < 0 or self.retry_delay < 0 or self.request_timeout <= 0:
            raise ValueError("max_retries and retry_delay must be >= 0, request_timeout > 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
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


# ============================================================================ rows


@dataclass
class Completion:
    """One generated assistant turn."""

    text: str
    finish_reason: str


class RowError(Exception):
    """A row that could not be regenerated; `retryable` errors may succeed on another attempt."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class Stopped(RowError):
    """The run is stopping: the row was abandoned, not failed (a re-run will do it)."""


@dataclass
class RowJob:
    """One input conversation being regenerated: its output turns, with None where an answer is
    still to be generated, filled in order."""

    source_line: int
    turns: list[Message | None]
    finish_reasons: list[str] = field(default_factory=list)

    @classmethod
    def from_messages(cls, source_line: int, messages: list[Message], mode: Turns) -> RowJob:
        if mode == "last":
            return cls(source_line, [*prompt_messages(messages), None])
        turns: list[Message | None] = []
        for m in messages:
            if m["role"] != "assistant":
                turns.append(m)
            elif turns and turns[-1] is not None and turns[-1]["role"] == "user":
                turns.append(None)
        if turns and turns[-1] is not None and turns[-1]["role"] == "user":
            turns.append(None)
        if None not in turns:
            raise ConversationError("no user turn to answer", kind="no user turn")
        return cls(source_line, turns)

    @property
    def done(self) -> bool:
        return None not in self.turns

    def next_prompt(self) -> list[Message]:
        """The conversation up to the next answer to generate."""
        return list(self.turns[: self.turns.index(None)])  # type: ignore[arg-type]

    def add(self, completion: Completion) -> None:
        self.turns[self.turns.index(None)] = {"role": "assistant", "content": completion.text}
        self.finish_reasons.append(completion.finish_reason)

    def output(self, settings: dict[str, Any]) -> dict[str, Any]:
        assert self.done
        return {
            "messages": self.turns,
            "source_line": self.source_line,
            "finish_reasons": self.finish_reasons,
            "regenerated_with": settings,
        }


@dataclass(frozen=True)
class RowFailure:
    source_line: int
    reason: str


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
            self.path.unlink()
        if self.path.exists():
            self._scan(settings)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

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


def regenerate(config: RegenerateConfig, *, stream: TextIO | None = None) -> int:
    """Run `regenerate`; returns the exit code (0 done, 1 stopped by a failed row)."""
    out_stream = stream or sys.stdout
    bad_lines = BadLines()
    sha256, _ = file_digest(config.data)
    total = _validate_input(config, bad_lines)
    backend = _make_backend(config)
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


# ============================================================================ back ends

WriteRow = Callable[[RowJob], None]


class Backend(Protocol):
    """What `regenerate` needs of a back end."""

    name: str
    """"local" or "server" (recorded with every output row)."""
    model: str
    """The model's name (recorded with every output row)."""

    def run(
        self, jobs: Iterator[RowJob], write: WriteRow, failures: list[RowFailure]
    ) -> RowFailure | None:
        """Regenerate `jobs`, calling `write(job)` on the caller's thread for each finished row.

        A failed row is appended to `failures` under --on-error skip; under fail the run stops
        and returns it, after writing every row that finished."""
        ...


def _make_backend(config: RegenerateConfig) -> Backend:
    if config.endpoint is not None:
        return ServerBackend(config)
    return LocalBackend(config)


def _failure(
    job: RowJob, error: RowError, on_error: str, failures: list[RowFailure]
) -> RowFailure | None:
    """Record a failed row; returns it when the run must stop (--on-error fail)."""
    failure = RowFailure(job.source_line, str(error))
    if on_error == "fail":
        return failure
    failures.append(failure)
    return None


class ServerBackend:
    """Requests to an OpenAI-compatible /chat/completions endpoint from a pool of threads.

    In flight: at most `2 * concurrency` rows are submitted (`concurrency` running, as many
    queued), so memory does not grow with the input. Each request has a socket timeout; each
    back-off sleep waits on the stop event, so stopping never waits for a back-off to end.
    """

    name = "server"

    def __init__(self, config: RegenerateConfig) -> None:
        self.config = config
        self.base = config.endpoint.rstrip("/")  # type: ignore[union-attr]
        self.stop = threading.Event()
        self.headers = {"Content-Type": "application/json"}
        if key := os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = f"Bearer {key}"
        self.model = config.model or self._only_model()

    def run(
        self, jobs: Iterator[RowJob], write: WriteRow, failures: list[RowFailure]
    ) -> RowFailure | None:
        """Regenerate `jobs`, calling `write(job)` on this thread as rows complete."""
        window = 2 * self.config.concurrency
        fatal: RowFailure | None = None
        pending: dict[Future, RowJob] = {}
        pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="regenerate-http")
        try:
            while True:
                while fatal is None and len(pending) < window:
                    job = next(jobs, None)
                    if job is None:
                        break
                    pending[pool.submit(self._run_row, job)] = job
                if not pending:
                    return fatal
                done, _ = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = pending.pop(fut)
                    try:
                        fut.result()
                    except Stopped:
                        continue
                    except RowError as e:
                        stop_now = _failure(job, e, self.config.on_error, failures)
                        if stop_now is not None and fatal is None:
                            fatal = stop_now
                            self.stop.set()  # in-flight rows finish; queued ones are dropped
                        continue
                    write(job)
        finally:
            # Leaving early (error, Ctrl-C): end back-offs now, drop queued rows, and wait only
            # for requests already on the wire (bounded by request_timeout).
            self.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)

    def _run_row(self, job: RowJob) -> None:
        while not job.done:
            job.add(self.complete(job.next_prompt()))

    def complete(self, messages: list[Message]) -> Completion:
        """One chat completion, retried on transient errors."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_new_tokens,
        }
        if self.config.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.config.enable_thinking}
        return _parse_completion(self._request("/chat/completions", body))

    def _only_model(self) -> str:
        try:
            listing = self._request("/models", None)
        except RowError as e:
            raise ValueError(f"cannot list the models of {self.base}: {e}; pass --model") from None
        try:
            names = [m["id"] for m in listing["data"]]
        except (KeyError, TypeError):
            raise ValueError(
                f"{self.base}/models did not return a model list; pass --model"
            ) from None
        if len(names) != 1:
            raise ValueError(f"{self.base} serves {len(names)} models {names}: pass --model NAME")
        return names[0]

    def _request(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """GET (body None) or POST JSON with retries and exponential back-off."""
        attempts = self.config.max_retries + 1
        for attempt in range(attempts):
            if self.stop.is_set():
                raise Stopped("stopped")
            try:
                return self._attempt(path, body)
            except RowError as e:
                if not e.retryable or attempt == attempts - 1:
                    note = f" (after {attempts} attempts)" if e.retryable else ""
                    raise RowError(f"{e}{note}") from None
            if self.stop.wait(min(self.config.retry_delay * 2**attempt, MAX_BACKOFF_S)):
                raise Stopped("stopped")
        raise AssertionError("unreachable")

    def _attempt(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.config.request_timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            retryable = e.code in (408, 429) or e.code >= 500
            raise RowError(
                f"HTTP {e.code} from {self.base}{path}: {detail}", retryable=retryable
            ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, HTTPException) as e:
            reason = getattr(e, "reason", e)
            raise RowError(
                f"request to {self.base}{path} failed: {reason}", retryable=True
            ) from None
        try:
            return json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RowError(f"{self.base}{path} returned invalid JSON: {payload[:200]!r}") from None


def _parse_completion(response: dict[str, Any]) -> Completion:
    try:
        choice = response["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        raise RowError(f"unexpected chat-completions response: {str(response)[:200]}") from None
    if not isinstance(content, str) or not isinstance(reasoning, str):
        raise RowError("chat-completions response content is not a string")
    if reasoning:
        content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    return Completion(content, choice.get("finish_reason") or "stop")


class LocalBackend:
    """The target loaded with transformers; `batch_size` rows generated together.

    Prompts are left-padded so every row's last prompt token sits at the same position and
    generation appends after it; the attention mask hides the padding.
    """

    name = "local"

    def __init__(self, config: RegenerateConfig) -> None:
        import torch

        from dflash_train.data.chat import ChatFormat, load_chat_template
        from dflash_train.data.prepare import load_tokenizer

        self.config = config
        self.target = Path(config.target)  # type: ignore[arg-type]
        if not self.target.is_dir():
            raise ValueError(f"target directory {self.target} does not exist")
        self.model = self.target.name
        try:
            self.device = torch.device(config.device)
        except RuntimeError:
            raise ValueError(f"device must be cpu or cuda:N, got {config.device!r}") from None
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device} requested but CUDA is not available")
        tokenizer = load_tokenizer(config.tokenizer or self.target)
        self.fmt = ChatFormat(
            tokenizer,
            chat_template=load_chat_template(config.chat_template),
            enable_thinking=config.enable_thinking,
        )
        self.stop_ids = self.fmt.stop_token_ids
        if not self.stop_ids:
            raise ValueError("the tokenizer has no eos or end-of-turn token to stop generation")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self.lm: Any = None  # loaded by run(): a resumed run with nothing left never loads it

    def _load_model(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.config.dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            dtype = dtypes[self.config.dtype]
        self.lm = AutoModelForCausalLM.from_pretrained(self.target, dtype=dtype)
        self.lm.to(self.device).eval()
        vocab = self.lm.get_input_embeddings().weight.shape[0]
        if len(self.fmt.tokenizer) > vocab:
            raise ValueError(
                f"the tokenizer has {len(self.fmt.tokenizer)} tokens but the target embeds only "
                f"{vocab}: they do not belong together"
            )
        torch.manual_seed(self.config.seed)

    def run(
        self, jobs: Iterator[RowJob], write: WriteRow, failures: list[RowFailure]
    ) -> RowFailure | None:
        """Regenerate `jobs` batch by batch; rows are written when all their turns are done."""
        while batch := list(itertools.islice(jobs, self.config.batch_size)):
            if self.lm is None:
                self._load_model()
            fatal = self._run_batch(batch, failures)
            for job in batch:
                if job.done:
                    write(job)
            if fatal is not None:
                return fatal
        return None

    def _run_batch(self, batch: list[RowJob], failures: list[RowFailure]) -> RowFailure | None:
        """Generate turn after turn for the rows of `batch` that still have turns to do."""
        active = batch
        while active:
            prompts, ready = [], []
            for job in active:
                try:
                    prompts.append(self.fmt.prompt_ids(job.next_prompt()))
                except ConversationError as e:
                    fatal = _failure(job, RowError(str(e)), self.config.on_error, failures)
                    if fatal is not None:
                        return fatal
                    continue
                ready.append(job)
            for job, completion in zip(ready, self.generate(prompts), strict=True):
                job.add(completion)
            active = [job for job in ready if not job.done]
        return None

    def generate(self, prompts: list[Any]) -> list[Completion]:
        """Greedy or sampled continuations of token-id prompts, one batched generate call."""
        import torch

        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        sample = self.config.temperature > 0
        extra = {"temperature": self.config.temperature} if sample else {}
        with torch.no_grad():
            out = self.lm.generate(
                input_ids=ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=self.config.max_new_tokens,
                do_sample=sample,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                **extra,
            )
        return [self._completion(row) for row in out[:, width:].tolist()]

    def _completion(self, new_ids: list[int]) -> Completion:
        stops = [i for i, t in enumerate(new_ids) if t in self.stop_ids]
        if stops:
            new_ids, reason = new_ids[: stops[0]], "stop"
        else:
            reason = "length"
        text = self.fmt.tokenizer.decode(new_ids, skip_special_tokens=True)
        return Completion(text, reason)
