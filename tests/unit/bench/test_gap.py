"""`bench gap`'s arithmetic: GSM8K-shaped rows and the split of a run's step into parts."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.bench.gap import (
    GSM8K_MAX,
    GSM8K_MIN,
    OFF_PATH,
    RUN_PARTS,
    gsm8k_like_rows,
    run_window,
)


def test_gsm8k_like_rows_have_gsm8k_lengths_and_a_supervised_answer():
    rows = gsm8k_like_rows(3000, vocab=2048, seed=1)
    lengths = np.array([len(ids) for ids, _ in rows])
    assert lengths.min() >= GSM8K_MIN and lengths.max() <= GSM8K_MAX
    assert 150 < np.median(lengths) < 230  # GSM8K train's chats: median ~186 tokens
    for ids, mask in rows[:50]:
        n = len(ids)
        assert ids.max() < 2047  # the last id is the mask token's
        supervised = int(mask.sum())
        assert 0.3 * n <= supervised <= 0.75 * n
        assert mask[n - supervised :].all()  # the answer: the row's tail


def marks(per_step: dict[str, float], wall: float, steps: int):
    """Timer totals and times after each of `steps` steps of a run whose every step took
    `wall` seconds and `per_step` seconds of each stage."""
    return [(wall * (i + 1), {k: v * (i + 1) for k, v in per_step.items()}) for i in range(steps)]


def test_the_parts_of_a_step_add_up_to_its_wall_time():
    per_step = {
        "drafter_forward_s": 0.3,
        "drafter_backward_s": 0.5,
        "drafter_micro_step_s": 0.9,
        "optimizer_s": 0.05,
        "drafter_apply_s": 0.06,
        "drafter_get_wait_s": 0.02,
        "drafter_rendezvous_s": 0.01,
        "drafter_listener_s": 0.004,
        "target_forward_s": 0.2,
    }
    w = run_window(marks(per_step, 1.1, 10), skip=3, drafters=1)
    assert w is not None and w.steps == 7
    assert w.wall_s == pytest.approx(1.1)
    assert w.parts["drafter forward + backward"] == pytest.approx(0.8)
    assert w.parts["host work in the micro-step"] == pytest.approx(0.1)
    assert w.parts["host work around the optimizer"] == pytest.approx(0.01)
    assert w.parts["unattributed"] == pytest.approx(1.1 - 0.9 - 0.06 - 0.02 - 0.01 - 0.004)
    assert sum(w.parts.values()) == pytest.approx(w.wall_s)
    assert w.off_path["target_forward_s"] == pytest.approx(0.2)
    assert set(w.off_path) == set(OFF_PATH)
    assert len(w.parts) == len(RUN_PARTS) + 1


def test_two_drafters_timers_are_summed_so_each_part_is_their_mean():
    per_step = {"drafter_forward_s": 2.0, "drafter_micro_step_s": 2.0, "drafter_get_wait_s": 0.4}
    w = run_window(marks(per_step, 1.5, 6), skip=1, drafters=2)
    assert w.parts["drafter forward + backward"] == pytest.approx(1.0)
    assert w.parts["waiting for features"] == pytest.approx(0.2)
    assert sum(w.parts.values()) == pytest.approx(1.5)


def test_too_few_steps_measure_nothing():
    assert run_window(marks({}, 1.0, 3), skip=2, drafters=1) is None


def test_the_window_starts_at_the_end_of_step_skip():
    # Steps of 1, 2, 3, ... seconds: the window of skip 1 is steps 2..5 (2+3+4+5 = 14 s).
    ends = [1.0, 3.0, 6.0, 10.0, 15.0]
    w = run_window([(t, {}) for t in ends], skip=1, drafters=1)
    assert w is not None and w.steps == 4 and w.wall_s == pytest.approx(14 / 4)


def test_a_window_with_step_1_is_refused():
    # Step 1 has no mark at its start (it holds the pipeline's start): skip 0 used to measure
    # steps 2..N under the title "steps 1-N".
    with pytest.raises(ValueError, match="skip must be >= 1"):
        run_window(marks({}, 1.0, 5), skip=0, drafters=1)
