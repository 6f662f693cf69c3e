"""`dflash-train bench target`: the target's features from the hf backend and from a vLLM
engine, side by side on the same target and batches (the CPU figures of the README's "The
target on a serving engine").

Same target (`--target DIR`, or a random Qwen3 of `--hidden` x `--layers` built from a config),
same batches (`--batches` of `--rows` x `--length` random token ids, one warm-up first), fp32:
- hf: the hf backend's source (`model.target.TargetFeatureExtractor`) in this process;
- vllm: one engine started as `train --target-backend vllm` starts it (`engine.source`; vLLM's
  CPU build in the cached environment `bench engine` builds, unless `--vllm-python`), read by 1
  and by `--workers` concurrent sources (target workers), features handed over through shared
  memory; and once inline over HTTP, as a trainer on another host receives them.
Rows: target tokens/s; the seconds a target worker waits for one batch's features (mean, p90:
the trainer's `time/target_forward_s` per batch); for vllm the engine's own seconds per batch
(admission to the last file written) and the trainer-side hand-over read per MB. Also measured
alone: the shared-memory hand-over itself (write + rename + read into the batch + delete of the
same bytes) per MB. Every vllm batch must equal hf's to `FEATURE_ATOL` (else exit 1).

The two backends run one after the other, never together (the engine is idle while hf runs):
on 2 cores either would take both.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.bench.common import BenchReport, add_json_argument, emit

FEATURE_ATOL = 1e-4  # fp32 on CPU: vLLM vs transformers, features of size ~1-10
MB = 1e6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--target", default=None, help="a target model directory (default: random)")
    parser.add_argument("--hidden", type=int, default=256, help="random target: hidden size")
    parser.add_argument("--layers", type=int, default=8, help="random target: decoder layers")
    parser.add_argument("--layer-ids", default="1,3,5", help="DFlash target layer ids (K of them)")
    parser.add_argument("--rows", type=int, default=4, help="rows per batch")
    parser.add_argument("--length", type=int, default=512, help="tokens per row")
    parser.add_argument("--batches", type=int, default=8, help="timed batches per row")
    parser.add_argument("--workers", type=int, default=2, help="concurrent vllm sources")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the hf forward")
    parser.add_argument("--vllm-python", default=None, help="default: the cached vLLM CPU env")
    add_json_argument(parser)


def random_target(path: Path, hidden: int, layers: int) -> Path:
    from dflash_train.model.tiny import save_random_qwen3

    return save_random_qwen3(
        path,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=max(1, hidden // 64),
        num_kv_heads=max(1, hidden // 128),
        head_dim=64,  # vLLM's CPU attention kernels take 32, 64, ... (not 16)
        vocab_size=4096,
        initializer_range=1.5 / hidden**0.5,
    )


def timed(call, batches: list[torch.Tensor]) -> tuple[list[float], list[torch.Tensor]]:
    """Seconds of each call after one warm-up call, and the outputs."""
    call(batches[0])
    seconds, outs = [], []
    for ids in batches:
        t0 = time.perf_counter()
        outs.append(call(ids))
        seconds.append(time.perf_counter() - t0)
    return seconds, outs


def concurrent(sources: list[Any], batches: list[torch.Tensor]) -> tuple[float, list[float]]:
    """Wall seconds for `sources` (one thread each) to take every batch, round robin, and every
    call's seconds."""
    waits: list[float] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for ids in batches[i :: len(sources)]:
                t0 = time.perf_counter()
                sources[i](ids)
                waits.append(time.perf_counter() - t0)
        except BaseException as e:
            errors.append(e)

    for s in sources:
        s(batches[0])  # each connection warmed up
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sources))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3600)
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, waits


def row(name: str, workers: int, tokens: int, wall: float, waits: list[float]) -> dict[str, Any]:
    return {
        "backend": name,
        "workers": workers,
        "tokens/s": tokens / wall,
        "wait/batch s": float(np.mean(waits)),
        "wait p90 s": float(np.percentile(waits, 90)),
    }


def handover_cost(nbytes: int, repeats: int = 20) -> float:
    """Seconds per MB of the shared-memory hand-over alone: the connector's write (raw bytes
    to a .part file, renamed) and the source's read straight into a batch row, then delete."""
    from dflash_train.engine.source import read_into

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    with tempfile.TemporaryDirectory(dir=base) as d:
        path = os.path.join(d, "row.bin")
        t0 = time.perf_counter()
        for _ in range(repeats):
            src.numpy().tofile(path + ".part")
            os.replace(path + ".part", path)
            read_into(path, dst)
            os.unlink(path)
        seconds = (time.perf_counter() - t0) / repeats
    assert torch.equal(src, dst)
    return seconds / (nbytes / MB)


