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
Muon's learning rate is on AdamW's scale (torch's `adjust_lr_fn="match_rms_adamw"`: 0.2 x
sqrt(max(rows, cols))). Both keep per-parameter state only (AdamW: moments and step; Muon: its
momentum buffer), saved by parameter name like AdamW's alone (`train/checkpoint.py`).

`Muon` here is the project's own, the same algorithm and constants as `torch.optim.Muon`
(tested equal to it), because its step splits in two: the Newton-Schulz orthogonalisation,
about a third of an 8B-shaped drafter's step, is the same on every replica, so each replica of
a step orthogonalises only its share of the matrices (`begin`, a balanced split by FLOPs), the
replicas sum their shares (the pipeline's update exchange: one all-reduce of the matrices'
size, like the gradients'), and every replica applies every update (`finish`). The sum adds
each update to zeros, so the result equals the unsplit step bit for bit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
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


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz iteration's coefficients (torch's and the Muon paper's)."""
NS_STEPS = 5
NS_EPS = 1e-7


def orthogonalise(update: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Newton-Schulz orthogonalisation of a 2-D update in bf16 (torch.optim.Muon's): the
    transpose of a tall matrix is iterated so the Gram matrix is the small side's."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def orthogonalise_flops(shape: Sequence[int], steps: int = NS_STEPS) -> float:
    """Matmul FLOPs of `orthogonalise` on a (rows, cols) matrix: per step, the Gram matrix
    (2 s^2 l), its square (2 s^3) and the product with x (2 s^2 l), s the small side."""
    small, large = sorted(shape[:2])
    return steps * (4.0 * small * small * large + 2.0 * small**3)


def balanced_shares(shapes: Sequence[Sequence[int]], parts: int) -> list[int]:
    """The part (0 .. parts - 1) orthogonalising each matrix: largest first, each to the part
    with the least work so far (ties: the lower part, the earlier matrix), so the parts' FLOPs
    differ by at most one matrix's; the same split on every replica and node."""
    owner = [0] * len(shapes)
    load = [0.0] * parts
    order = sorted(range(len(shapes)), key=lambda i: (-orthogonalise_flops(shapes[i]), i))
    for i in order:
        part = min(range(parts), key=lambda k: (load[k], k))
        owner[i] = part
        load[part] += orthogonalise_flops(shapes[i])
    return owner


class Muon(torch.optim.Optimizer):
    """Muon with Nesterov momentum and decoupled weight decay, as torch.optim.Muon with
    `adjust_lr_fn="match_rms_adamw"`: `step()` updates every matrix; `begin(owned, out)` and
    `finish(updates)` split one step in two around a sum over the replicas (module doc)."""

    def __init__(
        self, params, lr: float, weight_decay: float = 0.1, momentum: float = 0.95
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        for group in self.param_groups:
            if any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon takes 2-D parameters only")

    def _momentum(self, p: torch.Tensor, momentum: float) -> torch.Tensor:
        """Advance p's momentum buffer by its gradient; the Nesterov update to orthogonalise."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - momentum)
        return p.grad.lerp(buf, momentum)

    def _apply(self, p: torch.Tensor, update: torch.Tensor, group: dict[str, Any]) -> None:
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape)))

    @torch.no_grad()
    def step(self, closure=None) -> None:
        assert closure is None, "Muon takes no closure"
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = orthogonalise(self._momentum(p, group["momentum"]))
                    self._apply(p, update, group)

    @torch.no_grad()
    def begin(self, owned: Sequence[bool], out: Sequence[torch.Tensor]) -> None:
        """The first half of a split step: every momentum buffer advances (cheap, so every
        replica's state stays whole), and `out[i]` gets the orthogonalised update of matrix i
        where `owned[i]`, zeros elsewhere (`out[i]` may be matrix i's own gradient)."""
        params = [p for g in self.param_groups for p in g["params"]]
        momentum = [g["momentum"] for g in self.param_groups for _ in g["params"]]
        for p, mu, mine, dst in zip(params, momentum, owned, out, strict=True):
            update = self._momentum(p, mu)
            if mine:
                dst.copy_(orthogonalise(update))  # bf16 -> fp32 is exact
            else:
                dst.zero_()

    @torch.no_grad()
    def finish(self, updates: Sequence[torch.Tensor]) -> None:
        """The second half: every matrix takes its update (summed over the replicas: the one
        that orthogonalised it, plus zeros)."""
        pairs = [(p, g) for g in self.param_groups for p in g["params"]]
        for (p, group), update in zip(pairs, updates, strict=True):
            # Back to the bf16 `orthogonalise` made (exact): the same add kernel as `step`'s.
            self._apply(p, update.bfloat16(), group)


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
    muon = Muon(muon_params, lr=muon_lr, weight_decay=opts.weight_decay)
    parts = [_with_peak(muon)]
    if rest:
        parts.append(_with_peak(torch.optim.AdamW(rest, lr=opts.lr, **adamw)))
    return SplitOptimizer(parts)


def muon_of(optimizer: torch.optim.Optimizer | SplitOptimizer) -> Muon | None:
    """The Muon part of a drafter's optimizer (None with AdamW alone)."""
    parts = optimizer.optimizers if isinstance(optimizer, SplitOptimizer) else [optimizer]
    return next((o for o in parts if isinstance(o, Muon)), None)


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
