"""Every target family users bring, on a tiny random target of each (`tests/target_zoo.py`):
loading (only the language model of a multimodal checkpoint), features, the embedding and
head, the drafter's config, and the speculative loop's output against plain greedy decoding
with partly accepted blocks (every cache kind: KV, MLA latents, sliding windows, recurrent
linear-attention states). The end-to-end runs (prepare -> train -> export -> eval, and the
reference client) are in tests/integration/test_target_zoo_e2e.py (slow)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.families import input_embedding_scale, read_target_layout
from dflash_train.model.serving import config_from_exported, exported_config
from dflash_train.model.target import (
    TEACHER_INPUT_ID,
    TargetFeatureExtractor,
    TargetLoadError,
    draft_config_from_target,
    load_causal_lm,
    load_frozen_head,
    load_target_config,
    soft_cap,
)
from dflash_train.speculative import _Loop, speculative_generate
from target_zoo import HYBRID, REFUSED, SUPPORTED, WRAPPERS, Zoo, save_refused

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    return Zoo(tmp_path_factory.mktemp("zoo"))


def reference_hidden_states(path, ids):
    """transformers' own hidden states for `ids` (a wrapper: the whole multimodal model)."""
    cfg = read_target_layout(path)
    if cfg.wrapper:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    return out.hidden_states, out.logits


@pytest.mark.parametrize("family", SUPPORTED)
def test_features_are_the_wrappers_own_hidden_states_and_no_vision_tower_is_built(zoo, family):
    path = zoo[family]
    ids = torch.randint(3, 250, (2, 13), generator=torch.Generator().manual_seed(1))
    hidden, logits = reference_hidden_states(path, ids)
    ex = TargetFeatureExtractor(path, [0, 2, 4], CPU, torch.float32)
    want = torch.cat([hidden[i + 1] for i in (0, 2, 4)], -1)
    torch.testing.assert_close(ex(ids), want, atol=1e-4, rtol=1e-4)
    model = load_causal_lm(path, CPU, torch.float32)
    names = list(model.state_dict())
    assert not any(("vision" in n or "visual" in n or "multi_modal" in n) for n in names)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_frozen_head_embeds_as_the_target_does(zoo, family):
    path = zoo[family]
    head = load_frozen_head(path)
    model = load_causal_lm(path, CPU, torch.float32)
    ids = torch.tensor([[5, 17, 42]])
    seen = []
    model.get_decoder().layers[0].register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True,
    )
    with torch.no_grad():
        model(ids)
    # What the target's first layer receives is what the drafter's block embedding is.
    torch.testing.assert_close(head.embed_tokens(ids), seen[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.head, model.get_output_embeddings().weight)
    gemma = family.startswith("gemma")
    assert head.embed_scale == (math.sqrt(64) if gemma else 1.0)


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_drafter_config_is_read_from_the_text_config_and_round_trips_the_export(zoo, family):
    layout = read_target_layout(zoo[family])
    assert (layout.wrapper is not None) == (family in WRAPPERS)
    text = load_target_config(zoo[family])
    assert (text.hidden_size, text.num_hidden_layers) == (64, 6)
    scale = input_embedding_scale(layout)
    config = draft_config_from_target(text, 2, 8, 250, num_features=3, input_embedding_scale=scale)
    assert config.hidden_act == "silu" and config.hidden_size == 64
    # One flat RoPE of the drafter's own, rotating every dimension at 1-D positions.
    assert not {"partial_rotary_factor", "mrope_section"} & set(config.rope_parameters)
    assert isinstance(config.rope_parameters["rope_theta"], float)
    back = config_from_exported(exported_config(config))
    assert back.to_dict() == config.to_dict()
    DFlashDraftModel(config)  # builds (RoPE tables, shapes)


def needs(*families: str):
    """Skip a test of `families` where the installed transformers refuses one of them (that
    refusal is tested below)."""
    missing = [f for f in families if f not in SUPPORTED]
    return pytest.mark.skipif(bool(missing), reason=f"transformers too old for {missing}")


@needs("gemma3", "qwen3_5_moe")
def test_family_specific_choices_of_the_drafter_shape(zoo):
    # Gemma 3: the full-attention layers' RoPE, the scaled embedding exported for readers.
    gemma = read_target_layout(zoo["gemma3"])
    cfg = draft_config_from_target(
        gemma.text, 1, 8, 250, num_features=2, input_embedding_scale=input_embedding_scale(gemma)
    )
    assert (
        cfg.rope_parameters["rope_theta"]
        == gemma.text.rope_parameters["full_attention"]["rope_theta"]
    )
    assert exported_config(cfg)["dflash_config"]["input_embedding_scale"] == 8.0
    # MLA: heads at v_head_dim (the config's head_dim is the rotary part), one kv per query head.
    mla = draft_config_from_target(load_target_config(zoo["deepseek_v3"]), 1, 8, 250)
    assert (mla.num_attention_heads, mla.num_key_value_heads, mla.head_dim) == (4, 4, 16)
    # Qwen3.5 MoE has expert sizes only: 3 x hidden, the dense ratio.
    moe = draft_config_from_target(load_target_config(zoo["qwen3_5_moe"]), 1, 8, 250)
    assert moe.intermediate_size == 192


def greedy_reference(model, prompt, n):
    """Plain greedy decoding without any cache: every step re-runs the whole sequence."""
    ids = prompt.clone()
    out = []
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(ids[None], use_cache=False).logits[0, -1].argmax())
            out.append(tok)
            ids = torch.cat([ids, torch.tensor([tok])])
    return out


