"""How much of the target's next-token distribution its top-k logits carry, on a prepared set.

    python scripts/teacher_topk.py --target TARGET --data PREPARED [--rows 64] [--k 1 8 32 128]

The teacher of the losses on the target's distribution can travel as the target's last hidden
state (exact: the drafter's loss applies the LM head to it) or as its top-k logits (smaller,
what some trainers store). Renormalised top-k probabilities p_k differ from p by exactly the
mass they drop, TV(p, p_k) = 1 - sum of the top k, which bounds the error of every acceptance
rate sum_v min(p, q) computed from them, whatever the drafter q. Per k this prints that
missing mass over the supervised positions of the first --rows rows (mean, median, p90, p99,
max) and the bytes per token of each form (top-k: an fp16 logit and an int32 id per entry;
hidden: bf16), for this target and for Qwen3-8B's shape (hidden 4096, K = 5 features).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from dflash_train.data.dataset import PreparedDataset
from dflash_train.model.target import load_causal_lm

QWEN3_8B_HIDDEN, FEATURES = 4096, 5


def missing_mass(logits: torch.Tensor, ks: list[int]) -> dict[int, torch.Tensor]:
    """Per position (rows of `logits`), 1 - the probability mass of its top k, for each k."""
    probs = logits.float().softmax(-1).sort(-1, descending=True).values.cumsum(-1)
    return {k: (1.0 - probs[:, min(k, probs.shape[1]) - 1]).clamp(min=0.0) for k in ks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_causal_lm(args.target, torch.device("cpu"), torch.float32)
    ds = PreparedDataset(args.data)
    gaps: dict[int, list[torch.Tensor]] = {k: [] for k in args.k}
    entropy = []
    for i in range(min(args.rows, len(ds))):
        ids, mask = ds.row(i)
        # The teacher's positions: p + k - 1 for every supervised label x[p + k].
        keep = torch.from_numpy(np.flatnonzero(np.asarray(mask[1:], dtype=bool)))
        with torch.no_grad():
            logits = target(torch.tensor(np.asarray(ids))[None]).logits[0, keep]
        for k, gap in missing_mass(logits, args.k).items():
            gaps[k].append(gap)
        p = logits.softmax(-1)
        entropy.append(-(p * p.clamp(min=1e-30).log()).sum(-1))
    hidden = target.config.hidden_size
    out = {"positions": int(sum(len(g) for g in gaps[args.k[0]])), "hidden": hidden}
    out["entropy_nats_mean"] = float(torch.cat(entropy).mean())
    for k, parts in gaps.items():
        g = torch.cat(parts).numpy()
        out[f"top{k}"] = {
            "missing_mass_mean": float(g.mean()),
            "p50": float(np.quantile(g, 0.5)),
            "p90": float(np.quantile(g, 0.9)),
            "p99": float(np.quantile(g, 0.99)),
            "max": float(g.max()),
            "bytes_per_token": 6 * k,
        }
    out["hidden_bytes_per_token"] = 2 * hidden
    out["qwen3_8b"] = {
        "hidden_bytes_per_token": 2 * QWEN3_8B_HIDDEN,
        "features_bytes_per_token": 2 * QWEN3_8B_HIDDEN * FEATURES,
        "topk_bytes_per_token": {k: 6 * k for k in args.k},
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
