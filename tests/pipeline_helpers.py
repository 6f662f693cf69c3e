"""Helpers shared by pipeline tests: random prepared datasets and tiny train configs."""

from __future__ import annotations


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
    """A TrainConfig sized for 2 CPU cores: 2 target + 2 drafter workers, seconds per epoch."""
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
