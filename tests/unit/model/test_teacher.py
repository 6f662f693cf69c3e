"""The teacher's input: the target's final-normed last hidden state, at the right shift, and
its logits equal to the target's own (a family that transforms its logits otherwise refused)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.model.compat import family_supported
from dflash_train.model.target import (
    TEACHER_INPUT_ID,
    FrozenHead,
    TargetFeatureExtractor,
    TargetLoadError,
    feature_layer_ids,
    load_causal_lm,
    load_frozen_head,
    soft_cap,
)
from dflash_train.objective import block_targets, pack_anchors
from dflash_train.speculative import plain_generate
from target_zoo import save_target

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


def test_the_teachers_argmax_at_p_plus_k_minus_1_is_the_targets_greedy_token(tiny_target):
    # A row the target wrote itself (greedy): each x[j + 1] is its greedy next token after
    # x[..j], so the teacher of every supervised block position must predict that position's
    # label, read through the extractor's features, the targets' shift and the frozen head.
    target = load_causal_lm(tiny_target, CPU, torch.float32)
    prompt = torch.tensor([5, 17, 99, 3, 250, 41])
    row = torch.cat(
        [prompt, torch.tensor(plain_generate(target, prompt, max_new_tokens=40).tokens)]
    )
    ids = row[None]
    ex = TargetFeatureExtractor(tiny_target, feature_layer_ids([1, 3], True), CPU, torch.float32)
    feats = ex(ids)
    plain = TargetFeatureExtractor(tiny_target, [1, 3], CPU, torch.float32)(ids)
    assert feats.shape[-1] == 3 * 64
    torch.testing.assert_close(feats[..., :128], plain)  # the drafter's features unchanged
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    torch.testing.assert_close(feats[..., 128:], out.hidden_states[-1], atol=1e-5, rtol=1e-5)
    mask = torch.zeros_like(ids)
    mask[:, len(prompt) :] = 1
    anchors, valid = pack_anchors([np.arange(len(prompt), len(row) - 1, 3)], 16)
    targets = block_targets(ids, mask, anchors, valid, 4, 4.0)
    head = load_frozen_head(tiny_target)
    states = feats[..., 128:].reshape(-1, 64)[targets.teacher_rows]
    logits = states @ head.head.T
    assert len(targets) > 30
    assert torch.equal(logits.argmax(-1), targets.labels)
    torch.testing.assert_close(logits, out.logits.reshape(-1, 256)[targets.teacher_rows])


def test_the_teacher_input_comes_last_once_and_keeps_every_layer(tiny_target):
    ex = TargetFeatureExtractor(tiny_target, [1, TEACHER_INPUT_ID], CPU, torch.float32)
    assert len(ex.decoder.layers) == 6 and ex.layer_ids == [1] and ex.teacher
    with pytest.raises(TargetLoadError, match="comes last, once"):
        TargetFeatureExtractor(tiny_target, [TEACHER_INPUT_ID, 1], CPU, torch.float32)


@pytest.mark.skipif(
    not family_supported("gemma3_text"), reason="a gemma3 target needs transformers >= 5.15"
)
def test_a_soft_capped_targets_teacher_takes_its_cap(tmp_path):
    path = save_target("gemma3_text", tmp_path / "capped", final_logit_softcapping=2.0)
    ex = TargetFeatureExtractor(path, [1, TEACHER_INPUT_ID], CPU, torch.float32)  # checked
    head = load_frozen_head(path)
    assert head.logit_softcap == 2.0
    assert FrozenHead.of_model(load_causal_lm(path, CPU, torch.float32)).logit_softcap == 2.0
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        want = load_causal_lm(path, CPU, torch.float32)(ids).logits
    states = ex(ids)[..., 64:]
    got = soft_cap(states @ head.head.T, head.logit_softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert float(want.abs().max()) < 2.0 < float((states @ head.head.T).abs().max())


def test_a_target_whose_logits_are_transformed_otherwise_is_refused_as_a_teacher(tmp_path):
    path = save_target("granite", tmp_path / "granite")  # logits divided by 4 after the head
    TargetFeatureExtractor(path, [1], CPU, torch.float32)  # a plain target: features are fine
    with pytest.raises(TargetLoadError, match="cannot be the teacher: use --loss ce"):
        TargetFeatureExtractor(path, [1, TEACHER_INPUT_ID], CPU, torch.float32)
