"""Seeing a run: metrics loggers, GPU telemetry, and the HTML report (`dflash-train report`).

Metric keys are namespaced `family/name`; not every log line has every key. Units:

- `train/loss` (weighted cross-entropy, nats), `train/acc_k1` .. `train/acc_k{B-1}` (top-1
  accuracy per block position, in [0, 1]), `train/tau_est` (estimated acceptance length, tokens),
  `train/lr`, `train/grad_norm`, `train/tokens_per_s` and `train/seqs_per_s` (trained tokens,
  padding excluded), `train/padding_frac` ([0, 1]), `train/epoch`.
- DFlash 2 also: `train/topk_recall_k{k}` (gold token among the top-K unary candidates, [0, 1]),
  `train/selector_acc_k{k}` (teacher-forced selector top-1, [0, 1]), `train/selector_loss`
  (weighted selector cross-entropy, nats, unscaled by alpha; `train/loss` is the whole
  objective), and `train/tau_est` is the selector path's estimate (`train/tau_est_unary` the
  unary logits').
- `time/{prefetch,target_forward,target_put_wait,drafter_get_wait,drafter_forward,
  drafter_backward,optimizer,grad_sync}_s` and the other `time/*_s`: mean seconds per event
  (a batch, micro-batch, step or checkpoint: the stage's own) over the log interval, summed over
  the node's workers, then divided by the events (docs/reference/metrics.md).
- `queue/depth`, `queue/bytes`, `queue/bucket{b}_depth` (b = 0.. shortest first),
  `queue/producer_blocked_frac`, `queue/consumer_starved_frac`, `queue/hol_wait_frac`
  (drafters waiting for their planned batch while others were ready; [0, 1] of wall time),
  `queue/mix_tv` (total-variation distance of the drawn length mix vs the dataset's),
  `queue/put_total`, `queue/get_total` (cumulative counts).
- `eval/tau` (acceptance length from in-training evaluation; eval steps only).
- `gpu/{i}/util_pct`, `gpu/{i}/mem_used_gb`, `gpu/{i}/power_w`, `gpu/{i}/temp_c`
  (see `GpuTelemetry`).
"""

from dflash_train.metrics.logger import (
    METRICS_FILE,
    JsonlLogger,
    MetricsLogger,
    MultiLogger,
    NullLogger,
    TensorBoardLogger,
    WandbLogger,
    build_loggers,
    strip_secrets,
)
from dflash_train.metrics.telemetry import GpuTelemetry

__all__ = [
    "METRICS_FILE",
    "GpuTelemetry",
    "JsonlLogger",
    "MetricsLogger",
    "MultiLogger",
    "NullLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "build_loggers",
    "strip_secrets",
]
