"""`--target-backend vllm` without vLLM (default suite): an environment without vLLM and an
endpoint where no engine answers are one line and exit 2, before the run directory exists, with
no engine process left behind; `capture` takes every --target-endpoint, as `train` does, and
sends each row's own tokens, not its padding (the real engine server around a fake engine)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import torch

from dflash_train import cli
from dflash_train.data.dataset import PreparedDataset
from dflash_train.store.reader import StoreReader
from dflash_train.store.store import FeatureStore
from engine_helpers import FakeEngine, FakeServer, assert_no_engine_left, engine_pgids, fake_values
from pipeline_helpers import write_random_dataset


def argv(tiny_target, data, out, *extra: str) -> list[str]:
    return [
        "train", "--target", str(tiny_target), "--data", str(data), "--out", str(out),
        "--target-backend", "vllm", "--target-devices", "cpu", "--drafter-devices", "cpu",
        "--draft-layers", "1", "--block-size", "8", "--num-anchors", "16",
        "--mask-token-id", "255", "--batch-cost", "blocks", "--no-progress", *extra,
    ]  # fmt: skip


def one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_an_environment_without_vllm_is_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    data = write_random_dataset(tmp_path / "data", num_rows=8)
    # This project's own environment has no vLLM: it never enters it.
    code = cli.main(argv(tiny_target, data, tmp_path / "run", "--vllm-python", sys.executable))
    err = capsys.readouterr().err
    assert code == 2
    line = one_error_line(err)
    assert "the vLLM engine did not start (exit 3): no working vLLM in" in line
    assert "log: " in line
    assert not (tmp_path / "run").exists()
    assert_no_engine_left(engine_pgids(err))


def test_an_endpoint_with_no_engine_is_one_line_and_exit_2(tiny_target, tmp_path, capsys):
    data = write_random_dataset(tmp_path / "data", num_rows=8)
    code = cli.main(
        argv(tiny_target, data, tmp_path / "run", "--target-endpoint", "http://127.0.0.1:9")
    )
    assert code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "--target-endpoint: no engine answers at http://127.0.0.1:9" in line
    assert not (tmp_path / "run").exists()


class BothEngines(FakeEngine):
    """A fake engine whose first step waits (at most 60 s) until every engine of the test has
    been sent a row: so each of them computes some, whatever the threads' timing."""

    def __init__(self, *args, everyone: list, started: threading.Event) -> None:
        super().__init__(*args)
        self.everyone, self.started = everyone, started

    def add_request(self, rid, prompt, params) -> None:
        super().add_request(rid, prompt, params)
        if all(e.prompts for e in self.everyone):
            self.started.set()

    def step(self):
        assert self.started.wait(timeout=60), "a target worker never reached its engine"
        return super().step()


def test_capture_uses_every_endpoint_and_sends_rows_without_padding(tiny_target, tmp_path):
    data = write_random_dataset(tmp_path / "data", num_rows=12, min_len=10, max_len=60)
    everyone: list[FakeEngine] = []
    started = threading.Event()

    def engine(directory):
        everyone.append(BothEngines(directory, [1, 3], 64, everyone=everyone, started=started))
        return everyone[-1]

    servers = [
        FakeServer(tmp_path / f"e{i}", tiny_target, [1, 3], 64, bound=1 << 26,
                   max_model_len=256, engine=engine)
        for i in range(2)
    ]  # fmt: skip
    store = tmp_path / "store"
    argv = ["capture", "--target", str(tiny_target), "--data", str(data), "--out", str(store)]
    argv += ["--dtype", "fp32", "--target-layer-ids", "1,3", "--target-devices", "cpu"]
    argv += ["--batch-size", "2", "--target-backend", "vllm", "--target-workers", "2"]
    try:
        code = cli.main([*argv, "--target-endpoint", ",".join(s.url for s in servers)])
    finally:
        for server in servers:
            server.close()
    assert code == 0
    assert all(e.prompts for e in everyone)  # both engines computed rows
    dataset = PreparedDataset(data)
    sent = sorted(len(p) for e in everyone for p in e.prompts)
    assert sent == sorted(dataset.lengths.tolist())  # every row once, its own tokens only
    reader = StoreReader(FeatureStore.open(store), [1, 3], torch.device("cpu"), torch.float32)
    for sid in range(len(dataset)):
        ids = torch.from_numpy(dataset.row(sid)[0].astype(np.int64))[None]
        got = reader.read(np.array([sid]), ids)
        assert torch.equal(got, fake_values(ids, [1, 3], 64)), sid
