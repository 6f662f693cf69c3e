"""What `train` and `tune` set up from the data and the target's config before any model runs:
the dataset, its length buckets and epoch plans, the bucket mix, the drafter's architecture and
the batch builder. One place, so the tuner measures exactly what training will run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dflash_train.config import (
    DFLASH2_OPTIONS,
    SELECTOR_OPTIONS,
    ModelOptions,
    ObjectiveOptions,
    TrainConfig,
)
from dflash_train.data.buckets import (
    Batching,
    RowKinds,
    bucket_weights,
    count_weights,
    fit_bucket_lengths,
    fit_bucket_options,
)
from dflash_train.data.dataset import PreparedDataset
from dflash_train.data.tokenizer import resolve_mask_token_id
from dflash_train.devices import default_devices
from dflash_train.model import flops
from dflash_train.model.draft import DFlashConfig
from dflash_train.model.families import input_embedding_scale, read_target_layout
from dflash_train.model.target import draft_config_from_target, feature_layer_ids
from dflash_train.objective import loss_gamma
from dflash_train.pipeline.mixing import MIX_TV_PLAN, MIX_WINDOW_STEPS, window_mix_tv
from dflash_train.pipeline.prefetch import BatchBuilder, EpochPlans
from dflash_train.train.init_from import config_from_init


def draft_config_for(
    opts: ModelOptions, chat_thinking: str | None = None
) -> tuple[DFlashConfig, str]:
    """The drafter's architecture for the target and options in `opts` (with --init-from: the
    trained drafter's, `train/init_from.py`), and how its mask token was chosen (for the run's
    log). `chat_thinking`: the training data's chat mode, recorded in
    the config so that evaluations encode prompts the same way."""
    layout = read_target_layout(opts.target, opts.trust_remote_code)
    if opts.init_from:  # the drafter's shape is the trained one's
        return config_from_init(opts, layout, chat_thinking)
    target_cfg = layout.text
    mask_id, how = resolve_mask_token_id(opts.target, target_cfg.vocab_size, opts.mask_token_id)
    config = draft_config_from_target(
        target_cfg,
        opts.draft_layers,
        opts.block_size,
        mask_id,
        opts.target_layer_ids,
        opts.num_target_features,
        layer_types=opts.draft_layer_types(),
        sliding_window=opts.sliding_window,
        is_causal=_in_block_rule(opts),
        arch=opts.arch,
        input_embedding_scale=input_embedding_scale(layout),
        **dflash2_sizes(opts),
    )
    return dataclasses.replace(config, chat_thinking=chat_thinking), how


def _in_block_rule(opts: ModelOptions) -> bool | None:
    """`is_causal` of the drafter: --causal-in-block, else for DFlash 2 its checkpoint contract's
    explicit false (every layer bidirectional inside the block, sliding ones too)."""
    if opts.causal_in_block is None and opts.arch == "dflash2":
        return False
    return opts.causal_in_block


def dflash2_sizes(opts: ModelOptions) -> dict[str, int]:
    """The DFlash 2 sizes of `opts` for the drafter's config (none for a DFlash 1 drafter)."""
    return {k: getattr(opts, k) for k in DFLASH2_OPTIONS} if opts.arch == "dflash2" else {}


def unused_dflash2_options(cfg: TrainConfig) -> list[str]:
    """The DFlash 2 options set away from their defaults for a DFlash 1 drafter (no effect)."""
    if cfg.model.arch == "dflash2":
        return []
    defaults = {"model": ModelOptions(), "objective": ObjectiveOptions()}
    names = [("model", k) for k in DFLASH2_OPTIONS] + [("objective", k) for k in SELECTOR_OPTIONS]
    return [
        k
        for section, k in names
        if getattr(getattr(cfg, section), k) != getattr(defaults[section], k)
    ]


