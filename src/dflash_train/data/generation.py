"""Rows being regenerated and the two generation back ends of `dflash-train regenerate`.

- `ServerBackend`: any OpenAI-compatible chat-completions server (vLLM, SGLang), requests in
  flight up to the concurrency, retries with exponential back-off on connection errors,
  timeouts, HTTP 408, 429 and 5xx, and an answer the server ended otherwise than "stop" or
  "length" (vLLM's "abort"); an empty answer fails its row; HTTP 401, 403 and 404 stop the
  run (`ServerRefused`);
- `LocalBackend`: the target loaded with transformers, batched generation with left padding;
  an empty answer fails its row, and a row that runs past the target's maximum length is
  named in a warning.

Each back end takes its own settings; the command (`regenerate.make_backend`) picks one.
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import http.client
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
import urllib.parse
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
from dflash_train.data.prompts import eos_token_ids
from dflash_train.data.tokenizer import load_tokenizer
from dflash_train.devices import parse_devices, resolve_dtype
from dflash_train.model.target import load_causal_lm

Turns = Literal["all", "last"]
_T = TypeVar("_T")
MAX_BACKOFF_S = 60.0  # longest single back-off sleep between retries
POLL_S = 0.5
"""Longest single wait of the server back end's threads on a queue: the main thread for a
finished row, a worker for its next row (then each checks whether the run is stopping)."""
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
    warnings: list[str] = field(default_factory=list)
    """What the user is told about the row, one line each, without the row's name: printed
    when the row is written, or as part of its failure."""

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
    failure = RowFailure(job.source_line, "; ".join([str(error), *job.warnings]))
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
    interrupt (Ctrl-C), a refusal (`ServerRefused`) or a failed row under --on-error fail
    writes the rows already back and leaves at once, abandoning the requests on the wire (their
    rows are redone by the next run), and the interpreter does not wait for them at exit. The
    stop event ends the run's waits: a worker sends no request once it is set (the worker whose
    row failed sets it itself), each back-off sleep waits on it, and an idle worker sees it
    within POLL_S. Each attempt takes at most about `request_timeout` seconds, its body
    included.
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
        self.route = _Route.to(self.base)
        self.concurrency = concurrency
        self.max_retries, self.retry_delay = max_retries, retry_delay
        self.request_timeout = request_timeout
        self.stop = threading.Event()
        # A User-Agent as urllib sent one (http.client sends none: some gateways refuse that).
        self.headers = {"Content-Type": "application/json", "User-Agent": "dflash-train"}
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
        in_flight = 0
        try:
            while True:
                while in_flight < window and (job := next(jobs, None)) is not None:
                    todo.put(job)
                    in_flight += 1
                if in_flight == 0:
                    return None
                try:
                    job, error = done.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                in_flight -= 1
                if isinstance(error, ServerRefused):
                    self._write_finished(done, write)
                    raise error
                fatal = self._finished(job, error, write, failures)
                if fatal is not None:  # --on-error fail: stop now, without waiting for the wire
                    self._write_finished(done, write)
                    return fatal
        except KeyboardInterrupt:
            self._write_finished(done, write)
            raise
        finally:
            # Leaving (done, failed, refused, interrupted): end back-offs now, let the idle
            # workers go; requests still on the wire are abandoned with their daemon threads.
            self.stop.set()
            for _ in range(self.concurrency):
                todo.put(None)

    def _finished(
        self,
        job: RowJob,
        error: BaseException | None,
        write: WriteRow,
        failures: list[RowFailure],
    ) -> RowFailure | None:
        """A row back from a worker: written, or recorded as failed; returns the failure that
        stops the run (--on-error fail)."""
        if error is None:
            write(job)
            return None
        if isinstance(error, Stopped):
            return None  # abandoned as the run stops: the next run does it
        if isinstance(error, RowError):
            return _failure(job, error, self.generation.on_error, failures)
        raise error  # a bug in a worker: its traceback, on this thread

    def _write_finished(
        self, done: queue.SimpleQueue[tuple[RowJob, BaseException | None]], write: WriteRow
    ) -> None:
        """Leaving early: stop the workers, then write the rows whose answers are already back
        (complete rows only; those still on the wire are redone by the next run)."""
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
        while (job := self._next_job(todo)) is not None:
            try:
                while not job.done:
                    job.add(self.complete(job.next_prompt()))
            except BaseException as e:  # handed to the caller's thread
                if self._ends_the_run(e):
                    self.stop.set()  # at once: no worker sends another request
                done.put((job, e))
            else:
                done.put((job, None))

    def _ends_the_run(self, error: BaseException) -> bool:
        """Whether a worker's error ends the run: a refusal no row gets past, a failed row
        under --on-error fail, a bug; not a row abandoned as the run stops."""
        if isinstance(error, Stopped):
            return False
        if isinstance(error, RowError) and not isinstance(error, ServerRefused):
            return self.generation.on_error == "fail"
        return True

    def _next_job(self, todo: queue.SimpleQueue[RowJob | None]) -> RowJob | None:
        """The next row for a worker; None once the run stops (the stop event, or the None each
        worker is sent on leaving). Each wait is timed, so a stop is seen within POLL_S."""
        while not self.stop.is_set():
            try:
                return todo.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return None

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
        deadline = time.monotonic() + self.request_timeout
        try:
            status, wait, payload = self._exchange(path, data, deadline)
        except TimeoutError:  # a socket timeout: each wait was cut to the time left
            raise RowError(
                f"request to {self.base}{path} timed out after {self.request_timeout:g} s "
                "(--request-timeout)",
                retryable=True,
            ) from None
        except (OSError, HTTPException) as e:  # refused, reset, DNS, TLS, a garbled answer
            raise RowError(f"request to {self.base}{path} failed: {e}", retryable=True) from None
        if not 200 <= status < 300:
            raise self._http_error(path, status, wait, payload)
        try:
            return json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RowError(f"{self.base}{path} returned invalid JSON: {payload[:200]!r}") from None

    def _exchange(
        self, path: str, data: bytes | None, deadline: float
    ) -> tuple[int, str | None, bytes]:
        """Send one request on a new connection and read its answer by `deadline` (a monotonic
        time): (status, its Retry-After header, body)."""
        conn = self.route.connect(self.request_timeout)
        # The socket this connection opened, kept here: http.client lets go of it (`sock` None)
        # once an answer says "Connection: close", while the answer still reads from it. Every
        # wait on it is cut to the time left before the deadline.
        sock = conn.sock
        response = None
        try:
            _time_left(sock, deadline)
            method = "GET" if data is None else "POST"
            headers = {**self.headers, **self.route.request_headers}
            conn.request(method, self.route.prefix + path, data, headers)
            _time_left(sock, deadline)
            response = conn.getresponse()
            payload = _read_body(response, sock, deadline)
            return response.status, response.getheader("Retry-After"), payload
        finally:
            if response is not None:
                response.close()
            conn.close()

    def _http_error(self, path: str, status: int, wait: str | None, payload: bytes) -> RowError:
        """The error an HTTP error answer is: `ServerRefused` (401, 403, 404: no row can get
        past it), retryable (408, 429, 5xx) or not (any other)."""
        detail = payload[:300].decode("utf-8", "replace").strip()
        message = f"HTTP {status} from {self.base}{path}: {detail}"
        if status in (401, 403):
            return ServerRefused(
                f"{message}; check OPENAI_API_KEY (sent as the bearer token)", code=status
            )
        if status == 404:
            hint = "" if path == "/models" else "; check --endpoint and --model"
            return ServerRefused(f"{message}{hint}", code=status)
        after = retry_after(wait) if status in (429, 503) else None
        retryable = status in (408, 429) or status >= 500
        return RowError(message, retryable=retryable, retry_after=after)


@dataclass(frozen=True)
class _Route:
    """How the requests reach --endpoint: directly, or through the proxy the environment names
    for it (http_proxy, https_proxy, no_proxy, read as urllib reads them): a plain-HTTP proxy
    carries an http:// endpoint's requests, and tunnels (CONNECT) to an https:// one."""

    host: str
    port: int
    https: bool
    prefix: str
    """What precedes a request's path (/models): the endpoint's path, or its whole URL when a
    proxy carries the request."""
    tunnel: tuple[str, int] | None = None
    proxy_auth: dict[str, str] = field(default_factory=dict)
    """Proxy-Authorization, from credentials in the proxy's URL."""

    @classmethod
    def to(cls, base: str) -> _Route:
        url = urllib.parse.urlsplit(base)
        https = url.scheme == "https"
        host, port = url.hostname or "", _port(url, f"--endpoint {base}") or (443 if https else 80)
        proxy = _environment_proxy(url)
        if proxy is None or proxy.hostname is None:
            return cls(host, port, https, url.path)
        auth = {}
        if proxy.username is not None:
            user, password = proxy.username, proxy.password or ""
            pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
            auth["Proxy-Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        proxy_port = _port(proxy, f"the {url.scheme}_proxy environment variable") or 80
        if https:
            return cls(proxy.hostname, proxy_port, True, url.path, (host, port), auth)
        return cls(proxy.hostname, proxy_port, False, base, None, auth)

    @property
    def request_headers(self) -> dict[str, str]:
        """Headers every request carries for the proxy (a tunnel sends them once, on CONNECT)."""
        return {} if self.tunnel is not None else self.proxy_auth

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        """A new connection, connected; `timeout` bounds the connecting."""
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = kind(self.host, self.port, timeout=timeout)
        if self.tunnel is not None:
            conn.set_tunnel(*self.tunnel, headers=self.proxy_auth)
        try:
            conn.connect()
        except BaseException:
            conn.close()
            raise
        return conn


def _environment_proxy(url: urllib.parse.SplitResult) -> urllib.parse.SplitResult | None:
    """The proxy the environment names for `url`, or None to connect directly."""
    proxy = urllib.request.getproxies().get(url.scheme)
    if not proxy or urllib.request.proxy_bypass(url.netloc):
        return None
    return urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")


def _port(url: urllib.parse.SplitResult, what: str) -> int | None:
    """The port `url` names, None when it names none; a ValueError naming `what` (not the URL:
    a proxy's may hold a password) when it is no port number."""
    try:
        return url.port
    except ValueError:
        raise ValueError(f"{what} names no valid port") from None


def _time_left(sock: socket.socket, deadline: float) -> None:
    """Cut the socket's waits to the time left before `deadline`; past it, a TimeoutError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)


def _read_body(response: http.client.HTTPResponse, sock: socket.socket, deadline: float) -> bytes:
    """The whole body of `response`, read chunk by chunk from `sock` until `deadline`: each read
    waits at most the time left, so a slow or trickling answer cannot hold an attempt past it
    (a TimeoutError then)."""
    chunks = []
    while not response.isclosed():  # http.client closes it once the body is all read
        _time_left(sock, deadline)
        chunk = response.read1(65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


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
    if ended_at_once(reason, content, ids):
        # Nothing to train on (prepare would drop the row without a word). Not retried: a
        # greedy target gives the same empty answer again, each retry after a longer back-off.
        raise RowError(empty_answer(reason))
    return Completion(content, reason, ids)


def ended_at_once(reason: str, text: str, ids: list[int] | tuple[int, ...] | None) -> bool:
    """Whether an answer is empty: the model ended its turn at once, with no text and no token
    but the stop token. White space, or tokens that decode to no text (a random target's, cut
    at the limit), are the model's answer all the same: prepare trains on them."""
    return reason == "stop" and not text and len(ids or ()) <= 1


def empty_answer(reason: str) -> str:
    """The failure of an answer that ended at once (`ended_at_once`)."""
    return f"the answer is empty (finish_reason {reason!r}): nothing to train on"


_LENGTH_WARNINGS = {
    "transformers.generation.stopping_criteria": "This is a friendly reminder - the current "
    "text generation call has exceeded the model's predefined maximum length",
    "transformers.tokenization_utils_base": "Token indices sequence length is longer than the "
    "specified maximum sequence length",
}
"""transformers' warnings that a sequence is too long, by logger: they name no row, so the local
back end says which rows ran past the limit instead (`LocalBackend._check_length`)."""


def _not_a_length_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_LENGTH_WARNINGS[record.name])


