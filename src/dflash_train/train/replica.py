"""One drafter replica on one device: forward/backward of micro-batches and the optimizer step.

Gradients live in ONE flat fp32 buffer per replica (each parameter's `.grad` is a view into it),
so summing gradients across replicas, dividing by the global weight sum, the global norm and
clipping are each a single tensor op. A step is split in two so replicas can meet in between:
`micro_step` (any number of times: forward + backward of the loss NUMERATOR) then, after the
gradients were summed across replicas, `apply(global_weight)` (the global divisor: the decay's
weight sum, or D-PACE's valid anchors; see `position_weights.loss_normaliser`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from dflash_train import faults
from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.devices import SegmentClock, handover
from dflash_train.model.block_attention import BlockLayout, layout_to, resolve_backend
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import FrozenHead
from dflash_train.objective import (
    DraftTargets,
    HeadLoss,
    LossOutput,
    SelectorLoss,
    Teacher,
    auto_chunk_rows,
    block_token_ids,
    draft_loss,
    loss_chunk_bytes,
    loss_gamma,
    uniform_position_weight,
)
from dflash_train.on_policy import RoundBlocks, RoundStreams, batch_rounds, round_blocks
from dflash_train.pipeline.monitor import StageTimers
from dflash_train.pipeline.records import HSBatch, Job
from dflash_train.position_weights import PositionWeights
from dflash_train.train.optimizers import (
    balanced_shares,
    build_optimizer,
    muon_of,
    set_schedule,
)

SAVED_BYTES_PER_TOKEN = 68
"""Bytes a forward pass saves for backward per block token, per draft layer, per unit of hidden
width, under bf16 autocast (`bench dispatch --memory`: 45.5 GB for the Qwen3-8B drafter's 4 x
512 x 16 block tokens, 5 layers of width 4096; twice that in fp32)."""
WHOLE_STEP_MEMORY_SHARE = 0.4
"""The share of a GPU's memory one pass's activations may take when `whole_step_tokens` is
unset (an 8B drafter's fp32 weights, gradients and optimizer state, their bf16 casts, the
features and the loss chunks take some 15-20 GB, 10-15% of an H200; a target sharing the GPU
takes its own share)."""


def whole_step_tokens_for(
    device_bytes: int, hidden: int, layers: int, dtype: torch.dtype = torch.bfloat16
) -> int:
    """`ObjectiveOptions.whole_step_tokens` when unset on a GPU of `device_bytes`: the block
    tokens whose activations fit `WHOLE_STEP_MEMORY_SHARE` of it (an H200 and the Qwen3-8B
    drafter: 43K, so the recipe's 4 x 512 x 16 = 32,768 run in one pass; an 80 GB GPU: 24K)."""
    per_token = SAVED_BYTES_PER_TOKEN * hidden * layers * (1 if dtype.itemsize < 4 else 2)
    return int(WHOLE_STEP_MEMORY_SHARE * device_bytes // per_token)


def lr_at(step: int, total_steps: int, opts: OptimOptions) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine to lr * min_lr_ratio."""
    warmup = math.ceil(opts.warmup_ratio * total_steps)
    if step < warmup:
        return opts.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return opts.lr * (opts.min_lr_ratio + (1.0 - opts.min_lr_ratio) * cosine)


def compile_layers(model: DFlashDraftModel) -> None:
    """torch.compile the tensor-only pieces of every draft layer (projections, norms, RoPE, the
    MLP, residuals and DFlash 2's convolutions), with dynamic shapes.

    The attention kernel and the model's forward stay eager: they take the host-side chunk plan
    (Python ints that vary per batch), which would make a whole-model graph recompile on almost
    every batch. Compiling bound methods keeps the parameter names of the state dict.
    """
    for layer in model.layers:
        attn = layer.self_attn
        attn.queries = torch.compile(attn.queries, dynamic=True)
        attn.keys_values = torch.compile(attn.keys_values, dynamic=True)
        layer.prepare = torch.compile(layer.prepare, dynamic=True)
        layer.finish = torch.compile(layer.finish, dynamic=True)


class DraftReplica:
    """A drafter copy with its optimizer, frozen head and gradient buffer on `device`."""

    def __init__(
        self,
        model: DFlashDraftModel,
        head: FrozenHead,
        device: torch.device,
        compute_dtype: torch.dtype,
        objective: ObjectiveOptions,
        optim: OptimOptions,
        total_steps: int,
        timers: StageTimers | None = None,
    ) -> None:
        self.device, self.compute_dtype = device, compute_dtype
        self.model = model.to(device=device, dtype=torch.float32).train()
        self.head = head.to(device, compute_dtype)
        self.block_size = model.config.block_size
        self.optim_opts, self.total_steps = optim, total_steps
        self.attention = resolve_backend(objective.attention, device, needs_grad=True)
        self.chunk_rows = objective.loss_chunk_size or auto_chunk_rows(
            model.config.vocab_size, loss_chunk_bytes(device)
        )
        self.chunked = objective.chunked_step
        self.whole_step_tokens = self._whole_step_tokens(objective.whole_step_tokens)
        self.selector = self._selector_loss(objective)  # DFlash 2's, on the replica's selector
        self.positions = PositionWeights(objective.position_weights, objective.dpace_alpha)
        self.loss = HeadLoss(objective.loss, objective.lk_eta)
        self.attention_chunks = objective.attention_chunks
        self.streams = round_streams(objective, self.block_size)  # None: random anchors
        self.needs_teacher = objective.needs_teacher
        # (batch, L, K * hidden) of the selected layers, then the teacher's input (hidden).
        self.context_width = model.config.num_features * model.config.hidden_size
        self.timers = timers or StageTimers()
        self._clock = SegmentClock(device)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer = build_optimizer(named, optim, device)
        self.muon = muon_of(self.optimizer)
        self.params, self.flat_grad = self._flat_gradients(named)
        self._owned: list[bool] | None = None  # Muon's matrices this replica orthogonalises
        self.mid_step = False
        """An optimizer step begun and not counted (an error inside `optimizer.step`, or a split
        step with AdamW stepped and Muon's momentum moved): the weights may be half updated, so
        no checkpoint may be taken of them."""
        self.update_share: torch.Tensor | None = None
        """Set by `split_optimizer`: the slice of `flat_grad` that holds Muon's updates between
        `apply` and `finish`, summed over the replicas in between (the pipeline does it)."""
        self.step = 0

    def _whole_step_tokens(self, asked: int | None) -> int:
        """The block tokens a micro-batch may run in one pass: `asked`, or on CUDA what the
        device's memory holds (`whole_step_tokens_for`); 0 (always chunked) otherwise."""
        cfg = self.model.config
        if asked is None and self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            return whole_step_tokens_for(
                total, cfg.hidden_size, cfg.num_hidden_layers, self.compute_dtype
            )
        return asked or 0

    def _selector_loss(self, objective: ObjectiveOptions) -> SelectorLoss | None:
        """DFlash 2's selector term on this replica's selector (None for DFlash 1)."""
        if self.model.candidate_selector is None:
            return None
        uniform = None
        if objective.selector_weights == "uniform":
            gamma = loss_gamma(self.block_size, objective.gamma)
            uniform = uniform_position_weight(self.block_size, gamma)
        return SelectorLoss(
            self.model.candidate_selector,
            objective.selector_loss_weight,
            objective.selector_misses,
            objective.selector_backbone_grad,
            uniform,
        )

    def _flat_gradients(
        self, named: list[tuple[str, torch.nn.Parameter]]
    ) -> tuple[list[torch.nn.Parameter], torch.Tensor]:
        """(parameters, one fp32 buffer whose views are their .grad). Muon's matrices come
        first: their gradients, then their updates, are one contiguous slice (`update_share`)."""
        first = [] if self.muon is None else self.muon.param_groups[0]["params"]
        taken = {id(p) for p in first}
        params = [*first, *(p for _, p in named if id(p) not in taken)]
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel, device=self.device, dtype=torch.float32)
        offset = 0
        for p in params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return params, flat

    @property
    def feature_width(self) -> int:
        """Width of the features a batch brings: the selected layers', then for a loss on the
        target's distribution the teacher's input (`model.target.feature_layer_ids`)."""
        extra = self.model.config.hidden_size if self.needs_teacher else 0
        return self.context_width + extra

    def _split_features(self, features: torch.Tensor) -> tuple[torch.Tensor, Teacher | None]:
        """The drafter's context features and the loss's teacher input (views, no copy)."""
        assert features.shape[-1] == self.feature_width, (
            f"features of width {features.shape[-1]}, the replica reads {self.feature_width}"
        )
        if not self.needs_teacher:
            return features, None
        w = self.context_width
        teacher = Teacher(features[..., w:], self.head.logit_softcap)
        return features[..., :w], teacher

    def split_optimizer(self, part: int, parts: int) -> None:
        """Share Muon's orthogonalisation with the other replicas of every step: this replica
        (`part` of `parts`, over every node) orthogonalises its share of the matrices in
        `apply`, the pipeline sums `update_share` over the replicas, and `finish` applies every
        update. No effect without Muon or with one replica in all."""
        if self.muon is None or parts < 2:
            return
        matrices = self.muon.param_groups[0]["params"]
        owners = balanced_shares([p.shape for p in matrices], parts)
        self._owned = [owner == part for owner in owners]
        self.update_share = self.flat_grad[: sum(p.numel() for p in matrices)]

    def _autocast(self, enabled: bool = True):
        """fp32 master weights, matmuls in the compute dtype (CPU autocast too: --dtype bfloat16
        on CPU runs the same mixed-precision path as CUDA, only slower). One region spans a
        micro-step, so each weight is cast once however many chunks run (autocast keeps its
        casts until the outermost region ends); backward runs in a nested region with autocast
        off (`enabled=False`), as it ran outside any region before."""
        if self.compute_dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)
        return contextlib.nullcontext()

    def runs_chunked(self, rows: int, blocks: int) -> bool:
        """Whether a micro-batch of `rows` rows of `blocks` blocks runs one anchor chunk at a
        time (`chunked_step`, past `whole_step_tokens`) rather than in one pass."""
        return self.chunked and rows * blocks * self.block_size > self.whole_step_tokens

    def micro_step(self, batch: HSBatch) -> LossOutput | None:
        """Forward + backward of the loss numerator; None when the batch supervises nothing."""
        job = batch.job
        if job.num_supervised == 0:
            return None  # zero weight: nothing to learn, nothing to add to the gradients
        faults.point("drafter_forward")
        dev = self.device
        features = handover(batch.features, dev, batch.ready)  # ordered after the target, no wait
        features, teacher = self._split_features(features)
        rounds = None
        if self.streams is None:
            blocks = _Blocks.of_job(job)
        else:
            rounds = self._rounds(job, features)
            mask_id = self.model.config.mask_token_id
            blocks = _Blocks.of_rounds(job, rounds, self.block_size, mask_id, self.attention_chunks)
        layout = blocks.layout
        # Host tensors, pinned by the prefetchers on CUDA: every copy here is asynchronous.
        # The layout goes over whole (contiguous) and is sliced on the device.
        with self._autocast():
            embeds = self.head.embed_tokens(blocks.block_ids.to(dev, non_blocking=True))
            if self.runs_chunked(blocks.block_ids.shape[0], layout.num_blocks):
                chunks = blocks.split(layout)
                out = self._chunked_step(embeds, features, layout_to(layout, dev), chunks, teacher)
            else:
                targets = (blocks.targets.to(dev), _to(blocks.rejected, dev))
                out = self._whole_step(embeds, features, layout_to(layout, dev), targets, teacher)
        out.loss_sum = out.loss_sum.detach()
        if rounds is not None:
            out.normaliser = rounds.normaliser
            out.rounds = (rounds.num_rounds, rounds.num_emitted, rounds.num_rejected)
        self._clock.end_group()  # one micro-batch, however many chunks it ran
        self._report_times()
        self._check_grad_views()
        return out

    def _rounds(self, job: Job, features: torch.Tensor) -> RoundBlocks:
        """The current drafter's verify rounds over the rows' responses (one no-grad parallel
        forward) and the blocks they train. Costs a device-to-host copy of the drafts: the
        rounds decide the blocks, so the host waits for them here, once per micro-batch (the
        price of on-policy anchors; random anchors are decided by the prefetchers)."""
        assert job.loss_mask is not None, "on-policy anchors need the job's loss mask"
        ids = job.input_ids.to(self.device, non_blocking=True)
        with self._clock.segment("drafter_rounds_s"), self._autocast():
            rounds = batch_rounds(
                self.model,
                self.head,
                features,
                ids,
                job.loss_mask,
                self.attention,
                chunk_rows=self.chunk_rows,
            )
        assert self.streams is not None
        return round_blocks(job.input_ids, job.loss_mask, rounds, self.block_size, self.streams)

    @property
    def on_policy(self) -> bool:
        """Whether the replica trains on its own verify rounds (their blocks per row, and so
        the attention's shapes, are known only at each step)."""
        return self.streams is not None

    def run_blocks(self, rows: int, length: int, blocks: int) -> None:
        """One attention call of `blocks` mask-token blocks per row of `rows` rows over
        `length` zero context features, without gradients (as the rounds' parallel forward)
        and with them, backward included (as a training chunk): a warm-up's trace of that
        shape. Trains nothing."""
        cfg, dev, b = self.model.config, self.device, self.block_size
        real = min(blocks, max(1, length - 1))  # ascending anchors, the rest padding
        anchors = torch.zeros(rows, blocks, dtype=torch.long)
        anchors[:, :real] = torch.arange(real)
        valid = torch.zeros(rows, blocks, dtype=torch.bool)
        valid[:, :real] = True
        layout = BlockLayout.build(anchors, valid, b, dev, num_chunks=1)
        ids = torch.full((rows, blocks * b), cfg.mask_token_id, device=dev)
        features = torch.zeros(rows, length, self.context_width, device=dev)
        for grad in (False, True):
            with torch.set_grad_enabled(grad), self._autocast():
                context = self.model.context_kv(features.to(self.compute_dtype))
                ((_, _, sub, kv),) = layout.chunk_views(context, self.attention)
                hidden = self.model.blocks(self.head.embed_tokens(ids), kv, sub, self.attention)
            if grad:
                with self._autocast(enabled=False):
                    hidden.float().sum().backward()
        self.flat_grad.zero_()

    def _report_times(self, wait: bool = False) -> None:
        """Stage seconds of the work the device has finished (no wait unless `wait`)."""
        for group in self._clock.harvest(wait):
            for stage, seconds in group.items():
                self.timers.add(stage, seconds)

    def flush_timers(self) -> None:
        """At the end of a run: wait for the device once and report the last stage times."""
        self._report_times(wait=True)

    def _loss(
        self,
        hidden: torch.Tensor,
        targets: tuple[DraftTargets, DraftTargets | None],
        teacher: Teacher | None,
    ) -> LossOutput:
        """The micro-batch's (or chunk's) loss: the response stream, and with on-policy anchors
        the rejected-draft stream (`targets`: the two streams' rows on the device)."""
        head = self.head
        targets, rejected = targets
        return draft_loss(
            hidden,
            targets,
            head.head,
            self.block_size,
            self.chunk_rows,
            head.head_bias,
            self.selector,
            self.positions,
            self.loss,
            teacher,
            rejected if rejected is not None and len(rejected) else None,
        )

    def _whole_step(self, embeds, features, layout, targets, teacher) -> LossOutput:
        """Every block of the micro-batch in one forward, then one backward."""
        with self._clock.segment("drafter_forward_s"):
            hidden = self.model(embeds, features, layout, self.attention)
            out = self._loss(hidden, targets, teacher)
        with self._clock.segment("drafter_backward_s"), self._autocast(enabled=False):
            faults.point("drafter_backward")
            out.loss_sum.backward()
        return out

    def _chunked_step(self, embeds, features, layout, chunk_targets, teacher) -> LossOutput:
        """Forward, loss and backward one anchor chunk at a time.

        Blocks see only the context and themselves, so a chunk's rows, loss and gradients are
        exactly what the whole micro-batch would give for them: activation memory is one chunk's
        and nothing is recomputed. The context keys/values are shared: computed once, each chunk
        backpropagates into detached copies, and their summed gradients go through the context
        path (fc, hidden_norm, k/v projections) once at the end.
        """
        dev, b = self.device, self.block_size
        with self._clock.segment("drafter_forward_s"):
            context_kv = self.model.context_kv(features)
            # fp32 leaves: their gradients sum over every chunk, in fp32 even under bf16
            # autocast; cast to the kernels' dtype once for every chunk (the kernels read it).
            leaves = [t.detach().float().requires_grad_() for t in _flat(context_kv)]
            cast = [_compute_dtype(t) for t in leaves]
        dtype = context_kv[0][0].dtype  # the blocks' residual stream's, as in the whole step
        pairs = list(zip(cast[0::2], cast[1::2], strict=True))
        total = None
        views = layout.chunk_views(pairs, self.attention)  # of the device layout and context
        for (lo, hi, sub, kv), (targets, rejected) in zip(views, chunk_targets, strict=True):
            if not len(targets):
                continue  # padding blocks or unsupervised positions only: no loss, no gradient
            with self._clock.segment("drafter_forward_s"):
                x = embeds[:, lo * b : hi * b]
                hidden = self.model.blocks(x, kv, sub, self.attention, dtype)
                out = self._loss(hidden, (targets.to(dev), _to(rejected, dev)), teacher)
            with self._clock.segment("drafter_backward_s"), self._autocast(enabled=False):
                faults.point("drafter_backward")
                out.loss_sum.backward()
            total = out if total is None else total.add_(out)
        with self._clock.segment("drafter_backward_s"), self._autocast(enabled=False):
            grads = [(t, leaf.grad) for t, leaf in zip(_flat(context_kv), leaves, strict=True)]
            grads = [(t, g) for t, g in grads if g is not None]
            if grads:
                torch.autograd.backward([t for t, _ in grads], [g.to(t.dtype) for t, g in grads])
        return total

    def _check_grad_views(self) -> None:
        # Autograd accumulates into existing .grad in place; if it ever replaced one, the flat
        # buffer would silently miss that parameter's gradient.
        p = self.params[0]
        base = self.flat_grad.data_ptr()
        assert base <= p.grad.data_ptr() < base + self.flat_grad.numel() * 4, (
            "a parameter's .grad is no longer a view of the flat gradient buffer"
        )

    def apply(self, global_weight: float) -> torch.Tensor | None:
        """Normalise the summed gradients by the global weight, clip, step, zero.

        Returns the pre-clip gradient norm (a device tensor), or None when the global weight is 0
        (nothing was supervised anywhere: the update is skipped, the step still counted, so
        every step of the schedule has its own number: its learning rate, evaluation,
        checkpoint and metric line).
        """
        if global_weight <= 0:
            self.flat_grad.zero_()
            self._end_step()
            return None
        with self._clock.segment("optimizer_s"):
            self.flat_grad.div_(global_weight)
            norm = self.flat_grad.norm()  # stays on the device: read at log steps only
            clip = self.optim_opts.grad_clip
            if clip > 0:
                self.flat_grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))
            opts = self.optim_opts
            set_schedule(self.optimizer, lr_at(self.step, self.total_steps, opts) / opts.lr)
            if self._owned is None:
                self.mid_step = True  # an error inside (an OOM) leaves the weights half updated
                self.optimizer.step()
            else:
                self._begin_split_step()
                return norm  # `finish` completes the step once the shares are summed
            self.flat_grad.zero_()
        self._end_step()
        return norm

    def _begin_split_step(self) -> None:
        """AdamW's part in full; Muon's momentum for every matrix and the orthogonalised
        updates of this replica's share, written over their gradients (read just before)."""
        assert self.muon is not None and self._owned is not None
        for opt in self.optimizer.optimizers:
            if opt is not self.muon:
                opt.step()
        matrices = self.muon.param_groups[0]["params"]
        self.mid_step = True
        self.muon.begin(self._owned, [p.grad for p in matrices])

    def finish(self) -> None:
        """After `update_share` was summed over the replicas: apply Muon's updates, zero the
        gradients, count the step."""
        assert self.muon is not None and self.update_share is not None
        with self._clock.segment("optimizer_s"):
            self.muon.finish([p.grad for p in self.muon.param_groups[0]["params"]])
            self.flat_grad.zero_()
        self._end_step()

    def _end_step(self) -> None:
        self.mid_step = False
        self.step += 1
        self._clock.end_group()
        self._report_times()

    @property
    def lr(self) -> float:
        return lr_at(max(0, self.step - 1), self.total_steps, self.optim_opts)


