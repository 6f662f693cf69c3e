"""Reading published drafters (`model/published.py`, `model/serving.py`) and starting a run from
one (`train/init_from.py`): what is read as what, and what is refused in one line. That a
drafter read from each layout drafts exactly as published is
tests/integration/test_published_drafters.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_train import cli
from dflash_train.config import ModelOptions
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.published import layout_of, read_config, speculators_as_exported
from dflash_train.model.serving import config_from_exported, exported_config, read_tensors
from dflash_train.train.setup import draft_config_for
from pipeline_helpers import write_random_dataset

pytestmark = pytest.mark.usefixtures("one_thread")

# The conftest's tiny target: Qwen3, 6 layers, hidden 64, vocabulary 256 (no tokenizer).
FITS = dict(hidden_size=64, num_target_layers=6, vocab_size=256, target_layer_ids=[1, 3])


def make_config(**kw) -> DFlashConfig:
    base = dict(
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mask_token_id=255,
        block_size=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=4096,
        **FITS,
    )
    return DFlashConfig(**{**base, **kw})


def write_config(path, data: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(data))
    return path


def speculators_config(**kw) -> dict:
    """A speculators DFlash config.json (decoder fields as a 4.x writer left them: defaults out)."""
    decoder = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 12,
    }
    data = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": decoder,
        "draft_vocab_size": 256,
        "block_size": 8,
        "aux_hidden_state_layer_ids": [2, 4],
        "mask_token_id": 255,
        "sliding_window_non_causal": False,
    }
    return {**data, **kw}


# ----------------------------------------------------------------------------- speculators
def test_a_speculators_config_reads_as_the_drafter_it_describes(tmp_path):
    path = write_config(tmp_path / "s", speculators_config())
    assert layout_of(path) == "speculators"  # though it names DFlashDraftModel too
    config = read_config(path, num_target_layers=6)
    assert config.target_layer_ids == [1, 3]  # vLLM's aux ids (inputs of layers 2, 4) - 1
    assert (config.mask_token_id, config.block_size, config.num_target_layers) == (255, 8, 6)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window == 12 and config.is_causal is None  # sliding causal, full not
    assert config.rms_norm_eps == 1e-6 and config.rope_parameters["rope_theta"] == 10000.0
    bidirectional = read_config(
        write_config(tmp_path / "b", speculators_config(sliding_window_non_causal=True)), 6
    )
    assert [bidirectional.layer_causal(i) for i in range(2)] == [False, False]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"draft_vocab_size": 128}, "draft_vocab_size 128 is not the target's 256"),
        ({"sample_from_anchor": True}, "sample_from_anchor is true"),
        ({"projector_type": "domino"}, "projector_type 'domino'"),
        ({"shift_label": True}, "shift_label is true"),
        ({"aux_hidden_state_layer_ids": [0, 4]}, "has 0, the embeddings"),
        ({"mask_token_id": None}, "mask_token_id is missing"),
        ({"speculators_model_type": "eagle3"}, "a speculators 'eagle3' checkpoint"),
        ({"layer_types": ["full_attention"] * 2}, "readers take either"),
    ],
)
def test_what_a_speculators_checkpoint_cannot_be_exactly_is_refused(change, needle):
    with pytest.raises(ValueError, match=needle):
        speculators_as_exported(speculators_config(**change), 6, "config.json")


def test_a_speculators_checkpoint_needs_the_targets_depth(tmp_path):
    path = write_config(tmp_path / "s", speculators_config())
    with pytest.raises(ValueError, match="does not record its target's layer count"):
        read_config(path)


def test_a_speculators_last_layer_aux_id_is_the_refused_last_layer(tmp_path):
    # aux id 6 is the output of the last of 6 layers, which readers take before or after the
    # final norm: refused as any drafter reading the last layer is.
    data = speculators_config(aux_hidden_state_layer_ids=[2, 6])
    with pytest.raises(ValueError, match="last layer"):
        config_from_exported(speculators_as_exported(data, 6, "c"))


# ----------------------------------------------------------------------------- serving layout
def test_mask_and_layer_ids_at_the_top_level_are_read_as_the_reference_client_reads_them():
    data = exported_config(make_config())
    dflash_config = data.pop("dflash_config")
    data.update(dflash_config)
    assert config_from_exported(data) == make_config()
    del data["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id is missing"):
        config_from_exported(data)


def test_a_config_without_layer_types_gets_qwen3_configs_layout():
    data = exported_config(make_config())
    del data["layer_types"]
    data.update(use_sliding_window=True, sliding_window=12, max_window_layers=1)
    # transformers' Qwen3Config: layers from max_window_layers on slide.
    assert config_from_exported(data).layer_types == ["full_attention", "sliding_attention"]
    data["use_sliding_window"] = False
    assert config_from_exported(data).layer_types == ["full_attention"] * 2


def test_weights_with_a_vocabulary_mapping_or_a_missing_shard_are_refused(tmp_path):
    out = tmp_path / "mapped"
    out.mkdir()
    save_file({"fc.weight": torch.zeros(2, 2), "d2t": torch.zeros(3)}, out / "model.safetensors")
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        read_tensors(out)
    index = {"weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"shards missing: \['model-00001"):
        read_tensors(out)


# ----------------------------------------------------------------------------- --init-from
def export_config_only(tmp_path, name: str, **kw):
    """A published drafter's config.json (init-from reads the config first; no weights)."""
    return write_config(tmp_path / name, exported_config(make_config(**kw)))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(hidden_size=32), "hidden size 32 != target hidden size 64"),
        (dict(num_target_layers=12, target_layer_ids=[7, 9]), r"target layer ids \[7, 9\] out of"),
        (dict(vocab_size=300, mask_token_id=280), "mask_token_id 280 is not a row"),
        (dict(vocab_size=300), "vocab_size 300 != target vocab_size 256"),
    ],
)
def test_a_published_drafter_that_does_not_fit_the_target_is_refused(
    kw, needle, tiny_target, tmp_path
):
    source = export_config_only(tmp_path, "src", **kw)
    with pytest.raises(ValueError, match=f"--init-from {source}: .*{needle}"):
        draft_config_for(ModelOptions(target=str(tiny_target), init_from=str(source)))


