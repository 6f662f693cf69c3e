"""StepRendezvous's contract as concurrency properties (hypothesis draws the scenario).

Replica threads run `run_drafter`'s loop (without the model): each pulls up to `grad_accum`
batches from its own stream per step, learns the end of the stream when it runs dry, writes its
gradient into its buffer and meets the others. A sequential model of the same lockstep gives the
outcome every exchange must return. Invariants:
- every replica sees exactly the model's sequence of outcomes (step numbers, global weight,
  all_ended, jobs, loss sums), so none is lost, doubled or seen by some replicas only, and the
  lockstep ends right after the step in which every replica has seen the end;
- after each reduce every replica's gradient buffer holds the same sum of all contributions;
- a replica (or the reduce) that fails, with the stop event set as `WorkerGroup` does, makes
  every other replica leave promptly (QueueStopped) and no later step is reduced;
- a replica that never arrives makes the others raise TimeoutError naming it, and arriving late
  it completes no step (nobody else would apply it);
- after a stop request, a late replica's exchange raises QueueStopped and produces no outcome.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.objective import LossOutput
from dflash_train.pipeline.queue import QueueStopped
from dflash_train.pipeline.sync import Contribution, StepRendezvous, sum_into_all

RUN_BOUND_S = 20.0  # a scenario exchanges a few dozen tiny steps: anything near this is a hang
WAKE_BOUND_S = 2.0  # how long after a stop (plus one poll) every replica must have left


@dataclass(frozen=True)
class Batch:
    job: int  # a unique id, standing in for the Job
    weight: float  # the job's weight_sum (zero: nothing to supervise)
    grad: int  # what its backward adds to the replica's gradient buffer
    loss: bool  # whether micro_step returned a LossOutput


def loss_of(b: Batch) -> LossOutput:
    return LossOutput(
        loss_sum=torch.tensor(float(b.job)),
        correct=torch.tensor([0.0, float(b.job % 2)]),
        count=torch.tensor([0.0, 1.0]),
    )


@dataclass(frozen=True)
class Seen:
    """What one replica observed in one exchange (host values)."""

    step: int
    global_weight: float
    all_ended: bool
    jobs: tuple[int, ...]
    loss: tuple[float, float, float] | None  # loss_sum, correct total, count total
    grad: tuple[float, float]  # the replica's buffer after the reduce


def model(streams: list[list[Batch]], accum: int) -> list[Seen]:
    """The lockstep, sequentially: what exchange k must return to every replica."""
    pos, ended, out, steps = [0] * len(streams), [False] * len(streams), [], 0
    while True:
        jobs, weight, grad, count, losses = [], 0.0, 0.0, 0.0, []
        for r, stream in enumerate(streams):
            for _ in range(accum):
                if ended[r]:
                    break
                if pos[r] == len(stream):
                    ended[r] = True  # this get returned END
                    break
                b = stream[pos[r]]
                pos[r] += 1
                jobs.append(b.job)
                weight += b.weight
                grad += b.grad
                count += 1
                if b.loss:
                    losses.append(b)
        loss = None
        if losses:
            loss = (
                float(sum(b.job for b in losses)),
                float(sum(b.job % 2 for b in losses)),
                float(len(losses)),
            )
        out.append(Seen(steps, weight, all(ended), tuple(jobs), loss, (grad, count)))
        steps += bool(jobs)
        if all(ended):
            return out


@dataclass
class Faults:
    """What goes wrong, by replica rank and exchange index (the k-th exchange of the run)."""

    fail_before: dict[int, int] = field(default_factory=dict)  # raises before exchange k
    fail_after: dict[int, int] = field(default_factory=dict)  # raises after exchange k
    stop_before: dict[int, int] = field(default_factory=dict)  # requests a stop, then exchanges
    hang_before: dict[int, int] = field(default_factory=dict)  # waits for `release` first
    reduce_fails_at: int | None = None  # the k-th reduce raises
    stop_on_error: bool = True  # an error sets the stop event (as WorkerGroup does)


@dataclass
class Exit:
    how: str  # "ended" (all_ended), "left" (saw the stop), "stopped", "timeout", "failed"
    at: float
    message: str = ""


class ReduceFailed(RuntimeError):
    pass


def run_lockstep(streams, accum, delays, seed, poll_s, stall_s, faults: Faults):
    """Run one replica thread per stream; returns (seen per rank, exits, rendezvous, stop info)."""
    world = len(streams)
    bufs = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    stop = threading.Event()
    release = threading.Event()
    reduces = [0]

    def reduce(buffers):
        k, reduces[0] = reduces[0], reduces[0] + 1
        if k == faults.reduce_fails_at:
            raise ReduceFailed(f"reduce {k} failed")
        sum_into_all(buffers)

    rdv = StepRendezvous(bufs, stop, stall_timeout_s=stall_s, reduce=reduce, poll_s=poll_s)
    seen: list[list[Seen]] = [[] for _ in range(world)]
    exits: dict[int, Exit] = {}
    stop_at: list[float] = []

    def request_stop():
        if not stop.is_set():
            stop_at.append(time.monotonic())
            stop.set()

    def replica(r: int) -> None:
        rng = random.Random(seed * 31 + r)
        it, ended, k = iter(streams[r]), False, 0
        while not stop.is_set():
            contrib = Contribution(r)
            grad = torch.zeros(2, dtype=torch.float64)
            for _ in range(accum):
                if ended:
                    break
                b = next(it, None)
                if b is None:
                    ended = True
                    break
                contrib.jobs.append(b.job)
                contrib.weight_sum += b.weight
                grad += torch.tensor([float(b.grad), 1.0], dtype=torch.float64)
                if b.loss:
                    contrib.losses.append(loss_of(b))
            contrib.ended = ended
            bufs[r].copy_(grad)  # the backward passes wrote the replica's own buffer
            if delays[r] and rng.random() < 0.5:
                time.sleep(rng.uniform(0, delays[r]))
            if faults.fail_before.get(r) == k:
                raise RuntimeError(f"replica {r} failed before exchange {k}")
            if faults.stop_before.get(r) == k:
                request_stop()
            if faults.hang_before.get(r) == k:
                release.wait(RUN_BOUND_S)
            out = rdv.exchange(contrib)
            loss = None
            if out.loss_sum is not None:
                loss = (float(out.loss_sum), float(out.correct.sum()), float(out.count.sum()))
            jobs = tuple(out.jobs)
            grad_now = tuple(bufs[r].tolist())
            seen[r].append(Seen(out.step, out.global_weight, out.all_ended, jobs, loss, grad_now))
            bufs[r].zero_()  # apply() consumes the summed gradient
            if faults.fail_after.get(r) == k:
                raise RuntimeError(f"replica {r} failed after exchange {k}")
            if out.all_ended:
                exits[r] = Exit("ended", time.monotonic())
                return
            k += 1
        exits[r] = Exit("left", time.monotonic())

    def body(r: int) -> None:
        try:
            replica(r)
        except QueueStopped as e:
            exits[r] = Exit("stopped", time.monotonic(), str(e))
        except TimeoutError as e:
            exits[r] = Exit("timeout", time.monotonic(), str(e))
            if faults.stop_on_error:
                request_stop()
        except Exception as e:
            exits[r] = Exit("failed", time.monotonic(), f"{type(e).__name__}: {e}")
            if faults.stop_on_error:
                request_stop()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    hung = set(faults.hang_before)
    deadline = time.monotonic() + RUN_BOUND_S
    for r, t in enumerate(threads):
        if r not in hung:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    release.set()  # the missing replicas arrive, late, once every other one has left
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:  # release them so a failing example does not leave threads behind
        stop.set()
        for r in alive:
            threads[r].join(timeout=5)
    assert not alive, f"replicas {alive} never finished"
    return seen, exits, rdv, stop_at


# ---------------------------------------------------------------------------- strategies
batches = st.tuples(
    st.sampled_from([0.0, 0.5, 1.0, 2.5]), st.integers(-3, 3), st.booleans()
)  # (weight, grad, has a loss)


@st.composite
def lockstep(draw, min_world: int = 1):
    world = draw(st.integers(min_world, 6))
    raw = draw(st.lists(st.lists(batches, max_size=6), min_size=world, max_size=world))
    job = iter(range(10**6))
    streams = [[Batch(next(job), w, g, loss) for w, g, loss in s] for s in raw]
    accum = draw(st.integers(1, 3))
    delays = draw(st.lists(st.sampled_from([0.0, 0.001, 0.003]), min_size=world, max_size=world))
    return streams, accum, delays, draw(st.integers(0, 2**16))


def named_ranks(message: str) -> set[int]:
    m = re.search(r"replicas \[([\d, ]*)\]", message)
    assert m, message
    return {int(x) for x in m.group(1).split(",") if x.strip()}


# ---------------------------------------------------------------------------- properties
@settings(max_examples=50, deadline=None)
@given(sc=lockstep(), poll_s=st.sampled_from([0.005, 0.05, 30.0]))
def test_every_replica_sees_the_same_steps_until_all_have_ended(sc, poll_s):
    """Replicas with no batch, zero weights, ends at different steps: one lockstep for all.
    (A large poll_s shows any exchange that needs a poll instead of the last arrival's
    notify as a hang.)"""
    streams, accum, delays, seed = sc
    expected = model(streams, accum)
    seen, exits, rdv, _ = run_lockstep(streams, accum, delays, seed, poll_s, 60.0, Faults())
    for r in range(len(streams)):
        assert seen[r] == expected, f"replica {r} saw another lockstep"
        assert exits[r].how == "ended"
    assert rdv.steps == sum(1 for s in expected if s.jobs)
    assert [s.step for s in expected if s.jobs] == list(range(rdv.steps))


@st.composite
def failures(draw):
    streams, accum, delays, seed = draw(lockstep(min_world=2))
    steps = len(model(streams, accum))
    world, k = len(streams), draw(st.integers(0, steps - 1))
    kind = draw(st.sampled_from(["fail_before", "fail_after", "stop_before", "reduce"]))
    rank = draw(st.integers(0, world - 1))
    faults = Faults()
    if kind == "reduce":
        faults.reduce_fails_at = k
    else:
        getattr(faults, kind)[rank] = k
    return streams, accum, delays, seed, faults, kind, rank, k


@settings(max_examples=50, deadline=None)
@given(sc=failures(), poll_s=st.sampled_from([0.005, 0.05]))
def test_a_failure_or_a_stop_ends_every_replica_promptly_and_reduces_nothing_more(sc, poll_s):
    """The stop event is set by the failing replica (as WorkerGroup does), or by a replica that
    then exchanges anyway (a late arrival after a stop): nobody gets another outcome, every
    replica still waiting raises QueueStopped within a poll."""
    streams, accum, delays, seed, faults, kind, rank, k = sc
    expected = model(streams, accum)
    seen, exits, rdv, stop_at = run_lockstep(streams, accum, delays, seed, poll_s, 60.0, faults)
    last = k + 1 if kind == "fail_after" else k  # exchanges completed before the fault
    for r in range(len(streams)):
        assert seen[r] == expected[:last], f"replica {r}: {len(seen[r])} steps, not {last}"
    assert rdv.steps == sum(1 for s in expected[:last] if s.jobs)
    if kind == "fail_after" and last == len(expected):
        return  # the fault came after the final step: everyone else ended normally
    assert stop_at, "nobody requested the stop"
    if kind == "stop_before":
        assert exits[rank].how == "stopped", "a late exchange after the stop did not refuse"
    for r, e in exits.items():
        assert e.how in ("stopped", "left", "failed"), (r, e)
        assert e.at - stop_at[0] < WAKE_BOUND_S + poll_s, f"replica {r} left late"


@st.composite
def stalls(draw):
    streams, accum, delays, seed = draw(lockstep(min_world=2))
    steps = len(model(streams, accum))
    world, k = len(streams), draw(st.integers(0, steps - 1))
    missing = draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world - 1))
    faults = Faults(hang_before=dict.fromkeys(missing, k), stop_on_error=draw(st.booleans()))
    return streams, accum, delays, seed, faults, k


@settings(max_examples=15, deadline=None)
@given(sc=stalls())
def test_a_missing_replica_is_named_and_arriving_late_completes_no_step(sc):
    """The others raise TimeoutError naming the missing ranks after stall_timeout_s (or, once
    one of them has set the stop event, QueueStopped); released after they all left, the
    missing replicas complete no step, with or without a stop request."""
    streams, accum, delays, seed, faults, k = sc
    stall_s = 0.25
    expected = model(streams, accum)
    seen, exits, rdv, _ = run_lockstep(streams, accum, delays, seed, 0.01, stall_s, faults)
    missing = set(faults.hang_before)
    for r in range(len(streams)):
        assert seen[r] == expected[:k], f"replica {r}: {len(seen[r])} steps, not {k}"
    assert rdv.steps == sum(1 for s in expected[:k] if s.jobs)
    others = [r for r in range(len(streams)) if r not in missing]
    timeouts = [r for r in others if exits[r].how == "timeout"]
    assert timeouts, "no replica timed out"
    for r in others:
        assert exits[r].how in ("timeout", "stopped"), (r, exits[r])
    for r in timeouts:
        named = named_ranks(exits[r].message)
        assert missing <= named and r not in named, (r, exits[r].message)
    for r in missing:
        assert exits[r].how in ("timeout", "stopped"), (r, exits[r])
