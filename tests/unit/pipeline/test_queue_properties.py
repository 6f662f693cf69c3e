"""BufferedHSQueue's contract as concurrency properties (hypothesis draws the scenario).

Random numbers of producers and consumers, depths, min_ready, byte bounds, bucket mixes, small
random delays and stop requests at random moments. Invariants:
- exactly once: every item put is got once, or is still buffered at the stop;
- bounds: no admission takes the depth past `max_depth`, the bytes past `max_bytes` (unless the
  queue was empty) or, in stratified mode once filling up, a bucket past its cap;
- readiness gate: no get takes an item while depth < min_ready, a producer is alive, no producer
  is blocked in put (waiting for room it does not have) and the byte clause does not hold;
- END only after every producer is done;
- stop wakes every waiter (each one blocked at the stop raises QueueStopped, promptly);
- the run always terminates (without a stop, every consumer ends on END).

The observations are exact, not sampled: an instrumented subclass checks each admission and
each take at the moment it happens, under the queue's own lock, and records which threads wait
in `put`/`get` (and for what) so the stop can snapshot the waiters atomically.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from dflash_train.pipeline.queue import END, MIX_MODES, BufferedHSQueue, QueueStopped

RUN_BOUND_S = 20.0  # a scenario moves at most 72 tiny items: anything near this is a hang
WAKE_BOUND_S = 2.0  # how long after a stop every thread must have left (plus poll_s if unnotified)


class ObservedQueue(BufferedHSQueue):
    """The production queue plus exact checks at its boundaries (all run under its lock)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.violations: list[str] = []
        self.takes_below_min_ready = 0  # how often the gate was open below min_ready
        self.waiting: dict[int, tuple[str, object]] = {}  # thread ident -> (op, predicate)
        pool = self._plan or self._pool
        admit = pool.add

        def checked_add(entry):
            self._check_admission(entry)
            admit(entry)

        pool.add = checked_add

    def _wait(self, cond, predicate, deadline, op, charge=None):
        me = threading.get_ident()
        self.waiting[me] = (op, predicate)
        try:
            return super()._wait(cond, predicate, deadline, op, charge)
        finally:
            del self.waiting[me]

    def _take(self, ticket):
        takes = self._plan.has(ticket) if self._plan is not None else self._depth > 0
        if takes:  # END takes nothing: no gate (checked before the take changes the state)
            self._check_gate()
        entry = super()._take(ticket)
        if entry is not None and self._plan is not None and entry.seq != ticket:
            self.violations.append(f"ticket {ticket} was handed position {entry.seq}")
        return entry

    def _check_admission(self, e) -> None:
        depth, nbytes = self._depth, self._bytes  # before this item
        limit = self._plan.span if self._plan is not None else self.max_depth
        if depth + 1 > limit:
            self.violations.append(f"depth {depth + 1} > the bound {limit}")
        # Plan mode: a position consumers may hold a ticket for now is admitted past the bytes.
        urgent = self._plan is not None and self._plan.urgent(e.seq)
        if (
            self.max_bytes is not None
            and depth > 0
            and not urgent
            and (nbytes + e.nbytes > self.max_bytes)
        ):
            self.violations.append(
                f"bytes {nbytes} + {e.nbytes} > max_bytes {self.max_bytes} at depth {depth}"
            )
        cap = self._caps.get(e.bucket)
        held = len(self._pool.by_bucket.get(e.bucket, ()))
        if cap is not None and 2 * depth >= self.min_ready + self.max_depth and held >= cap:
            self.violations.append(f"bucket {e.bucket} holds {held} >= cap {cap} at depth {depth}")

    def _check_gate(self) -> None:
        self.takes_below_min_ready += self._depth < self.min_ready
        if self._done >= self.num_producers:
            return  # draining: no gate
        blocked = [op for op, room in self.waiting.values() if op == "put" and not room()]
        byte_ready = self.max_bytes is not None and (
            self._bytes * self.max_depth >= self.max_bytes * self.min_ready
        )
        if self._depth < self.min_ready and not blocked and not byte_ready:
            self.violations.append(
                f"get took an item at depth {self._depth} < min_ready {self.min_ready} with "
                f"{self.num_producers - self._done} producers alive and none blocked "
                f"(bytes {self._bytes}/{self.max_bytes})"
            )


@dataclass
class Scenario:
    max_depth: int
    min_ready: int
    mix: str
    weights: dict[int, float] | None
    bucket_cap: float | None
    max_bytes: int | None
    producers: list[list[tuple[int, int]]]  # per producer: (bucket, nbytes) per item
    consumers: int
    delays: list[float]  # per thread (producers, then consumers): max sleep between calls
    seed: int
    poll_s: float
    stop: tuple[str, int, str] | None  # (after "put"/"get", count, via "stop"/"event")

    @property
    def total(self) -> int:
        return sum(len(p) for p in self.producers)


