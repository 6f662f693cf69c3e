"""`BufferedHSQueue`: the bounded, mixing buffer between producers and consumers.

Used twice in the pipeline: as the hidden-state queue (target workers -> drafter workers) and as
the job queue (prefetchers -> target workers, min_ready = 1).

Contract (what is counted, what blocks, when it drains):
- The queue knows how many producers exist (`num_producers`). Each producer calls
  `producer_done()` exactly once, including when it fails; a further call is an error.
- Pull order (`mix`):
  - "plan" (the pipeline's default): every item carries its position in the plan (`seq`:
    0, 1, 2, ... with no gaps, one stream per node) and is released only to the consumer
    that holds its ticket (`get(ticket=seq)`; a `get()` without one takes the next ticket in
    call order). Which item a consumer gets is then a function of the plan alone, never of
    which producer finished first: the buffer is the window in which the planned order is
    restored. The window is `max(max_depth, reserve)` positions from the head (the lowest
    position not yet taken): `put` blocks an item beyond it, so the depth bound holds, and the
    head is always admitted (no deadlock when the buffer is full of later items and the next
    planned one is still in flight). The first `reserve` positions of the window (one
    lockstep step's items: every ticket a consumer can hold at once) are admitted past the
    byte bound too, for the same reason.
  - "stratified": choose a bucket so the draws follow the dataset's bucket shares, by smooth
    weighted round robin over the NON-EMPTY buckets (an empty bucket is never waited for);
    then that bucket's OLDEST item (a uniform pick inside a bucket left some items waiting
    for epochs, so a run stopped at --max-steps trained a sample skewed towards new batches).
  - "random" (uniform over buffered items) and "fifo" (arrival order).
  The last three depend on arrival order (thread timing); they stay for comparison.
- `put` blocks while the queue holds `max_depth` items (in plan mode: while the item is beyond
  the window), or while adding the item would exceed `max_bytes` (if set; an item larger than
  the bound is still admitted into an empty queue, so one oversized batch cannot hang the
  run). In stratified mode, once the buffer is filling up (depth at least halfway from
  `min_ready` to `max_depth`, i.e. producers outpace consumers), it also blocks while the
  item's bucket holds `bucket_cap` times its share of `max_depth` (an empty bucket always
  admits): freed slots would otherwise go to whichever producer is fastest, and a flooding
  bucket would leave the pull nothing else to choose from. Below that depth nothing is
  capped, so a producer-bound pipeline never idles its producers for the mix.
- `get` blocks while fewer than `min_ready` items are buffered AND at least one producer is alive
  AND no producer is blocked in `put` (a blocked producer means the buffer cannot grow, so
  waiting for `min_ready` would deadlock; a producer still waiting in `put` whose room has come
  is not blocked, it is about to add its item) AND, with a byte bound, the buffered bytes fill
  less of `max_bytes` than `min_ready` fills of `max_depth` (the gate scales with the byte
  capacity). In plan mode it also blocks until its ticket's item is buffered (a head-of-line
  wait, counted apart from the gate's).
  Once every producer is done, `get` drains the buffer to zero and then returns `END` (in plan
  mode: for every ticket whose item never came): a dataset smaller than `min_ready` finishes.
- Age: an item's age at `get` is the number of items taken while it waited. In stratified mode
  no item waits longer than `max_age` takes (default twice `max_depth`: a full queue's mean
  wait is `max_depth`): once the oldest buffered item has waited that long it is taken next,
  whatever its bucket (and charged to its bucket in the round robin, so the mix keeps its
  account). `take_ages()` hands the ages of the items taken since its last call.
- Every wait is `Condition.wait(poll_s)` in a loop that re-checks its predicate, the stop event
  and the caller's deadline. `stop()` (or setting the shared stop event) wakes every waiter, which
  raises `QueueStopped`; a deadline raises `TimeoutError`.
- Counters for monitoring: depth, bytes, per-bucket depth, items put / got, drawn per bucket,
  seconds producers spent blocked, consumers spent starved (gate shut) and, in plan mode,
  waiting at the head of the line (gate open, their item not there yet).
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")
MixMode = Literal["plan", "stratified", "random", "fifo"]
MIX_MODES = ("plan", "stratified", "random", "fifo")


class _EndOfStream:
    """The sentinel `get` returns once every producer is done and the buffer is empty."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "END"


