"""The draft-and-verify loop of speculative decoding with a DFlash drafter.

The draft-and-verify loop (`speculative_generate`), for one prompt of n tokens:
1. Prefill: the target runs the prompt once, with its KV cache; its last logits give the first new
   token, its hidden states the context features of positions 0 .. n-1.
2. Cycles. The newest token is the block's anchor at position `start`. The drafter fills the B-1
   masked slots after it in ONE pass against its cache of context keys/values (the new features
   are appended to that cache; block entries never are). The target verifies the B tokens in ONE
   pass on top of its cache. The longest accepted prefix of the drafts plus one token of the
   target's own (the bonus) is emitted: the cycle's acceptance length, 1 .. B, clipped at
   `max_new_tokens` and at the first stop token. The target cache is cropped back to the emitted
   positions and the verified features of the anchor and the accepted drafts become new context;
   the bonus token is the next anchor.
Greedy (T = 0): a draft is accepted while it equals the target's argmax; the output is identical
to plain greedy decoding of the target. T > 0: speculative rejection sampling, so the output
follows the target's distribution exactly, with drafts made one of two ways (`draft_sampling`):
- "probabilistic" (the reference client's, vLLM's `draft_sample_method: probabilistic`): draft d
  drawn from the drafter's q at T, accepted with probability min(1, p(d) / q(d)), else a draw
  from the normalised residual max(0, p - q);
- "greedy" (vLLM's default `draft_sample_method`): d = argmax q, i.e. rejection sampling with
  q = onehot(d): accepted with probability p(d), else a draw from p with d removed, normalised.
Both are lossless; they accept differently, so tau at T > 0 depends on which one an engine runs.
A DFlash 2 drafter drafts by its candidate path selector instead of the unary argmax or a draw
from the unary logits: greedy follows the argmax of the selector's score (each chosen token the
next position's predecessor, the anchor the first), sampled draws from q = softmax(S / T) over
the K candidates, and rejection sampling sees q spread onto the candidates' token ids.
Block size 1 is plain target decoding through the same loop (`plain_generate`), the speedup
baseline.

These semantics match the reference client (`dflash.dflash_generate`) cycle for cycle; a test runs
both on the same exported drafter and compares acceptance lengths prompt by prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.devices import synchronize
from dflash_train.model.compat import cache_kwargs
from dflash_train.model.draft import DFlashDraftModel, DraftCache
from dflash_train.model.target import FrozenHead
from dflash_train.model.target_cache import VerifyCache
from dflash_train.on_policy import Round


@dataclass
class GenerationResult:
    """One response of the draft-and-verify loop.

    tokens: the generated ids (the first comes from the prefill; a stop token is included).
    acceptance_lengths: per cycle, the tokens it emitted (accepted drafts + the bonus), 1 .. B.
    prefill_s, decode_s: wall seconds of the prefill (incl. the first token) and of all cycles.
    rounds: per cycle, its verify round (`on_policy.Round`: anchor position, drafts accepted
        within the response, the rejected draft when its position is inside the response), at
        T = 0 with a drafter only (empty otherwise): what on-policy training replays.
    """

    tokens: list[int]
    acceptance_lengths: list[int]
    prefill_s: float
    decode_s: float
    rounds: list[Round] = field(default_factory=list)

    @property
    def tau(self) -> float | None:
        """Mean acceptance length of this response; None when no cycle ran."""
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else None


def speculative_generate(
    draft: DFlashDraftModel | None,
    target: nn.Module,
    head: FrozenHead | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    draft_sampling: str = "probabilistic",
) -> GenerationResult:
    """Generate up to `max_new_tokens` for ONE prompt by draft-and-verify (see the module doc).

    draft, head: the drafter and the target's frozen embedding / LM head on the drafter's device
        (both unused, and may be None, when block_size == 1).
    target: the Hugging Face causal LM (frozen, eval mode).
    input_ids: (n,) or (1, n) prompt ids.
    generator: randomness for T > 0, on the target's device.
    draft_sampling: how drafts are made at T > 0, "probabilistic" or "greedy" (module doc).
    The drafter is not modified (inference mode; its cache is a fresh `DraftCache`).
    """
    _check_generation_args(draft, head, max_new_tokens, block_size, temperature, draft_sampling)
    with torch.inference_mode():
        loop = _Loop(draft, target, head, block_size, temperature, generator, draft_sampling)
        return loop.run(input_ids, max_new_tokens, set(stop_token_ids or ()))


def plain_generate(
    target: nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> GenerationResult:
    """Plain target decoding: the same loop at block size 1 (one token per target pass)."""
    return speculative_generate(
        None,
        target,
        None,
        input_ids,
        max_new_tokens=max_new_tokens,
        block_size=1,
        temperature=temperature,
        stop_token_ids=stop_token_ids,
        generator=generator,
    )


def _check_generation_args(
    draft: DFlashDraftModel | None,
    head: FrozenHead | None,
    max_new_tokens: int,
    block_size: int,
    temperature: float,
    draft_sampling: str = "probabilistic",
) -> None:
    if draft_sampling not in DRAFT_SAMPLING:
        raise ValueError(f"draft_sampling must be one of {DRAFT_SAMPLING}, got {draft_sampling!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if block_size > 1 and (draft is None or head is None):
        raise ValueError("block_size > 1 needs a drafter and the target's embedding / LM head")


DRAFT_SAMPLING = ("probabilistic", "greedy")


class _Loop:
    """State of one generation: the two caches, the pending context features, the samplers."""

    def __init__(
        self,
        draft: DFlashDraftModel | None,
        target: nn.Module,
        head: FrozenHead | None,
        block_size: int,
        temperature: float,
        generator: torch.Generator | None,
        draft_sampling: str = "probabilistic",
    ) -> None:
        self.draft, self.target, self.head = draft, target, head
        self.block_size, self.temperature, self.generator = block_size, temperature, generator
        self.draft_sampling = draft_sampling
        self.device = next(target.parameters()).device
        self.layer_ids = draft.config.target_layer_ids if block_size > 1 else None
        if draft is not None and block_size > 1:
            param = next(draft.parameters())
            self.draft_device, self.draft_dtype = param.device, param.dtype
            self.draft_cache = DraftCache(len(draft.layers))
        # DFlash 2's candidate path selector (None for DFlash 1 and for block size 1).
        self.selector = getattr(draft, "candidate_selector", None) if block_size > 1 else None
        # The target's cache, rolled back to the accepted prefix after every verify.
        self.target_cache = VerifyCache(target, block_size)
        # (1, S_new, K * hidden) target features of positions not yet in the draft cache.
        self.features: torch.Tensor | None = None

    def run(
        self, input_ids: torch.Tensor, max_new_tokens: int, stops: set[int]
    ) -> GenerationResult:
        ids = input_ids.reshape(1, -1).to(self.device)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("the prompt is empty")
        t0 = _clock(self.device)
        first = self._prefill(ids)
        t1 = _clock(self.device)
        tokens, lengths, rounds = [first], [], []
        start = n  # position of the newest token: the next block's anchor
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            # A block never verifies past the last token we may emit (+1 for its anchor).
            size = min(self.block_size, max_new_tokens - len(tokens) + 1)
            emitted, verified, drafts = self._cycle(tokens[-1], start, size)
            num = len(emitted) - 1  # drafts accepted by verification
            emitted = emitted[: max_new_tokens - len(tokens)]
            for i, tok in enumerate(emitted):
                if tok in stops:
                    emitted = emitted[: i + 1]
                    break
            produced = len(emitted)
            if size > 1 and self.temperature == 0:
                rounds.append(_round(start, num, produced, drafts))
            tokens.extend(emitted)
            lengths.append(produced)
            self.target_cache.keep(start + produced)
            if verified is not None:
                # The anchor and the accepted drafts are now context; the bonus is the next anchor.
                self.features = verified[:, :produced]
            start += produced
        t2 = _clock(self.device)
        return GenerationResult(tokens, lengths, t1 - t0, t2 - t1, rounds)

    def _prefill(self, ids: torch.Tensor) -> int:
        n = ids.shape[1]
        out = self.target(
            ids,
            position_ids=torch.arange(n, device=self.device)[None],
            **cache_kwargs(self.target, self.target_cache.cache),
            use_cache=True,
            output_hidden_states=self.layer_ids is not None,
            logits_to_keep=1,
        )
        if self.layer_ids is not None:
            self.features = _select_features(out.hidden_states, self.layer_ids)
        logits = out.logits[0, -1:]  # (1, vocab)
        return int(self._sample(logits)[0])  # host sync: the token decides what runs next

    def _cycle(
        self, anchor: int, start: int, size: int
    ) -> tuple[list[int], torch.Tensor | None, list[int]]:
        """One draft-and-verify step; returns the emitted tokens (accepted drafts + bonus), the
        verified block's features (1, size, K * hidden), None at block size 1, and the drafts."""
        block = torch.full((1, size), anchor, dtype=torch.long, device=self.device)
        draft_probs = None
        if size > 1:
            hidden, draft_logits = self._draft(anchor, start, size)  # drafter device
            if self.selector is not None:
                block[0, 1:], draft_probs = self._propose_path(hidden, draft_logits, anchor)
            else:
                block[0, 1:], draft_probs = self._propose(draft_logits.to(self.device))
        self.target_cache.before_verify(block, start)
        out = self.target(
            block,
            position_ids=torch.arange(start, start + size, device=self.device)[None],
            **cache_kwargs(self.target, self.target_cache.cache),
            use_cache=True,
            output_hidden_states=size > 1,
        )
        logits = out.logits[0]  # (size, vocab): the target's next-token logits after each slot
        drafts = block[0, 1:]
        if self.temperature > 0:
            accepted, bonus = self._accept_sampled(drafts, draft_probs, logits)
        else:
            accepted, bonus = _accept_greedy(drafts, logits)
        # One host transfer per cycle: drafts, accepted count and bonus together.
        host = torch.cat([drafts, accepted[None], bonus[None]]).tolist()
        num = host[-2]
        emitted = [*host[:num], host[-1]]
        verified = _select_features(out.hidden_states, self.layer_ids) if size > 1 else None
        return emitted, verified, host[:-2]

    def _draft(self, anchor: int, start: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft states (size - 1, hidden) and unary logits (size - 1, vocab) of the masked slots
        after `anchor` (one drafter pass), on the drafter's device."""
        assert self.draft is not None and self.head is not None and self.features is not None
        mask_id = self.draft.config.mask_token_id
        ids = torch.full((1, size), mask_id, dtype=torch.long, device=self.head.embed.device)
        ids[0, 0] = anchor
        embeds = self.head.embed_tokens(ids).to(self.draft_dtype)  # (1, size, hidden)
        feats = self.features.to(self.draft_device)
        hidden = self.draft.forward_cached(embeds, feats, start, self.draft_cache)
        self.features = None
        head_dtype = self.head.head.dtype
        logits = F.linear(hidden[0, 1:].to(head_dtype), self.head.head, self.head.head_bias)
        return hidden[0, 1:], logits

    def _propose_path(
        self, hidden: torch.Tensor, draft_logits: torch.Tensor, anchor: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """DFlash 2: the selector's walk over the top-K candidates (`CandidateSelector.walk`)
        and, for T > 0, each draft's distribution over the vocabulary: q spread onto the
        candidates' ids (the q-mass of the candidates equal to a token is its probability), or
        the one-hot of the greedy path's token for greedy drafts."""
        assert self.selector is not None
        sampled = self.temperature > 0 and self.draft_sampling == "probabilistic"
        first = torch.tensor(anchor, device=hidden.device)
        tokens, candidates, q = self.selector.walk(
            hidden,
            draft_logits,
            first,
            self.temperature if sampled else 0.0,
            self.generator if sampled else None,
        )
        tokens = tokens.to(self.device)
        if self.temperature == 0:
            return tokens, None
        vocab = draft_logits.shape[-1]
        if not sampled:
            return tokens, F.one_hot(tokens, vocab).float()
        spread = torch.zeros(len(tokens), vocab, device=self.device)
        return tokens, spread.scatter_add_(1, candidates.to(self.device), q.to(self.device))

    def _propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens (size - 1,) and, for T > 0, the distributions they were drawn from: the
        drafter's at T, or for greedy drafts the one-hot of the argmax (a deterministic draft is
        a draw from its one-hot, which is what makes the same rejection rule lossless)."""
        if self.temperature == 0:
            return draft_logits.argmax(-1), None
        if self.draft_sampling == "greedy":
            tokens = draft_logits.argmax(-1)
            return tokens, F.one_hot(tokens, draft_logits.shape[-1]).float()
        probs = self._probs(draft_logits)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) target logits -> (rows,) tokens: argmax at T = 0, else a draw at T."""
        if self.temperature == 0:
            return logits.argmax(-1)
        return torch.multinomial(self._probs(logits), 1, generator=self.generator)[:, 0]

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distribution at temperature T, in fp32."""
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def _accept_sampled(
        self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative rejection sampling over the block (0-dim accepted count and token).

        Draft k was drawn from q_k (a DFlash 1 drafter sees only masks, so q_k does not depend
        on the earlier drafts; DFlash 2's selector conditions q_k on draft k - 1, which is
        exactly the prefix p_k conditions on too; for greedy drafts q_k is the one-hot of the
        draft); p_k is the target's distribution given the drafts before it. Accepting with
        probability min(1, p_k(d) / q_k(d)) and, on the first rejection, drawing from
        max(0, p_k - q_k) normalised, emits tokens distributed exactly as the target's.
        """
        p = self._probs(logits)  # (size, vocab)
        n = drafts.shape[0]
        if n == 0:
            return torch.zeros((), dtype=torch.long, device=p.device), self._draw(p[0])
        assert draft_probs is not None
        p_d = p[:n].gather(1, drafts[:, None])[:, 0]
        q_d = draft_probs.gather(1, drafts[:, None])[:, 0]
        u = torch.rand(n, device=p.device, generator=self.generator)
        accepted = (u * q_d < p_d).long().cumprod(0).sum()
        if int(accepted) == n:  # host sync: which distribution the bonus comes from
            return accepted, self._draw(p[n])
        residual = (p[accepted] - draft_probs[accepted]).clamp_min(0)
        total = residual.sum()
        # p == q at this slot would make the rejection impossible; guard the 0/0 anyway.
        residual = residual / total if float(total) > 0 else p[accepted]
        return accepted, self._draw(residual)

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(probs, 1, generator=self.generator)[0]


def _round(start: int, num: int, produced: int, drafts: list[int]) -> Round:
    """The verify round at anchor `start` that accepted `num` drafts and emitted `produced`
    tokens (fewer than num + 1 when a stop token or max_new_tokens cut it): the accepted drafts
    inside the response, and the rejected draft when the correction was emitted."""
    if produced > num and num < len(drafts):
        return Round(start, num, drafts[num])
    return Round(start, min(num, produced))


def _accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest prefix of drafts equal to the target's argmax, and the target's next token."""
    posterior = logits.argmax(-1)  # (size,)
    n = drafts.shape[0]
    accepted = (drafts == posterior[:n]).long().cumprod(0).sum()
    return accepted, posterior[accepted]


def _select_features(hidden_states: Sequence[torch.Tensor], layer_ids: list[int]) -> torch.Tensor:
    """Outputs of decoder layers `layer_ids` (hidden_states[id + 1]), concatenated on the last
    axis: (1, seq, K * hidden)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _clock(device: torch.device) -> float:
    synchronize(device)  # device work must be finished before it is timed
    return time.perf_counter()


# ----------------------------------------------------------------------------- acceptance
MIN_NEW_TOKENS = 2
"""The fewest new tokens per prompt that can measure an acceptance length: the first comes from
the prefill, and only the tokens after it are drafted and verified."""


def acceptance_summary(
    per_response: Sequence[Sequence[int]], block_size: int
) -> tuple[float, dict[str, int], list[float]]:
    """tau, the histogram counts (keys "1" .. "B") and the per-position acceptance rates from
    the acceptance lengths of each response. Responses without any cycle do not enter tau (it is
    1.0 when no response has one)."""
    means = [sum(r) / len(r) for r in per_response if r]
    tau = sum(means) / len(means) if means else 1.0
    counts = {str(b): 0 for b in range(1, block_size + 1)}
    for length in (a for r in per_response for a in r):
        counts[str(length)] += 1
    cycles = sum(counts.values())
    # The draft at offset k was accepted in every cycle that emitted more than k tokens.
    rates = [
        sum(c for b, c in counts.items() if int(b) > k) / cycles if cycles else 0.0
        for k in range(1, block_size)
    ]
    return tau, counts, rates


def quick_tau(
    draft: DFlashDraftModel,
    target: nn.Module,
    head: FrozenHead,
    prompt_ids: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 64,
    block_size: int | None = None,
    stop_token_ids: Sequence[int] | None = None,
) -> float:
    """Greedy tau on held-out prompts, for `eval/tau` during training (no timing, no baseline).

    `draft` may be a live training replica (the unwrapped module, on its own device with `head`
    there too): it runs under inference mode and its train/eval mode is restored, so its weights,
    gradients and optimizer state are untouched. `stop_token_ids`: where an answer ends, as
    `eval` and serving engines stop (`prompts.eos_token_ids`); without them every prompt
    decodes `max_new_tokens`, past its end of turn.
    """
    was_training = draft.training
    draft.eval()
    try:
        bs = block_size or draft.config.block_size
        stops = {"max_new_tokens": max_new_tokens, "stop_token_ids": stop_token_ids}
        lengths = [
            speculative_generate(
                draft, target, head, ids, block_size=bs, **stops
            ).acceptance_lengths
            for ids in prompt_ids
        ]
    finally:
        draft.train(was_training)
    return acceptance_summary(lengths, bs)[0]
