"""`dflash-train bench step`: the drafter's training step, its throughput and memory.

Random token batches, fully supervised, the same objective the trainer runs with its defaults
(random anchors, block mask, D-PACE weights and their loss normaliser, chunked loss, Muon +
AdamW step). Reports the median of `--iters` steps after `--warmup` steps, excluding the target
forward (timed separately). `tokens_per_s` counts the supervised block positions with non-zero
weight per second of step time. The MFU divides the step's model FLOPs (`step_flop_parts`) by
the peak measured on the device first (a large matmul in the compute dtype), and, where the
device's spec sheet is known, by that too (`mfu_spec`).

Each configuration (attention kernel x loss chunk size) runs in its own process so that peak
memory (RSS on CPU, allocator peak on CUDA) belongs to that configuration alone.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.config import ObjectiveOptions, OptimOptions
from dflash_train.data.buckets import BatchSpec
from dflash_train.devices import parse_devices, resolve_dtype, synchronize
from dflash_train.model import flex
from dflash_train.model.block_attention import resolve_backend
from dflash_train.model.draft import DFlashDraftModel
from dflash_train.model.flops import drafter_flop_parts
from dflash_train.model.target import (
    FrozenHead,
    TargetFeatureExtractor,
    draft_config_from_target,
    load_frozen_head,
    load_target_config,
)
from dflash_train.objective import loss_gamma
from dflash_train.pipeline.prefetch import make_job
from dflash_train.pipeline.records import HSBatch
from dflash_train.train.optimizers import orthogonalise_flops
from dflash_train.train.replica import DraftReplica, compile_layers

# Dense bf16 peak FLOP/s by device name fragment (public spec sheets), for `mfu_spec`; the MFU
# itself divides by the peak measured on the device (an H200's 989 spec measures ~790).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "4090": 165e12,
}


# Target shapes for --random-target: public configs, no weights needed (the target forward is
# replaced by random features and the embedding / LM head are random).
RANDOM_TARGETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "qwen3-0.6b": {
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "qwen3-1.7b": {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", help="target model directory (HF)")
    source.add_argument(
        "--random-target",
        choices=sorted(RANDOM_TARGETS),
        help="a target SHAPE instead of a model: random features stand in for the target "
        "forward (not timed) and the embedding / LM head are random; e.g. qwen3-8b on a GPU",
    )
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument(
        "--num-target-features",
        type=int,
        default=None,
        help="K target layers fused; default = --draft-layers (the rule "
        "SpecForge and the reference client default to)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-anchors",
        type=int,
        nargs="+",
        default=[256],
        help="anchors per sequence (several values: one row each)",
    )
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["auto"],
        choices=["auto", "dense", "blockwise", "flex"],
        help="attention kernels to measure (several: one row each)",
    )
    parser.add_argument(
        "--loss-chunk-size",
        type=int,
        nargs="+",
        default=[0],
        help="LM-head loss rows per chunk; 0 = automatic",
    )
    parser.add_argument("--attention-chunks", type=int, default=8)
    parser.add_argument(
        "--no-chunked-step",
        dest="chunked_step",
        action="store_false",
        help="run all blocks in one forward and one backward instead of one anchor chunk at a "
        "time (more activation memory)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the draft layers as train --compile does (the warm-up steps trace)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="OUT", help="write the results as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    counts = {"--seq-len": args.seq_len, "--batch-size": args.batch_size, "--iters": args.iters}
    counts |= {"--threads": args.threads, "--num-anchors": min(args.num_anchors)}
    for flag, value in counts.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.block_size < 2:
        raise ValueError(f"--block-size must be >= 2 (an anchor, a prediction): {args.block_size}")
    parse_devices(args.device, "--device")  # one that does not exist: here, not in each worker
    if args.target is not None and not Path(args.target).is_dir():
        raise ValueError(f"target directory {args.target} does not exist")
    if args.dtype == "float16":
        raise ValueError(
            "bench step --dtype float16 is refused, as train refuses it: fp16 gradients "
            "underflow without loss scaling, which the trainer does not do; use bfloat16"
        )
    if args.worker:
        print(json.dumps(measure(args)))
        return 0
    rows = []
    for anchors in args.num_anchors:
        for attention in args.attention:
            for chunk in args.loss_chunk_size:
                rows.append(_run_child(args, anchors, attention, chunk))
    _print_table(rows)
    result: dict[str, Any] = dict(rows[0]) if len(rows) == 1 else {"rows": rows}
    measured = [r for r in rows if "error" not in r]
    if len(rows) > 1 and measured:
        best = max(measured, key=lambda r: r.get("tokens_per_s") or 0.0)
        result.update(
            {
                k: best[k]
                for k in ("tokens_per_s", "step_s", "target_forward_s", "peak_rss_mb", "attention")
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


def _run_child(args: argparse.Namespace, anchors: int, attention: str, chunk: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "dflash_train",
        "bench",
        "step",
        "--worker",
        *(["--target", args.target] if args.target else ["--random-target", args.random_target]),
        "--draft-layers",
        str(args.draft_layers),
        "--num-target-features",
        str(args.num_target_features or args.draft_layers),
        "--block-size",
        str(args.block_size),
        "--num-anchors",
        str(anchors),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--threads",
        str(args.threads),
        "--attention",
        attention,
        "--loss-chunk-size",
        str(chunk),
        "--attention-chunks",
        str(args.attention_chunks),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--seed",
        str(args.seed),
    ]
    if not args.chunked_step:
        cmd.append("--no-chunked-step")
    if args.compile:
        cmd.append("--compile")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        # The worker's whole output, for whoever reads this run's log (the GPU check keeps it).
        print(proc.stdout + proc.stderr, file=sys.stderr, flush=True)
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {
            "attention": attention,
            "num_anchors": anchors,
            "loss_chunk_size": chunk,
            "error": tail[0],
        }
    return json.loads(lines[-1])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    (device,) = parse_devices(args.device, "device")
    dtype = resolve_dtype(args.dtype, device)
    (attention,) = args.attention
    (anchors,) = args.num_anchors
    (chunk,) = args.loss_chunk_size
    attention = resolve_backend(attention, device, needs_grad=True)
    peak = measured_peak_flops(device, dtype)  # first: nothing else on the device yet
    if args.random_target:
        tcfg = _random_target_config(args.random_target)
    else:
        tcfg = load_target_config(args.target)
    dcfg = draft_config_from_target(
        tcfg,
        args.draft_layers,
        args.block_size,
        tcfg.vocab_size - 1,
        num_features=args.num_target_features or args.draft_layers,
    )
    if args.random_target:
        extractor, head = None, _random_head(tcfg, device, dtype)
    else:
        extractor = TargetFeatureExtractor(args.target, dcfg.target_layer_ids, device, dtype)
        head = load_frozen_head(args.target)
    objective = ObjectiveOptions(
        num_anchors=anchors,
        attention=attention,
        loss_chunk_size=chunk,
        attention_chunks=args.attention_chunks,
        chunked_step=args.chunked_step,
    )
    replica = DraftReplica(
        DFlashDraftModel(dcfg),
        head,
        device,
        dtype,
        objective,
        OptimOptions(),
        args.warmup + args.iters,
    )
    if args.compile:
        compile_layers(replica.model)
    rng = np.random.default_rng(args.seed)
    gamma = loss_gamma(args.block_size, objective.gamma)
    steps, targets_s, supervised, blocks = [], [], [], []
    warmup_s, compiles, eager = 0.0, flex.timed_compiles(), flex.eager_calls()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for it in range(args.warmup + args.iters):
        rows = [
            (rng.integers(0, tcfg.vocab_size - 1, args.seq_len), np.ones(args.seq_len, np.uint8))
            for _ in range(args.batch_size)
        ]
        spec = BatchSpec(0, it, 0, tuple(range(it * args.batch_size, (it + 1) * args.batch_size)))
        job = make_job(
            spec,
            rows,
            args.seq_len,
            block_size=args.block_size,
            num_anchors=anchors,
            gamma=gamma,
            mask_token_id=dcfg.mask_token_id,
            seed=args.seed,
            attention_chunks=objective.attention_chunks,
            position_weights=objective.position_weights,  # the replica's loss normaliser
        )
        t0 = time.perf_counter()
        if extractor is None:
            shape = (*job.input_ids.shape, dcfg.num_features * dcfg.hidden_size)
            features = torch.randn(shape, device=device, dtype=dtype)
        else:
            features = extractor(job.input_ids)
        synchronize(device)
        t1 = time.perf_counter()
        step_s = timed_step(replica, HSBatch(job, features))
        if it < args.warmup:
            warmup_s += step_s  # where compiles are paid (this is the main thread)
        else:
            targets_s.append(t1 - t0)
            steps.append(step_s)
            supervised.append(job.num_supervised)
            blocks.append(float(job.layout.valid.sum()) / args.batch_size)  # real, per row
    step_s = statistics.median(steps)
    out: dict[str, Any] = {
        "attention": attention,
        "num_anchors": anchors,
        "loss_chunk_size": replica.chunk_rows,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "block_size": args.block_size,
        "draft_layers": args.draft_layers,
        "threads": args.threads,
        "chunked_step": args.chunked_step,
        "compile": args.compile,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "supervised_per_step": statistics.mean(supervised),
        "step_s": step_s,
        "target": args.target or f"random:{args.random_target}",
        "target_forward_s": None if extractor is None else statistics.median(targets_s),
        "tokens_per_s": statistics.mean(supervised) / step_s,
        "warmup_s": warmup_s,
        "flex_traces": compiles()[0],
        "flex_eager_calls": flex.eager_calls() - eager,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    if device.type == "cuda":
        out["peak_gpu_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    muon = [] if replica.muon is None else replica.muon.param_groups[0]["params"]
    # The blocks the step ran, not --num-anchors: a row has at most as many anchors as its
    # supervised positions allow (counting the flag's made MFU exceed 1 on short rows).
    flops = step_flops(
        dcfg,
        args.batch_size,
        args.seq_len,
        statistics.mean(blocks),
        statistics.mean(supervised),
        [p.shape for p in muon],
    )
    out.update(mfu_figures(flops / step_s, peak, _spec_peak_flops(device, dtype)))
    return out


def timed_step(replica: DraftReplica, batch: HSBatch) -> float:
    """Seconds of one optimizer step of `replica` on `batch` alone (micro-step + apply, the
    device waited for): what `bench step` times, and `bench gap` beside a whole run."""
    synchronize(replica.device)
    t0 = time.perf_counter()
    replica.micro_step(batch)
    replica.apply(batch.job.weight_sum)
    synchronize(replica.device)
    return time.perf_counter() - t0


def mfu_figures(flops_per_s: float, measured: float, spec: float | None) -> dict[str, Any]:
    """The step's model TFLOP/s, the measured peak and the MFU against it, and against the
    spec sheet's peak when the device is known."""
    out: dict[str, Any] = {
        "model_tflops_per_s": flops_per_s / 1e12,
        "peak_tflops_measured": measured / 1e12,
        "mfu": flops_per_s / measured,
    }
    if spec:
        out.update(peak_tflops_spec=spec / 1e12, mfu_spec=flops_per_s / spec)
    return out


