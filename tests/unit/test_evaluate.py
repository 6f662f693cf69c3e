"""The draft-and-verify loop (speculative.py) and evaluation: exactness, bookkeeping, metrics."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch import nn

from dflash_train.evaluate import evaluate
from dflash_train.export import export_draft
from dflash_train.model.checkpoint import init_from_draft, load_draft
from dflash_train.model.draft import DFlashConfig, DFlashDraftModel
from dflash_train.model.target import FrozenHead, draft_config_from_target, load_causal_lm
from dflash_train.model.tiny import save_random_qwen3
from dflash_train.speculative import (
    _Loop,
    acceptance_summary,
    plain_generate,
    quick_tau,
    speculative_generate,
)

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target(tiny_lm):
    return tiny_lm


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (n,), generator=gen) for n in (3, 8, 13)]


def random_draft(target, block_size=4, seed=0) -> DFlashDraftModel:
    config = draft_config_from_target(
        target.config, num_layers=1, block_size=block_size, mask_token_id=255, num_features=2
    )
    torch.manual_seed(seed)
    return DFlashDraftModel(config).eval()


def target_features(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hs = target(ids[None], output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


class ScriptedDraft(nn.Module):
    """A stand-in drafter that knows the target's greedy continuation and errs on purpose.

    It proposes the true next tokens, except at (anchor position, offset) pairs where
    `wrong(start, k)` holds. It also asserts the loop's feed-back contract: the features it is
    given are exactly the target's features of the positions after its last call, up to the
    anchor. Paired with an identity LM head, its hidden states are the logits.
    """

    def __init__(self, truth, features, layer_ids, block_size, vocab, wrong=lambda s, k: False):
        super().__init__()
        self.truth, self.features, self.vocab, self.wrong = truth, features, vocab, wrong
        self.config = type(
            "Cfg", (), {"target_layer_ids": layer_ids, "mask_token_id": 0, "block_size": block_size}
        )()
        self.layers = [None]
        self.dummy = nn.Parameter(torch.zeros(1))
        self.seen = 0

    def forward_cached(self, block_embeds, new_features, start, cache):
        assert self.seen + new_features.shape[1] == start
        torch.testing.assert_close(
            new_features, self.features[:, self.seen : start], atol=1e-4, rtol=1e-4
        )
        self.seen = start
        size = block_embeds.shape[1]
        hidden = torch.zeros(1, size, self.vocab)
        for k in range(1, size):
            tok = int(self.truth[start + k])
            if self.wrong(start, k):
                tok = (tok + 1) % self.vocab
            hidden[0, k, tok] = 10.0
        return hidden


def expected_lengths(num_prompt, max_new, block_size, wrong) -> list[int]:
    """Acceptance lengths the loop must report for a scripted drafter (no stop tokens)."""
    out, generated, start = [], 1, num_prompt
    while generated < max_new:
        size = min(block_size, max_new - generated + 1)
        accepted = 0
        while accepted < size - 1 and not wrong(start, accepted + 1):
            accepted += 1
        produced = min(accepted + 1, max_new - generated)
        out.append(produced)
        generated += produced
        start += produced
    return out


def scripted(target, ids, max_new, block_size, wrong):
    plain = plain_generate(target, ids, max_new_tokens=max_new + 8)
    truth = torch.cat([ids, torch.tensor(plain.tokens)])
    layer_ids = [1, 3]
    feats = target_features(target, truth, layer_ids)
    vocab = target.config.vocab_size
    draft = ScriptedDraft(truth, feats, layer_ids, block_size, vocab, wrong)
    head = FrozenHead(torch.zeros(vocab, 4), torch.eye(vocab))
    return draft, head, plain


# ----------------------------------------------------------------------------- greedy loop
@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_acceptance_lengths_follow_the_drafters_mistakes(target, prompts, block_size):
    def wrong(start, k):  # a fixed, position-dependent error pattern
        return (start * 7 + k * 3) % 5 == 0

    for ids in prompts:
        max_new = 23
        draft, head, plain = scripted(target, ids, max_new, block_size, wrong)
        res = speculative_generate(
            draft, target, head, ids, max_new_tokens=max_new, block_size=block_size
        )
        assert res.acceptance_lengths == expected_lengths(len(ids), max_new, block_size, wrong)
        assert res.tokens == plain.tokens[:max_new]
        assert max(res.acceptance_lengths) > 1  # the pattern lets whole runs through


def test_a_perfect_drafter_emits_full_blocks_until_the_length_limit(target, prompts):
    draft, head, plain = scripted(target, prompts[0], 20, 4, lambda s, k: False)
    res = speculative_generate(draft, target, head, prompts[0], max_new_tokens=20, block_size=4)
    # 1 token from the prefill, then blocks of 4 until 19 more are out: 4 x 4 + 3.
    assert res.acceptance_lengths == [4, 4, 4, 4, 3]
    assert res.tokens == plain.tokens[:20]


def test_generation_stops_at_a_stop_token_inside_an_accepted_block(target, prompts):
    ids = prompts[1]
    draft, head, plain = scripted(target, ids, 30, 5, lambda s, k: False)
    stop = plain.tokens[6]  # emitted in the second cycle, inside the accepted run
    first = plain.tokens.index(stop)
    assert first > 5  # the random target's continuation has not used it before
    res = speculative_generate(
        draft, target, head, ids, max_new_tokens=30, block_size=5, stop_token_ids=[stop]
    )
    assert res.tokens == plain.tokens[: first + 1]
    assert sum(res.acceptance_lengths) == first  # the first token came from the prefill


def test_speculative_greedy_output_equals_plain_greedy_decoding(target, prompts):
    draft = random_draft(target)
    for ids in prompts:
        hf = target.generate(ids[None], max_new_tokens=25, do_sample=False)[0, len(ids) :]
        plain = plain_generate(target, ids, max_new_tokens=25)
        assert plain.tokens == hf.tolist()
        assert plain.acceptance_lengths == [1] * 24
        assert_speculative_equals_plain(draft, target, ids, plain, (2, 3, 5, 16))


def assert_speculative_equals_plain(draft, target, ids, plain, block_sizes) -> None:
    """Greedy speculative decoding of 25 tokens gives plain greedy decoding's `plain`."""
    for block_size in block_sizes:
        res = speculative_generate(
            draft,
            target,
            FrozenHead.of_model(target),
            ids,
            max_new_tokens=25,
            block_size=block_size,
        )
        assert res.tokens == plain.tokens
        assert sum(res.acceptance_lengths) == 24


