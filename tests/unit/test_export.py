"""Export: the serving-engine layout, exact round trips, and drafters that do not fit a target."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_train import cli
from dflash_train.export import export_draft
from dflash_train.model.checkpoint import load_draft, save_draft
from dflash_train.model.compat import family_supported
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel, DraftCache
from dflash_train.model.serving import config_from_exported, exported_config, load_exported
from dflash_train.model.target import check_draft_fits_target

pytestmark = pytest.mark.usefixtures("one_thread")

H, K, LAYERS = 32, 2, 2


def make_config(**kw) -> DFlashConfig:
    base = dict(
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=96,
        num_target_layers=6,
        target_layer_ids=[1, 3],
        mask_token_id=95,
        block_size=5,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 12345.0},
        max_position_embeddings=2048,
    )
    base.update(kw)
    return DFlashConfig(**base)


@pytest.fixture
def model() -> DFlashDraftModel:
    torch.manual_seed(0)
    m = DFlashDraftModel(make_config())
    with torch.no_grad():  # non-trivial norms, so a swapped norm weight would show
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return m.eval()


def draft_logits(model: DFlashDraftModel, seed: int = 0) -> torch.Tensor:
    """Logits of one cached block after 7 context positions, through a random frozen head."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, 7, K * H, generator=gen)
    embeds = torch.randn(1, 5, H, generator=gen)
    head = torch.randn(96, H, generator=gen)
    with torch.no_grad():
        hidden = model.forward_cached(embeds, feats, 7, DraftCache(LAYERS))
    return hidden @ head.T


def test_exported_config_has_every_field_serving_engines_read(model, tmp_path):
    export_draft(model, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3"
    expected = {
        "hidden_size": H,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "vocab_size": 96,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "block_size": 5,
        "num_target_layers": 6,
        "dtype": "bfloat16",
        "rope_theta": 12345.0,
        "rope_scaling": None,
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 12345.0}
    assert cfg["layer_types"] == ["full_attention"] * LAYERS
    assert cfg["dflash_config"] == {
        "mask_token_id": 95,
        "target_layer_ids": [1, 3],
        "block_size": 5,
    }


def test_exported_weights_are_draft_only_unprefixed_bf16(model, tmp_path):
    export_draft(model, tmp_path / "out")
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        tensors = {k: f.get_tensor(k) for k in keys}
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    expected = {f"layers.{i}.{n}" for i in range(LAYERS) for n in per_layer}
    expected |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert keys == expected  # no model. prefix, no embedding, no lm_head, no rotary buffer
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert tensors["fc.weight"].shape == (H, K * H)


def test_fp32_round_trip_restores_every_tensor_and_logit_exactly(model, tmp_path):
    export_draft(model, tmp_path / "out", dtype=torch.float32)
    loaded = load_exported(tmp_path / "out")
    assert loaded.config == model.config
    mine, theirs = model.trainable_state_dict(), loaded.trainable_state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
    assert torch.equal(draft_logits(loaded), draft_logits(model))


def test_bf16_round_trip_matches_the_in_memory_model(model, tmp_path):
    export_draft(model, tmp_path / "out")
    loaded = load_exported(tmp_path / "out")
    # Exactly the in-memory model with its weights rounded to bf16 ...
    rounded = DFlashDraftModel(model.config).eval()
    rounded.load_state_dict(
        {k: v.bfloat16().float() for k, v in model.trainable_state_dict().items()}, strict=False
    )
    assert torch.equal(draft_logits(loaded), draft_logits(rounded))
    # ... and within bf16 rounding of the fp32 original.
    ref = draft_logits(model)
    torch.testing.assert_close(draft_logits(loaded), ref, rtol=0, atol=0.03 * ref.abs().max())


def test_exported_files_are_readable_as_the_umask_allows(model, tmp_path):
    """Regression: safetensors' save_file (0.8) made model.safetensors owner-only (0600) while
    config.json followed the umask: an engine running as another user (a container's uid)
    could not read the weights it was given."""
    import os

    old = os.umask(0o022)
    try:
        export_draft(model, tmp_path / "out")
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "out" / name).stat().st_mode & 0o777 == 0o644, name


