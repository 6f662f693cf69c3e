"""The serving-engine layout of an exported drafter: what SGLang, vLLM and the `dflash` package
load.

An exported drafter is a directory with
  config.json        a Qwen3-style config: architectures ["DFlashDraftModel"], the Qwen3 fields,
                     RoPE settings in both the transformers 5 form (`rope_parameters`) and the 4.x
                     form (`rope_theta`, `rope_scaling`), the attention layout (`layer_types`,
                     `sliding_window`, `use_sliding_window`, `max_window_layers`, `is_causal`),
                     `block_size` at the top level AND in `dflash_config`, `num_target_layers`,
                     and
                     `dflash_config: {mask_token_id, target_layer_ids, block_size}`;
  model.safetensors  the draft-only weights (no embedding, no LM head) with unprefixed names
                     (`layers.0.self_attn.q_proj.weight`, `fc.weight`, ...), bf16 by default.

SGLang (`--speculative-algorithm DFLASH`), vLLM (`"method": "dflash"`, which requires
`dflash_config.mask_token_id`) and `dflash.DFlashDraftModel.from_pretrained` read this layout.
`write_exported` writes it, `load_exported` reads it back (also the official z-lab drafters).

A DFlash 2 drafter (`DFlashConfig.arch == "dflash2"`) is the same layout with
`architectures: ["DFlash2DraftModel"]`, `dflash_config` also holding `conv_kernel_size`,
`conv_group_size`, `selector_rank` and `selector_top_k`, `is_causal: false` written explicitly
(readers take sliding layers as causal when it is absent), and the weights of its modules:
`layers.{i}.attention_conv.base_kernel`, `layers.{i}.attention_conv.kernel_projection.weight`
(the same for `mlp_conv`), `candidate_selector.hidden_projection.weight` and the two codebooks
`candidate_selector.predecessor_codebook` / `successor_codebook` WITHOUT a `.weight` suffix (the
reference client maps them on load). `dflash.DFlash2DraftModel.from_pretrained` reads it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash_train.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_train.model.draft import (
    DFLASH2_DEFAULTS,
    DFlashConfig,
    DFlashDraftModel,
    default_target_layer_ids,
    drafter_rope,
    rope_settings,
)
from dflash_train.model.tensor_file import write_safetensors

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}
"""config.json's architecture name of each `DFlashConfig.arch`."""
PROJECT_KEY = "dflash_train"
"""config.json key of what only this project reads (the training data's chat mode)."""
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
    "num_target_layers",
)


