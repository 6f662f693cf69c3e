"""`dflash-train regenerate --endpoint` against a real vLLM OpenAI server (slow): the CPU build
`bench engine` caches, one server for the module, a tiny random Qwen3 with a ChatML tokenizer.

vLLM returns a completion's generated ids when asked (`return_token_ids`), through the stop token
that ended the turn, the convention the local back end follows; `prepare` then trains the last
answer on exactly those ids after its generation prompt, as it does the local back end's. The
target's LM head row of the end-of-turn token is scaled up so that some answers stop on it
before `--max-new-tokens` (a random target rarely does) and both ends are seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_train.cli import main as cli
from dflash_train.data.synthetic import write_jsonl
from engine_helpers import ENGINE_TEST_TIMEOUT_S, vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S)]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Count with me: one, two, three, four, five, six, seven, eight, nine, ten.",
    "What is the capital of France? Paris is the capital of France.",
] * 20
START_TIMEOUT_S = 600


def make_target(path: Path) -> Path:
    """A random Qwen3 vLLM's CPU kernels take (head dim 32), its vocabulary the tokenizer's, its
    end-of-turn logit made large where it is positive (answers stop at random places)."""
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_train.data.tokenizer import build_chat_tokenizer
    from dflash_train.model.tiny import save_random_qwen3

    tok = build_chat_tokenizer(TEXTS, path, vocab_size=320, style="qwen3")
    save_random_qwen3(
        path, num_heads=2, num_kv_heads=1, head_dim=32, initializer_range=0.1, vocab_size=len(tok)
    )
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"][tok.convert_tokens_to_ids("<|im_end|>")] *= 3.0
    save_file({k: v.contiguous() for k, v in weights.items()}, path / "model.safetensors")
    torch.set_num_threads(1)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(endpoint, target dir): vLLM's OpenAI server on the tiny target, its own process group."""
    root = tmp_path_factory.mktemp("regen_vllm")
    target = make_target(root / "target")
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ""}
    log = (root / "server.log").open("w")
    argv = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    argv += ["--dtype", "float32", "--port", str(port), "--max-model-len", "512"]
    argv += ["--served-model-name", "tiny"]
    proc = subprocess.Popen(
        argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited ({proc.returncode}): {root / 'server.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"vLLM's server did not start in {START_TIMEOUT_S} s")
                time.sleep(2)
        yield f"http://127.0.0.1:{port}/v1", target
    finally:  # the server and the engine core it started: one process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()


def test_vllm_returns_the_generated_ids_and_prepare_trains_the_answers_on_them(
    served, tmp_path, capsys
):
    from transformers import AutoTokenizer

    from dflash_train.data.chat import ChatFormat
    from dflash_train.data.dataset import PreparedDataset

    endpoint, target = served
    prompts = [{"prompt": f"question {i}: count with me"} for i in range(8)]
    prompts.append(
        {
            "messages": [
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "Count with me."},
            ]
        }
    )
    data = write_jsonl(prompts, tmp_path / "in.jsonl")
    out = tmp_path / "regen.jsonl"
    argv = ["regenerate", "--data", str(data), "--out", str(out), "--endpoint", endpoint]
    assert cli([*argv, "--max-new-tokens", "10", "--thinking", "off", "--concurrency", "4"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fmt = ChatFormat(AutoTokenizer.from_pretrained(target), enable_thinking=False)
    reasons = []
    for row in rows:
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(row["token_ids"]) == len(row["finish_reasons"]) == len(answers), row
        for ids, reason, text in zip(row["token_ids"], row["finish_reasons"], answers, strict=True):
            reasons.append(reason)
            assert (ids[-1] in fmt.stop_token_ids) == (reason == "stop"), row
            assert len(ids) == 10 or reason == "stop"
            text_ids = ids[:-1] if reason == "stop" else ids
            decoded = fmt.tokenizer.decode(text_ids, skip_special_tokens=True)
            # vLLM holds back the bytes of a character the turn's end cut (decode: U+FFFD)
            assert decoded.rstrip("\ufffd") == text
    assert "stop" in reasons and "length" in reasons, [list(map(len, r["token_ids"])) for r in rows]

    ds_dir = tmp_path / "ds"
    prep = ["prepare", "--data", str(out), "--tokenizer", str(target), "--out", str(ds_dir)]
    assert cli([*prep, "--no-enable-thinking"]) == 0
    ds = PreparedDataset(ds_dir)
    assert ds.summary["stats"]["answers_from_ids"] == len(rows) == len(ds)
    for i, row in enumerate(rows):
        ids, mask = ds.row(i)
        prompt = fmt.prompt_ids(row["messages"][:-1])
        generated = row["token_ids"][-1]
        assert ids[len(ids) - len(generated) :].tolist() == generated, row
        assert mask[len(ids) - len(generated) :].all()
        if len(row["messages"]) == 1 + 1:  # one turn: the row is the prompt, then the ids
            assert ids.tolist() == [*prompt.tolist(), *generated]
            assert not mask[: len(prompt)].any()
