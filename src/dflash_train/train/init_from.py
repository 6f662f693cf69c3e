"""The drafter of a run that starts from a trained one (`--init-from`): its architecture is the
source's, read from any layout `model/published.py` reads (or a checkpoint or run directory),
and it must fit the run's target.

Taken from the source: layers, widths, heads, target layer ids, mask token, attention layout,
RoPE, DFlash 2 sizes. An option left at its default follows the source; one set otherwise
(a flag, the --config file or a --recipe) must say what the source says, or the run is refused
in one line naming each. Two changes that keep every weight's meaning are allowed: another
--block-size (the positions a block drafts; the paper's drafters are served at other sizes too),
and --arch dflash2 from a DFlash 1 source (its new modules start at the identity, so it drafts
exactly what the source did). A resumed run reads the source's config again (not its weights:
they come from the run's checkpoint).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dflash_train.config import DFLASH2_OPTIONS, ModelOptions
from dflash_train.model.checkpoint import (
    attention_layout,
    is_checkpoint,
    load_checkpoint_model,
    not_a_drafter,
)
from dflash_train.model.draft import DFlashConfig
from dflash_train.model.families import TargetLayout, input_embedding_scale
from dflash_train.model.published import layout_of, read_config
from dflash_train.model.target import check_draft_fits_target

DEFAULTS = ModelOptions()


def source_config(path: str, num_target_layers: int) -> DFlashConfig:
    """The config of the drafter at `path` (a published directory, a checkpoint or a run
    directory), its weights unread where the layout allows."""
    if layout_of(path) is not None:
        return read_config(path, num_target_layers)
    if is_checkpoint(path):
        return load_checkpoint_model(path).config
    raise not_a_drafter(Path(path))


def config_from_init(
    opts: ModelOptions, layout: TargetLayout, chat_thinking: str | None
) -> tuple[DFlashConfig, str]:
    """The run's drafter config from the drafter `opts.init_from` holds, checked against the
    target (`layout`) and the options; and how its mask token was chosen (for the run's log)."""
    path = opts.init_from
    assert path
    try:
        source = source_config(path, layout.text.num_hidden_layers)
        check_draft_fits_target(source, layout.text, input_embedding_scale(layout))
    except ValueError as e:
        raise ValueError(f"--init-from {path}: {e}") from None
    conflicts = option_conflicts(opts, source)
    if conflicts:
        raise ValueError(
            f"--init-from {path}: options that contradict the drafter it holds (its shape is "
            f"the run's): {'; '.join(conflicts)}; leave them unset (`none` unsets a --recipe's)"
        )
    changes: dict[str, Any] = {"chat_thinking": chat_thinking}
    if opts.block_size != DEFAULTS.block_size:
        changes["block_size"] = opts.block_size
    if opts.arch == "dflash2" and not source.is_dflash2:
        changes |= {"arch": "dflash2", **{k: getattr(opts, k) for k in DFLASH2_OPTIONS}}
    return dataclasses.replace(source, **changes), "the --init-from drafter's"


def option_conflicts(opts: ModelOptions, source: DFlashConfig) -> list[str]:
    """The options set away from their defaults that say otherwise than `source`."""
    out = []

    def differs(name: str, mine: Any, theirs: Any) -> None:
        if getattr(opts, name) != getattr(DEFAULTS, name) and mine != theirs:
            out.append(f"--{name.replace('_', '-')} {_text(getattr(opts, name))} (it: {theirs})")

    differs("draft_layers", opts.draft_layers, source.num_hidden_layers)
    differs("target_layer_ids", opts.target_layer_ids, source.target_layer_ids)
    if opts.target_layer_ids is None:
        differs("num_target_features", opts.num_target_features, source.num_features)
    differs("mask_token_id", opts.mask_token_id, source.mask_token_id)
    if source.is_dflash2:
        for name in DFLASH2_OPTIONS:
            differs(name, getattr(opts, name), getattr(source, name))
    out += _layout_conflict(opts, source)
    return out


LAYOUT_OPTIONS = ("sliding_window", "full_attention_layers", "layer_types", "causal_in_block")


def _layout_conflict(opts: ModelOptions, source: DFlashConfig) -> list[str]:
    """Layout options given must give the source's attention, layer by layer."""
    given = [k for k in LAYOUT_OPTIONS if getattr(opts, k) != getattr(DEFAULTS, k)]
    if not given:
        return []
    flags = ", ".join(f"--{k.replace('_', '-')} {_text(getattr(opts, k))}" for k in given)
    try:
        types = dataclasses.replace(opts, draft_layers=source.num_hidden_layers).draft_layer_types()
        causal = source.is_causal if opts.causal_in_block is None else opts.causal_in_block
        mine = dataclasses.replace(
            source, layer_types=types, sliding_window=opts.sliding_window, is_causal=causal
        )
    except ValueError as e:
        return [f"{flags} ({e})"]
    theirs = attention_layout(source)
    if attention_layout(mine) == theirs:
        return []
    return [f"{flags} (it: {', '.join(theirs)})"]


def _text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
