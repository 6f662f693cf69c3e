"""Regeneration bookkeeping: which turns are regenerated, and the resumable output file."""

from __future__ import annotations

import json

import pytest

from dflash_train.data.formats import ConversationError
from dflash_train.data.generation import Completion, RowError, RowJob, _parse_completion
from dflash_train.data.regenerate import OutputFile

S = {"role": "system", "content": "s"}
U1, U2 = {"role": "user", "content": "u1"}, {"role": "user", "content": "u2"}
A1, A2 = {"role": "assistant", "content": "a1"}, {"role": "assistant", "content": "a2"}
SETTINGS = {"model": "m", "temperature": 0.0}


@pytest.mark.parametrize(
    ("messages", "turns"),
    [
        ([S, U1, A1, U2, A2], [S, U1, None, U2, None]),
        ([U1], [U1, None]),
        ([U1, A1, U2], [U1, None, U2, None]),
        ([A1, U1, A2], [U1, None]),  # an assistant turn answering nothing is dropped
        ([U1, A1, A2], [U1, None]),
        ([U1, U2, A1], [U1, U2, None]),
    ],
)
def test_all_mode_regenerates_every_answer_to_a_user_turn(messages, turns):
    assert RowJob.from_messages(7, messages, "all").turns == turns


def test_last_mode_keeps_the_history_verbatim():
    assert RowJob.from_messages(1, [S, U1, A1, U2, A2], "last").turns == [S, U1, A1, U2, None]


def test_a_conversation_without_a_user_turn_is_refused():
    with pytest.raises(ConversationError, match="no user turn"):
        RowJob.from_messages(1, [S, A1], "all")


def test_answers_fill_the_turns_in_order_and_condition_the_next_prompt():
    job = RowJob.from_messages(3, [U1, A1, U2, A2], "all")
    assert job.next_prompt() == [U1]
    job.add(Completion("new1", "stop"))
    assert job.next_prompt() == [U1, {"role": "assistant", "content": "new1"}, U2]
    job.add(Completion("new2", "length"))
    assert job.done
    row = job.output(SETTINGS)
    assert row["source_line"] == 3 and row["finish_reasons"] == ["stop", "length"]
    assert [m["content"] for m in row["messages"]] == ["u1", "new1", "u2", "new2"]
    assert "token_ids" not in row  # a text-only back end: nothing to train on exactly


def test_generated_ids_are_written_beside_the_text_when_every_turn_has_them():
    job = RowJob.from_messages(3, [U1, A1, U2, A2], "all")
    job.add(Completion("new1", "stop", [5, 6, 2]))
    job.add(Completion("new2", "length", [7, 8]))
    row = job.output(SETTINGS)
    assert row["token_ids"] == [[5, 6, 2], [7, 8]] and row["finish_reasons"] == ["stop", "length"]
    assert list(row)[-1] == "regenerated_with"


def _row(line, settings=SETTINGS):
    return json.dumps({"messages": [], "source_line": line, "regenerated_with": settings}) + "\n"


