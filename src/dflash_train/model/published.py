"""The layouts drafters are published in, read into a `DFlashDraftModel` (`--init-from`, and
`eval` / `export` of a published drafter).

- The serving layout (`model/serving.py`): this project's exports and z-lab's
  `DFlashDraftModel` / `DFlash2DraftModel` checkpoints (`dflash_config`). The reference client
  (PyPI `dflash` 0.1.0) loads them with transformers' `from_pretrained`, which also takes what
  published checkpoints differ in, so this reader takes it too: `mask_token_id` and
  `target_layer_ids` at the top level instead of in `dflash_config`, `block_size` at the top level
  only (older checkpoints), no `layer_types` (derived as Qwen3Config does), weights sharded
  (`model.safetensors.index.json`) or under a `model.` prefix, DFlash 2's codebooks with a
  `.weight` suffix.
- vLLM speculators' layout (`speculators_model_type: "dflash"`): the same draft weights under
  the same names, beside the verifier's `embed_tokens` and `lm_head` copies, and a config that
  nests the decoder's fields in `transformer_layer_config` (under transformers 4.x written as a
  difference from that model type's defaults, so read back through its config class) with
  `aux_hidden_state_layer_ids` in vLLM's hidden-state numbering: id a is the INPUT of decoder
  layer a (0: the embeddings), DFlash's id a - 1 (the numbering speculators' own converter from
  z-lab's layout uses). What is not a DFlash drafter of this kind is refused in one line: a
  reduced draft vocabulary (a head of its own), the anchor slot drafting (DSpark's
  `sample_from_anchor`), Domino's projector, shifted labels, an aux id of 0. It records no
  target layer count: the caller gives the target's.

The target's embedding and LM head are never the drafter's (it uses its target's, frozen), so
copies of them in a checkpoint are left unread (`serving.read_tensors`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from dflash_train.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.serving import (
    ARCHITECTURES,
    CONFIG_FILE,
    config_from_exported,
    load_exported,
)

SPECULATORS_KEY = "speculators_model_type"


def read_json(path: Path) -> dict[str, Any] | None:
    """`path`'s JSON object, None when it is absent or not JSON."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def layout_of(path: str | Path) -> str | None:
    """A directory's layout: "speculators", "serving", or None (not a published drafter)."""
    data = read_json(Path(path) / CONFIG_FILE)
    if data is None:
        return None
    if SPECULATORS_KEY in data:  # before architectures: speculators also names DFlashDraftModel
        return "speculators"
    archs = data.get("architectures") or []
    return "serving" if any(name in archs for name in ARCHITECTURES.values()) else None


def read_config(path: str | Path, num_target_layers: int | None = None) -> DFlashConfig:
    """The `DFlashConfig` of a published drafter directory; `num_target_layers`, the target's
    depth, is what a speculators checkpoint does not record."""
    where = Path(path) / CONFIG_FILE
    data = read_json(where)
    if data is None:
        raise ValueError(f"{where} is missing or not a JSON object")
    if SPECULATORS_KEY in data:
        data = speculators_as_exported(data, num_target_layers, where)
    return config_from_exported(data, where)


