"""The engine process's core, apart from HTTP: the jobs, the loop around vLLM's engine (the only
thread that touches vLLM) and the hand-over directory's bound and clean-up.

Standard library only (and `dflash_train.faults`): the engine object is handed in, so tests run
the loop on a fake engine without vLLM.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from dflash_train import faults
from dflash_train.engine.protocol import LOCK_FILE, TOKEN_FILE, request_files


@dataclass(eq=False)  # one job is one request: compared (and hashed) by identity
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
    """The main thread's loop around vLLM's `LLMEngine` (see the module docstring). A job is
    handed over only once all its rows finished; the files of a job nobody will answer (it
    failed, or its client's deadline passed) are deleted here, as it is aborted, and so are
    those of its rows that finish later (`directory`: the hand-over directory)."""

    def __init__(self, engine: Any, sampling: Any, tokens_prompt: Any, directory: str) -> None:
        self.engine, self.sampling, self.tokens_prompt = engine, sampling, tokens_prompt
        self.directory = directory
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
        """Abort the job's unfinished rows and delete every file of it (complete ones: a
        `.part` is the connector's until renamed; `HandOverBudget.reap` takes what comes
        later)."""
        live = [r for r in job.request_ids if r in self.rows]
        for rid in live:
            del self.rows[rid]
        if live:
            self.engine.abort_request(live)
        for path in request_files(self.directory, job.request_ids):
            _unlink(path)

    def _step(self) -> None:
        for out in self.engine.step():
            if not out.finished:
                continue
            params = out.kv_transfer_params or {}
            if out.request_id not in self.rows:  # its job was aborted: nobody takes the file
                if "hidden_states_path" in params:
                    _unlink(params["hidden_states_path"])
                continue
            job, i = self.rows.pop(out.request_id)
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


@dataclass
class Handed:
    """Files handed to a client, their bytes, and when (`HandOverBudget`'s clock)."""

    paths: list[str]
    nbytes: int
    at: float


class HandOverBudget:
    """The hand-over directory's bytes and files.

    Bytes are reserved when a job is admitted (a job waits, up to its deadline, while the bound
    is full), then released (the job failed, or its bytes went inline) or handed to the client
    with its files, and held while any of those files exists (the client deletes them).
    Files nobody collects are deleted by `reap` once `ttl_s` has passed: files handed to a client
    that never took them (it died, or lost the answer and asked again), and any other file in
    the directory that no job in flight owns (rows of aborted jobs written after the abort, a
    killed writer's `.part`, an earlier engine's leftovers). Ages are measured on `clock`
    (monotonic seconds; tests inject their own); deadlines on `time.monotonic`.
    """

    def __init__(
        self,
        bound: int,
        directory: str | None = None,
        ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bound, self.directory, self.ttl_s, self.clock = bound, directory, ttl_s, clock
        self._cond = threading.Condition()
        self._reserved = 0
        self._handed: list[Handed] = []
        self._seen: dict[str, float] = {}  # other files in the directory: when first seen

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
            self._handed.append(Handed(paths, nbytes, self.clock()))

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._reserved -= nbytes
            self._cond.notify_all()

    def in_use(self) -> int:
        with self._cond:
            return self._in_use()

    def _in_use(self) -> int:
        self._handed = [h for h in self._handed if any(os.path.exists(x) for x in h.paths)]
        return self._reserved + sum(h.nbytes for h in self._handed)

    def reap(self, keep: Collection[str] = ()) -> list[str]:
        """Delete what nobody collected within `ttl_s` (see the class docstring); `keep`: the
        files of jobs in flight. Returns the paths deleted."""
        now = self.clock()
        with self._cond:
            expired = [h for h in self._handed if now - h.at > self.ttl_s]
            self._handed = [h for h in self._handed if now - h.at <= self.ttl_s]
            gone = [p for h in expired for p in h.paths]
            owned = {p for h in self._handed for p in h.paths} | set(keep) | set(gone)
            others = [p for p in self._files() if p not in owned]
            self._seen = {p: self._seen.get(p, now) for p in others}
            gone += [p for p, first in self._seen.items() if now - first > self.ttl_s]
            for path in gone:
                _unlink(path)
                self._seen.pop(path, None)
            self._cond.notify_all()
        return gone

    def _files(self) -> list[str]:
        if self.directory is None:
            return []
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return [os.path.join(self.directory, n) for n in names if n not in (TOKEN_FILE, LOCK_FILE)]


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
