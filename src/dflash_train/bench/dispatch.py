"""`dflash-train bench dispatch`: ATen operations dispatched per drafter micro-step.

Every operation a drafter thread dispatches costs host time (Python, the dispatcher, a kernel
launch on a GPU) under one interpreter shared by a node's drafter and target threads. A
`TorchDispatchMode` counts them on CPU, by phase (the micro-step's forward, loss and backward,
then the optimizer step) and by operation; on a GPU each non-view operation is one kernel
launch up to fusion.

The count depends on the step's structure (layers and their kinds, anchor chunks, blocks per
chunk, loss chunks, Muon's matrices), not on the widths: it is taken at the Qwen3-8B drafter's
structure with every width scaled down together (heads, aspect ratios and the LM-head loss's
rows per chunk kept), which `tests/unit/bench/test_dispatch.py` checks at two widths.

The attention kernel is the one CUDA runs, flex, compiled: one graph per call whose kernels do
not pass through the dispatcher. On CPU (flex has no backward there) the call is modelled: its
launches are counted as `FLEX_LAUNCHES` (stated assumptions, see there) and its output is a
stand-in of the right shape that carries gradients; everything around it (casts, copies,
concatenations) is counted as dispatched.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_train.bench.common import BenchReport, add_json_argument, add_seed_argument, emit
from dflash_train.bench.step import RANDOM_TARGETS, step_flops
from dflash_train.config import FULL_ATTENTION, SLIDING_ATTENTION, ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import BatchSpec
from dflash_train.head_loss import CUDA_LOSS_CHUNK_SHARE, auto_chunk_rows
from dflash_train.model import flex
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.target import FrozenHead, draft_config_from_target
from dflash_train.objective import loss_gamma
from dflash_train.pipeline.prefetch import make_job
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.replica import DraftReplica, whole_step_tokens_for

H200_BYTES = 150_000_000_000
"""An H200's memory as CUDA reports it (~139.7 GiB): what sizes CUDA's LM-head loss chunks."""
PHASES = ("forward", "loss", "backward", "optimizer")

FLEX_LAUNCHES = {"forward": 9, "backward": 2}
"""Kernel launches assumed per compiled flex call (not measured: no GPU has run this code).
forward: the block mask built inside the compiled call (inductor's fused kernels for the
mask_mod's grid and its partial/full block counts, two sorts for the ordered kv indices and two
for their transpose: ~8) plus the attention kernel (1); backward: the delta preprocess and the
attention's backward kernel (torch 2.13's flex lowering)."""

# Operations that launch no kernel on a GPU: views, and allocations without a fill.
_NO_KERNEL = {
    "empty.memory_format",
    "empty_strided.default",
    "empty_like.default",
    "_unsafe_view.default",
}


class DispatchCounter(TorchDispatchMode):
    """Counts every ATen operation dispatched while active, under the current `phase`.

    `counts[(phase, op)]`: calls of `op` (its overload name) in `phase`; `views` the subset
    that are views or bare allocations (no kernel on a GPU). `paused()` stops counting (a
    modelled kernel's stand-in computation); `add` counts modelled launches.
    """

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.counts: Counter[tuple[str, str]] = Counter()
        self.views: Counter[str] = Counter()
        self.view_ops: set[str] = set()
        self._paused = 0
        self.saved_per_pass: list[int] = []
        """Bytes autograd saved for backward in each forward pass (storages counted once,
        parameters left out): what a pass's activations hold at its peak."""
        self._saved: dict[int, int] = {}
        self.params: set[int] = set()

    def save(self, t: torch.Tensor) -> torch.Tensor:
        """A pack hook of `saved_tensors_hooks`: records `t`'s storage for the current pass."""
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self._saved[storage.data_ptr()] = storage.nbytes()
        return t

    def end_pass(self) -> None:
        """A backward begins: the saved bytes of the forward before it are one pass's."""
        if self._saved:
            self.saved_per_pass.append(sum(self._saved.values()))
        self._saved = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._paused:
            name = str(func).removeprefix("aten.")
            self.counts[(self.phase, name)] += 1
            if func.is_view or name in _NO_KERNEL:
                self.views[self.phase] += 1
                self.view_ops.add(name)
        return func(*args, **(kwargs or {}))

    def add(self, name: str, launches: int, phase: str | None = None) -> None:
        self.counts[(phase or self.phase, name)] += launches

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def total(self, phase: str | None = None) -> int:
        return sum(n for (p, _), n in self.counts.items() if phase in (None, p))

    def by_op(self, phases: tuple[str, ...] = PHASES) -> Counter[str]:
        out: Counter[str] = Counter()
        for (p, op), n in self.counts.items():
            if p in phases:
                out[op] += n
        return out


class _ModelledFlex(torch.autograd.Function):
    """A compiled flex call as CUDA runs it: its launches counted, its output a stand-in of
    q's shape that passes a gradient to q, k and v (values are not the attention's)."""

    @staticmethod
    def forward(ctx, counter: DispatchCounter, q, k, v):
        counter.add("flex_attention (compiled, modelled)", FLEX_LAUNCHES["forward"])
        ctx.counter, ctx.kv_shape = counter, (k.shape, v.shape)
        with counter.paused():
            out = q.clone()
        ctx.save_for_backward(q, k, v, out)  # what flex saves, less its (heads x rows) lse
        return out

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.add("flex_attention_backward (compiled, modelled)", FLEX_LAUNCHES["backward"])
        with ctx.counter.paused():
            dk, dv = (grad.new_zeros(s) for s in ctx.kv_shape)
            return None, grad.clone(), dk, dv


class _FlexModel:
    """Stands in for `model.flex.FLEX` while counting."""

    def __init__(self, counter: DispatchCounter) -> None:
        self.counter = counter

    def __call__(self, q, k, v, limits, anchors, block_size, window, causal, *rest):
        return _ModelledFlex.apply(self.counter, q, k, v)


class _PhaseClock:
    """The replica's segment clock, also switching the counter's phase by segment."""

    PHASE_OF: ClassVar[dict[str, str]] = {
        "drafter_forward_s": "forward",
        "drafter_backward_s": "backward",
    }

    def __init__(self, clock: Any, counter: DispatchCounter) -> None:
        self.clock, self.counter = clock, counter

    @contextlib.contextmanager
    def segment(self, name: str) -> Iterator[None]:
        phase = self.PHASE_OF.get(name, "optimizer" if name == "optimizer_s" else "forward")
        if phase == "backward":
            self.counter.end_pass()
        # The loss runs inside a forward segment: keep its own phase.
        if self.counter.phase == "loss":
            phase = "loss"
        with self.counter.in_phase(phase), self.clock.segment(name):
            yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self.clock, name)


