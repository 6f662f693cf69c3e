"""`dflash-train eval` end to end on a tiny Qwen3 target with a real tokenizer and chat template,
and the errors it must give before any decoding starts."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_train import cli
from dflash_train import evaluate as evaluate_module
from dflash_train.data.tokenizer import build_chat_tokenizer
from dflash_train.export import export_draft
from dflash_train.model import target as target_module
from dflash_train.model.checkpoint import save_draft
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import draft_config_from_target, load_target_config
from dflash_train.model.tiny import save_random_qwen3

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a block of tokens and the target verifies them at once.",
    "Count with me: one, two, three, four, five, six, seven, eight, nine, ten.",
    "What is the capital of France? Paris is the capital of France.",
] * 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A target directory with a ChatML tokenizer, a run directory and an export of a drafter."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("evalcli")
    target_dir = save_random_qwen3(root / "target", vocab_size=384, num_layers=5)
    tok = build_chat_tokenizer(TEXTS, target_dir, vocab_size=320, style="qwen3")
    assert len(tok) <= 384
    config = draft_config_from_target(
        load_target_config(target_dir),
        num_layers=1,
        block_size=4,
        mask_token_id=tok.convert_tokens_to_ids("<|MASK|>"),
        num_features=2,
    )
    torch.manual_seed(0)
    draft = DFlashDraftModel(config)
    save_draft(root / "run" / "checkpoint", draft)
    export_draft(draft, root / "exported")
    prompts = root / "prompts.jsonl"
    rows = [
        {"prompt": "What is the capital of France?"},
        {"messages": [{"role": "user", "content": "Count to ten."}]},
        {"conversations": [{"from": "human", "value": "Tell me about foxes."}]},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "target": target_dir, "prompts": prompts, "config": config}


def run_eval(setup, *extra: str, draft: str | None = None) -> int:
    argv = [
        "eval",
        "--draft",
        draft or str(setup["root"] / "run"),
        "--target",
        str(setup["target"]),
        "--prompts",
        str(setup["prompts"]),
        "--max-new-tokens",
        "8",
        *extra,
    ]
    return cli.main(argv)


def test_eval_writes_a_report_and_prints_a_table(setup, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert run_eval(setup, "--json", str(out)) == 0
    table = capsys.readouterr().out
    assert "tau (mean acceptance length)" in table and "speedup" in table
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 3
    assert 1.0 <= report["tau"] <= 4.0
    assert list(report["acceptance_histogram"]) == ["1", "2", "3", "4"]
    assert report["speedup"] > 0
    assert len(report["per_position_acceptance"]) == 3
    assert report["spec_tokens_per_s"] > 0 and report["plain_tokens_per_s"] > 0
    assert report["greedy_match"] == 1.0
    assert report["settings"]["dtype"] == "float32" and report["settings"]["device"] == "cpu"
    assert all(r["new_tokens"] <= 8 for r in report["responses"])


def test_eval_takes_an_exported_directory_a_limit_and_a_block_size(setup, tmp_path):
    out = tmp_path / "report.json"
    code = run_eval(
        setup,
        "--limit",
        "2",
        "--block-size",
        "3",
        "--no-baseline",
        "--json",
        str(out),
        draft=str(setup["root"] / "exported"),
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["num_prompts"] == 2 and report["block_size"] == 3
    assert report["speedup"] is None


def test_sampled_eval_is_reproducible_with_a_seed(setup, tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.json"
        args = ("--temperature", "0.8", "--seed", "3", "--no-baseline", "--json", str(out))
        assert run_eval(setup, *args) == 0
        runs.append([r["acceptance_lengths"] for r in json.loads(out.read_text())["responses"]])
    assert runs[0] == runs[1]


def test_eval_draft_sampling_is_chosen_and_reported(setup, tmp_path, capsys):
    out = tmp_path / "greedy.json"
    args = ("--temperature", "0.8", "--draft-sampling", "greedy", "--no-baseline")
    assert run_eval(setup, *args, "--json", str(out)) == 0
    assert "T = 0.8 (greedy drafts)" in capsys.readouterr().out
    assert json.loads(out.read_text())["draft_sampling"] == "greedy"


def test_thinking_off_opens_an_empty_think_block_in_the_prompt(setup, tmp_path):
    lengths = {}
    for mode in ("on", "off"):
        out = tmp_path / f"{mode}.json"
        assert run_eval(setup, "--thinking", mode, "--no-baseline", "--json", str(out)) == 0
        report = json.loads(out.read_text())
        assert report["settings"]["thinking"] == mode
        lengths[mode] = [r["prompt_tokens"] for r in report["responses"]]
    assert all(off > on for on, off in zip(lengths["on"], lengths["off"], strict=True))


# ----------------------------------------------------------------------------- bad input
@pytest.fixture
def no_decoding(monkeypatch):
    """Fail the test if the command gets as far as loading target weights or decoding."""

    def refuse(*args, **kwargs):
        raise AssertionError("decoding started despite bad input")

    monkeypatch.setattr(evaluate_module, "evaluate", refuse)
    monkeypatch.setattr(target_module, "load_causal_lm", refuse)


def expect_error(capsys, code: int, needle: str) -> None:
    assert code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_an_empty_prompt_file_stops_before_decoding(setup, tmp_path, capsys, no_decoding):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = ["eval", "--draft", str(setup["root"] / "run"), "--target", str(setup["target"])]
    expect_error(capsys, cli.main([*argv, "--prompts", str(empty)]), "holds no prompts")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_temperature_that_is_no_finite_number_is_one_line(value, tmp_path, capsys, no_decoding):
    """NaN reached the sampler (a traceback) and inf was taken; the check runs before anything
    is read, so the paths need not exist."""
    argv = ["eval", "--draft", str(tmp_path / "d"), "--target", str(tmp_path / "t")]
    code = cli.main([*argv, "--prompts", str(tmp_path / "p"), f"--temperature={value}"])
    expected = f"--temperature must be a finite number >= 0, got {float(value)}"
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [f"dflash-train eval: error: {expected}"]


def test_one_new_token_is_refused_it_measures_no_acceptance(tmp_path, capsys, no_decoding):
    """Regression: --max-new-tokens 1 decoded no verify round and reported tau 1.000 from
    0 cycles, a value nothing measured."""
    argv = ["eval", "--draft", str(tmp_path / "d"), "--target", str(tmp_path / "t")]
    code = cli.main([*argv, "--prompts", str(tmp_path / "p"), "--max-new-tokens", "1"])
    assert code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("dflash-train eval: error: --max-new-tokens must be >= 2 (")


def test_a_missing_draft_directory_is_named(setup, tmp_path, capsys, no_decoding):
    expect_error(capsys, run_eval(setup, draft=str(tmp_path / "nope")), "does not exist")


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"hidden_size": 32, "head_dim": 8}, "hidden size 32 != target hidden size 64"),
        ({"target_layer_ids": [1, 4], "num_target_layers": 6}, "out of range for 5 target"),
        ({"vocab_size": 512}, "vocab_size 512 != target vocab_size 384"),
    ],
)
def test_a_drafter_that_does_not_fit_the_target_stops_before_decoding(
    setup, tmp_path, capsys, no_decoding, change, needle
):
    from dflash_train.model.draft import DFlashConfig

    config = DFlashConfig.from_dict({**setup["config"].to_dict(), **change})
    export_draft(DFlashDraftModel(config), tmp_path / "bad")
    expect_error(capsys, run_eval(setup, draft=str(tmp_path / "bad")), needle)


def test_a_target_without_a_tokenizer_is_a_clear_error(setup, tiny_target, capsys, no_decoding):
    argv = ["eval", "--draft", str(setup["root"] / "run"), "--target", str(tiny_target)]
    code = cli.main([*argv, "--prompts", str(setup["prompts"])])
    expect_error(capsys, code, "has no tokenizer")


def test_a_tokenizer_without_a_chat_template_is_a_clear_error(setup, tmp_path, capsys, no_decoding):
    from transformers import AutoTokenizer

    target = save_random_qwen3(tmp_path / "t", vocab_size=384, num_layers=5)
    tok = AutoTokenizer.from_pretrained(setup["target"])
    tok.chat_template = None
    tok.save_pretrained(target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    argv = ["eval", "--draft", str(setup["root"] / "run"), "--target", str(target)]
    code = cli.main([*argv, "--prompts", str(setup["prompts"])])
    expect_error(capsys, code, "has no chat template")


def test_eval_encodes_prompts_in_the_drafters_training_mode_by_default(setup, tmp_path):
    # A drafter trained on data prepared with thinking off (recorded in its config and export).
    from dflash_train.model.draft import DFlashConfig

    config = DFlashConfig.from_dict({**setup["config"].to_dict(), "chat_thinking": "off"})
    torch.manual_seed(0)
    export_draft(DFlashDraftModel(config), tmp_path / "off")
    reports = {}
    for name, extra in (("auto", ()), ("explicit", ("--thinking", "off"))):
        out = tmp_path / f"{name}.json"
        args = (*extra, "--no-baseline", "--json", str(out))
        assert run_eval(setup, *args, draft=str(tmp_path / "off")) == 0
        reports[name] = json.loads(out.read_text())
    auto = reports["auto"]
    assert auto["settings"]["thinking"] == "off"
    assert auto["settings"]["thinking_source"] == "the drafter's training data"
    lengths = {k: [r["prompt_tokens"] for r in v["responses"]] for k, v in reports.items()}
    assert lengths["auto"] == lengths["explicit"]
    # Another mode is still possible on purpose, with a warning that names both.
    with pytest.warns(UserWarning, match="trained on data prepared with thinking off"):
        code = run_eval(setup, "--thinking", "on", "--no-baseline", draft=str(tmp_path / "off"))
    assert code == 0


def test_eval_encodes_prompts_with_the_chat_template_the_data_was_prepared_with(setup, tmp_path):
    """Regression: `prepare --chat-template FILE` rendered the training rows with FILE, and eval
    (which had no such flag) encoded its prompts with the target tokenizer's own template."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(setup["target"]).chat_template
    template = tmp_path / "system.jinja"
    template.write_text("{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}" + own)
    lengths = {}
    for name, extra in (("own", ()), ("file", ("--chat-template", str(template)))):
        out = tmp_path / f"{name}.json"
        assert run_eval(setup, *extra, "--no-baseline", "--limit", "2", "--json", str(out)) == 0
        lengths[name] = [r["prompt_tokens"] for r in json.loads(out.read_text())["responses"]]
    assert all(f > o for o, f in zip(lengths["own"], lengths["file"], strict=True))


def test_a_missing_chat_template_file_is_one_line(setup, tmp_path, capsys, no_decoding):
    code = run_eval(setup, "--chat-template", str(tmp_path / "nope.jinja"))
    expect_error(capsys, code, "nope.jinja")
