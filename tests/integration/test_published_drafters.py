"""Fine-tuning a published drafter: `--init-from` reads the layouts drafters are published in and
the drafter it starts from drafts exactly what the published one does.

A drafter is fitted to the tiny target for a few CPU-seconds (the reference-client test's
fitting: it then accepts a spread of lengths), and written in each layout as it is published:
- z-lab's `DFlashDraftModel` checkpoint as transformers 4.57 wrote it (`rope_theta` /
  `rope_scaling` only, `block_size` at the top level only, `dflash_config` without it, an
  `auto_map`, no `is_causal`), and the variants the reference client also loads: weights under a
  `model.` prefix in two shards with an index, `mask_token_id` / `target_layer_ids` at the top
  level only;
- a DFlash 2 checkpoint (`DFlash2DraftModel`, `dflash_config` with its sizes), of a fitted
  DFlash 2 drafter with the published layout (every layer sliding, bidirectional);
- vLLM speculators' layout: `speculators_model_type` "dflash", the decoder's fields in
  `transformer_layer_config` as a difference from Qwen3Config's defaults, vLLM's aux-layer
  numbering (DFlash id + 1), the verifier's embedding and head copied beside the draft weights.
Each is read the way a run reads it (`draft_config_for` with `init_from`, the drafter built from
that config and seeded, then `init_from_draft`), and decodes with this project's loop exactly as
the published drafter (the fitted one at the published bf16 weights): the same tokens, the same
acceptance lengths and the same draft tokens, cycle by cycle. The reference client loads the
z-lab layouts itself and accepts the same lengths (its parity, by layout)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dflash_train.config import ModelOptions
from dflash_train.model.checkpoint import init_from_draft
from dflash_train.model.draft import DFLASH2_DEFAULTS, DFlashConfig, DFlashDraftModel
from dflash_train.model.target import FrozenHead
from dflash_train.speculative import _Loop, speculative_generate
from dflash_train.train.setup import draft_config_for
from integration.test_reference_client import (
    BLOCK,
    check_parity,
    fit_drafter,
    random_prompts,
)

dflash = pytest.importorskip("dflash", reason="install with pip install --no-deps dflash==0.1.0")
pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]

ATTENTION = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 12}
"""The fitted drafter's layout: a sliding layer under a full one (the window within reach)."""


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def continuations(tiny_continuations):
    return tiny_continuations


def at_bf16(model: DFlashDraftModel) -> DFlashDraftModel:
    """`model` at bf16 weights, as a published checkpoint holds it (computing in fp32)."""
    out = DFlashDraftModel(model.config)
    state = {k: v.bfloat16().float() for k, v in model.trainable_state_dict().items()}
    out.load_state_dict(state, strict=False)
    return out.eval()


@pytest.fixture(scope="module")
def fitted(target, continuations):
    """The published DFlash 1 drafter."""
    return at_bf16(fit_drafter(target, continuations, steps=200, **ATTENTION))


@pytest.fixture(scope="module")
def fitted_dflash2(target, continuations):
    """The published DFlash 2 drafter (every layer sliding and bidirectional, as published)."""
    layout = {"layer_types": ["sliding_attention"] * 2, "sliding_window": 12, "is_causal": False}
    objective = {"arch": "dflash2"}
    return at_bf16(fit_drafter(target, continuations, steps=120, objective=objective, **layout))


# ----------------------------------------------------------------------------- the layouts
def bf16(model: DFlashDraftModel, prefix: str = "") -> dict[str, torch.Tensor]:
    return {prefix + k: v.bfloat16() for k, v in model.trainable_state_dict().items()}


def qwen3_fields(c: DFlashConfig) -> dict:
    """The decoder's fields as a transformers Qwen3Config names them."""
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "layer_types": list(c.layer_types),
        "use_sliding_window": c.sliding_window is not None,
        "sliding_window": c.sliding_window,
    }


