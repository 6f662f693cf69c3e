"""Every recipe (`dflash_train/recipes.py`) runs, scaled down, on its family's tiny target from
the test zoo: a random prepared dataset, three `train` steps with `--recipe NAME` and this
test's scale-down flags (CPU devices, the hf backend, small batches), `export --target`, and the
export's config and weights checked field by field against what vLLM and SGLang read (SGLang
0.5.23's `srt/models/dflash.py` and `srt/speculative/dflash_utils.py`, vLLM's `qwen3_dflash`:
README, Correctness) and against the recipe's own values. A recipe whose values stop building,
training or exporting fails here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_train import cli
from dflash_train.model.compat import family_supported
from dflash_train.model.serving import load_exported
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.recipes import RECIPES, Recipe
from pipeline_helpers import write_random_dataset
from target_zoo import save_target

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, HIDDEN, VOCAB, MASK = 12, 64, 256, 255
"""The tiny targets: deep enough that the paper's rule gives 5 distinct ids ([1, 3, 5, 7, 9])."""

SCALE_DOWN = {
    "--target-devices": "cpu", "--drafter-devices": "cpu", "--target-backend": "hf",
    "--mask-token-id": MASK, "--num-anchors": 8, "--batch-size": 2, "--batch-cost": "blocks",
    "--max-steps": 3, "--num-prefetchers": 1, "--hs-queue-depth": 4, "--hs-min-ready": 1,
    "--cpu-threads": 1, "--log-every": 1,
}  # fmt: skip
"""What this test changes of every recipe: devices and backend (no GPU, no vLLM here), the mask
(the tiny targets have no tokenizer) and the run's size. Nothing of the drafter's shape."""
ENGINE_DEFAULTS = {"--target-tp": 1, "--target-workers": 0, "--engine-args": "none"}


def tiny_target(recipe: Recipe, path):
    """A random target of the recipe's family (`model_type`), 12 layers deep."""
    if recipe.family == "qwen3":
        return save_random_qwen3(path, num_layers=LAYERS, vocab_size=VOCAB)
    return save_target(recipe.family, path, vocab_size=VOCAB, num_hidden_layers=LAYERS)


def weight_names(config: dict) -> set[str]:
    """The names SGLang's and vLLM's loaders fill: draft weights only, unprefixed (SGLang drops
    names it does not know without a word, so they are pinned here)."""
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    if config["architectures"] == ["DFlash2DraftModel"]:
        for conv in ("attention_conv", "mlp_conv"):
            per_layer += [f"{conv}.base_kernel", f"{conv}.kernel_projection.weight"]
    names = {f"layers.{i}.{n}" for i in range(config["num_hidden_layers"]) for n in per_layer}
    names |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    if config["architectures"] == ["DFlash2DraftModel"]:
        names |= {
            "candidate_selector.hidden_projection.weight",
            "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook",
        }
    return names


def check_served_fields(recipe: Recipe, export, family: str) -> None:
    """The export as serving engines read it, and as the recipe set it."""
    values = recipe.values()
    cfg = json.loads((export / "config.json").read_text())
    dflash2 = values.get("arch") == "dflash2"
    assert cfg["architectures"] == ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"]
    assert cfg["model_type"] == "qwen3" and cfg["hidden_size"] == HIDDEN
    dc = cfg["dflash_config"]
    # block size, mask and layer ids: dflash_config first, then the top level (both written).
    assert dc["block_size"] == cfg["block_size"] == values["block_size"]
    assert dc["mask_token_id"] == MASK < cfg["vocab_size"] == VOCAB
    assert dc["target_layer_ids"] == [1, 3, 5, 7, 9]  # the rule for 12 layers, K = 5
    assert all(0 <= i <= LAYERS - 2 for i in dc["target_layer_ids"])  # no capture of the last
    assert cfg["num_target_layers"] == LAYERS
    # The attention layout, at the top level: the recipe's window, the top layer(s) full.
    n = values["draft_layers"]
    assert cfg["num_hidden_layers"] == n == len(cfg["layer_types"])
    n_full = values.get("full_attention_layers", 1)  # --sliding-window alone: the top one full
    assert cfg["layer_types"] == ["sliding_attention"] * (n - n_full) + ["full_attention"] * n_full
    assert cfg["use_sliding_window"] is True and cfg["sliding_window"] == values["sliding_window"]
    # DFlash 2: bidirectional, said; DFlash 1 mixed: null, the per-layer rule (sliding causal).
    assert "is_causal" in cfg and cfg["is_causal"] is (False if dflash2 else None)
    # RoPE in both forms (SGLang: rope_parameters, else rope_theta / rope_scaling).
    assert "rope_theta" in cfg["rope_parameters"] and cfg["rope_theta"] > 0
    assert cfg["max_position_embeddings"] >= 4096
    if dflash2:  # in dflash_config only, each pair together
        sizes = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        assert {k: dc[k] for k in sizes} == {k: values[k] for k in sizes}
    if family.startswith("gemma"):  # the target embeds at sqrt(hidden): readers must too
        assert dc["input_embedding_scale"] == HIDDEN**0.5
    with safe_open(export / "model.safetensors", "pt") as f:
        assert set(f.keys()) == weight_names(cfg)
        assert f.get_tensor("fc.weight").shape == (HIDDEN, 5 * HIDDEN)
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())  # noqa: SIM118
    load_exported(export)  # and this project's reader (the reference client's layout) takes it


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_trains_scaled_down_and_exports_what_engines_read(name, tmp_path):
    recipe = RECIPES[name]
    if not family_supported(recipe.family):  # refused in one line (tests/unit/model)
        pytest.skip(f"a {recipe.family!r} target needs a newer transformers than installed")
    target = tiny_target(recipe, tmp_path / "target")
    data = write_random_dataset(tmp_path / "data", num_rows=16, min_len=24, max_len=64)
    run, export = tmp_path / "run", tmp_path / "export"
    flags = {"--target": target, "--data": data, "--out": run, **SCALE_DOWN}
    if recipe.values().get("target_backend") == "vllm":
        flags |= ENGINE_DEFAULTS  # the hf backend stands in for the engine here
    argv = ["train", "--recipe", name, *(str(x) for kv in flags.items() for x in kv)]
    assert cli.main([*argv, "--no-progress"]) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["run"]["recipe"] == name  # the name, beside every resolved value
    resolved = {k: v for section in saved.values() for k, v in section.items()}
    kept = {k: v for k, v in recipe.values().items() if "--" + k.replace("_", "-") not in flags}
    assert {k: resolved[k] for k in kept} == kept
    assert cli.main(["export", str(run), "--out", str(export), "--target", str(target)]) == 0
    check_served_fields(recipe, export, recipe.family)