@st.composite
def scenarios(draw) -> Scenario:
    max_depth = draw(st.integers(1, 10))
    min_ready = draw(st.integers(1, max_depth))
    num_buckets = draw(st.integers(1, 4))
    buckets = st.integers(0, num_buckets)  # the last bucket id may be missing from the weights
    weights = draw(
        st.none()
        | st.dictionaries(
            st.integers(0, num_buckets - 1), st.sampled_from([0.0, 0.1, 0.5, 1.0, 3.0]), min_size=1
        )
    )
    max_bytes = draw(st.none() | st.integers(1, 100))
    sizes = st.integers(0, 60) if max_bytes is not None else st.just(0)
    producers = draw(
        st.lists(st.lists(st.tuples(buckets, sizes), max_size=12), min_size=1, max_size=6)
    )
    consumers = draw(st.integers(1, 6))
    total = sum(len(p) for p in producers)
    stop = None
    if total and draw(st.booleans()):
        stop = (
            draw(st.sampled_from(["put", "get"])),
            draw(st.integers(1, total)),
            draw(st.sampled_from(["stop", "event"])),
        )
    # A large poll_s makes any progress that relies on polling instead of a notify show up as
    # a hang; a stop by the bare event is seen only by polling, so it gets a small one.
    polls = [0.005, 0.05] if stop is not None and stop[2] == "event" else [0.005, 0.05, 30.0]
    return Scenario(
        max_depth=max_depth,
        min_ready=min_ready,
        mix=draw(st.sampled_from(MIX_MODES)),
        weights=weights,
        bucket_cap=draw(st.sampled_from([None, 0.5, 1.0, 1.5, 3.0])),
        max_bytes=max_bytes,
        producers=producers,
        consumers=consumers,
        delays=draw(
            st.lists(
                st.sampled_from([0.0, 0.0005, 0.002]),
                min_size=len(producers) + consumers,
                max_size=len(producers) + consumers,
            )
        ),
        seed=draw(st.integers(0, 2**16)),
        poll_s=draw(st.sampled_from(polls)),
        stop=stop,
    )


@dataclass
class Run:
    """What the threads saw; each list is appended to by one thread or under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    put: list = field(default_factory=list)
    got: list = field(default_factory=list)
    ends: int = 0
    end_early: int = 0  # END seen while some producer had not yet called producer_done
    done_calls: int = 0
    errors: list = field(default_factory=list)
    exits: dict[str, tuple[str, float]] = field(default_factory=dict)  # name -> (how, when)
    idents: dict[int, str] = field(default_factory=dict)
    calls: int = 0  # puts or gets (the kind that triggers the stop) returned so far
    stop_at: float | None = None
    waiting_at_stop: dict[str, str] = field(default_factory=dict)  # name -> op


def run_scenario(sc: Scenario) -> tuple[ObservedQueue, Run, list[threading.Thread]]:
    q = ObservedQueue(
        sc.max_depth,
        sc.min_ready,
        len(sc.producers),
        mix=sc.mix,
        bucket_weights=sc.weights,
        max_bytes=sc.max_bytes,
        bucket_cap=sc.bucket_cap,
        seed=sc.seed,
        poll_s=sc.poll_s,
    )
    run = Run()

    def request_stop():
        with q._lock:  # snapshot the waiters and set the event atomically
            run.stop_at = time.monotonic()
            run.waiting_at_stop = {run.idents[t]: op for t, (op, _) in q.waiting.items()}
            q.stop_event.set()
        if sc.stop[2] == "stop":
            q.stop()  # sets it again and notifies every waiter

    def count(kind: str) -> None:
        if sc.stop is None or sc.stop[0] != kind:
            return
        with run.lock:
            run.calls += 1
            n = run.calls
        if n == sc.stop[1]:
            request_stop()

    def body(name, rng, max_delay, fn):
        run.idents[threading.get_ident()] = name
        how = "returned"
        try:
            fn(rng, max_delay)
        except QueueStopped:
            how = "stopped"
        except Exception as e:  # recorded and asserted on below
            how = "error"
            run.errors.append(f"{name}: {type(e).__name__}: {e}")
        finally:
            run.exits[name] = (how, time.monotonic())

    def pause(rng, max_delay):
        if max_delay and rng.random() < 0.3:
            time.sleep(rng.uniform(0, max_delay))

    positions = plan_positions(sc.producers)

    def producer(p):
        def fn(rng, max_delay):
            try:
                for i, (bucket, nbytes) in enumerate(sc.producers[p]):
                    pause(rng, max_delay)
                    if q.stop_event.is_set():
                        return
                    q.put((p, i), bucket=bucket, nbytes=nbytes, seq=positions[p, i])
                    run.put.append(((p, i), nbytes))
                    count("put")
            finally:
                with run.lock:
                    run.done_calls += 1
                q.producer_done()  # exactly once, also on a stop (as WorkerGroup's on_exit)

        return fn

    def consumer(rng, max_delay):
        while not q.stop_event.is_set():
            pause(rng, max_delay)
            x = q.get()
            if x is END:
                with run.lock:
                    run.ends += 1
                    run.end_early += run.done_calls < len(sc.producers)
                return
            run.got.append(x)
            count("get")

    threads = []
    for p in range(len(sc.producers)):
        rng = random.Random(sc.seed * 31 + p)
        args = (f"producer{p}", rng, sc.delays[p], producer(p))
        threads.append(threading.Thread(target=body, args=args, daemon=True))
    for c in range(sc.consumers):
        rng = random.Random(sc.seed * 31 + 100 + c)
        args = (f"consumer{c}", rng, sc.delays[len(sc.producers) + c], consumer)
        threads.append(threading.Thread(target=body, args=args, daemon=True))
    for t in threads:
        t.start()
    deadline = time.monotonic() + RUN_BOUND_S
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    hung = [t for t in threads if t.is_alive()]
    if hung:  # release them so a failing example does not leave threads behind
        q.stop()
        for t in hung:
            t.join(timeout=5)
    return q, run, hung


def plan_positions(producers: list[list]) -> dict[tuple[int, int], int]:
    """Plan positions 0, 1, 2, ... dealt to the producers in turn (as prefetchers deal the
    plan), each producer's in increasing order."""
    out: dict[tuple[int, int], int] = {}
    for i in range(max((len(p) for p in producers), default=0)):
        for p, items in enumerate(producers):
            if i < len(items):
                out[p, i] = len(out)
    return out