def test_export_from_a_run_directory_equals_export_from_memory(model, tmp_path):
    save_draft(tmp_path / "run" / "checkpoint", model)
    export_draft(tmp_path / "run", tmp_path / "a", dtype=torch.float32)
    export_draft(model, tmp_path / "b", dtype=torch.float32)
    assert (tmp_path / "a" / "config.json").read_text() == (
        tmp_path / "b" / "config.json"
    ).read_text()
    a, b = load_exported(tmp_path / "a"), load_exported(tmp_path / "b")
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])


def test_export_refuses_to_overwrite_a_training_checkpoint(model, tmp_path):
    save_draft(tmp_path / "ckpt", model)
    with pytest.raises(ValueError, match="training checkpoint"):
        export_draft(model, tmp_path / "ckpt")


def test_export_replaces_only_an_earlier_export(model, tmp_path):
    """Regression: `--out` given the target's directory (or any non-empty one) replaced its
    config.json and model.safetensors with the drafter's: the model was lost."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (target / "model.safetensors").write_bytes(b"the target's weights")
    with pytest.raises(ValueError, match="not empty and holds no exported drafter"):
        export_draft(model, target)
    assert (target / "model.safetensors").read_bytes() == b"the target's weights"
    export_draft(model, tmp_path / "new")  # new, empty, or an earlier export: written
    (tmp_path / "empty").mkdir()
    export_draft(model, tmp_path / "empty")
    export_draft(model, tmp_path / "new")


def test_load_draft_accepts_exports_checkpoints_and_run_directories(model, tmp_path):
    save_draft(tmp_path / "run" / "checkpoint", model)
    export_draft(model, tmp_path / "exp", dtype=torch.float32)
    ref = draft_logits(model)
    for path in (tmp_path / "exp", tmp_path / "run", tmp_path / "run" / "checkpoint"):
        assert torch.equal(draft_logits(load_draft(path)), ref)


def test_load_draft_names_a_missing_or_foreign_directory(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_draft(tmp_path / "nope")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="neither an exported drafter"):
        load_draft(tmp_path / "other")


def test_weights_that_do_not_fit_the_config_are_refused(model, tmp_path):
    export_draft(model, tmp_path / "out")
    cfg_path = tmp_path / "out" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"], cfg["layer_types"] = 3, ["full_attention"] * 3
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing \['layers\.2"):
        load_exported(tmp_path / "out")


def test_a_config_without_required_fields_is_named(model):
    data = exported_config(model.config)
    del data["num_target_layers"]
    with pytest.raises(ValueError, match=r"missing \['num_target_layers'\]"):
        config_from_exported(data)
    data = exported_config(model.config)
    del data["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id is missing"):
        config_from_exported(data)


def test_scaled_rope_is_written_in_both_forms_and_read_back(tmp_path):
    rope = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    config = make_config(rope_parameters=rope)
    data = exported_config(config)
    assert data["rope_theta"] == 1e6
    assert data["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert config_from_exported(data).rope_parameters == rope
    # A 4.x-style config (no rope_parameters, `type` instead of `rope_type`) reads the same.
    legacy = {k: v for k, v in data.items() if k != "rope_parameters"}
    legacy["rope_scaling"] = {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
    }
    assert config_from_exported(legacy).rope_parameters == rope


def test_a_drafter_trained_with_yarn_magnitude_fields_keeps_them_and_its_export_says_so(tmp_path):
    # A checkpoint from before new drafters left DeepSeek's mscale pair out trained with an
    # attention factor of 1.0: it keeps that, and its export names what some engines read else.
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "beta_fast": 32,
            "beta_slow": 1, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0}  # fmt: skip
    model = DFlashDraftModel(make_config(rope_parameters=rope, max_position_embeddings=163840))
    assert model.rotary.attention_scaling == 1.0
    with pytest.warns(UserWarning, match=r"mscale.*1\.0000 in training.*1\.3689 instead"):
        export_draft(model, tmp_path / "out", dtype=torch.float32)
    assert load_exported(tmp_path / "out").config.rope_parameters == rope


def test_a_drafter_without_yarn_magnitude_fields_exports_silently(model, tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export_draft(model, tmp_path / "out")


def test_a_drafter_with_a_repeated_layer_id_exports_with_a_warning_naming_the_engines(tmp_path):
    # The paper's rule on a test-sized target: the reference client serves it, vLLM and SGLang
    # (each layer gathered once) cannot.
    model = DFlashDraftModel(make_config(target_layer_ids=[1, 1, 3]))
    with pytest.warns(UserWarning, match=r"repeat \[1\].*vLLM and SGLang.*cannot serve"):
        export_draft(model, tmp_path / "out", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"\[3, 1\] must be ascending"):
        make_config(target_layer_ids=[3, 1])


def test_a_dflash1_drafter_with_a_scaled_embedding_exports_with_a_warning_naming_vllm(tmp_path):
    # vLLM 0.32's qwen3_dflash embeds without the scale; its DFlash 2 model applies it.
    model = DFlashDraftModel(make_config(input_embedding_scale=8.0))
    with pytest.warns(UserWarning, match=r"scaled by 8 .*vLLM 0\.32's DFlash 1 model does not"):
        export_draft(model, tmp_path / "out", dtype=torch.float32)
    assert load_exported(tmp_path / "out").config.input_embedding_scale == 8.0


def test_exported_config_reads_as_a_transformers_qwen3_config(model, tmp_path):
    from transformers import AutoConfig

    export_draft(model, tmp_path / "out")
    cfg = AutoConfig.from_pretrained(tmp_path / "out")
    assert cfg.model_type == "qwen3"
    assert cfg.rope_parameters["rope_theta"] == 12345.0
    assert cfg.dflash_config["mask_token_id"] == 95


def target_config(**kw) -> SimpleNamespace:
    base = dict(hidden_size=H, num_hidden_layers=6, vocab_size=96)
    base.update(kw)
    return SimpleNamespace(**base)


@pytest.mark.parametrize(
    ("target_kw", "needle"),
    [
        ({"hidden_size": 64}, "hidden size 32 != target hidden size 64"),
        ({"num_hidden_layers": 3}, r"target layer ids \[3\] out of range"),
        ({"num_hidden_layers": 8}, "trained for a target with 6 layers, this target has 8"),
        ({"vocab_size": 90}, "mask_token_id 95 is not a row"),
        ({"vocab_size": 128}, "vocab_size 96 != target vocab_size 128"),
    ],
)
def test_a_drafter_that_does_not_fit_the_target_is_named(target_kw, needle):
    with pytest.raises(ValueError, match=needle):
        check_draft_fits_target(make_config(), target_config(**target_kw))


def test_a_fitting_drafter_passes_the_check():
    check_draft_fits_target(make_config(), target_config())


def test_export_with_a_target_checks_the_fit_first(model, tiny_target, tmp_path):
    with pytest.raises(ValueError, match="does not fit the target"):
        export_draft(model, tmp_path / "out", target_dir=tiny_target)
    assert not (tmp_path / "out").exists()


def test_export_command_writes_the_layout(model, tmp_path, capsys):
    save_draft(tmp_path / "run" / "checkpoint", model)
    assert cli.main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert "exported drafter" in capsys.readouterr().out
    assert load_exported(tmp_path / "out").config == model.config


def test_export_command_names_a_missing_checkpoint(tmp_path, capsys):
    code = cli.main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- RoPE = served RoPE
def save_qwen3_next_config(path):
    """A tiny Qwen3-Next-shaped target (config only: the drafter's config reads nothing else).
    Like Qwen3-Next / Qwen3-Coder-Next it rotates a quarter of each head (partial_rotary_factor)."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=256,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=2,
        architectures=["Qwen3NextForCausalLM"],
    )
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    cfg.save_pretrained(path)
    return path


