"""Target families: what differs between the causal LMs users bring, in one place.

Everything a target family changes about loading the target is decided here, from the
checkpoint's config and the names of its weights, never inside the pipeline or the drafter:

- **Where the language model is.** A plain causal LM (`Qwen3ForCausalLM`, `GptOssForCausalLM`,
  `DeepseekV3ForCausalLM`, ...) is loaded as it is. A multimodal checkpoint whose text part is a
  causal LM (Qwen3.5 / Qwen3.6 `Qwen3_5*ForConditionalGeneration`, Gemma 3
  `Gemma3ForConditionalGeneration`, and the same pattern elsewhere) is loaded as its text-only
  causal LM: the config is its `text_config`, the weights are renamed from the wrapper's prefix
  (`model.language_model.*` or `language_model.model.*`, and `language_model.lm_head.*`), and
  the vision tower is never built nor read. The prefix is read off the checkpoint's weight names.
- **Attention implementation.** SDPA where the model class has it, else the implementation
  its config names, else eager (gpt-oss has no SDPA in transformers); printed once per class.
- **Quantised checkpoints.** gpt-oss stores its experts in MXFP4: they are dequantised on load to
  the target dtype (`mxfp4_dequantised_bytes` says how much memory that takes); other
  quantisation methods load as transformers loads them.
- **MLA's key/value heads.** `num_key_value_heads` of an MLA config is set to its query heads
  (`_one_kv_head_per_query_head`).
- **The input embedding scale.** Gemma multiplies its token embeddings by sqrt(hidden) inside
  its embedding module; the drafter embeds its block with the raw rows, so it must apply the
  same scale (`input_embedding_scale`), exported as `dflash_config.input_embedding_scale`, which
  the reference client and vLLM's DFlash 2 read. Measured, not assumed: `check_embedding_scale`
  compares what the loaded target's first layer receives with the raw rows times the scale.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_train.model.compat import require_family


class TargetLoadError(ValueError):
    """The target directory cannot be used; the message says why."""


TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
"""Where wrappers keep their language model's decoder (`model.` in a text-only causal LM)."""
HEAD_PREFIXES = ("language_model.lm_head.",)
"""Where wrappers keep their language model's LM head (`lm_head.` in a text-only causal LM)."""


@dataclass(frozen=True)
class TargetLayout:
    """How to load one target directory's language model.

    text: the causal LM's config (the checkpoint's own config, or a wrapper's `text_config`).
    wrapper: the wrapper's model type ("qwen3_5_moe", "gemma3", ...) when the language model is
        the text part of a multimodal checkpoint, else None.
    key_mapping: regex -> replacement renaming the checkpoint's weights to the text-only causal
        LM's names (empty for a plain causal LM).
    """

    path: Path
    text: Any
    wrapper: str | None = None
    key_mapping: dict[str, str] = field(default_factory=dict)

    @property
    def model_class(self) -> type[nn.Module]:
        """The text-only causal LM class transformers maps the text config to."""
        return causal_lm_class(self.text)


def causal_lm_class(text_config: Any) -> type[nn.Module]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(text_config)]
    except KeyError:
        raise TargetLoadError(
            f"transformers has no causal LM class for a {text_config.model_type!r} config"
        ) from None


