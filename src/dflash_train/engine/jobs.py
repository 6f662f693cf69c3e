"""The engine process's core, apart from HTTP: the jobs, the loop around vLLM's engine (the only
thread that touches vLLM) and the bound on the bytes waiting in the hand-over directory.

Standard library only (and `dflash_train.faults`): the engine object is handed in, so tests run
the loop on a fake engine without vLLM.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dflash_train import faults


@dataclass
class Job:
    """One POST /features: its rows, and what the engine loop found for each."""

    rows: list[list[int]]
    files: list[tuple[str, int] | None] = field(default_factory=list)
    error: tuple[int, str] | None = None
    """(HTTP status, one line) when the job failed."""
    done: threading.Event = field(default_factory=threading.Event)
    request_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.files = [None] * len(self.rows)

    def fail(self, status: int, message: str) -> None:
        if not self.done.is_set():
            self.error = (status, message)
            self.done.set()


class EngineLoop:
    """The main thread's loop around vLLM's `LLMEngine` (see the module docstring)."""

    def __init__(self, engine: Any, sampling: Any, tokens_prompt: Any) -> None:
        self.engine, self.sampling, self.tokens_prompt = engine, sampling, tokens_prompt
        self.inbox: queue.Queue[Job | tuple[str, Job]] = queue.Queue()
        self.rows: dict[str, tuple[Job, int]] = {}  # request id -> (job, row)
        self.dead: str | None = None
        self._admitting: Job | None = None
        self._next = 0

    def submit(self, job: Job) -> None:
        if self.dead is not None:
            job.fail(500, f"the engine died: {self.dead}")
            return
        self.inbox.put(job)

    def abandon(self, job: Job) -> None:
        """The client gave up (its deadline passed): abort the job's requests."""
        self.inbox.put(("abort", job))

    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self._admit(wait_s=0.0 if self.engine.has_unfinished_requests() else 0.05)
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:
            self.dead = f"{type(e).__name__}: {e}".splitlines()[0]
            self._fail_all()
            raise

    def _admit(self, wait_s: float) -> None:
        try:
            item = self.inbox.get(timeout=wait_s) if wait_s else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, tuple):
                self._abort(item[1])
            else:
                self._admitting = item  # failed with the rest if the engine dies admitting it
                faults.point("engine")  # tests: the engine dies, hangs or slows down here
                self._add(item)
                self._admitting = None
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, job: Job) -> None:
        for i, row in enumerate(job.rows):
            rid = f"j{self._next}-{i}"
            try:
                self.engine.add_request(
                    rid, self.tokens_prompt(prompt_token_ids=row), self.sampling
                )
            except ValueError as e:  # e.g. a token id outside the vocabulary
                self._abort(job)
                job.fail(400, f"row {i}: {e}".splitlines()[0])
                return
            self.rows[rid] = (job, i)
            job.request_ids.append(rid)
        self._next += 1

    def _abort(self, job: Job) -> None:
        live = [r for r in job.request_ids if r in self.rows]
        for rid in live:
            del self.rows[rid]
        if live:
            self.engine.abort_request(live)

    def _step(self) -> None:
        for out in self.engine.step():
            if not out.finished or out.request_id not in self.rows:
                continue
            job, i = self.rows.pop(out.request_id)
            params = out.kv_transfer_params or {}
            if "hidden_states_path" not in params:
                self._abort(job)
                job.fail(500, f"row {i}: vLLM returned no hidden states (finished: {out})")
                continue
            job.files[i] = (params["hidden_states_path"], int(params["num_tokens"]))
            if all(f is not None for f in job.files):
                job.done.set()

    def _fail_all(self) -> None:
        if self._admitting is not None:
            self._admitting.fail(500, f"the engine died: {self.dead}")
        for job, _ in list(self.rows.values()):
            job.fail(500, f"the engine died: {self.dead}")
        self.rows.clear()
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Job):
                item.fail(500, f"the engine died: {self.dead}")


class HandOverBudget:
    """Bytes in the hand-over directory: reserved when a job is admitted, held while the files
    handed to a client exist (the client deletes them), released when they are gone. A job
    waits (up to its deadline) while the bound is full."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._cond = threading.Condition()
        self._reserved = 0
        self._handed: list[tuple[list[str], int]] = []

    def reserve(self, nbytes: int, deadline: float) -> bool:
        with self._cond:
            while self._in_use() + nbytes > self.bound:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 0.01))  # files vanish without a notice
            self._reserved += nbytes
            return True

    def hand(self, paths: list[str], nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._handed.append((paths, nbytes))

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return self._in_use()

    def _in_use(self) -> int:
        self._handed = [(p, n) for p, n in self._handed if any(os.path.exists(x) for x in p)]
        return self._reserved + sum(n for _, n in self._handed)
