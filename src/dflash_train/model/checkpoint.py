"""A drafter's files in a training checkpoint, and loading a drafter from any of its layouts.

A training checkpoint directory holds the drafter as
  draft_config.json   the `DFlashConfig` (rebuilds the model alone)
  model.safetensors   the trainable weights in full precision, serving-engine names (no prefix)
beside the training run's own state (see `dflash_train.train.checkpoint`). A run directory keeps
its final checkpoint in `RUN_DIR/checkpoint/`.

`load_draft` accepts an exported drafter (`model/serving.py`), a training checkpoint or a run
directory, so `eval` and `export` take any of them. Everything is safetensors or JSON: no pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.published import layout_of, load_published
from dflash_train.model.serving import ARCHITECTURES, load_safetensors
from dflash_train.model.tensor_file import FileRecord, WriteMeter, write_bytes, write_safetensors

CONFIG_FILE = "draft_config.json"
STATE_FILE = "train_state.json"
"""The run's state beside a training checkpoint's drafter (written by `train/checkpoint.py`)."""
WEIGHTS_FILE = "model.safetensors"
FINAL_CHECKPOINT = "checkpoint"
"""The run directory's subdirectory holding its final (or latest) checkpoint."""


def draft_tensors(model: DFlashDraftModel) -> dict[str, torch.Tensor]:
    """Host fp32 copies of the drafter's trainable weights (safe to write while it trains on)."""
    return {
        k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
        for k, v in model.trainable_state_dict().items()
    }


def write_draft(
    directory: str | Path,
    config: DFlashConfig,
    tensors: dict[str, torch.Tensor],
    meter: WriteMeter | None = None,
) -> dict[str, FileRecord]:
    """A drafter's weights (from `draft_tensors`) and its config into `directory`, synced to
    the disk (counted in `meter`); each file's size and sha256, by name."""
    out = Path(directory)
    weights = write_safetensors(out / WEIGHTS_FILE, tensors, {"format": "dflash-train"}, meter)
    text = (json.dumps(config.to_dict(), indent=2) + "\n").encode()
    return {WEIGHTS_FILE: weights, CONFIG_FILE: write_bytes(out / CONFIG_FILE, text, meter)}


