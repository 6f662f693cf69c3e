"""Rows being regenerated and the two generation back ends of `dflash-train regenerate`.

- `ServerBackend`: any OpenAI-compatible chat-completions server (vLLM, SGLang), requests in
  flight up to the concurrency, retries with exponential back-off on connection errors,
  timeouts, HTTP 408, 429 and 5xx, and an answer the server ended otherwise than "stop" or
  "length" (vLLM's "abort"); HTTP 401, 403 and 404 stop the run (`ServerRefused`);
- `LocalBackend`: the target loaded with transformers, batched generation with left padding.

Each back end takes its own settings; the command (`regenerate.make_backend`) picks one.
"""

from __future__ import annotations

import email.utils
import itertools
import json
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.client import HTTPException
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

import torch

from dflash_train.data.chat import ChatFormat, load_chat_template
from dflash_train.data.formats import (
    ConversationError,
    Message,
    OnError,
    prompt_messages,
)
from dflash_train.data.tokenizer import load_tokenizer
from dflash_train.devices import parse_devices, resolve_dtype
from dflash_train.model.target import load_causal_lm

Turns = Literal["all", "last"]
_T = TypeVar("_T")
MAX_BACKOFF_S = 60.0  # longest single back-off sleep between retries
FINISHED = ("stop", "length")
"""The finish reasons of an answer the model ended itself ("stop") or the token limit cut
("length"); any other ("abort", "tool_calls", "content_filter", one a server makes up) is a
failed attempt, retried like a transient error."""
IDS = {"return_token_ids": True}
"""What asks an OpenAI-compatible server for a completion's generated ids (vLLM: `token_ids` of
each choice, through the stop token, as the local back end gives them); a server that does not
know the field ignores it (vLLM, SGLang) or refuses it (then it is not sent again)."""


# ============================================================================ rows


@dataclass
class Completion:
    """One generated assistant turn."""

    text: str
    finish_reason: str
    token_ids: list[int] | None = None
    """The ids the model generated, through the stop token that ended the turn (none after a
    "length" stop); None from a back end that returns text only."""


