"""Assistant-only loss masks: exact on both template families, with and without markers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from dflash_train.data.chat import (
    ChatFormat,
    tokenizer_digest,
)
from dflash_train.data.formats import ConversationError

MULTI = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "Count from 1 to 3."},
    {"role": "assistant", "content": "1, 2, 3."},
    {"role": "user", "content": "assistant"},
    # Content equal to a header word: locating it must not match inside the header.
    {"role": "assistant", "content": "assistant"},
]
EOT = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _supervised_texts(tok, ids, mask) -> list[str]:
    return [tok.decode(ids[s:e].tolist()) for s, e in _runs(mask)]


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
@pytest.mark.parametrize("markers", [True, False])
@pytest.mark.parametrize("thinking", [None, False])
def test_mask_is_exactly_each_assistant_turn_plus_its_end_of_turn_token(
    make_tokenizer, style, markers, thinking
):
    tok = make_tokenizer(style, markers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # llama3 has no thinking switch: warned, tested below
        fmt = ChatFormat(tok, enable_thinking=thinking)
    ids, mask = fmt.encode(MULTI)
    assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
    expected = [m["content"] + EOT[style] for m in MULTI if m["role"] == "assistant"]
    assert _supervised_texts(tok, ids, mask) == expected
    # Everything else, decoded, is the template around the turns: no assistant text leaks out.
    unsupervised = tok.decode(ids[mask == 0].tolist())
    assert "1, 2, 3." not in unsupervised and unsupervised.count(EOT[style]) == 3
    if thinking is False and style == "qwen3":
        assert "<think>" in unsupervised


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
def test_marker_and_prefix_diff_masks_agree_on_the_synthetic_corpus(make_tokenizer, corpus, style):
    marked = ChatFormat(make_tokenizer(style, True))
    plain = ChatFormat(make_tokenizer(style, False))
    assert (marked.mask_method, plain.mask_method) == ("generation_markers", "prefix_diff")
    for row in corpus[:150]:
        a_ids, a_mask = marked.encode(row["messages"])
        b_ids, b_mask = plain.encode(row["messages"])
        assert np.array_equal(a_ids, b_ids)
        assert np.array_equal(a_mask, b_mask), row


@pytest.mark.parametrize("markers", [True, False])
def test_whitespace_merged_with_the_header_newline_is_not_supervised(make_tokenizer, markers):
    tok = make_tokenizer("qwen3", markers)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\nred"}]
    ids, mask = ChatFormat(tok).encode(msgs)
    tokens = tok.convert_ids_to_tokens(ids.tolist())
    merged = tokens.index("\u010a\u010a")  # byte-level "\n\n": header newline + content newline
    assert mask[merged] == 0
    assert tok.decode(ids[mask == 1].tolist()) == "red<|im_end|>"
    if markers:
        # transformers marks every token overlapping the span, the merged one included.
        theirs = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
        assert theirs["input_ids"] == ids.tolist()
        assert theirs["assistant_masks"][merged] == 1
        differ = np.flatnonzero(np.asarray(theirs["assistant_masks"]) != mask)
        assert differ.tolist() == [merged]


def markers_before_end_of_turn(marked: str = "m.role == 'assistant'") -> str:
    """A qwen3-style template whose {% generation %} markers close before <|im_end|>, around the
    turns where `marked` holds."""
    return (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        f"{{% if {marked} %}}{{% generation %}}{{{{ m.content }}}}{{% endgeneration %}}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def test_end_of_turn_token_is_supervised_when_markers_stop_before_it(make_tokenizer):
    tok = make_tokenizer("qwen3")
    fmt = ChatFormat(tok, chat_template=markers_before_end_of_turn())
    assert fmt.end_of_turn == "<|im_end|>"
    ids, mask = fmt.encode(MULTI)
    assert _supervised_texts(tok, ids, mask) == ["1, 2, 3.<|im_end|>", "assistant<|im_end|>"]


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
@pytest.mark.parametrize("markers", [True, False])
def test_an_answer_cut_at_the_token_limit_does_not_supervise_its_end_of_turn(
    make_tokenizer, style, markers
):
    # Its generator stopped at --max-new-tokens: the end-of-turn token after it was written by
    # the template, never generated, so the drafter must not learn to predict it there.
    tok = make_tokenizer(style, markers)
    fmt = ChatFormat(tok)
    first, last = (i for i, m in enumerate(MULTI) if m["role"] == "assistant")
    whole = fmt.encode_rendered([fmt.render(MULTI)])[0]
    for cut, want in (
        ({last}, ["1, 2, 3." + EOT[style], "assistant"]),
        ({first}, ["1, 2, 3.", "assistant" + EOT[style]]),
        ({first, last}, ["1, 2, 3.", "assistant"]),
    ):
        ids, mask = fmt.encode_rendered([fmt.render(MULTI, cut=cut)])[0]
        assert np.array_equal(ids, whole[0])  # the same tokens, only the mask differs
        assert _supervised_texts(tok, ids, mask) == want, cut
        assert mask.sum() == whole[1].sum() - len(cut)


@pytest.mark.parametrize("markers", [True, False])
def test_a_generated_answer_trains_on_its_ids_after_its_generation_prompt(make_tokenizer, markers):
    # The ids the model generated, not its decoded text tokenised again: here ids that no
    # tokenisation of their text gives (one character per token, a special token inside).
    tok = make_tokenizer("qwen3", markers)
    fmt = ChatFormat(tok)
    history = MULTI[:-1]
    messages = [*history, {"role": "assistant", "content": "abc"}]
    generated = (
        *tok.convert_tokens_to_ids(list("abc")),
        tok.convert_tokens_to_ids("<|im_end|>"),
    )
    whole = fmt.encode_rendered([fmt.render(messages)])[0]
    ids, mask = fmt.encode_rendered([fmt.render_generated(messages, generated)])[0]
    prompt = fmt.prompt_ids(history)
    assert np.array_equal(ids, np.concatenate([prompt, generated]))
    assert mask[len(prompt) :].all()
    # The turns before keep their text supervision, as a whole rendering gives it.
    before = _supervised_texts(tok, ids[: len(prompt)], mask[: len(prompt)])
    assert before == ["1, 2, 3.<|im_end|>"]
    assert np.array_equal(ids[: len(prompt)], whole[0][: len(prompt)])
    # Refused, each in one line: ids that do not decode to the text (another tokenizer's), and
    # ids generated after another thinking switch's prompt.
    for bad, thinking, says, kind in (
        (generated[1:], None, "do not decode to the last answer's text", "bad token_ids"),
        (
            generated,
            False,
            "generated with thinking off, and this prepares with the template's",
            "thinking mismatch",
        ),
    ):
        with pytest.raises(ConversationError, match=says) as e:
            fmt.render_generated(messages, bad, thinking=thinking)
        assert e.value.kind == kind
    on = ChatFormat(tok, enable_thinking=True)
    assert on.render_generated(messages, generated, thinking=True).answer_ids == generated
    # An id past the tokenizer's tokens is still the target's (embeddings padded past the
    # tokenizer: a random target generates them): kept; train checks ids against the target.
    padded = (*generated[:-1], len(tok) + 3, generated[-1])
    assert fmt.render_generated(messages, padded).answer_ids == padded
    # A turn that ends inside a character (the first byte of "é", then the stop token): decode
    # gives U+FFFD where a server's streaming detokenizer (vLLM's) writes nothing; accepted
    # there, at the end only.
    half = tok.convert_tokens_to_ids("Ã")  # byte 0xC3, byte-level BPE's symbol for it
    ends_in_half = (*generated[:-1], half, generated[-1])
    assert tok.decode(ends_in_half[:-1]) == "abc\ufffd"
    assert fmt.render_generated(messages, ends_in_half).answer_ids == ends_in_half
    inside = (*generated[:2], half, *generated[2:])
    with pytest.raises(ConversationError, match="do not decode to the last answer's text"):
        fmt.render_generated(messages, inside)


@pytest.mark.parametrize("markers", [True, False])
def test_a_single_turn_generated_answer_trains_on_its_ids(make_tokenizer, markers):
    """Regression: a one-turn row with ids (what regenerate writes for a prompt dataset) under a
    template without {% generation %} markers (Qwen3's and Llama 3's own) failed with a bare
    ValueError that --on-error skip did not catch: prepare stopped at the first row."""
    tok = make_tokenizer("qwen3", markers)
    fmt = ChatFormat(tok)
    history = [{"role": "user", "content": "Count from 1 to 3."}]
    messages = [*history, {"role": "assistant", "content": "abc"}]
    generated = (
        *tok.convert_tokens_to_ids(list("abc")),
        tok.convert_tokens_to_ids("<|im_end|>"),
    )
    ids, mask = fmt.encode_rendered([fmt.render_generated(messages, generated)])[0]
    prompt = fmt.prompt_ids(history)
    assert np.array_equal(ids, np.concatenate([prompt, generated]))
    assert mask[len(prompt) :].all() and not mask[: len(prompt)].any()


def test_markers_on_the_newest_turn_only_belong_to_it(make_tokenizer):
    # A template that marks only the last assistant turn: its one block is that turn's, so a cut
    # of the earlier turn changes nothing and a cut of the last one drops its end-of-turn.
    template = markers_before_end_of_turn("m.role == 'assistant' and loop.last")
    tok = make_tokenizer("qwen3")
    fmt = ChatFormat(tok, chat_template=template)
    assert fmt.mask_method == "generation_markers"
    first, last = (i for i, m in enumerate(MULTI) if m["role"] == "assistant")
    for cut, want in (((), ["assistant<|im_end|>"]), ({first}, ["assistant<|im_end|>"])):
        ids, mask = fmt.encode_rendered([fmt.render(MULTI, cut=cut)])[0]
        assert _supervised_texts(tok, ids, mask) == want
    ids, mask = fmt.encode_rendered([fmt.render(MULTI, cut={last})])[0]
    assert _supervised_texts(tok, ids, mask) == ["assistant"]


# Like Qwen3's own template: an empty think block is written for the newest assistant turn only,
# while the thinking-off generation prompt always ends with one. The prompt's header is then not
# what earlier turns repeat, and only the common part may precede their content.
NEWEST_TURN_THINK = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and loop.last %}<think>\n\n</think>\n\n{%- endif %}"
    "{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{%- endif %}"
)


# Like Qwen3's own template: an earlier assistant turn is written without its think block.
HISTORY_WITHOUT_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_an_earlier_turn_written_without_its_reasoning_is_context_and_not_found_later(
    make_tokenizer,
):
    # Qwen3's template shows an earlier answer without its think block: "red" there was
    # generated after "<think>r</think>", not after the text before it, so it is context (a
    # multi-turn thinking row was refused). Regression: the search for turn 1's content ran to
    # the end of the text, so a later turn with the same content took its span.
    tok = make_tokenizer("qwen3", False)
    fmt = ChatFormat(tok, chat_template=HISTORY_WITHOUT_THINK)
    answer = "<think>r</think>red"
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": answer},
    ]
    rendered = fmt.render(messages)
    assert [rendered.text[a:b] for a, b in rendered.spans] == [answer + "<|im_end|>"]
    assert rendered.text.index(answer) > rendered.text.index("b")  # the last turn's, not turn 1's
    assert rendered.context_turns == 1
    # The same with the last answer trained on its ids: the turns before keep their rendering.
    generated = (*tok.encode(answer), tok.convert_tokens_to_ids("<|im_end|>"))
    assert fmt.render_generated(messages, generated).context_turns == 1
    # A turn the template shows as written is supervised where it is.
    messages[1]["content"] = "red"
    rendered = fmt.render(messages)
    assert [rendered.text[a:b] for a, b in rendered.spans] == [
        "red<|im_end|>",
        answer + "<|im_end|>",
    ]
    assert rendered.context_turns == 0
    # Any other rewrite of an earlier turn is refused.
    upper = ChatFormat(
        tok, chat_template=HISTORY_WITHOUT_THINK.replace("[-1] }}", "[-1] | upper }}")
    )
    with pytest.raises(ConversationError, match="assistant turn 1 does not appear"):
        upper.render(messages)


# Like Qwen3's own template with thinking on: a last answer without "</think>" (cut inside its
# reasoning) is written after an empty think block the generation prompt does not hold.
THINKS_FOR_THE_LAST = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and loop.last and '</think>' not in m.content %}"
    "<think>\n\n</think>\n\n{%- endif %}"
    "{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_an_answer_cut_inside_its_reasoning_follows_its_generation_prompt(make_tokenizer):
    """Regression: the template writes an empty think block before an answer cut inside its
    reasoning; the row trained that answer after a think block the target never saw (it
    generated it right after the prompt)."""
    tok = make_tokenizer("qwen3", False)
    fmt = ChatFormat(tok, chat_template=THINKS_FOR_THE_LAST)
    history = [*MULTI[:3], {"role": "user", "content": "Why?"}]
    messages = [*history, {"role": "assistant", "content": "<think>\nBecause"}]
    last = len(messages) - 1
    rendered = fmt.render(messages, cut={last})
    prompt = fmt.prompt_text(history)
    assert rendered.text == prompt + "<think>\nBecause<|im_end|>"  # nothing before the answer
    assert [rendered.text[a:b] for a, b in rendered.spans] == [
        "1, 2, 3.<|im_end|>",
        "<think>\nBecause",
    ]
    ids, _ = fmt.encode_rendered([rendered])[0]
    assert np.array_equal(ids[: len(fmt.prompt_ids(history))], fmt.prompt_ids(history))
    # A finished answer with its reasoning is written as the model generated it: unchanged.
    messages[-1]["content"] = "<think>\nBecause</think>It is."
    rendered = fmt.render(messages)
    assert rendered.text == fmt.render_text(messages)
    assert rendered.text[slice(*rendered.spans[-1])] == "<think>\nBecause</think>It is.<|im_end|>"


def test_prefix_diff_handles_a_generation_prompt_longer_than_older_turn_headers(make_tokenizer):
    """The older turn stays supervised after "assistant\\n" although its generation prompt
    ended with thinking off's empty think block, which the template leaves out of older turns:
    the block holds no reasoning the answer followed, and thinking off's multi-turn rows would
    otherwise train on their last answer alone. The newest turn follows its prompt exactly."""
    tok = make_tokenizer("qwen3", False)
    fmt = ChatFormat(tok, chat_template=NEWEST_TURN_THINK)
    rendered = fmt.render(MULTI)
    ids, mask = fmt.encode_rendered([rendered])[0]
    assert _supervised_texts(tok, ids, mask) == ["1, 2, 3.<|im_end|>", "assistant<|im_end|>"]
    assert rendered.context_turns == 0
    assert "<think>" in tok.decode(ids[mask == 0].tolist())
    prompt = fmt.prompt_ids(MULTI[:-1])
    assert np.array_equal(ids[: len(prompt)], prompt) and mask[len(prompt)] == 1


def test_template_that_renders_earlier_turns_differently_is_refused(make_tokenizer):
    # Writes the number of messages first: no prefix of the conversation renders as a prefix.
    template = "{{ messages | length }}" + NEWEST_TURN_THINK
    fmt = ChatFormat(make_tokenizer("qwen3", False), chat_template=template)
    with pytest.raises(ConversationError, match="generation") as info:
        fmt.encode(MULTI)
    assert info.value.kind == "template error"


def test_template_that_rewrites_assistant_content_is_refused(make_tokenizer):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' %}{{ m.content | upper }}{% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fmt = ChatFormat(make_tokenizer("qwen3", False), chat_template=template)
    with pytest.raises(ConversationError, match="does not appear"):
        fmt.encode(MULTI)


def test_template_exceptions_become_conversation_errors(make_tokenizer):
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('system messages are not supported') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    fmt = ChatFormat(make_tokenizer("qwen3"), chat_template=template)
    with pytest.raises(ConversationError, match="system messages are not supported"):
        fmt.encode(MULTI)


def test_tokenizer_without_a_chat_template_is_a_clear_error(make_tokenizer):
    tok = make_tokenizer("qwen3")
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"no chat template.*--chat-template"):
        ChatFormat(tok)


def test_enable_thinking_warns_when_the_template_ignores_it(make_tokenizer):
    with pytest.warns(UserWarning, match="enable_thinking has no effect"):
        ChatFormat(make_tokenizer("llama3"), enable_thinking=False)


def test_truncation_keeps_the_first_max_length_tokens(make_tokenizer):
    fmt = ChatFormat(make_tokenizer("qwen3"))
    ids, mask = fmt.encode(MULTI)
    short_ids, short_mask = fmt.encode(MULTI, max_length=20)
    assert np.array_equal(short_ids, ids[:20]) and np.array_equal(short_mask, mask[:20])


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
@pytest.mark.parametrize("markers", [True, False])
def test_prompt_ids_are_exactly_the_tokens_before_the_first_supervised_token(
    make_tokenizer, style, markers
):
    fmt = ChatFormat(make_tokenizer(style, markers))
    ids, mask = fmt.encode(MULTI[:3])
    prompt = fmt.prompt_ids(MULTI[:2])
    first = int(np.argmax(mask))
    assert np.array_equal(prompt, ids[:first])


def test_stop_token_ids_hold_the_end_of_turn_token(make_tokenizer):
    tok = make_tokenizer("llama3")
    assert ChatFormat(tok).stop_token_ids == [tok.convert_tokens_to_ids("<|eot_id|>")]


def test_empty_assistant_content_supervises_only_the_end_of_turn_token(make_tokenizer):
    tok = make_tokenizer("qwen3", False)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]
    ids, mask = ChatFormat(tok).encode(msgs)
    assert tok.convert_ids_to_tokens(ids[mask == 1].tolist()) == ["<|im_end|>"]


@pytest.mark.parametrize("markers", [True, False])
def test_non_ascii_content_is_masked_whole(make_tokenizer, markers):
    tok = make_tokenizer("qwen3", markers)
    content = "caf\u00e9 \u2615 na\u00efve \u4f60\u597d"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    ids, mask = ChatFormat(tok).encode(msgs)
    assert _supervised_texts(tok, ids, mask) == [content + "<|im_end|>"]


def test_tokenizer_digest_follows_the_vocabulary_special_tokens_and_template(make_tokenizer):
    tok = make_tokenizer("qwen3")
    digest = tokenizer_digest(ChatFormat(tok))
    assert tokenizer_digest(ChatFormat(make_tokenizer("qwen3"))) == digest
    assert tokenizer_digest(ChatFormat(make_tokenizer("qwen3", False))) != digest  # template
    assert tokenizer_digest(ChatFormat(make_tokenizer("llama3"))) != digest  # vocabulary
    tok.pad_token = "<|im_start|>"  # same vocabulary and template, other special tokens
    assert tokenizer_digest(ChatFormat(tok)) != digest


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
@pytest.mark.parametrize("markers", [True, False])
def test_special_token_text_in_an_answer_is_plain_text(make_tokenizer, style, markers):
    """Regression: an answer whose text holds "<|im_end|>" (one explaining ChatML) trained on
    the special end-of-turn id in mid-answer; its model wrote plain-text tokens there (the
    special id would have ended its turn). The template's own tokens stay special, and so does
    a user turn's text: serving parses it the same way."""
    tok = make_tokenizer(style, markers)
    fmt = ChatFormat(tok)
    eot = EOT[style]
    answer = f"Write {eot} after <|begin_of_text|> the turn."
    question = f"What does {eot} do?"
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And?"},
        {"role": "assistant", "content": answer},
    ]
    ids, mask = fmt.encode(messages)
    eot_id = tok.convert_tokens_to_ids(eot)
    plain = tok(answer, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    runs = [ids[s:e].tolist() for s, e in _runs(mask)]
    assert runs == [[*plain, eot_id], [*plain, eot_id]]
    # Outside the answers: the template's end-of-turn tokens, and the user turn's.
    assert ids[mask == 0].tolist().count(eot_id) == 3
    assert tok.decode(ids.tolist()) == fmt.render_text(messages)
    # Rows without special-token text in their answers are tokenised in one piece, as before.
    rendered = fmt.render(MULTI)
    assert rendered.plain_spans == ()


def test_a_stop_token_inside_an_answer_is_never_supervised_where_it_stays_special(
    make_tokenizer, monkeypatch
):
    """Regression: a SentencePiece tokenizer (pieces tokenise with a space before each) had any
    answer holding special-token text refused (an HTML "<s>" stopped prepare); and a row trained
    on its ids supervised an earlier answer's "<|im_end|>" text as the end-of-turn id, teaching
    the drafter to end a draft in mid-answer. Where the special id stays, a stop token inside
    an answer is left unsupervised; the answer's other tokens and its end stay supervised."""
    tok = make_tokenizer("qwen3", False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    fmt = ChatFormat(tok)
    monkeypatch.setattr(fmt, "_splits_cleanly", False)
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Write <|im_end|> then stop."},
    ]
    ids, mask = fmt.encode(messages)
    (_, stop), (resume, end) = _runs(mask)  # the answer, around its inner stop token
    assert ids[stop] == eot and resume == stop + 1  # the inner one: unsupervised
    assert ids[end - 1] == eot  # the answer's own end: supervised
    # A row trained on its ids: an earlier answer's text is tokenised as served (special id),
    # that id unsupervised; the last answer's ids all supervised.
    plain = ChatFormat(tok)
    history = [*messages, {"role": "user", "content": "again"}]
    last = (*tok.convert_tokens_to_ids(list("ok")), eot)
    rows = [*history, {"role": "assistant", "content": "ok"}]
    ids, mask = plain.encode_rendered([plain.render_generated(rows, last)])[0]
    supervised_eot = [i for i in range(len(ids)) if ids[i] == eot and mask[i]]
    assert len(supervised_eot) == 2  # the earlier answer's end and the last answer's
    assert mask[-len(last) :].all()


def test_switches_that_give_the_same_generation_prompt_are_the_same_mode(make_tokenizer):
    """Regression: rows regenerated with --thinking on were refused by a prepare that left the
    switch unset (the template's default is thinking on): the values differ, the prompts not."""
    tok = make_tokenizer("qwen3", False)
    default, on, off = (ChatFormat(tok, enable_thinking=v) for v in (None, True, False))
    assert default.prompt_text(MULTI[:1]) == on.prompt_text(MULTI[:1])
    default.check_thinking(True, "the row was regenerated")
    on.check_thinking(None, "the row was regenerated")
    for fmt, row in ((off, None), (off, True), (default, False), (on, False)):
        with pytest.raises(ConversationError, match="thinking mode mismatch"):
            fmt.check_thinking(row, "the row was regenerated")


def test_a_think_tag_in_an_answer_stays_the_token_its_model_generates(make_tokenizer):
    # "<think>" is an added token, not a special one: the model generates it, and an answer that
    # also holds special-token text (tokenised as plain text) keeps it.
    tok = make_tokenizer("qwen3", False)
    fmt = ChatFormat(tok)
    answer = "<think>\nhm</think>Write <|im_end|>."
    ids, mask = fmt.encode(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    )
    supervised = tok.convert_ids_to_tokens(ids[mask == 1].tolist())
    assert supervised[0] == "<think>" and "</think>" in supervised
    assert supervised.count("<|im_end|>") == 1 and supervised[-1] == "<|im_end|>"


# Llama 2's: a space between the answer and the end-of-turn token.
SPACE_BEFORE_EOS = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{{ '[INST] ' + m.content + ' [/INST]' }}"
    "{% else %}{{ ' ' + m.content + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def test_an_end_of_turn_token_after_white_space_is_supervised(make_tokenizer):
    """Regression: the template writes a space before its end-of-turn token, the probe looked
    for the token right after the content only, and no row supervised an end of turn: the
    drafter never learnt where answers end, and nothing said so."""
    tok = make_tokenizer("llama3", False)
    fmt = ChatFormat(tok, chat_template=SPACE_BEFORE_EOS)
    assert fmt.end_of_turn == "<|eot_id|>"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1, 2, 3."}]
    rendered = fmt.render(messages)
    assert rendered.text[slice(*rendered.spans[0])] == "1, 2, 3. <|eot_id|>"
    ids, mask = fmt.encode_rendered([rendered])[0]
    assert ids[-1] == tok.convert_tokens_to_ids("<|eot_id|>") and mask[-1] == 1
    # Cut at its token limit: the content only, without the template's space.
    cut = fmt.render(messages, cut={1})
    assert cut.text[slice(*cut.spans[0])] == "1, 2, 3."


def test_a_template_without_an_end_of_turn_token_has_none(make_tokenizer):
    template = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # prepare says it; eval and regenerate need not
        fmt = ChatFormat(make_tokenizer("qwen3", False), chat_template=template)
    assert fmt.end_of_turn is None


def test_an_answer_stored_with_the_prompt_s_think_block_trains_after_the_prompt(make_tokenizer):
    """This project's Qwen3-style template writes thinking off's empty think block before every
    answer, a stored copy of it after that: the model generated what follows the prompt's."""
    tok = make_tokenizer("qwen3", False)
    fmt = ChatFormat(tok, enable_thinking=False)
    stored = "<think>\n\n</think>\n\n1, 2, 3."
    messages = [*MULTI[:-1], {"role": "assistant", "content": stored}]
    ids, mask = fmt.encode(messages)
    prompt = fmt.prompt_ids(MULTI[:-1])
    assert np.array_equal(ids[: len(prompt)], prompt)
    assert tok.decode(ids[len(prompt) :].tolist()) == "1, 2, 3.<|im_end|>\n"
    assert _supervised_texts(tok, ids, mask)[-1] == "1, 2, 3.<|im_end|>"