@contextlib.contextmanager
def counting(
    replica: DraftReplica, model_flex: bool = False, saved: bool = False
) -> Iterator[DispatchCounter]:
    """Count what `replica` dispatches while the block runs, phase by phase; with
    `model_flex`, its attention runs as the modelled compiled flex kernel; with `saved`, also
    the bytes saved for backward per pass (its hooks add operations of their own: not for
    counting)."""
    counter = DispatchCounter()
    clock, loss = replica._clock, replica._loss

    def counted_loss(*args, **kwargs):
        with counter.in_phase("loss"):
            return loss(*args, **kwargs)

    replica._clock, replica._loss = _PhaseClock(clock, counter), counted_loss
    kernel = flex.FLEX
    if model_flex:
        flex.FLEX = _FlexModel(counter)
    counter.params = {p.untyped_storage().data_ptr() for p in replica.model.parameters()}
    hooks = contextlib.nullcontext()
    if saved:
        hooks = torch.autograd.graph.saved_tensors_hooks(counter.save, lambda t: t)
    try:
        with counter, hooks:
            yield counter
    finally:
        flex.FLEX = kernel
        replica._clock = clock
        del replica._loss  # the instance attribute: the method is back


@dataclass(frozen=True)
class Shape:
    """The structure counted: the target's shape scaled to `head_dim` (8B: 128), the batch."""

    target: str = "qwen3-8b"
    head_dim: int = 2
    draft_layers: int = 5
    sliding_layers: int = 4
    sliding_window: int = 2048
    block_size: int = 16
    num_anchors: int = 512
    attention_chunks: int = 8
    batch_size: int = 4
    seq_len: int = 3072
    vocab_size: int = 512
    whole_step_tokens: int | None = None
    """None: what CUDA chooses on a GPU of `device_bytes` for the real-width drafter."""
    device_bytes: int = H200_BYTES


