"""Recipes on the command line: a layer under the --config file and the flags, recorded by name,
listed and shown with a source per value (`recipes.py`, `config.py`, `train/recipe_command.py`).
Each recipe's scaled-down run is tests/integration/test_recipe_runs.py."""

from __future__ import annotations

import argparse

import pytest
import yaml

from dflash_train import cli
from dflash_train.config import TrainConfig
from dflash_train.dataclass_cli import load_yaml
from dflash_train.recipes import RECIPES
from dflash_train.train import command, recipe_command

ENDPOINT = {"target_endpoint": ["http://engines:8100"]}
"""What the recipes that need an engine's URL are given here."""


def resolved(cfg: TrainConfig) -> dict:
    """Every option of a config, flat by name."""
    return {k: v for section in cfg.to_dict().values() for k, v in section.items()}


def parse_train(argv: list[str]) -> TrainConfig:
    """`dflash-train train ARGV`'s config, as the command builds it (nothing runs)."""
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.config_from_args(parser.parse_args(argv))


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_sets_every_value_it_lists(name):
    recipe = RECIPES[name]
    cfg = TrainConfig.from_layers({"recipe": name, **ENDPOINT})
    assert cfg.run.recipe == name
    assert {k: resolved(cfg)[k] for k in recipe.values()} == recipe.values()
    assert all(s.source.strip() for s in recipe.settings.values())  # a line per value


def test_the_config_file_overrides_the_recipe_and_flags_override_both(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"recipe": "qwen3-8b", "lr": 1e-3, "block_size": 8}))
    cfg = parse_train(["--config", str(path), "--block-size", "4", "--draft-layers", "3"])
    assert cfg.run.recipe == "qwen3-8b"
    assert cfg.optim.lr == 1e-3  # the file's, over the recipe's 6e-4
    assert cfg.model.block_size == 4  # the flag's, over the file's and the recipe's
    assert cfg.model.draft_layers == 3  # a flag over a recipe value the file did not touch
    assert cfg.model.sliding_window == 2048  # the recipe's, untouched
    cfg = parse_train(["--recipe", "qwen3-8b", "--sliding-window", "none"])
    assert cfg.model.draft_layer_types() == ["full_attention"] * 5


def test_a_recipe_named_in_a_section_and_the_last_one_named_wins():
    cfg = TrainConfig.from_layers({"run": {"recipe": "gemma-3"}}, {"recipe": "qwen3.5-dflash2"})
    assert cfg.run.recipe == "qwen3.5-dflash2" and cfg.model.arch == "dflash2"
    assert TrainConfig.from_layers({"recipe": "gemma-3"}, {"recipe": None}).model.arch == "dflash"


def test_an_error_caused_by_a_recipe_value_says_where_it_came_from():
    with pytest.raises(ValueError, match=r"\(--sliding-window 2048: from recipe qwen3-8b; "):
        parse_train(["--recipe", "qwen3-8b", "--layer-types", "full,full,full,full,full"])
    # Only the recipe's values are named, never the user's own (--draft-layers here).
    with pytest.raises(ValueError, match=r"must be in 0\.\.0") as err:
        parse_train(["--recipe", "qwen3-8b", "--draft-layers", "1"])
    blamed = str(err.value).rsplit("(", 1)[1]
    assert blamed.startswith("--sliding-window 2048: from recipe") and "draft" not in blamed
    with pytest.raises(ValueError) as err:  # an error no recipe value is part of
        parse_train(["--recipe", "qwen3-8b", "--lr", "-1"])
    assert "recipe" not in str(err.value)


def test_an_unknown_recipe_names_the_recipes_there_are(capsys):
    assert cli.main(["train", "--recipe", "qwen9", "--target", "t", "--data", "d"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'qwen9'" in err and "qwen3-8b" in err and len(err.splitlines()) == 1


def test_a_recipe_that_needs_an_engine_url_says_how_to_start_one():
    with pytest.raises(ValueError, match=r"recipe deepseek-v3 needs --target-endpoint: .*server"):
        TrainConfig.from_layers({"recipe": "deepseek-v3"})
    # Not needed once the features come from elsewhere.
    assert TrainConfig.from_layers({"recipe": "deepseek-v3", "target_backend": "hf"})


def test_recipes_lists_every_recipe_and_train_recipe_list_prints_the_same(capsys):
    assert cli.main(["recipes"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in RECIPES)
    assert cli.main(["train", "--recipe", "list"]) == 0
    assert capsys.readouterr().out == listed


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_shown_names_each_value_as_a_flag_with_its_source(name, capsys):
    assert cli.main(["recipes", name]) == 0
    out = capsys.readouterr().out
    for option, setting in RECIPES[name].settings.items():
        line = recipe_command.flag_text(option, setting.value)
        assert f"  {line}\n      {setting.source}\n" in out
    # The flag as printed sets the value (what a user copies is what the recipe applies).
    flags = [recipe_command.flag_text(k, s.value) for k, s in RECIPES[name].settings.items()]
    argv = [part.strip("'") for f in flags for part in f.split(" ", 1)]
    assert resolved(
        parse_train([*argv, "--target-endpoint", ENDPOINT["target_endpoint"][0]])
    ) == resolved(TrainConfig.from_layers({"recipe": name, **ENDPOINT})) | {"recipe": None}


def test_the_rule_gives_the_published_drafters_ids_for_the_named_depths():
    # z-lab's Qwen3-8B drafter uses [1, 9, 17, 25, 33]; the engine example for Qwen3.6-35B-A3B
    # in the README [1, 10, 19, 28, 37].
    assert "[1, 9, 17, 25, 33]" in recipe_command.layer_ids_line(RECIPES["qwen3-8b"])
    assert "[1, 10, 19, 28, 37]" in recipe_command.layer_ids_line(RECIPES["qwen3.6-35b-a3b"])
    assert "[1, 8, 15, 22, 29]" in recipe_command.layer_ids_line(RECIPES["llama-3.1-8b"])


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_recipe_as_yaml_is_a_config_file_of_the_same_values(name, tmp_path, capsys):
    assert cli.main(["recipes", name, "--yaml"]) == 0
    path = tmp_path / "recipe.yaml"
    path.write_text(capsys.readouterr().out)
    text = path.read_text()
    assert all(f"# {s.source}\n" in text for s in RECIPES[name].settings.values())
    from_file = TrainConfig.from_layers(load_yaml(path), ENDPOINT)
    assert resolved(from_file) == resolved(
        TrainConfig.from_layers({"recipe": name, **ENDPOINT})
    ) | {"recipe": None}