def buffered(q: BufferedHSQueue) -> list:
    with q._lock:
        if q._plan is not None:
            return [(e.item, e.nbytes) for e in q._plan.entries.values()]
        if q._pool.fifo:
            return [(e.item, e.nbytes) for e in q._pool.arrival]
        return [(e.item, e.nbytes) for v in q._pool.by_bucket.values() for e in v]


@settings(max_examples=60, deadline=None)
@given(sc=scenarios())
def test_concurrent_traffic_keeps_the_contract(sc: Scenario):
    q, run, hung = run_scenario(sc)
    event(f"stop: {sc.stop and sc.stop[2]}, waiters at the stop: {len(run.waiting_at_stop)}")
    event(f"producers blocked: {q.stats().producer_blocked_s > 0}")
    event(f"takes below min_ready: {q.takes_below_min_ready > 0}")
    assert not hung, f"threads hung (terminated only by the test's own stop): {hung}"
    assert not run.errors
    assert not q.violations, q.violations[:5]
    assert run.end_early == 0, "END returned before every producer was done"

    # Exactly once: got + buffered-at-stop is the multiset put, without duplicates.
    left = buffered(q)
    got = Counter(run.got)
    assert max(got.values(), default=0) <= 1, "an item was got twice"
    assert got + Counter(item for item, _ in left) == Counter(item for item, _ in run.put)
    s = q.stats()
    assert (s.put_total, s.got_total) == (len(run.put), len(run.got))
    assert (s.depth, s.bytes) == (len(left), sum(n for _, n in left))

    if sc.stop is None:
        # Termination: producers finished, every consumer ended on END, nothing is left.
        assert run.ends == sc.consumers and not left
        assert len(run.put) == sc.total
        assert all(how == "returned" for how, _ in run.exits.values())
        return

    # A stop request: every thread waiting at that moment raised QueueStopped, and every
    # thread left promptly (a stop through the bare event is seen within one poll).
    assert run.stop_at is not None, "the stop trigger never fired"
    for name in run.waiting_at_stop:
        assert run.exits[name][0] == "stopped", f"{name} waited at the stop but was not woken"
    bound = WAKE_BOUND_S + (sc.poll_s if sc.stop[2] == "event" else 0.0)
    slowest = max(when for _, when in run.exits.values()) - run.stop_at
    assert slowest < bound, f"a thread left {slowest:.2f}s after the stop"


@settings(max_examples=20, deadline=None)
@given(
    depth=st.integers(1, 6),
    ready=st.integers(1, 6),
    timeout=st.sampled_from([0.01, 0.05]),
    poll_s=st.sampled_from([0.005, 0.05, 30.0]),
)
def test_deadlines_raise_timeout_error_on_time(depth, ready, timeout, poll_s):
    """A get on a not-ready queue and a put on a full one raise TimeoutError after `timeout`
    (not after a poll period), leaving the queue as it was."""
    ready = min(ready, depth)
    q = BufferedHSQueue(depth, ready, 1, poll_s=poll_s)
    for i in range(ready - 1):
        q.put(i)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        q.get(timeout=timeout)
    took = time.monotonic() - t0
    assert timeout <= took + 1e-3 and took < timeout + 1.0
    for i in range(ready - 1, depth):
        q.put(i)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        q.put("x", timeout=timeout)
    took = time.monotonic() - t0
    assert timeout <= took + 1e-3 and took < timeout + 1.0
    s = q.stats()
    assert (s.depth, s.put_total, s.got_total) == (depth, depth, 0)