def scripted_drafts(monkeypatch, reference, prompt_len, seed):
    """Replace the drafter with one that drafts the true continuation up to a random point and
    a wrong token after it, so blocks are accepted in part, in full and not at all."""
    rng = torch.Generator().manual_seed(seed)
    cuts = []

    def draft(self, anchor, start, size):
        done = start - prompt_len + 1  # tokens emitted so far (the anchor is the last)
        vocab = self.head.head.shape[0]
        truth = reference[done : done + size - 1]
        truth = truth + [0] * (size - 1 - len(truth))
        cut = int(torch.randint(0, size, (1,), generator=rng))
        tokens = [t if k < cut else (t + 1) % vocab for k, t in enumerate(truth)]
        cuts.append(cut)
        self.features = None
        logits = torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()
        return torch.zeros(size - 1, self.draft.config.hidden_size), logits

    monkeypatch.setattr(_Loop, "_draft", draft)
    return cuts


@pytest.mark.parametrize("family", SUPPORTED)
def test_speculative_output_is_plain_greedy_with_partly_accepted_blocks(zoo, family, monkeypatch):
    path = zoo[family]
    model = load_causal_lm(path, CPU, torch.float32)
    head = load_frozen_head(path)
    draft = DFlashDraftModel(draft_config_from_target(load_target_config(path), 1, 5, 250))
    prompt = torch.randint(3, 250, (11,), generator=torch.Generator().manual_seed(2))
    want = greedy_reference(model, prompt, 40)
    cuts = scripted_drafts(monkeypatch, want, len(prompt), seed=3)
    got = speculative_generate(draft, model, head, prompt, max_new_tokens=40, block_size=5)
    assert got.tokens == want
    assert max(got.acceptance_lengths) == 5 and min(got.acceptance_lengths) == 1
    assert len(set(cuts)) > 2  # none, some and all of a block were accepted along the way


@needs("qwen3_5")
def test_without_restoring_the_recurrent_state_a_hybrid_target_drifts(zoo, monkeypatch):
    # The rollback is what keeps a hybrid target exact: with a crop alone (what transformers'
    # cache offers before 5.25), its linear-attention state keeps every rejected token.
    from transformers import DynamicCache

    from dflash_train.model import target_cache

    path = zoo["qwen3_5"]
    assert "qwen3_5" in HYBRID
    model = load_causal_lm(path, CPU, torch.float32)
    if target_cache.records_recurrent_states(DynamicCache(config=model.config)):
        pytest.skip("transformers >= 5.25 restores recurrent states in its own crop")
    head = load_frozen_head(path)
    draft = DFlashDraftModel(draft_config_from_target(load_target_config(path), 1, 5, 250))
    prompt = torch.randint(3, 250, (11,), generator=torch.Generator().manual_seed(2))
    want = greedy_reference(model, prompt, 40)
    scripted_drafts(monkeypatch, want, len(prompt), seed=3)
    monkeypatch.setattr(target_cache, "_recurrent_states", lambda cache: {})
    got = speculative_generate(draft, model, head, prompt, max_new_tokens=40, block_size=5)
    assert got.tokens != want


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_architectures_refused_on_purpose_say_so_in_one_line(tmp_path, kind):
    path = save_refused(kind, tmp_path / kind)
    with pytest.raises(TargetLoadError, match=REFUSED[kind]) as e:
        load_target_config(path)
    assert "\n" not in str(e.value)


