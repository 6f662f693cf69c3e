"""Config: defaults < YAML < flags, validation naming the field, every flag documented."""

from __future__ import annotations

import argparse
import math
import re
import typing

import pytest

from dflash_train.config import FLOAT_BOUNDS, SECTIONS, CaptureOptions, TrainConfig, parse_bytes
from dflash_train.dataclass_cli import build, dataclass_fields, field_docs
from dflash_train.train.command import add_arguments, config_from_args


def parse(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_defaults_match_the_paper_and_the_issue():
    cfg = TrainConfig()
    assert (cfg.optim.lr, cfg.optim.warmup_ratio, cfg.optim.grad_clip) == (6e-4, 0.04, 1.0)
    assert (cfg.objective.num_anchors, cfg.model.block_size, cfg.run.epochs) == (512, 16, 6)
    assert (cfg.pipeline.hs_queue_depth, cfg.pipeline.hs_min_ready) == (90, 30)
    assert (cfg.pipeline.num_prefetchers, cfg.pipeline.mix) == (5, "plan")


def test_flags_override_yaml_which_overrides_defaults(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text(
        "lr: 0.001\npipeline:\n  hs_queue_depth: 40\n  drafter_devices: [cpu, cpu]\nepochs: 2\n"
    )
    cfg = parse(
        ["--config", str(yml), "--lr", "0.002", "--target-devices", "cpu,cpu", "--no-progress"]
    )
    assert cfg.optim.lr == 0.002
    assert cfg.pipeline.hs_queue_depth == 40 and cfg.run.epochs == 2
    assert cfg.pipeline.drafter_devices == ["cpu", "cpu"]
    assert cfg.pipeline.target_devices == ["cpu", "cpu"]
    assert cfg.metrics.progress is False


def test_issue_flag_names_exist():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {opt for a in parser._actions for opt in a.option_strings}
    for name in (
        "--target",
        "--data",
        "--out",
        "--target-devices",
        "--drafter-devices",
        "--draft-layers",
        "--block-size",
        "--num-anchors",
        "--batch-size",
        "--epochs",
        "--max-steps",
        "--lr",
        "--seed",
        "--num-prefetchers",
        "--hs-queue-depth",
        "--hs-min-ready",
        "--hs-queue-bytes",
        "--mix",
        "--config",
        "--position-weights",
        "--dpace-alpha",
        "--optimizer",
        "--muon-lr",
        "--loss",
        "--lk-eta",
    ):
        assert name in flags, name


def test_every_field_has_help_text():
    for section in SECTIONS.values():
        docs = field_docs(section)
        for f in dataclass_fields(section):
            assert docs.get(f.name), f"{section.__name__}.{f.name} has no docstring"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"hs_min_ready": 50, "hs_queue_depth": 10}, "hs_min_ready"),
        ({"lr": -1.0}, "--lr"),
        ({"block_size": 1}, "block_size"),
        ({"hs_queue_bytes": "lots"}, "hs_queue_bytes"),
        ({"bucket_lengths": [64, 32]}, "bucket_lengths"),
        ({"warmup_ratio": 1.5}, "--warmup-ratio"),
        ({"batch_cost": "1.5"}, "batch_cost"),
        ({"batch_cost": "flop"}, "batch_cost"),
        ({"dpace_alpha": 0.0}, "--dpace-alpha"),
        ({"dpace_alpha": 1.5}, "--dpace-alpha"),
        ({"muon_lr": -1e-3}, "--muon-lr"),
        ({"loss": "tv"}, "loss"),
        ({"lk_eta": 0.0}, "--lk-eta"),
        ({"no_such_option": 1}, "unknown option"),
        # fp16 trains without a grad scaler here: its gradients would underflow, silently.
        ({"dtype": "float16"}, "dtype float16 .*loss scaling"),
    ],
)
def test_bad_values_name_the_field(flags, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig.from_layers(flags)


# ----------------------------------------------------------------------------- float options
FLOAT_SECTIONS = (*SECTIONS.values(), CaptureOptions)


def float_fields(section: type) -> list[str]:
    hints = typing.get_type_hints(section)
    return [f.name for f in dataclass_fields(section) if hints[f.name] in (float, float | None)]


FLOAT_FIELDS = [(section, name) for section in FLOAT_SECTIONS for name in float_fields(section)]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def refused(section: type, name: str, value: float) -> None:
    """Building `section` with `name` = `value` (a train option through the train flags, a
    capture option as its command builds it): one ValueError naming the flag and the value."""
    with pytest.raises(ValueError, match=rf"^{re.escape(flag(name))} must be a finite number"):
        if section is CaptureOptions:
            build(CaptureOptions, {name: value})
        else:
            parse([f"{flag(name)}={value}"])  # "=": argparse takes -inf for an option


def test_every_float_option_has_its_bounds_declared():
    names = {name for _, name in FLOAT_FIELDS}
    assert names == set(FLOAT_BOUNDS)
    reviewed = {"lr", "weight_decay", "adam_beta1", "adam_beta2", "stall_timeout", "muon_lr"}
    assert reviewed <= names and {s for s, _ in FLOAT_FIELDS} >= {CaptureOptions}


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    ("section", "name"), FLOAT_FIELDS, ids=[f"{s.__name__}.{n}" for s, n in FLOAT_FIELDS]
)
def test_no_float_option_takes_nan_or_infinity(section, name, value):
    """NaN passes every `value <= 0` check: --lr inf trained to NaN weights, --stall-timeout
    nan disabled the hang watchdog."""
    refused(section, name, value)