def test_the_run_takes_the_published_drafters_shape_not_the_targets(tiny_target, tmp_path):
    # 8 heads of 8 where the target has 4 of 16 (as z-lab's Qwen3.6 drafters differ from theirs).
    kw = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8, block_size=8)
    source = export_config_only(tmp_path, "src", **kw)
    opts = ModelOptions(target=str(tiny_target), init_from=str(source))
    config, how = draft_config_for(opts, chat_thinking="off")
    assert config == make_config(**kw, chat_thinking="off") and "init-from" in how
    # Allowed: another block size, and DFlash 2 from DFlash 1 (its modules at the identity).
    opts = ModelOptions(target=str(tiny_target), init_from=str(source), block_size=6)
    assert draft_config_for(opts)[0].block_size == 6
    opts = ModelOptions(target=str(tiny_target), init_from=str(source), arch="dflash2")
    assert draft_config_for(opts)[0].is_dflash2


@pytest.mark.parametrize(
    ("given", "needle"),
    [
        (dict(draft_layers=3), r"--draft-layers 3 \(it: 2\)"),
        (dict(target_layer_ids=[2, 3]), r"--target-layer-ids 2,3 \(it: \[1, 3\]\)"),
        (dict(num_target_features=3), r"--num-target-features 3 \(it: 2\)"),
        (dict(mask_token_id=7), r"--mask-token-id 7 \(it: 255\)"),
        (dict(sliding_window=2048), r"--sliding-window 2048 \(it: full bidirectional"),
        (dict(causal_in_block=True), r"--causal-in-block True \(it: full bidirectional"),
    ],
)
def test_options_that_contradict_the_published_drafter_are_named(
    given, needle, tiny_target, tmp_path
):
    source = export_config_only(tmp_path, "src")
    opts = ModelOptions(target=str(tiny_target), init_from=str(source), **given)
    with pytest.raises(ValueError, match=f"contradict the drafter it holds.*{needle}"):
        draft_config_for(opts)


def test_options_that_restate_the_published_drafter_are_fine(tiny_target, tmp_path):
    source = export_config_only(
        tmp_path, "src", layer_types=["sliding_attention", "full_attention"], sliding_window=12
    )
    same = dict(draft_layers=2, target_layer_ids=[1, 3], mask_token_id=255, sliding_window=12)
    opts = ModelOptions(target=str(tiny_target), init_from=str(source), **same)
    assert draft_config_for(opts)[0].layer_types == ["sliding_attention", "full_attention"]


def test_train_refuses_a_published_drafter_of_another_target_in_one_line(
    tiny_target, tmp_path, capsys
):
    source = tmp_path / "other"
    model = DFlashDraftModel(make_config(hidden_size=32, num_attention_heads=2))
    from dflash_train.export import export_draft

    export_draft(model, source)
    data = write_random_dataset(tmp_path / "data", num_rows=4)
    argv = ["train", "--target", str(tiny_target), "--data", str(data), "--out"]
    argv += [str(tmp_path / "run"), "--init-from", str(source), "--target-devices", "cpu"]
    assert cli.main([*argv, "--drafter-devices", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "hidden size 32 != target hidden size 64" in err[0]
    assert not (tmp_path / "run").exists()
