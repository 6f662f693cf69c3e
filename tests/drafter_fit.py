"""A drafter fitted for a few CPU-seconds to a tiny target's own greedy continuations, with the
project's objective: it accepts a spread of lengths on those prompts (a random drafter accepts
almost nothing), which is what the exactness tests of the serving loop need."""

from __future__ import annotations

import numpy as np
import torch

from dflash_train.config import OptimOptions
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.target import FrozenHead, draft_config_from_target
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
from dflash_train.speculative import plain_generate
from dflash_train.train.optimizers import build_optimizer

BLOCK = 4
PROMPT_LEN, CONT_LEN = 8, 40
MASK_ID = 255
DFLASH2_SIZES = {"arch": "dflash2", "selector_top_k": 8, "selector_rank": 16}


def random_prompts(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (PROMPT_LEN,), generator=gen) for _ in range(n)]


FIT_PROMPTS = 32


def greedy_continuations(target):
    """(sequences (32, PROMPT_LEN + CONT_LEN), hidden states) of the fitting prompts."""
    seqs = torch.stack(
        [
            torch.cat([p, torch.tensor(plain_generate(target, p, max_new_tokens=CONT_LEN).tokens)])
            for p in random_prompts(FIT_PROMPTS, seed=100)
        ]
    )  # (32, PROMPT_LEN + CONT_LEN)
    with torch.no_grad():
        hidden_states = target(seqs, output_hidden_states=True).hidden_states
    return seqs, hidden_states


def fit_drafter(
    target,
    continuations,
    steps: int = 300,
    seed: int = 0,
    objective: dict | None = None,
    **attention,
) -> DFlashDraftModel:
    """Train a drafter (1 full-attention layer, or the layers of `attention`) on the target's
    greedy continuations with the DFlash objective (`objective`: the options of `OBJECTIVES`)."""
    seqs, hs = continuations
    head = FrozenHead.of_model(target)
    objective = objective or {}
    arch = objective.get("arch", "dflash")
    config = draft_config_from_target(
        target.config,
        num_layers=len(attention.get("layer_types") or [None]),
        block_size=BLOCK,
        mask_token_id=MASK_ID,
        num_features=2,
        input_embedding_scale=head.embed_scale,
        **attention,
        **(DFLASH2_SIZES if arch == "dflash2" else {}),
    )
    feats = torch.cat([hs[i + 1] for i in config.target_layer_ids], dim=-1)
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, PROMPT_LEN:] = 1  # supervise the continuation, as on assistant tokens
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    positions = PositionWeights(objective.get("position_weights", "decay"))
    loss = HeadLoss(objective.get("loss", "ce"))
    selector = None if arch == "dflash" else SelectorLoss(draft.candidate_selector)
    optim = OptimOptions(lr=3e-3, optimizer=objective.get("optimizer", "adamw"))
    opt = build_optimizer(list(draft.named_parameters()), optim, torch.device("cpu"))
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = torch.from_numpy(rng.choice(len(seqs), size=8, replace=False))
        ids, mask = seqs[rows], loss_mask[rows]
        anchors, valid = pack_anchors(
            [sample_anchors(m.numpy(), 16, rng) for m in mask], num_blocks=16
        )
        embeds = head.embed_tokens(block_token_ids(ids, anchors, BLOCK, MASK_ID))
        targets = block_targets(ids, mask, anchors, valid, BLOCK, default_gamma(BLOCK))
        layout = make_layout(anchors, valid, BLOCK, "cpu")
        hidden = draft(embeds, feats[rows], layout, attention="blockwise")
        # The teacher's input: the target's final-normed last hidden state (HF's last entry).
        teacher = Teacher(hs[-1][rows], head.logit_softcap) if loss.needs_teacher else None
        out = draft_loss(
            hidden,
            targets,
            head.head,
            BLOCK,
            4096,
            selector=selector,
            positions=positions,
            loss=loss,
            teacher=teacher,
        )
        for p in draft.parameters():
            p.grad = None
        (out.loss_sum / loss_normaliser(targets.weights, valid, positions.kind)).backward()
        opt.step()
    return draft.eval()


def move_dflash2_off_identity(draft: DFlashDraftModel, seed: int = 0) -> None:
    """A DFlash 2 drafter's convolutions and selector moved off the identity (random kernels,
    scrambled codebooks), in place, so that the selector's walk often leaves the unary argmax:
    tests of the walk then cover the convolutions, the codebooks and the walk itself."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            elif "candidate_selector." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