def served_rotary_dim(exported: dict) -> int:
    """The dimensions vLLM's `get_rope` rotates for an exported drafter config."""
    factor = (exported.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    return int(exported["head_dim"] * factor)


@pytest.mark.skipif(
    not family_supported("qwen3_next"), reason="transformers too old for qwen3_next targets"
)
def test_a_partial_rotary_target_gives_a_drafter_that_is_served_as_it_was_trained(tmp_path):
    from dflash_train.model.target import draft_config_from_target, load_target_config

    target = save_qwen3_next_config(tmp_path / "qwen3_next")
    config = draft_config_from_target(load_target_config(target), 2, 4, 255, num_features=2)
    assert "partial_rotary_factor" not in config.rope_parameters
    model = DFlashDraftModel(config)
    trained_dims = 2 * model.rotary.inv_freq.numel()  # what training rotates
    assert trained_dims == config.head_dim == 32
    export_draft(model, tmp_path / "out")
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert served_rotary_dim(exported) == trained_dims
    assert exported["rope_scaling"] is None
    # The 4.x spelling and the transformers 5 one agree, and both carry nothing that rotates less.
    assert exported["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_mrope_fields_and_older_checkpoints_that_copied_the_factor_rotate_fully():
    old = make_config(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
    ).to_dict()
    config = DFlashConfig.from_dict(old)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    assert served_rotary_dim(exported_config(config)) == 8 == config.head_dim


def test_importing_a_config_that_declares_partial_rotation_warns(model):
    data = exported_config(model.config)
    data["rope_parameters"] = {**data["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.warns(UserWarning, match="partial_rotary_factor"):
        config = config_from_exported(data)
    assert "partial_rotary_factor" not in config.rope_parameters


# ----------------------------------------------------------------------------- sliding windows
OFFICIAL_LAYOUT = dict(
    layer_types=["sliding_attention", "full_attention"], sliding_window=2048, is_causal=None
)


def test_a_sliding_window_drafter_exports_its_layout_explicitly(tmp_path):
    torch.manual_seed(0)
    model = DFlashDraftModel(make_config(**OFFICIAL_LAYOUT)).eval()
    export_draft(model, tmp_path / "out", dtype=torch.float32)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == 2048
    assert cfg["max_window_layers"] == LAYERS
    assert "is_causal" in cfg and cfg["is_causal"] is None  # mixed: the per-layer default rule
    loaded = load_exported(tmp_path / "out")
    assert loaded.config == model.config
    assert torch.equal(draft_logits(loaded), draft_logits(model))
    # transformers' Qwen3Config keeps the window only with use_sliding_window: check it does.
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path / "out")
    assert hf.sliding_window == 2048 and hf.layer_types == cfg["layer_types"]
    assert getattr(hf, "is_causal", None) is None


@pytest.mark.parametrize(
    ("layout", "written"),
    [
        ({}, False),  # all full: bidirectional, said explicitly
        (dict(layer_types=["sliding_attention"] * 2, sliding_window=8), True),
        (dict(OFFICIAL_LAYOUT, is_causal=False), False),
        (dict(OFFICIAL_LAYOUT, is_causal=True), True),
    ],
)
def test_is_causal_is_written_as_readers_take_it_and_read_back(layout, written):
    config = make_config(**layout)
    data = exported_config(config)
    assert data["is_causal"] is written
    assert config_from_exported(data) == config


def test_an_official_all_sliding_bidirectional_config_imports():
    # The layout of published DFlash configs for Qwen3.5-class targets (window 2048,
    # is_causal false, max_window_layers = layers).
    data = exported_config(make_config())
    data.update(
        layer_types=["sliding_attention"] * LAYERS,
        use_sliding_window=True,
        sliding_window=2048,
        max_window_layers=LAYERS,
        is_causal=False,
    )
    config = config_from_exported(data)
    assert [config.layer_window(i) for i in range(LAYERS)] == [2048] * LAYERS
    assert [config.layer_causal(i) for i in range(LAYERS)] == [False] * LAYERS


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"use_sliding_window": False}, "readers disagree"),
        ({"sliding_window": None}, "readers disagree"),
        ({"layer_types": ["linear_attention", "full_attention"]}, "unsupported draft layer"),
        ({"dflash_config": {"mask_token_id": 95, "causal": True}}, "vLLM reads"),
    ],
)
def test_layouts_that_readers_disagree_on_are_refused(change, needle):
    data = {**exported_config(make_config(**OFFICIAL_LAYOUT)), **change}
    with pytest.raises(ValueError, match=needle):
        config_from_exported(data)