def scaled_config(shape: Shape) -> tuple[DFlashConfig, int]:
    """The drafter of `shape.target` with every width scaled to `shape.head_dim` (heads, aspect
    ratios and layers kept), and the LM-head loss's rows per chunk at the real vocabulary."""
    t = RANDOM_TARGETS[shape.target]
    scale = shape.head_dim / t["head_dim"]
    n = shape.draft_layers
    types = [SLIDING_ATTENTION] * shape.sliding_layers + [FULL_ATTENTION] * (
        n - shape.sliding_layers
    )
    layers = t["num_hidden_layers"]
    cfg = DFlashConfig(
        hidden_size=round(t["hidden_size"] * scale),
        intermediate_size=round(t["intermediate_size"] * scale),
        num_hidden_layers=n,
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        num_target_layers=layers,
        target_layer_ids=[round(1 + i * (layers - 4) / 4) for i in range(5)],
        mask_token_id=shape.vocab_size - 1,
        block_size=shape.block_size,
        layer_types=types,
        sliding_window=shape.sliding_window if shape.sliding_layers else None,
    )
    return cfg, auto_chunk_rows(t["vocab_size"], shape.device_bytes // CUDA_LOSS_CHUNK_SHARE)


def cuda_whole_step_tokens(shape: Shape) -> int:
    """`shape.whole_step_tokens`, or when unset what a GPU of `shape.device_bytes` chooses for
    the real-width drafter (`replica.whole_step_tokens_for`)."""
    if shape.whole_step_tokens is not None:
        return shape.whole_step_tokens
    t = RANDOM_TARGETS[shape.target]
    return whole_step_tokens_for(shape.device_bytes, t["hidden_size"], shape.draft_layers)


def build(
    shape: Shape, attention: str, dtype: torch.dtype, arch: str = "dflash", seed: int = 0
) -> tuple[DraftReplica, HSBatch]:
    """A replica of `shape`'s structure at the default objective and optimizer (D-PACE, Muon),
    and one fully supervised batch of `shape`'s rows. `attention` "flex" is built as
    blockwise and switched to flex: counted with `model_flex` (CPU flex has no backward)."""
    cfg, chunk_rows = scaled_config(shape)
    if arch != "dflash":
        cfg = DFlashConfig.from_dict({**cfg.to_dict(), "arch": arch})
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    size = (cfg.vocab_size, cfg.hidden_size)
    head = FrozenHead(torch.randn(size, generator=gen) * 0.02, torch.randn(size, generator=gen))
    objective = ObjectiveOptions(
        num_anchors=shape.num_anchors,
        attention="blockwise" if attention == "flex" else attention,
        attention_chunks=shape.attention_chunks,
        loss_chunk_size=chunk_rows,
        whole_step_tokens=cuda_whole_step_tokens(shape),  # CUDA's choice, not CPU's
    )
    device = torch.device("cpu")
    replica = DraftReplica(DFlashDraftModel(cfg), head, device, dtype, objective, OptimOptions(), 4)
    replica.attention = attention
    rng = np.random.default_rng(seed)
    rows = [
        (rng.integers(0, cfg.vocab_size - 1, shape.seq_len), np.ones(shape.seq_len, np.uint8))
        for _ in range(shape.batch_size)
    ]
    job = make_job(
        BatchSpec(0, 0, 0, tuple(range(shape.batch_size))),
        rows,
        shape.seq_len,
        block_size=shape.block_size,
        num_anchors=shape.num_anchors,
        gamma=loss_gamma(shape.block_size),
        mask_token_id=cfg.mask_token_id,
        seed=seed,
        attention_chunks=shape.attention_chunks,
        position_weights=objective.position_weights,
    )
    width = replica.feature_width
    features = torch.randn(shape.batch_size, shape.seq_len, width, generator=gen).to(dtype)
    return replica, HSBatch(job, features)


def count_step(
    replica: DraftReplica, batch: HSBatch, attention: str, saved: bool = False
) -> DispatchCounter:
    """One micro-step and one optimizer step of `replica`, counted (after one uncounted step,
    so the optimizer's state exists as in every later step)."""
    for _ in range(2):  # the first one's counts are dropped
        with counting(replica, attention == "flex", saved) as counter:
            replica.micro_step(batch)
            replica.apply(batch.job.weight_sum)
    return counter


MEMORY_HEAD_DIMS = (2, 4, 6)


def saved_bytes(shape: Shape, attention: str, dtype: torch.dtype) -> dict[str, float]:
    """The largest pass's saved activations at the real width (`shape.target`'s head dim),
    from three scaled widths: saved bytes are a + b w + c w^2 in the head dim w (per-head
    statistics, activations, the weights' compute-dtype casts), solved exactly."""
    saved = []
    for w in MEMORY_HEAD_DIMS:
        replica, batch = build(dataclasses.replace(shape, head_dim=w), attention, dtype)
        saved.append(max(count_step(replica, batch, attention, saved=True).saved_per_pass))
    terms = torch.tensor([[1.0, w, w * w] for w in MEMORY_HEAD_DIMS], dtype=torch.float64)
    a, b, c = torch.linalg.solve(terms, torch.tensor(saved, dtype=torch.float64)).tolist()
    real = RANDOM_TARGETS[shape.target]["head_dim"]
    return {
        "saved_gb_per_pass": (a + b * real + c * real**2) / 1e9,
        "activation_gb": b * real / 1e9,
    }


def phase_rows(counter: DispatchCounter) -> list[dict[str, Any]]:
    """One row per phase, then the micro-step and the whole step: ops and kernel ops."""
    rows = []
    for name, phases in [*((p, (p,)) for p in PHASES), ("micro-step", PHASES[:3])]:
        ops = sum(counter.total(p) for p in phases)
        views = sum(counter.views[p] for p in phases)
        rows.append({"what": name, "ops": ops, "kernel_ops": ops - views})
    ops = counter.total()
    rows.append({"what": "step", "ops": ops, "kernel_ops": ops - sum(counter.views.values())})
    return rows


def op_rows(counter: DispatchCounter, top: int = 15) -> list[dict[str, Any]]:
    """The `top` operations of the micro-step and the optimizer, by count."""
    rows = []
    for op, n in counter.by_op().most_common(top):
        kernel = 0 if op in counter.view_ops else n
        rows.append({"what": f"op {op}", "ops": n, "kernel_ops": kernel})
    return rows


LAUNCH_S = 5e-6
"""Host seconds a CUDA kernel launch adds to an operation's dispatch: assumed (the usual few
microseconds of `cudaLaunchKernel`), not measured: no GPU has run this code."""
PEAK_FLOPS, DRAFTER_MFU = 989e12, 0.45
"""The GPU step time's source: `bench scale`'s cost model (an H200's dense bf16 peak and the
drafter MFU issue 35 aims at)."""


def host_seconds_per_op(reps: int = 5, seed: int = 0) -> float:
    """Measured here: host seconds per dispatched operation, from a drafter step whose every
    tensor is a few elements (so the kernels cost next to nothing): the median of `reps` timed
    steps over the operations the same step dispatches. Python, the dispatcher and autograd's
    engine, as a drafter thread pays them. Timed in this thread's CPU seconds (one intra-op
    thread: all of the step's work is this thread's), so the other work of a busy machine
    does not count, and the fastest of `reps` steps is taken."""
    # 64 positions, 16 anchors, a 64-token vocabulary: below this, the time per operation
    # stops falling (~10 us here), so what is left is the host's.
    shape = Shape(batch_size=1, seq_len=64, num_anchors=16, sliding_window=16, vocab_size=64)
    replica, batch = build(shape, "blockwise", torch.float32, seed=seed)
    ops = count_step(replica, batch, "blockwise").total()
    times = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(reps):
        t0 = time.thread_time()
        replica.micro_step(batch)
        replica.apply(batch.job.weight_sum)
        times.append(time.thread_time() - t0)
    torch.set_num_threads(threads)
    return min(times) / ops


def gpu_step_seconds(shape: Shape) -> float:
    """The real-width drafter's step on one GPU, as `bench scale` models it (its FLOPs at
    `DRAFTER_MFU` of `PEAK_FLOPS`, fully supervised rows)."""
    from transformers import Qwen3Config

    t = RANDOM_TARGETS[shape.target]
    cfg = draft_config_from_target(Qwen3Config(**t), shape.draft_layers, shape.block_size, 0)
    rows, anchors = shape.batch_size, shape.num_anchors
    supervised = rows * anchors * (shape.block_size - 1)
    flops = step_flops(cfg, rows, shape.seq_len, anchors, supervised)
    return flops / (PEAK_FLOPS * DRAFTER_MFU)


def feeding(counter: DispatchCounter, per_op_s: float, gpu_step_s: float) -> dict[str, Any]:
    """How many drafter GPUs one interpreter can feed: each drafter thread's host time per
    step (every operation's dispatch, plus a launch per kernel operation) is serialised by
    the GIL with every other thread's, so the GPUs stay busy while N x that fits in one GPU
    step (the target workers' own dispatches left out)."""
    ops = counter.total()
    kernels = ops - sum(counter.views.values())
    host = ops * per_op_s + kernels * LAUNCH_S
    return {
        "host_us_per_op": per_op_s * 1e6,
        "launch_us_assumed": LAUNCH_S * 1e6,
        "host_ms_per_step": host * 1e3,
        "gpu_step_ms": gpu_step_s * 1e3,
        "drafters_one_process_feeds": math.floor(gpu_step_s / host),
        "load_average": os.getloadavg()[0],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Shape()
    parser.add_argument("--target", default=d.target, choices=sorted(RANDOM_TARGETS))
    parser.add_argument(
        "--head-dim",
        type=int,
        default=d.head_dim,
        help="every width scaled to this head dim (the target's own: its full width); the "
        "count does not depend on it",
    )
    parser.add_argument("--draft-layers", type=int, default=d.draft_layers)
    parser.add_argument("--sliding-layers", type=int, default=d.sliding_layers)
    parser.add_argument("--num-anchors", type=int, default=d.num_anchors)
    parser.add_argument("--attention-chunks", type=int, default=d.attention_chunks)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--seq-len", type=int, default=d.seq_len)
    parser.add_argument(
        "--whole-step-tokens",
        type=int,
        default=None,
        help="the objective's whole_step_tokens (default: CUDA's choice on an H200; 0: every "
        "micro-batch chunked, as before it existed)",
    )
    parser.add_argument(
        "--attention",
        default="flex",
        choices=["flex", "blockwise", "dense"],
        help="flex: CUDA's kernel, its compiled call modelled (FLEX_LAUNCHES)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--arch", default="dflash", choices=["dflash", "dflash2"])
    parser.add_argument("--top", type=int, default=15, help="operations listed by name")
    parser.add_argument(
        "--memory",
        action="store_true",
        help="also the largest pass's saved activations at the real width, from three scaled "
        "widths (a minute or two)",
    )
    parser.add_argument(
        "--no-feeding",
        action="store_true",
        help="leave out the model of how many drafter GPUs one process feeds (it times steps)",
    )
    add_seed_argument(parser)
    add_json_argument(parser)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Shape)}
    shape = Shape(**{k: v for k, v in given.items() if v is not None})
    if not 0 <= shape.sliding_layers <= shape.draft_layers:
        raise ValueError(f"--sliding-layers must be within 0..{shape.draft_layers}")
    dtype = getattr(torch, args.dtype)
    replica, batch = build(shape, args.attention, dtype, args.arch, args.seed)
    counter = count_step(replica, batch, args.attention)
    report = BenchReport(
        title=f"ATen operations per drafter step, {shape.target} structure ({args.attention}, "
        f"{args.dtype}, {shape.batch_size} x {shape.seq_len}, {shape.num_anchors} anchors, "
        f"{shape.attention_chunks} chunks)",
        columns=["what", "ops", "kernel_ops"],
        rows=phase_rows(counter) + op_rows(counter, args.top),
    )
    micro = sum(counter.total(p) for p in PHASES[:3])
    report.summary.update(micro_step_ops=micro, optimizer_ops=counter.total("optimizer"))
    if args.memory:
        report.summary.update(saved_bytes(shape, args.attention, dtype))
    if not args.no_feeding:
        report.summary.update(feeding(counter, host_seconds_per_op(), gpu_step_seconds(shape)))
        report.notes.append(
            f"drafters fed: GPU step ({shape.target} drafter at {DRAFTER_MFU:.0%} MFU of "
            f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s, bench scale's model) over one drafter's host "
            f"time (ops x host_s_per_op measured here + kernel ops x {LAUNCH_S * 1e6:.0f} us "
            "launch, assumed)"
        )
    report.notes.append(
        "kernel_ops leaves out views and bare allocations (no kernel on a GPU); flex's compiled "
        f"call counts {FLEX_LAUNCHES} launches (assumed)"
    )
    return emit(report, args.json)