def test_generation_leaves_the_drafter_unchanged(target, prompts):
    draft = random_draft(target)
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    speculative_generate(
        draft, target, FrozenHead.of_model(target), prompts[0], max_new_tokens=8, block_size=4
    )
    for k, v in draft.state_dict().items():
        assert torch.equal(v, before[k])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": 0, "block_size": 4}, "max_new_tokens"),
        ({"max_new_tokens": 4, "block_size": 0}, "block_size"),
        ({"max_new_tokens": 4, "block_size": 4, "temperature": -1.0}, "temperature"),
    ],
)
def test_bad_generation_arguments_are_refused(target, prompts, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        speculative_generate(
            random_draft(target), target, FrozenHead.of_model(target), prompts[0], **kwargs
        )


def test_block_size_above_one_needs_a_drafter(target, prompts):
    with pytest.raises(ValueError, match="drafter"):
        speculative_generate(None, target, None, prompts[0], max_new_tokens=4, block_size=4)


# ----------------------------------------------------------------------------- sampling
VOCAB = 12
PROMPT = torch.tensor([3, 7, 1, 9, 4])


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A 2-layer target over 12 tokens with sharpened (not one-hot) next-token distributions,
    and a random drafter whose proposals clearly differ from them."""
    path = save_random_qwen3(
        tmp_path_factory.mktemp("v12") / "t",
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        vocab_size=VOCAB,
        seed=3,
    )
    model = load_causal_lm(path, CPU, torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    config = draft_config_from_target(
        model.config, num_layers=1, block_size=3, mask_token_id=VOCAB - 1, target_layer_ids=[0]
    )  # layer 1, the last, is never a feature layer
    torch.manual_seed(1)
    return model, DFlashDraftModel(config).eval()


def exact_joint(model, prompt: torch.Tensor, length: int) -> torch.Tensor:
    """P(t1 .. t_length | prompt) of the target at T = 1, as a (VOCAB,) * length tensor."""
    joint = torch.ones(())
    seqs = prompt[None]
    for _ in range(length):
        with torch.no_grad():
            p = torch.softmax(model(seqs).logits[:, -1].double(), -1)  # (VOCAB ** i, VOCAB)
        joint = (joint.reshape(-1, 1) * p).reshape(*joint.shape, VOCAB)
        seqs = torch.cat(
            [seqs.repeat_interleave(VOCAB, 0), torch.arange(VOCAB).repeat(len(seqs))[:, None]], 1
        )
    return joint


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test; cells expected below 5 are pooled into one so the chi-square holds."""
    n = counts.sum()
    expected = probs.flatten() * n
    counts = counts.flatten().double()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), stat / 2.0))


