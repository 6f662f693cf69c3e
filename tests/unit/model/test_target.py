"""Target loading, selected-layer features and the frozen head."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_train.config import ModelOptions
from dflash_train.model.draft import served_repeats
from dflash_train.model.target import (
    TargetFeatureExtractor,
    TargetLoadError,
    draft_config_from_target,
    load_frozen_head,
    load_target_config,
)
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.train.setup import draft_config_for


def test_features_are_hidden_states_of_id_plus_one_for_every_id(tiny_target):
    ids = torch.randint(0, 250, (2, 17))
    full = AutoModelForCausalLM.from_pretrained(tiny_target)
    with torch.no_grad():
        hs = full(ids, output_hidden_states=True).hidden_states
    # Layer id l means hidden_states[l + 1]: the OUTPUT of decoder layer l (the last layer, 5,
    # is refused: see test_the_last_target_layer_is_refused_before_any_model_loads).
    for layer_ids in ([3, 0, 4], [0], [4], [1, 2, 3, 4]):
        ex = TargetFeatureExtractor(tiny_target, layer_ids, torch.device("cpu"), torch.float32)
        feats = ex(ids)
        want = torch.cat([hs[i + 1] for i in layer_ids], -1)
        torch.testing.assert_close(feats, want, atol=1e-5, rtol=1e-5)
        assert not feats.requires_grad


def test_the_last_target_layer_is_refused_before_any_model_loads(tiny_target, tmp_path):
    # Its output is normed for transformers and the reference client, not for vLLM: train = serve
    # cannot hold for it. A directory with only the config shows that nothing else is read.
    only_config = tmp_path / "config_only"
    only_config.mkdir()
    (only_config / "config.json").write_text((tiny_target / "config.json").read_text())
    cfg = load_target_config(only_config)
    with pytest.raises(ValueError, match=r"target layer id 5 is the target's last layer"):
        draft_config_from_target(cfg, 1, 8, 255, target_layer_ids=[1, 5])
    opts = ModelOptions(target=str(only_config), target_layer_ids=[1, 5], mask_token_id=255)
    with pytest.raises(ValueError, match=r"use ids 0\.\.4"):
        draft_config_for(opts)
    with pytest.raises(TargetLoadError, match="last layer"):
        TargetFeatureExtractor(tiny_target, [5], torch.device("cpu"), torch.float32)
    # With K = 1 the default rule takes the middle layer, never the last.
    assert draft_config_from_target(cfg, 1, 8, 255, num_features=1).target_layer_ids == [3]


def test_extractor_drops_layers_after_the_last_needed_one(tiny_target):
    ex = TargetFeatureExtractor(tiny_target, [1, 2], torch.device("cpu"), torch.float32)
    assert len(ex.decoder.layers) == 3


def test_missing_and_non_lm_directories_are_clear_errors(tmp_path):
    with pytest.raises(TargetLoadError, match="does not exist"):
        load_target_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetLoadError, match="no config.json"):
        load_target_config(tmp_path / "empty")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"]})
    )
    with pytest.raises(TargetLoadError, match="not a causal language model"):
        load_target_config(bert)


def test_layer_ids_out_of_range_are_refused(tiny_target):
    with pytest.raises(TargetLoadError, match="out of range"):
        TargetFeatureExtractor(tiny_target, [1, 6], torch.device("cpu"), torch.float32)
    cfg = load_target_config(tiny_target)
    with pytest.raises(ValueError, match="out of range"):
        draft_config_from_target(cfg, 1, 8, 255, target_layer_ids=[0, 9])


def test_draft_config_copies_the_target_shape(tiny_target):
    cfg = load_target_config(tiny_target)
    d = draft_config_from_target(cfg, 2, 16, 255)
    assert (
        d.hidden_size,
        d.intermediate_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.vocab_size,
    ) == (64, 128, 4, 2, 16, 256)
    assert d.rope_parameters["rope_theta"] == 10000.0
    assert d.target_layer_ids == [1, 2, 2, 2, 3]  # the paper's rule on 6 layers, K = 5


def test_frozen_head_matches_the_model_untied_and_tied(tmp_path, tiny_target):
    full = AutoModelForCausalLM.from_pretrained(tiny_target)
    head = load_frozen_head(tiny_target)
    assert torch.equal(head.embed, full.model.embed_tokens.weight)
    assert torch.equal(head.head, full.lm_head.weight)
    tied = save_random_qwen3(tmp_path / "tied", tie_word_embeddings=True)
    h = load_frozen_head(tied)
    assert torch.equal(h.head, h.embed)


def test_a_quantized_lm_head_is_refused_not_taken_for_the_embedding(tmp_path, tiny_target):
    # A GPTQ head stores lm_head.qweight (no lm_head.weight): the tied guess would train the
    # drafter against the embedding while serving uses the real head.
    import shutil

    from safetensors.torch import load_file, save_file

    from dflash_train.model.families import TargetLoadError

    quantized = tmp_path / "gptq"
    shutil.copytree(tiny_target, quantized)
    tensors = load_file(quantized / "model.safetensors")
    head = tensors.pop("lm_head.weight")
    tensors["lm_head.qweight"] = head.to(torch.int8)
    tensors["lm_head.scales"] = torch.ones(head.shape[0])
    save_file(tensors, quantized / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TargetLoadError, match=r"LM head is stored quantized \(lm_head\.qweight"):
        load_frozen_head(quantized)


def test_llama_targets_work_too(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    ids = torch.randint(0, 128, (1, 9))
    ex = TargetFeatureExtractor(tmp_path / "llama", [1, 3], torch.device("cpu"), torch.float32)
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    with torch.no_grad():
        hs = full(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(ex(ids), torch.cat([hs[2], hs[4]], -1), atol=1e-5, rtol=1e-5)
    d = draft_config_from_target(load_target_config(tmp_path / "llama"), 1, 8, 127, num_features=2)
    assert (d.head_dim, d.target_layer_ids) == (8, [1, 3])
    head = load_frozen_head(tmp_path / "llama")
    assert torch.equal(head.head, full.lm_head.weight)


def test_the_attention_layout_flags_reach_the_draft_config(tiny_target):
    opts = ModelOptions(
        target=str(tiny_target),
        draft_layers=3,
        sliding_window=16,
        causal_in_block=False,
        mask_token_id=255,
    )
    config, _ = draft_config_for(opts)
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (config.sliding_window, config.is_causal) == (16, False)


def test_graph_replays_pad_rows_copy_their_output_out_and_fall_back_when_too_big(tiny_target):
    # The CUDA-graph path's buffers and dispatch, on CPU: the "eager" backend overwrites one
    # static output in place per replay, as a replay does, so a batch handed out must be a copy.
    cpu = torch.device("cpu")
    eager = TargetFeatureExtractor(tiny_target, [1, 3], cpu, torch.float32)
    graphed = TargetFeatureExtractor(tiny_target, [1, 3], cpu, torch.float32)
    assert graphed.capture_graphs({16: 3, 32: 2}, backend="eager") == 2
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 250, (rows, 16), generator=gen) for rows in (2, 3))
    got_a = graphed(a)  # 2 rows padded to the captured 3
    got_b = graphed(b)  # the next replay overwrites the static output
    torch.testing.assert_close(got_a, eager(a), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_b, eager(b), atol=1e-5, rtol=1e-5)
    assert got_a.shape[0] == 2 and graphed.graph_misses == 0
    big, other = torch.randint(0, 250, (4, 16)), torch.randint(0, 250, (1, 24))
    torch.testing.assert_close(graphed(big), eager(big), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(graphed(other), eager(other), atol=1e-5, rtol=1e-5)
    assert graphed.graph_misses == 2  # more rows than captured, and a length not captured


@pytest.mark.slow
def test_a_compiled_target_gives_the_eager_features_and_traces_only_in_its_warm_up(tiny_target):
    from torch._dynamo.utils import counters

    cpu = torch.device("cpu")
    eager = TargetFeatureExtractor(tiny_target, [1, 3], cpu, torch.float32)
    compiled = TargetFeatureExtractor(tiny_target, [1, 3], cpu, torch.float32)
    compiled.compile([16, 32], backend="aot_eager")  # inductor's code generation left out
    graphs = counters["stats"]["unique_graphs"]
    with torch.compiler.set_stance("eager_on_recompile"):
        for rows, length in ((1, 16), (3, 32), (5, 16), (2, 24)):
            ids = torch.randint(0, 250, (rows, length))
            torch.testing.assert_close(compiled(ids), eager(ids), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs  # no shape traced after the warm-up


def test_ids_a_user_gives_must_be_ascending_and_distinct_as_servers_gather_them(tiny_target):
    # vLLM and SGLang gather each asked layer once, in layer order: [3, 1] would be served with
    # fc's inputs swapped, [1, 1] with half of them. The paper's rule on a test-sized target
    # may repeat ids (trainable, and the reference client serves it): export names it.
    cfg = load_target_config(tiny_target)
    for ids, says in (([3, 1], r"ascending and distinct.*use \[1, 3\]"), ([1, 1], r"use \[1\]")):
        with pytest.raises(ValueError, match=says):
            draft_config_from_target(cfg, 1, 8, 255, target_layer_ids=ids)
    assert draft_config_from_target(cfg, 1, 8, 255, target_layer_ids=[1, 3]).target_layer_ids == [
        1,
        3,
    ]
    repeated = draft_config_from_target(cfg, 1, 8, 255, num_features=5)
    assert served_repeats(repeated.target_layer_ids) == [2]
