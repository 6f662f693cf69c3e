"""Conversation parsing: both forms, every kind of bad record, line-numbered reading."""

from __future__ import annotations

import json

import pytest

from dflash_train.data.formats import (
    BadLines,
    ConversationError,
    answer_ids,
    cut_turns,
    file_digest,
    generated_thinking,
    parse_conversation,
    prompt_messages,
    read_conversations,
    read_jsonl,
)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_openai_and_sharegpt_forms_normalise_to_the_same_messages():
    openai = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
        ]
    }
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "S"},
            {"from": "human", "value": "U"},
            {"from": "gpt", "value": "A"},
        ]
    }
    assert parse_conversation(openai) == parse_conversation(sharegpt) == openai["messages"]


def test_sharegpt_turns_spelled_with_role_and_content_are_accepted():
    row = {"conversations": [{"role": "user", "content": "U"}, {"from": "gpt", "value": "A"}]}
    assert [m["role"] for m in parse_conversation(row)] == ["user", "assistant"]


def test_prompt_rows_are_accepted_only_when_no_assistant_is_required():
    assert parse_conversation({"prompt": "P"}, require_assistant=False) == [
        {"role": "user", "content": "P"}
    ]
    with pytest.raises(ConversationError):
        parse_conversation({"prompt": "P"})


