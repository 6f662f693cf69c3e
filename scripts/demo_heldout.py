"""More held-out prompts for the demo target than the 32 `dflash-train demo` writes.

    python scripts/demo_heldout.py --demo dflash-demo --num 256

Writes DEMO/data/heldout-NUM.jsonl: conversations from the demo's held-out generator (the
same seed, so its first rows are the demo's own held-out file's), without any whose prompt (the
conversation before the last answer) is also a training prompt or an earlier held-out one:
the synthetic world is small, and about one in seven rows repeats a training prompt exactly.
Enough prompts that the evaluation's own noise is small next to the seeds' spread
(`dflash-train compare` reports both).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dflash_train.data.synthetic import synthetic_conversations, write_jsonl
from dflash_train.demo import HELDOUT_SEED


def prompt_key(row: dict) -> str:
    return json.dumps(row["messages"][:-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", required=True, help="the directory `dflash-train demo` wrote")
    parser.add_argument("--num", type=int, default=256)
    args = parser.parse_args()
    data = Path(args.demo) / "data"
    lines = (data / "train.jsonl").read_text(encoding="utf-8").splitlines()
    seen = {prompt_key(json.loads(line)) for line in lines}
    rows: list[dict] = []
    for row in synthetic_conversations(4 * args.num, seed=HELDOUT_SEED):
        if (key := prompt_key(row)) not in seen:
            seen.add(key)
            rows.append(row)
    if len(rows) < args.num:
        raise SystemExit(f"only {len(rows)} distinct held-out prompts; ask for fewer")
    out = write_jsonl(rows[: args.num], data / f"heldout-{args.num}.jsonl")
    print(f"{out}: {args.num} held-out conversations")


if __name__ == "__main__":
    main()
