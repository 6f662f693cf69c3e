"""Every read across worker threads waits for the writer's lane (stream), checked on CPU.

On CUDA each worker thread queues its kernels on a stream of its own (`devices.Lane`), so a
tensor written by one thread may still be in flight when another takes it. What orders them is
the wiring: the target worker marks its lane after each forward and the batch carries the mark;
the drafter waits for it before its copy; each replica marks its lane before the rendezvous and
the reducing thread waits for every mark before it sums gradients; each replica waits for the
reduce's mark on its device before its optimizer step. On CPU marks are always reached, so
the same wiring is recorded here with marks that log who made and who waited for them; the
GPU test (`tests/cuda`) checks the values themselves.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import torch

from dflash_train import devices
from dflash_train.pipeline import sync
from dflash_train.train.trainer import Trainer
from pipeline_helpers import tiny_train_config, write_random_dataset

_ids = itertools.count()


class RecordedMark(devices.Mark):
    log: list[tuple[str, str, int, str]]

    def __init__(self, device, kind: str) -> None:
        super().__init__(device)
        self.id, self.kind = next(_ids), kind
        self.log.append(("mark", threading.current_thread().name, self.id, kind))

    def wait_here(self) -> None:
        self.log.append(("wait", threading.current_thread().name, self.id, self.kind))


def train_tiny(tiny_target, tmp_path):
    """A complete tiny run (2 targets, 2 drafters on CPU)."""
    data = write_random_dataset(tmp_path / "data", num_rows=24)
    cfg = tiny_train_config(tiny_target, data, tmp_path / "run", save_every=0)
    trainer = Trainer(cfg, log=lambda _m: None)
    trainer.build()
    result = trainer.run()
    assert result.complete
    return result


def test_every_cross_thread_read_waits_for_the_writers_mark(tiny_target, tmp_path, monkeypatch):
    log: list[tuple[str, str, int, str]] = []
    monkeypatch.setattr(RecordedMark, "log", log, raising=False)
    monkeypatch.setattr(devices.Lane, "mark", lambda lane: RecordedMark(lane.device, "lane"))
    monkeypatch.setattr(
        sync, "marks_here", lambda devs: [RecordedMark(d, "reduce") for d in dict.fromkeys(devs)]
    )
    result = train_tiny(tiny_target, tmp_path)

    made = {i: (thread, kind) for op, thread, i, kind in log if op == "mark"}
    waits = defaultdict(list)
    for op, thread, i, _ in log:
        if op == "wait":
            waits[i].append(thread)
    by_target = [i for i, (t, _) in made.items() if t.startswith("target")]
    by_drafter = [i for i, (t, k) in made.items() if t.startswith("drafter") and k == "lane"]
    reduces = [i for i, (_, k) in made.items() if k == "reduce"]

    # One mark per target forward; a drafter thread waited for each before reading it.
    assert len(by_target) >= result.steps and by_target
    for i in by_target:
        assert len(waits[i]) == 1 and waits[i][0].startswith("drafter"), (i, waits[i])
    # One mark per replica per step, waited for by the thread that reduced that step.
    assert len(by_drafter) >= 2 * result.steps
    for i in by_drafter:
        assert waits[i], f"a replica's gradients were read without waiting for its lane ({i})"
    # The reduce's marks: every replica waited for its device's before its optimizer step
    # (both replicas are on `cpu` here, so each mark is waited for by both threads).
    applied = [i for i in reduces if waits[i]]
    assert len(applied) >= result.steps
    for i in applied:
        assert sorted(waits[i]) == ["drafter-0", "drafter-1"], waits[i]


def test_a_mark_orders_the_waiting_threads_stream_and_is_free_on_cpu():
    lane = devices.enter_worker_thread(torch.device("cpu"))
    assert lane.stream is None
    mark = lane.mark()
    assert mark.event is None
    mark.wait_here()  # reached at once: no stream to wait on
    x = torch.arange(4.0)
    assert devices.handover(x, torch.device("cpu"), mark) is x
    devices.wait_for(devices.marks_here([torch.device("cpu")] * 3))
    assert len(devices.marks_here([torch.device("cpu")] * 3)) == 1


def test_the_main_thread_waits_for_rank_0s_mark_before_it_reads_a_steps_tensors(
    tiny_target, tmp_path, monkeypatch
):
    # The loss statistics and the grad norm of a step are written on rank 0's lane (or the
    # reducer's); the main thread sums and reads them on its own stream. Each step record
    # carries rank 0's mark after the step, and the main thread waits for it before its first
    # read of that step's tensors.
    from dflash_train.train import interval
    from dflash_train.train import trainer as trainer_module

    log: list[tuple[str, str, int, str]] = []
    monkeypatch.setattr(RecordedMark, "log", log, raising=False)
    monkeypatch.setattr(
        trainer_module, "marks_here", lambda devs: [RecordedMark(d, "step") for d in devs]
    )
    real_acc = interval._acc

    def reading(total, x):
        log.append(("read", threading.current_thread().name, -1, ""))
        return real_acc(total, x)

    monkeypatch.setattr(interval, "_acc", reading)
    result = train_tiny(tiny_target, tmp_path)

    steps = [i for op, thread, i, kind in log if op == "mark" and kind == "step"]
    assert len(steps) == result.steps and {
        thread for op, thread, _, kind in log if op == "mark" and kind == "step"
    } == {"drafter-0"}
    main = [(op, i) for op, thread, i, _ in log if thread == "MainThread" and op != "mark"]
    waits = [i for op, i in main if op == "wait"]
    assert waits == steps  # every step's mark, in order, once
    assert main[0][0] == "wait"  # no read before the first step's wait
    reads = sum(op == "read" for op, _ in main)
    assert reads >= 3 * result.steps  # loss, correct, count of every step