@contextlib.contextmanager
def _quiet_length_warnings() -> Iterator[None]:
    """Drop transformers' too-long warnings while the local back end generates."""
    loggers = [logging.getLogger(name) for name in _LENGTH_WARNINGS]
    for logger in loggers:
        logger.addFilter(_not_a_length_warning)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_not_a_length_warning)


def length_limit(lm: Any, tokenizer: Any) -> tuple[int, str] | None:
    """The longest sequence the target takes, and what says so: the model's
    max_position_embeddings, or the tokenizer's model_max_length when smaller (transformers
    sets a huge one where the tokenizer names none); None when neither is known."""
    known = []
    positions = getattr(lm.config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        known.append((positions, "its max_position_embeddings"))
    tokens = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokens, int) and 0 < tokens < 10**12:
        known.append((tokens, "its tokenizer's model_max_length"))
    return min(known) if known else None


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
        self.limit: tuple[int, str] | None = None
        """The longest sequence the target takes, and what says so (set with the model)."""

    def _load_model(self) -> None:
        # As training and eval load it: a wrapper's text model, the family's attention.
        self.lm = load_causal_lm(self.target, self.device, self.dtype)
        vocab = self.lm.get_input_embeddings().weight.shape[0]
        if len(self.fmt.tokenizer) > vocab:
            raise ValueError(
                f"the tokenizer has {len(self.fmt.tokenizer)} tokens but the target embeds only "
                f"{vocab}: they do not belong together"
            )
        self.limit = length_limit(self.lm, self.fmt.tokenizer)
        # Where eval and a serving engine stop the target too (its generation config's eos).
        self.stop_ids = eos_token_ids(self.lm, self.fmt.tokenizer, self.fmt.stop_token_ids)
        torch.manual_seed(self.seed)

    def run(
        self, jobs: Iterator[RowJob], write: WriteRow, failures: list[RowFailure]
    ) -> RowFailure | None:
        """Regenerate `jobs` batch by batch; rows are written when all their turns are done."""
        with _quiet_length_warnings():
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
            active, fatal = self._add_answers(ready, prompts, failures)
            if fatal is not None:
                return fatal
        return None

    def _add_answers(
        self, ready: list[RowJob], prompts: list[Any], failures: list[RowFailure]
    ) -> tuple[list[RowJob], RowFailure | None]:
        """Generate the next answer of each row of `ready` and add it; an empty one fails its
        row. Returns the rows with turns still to do, and the failure that stops the run (the
        first, under --on-error fail: every answer of this call is added first)."""
        active, fatal = [], None
        for job, prompt, completion in zip(ready, prompts, self.generate(prompts), strict=True):
            self._check_length(job, len(prompt), completion)
            if ended_at_once(completion.finish_reason, completion.text, completion.token_ids):
                error = RowError(empty_answer(completion.finish_reason))
                stop_now = _failure(job, error, self.generation.on_error, failures)
                fatal = fatal or stop_now
                continue
            job.add(completion)
            if not job.done:
                active.append(job)
        return active, fatal

    def _check_length(self, job: RowJob, prompt_len: int, completion: Completion) -> None:
        """Warn (once per row) when a turn ran past the target's maximum length: transformers'
        own warning names no row, and measures the padded batch, not the row."""
        answer_len = len(completion.token_ids or ())
        if self.limit is None or job.warnings or prompt_len + answer_len <= self.limit[0]:
            return
        limit, what = self.limit
        job.warnings.append(
            f"its prompt ({prompt_len} tokens) and answer ({answer_len}) run past the target's "
            f"maximum length {limit} ({what}): the answer may be degraded"
        )

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
