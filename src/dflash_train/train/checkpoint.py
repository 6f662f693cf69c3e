"""Training checkpoints of the drafter: tensors + readable JSON.

A checkpoint directory holds
  draft_config.json   the `DFlashConfig` (rebuilds the model alone)
  model.safetensors   the trainable weights in full precision, serving-engine names (no prefix)
  train_state.json    loop state (step, epoch, ...), free-form
  optimizer.safetensors  (training runs) AdamW moments per parameter name, for exact resume
  trained.npy         (training runs) bit-packed ids trained per epoch, (epochs, ceil(rows/8))

Everything is tensors, numpy arrays or JSON: no pickle.

A run directory keeps its final checkpoint in `RUN_DIR/checkpoint/`. `resolve_checkpoint` accepts
either a run directory or a checkpoint directory.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.model.draft import DFlashConfig, DFlashDraftModel

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "train_state.json"


OPTIMIZER_FILE = "optimizer.safetensors"
TRAINED_FILE = "trained.npy"


def save_checkpoint(
    path: str | Path,
    model: DFlashDraftModel,
    train_state: dict[str, Any] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    trained: np.ndarray | None = None,
) -> Path:
    """Write atomically: a temporary sibling directory renamed into place.

    `optimizer`'s per-parameter state is stored by parameter name; `trained` is a (epochs, rows)
    boolean array of the sequence ids already trained in each epoch.
    """
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
    if optimizer is not None:
        save_file(_optimizer_tensors(model, optimizer), tmp / OPTIMIZER_FILE)
    if trained is not None:
        np.save(tmp / TRAINED_FILE, np.packbits(trained.astype(bool), axis=-1))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _optimizer_tensors(
    model: DFlashDraftModel, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """`{param_name}.{state_key}` -> tensor (scalars such as AdamW's step as 0-d tensors)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for p, state in optimizer.state.items():
        for key, value in state.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{names[id(p)]}.{key}"] = t.detach().cpu().contiguous()
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