# ----------------------------------------------------------------------------- config.json
def _rope_legacy(rope_parameters: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 4.x form of the RoPE settings: (rope_theta, rope_scaling or None)."""
    params = dict(rope_parameters)
    theta = float(params.pop("rope_theta", 10000.0))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params  # 4.x readers from 4.45 on accept `rope_type` here


def exported_config(config: DFlashConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """The config.json dict of an exported drafter (see the module docstring)."""
    rope_theta, rope_scaling = _rope_legacy(config.rope_parameters)
    dtype_name = str(dtype).removeprefix("torch.")
    sliding = SLIDING_ATTENTION in config.layer_types
    out = {
        "architectures": [ARCHITECTURES[config.arch]],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": dict(config.rope_parameters),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        # The attention layout, written out in full: Qwen3Config drops sliding_window unless
        # use_sliding_window is true, and layer_types (not max_window_layers, which cannot say
        # "sliding below, full on top") decides each layer, as in the official drafters.
        "layer_types": list(config.layer_types),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window,
        "max_window_layers": config.num_hidden_layers,
        "is_causal": _is_causal_field(config),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
            **{k: getattr(config, k) for k in DFLASH2_DEFAULTS if config.is_dflash2},
            # Only for targets that scale their embeddings (Gemma): readers default to 1.0.
            **(
                {"input_embedding_scale": config.input_embedding_scale}
                if config.input_embedding_scale != 1.0
                else {}
            ),
        },
        "dtype": dtype_name,
        # transformers 4.x readers look for the dtype under this name.
        "torch_dtype": dtype_name,
    }
    if config.chat_thinking is not None:
        # This project's own key (engines ignore it): the chat mode the drafter was trained in,
        # so that `eval` of the export encodes prompts as training did.
        out[PROJECT_KEY] = {"chat_thinking": config.chat_thinking}
    return out


def _is_causal_field(config: DFlashConfig) -> bool | None:
    """`is_causal` as readers take it: one value for every layer. When the layers differ (the
    default rule with mixed layers) it is null, which means that same rule to the reference
    client and vLLM."""
    per_layer = {config.layer_causal(i) for i in range(config.num_hidden_layers)}
    return per_layer.pop() if len(per_layer) == 1 else None


# Attention keys in dflash_config that vLLM reads and the reference client does not: a config
# that uses them means different drafters to the two, so it is refused rather than guessed at.
_ENGINE_SPECIFIC = ("causal", "use_swa", "swa_window_size")


def _attention_layout(
    data: dict[str, Any], dflash: dict[str, Any], num_layers: int, where: str | Path
) -> dict[str, Any]:
    """`layer_types`, `sliding_window` and `is_causal` for a `DFlashConfig` from config.json."""
    specific = [k for k in _ENGINE_SPECIFIC if k in dflash]
    if specific:
        raise ValueError(
            f"{where}: dflash_config sets {specific}, which vLLM reads and the reference client "
            "ignores: the two would run different drafters; use layer_types, sliding_window, "
            "use_sliding_window and is_causal"
        )
    layer_types = data.get("layer_types") or _derived_layer_types(data, num_layers)
    unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unknown:
        raise ValueError(f"{where}: unsupported draft layer types {unknown}")
    window = None
    if SLIDING_ATTENTION in layer_types:
        window = data.get("sliding_window")
        if not data.get("use_sliding_window") or window is None:
            raise ValueError(
                f"{where}: layer_types has sliding_attention layers but use_sliding_window is "
                f"{data.get('use_sliding_window')!r} and sliding_window {window!r}: readers "
                "disagree on what that means (the reference client runs them causal with no "
                "window, vLLM refuses them)"
            )
        window = int(window)
    is_causal = data.get("is_causal")
    if is_causal is not None:
        is_causal = bool(is_causal)
        # A value that only restates the default rule (e.g. false for all-full layers, as
        # `exported_config` writes it) is the default: round trips give the same config.
        if all((t == SLIDING_ATTENTION) == is_causal for t in layer_types):
            is_causal = None
    return {"layer_types": list(layer_types), "sliding_window": window, "is_causal": is_causal}


def _derived_layer_types(data: dict[str, Any], num_layers: int) -> list[str]:
    """A config without `layer_types` (transformers 4.x wrote none) means what transformers'
    Qwen3Config, and so the reference client, derives: with `use_sliding_window` and a
    `sliding_window`, the layers from `max_window_layers` (28 when absent) on slide."""
    window = data.get("sliding_window") if data.get("use_sliding_window") else None
    first = data.get("max_window_layers", 28)
    return [
        SLIDING_ATTENTION if window is not None and i >= first else FULL_ATTENTION
        for i in range(num_layers)
    ]


def _architecture_of(data: dict[str, Any], where: str | Path) -> str:
    """The `DFlashConfig.arch` a config.json's `architectures` names."""
    archs = data.get("architectures") or []
    found = [arch for arch, name in ARCHITECTURES.items() if name in archs]
    if len(found) != 1:
        names = " or ".join(repr(n) for n in ARCHITECTURES.values())
        raise ValueError(
            f"{where}: architectures is {archs or 'missing'}, not [{names}]: not an exported "
            "DFlash drafter"
        )
    return found[0]


# Optional config values of the logits (read from dflash_config or the top level, as the
# reference client does) with the value that means "not used": this project's drafters never
# use them.
_UNSUPPORTED_SCALES = {"output_multiplier": 1.0, "final_logit_softcapping": 0.0}


def _input_embedding_scale(
    data: dict[str, Any], dflash: dict[str, Any], where: str | Path
) -> float:
    """`input_embedding_scale` of an exported config (1.0 when absent), refusing the optional
    scalings of the logits."""
    used = {}
    for key, neutral in _UNSUPPORTED_SCALES.items():
        value = dflash.get(key, data.get(key))
        if value is not None and float(value) != neutral:
            used[key] = value
    if used:
        raise ValueError(
            f"{where}: {used} are not supported (this project trains and evaluates drafters "
            "whose logits are the target head's, unscaled and uncapped)"
        )
    scale = float(dflash.get("input_embedding_scale", data.get("input_embedding_scale")) or 1.0)
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"{where}: input_embedding_scale must be a positive number, got {scale}")
    return scale


