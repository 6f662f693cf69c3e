"""The stream tests of `tests/cuda` can fail: their long computations keep values of order one
(a read that races the kernels then sees wrong numbers), where the old inputs shrank to
1e-17..1e-33 and passed against unfinished zeros. Checked on CPU at a smaller size."""

from __future__ import annotations

import torch

from device_values import chain, orthogonal


def test_the_chains_keep_their_size_however_long():
    n = 256
    q = orthogonal(n)
    for steps in (10, 20, 200):
        out = chain(q, q, steps)
        # Unit rows stay unit rows: entries about 1 / sqrt(n), far above assert_close's atol.
        torch.testing.assert_close(out.norm(dim=1), torch.ones(n), atol=1e-3, rtol=1e-3)
        assert out.abs().mean() > 0.5 / n**0.5


def test_the_old_inputs_vanished_which_is_why_they_could_not_fail():
    n = 256
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    out = a
    for _ in range(10):
        out = out @ a / n
    zeros = torch.zeros_like(out)
    torch.testing.assert_close(out, zeros, atol=1e-5, rtol=1e-5)  # "passes" on zeros
    q = orthogonal(n)
    assert not torch.allclose(chain(q, q, 10), zeros, atol=1e-5, rtol=1e-5)
