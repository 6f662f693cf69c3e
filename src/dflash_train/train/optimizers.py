"""The drafter's optimizer: AdamW, or Muon for the backbone's matrices with AdamW for the rest.

Muon (torch.optim.Muon) orthogonalises each 2-D weight's momentum with a few Newton-Schulz
steps; it is meant for the matrices of hidden layers. Here it takes the 2-D weights of the
backbone's linear layers: `fc` and every draft layer's attention (q, k, v, o) and MLP (gate, up,
down) projections. AdamW keeps the rest:
- the RMSNorm weights (1-D);
- DFlash 2's convolutions: `base_kernel` is 3-D and `kernel_projection` starts at zero so that
  each convolution starts at the identity; Muon's fixed-size orthogonal steps would move it off
  the identity at full speed from the first step, whatever the gradient's size;
- DFlash 2's selector: the two codebooks are vocabulary-sized embedding tables (a batch's
  gradient touches a few rows; orthogonalising the whole table would spread it over tokens not
  in the batch), and its hidden projection only acts through them, so the selector stays with
  one optimizer.
Muon runs with `adjust_lr_fn="match_rms_adamw"`, so its learning rate is on AdamW's scale.
Both keep per-parameter state only (AdamW: moments and step; Muon: its momentum buffer), saved
by parameter name like AdamW's alone (`train/checkpoint.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from dflash_train.config import OptimOptions

MUON_PARAMS = re.compile(
    r"(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight"
)
"""Trainable parameters Muon takes (the backbone's 2-D linear weights)."""

MUON_LR_FACTOR = 2.0
"""--muon-lr when unset, as a multiple of --lr: the best of the sweep 0.5x-8x on the demo
(README, Objectives; 1x came second)."""

PEAK_LR = "peak_lr"
"""A param group's own peak learning rate (the schedule scales it)."""


class _SplitState(Mapping):
    """The per-parameter state of several optimizers as one mapping (parameters are disjoint);
    setting a parameter's state sets it in the optimizer that owns that parameter."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._owner = {p: o for o in optimizers for g in o.param_groups for p in g["params"]}
        self._optimizers = optimizers

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        return self._owner[p].state[p]

    def __setitem__(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        self._owner[p].state[p] = state

    def __iter__(self) -> Iterator[torch.Tensor]:
        for o in self._optimizers:
            yield from o.state

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class SplitOptimizer:
    """Several optimizers over disjoint parameters, stepped together: `param_groups`, `state`
    and `step()` as one optimizer (what the replica and the checkpoint use)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers
        self.state = _SplitState(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def split_for_muon(
    named: list[tuple[str, torch.nn.Parameter]],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's parameters, AdamW's) of the trainable `named` parameters."""
    muon = [p for n, p in named if MUON_PARAMS.fullmatch(n) and p.ndim == 2]
    taken = {id(p) for p in muon}
    return muon, [p for _, p in named if id(p) not in taken]


def build_optimizer(
    named: list[tuple[str, torch.nn.Parameter]], opts: OptimOptions, device: torch.device
) -> torch.optim.Optimizer | SplitOptimizer:
    """The optimizer `opts.optimizer` names over the trainable `named` parameters; every param
    group carries its peak learning rate under `PEAK_LR`."""
    params = [p for _, p in named]
    adamw = dict(
        betas=(opts.adam_beta1, opts.adam_beta2),
        weight_decay=opts.weight_decay,
        foreach=device.type == "cuda",
    )
    if opts.optimizer == "adamw":
        return _with_peak(torch.optim.AdamW(params, lr=opts.lr, **adamw))
    muon_params, rest = split_for_muon(named)
    if not muon_params:
        raise ValueError("optimizer muon: the drafter has no 2-D backbone weights for Muon")
    muon_lr = opts.muon_lr if opts.muon_lr is not None else MUON_LR_FACTOR * opts.lr
    muon = torch.optim.Muon(
        muon_params,
        lr=muon_lr,
        weight_decay=opts.weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    parts = [_with_peak(muon)]
    if rest:
        parts.append(_with_peak(torch.optim.AdamW(rest, lr=opts.lr, **adamw)))
    return SplitOptimizer(parts)


def describe_optimizer(optimizer: torch.optim.Optimizer | SplitOptimizer) -> str:
    """One line: each optimizer, its peak learning rate and how many tensors it updates."""
    parts = optimizer.optimizers if isinstance(optimizer, SplitOptimizer) else [optimizer]
    return " + ".join(
        f"{type(o).__name__} (lr {o.param_groups[0][PEAK_LR]:.3g}, "
        f"{sum(len(g['params']) for g in o.param_groups)} tensors)"
        for o in parts
    )


def _with_peak(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        group[PEAK_LR] = group["lr"]
    return optimizer


def set_schedule(optimizer: torch.optim.Optimizer | SplitOptimizer, factor: float) -> None:
    """Every param group at `factor` (the schedule's multiplier, 0 .. 1) of its own peak."""
    for group in optimizer.param_groups:
        group["lr"] = group[PEAK_LR] * factor
