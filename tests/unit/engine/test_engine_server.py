"""The engine server and its client without vLLM: the real HTTP server, engine loop, hand-over
budget and `VllmFeatureSource`, around a fake engine that writes each row's features as the
connector does (raw (n, K, hidden) bytes, renamed into place). Checked: features arrive in the
drafter's layer order by either hand-over and are deleted once read, also for rows sent without
their padding; an engine that dies, hangs or has its hand-over bound full fails the request with
one clear error, never silently; an engine serving another target, or whose bound cannot hold
the largest batch, is refused at open in one line; nothing stays in the hand-over directory:
files of aborted jobs are deleted, and what nobody collects is reaped after the ttl (on an
injected clock), never a job's in flight."""

from __future__ import annotations

import http.client
import json
import os
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_train import faults
from dflash_train.engine import jobs, protocol, server
from dflash_train.engine.process import EngineError
from dflash_train.engine.source import VllmTarget, VllmTargetSettings
from engine_helpers import FakeEngine, FakeServer, fake_values

HIDDEN = 4
SERVED = [0, 2, 5]  # DFlash ids the fake engine serves (aux 1, 3, 6)


def expected(ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    return fake_values(ids, layer_ids, HIDDEN)


def write_target(path: Path, seed: int = 0, hidden: int = HIDDEN) -> Path:
    """A target directory as far as the weights digest reads it: config.json and weights."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    (path / "model.bin").write_bytes(np.random.default_rng(seed).bytes(20000))
    return path


class Running(FakeServer):
    """The module's fake engine server: its target is `tmp_path/target`."""

    def __init__(self, tmp_path: Path, **kw) -> None:
        target = tmp_path / "target"
        if not target.exists():
            write_target(target)
        super().__init__(tmp_path, target, SERVED, HIDDEN, **kw)
        self.target = target


@pytest.fixture
def running(tmp_path):
    r = Running(tmp_path)
    yield r
    r.close()


def settings_for(running: Running, layer_ids: list[int], **kw) -> VllmTargetSettings:
    base = dict(
        target=str(running.target), layer_ids=layer_ids, dtype=torch.float32, max_model_len=32,
        request_timeout_s=10.0, endpoint=running.url,
    )  # fmt: skip
    return VllmTargetSettings(**{**base, **kw})


def open_target(running: Running, layer_ids: list[int], **kw) -> VllmTarget:
    return VllmTarget.open(settings_for(running, layer_ids, **kw), say=lambda _m: None)


@pytest.mark.parametrize("layer_ids", [[0, 2, 5], [5, 0], [2, 2]])
def test_features_arrive_in_the_drafters_layer_order_and_are_deleted(running, layer_ids):
    target = open_target(running, layer_ids)
    assert target.shared_memory  # the token file is readable here
    ids = torch.randint(0, 1000, (3, 20))
    got = target.source()(ids)
    assert torch.equal(got, expected(ids, layer_ids))
    assert running.files() == []


def test_inline_hand_over_equals_shared_memory_and_leaves_nothing(running):
    ids = torch.randint(0, 1000, (2, 17))
    shm = open_target(running, [5, 2]).source()(ids)
    inline_target = open_target(running, [5, 2])
    inline_target.shared_memory = False
    assert torch.equal(inline_target.source()(ids), shm)
    assert running.files() == []


def test_a_layer_not_served_and_a_context_too_short_are_refused_at_open(running):
    with pytest.raises(ValueError, match=r"also needs \[1\].*--target-layer-ids 1,2"):
        open_target(running, [2, 1])
    with pytest.raises(ValueError, match="up to 64 tokens; this run needs 100"):
        open_target(running, [2], max_model_len=100)


def test_no_engine_at_the_endpoint_is_one_error(tmp_path):
    settings = VllmTargetSettings(
        str(tmp_path), [0], torch.float32, 32, 5.0, endpoint="http://127.0.0.1:9"
    )
    with pytest.raises(ValueError, match="--target-endpoint: no engine answers at http://127.0"):
        VllmTarget.open(settings, say=lambda _m: None)


def test_an_engine_that_dies_fails_the_request_and_every_later_one(tmp_path):
    r = Running(tmp_path, die_at_step=2)
    try:
        source = open_target(r, [0]).source()
        source(torch.ones(1, 8, dtype=torch.long))
        with pytest.raises(EngineError, match="answered 500: the engine died: RuntimeError"):
            source(torch.ones(1, 8, dtype=torch.long))
        with pytest.raises(EngineError, match="the engine died"):
            source(torch.ones(1, 8, dtype=torch.long))
        assert r.error and "engine core died" in str(r.error[0])
    finally:
        r.close()


def test_an_engine_fault_raises_in_the_loop_and_fails_the_job(running):
    faults.install([{"stage": "engine", "at": 2, "action": "raise"}])
    try:
        source = open_target(running, [0]).source()
        source(torch.ones(1, 8, dtype=torch.long))
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="answered 500: the engine died: InjectedFault"):
            source(torch.ones(1, 8, dtype=torch.long))
        assert time.monotonic() - t0 < 5  # at once, not at the request's 10 s deadline
    finally:
        faults.install(None)