@pytest.mark.parametrize(
    ("name", "value", "rule"),
    [
        ("adam_beta1", 1.0, "in [0, 1)"),
        ("adam_beta1", 1.5, "in [0, 1)"),
        ("adam_beta1", -0.1, "in [0, 1)"),
        ("adam_beta2", 1.0, "in [0, 1)"),
        ("weight_decay", -0.01, ">= 0"),
        ("grad_clip", -1.0, ">= 0"),
        ("lr", 0.0, "> 0"),
        ("muon_lr", -1e-3, "> 0"),
        ("warmup_ratio", 1.0, "in [0, 1)"),
        ("min_lr_ratio", 1.5, "in [0, 1]"),
        ("gamma", 0.0, "> 0"),
        ("dpace_alpha", 0.0, "in (0, 1]"),
        ("opd_gamma", 1.5, "in (0, 1]"),
        ("opd_rejected_weight", -1.0, ">= 0"),
        ("selector_loss_weight", -1.0, ">= 0"),
        ("lk_eta", 0.0, "> 0"),
        ("stall_timeout", 0.0, "> 0"),
        ("stop_timeout", -1.0, "> 0"),
        ("engine_start_timeout", 0.0, "> 0"),
    ],
)
def test_float_options_out_of_range_name_the_flag_and_the_range(name, value, rule):
    expected = f"{flag(name)} must be a finite number {rule}, got {value}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        TrainConfig.from_layers({name: value})


def test_capture_refuses_a_nan_stall_timeout():
    with pytest.raises(ValueError, match=r"^--stall-timeout must be a finite number > 0, got nan"):
        CaptureOptions(stall_timeout=math.nan)


def test_the_edges_of_each_range_are_accepted():
    edges = {
        "adam_beta1": 0.0,
        "adam_beta2": 0.999,
        "weight_decay": 0.0,
        "grad_clip": 0.0,
        "warmup_ratio": 0.0,
        "min_lr_ratio": 1.0,
        "dpace_alpha": 1.0,
        "opd_gamma": 1.0,
        "opd_rejected_weight": 0.0,
        "selector_loss_weight": 0.0,
        "gamma": 1e-3,
        "lr": 1e-9,
    }
    cfg = TrainConfig.from_layers(edges)
    assert (cfg.optim.adam_beta1, cfg.optim.min_lr_ratio, cfg.objective.opd_gamma) == (0, 1, 1)


@pytest.mark.parametrize(
    ("command", "flag_value", "rule"),
    [
        ("train", ["--lr", "inf"], "> 0"),
        ("train", ["--stall-timeout", "nan"], "> 0"),
        ("train", ["--adam-beta1", "1.5"], "in [0, 1)"),
        ("capture", ["--stall-timeout", "nan"], "> 0"),
    ],
)
def test_a_bad_float_flag_is_one_line_and_exit_2(command, flag_value, rule, capsys):
    """Refused as the config is built: before any data, target or drafter is read."""
    from dflash_train import cli

    name, value = flag_value
    assert cli.main([command, *flag_value]) == 2
    line = f"dflash-train {command}: error: {name} must be a finite number {rule}, got {value}"
    assert capsys.readouterr().err.splitlines() == [line]


@pytest.mark.parametrize(
    ("value", "share"),
    [("flops", None), ("auto", None), ("blocks", 0.0), ("tokens", 1.0), ("0.35", 0.35)],
)
def test_batch_cost_names_a_token_share(value, share):
    assert TrainConfig.from_layers({"batch_cost": value}).pipeline.token_share == share