class RowError(Exception):
    """A row that could not be regenerated; `retryable` errors may succeed on another attempt,
    after at least `retry_after` seconds when the server said so (HTTP 429, 503)."""

    def __init__(
        self, message: str, *, retryable: bool = False, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after = retry_after


class Stopped(RowError):
    """The run is stopping: the row was abandoned, not failed (a re-run will do it)."""


class ServerRefused(RowError):
    """An answer no row can get past (HTTP 401, 403, 404 on the completions endpoint: the
    credentials, the URL or the model name): the run stops at once, whatever --on-error says."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class RowJob:
    """One input conversation being regenerated: its output turns, with None where an answer is
    still to be generated, filled in order."""

    source_line: int
    turns: list[Message | None]
    finish_reasons: list[str] = field(default_factory=list)
    token_ids: list[list[int] | None] = field(default_factory=list)

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
        self.token_ids.append(completion.token_ids)

    def output(self, settings: dict[str, Any]) -> dict[str, Any]:
        assert self.done
        row = {
            "messages": self.turns,
            "source_line": self.source_line,
            "finish_reasons": self.finish_reasons,
        }
        if all(ids is not None for ids in self.token_ids):
            # The text is decoded for reading; prepare trains the last answer on these ids,
            # which re-tokenising the text need not give back (see formats.answer_ids).
            row["token_ids"] = self.token_ids
        return {**row, "regenerated_with": settings}


@dataclass(frozen=True)
class RowFailure:
    source_line: int
    reason: str


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
        and returns it, after writing every row that finished. `ServerRefused` and
        KeyboardInterrupt propagate, after writing the rows already finished."""
        ...


@dataclass(frozen=True)
class GenerationSettings:
    """How every answer is generated, and what a failed row does, whichever the back end."""

    temperature: float
    """0: greedy."""
    max_new_tokens: int
    """Most tokens generated per assistant turn."""
    enable_thinking: bool | None
    """The chat template's enable_thinking switch; None: the template's default."""
    on_error: OnError
    """fail: a failed row stops the run; skip: it is reported and the run goes on."""


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
    """Requests to an OpenAI-compatible /chat/completions endpoint from `concurrency` worker
    threads.

    In flight: at most `2 * concurrency` rows are handed to the workers (`concurrency` running,
    as many queued), so memory does not grow with the input. Finished rows come back to the
    caller's thread through a queue and are written there. The workers are daemon threads: an
    interrupt (Ctrl-C) or a refusal (`ServerRefused`) writes the rows already back and leaves at
    once, abandoning the requests on the wire (their rows are redone by the next run), and the
    interpreter does not wait for them at exit. Each attempt takes at most about
    `request_timeout` seconds, its body included; each back-off sleep waits on the stop event,
    so stopping never waits for a back-off to end.
    """

    name = "server"

    def __init__(
        self,
        endpoint: str,
        generation: GenerationSettings,
        *,
        model: str | None,
        concurrency: int,
        max_retries: int,
        retry_delay: float,
        request_timeout: float,
    ) -> None:
        """`model` None: the server's only model. A failed request (connection error, timeout,
        HTTP 408, 429, 5xx, an answer ended otherwise than "stop" or "length") is retried
        `max_retries` times, after `retry_delay` seconds doubled per retry, or the server's
        Retry-After when longer (at most MAX_BACKOFF_S); each attempt, connecting and reading
        the whole answer, takes at most about `request_timeout` seconds."""
        self.generation = generation
        self.base = endpoint.rstrip("/")
        self.concurrency = concurrency
        self.max_retries, self.retry_delay = max_retries, retry_delay
        self.request_timeout = request_timeout
        self.stop = threading.Event()
        self.headers = {"Content-Type": "application/json"}
        if key := os.environ.get("OPENAI_API_KEY"):
            self.headers["Authorization"] = f"Bearer {key}"
        self.model = model or self._only_model()
        self.ask_ids = True  # ask for the generated ids (`IDS`) until the server refuses them

    def run(
        self, jobs: Iterator[RowJob], write: WriteRow, failures: list[RowFailure]
    ) -> RowFailure | None:
        """Regenerate `jobs`, calling `write(job)` on this thread as rows complete."""
        window = 2 * self.concurrency
        todo: queue.SimpleQueue[RowJob | None] = queue.SimpleQueue()
        done: queue.SimpleQueue[tuple[RowJob, BaseException | None]] = queue.SimpleQueue()
        for i in range(self.concurrency):
            threading.Thread(
                target=self._work, args=(todo, done), name=f"regenerate-http-{i}", daemon=True
            ).start()
        fatal: RowFailure | None = None
        in_flight = 0
        try:
            while True:
                while fatal is None and in_flight < window:
                    job = next(jobs, None)
                    if job is None:
                        break
                    todo.put(job)
                    in_flight += 1
                if in_flight == 0:
                    return fatal
                try:
                    job, error = done.get(timeout=0.5)
                except queue.Empty:
                    continue
                in_flight -= 1
                if error is None:
                    write(job)
                elif isinstance(error, ServerRefused):
                    self._write_finished(done, write)
                    raise error
                elif isinstance(error, Stopped):
                    continue
                elif isinstance(error, RowError):
                    stop_now = _failure(job, error, self.generation.on_error, failures)
                    if stop_now is not None and fatal is None:
                        fatal = stop_now
                        self.stop.set()  # requests on the wire finish; queued rows are dropped
                else:
                    raise error  # a bug in a worker: its traceback, on this thread
        except KeyboardInterrupt:
            self._write_finished(done, write)
            raise
        finally:
            # Leaving (done, refused, interrupted): end back-offs now, let the idle workers go;
            # requests still on the wire are abandoned with their daemon threads.
            self.stop.set()
            for _ in range(self.concurrency):
                todo.put(None)

    def _write_finished(
        self, done: queue.SimpleQueue[tuple[RowJob, BaseException | None]], write: WriteRow
    ) -> None:
        """Leaving early: stop the workers, then write the rows whose answers are already back."""
        self.stop.set()
        while True:
            try:
                job, error = done.get_nowait()
            except queue.Empty:
                return
            if error is None:
                write(job)

    def _work(
        self,
        todo: queue.SimpleQueue[RowJob | None],
        done: queue.SimpleQueue[tuple[RowJob, BaseException | None]],
    ) -> None:
        while (job := todo.get()) is not None:
            try:
                while not job.done:
                    job.add(self.complete(job.next_prompt()))
            except BaseException as e:  # handed to the caller's thread
                if isinstance(e, ServerRefused):
                    self.stop.set()  # no other row can succeed: send nothing more
                done.put((job, e))
            else:
                done.put((job, None))

    def complete(self, messages: list[Message]) -> Completion:
        """One chat completion, retried on transient errors."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.generation.temperature,
            "max_tokens": self.generation.max_new_tokens,
        }
        if self.generation.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.generation.enable_thinking}
        if self.ask_ids:
            try:
                return self._request("/chat/completions", {**body, **IDS}, _parse_completion)
            except ServerRefused:
                raise
            except RowError as e:
                if "return_token_ids" not in str(e) or not str(e).startswith("HTTP 4"):
                    raise
                self.ask_ids = False  # a server that refuses the field: text only from now on
        return self._request("/chat/completions", body, _parse_completion)

    def _only_model(self) -> str:
        try:
            listing = self._request("/models", None, lambda response: response)
        except ServerRefused as e:
            if e.code == 404:
                raise ValueError(
                    f"cannot list the models of {self.base}: {e}; check --endpoint, or pass --model"
                ) from None
            raise ValueError(f"cannot list the models of {self.base}: {e}") from None
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

    def _request(
        self, path: str, body: dict[str, Any] | None, parse: Callable[[dict[str, Any]], _T]
    ) -> _T:
        """GET (body None) or POST JSON, its answer read by `parse`, with retries and
        exponential back-off (Retry-After when the server asks for longer)."""
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if self.stop.is_set():
                raise Stopped("stopped")
            try:
                return parse(self._attempt(path, body))
            except ServerRefused:
                raise
            except RowError as e:
                if not e.retryable or attempt == attempts - 1:
                    note = f" (after {attempts} attempts)" if e.retryable and attempt else ""
                    raise RowError(f"{e}{note}") from None
                delay = max(backoff_delay(self.retry_delay, attempt), e.retry_after or 0.0)
            if self.stop.wait(min(delay, MAX_BACKOFF_S)):
                raise Stopped("stopped")
        raise AssertionError("unreachable")

    def _attempt(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """One request: connecting, the headers and the whole body within about
        `request_timeout` seconds (a server trickling its answer is timed out too)."""
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        deadline = time.monotonic() + self.request_timeout
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                payload = _read_body(response, deadline)
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace").strip()
            message = f"HTTP {e.code} from {self.base}{path}: {detail}"
            if e.code in (401, 403):
                raise ServerRefused(
                    f"{message}; check OPENAI_API_KEY (sent as the bearer token)", code=e.code
                ) from None
            if e.code == 404:
                hint = "" if path == "/models" else "; check --endpoint and --model"
                raise ServerRefused(f"{message}{hint}", code=e.code) from None
            wait = retry_after(e.headers.get("Retry-After")) if e.code in (429, 503) else None
            retryable = e.code in (408, 429) or e.code >= 500
            raise RowError(message, retryable=retryable, retry_after=wait) from None
        except _Timeout:
            raise RowError(
                f"request to {self.base}{path} timed out after {self.request_timeout:g} s "
                "(--request-timeout)",
                retryable=True,
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


class _Timeout(Exception):
    """An attempt's deadline passed while its answer was still arriving."""


def _read_body(response: Any, deadline: float) -> bytes:
    """The whole body of `response`, read chunk by chunk until `deadline` (a monotonic time):
    each read waits at most the time left, so a slow or trickling answer cannot hold an attempt
    past it."""
    # The socket's per-read timeout, narrowed to the time left (http.client keeps the socket
    # behind its file object; without it, each read still waits at most request_timeout).
    sock = getattr(getattr(response.fp, "raw", None), "_sock", None)
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout
        if sock is not None and not response.isclosed():
            sock.settimeout(left)
        try:
            chunk = response.read1(65536)
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise _Timeout from None
            raise
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def backoff_delay(retry_delay: float, attempt: int) -> float:
    """The sleep before retry `attempt + 1`: `retry_delay` doubled per retry, at most
    MAX_BACKOFF_S (the exponent is capped first: 2**1024 is no float)."""
    return min(retry_delay * 2.0 ** min(attempt, 32), MAX_BACKOFF_S)


def retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks to wait (a number of seconds, or an HTTP date); None
    when it is absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if seconds != seconds:  # NaN
        return None
    return max(seconds, 0.0)


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
    ids = choice.get("token_ids")
    if reasoning:
        if content or choice.get("finish_reason") != "length":
            content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
        else:  # cut inside its reasoning: the model never closed the block
            content = f"<think>\n{reasoning.lstrip()}"
        ids = None  # the ids are of the text as generated, not of this reassembly of it
    if ids is not None and not (
        isinstance(ids, list) and all(type(i) is int and i >= 0 for i in ids)
    ):
        raise RowError(f"chat-completions token_ids is not a list of token ids: {str(ids)[:200]}")
    reason = choice.get("finish_reason") or "stop"
    if reason not in FINISHED:
        # vLLM's "abort" (the request was cancelled: the answer is cut short), "tool_calls"
        # (not asked for), "content_filter" (not the model's own text), or unknown: not an
        # answer to train on. Retried like a transient error, then the row fails.
        raise RowError(
            f"the server ended the answer with finish_reason {str(reason)[:50]!r}, not "
            '"stop" or "length"',
            retryable=True,
        )
    return Completion(content, reason, ids)


class LocalBackend:
    """The target loaded with transformers; `batch_size` rows generated together.

    Prompts are left-padded so every row's last prompt token sits at the same position and
    generation appends after it; the attention mask hides the padding.
    """

    name = "local"

    def __init__(
        self,
        target: str | Path,
        generation: GenerationSettings,
        *,
        tokenizer: str | Path | None,
        chat_template: str | Path | None,
        device: str,
        dtype: str,
        batch_size: int,
        seed: int,
    ) -> None:
        """`tokenizer` None: the target directory's. `chat_template`: a Jinja file to use instead
        of the tokenizer's template. `dtype` "auto": bfloat16 on CUDA, float32 on CPU. `seed`
        seeds sampling (temperature > 0)."""
        self.generation = generation
        self.target = Path(target)
        if not self.target.is_dir():
            raise ValueError(f"target directory {self.target} does not exist")
        self.model = self.target.name
        devices = parse_devices(device, "--device")
        if len(devices) != 1:
            raise ValueError(f"--device: the local back end runs on one device, got {device!r}")
        self.device = devices[0]
        self.dtype = resolve_dtype(dtype, self.device)
        self.batch_size, self.seed = batch_size, seed
        loaded = load_tokenizer(tokenizer or self.target)
        self.fmt = ChatFormat(
            loaded,
            chat_template=load_chat_template(chat_template),
            enable_thinking=generation.enable_thinking,
        )
        self.stop_ids = self.fmt.stop_token_ids
        if not self.stop_ids:
            raise ValueError("the tokenizer has no eos or end-of-turn token to stop generation")
        pad = loaded.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self.lm: Any = None  # loaded by run(): a resumed run with nothing left never loads it

    def _load_model(self) -> None:
        # As training and eval load it: a wrapper's text model, the family's attention.
        self.lm = load_causal_lm(self.target, self.device, self.dtype)
        vocab = self.lm.get_input_embeddings().weight.shape[0]
        if len(self.fmt.tokenizer) > vocab:
            raise ValueError(
                f"the tokenizer has {len(self.fmt.tokenizer)} tokens but the target embeds only "
                f"{vocab}: they do not belong together"
            )
        torch.manual_seed(self.seed)

    def run(
        self, jobs: Iterator[RowJob], write: WriteRow, failures: list[RowFailure]
    ) -> RowFailure | None:
        """Regenerate `jobs` batch by batch; rows are written when all their turns are done."""
        while batch := list(itertools.islice(jobs, self.batch_size)):
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
                    fatal = _failure(job, RowError(str(e)), self.generation.on_error, failures)
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
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        sample = self.generation.temperature > 0
        extra = {"temperature": self.generation.temperature} if sample else {}
        with torch.no_grad():
            out = self.lm.generate(
                input_ids=ids.to(self.device),
                attention_mask=attention.to(self.device),
                max_new_tokens=self.generation.max_new_tokens,
                do_sample=sample,
                eos_token_id=self.stop_ids,
                pad_token_id=self.pad_id,
                **extra,
            )
        return [self._completion(row) for row in out[:, width:].tolist()]

    def _completion(self, new_ids: list[int]) -> Completion:
        stops = [i for i, t in enumerate(new_ids) if t in self.stop_ids]
        if stops:
            generated, reason = new_ids[: stops[0] + 1], "stop"
            text_ids = generated[:-1]
        else:
            generated = text_ids = new_ids
            reason = "length"
        text = self.fmt.tokenizer.decode(text_ids, skip_special_tokens=True)
        return Completion(text, reason, generated)