END = _EndOfStream()


class QueueStopped(RuntimeError):
    """The pipeline was asked to stop while this call waited."""


@dataclass
class QueueStats:
    """A consistent snapshot of the queue's counters."""

    depth: int
    bytes: int
    bucket_depth: dict[int, int]
    put_total: int
    got_total: int
    drawn: dict[int, int]
    producer_blocked_s: float
    consumer_starved_s: float
    producers_alive: int
    max_depth: int
    min_ready: int
    consumer_hol_s: float = 0.0
    """Seconds consumers waited for their planned item while the gate was open (plan mode)."""


@dataclass
class _Entry:
    item: Any
    bucket: int
    nbytes: int
    born: int = 0
    """Items taken from the queue before this one was put (its age is counted from here)."""
    seq: int = -1
    """Its position in the plan (plan mode)."""


@dataclass
class _Pool:
    """Buffered entries of the arrival-order pulls: per bucket for O(1) random removal, or one
    deque for FIFO."""

    fifo: bool
    by_bucket: dict[int, list[_Entry]] = field(default_factory=dict)
    arrival: deque = field(default_factory=deque)

    def add(self, e: _Entry) -> None:
        if self.fifo:
            self.arrival.append(e)
        else:
            self.by_bucket.setdefault(e.bucket, []).append(e)

    def take_fifo(self) -> _Entry:
        return self.arrival.popleft()

    def take_from(self, bucket: int, rng: random.Random) -> _Entry:
        """A uniformly random item of `bucket` (the lists lose their arrival order)."""
        items = self.by_bucket[bucket]
        i = rng.randrange(len(items))
        items[i], items[-1] = items[-1], items[i]
        return items.pop()

    def take_oldest(self, bucket: int) -> _Entry:
        """The item of `bucket` that arrived first (lists kept in arrival order; <= max_depth
        items, so the shift is cheap)."""
        return self.by_bucket[bucket].pop(0)

    def bucket_len(self, bucket: int) -> int:
        return len(self.by_bucket.get(bucket, ()))

    def sizes(self) -> dict[int, int]:
        if self.fifo:
            return _count_buckets(self.arrival)
        return {b: len(v) for b, v in self.by_bucket.items() if v}


@dataclass
class _PlanWindow:
    """Plan order: entries by their plan position, each released to its ticket's holder.

    `head` is the lowest position not yet taken; positions taken above it wait in `taken`
    until the head passes them. A position is admitted while it lies within `span` of the
    head, and counts as urgent (admitted past the byte bound) within `reserve` of it.
    """

    span: int
    reserve: int
    entries: dict[int, _Entry] = field(default_factory=dict)
    head: int = 0
    taken: set[int] = field(default_factory=set)
    issued: int = 0
    """Tickets handed out to consumers that asked without one (in call order)."""

    def admits(self, seq: int) -> bool:
        return seq < self.head + self.span

    def urgent(self, seq: int) -> bool:
        return seq < self.head + self.reserve

    def add(self, e: _Entry) -> None:
        if e.seq < 0:
            raise ValueError("plan order: every item needs its plan position (put(..., seq=))")
        if e.seq in self.entries or e.seq < self.head or e.seq in self.taken:
            raise RuntimeError(f"plan position {e.seq} was put twice")
        self.entries[e.seq] = e

    def has(self, ticket: int) -> bool:
        return ticket in self.entries

    def take(self, ticket: int) -> _Entry:
        e = self.entries.pop(ticket)
        self.taken.add(ticket)
        while self.head in self.taken:
            self.taken.remove(self.head)
            self.head += 1
        return e

    def next_ticket(self) -> int:
        self.issued += 1
        return self.issued - 1

    def sizes(self) -> dict[int, int]:
        return _count_buckets(self.entries.values())


def _count_buckets(entries) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in entries:
        out[e.bucket] = out.get(e.bucket, 0) + 1
    return out


