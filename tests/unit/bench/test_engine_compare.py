"""The engine check's comparison (`bench/engine_compare.py`) on fabricated counts: agreement
passes, and each kind of injected mismatch is reported. No vLLM needed."""

from __future__ import annotations

import pytest

from dflash_train.bench.engine_compare import DrafterCheck, ProjectDecode, check_request

B = 4  # block size: every verify step drafts 3 tokens


LIMIT = 10  # --max-new-tokens of the cases below: eval's 4th cycle (9 tokens out) is a short block
NO_LIMIT = 100  # the same counts ending at a stop token instead: every eval block is full


def agreeing_case():
    """One prompt: the project's unclipped cycles [3, 1, 4, 2]; the engine returns 1 (prefill)
    + 3 + 1 + 4 + 1 = 10 tokens, its last step accepting 1 draft past the end (surplus 1)."""
    unclipped = [3, 1, 4, 2, 4]  # the unclipped run goes on past the engine's last step
    tokens = list(range(100, 110))
    project = ProjectDecode(
        eval_tokens=[tokens], eval_lengths=[[3, 1, 4, 1]], unclipped_lengths=[unclipped]
    )
    engine = {
        "tokens": tokens,
        "accepted": [2, 0, 3, 1],
        "drafted": [B - 1] * 4,
        "engine_tau": (3 + 1 + 4 + 2) / 4,
    }
    return engine, tokens, project


def run(engine, plain, project, max_new_tokens: int = LIMIT) -> DrafterCheck:
    req = check_request(
        engine["tokens"],
        engine["accepted"],
        engine["drafted"],
        engine["engine_tau"],
        plain,
        project,
        0,
        B,
        max_new_tokens,
    )
    return DrafterCheck("served", "as trained", True, [req])


@pytest.mark.parametrize("max_new_tokens", [LIMIT, NO_LIMIT])
def test_agreeing_counts_pass_and_the_tau_gap_is_the_one_the_counts_explain(max_new_tokens):
    check = run(*agreeing_case(), max_new_tokens)
    req = check.requests[0]
    assert check.passed and req.first_mismatch is None and req.eval_agrees
    assert req.surplus == 1
    # At the limit eval's 4th cycle ran on a block of 2 (free); before a stop token it was a
    # full block, which must be the engine's clipped by the surplus (2 - 1 = 1: it is).
    assert req.shared_cycles == (3 if max_new_tokens == LIMIT else 4)
    row = check.row()
    assert row["tau vLLM"] == pytest.approx(2.5)
    assert row["tau eval"] == pytest.approx(9 / 4)
    # 10 tokens: the engine counts 3+1+4+2 in 4 steps, eval 3+1+4+1 in 4 cycles: (1 + 0) / 4
    assert row["vLLM - eval"] == pytest.approx(row["explained"]) == pytest.approx(0.25)


def test_an_eval_full_block_cycle_that_differs_fails_even_with_the_same_tokens_out():
    engine, plain, project = agreeing_case()
    project.eval_lengths = [[3, 2, 3, 1]]  # same total, cycles 1 and 2 differ
    check = run(engine, plain, project)
    assert not check.passed and "eval's cycles differ" in check.problem()


def test_an_eval_last_full_block_not_clipped_by_the_surplus_fails():
    engine, plain, project = agreeing_case()
    project.eval_lengths = [[3, 1, 3, 2]]  # 10 tokens out, but cycle 2 is not the engine's 4
    assert not run(engine, plain, project, NO_LIMIT).passed


def test_one_step_accepting_differently_is_reported_at_that_step():
    engine, plain, project = agreeing_case()
    engine["accepted"] = [2, 1, 2, 1]  # step 1 accepts one more, step 2 one fewer: same total
    check = run(engine, plain, project)
    assert not check.passed
    assert check.requests[0].first_mismatch == 1
    assert check.mismatched_steps == 2
    assert "step 1 differs" in check.problem()


def test_an_output_that_is_not_greedy_fails_even_when_every_step_agrees():
    engine, plain, project = agreeing_case()
    engine["tokens"] = [*plain[:-1], 7]
    check = run(engine, plain, project)
    assert check.requests[0].first_mismatch is None
    assert not check.passed and "output != greedy" in check.problem()


def test_eval_cycles_that_are_not_the_engine_clipped_fail():
    engine, plain, project = agreeing_case()
    project.eval_lengths = [[3, 1, 4, 2]]  # eval unclipped: its tau would equal the engine's
    check = run(engine, plain, project)
    assert not check.passed and "eval's cycles differ" in check.problem()


def test_a_step_drafting_fewer_than_block_minus_one_fails():
    engine, plain, project = agreeing_case()
    engine["drafted"] = [3, 3, 2, 3]
    check = run(engine, plain, project)
    assert check.requests[0].first_mismatch == 2 and not check.passed


def test_a_missing_or_extra_step_fails():
    engine, plain, project = agreeing_case()
    project.unclipped_lengths = [[3, 1, 4]]  # the project ended a step earlier
    assert run(engine, plain, project).requests[0].first_mismatch == 3
    engine, plain, project = agreeing_case()
    engine["accepted"].append(0)  # an extra step after the response had ended
    engine["drafted"].append(B - 1)
    project.unclipped_lengths = [[3, 1, 4, 2, 1]]
    assert not run(engine, plain, project).passed


def test_a_reported_mean_that_is_not_the_steps_mean_fails():
    engine, plain, project = agreeing_case()
    engine["engine_tau"] += 0.01
    check = run(engine, plain, project)
    assert not check.passed and "reported tau differs" in check.problem()


def test_a_row_passes_only_when_every_prompt_agrees():
    good = run(*agreeing_case()).requests[0]
    engine, plain, project = agreeing_case()
    engine["accepted"] = [2, 0, 3, 0]
    bad = run(engine, plain, project).requests[0]
    check = DrafterCheck("served", "as trained", True, [good, bad, good])
    assert not check.passed and check.mismatched_requests == [1]
    assert check.row()["prompts agreeing"] == "2/3"