def _compute_dtype(t: torch.Tensor) -> torch.Tensor:
    """`t` in autocast's dtype where a region is on (the attention kernels' operands), else
    itself."""
    dev = t.device.type
    return t.to(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else t


def round_streams(objective: ObjectiveOptions, block_size: int) -> RoundStreams | None:
    """The on-policy streams' settings of `objective` (None with random anchors)."""
    if not objective.on_policy:
        return None
    gamma = loss_gamma(block_size, objective.gamma)
    weight = objective.opd_rejected_weight
    return RoundStreams(gamma, objective.position_weights, objective.opd_gamma, weight)


def _flat(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [t for pair in pairs for t in pair]


def _to(targets: DraftTargets | None, device: torch.device) -> DraftTargets | None:
    return None if targets is None else targets.to(device)


@dataclass
class _Blocks:
    """What a micro-step trains: block inputs, layout, the response stream's targets and the
    rejected-draft stream's (None with random anchors), all on the host."""

    block_ids: torch.Tensor
    layout: BlockLayout
    targets: DraftTargets
    rejected: DraftTargets | None = None
    chunk_targets: list[DraftTargets] = field(default_factory=list)

    @classmethod
    def of_job(cls, job: Job) -> _Blocks:
        """The prefetcher's random anchors."""
        return cls(job.block_ids, job.layout, job.targets, None, job.chunk_targets)

    @classmethod
    def of_rounds(
        cls, job: Job, rounds: RoundBlocks, block_size: int, mask_token_id: int, chunks: int
    ) -> _Blocks:
        """The blocks of the replica's own rounds, with their chunk plan (host)."""
        ids = block_token_ids(job.input_ids, rounds.anchors, block_size, mask_token_id)
        layout = BlockLayout.build(rounds.anchors, rounds.valid, block_size, None, chunks)
        return cls(ids, layout, rounds.targets, rounds.rejected)

    def split(self, layout: BlockLayout) -> list[tuple[DraftTargets, DraftTargets | None]]:
        """Both streams split by the layout's anchor chunks (the chunked step's)."""
        n, b = layout.num_blocks, layout.block_size
        targets = self.chunk_targets or self.targets.split_by_chunks(n, b, layout.chunks)
        if self.rejected is None:
            return [(t, None) for t in targets]
        return list(zip(targets, self.rejected.split_by_chunks(n, b, layout.chunks), strict=True))
