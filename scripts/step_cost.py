"""Drafter step cost of architectures and objectives at one target's shapes, measured interleaved.

    python scripts/step_cost.py --target TARGET [--steps 30] [--seq 300] [--batch 4] \
        [--variants dflash dflash2 dflash:dpace dflash:decay:muon ...]

A variant is ARCH[:POSITION_WEIGHTS[:OPTIMIZER[:LOSS]]] (default decay, adamw, ce). One step =
draft forward over the blocks, the chunked loss (plus, for DFlash 2, the selector term; with
dpace its weights from the confidences; with a loss on the target's distribution its teacher's
logits from random teacher states), backward and the optimizer's step, on random features and
tokens (the cost does not depend on the values). The variants alternate step by step in one
process, one thread, so load from other processes slows all alike; prints the median seconds
per step of each and its ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from dflash_train.config import OptimOptions
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import draft_config_from_target, load_target_config
from dflash_train.objective import (
    HeadLoss,
    SelectorLoss,
    Teacher,
    block_targets,
    block_token_ids,
    default_gamma,
    draft_loss,
    make_layout,
    pack_anchors,
    sample_anchors,
)
from dflash_train.position_weights import PositionWeights, loss_normaliser
from dflash_train.train.optimizers import build_optimizer

BLOCK, ANCHORS, MASK = 16, 32, 3


def build_variant(name: str, tc) -> tuple[DFlashDraftModel, object, PositionWeights, HeadLoss]:
    """The drafter, optimizer, position weights and loss of one ARCH[:WEIGHTS[:OPTIMIZER[:LOSS]]]
    name."""
    given = name.split(":")
    arch, weights, optimizer, loss = [*given, *("decay", "adamw", "ce")[len(given) - 1 :]][:4]
    kw = {"num_layers": 1, "block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": [0]}
    torch.manual_seed(0)
    model = DFlashDraftModel(draft_config_from_target(tc, arch=arch, **kw))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = build_optimizer(named, OptimOptions(lr=1e-4, optimizer=optimizer), torch.device("cpu"))
    return model, opt, PositionWeights(weights), HeadLoss(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=["dflash", "dflash2"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    tc = load_target_config(args.target)
    variants = {name: build_variant(name, tc) for name in args.variants}
    embed = torch.randn(tc.vocab_size, tc.hidden_size) * 0.02
    head = torch.randn(tc.vocab_size, tc.hidden_size) * 0.02
    rng = np.random.default_rng(0)
    ids = torch.randint(0, tc.vocab_size, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    feats = torch.randn(args.batch, args.seq, tc.hidden_size)
    teacher = Teacher(torch.randn(args.batch, args.seq, tc.hidden_size))
    anchors, valid = pack_anchors(
        [sample_anchors(m.numpy(), ANCHORS, rng) for m in mask], num_blocks=ANCHORS
    )
    embeds = embed[block_token_ids(ids, anchors, BLOCK, MASK)]
    targets = block_targets(ids, mask, anchors, valid, BLOCK, default_gamma(BLOCK))
    layout = make_layout(anchors, valid, BLOCK, "cpu")
    times = {name: [] for name in variants}
    for i in range(args.steps + 3):  # 3 warm-up steps each
        for name, (model, opt, positions, loss) in variants.items():
            t0 = time.perf_counter()
            hidden = model(embeds, feats, layout, attention="blockwise")
            sel = None
            if model.candidate_selector is not None:
                sel = SelectorLoss(model.candidate_selector)
            out = draft_loss(
                hidden, targets, head, BLOCK, 4096, None, sel, positions, loss, teacher
            )
            for p in model.parameters():
                p.grad = None
            (out.loss_sum / loss_normaliser(targets.weights, valid, positions.kind)).backward()
            opt.step()
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    first = args.variants[0]
    print(
        json.dumps(
            {
                "s_per_step": med,
                "ratio_to_first": {name: med[name] / med[first] for name in med},
                "params": {
                    name: sum(p.numel() for p in m.parameters())
                    for name, (m, *_) in variants.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()
