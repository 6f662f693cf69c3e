"""On-policy verify rounds: the rounds the serving loop runs equal the rounds recomputed from one
parallel drafter forward over the target's greedy output (DFlash 1 and 2), and the chain's
bookkeeping against a hand-run draft-and-verify."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

from dflash_train.config import ObjectiveOptions, OptimOptions, on_policy_only_options
from dflash_train.data.buckets import BatchSpec
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.target import (
    FrozenHead,
    TargetFeatureExtractor,
    feature_layer_ids,
    load_causal_lm,
)
from dflash_train.objective import LossOutput, block_token_ids, make_layout, pack_anchors
from dflash_train.on_policy import (
    Round,
    RoundStreams,
    accepted_counts,
    batch_rounds,
    chain_rounds,
    draft_positions,
    response_spans,
    round_blocks,
)
from dflash_train.pipeline.prefetch import make_job
from dflash_train.pipeline.records import HSBatch
from dflash_train.pipeline.sync import Contribution
from dflash_train.speculative import plain_generate, speculative_generate
from dflash_train.train.replica import DraftReplica
from drafter_fit import (
    DFLASH2_SIZES,
    FIT_PROMPTS,
    PROMPT_LEN,
    fit_drafter,
    greedy_continuations,
    move_dflash2_off_identity,
    random_prompts,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


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
def target(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def drafter(target, tiny_continuations):
    return fit_drafter(target, tiny_continuations, steps=200)


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
    return batch_rounds(draft, head, feats, ids, mask, blocks_per_chunk=16, chunk_rows=37)


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


# ----------------------------------------------------------------------------- training blocks
def test_round_blocks_supervise_the_accepted_drafts_and_the_correction_only():
    ids = torch.arange(20)[None].repeat(2, 1)
    mask = np.zeros((2, 20), dtype=np.uint8)
    mask[0, 4:20] = 1
    mask[1, 2:9] = 1
    rounds = [  # block size 4: up to 3 drafts
        [Round(4, 2, 77), Round(7, 3), Round(11, 0, 78), Round(12, 2, 79), Round(15, 3)],
        [Round(2, 1, 80), Round(4, 2, 81), Round(7, 1)],
    ]
    streams = RoundStreams(gamma=4.0, opd_gamma=0.5, rejected_weight=2.0)
    out = round_blocks(ids, mask, rounds, 4, streams)
    assert out.anchors.shape == (2, 16)  # blocks: a power of two
    n = out.anchors.shape[1]
    row, rest = out.targets.select // (n * 4), out.targets.select % (n * 4)
    got = sorted(zip(row.tolist(), (rest // 4).tolist(), out.targets.offsets.tolist(), strict=True))
    # Offsets 1 .. accepted + 1 within the block (a round that accepted every draft has its
    # correction in the next block, as the next anchor), never past the response's end.
    want = [
        (i, j, k)
        for i, rs in enumerate(rounds)
        for j, r in enumerate(rs)
        for k in range(1, min(r.accepted + 2, 4))
    ]
    want.remove((1, 2, 2))  # position 9: past row 1's response
    assert got == sorted(want)
    torch.testing.assert_close(out.targets.labels, out.targets.teacher_rows % 20 + 1)
    assert out.normaliser == pytest.approx(float(out.targets.weights.sum()))
    rej = out.rejected
    assert rej.labels.tolist() == [77, 78, 79, 80, 81]
    assert rej.offsets.tolist() == [3, 1, 3, 2, 3]
    assert rej.weights.tolist() == pytest.approx([0.5, 2.0, 0.5, 1.0, 0.5])  # 2 x 0.5^(k-1)
    # The teacher's row is the target's state just before the rejected slot.
    slots = [(0, 7), (0, 12), (0, 15), (1, 4), (1, 7)]
    assert rej.teacher_rows.tolist() == [i * 20 + p - 1 for i, p in slots]
    # Each rejected slot is one of the response stream's rows (its correction).
    assert set(rej.select.tolist()) <= set(out.targets.select.tolist())
    assert (out.num_rounds, out.num_rejected) == (8, 5)
    # Emitted: accepted + the correction while it is inside the response.
    assert out.num_emitted == (3 + 4 + 1 + 3 + 4) + (2 + 3 + 1)
    off = round_blocks(ids, mask, rounds, 4, RoundStreams(4.0, rejected_weight=0.0))
    assert len(off.rejected) == 0 and off.num_rejected == 5


# ----------------------------------------------------------------------------- the replica
def on_policy_batch(tiny_target, draft, rows: int = 4):
    """An HSBatch of the fitted prompts' greedy continuations (the responses), its features
    ending with the teacher's input, as the pipeline brings them."""
    seqs = greedy_continuations_cached(tiny_target)
    data = []
    for r in seqs[:rows]:
        mask = np.zeros(len(r), dtype=np.uint8)
        mask[PROMPT_LEN:] = 1
        data.append((r.numpy(), mask))
    job = make_job(
        BatchSpec(0, 0, 0, tuple(range(rows))),
        data,
        seqs.shape[1] + 3,  # right padding, as in a bucket
        block_size=draft.config.block_size,
        num_anchors=16,
        gamma=3.0,
        mask_token_id=draft.config.mask_token_id,
        seed=0,
    )
    ids = feature_layer_ids(draft.config.target_layer_ids, True)
    ex = TargetFeatureExtractor(tiny_target, ids, CPU, torch.float32)
    return HSBatch(job, ex(job.input_ids))


