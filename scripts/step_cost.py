"""Drafter step cost of DFlash 1 vs DFlash 2 at one target's shapes, measured interleaved.

    python scripts/step_cost.py --target TARGET [--steps 30] [--seq 300] [--batch 4]

One step = draft forward over the blocks, the chunked loss (plus, for DFlash 2, the selector
term), backward and an AdamW step, on random features and tokens (the cost does not depend on
the values). The two drafters alternate step by step in one process, one thread, so load from
other processes slows both alike; prints the median seconds per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import draft_config_from_target, load_target_config
from dflash_train.objective import (
    SelectorLoss,
    block_targets,
    block_token_ids,
    default_gamma,
    draft_loss,
    make_layout,
    pack_anchors,
    sample_anchors,
)

BLOCK, ANCHORS, MASK = 16, 32, 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tc = load_target_config(args.target)
    kw = {"num_layers": 1, "block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": [0]}
    models = {
        arch: DFlashDraftModel(draft_config_from_target(tc, arch=arch, **kw))
        for arch in ("dflash", "dflash2")
    }
    opts = {a: torch.optim.AdamW(m.parameters(), lr=1e-4) for a, m in models.items()}
    embed = torch.randn(tc.vocab_size, tc.hidden_size) * 0.02
    head = torch.randn(tc.vocab_size, tc.hidden_size) * 0.02
    rng = np.random.default_rng(0)
    ids = torch.randint(0, tc.vocab_size, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    feats = torch.randn(args.batch, args.seq, tc.hidden_size)
    anchors, valid = pack_anchors(
        [sample_anchors(m.numpy(), ANCHORS, rng) for m in mask], num_blocks=ANCHORS
    )
    embeds = embed[block_token_ids(ids, anchors, BLOCK, MASK)]
    targets = block_targets(ids, mask, anchors, valid, BLOCK, default_gamma(BLOCK))
    layout = make_layout(anchors, valid, BLOCK, "cpu")
    times = {a: [] for a in models}
    for i in range(args.steps + 3):  # 3 warm-up steps each
        for arch, model in models.items():
            t0 = time.perf_counter()
            hidden = model(embeds, feats, layout, attention="blockwise")
            sel = (
                None if model.candidate_selector is None else SelectorLoss(model.candidate_selector)
            )
            out = draft_loss(hidden, targets, head, BLOCK, chunk_rows=4096, selector=sel)
            opts[arch].zero_grad()
            (out.loss_sum / targets.weights.sum()).backward()
            opts[arch].step()
            if i >= 3:
                times[arch].append(time.perf_counter() - t0)
    med = {a: statistics.median(t) for a, t in times.items()}
    print(
        json.dumps(
            {
                "s_per_step": med,
                "ratio": med["dflash2"] / med["dflash"],
                "params": {a: sum(p.numel() for p in m.parameters()) for a, m in models.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
