"""The drafter is served with the rotation it trained with (slow: vLLM's CPU build).

For targets whose RoPE is scaled as real checkpoints' is (`target_zoo.ROPE_VARIANTS`: DeepSeek-V3
and Kimi K2 YaRN with the mscale pair, Llama 3.1's llama3, Gemma 3's per-layer-type linear,
gpt-oss YaRN with truncate false, Phi-3.5's longrope) and a plain Qwen3 target: a new drafter
is built from the target and exported as `dflash-train export --target` writes it; then
vLLM's rotary embedding is built from that config.json inside vLLM's own environment
(`vllm_rope_tables.py`, run by the cached venv's python as `bench engine` runs vLLM) and its
cos/sin and rotated queries are compared with the trainer's at positions up to the target's
context length. The same is checked for a vLLM that ignores YaRN's magnitude fields (vLLM up
to 0.25 ignored `mscale` / `mscale_all_dim`, SGLang ignores `attention_factor`), and for
transformers and the reference client (PyPI `dflash`) reading the export.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_train.bench.engine import default_cache_dir, ensure_vllm_env
from dflash_train.export import export_draft
from dflash_train.model.draft import DFlashDraftModel, apply_rope
from dflash_train.model.families import input_embedding_scale, read_target_layout
from dflash_train.model.target import draft_config_from_target
from dflash_train.model.tiny import save_random_qwen3
from target_zoo import ROPE_VARIANTS, save_target

pytestmark = pytest.mark.slow  # ~1 minute with the vLLM venv cached (3 more to build it)

SCRIPT = Path(__file__).with_name("vllm_rope_tables.py")
IGNORED_BY_SOME_READERS = ["mscale", "mscale_all_dim", "attention_factor"]
POSITIONS = [0, 1, 17, 255, 1000, 4095, 4096, 5000, 8191, 40000, 100000, 163839]
VLLM_TIMEOUT_S = 600  # one import of vLLM and a few tables: ~30 s here
CASES = [*ROPE_VARIANTS, "qwen3"]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, DFlashDraftModel, list[int]]]:
    """name -> (export directory, the drafter as trained, positions inside its context)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("served_rope")
    targets = {n: save_target(f, root / n / "target", **kw) for n, (f, kw) in ROPE_VARIANTS.items()}
    targets["qwen3"] = save_random_qwen3(root / "qwen3" / "target", max_position_embeddings=40960)
    out = {}
    for name, target in targets.items():
        torch.manual_seed(0)
        layout = read_target_layout(target)
        scale = input_embedding_scale(layout)  # Gemma's sqrt(hidden), checked by the export
        config = draft_config_from_target(layout.text, 1, 4, 255, input_embedding_scale=scale)
        model = DFlashDraftModel(config)
        export_draft(model, root / name / "export", target_dir=target)
        positions = [p for p in POSITIONS if p < config.max_position_embeddings]
        out[name] = (root / name / "export", model, positions)
    return out


@pytest.fixture(scope="module")
def served(exports, tmp_path_factory) -> dict[str, torch.Tensor]:
    """`vllm_rope_tables.py`'s tables for every export, computed by vLLM's CPU build."""
    env = ensure_vllm_env(default_cache_dir())
    work = tmp_path_factory.mktemp("vllm_rope")
    job = {"ignored_fields": IGNORED_BY_SOME_READERS, "exports": {}}
    for name, (export, model, positions) in exports.items():
        torch.save(_query(model, len(positions)), work / f"{name}.pt")
        job["exports"][name] = {
            "dir": str(export), "positions": positions, "query": str(work / f"{name}.pt"),
        }  # fmt: skip
    (work / "job.json").write_text(json.dumps(job))
    env_vars = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [str(env.python), "-P", str(SCRIPT), str(work / "job.json"), str(work / "out.pt")],
        capture_output=True, text=True, timeout=VLLM_TIMEOUT_S, env=env_vars, cwd=work,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(work / "out.pt")


def _query(model: DFlashDraftModel, tokens: int) -> torch.Tensor:
    """(tokens, heads * head_dim): one query per position, as vLLM's attention hands it over."""
    c = model.config
    gen = torch.Generator().manual_seed(tokens)
    return torch.randn(tokens, c.num_attention_heads * c.head_dim, generator=gen)


def _trained(model: DFlashDraftModel, positions: list[int]) -> tuple[torch.Tensor, ...]:
    """The trainer's cos, sin (tokens, head_dim) and its rotation of `_query`."""
    c = model.config
    cos, sin = model.rotary(torch.tensor(positions), torch.float32)
    q = _query(model, len(positions)).view(1, len(positions), c.num_attention_heads, c.head_dim)
    rotated = apply_rope(q.transpose(1, 2), cos[None], sin[None]).transpose(1, 2)
    return cos, sin, rotated.reshape(len(positions), -1)


@pytest.mark.parametrize("reading", ["vllm", "ignoring"])
@pytest.mark.parametrize("name", CASES)
def test_vllm_serves_the_rotation_the_drafter_trained_with(exports, served, name, reading):
    """vLLM 0.32.0 as it reads the export ("vllm"), and a vLLM that ignores YaRN's magnitude
    fields ("ignoring": what vLLM up to 0.25 and SGLang read of them): the same cos/sin table
    and the same rotated queries as training, at every position."""
    _export, model, positions = exports[name]
    assert f"{name}/error" not in served, served.get(f"{name}/error")
    cos, sin, rotated = _trained(model, positions)
    half = model.config.head_dim // 2
    cos_sin = served[f"{name}/{reading}/cos_sin"]  # (tokens, head_dim): cos of pairs, then sin
    torch.testing.assert_close(cos_sin[:, :half], cos[:, :half], atol=1e-5, rtol=0)
    torch.testing.assert_close(cos_sin[:, half:], sin[:, :half], atol=1e-5, rtol=0)
    torch.testing.assert_close(served[f"{name}/{reading}/query"], rotated, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_transformers_and_the_reference_client_read_the_export_as_trained(exports, name):
    dflash = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    export, model, positions = exports[name]
    cos, sin, _ = _trained(model, positions)
    ids = torch.tensor(positions)[None]
    x = torch.zeros(1, dtype=torch.float32)
    reference = dflash.DFlashDraftModel.from_pretrained(export, torch_dtype=torch.float32)
    readers = {
        "transformers": Qwen3RotaryEmbedding(AutoConfig.from_pretrained(export)),
        "reference client": reference.rotary_emb,
    }
    for reader, rotary in readers.items():
        got_cos, got_sin = rotary(x, ids)
        torch.testing.assert_close(got_cos[0], cos, atol=1e-6, rtol=0, msg=reader)
        torch.testing.assert_close(got_sin[0], sin, atol=1e-6, rtol=0, msg=reader)
