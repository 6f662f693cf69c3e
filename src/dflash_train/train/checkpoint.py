"""Training checkpoints: the drafter (`model/checkpoint.py`) plus the run's state.

A checkpoint directory holds
  draft_config.json, model.safetensors   the drafter (see `dflash_train.model.checkpoint`)
  train_state.json    loop state (step, epoch, ...), free-form
  optimizer.safetensors  (training runs) AdamW moments per parameter name, for exact resume
  trained.npy         (training runs) bit-packed ids trained per epoch, (epochs, ceil(rows/8))

Everything is tensors, numpy arrays or JSON: no pickle.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from dflash_train.model.checkpoint import write_draft
from dflash_train.model.draft import DFlashDraftModel

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
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write_draft(tmp, model)
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
