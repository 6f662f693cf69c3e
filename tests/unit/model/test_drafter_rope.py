"""A new drafter's RoPE, from targets whose RoPE is scaled as real checkpoints' is: the settings
it trains with are read alike by every reader of its export (transformers, so the reference
client, which builds transformers' Qwen3 rotary embedding; vLLM and SGLang, whose YaRN ignored
or ignores some of the magnitude fields). vLLM itself: tests/integration/test_served_rope.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_train.model.compat import family_supported
from dflash_train.model.draft import (
    YARN_SHARED_FIELDS,
    RotaryEmbedding,
    yarn_magnitude_fields,
)
from dflash_train.model.families import read_target_layout
from dflash_train.model.serving import exported_config
from dflash_train.model.target import draft_config_from_target
from dflash_train.model.tiny import save_random_qwen3
from target_zoo import ROPE_VARIANTS, save_target

MAGNITUDE_FIELDS = ("mscale", "mscale_all_dim", "attention_factor")
"""The YaRN fields vLLM up to 0.25 (the first two) and SGLang (the last) do not read."""


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """name -> the DFlashConfig a new drafter of that target gets."""
    root = tmp_path_factory.mktemp("rope")
    targets = {
        name: save_target(fam, root / name, **kw)
        for name, (fam, kw) in ROPE_VARIANTS.items()
        if family_supported(fam)  # the others are refused in one line (test_target_zoo)
    }
    targets["qwen3"] = save_random_qwen3(root / "qwen3", max_position_embeddings=40960)
    return Drafters(
        {
            name: draft_config_from_target(read_target_layout(path).text, 1, 4, 255)
            for name, path in targets.items()
        }
    )


class Drafters(dict):
    """The drafters by variant; a variant whose family the installed transformers refuses
    skips the test that asks for it."""

    def __missing__(self, name: str):
        family = ROPE_VARIANTS[name][0]
        pytest.skip(f"a {family!r} target needs a newer transformers than the installed one")


def _transformers_tables(config_json: dict, positions: torch.Tensor, tmp_path):
    """cos, sin as transformers (and so the reference client) computes them from an export's
    config.json, over one sequence of `positions` (length-dependent tables switch as at
    inference)."""
    from transformers import AutoConfig
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    (tmp_path / "config.json").write_text(json.dumps(config_json))
    rotary = Qwen3RotaryEmbedding(AutoConfig.from_pretrained(tmp_path))
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", ["deepseek_v3_yarn", "kimi_k2_yarn"])
def test_a_deepseek_or_kimi_drafter_trains_with_the_yarn_factor_every_reader_applies(
    drafters, name
):
    config = drafters[name]
    rope = config.rope_parameters
    assert rope["rope_type"] == "yarn" and not yarn_magnitude_fields(rope)
    # Every reader's factor without the magnitude fields: 1 + 0.1 ln(factor), 1.369 at 40.
    assert RotaryEmbedding(config).attention_scaling == pytest.approx(
        1 + 0.1 * math.log(rope["factor"])
    )
    exported = exported_config(config)
    for params in (exported["rope_parameters"], exported["rope_scaling"]):
        assert set(params) <= set(YARN_SHARED_FIELDS)
        assert params["factor"] == ROPE_VARIANTS[name][1]["rope_scaling"]["factor"]


@pytest.mark.parametrize("name", [*ROPE_VARIANTS, "qwen3"])
def test_the_trainer_and_every_transformers_reading_of_the_export_rotate_alike(
    drafters, name, tmp_path
):
    """Over a 6,000-token sequence (past the 4,096 original context of the YaRN and longrope
    targets): the trainer's tables equal transformers' from the export's config.json, and
    equal them again with the magnitude fields removed, as readers that ignore them see it."""
    config = drafters[name]
    positions = torch.arange(6000)
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    exported = exported_config(config)
    ignoring = json.loads(json.dumps(exported))
    for key in ("rope_parameters", "rope_scaling"):
        for field in MAGNITUDE_FIELDS:
            (ignoring[key] or {}).pop(field, None)
    for i, reading in enumerate((exported, ignoring)):
        (tmp_path / str(i)).mkdir()
        got_cos, got_sin = _transformers_tables(reading, positions, tmp_path / str(i))
        torch.testing.assert_close(got_cos, cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(got_sin, sin, atol=1e-6, rtol=0)


def test_a_longrope_target_gives_a_plain_rope_drafter(drafters):
    # transformers picks the short or long factors by the running sequence length, vLLM by
    # the engine's max_model_len: no table every reader computes alike.
    assert drafters["phi3_longrope"].rope_parameters == {"rope_type": "default", "rope_theta": 1e4}


@pytest.mark.parametrize(
    ("name", "rope_type"),
    [
        ("llama3", "llama3"),
        ("llama_dynamic", "dynamic"),
        ("gemma3_linear", "linear"),
        ("gpt_oss_yarn", "yarn"),
    ],
)
def test_scalings_that_readers_apply_alike_are_kept(drafters, name, rope_type):
    rope = drafters[name].rope_parameters
    assert rope["rope_type"] == rope_type
    if name == "gpt_oss_yarn":  # truncate is read by transformers, vLLM 0.32.0 and SGLang
        assert rope["truncate"] is False


def test_a_drafter_cast_to_bf16_keeps_its_rope_frequencies_in_fp32(tmp_path):
    """Regression: `eval` loads a drafter on CUDA in bf16 (`load_draft(..., dtype)`), and the
    cast rounded `inv_freq` too: angles ~1 rad off at position 1,000, where training, vLLM and
    the reference client compute RoPE from fp32 frequencies."""
    from dflash_train.model.checkpoint import load_draft, save_draft
    from dflash_train.model.draft import DFlashDraftModel

    target = save_random_qwen3(tmp_path / "target", max_position_embeddings=40960)
    config = draft_config_from_target(read_target_layout(target).text, 1, 4, 255)
    model = DFlashDraftModel(config)
    positions = torch.arange(0, 4096, 64)[None]
    want = model.rotary(positions, torch.float32)
    cast = DFlashDraftModel(config).to(torch.bfloat16)
    assert cast.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(cast.rotary.inv_freq, model.rotary.inv_freq)
    save_draft(tmp_path / "drafter", model)
    loaded = load_draft(tmp_path / "drafter", "cpu", torch.bfloat16)
    assert next(loaded.parameters()).dtype == torch.bfloat16  # the weights are cast
    for got, ref in zip(loaded.rotary(positions, torch.float32), want, strict=True):
        torch.testing.assert_close(got, ref)
