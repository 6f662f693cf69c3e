"""Rows being regenerated and the two generation back ends of `dflash-train regenerate`.

- `ServerBackend`: any OpenAI-compatible chat-completions server (vLLM, SGLang), requests in
  flight up to the concurrency, retries with exponential back-off on connection errors,
  timeouts, HTTP 408, 429 and 5xx;
- `LocalBackend`: the target loaded with transformers, batched generation with left padding.

Each back end takes its own settings; the command (`regenerate.make_backend`) picks one.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from http.client import HTTPException
from pathlib import Path
from typing import Any, Literal, Protocol

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
MAX_BACKOFF_S = 60.0  # longest single back-off sleep between retries
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
        and returns it, after writing every row that finished."""
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
    """Requests to an OpenAI-compatible /chat/completions endpoint from a pool of threads.

    In flight: at most `2 * concurrency` rows are submitted (`concurrency` running, as many
    queued), so memory does not grow with the input. Each request has a socket timeout; each
    back-off sleep waits on the stop event, so stopping never waits for a back-off to end.
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
        HTTP 408, 429, 5xx) is retried `max_retries` times, after `retry_delay` seconds doubled
        per retry (at most MAX_BACKOFF_S); each request waits `request_timeout` seconds."""
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
        fatal: RowFailure | None = None
        pending: dict[Future, RowJob] = {}
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="regenerate-http")
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
                        stop_now = _failure(job, e, self.generation.on_error, failures)
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
            "temperature": self.generation.temperature,
            "max_tokens": self.generation.max_new_tokens,
        }
        if self.generation.enable_thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.generation.enable_thinking}
        if self.ask_ids:
            try:
                return _parse_completion(self._request("/chat/completions", {**body, **IDS}))
            except RowError as e:
                if "return_token_ids" not in str(e) or not str(e).startswith("HTTP 4"):
                    raise
                self.ask_ids = False  # a server that refuses the field: text only from now on
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
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if self.stop.is_set():
                raise Stopped("stopped")
            try:
                return self._attempt(path, body)
            except RowError as e:
                if not e.retryable or attempt == attempts - 1:
                    note = f" (after {attempts} attempts)" if e.retryable else ""
                    raise RowError(f"{e}{note}") from None
            if self.stop.wait(min(self.retry_delay * 2**attempt, MAX_BACKOFF_S)):
                raise Stopped("stopped")
        raise AssertionError("unreachable")

    def _attempt(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(self.base + path, data=data, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
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
    return Completion(content, choice.get("finish_reason") or "stop", ids)


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