def test_a_hung_engine_answers_at_the_deadline_and_the_rows_are_aborted(running):
    faults.install([{"stage": "engine", "at": 1, "action": "hang", "seconds": 3.0}])
    try:
        source = open_target(running, [0], request_timeout_s=1.0).source()
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="answered 504: no features by the request's"):
            source(torch.ones(2, 8, dtype=torch.long))
        assert time.monotonic() - t0 < 2.5
    finally:
        faults.install(None)
    deadline = time.monotonic() + 10
    while len(running.engine.aborted) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the loop aborts them once it is back from the hang
    assert sorted(running.engine.aborted) == ["j0-0", "j0-1"]
    assert running.files() == []


def test_a_bad_row_is_a_400_and_the_engine_goes_on(running):
    source = open_target(running, [0]).source()
    with pytest.raises(EngineError, match="answered 400: row 1: token id 5000"):
        source(torch.tensor([[1, 2], [5000, 3]]))
    assert torch.equal(source(torch.tensor([[1, 2]])), expected(torch.tensor([[1, 2]]), [0]))


def post(url: str, body: dict) -> tuple[int, dict]:
    port = int(url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", protocol.FEATURES, json.dumps(body))
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


def test_the_hand_over_bound_holds_uncollected_bytes_and_refuses_what_never_fits(tmp_path):
    one_row = protocol.feature_bytes(8, 3, HIDDEN, "float32")  # 384 bytes
    r = Running(tmp_path, bound=one_row)
    try:
        status, answer = post(r.url, {"rows": [[1] * 8], "timeout_s": 5})
        assert status == 200 and len(answer["files"]) == 1  # handed over, not yet collected
        handed = answer["files"]
        status, answer = post(r.url, {"rows": [[1] * 8], "timeout_s": 0.5})
        assert status == 503 and "still held 384 bytes not collected" in answer["error"]
        os.unlink(handed[0])  # the client collected it: the bound has room again
        status, answer = post(r.url, {"rows": [[2] * 8], "timeout_s": 5})
        assert status == 200
        status, answer = post(r.url, {"rows": [[1] * 8, [1] * 8], "timeout_s": 5})
        assert status == 413 and "exceeds the engine's hand-over bound" in answer["error"]
        assert "--handover-bytes" in answer["error"] and "/dev/shm" in answer["error"]
    finally:
        r.close()


def test_bad_requests_are_400s(running):
    assert post(running.url, {"rows": []})[0] == 400
    assert post(running.url, {"rows": [[1, "x"]]})[0] == 400
    status, answer = post(running.url, {"rows": [[1] * 64]})
    assert status == 400 and "max_model_len is 64" in answer["error"]
    assert post(running.url, {"rows": [[1]], "handover": "disk"})[0] == 400


def test_an_engine_serving_other_weights_or_another_width_is_refused_in_one_line(running, tmp_path):
    # Another fine-tune of the same shape: the same config, other weights.
    other = write_target(tmp_path / "other", seed=1)
    with pytest.raises(ValueError) as err:
        open_target(running, [0], target=str(other))
    msg = str(err.value)
    assert "\n" not in msg and "serves other weights than this run's --target" in msg
    assert str(running.target) in msg and str(other) in msg
    with pytest.raises(ValueError, match=r"of hidden size 4; this run's --target .* size 8"):
        open_target(running, [0], hidden_size=8)
    running.info.update(weights_digest=None, weights_digest_error="x is not a local directory")
    with pytest.raises(ValueError, match=r"cannot tell which weights it serves \(x is not a"):
        open_target(running, [0])


class Clock:
    """A hand-set clock (seconds) for the hand-over's ages: nothing sleeps through real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_files_nobody_collects_are_deleted_after_the_ttl_and_free_the_bound(tmp_path):
    clock = Clock()
    one_row = protocol.feature_bytes(8, 3, HIDDEN, "float32")
    r = Running(tmp_path, bound=one_row, ttl_s=30.0, clock=clock)
    try:
        status, answer = post(r.url, {"rows": [[1] * 8], "timeout_s": 5})
        assert status == 200  # handed over; its client dies before collecting it
        handed = answer["files"]
        status, refused = post(r.url, {"rows": [[2] * 8], "timeout_s": 0.2})
        assert status == 503 and "deleted after 30 s, --handover-ttl" in refused["error"]
        stray = str(r.dir / "j9-0.bin.part")  # a killed writer's leftover
        Path(stray).write_bytes(b"x")
        assert r.server.budget.reap() == []  # nothing is old enough yet
        clock.now = 29.0
        assert r.server.budget.reap() == []
        clock.now = 31.0
        assert sorted(r.server.budget.reap()) == sorted([*handed, stray])
        assert r.files() == [] and r.server.budget.in_use() == 0
        status, answer = post(r.url, {"rows": [[2] * 8], "timeout_s": 5})
        assert status == 200
    finally:
        r.close()


def test_the_files_of_jobs_in_flight_are_never_reaped(tmp_path):
    clock = Clock()
    r = Running(tmp_path, ttl_s=30.0, clock=clock)
    try:
        job = jobs.Job([[1, 2]])
        job.request_ids.append("j7-0")
        r.server.begin(job)
        # Its row finished (the file under vLLM 0.32's own id for it, "j7-0-" and 8 random
        # characters); the job waits for its others. Another job's file is not its.
        path = protocol.handover_path(str(r.dir), "j7-0-1a2b3c4d")
        Path(path).write_bytes(b"x")
        other = protocol.handover_path(str(r.dir), "j7-00-1a2b3c4d")
        assert r.server.files_in_flight() == {path}
        Path(other).write_bytes(b"y")
        assert r.server.files_in_flight() == {path}
        Path(other).unlink()
        clock.now = 1000.0
        assert r.server.budget.reap(r.server.files_in_flight()) == []
        r.server.end(job)  # answered or failed: its ttl starts now
        assert r.server.budget.reap(r.server.files_in_flight()) == []
        clock.now = 1031.0
        assert r.server.budget.reap(r.server.files_in_flight()) == [path]
    finally:
        r.close()


def test_a_job_nobody_will_answer_has_its_files_deleted_even_those_finished_later(tmp_path):
    # The job's deadline passed with one row finished: the loop aborts the other and deletes
    # the finished row's file; the aborted row, finished anyway in the step that was running
    # (vLLM's engine core in its own process), is deleted when its output arrives.
    directory = tmp_path / "handover"
    directory.mkdir()
    engine = FakeEngine(directory, SERVED, HIDDEN, per_step=1)
    loop = jobs.EngineLoop(engine, None, lambda prompt_token_ids: prompt_token_ids, str(directory))
    job = jobs.Job([[1, 2], [3, 4]])
    loop.submit(job)
    loop._admit(0.0)
    loop._step()
    [name] = os.listdir(directory)  # named by vLLM 0.32's own id for the row: j0-0-XXXXXXXX
    assert job.files[0] is not None and name.startswith("j0-0-") and name.endswith(".bin")
    late = list(engine.waiting)
    loop.abandon(job)
    loop._admit(0.0)
    assert engine.aborted == ["j0-1"] and os.listdir(directory) == []
    engine.waiting = late  # it finishes after all
    loop._step()
    assert os.listdir(directory) == [] and not job.done.is_set()


def test_rows_go_to_the_engine_without_their_padding_and_come_back_padded(running):
    ids = torch.randint(1, 1000, (3, 12))
    lengths = [12, 5, 9]
    for i, n in enumerate(lengths):
        ids[i, n:] = 0  # the prefetchers' padding
    by_row_id = np.array([9, 12, 5])  # the dataset's lengths: the job holds rows 1, 2, 0
    job = types.SimpleNamespace(input_ids=ids, seq_ids=np.array([1, 2, 0]))
    whole = open_target(running, [5, 0]).source()(ids)  # rows sent whole, padding included
    running.engine.prompts.clear()
    for shm in (True, False):
        target = open_target(running, [5, 0])
        target.shared_memory = shm
        got = target.source(by_row_id).features_of(job)
        assert running.engine.prompts == [ids[i, :n].tolist() for i, n in enumerate(lengths)]
        running.engine.prompts.clear()
        for i, n in enumerate(lengths):
            assert torch.equal(got[i, :n], whole[i, :n])  # the same on a row's own tokens
            assert not got[i, n:].any()
    assert running.files() == []


def test_a_hand_over_bound_too_small_for_the_largest_batch_is_refused_at_open(tmp_path):
    # A container's 64 MB /dev/shm caps the engine's bound: every batch would be a 413.
    r = Running(tmp_path, bound=1 << 20)
    try:
        with pytest.raises(ValueError) as err:
            open_target(r, [0], largest_batch_tokens=32768)
        msg = str(err.value)
        assert "\n" not in msg and "largest batch (32768 tokens) needs 1572864 bytes" in msg
        assert "bound of 1048576 bytes (--handover-bytes" in msg and "/dev/shm" in msg
        open_target(r, [0], largest_batch_tokens=16384)  # 786432 bytes fit
    finally:
        r.close()


def test_a_client_gone_when_its_answer_is_written_has_its_files_deleted(running, monkeypatch):
    # A client that gave up (or whose connection dropped and which asked again): the answer
    # naming its files cannot be written, so nobody will take them.
    written = server.Handler._json

    def gone(self, status, payload):
        if "files" in payload:
            raise BrokenPipeError(32, "Broken pipe")
        return written(self, status, payload)

    monkeypatch.setattr(server.Handler, "_json", gone)
    with pytest.raises(http.client.HTTPException):
        post(running.url, {"rows": [[1] * 8, [2] * 8], "timeout_s": 5})
    assert running.files() == [] and running.server.budget.in_use() == 0
