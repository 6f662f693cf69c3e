"""Loss masks under a template with the behaviours of Qwen3's chat template
(qwen3_chat_template.jinja: this project's own, written to match them), which writes assistant
turns otherwise than their generation prompt: it drops the think block of turns before the last
user turn (thinking off's empty one included), normalises the newlines around `</think>`, and
writes an answer's think block once however it is stored."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dflash_train.data.chat import ChatFormat
from dflash_train.data.formats import ConversationError

QWEN3_TEMPLATE = (Path(__file__).parent / "qwen3_chat_template.jinja").read_text()

QUESTION = {"role": "user", "content": "Hello world"}
FOLLOW_UP = {"role": "user", "content": "Thanks! Continue."}


@pytest.fixture
def qwen3(make_tokenizer):
    """(tokenizer, ChatFormat with thinking off) under Qwen3's template."""
    tok = make_tokenizer("qwen3", False)
    return tok, ChatFormat(tok, chat_template=QWEN3_TEMPLATE, enable_thinking=False)


def _answer(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def test_earlier_answers_of_a_thinking_off_row_stay_supervised(qwen3):
    """The template writes an earlier answer right after "assistant\\n", while its model
    generated it after the generation prompt's empty think block: supervised there all the same
    (the block holds no reasoning the answer followed; as context, thinking off's multi-turn rows
    would train on their last answer alone). The last answer follows its generation prompt."""
    tok, fmt = qwen3
    messages = [QUESTION, _answer("The answer is 42."), FOLLOW_UP, _answer("Hello world.")]
    assert "assistant\nThe answer is 42." in fmt.render_text(messages)  # no think block there
    rendered = fmt.render(messages)
    assert rendered.context_turns == 0
    spans = [rendered.text[a:b] for a, b in rendered.spans]
    assert spans == ["The answer is 42.<|im_end|>", "Hello world.<|im_end|>"]
    ids, mask = fmt.encode_rendered([rendered])[0]
    prompt = fmt.prompt_ids(messages[:3])
    assert np.array_equal(ids[: len(prompt)], prompt) and mask[len(prompt)] == 1
    # The same with the last answer trained on its ids.
    generated = (*tok.encode("Hello world."), tok.convert_tokens_to_ids("<|im_end|>"))
    assert fmt.render_generated(messages, generated, thinking=False).context_turns == 0


def test_an_answer_stored_with_thinking_off_s_empty_think_block_trains_once(qwen3):
    """Regression: an answer stored with the empty think block its thinking-off prompt ends
    with was refused ("the template rewrites it; use a template with {% generation %}
    markers"), although the template writes that block once, as the model followed it."""
    tok, fmt = qwen3
    plain = [QUESTION, _answer("The answer is 42.")]
    stored = [QUESTION, _answer("<think>\n\n</think>\n\nThe answer is 42.")]
    ids, mask = fmt.encode(stored)
    assert np.array_equal(ids, fmt.encode(plain)[0]) and np.array_equal(mask, fmt.encode(plain)[1])
    prompt = fmt.prompt_ids([QUESTION])
    assert np.array_equal(ids[: len(prompt)], prompt) and mask[len(prompt) :].sum() > 0
    assert tok.decode(ids[mask == 1].tolist()) == "The answer is 42.<|im_end|>"


def test_a_thinking_answer_prepared_with_thinking_off_is_a_thinking_mode_mismatch(qwen3):
    """Regression: refused as "the template rewrites it; use a template with {% generation %}
    markers", which no template fixes: the answer was generated with thinking on."""
    _, fmt = qwen3
    messages = [QUESTION, _answer("<think>\nThe answer\n</think>\n\nThe answer is 42.")]
    with pytest.raises(ConversationError, match="thinking mode mismatch") as e:
        fmt.encode(messages)
    assert e.value.kind == "thinking mismatch" and "--enable-thinking" in str(e.value)
    # With thinking on the same answer is the model's: supervised whole, after the prompt.
    on = ChatFormat(fmt.tokenizer, chat_template=QWEN3_TEMPLATE, enable_thinking=True)
    rendered = on.render(messages)
    assert rendered.text[slice(*rendered.spans[0])] == messages[1]["content"] + "<|im_end|>"
