"""On-policy verify rounds: the rounds the serving loop runs equal the rounds recomputed from one
parallel drafter forward over the target's greedy output (DFlash 1 and 2), and the chain's
bookkeeping against a hand-run draft-and-verify."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.target import FrozenHead, load_causal_lm
from dflash_train.on_policy import (
    Round,
    accepted_counts,
    batch_rounds,
    chain_rounds,
    draft_positions,
    response_spans,
)
from dflash_train.speculative import plain_generate, speculative_generate
from drafter_fit import (
    DFLASH2_SIZES,
    FIT_PROMPTS,
    PROMPT_LEN,
    fit_drafter,
    greedy_continuations,
    move_dflash2_off_identity,
    random_prompts,
)

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # the machine's 2 cores are shared with other test runs


# ----------------------------------------------------------------------------- the chain
def hand_run(tokens: list[int], start: int, drafts_at) -> list[Round]:
    """Draft-and-verify by hand over a known response tokens[start:]: one round at a time."""
    end, rounds, a = len(tokens), [], start
    while a < end - 1:
        d = drafts_at(a)
        acc = 0
        while acc < len(d) and a + acc + 1 < end and d[acc] == tokens[a + acc + 1]:
            acc += 1
        inside = min(len(d), end - 1 - a)
        rounds.append(Round(a, acc, d[acc] if acc < inside else None))
        a += acc + 1
    return rounds


def test_response_spans_and_draft_positions_follow_the_loss_mask():
    mask = np.array([0, 1, 1, 1, 0, 0, 1, 1, 0, 1])
    assert response_spans(mask) == [(1, 4), (6, 8), (9, 10)]
    # A span's last token anchors nothing; a one-token span has no round.
    assert draft_positions(mask).tolist() == [1, 2, 6]


def test_chain_rounds_equal_a_hand_run_draft_and_verify():
    rng = np.random.default_rng(0)
    block, vocab = 5, 3  # a small vocabulary: many accepted drafts, many rejections
    for trial in range(30):
        length = int(rng.integers(4, 40))
        tokens = rng.integers(0, vocab, length)
        start = int(rng.integers(0, length))
        mask = np.zeros(length, dtype=np.int64)
        mask[start:] = 1
        positions = draft_positions(mask)
        drafts = rng.integers(0, vocab, (len(positions), block - 1))
        table = {int(p): d.tolist() for p, d in zip(positions, drafts, strict=True)}
        expected = hand_run(tokens.tolist(), start, lambda a, t=table: t[a])
        if not len(positions):
            assert expected == []
            continue
        t = torch.from_numpy(tokens)[None]
        acc = accepted_counts(
            torch.from_numpy(drafts)[None],
            t,
            torch.from_numpy(positions)[None],
            torch.full((1, len(positions)), length),
        )[0].numpy()
        got = chain_rounds((start, length), positions, acc, drafts)
        assert got == expected, f"trial {trial}"


# ----------------------------------------------------------------------------- equivalence
@pytest.fixture(scope="module")
def target(tiny_target):
    torch.set_num_threads(1)  # module fixtures run before the function-scoped thread setting
    return load_causal_lm(tiny_target, CPU, torch.float32)


@pytest.fixture(scope="module")
def drafter(target):
    return fit_drafter(target, greedy_continuations(target), steps=200)


@pytest.fixture(scope="module")
def dflash2_drafter(drafter):
    """The fitted drafter as DFlash 2 with its convolutions and selector moved off the identity,
    so the selector's walk often leaves the unary argmax."""
    draft = DFlashDraftModel(DFlashConfig.from_dict({**drafter.config.to_dict(), **DFLASH2_SIZES}))
    draft.load_state_dict(drafter.state_dict(), strict=False)
    move_dflash2_off_identity(draft)
    return draft.eval()


def served_rounds(draft, target, prompts) -> tuple[list[torch.Tensor], list[list[Round]]]:
    """Each prompt's response from the serving loop and the rounds it ran. Each response ends at
    a stop token (the plain continuation's 25th token, at its first occurrence) well before
    max_new_tokens, so no block is cut short by the length limit."""
    head = FrozenHead.of_model(target)
    rows, rounds = [], []
    for p in prompts:
        stop = plain_generate(target, p, max_new_tokens=25).tokens[-1]
        out = speculative_generate(
            draft, target, head, p, max_new_tokens=64, block_size=4, stop_token_ids=[stop]
        )
        assert out.tokens[-1] == stop and len(out.tokens) < 64 - 4
        rows.append(torch.cat([p, torch.tensor(out.tokens)]))
        rounds.append(out.rounds)
    return rows, rounds


def recomputed_rounds(draft, target, rows) -> list[list[Round]]:
    """The rounds from ONE parallel drafter forward over the right-padded rows (features of the
    teacher-forced rows; the response marked by the loss mask)."""
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = np.zeros((len(rows), length), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, PROMPT_LEN : len(r)] = 1
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in draft.config.target_layer_ids], dim=-1)
    head = FrozenHead.of_model(target)
    return batch_rounds(draft, head, feats, ids, mask, blocks_per_chunk=16)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_rounds_of_the_serving_loop_equal_rounds_from_one_parallel_forward(
    arch, target, drafter, dflash2_drafter
):
    draft = drafter if arch == "dflash" else dflash2_drafter
    prompts = random_prompts(FIT_PROMPTS, seed=100)[:6] + random_prompts(3, seed=7)
    rows, served = served_rounds(draft, target, prompts)
    assert recomputed_rounds(draft, target, rows) == served
    # The comparison has power: many rounds, a spread of accepted counts, rejections, and
    # rounds where every draft was accepted.
    flat = [r for rounds in served for r in rounds]
    accepted = {r.accepted for r in flat}
    assert len(flat) >= 40 and {0, 1, 3} <= accepted, accepted
    assert sum(r.rejected is not None for r in flat) >= 10
    # The rounds tile each response: anchors step by accepted + 1 from the first token.
    for row, rounds in zip(rows, served, strict=True):
        if len(row) == PROMPT_LEN + 1:
            assert rounds == []  # the prefill's token was the stop: nothing to verify
            continue
        assert rounds[0].anchor == PROMPT_LEN
        for a, b in itertools.pairwise(rounds):
            assert b.anchor == a.anchor + a.accepted + 1
        assert rounds[-1].anchor + rounds[-1].accepted + 1 >= len(row) - 1