@dataclass
class TrainingData:
    """The data side of a run, from a `TrainConfig` (see the module docstring)."""

    dataset: PreparedDataset
    bucket_lengths: list[int]
    plans: EpochPlans
    weights: dict[int, float]
    """Share of an epoch's batches per bucket: the mix drafters should see."""
    draft_config: DFlashConfig
    mask_how: str
    """How the mask token was chosen, for the run's log."""
    builder: BatchBuilder
    teacher: bool = False
    """Whether the loss reads the target's distribution (`--loss`): the features then end with
    the teacher's input."""

    @property
    def feature_layer_ids(self) -> list[int]:
        """What the run's features hold, in order (the feature sources' and stores' ids)."""
        return feature_layer_ids(self.draft_config.target_layer_ids, self.teacher)

    @classmethod
    def load(
        cls,
        cfg: TrainConfig,
        epochs: int | None = None,
        done: np.ndarray | None = None,
        shard: tuple[int, int] = (0, 1),
    ) -> TrainingData:
        """Everything above for `cfg`, over `epochs` (default: the run's) epochs; with `done`
        (a resumed run's trained ids per epoch) the plans leave those batches out; with `shard`
        (node, nodes) the plans yield only this node's share."""
        p, r, obj = cfg.pipeline, cfg.run, cfg.objective
        if not p.data:
            raise ValueError("--data is required (a directory from `dflash-train prepare`)")
        dataset = PreparedDataset(p.data)
        if len(dataset) == 0:
            raise ValueError(f"prepared dataset {p.data} has no rows")
        draft, how = draft_config_for(cfg.model, dataset.chat_thinking())
        # Buckets chosen from the data are fitted by block positions alone, whatever the share:
        # under flops and auto the share is known only after the fit, and a share given again
        # (`--batch-cost 0.45`, as the run recorded it) must fit the same buckets.
        batching = Batching(
            p.batch_size,
            p.batch_tokens,
            p.batching,
            np.minimum(dataset.anchor_counts(), obj.num_anchors) if p.batching == "work" else None,
            draft.block_size,
            obj.num_anchors,
            0.0,
        )
        bucket_lengths = p.bucket_lengths or (
            fit_bucket_lengths(dataset.lengths, p.num_buckets)
            if p.num_buckets
            else auto_bucket_lengths(
                dataset.lengths, batching, r.seed, MIX_WINDOW_STEPS * draws_per_step(cfg, shard)
            )
        )
        share = p.token_share or 0.0  # auto: blocks until measured (Trainer)
        if p.batching == "work" and p.batch_cost == "flops":
            share = flops.token_share(draft, bucket_lengths[-1], obj.num_anchors)
        batching = dataclasses.replace(batching, token_share=share)
        plans = EpochPlans(
            dataset.lengths, bucket_lengths, batching, r.seed, epochs or r.epochs, done, shard
        )
        _check_token_ids(dataset, draft.vocab_size)
        builder = BatchBuilder(
            dataset,
            bucket_lengths,
            draft.block_size,
            obj.num_anchors,
            loss_gamma(draft.block_size, obj.gamma),
            draft.mask_token_id,
            r.seed,
            obj.attention_chunks,
            position_weights=obj.position_weights,
        )
        weights = bucket_weights(plans.epoch(0))
        return cls(dataset, bucket_lengths, plans, weights, draft, how, builder, obj.needs_teacher)

    def with_token_share(self, share: float) -> TrainingData:
        """The same set-up with its work batches planned by `share` (`--batch-cost auto`, once
        measured): the same epochs, resume state and shard; only the plans and the mix change."""
        old = self.plans
        batching = dataclasses.replace(old.batching, token_share=share)
        plans = EpochPlans(
            self.dataset.lengths,
            self.bucket_lengths,
            batching,
            old.seed,
            old.epochs,
            old.done,
            (old.node, old.nodes),
        )
        weights = bucket_weights(plans.epoch(0))
        return dataclasses.replace(self, plans=plans, weights=weights)


AUTO_MAX_BUCKETS = 32
PADDING_GOAL = 0.05


def auto_bucket_lengths(
    lengths: np.ndarray, batching: Batching, seed: int, window_draws: int
) -> list[int]:
    """--num-buckets auto (padding against mix): the fewest buckets (at most
    `AUTO_MAX_BUCKETS`) whose padding is at most `PADDING_GOAL`, or if none is, the most; then
    fewer while the stratified pull could not follow the mix within `MIX_TV_PLAN` in a window
    of `window_draws` batches (`window_mix_tv` of the epoch plan's bucket shares). A pure
    function of the data and the run's settings, so a resumed run fits the same buckets.

    The shares are those of the epoch plans, counted without planning one, from the rows'
    distinct kinds (`RowKinds`): how many batches each bucket gets is the same in every epoch
    of every seed, so `seed` does not change the choice (kept for the callers)."""
    options = fit_bucket_options(lengths, AUTO_MAX_BUCKETS)
    kinds = RowKinds.of(lengths, batching)
    pads = [kinds.padding(b) for b in options]
    start = next((i for i, pad in enumerate(pads) if pad <= PADDING_GOAL), len(options) - 1)
    for b in options[start::-1]:
        weights = count_weights(kinds.batch_counts(b, batching))
        if window_mix_tv(weights, window_draws) <= MIX_TV_PLAN:
            return b
    return options[0]


def draws_per_step(cfg: TrainConfig, shard: tuple[int, int] = (0, 1)) -> int:
    """Batches one optimizer step trains over every node (`shard`'s node count), with the
    drafter devices the run will resolve."""
    p = cfg.pipeline
    _, drafters = default_devices(p.target_devices, p.drafter_devices, p.share_device)
    return shard[1] * len(drafters) * cfg.optim.grad_accum


def _check_token_ids(dataset: PreparedDataset, vocab_rows: int) -> None:
    """Every token id of the data must be a row of the target's embedding: data prepared with
    another model's tokenizer would otherwise fail deep inside a target worker."""
    top = int(dataset.input_ids.max()) if len(dataset.input_ids) else -1
    if top >= vocab_rows:
        raise ValueError(
            f"the prepared dataset {dataset.path} holds token id {top}, beyond the target's "
            f"{vocab_rows} embedding rows: it was prepared with another tokenizer than the "
            "target's"
        )
