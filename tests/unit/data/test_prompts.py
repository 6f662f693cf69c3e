"""Evaluation prompts: read from every conversation form, encoded as the chat template says."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dflash_train.data.chat import ChatFormat
from dflash_train.data.prompts import encode_prompts, read_prompts

MSGS = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "Count from 1 to 3."},
    {"role": "assistant", "content": "1, 2, 3."},
    {"role": "user", "content": "And back?"},
]


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


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
def test_encoded_prompts_are_the_rendered_generation_prompt_tokenised(make_tokenizer, style):
    tok = make_tokenizer(style)
    ids = encode_prompts(tok, [MSGS], len(tok))[0]
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert np.array_equal(ids.numpy(), ChatFormat(tok).prompt_ids(MSGS))


def test_thinking_off_adds_the_empty_think_block(make_tokenizer):
    tok = make_tokenizer("qwen3")
    on = encode_prompts(tok, [MSGS], len(tok), enable_thinking=True)[0]
    off = encode_prompts(tok, [MSGS], len(tok), enable_thinking=False)[0]
    assert torch.equal(encode_prompts(tok, [MSGS], len(tok))[0], on)  # the template's default: on
    assert tok.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not tok.decode(on).endswith("</think>\n\n")


def test_ids_beyond_the_target_vocabulary_are_refused(make_tokenizer):
    tok = make_tokenizer("qwen3")
    ids = encode_prompts(tok, [MSGS], len(tok))[0]
    with pytest.raises(ValueError, match="do not belong together"):
        encode_prompts(tok, [MSGS], int(ids.max()))
