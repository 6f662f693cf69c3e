"""Compile and warm up the drafters on the main thread, one device after the other, before any
worker thread starts: a worker then only runs code already compiled for the shapes it meets
(tracing from two threads races, and a trace inside one worker stalls the others).

The shapes are the plan's own. Dynamic shapes make one trace serve many batch sizes, but torch
specialises every size of 1, and the flex kernel also on its query and key counts against one
tile of its block mask and the CUDA lowering's 128 queries (`model.flex.shape_class`). A batch's
classes are those of the flex calls the replica will make for it: one per anchor chunk that
holds an anchor (the chunked step skips the others), or one for the whole batch
(`--no-chunked-step`, or a batch within `--whole-step-tokens`). The warm-up runs, on every
replica's device, one planned batch of every class the plan holds (the largest of each: its
memory peak shows here, not mid-run) and a second, smaller one of each, which must not compile
anything new.

With on-policy anchors the blocks a batch trains are the drafter's own verify rounds, counted
only at the step, and the rounds' parallel forward runs without gradients (a class of its own):
there the warm-up also runs, at every planned (rows, length), one call of every class any block
count could fall in, with and without gradients (`round_calls`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator

import numpy as np
import torch

from dflash_train.data.buckets import BatchSpec
from dflash_train.devices import on_device
from dflash_train.model import flex
from dflash_train.objective import blocks_per_row
from dflash_train.pipeline.prefetch import BatchBuilder, EpochPlans
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.replica import DraftReplica, compile_layers


def compile_replicas(replicas: list[DraftReplica]) -> None:
    """--compile: wrap each replica's draft layers in torch.compile (traced by `warm_up`)."""
    for rep in replicas:
        compile_layers(rep.model)


def planned_specs(plans: EpochPlans, epochs: int) -> Iterator[BatchSpec]:
    """Every batch this node plans, over every epoch."""
    for e in range(epochs):
        yield from plans.epoch(e)


def batch_classes(
    spec: BatchSpec, builder: BatchBuilder, blocks: int, anchors: int, chunked: bool = True
) -> set[tuple]:
    """The flex shape classes of the calls a replica makes for `spec`'s batch: `blocks` blocks
    per row, `anchors` the most anchors of one of its rows (blocks past it are padding);
    `chunked`: one call per anchor chunk with an anchor, else one for all blocks."""
    rows, length = len(spec.seq_ids), builder.bucket_lengths[spec.bucket]
    if not chunked:
        return {flex.shape_class(rows, blocks, builder.block_size, length)}
    # The chunk plan of `BlockLayout.build` (model.block_attention), which the replica follows.
    num_chunks = max(1, min(builder.attention_chunks, blocks))
    bounds = [round(i * blocks / num_chunks) for i in range(num_chunks + 1)]
    sizes = {hi - lo for lo, hi in itertools.pairwise(bounds) if lo < hi and lo < anchors}
    return {flex.shape_class(rows, n, builder.block_size, length) for n in sizes}


def warm_up_specs(
    plans: EpochPlans,
    builder: BatchBuilder,
    epochs: int,
    every_bucket: bool = False,
    chunked: Callable[[int, int], bool] = lambda _rows, _blocks: True,
) -> tuple[list[BatchSpec], int]:
    """Planned batches to warm up on: per shape class of the flex kernel (`batch_classes`), its
    largest and its smallest batch (by padded tokens); with `every_bucket` (--compile) also
    every bucket's largest batch and one-row batch. `chunked(rows, blocks)`: whether the
    replica runs such a batch one anchor chunk at a time (`DraftReplica.runs_chunked`).
    Returns them (largest first) and the number of classes."""
    counts = np.minimum(builder.dataset.anchor_counts(), builder.num_anchors)
    largest: dict[tuple, tuple[int, BatchSpec]] = {}
    smallest: dict[tuple, tuple[int, BatchSpec]] = {}
    classes: set[tuple] = set()
    for spec in planned_specs(plans, epochs):
        rows = len(spec.seq_ids)
        size = rows * builder.bucket_lengths[spec.bucket]
        most = int(counts[list(spec.seq_ids)].max())
        blocks = blocks_per_row(most, builder.num_anchors)
        found = batch_classes(spec, builder, blocks, most, chunked(rows, blocks))
        classes |= found
        keys = [("flex", c) for c in found]
        if every_bucket:
            keys.append(("bucket", spec.bucket, rows == 1))
        for key in keys:
            if key not in largest or size > largest[key][0]:
                largest[key] = (size, spec)
            if key[0] == "flex" and (key not in smallest or size < smallest[key][0]):
                smallest[key] = (size, spec)
    chosen = {id(spec): (size, spec) for size, spec in (*largest.values(), *smallest.values())}
    ordered = sorted(chosen.values(), key=lambda item: -item[0])
    return [spec for _, spec in ordered], len(classes)