def read_target_layout(path: str | Path, trust_remote_code: bool = False) -> TargetLayout:
    """The layout of the target in `path`, or one `TargetLoadError` saying why it is not a
    causal language model this trainer can load."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise TargetLoadError(f"target {p} is a file, not a model directory")
    if not p.is_dir():
        raise TargetLoadError(f"target directory {p} does not exist")
    if not (p / "config.json").is_file():
        raise TargetLoadError(f"{p} has no config.json: not a Hugging Face model directory")
    _require_transformers_for(p / "config.json")
    try:
        config = AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises several kinds here; one message for the user
        raise TargetLoadError(f"cannot read the model config in {p}: {e}") from e
    archs = getattr(config, "architectures", None) or []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config and text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        layout = TargetLayout(p, text, config.model_type, _wrapper_key_mapping(p))
    else:
        if archs:  # what the checkpoint says it is wins over what its model type could be
            is_lm = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
        else:
            is_lm = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if not is_lm:
            raise TargetLoadError(
                f"{p} holds a {config.model_type!r} model ({archs or 'no architectures'}), not a "
                "causal language model (nor a multimodal model whose text part is one)"
            )
        layout = TargetLayout(p, config)
    for name in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if getattr(layout.text, name, None) is None:
            raise TargetLoadError(f"the config in {p} has no {name}")
    _one_kv_head_per_query_head(layout.text)
    return layout


def _require_transformers_for(config_file: Path) -> None:
    """Refuse, before transformers reads it, a family the installed release cannot serve."""
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (OSError, ValueError) as e:
        raise TargetLoadError(f"cannot read {config_file}: {e}") from e
    try:
        require_family(str(model_type))
    except ValueError as e:
        raise TargetLoadError(str(e)) from None


def _one_kv_head_per_query_head(text: Any) -> None:
    """MLA (DeepSeek-V3, Kimi K2: `kv_lora_rank` set) expands its latent into keys and values
    for EVERY query head, so `num_key_value_heads` can only mean `num_attention_heads`.
    transformers' attention nevertheless repeats the expanded keys by heads // kv heads when a
    cache is passed, which fails (or, for a divisor, is wrong) on a config that says fewer: it
    is set to the query heads, which changes nothing else (no weight depends on it)."""
    if getattr(text, "kv_lora_rank", None) and getattr(text, "num_key_value_heads", None):
        text.num_key_value_heads = text.num_attention_heads


def weight_names(path: Path) -> list[str]:
    """Names of the checkpoint's tensors, from its index or safetensors header (no data read)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return list(f.keys())
    return []


def _wrapper_key_mapping(path: Path) -> dict[str, str]:
    """Renames from a wrapper's weight names to its text-only causal LM's."""
    names = weight_names(path)
    mapping = {}
    for prefix in TEXT_PREFIXES:
        if any(n.startswith(prefix) for n in names):
            mapping["^" + prefix.replace(".", r"\.")] = "model."
    for prefix in HEAD_PREFIXES:
        if any(n.startswith(prefix + "weight") for n in names):
            mapping["^" + prefix.replace(".", r"\.")] = "lm_head."
    return mapping


# ----------------------------------------------------------------------------- attention
_ANNOUNCED: set[tuple[str, str]] = set()


def attention_implementation(layout: TargetLayout) -> str:
    """SDPA where the model class has it, else what the config names, else eager; said once
    per (class, choice) on stderr, so a user sees why a target runs the slower eager path."""
    try:
        cls = layout.model_class
    except TargetLoadError:  # remote code: transformers asks the class itself
        return "sdpa"
    named = getattr(layout.text, "_attn_implementation_internal", None)
    if getattr(cls, "_supports_sdpa", False):
        choice, why = "sdpa", None
    elif named and named != "sdpa":
        choice, why = named, f"{cls.__name__} has no SDPA attention; its config names {named}"
    else:
        choice, why = "eager", f"{cls.__name__} has no SDPA attention in transformers"
    key = (cls.__name__, choice)
    if why and key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        print(f"[dflash-train] target attention: {choice} ({why})", file=sys.stderr)
    return choice


