"""The KV connector without vLLM, inside a fake of vLLM 0.32's engine core that steps as the
real one does (`fake_vllm_core`: what it copies of vLLM, and why it matters here).

Checked: each request's file is complete when its finished output arrives, however the core is
driven, with no later step (on a GPU: once its copy, ordered before any reuse of its blocks, has
completed); the blocks are freed at once and reused without touching a written file; token
order; a request aborted before its prompt was computed hands over nothing; TP ranks other than
0 write nothing.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from fake_vllm_core import (
    HIDDEN,
    K,
    Output,
    connector_module,
    make_core,
    run_busy_loop,
    run_in_process,
    states_of,
)


@pytest.fixture
def mod():
    with connector_module() as module:
        yield module


def read_file(path: str, n: int) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.float32)).reshape(n, K, HIDDEN)


@pytest.mark.parametrize("drive", [run_in_process, run_busy_loop])
def test_each_file_is_complete_when_its_request_is_reported_finished(mod, tmp_path, drive):
    # One prompt computed in three chunks, one in a single step: each file exists, complete and
    # in token order, the moment vLLM reports its request finished; the last step needs no
    # later one (in-process, nothing would run it), and no block is kept after it.
    core = make_core(mod, tmp_path, budget=6)
    prompts = {"r/1": list(range(100, 114)), "r2": [7, 3, 9]}
    for req_id, prompt in prompts.items():
        core.add_request(req_id, prompt)
    seen = []

    def on_finished(out: Output) -> None:
        params = out.kv_transfer_params
        prompt = prompts[out.request_id]
        assert params["num_tokens"] == len(prompt)
        path = params["hidden_states_path"]
        assert os.path.exists(path), f"{out.request_id}: no file when reported finished"
        assert not os.path.exists(path + mod.PART_SUFFIX)
        assert torch.equal(read_file(path, len(prompt)), states_of(prompt))
        seen.append(out.request_id)

    drive(core, on_finished)
    assert sorted(seen) == ["r/1", "r2"]
    assert core.kept == set() and core.blocks.tables == {}  # every block freed already
    assert sorted(os.listdir(tmp_path)) == ["r2.bin", "r_1.bin"]


def test_freed_blocks_are_reused_without_touching_a_written_file(mod, tmp_path):
    core = make_core(mod, tmp_path, budget=8)
    core.add_request("a", list(range(20, 28)))
    run_in_process(core, lambda out: None)
    first = core.blocks.free[:2]  # a's blocks, first in line for reuse
    core.add_request("b", list(range(50, 58)))
    run_in_process(core, lambda out: None)
    assert core.blocks.tables == {} and first == sorted(first)
    assert torch.equal(read_file(str(tmp_path / "a.bin"), 8), states_of(list(range(20, 28))))
    assert torch.equal(read_file(str(tmp_path / "b.bin"), 8), states_of(list(range(50, 58))))


def test_an_aborted_request_hands_over_nothing_and_other_ranks_write_nothing(mod, tmp_path):
    core = make_core(mod, tmp_path, budget=4)
    core.add_request("cut", list(range(10)))
    assert core.step() == []  # 4 of its 10 tokens computed
    core.abort("cut")
    assert core.requests["cut"].finished and os.listdir(tmp_path) == []
    mod.rank["value"] = 1
    other = make_core(mod, tmp_path / "rank1", budget=8)
    (tmp_path / "rank1").mkdir()
    other.add_request("r", [1, 2, 3])
    outputs = []
    run_in_process(other, outputs.append)
    assert outputs[0].kv_transfer_params["num_tokens"] == 3  # rank 0 names and writes it
    assert os.listdir(tmp_path / "rank1") == []


class FakeCuda:
    """Stand-ins for the CUDA calls of the connector's device hand-over, recording their order;
    the copy completes when the test sets `copied`."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.copied = threading.Event()
        fake = self

        class Stream:
            def __init__(self, device=None, name: str = "side") -> None:
                self.name = name
                if name == "side":
                    fake.calls.append("new side stream")

            def wait_stream(self, other) -> None:
                fake.calls.append(f"{self.name} waits for {other.name}")

            def wait_event(self, event) -> None:
                fake.calls.append(f"{self.name} waits for the copy")

        class Event:
            def record(self, stream) -> None:
                fake.calls.append(f"copy recorded on {stream.name}")

            def query(self) -> bool:
                return fake.copied.is_set()

            def synchronize(self) -> None:
                assert fake.copied.wait(timeout=30)

        class StreamContext:
            def __init__(self, stream) -> None:
                pass

            def __enter__(self):
                fake.calls.append("enter side")

            def __exit__(self, *exc):
                fake.calls.append("leave side")

        self.compute = Stream(name="compute")
        self.Stream, self.Event, self.stream = Stream, Event, StreamContext

    def current_stream(self, device=None):
        return self.compute


def test_on_a_gpu_the_file_comes_after_the_last_step_once_its_copy_completes(
    mod, tmp_path, monkeypatch
):
    # The CUDA path, as far as a CPU can run it: the side stream waits for the forward's
    # stream, gathers and copies into pinned host memory, records the copy, and the forward's
    # stream waits for it (so a later step reusing the blocks runs after the copy); the request
    # is reported finished in that step, its blocks freed, and no later step runs. The writer
    # thread writes the file once the copy completes: no engine step is needed for it.
    fake = FakeCuda()
    for name in ("Stream", "Event", "stream", "current_stream"):
        monkeypatch.setattr(mod.torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(mod, "pinned_like", lambda t: torch.empty_like(t))
    core = make_core(mod, tmp_path, budget=8)
    monkeypatch.setattr(core.worker, "_copies_on_device", lambda: True)
    prompt = list(range(30, 36))
    core.add_request("g1", prompt)
    outputs = []
    run_in_process(core, outputs.append)
    assert [o.request_id for o in outputs] == ["g1"] and core.blocks.tables == {}
    steps = core.steps
    assert fake.calls == [
        "new side stream",
        "side waits for compute",
        "enter side",
        "copy recorded on side",
        "leave side",
        "compute waits for the copy",
    ]
    path = outputs[0].kv_transfer_params["hidden_states_path"]
    assert not os.path.exists(path)  # the copy is still in flight
    fake.copied.set()
    core.worker.shutdown()  # the writer thread is done with its file
    assert core.steps == steps  # no engine step was needed
    assert torch.equal(read_file(path, len(prompt)), states_of(prompt))
    assert not os.path.exists(path + mod.PART_SUFFIX)