def main(args: argparse.Namespace) -> int:
    from dflash_train.engine.source import VllmTarget, VllmTargetSettings
    from dflash_train.model.target import TargetFeatureExtractor

    layer_ids = [int(x) for x in args.layer_ids.split(",")]
    if min(args.rows, args.length, args.batches, args.workers) < 1:
        raise ValueError("--rows, --length, --batches and --workers must be >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        if args.target:
            target = Path(args.target)
        else:
            target = random_target(Path(tmp) / "target", args.hidden, args.layers)
        vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
        gen = torch.Generator().manual_seed(0)
        batches = [
            torch.randint(0, vocab, (args.rows, args.length), generator=gen)
            for _ in range(args.batches)
        ]
        tokens = args.rows * args.length * args.batches
        torch.set_num_threads(args.threads)
        hf = TargetFeatureExtractor(target, layer_ids, torch.device("cpu"), torch.float32)
        hf_s, want = timed(hf, batches)
        rows = [row("hf (in-process)", 1, tokens, sum(hf_s), hf_s)]
        del hf
        python = args.vllm_python or _cached_vllm_python()
        settings = VllmTargetSettings(
            target=str(target),
            layer_ids=layer_ids,
            dtype=torch.float32,
            max_model_len=args.length + 16,
            request_timeout_s=600.0,
            python=python,
        )
        t0 = time.perf_counter()
        engine = VllmTarget.open(settings, say=lambda m: print(f"    {m}", flush=True))
        startup_s = time.perf_counter() - t0
        try:
            report = measure(engine, batches, want, tokens, rows, args.workers)
        finally:
            engine.close()
    feature_mb = want[0].numel() * 4 / MB
    described = f"random Qwen3, hidden {args.hidden}, {args.layers} layers"
    report.summary.update(
        {
            "target": str(args.target or described),
            "batch": f"{args.rows} x {args.length} tokens, K = {len(layer_ids)}",
            "feature_mb_per_batch": feature_mb,
            "engine_startup_s": startup_s,
            "handover_s_per_mb": handover_cost(int(want[0][0].numel() * 4)),
        }
    )
    return emit(report, args.json)


def measure(engine, batches, want, tokens, rows, workers) -> BenchReport:
    problems = []
    one = engine.source()
    v_s, got = timed(one, batches)
    pairs = enumerate(zip(got, want, strict=True))
    bad = [i for i, (g, w) in pairs if not torch.allclose(g, w, atol=FEATURE_ATOL, rtol=0)]
    if bad:
        worst = max(float((got[i] - want[i]).abs().max()) for i in bad)
        problems.append(f"vllm features differ from hf's in batches {bad} (max {worst:.2e})")
    st = one.stats
    single = row("vllm, shared memory", 1, tokens, sum(v_s), v_s)
    single["engine s/batch"] = st.engine_s / st.batches
    single["read s/MB"] = st.read_s / (st.nbytes / MB)
    rows.append(single)
    wall, waits = concurrent([engine.source() for _ in range(workers)], batches)
    rows.append(row("vllm, shared memory", workers, tokens, wall, waits))
    engine.shared_memory = False  # as a trainer on another host receives them
    inline = engine.source()
    i_s, _ = timed(inline, batches)
    inline_row = row("vllm, inline HTTP", 1, tokens, sum(i_s), i_s)
    inline_row["read s/MB"] = inline.stats.read_s / (inline.stats.nbytes / MB)
    rows.append(inline_row)
    hf_tps = rows[0]["tokens/s"]
    report = BenchReport(
        title="target features: hf (in-process) vs a vLLM engine (CPU build), fp32, same batches",
        columns=[
            "backend",
            "workers",
            "tokens/s",
            "wait/batch s",
            "wait p90 s",
            "engine s/batch",
            "read s/MB",
        ],
        rows=rows,
        summary={
            "tokens_per_s_hf": hf_tps,
            "tokens_per_s_vllm": max(r["tokens/s"] for r in rows[1:3]),
            "vllm_over_hf": max(r["tokens/s"] for r in rows[1:3]) / hf_tps,
            "vllm_version": engine.info.get("vllm_version"),
        },
        problems=problems,
    )
    report.notes += [
        "wait/batch: seconds a target worker waits for one batch's features (train's "
        "time/target_forward_s per batch); engine s/batch: admission to the last hand-over file "
        "written, inside the engine process; read s/MB: the trainer-side hand-over (files read "
        "into the batch tensor and deleted, or the HTTP body copied) per MB of features",
        "handover_s_per_mb: the shared-memory hand-over alone, one row's bytes written, renamed, "
        "read into a tensor and deleted, in this process",
    ]
    return report


def _cached_vllm_python() -> str:
    from dflash_train.bench.engine import default_cache_dir, ensure_vllm_env

    return str(ensure_vllm_env(default_cache_dir()).python)
