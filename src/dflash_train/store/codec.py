"""How one row's features are laid out as bytes in a shard, per store dtype.

A row of n tokens with K layers of `hidden` features is ONE contiguous byte range:

  fp32:  values (n, K * hidden) float32
  bf16:  values (n, K * hidden) bfloat16 (round to nearest even, as torch casts)
  fp8:   values (n, K * hidden) float8 e4m3 (fn variant: no infinities, max 448), then
         scales (n, K) float32: one per token and layer

fp8 scales each (token, layer) vector of `hidden` values by its own absolute maximum, so that
maximum maps to 448: x ~ q * s with s = amax / 448 and q = e4m3(x / s), rounded to nearest even
(torch's cast; values are clamped to +-448 first, so nothing saturates by surprise). A vector of
zeros gets s = 1. A normal e4m3 value carries 3 mantissa bits: the relative error of one value
is at most 2^-4 (6.25%); values below 2^-6 of the vector's scale are subnormal and keep an
absolute error of at most 2^-10 * s. Decoding is q * s in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

StoreDtype = Literal["fp8", "bf16", "fp32"]
STORE_DTYPES: tuple[str, ...] = ("fp8", "bf16", "fp32")
VALUE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}
SCALE_BYTES = 4  # fp8 only: one float32 per token and layer
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TORCH = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


def bytes_per_token(dtype: str, num_layers: int, hidden: int) -> int:
    """Bytes one token takes in a shard: its K * hidden values (and K scales for fp8)."""
    scales = num_layers * SCALE_BYTES if dtype == "fp8" else 0
    return num_layers * hidden * VALUE_BYTES[dtype] + scales


def encode_rows(
    features: torch.Tensor, lengths: Sequence[int], dtype: str, num_layers: int
) -> list[np.ndarray]:
    """The rows of a padded batch, (batch, L, K * hidden) on any device, the first `lengths[r]`
    tokens of row r -> each row's bytes in the shard (host uint8, 1-D). The conversion runs on
    the batch's device (a GPU quantises its own features), then ONE copy of the converted batch
    (1 byte per value for fp8, 2 for bf16) reaches the host."""
    rows, length, width = features.shape
    x = features.detach()
    if dtype != "fp8":
        host = x.to(_TORCH[dtype]).contiguous().view(torch.uint8).cpu().numpy()
        return [host[r, :n].reshape(-1) for r, n in enumerate(lengths)]
    x = x.to(torch.float32).view(rows, length, num_layers, width // num_layers)
    amax = x.abs().amax(dim=-1)  # (batch, L, K)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    values = q.view(torch.uint8).view(rows, length, width).cpu().numpy()
    scales = scale.contiguous().view(torch.uint8).view(rows, length, -1).cpu().numpy()
    return [
        np.concatenate([values[r, :n].reshape(-1), scales[r, :n].reshape(-1)])
        for r, n in enumerate(lengths)
    ]


def encode_row(features: torch.Tensor, dtype: str, num_layers: int) -> np.ndarray:
    """(n, K * hidden) features of one row -> its bytes in the shard (uint8, 1-D)."""
    return encode_rows(features[None], [features.shape[0]], dtype, num_layers)[0]


def decode_row(
    raw: torch.Tensor, n: int, num_layers: int, hidden: int, dtype: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """A row's bytes (uint8, 1-D, on any device) -> (n, K * hidden) in `out_dtype` there."""
    width = num_layers * hidden
    values = raw[: n * width * VALUE_BYTES[dtype]].view(_TORCH[dtype]).view(n, width)
    if dtype != "fp8":
        return values.to(out_dtype)
    scales = raw[n * width :].view(torch.float32).view(n, num_layers, 1)
    # Dequantised in float32 (the scale's precision), then cast once to the compute dtype.
    x = values.view(n, num_layers, hidden).to(torch.float32) * scales
    return x.view(n, width).to(out_dtype)
