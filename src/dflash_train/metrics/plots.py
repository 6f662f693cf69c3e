"""The report's figures: one `PlotSpec` per question a person asks about a run.

Figures are built with matplotlib's object API (`Figure`, rendered by Agg when saved), so nothing
here touches pyplot's global state or needs a display.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from dflash_train.metrics.runlog import RunLog

STEP_LABEL = "optimizer step"

# Stage timings split by the thread that spends them: target-side stages and drafter-side stages
# run concurrently, so only stages of the same side add up to that side's time per step.
PRODUCER_STAGES = {
    "time/prefetch_s": "prefetch (data)",
    "time/target_forward_s": "target forward",
    "time/target_put_wait_s": "put wait (queue full)",
}
DRAFTER_STAGES = {
    "time/drafter_get_wait_s": "get wait (queue starved)",
    "time/drafter_forward_s": "drafter forward",
    "time/drafter_backward_s": "drafter backward",
    "time/optimizer_s": "optimizer",
    "time/grad_sync_s": "gradient sync",
}


@dataclass(frozen=True)
class PlotSpec:
    """A figure of the report, drawn when at least one logged key matches `requires`."""

    stem: str
    """PNG file name without extension."""
    title: str
    requires: str
    """Regex (re.search) over metric keys."""
    draw: Callable[[RunLog, Figure], None]


def _smooth(values: np.ndarray, points: int) -> np.ndarray:
    """Trailing exponential moving average over about `points` samples; NaNs are held over."""
    alpha = 2.0 / (points + 1)
    out = np.empty_like(values)
    acc = np.nan
    for i, v in enumerate(values):
        if np.isfinite(v):
            acc = v if np.isnan(acc) else alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


# Below this many points every point is readable as is; above it a noisy series gets a faint raw
# line plus an EMA over about 1/25 of the run.
_SMOOTH_MIN_POINTS = 100


def _line(
    ax: Axes, run: RunLog, key: str, label: str, *, smooth: bool = False, color: str | None = None
) -> bool:
    """Plot `key` over steps; `smooth` adds an EMA for noisy, long series. False if not logged."""
    steps, values = run.series(key)
    if steps.size == 0:
        return False
    if smooth and steps.size >= _SMOOTH_MIN_POINTS:
        (raw,) = ax.plot(steps, values, alpha=0.3, linewidth=0.8, color=color)
        ax.plot(steps, _smooth(values, steps.size // 25), color=raw.get_color(),
                label=f"{label} (smoothed; faint: raw)")  # fmt: skip
    else:
        ax.plot(steps, values, label=label, color=color, marker="." if steps.size < 50 else None)
    return True


def _legend(*axes: Axes) -> None:
    handles, labels = [], []
    for ax in axes:
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    if handles:
        axes[0].legend(handles, labels, loc="best", fontsize="small")


def _panel(ax: Axes, run: RunLog, key: str, label: str, ylabel: str, color: str) -> None:
    """One series on its own axes, or a "not logged" mark so the layout stays the same."""
    ax.set_xlabel(STEP_LABEL)
    ax.set_title(label)
    if _line(ax, run, key, label, smooth=True, color=color):
        ax.set_ylabel(ylabel)
    else:
        ax.text(0.5, 0.5, f"{key} not logged", ha="center", va="center", transform=ax.transAxes)


def _draw_loss_tau(run: RunLog, fig: Figure) -> None:
    left, right = fig.subplots(1, 2)
    _panel(left, run, "train/loss", "training loss", "weighted cross-entropy (nats)", "tab:blue")
    _panel(right, run, "train/tau_est", "estimated acceptance length", "tau (tokens per draft)",
           "tab:orange")  # fmt: skip
    _legend(left)
    _legend(right)


def _draw_eval_tau(run: RunLog, fig: Figure) -> None:
    ax = fig.add_subplot()
    steps, values = run.series("eval/tau")
    ax.plot(steps, values, marker="o", color="tab:green", label="eval tau (speculative decoding)")
    if run.matching(r"^train/tau_est$"):
        s, v = run.series("train/tau_est")
        ax.plot(s, v, color="tab:orange", alpha=0.6, linestyle="--", linewidth=1,
                label="training estimate (train/tau_est)")  # fmt: skip
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel("acceptance length tau (tokens per draft)")
    _legend(ax)


def _draw_throughput(run: RunLog, fig: Figure) -> None:
    left, right = fig.subplots(1, 2)
    _panel(left, run, "train/tokens_per_s", "trained tokens/s (padding excluded)",
           "tokens per second", "tab:blue")  # fmt: skip
    _panel(right, run, "train/seqs_per_s", "sequences/s", "sequences per second", "tab:purple")
    for ax in (left, right):
        ax.set_ylim(bottom=0)
        _legend(ax)


def _log_scale_if_positive(ax: Axes, values: np.ndarray) -> None:
    """Log y axis for a positive series: spikes span decades, the baseline stays visible."""
    finite = values[np.isfinite(values)]
    if finite.size == 0 or finite.min() <= 0:
        return
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")  # "0.6", "2" instead of "6x10^-1"
    ax.yaxis.set_major_formatter(plain)
    # Label the 2..9 minor ticks only when they are few (range within ~1.5 decades).
    few = np.log10(finite.max() / finite.min()) <= 1.5
    ax.yaxis.set_minor_formatter(plain if few else NullFormatter())


def _draw_optimizer(run: RunLog, fig: Figure) -> None:
    left, right = fig.subplots(1, 2)
    if _line(left, run, "train/lr", "learning rate", color="tab:blue"):
        left.set_title("learning rate")
        left.set_ylabel("learning rate")
        left.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if _line(right, run, "train/grad_norm", "gradient norm", smooth=True, color="tab:red"):
        right.set_title("gradient norm")
        right.set_ylabel("L2 norm")
        _log_scale_if_positive(right, run.series("train/grad_norm")[1])
    for ax in (left, right):
        ax.set_xlabel(STEP_LABEL)


def _draw_queue_depth(run: RunLog, fig: Figure) -> None:
    ax = fig.add_subplot()
    _line(ax, run, "queue/depth", "depth (batches ready)", color="tab:blue")
    max_depth = run.config_value("pipeline.hs_queue_depth")
    min_ready = run.config_value("pipeline.hs_min_ready")
    if isinstance(max_depth, int | float):
        ax.axhline(max_depth, color="tab:red", linestyle="--", label=f"max depth ({max_depth})")
    if isinstance(min_ready, int | float):
        ax.axhline(min_ready, color="tab:orange", linestyle=":", label=f"min ready ({min_ready})")
    ax.set_ylim(bottom=0)
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel("hidden-state batches in queue")
    _legend(ax)


def _draw_bucket_depth(run: RunLog, fig: Figure) -> None:
    ax = fig.add_subplot()
    keys = run.matching(r"^queue/bucket\d+_depth$")
    steps = np.array([r["step"] for r in run.records if any(k in r for k in keys)])
    # Stacked on a common step axis; a bucket not logged at a step counts as empty there.
    rows = [[r.get(k) or 0.0 for r in run.records if any(k2 in r for k2 in keys)] for k in keys]
    labels = [f"bucket {k.removeprefix('queue/bucket').removesuffix('_depth')}" for k in keys]
    stack = np.array(rows, dtype=np.float64)
    ax.stackplot(steps, stack, labels=labels, alpha=0.85)
    # Headroom above the stack so the legend does not hide it.
    ax.set_ylim(0, 1.3 * max(float(stack.sum(axis=0).max(initial=0.0)), 1.0))
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel("batches in queue (stacked by length bucket)")
    ax.legend(loc="upper left", fontsize="small", ncols=min(len(keys), 4), title="shortest first")


def _draw_fractions(run: RunLog, fig: Figure, series: dict[str, str], ylabel: str) -> None:
    ax = fig.add_subplot()
    peak = 0.0
    for key, label in series.items():
        if _line(ax, run, key, label):
            peak = max(peak, float(np.nanmax(run.series(key)[1], initial=0.0)))
    # Fractions live in [0, 1], but small ones (a few percent) are what matters: zoom to the data.
    ax.set_ylim(0, min(1.0, max(0.1, 1.3 * peak)))
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(ylabel)
    _legend(ax)


def _draw_stalls(run: RunLog, fig: Figure) -> None:
    _draw_fractions(run, fig, {
        "queue/producer_blocked_frac": "target producers blocked (queue full)",
        "queue/consumer_starved_frac": "drafters starved (below min ready)",
        "queue/hol_wait_frac": "drafters waiting for their planned batch",
    }, "fraction of wall time in the log interval")  # fmt: skip


def _draw_batch_mix(run: RunLog, fig: Figure) -> None:
    _draw_fractions(run, fig, {
        "train/padding_frac": "padding fraction of batch tokens",
        "queue/mix_tv": "length mix drawn vs dataset (total variation)",
    }, "fraction (0 = ideal)")  # fmt: skip


def _stage_colors() -> dict[str, str]:
    """One colour per stage, shared by the stacked areas and the bars."""
    keys = [*PRODUCER_STAGES, *DRAFTER_STAGES]
    return {k: f"C{i}" for i, k in enumerate(keys)}


def _stack_stages(ax: Axes, run: RunLog, stages: dict[str, str], title: str) -> None:
    keys = [k for k in stages if k in run.logged_keys]
    ax.set_title(title)
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel("ms per event (batch, micro-batch or step)")
    if not keys:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        return
    recs = [r for r in run.records if any(k in r for k in keys)]
    steps = np.array([r["step"] for r in recs])
    rows = np.array([[1e3 * (r.get(k) or 0.0) for r in recs] for k in keys])  # seconds -> ms
    colors = _stage_colors()
    ax.stackplot(steps, rows, labels=[stages[k] for k in keys], colors=[colors[k] for k in keys])
    # Headroom above the stack so the legend does not hide it.
    ax.set_ylim(0, 1.45 * max(float(np.nanmax(rows.sum(axis=0), initial=0.0)), 1e-3))
    ax.legend(loc="upper left", fontsize="small", ncols=3)


def _draw_stage_times(run: RunLog, fig: Figure) -> None:
    fig.set_size_inches(13, 8)
    grid = fig.add_gridspec(2, 2, width_ratios=[3, 2])
    _stack_stages(fig.add_subplot(grid[0, 0]), run, PRODUCER_STAGES, "target side (producers)")
    _stack_stages(fig.add_subplot(grid[1, 0]), run, DRAFTER_STAGES, "drafter side (consumers)")
    bars = fig.add_subplot(grid[:, 1])
    colors = _stage_colors()
    names, means, bar_colors = [], [], []
    for side, stages in (("target", PRODUCER_STAGES), ("drafter", DRAFTER_STAGES)):
        for key, label in stages.items():
            values = run.series(key)[1]
            if values.size and np.isfinite(values).any():
                names.append(f"{side}: {label}")
                means.append(1e3 * float(np.nanmean(values)))
                bar_colors.append(colors[key])
    bars.barh(names[::-1], means[::-1], color=bar_colors[::-1])
    bars.set_xlabel("ms per event (the stage's own), mean over the run")
    bars.set_title("mean per stage")


def _draw_accuracy(run: RunLog, fig: Figure) -> None:
    ax = fig.add_subplot()
    keys = run.matching(r"^train/acc_k\d+$")
    positions = np.array([int(k.removeprefix("train/acc_k")) for k in keys])
    first = next((r for r in run.records if all(k in r for k in keys)), None)
    latest = run.latest(keys)
    width = 0.4
    if first is not None and latest is not None and first["step"] != latest[0]:
        vals = [np.nan if first[k] is None else first[k] for k in keys]
        ax.bar(positions - width / 2, vals, width, color="lightgray",
               label=f"first logged (step {first['step']})")  # fmt: skip
        offset = width / 2
    else:
        offset = 0.0
    if latest is not None:
        ax.bar(positions + offset, latest[1], width, color="tab:blue",
               label=f"latest (step {latest[0]})")  # fmt: skip
    ax.set_xticks(positions)
    ax.set_ylim(0, 1)
    ax.set_xlabel("position k inside the draft block (k = 1 follows the anchor)")
    ax.set_ylabel("top-1 accuracy on the block labels")
    _legend(ax)


GPU_PANELS = {
    "util_pct": ("GPU utilisation", "utilisation (%)"),
    "mem_used_gb": ("memory used", "memory used (GB)"),
    "power_w": ("power draw", "power (W)"),
    "temp_c": ("temperature", "temperature (deg C)"),
}


def _draw_gpu(run: RunLog, fig: Figure) -> None:
    fig.set_size_inches(12, 7)
    devices = sorted({int(k.split("/")[1]) for k in run.matching(r"^gpu/\d+/")})
    for ax, (name, (title, ylabel)) in zip(
        fig.subplots(2, 2).flat, GPU_PANELS.items(), strict=True
    ):
        for d in devices:
            steps, values = run.series(f"gpu/{d}/{name}")
            if steps.size:
                ax.plot(steps, values, label=f"GPU {d}", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(ylabel)
        if name == "util_pct":
            ax.set_ylim(0, 105)
        _legend(ax)


PLOTS: list[PlotSpec] = [
    PlotSpec("loss_tau", "Training loss and estimated acceptance length",
             r"^train/(loss|tau_est)$", _draw_loss_tau),
    PlotSpec("eval_tau", "Evaluation acceptance length", r"^eval/tau$", _draw_eval_tau),
    PlotSpec("throughput", "Training throughput", r"^train/(tokens|seqs)_per_s$",
             _draw_throughput),
    PlotSpec("optimizer", "Learning rate and gradient norm", r"^train/(lr|grad_norm)$",
             _draw_optimizer),
    PlotSpec("queue_depth", "Hidden-state queue depth", r"^queue/depth$", _draw_queue_depth),
    PlotSpec("bucket_depth", "Queue depth per length bucket", r"^queue/bucket\d+_depth$",
             _draw_bucket_depth),
    PlotSpec("queue_stalls", "Producers blocked and drafters starved",
             r"^queue/(producer_blocked|consumer_starved|hol_wait)_frac$", _draw_stalls),
    PlotSpec("batch_mix", "Padding and length mix", r"^(train/padding_frac|queue/mix_tv)$",
             _draw_batch_mix),
    PlotSpec("stage_times", "Time per pipeline stage", r"^time/", _draw_stage_times),
    PlotSpec("accuracy", "Accuracy per block position", r"^train/acc_k\d+$", _draw_accuracy),
    PlotSpec("gpu", "GPU telemetry", r"^gpu/\d+/", _draw_gpu),
]  # fmt: skip
"""The report's figures, in page order."""


def build_figure(spec: PlotSpec, run: RunLog) -> Figure:
    """A new figure for `spec` (the caller checked `run.matching(spec.requires)`)."""
    fig = Figure(figsize=(10, 4.8), layout="constrained")
    spec.draw(run, fig)
    fig.suptitle(spec.title, fontsize="large", fontweight="bold")
    return fig