def _dflash2_sizes(dflash: dict[str, Any], where: str | Path) -> dict:
    """The DFlash 2 fields of an exported config."""
    missing = [k for k in DFLASH2_DEFAULTS if dflash.get(k) is None]
    if missing:
        raise ValueError(f"{where}: a DFlash2DraftModel needs dflash_config.{missing}")
    return {k: int(dflash[k]) for k in DFLASH2_DEFAULTS}


def _top_level_dflash_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`mask_token_id` and `target_layer_ids` where a config has them at the top level."""
    return {k: data[k] for k in ("mask_token_id", "target_layer_ids") if k in data}


def config_from_exported(data: dict[str, Any], where: str | Path = "config.json") -> DFlashConfig:
    """A `DFlashConfig` from an exported config.json dict (this project's or z-lab's), DFlash 1
    or DFlash 2."""
    arch = _architecture_of(data, where)
    missing = [k for k in REQUIRED_FIELDS if data.get(k) is None]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    # The reference client reads these from dflash_config first, then from the top level
    # (published configs have used both); vLLM needs dflash_config's, which the export writes.
    dflash = {**_top_level_dflash_fields(data), **(data.get("dflash_config") or {})}
    if dflash.get("mask_token_id") is None:
        raise ValueError(
            f"{where}: mask_token_id is missing (neither dflash_config.mask_token_id nor a "
            "top-level mask_token_id)"
        )
    num_layers = int(data["num_hidden_layers"])
    num_target_layers = int(data["num_target_layers"])
    # Same fallback as the reference client when a config omits the ids: one feature per layer.
    layer_ids = dflash.get("target_layer_ids") or default_target_layer_ids(
        num_target_layers, num_layers
    )
    heads = int(data["num_attention_heads"])
    return DFlashConfig(
        hidden_size=int(data["hidden_size"]),
        intermediate_size=int(data["intermediate_size"]),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or int(data["hidden_size"]) // heads),
        vocab_size=int(data["vocab_size"]),
        num_target_layers=num_target_layers,
        target_layer_ids=layer_ids,
        mask_token_id=int(dflash["mask_token_id"]),
        block_size=int(dflash.get("block_size", data.get("block_size", 16))),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_parameters=_rope_parameters_of(data, where),
        max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
        hidden_act=data.get("hidden_act", "silu"),
        **_attention_layout(data, dflash, num_layers, where),
        arch=arch,
        input_embedding_scale=_input_embedding_scale(data, dflash, where),
        **(_dflash2_sizes(dflash, where) if arch == "dflash2" else {}),
        chat_thinking=(data.get(PROJECT_KEY) or {}).get("chat_thinking"),
    )


def _rope_parameters_of(data: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """The drafter's RoPE settings from an exported config; a rotation-changing field (which this
    project, like the reference client, does not apply) is dropped with a warning, since vLLM
    would apply it."""
    params, dropped = drafter_rope(
        rope_settings(
            data.get("rope_parameters"),
            data.get("rope_scaling"),
            data.get("rope_theta"),
            data.get("partial_rotary_factor"),
        )
    )
    if dropped:
        warnings.warn(
            f"{where}: RoPE fields {dropped} are ignored: this project and the reference client "
            "rotate the full head dimension, vLLM would apply them (its acceptance may differ)",
            stacklevel=2,
        )
    return params


# ----------------------------------------------------------------------------- writing
def write_exported(
    model: DFlashDraftModel, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """`model`'s trainable weights in `dtype` and its config.json, into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().to(device="cpu", dtype=dtype).contiguous()
        for k, v in model.trainable_state_dict().items()
    }
    # Written by `write_safetensors`, not safetensors' save_file: that one makes the file
    # owner-only (0600, safetensors 0.8), and an engine running as another user (a container's
    # uid) could not read the weights; this one leaves the permissions to the umask, as every
    # other file of the export and of a checkpoint.
    write_safetensors(out / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    config = exported_config(model.config, dtype)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------- reading
def is_exported(path: str | Path) -> bool:
    """Whether `path` holds a config.json naming the DFlashDraftModel or DFlash2DraftModel
    architecture."""
    cfg = Path(path) / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError:
        return False
    return any(name in (data.get("architectures") or []) for name in ARCHITECTURES.values())


WEIGHTS_INDEX = "model.safetensors.index.json"
NOT_THE_DRAFTERS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight")
"""The target's (or verifier's) weights a published checkpoint may carry beside the drafter's:
the drafter uses its target's own, so these are left unread."""
NOT_DRAFTING = ("verifier_norm.weight",)
"""vLLM speculators' norm of the verifier's last hidden state (its training targets' only)."""
_CODEBOOK_ALIASES = {
    f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
    for name in ("predecessor_codebook", "successor_codebook")
}


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a drafter: `model.safetensors`, or the shards its index names."""
    index_path = path / WEIGHTS_INDEX
    if index_path.is_file():
        try:
            shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError, TypeError):
            raise ValueError(f"{index_path} is not a safetensors index (a weight_map)") from None
        missing = [s for s in shards if not (path / s).is_file()]
        if not shards or missing:
            raise ValueError(f"{index_path}: shards missing: {missing or 'none listed'}")
        return [path / s for s in shards]
    if not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path} has no {WEIGHTS_FILE}")
    return [path / WEIGHTS_FILE]


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; one that cannot be parsed (cut short, or not safetensors
    at all) is a `ValueError` naming it."""
    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(
            f"{path} is truncated or corrupt: it cannot be read as safetensors ({e})"
        ) from None


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A drafter's weights under the export's names, in the forms published checkpoints take
    (the reference client loads them all through transformers' `from_pretrained`): sharded, under
    a `model.` prefix (SGLang accepts it too), the codebooks with a `.weight` suffix, beside
    copies of the target's embedding and head (left unread). A vocabulary mapping (speculators'
    `t2d` / `d2t`: a reduced head of the drafter's own) is refused."""
    p = Path(path)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(p):
        state.update(load_safetensors(file))
    if "t2d" in state or "d2t" in state:
        raise ValueError(
            f"{p}: a vocabulary mapping (t2d / d2t), i.e. a reduced draft vocabulary with a head "
            "of its own: this drafter drafts with the target's whole head"
        )
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name not in NOT_THE_DRAFTERS and name not in NOT_DRAFTING:
            out[_CODEBOOK_ALIASES.get(name, name)] = tensor
    return out


def load_exported(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    config: DFlashConfig | None = None,
) -> DFlashDraftModel:
    """An exported drafter as a `DFlashDraftModel` in eval mode (weights cast to `dtype`);
    `config`: its config when read otherwise than from its config.json (another layout's)."""
    p = Path(path)
    if config is None:
        if not (p / CONFIG_FILE).is_file():
            raise ValueError(f"{p} has no {CONFIG_FILE}: not an exported drafter")
        config = config_from_exported(json.loads((p / CONFIG_FILE).read_text()), p / CONFIG_FILE)
    state = read_tensors(p)
    model = DFlashDraftModel(config)
    expected = set(model.trainable_state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{p}: its weights do not fit its config: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    model.load_state_dict(state, strict=False)  # strict=False: the RoPE buffer is not stored
    return model.to(device=device, dtype=dtype).eval()
