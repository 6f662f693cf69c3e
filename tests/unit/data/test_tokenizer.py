"""Tokenizers: loading with clear errors, the mask-token rules, and the chat tokenizer builder
(offline reload, each family's special tokens and template)."""

from __future__ import annotations

import pytest

from dflash_train.data.tokenizer import (
    build_chat_tokenizer,
    load_chat_tokenizer,
    load_tokenizer,
    resolve_mask_token_id,
)

MSGS = [
    {"role": "system", "content": "Be exact."},
    {"role": "user", "content": "Count from 1 to 3."},
    {"role": "assistant", "content": "1, 2, 3."},
]


def test_saved_tokenizer_reloads_offline_with_its_template_and_tokens(tmp_path, corpus):
    from transformers import AutoTokenizer

    from dflash_train.data.synthetic import corpus_texts

    built = build_chat_tokenizer(corpus_texts(corpus), tmp_path / "tok", vocab_size=512)
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    text = "Count from 17 to 42."
    assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert loaded.chat_template == built.chat_template
    assert len(loaded) == 512


def test_qwen3_style_has_chatml_turns_a_mask_token_and_im_end_as_eos(make_tokenizer):
    tok = make_tokenizer("qwen3")
    text = tok.apply_chat_template(MSGS, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nCount from 1 to 3.<|im_end|>\n"
        "<|im_start|>assistant\n1, 2, 3.<|im_end|>\n"
    )
    assert tok.eos_token == "<|im_end|>"
    assert tok.mask_token == "<|MASK|>"
    assert tok.convert_ids_to_tokens(tok("<|MASK|>")["input_ids"]) == ["<|MASK|>"]
    # Special tokens are single ids, never split into bytes.
    assert len(tok("<|im_start|><|im_end|>")["input_ids"]) == 2


def test_qwen3_thinking_off_writes_an_empty_think_block_in_turns_and_generation_prompt(
    make_tokenizer,
):
    tok = make_tokenizer("qwen3")
    empty_think = "<think>\n\n</think>\n\n"
    off = tok.apply_chat_template(MSGS, tokenize=False, enable_thinking=False)
    assert f"<|im_start|>assistant\n{empty_think}1, 2, 3.<|im_end|>" in off
    prompt = tok.apply_chat_template(
        MSGS[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert prompt.endswith(f"<|im_start|>assistant\n{empty_think}")
    on = tok.apply_chat_template(
        MSGS[:2], tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert on.endswith("<|im_start|>assistant\n")
    assert len(tok("<think></think>")["input_ids"]) == 2


def test_llama3_style_has_header_ids_bos_and_eot_and_no_mask_token(make_tokenizer):
    tok = make_tokenizer("llama3")
    text = tok.apply_chat_template(MSGS, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe exact.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nCount from 1 to 3.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n1, 2, 3.<|eot_id|>"
    )
    assert tok.eos_token == "<|eot_id|>" and tok.bos_token == "<|begin_of_text|>"
    assert tok.mask_token is None and tok.pad_token is None
    assert "<|reserved_special_token_0|>" in tok.get_vocab()
    # Like Llama 3, plain encoding prepends BOS (chat text is encoded without it).
    assert tok("hi")["input_ids"][0] == tok.bos_token_id
    assert tok("hi", add_special_tokens=False)["input_ids"][0] != tok.bos_token_id


@pytest.mark.parametrize("style", ["qwen3", "llama3"])
def test_templates_without_markers_render_the_same_text(make_tokenizer, style):
    marked, plain = make_tokenizer(style, True), make_tokenizer(style, False)
    assert "endgeneration" in marked.chat_template
    assert "endgeneration" not in plain.chat_template
    for kwargs in ({}, {"add_generation_prompt": True}):
        msgs = MSGS if not kwargs else MSGS[:2]
        assert marked.apply_chat_template(msgs, tokenize=False, **kwargs) == (
            plain.apply_chat_template(msgs, tokenize=False, **kwargs)
        )


def test_training_is_deterministic(tmp_path, corpus):
    from dflash_train.data.synthetic import corpus_texts

    texts = list(corpus_texts(corpus))
    a = build_chat_tokenizer(texts, tmp_path / "a", vocab_size=500)
    b = build_chat_tokenizer(texts, tmp_path / "b", vocab_size=500)
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (
        (tmp_path / "b" / "tokenizer.json").read_text()
    )


def test_role_names_are_single_tokens_even_when_the_texts_lack_them(tmp_path):
    tok = build_chat_tokenizer(["one two three"] * 50, tmp_path / "t", vocab_size=400)
    for role in ("system", "user", "assistant"):
        assert len(tok(role, add_special_tokens=False)["input_ids"]) == 1


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        build_chat_tokenizer(["abc"], tmp_path / "t", vocab_size=100)
    with pytest.raises(ValueError, match="non-empty text"):
        build_chat_tokenizer([], tmp_path / "t")
    with pytest.raises(ValueError, match="style"):
        build_chat_tokenizer(["abc"], tmp_path / "t", style="gpt2")


def test_loading_names_what_the_directory_lacks(tmp_path, make_tokenizer):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    # A model directory without tokenizer files: transformers would build an empty tokenizer.
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_tokenizer(tmp_path)
    tok = make_tokenizer("qwen3")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "plain")
    assert len(load_tokenizer(tmp_path / "plain")) == len(tok)
    with pytest.raises(ValueError, match="has no chat template"):
        load_chat_tokenizer(tmp_path / "plain")


def test_mask_token_rules(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def save_tok(name, extra):
        tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
        fast.add_special_tokens({"additional_special_tokens": extra})
        fast.save_pretrained(tmp_path / name)
        return tmp_path / name

    with_mask = save_tok("m", ["<|MASK|>"])
    assert resolve_mask_token_id(with_mask, 10) == (3, "tokenizer token <|MASK|>")
    plain = save_tok("p", [])
    assert resolve_mask_token_id(plain, 10) == (3, "first embedding row beyond the tokenizer")
    reserved = save_tok("r", ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"])
    assert resolve_mask_token_id(reserved, 5)[0] == 3
    with pytest.raises(ValueError, match="cannot choose a mask token"):
        resolve_mask_token_id(plain, 3)
    with pytest.raises(ValueError, match="not a row"):
        resolve_mask_token_id(None, 10, override=10)
    assert resolve_mask_token_id(None, 10, override=9) == (9, "given")
    # A model directory without tokenizer files: transformers would build an empty tokenizer and
    # row 0 would be "beyond" it; refuse instead and say how to proceed.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no tokenizer.*pass --mask-token-id"):
        resolve_mask_token_id(bare, 10)