def sample_joint(
    model, draft, block_size: int, n: int, seed: int, draft_sampling: str = "probabilistic"
) -> torch.Tensor:
    counts = torch.zeros(VOCAB, VOCAB, VOCAB)
    gen = torch.Generator().manual_seed(seed)
    head = FrozenHead.of_model(model)
    for _ in range(n):
        res = speculative_generate(
            draft,
            model,
            head,
            PROMPT,
            max_new_tokens=3,
            block_size=block_size,
            temperature=1.0,
            generator=gen,
            draft_sampling=draft_sampling,
        )
        counts[tuple(res.tokens)] += 1
    return counts


@pytest.mark.parametrize("block_size", [2, 3])
def test_rejection_sampling_reproduces_the_targets_distribution(small_vocab, block_size):
    model, draft = small_vocab
    exact = exact_joint(model, PROMPT, 3)
    counts = sample_joint(model, draft, block_size, n=2500, seed=block_size)
    # The joint of the first three tokens covers the prefill token, accepted drafts, residual
    # draws after a rejection and (block size 2) the bonus after a fully accepted block.
    assert chi_square_pvalue(counts, exact) > 1e-3
    freq = counts / counts.sum()
    for dims in [(1, 2), (0, 2), (0, 1)]:  # marginal of t1, t2, t3: noise alone is ~0.03 TV
        assert 0.5 * (freq.sum(dims) - exact.sum(dims)).abs().sum() < 0.07


def test_the_distribution_check_detects_resampling_from_the_target_after_a_rejection(
    small_vocab, monkeypatch
):
    """Power of the test above: the classic bug (after a rejection, draw from p instead of the
    residual max(0, p - q)) must fail it."""
    model, draft = small_vocab

    def resample_from_p(self, drafts, draft_probs, logits):
        p = torch.softmax(logits.float(), -1)
        n = drafts.shape[0]
        p_d = p[:n].gather(1, drafts[:, None])[:, 0]
        q_d = draft_probs.gather(1, drafts[:, None])[:, 0]
        u = torch.rand(n, generator=self.generator)
        accepted = (u * q_d < p_d).long().cumprod(0).sum()
        return accepted, self._draw(p[accepted])

    monkeypatch.setattr(_Loop, "_accept_sampled", resample_from_p)
    counts = sample_joint(model, draft, 3, n=2500, seed=0)
    assert chi_square_pvalue(counts, exact_joint(model, PROMPT, 3)) < 1e-6


