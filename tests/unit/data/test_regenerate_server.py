"""The server back end's retry policy: back-off delays, Retry-After, finish reasons."""

from __future__ import annotations

import email.utils
import queue
import threading
import time

import pytest

from dflash_train.data.generation import (
    MAX_BACKOFF_S,
    POLL_S,
    GenerationSettings,
    RowError,
    ServerBackend,
    _parse_completion,
    backoff_delay,
    retry_after,
)


class _Waits:
    """A stop event that never stops and records each back-off asked of it."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    def is_set(self) -> bool:
        return False

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return False


def _unconnected(max_retries: int = 0, retry_delay: float = 0.0) -> ServerBackend:
    """A back end for an endpoint nothing listens on (it is given its model: no request)."""
    generation = GenerationSettings(0.0, 8, None, "fail")
    return ServerBackend(
        "http://127.0.0.1:9/v1",
        generation,
        model="m",
        concurrency=1,
        max_retries=max_retries,
        retry_delay=retry_delay,
        request_timeout=1.0,
    )


def _backend(max_retries: int, retry_delay: float, error: RowError) -> tuple[ServerBackend, _Waits]:
    """A back end (never contacting its endpoint) whose every attempt fails with `error`."""
    backend = _unconnected(max_retries, retry_delay)
    waits = _Waits()
    backend.stop = waits  # type: ignore[assignment]

    def attempt(path, body):
        raise error

    backend._attempt = attempt  # type: ignore[method-assign]
    return backend, waits


@pytest.mark.parametrize("retry_delay", [0.0, 1.0])
def test_many_retries_back_off_without_overflowing(retry_delay):
    """Regression: `retry_delay * 2**attempt` overflowed a float (OverflowError) past 1023
    retries, before the cap applied."""
    backend, waits = _backend(1100, retry_delay, RowError("HTTP 503", retryable=True))
    with pytest.raises(RowError, match=r"HTTP 503 \(after 1101 attempts\)"):
        backend._request("/chat/completions", {}, lambda r: r)
    assert len(waits.waits) == 1100
    assert max(waits.waits) == (MAX_BACKOFF_S if retry_delay else 0.0)
    assert backoff_delay(1.0, 0) == 1.0 and backoff_delay(1.0, 3) == 8.0
    assert backoff_delay(1e308, 10**9) == MAX_BACKOFF_S


def test_retry_after_lengthens_the_back_off_up_to_the_cap():
    error = RowError("HTTP 429", retryable=True, retry_after=5.0)
    backend, waits = _backend(2, 0.5, error)
    with pytest.raises(RowError):
        backend._request("/chat/completions", {}, lambda r: r)
    assert waits.waits == [5.0, 5.0]
    error = RowError("HTTP 503", retryable=True, retry_after=3600.0)
    backend, waits = _backend(1, 0.5, error)
    with pytest.raises(RowError):
        backend._request("/chat/completions", {}, lambda r: r)
    assert waits.waits == [MAX_BACKOFF_S]


def test_retry_after_reads_seconds_and_http_dates():
    assert retry_after("7") == 7.0 and retry_after(" 1.5 ") == 1.5
    assert retry_after("-3") == 0.0
    assert retry_after(None) is None and retry_after("soon") is None
    assert retry_after("nan") is None
    ahead = retry_after(email.utils.formatdate(time.time() + 30, usegmt=True))
    assert ahead is not None and 28 <= ahead <= 30
    assert retry_after(email.utils.formatdate(time.time() - 30, usegmt=True)) == 0.0


def _choice(reason):
    return {"choices": [{"message": {"content": "hi"}, "finish_reason": reason}]}


@pytest.mark.parametrize(
    ("reason", "kept"), [("stop", "stop"), ("length", "length"), (None, "stop")]
)
def test_answers_the_model_ended_or_the_limit_cut_are_kept(reason, kept):
    assert _parse_completion(_choice(reason)).finish_reason == kept


@pytest.mark.parametrize("reason", ["abort", "tool_calls", "content_filter", "error", 3])
def test_any_other_finish_reason_is_a_retryable_failure(reason):
    """Regression: vLLM's "abort" (a cancelled request, its answer cut short) was written as a
    finished answer."""
    with pytest.raises(RowError, match="finish_reason") as caught:
        _parse_completion(_choice(reason))
    assert caught.value.retryable


def test_an_idle_worker_leaves_when_the_run_stops_without_its_none():
    """Regression: a worker waited for its next row in `todo.get()` with no timeout: only the
    None each worker is sent on leaving ended it, not the run's stop event."""
    backend = _unconnected()
    todo: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()
    worker = threading.Thread(target=backend._work, args=(todo, done), daemon=True)
    worker.start()
    time.sleep(0.1)  # waiting for a row
    stopped = time.monotonic()
    backend.stop.set()
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert time.monotonic() - stopped <= POLL_S + 0.5
    assert done.empty()


@pytest.mark.parametrize("content", ["", None])
def test_an_empty_answer_fails_its_row_without_a_retry(content):
    """Regression: an answer with no text was written as the row's answer (and prepare dropped
    the row later, without a word). Not retried: a greedy target answers the same again."""
    response = {"choices": [{"message": {"content": content}, "finish_reason": "stop"}]}
    with pytest.raises(RowError, match=r"the answer is empty \(finish_reason 'stop'\)") as caught:
        _parse_completion(response)
    assert not caught.value.retryable


@pytest.mark.parametrize(
    ("content", "reason", "ids"),
    [(" \n", "stop", None), ("", "length", None), ("", "stop", [5, 2])],
)
def test_white_space_or_tokens_without_text_are_an_answer(content, reason, ids):
    """The model's own answer, though it has no visible text: white space, tokens a random
    target generated to the limit, tokens that decode to nothing; prepare trains on them."""
    choice = {"message": {"content": content}, "finish_reason": reason}
    if ids is not None:
        choice["token_ids"] = ids
    assert _parse_completion({"choices": [choice]}).text == content