_SEQS: dict = {}


def greedy_continuations_cached(tiny_target) -> torch.Tensor:
    if "seqs" not in _SEQS:
        target = load_causal_lm(tiny_target, CPU, torch.float32)
        _SEQS["seqs"] = greedy_continuations(target)[0]
    return _SEQS["seqs"]


def direct_numerator(model, head, batch, width, rounds, gamma, opd_gamma, rejected_weight):
    """The on-policy loss numerator and divisor, written out: every round's block through the
    dense reference kernel, KL(p || q) with the decay at offsets 1 .. accepted + 1 inside the
    response, weight x opd_gamma^(k-1) x k3 at each rejected draft."""
    job, b = batch.job, model.config.block_size
    feats, teacher = batch.features[..., :width], batch.features[..., width:]
    per_row = [np.array([r.anchor for r in rs]) for rs in rounds]
    anchors, valid = pack_anchors(per_row, max(len(a) for a in per_row))
    ids = block_token_ids(job.input_ids, anchors, b, model.config.mask_token_id)
    hidden = model(head.embed_tokens(ids), feats, make_layout(anchors, valid, b, CPU), "dense")
    total, divisor = 0.0, 0.0
    for i, rs in enumerate(rounds):
        for j, r in enumerate(rs):
            for k in range(1, min(r.accepted + 2, b)):
                p = r.anchor + k
                if p >= job.input_ids.shape[1] or not job.loss_mask[i, p]:
                    continue
                log_q = torch.log_softmax(hidden[i, j * b + k] @ head.head.T, -1)
                log_p = torch.log_softmax(teacher[i, p - 1] @ head.head.T, -1)
                w = float(np.exp(-(k - 1) / gamma))
                total = total + w * (log_p.exp() * (log_p - log_q)).sum()
                divisor += w
                if k == r.accepted + 1 and r.rejected is not None:
                    x = log_p[r.rejected] - log_q[r.rejected]
                    total = total + rejected_weight * opd_gamma ** (k - 1) * (x.exp() - 1 - x)
    return total, divisor


