"""Tau of an exported drafter (DFlash 1 or 2) as the reference client measures it.

    python scripts/reference_tau.py --draft EXPORT --target TARGET --prompts heldout.jsonl \
        [--max-new-tokens 256] [--limit N]

Prompts are encoded exactly as `dflash-train eval` encodes them (same chat mode, same stop
tokens); decoding, drafting and acceptance are PyPI `dflash`'s `dflash_generate` (T = 0) with
its `DFlashDraftModel` or `DFlash2DraftModel`, in fp32 on CPU. Prints one JSON line: tau (mean
over prompts of each prompt's mean acceptance length) and the cycle count.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dflash
import torch

from dflash_train.data.dataset import thinking_flag
from dflash_train.data.prompts import encode_prompts, read_prompts
from dflash_train.data.tokenizer import load_chat_tokenizer
from dflash_train.evaluate import eos_token_ids
from dflash_train.model.target import load_causal_lm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    config = json.loads((Path(args.draft) / "config.json").read_text())
    cls = dflash.DFlash2DraftModel
    if "DFlash2DraftModel" not in config["architectures"]:
        cls = dflash.DFlashDraftModel
    draft = cls.from_pretrained(args.draft, dtype=torch.float32).eval()
    target = load_causal_lm(args.target, torch.device("cpu"), torch.float32)
    tokenizer = load_chat_tokenizer(args.target)
    thinking = (config.get("dflash_train") or {}).get("chat_thinking")
    thinking = thinking if thinking in ("on", "off") else None
    prompts = encode_prompts(
        tokenizer,
        read_prompts(args.prompts, args.limit),
        target.config.vocab_size,
        enable_thinking=thinking_flag(thinking),
    )
    dflash.model._cuda_time = time.perf_counter  # its stats path times with CUDA events
    stops = eos_token_ids(target, tokenizer)
    means, cycles = [], 0
    with torch.no_grad():
        for ids in prompts:
            out = dflash.model.dflash_generate(
                draft,
                target,
                ids[None],
                args.max_new_tokens,
                stops,
                temperature=0.0,
                return_stats=True,
            )
            lengths = out.acceptance_lengths
            means.append(sum(lengths) / len(lengths))
            cycles += len(lengths)
    print(json.dumps({"draft": args.draft, "tau": sum(means) / len(means), "cycles": cycles}))


if __name__ == "__main__":
    main()
