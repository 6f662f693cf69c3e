"""What the GPU check should show on one H200 with its default shapes, and the figures table.

The ranges are reasoned from FLOPs and bandwidth, not measured (no GPU has run this code):
~790 TFLOP/s bf16 on an 8K matmul and ~4.3 TB/s device copy (read + write) on this H200.
The README's "What the GPU check should show" gives the arithmetic. A figure outside its
range is flagged (`LOW` / `HIGH`) in `figures.md` and listed in the summary's `out_of_range`;
it does not fail the check (the check fails on errors, time-outs and missing figures), it
says where to look.

Default shapes: drafter of the Qwen3-8B shape (hidden 4096, 32/8 heads of 128, MLP 12288,
vocab 151936) with 5 layers and 5 target features, batch 4 x 2048 tokens, 256 anchors of 16
per row (16,384 block positions, 15,360 supervised), Muon (5 Newton-Schulz steps, bf16).
"""

from __future__ import annotations

from typing import Any

# (part, figure) -> (low, high, unit). Seconds are the part's whole wall time, cold caches.
EXPECTED_H200: dict[tuple[str, str], tuple[float, float, str]] = {
    ("install", "seconds"): (2, 40, "s"),
    ("device", "seconds"): (5, 40, "s"),
    ("device", "matmul_tflops"): (650, 830, "TFLOP/s"),
    ("device", "copy_tb_s"): (3.5, 4.7, "TB/s"),
    ("device", "h2d_pinned_gb_s"): (35, 60, "GB/s"),
    ("device", "h2d_pageable_gb_s"): (5, 40, "GB/s"),
    ("step_flex", "seconds"): (30, 140, "s"),
    ("step_flex", "step_s"): (0.40, 1.00, "s"),
    ("step_flex", "tokens_per_s"): (15_000, 38_000, "tok/s"),
    ("step_flex", "warmup_s"): (10, 100, "s"),
    ("step_flex", "peak_gpu_mem_mb"): (8_000, 45_000, "MB"),
    ("step_flex", "flex_eager_calls"): (0, 0, "calls"),
    ("cuda_tests", "seconds"): (30, 170, "s"),
    ("cuda_tests", "failed"): (0, 0, "tests"),
    ("pipeline", "seconds"): (60, 170, "s"),
    ("pipeline", "target_tokens_per_s"): (15_000, 36_000, "tok/s"),
    ("pipeline", "drafter_supervised_tokens_per_s"): (6_000, 30_000, "tok/s"),
    ("pipeline", "host_syncs_per_step"): (0, 2, "syncs"),
    ("pipeline", "flex_eager_calls"): (0, 0, "calls"),
    ("pipeline", "warm_up_s"): (5, 120, "s"),
    ("step_blockwise", "seconds"): (15, 80, "s"),
    ("step_blockwise", "step_s"): (0.40, 1.30, "s"),
    ("step_blockwise", "tokens_per_s"): (12_000, 38_000, "tok/s"),
    ("step_compile", "seconds"): (40, 170, "s"),
    ("step_compile", "step_s"): (0.38, 0.95, "s"),
    ("step_compile", "warmup_s"): (20, 150, "s"),
}
"""The ranges, for an H200 and the check's default shapes only."""

SHOWN = ("mfu", "model_tflops_per_s", "mfu_of_measured_peak", "flex_traces", "passed", "skipped")
"""Figures shown without a range (their definition is being changed by other work, or they
are counts whose right value follows from the others)."""


def expected_for(gpu_name: str, default_shapes: bool) -> dict[tuple[str, str], tuple]:
    """The ranges that apply: the H200's with the default shapes, none elsewhere."""
    return EXPECTED_H200 if default_shapes and "H200" in gpu_name else {}


def out_of_range(
    parts: dict[str, dict[str, Any]], expected: dict[tuple[str, str], tuple]
) -> list[str]:
    """`part.figure = value (LOW|HIGH, expected lo-hi unit)` for each measured figure outside
    its range."""
    flags = []
    for (part, name), (lo, hi, unit) in expected.items():
        value = figure(parts.get(part, {}), name)
        if isinstance(value, (int, float)) and not lo <= value <= hi:
            word = "LOW" if value < lo else "HIGH"
            flags.append(f"{part}.{name} = {_num(value)} ({word}, expected {lo:g}-{hi:g} {unit})")
    return flags


def figure(record: dict[str, Any], name: str) -> Any:
    """A part's figure by name: its wall seconds, else what it measured."""
    if name == "seconds":
        return record.get("seconds")
    return (record.get("figures") or {}).get(name)


def render(summary: dict[str, Any], expected: dict[tuple[str, str], tuple]) -> str:
    """figures.md: per part, its status and time, then each figure against its range."""
    lines = [
        "# GPU check",
        "",
        f"{summary.get('gpu', '?')}; {summary.get('versions', '')}",
        f"passed: {summary.get('passed')}; wall {summary.get('seconds', 0):.0f}s "
        f"of {summary.get('budget_s', 0):.0f}s",
        "",
        "| part | status | figure | value | expected | flag |",
        "|---|---|---|---|---|---|",
    ]
    for name, record in summary.get("parts", {}).items():
        status = record.get("status", "?")
        if record.get("reason") and status != "passed":
            status += f": {record['reason']}"[:120]
        rows = [("seconds", record.get("seconds"))]
        rows += [(k, v) for k, v in (record.get("figures") or {}).items() if _shown(name, k)]
        for i, (fig, value) in enumerate(rows):
            rng = expected.get((name, fig))
            want = f"{rng[0]:g}-{rng[1]:g} {rng[2]}" if rng else ""
            flag = _flag(value, rng)
            lines.append(
                f"| {name if i == 0 else ''} | {status if i == 0 else ''} | {fig} | "
                f"{_num(value)} | {want} | {flag} |"
            )
    return "\n".join(lines) + "\n"


def _shown(part: str, name: str) -> bool:
    return (part, name) in EXPECTED_H200 or name in SHOWN


def _flag(value: Any, rng: tuple | None) -> str:
    if rng is None or not isinstance(value, (int, float)):
        return ""
    return "LOW" if value < rng[0] else "HIGH" if value > rng[1] else "ok"


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return "-" if value is None else str(value)
