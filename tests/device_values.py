"""Inputs for the stream-ordering tests of `tests/cuda`: long chains of matmuls whose values
stay of order one, so a read that races the kernels sees wrong values, not 1e-30 against 0.

Multiplying by an orthogonal matrix keeps every row's norm: after any number of steps the rows
of `chain(x, q, k)` have x's norms (entries about 1 / sqrt(n) for unit rows), whereas `x @ a / n`
with a Gaussian `a` shrinks by about sqrt(n) per step and reaches 1e-17..1e-33 in 10-20 steps.
"""

from __future__ import annotations

import torch


def orthogonal(n: int, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """A random (n, n) orthogonal matrix on `device` (made on the CPU: the same everywhere)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q.float().to(device)


def chain(x: torch.Tensor, q: torch.Tensor, steps: int) -> torch.Tensor:
    """x @ q @ q ... (`steps` times): the long computation a racing read must not see half of."""
    for _ in range(steps):
        x = x @ q
    return x