def test_output_file_resumes_and_drops_a_partially_written_last_row(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(_row(1) + _row(4) + _row(2)[:17])
    out = OutputFile(path, SETTINGS, overwrite=False)
    assert out.done == {1, 4}
    out.write({"messages": [], "source_line": 2, "regenerated_with": SETTINGS})
    out.close()
    lines = path.read_text().splitlines()
    assert [json.loads(x)["source_line"] for x in lines] == [1, 4, 2]


def test_output_file_refuses_rows_written_with_other_settings(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(_row(1, {"model": "m", "temperature": 0.7}))
    with pytest.raises(ValueError, match=r"other settings or inputs \(temperature differ\)"):
        OutputFile(path, SETTINGS, overwrite=False)
    out = OutputFile(path, SETTINGS, overwrite=True)
    assert out.done == set()
    out.close()
    assert path.read_text() == ""


@pytest.mark.parametrize("content", ["not json\n", '{"messages": []}\n'])
def test_output_file_refuses_a_file_it_did_not_write(tmp_path, content):
    path = tmp_path / "out.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match="not a row written by `regenerate`"):
        OutputFile(path, SETTINGS, overwrite=False)
    # Regression: --overwrite deleted it (a dataset given as --out, the input file itself).
    with pytest.raises(ValueError, match="--overwrite replaces only those"):
        OutputFile(path, SETTINGS, overwrite=True)
    assert path.read_text() == content


def test_regenerate_refuses_its_input_as_its_output(tmp_path):
    """Regression: `--out` the `--data` file with --overwrite emptied the input and said
    "0/2 rows done", exit 0."""
    from dflash_train.cli import main as cli

    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    before = data.read_text()
    argv = ["regenerate", "--data", str(data), "--out", str(data), "--overwrite"]
    assert cli([*argv, "--endpoint", "http://127.0.0.1:9"]) == 2
    assert data.read_text() == before


def test_output_file_refuses_duplicate_rows(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text(_row(1) + _row(1))
    with pytest.raises(ValueError, match="repeats input line 1"):
        OutputFile(path, SETTINGS, overwrite=False)


def test_server_reasoning_is_written_back_inline_as_a_think_block():
    response = {
        "choices": [
            {
                "message": {"content": "\nanswer", "reasoning_content": "\nsteps\n"},
                "finish_reason": "stop",
            }
        ]
    }
    completion = _parse_completion(response)
    assert completion.text == "<think>\nsteps\n</think>\n\nanswer"
    assert completion.finish_reason == "stop"


def test_server_reasoning_cut_at_the_token_limit_gets_no_closing_tag():
    """Regression: a turn cut inside its reasoning was written back closed ("</think>"), text
    the model never generated, and prepare supervised it."""
    message = {"content": None, "reasoning_content": "\nLet me think about"}
    completion = _parse_completion({"choices": [{"message": message, "finish_reason": "length"}]})
    assert completion.text == "<think>\nLet me think about"
    assert completion.finish_reason == "length"


@pytest.mark.parametrize("response", [{}, {"choices": []}, {"choices": [{"message": None}]}])
def test_malformed_server_responses_are_row_errors(response):
    with pytest.raises(RowError, match="unexpected chat-completions response"):
        _parse_completion(response)


def _local(on_error, answers, limit=None):
    """A local back end without a model: its prompts are 3 tokens, its answers `answers`."""
    from types import SimpleNamespace

    from dflash_train.data.generation import GenerationSettings, LocalBackend

    backend = object.__new__(LocalBackend)
    backend.generation = GenerationSettings(0.0, 8, None, on_error)
    backend.fmt = SimpleNamespace(prompt_ids=lambda messages: [1, 2, 3])
    backend.limit = limit
    backend.generate = lambda prompts: answers[: len(prompts)]  # type: ignore[method-assign]
    return backend


@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_an_empty_local_answer_fails_its_row_and_the_batch_goes_on(on_error):
    """Regression: the local back end wrote an empty answer (the target's stop token at once) as
    the row's answer, and prepare dropped the row later without a word."""
    answers = [Completion("", "stop", [2]), Completion("yes", "stop", [7, 2])]
    backend = _local(on_error, answers)
    jobs = [RowJob.from_messages(n, [U1], "all") for n in (4, 5)]
    failures: list = []
    fatal = backend._run_batch(jobs, failures)
    failed = failures[0] if on_error == "skip" else fatal
    assert failed is not None and failed.source_line == 4
    assert failed.reason == "the answer is empty (finish_reason 'stop'): nothing to train on"
    assert not jobs[0].done
    assert jobs[1].done and jobs[1].turns[-1]["content"] == "yes"  # its answer is kept


def test_a_local_row_past_the_limit_is_warned_once_and_the_warning_joins_its_failure():
    answers = [Completion("", "stop", [2])]
    backend = _local("skip", answers, limit=(3, "its max_position_embeddings"))
    job = RowJob.from_messages(6, [U1], "all")
    failures: list = []
    backend._run_batch([job], failures)
    warning = (
        "its prompt (3 tokens) and answer (1) run past the target's maximum length 3 (its "
        "max_position_embeddings): the answer may be degraded"
    )
    assert job.warnings == [warning]
    assert failures[0].reason.endswith(f"nothing to train on; {warning}")
