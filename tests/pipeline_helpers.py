"""Helpers shared by pipeline tests: random prepared datasets, tiny train configs, a trainer
stopped at a chosen step, and the losses a run logged."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from dflash_train.train.trainer import Trainer


def run_trainer(cfg, cls=Trainer, resume=None, **kwargs):
    """Build and run a trainer of `cfg` with its metric sinks (as `train` makes them), closed
    afterwards; returns (trainer, result)."""
    from dflash_train.train.command import metrics_sink

    trainer = cls(cfg, log=lambda _m: None, resume=resume, sink_factory=metrics_sink(cfg), **kwargs)
    try:
        trainer.build()
        return trainer, trainer.run()
    finally:
        trainer.close()


class StopsAt(Trainer):
    """A trainer that receives a stop request (as from SIGTERM) right after step `stop_at`."""

    def __init__(self, *args, stop_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stop_at = stop_at

    def on_step(self, outcome, grad_norm) -> None:
        super().on_step(outcome, grad_norm)
        if self.replicas[0].step == self.stop_at:
            self.signals.received = signal.SIGTERM
            self.pipeline.stop_event.set()  # the drafters stop before another step


JITTER_STAGES = ("prefetch", "target", "reader", "drafter_step", "rendezvous")


def jitter(seed: int, seconds: float = 0.02) -> list[dict]:
    """A fault plan: a random delay of up to `seconds` before every call of every pipeline
    stage (another seed, another interleaving of the threads)."""
    return [
        {"stage": s, "action": "jitter", "seconds": seconds, "every": True, "seed": seed + i}
        for i, s in enumerate(JITTER_STAGES)
    ]


def logged_losses(run_dir: Path) -> dict[int, float]:
    """train/loss by step from a run's metrics.jsonl (a resumed run's later lines win)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "train/loss" in rec:
            out[rec["step"]] = rec["train/loss"]
    return out


def write_random_dataset(
    path, num_rows=40, min_len=20, max_len=120, vocab=250, seed=0, unsupervised_rows=()
):
    """A prepared dataset of random tokens; the first third of each row is the 'prompt'."""
    import numpy as np

    from dflash_train.data.dataset import write_prepared

    rng = np.random.default_rng(seed)
    rows = []
    for i in range(num_rows):
        n = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(0, vocab, n)
        mask = np.zeros(n, np.uint8)
        if i not in unsupervised_rows:
            mask[n // 3 :] = 1
        rows.append((ids, mask))
    write_prepared(path, rows)
    return path


def tiny_train_config(target, data, out, **overrides):
    """A TrainConfig sized for 2 CPU cores: 2 target + 2 drafter workers, seconds per epoch.

    Batches are planned by block positions (`batch_cost="blocks"`, the plan these tests were
    written on; train's default, flops, and `--batch-cost auto` have their own tests)."""
    from dflash_train.config import TrainConfig

    base = dict(
        target=str(target),
        data=str(data),
        out=str(out),
        overwrite=True,
        target_devices=["cpu", "cpu"],
        drafter_devices=["cpu", "cpu"],
        draft_layers=1,
        block_size=8,
        num_anchors=16,
        batch_size=2,
        batch_cost="blocks",
        epochs=1,
        hs_queue_depth=8,
        hs_min_ready=4,
        num_prefetchers=2,
        log_every=5,
        num_target_features=3,
        mask_token_id=255,
        progress=False,
        cpu_threads=1,
        stall_timeout=60.0,
    )
    base.update(overrides)
    return TrainConfig.from_layers(base)


def deterministic_train_config(target, data, out, **overrides):
    """A run whose losses are a function of its inputs alone: 1 prefetcher, 1 target worker,
    1 drafter, --mix fifo, one 128-token bucket, 2 epochs, a metric line every step."""
    base = dict(
        target_devices=["cpu"],
        drafter_devices=["cpu"],
        num_prefetchers=1,
        mix="fifo",
        epochs=2,
        log_every=1,
        bucket_lengths=[128],  # one bucket: N / 2 batches of 2 rows per epoch
    )
    return tiny_train_config(target, data, out, **{**base, **overrides})


def chat_workspace(
    root,
    *,
    conversations,
    prompts,
    seed,
    vocab_size=512,
    initializer_range=0.02,
    prepare_max_length=None,
):
    """A tiny Qwen3 target with a real chat tokenizer in ROOT/target, synthetic conversations
    in ROOT/train.jsonl (the first `conversations - prompts`) and ROOT/prompts.jsonl (the rest),
    and, with `prepare_max_length`, ROOT/data prepared from them. Returns the tokenizer."""
    from dflash_train import cli
    from dflash_train.data.synthetic import corpus_texts, synthetic_conversations, write_jsonl
    from dflash_train.data.tokenizer import build_chat_tokenizer
    from dflash_train.model.tiny import save_random_qwen3

    rows = synthetic_conversations(conversations, seed=seed)
    write_jsonl(rows[: conversations - prompts], root / "train.jsonl")
    write_jsonl(rows[conversations - prompts :], root / "prompts.jsonl")
    target = root / "target"
    tok = build_chat_tokenizer(corpus_texts(rows), target, vocab_size=vocab_size, style="qwen3")
    save_random_qwen3(
        target, vocab_size=len(tok) + 8, num_layers=6, initializer_range=initializer_range
    )
    if prepare_max_length is not None:
        argv = ["prepare", "--data", str(root / "train.jsonl"), "--tokenizer", str(target)]
        argv += ["--out", str(root / "data"), "--max-length", str(prepare_max_length)]
        assert cli.main(argv) == 0
    return tok


def fine_tune(src, dst, name_part: str, where: str) -> None:
    """A copy of the target directory `src` at `dst` with one tensor (the first whose name
    holds `name_part`) changed at its first or last element (`where`: "start" or "end"): the
    same config.json, other weights."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    tensors = load_file(path)
    name = next(k for k in sorted(tensors) if name_part in k)
    flat = tensors[name].flatten().clone()
    flat[0 if where == "start" else -1] += 0.5
    tensors[name] = flat.view_as(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})


def record_context_tiles(monkeypatch) -> list[int]:
    """The tile size of every chunk the blockwise kernel reads in tiles (long contexts), as a
    list that fills while the test runs (from any thread)."""
    from dflash_train.model import context_tiles

    tiles: list[int] = []
    real = context_tiles.TiledContextChunk.forward

    def recorded(ctx, *args):
        tiles.append(args[-1])
        return real(ctx, *args)

    monkeypatch.setattr(context_tiles.TiledContextChunk, "forward", staticmethod(recorded))
    return tiles


def record_replica_calls(monkeypatch) -> dict[str, list]:
    """Every `DraftReplica.micro_step` as (thread, torch.compile stance, job) under "steps",
    every `apply`'s global weight under "weights"; lists that fill while the test runs."""
    import threading

    import torch

    from dflash_train.train.replica import DraftReplica

    log: dict[str, list] = {"steps": [], "weights": []}
    micro_step, apply = DraftReplica.micro_step, DraftReplica.apply

    def recording_step(self, batch):
        stance = torch._dynamo.eval_frame._stance.stance
        log["steps"].append((threading.current_thread().name, stance, batch.job))
        return micro_step(self, batch)

    def recording_apply(self, global_weight):
        log["weights"].append(global_weight)
        return apply(self, global_weight)

    monkeypatch.setattr(DraftReplica, "micro_step", recording_step)
    monkeypatch.setattr(DraftReplica, "apply", recording_apply)
    return log