@pytest.mark.slow  # ~26 s on the 2-core machine; the cycle-level test below runs by default
def test_greedy_drafts_reproduce_the_targets_distribution(small_vocab):
    # vLLM's default draft_sample_method: argmax drafts, accepted with probability p(d), else a
    # draw from p without d. Lossless as well: the same joint as the target's.
    model, draft = small_vocab
    exact = exact_joint(model, PROMPT, 3)
    counts = sample_joint(model, draft, 3, n=2500, seed=11, draft_sampling="greedy")
    assert chi_square_pvalue(counts, exact) > 1e-3
    freq = counts / counts.sum()
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert 0.5 * (freq.sum(dims) - exact.sum(dims)).abs().sum() < 0.07


def _cycle_loop(draft_sampling: str, seed: int) -> _Loop:
    """The acceptance machinery of the loop alone (no models): T = 1, a seeded generator."""
    loop = _Loop.__new__(_Loop)
    loop.temperature, loop.draft_sampling = 1.0, draft_sampling
    loop.generator = torch.Generator().manual_seed(seed)
    return loop


def emitted_first_two(loop, draft_logits, target_logits, n, accept=None):
    """Counts of the first emitted token, and of the second given the first draft was accepted,
    over n cycles of two drafts against fixed target logits."""
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    accept = accept or loop._accept_sampled
    for _ in range(n):
        drafts, q = loop._propose(draft_logits)
        accepted, bonus = accept(drafts, q, target_logits)
        out = [*drafts[: int(accepted)].tolist(), int(bonus)]
        first[out[0]] += 1
        if int(accepted) >= 1:
            second[out[1]] += 1
    return first, second


def test_one_greedy_cycle_emits_the_targets_distribution_slot_by_slot():
    gen = torch.Generator().manual_seed(4)
    target_logits = 2.0 * torch.randn(3, VOCAB, generator=gen)
    draft_logits = 2.0 * torch.randn(2, VOCAB, generator=gen)
    draft_logits[0, target_logits[0].argmax()] += 10.0  # a draft the target often accepts
    p = torch.softmax(target_logits.double(), -1)
    loop = _cycle_loop("greedy", seed=0)
    drafts, q = loop._propose(draft_logits)
    assert torch.equal(drafts, draft_logits.argmax(-1))
    assert torch.equal(q, torch.nn.functional.one_hot(drafts, VOCAB).float())
    first, second = emitted_first_two(loop, draft_logits, target_logits, n=6000)
    assert chi_square_pvalue(first, p[0]) > 1e-3
    assert second.sum() > 1000 and chi_square_pvalue(second, p[1]) > 1e-3

    # Power: drawing from p itself (not p without the rejected draft) after a rejection fails.
    def resample_from_p(drafts, q, logits):
        probs = torch.softmax(logits.float(), -1)
        ok = (
            torch.rand(len(drafts), generator=loop.generator)
            < probs[:2].gather(1, drafts[:, None])[:, 0]
        )
        accepted = ok.long().cumprod(0).sum()
        return accepted, loop._draw(probs[accepted])

    bad, _ = emitted_first_two(loop, draft_logits, target_logits, n=6000, accept=resample_from_p)
    assert chi_square_pvalue(bad, p[0]) < 1e-6


def test_an_unknown_draft_sampling_is_refused(target, prompts):
    with pytest.raises(ValueError, match="draft_sampling must be one of"):
        speculative_generate(
            random_draft(target),
            target,
            FrozenHead.of_model(target),
            prompts[0],
            max_new_tokens=4,
            block_size=4,
            temperature=1.0,
            draft_sampling="topk",
        )


