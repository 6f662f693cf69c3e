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
absolute error of at most 2^-10 * s. Decoding is q * s in float32, cast once to the compute
dtype, on the device that uses the features: a batch of rows travels in its stored form
(`StagedRows`: 1 byte a value for fp8), padded with zero bytes, which decode to zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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


def encode_batch(
    features: torch.Tensor, dtype: str, num_layers: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A padded batch (batch, L, K * hidden), on any device, in the store's encoding there:
    (values as bytes (batch, L, K * hidden * value bytes) uint8, fp8's scales as bytes
    (batch, L, K * 4) uint8 or None). A GPU quantises its own features."""
    rows, length, width = features.shape
    x = features.detach()
    if dtype != "fp8":
        return x.to(_TORCH[dtype]).contiguous().view(torch.uint8), None
    x = x.to(torch.float32).view(rows, length, num_layers, width // num_layers)
    amax = x.abs().amax(dim=-1)  # (batch, L, K)
    scale = amax / FP8_MAX
    # A zero vector, or one so small its scale underflows to 0: scale 1 (it stores as zeros,
    # within 2^-10 of the smallest scale's error bound). A non-finite one (a target that
    # overflowed): scale NaN, so it reads back NaN whole, as bf16 and fp32 keep it, rather than
    # its other values clamped to +-448 on scale 1, or all NaN from an infinite scale.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scale = torch.where(amax.isfinite(), scale, torch.full_like(scale, float("nan")))
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    values = q.view(torch.uint8).view(rows, length, width)
    return values, scale.contiguous().view(torch.uint8).view(rows, length, -1)


def row_records(
    values: np.ndarray, scales: np.ndarray | None, lengths: Sequence[int]
) -> list[np.ndarray]:
    """Host bytes of an encoded batch (`encode_batch`'s, on the host) -> each row's record in a
    shard (uint8, 1-D): its first `lengths[r]` tokens' values, then their scales (fp8)."""
    if scales is None:
        return [values[r, :n].reshape(-1) for r, n in enumerate(lengths)]
    return [
        np.concatenate([values[r, :n].reshape(-1), scales[r, :n].reshape(-1)])
        for r, n in enumerate(lengths)
    ]


def encode_rows(
    features: torch.Tensor, lengths: Sequence[int], dtype: str, num_layers: int
) -> list[np.ndarray]:
    """The rows of a padded batch, (batch, L, K * hidden) on any device, the first `lengths[r]`
    tokens of row r -> each row's bytes in the shard (host uint8, 1-D). The conversion runs on
    the batch's device, then ONE copy of each converted tensor (1 byte per value for fp8, 2 for
    bf16) reaches the host, on the calling thread's stream."""
    values, scales = encode_batch(features, dtype, num_layers)
    host = scales if scales is None else scales.cpu().numpy()
    return row_records(values.cpu().numpy(), host, lengths)


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
    return _dequantise(values, raw[n * width :].view(torch.float32).view(n, num_layers), out_dtype)


def _dequantise(values: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """fp8 values (n, K * hidden) and their scales (n, K) float32 -> (n, K * hidden) in
    `out_dtype`: dequantised in float32 (the scale's precision), then cast once."""
    n, k = scales.shape
    x = values.view(n, k, -1).to(torch.float32) * scales.view(n, k, 1)
    return x.view(n, -1).to(out_dtype)


@dataclass
class StagedRows:
    """A batch of stored rows in their stored form, in host memory (pinned when a CUDA device
    reads it): `values` (batch, L, K * hidden * value bytes) uint8 and, for fp8, `scales`
    (batch, L, K * 4) uint8, zero past each row's length. The device that uses them copies and
    decodes them (`to_device`), so the host never expands fp8 to float32 and the copy carries
    the stored bytes (1 a value for fp8), not the decoded ones."""

    values: torch.Tensor
    scales: torch.Tensor | None
    dtype: str
    """The store's dtype (fp8, bf16, fp32)."""
    out_dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Host bytes held (what a queue of these holds)."""
        return self.values.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def to_device(self, device: torch.device) -> torch.Tensor:
        """(batch, L, K * hidden) in `out_dtype` on `device`: the bytes copied there on the
        calling thread's current stream (asynchronous from pinned memory), decoded there."""
        values = self.values.to(device, non_blocking=True)
        scales = None if self.scales is None else self.scales.to(device, non_blocking=True)
        return decode_batch(values, scales, self.dtype, self.out_dtype)


def decode_batch(
    values: torch.Tensor, scales: torch.Tensor | None, dtype: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """`StagedRows`' bytes, on any device -> (batch, L, K * hidden) in `out_dtype` there (the
    values `decode_row` gives each row; zero bytes decode to zeros)."""
    typed = values.view(_TORCH[dtype])  # (batch, L, K * hidden)
    if dtype != "fp8":
        return typed.to(out_dtype)
    scale = scales.view(torch.float32)  # (batch, L, K)
    out = torch.empty(typed.shape, dtype=out_dtype, device=typed.device)
    for r in range(typed.shape[0]):  # one row's float32 temporary at a time, not the batch's
        out[r] = _dequantise(typed[r], scale[r], out_dtype)
    return out
