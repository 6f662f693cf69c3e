"""`dflash-train bench loss`: peak memory of the LM-head loss as the number of anchors grows.

The loss of one step covers anchors x (block_size - 1) supervised positions against the whole
vocabulary. Unchunked, its logits (and their softmax) are rows x vocab floats and grow with the
anchors; the fused chunked loss holds one chunk of logits at a time plus d loss / d hidden
(rows x hidden), so its peak beyond the hidden states stays flat. Each measurement runs forward
+ backward in a fresh process and reports the growth of its peak RSS over the inputs alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Any

from dflash_train.bench.common import add_json_argument, format_table, write_json
from dflash_train.objective import fused_linear_cross_entropy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--anchors",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help="anchors per step (rows = anchors x (block_size - 1))",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--chunk", type=int, default=1024, help="rows per loss chunk")
    add_json_argument(parser)
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "ANCHORS"), help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.worker:
        mode, anchors = args.worker
        print(json.dumps(_measure(mode, int(anchors), args)))
        return 0
    rows = []
    for anchors in args.anchors:
        row: dict[str, Any] = {"anchors": anchors, "rows": anchors * (args.block_size - 1)}
        for mode in ("chunked", "unchunked"):
            row[f"{mode}_mb"] = _child(mode, anchors, args)
        rows.append(row)
    print(format_table(["anchors", "rows", "chunked_mb", "unchunked_mb"], rows))
    first, last = rows[0], rows[-1]
    result = {
        "rows": rows,
        "chunk": args.chunk,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunked_growth_mb": last["chunked_mb"] - first["chunked_mb"],
        "unchunked_growth_mb": last["unchunked_mb"] - first["unchunked_mb"],
        "note": "MB = peak RSS growth of forward + backward over the inputs (hidden states, "
        "head, labels); chunked growth beyond d loss / d hidden stays flat",
    }
    print(
        f"chunked growth {result['chunked_growth_mb']:.0f} MB vs unchunked "
        f"{result['unchunked_growth_mb']:.0f} MB from {first['anchors']} to "
        f"{last['anchors']} anchors"
    )
    if args.json:
        write_json(args.json, result)
    return 0


def _child(mode: str, anchors: int, args: argparse.Namespace) -> float:
    cmd = [
        sys.executable,
        "-m",
        "dflash_train",
        "bench",
        "loss",
        "--worker",
        mode,
        str(anchors),
        "--block-size",
        str(args.block_size),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--chunk",
        str(args.chunk),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_growth_mb"]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _measure(mode: str, anchors: int, args: argparse.Namespace) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rows = anchors * (args.block_size - 1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, args.hidden, generator=gen, requires_grad=True)
    head = torch.randn(args.vocab, args.hidden, generator=gen) * 0.05
    labels = torch.randint(0, args.vocab, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen)
    base = _peak_mb()
    if mode == "chunked":
        loss, _ = fused_linear_cross_entropy(hidden, head, labels, weights, args.chunk)
    else:
        logits = hidden @ head.T
        loss = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    loss.backward()
    return {"peak_growth_mb": _peak_mb() - base, "loss": float(loss)}