# ----------------------------------------------------------------------------- quantisation
def quantization_method(layout: TargetLayout) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, None when unquantised."""
    q = getattr(layout.text, "quantization_config", None)
    if q is None:  # a wrapper keeps it at the top level
        from transformers import AutoConfig

        q = getattr(AutoConfig.from_pretrained(layout.path), "quantization_config", None)
    if q is None:
        return None
    return q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)


def mxfp4_dequantised_bytes(layout: TargetLayout, dtype: torch.dtype) -> int:
    """Bytes the target's weights take once MXFP4 blocks are dequantised to `dtype`: each
    `*_blocks` byte holds two 4-bit values (scales are dropped); other tensors as stored."""
    from safetensors import safe_open

    files = sorted(layout.path.glob("*.safetensors"))
    total = 0
    for file in files:
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118
                sl = f.get_slice(name)
                numel = math.prod(sl.get_shape())
                if name.endswith("_blocks"):
                    total += 2 * numel * dtype.itemsize
                elif not name.endswith("_scales"):
                    total += numel * _SAFETENSORS_ITEMSIZE.get(sl.get_dtype(), 4)
    return total


_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1}


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device, None elsewhere (no limit is checked on the host)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def load_kwargs(
    layout: TargetLayout, dtype: torch.dtype, device: torch.device | None = None
) -> dict[str, Any]:
    """Extra `from_pretrained` arguments for this family: the wrapper's renames and, for an
    MXFP4 checkpoint, dequantisation on load (said once, with the memory it takes; refused in
    one line when `device` has less memory free)."""
    kwargs: dict[str, Any] = {"attn_implementation": attention_implementation(layout)}
    if layout.key_mapping:
        kwargs["key_mapping"] = dict(layout.key_mapping)
    if quantization_method(layout) == "mxfp4":
        from transformers import Mxfp4Config

        need = mxfp4_dequantised_bytes(layout, dtype)
        free = device_free_bytes(device) if device is not None else None
        if free is not None and need > free:
            raise TargetLoadError(
                f"{layout.path} holds MXFP4 experts that take {need / 2**30:.1f} GiB once "
                f"dequantised to {dtype}, and {device} has {free / 2**30:.1f} GiB free: put the "
                "target on a device with more memory, or serve it from an engine that runs "
                "MXFP4 natively (--target-backend vllm)"
            )
        key = (str(layout.path), "mxfp4")
        if key not in _ANNOUNCED:
            _ANNOUNCED.add(key)
            print(
                f"[dflash-train] target weights: MXFP4 experts dequantised to {dtype} on load "
                f"({need / 2**30:.1f} GiB in all)",
                file=sys.stderr,
            )
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    return kwargs


@torch.no_grad()
def match_dequantised_dtype(model: nn.Module, layout: TargetLayout, dtype: torch.dtype) -> None:
    """Give MXFP4-dequantised weights the run's dtype: transformers < 5.24 dequantises them to
    bf16 whatever dtype was asked for. Exact (bf16 holds every 4-bit value times its
    power-of-two scale); only the weights stored as `*_blocks` are touched."""
    if quantization_method(layout) != "mxfp4":
        return
    stored = [n.removesuffix("_blocks") for n in weight_names(layout.path) if n.endswith("_blocks")]
    for name, param in model.named_parameters():
        # Names end alike whatever prefix a wrapper's renames (`key_mapping`) changed.
        tail = "." + name.split(".", 1)[-1]
        if param.dtype != dtype and any(n.endswith(tail) for n in stored):
            param.data = param.data.to(dtype)


# ----------------------------------------------------------------------------- embeddings
def input_embedding_scale(layout: TargetLayout) -> float:
    """The factor the target's embedding module multiplies its rows by (Gemma: sqrt(hidden)),
    1.0 for a plain embedding. Read off the module transformers builds for this config, built
    on the meta device with one layer (no memory, no weights)."""
    try:
        cls = layout.model_class
    except TargetLoadError:  # remote code: `check_embedding_scale` verifies 1.0 on load
        return 1.0
    text = copy.deepcopy(layout.text)
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types[:1])
    with torch.device("meta"):
        model = cls._from_config(text)
    scale = getattr(model.get_input_embeddings(), "scalar_embed_scale", None)
    return 1.0 if scale is None else float(scale)


class _Stop(Exception):
    """Raised by a probe hook once it has what it needs (the rest of the forward is skipped)."""


@torch.no_grad()
def check_embedding_scale(model: nn.Module, decoder: nn.Module, scale: float) -> None:
    """Refuse a target whose first decoder layer does not receive its raw embedding rows
    times `scale`: the drafter would embed its blocks differently than the target does."""
    weight = model.get_input_embeddings().weight
    ids = torch.tensor([[0, min(1, weight.shape[0] - 1)]], device=weight.device)
    seen: list[torch.Tensor] = []

    def grab(_module, args, kwargs):
        seen.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    handle = decoder.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        decoder(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    want = nn.functional.embedding(ids, weight).float() * scale
    got = seen[0].float()
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-3 * float(want.abs().max()) + 1e-6):
        ratio = float(got.norm() / weight[ids].float().norm())
        raise TargetLoadError(
            f"{type(model).__name__}'s first layer receives its token embeddings times about "
            f"{ratio:.4g}, not the {scale:.4g} this trainer applies to the drafter's block "
            "embeddings: a target family whose embeddings this trainer does not know"
        )
