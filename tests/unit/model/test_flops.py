"""The drafter's FLOP count by part, and the token share `--batch-cost flops` plans with (torch's
own count of a micro-step's matmuls is checked against the parts in tests/unit/bench)."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from dflash_train.model.flops import SHARE_STEP, TOKEN_PARTS, drafter_flop_parts, token_share
from dflash_train.model.target import draft_config_from_target

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936,
)  # fmt: skip


def drafter(**kw):
    return draft_config_from_target(Qwen3Config(**QWEN3_8B), 5, 16, 151935, **kw)


def test_what_grows_with_tokens_and_what_with_block_positions():
    cfg = drafter()
    short, long_ = (drafter_flop_parts(cfg, 2, seq, 512, 2 * 512 * 15) for seq in (1024, 4096))
    for part in TOKEN_PARTS:
        assert long_[part] == pytest.approx(4 * short[part])
    assert long_["queries"] == short["queries"] and long_["head"] == short["head"]
    fewer = drafter_flop_parts(cfg, 2, 1024, 256, 2 * 256 * 15)
    assert fewer["queries"] == pytest.approx(short["queries"] / 2)
    assert all(fewer[part] == short[part] for part in TOKEN_PARTS)


def test_a_sliding_layer_attends_at_most_its_window():
    seq, windowed = 16384, ["sliding_attention"] * 4 + ["full_attention"]
    full = drafter_flop_parts(drafter(), 1, seq, 512, 512 * 15)["attention"]
    slid = drafter(layer_types=windowed, sliding_window=2048)
    part = drafter_flop_parts(slid, 1, seq, 512, 512 * 15)["attention"]
    # Per query and layer: half the context, or the window, plus its block.
    assert part / full == pytest.approx((4 * (2048 + 16) + (seq / 2 + 16)) / (5 * (seq / 2 + 16)))


def test_the_token_share_is_the_token_parts_of_a_full_row_rounded():
    cfg = drafter()
    for longest, anchors in [(3072, 512), (32768, 512), (32768, 64)]:
        parts = drafter_flop_parts(cfg, 1, longest, anchors, anchors * 15)
        exact = sum(parts[p] for p in TOKEN_PARTS) / sum(parts.values())
        share = token_share(cfg, longest, anchors)
        assert share == pytest.approx(exact, abs=SHARE_STEP / 2)
        assert share == pytest.approx(round(share / SHARE_STEP) * SHARE_STEP)
    # An 8B drafter's work is mostly its block positions at chat lengths; less so at long
    # context with few anchors.
    assert token_share(cfg, 3072, 512) == 0.05
    assert token_share(cfg, 32768, 64) > 0.5