def measured_peak_flops(device: torch.device, dtype: torch.dtype, reps: int = 10) -> float:
    """FLOP/s of a square matmul in `dtype` on `device` (8192 on CUDA, 1024 on CPU), the
    median of `reps` timings after one warm-up: the peak an MFU can reach here (a spec sheet's
    dense figure is rarely reached)."""
    n = 8192 if device.type == "cuda" else 1024
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    times = []
    for _ in range(reps + 1):
        synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the bench's own memory peak starts clean
    return 2.0 * n**3 / statistics.median(times[1:])


def _random_target_config(name: str):
    from transformers import Qwen3Config

    return Qwen3Config(**RANDOM_TARGETS[name])


def _random_head(config, device: torch.device, dtype: torch.dtype):
    """Random embedding and LM head of the target's shape, built on `device` in `dtype`."""
    shape = (config.vocab_size, config.hidden_size)
    gen = torch.Generator(device=device).manual_seed(0)
    scale = config.hidden_size**-0.5
    return FrozenHead(
        torch.randn(shape, device=device, dtype=dtype, generator=gen) * 0.02,
        torch.randn(shape, device=device, dtype=dtype, generator=gen) * scale,
    )


def step_flop_parts(
    cfg, batch: int, seq: int, anchors: int, supervised: float, muon_shapes: Sequence = ()
) -> dict[str, float]:
    """Model FLOPs of one training step by part: the micro-step's
    (`model.flops.drafter_flop_parts`) and Muon's orthogonalisation of the matrices
    `muon_shapes`, run once per step (`optimizers.orthogonalise_flops`)."""
    return {
        **drafter_flop_parts(cfg, batch, seq, anchors, supervised),
        "muon": sum(orthogonalise_flops(s) for s in muon_shapes),
    }


