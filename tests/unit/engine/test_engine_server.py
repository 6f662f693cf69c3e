"""The engine server and its client without vLLM: the real HTTP server, engine loop, hand-over
budget and `VllmFeatureSource`, around a fake engine that writes each row's features as the
connector does (raw (n, K, hidden) bytes, renamed into place). Checked: features arrive in the
drafter's layer order by either hand-over and are deleted once read; an engine that dies, hangs
or has its hand-over bound full fails the request with one clear error, never silently."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_train import faults
from dflash_train.engine import jobs, protocol, server
from dflash_train.engine.process import EngineError
from dflash_train.engine.source import VllmTarget, VllmTargetSettings

HIDDEN = 4
SERVED = [0, 2, 5]  # DFlash ids the fake engine serves (aux 1, 3, 6)


def expected(ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """What the fake engine computes: value = token id + DFlash layer id / 10 + channel / 100."""
    rows, length = ids.shape
    parts = [
        ids[..., None].float() + i / 10 + torch.arange(HIDDEN).float() / 100 for i in layer_ids
    ]
    return torch.cat(parts, dim=-1).reshape(rows, length, len(layer_ids) * HIDDEN)


class Output:
    def __init__(self, request_id: str, params: dict | None) -> None:
        self.request_id, self.finished, self.kv_transfer_params = request_id, True, params


class FakeEngine:
    """LLMEngine's calls the loop makes; `step` writes the finished rows' hand-over files."""

    def __init__(self, directory: Path, die_at_step: int | None = None) -> None:
        self.dir, self.die_at_step = directory, die_at_step
        self.waiting: list[tuple[str, list[int]]] = []
        self.steps, self.aborted = 0, []

    def add_request(self, rid: str, prompt: list[int], params) -> None:
        if max(prompt) >= 1000:
            raise ValueError(f"token id {max(prompt)} is out of vocabulary")
        self.waiting.append((rid, prompt))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def abort_request(self, rids: list[str]) -> None:
        self.aborted += rids
        self.waiting = [(r, p) for r, p in self.waiting if r not in rids]

    def step(self) -> list[Output]:
        self.steps += 1
        if self.die_at_step is not None and self.steps >= self.die_at_step:
            raise RuntimeError("the engine core died")
        outs = []
        for rid, prompt in self.waiting:
            states = expected(torch.tensor([prompt]), SERVED)[0]  # (n, K * hidden) = (n, K, hidden)
            path = str(self.dir / f"{rid}.bin")
            states.numpy().astype(np.float32).tofile(path + ".part")
            os.replace(path + ".part", path)
            outs.append(Output(rid, {"hidden_states_path": path, "num_tokens": len(prompt)}))
        self.waiting = []
        return outs


class Running:
    """A server with a fake engine on a free port, its loop on a thread of its own."""

    def __init__(self, tmp_path: Path, bound: int = 1 << 20, **fake) -> None:
        self.dir = tmp_path / "handover"
        self.dir.mkdir()
        (self.dir / protocol.TOKEN_FILE).write_text("t0k")
        info = {
            "target": "fake", "target_layer_ids": SERVED, "aux_layer_ids": [1, 3, 6],
            "hidden_size": HIDDEN, "dtype": "float32", "max_model_len": 64,
            "tensor_parallel_size": 1, "vllm_version": "fake", "pid": os.getpid(),
            "handover_dir": str(self.dir), "handover_token": "t0k", "handover_bytes": bound,
        }  # fmt: skip
        self.server = server.Server(("127.0.0.1", 0), info)
        self.server.budget = jobs.HandOverBudget(bound)
        self.engine = FakeEngine(self.dir, **fake)
        self.server.loop = jobs.EngineLoop(
            self.engine, None, lambda prompt_token_ids: prompt_token_ids
        )
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.stop = threading.Event()
        self.error: list[BaseException] = []
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        try:
            self.server.loop.run(self.stop)
        except BaseException as e:
            self.error.append(e)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[str]:
        return sorted(set(os.listdir(self.dir)) - {protocol.TOKEN_FILE})


@pytest.fixture
def running(tmp_path):
    r = Running(tmp_path)
    yield r
    r.close()


def open_target(url: str, layer_ids: list[int], timeout_s: float = 10.0) -> VllmTarget:
    settings = VllmTargetSettings(
        target="fake", layer_ids=layer_ids, dtype=torch.float32, max_model_len=32,
        request_timeout_s=timeout_s, endpoint=url,
    )  # fmt: skip
    return VllmTarget.open(settings, say=lambda _m: None)


@pytest.mark.parametrize("layer_ids", [[0, 2, 5], [5, 0], [2, 2]])
def test_features_arrive_in_the_drafters_layer_order_and_are_deleted(running, layer_ids):
    target = open_target(running.url, layer_ids)
    assert target.shared_memory  # the token file is readable here
    ids = torch.randint(0, 1000, (3, 20))
    got = target.source()(ids)
    assert torch.equal(got, expected(ids, layer_ids))
    assert running.files() == []


def test_inline_hand_over_equals_shared_memory_and_leaves_nothing(running):
    ids = torch.randint(0, 1000, (2, 17))
    shm = open_target(running.url, [5, 2]).source()(ids)
    inline_target = open_target(running.url, [5, 2])
    inline_target.shared_memory = False
    assert torch.equal(inline_target.source()(ids), shm)
    assert running.files() == []


def test_a_layer_not_served_and_a_context_too_short_are_refused_at_open(running):
    with pytest.raises(ValueError, match=r"also needs \[1\].*--target-layer-ids 1,2"):
        open_target(running.url, [2, 1])
    settings = VllmTargetSettings("fake", [2], torch.float32, 100, 5.0, endpoint=running.url)
    with pytest.raises(ValueError, match="up to 64 tokens; this run needs 100"):
        VllmTarget.open(settings, say=lambda _m: None)


def test_no_engine_at_the_endpoint_is_one_error():
    with pytest.raises(ValueError, match="--target-endpoint: no engine answers at http://127.0"):
        open_target("http://127.0.0.1:9", [0])


def test_an_engine_that_dies_fails_the_request_and_every_later_one(tmp_path):
    r = Running(tmp_path, die_at_step=2)
    try:
        source = open_target(r.url, [0]).source()
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
        source = open_target(running.url, [0]).source()
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
        source = open_target(running.url, [0], timeout_s=1.0).source()
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
    source = open_target(running.url, [0]).source()
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
    finally:
        r.close()


def test_bad_requests_are_400s(running):
    assert post(running.url, {"rows": []})[0] == 400
    assert post(running.url, {"rows": [[1, "x"]]})[0] == 400
    status, answer = post(running.url, {"rows": [[1] * 64]})
    assert status == 400 and "max_model_len is 64" in answer["error"]
    assert post(running.url, {"rows": [[1]], "handover": "disk"})[0] == 400
