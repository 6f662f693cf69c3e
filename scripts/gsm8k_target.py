"""A tiny Qwen3 target trained on GSM8K, for measurements on real text (never needed to run).

    python scripts/gsm8k_target.py --gsm8k ../shared/data/gsm8k --out gsm [--steps 3000] \
        [--heldout 32]

Writes OUT/train.jsonl (the train split as chat rows), OUT/heldout.jsonl (the first --heldout
test questions), OUT/tokenizer (a byte-level BPE with the chat template) and OUT/target (the
demo's target shape trained on the train split, reused when already there with the same
settings), and prints one JSON line of the target's figures.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_train.data.chat import ChatFormat, tokenizer_digest
from dflash_train.data.synthetic import corpus_texts, write_jsonl
from dflash_train.data.tokenizer import build_chat_tokenizer
from dflash_train.demo_target import TargetSpec, build_target, fingerprint


def chat_rows(path: Path, limit: int | None = None) -> list[dict]:
    rows = []
    for line in path.open(encoding="utf-8"):
        r = json.loads(line)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": r["question"]},
                    {"role": "assistant", "content": r["answer"]},
                ]
            }
        )
    return rows[:limit] if limit else rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gsm8k", required=True, help="directory with train.jsonl, test.jsonl")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--heldout", type=int, default=32, help="test questions to evaluate on")
    args = parser.parse_args()
    torch.set_num_threads(2)
    src, out = Path(args.gsm8k), Path(args.out)
    train = chat_rows(src / "train.jsonl")
    write_jsonl(train, out / "train.jsonl")
    write_jsonl(chat_rows(src / "test.jsonl", args.heldout), out / "heldout.jsonl")
    tokenizer = build_chat_tokenizer(corpus_texts(train), out / "tokenizer", vocab_size=1024)
    fmt = ChatFormat(tokenizer)

    def encode(rows):
        return fmt.encode_rendered([fmt.render(r["messages"]) for r in rows])

    spec = TargetSpec(steps=args.steps)
    t0 = time.time()
    res = build_target(
        encode(train),
        encode(chat_rows(src / "test.jsonl", 200)),
        tokenizer,
        out / "target",
        spec,
        fingerprint(spec, "gsm8k", tokenizer_digest(fmt)),
    )
    figures = {"train_s": res.train_s, "final_loss": res.final_loss}
    figures.update(heldout_token_accuracy=res.token_accuracy, params=res.num_params)
    print(json.dumps({**figures, "wall_s": time.time() - t0}))


if __name__ == "__main__":
    main()
