"""Training configuration: typed sections, one docstring per field (= the CLI help).

Flags are the field names with dashes (`--hs-queue-depth`); a YAML file (`--config`) may give
the same names flat or grouped by section (`pipeline: {hs_queue_depth: 90}`); flags win over the
file, the file over the defaults. Each component receives only its own section.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from dflash_train.dataclass_cli import add_arguments as add_dataclass_arguments
from dflash_train.dataclass_cli import (
    build,
    coerced,
    dataclass_fields,
    load_yaml,
    parsed_overrides,
    to_dict,
)
from dflash_train.recipes import Recipe, get_recipe, unmet_requirements

# Layer type names as Qwen3 configs (and so the exported drafter) spell them.
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


@dataclass
class ModelOptions:
    """What to train: the target, and the drafter's shape."""

    target: str = ""
    """Target model: a local Hugging Face causal-LM directory (Qwen3, Llama, ...)."""
    draft_layers: int = 5
    """Decoder layers in the drafter (the paper uses 5; 8 for a coder target)."""
    block_size: int = 16
    """Tokens per block: the anchor plus block_size - 1 predicted tokens."""
    num_target_features: int = 5
    """K: how many target layers condition the drafter (ids by the paper's rule)."""
    target_layer_ids: list[int] | None = None
    """Explicit target layer ids (overrides the paper's rule), e.g. 1,9,17,25,33: ascending and
    distinct, the order in which vLLM and SGLang gather them."""
    mask_token_id: int | None = None
    """Embedding row for masked block slots; default: the tokenizer's <|MASK|>, else the first
    spare embedding row, else a reserved special token."""
    sliding_window: int | None = None
    """Window (tokens) of sliding-window draft layers, e.g. 2048. Alone it gives the layout of
    recent official drafters: every layer sliding except the last --full-attention-layers."""
    full_attention_layers: int | None = None
    """With --sliding-window (and no --layer-types): how many of the top draft layers keep full
    attention (1 when unset; 0 = all sliding)."""
    layer_types: list[str] | None = None
    """Attention of each draft layer instead, bottom first, e.g. sliding,sliding,full,full,full
    (sliding / full, or sliding_attention / full_attention); default: all full."""
    causal_in_block: bool | None = None
    """Causal attention inside the block for every layer (on) or for none (off); unset: sliding
    layers causal, full layers bidirectional (the reference client's and vLLM's rule), and for
    dflash2 off (its checkpoint contract's is_causal: false). Exported as is_causal."""
    arch: Literal["dflash", "dflash2"] = "dflash"
    """Drafter architecture: dflash (DFlash 1) or dflash2 (per layer two grouped dynamic
    convolutions, and a candidate path selector over the top-K unary candidates)."""
    conv_kernel_size: int = 2
    """dflash2: taps of each convolution (the current position and the ones before it, never
    across a block boundary); at most 3, what the served implementations run at a decode's
    shortest (2-token) final block."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic tap; must divide the hidden size."""
    selector_rank: int = 256
    """dflash2: rank of the selector's predecessor / successor codebooks and hidden projection."""
    selector_top_k: int = 16
    """dflash2: unary candidates the selector scores per draft position."""
    init_from: str | None = None
    """Start from a trained drafter (an export, checkpoint or run directory) with the same
    backbone, e.g. a DFlash 1 drafter for --arch dflash2: its weights are copied, the DFlash 2
    modules start at the identity (the drafter then drafts exactly what it did)."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the target (off unless you trust it)."""
    dtype: str = "auto"
    """Compute dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16. (float16 is
    refused: its gradients underflow without loss scaling, which this trainer does not do.)"""

    def __post_init__(self) -> None:
        check_floats(self)
        _positive(self, "draft_layers", "num_target_features")
        _positive(self, *DFLASH2_OPTIONS)
        if self.conv_kernel_size > MAX_CONV_KERNEL_SIZE:
            raise ValueError(
                f"conv_kernel_size must be <= {MAX_CONV_KERNEL_SIZE}, got "
                f"{self.conv_kernel_size}: the reference client's convolution (PyPI dflash "
                "0.1.0) fails on a block shorter than kernel_size - 1 positions, and a decode's "
                "last block can be 2 tokens (this project's own eval clamps the taps there, so "
                "it would not show)"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.dtype == "float16":
            raise ValueError(
                "dtype float16 is not supported for training: fp16 gradients underflow without "
                "loss scaling, which this trainer does not do; use bfloat16 (or float32)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16: {self.dtype!r}")
        self.draft_layer_types()  # a layout that cannot be built is refused now

    def draft_layer_types(self) -> list[str]:
        """Each draft layer's attention ("full_attention" / "sliding_attention"), from
        --layer-types, or from --sliding-window and --full-attention-layers."""
        n, window, n_full = self.draft_layers, self.sliding_window, self.full_attention_layers
        if window is not None and window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {window}")
        if self.layer_types is not None:
            if n_full is not None:
                raise ValueError(
                    "give --layer-types or --full-attention-layers, not both (--layer-types "
                    "names every layer)"
                )
            names = {t: t for t in (FULL_ATTENTION, SLIDING_ATTENTION)}
            names |= {"full": FULL_ATTENTION, "sliding": SLIDING_ATTENTION}
            bad = [t for t in self.layer_types if t not in names]
            if bad:
                raise ValueError(f"layer_types: unknown {bad}; use sliding or full per layer")
            types = [names[t] for t in self.layer_types]
            if len(types) != n:
                raise ValueError(
                    f"layer_types names {len(types)} layers, the drafter has draft_layers={n}"
                )
            if SLIDING_ATTENTION in types and window is None:
                raise ValueError("layer_types has sliding layers: give their --sliding-window")
            if SLIDING_ATTENTION not in types and window is not None:
                raise ValueError(
                    f"--sliding-window {window} has no effect: layer_types has no sliding layer"
                )
            return types
        if window is None:
            if n_full is not None:
                raise ValueError("--full-attention-layers needs --sliding-window")
            return [FULL_ATTENTION] * n
        n_full = 1 if n_full is None else n_full
        if not 0 <= n_full < n:
            raise ValueError(
                f"full_attention_layers must be in 0..{n - 1} (draft_layers={n}; all full is "
                f"the default without --sliding-window), got {n_full}"
            )
        return [SLIDING_ATTENTION] * (n - n_full) + [FULL_ATTENTION] * n_full


MAX_CONV_KERNEL_SIZE = 3
"""The largest --conv-kernel-size the served convolution runs on every block a decode makes:
tap tau reads position t - tau, and the reference client shifts a block of L positions by tau
with a pad that breaks for tau > L; the last block of a decode has L >= 2 (pinned by
tests/unit/model/test_dflash2.py against the reference)."""

DFLASH2_OPTIONS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""ModelOptions fields that only a dflash2 drafter has."""


LossName = Literal["ce", "kl", "lk_alpha", "lk_lambda"]
LOSSES: tuple[str, ...] = get_args(LossName)
ANCHORS = ("random", "on-policy")
"""The block positions' losses (`head_loss`): ce on the data's tokens, the others on the
target's distribution."""


@dataclass
class ObjectiveOptions:
    """The training objective."""

    num_anchors: int = 512
    """Maximum random anchors (blocks) per sequence, re-sampled every epoch."""
    gamma: float | None = None
    """--position-weights decay: exp(-(k-1)/gamma) over block offsets; default 7/5/4 for block
    16/10/8."""
    position_weights: Literal["decay", "dpace"] = "dpace"
    """Weights of the block positions: dpace (D-PACE: each position's credit towards the
    expected accepted length from the drafter's own detached confidences, loss divided by the
    valid anchors; dflash2: the selector term from the selector's confidences) or decay (the
    paper's exp(-(k-1)/gamma), loss divided by the weights' sum). dpace measured best here; see
    docs, Objectives."""
    dpace_alpha: float = 0.5
    """dpace: confidence smoothing q~ = (1 - alpha) q + alpha, in (0, 1] (1 = weights B - j)."""
    loss: LossName = "ce"
    """Each block position's loss (default ce, with --anchors on-policy too: there the data is
    the target's greedy output, and a kl stage from a ce-trained drafter lost 0.72 tau to SFT at
    equal steps on GSM8K where a ce stage tied; docs: On-policy rounds against SFT): ce
    (cross-entropy on the data's token, the paper's), or one on
    the target's own next-token distribution p at that position (the teacher: its LM head on its
    final-normed last hidden state, teacher-forced): kl (KL(p || q), the soft cross-entropy's
    gradient), lk_alpha (-log of the acceptance rate sum_v min(p, q)) or lk_lambda (lambda KL +
    (1 - lambda)(1 - alpha), lambda = exp(-lk_eta alpha)). The teacher's losses need the target
    in process or a feature store captured with --teacher-input; on data the target did not
    write kl beat ce by 0.17 tau (8 percent), and ce given kl's compute by 0.10, where the
    target is uncertain, and tied where it is near one-hot (docs: Losses against each other)."""
    lk_eta: float = 3.0
    """lk_lambda: eta, how fast the KL term gives way to the acceptance rate as alpha grows."""
    anchors: Literal["random", "on-policy"] = "random"
    """Where blocks are anchored: random (up to --num-anchors valid positions per row, drawn
    per epoch) or on-policy (Draft-OPD: every anchor of the current drafter's own greedy verify
    rounds over each response, recomputed at every step from one extra no-grad forward; trains
    offsets 1 .. accepted + 1 of each round and, with --opd-rejected-weight, the rejected
    drafts). See docs/guides/on-policy.md."""
    opd_gamma: float = 0.8
    """on-policy: the rejected-draft stream weighs a rejection at block offset k gamma^(k-1)."""
    opd_rejected_weight: float = 1.0
    """on-policy: weight of the rejected-draft stream (the k3 estimate of KL(q || p) at each
    rejected draft token; needs the target's distribution: the teacher input); 0 turns it off."""
    attention: Literal["auto", "dense", "blockwise", "flex"] = "auto"
    """Block-mask attention kernel: auto = flex on CUDA, blockwise elsewhere."""
    attention_chunks: int = 8
    """Anchor chunks per micro-batch (anchors sorted): each sees only its context prefix, and
    with chunked_step each runs forward, loss and backward on its own."""
    loss_chunk_size: int = 0
    """Rows per LM-head loss chunk; 0 = automatic (one chunk of fp32 logits within 64 MiB on
    CPU, 1/64 of the device's memory on CUDA; 512-4096 rows)."""
    chunked_step: bool = True
    """Run forward, loss and backward one anchor chunk at a time. Exact (blocks never see each
    other) and nothing is recomputed: activation memory is one chunk's instead of the whole
    micro-batch's. Off (--no-chunked-step): all blocks in one forward and one backward."""
    whole_step_tokens: int | None = None
    """With chunked_step: a micro-batch of at most this many block tokens (rows x blocks x
    block size) still runs as one forward, loss and backward (the same numbers, about 1/5 of
    the operations dispatched: each layer runs once instead of once per anchor chunk; the
    activations of all its blocks at once). Unset: on CUDA as many as 0.4 of the GPU's memory
    holds (an H200 and the Qwen3-8B drafter: 43K, the recipe's 4 x 512 x 16 = 32,768 in one
    pass), 0 (never) on CPU, where the chunked step measured faster."""
    selector_loss_weight: float = 1.0
    """dflash2: alpha, the weight of the selector's K-way cross-entropy (teacher-forced, the
    unary term's position weights) beside the unary DFlash loss."""
    selector_misses: Literal["exclude", "inject"] = "exclude"
    """dflash2: a gold token outside the top K is left out of the selector term (exclude) or
    replaces the weakest candidate for the loss only (inject). See docs, Performance."""
    selector_backbone_grad: bool = True
    """dflash2: the selector term's gradient reaches the drafter's backbone (off: it trains the
    selector's own parameters only). See docs, Performance."""
    selector_weights: Literal["decayed", "uniform"] = "decayed"
    """dflash2: position weights of the selector term: decayed = the unary term's kind
    (--position-weights: the decay, or D-PACE from the selector's confidences), or uniform
    (every supervised position alike, at the decay's mean). See docs, DFlash 2."""

    def __post_init__(self) -> None:
        check_floats(self)
        _positive(self, "num_anchors", "attention_chunks")
        if self.loss_chunk_size < 0:
            raise ValueError("loss_chunk_size must be >= 0")
        if self.whole_step_tokens is not None and self.whole_step_tokens < 0:
            raise ValueError(f"whole_step_tokens must be >= 0, got {self.whole_step_tokens}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.anchors not in ANCHORS:
            raise ValueError(f"anchors must be one of {', '.join(ANCHORS)}, got {self.anchors!r}")

    @property
    def on_policy(self) -> bool:
        """Whether blocks are anchored at the drafter's own verify rounds."""
        return self.anchors == "on-policy"

    @property
    def rejected_stream(self) -> bool:
        """Whether the on-policy rejected-draft stream is trained (it reads the teacher)."""
        return self.on_policy and self.opd_rejected_weight > 0

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss reads the target's distribution (its last hidden state)."""
        return self.loss != "ce" or self.rejected_stream

    @property
    def teacher_reason(self) -> str:
        """What makes the run read the teacher input (for one-line refusals)."""
        reasons = [f"--loss {self.loss}"] if self.loss != "ce" else []
        if self.rejected_stream:
            reasons.append("the rejected-draft stream of --anchors on-policy")
        return " and ".join(reasons)

    @property
    def teacher_free(self) -> str:
        """The flags that let this run train without the teacher input, all of them: with kl
        and the rejected stream, --loss ce alone still reads the teacher."""
        flags = ["--loss ce"] if self.loss != "ce" else []
        if self.rejected_stream:
            flags.append("--opd-rejected-weight 0")
        return " ".join(flags)


def on_policy_only_options(objective: ObjectiveOptions) -> list[str]:
    """The on-policy flags set away from their defaults while anchors are random."""
    if objective.on_policy:
        return []
    default = ObjectiveOptions()
    names = ("opd_gamma", "opd_rejected_weight")
    changed = [n for n in names if getattr(objective, n) != getattr(default, n)]
    return [f"--{n.replace('_', '-')}" for n in changed]


SELECTOR_OPTIONS = (
    "selector_loss_weight",
    "selector_misses",
    "selector_backbone_grad",
    "selector_weights",
)
"""ObjectiveOptions fields that only a dflash2 drafter uses."""


@dataclass
class OptimOptions:
    """Optimizer and schedule."""

    lr: float = 6e-4
    """Peak learning rate of AdamW (with --optimizer muon: of the parameters AdamW keeps)."""
    optimizer: Literal["adamw", "muon"] = "muon"
    """muon: Muon for the 2-D weights of the backbone's linear layers (fc, attention and MLP
    projections), AdamW for the rest (norms, DFlash 2's convolutions and selector); or adamw
    for every parameter. muon measured best here; see docs, Objectives."""
    muon_lr: float | None = None
    """muon: peak learning rate of the Muon parameters, on AdamW's scale (its update RMS is
    matched to AdamW's); default: 2 x --lr (the best of a sweep, docs, Objectives)."""
    warmup_ratio: float = 0.04
    """Fraction of the steps spent warming up linearly from 0 to lr."""
    min_lr_ratio: float = 0.0
    """Cosine decay ends at lr * min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    grad_accum: int = 1
    """Micro-batches per drafter per optimizer step."""

    def __post_init__(self) -> None:
        check_floats(self)
        _positive(self, "grad_accum")


@dataclass
class PipelineOptions:
    """Data, batching and the threaded pipeline."""

    data: str = ""
    """Prepared dataset directory (from `dflash-train prepare`)."""
    target_devices: list[str] | None = None
    """Devices running the frozen target, e.g. cuda:0,cuda:1 or cpu. Default: cuda:0 when CUDA
    exists, else cpu."""
    drafter_devices: list[str] | None = None
    """Devices training drafter replicas, e.g. cuda:2,cuda:3 or cpu,cpu. Default: the remaining
    CUDA devices, else cpu."""
    share_device: bool = False
    """Allow a GPU listed as both a target and a drafter device (the roles time-slice it; the
    default on a one-GPU machine). A GPU listed twice in one role is always refused."""
    batch_size: int = 4
    """Sequences per batch of fully anchored sequences (work batching: the budget is
    batch_size x num_anchors x block_size block positions); the batch size (fixed batching)."""
    batch_cost: str = "flops"
    """What work batching's budget counts, as the share of a full batch's cost that grows with
    its padded tokens (the rest grows with its block positions): flops (the drafter's model
    FLOPs at the longest bucket: the same batches on every launch and machine), auto (timed on
    the first drafter before training: another launch may plan other batches), blocks (the
    share is 0), tokens (1), or a share in [0, 1]. The share is recorded in the run's config."""
    batch_tokens: int | None = None
    """Padded tokens per batch: the cap of work batching (default batch_size x the longest
    bucket); with fixed batching, batch size per bucket = batch_tokens // bucket length."""
    batching: Literal["work", "fixed"] = "work"
    """work: each batch fills one budget of the drafter's work (its block positions), so the
    batches of one lockstep step cost about the same whatever their lengths; fixed:
    batch_size rows (or the batch_tokens budget)."""
    num_buckets: int | None = None
    """Number of padded lengths, fitted to the data's length histogram to minimise padding.
    Unset (auto): the fewest that pad at most 0.05 of the tokens (at most 32), but no more than
    let the length mix hold in every 50-step window at the run's batches per step (an ideal
    pull within 0.03 total variation: fewer buckets mix better in a short window, more pad
    less). Chosen from the data, the same on a resume."""
    bucket_lengths: list[int] | None = None
    """Explicit padded lengths (ascending) instead of fitted ones."""
    num_prefetchers: int = 5
    """Prefetcher threads building padded batches (and sampling anchors)."""
    job_queue_depth: int = 32
    """Bound of the job queue between prefetchers and target workers."""
    hs_queue_depth: int = 90
    """Bound (batches) of the hidden-state queue between target and drafter workers (with
    --mix plan at least one step's: drafters x --grad-accum)."""
    hs_min_ready: int = 30
    """Drafters wait until this many batches are buffered (while targets run), so every step
    draws from a mixed pool."""
    hs_queue_bytes: str | None = None
    """Optional memory bound of the hidden-state queue, e.g. 40GiB or 500MB."""
    mix: Literal["plan", "stratified", "random", "fifo"] = "plan"
    """How drafters take batches: plan (the epoch plan's order, restored in the queues: which
    batch each replica trains at each step follows from the data, flags, seed and world size
    alone, so a run reproduces and a resume equals the uninterrupted run; the plan already
    interleaves buckets by their shares), or an arrival-order pull, for comparison:
    stratified (buckets in the dataset's proportions), random, or fifo."""
    compile: bool = False
    """torch.compile the draft layers and the target forward (dynamic shapes), traced on every
    bucket length per device before the workers start (which then never trace)."""
    cuda_graphs: bool = False
    """Replay the target forward from CUDA graphs, one per bucket length (rows padded to the
    bucket's largest planned batch), captured per device before the workers start."""
    cpu_threads: int = 0
    """torch intra-op threads for CPU workers (0 = cores / CPU workers). Workers are threads,
    and more than one intra-op thread each makes every small operator wait for a wake-up once
    the process holds more OpenMP threads than cores: more drafter replicas at 1 thread each
    (`--drafter-devices cpu,cpu`) use the cores better."""
    stall_timeout: float = 900.0
    """Seconds without any pipeline progress after which the run is declared hung and stopped
    (also a checkpoint write that writes no byte for this long)."""
    features: str | None = None
    """Train from a feature store (`dflash-train capture`) instead of the target: reader
    threads take the target workers' place and no target is loaded on any device (only its
    embedding and LM head, read from its safetensors). The store must match the target, the
    data and the drafter's layers."""
    num_readers: int = 2
    """Reader threads in the target workers' place with --features."""
    cache_features: str | None = None
    """Hybrid: the first epoch computes the features online and writes them to this feature
    store, later epochs read them (a run resumed in either phase reads what is stored)."""
    cache_budget: str | None = None
    """With --cache-features: the most the store may hold, e.g. 20GiB; when not every row fits,
    it keeps the rows that save the most target work per byte and the rest is computed online
    every epoch (the run says which)."""
    cache_dtype: Literal["fp8", "bf16", "fp32"] = "bf16"
    """With --cache-features: the store's dtype (fp8: e4m3 with a scale per token and layer)."""

    def __post_init__(self) -> None:
        check_floats(self)
        _positive(
            self,
            "num_readers",
            "batch_size",
            "num_prefetchers",
            "job_queue_depth",
            "hs_queue_depth",
            "hs_min_ready",
        )
        if self.hs_min_ready > self.hs_queue_depth:
            raise ValueError(
                f"hs_min_ready ({self.hs_min_ready}) must be <= hs_queue_depth "
                f"({self.hs_queue_depth})"
            )
        if self.num_buckets is not None and self.num_buckets < 1:
            raise ValueError(f"num_buckets must be positive when set, got {self.num_buckets}")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError("batch_tokens must be positive when set")
        if self.bucket_lengths is not None and (
            not self.bucket_lengths
            or sorted(set(self.bucket_lengths)) != self.bucket_lengths
            or self.bucket_lengths[0] < 2
        ):
            raise ValueError(f"bucket_lengths must be ascending and >= 2: {self.bucket_lengths}")
        if self.hs_queue_bytes is not None:
            parse_bytes(self.hs_queue_bytes)
        token_share_of(self.batch_cost)
        if self.features and self.cache_features:
            raise ValueError("give --features (a captured store) or --cache-features, not both")
        if self.cache_budget is not None:
            if not self.cache_features:
                raise ValueError("cache_budget needs --cache-features")
            parse_bytes(self.cache_budget, "cache_budget")

    @property
    def token_share(self) -> float | None:
        """batch_cost as the share of a full batch's cost that scales with tokens; None: auto
        (measured by the trainer)."""
        return token_share_of(self.batch_cost)

    @property
    def hs_queue_max_bytes(self) -> int | None:
        return None if self.hs_queue_bytes is None else parse_bytes(self.hs_queue_bytes)


@dataclass
class RunOptions:
    """The run: where it writes, how long it trains, when it logs, evaluates and saves."""

    out: str = "runs/dflash"
    """Run directory (config, metrics, checkpoints)."""
    epochs: int = 6
    """Passes over the dataset."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (also sets the schedule length)."""
    seed: int = 0
    """Seed for shuffling, anchors and initialisation."""
    log_every: int = 10
    """Optimizer steps between metric lines (the only host syncs of the hot loop)."""
    eval_every: int = 0
    """Optimizer steps between short speculative-decoding evaluations (0 = never)."""
    eval_prompts: str | None = None
    """JSON-lines prompts for the in-training evaluation (conversation or {"prompt"} rows)."""
    eval_num_prompts: int = 8
    """How many of those prompts each evaluation runs."""
    eval_max_new_tokens: int = 64
    """Tokens generated per prompt in the in-training evaluation."""
    save_every: int = 0
    """Optimizer steps between checkpoints (0 = only the final one). Checkpoints are written
    atomically by a background thread; `train --resume RUN_DIR` continues from the newest."""
    keep_last: int = 3
    """Checkpoints kept in RUN_DIR/checkpoints: the newest N (0 = every one)."""
    stop_timeout: float = 60.0
    """Seconds a run may take, after SIGINT or SIGTERM, to finish its step in flight, write a
    checkpoint and exit; a second signal exits at once."""
    overwrite: bool = False
    """Start over in an existing run directory (its metrics and checkpoints are deleted)."""
    recipe: str | None = None
    """Start from a recipe shipped with the package, e.g. qwen3-8b (`--recipe list` or
    `dflash-train recipes` shows them, each value with its source): a --config file and the
    flags override any of its values; the run's config records its name."""

    def __post_init__(self) -> None:
        check_floats(self)
        _positive(self, "epochs", "log_every", "eval_num_prompts", "eval_max_new_tokens")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1 when set")
        if self.eval_every < 0 or self.save_every < 0 or self.keep_last < 0:
            raise ValueError("eval_every, save_every and keep_last must be >= 0")


@dataclass
class EngineOptions:
    """Where the target's hidden states come from: in-process transformers, or a vLLM engine."""

    target_backend: Literal["hf", "vllm"] = "hf"
    """hf: each target worker runs the frozen target in-process (one copy per target device);
    vllm: one vLLM engine computes the features (tensor parallel, its own kernels) and the
    target workers send it their batches. See docs, The target on a serving engine."""
    target_endpoint: list[str] | None = None
    """vllm: URL(s) of engines already running (`python -m dflash_train.engine.server`, as
    the docs start it), e.g. http://node1:8100 or a comma list (target workers take them in
    turn); unset: the trainer starts one engine and stops it."""
    vllm_python: str | None = None
    """vllm: the Python interpreter of the environment with vLLM the trainer starts the engine
    in (vLLM pins its own torch and transformers: its own venv works); default: this one."""
    target_tp: int = 1
    """vllm: tensor-parallel size of the engine the trainer starts; it gets the GPUs of
    --target-devices (as many as this)."""
    target_workers: int = 0
    """vllm: target worker threads, each with one batch in flight to the engine (0: one per
    --target-devices entry)."""
    engine_args: str | None = None
    """vllm: more vLLM engine arguments for the engine the trainer starts, as a JSON object,
    e.g. '{"gpu_memory_utilization": 0.85, "enable_expert_parallel": true}'."""
    engine_start_timeout: float = 900.0
    """vllm: seconds the engine may take to load the target and become ready."""

    def __post_init__(self) -> None:
        check_floats(self)
        _positive(self, "target_tp")
        if self.target_workers < 0:
            raise ValueError(f"target_workers must be >= 0, got {self.target_workers}")
        if self.target_backend not in ("hf", "vllm"):
            raise ValueError(f"target_backend must be hf or vllm, got {self.target_backend!r}")
        self.engine_args_dict  # noqa: B018 (parsed here so a bad value fails at construction)

    @property
    def engine_args_dict(self) -> dict[str, Any]:
        if not self.engine_args:
            return {}
        try:
            value = json.loads(self.engine_args)
        except ValueError as e:
            raise ValueError(f"engine_args is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"engine_args must be a JSON object, got {self.engine_args!r}")
        return value


ENGINE_ONLY = ("target_endpoint", "vllm_python", "target_tp", "target_workers", "engine_args")
"""EngineOptions fields that only the vllm backend uses."""


@dataclass
class MetricsOptions:
    """Where metrics go (JSON lines in the run directory are always written)."""

    tensorboard: bool = False
    """Also write TensorBoard event files to RUN_DIR/tensorboard."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (honours WANDB_MODE=offline)."""
    wandb_run_name: str | None = None
    """W&B run name; unset: the run directory's name."""
    progress: bool = True
    """Show a live progress bar on a terminal (one line per log step otherwise)."""


SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "objective": ObjectiveOptions,
    "optim": OptimOptions,
    "pipeline": PipelineOptions,
    "run": RunOptions,
    "metrics": MetricsOptions,
    "engine": EngineOptions,
}


@dataclass
class TrainConfig:
    """Everything `dflash-train train` needs, by section."""

    model: ModelOptions = field(default_factory=ModelOptions)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    optim: OptimOptions = field(default_factory=OptimOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    run: RunOptions = field(default_factory=RunOptions)
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    engine: EngineOptions = field(default_factory=EngineOptions)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    @classmethod
    def from_layers(cls, *layers: dict[str, Any]) -> TrainConfig:
        """Build from dicts (YAML, flags), later ones winning; each may be flat or sectioned.
        A recipe named in them (`recipe`; the last one named) is a layer under all of them."""
        name = _recipe_named(layers)
        if name is None:
            return cls._from_layers(*layers)
        recipe = get_recipe(name)
        try:
            cfg = cls._from_layers(recipe.values(), *layers)
        except ValueError as e:
            raise ValueError(f"{e}{_recipe_part(str(e), recipe, layers)}") from None
        problems = unmet_requirements(recipe, lambda option: _option_value(cfg, option))
        if problems:
            raise ValueError("; ".join(problems))
        return cfg

    @classmethod
    def _from_layers(cls, *layers: dict[str, Any]) -> TrainConfig:
        splits = [_by_section(layer) for layer in layers]
        return cls(**{name: build(sc, *(s[name] for s in splits)) for name, sc in SECTIONS.items()})

    @classmethod
    def from_yaml_and_flags(cls, yaml_path: str | None, flags: dict[str, Any]) -> TrainConfig:
        return cls.from_layers(load_yaml(yaml_path) if yaml_path else {}, flags)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        return cls.from_layers(data)


def _flat(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer's options by field name, whether given flat or grouped by section."""
    out: dict[str, Any] = {}
    for key, value in layer.items():
        if key in SECTIONS and isinstance(value, dict):
            out.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            out[key.replace("-", "_")] = value
    return out


def _recipe_named(layers: tuple[dict[str, Any], ...]) -> str | None:
    """The recipe the last layer naming one names (None: no recipe)."""
    name = None
    for layer in layers:
        flat = _flat(layer)
        if "recipe" in flat:
            name = flat["recipe"]
    return name


def _as_flag(value: Any) -> str:
    """A value as its flag is typed: a list comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _names(message: str, word: str) -> bool:
    """Whether `message` names `word` whole (`lr` is no part of "already")."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", message) is not None


def recipe_note(message: str, *layers: dict[str, Any]) -> str:
    """What an error `message` found later (building the run: its devices, its target) owes
    to the recipe the layers name: " (--X value: from recipe NAME; ...)", or "" when no recipe
    value the user did not set is named."""
    name = _recipe_named(layers)
    return "" if name is None else _recipe_part(message, get_recipe(name), layers)


def _recipe_part(message: str, recipe: Recipe, layers: tuple[dict[str, Any], ...]) -> str:
    """The values of `recipe` that an error `message` names and no layer set: the user did
    not type them, so say where they came from and how to unset them."""
    given = {k for layer in layers for k in _flat(layer)}
    named = [
        k
        for k in recipe.settings
        if k not in given and (_names(message, k) or _names(message, "--" + k.replace("_", "-")))
    ]
    if not named:
        return ""
    values = ", ".join(
        f"--{k.replace('_', '-')} {_as_flag(recipe.settings[k].value)}" for k in named
    )
    return f" ({values}: from recipe {recipe.name}; a flag overrides it, `none` unsets it)"


def _option_value(cfg: TrainConfig, name: str) -> Any:
    """A resolved option by its field name (whichever section holds it)."""
    for section in SECTIONS:
        options = getattr(cfg, section)
        if hasattr(options, name):
            return getattr(options, name)
    raise KeyError(name)


@dataclass
class CaptureOptions:
    """`dflash-train capture`: the target's features of every row of a prepared dataset, into
    a feature store that `train --features` reads."""

    target: str = ""
    """Target model: a local Hugging Face causal-LM directory (the drafter's target)."""
    data: str = ""
    """Prepared dataset directory (from `dflash-train prepare`)."""
    out: str = ""
    """Feature store directory; a capture interrupted there resumes when run again."""
    dtype: Literal["fp8", "bf16", "fp32"] = "bf16"
    """Stored dtype: fp8 (e4m3 with one fp32 scale per token and layer, about half of bf16's
    bytes), bf16, or fp32 (exact)."""
    num_target_features: int = 5
    """K: how many target layers to store (ids by the paper's rule, as train's default)."""
    target_layer_ids: list[int] | None = None
    """Explicit target layer ids to store instead, e.g. 1,9,17,25,33."""
    teacher_input: bool = False
    """Also store the teacher's input, the target's final-normed last hidden state (one more
    hidden-size slot per token, bound as layer id -1), which train --loss kl, lk_alpha or
    lk_lambda reads from the store."""
    target_devices: list[str] | None = None
    """Devices running the target, e.g. cuda:0,cuda:1 or cpu. Default: cuda:0 when CUDA exists,
    else cpu."""
    compute_dtype: str = "auto"
    """The target's compute dtype: auto (bfloat16 on CUDA, float32 on CPU, as train's), float32,
    bfloat16."""
    batch_size: int = 8
    """Rows per target batch (or --batch-tokens)."""
    batch_tokens: int | None = None
    """Padded tokens per target batch instead: rows = batch_tokens // bucket length."""
    num_buckets: int = 16
    """Number of padded lengths, fitted to the data's length histogram."""
    num_prefetchers: int = 2
    """Prefetcher threads reading and padding rows."""
    queue_depth: int = 8
    """Batches of features buffered between the target workers and the store writer."""
    shard_bytes: str = "4GiB"
    """Size after which the writer starts a new shard file."""
    cpu_threads: int = 0
    """torch intra-op threads for CPU target workers (0 = cores / workers)."""
    stall_timeout: float = 900.0
    """Seconds without progress after which the capture is declared hung and stopped."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped with the target."""
    dry_run: bool = False
    """Print the size estimate (bytes per token, total, free disk) and stop."""
    overwrite: bool = False
    """Replace a feature store of other features at --out (one of the same features resumes)."""

    def __post_init__(self) -> None:
        names = ("num_target_features", "batch_size", "num_buckets", "num_prefetchers")
        check_floats(self)
        _positive(self, *names, "queue_depth")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError("batch_tokens must be positive when set")
        if self.compute_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"compute_dtype must be auto, float32, bfloat16 or float16: {self.compute_dtype!r}"
            )
        parse_bytes(self.shard_bytes, "shard_bytes")


def token_share_of(batch_cost: str) -> float | None:
    """`--batch-cost` as a token share in [0, 1] (None: flops or auto, known once the drafter
    is); one clear error otherwise."""
    named = {"flops": None, "auto": None, "blocks": 0.0, "tokens": 1.0}
    if batch_cost in named:
        return named[batch_cost]
    try:
        share = float(batch_cost)
    except ValueError:
        share = float("nan")
    if not 0.0 <= share <= 1.0:
        raise ValueError(
            f"batch_cost must be flops, auto, blocks, tokens or a share in [0, 1], got "
            f"{batch_cost!r}"
        )
    return share


def _positive(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None or value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class Bounds:
    """The range a float option must lie in; it must also be finite, always."""

    low: float
    high: float = math.inf
    low_open: bool = False
    """Whether `low` itself is excluded."""
    high_open: bool = True
    """Whether `high` itself is excluded."""

    def holds(self, value: float) -> bool:
        # Written as what must hold: NaN passes no comparison, so it fails every bound.
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        left = "(" if self.low_open else "["
        right = ")" if self.high_open else "]"
        return f"in {left}{self.low:g}, {self.high:g}{right}"


POSITIVE, NON_NEGATIVE = Bounds(0.0, low_open=True), Bounds(0.0)
UNIT_OPEN_LOW = Bounds(0.0, 1.0, low_open=True, high_open=False)  # (0, 1]
UNIT_OPEN_HIGH = Bounds(0.0, 1.0)  # [0, 1)

FLOAT_BOUNDS: dict[str, Bounds] = {
    # ObjectiveOptions
    "gamma": POSITIVE,
    "dpace_alpha": UNIT_OPEN_LOW,
    "lk_eta": POSITIVE,
    "opd_gamma": UNIT_OPEN_LOW,
    "opd_rejected_weight": NON_NEGATIVE,
    "selector_loss_weight": NON_NEGATIVE,
    # OptimOptions (the betas and weight decay as torch's AdamW takes them)
    "lr": POSITIVE,
    "muon_lr": POSITIVE,
    "warmup_ratio": UNIT_OPEN_HIGH,
    "min_lr_ratio": Bounds(0.0, 1.0, high_open=False),
    "weight_decay": NON_NEGATIVE,
    "adam_beta1": UNIT_OPEN_HIGH,
    "adam_beta2": UNIT_OPEN_HIGH,
    "grad_clip": NON_NEGATIVE,
    # Timeouts in seconds: stall (PipelineOptions, CaptureOptions), stop (RunOptions) and the
    # engine start (EngineOptions)
    "stall_timeout": POSITIVE,
    "stop_timeout": POSITIVE,
    "engine_start_timeout": POSITIVE,
}
"""The range of each float option by field name (the same for a name two sections share).
No option documents infinity as a value, so every float option must be finite, also one
missing here."""


def check_floats(obj: Any, table: dict[str, Bounds] = FLOAT_BOUNDS) -> None:
    """Every float option of dataclass `obj`: finite and within its bounds in `table` (None,
    where an option allows it, means unset). One line naming the flag otherwise, before any
    model loads: a NaN learning rate or stall timeout would otherwise train to NaN weights or
    silently disable the hang watchdog."""
    for f in dataclass_fields(type(obj)):
        value, bounds = getattr(obj, f.name), table.get(f.name)
        if value is None or isinstance(value, bool):
            continue
        if bounds is None and not isinstance(value, float):
            continue
        if not (bounds.holds(value) if bounds else math.isfinite(value)):
            flag = "--" + f.name.replace("_", "-")
            rule = f"a finite number {bounds}" if bounds else "a finite number"
            raise ValueError(f"{flag} must be {rule}, got {value}")


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (the inverse of `parse_bytes`, to one decimal)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str | int, name: str = "hs_queue_bytes") -> int:
    """'40GiB' -> 42949672960; '500MB' -> 500000000; plain integers are bytes. Errors name the
    field `name`."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}: cannot read {text!r} as a size (e.g. 40GiB, 500MB)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {text!r}")
    return value


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """`train`'s flags: --config, --resume and every section's options (the train command's
    parser; `compare` checks its variants' flags with it before any runs)."""
    parser.add_argument(
        "--config",
        metavar="YAML",
        help="YAML file of options (flat names or grouped by section); flags override it",
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its newest complete checkpoint, with its saved "
        "config; only settings that do not change what it trains may be given (queue sizes, "
        "prefetchers, devices with the same number of drafters, logging, evaluation, checkpoint "
        "cadence, metric backends, --max-steps to extend); others are refused, each listed",
    )
    for name, section in SECTIONS.items():
        add_dataclass_arguments(parser, section, title=f"{name} options")


def _by_section(layer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A layer of options (flat, sectioned or both) split by the section that owns each."""
    owner = {f.name: name for name, sc in SECTIONS.items() for f in dataclass_fields(sc)}
    split: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, value in layer.items():
        if key in SECTIONS and isinstance(value, dict):
            split[key].update(value)
            continue
        name = key.replace("-", "_")
        if name not in owner:
            raise ValueError(f"unknown option {key!r}")
        split[owner[name]][name] = value
    return split


def train_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The options set on `train`'s command line (and in its --config), by field name. The
    file's values are checked on their own first: a flag that sets the same option must not
    hide a value of the wrong type in it."""
    flags: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for name, values in _by_section(flags).items():
        coerced(SECTIONS[name], values)
    for section in SECTIONS.values():
        flags.update(parsed_overrides(args, section))
    return flags