def step_flops(
    cfg, batch: int, seq: int, anchors: int, supervised: float, muon_shapes: Sequence = ()
) -> float:
    """Model FLOPs of one training step (`step_flop_parts`, summed)."""
    return sum(step_flop_parts(cfg, batch, seq, anchors, supervised, muon_shapes).values())


def _spec_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The spec sheet's dense bf16 peak of a known CUDA device (None elsewhere)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def _print_table(rows: list[dict]) -> None:
    head = (
        f"{'attention':>10} {'anchors':>7} {'chunk':>6} {'sup/step':>8} {'step s':>8} "
        f"{'tok/s':>9} {'target s':>8} {'peak MB':>8}"
    )
    print(head)
    for r in rows:
        if "error" in r:
            print(
                f"{r['attention']:>10} {r['num_anchors']:>7} {r['loss_chunk_size']:>6} "
                f"error: {r['error']}"
            )
            continue
        print(
            f"{r['attention']:>10} {r['num_anchors']:>7} {r['loss_chunk_size']:>6} "
            f"{r['supervised_per_step']:>8.0f} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} "
            f"{_seconds(r['target_forward_s']):>8} {r['peak_rss_mb']:>8.0f}"
            + (f" mfu {r['mfu']:.3f}" if "mfu" in r else "")
        )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