@pytest.mark.parametrize("chunked", [True, False])
def test_an_on_policy_micro_step_trains_the_rounds_two_streams_as_written_out(
    tiny_target, target, drafter, chunked
):
    draft = copy.deepcopy(drafter).train()
    batch = on_policy_batch(tiny_target, draft)
    head = FrozenHead.of_model(target)
    objective = ObjectiveOptions(
        anchors="on-policy",
        loss="kl",  # Draft-OPD's response-stream loss, the one the reference writes out
        position_weights="decay",
        gamma=3.0,
        opd_gamma=0.7,
        opd_rejected_weight=1.5,
        attention="blockwise",
        attention_chunks=3,
        chunked_step=chunked,
    )
    reference = copy.deepcopy(draft)
    rep = DraftReplica(draft, head, CPU, torch.float32, objective, OptimOptions(), 10)
    out = rep.micro_step(batch)
    width = rep.context_width
    job = batch.job
    with torch.no_grad():
        rounds = batch_rounds(
            reference, head, batch.features[..., :width], job.input_ids, job.loss_mask
        )
    total, divisor = direct_numerator(reference, head, batch, width, rounds, 3.0, 0.7, 1.5)
    total.backward()
    assert out.normaliser == pytest.approx(divisor)
    torch.testing.assert_close(out.loss_sum, total.detach(), rtol=1e-4, atol=1e-5)
    num_rounds = sum(len(rs) for rs in rounds)
    rejections = sum(r.rejected is not None for rs in rounds for r in rs)
    assert out.rounds[0] == num_rounds and out.rounds[2] == rejections >= 5
    assert float(out.rejected) > 0
    mine = dict(draft.named_parameters())
    for name, p in reference.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=1e-3, atol=1e-6)


# ----------------------------------------------------------------------------- options
def test_on_policy_options_default_to_ce_and_say_why_they_need_the_teacher():
    # ce by default on-policy too (a kl stage undid a ce drafter on GSM8K, docs/measurements/
    # on-policy.md); the rejected stream still reads the teacher, and kl names itself.
    opd = ObjectiveOptions(anchors="on-policy")
    assert opd.loss == "ce" and opd.needs_teacher
    assert opd.teacher_reason == "the rejected-draft stream of --anchors on-policy"
    assert opd.teacher_free == "--opd-rejected-weight 0"
    assert ObjectiveOptions().loss == "ce" and not ObjectiveOptions().needs_teacher
    kl = ObjectiveOptions(loss="kl")
    assert kl.needs_teacher and kl.teacher_reason == "--loss kl" and kl.teacher_free == "--loss ce"
    # kl on-policy reads the teacher twice: --loss ce alone would still need it.
    both = ObjectiveOptions(anchors="on-policy", loss="kl")
    assert both.teacher_reason == "--loss kl and the rejected-draft stream of --anchors on-policy"
    assert both.teacher_free == "--loss ce --opd-rejected-weight 0"
    assert not ObjectiveOptions(
        anchors="on-policy", loss="kl", opd_rejected_weight=0
    ).rejected_stream
    assert not ObjectiveOptions(anchors="on-policy", loss="ce", opd_rejected_weight=0).needs_teacher
    for bad in ({"anchors": "sometimes"}, {"opd_gamma": 0.0}, {"opd_rejected_weight": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad)).replace("_", "[-_]")):
            ObjectiveOptions(**bad)
    assert on_policy_only_options(ObjectiveOptions(opd_gamma=0.5)) == ["--opd-gamma"]
    assert on_policy_only_options(ObjectiveOptions(anchors="on-policy", opd_gamma=0.5)) == []


def test_the_replicas_own_divisor_replaces_the_prefetchers_at_the_rendezvous():
    job = make_job(
        BatchSpec(0, 0, 0, (0,)),
        [(np.arange(12), np.array([0] * 4 + [1] * 8, dtype=np.uint8))],
        16,
        block_size=4,
        num_anchors=4,
        gamma=3.0,
        mask_token_id=255,
        seed=0,
    )
    assert job.weight_sum > 0 and job.loss_mask is not None
    zeros = torch.zeros(4)
    random_anchors = LossOutput(torch.tensor(1.0), zeros, zeros)
    on_policy = LossOutput(torch.tensor(1.0), zeros, zeros, normaliser=2.5, rounds=(3, 5, 2))
    a, b = Contribution(0), Contribution(1)
    a.add(job, random_anchors)
    b.add(job, on_policy)
    assert a.weight_sum == job.weight_sum and b.weight_sum == 2.5