@pytest.mark.parametrize(
    ("record", "kind"),
    [
        ([1, 2], "not a JSON object"),
        ({"text": "x"}, "no conversation field"),
        ({"messages": []}, "empty conversation"),
        ({"messages": [{"role": "user"}]}, "bad turn"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "non-string content"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ],
)
def test_bad_records_raise_with_a_reason_kind(record, kind):
    with pytest.raises(ConversationError) as info:
        parse_conversation(record)
    assert info.value.kind == kind


def test_malformed_json_raises_with_file_and_line(tmp_path):
    path = _write(tmp_path / "d.jsonl", ['{"prompt": "a"}', "", "{oops"])
    with pytest.raises(ConversationError, match=r"d\.jsonl:3: malformed JSON"):
        list(read_jsonl(path))


def test_invalid_utf8_is_reported_as_a_bad_line_not_a_crash(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n{"prompt": "c"}\n')
    bad = []
    rows = list(read_jsonl(path, on_bad_line=bad.append))
    assert [n for n, _ in rows] == [1, 3]
    assert [(b.line, b.reason) for b in bad] == [(2, "not valid UTF-8")]


def test_read_conversations_fail_stops_at_the_first_bad_line_with_its_location(tmp_path):
    good = json.dumps(
        {"messages": [{"role": "user", "content": "u"}, {"role": "gpt", "content": "a"}]}
    )
    path = _write(tmp_path / "d.jsonl", [good, '{"messages": [{"role": "bot", "content": "x"}]}'])
    with pytest.raises(ConversationError, match=r"d\.jsonl:2: turn 0 has unknown role 'bot'"):
        list(read_conversations([path], require_assistant=True))


def test_read_conversations_skip_records_every_bad_line_and_keeps_the_good_ones(tmp_path):
    good = json.dumps(
        {"messages": [{"role": "user", "content": "u"}, {"role": "gpt", "content": "a"}]}
    )
    path = _write(
        tmp_path / "d.jsonl",
        [good, "{", '{"messages": []}', good, '{"conversations": [{"from": "human", "value": 3}]}'],
    )
    bad = BadLines()
    rows = list(read_conversations([path], require_assistant=True, on_error="skip", bad_lines=bad))
    assert [r.line for r in rows] == [1, 4]
    assert bad.counts() == {"malformed JSON": 1, "empty conversation": 1, "non-string content": 1}
    text = bad.summary()
    assert "skipped 3 line(s)" in text and "d.jsonl:5" in text


def test_bad_lines_summary_lists_only_the_first_few_locations(tmp_path):
    path = _write(tmp_path / "d.jsonl", ["{"] * 15)
    bad = BadLines()
    list(read_conversations([path], require_assistant=True, on_error="skip", bad_lines=bad))
    assert len(bad) == 15
    assert "... and 5 more" in bad.summary(limit=10)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list(read_jsonl(tmp_path / "nope.jsonl"))


def test_prompt_messages_stops_at_the_last_user_turn():
    msgs = [
        {"role": "user", "content": "1"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "3"},
        {"role": "assistant", "content": "4"},
    ]
    assert prompt_messages(msgs) == msgs[:3]


def test_file_digest_changes_with_content_and_counts_lines(tmp_path):
    a = _write(tmp_path / "a", ["x", "y"])
    digest, lines = file_digest(a)
    assert lines == 2
    _write(a, ["x", "z"])
    assert file_digest(a)[0] != digest


def test_finish_reasons_name_the_cut_turns_from_the_last_assistant_turn_back():
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert cut_turns({}, msgs) == frozenset()
    assert cut_turns({"finish_reasons": ["length", "stop"]}, msgs) == {1}
    assert cut_turns({"finish_reasons": ["stop", "length"]}, msgs) == {3}
    # --turns last: one reason, the final answer's.
    assert cut_turns({"finish_reasons": ["length"]}, msgs) == {3}
    assert cut_turns({"finish_reasons": ["stop"]}, msgs) == frozenset()
    for bad, says in (
        ("length", "must be a list of strings"),
        ([1], "must be a list of strings"),
        (["stop"] * 3, "names 3 generated turns, the conversation has 2 assistant turns"),
    ):
        with pytest.raises(ConversationError, match=says) as e:
            cut_turns({"finish_reasons": bad}, msgs)
        assert e.value.kind == "bad finish_reasons"


def test_read_conversations_carries_the_cut_turns_and_refuses_bad_finish_reasons(tmp_path):
    row = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    lines = [json.dumps({**row, "finish_reasons": r}) for r in (["length"], ["stop"], "x")]
    path = _write(tmp_path / "d.jsonl", [json.dumps(row), *lines])
    bad = BadLines()
    rows = list(read_conversations([path], require_assistant=True, on_error="skip", bad_lines=bad))
    assert [r.cut_turns for r in rows] == [frozenset(), {1}, frozenset()]
    assert bad.counts() == {"bad finish_reasons": 1} and "d.jsonl:4" in bad.summary()


def test_token_ids_give_the_last_answer_s_ids_and_are_checked():
    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    assert answer_ids({}, msgs) is None
    assert answer_ids({"token_ids": [[1, 2], [3, 4, 0]]}, msgs) == (3, 4, 0)
    assert answer_ids({"token_ids": [[3]], "finish_reasons": ["stop"]}, msgs) == (3,)
    for obj, says in (
        ({"token_ids": [3]}, "must be a list of lists"),
        ({"token_ids": [[3, -1]]}, "must be a list of lists"),
        ({"token_ids": [[3, True]]}, "must be a list of lists"),
        ({"token_ids": [[3]], "finish_reasons": ["stop", "stop"]}, "1 turns, 'finish_reasons' 2"),
    ):
        with pytest.raises(ConversationError, match=says) as e:
            answer_ids(obj, msgs)
        assert e.value.kind == "bad token_ids"
    with pytest.raises(ConversationError, match="does not end with an assistant turn"):
        answer_ids({"token_ids": [[3]]}, msgs[:3])


def test_the_thinking_switch_of_generated_ids_comes_from_regenerated_with():
    assert generated_thinking({}) is None
    assert generated_thinking({"regenerated_with": {"thinking": "on"}}) is True
    assert generated_thinking({"regenerated_with": {"thinking": "off"}}) is False
    assert generated_thinking({"regenerated_with": {"thinking": None}}) is None
    with pytest.raises(ConversationError, match="thinking 'maybe'"):
        generated_thinking({"regenerated_with": {"thinking": "maybe"}})


def test_rows_record_the_thinking_switch_they_were_regenerated_with(tmp_path):
    """Regression: a text row regenerate wrote (`regenerated_with.thinking`, no `token_ids`)
    carried no switch, so prepare trained it in whatever mode it was run with."""
    row = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    lines = [
        json.dumps(row),
        json.dumps({**row, "regenerated_with": {"thinking": "off"}}),
        json.dumps({**row, "regenerated_with": {"thinking": None}}),
        json.dumps({**row, "regenerated_with": {"model": "m"}}),
        json.dumps({**row, "token_ids": [[1]]}),
    ]
    rows = list(read_conversations([_write(tmp_path / "d.jsonl", lines)], require_assistant=True))
    got = [(r.thinking_recorded, r.generated_thinking) for r in rows]
    assert got == [(False, None), (True, False), (True, None), (False, None), (True, None)]


ASSISTANT_FIELDS = [
    ("reasoning_content", "The answer", "reasoning field"),
    ("reasoning", "The answer", "reasoning field"),
    ("thinking", "The answer", "reasoning field"),
    ("tool_calls", [{"type": "function", "function": {"name": "f"}}], "tool calls field"),
    ("function_call", {"name": "f", "arguments": "{}"}, "tool calls field"),
]


@pytest.mark.parametrize(("field", "value", "kind"), ASSISTANT_FIELDS)
def test_assistant_fields_the_template_renders_are_refused_for_training(field, value, kind):
    """Regression: fields other than content were dropped without a word: a row with its
    reasoning in `reasoning_content` trained on the answer alone, while the template renders the
    reasoning; a last turn that is a tool call supervised only an end-of-turn token."""
    turns = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    turns[1][field] = value
    for record in (
        {"messages": turns},
        {"conversations": [{"from": "human", "value": "u"}, {**turns[1]}]},
    ):
        with pytest.raises(ConversationError, match=f"turn 1 has '{field}'") as e:
            parse_conversation(record, for_training=True)
        assert e.value.kind == kind and "\n" not in str(e.value)
        # Prompts and regeneration do not train on the turn: they keep reading it.
        plain = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        assert parse_conversation(record) == plain
    if kind == "reasoning field":
        assert "put the reasoning into 'content' as the template renders it" in str(e.value)


def test_empty_placeholders_of_template_fields_are_accepted_for_training(tmp_path):
    # OpenAI exports write them on every message; a user turn's are not the model's.
    turns = [
        {"role": "user", "content": "u", "reasoning_content": "not the model's"},
        {
            "role": "assistant",
            "content": "a",
            "refusal": None,
            "function_call": None,
            "reasoning_content": None,
            "tool_calls": [],
        },
    ]
    assert [m["content"] for m in parse_conversation({"messages": turns}, for_training=True)] == [
        "u",
        "a",
    ]
    bad = {"messages": [turns[0], {**turns[1], "reasoning_content": "r"}]}
    path = _write(tmp_path / "d.jsonl", [json.dumps({"messages": turns}), json.dumps(bad)])
    lines = BadLines()
    rows = list(
        read_conversations(
            [path], require_assistant=True, on_error="skip", bad_lines=lines, for_training=True
        )
    )
    assert [r.line for r in rows] == [1] and lines.counts() == {"reasoning field": 1}
