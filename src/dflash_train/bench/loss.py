"""`dflash-train bench loss`: peak memory of the LM-head losses as the number of anchors grows.

The loss of one step covers anchors x (block_size - 1) supervised positions against the whole
vocabulary. Computed directly, its logits (and their softmax, and for the losses on the
target's distribution the teacher's logits and theirs) are rows x vocab floats each and grow
with the anchors; the fused chunked loss (`head_loss`) holds one chunk of draft logits, one of
teacher logits and one work buffer at a time, plus d loss / d hidden (rows x hidden), so its
peak beyond the inputs stays flat. Each measurement runs forward + backward of one loss in a
fresh process and reports the growth of its peak RSS over the inputs alone, and its seconds.
A direct measurement whose one (rows x vocab) fp32 tensor would pass --direct-max-gb is
skipped (None): several of them would not fit the machine. The growth from the fewest to the
most anchors needs two measured anchor counts; with one it is "not measured".
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time
from typing import Any

from dflash_train.bench.common import add_json_argument, format_table, write_json
from dflash_train.head_loss import (
    LK_ALPHA_EPS,
    LOSSES,
    HeadLoss,
    auto_chunk_rows,
    fused_head_loss,
)


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
    parser.add_argument(
        "--chunk", type=int, default=0, help="rows per loss chunk (0: train's automatic choice)"
    )
    parser.add_argument(
        "--loss", nargs="+", choices=LOSSES, default=list(LOSSES), help="the losses to measure"
    )
    parser.add_argument(
        "--direct-max-gb",
        type=float,
        default=2.0,
        help="skip a direct measurement whose (rows x vocab) fp32 logits pass this size",
    )
    add_json_argument(parser)
    parser.add_argument(
        "--worker", nargs=3, metavar=("LOSS", "MODE", "ANCHORS"), help=argparse.SUPPRESS
    )


def _check(args: argparse.Namespace) -> None:
    """The flags' ranges, up front: one line each (a ValueError), not a worker's traceback."""
    if min(args.anchors) < 1:
        raise ValueError(f"--anchors must be >= 1 each, got {min(args.anchors)}")
    if args.block_size < 2:
        raise ValueError(
            f"--block-size must be >= 2 (one supervised position), got {args.block_size}"
        )
    for name in ("vocab", "hidden"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.chunk < 0:
        raise ValueError(f"--chunk must be >= 0 (0: train's automatic choice), got {args.chunk}")


class WorkerFailed(RuntimeError):
    """A measuring process failed; the message is one line naming it."""


def main(args: argparse.Namespace) -> int:
    _check(args)
    args.chunk = args.chunk or auto_chunk_rows(args.vocab)
    if args.worker:
        loss, mode, anchors = args.worker
        print(json.dumps(_measure(loss, mode, int(anchors), args)))
        return 0
    try:
        rows = [_row(anchors, args) for anchors in args.anchors]
    except WorkerFailed as e:
        print(f"dflash-train bench: error: {e}", file=sys.stderr)
        return 1
    columns = ["anchors", "rows"] + [f"{x}_{m}" for x in args.loss for m in ("mb", "direct_mb")]
    print(format_table(columns, rows))
    growth = {
        loss: {mode: _growth(rows, key) for mode, key in (("chunked", loss), ("direct", direct))}
        for loss in args.loss
        for direct in [f"{loss}_direct"]
    }
    result = {
        "rows": rows,
        "chunk": args.chunk,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "growth_mb": growth,
        "logits_chunk_mb": args.chunk * args.vocab * 4 / 1e6,
        "note": "MB = peak RSS growth of forward + backward over the inputs (hidden and teacher "
        "rows, head, labels); a chunked loss's growth beyond d loss / d hidden stays flat",
    }
    for loss, g in growth.items():
        chunked = (
            "not measured (one anchor count)"
            if g["chunked"] is None
            else "{:.0f} MB from {} to {} anchors".format(*g["chunked"])
        )
        direct = (
            "not measured"
            if g["direct"] is None
            else "{:.0f} MB from {} to {}".format(*g["direct"])
        )
        print(f"{loss}: growth chunked {chunked}; direct {direct}")
    if args.json:
        write_json(args.json, result)
    return 0


def _growth(rows: list[dict[str, Any]], key: str) -> tuple[float, int, int] | None:
    """(peak growth from the first to the last measured row, their anchors) of `key`_mb; None
    with fewer than two measured rows."""
    seen = [r for r in rows if r[f"{key}_mb"] is not None]
    if len(seen) < 2:
        return None
    a, b = seen[0], seen[-1]
    return b[f"{key}_mb"] - a[f"{key}_mb"], a["anchors"], b["anchors"]


def _row(anchors: int, args: argparse.Namespace) -> dict[str, Any]:
    rows = anchors * (args.block_size - 1)
    row: dict[str, Any] = {"anchors": anchors, "rows": rows}
    direct_ok = rows * args.vocab * 4 <= args.direct_max_gb * 1e9
    for loss in args.loss:
        out = _child(loss, "chunked", anchors, args)
        row[f"{loss}_mb"], row[f"{loss}_s"] = out["peak_growth_mb"], out["seconds"]
        row[f"{loss}_direct_mb"] = (
            _child(loss, "direct", anchors, args)["peak_growth_mb"] if direct_ok else None
        )
    return row


def _child(loss: str, mode: str, anchors: int, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, "-m", "dflash_train", "bench", "loss", "--worker", loss, mode]
    cmd += [str(anchors), "--block-size", str(args.block_size), "--hidden", str(args.hidden)]
    cmd += ["--vocab", str(args.vocab), "--chunk", str(args.chunk)]
    what = f"the {loss} {mode} worker at {anchors} anchors"
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired as e:
        raise WorkerFailed(f"{what} ran past {e.timeout:g} s") from None
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        said = [x.strip() for x in out.stderr.strip().splitlines() if x.strip()]
        why = re.sub(r"^dflash-train[^:]*: error: ", "", said[-1]) if said else "no message"
        if out.returncode == 2 and said:  # the worker's own one-line user error
            raise ValueError(f"{what}: {why}")
        rc = out.returncode
        status = f"killed by signal {-rc}" if rc < 0 else f"exit status {rc}"
        raise WorkerFailed(f"{what} failed ({status}): {why}")
    return json.loads(lines[-1])


def _peak_mb() -> float:
    """This process's peak RSS (MB): /proc's VmHWM, the peak of this process image alone, where
    there is one. On Linux `ru_maxrss` starts at the launching process's peak (kept across fork
    and exec), so a worker started by a larger process (a test suite) showed no growth below it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _measure(kind: str, mode: str, anchors: int, args: argparse.Namespace) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    rows = anchors * (args.block_size - 1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, args.hidden, generator=gen, requires_grad=True)
    # In place: a temporary the size of the head would raise the baseline peak and hide the
    # growth of the small cases below it.
    teacher = torch.randn(rows, args.hidden, generator=gen).mul_(0.5).add_(hidden.detach())
    head = torch.randn(args.vocab, args.hidden, generator=gen).mul_(0.05)
    labels = torch.randint(0, args.vocab, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen)
    loss = HeadLoss(kind)
    base = _peak_mb()
    t0 = time.perf_counter()
    if mode == "chunked":
        per_row = fused_head_loss(hidden, head, labels, args.chunk, loss=loss, teacher=teacher)
        value = per_row.value
    else:
        value = _direct(hidden, teacher, head, labels, loss)
    total = (weights * value).sum()
    total.backward()
    seconds = time.perf_counter() - t0
    return {"peak_growth_mb": _peak_mb() - base, "seconds": seconds, "loss": float(total.detach())}


def _direct(hidden, teacher, head, labels, loss: HeadLoss):
    """Each loss from whole (rows x vocab) logits with autograd: what chunking saves."""
    import torch.nn.functional as F

    z = hidden @ head.T
    if loss.kind == "ce":
        return F.cross_entropy(z, labels, reduction="none")
    log_q, log_p = z.log_softmax(-1), (teacher @ head.T).log_softmax(-1)
    q, p = log_q.exp(), log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1) if loss.kind != "lk_alpha" else None
    if loss.kind == "kl":
        return kl
    alpha = p.minimum(q).sum(-1)
    if loss.kind == "lk_alpha":
        return -(alpha + LK_ALPHA_EPS).log()
    lam = (-loss.lk_eta * alpha.detach()).exp()
    return lam * kl + (1 - lam) * (1 - alpha)
