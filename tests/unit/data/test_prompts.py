"""Evaluation prompts: read from every conversation form."""

from __future__ import annotations

import json

import pytest

from dflash_train.data.prompts import read_prompts


def test_prompt_files_take_the_last_user_turn_in_every_format(tmp_path):
    rows = [
        {"prompt": "hello"},
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "q1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "a2"},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = read_prompts(path)
    assert got[0] == [{"role": "user", "content": "hello"}]
    assert got[1][-1] == {"role": "user", "content": "q2"} and len(got[1]) == 4
    assert got[2] == [{"role": "user", "content": "hi"}]
    assert len(read_prompts(path, limit=2)) == 2


def test_an_empty_prompt_file_is_a_clear_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")


def test_a_bad_prompt_row_names_its_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt here"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_prompts(path)