def _validate(name: str, max_depth: int, min_ready: int, num_producers: int, mix: str) -> None:
    if max_depth < 1 or min_ready < 1:
        raise ValueError(
            f"{name}: max_depth and min_ready must be positive (got {max_depth}, {min_ready})"
        )
    if min_ready > max_depth:
        raise ValueError(
            f"{name}: min_ready ({min_ready}) must be <= max_depth ({max_depth}), otherwise "
            "consumers would wait for more items than the queue may hold"
        )
    if num_producers < 1:
        raise ValueError(f"{name}: num_producers must be >= 1")
    if mix not in MIX_MODES:
        raise ValueError(f"{name}: mix must be one of {MIX_MODES}, got {mix!r}")


def _bucket_caps(
    weights: dict[int, float], bucket_cap: float | None, max_depth: int, name: str
) -> dict[int, int]:
    """Stratified admission: at most `bucket_cap` x its share of `max_depth` items per bucket."""
    if bucket_cap is None:
        return {}
    if bucket_cap <= 0:
        raise ValueError(f"{name}: bucket_cap must be positive when set")
    total = sum(weights.values()) or 1.0
    return {b: max(1, math.ceil(bucket_cap * w / total * max_depth)) for b, w in weights.items()}


class BufferedHSQueue(Generic[T]):
    """Bounded multi-producer / multi-consumer buffer with a readiness gate and mixed pull.

    See the module docstring for the full contract.
    """

    def __init__(
        self,
        max_depth: int,
        min_ready: int,
        num_producers: int,
        *,
        mix: MixMode = "stratified",
        bucket_weights: dict[int, float] | None = None,
        max_bytes: int | None = None,
        bucket_cap: float | None = 1.5,
        stop_event: threading.Event | None = None,
        seed: int = 0,
        poll_s: float = 0.05,
        name: str = "queue",
        max_age: int | None = None,
        reserve: int = 1,
    ) -> None:
        """`reserve` (plan mode): tickets consumers may hold at once (one lockstep step's
        items); the window is at least that wide and admits them past the byte bound."""
        _validate(name, max_depth, min_ready, num_producers, mix)
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"{name}: max_bytes must be positive when set")
        self.name, self.mix = name, mix
        self.max_depth, self.min_ready, self.max_bytes = max_depth, min_ready, max_bytes
        self.max_age = 2 * max_depth if max_age is None else max_age
        if self.max_age < 1:
            raise ValueError(f"{name}: max_age must be positive, got {self.max_age}")
        self.num_producers = num_producers
        self.stop_event = stop_event or threading.Event()
        self.poll_s = poll_s
        self._weights = dict(bucket_weights or {})
        stratified = mix == "stratified"
        self._caps = _bucket_caps(
            self._weights, bucket_cap if stratified else None, max_depth, name
        )
        self._plan = _PlanWindow(max(max_depth, reserve), reserve) if mix == "plan" else None
        self._pool = _Pool(fifo=mix == "fifo")
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._depth = self._bytes = self._done = 0
        self._blocked: list[tuple[int, int, int]] = []  # (nbytes, bucket, seq) of producers in put
        self._put_total = self._got_total = 0
        self._drawn: dict[int, int] = {}
        self._ages: deque[int] = deque(maxlen=1 << 16)  # since the last take_ages()
        self._credit: dict[int, float] = {}
        self._blocked_s = self._starved_s = self._hol_s = 0.0

    # ------------------------------------------------------------------ producer side
    def put(
        self,
        item: T,
        *,
        bucket: int = 0,
        nbytes: int = 0,
        timeout: float | None = None,
        seq: int = -1,
    ) -> None:
        """Add an item (in plan mode with its plan position `seq`); blocks while the depth or
        byte bound is reached, or the item lies beyond the plan window."""
        deadline = None if timeout is None else time.monotonic() + timeout
        key = (nbytes, bucket, seq)
        with self._not_full:
            if self._done >= self.num_producers:
                raise RuntimeError(f"{self.name}: put after every producer signalled done")
            if not self._has_room(*key):
                t0 = time.monotonic()
                self._blocked.append(key)
                self._not_empty.notify_all()  # a blocked producer opens the readiness gate
                try:
                    self._wait(self._not_full, lambda: self._has_room(*key), deadline, "put")
                finally:
                    self._blocked.remove(key)
                    self._blocked_s += time.monotonic() - t0
            entry = _Entry(item, bucket, nbytes, born=self._got_total, seq=seq)
            (self._plan or self._pool).add(entry)
            self._depth += 1
            self._bytes += nbytes
            self._put_total += 1
            # Plan mode: each waiter waits for its own item, so wake them all.
            (self._not_empty.notify_all if self._plan else self._not_empty.notify)()

    def producer_done(self) -> None:
        """Signal that one producer will put nothing more (call exactly once per producer)."""
        with self._lock:
            if self._done >= self.num_producers:
                raise RuntimeError(
                    f"{self.name}: producer_done called more than num_producers="
                    f"{self.num_producers} times"
                )
            self._done += 1
            self._not_empty.notify_all()

    # ------------------------------------------------------------------ consumer side
    def get(self, timeout: float | None = None, *, ticket: int | None = None) -> T | _EndOfStream:
        """The next item by the pull mode, or END once producers are done and it is empty.

        Plan mode: the item at plan position `ticket` (None: the next ticket in call order),
        or END once the producers are done without it. Other modes ignore `ticket`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            if self._plan is not None and ticket is None:
                ticket = self._plan.next_ticket()
            if not self._ready(ticket):
                self._wait(
                    self._not_empty, lambda: self._ready(ticket), deadline, "get", self._charge
                )
            entry = self._take(ticket)
            if entry is None:
                return END
            self._ages.append(self._got_total - entry.born)
            self._depth -= 1
            self._bytes -= entry.nbytes
            self._got_total += 1
            self._drawn[entry.bucket] = self._drawn.get(entry.bucket, 0) + 1
            self._not_full.notify_all()
            return entry.item

    # ------------------------------------------------------------------ control and stats
    def stop(self) -> None:
        """Set the stop event and wake every waiter (they raise QueueStopped)."""
        self.stop_event.set()
        with self._lock:
            self._not_full.notify_all()
            self._not_empty.notify_all()

    @property
    def _blocked_producers(self) -> int:
        """Producers waiting in `put` (with or without room by now)."""
        return len(self._blocked)

    @property
    def producers_alive(self) -> int:
        return self.num_producers - self._done

    def __len__(self) -> int:
        return self._depth

    def take_ages(self) -> list[int]:
        """Ages (items taken while each waited) of the items taken since the last call."""
        with self._lock:
            ages = list(self._ages)
            self._ages.clear()
            return ages

    def bucket_sizes(self) -> dict[int, int]:
        """Buffered items per bucket (non-empty buckets only)."""
        with self._lock:
            return (self._plan or self._pool).sizes()

    def stats(self) -> QueueStats:
        with self._lock:
            return QueueStats(
                depth=self._depth,
                bytes=self._bytes,
                bucket_depth=(self._plan or self._pool).sizes(),
                put_total=self._put_total,
                got_total=self._got_total,
                drawn=dict(self._drawn),
                producer_blocked_s=self._blocked_s,
                consumer_starved_s=self._starved_s,
                producers_alive=self.num_producers - self._done,
                max_depth=self.max_depth,
                min_ready=self.min_ready,
                consumer_hol_s=self._hol_s,
            )

    # ------------------------------------------------------------------ internals (lock held)
    def _has_room(self, nbytes: int, bucket: int, seq: int) -> bool:
        if self._plan is not None:
            if not self._plan.admits(seq):
                return False
            if self._plan.urgent(seq):
                return True  # a ticket some consumer may be waiting for now
        elif self._depth >= self.max_depth or self._capped(bucket):
            return False
        if self.max_bytes is None or self._depth == 0:
            return True
        return self._bytes + nbytes <= self.max_bytes

    def _capped(self, bucket: int) -> bool:
        """Stratified: the buffer is filling up and `bucket` holds its cap already."""
        cap = self._caps.get(bucket)
        return (
            cap is not None
            and 2 * self._depth >= self.min_ready + self.max_depth
            and self._pool.bucket_len(bucket) >= cap
        )

    def _ready(self, ticket: int | None) -> bool:
        if self._done >= self.num_producers:
            return True  # drain to zero, then END
        if self._plan is not None and not self._plan.has(ticket):
            return False
        return self._gate_open()

    def _gate_open(self) -> bool:
        if self._depth == 0:
            return False
        if self._depth >= self.min_ready or self._producer_blocked():
            return True
        return self.max_bytes is not None and (
            self._bytes * self.max_depth >= self.max_bytes * self.min_ready
        )

    def _charge(self, seconds: float, gate_was_open: bool) -> None:
        """A consumer's wait: head-of-line when the gate was open (plan mode), else starved."""
        if gate_was_open and self._plan is not None:
            self._hol_s += seconds
        else:
            self._starved_s += seconds

    def _producer_blocked(self) -> bool:
        """A producer waits in `put` for room it still does not have (one that was woken with
        room only has to re-take the lock: the buffer is about to grow, the gate stays shut)."""
        return any(not self._has_room(*key) for key in self._blocked)

    def _wait(
        self,
        cond: threading.Condition,
        predicate: Callable[[], bool],
        deadline: float | None,
        op: str,
        charge: Callable[[float, bool], None] | None = None,
    ) -> None:
        while not predicate():
            if self.stop_event.is_set():
                raise QueueStopped(f"{self.name}: stopped during {op}")
            wait = self.poll_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.name}: {op} timed out (depth {self._depth}/{self.max_depth}, "
                        f"min_ready {self.min_ready}, producers alive "
                        f"{self.num_producers - self._done})"
                    )
                wait = min(wait, left)
            gate = charge is not None and self._gate_open()
            t0 = time.monotonic()
            cond.wait(wait)
            if charge is not None:
                charge(time.monotonic() - t0, gate)
        if self.stop_event.is_set():
            raise QueueStopped(f"{self.name}: stopped during {op}")

    def _take(self, ticket: int | None) -> _Entry | None:
        """The entry to hand out, or None for END (every producer done, nothing for it)."""
        if self._plan is not None:
            assert ticket is not None
            return self._plan.take(ticket) if self._plan.has(ticket) else None
        if self._depth == 0:
            return None
        if self._pool.fifo:
            return self._pool.take_fifo()
        nonempty = [b for b, v in self._pool.by_bucket.items() if v]
        if self.mix == "random":
            r = self._rng.randrange(self._depth)
            for b in nonempty:
                n = len(self._pool.by_bucket[b])
                if r < n:
                    return self._pool.take_from(b, self._rng)
                r -= n
            raise AssertionError("depth counter out of sync with buffered items")
        return self._pool.take_oldest(self._draw_bucket(nonempty, self._overdue(nonempty)))

    def _overdue(self, nonempty: list[int]) -> int | None:
        """The bucket whose oldest item has waited `max_age` takes or more, if any."""
        bucket, born = min(
            ((b, self._pool.by_bucket[b][0].born) for b in nonempty), key=lambda x: x[1]
        )
        return bucket if self._got_total - born >= self.max_age else None

    def _draw_bucket(self, nonempty: list[int], forced: int | None = None) -> int:
        """Smooth weighted round robin over the NON-EMPTY buckets.

        Each draw credits every non-empty bucket with its weight, takes the bucket with the most
        credit and debits it by the total weight credited. Over any window the draws follow the
        weights as closely as integers allow (a random choice per draw would leave the mix of
        a 10-step window far off by chance alone), and an empty bucket earns no credit, so it
        does not burst when its items arrive. `forced` (an overdue item's bucket) is taken
        instead of the one with the most credit, and debited the same.
        """
        if len(nonempty) == 1:
            return nonempty[0]
        default = (sum(self._weights.values()) / len(self._weights)) if self._weights else 1.0
        w = {b: max(0.0, self._weights.get(b, default)) for b in nonempty}
        if sum(w.values()) <= 0:
            w = dict.fromkeys(nonempty, 1.0)
        for b in nonempty:
            self._credit[b] = self._credit.get(b, 0.0) + w[b]
        top = max(self._credit[b] for b in nonempty)
        best = [b for b in nonempty if self._credit[b] == top]
        pick = best[0] if len(best) == 1 else self._rng.choice(best)
        if forced is not None:
            pick = forced
        self._credit[pick] -= sum(w.values())
        return pick


def total_variation(p: dict[int, float], q: dict[int, float]) -> float:
    """Total-variation distance between two distributions given as (unnormalised) dicts."""
    sp, sq = sum(p.values()), sum(q.values())
    if sp <= 0 or sq <= 0:
        return 0.0
    keys = set(p) | set(q)
    return 0.5 * sum(abs(p.get(k, 0) / sp - q.get(k, 0) / sq) for k in keys)
