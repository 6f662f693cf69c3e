"""`dflash-train eval`: real speculative decoding, its acceptance length (tau) and speedup.

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
to plain greedy decoding of the target. T > 0: speculative rejection sampling (accept draft d with
probability min(1, p(d) / q(d)), else sample the normalised residual max(0, p - q)), so the output
follows the target's distribution exactly. Block size 1 is plain target decoding through the same
loop (`plain_generate`), the speedup baseline.

These semantics match the reference client (`dflash.dflash_generate`) cycle for cycle; a test runs
both on the same exported drafter and compares acceptance lengths prompt by prompt.

Metrics (`evaluate`): tau = mean acceptance length per response, averaged over responses; the
histogram of acceptance lengths over all cycles; the per-position acceptance rate (fraction of
cycles whose draft at offset k was accepted, k = 1 .. B-1); decode throughput as the reference
client measures it (decode seconds per output token, averaged over responses, inverted) for the
speculative loop and for plain decoding on the same prompts, and their ratio (speedup).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.model.draft import DFlashDraftModel, DraftCache
from dflash_train.model.target import FrozenHead

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# ============================================================================= the loop


@dataclass
class GenerationResult:
    """One response of the draft-and-verify loop.

    tokens: the generated ids (the first comes from the prefill; a stop token is included).
    acceptance_lengths: per cycle, the tokens it emitted (accepted drafts + the bonus), 1 .. B.
    prefill_s, decode_s: wall seconds of the prefill (incl. the first token) and of all cycles.
    """

    tokens: list[int]
    acceptance_lengths: list[int]
    prefill_s: float
    decode_s: float

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
) -> GenerationResult:
    """Generate up to `max_new_tokens` for ONE prompt by draft-and-verify (see the module doc).

    draft, head: the drafter and the target's frozen embedding / LM head on the drafter's device
        (both unused, and may be None, when block_size == 1).
    target: the Hugging Face causal LM (frozen, eval mode).
    input_ids: (n,) or (1, n) prompt ids.
    generator: randomness for T > 0, on the target's device.
    The drafter is not modified (inference mode; its cache is a fresh `DraftCache`).
    """
    _check_generation_args(draft, head, max_new_tokens, block_size, temperature)
    with torch.inference_mode():
        return _Loop(draft, target, head, block_size, temperature, generator).run(
            input_ids, max_new_tokens, set(stop_token_ids or ())
        )


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
) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if block_size > 1 and (draft is None or head is None):
        raise ValueError("block_size > 1 needs a drafter and the target's embedding / LM head")


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
    ) -> None:
        self.draft, self.target, self.head = draft, target, head
        self.block_size, self.temperature, self.generator = block_size, temperature, generator
        self.device = next(target.parameters()).device
        self.layer_ids = draft.config.target_layer_ids if block_size > 1 else None
        if draft is not None and block_size > 1:
            param = next(draft.parameters())
            self.draft_device, self.draft_dtype = param.device, param.dtype
            self.draft_cache = DraftCache(len(draft.layers))
        self.target_cache = _new_target_cache(target)
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
        tokens, lengths = [first], []
        start = n  # position of the newest token: the next block's anchor
        while len(tokens) < max_new_tokens and tokens[-1] not in stops:
            # A block never verifies past the last token we may emit (+1 for its anchor).
            size = min(self.block_size, max_new_tokens - len(tokens) + 1)
            emitted, verified = self._cycle(tokens[-1], start, size)
            emitted = emitted[: max_new_tokens - len(tokens)]
            for i, tok in enumerate(emitted):
                if tok in stops:
                    emitted = emitted[: i + 1]
                    break
            produced = len(emitted)
            tokens.extend(emitted)
            lengths.append(produced)
            _crop(self.target_cache, start + produced)
            if verified is not None:
                # The anchor and the accepted drafts are now context; the bonus is the next anchor.
                self.features = verified[:, :produced]
            start += produced
        t2 = _clock(self.device)
        return GenerationResult(tokens, lengths, prefill_s=t1 - t0, decode_s=t2 - t1)

    def _prefill(self, ids: torch.Tensor) -> int:
        n = ids.shape[1]
        out = self.target(
            ids,
            position_ids=torch.arange(n, device=self.device)[None],
            cache=self.target_cache,
            use_cache=True,
            output_hidden_states=self.layer_ids is not None,
            logits_to_keep=1,
        )
        if self.layer_ids is not None:
            self.features = _select_features(out.hidden_states, self.layer_ids)
        logits = out.logits[0, -1:]  # (1, vocab)
        return int(self._sample(logits)[0])  # host sync: the token decides what runs next

    def _cycle(self, anchor: int, start: int, size: int) -> tuple[list[int], torch.Tensor | None]:
        """One draft-and-verify step; returns the emitted tokens (accepted drafts + bonus) and
        the verified block's features (1, size, K * hidden), None at block size 1."""
        block = torch.full((1, size), anchor, dtype=torch.long, device=self.device)
        draft_probs = None
        if size > 1:
            draft_logits = self._draft(anchor, start, size)  # (size - 1, vocab), target device
            block[0, 1:], draft_probs = self._propose(draft_logits)
        out = self.target(
            block,
            position_ids=torch.arange(start, start + size, device=self.device)[None],
            cache=self.target_cache,
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
        return emitted, verified

    def _draft(self, anchor: int, start: int, size: int) -> torch.Tensor:
        """Draft logits for the size - 1 masked slots after `anchor` (one drafter pass)."""
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
        return logits.to(self.device)

    def _propose(self, draft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens (size - 1,) and, for T > 0, the distributions they were drawn from."""
        if self.temperature == 0:
            return draft_logits.argmax(-1), None
        probs = self._probs(draft_logits)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        """(rows, vocab) logits -> (rows,) tokens: argmax at T = 0, else a draw at T."""
        return self._propose(logits)[0]

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Sampling distribution at temperature T, in fp32."""
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def _accept_sampled(
        self, drafts: torch.Tensor, draft_probs: torch.Tensor | None, logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Speculative rejection sampling over the block (0-dim accepted count and token).

        Draft k was drawn from q_k (the drafter sees only masks, so q_k does not depend on the
        earlier drafts); p_k is the target's distribution given the drafts before it. Accepting
        with probability min(1, p_k(d) / q_k(d)) and, on the first rejection, drawing from
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


def _new_target_cache(target: nn.Module):
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    # Sliding-window layers must keep enough past to roll back the rejected part of a block.
    cache.activate_past_recording()
    return cache


def _crop(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a transformers cache."""
    cache.crop(-(cache.get_seq_length() - length))


def _clock(device: torch.device) -> float:
    from dflash_train.devices import synchronize

    synchronize(device)  # device work must be finished before it is timed
    return time.perf_counter()


# ============================================================================= metrics


@dataclass
class EvalReport:
    """Acceptance and speed of a drafter on a prompt set (see the module doc for definitions)."""

    num_prompts: int
    block_size: int
    max_new_tokens: int
    temperature: float
    tau: float
    """Mean acceptance length per response, averaged over responses (1 .. block_size)."""
    acceptance_histogram: dict[str, float]
    """Fraction of cycles by acceptance length, keys "1" .. str(block_size)."""
    acceptance_counts: dict[str, int]
    """Cycles by acceptance length, keys "1" .. str(block_size)."""
    per_position_acceptance: list[float]
    """Entry k-1: fraction of cycles whose draft at block offset k was accepted, k = 1 .. B-1."""
    num_cycles: int
    num_tokens: int
    """Tokens generated by the speculative loop over all prompts."""
    spec_tokens_per_s: float | None
    """Decode throughput of the speculative loop (None when no decode time was measured)."""
    plain_tokens_per_s: float | None
    """Decode throughput of plain target decoding on the same prompts (None without baseline)."""
    speedup: float | None
    """spec_tokens_per_s / plain_tokens_per_s."""
    greedy_match: float | None
    """T = 0 with a baseline: fraction of prompts whose speculative output equals plain greedy
    decoding token for token (1.0 unless numerics differ between batch shapes)."""
    responses: list[dict[str, Any]] = field(default_factory=list)
    """Per prompt: prompt_tokens, new_tokens, tau, acceptance_lengths."""
    settings: dict[str, Any] = field(default_factory=dict)
    """How the evaluation was run (paths, device, dtype, seed, ...), for the JSON file."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def _decode_tokens_per_s(results: Sequence[GenerationResult]) -> float | None:
    """As the reference client: mean over responses of decode seconds per output token, inverted."""
    tpot = [r.decode_s / len(r.tokens) for r in results if r.decode_s > 0]
    return len(tpot) / sum(tpot) if tpot else None


def evaluate(
    draft: DFlashDraftModel,
    target: nn.Module,
    head: FrozenHead,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 256,
    block_size: int | None = None,
    temperature: float = 0.0,
    stop_token_ids: Sequence[int] | None = None,
    seed: int = 0,
    baseline: bool = True,
    warmup: bool = True,
    progress: Any | None = None,
) -> EvalReport:
    """Run the speculative loop (and, with `baseline`, plain decoding) on every prompt.

    prompts: 1-D id tensors. block_size: defaults to the drafter's. seed: prompt i draws its
    randomness (T > 0) from a generator seeded with seed + i, for both loops. warmup: one short
    untimed run of each loop first (first-call costs would otherwise land in prompt 0's time).
    progress: an object with `update(n, **fields)` (e.g. `Progress`), or None.
    """
    from dflash_train.export import check_draft_fits_target

    if not prompts:
        raise ValueError("no prompts to evaluate")
    text_config = getattr(target.config, "get_text_config", lambda: target.config)()
    check_draft_fits_target(draft.config, text_config)  # before any decoding
    bs = block_size or draft.config.block_size
    device = next(target.parameters()).device
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=stop_token_ids)
    gen = lambda i: torch.Generator(device).manual_seed(seed + i)  # noqa: E731
    if warmup:
        short = dict(kw, max_new_tokens=min(max_new_tokens, 2 * bs))
        speculative_generate(
            draft, target, head, prompts[0], block_size=bs, generator=gen(0), **short
        )
        if baseline:
            plain_generate(target, prompts[0], generator=gen(0), **short)
    spec, plain = [], []
    for i, ids in enumerate(prompts):
        spec.append(
            speculative_generate(draft, target, head, ids, block_size=bs, generator=gen(i), **kw)
        )
        if baseline:
            plain.append(plain_generate(target, ids, generator=gen(i), **kw))
        if progress is not None:
            progress.update(1, tau=spec[-1].tau or 1.0)
    return _report(spec, plain, prompts, bs, max_new_tokens, temperature)


def _report(
    spec: list[GenerationResult],
    plain: list[GenerationResult],
    prompts: Sequence[torch.Tensor],
    block_size: int,
    max_new_tokens: int,
    temperature: float,
) -> EvalReport:
    tau, counts, rates = acceptance_summary([r.acceptance_lengths for r in spec], block_size)
    cycles = sum(counts.values())
    spec_tps = _decode_tokens_per_s(spec)
    plain_tps = _decode_tokens_per_s(plain) if plain else None
    match = None
    if plain and temperature == 0:
        match = sum(s.tokens == p.tokens for s, p in zip(spec, plain, strict=True)) / len(spec)
    return EvalReport(
        num_prompts=len(spec),
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        tau=tau,
        acceptance_histogram={b: (c / cycles if cycles else 0.0) for b, c in counts.items()},
        acceptance_counts=counts,
        per_position_acceptance=rates,
        num_cycles=cycles,
        num_tokens=sum(len(r.tokens) for r in spec),
        spec_tokens_per_s=spec_tps,
        plain_tokens_per_s=plain_tps,
        speedup=spec_tps / plain_tps if spec_tps and plain_tps else None,
        greedy_match=match,
        responses=[
            {
                "prompt_tokens": int(ids.numel()),
                "new_tokens": len(r.tokens),
                "tau": r.tau,
                "acceptance_lengths": r.acceptance_lengths,
            }
            for ids, r in zip(prompts, spec, strict=True)
        ],
    )


def quick_tau(
    draft: DFlashDraftModel,
    target: nn.Module,
    head: FrozenHead,
    prompt_ids: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 64,
    block_size: int | None = None,
) -> float:
    """Greedy tau on held-out prompts, for `eval/tau` during training (no timing, no baseline).

    `draft` may be a live training replica (the unwrapped module, on its own device with `head`
    there too): it runs under inference mode and its train/eval mode is restored, so its weights,
    gradients and optimizer state are untouched.
    """
    was_training = draft.training
    draft.eval()
    try:
        bs = block_size or draft.config.block_size
        lengths = [
            speculative_generate(
                draft, target, head, ids, max_new_tokens=max_new_tokens, block_size=bs
            ).acceptance_lengths
            for ids in prompt_ids
        ]
    finally:
        draft.train(was_training)
    return acceptance_summary(lengths, bs)[0]


# ============================================================================= inputs


def read_prompts(path: str | Path, limit: int | None = None) -> list[list[dict[str, str]]]:
    """Prompt conversations (up to and including the last user turn) from a JSON-lines file in
    the OpenAI / ShareGPT / {"prompt": ...} forms; at most `limit`."""
    from dflash_train.data.formats import parse_conversation, prompt_messages, read_jsonl

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"prompts file {p} does not exist")
    prompts = []
    for n, obj in read_jsonl(p):
        try:
            prompts.append(prompt_messages(parse_conversation(obj, require_assistant=False)))
        except ValueError as e:
            raise ValueError(f"{p}:{n}: {e}") from None
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"prompts file {p} holds no prompts")
    return prompts


def load_chat_tokenizer(target_dir: str | Path) -> Any:
    """The target's tokenizer; a clear error when it is missing or has no chat template."""
    from transformers import AutoTokenizer

    # transformers builds an empty tokenizer from config.json alone: look for real files first.
    if not any((Path(target_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"the target directory {target_dir} has no tokenizer ({' / '.join(TOKENIZER_FILES)}): "
            "prompts are tokenised with the target's tokenizer and chat template"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
    except Exception as e:  # transformers raises many kinds here; one message for the user
        raise ValueError(
            f"cannot load a tokenizer from the target directory {target_dir}: {e}"
        ) from e
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer in {target_dir} has no chat template: prompts are tokenised with the "
            "target's chat template (add_generation_prompt=True)"
        )
    return tokenizer


def encode_prompt(
    tokenizer: Any, messages: list[dict[str, str]], vocab_size: int, thinking: str | None = None
) -> torch.Tensor:
    """(n,) ids of `messages` through the chat template, ready for the assistant's answer."""
    kwargs = {} if thinking is None else {"enable_thinking": thinking == "on"}
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if ids.numel() and int(ids.max()) >= vocab_size:
        raise ValueError(
            f"the tokenizer produced id {int(ids.max())}, beyond the target's {vocab_size} "
            "embedding rows: tokenizer and target do not belong together"
        )
    return ids


def eos_token_ids(target: nn.Module, tokenizer: Any) -> list[int]:
    """End-of-turn ids: the target's generation config eos ids and the tokenizer's eos."""
    ids: set[int] = set()
    gen_cfg = getattr(target, "generation_config", None)
    for value in (getattr(gen_cfg, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return sorted(ids)


def head_of(target: nn.Module) -> FrozenHead:
    """The target's own embedding and LM head tensors (shared, not copied)."""
    out = target.get_output_embeddings()
    bias = getattr(out, "bias", None)
    return FrozenHead(target.get_input_embeddings().weight, out.weight, bias)


# ============================================================================= output


def format_report(report: EvalReport) -> str:
    """A readable table of the report for the terminal."""

    def row(label: str, value: float | None, fmt: str, unit: str = "") -> str:
        text = "n/a" if value is None else format(value, fmt) + unit
        return f"  {label:<30}{text:>12}"

    lines = [
        f"DFlash evaluation: {report.num_prompts} prompts, block size {report.block_size}, "
        f"T = {report.temperature:g}, up to {report.max_new_tokens} new tokens",
        row("tau (mean acceptance length)", report.tau, ".3f"),
        row("cycles", report.num_cycles, "d"),
        row("tokens generated", report.num_tokens, "d"),
        row("speculative decode", report.spec_tokens_per_s, ".1f", " tok/s"),
        row("plain target decode", report.plain_tokens_per_s, ".1f", " tok/s"),
        row("speedup", report.speedup, ".2f", "x"),
    ]
    if report.greedy_match is not None:
        lines.append(row("identical to greedy target", report.greedy_match, ".0%"))
    lines.append(f"  {'acceptance length':<20}{'cycles':>10}{'share':>12}")
    for b, share in report.acceptance_histogram.items():
        bar = "#" * round(share * 30)
        count = report.acceptance_counts[b]
        lines.append(f"  {b:>17}   {count:>10}{share:>12.1%}  {bar}".rstrip())
    lines.append(f"  {'draft offset k':<20}{'accepted':>22}")
    for k, rate in enumerate(report.per_position_acceptance, 1):
        lines.append(f"  {k:>14}      {rate:>22.1%}")
    return "\n".join(lines)


# ============================================================================= CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-train eval`."""
    parser.add_argument(
        "--draft",
        required=True,
        help="exported drafter directory, training checkpoint, or run directory",
    )
    parser.add_argument(
        "--target", required=True, help="target model directory (with tokenizer and chat template)"
    )
    parser.add_argument(
        "--prompts",
        required=True,
        help="JSON lines: OpenAI / ShareGPT conversations (last user turn is the prompt) or "
        '{"prompt": "..."} rows',
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="new tokens per response (default: %(default)s)",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 = greedy (default); > 0 samples, verified by speculative rejection sampling",
    )
    parser.add_argument(
        "--block-size", type=int, default=None, help="tokens per block (default: the drafter's)"
    )
    parser.add_argument("--limit", type=int, default=None, help="evaluate the first N prompts")
    parser.add_argument("--json", default=None, help="also write the report to this JSON file")
    parser.add_argument(
        "--device", default="cpu", help="device for target and drafter (default: cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16",
    )
    parser.add_argument(
        "--thinking",
        choices=("on", "off"),
        default=None,
        help="pass enable_thinking to the chat template (default: the template's own default)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sampling (T > 0) (default: 0)"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip plain target decoding (no speedup figure, half the time)",
    )


def main(args: argparse.Namespace) -> int:
    """Validate everything cheap first, then load the target and decode."""
    from dflash_train.devices import parse_devices, resolve_dtype
    from dflash_train.export import check_draft_fits_target, load_draft
    from dflash_train.model.target import load_causal_lm, load_target_config
    from dflash_train.progress import Progress

    _check_cli_numbers(args)
    device = parse_devices(args.device, "--device")[0]
    dtype = resolve_dtype(args.dtype, device)
    messages = read_prompts(args.prompts, args.limit)
    target_config = load_target_config(args.target)
    tokenizer = load_chat_tokenizer(args.target)
    draft = load_draft(args.draft, device, dtype)
    check_draft_fits_target(draft.config, target_config)
    block_size = args.block_size or draft.config.block_size
    if block_size > draft.config.block_size:
        warnings.warn(
            f"block size {block_size} exceeds the {draft.config.block_size} the drafter was "
            "trained for: offsets beyond it are untrained",
            stacklevel=1,
        )
    thinking = _thinking_setting(tokenizer, args.thinking)
    prompts = [encode_prompt(tokenizer, m, target_config.vocab_size, thinking) for m in messages]
    target = load_causal_lm(args.target, device, dtype)
    with Progress(len(prompts), "eval", unit="prompt") as progress:
        report = evaluate(
            draft,
            target,
            head_of(target),
            prompts,
            max_new_tokens=args.max_new_tokens,
            block_size=block_size,
            temperature=args.temperature,
            stop_token_ids=eos_token_ids(target, tokenizer),
            seed=args.seed,
            baseline=not args.no_baseline,
            progress=progress,
        )
    report.settings = {
        "draft": str(args.draft),
        "target": str(args.target),
        "prompts": str(args.prompts),
        "limit": args.limit,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "thinking": thinking,
        "seed": args.seed,
        "baseline": not args.no_baseline,
    }
    print(format_report(report))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"report written to {out}", file=sys.stderr)
    return 0


def _check_cli_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(f"--block-size must be >= 1, got {args.block_size}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")


def _thinking_setting(tokenizer: Any, thinking: str | None) -> str | None:
    """The --thinking value to pass on, or None (with a warning) if the template ignores it."""
    if thinking is not None and "enable_thinking" not in str(tokenizer.chat_template):
        warnings.warn(
            f"--thinking {thinking} has no effect: the chat template has no enable_thinking",
            stacklevel=1,
        )
        return None
    return thinking
