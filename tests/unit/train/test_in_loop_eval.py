"""The in-training evaluation encodes its prompts in the chat mode the data was prepared in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_train.config import TrainConfig
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.prompts import encode_prompts, read_prompts
from dflash_train.train.setup import TrainingData
from dflash_train.train.trainer import Trainer
from pipeline_helpers import chat_workspace


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A Qwen3-style chat target (its template reads enable_thinking) and prompts."""
    root = tmp_path_factory.mktemp("inloop")
    tok = chat_workspace(root, conversations=24, prompts=4, seed=5, vocab_size=400)
    return root, tok


def evaluator_for(root, data_dir):
    """What the trainer builds for --eval-every, from the run's own TrainingData."""
    cfg = TrainConfig.from_layers(
        {
            "target": str(root / "target"),
            "data": str(data_dir),
            "draft_layers": 1,
            "block_size": 4,
            "num_target_features": 2,
            "eval_every": 1,
            "eval_prompts": str(root / "prompts.jsonl"),
        }
    )
    trainer = SimpleNamespace(
        cfg=cfg,
        data=TrainingData.load(cfg),
        drafter_devices=[torch.device("cpu")],
        replicas=[SimpleNamespace(compute_dtype=torch.float32)],
        say=print,
        is_main=True,
    )
    return trainer.data, Trainer._build_evaluator(trainer)


@pytest.mark.parametrize(("flag", "mode"), [(False, "off"), (True, "on"), (None, "default")])
def test_in_loop_eval_encodes_prompts_in_the_prepared_chat_mode(workspace, flag, mode):
    root, tok = workspace
    data_dir = root / f"data_{mode}"
    prepare(
        PrepareConfig(
            data=[str(root / "train.jsonl")],
            tokenizer=str(root / "target"),
            out=str(data_dir),
            enable_thinking=flag,
        )
    )
    data, evaluator = evaluator_for(root, data_dir)
    assert data.draft_config.chat_thinking == mode  # recorded with the drafter, so exported too
    messages = read_prompts(root / "prompts.jsonl", 8)
    want = encode_prompts(tok, messages, len(tok) + 8, enable_thinking=flag)
    assert [p.tolist() for p in evaluator.prompts] == [p.tolist() for p in want]
    if flag is False:
        # Thinking off opens an empty think block: not what the template's default encodes.
        default = encode_prompts(tok, messages, len(tok) + 8)
        assert all(len(a) > len(b) for a, b in zip(want, default, strict=True))


def test_in_loop_eval_stops_answers_where_eval_and_engines_do(workspace, monkeypatch):
    """Regression: eval/tau decoded every prompt to --eval-max-new-tokens, counting rounds after
    the end of turn that `eval` and serving engines never run."""
    from dflash_train.data.prompts import eos_token_ids
    from dflash_train.train import in_loop_eval

    root, tok = workspace
    data_dir = root / "data_stops"
    prepare(
        PrepareConfig(
            data=[str(root / "train.jsonl")], tokenizer=str(root / "target"), out=str(data_dir)
        )
    )
    _, evaluator = evaluator_for(root, data_dir)
    stops = eos_token_ids(evaluator.target, tok)
    assert stops and evaluator.stop_token_ids == stops
    seen = {}

    def recording(*args, **kwargs):
        seen.update(kwargs)
        return 2.0

    monkeypatch.setattr(in_loop_eval, "quick_tau", recording)
    replica = SimpleNamespace(model=None, head=None)
    assert evaluator(replica)[0] == 2.0 and seen["stop_token_ids"] == stops


def test_in_loop_eval_encodes_prompts_with_the_datas_chat_template_file(workspace, tmp_path):
    """Regression: data prepared with --chat-template FILE was evaluated during training with
    the target tokenizer's own template, other prompts than the drafter learnt after."""
    root, tok = workspace
    template = tmp_path / "system.jinja"
    template.write_text("{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}" + tok.chat_template)
    data_dir = tmp_path / "data"
    prepare(
        PrepareConfig(
            data=[str(root / "train.jsonl")],
            tokenizer=str(root / "target"),
            out=str(data_dir),
            chat_template=str(template),
        )
    )
    _, evaluator = evaluator_for(root, data_dir)
    messages = read_prompts(root / "prompts.jsonl", 8)
    tok.chat_template, own = template.read_text(), tok.chat_template
    try:
        want = encode_prompts(tok, messages, len(tok) + 8)
    finally:
        tok.chat_template = own
    assert [p.tolist() for p in evaluator.prompts] == [p.tolist() for p in want]
    # The file gone since: said, and the tokenizer's own template used.
    template.unlink()
    said = []
    from dflash_train.data.dataset import PreparedDataset
    from dflash_train.train.trainer import data_chat_template

    assert data_chat_template(PreparedDataset(data_dir), said.append) is None
    assert len(said) == 1 and "cannot be read" in said[0]
