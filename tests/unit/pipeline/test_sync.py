"""StepRendezvous: examples of the stall contract (see test_rendezvous_properties for the rest)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dflash_train.pipeline.queue import QueueStopped
from dflash_train.pipeline.sync import Contribution, StepRendezvous


def rendezvous(world: int, stall_s: float, reduced: list) -> StepRendezvous:
    def reduce(buffers):
        reduced.append(len(buffers))

    bufs = [torch.zeros(1) for _ in range(world)]
    return StepRendezvous(bufs, threading.Event(), stall_s, reduce=reduce, poll_s=0.01)


def exchange_in_thread(rdv: StepRendezvous, rank: int, result: dict) -> threading.Thread:
    def run():
        try:
            result[rank] = rdv.exchange(Contribution(rank))
        except Exception as e:  # the outcome of the exchange under test
            result[rank] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def pending(rdv: StepRendezvous) -> set[int]:
    meeting = rdv._meeting
    with meeting._cond:
        return set(meeting._pending)


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_a_late_replica_completes_no_step_after_the_others_timed_out():
    """Regression: the timed-out replica's contribution stayed pending, so the late one
    completed the step alone (and applied an update nobody else did)."""
    reduced: list = []
    rdv = rendezvous(2, 0.05, reduced)
    with pytest.raises(TimeoutError, match=r"replicas \[0\]"):
        rdv.exchange(Contribution(1))
    with pytest.raises(TimeoutError, match=r"replicas \[0\]"):
        rdv.exchange(Contribution(0))
    assert reduced == [] and rdv.steps == 0


def test_a_timeout_fails_every_waiter_so_none_applies_a_step_another_left():
    """Regression: with three replicas, rank 0 timed out while rank 1 (arrived later) still
    waited; rank 2 arriving then completed the step for ranks 1 and 2 only."""
    reduced: list = []
    stall_s = 0.5
    rdv = rendezvous(3, stall_s, reduced)
    result: dict = {}
    t0 = exchange_in_thread(rdv, 0, result)
    wait_until(lambda: pending(rdv) == {0})
    time.sleep(0.3)  # rank 1's deadline comes 0.3 s after rank 0's
    t1 = exchange_in_thread(rdv, 1, result)
    wait_until(lambda: pending(rdv) == {0, 1})
    t0.join(timeout=5)
    assert isinstance(result[0], TimeoutError)
    t1.join(timeout=0.2)  # rank 1 fails with rank 0, well before its own deadline
    assert not t1.is_alive() and isinstance(result[1], TimeoutError)
    with pytest.raises(TimeoutError, match=r"replicas \[2\]"):
        rdv.exchange(Contribution(2))
    assert reduced == [] and "replicas [2]" in str(result[1])


def test_the_stop_check_comes_before_the_stall_check():
    """After a timeout and a stop request, a late exchange is a normal stopped exit."""
    rdv = rendezvous(2, 0.05, [])
    with pytest.raises(TimeoutError):
        rdv.exchange(Contribution(1))
    rdv.stop_event.set()
    with pytest.raises(QueueStopped):
        rdv.exchange(Contribution(0))


def test_gradients_on_one_gpu_each_are_summed_by_one_nccl_all_reduce(monkeypatch):
    # Recorded on CPU: the buffers stand in for one GPU each. One collective over all of them,
    # in place; no buffer is copied through another device and no temporary is made.
    from dflash_train.pipeline import sync

    calls = []

    def all_reduce(inputs, outputs=None, op=0, streams=None, comms=None):
        calls.append([id(t) for t in inputs])
        total = torch.stack(list(inputs)).sum(0)
        for t in inputs:
            t.copy_(total)

    bufs = [torch.full((6,), float(i + 1)) for i in range(3)]
    ids = [id(b) for b in bufs]
    monkeypatch.setattr(sync, "_nccl_reduces", lambda buffers: True)
    monkeypatch.setattr(torch.cuda.nccl, "all_reduce", all_reduce)
    made = []
    real_to, real_clone = torch.Tensor.to, torch.Tensor.clone
    monkeypatch.setattr(
        torch.Tensor, "to", lambda t, *a, **k: made.append("to") or real_to(t, *a, **k)
    )
    monkeypatch.setattr(
        torch.Tensor, "clone", lambda t, *a, **k: made.append("clone") or real_clone(t, *a, **k)
    )
    sync.sum_into_all(bufs)
    monkeypatch.undo()
    assert calls == [ids] and made == []
    assert all(torch.equal(b, torch.full((6,), 6.0)) for b in bufs)


def test_nccl_is_used_only_for_contiguous_buffers_on_distinct_gpus():
    from dflash_train.pipeline.sync import _nccl_reduces

    assert not _nccl_reduces([torch.zeros(2), torch.zeros(2)])  # CPU replicas: plain sums


class PairedNodes:
    """Two in-process "nodes" whose collectives meet like torch.distributed's: each call waits
    for the other node's and returns the elementwise sum (one instance per node, shared state)."""

    def __init__(self, shared: dict, rank: int) -> None:
        self.shared, self.rank = shared, rank

    @staticmethod
    def pair() -> tuple[PairedNodes, PairedNodes]:
        shared = {"barrier": threading.Barrier(2, timeout=5), "slots": [None, None]}
        return PairedNodes(shared, 0), PairedNodes(shared, 1)

    def _sum(self, values):
        slots = self.shared["slots"]
        slots[self.rank] = values
        self.shared["barrier"].wait()
        total = slots[0] + slots[1]
        self.shared["barrier"].wait()  # both read before either writes the next call's
        return total

    def sum_step_numbers(self, values: list[float]) -> list[float]:
        return self._sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def sum_device(self, tensor: torch.Tensor) -> None:
        tensor.copy_(self._sum(tensor.clone()))


def test_a_stop_asked_on_one_node_ends_every_node_after_the_same_step():
    """Regression: each node checked its own stop flag, so nodes stopped at different steps and
    the final collectives failed. The request travels with the step's host numbers."""
    nodes = PairedNodes.pair()
    requests = [threading.Event(), threading.Event()]
    rdvs = [
        StepRendezvous([torch.zeros(3)], threading.Event(), 5.0, nodes=n, stop_request=r)
        for n, r in zip(nodes, requests, strict=True)
    ]
    outcomes: dict[int, list] = {0: [], 1: []}

    def node(rank: int) -> None:
        for step in range(10):
            if rank == 1 and step == 3:
                requests[1].set()  # only node 1 got the signal
            out = rdvs[rank].exchange(Contribution(0, weight_sum=1.0))
            outcomes[rank].append(out.stop_requested)
            if out.stop_requested:
                return

    threads = [threading.Thread(target=node, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert outcomes[0] == outcomes[1] == [False, False, False, True]
