"""Metrics backends: JSON lines read back, TensorBoard events readable, W&B offline, no secrets."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from dflash_train.metrics.logger import (
    METRICS_FILE,
    GuardedLogger,
    JsonlLogger,
    MetricsLogger,
    MultiLogger,
    NullLogger,
    TensorBoardLogger,
    build_loggers,
    strip_secrets,
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_lines_read_back_with_step_time_and_metrics(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path)
    logger.log(10, {"train/loss": 2.5, "queue/depth": 7})
    logger.log(20, {"train/loss": 2.0, "eval/tau": 3.25})
    logger.close()
    lines = _read_jsonl(tmp_path / METRICS_FILE)
    assert [line["step"] for line in lines] == [10, 20]
    assert lines[0]["train/loss"] == 2.5 and lines[0]["queue/depth"] == 7
    assert isinstance(lines[0]["queue/depth"], int)
    assert lines[1]["eval/tau"] == 3.25 and "queue/depth" not in lines[1]
    assert all(abs(line["time"] - lines[0]["time"]) < 60 for line in lines)


def test_jsonl_is_readable_before_close_so_a_crashed_run_keeps_its_lines(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path)
    logger.log(1, {"train/loss": 3.0})
    # Not closed: another reader (the report, or a post-mortem) must already see the line.
    assert _read_jsonl(tmp_path / METRICS_FILE)[0]["train/loss"] == 3.0
    logger.close()


def test_jsonl_appends_on_resume(tmp_path: Path) -> None:
    for step in (1, 2):
        logger = JsonlLogger(tmp_path)
        logger.log(step, {"train/loss": float(step)})
        logger.close()
    assert [line["step"] for line in _read_jsonl(tmp_path / METRICS_FILE)] == [1, 2]


def test_jsonl_writes_nan_and_inf_as_null_in_strict_json(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path)
    logger.log(5, {"train/loss": math.nan, "train/grad_norm": math.inf, "train/lr": -math.inf})
    logger.close()
    text = (tmp_path / METRICS_FILE).read_text()
    line = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert line["train/loss"] is None and line["train/grad_norm"] is None
    assert line["train/lr"] is None


def test_jsonl_rejects_metric_names_that_clash_with_step_or_time(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path)
    with pytest.raises(ValueError, match="reserved"):
        logger.log(1, {"step": 3})
    logger.close()


def test_null_logger_and_backends_satisfy_the_protocol(tmp_path: Path) -> None:
    assert isinstance(NullLogger(), MetricsLogger)
    jsonl = JsonlLogger(tmp_path)
    assert isinstance(jsonl, MetricsLogger)
    assert isinstance(MultiLogger([jsonl]), MetricsLogger)
    jsonl.close()


def test_multi_logger_closes_every_backend_even_when_one_fails() -> None:
    closed: list[str] = []

    class Failing(NullLogger):
        def close(self) -> None:
            closed.append("failing")
            raise RuntimeError("disk gone")

    class Recording(NullLogger):
        def close(self) -> None:
            closed.append("recording")

    with pytest.raises(RuntimeError, match="disk gone"):
        MultiLogger([Failing(), Recording()]).close()
    assert closed == ["failing", "recording"]


def test_tensorboard_events_hold_the_logged_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path / "tb")
    logger.log(10, {"train/loss": 2.5, "queue/depth": 7})
    logger.log(20, {"train/loss": 2.0})
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "queue/depth"}
    loss = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert loss == [(10, pytest.approx(2.5)), (20, pytest.approx(2.0))]
    assert [e.value for e in acc.Scalars("queue/depth")] == [7.0]


def test_missing_tensorboard_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes `import` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ValueError, match=r"dflash-train\[tensorboard\]"):
        TensorBoardLogger(tmp_path)


def test_missing_wandb_package_names_the_extra_and_leaves_no_open_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ValueError, match=r"dflash-train\[wandb\]"):
        build_loggers(tmp_path, wandb_project="p")


def test_build_loggers_always_writes_jsonl_and_adds_tensorboard_on_request(
    tmp_path: Path,
) -> None:
    logger = build_loggers(tmp_path, tensorboard=True)
    logger.log(3, {"train/loss": 1.0})
    logger.close()
    assert _read_jsonl(tmp_path / METRICS_FILE)[0]["step"] == 3
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_strip_secrets_drops_credential_keys_and_env_secret_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    config = {
        "run": {"wandb_api_key": "x" * 12, "hf_token": "y", "name": "r1", "notes": ["a"]},
        "data": {"max_tokens": 4096, "pad_token": "<pad>", "source": "hf_abcdefghijklmnop"},
        "password": "p",
    }
    assert strip_secrets(config) == {
        "run": {"name": "r1", "notes": ["a"]},
        "data": {"max_tokens": 4096, "pad_token": "<pad>"},
    }


def test_wandb_offline_run_is_written_without_the_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_key = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", fake_key)
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"run": {"lr": 6e-4, "wandb_api_key": fake_key}, "key_copy": fake_key}
    logger = build_loggers(tmp_path, wandb_project="dflash-test", wandb_run_name="t", config=config)
    logger.log(1, {"train/loss": 2.0, "queue/depth": 3})
    logger.log(2, {"train/loss": math.nan})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].rglob("*.wandb")), "no offline run data written"
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and fake_key.encode() in p.read_bytes()]
    assert leaks == []


def test_a_failing_optional_backend_is_said_once_and_turned_off(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Flaky:
        calls = 0

        def log(self, step, metrics) -> None:
            Flaky.calls += 1
            raise OSError("tensorboard disk error")

        def close(self) -> None:
            pass

    jsonl = JsonlLogger(tmp_path)
    logger = MultiLogger([jsonl, GuardedLogger(Flaky(), "TensorBoard")])
    for step in range(1, 4):
        logger.log(step, {"train/loss": 1.0})
    logger.close()
    assert Flaky.calls == 1  # off after its first failure
    assert capsys.readouterr().err.count("the TensorBoard backend failed at step 1") == 1
    assert [r["step"] for r in _read_jsonl(tmp_path / METRICS_FILE)] == [1, 2, 3]


def test_a_backend_that_cannot_start_leaves_training_with_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import dflash_train.metrics.logger as logger_module

    def unreachable(*args, **kwargs):
        raise ConnectionError("W&B is unreachable")

    monkeypatch.setattr(logger_module, "WandbLogger", unreachable)
    logger = build_loggers(tmp_path, wandb_project="p")
    logger.log(1, {"train/loss": 1.0})
    logger.close()
    assert "the W&B backend could not start (ConnectionError" in capsys.readouterr().err
    assert _read_jsonl(tmp_path / METRICS_FILE)[0]["step"] == 1