def round_calls(
    plans: EpochPlans, builder: BatchBuilder, epochs: int
) -> list[tuple[int, int, int]]:
    """(rows, length, blocks) of one attention call per flex shape class a batch of on-policy
    rounds can call at every planned (rows, padded length): the class depends on the blocks
    per call only through blocks == 1 and the query and key counts against 128, so counting
    up until both counts are past it meets every one."""
    b, tile = builder.block_size, max(flex.SHORT_QUERIES, flex.MASK_TILE)
    shapes = {
        (len(s.seq_ids), builder.bucket_lengths[s.bucket]) for s in planned_specs(plans, epochs)
    }
    calls: dict[tuple, tuple[int, int, int]] = {}
    for rows, length in sorted(shapes):
        n = 1
        while True:
            calls.setdefault(flex.shape_class(rows, n, b, length), (rows, length, n))
            if n * b > tile and length + n * b > tile:  # past every threshold
                break
            n += 1
    return list(calls.values())


def layer_kinds(replica: DraftReplica) -> int:
    """Distinct (window, causal-in-block) layer kinds of the drafter: a trace each."""
    c = replica.model.config
    return len({(c.layer_window(i), c.layer_causal(i)) for i in range(c.num_hidden_layers)})


def warm_up(
    replicas: list[DraftReplica],
    plans: EpochPlans,
    builder: BatchBuilder,
    epochs: int,
    say: Callable[[str], None],
    compiled_layers: bool = False,
) -> None:
    """Run every replica that compiles (flex on CUDA, or `compiled_layers`) on the warm-up
    batches, under its own device, its gradients zeroed after; say what it cost."""
    reps = [r for r in replicas if compiled_layers or _uses_compiled_flex(r)]
    if not reps:
        return
    specs, classes = warm_up_specs(plans, builder, epochs, compiled_layers, reps[0].runs_chunked)
    jobs = [builder.build(spec) for spec in specs]
    rounds = round_calls(plans, builder, epochs) if reps[0].on_policy else []
    if rounds:  # every class, with and without gradients: those of the planned batches too
        classes = 2 * len(rounds)
    kinds = layer_kinds(reps[0])
    # What torch keeps per compiled function: every device traces its own copy of each flex
    # (kind, class) pair, plus the cost probe's shapes (2 more classes at most); with
    # --compile each layer's pieces trace one row and several rows per device. Twice that.
    traces = len(reps) * kinds * (classes + 2)
    if compiled_layers:
        traces += len(reps) * reps[0].model.config.num_hidden_layers * 2
    limit = flex.ensure_recompile_limit(2 * traces)
    width = reps[0].feature_width
    for rep in reps:
        stopwatch = flex.timed_compiles()
        with on_device(rep.device):
            try:
                for job in jobs:
                    rows, length = job.input_ids.shape
                    features = torch.zeros(rows, length, width, device=rep.device)
                    rep.micro_step(HSBatch(job, features.to(rep.compute_dtype)))
                for rows, length, blocks in rounds:
                    rep.run_blocks(rows, length, blocks)
            except torch._dynamo.exc.TorchDynamoException as e:
                raise ValueError(_cannot_compile(rep, compiled_layers, e)) from e
            rep.flat_grad.zero_()
        traces, seconds = stopwatch()
        say(
            f"warmed up the drafter on {rep.device}: {len(jobs)} planned batches, {classes} "
            f"shape classes x {kinds} layer kinds, {traces} flex traces compiled in "
            f"{seconds:.1f}s (recompile limit {limit})"
        )
        if _uses_compiled_flex(rep) and traces > classes * kinds:
            say(
                f"warning: flex compiled {traces} traces for {classes * kinds} shape classes on "
                f"{rep.device}: its dynamic shapes did not hold, so batch shapes not warmed up "
                "run the unfused kernel (counted in time/flex_eager_calls)"
            )


@contextlib.contextmanager
def compiled_shapes_only(replicas: list[DraftReplica], compiled_layers: bool = False):
    """While the workers run after `warm_up`: torch.compile's `eager_on_recompile` stance when
    anything compiles, so a shape the warm-up missed runs eager (flex counts it in
    `flex.eager_calls`) instead of tracing inside a worker thread, where it stalls the other
    drafters and races. The stance is process-wide; the previous one is restored on exit."""
    if not any(compiled_layers or _uses_compiled_flex(r) for r in replicas):
        yield
        return
    with torch.compiler.set_stance("eager_on_recompile"):
        yield


def _cannot_compile(rep: DraftReplica, compiled_layers: bool, e: Exception) -> str:
    """One line for a compile that failed: where, torch's reason, and the settings that avoid
    it (a run must not die mid-way on it, nor fall back without saying)."""
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    fixes = []
    if _uses_compiled_flex(rep):
        fixes.append("--attention blockwise")
    if compiled_layers:
        fixes.append("no --compile")
    return (
        f"the drafter could not be compiled on {rep.device} ({type(e).__name__}: {reason}); "
        f"train with {' or '.join(fixes)}"
    )


def _uses_compiled_flex(replica: DraftReplica) -> bool:
    return replica.attention == "flex" and replica.device.type in flex.COMPILED_DEVICE_TYPES