@needs("gpt_oss")
def test_mxfp4_experts_are_dequantised_on_load_and_the_memory_is_said(tmp_path, capsys):
    # gpt-oss's real checkpoints store their experts in MXFP4; without a GPU kernel they must
    # be dequantised, and the user is told what that costs.
    from dflash_train.model.families import mxfp4_dequantised_bytes, quantization_method
    from target_zoo import save_mxfp4_gpt_oss

    path = tmp_path / "gpt_oss_mxfp4"
    dense = save_mxfp4_gpt_oss(path)
    layout = read_target_layout(path)
    assert quantization_method(layout) == "mxfp4"
    model = load_causal_lm(path, CPU, torch.float32)
    state = model.state_dict()
    for name, want in dense.items():
        torch.testing.assert_close(state[name], want, atol=0, rtol=0)
    need = mxfp4_dequantised_bytes(layout, torch.float32)
    assert need == sum(t.numel() * 4 for t in state.values() if t.dtype == torch.float32)
    assert "MXFP4 experts dequantised" in capsys.readouterr().err
    ex = TargetFeatureExtractor(path, [1, 3], CPU, torch.float32)
    assert ex(torch.randint(3, 250, (1, 9))).shape == (1, 9, 128)


@needs("gpt_oss")
def test_an_mxfp4_target_too_big_for_its_device_is_refused_before_loading(tmp_path, monkeypatch):
    from dflash_train.model import families
    from target_zoo import save_mxfp4_gpt_oss

    path = tmp_path / "gpt_oss_mxfp4"
    save_mxfp4_gpt_oss(path)
    monkeypatch.setattr(families, "device_free_bytes", lambda device: 1024)
    with pytest.raises(TargetLoadError, match=r"MXFP4 experts that take .* GiB free"):
        load_causal_lm(path, torch.device("cuda:3"), torch.bfloat16)


def test_a_family_newer_than_the_installed_transformers_is_refused_in_one_line(zoo, monkeypatch):
    # Qwen3-MoE serves on every supported release; pretend it needed a later one.
    from dflash_train.model import compat

    path = zoo["qwen3_moe"]
    monkeypatch.setitem(compat.FAMILY_MIN_TRANSFORMERS, "qwen3_moe", "99.1.0")
    with pytest.raises(TargetLoadError, match=r"'qwen3_moe' target needs transformers>=99\.1\.0"):
        load_target_config(path)
    with pytest.raises(TargetLoadError) as e:
        load_causal_lm(path, CPU, torch.float32)
    assert "\n" not in str(e.value) and "installed: " in str(e.value)
    assert compat.family_supported("llama")  # nothing asked of the plain families


@pytest.mark.parametrize("family", SUPPORTED)
def test_the_teachers_logits_are_the_targets_own_on_every_family(zoo, family):
    # The losses on the target's distribution read the final-normed last hidden state through
    # the frozen head (read from the safetensors, as --features does): the wrapper's own logits.
    path = zoo[family]
    ids = torch.randint(3, 250, (2, 13), generator=torch.Generator().manual_seed(2))
    _, logits = reference_hidden_states(path, ids)
    ex = TargetFeatureExtractor(path, [0, 2, TEACHER_INPUT_ID], CPU, torch.float32)
    head = load_frozen_head(path)
    states = ex(ids)[..., 2 * ex.hidden_size :]
    teacher = torch.nn.functional.linear(states, head.head, head.head_bias)
    teacher = soft_cap(teacher, head.logit_softcap)
    torch.testing.assert_close(teacher, logits, atol=1e-4, rtol=1e-4)