def test_the_training_chat_mode_travels_with_the_export():
    config = make_config(chat_thinking="off")
    data = exported_config(config)
    assert data["dflash_train"] == {"chat_thinking": "off"}  # engines ignore this key
    assert config_from_exported(data) == config
    assert "dflash_train" not in exported_config(make_config())  # unknown: nothing written
    with pytest.raises(ValueError, match="chat_thinking"):
        make_config(chat_thinking="maybe")


# ----------------------------------------------------------------------------- DFlash 2
DFLASH2_SIZES = {
    "arch": "dflash2",
    "conv_kernel_size": 2,
    "conv_group_size": 8,
    "selector_rank": 12,
    "selector_top_k": 5,
}


@pytest.fixture
def dflash2_model() -> DFlashDraftModel:
    torch.manual_seed(1)
    m = DFlashDraftModel(make_config(**DFLASH2_SIZES))
    with torch.no_grad():  # off the identity, so a lost or swapped module weight would show
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def test_a_dflash2_export_follows_its_checkpoint_contract(dflash2_model, tmp_path):
    export_draft(dflash2_model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    assert config["is_causal"] is False  # written, not left to readers' sliding-layer default
    sizes = {k: v for k, v in DFLASH2_SIZES.items() if k != "arch"}
    assert {k: config["dflash_config"][k] for k in sizes} == sizes
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for i in range(LAYERS):
        for conv in ("attention_conv", "mlp_conv"):
            assert {
                f"layers.{i}.{conv}.base_kernel",
                f"layers.{i}.{conv}.kernel_projection.weight",
            } <= keys
    selector = {k for k in keys if k.startswith("candidate_selector.")}
    assert selector == {
        "candidate_selector.hidden_projection.weight",
        "candidate_selector.predecessor_codebook",  # no .weight suffix: the contract's names
        "candidate_selector.successor_codebook",
    }
    assert not any("embed" in k or "lm_head" in k for k in keys)


def test_a_dflash2_fp32_round_trip_is_exact_and_dflash1_exports_stay_dflash1(
    dflash2_model, model, tmp_path
):
    export_draft(dflash2_model, tmp_path / "two", dtype=torch.float32)
    loaded = load_draft(tmp_path / "two")
    assert loaded.config == dflash2_model.config
    mine, theirs = dflash2_model.trainable_state_dict(), loaded.trainable_state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert torch.equal(draft_logits(loaded), draft_logits(dflash2_model))
    export_draft(model, tmp_path / "one")
    config = json.loads((tmp_path / "one" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert not any(k in config["dflash_config"] for k in DFLASH2_SIZES)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"output_multiplier": 2.0}, "are not supported"),
        ({"final_logit_softcapping": 30.0}, "are not supported"),
        ({"selector_top_k": None}, "a DFlash2DraftModel needs dflash_config"),
    ],
)
def test_dflash2_configs_this_project_cannot_serve_as_trained_are_refused(
    dflash2_model, change, needle
):
    data = exported_config(dflash2_model.config)
    data["dflash_config"].update(change)
    with pytest.raises(ValueError, match=needle):
        config_from_exported(data)


def test_codebooks_written_with_a_weight_suffix_are_read_too(dflash2_model, tmp_path):
    # Some writers keep nn.Embedding's names; the reference client maps both spellings.
    export_draft(dflash2_model, tmp_path / "out", dtype=torch.float32)
    path = tmp_path / "out" / "model.safetensors"
    state = load_file(path)
    for name in ("predecessor_codebook", "successor_codebook"):
        state[f"candidate_selector.{name}.weight"] = state.pop(f"candidate_selector.{name}")
    save_file(state, path)
    loaded = load_exported(tmp_path / "out")
    assert torch.equal(
        loaded.candidate_selector.successor_codebook,
        dflash2_model.candidate_selector.successor_codebook,
    )
