"""The drafter's optimizers: the project's Muon equals torch.optim.Muon, and its step split
over replicas (each orthogonalises its share, the shares summed) equals the unsplit step."""

from __future__ import annotations

import torch

from dflash_train.train import optimizers
from dflash_train.train.optimizers import (
    Muon,
    balanced_shares,
    orthogonalise_flops,
)

SHAPES = [(64, 32), (32, 64), (48, 48), (96, 16), (8, 8), (64, 320)]


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def test_muon_is_torchs_muon_bit_for_bit():
    ours, theirs = params(), params()
    a = Muon(ours, lr=0.02, weight_decay=0.1)
    b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(4):
        for p, q, gr in zip(ours, theirs, grads(step), strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        a.step()
        b.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)
        assert torch.equal(a.state[p]["momentum_buffer"], b.state[q]["momentum_buffer"])


def test_a_step_split_over_replicas_and_summed_equals_the_unsplit_step(monkeypatch):
    """Each of 3 replicas orthogonalises only its share; the summed shares give every replica
    the unsplit step's weights and momentum, bit for bit."""
    parts = 3
    whole = params()
    reference = Muon(whole, lr=0.02)
    replicas = [params() for _ in range(parts)]
    opts = [Muon(ps, lr=0.02) for ps in replicas]
    owners = balanced_shares(SHAPES, parts)
    calls: list[int] = []
    real = optimizers.orthogonalise
    monkeypatch.setattr(
        optimizers, "orthogonalise", lambda u: calls.append(tuple(u.shape)) or real(u)
    )
    for step in range(3):
        for p, gr in zip(whole, grads(step), strict=True):
            p.grad = gr.clone()
        reference.step()
        shares = []
        for part, (ps, opt) in enumerate(zip(replicas, opts, strict=True)):
            for p, gr in zip(ps, grads(step), strict=True):
                p.grad = gr.clone()
            calls.clear()
            opt.begin([o == part for o in owners], [p.grad for p in ps])
            assert sorted(calls) == sorted(
                s for s, o in zip(SHAPES, owners, strict=True) if o == part
            )
            shares.append([p.grad.clone() for p in ps])
        summed = [sum(parts_of) for parts_of in zip(*shares, strict=True)]
        for opt in opts:
            opt.finish(summed)
    for ps, opt in zip(replicas, opts, strict=True):
        for p, q in zip(ps, whole, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(
                opt.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"]
            )


def test_shares_are_balanced_by_flops_and_the_same_everywhere():
    shapes = [(4096, 4096)] * 4 + [(4096, 12288)] * 3 + [(12288, 4096)] * 3 + [(4096, 20480)]
    for parts in (2, 3, 7, 8):
        owners = balanced_shares(shapes, parts)
        assert owners == balanced_shares(shapes, parts)
        load = [
            sum(orthogonalise_flops(s) for s, o in zip(shapes, owners, strict=True) if o == k)
            for k in range(parts)
        ]
        biggest = max(orthogonalise_flops(s) for s in shapes)
        assert max(load) - min(load) <= biggest
        assert max(load) <= sum(load) / parts + biggest  # <= 1/N of the whole, plus one matrix