# ----------------------------------------------------------------------------- speculators
def speculators_as_exported(
    data: dict[str, Any], num_target_layers: int | None, where: str | Path
) -> dict[str, Any]:
    """A speculators DFlash config.json as the serving layout's config.json says the same."""
    kind = data[SPECULATORS_KEY]
    if kind != "dflash":
        raise ValueError(f"{where}: a speculators {kind!r} checkpoint, not a DFlash drafter")
    layer = _decoder_config(data, where)
    unreadable = _not_dflash(data, layer.vocab_size)
    if unreadable:
        raise ValueError(f"{where}: not readable as a DFlash drafter: {'; '.join(unreadable)}")
    if num_target_layers is None:
        raise ValueError(
            f"{where}: a speculators checkpoint does not record its target's layer count: read "
            "it with `train --init-from` (which takes the target's)"
        )
    ids = [int(i) - 1 for i in data["aux_hidden_state_layer_ids"]]
    window = layer.sliding_window  # None unless use_sliding_window, as its decoder reads it
    heads = layer.num_attention_heads
    block = int(data["block_size"])
    return {
        "architectures": [ARCHITECTURES["dflash"]],
        "model_type": "qwen3",
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_hidden_layers": layer.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": layer.num_key_value_heads or heads,
        "head_dim": getattr(layer, "head_dim", None) or layer.hidden_size // heads,
        "hidden_act": layer.hidden_act,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_parameters": _flat_rope(layer.rope_parameters),
        "max_position_embeddings": layer.max_position_embeddings,
        "vocab_size": layer.vocab_size,
        "layer_types": _layer_types(data, layer, where),
        "use_sliding_window": window is not None,
        "sliding_window": window,
        # Full layers are bidirectional in the block; sliding ones causal unless it says not.
        "is_causal": False if data.get("sliding_window_non_causal") else None,
        "block_size": block,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": data["mask_token_id"], "target_layer_ids": ids},
    }


def _decoder_config(data: dict[str, Any], where: str | Path) -> Any:
    """`transformer_layer_config` through its model type's transformers config class, which
    restores the fields it left out for equalling that class's defaults."""
    from transformers import AutoConfig

    fields = data.get("transformer_layer_config")
    if not isinstance(fields, dict) or not fields:
        raise ValueError(f"{where}: transformer_layer_config is missing")
    fields = dict(fields)
    kind = fields.pop("model_type", "qwen3")
    try:
        return AutoConfig.for_model(kind, **fields)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: transformer_layer_config does not read as {kind}: {e}") from e


def _not_dflash(data: dict[str, Any], vocab: int) -> list[str]:
    """What a speculators DFlash config sets that this drafter cannot be exactly."""
    out = []
    draft_vocab = data.get("draft_vocab_size", vocab)
    if draft_vocab != vocab:
        out.append(
            f"draft_vocab_size {draft_vocab} is not the target's {vocab} (a reduced LM head of "
            "its own; this drafter drafts with the target's whole head)"
        )
    if data.get("sample_from_anchor"):
        out.append("sample_from_anchor is true (the anchor slot drafts too, as DSpark's)")
    if data.get("projector_type", "dflash") != "dflash":
        out.append(f"projector_type {data['projector_type']!r} (only dflash)")
    if data.get("shift_label"):
        out.append("shift_label is true (labels one position later than DFlash's)")
    if data.get("mask_token_id") is None:
        out.append("mask_token_id is missing")
    aux = data.get("aux_hidden_state_layer_ids") or []
    if not aux:
        out.append("aux_hidden_state_layer_ids is missing")
    elif min(aux) < 1:
        out.append(
            "aux_hidden_state_layer_ids has 0, the embeddings: no DFlash layer id reads them"
        )
    if data.get("block_size") is None:
        out.append("block_size is missing")
    return out


def _flat_rope(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """One RoPE: speculators' drafter takes the sliding layers' of per-layer-type settings."""
    if params and all(isinstance(v, dict) for v in params.values()):
        return params.get(SLIDING_ATTENTION) or next(iter(params.values()))
    return params


def _layer_types(data: dict[str, Any], layer: Any, where: str | Path) -> list[str]:
    """The decoder's layer types; a top-level copy (some vLLM versions read that one) must agree."""
    types = list(getattr(layer, "layer_types", None) or [FULL_ATTENTION] * layer.num_hidden_layers)
    top = data.get("layer_types")
    if top is not None and list(top) != types:
        raise ValueError(
            f"{where}: layer_types {top} at the top level, {types} in transformer_layer_config: "
            "readers take either"
        )
    return types


# ----------------------------------------------------------------------------- the drafter
def load_published(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_target_layers: int | None = None,
) -> DFlashDraftModel:
    """A published drafter (see the module docstring) as a `DFlashDraftModel` in eval mode."""
    return load_exported(path, device, dtype, config=read_config(path, num_target_layers))
