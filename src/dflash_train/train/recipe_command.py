"""`dflash-train recipes [NAME] [--yaml]`: the recipes shipped with the package (`recipes.py`),
each value with where it comes from; `train --recipe list` prints the same list."""

from __future__ import annotations

import argparse
from typing import Any

import yaml

from dflash_train.config import ModelOptions
from dflash_train.model.draft import default_target_layer_ids
from dflash_train.recipes import RECIPES, Recipe, get_recipe


def listing() -> str:
    """One line per recipe, and how to use one."""
    width = max(map(len, RECIPES))
    lines = ["recipes (`dflash-train recipes NAME` shows one, value by value):"]
    lines += [f"  {r.name:<{width}}  {r.target}: {r.summary}" for r in RECIPES.values()]
    lines.append(
        "use one: dflash-train train --recipe NAME --target DIR --data PREPARED --out RUN_DIR "
        "(flags and --config override its values)"
    )
    return "\n".join(lines)


def flag_text(name: str, value: Any) -> str:
    """An option as the train command takes it, e.g. `--drafter-devices cuda:1,cuda:2`."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else "--no-" + flag[2:]
    if isinstance(value, list):
        return f"{flag} {','.join(map(str, value))}"
    text = str(value)
    return f"{flag} '{text}'" if any(c in text for c in ' {}"') else f"{flag} {text}"


def layer_ids_line(recipe: Recipe) -> str | None:
    """The feature ids the paper's rule gives for the named target's depth."""
    if recipe.target_layers is None:
        return None
    k = recipe.values().get("num_target_features", ModelOptions.num_target_features)
    ids = default_target_layer_ids(recipe.target_layers, k)
    return f"target layer ids: {ids} (the paper's rule for its {recipe.target_layers} layers)"


def details(recipe: Recipe) -> str:
    """A recipe value by value, each with its source, then what it needs and its notes."""
    lines = [f"{recipe.name}: {recipe.target}", f"  {recipe.summary}"]
    for name, setting in recipe.settings.items():
        lines += [f"  {flag_text(name, setting.value)}", f"      {setting.source}"]
    ids = layer_ids_line(recipe)
    if ids:
        lines.append(f"  {ids}")
    lines += [f"  needs --{r.option.replace('_', '-')}: {r.why}" for r in recipe.requires]
    lines += [f"  - {note}" for note in recipe.notes]
    lines.append(
        f"  run it: dflash-train train --recipe {recipe.name} --target DIR --data PREPARED "
        "--out RUN_DIR"
    )
    return "\n".join(lines)


def as_yaml(recipe: Recipe) -> str:
    """The recipe as a `--config` file: its values, each under a comment with its source."""
    lines = [f"# recipe {recipe.name}: {recipe.target} ({recipe.summary})"]
    for name, setting in recipe.settings.items():
        lines.append(f"# {setting.source}")
        lines.append(yaml.safe_dump({name: setting.value}, default_flow_style=True).strip()[1:-1])
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train recipes`."""
    parser.add_argument("name", nargs="?", help="a recipe to show (default: list them all)")
    parser.add_argument(
        "--yaml",
        action="store_true",
        help="print the recipe as a --config file (each value with its source as a comment)",
    )


def main(args: argparse.Namespace) -> int:
    """Print the list, one recipe, or one recipe as YAML."""
    if args.name is None or args.name == "list":
        if args.yaml:
            raise ValueError("--yaml needs a recipe's name")
        print(listing())
        return 0
    recipe = get_recipe(args.name)
    print(as_yaml(recipe) if args.yaml else details(recipe), end="" if args.yaml else "\n")
    return 0