def test_yaml_type_errors_are_reported(tmp_path):
    yml = tmp_path / "c.yaml"
    yml.write_text("epochs: many\n")
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig.from_yaml_and_flags(str(yml), {})
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig.from_yaml_and_flags(str(tmp_path / "none.yaml"), {})


@pytest.mark.parametrize(
    "text", ["hs_queue_depth: many\n", "pipeline:\n  hs_queue_depth: 4.5\n", "recipe: 3\n"]
)
def test_a_file_value_of_the_wrong_type_is_refused_also_under_a_flag(tmp_path, text):
    """Regression: a flag setting the same option replaced the file's value before it was
    checked, so the file's mistake passed unseen (refused without the flag)."""
    yml = tmp_path / "c.yaml"
    yml.write_text(text)
    flag = ["--recipe", "qwen3-8b"] if "recipe" in text else ["--hs-queue-depth", "4"]
    with pytest.raises(ValueError, match="expected"):
        parse(["--config", str(yml), *flag])


def test_parse_bytes_units():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("500MB") == 500 * 10**6
    assert parse_bytes("1024") == 1024


def test_resolved_config_round_trips():
    cfg = TrainConfig.from_layers({"lr": 0.01, "drafter_devices": ["cpu"]})
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


# ----------------------------------------------------------------------------- attention layout
def test_one_flag_gives_the_official_sliding_window_layout():
    cfg = parse(["--sliding-window", "2048"])
    assert cfg.model.draft_layer_types() == ["sliding_attention"] * 4 + ["full_attention"]
    cfg = parse(["--sliding-window", "2048", "--full-attention-layers", "2", "--draft-layers", "8"])
    assert cfg.model.draft_layer_types() == ["sliding_attention"] * 6 + ["full_attention"] * 2
    with pytest.raises(ValueError, match="sliding-window"):  # sliding layers need a window
        parse(["--layer-types", "full,sliding,full", "--draft-layers", "3"])


def test_explicit_layer_types_and_the_in_block_rule_parse():
    cfg = parse(
        ["--layer-types", "sliding,full,sliding_attention", "--draft-layers", "3",
         "--sliding-window", "64", "--causal-in-block", "off"]
    )  # fmt: skip
    assert cfg.model.draft_layer_types() == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    assert cfg.model.causal_in_block is False
    assert parse([]).model.causal_in_block is None  # the reference client's per-layer rule
    assert parse([]).model.draft_layer_types() == ["full_attention"] * 5


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--full-attention-layers", "1"], "needs --sliding-window"),
        (["--sliding-window", "16", "--full-attention-layers", "5"], r"in 0\.\.4"),
        (["--sliding-window", "0"], "sliding_window must be >= 1"),
        (["--layer-types", "full,full"], "names 2 layers, the drafter has draft_layers=5"),
        (["--layer-types", "full,linear,full,full,full"], "unknown"),
        (["--layer-types", "sliding,full,full,full,full"], "give their --sliding-window"),
        (["--layer-types", "full,full,full,full,full", "--sliding-window", "8"], "no effect"),
        (
            ["--layer-types", "sliding,full,full,full,full", "--sliding-window", "8",
             "--full-attention-layers", "1"],
            "not both",
        ),
    ],
)  # fmt: skip
def test_layouts_that_cannot_be_built_are_refused_at_config_time(argv, needle):
    with pytest.raises(ValueError, match=needle):
        parse(argv)


@pytest.mark.parametrize("command", ["train", "prepare", "eval", "tune"])
def test_every_commands_help_renders(command, capsys):
    """Regression: a field docstring with a bare percent sign broke `train --help` (argparse
    formats help strings with %)."""
    from dflash_train import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main([command, "--help"])
    assert stopped.value.code == 0 and "--" in capsys.readouterr().out


def test_a_recipe_is_named_only_for_the_values_an_error_names_whole():
    """Regression: `lr` matched inside "already", so a refused run directory blamed the
    recipe's learning rate."""
    from dflash_train.config import recipe_note

    flags = {"recipe": "qwen3-8b"}
    assert recipe_note("run directory R already exists and is not empty", flags) == ""
    note = recipe_note("target_devices: cuda:0 requested but CUDA is not available", flags)
    assert note.startswith(" (--target-devices cuda:0: from recipe qwen3-8b")
    assert recipe_note("--lr must be positive", flags).startswith(" (--lr ")
    assert recipe_note("--lr must be positive", {**flags, "lr": 0.1}) == ""  # the user's own
