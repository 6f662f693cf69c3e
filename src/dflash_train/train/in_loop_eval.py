"""A short speculative-decoding evaluation during training, logged as `eval/tau`.

Runs on rank 0's drafter thread right after an optimizer step (the other replicas wait at the
next rendezvous, so the weights cannot change under it). It needs the FULL target (LM head and KV
cache) on rank 0's device, loaded once at start-up; the pipeline's feature extractors are cut
after their last needed layer and cannot verify blocks.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dflash_train import faults
from dflash_train.config import RunOptions
from dflash_train.data.dataset import thinking_flag
from dflash_train.data.prompts import encode_prompts, eos_token_ids, read_prompts
from dflash_train.data.tokenizer import load_chat_tokenizer
from dflash_train.model.target import load_causal_lm, load_target_config
from dflash_train.speculative import quick_tau
from dflash_train.train.replica import DraftReplica


class InLoopEval:
    """Greedy tau on a few held-out prompts every `eval_every` steps."""

    def __init__(
        self,
        run: RunOptions,
        target_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype,
        trust_remote_code: bool = False,
        chat_thinking: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """`chat_thinking`: the training data's chat mode (`PreparedDataset.chat_thinking`);
        `chat_template`: the text of the template `prepare --chat-template` used (None: the
        tokenizer's own). Prompts are encoded in them, so eval/tau measures what the drafter
        learns."""
        if not run.eval_prompts:
            raise ValueError("--eval-every needs --eval-prompts (a JSON-lines prompt file)")
        self.every, self.max_new_tokens = run.eval_every, run.eval_max_new_tokens
        vocab = load_target_config(target_dir, trust_remote_code).vocab_size
        tokenizer = load_chat_tokenizer(target_dir, chat_template)
        messages = read_prompts(run.eval_prompts, run.eval_num_prompts)
        self.chat_thinking = chat_thinking
        encoded = encode_prompts(
            tokenizer, messages, vocab, enable_thinking=thinking_flag(chat_thinking)
        )
        self.prompts = [ids.to(device) for ids in encoded]
        self.target = load_causal_lm(target_dir, device, dtype, trust_remote_code)
        # Answers end where `eval` and serving engines stop them: rounds after the end of turn
        # (the target going on past it) are no part of the tau a drafter is served with.
        self.stop_token_ids = eos_token_ids(self.target, tokenizer)

    def due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def __call__(self, replica: DraftReplica) -> tuple[float, float]:
        """(tau, seconds) of the replica's current weights."""
        faults.point("eval")
        t0 = time.perf_counter()
        tau = quick_tau(
            replica.model,
            self.target,
            replica.head,
            self.prompts,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=self.stop_token_ids,
        )
        return tau, time.perf_counter() - t0
