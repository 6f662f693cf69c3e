"""What differs between the torch and transformers versions users have, in one place.

The supported range is declared in pyproject.toml and tested at both ends
(`scripts/lowest_versions.py` builds a venv at the lowest and runs the default suite). Inside
that range the code paths that depend on the version are decided here, by what the installed
library offers (a signature, an attribute), not by comparing version strings where that can
be avoided:

- **The cache argument of a causal LM's forward.** transformers 5.24 renamed
  `past_key_values` to `cache` (the old name is deprecated, removed in 5.40); an older release
  puts `cache=` into `**kwargs` and silently runs without a cache. `cache_kwargs` names the one
  the model's own `forward` declares.
- **Cropping a cache.** transformers >= 5.17 crops by the number of tokens to remove
  (`crop(-n)`; `crop(0)` also trims a recorded sliding window back to its working size); an
  older release crops to a length (`crop(max_length)`, where `crop(0)` empties the cache).
  `crop_cache` keeps the first `length` positions either way.
- **Families newer than the installed transformers.** `require_family` refuses a target whose
  model type the installed release cannot build, in one line naming the release that can
  (`FAMILY_MIN_TRANSFORMERS`).
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from torch import nn

MIN_TRANSFORMERS = "5.0.0"
"""The lowest transformers release the plain families (Llama, Qwen3, Qwen3-MoE, Mistral,
Qwen2, OLMo 2, Phi-3, GLM-4-MoE, DeepSeek-V3) are tested with; pyproject.toml declares the
same bound."""

_NEEDS_5_15 = "5.15.0"
"""Below it, the target zoo's speculative decoding drifts from greedy (or fails) for these
families (measured at 5.0, 5.2, 5.4, 5.5, 5.10.4, 5.13.1 and 5.14.1; exact at 5.15.0, 5.15.1,
5.17.0 and 5.24.0): a sliding window can be rolled back after a rejected block only with past
recording (5.14) and cropping by tokens removed (5.15), and the linear-attention layers'
recurrent states are where the rollback finds them from 5.15. Qwen3.5 has no class before
5.2."""

REFERENCE_CLIENT_MIN_TRANSFORMERS = _NEEDS_5_15
"""The reference client (PyPI `dflash` 0.1.0, installed --no-deps) builds its caches with
`activate_past_recording` (5.14) and crops them by tokens removed (5.15); its own pins ask
for 5.15. Its parity tests are skipped below it."""

FAMILY_MIN_TRANSFORMERS: dict[str, str] = dict.fromkeys(
    ("qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3", "gemma3_text", "gpt_oss"), _NEEDS_5_15
)
"""model_type (the checkpoint's config.json) -> the lowest transformers release that serves
that family correctly, for the families that need more than `MIN_TRANSFORMERS`."""


def version_tuple(version: str) -> tuple[int, ...]:
    """(5, 17, 0) from "5.17.0", "5.17.0.dev0", "5.17.0rc1" or "2.11.0+cu130": the release's
    numbers (a pre-release counts as its release)."""
    numbers = []
    for part in version.split("+")[0].split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        numbers.append(int(m.group()))
        if m.end() < len(part):  # "0rc1": the rest is a pre-release tag
            break
    return tuple(numbers)


def transformers_version() -> str:
    """The installed transformers release."""
    import transformers

    return transformers.__version__


def family_supported(model_type: str) -> bool:
    """Whether the installed transformers builds `model_type` targets correctly."""
    need = FAMILY_MIN_TRANSFORMERS.get(model_type)
    return need is None or version_tuple(transformers_version()) >= version_tuple(need)


def require_family(model_type: str) -> None:
    """Refuse, in one line naming the release it needs, a target family that the installed
    transformers cannot build (the caller turns the ValueError into its own error kind)."""
    if not family_supported(model_type):
        need, have = FAMILY_MIN_TRANSFORMERS[model_type], transformers_version()
        raise ValueError(
            f"a {model_type!r} target needs transformers>={need} (installed: {have}): "
            f"pip install 'transformers>={need}'"
        )


def cache_kwargs(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that hands `cache` to `model`'s forward: `cache` where the forward declares
    it (transformers >= 5.24), else `past_key_values`."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile wrapper: the model inside
    return {"cache": cache} if _declares_cache(type(model)) else {"past_key_values": cache}


@functools.cache
def _declares_cache(cls: type[nn.Module]) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (with the new convention,
    also trim recorded sliding windows back to their working size)."""
    if "max_length" in inspect.signature(cache.crop).parameters:
        if length < cache.get_seq_length():  # the old convention: crop(0) would empty it
            cache.crop(length)
        return
    cache.crop(-(cache.get_seq_length() - length))
