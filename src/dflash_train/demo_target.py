"""The demo's tiny target: a Qwen3-architecture causal LM trained from scratch on the synthetic
corpus in a few minutes of CPU time, then saved as an ordinary Hugging Face model directory
(config.json, model.safetensors, tokenizer files with the chat template), i.e. exactly what a
user points `dflash-train` at for a real model.

Training is plain next-token prediction on the rendered conversations, with the loss on the
assistant tokens only (the prompts are random draws: learning them costs steps and buys nothing
the drafter needs). Sequences are batched with others of similar length under a token budget, so
little compute goes to padding. fp32 (bf16 is several times slower on CPUs without native bf16).

`build_target` caches: the output directory holds a fingerprint of everything that decides the
weights (corpus, tokenizer, model shape, schedule, seed); a second call with the same settings
reuses the directory and trains nothing.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dflash_train.progress import Progress

# Bump when the way the target is trained changes, so that old caches are not reused.
TARGET_RECIPE_VERSION = 1
FINGERPRINT_FILE = "demo_fingerprint.json"
# Embedding rows: the tokenizer's size rounded up to a multiple of 64, as real targets do (Qwen3:
# 151669 tokens, 151936 rows); the rows beyond the tokenizer, if any, are never used.
ROW_MULTIPLE = 64
LOG_EVERY = 50  # training steps between loss read-backs (host syncs)


@dataclass(frozen=True)
class TargetSpec:
    """Shape and training schedule of the demo target (all of it enters the cache fingerprint).

    The defaults are the default demo's, chosen by measurement on 2 CPU cores with one thread:
    2 layers of width 128 train at ~20 steps/s of 1024 tokens; after 4000 steps (~200 s) the
    target predicts ~96% of held-out answer tokens. Wider (192) or deeper (3 layers) targets
    were no better for the same seconds, and lr 1e-2 or 5e-3 did slightly worse than 3e-3.
    """

    hidden_size: int = 128
    """Model width."""
    intermediate_size: int = 384
    """SwiGLU MLP width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention, as Qwen3)."""
    head_dim: int = 32
    """Per-head width."""
    steps: int = 4000
    """Optimizer steps."""
    batch_tokens: int = 1024
    """Token budget of one batch (padded length x sequences)."""
    lr: float = 3e-3
    """Peak learning rate (AdamW; linear warm-up, cosine decay to 10%)."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    seed: int = 0
    """Initialisation and batch-order seed."""


@dataclass
class TargetResult:
    """What `build_target` produced (or found in its cache)."""

    path: Path
    cached: bool
    """True when the directory was reused (nothing trained this time)."""
    train_s: float
    """Seconds spent training (in the run that trained it)."""
    final_loss: float
    """Mean assistant-token loss (nats) over the last training steps."""
    token_accuracy: float
    """Held-out assistant tokens whose greedy prediction is the corpus token (teacher forcing)."""
    num_params: int


