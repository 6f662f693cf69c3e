"""A row's bytes per store dtype: fp32 exact, bf16 as torch casts, fp8 e4m3 with one scale per
token and layer within its stated error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.store.codec import (
    FP8_MAX,
    bytes_per_token,
    decode_row,
    encode_row,
    encode_rows,
)

K, H, N = 3, 64, 11


def features(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Layers of very different scales, as a real target's residual stream grows with depth.
    scales = torch.tensor([0.05, 1.0, 40.0]).repeat_interleave(H)
    return torch.randn(N, K * H, generator=g) * scales


def roundtrip(x: torch.Tensor, dtype: str) -> torch.Tensor:
    raw = torch.from_numpy(encode_row(x, dtype, K))
    assert raw.numel() == N * bytes_per_token(dtype, K, H)
    return decode_row(raw, N, K, H, dtype, torch.float32)


def test_fp32_is_exact_and_bf16_is_torchs_cast():
    x = features()
    assert torch.equal(roundtrip(x, "fp32"), x)
    assert torch.equal(roundtrip(x, "bf16"), x.to(torch.bfloat16).float())


def test_fp8_has_one_scale_per_token_and_layer_and_the_stated_error():
    x = features()
    y = roundtrip(x, "fp8")
    xs, ys = x.view(N, K, H), y.view(N, K, H)
    scale = xs.abs().amax(-1, keepdim=True) / FP8_MAX  # (N, K, 1)
    err = (xs - ys).abs()
    # Normal range: at most half a unit in the last place of 3 mantissa bits (2^-4 relative);
    # subnormal range (below 2^-6 of the scale): at most 2^-10 of the scale.
    bound = torch.maximum(xs.abs() * 2**-4, scale * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    # The largest value of every (token, layer) vector is exact: it maps to 448.
    idx = xs.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(ys.gather(-1, idx), xs.gather(-1, idx), rtol=1e-6, atol=0)
    # Per-layer scales: the small layer keeps its relative precision beside the large one.
    rel = (err.pow(2).sum(-1) / xs.pow(2).sum(-1)).sqrt()  # (N, K)
    assert rel.max() < 0.05


def test_fp8_of_a_zero_vector_is_zero_and_finite():
    x = torch.zeros(N, K * H)
    y = roundtrip(x, "fp8")
    assert torch.equal(y, x)


def test_fp8_keeps_a_non_finite_vector_non_finite_and_a_tiny_one_finite():
    # Regression: a NaN made the scale 1 (its neighbours clamped to +-448 or rounded on an
    # absolute scale), an inf made every value NaN, and an amax under ~6e-43 made the scale 0
    # and its zeros NaN (0 / 0).
    x = features()
    x[0, 5], x[1, H + 2], x[2, 2 * H] = float("nan"), float("inf"), -float("inf")
    x[3, :H] = 1e-44
    y = roundtrip(x, "fp8").view(N, K, H)
    xs = x.view(N, K, H)
    assert y[0, 0].isnan().all() and y[1, 1].isnan().all() and y[2, 2].isnan().all()
    assert y[3, 0].isfinite().all() and (y[3, 0].abs() <= 1e-44).all()
    finite = xs.isfinite().all(-1)  # every other (token, layer) vector decodes as before
    finite[3, 0] = False
    assert torch.equal(y[finite], roundtrip(features(), "fp8").view(N, K, H)[finite])


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_decoding_casts_to_the_compute_dtype(dtype):
    raw = torch.from_numpy(encode_row(features(), dtype, K))
    assert decode_row(raw, N, K, H, dtype, torch.bfloat16).dtype == torch.bfloat16


def test_bytes_per_token_for_real_shapes():
    # Qwen3-8B, 5 layers of 4096: 20,480 fp8 values + 5 fp32 scales; twice the values in bf16.
    assert bytes_per_token("fp8", 5, 4096) == 20_500
    assert bytes_per_token("bf16", 5, 4096) == 40_960
    assert bytes_per_token("fp32", 5, 4096) == 81_920


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_a_padded_batch_encodes_each_row_as_that_row_alone(dtype):
    lengths = [N, 4, 7]
    batch = torch.stack([features(s) for s in range(3)])  # (3, N, K * H), rows 1, 2 padded
    rows = encode_rows(batch, lengths, dtype, K)
    for r, n in enumerate(lengths):
        assert np.array_equal(rows[r], encode_row(batch[r, :n], dtype, K))
