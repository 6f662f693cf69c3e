"""Tau of an exported drafter (DFlash 1 or 2) as the reference client measures it.

    python -m dflash_train.compare.reference --draft EXPORT --target TARGET \
        --prompts FILE.jsonl [--max-new-tokens 256] [--limit N] [--json OUT]

Prompts are encoded as `dflash-train eval` encodes them (the chat mode the drafter was trained
in, the same stop tokens); decoding, drafting and acceptance are PyPI `dflash`'s
`dflash_generate` (T = 0) with its `DFlashDraftModel` or `DFlash2DraftModel`, in fp32 on CPU.
Prints one JSON line (tau: the mean over prompts of each prompt's mean acceptance length, and
the cycle count); `--json` writes the per-prompt figures in `eval --json`'s shape
(`tau`, `num_prompts`, `num_cycles`, `responses[i].tau`), which `dflash-train compare --eval
reference` reads. Needs `pip install --no-deps dflash==0.1.0`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

REFERENCE_PACKAGE = "dflash"
INSTALL_HINT = "pip install --no-deps dflash==0.1.0"


def require_reference_client() -> None:
    """Refuse, in one line, when the reference client is not installed."""
    if importlib.util.find_spec(REFERENCE_PACKAGE) is None:
        raise ValueError(f"the reference client is not installed: {INSTALL_HINT}")


def reference_tau(
    draft_dir: str | Path,
    target_dir: str | Path,
    prompts_file: str | Path,
    max_new_tokens: int = 256,
    limit: int | None = None,
) -> dict[str, Any]:
    """Greedy speculative decoding of every prompt by the reference client; tau and the
    per-prompt acceptance lengths."""
    import torch

    from dflash_train.data.dataset import thinking_flag
    from dflash_train.data.prompts import encode_prompts, eos_token_ids, read_prompts
    from dflash_train.data.tokenizer import load_chat_tokenizer
    from dflash_train.model.target import load_causal_lm

    require_reference_client()
    import dflash

    config = json.loads((Path(draft_dir) / "config.json").read_text())
    cls = dflash.DFlashDraftModel
    if "DFlash2DraftModel" in config.get("architectures", []):
        cls = dflash.DFlash2DraftModel
    draft = cls.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    target = load_causal_lm(target_dir, torch.device("cpu"), torch.float32)
    tokenizer = load_chat_tokenizer(target_dir)
    thinking = (config.get("dflash_train") or {}).get("chat_thinking")
    prompts = encode_prompts(
        tokenizer,
        read_prompts(prompts_file, limit),
        target.config.vocab_size,
        enable_thinking=thinking_flag(thinking if thinking in ("on", "off") else None),
    )
    dflash.model._cuda_time = time.perf_counter  # its stats path times with CUDA events
    stops = eos_token_ids(target, tokenizer)
    responses = []
    with torch.no_grad():
        for ids in prompts:
            out = dflash.model.dflash_generate(
                draft, target, ids[None], max_new_tokens, stops, temperature=0.0, return_stats=True
            )
            lengths = [int(n) for n in out.acceptance_lengths]
            tau = sum(lengths) / len(lengths) if lengths else None  # None: no verify round
            responses.append({"tau": tau, "acceptance_lengths": lengths})
    taus = [r["tau"] for r in responses if r["tau"] is not None]
    return {
        "client": f"{REFERENCE_PACKAGE} {getattr(dflash, '__version__', '?')}",
        "tau": sum(taus) / len(taus) if taus else None,
        "num_prompts": len(responses),
        "num_cycles": sum(len(r["acceptance_lengths"]) for r in responses),
        "max_new_tokens": max_new_tokens,
        "responses": responses,
    }


def main(argv: list[str] | None = None) -> int:
    """The command line above; user errors are one line and exit 2."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="an exported drafter directory")
    parser.add_argument("--target", required=True, help="the target model directory")
    parser.add_argument("--prompts", required=True, help="JSON lines, as `eval --prompts`")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts")
    parser.add_argument("--json", default=None, help="also write the per-prompt figures here")
    args = parser.parse_args(argv)
    try:
        report = reference_tau(
            args.draft, args.target, args.prompts, args.max_new_tokens, args.limit
        )
    except ValueError as e:
        print(f"reference client: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    line = {"draft": args.draft, "tau": report["tau"], "cycles": report["num_cycles"]}
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