def save_draft(directory: str | Path, model: DFlashDraftModel) -> Path:
    """A drafter-only checkpoint directory (what eval and export read), created if needed."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_draft(out, model.config, draft_tensors(model))
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from itself or from a run directory (its final checkpoint)."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file():
        return p
    if (p / FINAL_CHECKPOINT / CONFIG_FILE).is_file():
        return p / FINAL_CHECKPOINT
    raise ValueError(f"{p} is neither a dflash-train checkpoint nor a run directory with one")


def checkpoint_caveat(path: str | Path) -> str | None:
    """Why a training checkpoint's weights may not be what its run agreed on at its end, from
    its STATE_FILE: its replicas diverged (rank 0's weights were saved to keep them), or the run
    stopped before its end (interrupted, failed, rows left untrained). None for a finished run
    (--max-steps included), a periodic save (a mid-run drafter, on purpose) or a directory
    without the file."""
    ckpt = resolve_checkpoint(path)
    if not (ckpt / STATE_FILE).is_file():
        return None
    state = json.loads((ckpt / STATE_FILE).read_text())
    reason, step = state.get("reason"), state.get("step")
    if state.get("replicas_agree") is False:
        return (
            f"{ckpt} (step {step}) was saved because the drafter replicas diverged: these are "
            "rank 0's weights, which the other replicas did not share"
        )
    if state.get("complete") is False and reason not in ("periodic", "finished"):
        return f"{ckpt} is step {step} of a run that did not finish ({reason})"
    return None


def is_checkpoint(path: str | Path) -> bool:
    try:
        resolve_checkpoint(path)
    except ValueError:
        return False
    return True


def load_checkpoint_model(path: str | Path, device: torch.device | str = "cpu") -> DFlashDraftModel:
    """The drafter of a checkpoint or run directory, fp32, in eval mode."""
    ckpt = resolve_checkpoint(path)
    config = DFlashConfig.from_dict(json.loads((ckpt / CONFIG_FILE).read_text()))
    model = DFlashDraftModel(config)
    missing, unexpected = model.load_state_dict(load_safetensors(ckpt / WEIGHTS_FILE), strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {ckpt} does not fit its config: missing {missing}, unexpected {unexpected}"
        )
    return model.to(device).eval()


def load_draft(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_target_layers: int | None = None,
) -> DFlashDraftModel:
    """A drafter from a published directory (an export, z-lab's or vLLM speculators' layout:
    `model/published.py`; `num_target_layers`, the target's depth, for the last, which does not
    record it), a training checkpoint or a run directory."""
    p = Path(path)
    if layout_of(p) is not None:
        return load_published(p, device, dtype, num_target_layers)
    if is_checkpoint(p):
        return load_checkpoint_model(p, device).to(dtype=dtype).eval()
    raise not_a_drafter(p)


def not_a_drafter(path: Path) -> ValueError:
    """The error for a path `load_draft` cannot read a drafter from."""
    if not path.exists():
        return ValueError(f"draft {path} does not exist")
    names = " or ".join(repr(n) for n in ARCHITECTURES.values())
    return ValueError(
        f"{path} is neither an exported drafter (config.json with architectures [{names}], or "
        "vLLM speculators' speculators_model_type dflash) nor a dflash-train checkpoint or run "
        "directory"
    )


# Config fields a drafter's backbone weights mean something only under: equal shapes are not
# enough when the fused features come from other target layers or the mask is another token.
_BACKBONE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_target_layers",
    "target_layer_ids",
    "mask_token_id",
    "rope_parameters",
    "input_embedding_scale",
)


def init_from_draft(model: DFlashDraftModel, path: str | Path) -> DFlashConfig:
    """Copy the weights of the trained drafter at `path` (a published drafter in any layout
    `load_draft` reads, a checkpoint or a run directory) into `model`, which must have the same
    backbone; returns the source's config.

    Weights `model` has and the source lacks must be DFlash 2's modules (a DFlash 1 source):
    they stay as `model` holds them, i.e. at the identity after `init_weights`, so the new
    drafter drafts exactly what the source did. Anything else that differs (a backbone field, a
    weight's shape, DFlash 2 weights `model` has no place for) is one `ValueError`.
    """
    try:
        source = load_draft(path, num_target_layers=model.config.num_target_layers)
    except ValueError as e:
        raise ValueError(f"--init-from: {e}") from None
    mine, theirs = model.config, source.config
    problems = [
        f"{k} {getattr(theirs, k)} there, {getattr(mine, k)} here"
        for k in _BACKBONE_FIELDS
        if getattr(theirs, k) != getattr(mine, k)
    ]
    if not problems:
        problems += _layout_change(theirs, mine)
    ours, given = model.trainable_state_dict(), source.trainable_state_dict()
    if not problems:
        problems += [
            f"{k} {list(given[k].shape)} there, {list(v.shape)} here"
            for k, v in ours.items()
            if k in given and given[k].shape != v.shape
        ]
        extra = sorted(set(given) - set(ours))
        if extra:
            problems.append(f"weights this drafter has no place for: {extra[:4]}")
        missing = sorted(k for k in set(ours) - set(given) if not _is_dflash2_weight(k))
        if missing:
            problems.append(f"backbone weights missing there: {missing[:4]}")
    if problems:
        raise ValueError(
            f"--init-from {path}: its backbone does not match this drafter's: "
            + "; ".join(problems)
        )
    model.load_state_dict(given, strict=False)  # the DFlash 2 modules keep their identity
    return theirs


def attention_layout(config: DFlashConfig) -> list[str]:
    """Each draft layer's attention as it runs: full or sliding (with its window), causal or
    bidirectional inside the block (`layer_causal`, so an unset is_causal reads by its rule)."""
    out = []
    for i in range(config.num_hidden_layers):
        window = config.layer_window(i)
        kind = "full" if window is None else f"sliding {window}"
        out.append(f"{kind} {'causal' if config.layer_causal(i) else 'bidirectional'}")
    return out


def _layout_change(theirs: DFlashConfig, mine: DFlashConfig) -> list[str]:
    """The same weights under another attention layout draft something else: a DFlash 1
    drafter with causal sliding layers warm-starting a DFlash 2 one (bidirectional by its
    contract) would silently change what every layer sees."""
    there, here = attention_layout(theirs), attention_layout(mine)
    if there == here:
        return []
    differ = [
        f"layer {i}: {a} there, {b} here"
        for i, (a, b) in enumerate(zip(there, here, strict=True))
        if a != b
    ]
    return [
        "attention layout (" + ", ".join(differ) + "; give --layer-types, --sliding-window "
        "and --causal-in-block so that every layer attends as it did there)"
    ]


def _is_dflash2_weight(name: str) -> bool:
    return name.startswith("candidate_selector.") or any(
        f".{conv}." in name for conv in ("attention_conv", "mlp_conv")
    )
