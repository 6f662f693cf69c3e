"""Reference-client parity: the PyPI `dflash` package, given this project's export, must accept
exactly what this project's own evaluation accepts, cycle by cycle and prompt by prompt.

A random drafter accepts almost nothing, which would make the comparison weak (every cycle 1).
So the drafter is first fitted for a few CPU-seconds, with the project's objective, to the
target's own greedy continuations of a set of prompts. On those prompts it then accepts a spread
of lengths 1 .. B (mean ~2.8 at B = 4; it memorises rather than generalises, which is all the
comparison needs); unseen prompts are mixed in for mostly-rejected cycles.

Both sides load the SAME bf16 export, upcast to fp32: identical weights, so any difference in
acceptance is a difference in semantics (positions, what the draft cache holds, the acceptance
rule, clipping at the length limit and at stop tokens), not bf16 rounding.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

dflash = pytest.importorskip("dflash", reason="install with pip install --no-deps dflash==0.1.0")

from dflash_train.export import export_draft  # noqa: E402
from dflash_train.model.draft import DFlashDraftModel  # noqa: E402
from dflash_train.model.serving import load_exported  # noqa: E402
from dflash_train.model.target import (  # noqa: E402
    FrozenHead,
    draft_config_from_target,
    load_causal_lm,
)
from dflash_train.objective import (  # noqa: E402
    block_targets,
    block_token_ids,
    default_gamma,
    draft_loss,
    make_layout,
    pack_anchors,
    sample_anchors,
)
from dflash_train.speculative import plain_generate, speculative_generate  # noqa: E402

BLOCK = 4
PROMPT_LEN, CONT_LEN = 8, 40
MASK_ID = 255


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the machine's 2 cores are shared with other test runs


@pytest.fixture(scope="module")
def target(tiny_target):
    torch.set_num_threads(1)  # module fixtures run before the function-scoped thread setting
    return load_causal_lm(tiny_target, torch.device("cpu"), torch.float32)


def random_prompts(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (PROMPT_LEN,), generator=gen) for _ in range(n)]


FIT_PROMPTS = 32


def fit_drafter(target, steps: int = 300, seed: int = 0) -> DFlashDraftModel:
    """Train a 1-layer drafter on the target's greedy continuations with the DFlash objective."""
    seqs = torch.stack(
        [
            torch.cat([p, torch.tensor(plain_generate(target, p, max_new_tokens=CONT_LEN).tokens)])
            for p in random_prompts(FIT_PROMPTS, seed=100)
        ]
    )  # (32, PROMPT_LEN + CONT_LEN)
    config = draft_config_from_target(
        target.config, num_layers=1, block_size=BLOCK, mask_token_id=MASK_ID, num_features=2
    )
    with torch.no_grad():
        hs = target(seqs, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in config.target_layer_ids], dim=-1)
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, PROMPT_LEN:] = 1  # supervise the continuation, as on assistant tokens
    head = FrozenHead.of_model(target)
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
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
        out = draft_loss(hidden, targets, head.head, BLOCK, chunk_rows=4096)
        opt.zero_grad()
        (out.loss_sum / targets.weights.sum()).backward()
        opt.step()
    return draft.eval()


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "drafter"
    export_draft(fit_drafter(target), path)  # bf16, the format serving engines read
    return path


def reference_lengths(ref_model, target, ids, max_new, stops, monkeypatch):
    # The stats path times with torch.cuda.synchronize; on CPU a plain clock does.
    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)
    out = dflash.model.dflash_generate(
        ref_model,
        target,
        ids[None],
        max_new,
        stops,
        temperature=0.0,
        block_size=BLOCK,
        return_stats=True,
    )
    return out.acceptance_lengths, out.output_ids[0, len(ids) :].tolist()


# The reference client still passes `past_key_values`, deprecated in transformers 5.
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_reference_client_accepts_exactly_what_this_project_accepts(target, exported, monkeypatch):
    mine = load_exported(exported)  # fp32 copy of the bf16 weights
    theirs = dflash.DFlashDraftModel.from_pretrained(exported, dtype=torch.float32).eval()
    assert theirs.target_layer_ids == mine.config.target_layer_ids
    assert theirs.mask_token_id == MASK_ID and theirs.block_size == BLOCK
    head = FrozenHead.of_model(target)
    all_lengths = []
    # Six prompts the drafter was fitted on, then four it has never seen.
    prompts = random_prompts(FIT_PROMPTS, seed=100)[:6] + random_prompts(4, seed=7)
    for i, ids in enumerate(prompts):
        max_new = 37 if i % 2 else 48  # odd limits: the last cycle is clipped
        plain = plain_generate(target, ids, max_new_tokens=max_new)
        # Every third prompt stops at a token emitted mid-way, to compare stop clipping too.
        stops = [plain.tokens[max_new // 2]] if i % 3 == 0 else None
        res = speculative_generate(
            mine,
            target,
            head,
            ids,
            max_new_tokens=max_new,
            block_size=BLOCK,
            stop_token_ids=stops,
        )
        ref_len, ref_tokens = reference_lengths(theirs, target, ids, max_new, stops, monkeypatch)
        assert res.acceptance_lengths == ref_len, f"prompt {i}"
        assert res.tokens == ref_tokens, f"prompt {i}"
        all_lengths += res.acceptance_lengths
    mean = sum(all_lengths) / len(all_lengths)
    hist = {b: all_lengths.count(b) for b in range(1, BLOCK + 1)}
    print(f"parity over {len(all_lengths)} cycles, mean acceptance {mean:.2f}, lengths {hist}")
    assert mean > 1.5  # the fitted drafter makes the comparison meaningful
    assert all(hist.values())  # every acceptance length 1 .. B occurred and matched
