"""`dflash-train export`: a trained drafter in the layout serving engines load.

The layout itself (config.json fields, weight names) is `dflash_train.model.serving`; this module
is the command: read a checkpoint or run directory, optionally check that the drafter fits a
target, and write the export without ever overwriting a training checkpoint.
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

import torch

from dflash_train.devices import DTYPES
from dflash_train.model.checkpoint import checkpoint_caveat, is_checkpoint, load_checkpoint_model
from dflash_train.model.draft import (
    DFlashDraftModel,
    RotaryEmbedding,
    served_repeats,
    yarn_magnitude_fields,
)
from dflash_train.model.families import input_embedding_scale, read_target_layout
from dflash_train.model.serving import CONFIG_FILE, WEIGHTS_FILE, is_exported, write_exported
from dflash_train.model.target import check_draft_fits_target


def export_draft(
    model_or_checkpoint: DFlashDraftModel | str | Path,
    out_dir: str | Path,
    *,
    target_dir: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write `model_or_checkpoint` (an in-memory drafter, a checkpoint or a run directory) to
    `out_dir` in the serving-engine layout. With `target_dir`, first check that the drafter fits
    that target (hidden size, layer ids, vocabulary). Returns `out_dir`."""
    if isinstance(model_or_checkpoint, DFlashDraftModel):
        model = model_or_checkpoint
    else:
        model = load_checkpoint_model(model_or_checkpoint)
        if caveat := checkpoint_caveat(model_or_checkpoint):
            warnings.warn(f"exporting anyway: {caveat}", stacklevel=2)
    if target_dir is not None:
        layout = read_target_layout(target_dir)
        check_draft_fits_target(model.config, layout.text, input_embedding_scale(layout))
    out = Path(out_dir)
    if is_checkpoint(out):
        # Both layouts name their weights model.safetensors: never overwrite a training checkpoint.
        raise ValueError(f"{out} holds a training checkpoint; export to another directory")
    if out.is_dir() and any(out.iterdir()) and not is_exported(out):
        # A model directory given for --out (the target's, its config.json and weights) would
        # lose both; only an earlier export is replaced.
        raise ValueError(
            f"{out} is not empty and holds no exported drafter (a model, a dataset?); export to "
            "a new or empty directory, or to an earlier export to replace it"
        )
    _warn_reader_dependent_rope(model)
    if repeats := served_repeats(model.config.target_layer_ids):
        warnings.warn(
            f"target_layer_ids {model.config.target_layer_ids} repeat {repeats} (the paper's "
            "rule on a target of fewer than K + 3 layers): vLLM and SGLang gather each layer once "
            "and cannot serve this drafter; the reference client can",
            stacklevel=2,
        )
    if model.config.input_embedding_scale != 1.0 and not model.config.is_dflash2:
        warnings.warn(
            f"the drafter embeds its block tokens scaled by {model.config.input_embedding_scale:g}"
            " (its target's, e.g. Gemma's sqrt(hidden)), written as "
            "dflash_config.input_embedding_scale: the reference client and vLLM's DFlash 2 apply "
            "it, vLLM 0.32's DFlash 1 model does not (its block embeddings would be that much "
            "smaller than in training)",
            stacklevel=2,
        )
    return write_exported(model, out, dtype)


def _warn_reader_dependent_rope(model: DFlashDraftModel) -> None:
    """A drafter trained before `served_rope` may carry YaRN magnitude fields (a DeepSeek or
    Kimi target's `mscale` / `mscale_all_dim`): written as trained, but said once, since some
    serving engines apply another attention factor than training did."""
    fields = yarn_magnitude_fields(model.config.rope_parameters)
    if not fields:
        return
    trained = RotaryEmbedding(model.config).attention_scaling
    factor = float(model.config.rope_parameters.get("factor") or 1.0)
    default = 1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0
    warnings.warn(
        f"the drafter's YaRN RoPE carries {fields} (attention factor {trained:.4f} in training "
        f"and in vLLM 0.32.0); readers that ignore them (vLLM up to 0.25: mscale, "
        f"mscale_all_dim; SGLang: attention_factor) apply {default:.4f} instead: serve it with "
        "vLLM >= 0.32 or retrain (new drafters leave these fields out)",
        stacklevel=2,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train export`."""
    parser.add_argument(
        "checkpoint", help="a run directory (its final checkpoint) or a checkpoint directory"
    )
    parser.add_argument("--out", required=True, help="directory to write the exported drafter to")
    parser.add_argument(
        "--target",
        default=None,
        help="target model directory; when given, check the drafter fits it before writing",
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=sorted(DTYPES),
        help="weight dtype of model.safetensors (serving engines expect bfloat16)",
    )


def main(args: argparse.Namespace) -> int:
    """Export a training checkpoint; print where it went."""
    src = Path(args.checkpoint)
    if not src.exists():
        raise ValueError(f"{src} does not exist")
    out = export_draft(src, args.out, target_dir=args.target, dtype=DTYPES[args.dtype])
    print(f"exported drafter to {out} ({args.dtype}, {CONFIG_FILE} + {WEIGHTS_FILE})")
    return 0