def test_sampling_is_reproducible_with_a_seeded_generator(small_vocab):
    model, draft = small_vocab
    runs = [
        speculative_generate(
            draft,
            model,
            FrozenHead.of_model(model),
            PROMPT,
            max_new_tokens=12,
            block_size=3,
            temperature=0.8,
            generator=torch.Generator().manual_seed(5),
        ).tokens
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------- metrics
def test_tau_averages_per_response_then_over_responses():
    tau, counts, rates = acceptance_summary([[4, 4], [1, 1, 1, 1], []], block_size=4)
    assert tau == pytest.approx((4.0 + 1.0) / 2)  # not the pooled 12 / 6 = 2
    assert counts == {"1": 4, "2": 0, "3": 0, "4": 2}
    assert rates == pytest.approx([2 / 6, 2 / 6, 2 / 6])


def test_per_position_rate_counts_cycles_that_reached_the_offset():
    _, _, rates = acceptance_summary([[1, 2, 3, 3]], block_size=3)
    assert rates == pytest.approx([3 / 4, 2 / 4])


def test_evaluate_reports_tau_histogram_and_speedup(target, prompts):
    draft = random_draft(target, block_size=4)
    report = evaluate(draft, target, FrozenHead.of_model(target), prompts, max_new_tokens=10)
    assert report.num_prompts == 3 and report.block_size == 4
    assert sum(report.acceptance_counts.values()) == report.num_cycles
    assert sum(report.acceptance_histogram.values()) == pytest.approx(1.0)
    assert len(report.per_position_acceptance) == 3
    assert 1.0 <= report.tau <= 4.0
    assert report.speedup == pytest.approx(report.spec_tokens_per_s / report.plain_tokens_per_s)
    assert report.greedy_match == 1.0
    assert [r["new_tokens"] for r in report.responses] == [10, 10, 10]
    json.dumps(report.to_dict())  # the JSON file must be writable


def test_evaluate_refuses_an_empty_prompt_list(target):
    with pytest.raises(ValueError, match="no prompts"):
        evaluate(random_draft(target), target, FrozenHead.of_model(target), [], max_new_tokens=4)


def test_evaluate_refuses_a_drafter_built_for_another_target(target, prompts):
    config = draft_config_from_target(
        target.config, num_layers=1, block_size=4, mask_token_id=255, num_features=2
    )
    config.vocab_size, config.mask_token_id = 512, 300  # a larger vocabulary than the target's
    with pytest.raises(ValueError, match="vocab_size 512 != target vocab_size 256"):
        evaluate(
            DFlashDraftModel(config), target, FrozenHead.of_model(target), prompts, max_new_tokens=4
        )


def test_quick_tau_restores_train_mode_and_leaves_weights_alone(target, prompts):
    draft = random_draft(target).train()
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    tau = quick_tau(draft, target, FrozenHead.of_model(target), prompts[:2], max_new_tokens=6)
    assert 1.0 <= tau <= 4.0
    assert draft.training
    assert all(p.grad is None for p in draft.parameters())
    assert all(torch.equal(v, before[k]) for k, v in draft.state_dict().items())


def test_quick_tau_runs_an_fp32_replica_against_a_bf16_target(tiny_target, prompts):
    """As in training: fp32 master weights, the target and the frozen head in bf16."""
    target16 = load_causal_lm(tiny_target, CPU, torch.bfloat16)
    draft = random_draft(target16).train()
    tau = quick_tau(draft, target16, FrozenHead.of_model(target16), prompts[:1], max_new_tokens=6)
    assert 1.0 <= tau <= 4.0
    assert next(draft.parameters()).dtype == torch.float32


def test_quick_tau_stops_each_answer_at_its_stop_token(target, prompts):
    # eval/tau during training counts the rounds `eval` and engines run: none past the stop.
    draft, head = random_draft(target), FrozenHead.of_model(target)
    whole = speculative_generate(draft, target, head, prompts[0], max_new_tokens=12, block_size=4)
    stop = whole.tokens[5]
    cut = speculative_generate(
        draft, target, head, prompts[0], max_new_tokens=12, block_size=4, stop_token_ids=[stop]
    )
    assert sum(cut.acceptance_lengths) < sum(whole.acceptance_lengths)
    tau = quick_tau(draft, target, head, [prompts[0]], max_new_tokens=12, stop_token_ids=[stop])
    assert tau == pytest.approx(acceptance_summary([cut.acceptance_lengths], 4)[0])


def test_quick_tau_equals_the_scripted_expectation(target, prompts):
    def wrong(start, k):
        return k == 3

    draft, head, _ = scripted(target, prompts[0], 13, 4, wrong)
    tau = quick_tau(draft, target, head, [prompts[0]], max_new_tokens=13, block_size=4)
    lengths = expected_lengths(len(prompts[0]), 13, 4, wrong)
    assert tau == pytest.approx(sum(lengths) / len(lengths))


def test_histogram_keys_cover_every_length(target, prompts):
    report = evaluate(
        random_draft(target, block_size=3),
        target,
        FrozenHead.of_model(target),
        prompts[:1],
        max_new_tokens=5,
        baseline=False,
        warmup=False,
    )
    assert list(report.acceptance_histogram) == ["1", "2", "3"]
    assert report.speedup is None and report.greedy_match is None
    assert Counter(report.responses[0]["acceptance_lengths"])  # lengths are kept per response


# ----------------------------------------------------------------------------- DFlash 2
def dflash2_draft(model_config, top_k: int, seed: int = 0, **kw) -> DFlashDraftModel:
    """A DFlash 2 drafter whose convolutions and selector are far from the identity: random
    kernels and codebooks, so the selector's walk really departs from the unary argmax."""
    kw = {"num_layers": 1, "block_size": 4, "mask_token_id": 255, "num_features": 2, **kw}
    config = draft_config_from_target(
        model_config, arch="dflash2", selector_top_k=top_k, selector_rank=8, **kw
    )
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "_conv." in name or "candidate_selector." in name:
                p.add_(torch.randn(p.shape, generator=gen) * (2.0 if "codebook" in name else 0.1))
    return draft.eval()


class WalkSpy:
    """Counts the selector's walks and the draft positions where the walk left the unary
    argmax (the test is only as strong as that count)."""

    def __init__(self, monkeypatch, draft):
        self.walks, self.departures = 0, 0
        walk = draft.candidate_selector.walk

        def spy(hidden, logits, anchor, *args):
            tokens, candidates, q = walk(hidden, logits, anchor, *args)
            self.walks += 1
            self.departures += int((tokens != logits.argmax(-1)).sum())
            return tokens, candidates, q

        monkeypatch.setattr(draft.candidate_selector, "walk", spy)


def test_dflash2_greedy_output_equals_plain_greedy_decoding(target, prompts, monkeypatch):
    draft = dflash2_draft(target.config, top_k=8)
    spy = WalkSpy(monkeypatch, draft)
    for ids in prompts:
        plain = plain_generate(target, ids, max_new_tokens=25)
        assert_speculative_equals_plain(draft, target, ids, plain, (2, 4))
    assert spy.walks > 0 and spy.departures > 0


@pytest.fixture(scope="module")
def small_vocab_dflash2(small_vocab):
    model, _ = small_vocab
    # Top 4 of 12: the candidates leave most of the vocabulary out of q.
    return dflash2_draft(
        model.config,
        top_k=4,
        seed=2,
        block_size=3,
        target_layer_ids=[0],
        mask_token_id=VOCAB - 1,
    )


@pytest.mark.slow  # 2500 generations, ~150 s on the loaded 2 cores; the cycle test is the default
def test_dflash2_sampled_drafts_reproduce_the_targets_distribution(
    small_vocab, small_vocab_dflash2, monkeypatch
):
    model, draft = small_vocab[0], small_vocab_dflash2
    spy = WalkSpy(monkeypatch, draft)
    exact = exact_joint(model, PROMPT, 3)
    counts = sample_joint(model, draft, 3, n=2500, seed=21)
    assert chi_square_pvalue(counts, exact) > 1e-3
    freq = counts / counts.sum()
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert 0.5 * (freq.sum(dims) - exact.sum(dims)).abs().sum() < 0.07
    assert spy.walks > 1000 and spy.departures > 100


@pytest.mark.slow
def test_the_dflash2_distribution_check_detects_a_q_that_ignores_the_selector(
    small_vocab, small_vocab_dflash2, monkeypatch
):
    """Power of the test above: verifying the selector's draws against the unary softmax (the
    DFlash 1 q) instead of q spread over the candidates must fail it."""
    model, draft = small_vocab[0], small_vocab_dflash2
    propose_path = _Loop._propose_path

    def unary_q(self, hidden, draft_logits, anchor):
        tokens, _ = propose_path(self, hidden, draft_logits, anchor)
        return tokens, torch.softmax(draft_logits.float() / self.temperature, -1).to(self.device)

    monkeypatch.setattr(_Loop, "_propose_path", unary_q)
    counts = sample_joint(model, draft, 3, n=2500, seed=21)
    assert chi_square_pvalue(counts, exact_joint(model, PROMPT, 3)) < 1e-6


def test_one_dflash2_cycle_emits_the_targets_distribution_slot_by_slot(small_vocab_dflash2):
    # The loop's acceptance machinery alone, on fixed draft states and target logits: the first
    # emitted token follows p_1, the second (given the first draft accepted) p_2, although the
    # second draft's q depends on the first draft through the selector.
    gen = torch.Generator().manual_seed(6)
    target_logits = 2.0 * torch.randn(3, VOCAB, generator=gen)
    hidden = torch.randn(2, small_vocab_dflash2.config.hidden_size, generator=gen)
    draft_logits = 2.0 * torch.randn(2, VOCAB, generator=gen)
    draft_logits[0, target_logits[0].argmax()] += 10.0  # a first draft the target often accepts
    p = torch.softmax(target_logits.double(), -1)
    loop = _cycle_loop("probabilistic", seed=0)
    loop.selector, loop.device = small_vocab_dflash2.candidate_selector, CPU
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for _ in range(4000):
        drafts, q = loop._propose_path(hidden, draft_logits, anchor=5)
        assert torch.allclose(q.sum(-1), torch.ones(2)) and int((q[0] > 0).sum()) <= 4
        accepted, bonus = loop._accept_sampled(drafts, q, target_logits)
        out = [*drafts[: int(accepted)].tolist(), int(bonus)]
        first[out[0]] += 1
        if int(accepted) >= 1:
            second[out[1]] += 1
    assert chi_square_pvalue(first, p[0]) > 1e-3
    assert second.sum() > 500 and chi_square_pvalue(second, p[1]) > 1e-3


def test_a_dflash2_drafter_warm_started_from_dflash1_drafts_exactly_its_tokens(
    target, prompts, tmp_path, monkeypatch
):
    # --init-from's promise: the new modules at the identity, the DFlash 1 drafter's drafts.
    export_draft(random_draft(target, block_size=4, seed=3), tmp_path / "d1", dtype=torch.float32)
    dflash1 = load_draft(tmp_path / "d1")
    config = DFlashConfig.from_dict({**dflash1.config.to_dict(), "arch": "dflash2"})
    dflash2 = DFlashDraftModel(config)
    dflash2.init_weights(seed=9)
    init_from_draft(dflash2, tmp_path / "d1")
    dflash2.eval()
    drafts = {"dflash": [], "dflash2": []}
    propose, propose_path = _Loop._propose, _Loop._propose_path

    def record(arch, fn):
        def wrapped(self, *args):
            tokens, q = fn(self, *args)
            drafts[arch].append(tokens.tolist())
            return tokens, q

        return wrapped

    monkeypatch.setattr(_Loop, "_propose", record("dflash", propose))
    monkeypatch.setattr(_Loop, "_propose_path", record("dflash2", propose_path))
    head = FrozenHead.of_model(target)
    for ids in prompts:
        runs = [
            speculative_generate(d, target, head, ids, max_new_tokens=20, block_size=4)
            for d in (dflash1, dflash2)
        ]
        assert runs[0].tokens == runs[1].tokens
        assert runs[0].acceptance_lengths == runs[1].acceptance_lengths
    assert len(drafts["dflash"]) > 10 and drafts["dflash"] == drafts["dflash2"]
