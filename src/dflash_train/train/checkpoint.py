"""Training checkpoints of the drafter: tensors + readable JSON.

A checkpoint directory holds
  draft_config.json   the `DFlashConfig` (rebuilds the model alone)
  model.safetensors   the trainable weights in full precision, serving-engine names (no prefix)
  train_state.json    loop state (step, epoch, ...), free-form

A run directory keeps its final checkpoint in `RUN_DIR/checkpoint/`. `resolve_checkpoint` accepts
either a run directory or a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dflash_train.model.draft import DFlashConfig, DFlashDraftModel

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "train_state.json"


def save_checkpoint(
    path: str | Path, model: DFlashDraftModel, train_state: dict[str, Any] | None = None
) -> Path:
    """Write atomically: a temporary sibling directory renamed into place."""
    from safetensors.torch import save_file

    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = {
        k: v.detach().float().cpu().contiguous() for k, v in model.trainable_state_dict().items()
    }
    save_file(tensors, tmp / WEIGHTS_FILE, metadata={"format": "dflash-train"})
    (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    (tmp / STATE_FILE).write_text(json.dumps(train_state or {}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself or from a run directory (its final checkpoint)."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file():
        return p
    if (p / "checkpoint" / CONFIG_FILE).is_file():
        return p / "checkpoint"
    raise ValueError(f"{p} is neither a dflash-train checkpoint nor a run directory with one")


def is_checkpoint(path: str | Path) -> bool:
    try:
        resolve_checkpoint(path)
    except ValueError:
        return False
    return True


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu"
) -> tuple[DFlashDraftModel, dict[str, Any]]:
    """The drafter (fp32, eval mode) and its train_state."""
    from safetensors.torch import load_file

    ckpt = resolve_checkpoint(path)
    config = DFlashConfig.from_dict(json.loads((ckpt / CONFIG_FILE).read_text()))
    model = DFlashDraftModel(config)
    state = load_file(ckpt / WEIGHTS_FILE)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {ckpt} does not fit its config: missing {missing}, unexpected {unexpected}"
        )
    train_state = {}
    if (ckpt / STATE_FILE).is_file():
        train_state = json.loads((ckpt / STATE_FILE).read_text())
    return model.to(device).eval(), train_state