def fingerprint(spec: TargetSpec, corpus_digest: str, tokenizer_digest: str) -> str:
    """SHA-256 of everything that decides the target's weights."""
    key = {
        "version": TARGET_RECIPE_VERSION,
        "spec": asdict(spec),
        "corpus": corpus_digest,
        "tokenizer": tokenizer_digest,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()


def cached_target(out_dir: Path, key: str) -> TargetResult | None:
    """The cached target in `out_dir` when its fingerprint is `key`, else None."""
    marker = out_dir / FINGERPRINT_FILE
    if not marker.is_file() or not (out_dir / "model.safetensors").is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return None
    if info.get("fingerprint") != key:
        return None
    return TargetResult(
        path=out_dir,
        cached=True,
        train_s=float(info["train_s"]),
        final_loss=float(info["final_loss"]),
        token_accuracy=float(info["token_accuracy"]),
        num_params=int(info["num_params"]),
    )


# ============================================================================ model


def new_target(spec: TargetSpec, tokenizer: Any) -> torch.nn.Module:
    """A freshly initialised Qwen3ForCausalLM sized by `spec`, for `tokenizer`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    rows = math.ceil(len(tokenizer) / ROW_MULTIPLE) * ROW_MULTIPLE
    config = Qwen3Config(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=rows,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


# ============================================================================ batches

Row = tuple[np.ndarray, np.ndarray]  # (input_ids int32, loss_mask uint8)


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Row indices grouped with rows of similar length: sorted by length, cut so that a
    batch's padded size (longest x count) stays within `batch_tokens` (at least one row)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # Ascending order: row i is the longest of the batch it joins.
        if current and lengths[i] * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collate(rows: Sequence[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (batch, L) ids and the (batch, L - 1) next-token targets, -100 where no
    loss applies (prompt tokens, padding). Right padding needs no attention mask: under the
    causal mask real tokens never see the padding after them."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for r, (row_ids, mask) in enumerate(rows):
        n = len(row_ids)
        ids[r, :n] = torch.from_numpy(row_ids.astype(np.int64))
        keep = torch.from_numpy(mask.astype(bool))
        labels[r, :n] = torch.where(keep, ids[r, :n], -100)
    return ids, labels[:, 1:]


# ============================================================================ training


def lr_at(step: int, spec: TargetSpec) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    t = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_lm(
    model: torch.nn.Module,
    rows: Sequence[Row],
    spec: TargetSpec,
    pad_id: int,
    on_step: Callable[[int, torch.Tensor], None] | None = None,
) -> float:
    """Train `model` for `spec.steps` steps on `rows`; returns the mean loss of the last 10%."""
    batches = length_batches([len(ids) for ids, _ in rows], spec.batch_tokens)
    rng = random.Random(spec.seed)
    optim = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay
    )
    model.train()
    order: list[int] = []
    tail: list[torch.Tensor] = []
    for step in range(spec.steps):
        if not order:  # a new pass: every batch once, in a fresh random order
            order = list(range(len(batches)))
            rng.shuffle(order)
        ids, labels = collate([rows[i] for i in batches[order.pop()]], pad_id)
        logits = model(input_ids=ids).logits[:, :-1]  # (batch, L - 1, vocab)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        for group in optim.param_groups:
            group["lr"] = lr_at(step, spec)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        if step >= spec.steps * 0.9:
            tail.append(loss.detach())
        if on_step is not None:
            on_step(step + 1, loss)
    model.eval()
    return float(torch.stack(tail).mean()) if tail else float("nan")


@torch.no_grad()
def token_accuracy(model: torch.nn.Module, rows: Sequence[Row], pad_id: int) -> float:
    """Fraction of supervised tokens of `rows` that the model's argmax predicts (teacher
    forcing): how often greedy decoding stays on the corpus answer, token by token."""
    model.eval()
    right = total = 0
    for batch in length_batches([len(ids) for ids, _ in rows], 8192):
        ids, labels = collate([rows[i] for i in batch], pad_id)
        pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
        seen = labels != -100
        right += int((pred[seen] == labels[seen]).sum())
        total += int(seen.sum())
    return right / max(1, total)


def save_target(
    model: torch.nn.Module,
    tokenizer: Any,
    out_dir: Path,
    key: str,
    result: TargetResult,
) -> None:
    """Write the HF model directory (weights, config, tokenizer) and, last, the cache marker,
    so that an interrupted save is never mistaken for a finished one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / FINGERPRINT_FILE).unlink(missing_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    info = {
        "fingerprint": key,
        "train_s": result.train_s,
        "final_loss": result.final_loss,
        "token_accuracy": result.token_accuracy,
        "num_params": result.num_params,
    }
    (out_dir / FINGERPRINT_FILE).write_text(json.dumps(info, indent=2) + "\n")


def build_target(
    train_rows: Sequence[Row],
    heldout_rows: Sequence[Row],
    tokenizer: Any,
    out_dir: Path,
    spec: TargetSpec,
    key: str,
    *,
    on_start: Callable[[], None] | None = None,
    progress_desc: str | None = None,
) -> TargetResult:
    """Train the target on `train_rows` and save it to `out_dir`, unless the cache there
    already holds a target with fingerprint `key`. `on_start` is called when training starts;
    `progress_desc` names a progress display (None: silent)."""
    cached = cached_target(out_dir, key)
    if cached is not None:
        return cached
    if on_start is not None:
        on_start()
    model = new_target(spec, tokenizer)
    progress = Progress(spec.steps, progress_desc or "", unit="step", enabled=bool(progress_desc))

    def on_step(step: int, loss: torch.Tensor) -> None:
        if step % LOG_EVERY == 0 or step == spec.steps:
            progress.update(1, loss=float(loss.detach()))  # host sync only at logging steps
        else:
            progress.update(1)

    t0 = time.monotonic()
    with progress:
        loss = train_lm(model, train_rows, spec, tokenizer.pad_token_id, on_step)
    train_s = time.monotonic() - t0
    acc = token_accuracy(model, heldout_rows, tokenizer.pad_token_id)
    result = TargetResult(
        path=out_dir,
        cached=False,
        train_s=train_s,
        final_loss=loss,
        token_accuracy=acc,
        num_params=sum(p.numel() for p in model.parameters()),
    )
    save_target(model, tokenizer, out_dir, key, result)
    return result


@torch.no_grad()
def greedy_answers(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int = 32,
) -> list[str]:
    """Greedy answers to rendered prompts (text ending in the generation prompt), batched with
    left padding."""
    model.eval()
    answers: list[str] = []
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for lo in range(0, len(prompts), batch_size):
            enc = tokenizer(
                list(prompts[lo : lo + batch_size]),
                add_special_tokens=False,
                padding=True,
                return_tensors="pt",
            )
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            new = out[:, enc["input_ids"].shape[1] :]
            answers += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
    return answers