def write_zlab(model: DFlashDraftModel, out, *, variant: str = "plain"):
    """z-lab's published layout (DFlash 1 as transformers 4.57 saved it; DFlash 2 with its
    `dflash_config` sizes)."""
    c = model.config
    out.mkdir(parents=True)
    dflash_config = {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids}
    config = {
        "architectures": ["DFlash2DraftModel" if c.is_dflash2 else "DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        **qwen3_fields(c),
        "max_window_layers": c.num_hidden_layers,
        "rope_theta": c.rope_parameters["rope_theta"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": dflash_config,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }
    if c.is_dflash2:
        dflash_config.update({k: getattr(c, k) for k in DFLASH2_DEFAULTS})
        dflash_config["block_size"] = c.block_size
        config["is_causal"] = c.is_causal
    if variant == "top_level":  # what the reference client reads when dflash_config lacks it
        config.update(dflash_config)
        config["dflash_config"] = {}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = bf16(model, "model." if variant == "sharded" else "")
    if variant != "sharded":
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out
    names = sorted(tensors)
    half = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, keys in half.items():
        save_file({k: tensors[k] for k in keys}, out / file, metadata={"format": "pt"})
    weight_map = {k: file for file, keys in half.items() for k in keys}
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def write_speculators(model: DFlashDraftModel, target, out):
    """vLLM speculators' DFlash layout (its DFlashSpeculatorConfig as saved)."""
    from transformers import Qwen3Config

    c = model.config
    out.mkdir(parents=True)
    full = Qwen3Config(
        **qwen3_fields(c), rope_parameters=dict(c.rope_parameters), tie_word_embeddings=False
    ).to_dict()
    # Its serializer writes `to_diff_dict()`: under transformers 4.x the fields that differ from
    # Qwen3Config's defaults (5.x writes them all), so a reader must restore the rest.
    defaults = Qwen3Config().to_dict()
    decoder = {k: v for k, v in full.items() if k == "model_type" or defaults.get(k) != v}
    config = {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashDraftModel"],
        "transformer_layer_config": decoder,
        "draft_vocab_size": c.vocab_size,
        "block_size": c.block_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}],
            "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tensors = bf16(model)
    tensors["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().bfloat16()
    tensors["lm_head.weight"] = target.get_output_embeddings().weight.detach().bfloat16()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------- the checks
def as_a_run_reads_it(tiny_target, path) -> DFlashDraftModel:
    """The drafter a run starting `--init-from path` trains from, before its first step."""
    config, _ = draft_config_for(ModelOptions(target=str(tiny_target), init_from=str(path)))
    model = DFlashDraftModel(config)
    model.init_weights(seed=7)  # what init_from_draft must overwrite, all of it
    init_from_draft(model, path)
    return model.eval()


def decode(model, target, prompts, monkeypatch):
    """Each prompt's tokens and acceptance lengths, and every cycle's draft tokens."""
    drafts = []
    for name in ("_propose", "_propose_path"):
        real = getattr(_Loop, name)

        def record(self, *args, _real=real):
            tokens, q = _real(self, *args)
            drafts.append(tokens.tolist())
            return tokens, q

        monkeypatch.setattr(_Loop, name, record)
    head = FrozenHead.of_model(target)
    runs = [
        speculative_generate(model, target, head, ids, max_new_tokens=40, block_size=BLOCK)
        for ids in prompts
    ]
    monkeypatch.undo()
    return [(r.tokens, r.acceptance_lengths) for r in runs], drafts


PROMPTS = random_prompts(4, seed=100)[:4] + random_prompts(2, seed=7)
"""Four prompts the drafter was fitted on, two it has never seen."""


def check_drafts_as_published(published, loaded, target, monkeypatch):
    assert loaded.config.to_dict() == {**published.config.to_dict(), "chat_thinking": None}
    want, want_drafts = decode(published, target, PROMPTS, monkeypatch)
    got, got_drafts = decode(loaded, target, PROMPTS, monkeypatch)
    assert got == want
    assert got_drafts == want_drafts and len(want_drafts) > 10
    lengths = [n for _, per_prompt in want for n in per_prompt]
    assert max(lengths) > 1  # a trained drafter: blocks accepted in part, caches cropped


@pytest.mark.parametrize("variant", ["plain", "sharded", "top_level"])
def test_a_zlab_drafter_is_fine_tuned_from_exactly(
    variant, fitted, target, tiny_target, tmp_path, monkeypatch
):
    path = write_zlab(fitted, tmp_path / "zlab", variant=variant)
    loaded = as_a_run_reads_it(tiny_target, path)
    check_drafts_as_published(fitted, loaded, target, monkeypatch)
    # The reference client reads this layout by itself, and drafts as the loaded drafter does.
    theirs = dflash.DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    check_parity(loaded, theirs, target, PROMPTS[:3], monkeypatch)


def test_a_dflash2_drafter_is_fine_tuned_from_exactly(
    fitted_dflash2, target, tiny_target, tmp_path, monkeypatch
):
    path = write_zlab(fitted_dflash2, tmp_path / "zlab2")
    loaded = as_a_run_reads_it(tiny_target, path)
    assert loaded.config.is_dflash2
    check_drafts_as_published(fitted_dflash2, loaded, target, monkeypatch)


def test_a_speculators_drafter_is_fine_tuned_from_exactly(
    fitted, target, tiny_target, tmp_path, monkeypatch
):
    path = write_speculators(fitted, target, tmp_path / "speculators")
    config = json.loads((path / "config.json").read_text())
    # Fields at Qwen3Config's defaults are left out: the reader must restore them.
    assert not {"rms_norm_eps", "hidden_act"} & set(config["transformer_layer_config"])
    loaded = as_a_run_reads_it(tiny_target, path)
    check_drafts_as_published(fitted, loaded, target, monkeypatch)
