"""Tau of an exported drafter (DFlash 1 or 2) as the reference client measures it.

    python scripts/reference_tau.py --draft EXPORT --target TARGET --prompts heldout.jsonl \
        [--max-new-tokens 256] [--limit N] [--json OUT]

The package's `dflash_train.compare.reference` (which `dflash-train compare --eval reference`
runs); prints one JSON line: tau (mean over prompts of each prompt's mean acceptance length) and
the cycle count.
"""

from dflash_train.compare.reference import main

if __name__ == "__main__":
    raise SystemExit(main())
