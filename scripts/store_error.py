"""How far a 16- or 8-bit feature store is from an fp32 store of the same features.

    python scripts/store_error.py --reference FP32_STORE --store FP8_STORE [--limit ROWS]

Over every stored (token, layer) vector: the relative error ||x_hat - x|| / ||x|| (mean, p99,
max), the largest element-wise error relative to the vector's absolute maximum, and the mean
cosine similarity. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from dflash_train.store.codec import decode_row
from dflash_train.store.store import FeatureStore


def decoded(store: FeatureStore, row: int) -> torch.Tensor:
    b = store.binding
    raw = torch.from_numpy(np.array(store.row_bytes(row)))
    n = int(store.tokens_of[row])
    x = decode_row(raw, n, len(b.layer_ids), b.hidden_size, b.dtype, torch.float32)
    return x.view(n, len(b.layer_ids), b.hidden_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--limit", type=int, default=None)
    args = parser.parse_args()
    ref, other = FeatureStore.open(args.reference), FeatureStore.open(args.store)
    assert ref.binding.layer_ids == other.binding.layer_ids, "stores of other layers"
    rows = np.flatnonzero(ref.present() & other.present())[: args.limit]
    rel, peak, cos = [], [], []
    for r in rows:
        x, y = decoded(ref, int(r)), decoded(other, int(r))
        norm = x.norm(dim=-1).clamp_min(1e-30)
        rel.append(((y - x).norm(dim=-1) / norm).flatten())
        peak.append(((y - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)).flatten())
        cos.append(torch.nn.functional.cosine_similarity(x, y, dim=-1).flatten())
    rel_t, peak_t, cos_t = torch.cat(rel), torch.cat(peak), torch.cat(cos)
    print(
        json.dumps(
            {
                "dtype": other.binding.dtype,
                "rows": len(rows),
                "vectors": rel_t.numel(),
                "relative_error_mean": float(rel_t.mean()),
                "relative_error_p99": float(rel_t.quantile(0.99)),
                "relative_error_max": float(rel_t.max()),
                "max_error_over_vector_amax": float(peak_t.max()),
                "cosine_mean": float(cos_t.mean()),
            }
        )
    )


if __name__ == "__main__":
    main()
