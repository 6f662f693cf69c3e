"""Tokenizers: loading the target's, choosing the drafter's mask token, and small chat tokenizers
trained in seconds (tests and the demo need a real tokenizer and chat template without
downloading one).

`load_tokenizer` reads a Hugging Face tokenizer directory with one clear error for each way it
can be unusable; `load_chat_tokenizer` also requires a chat template (for encoding prompts).
`resolve_mask_token_id` picks the embedding row the drafter uses as its block mask token.

`build_chat_tokenizer` trains a byte-level BPE on the given texts (the `tokenizers` library),
wraps it in transformers' fast tokenizer class with a chat template in one of two families,
and saves it so that `AutoTokenizer.from_pretrained(out_dir)` reloads it offline:

- "qwen3": ChatML turns `<|im_start|>role\\n...<|im_end|>\\n`, eos `<|im_end|>`, pad
  `<|endoftext|>`, a `<|MASK|>` special token (the drafter's mask token), `<think>` / `</think>`
  as added tokens and Qwen3's `enable_thinking` switch (false: an empty think block opens every
  assistant turn and the generation prompt).
- "llama3": `<|begin_of_text|>` then `<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`
  turns (content trimmed, as Llama 3 does), eos `<|eot_id|>`, no pad and no mask token, but a few
  `<|reserved_special_token_N|>` tokens as real Llama 3 tokenizers have.

With `generation_markers=True` the template wraps each assistant turn's content AND its
end-of-turn token in `{% generation %}` markers; `False` gives the same text without markers, so
that the fallback mask derivation (prefix rendering) can be tested against the marked one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

# ============================================================================ loading


def load_tokenizer(path: str | Path) -> Any:
    """A Hugging Face tokenizer from a local directory, with a clear error when there is none."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"tokenizer {p} is a file, not a directory")
    if not p.is_dir():
        raise ValueError(f"tokenizer directory {p} does not exist")
    # transformers builds an empty tokenizer from config.json alone: look for real files first.
    if not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{p} has no tokenizer (none of {' / '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(p)
    except Exception as e:  # transformers raises many kinds here; one message for the user
        raise ValueError(f"cannot load a tokenizer from {p}: {e}") from e


def load_chat_tokenizer(path: str | Path, chat_template: str | None = None) -> Any:
    """`load_tokenizer` for encoding prompts: a tokenizer without a chat template is refused.
    `chat_template`: a template's text to use instead of the tokenizer's own (the one `prepare
    --chat-template` rendered the training rows with)."""
    tokenizer = load_tokenizer(path)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer in {path} has no chat template: prompts are tokenised with the "
            "target's chat template (add_generation_prompt=True)"
        )
    return tokenizer


# ============================================================================ mask token


def resolve_mask_token_id(
    tokenizer_dir: str | Path | None, vocab_rows: int, override: int | None = None
) -> tuple[int, str]:
    """The embedding row used as the block mask token, and how it was chosen.

    Order: an explicit id; the tokenizer's `<|MASK|>` (or its mask token); the first embedding
    row beyond the tokenizer (Qwen3 has spare rows); a reserved special token the tokenizer marks
    unused (Llama 3). Always < vocab_rows.
    """
    if override is not None:
        _check_row(override, vocab_rows, "mask_token_id")
        return override, "given"
    if tokenizer_dir is None:
        raise ValueError("mask_token_id not given and no tokenizer to derive it from")
    try:
        # load_tokenizer refuses a directory without tokenizer files: transformers would build
        # an empty tokenizer from config.json, and row len(tokenizer) would silently be chosen.
        tok = load_tokenizer(tokenizer_dir)
    except ValueError as e:
        raise ValueError(f"{e}; to choose the mask token without it, pass --mask-token-id") from e
    vocab = tok.get_vocab()
    for name in ("<|MASK|>", "<|mask|>", tok.mask_token):
        if name and name in vocab:
            _check_row(vocab[name], vocab_rows, f"mask token {name}")
            return vocab[name], f"tokenizer token {name}"
    if len(tok) < vocab_rows:
        return len(tok), "first embedding row beyond the tokenizer"
    reserved = sorted(
        (i, t)
        for t, i in vocab.items()
        if "reserved" in t and t.startswith("<|") and i < vocab_rows
    )
    if reserved:
        return reserved[0][0], f"reserved token {reserved[0][1]}"
    raise ValueError(
        f"cannot choose a mask token: the tokenizer has no <|MASK|> or mask token, fills all "
        f"{vocab_rows} embedding rows and has no reserved special tokens; pass --mask-token-id"
    )


def _check_row(token_id: int, vocab_rows: int, what: str) -> None:
    if not 0 <= token_id < vocab_rows:
        raise ValueError(
            f"{what} id {token_id} is not a row of the target's embedding ({vocab_rows} rows)"
        )


# ============================================================================ building

Style = Literal["qwen3", "llama3"]

# Pre-tokenisation regexes in the style of each family: Qwen splits every digit on its own (good
# for the synthetic counting data), Llama 3 groups up to three digits.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_LLAMA3_RESERVED = 8


def qwen3_chat_template(generation_markers: bool = True) -> str:
    """A ChatML template with Qwen3's `enable_thinking` switch (written for this project)."""
    gen_open, gen_close = _markers(generation_markers)
    think_off = (
        "{%- if enable_thinking is defined and enable_thinking is false %}"
        "{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}"
    )
    return (
        "{%- for message in messages %}"
        "{%- if message.role == 'assistant' %}"
        "{{- '<|im_start|>assistant\\n' }}"
        + think_off
        + gen_open
        + "{{- message.content + '<|im_end|>' }}"
        + gen_close
        + "{{- '\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}" + think_off + "{%- endif %}"
    )


def llama3_chat_template(generation_markers: bool = True) -> str:
    """A Llama-3-style template (header ids, trimmed content, `<|eot_id|>`), written here."""
    gen_open, gen_close = _markers(generation_markers)
    return (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
        "{%- if message.role == 'assistant' %}"
        + gen_open
        + "{{- (message.content | trim) + '<|eot_id|>' }}"
        + gen_close
        + "{%- else %}"
        "{{- (message.content | trim) + '<|eot_id|>' }}"
        "{%- endif %}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{%- endif %}"
    )


def _markers(on: bool) -> tuple[str, str]:
    return ("{%- generation %}", "{%- endgeneration %}") if on else ("", "")


def _style_spec(style: Style) -> dict[str, Any]:
    """Special tokens, added tokens, split regex and the tokenizer attributes of one family."""
    if style == "qwen3":
        return {
            "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"],
            # Qwen3 keeps the think tags as added but not special tokens: decoding keeps them.
            "added": ["<think>", "</think>"],
            "split": _QWEN_SPLIT,
            "attrs": {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|MASK|>",
                "extra_special_tokens": ["<|im_start|>"],
            },
            "bos": None,
        }
    if style == "llama3":
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(NUM_LLAMA3_RESERVED)]
        return {
            "special": [
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                *reserved,
            ],
            "added": [],
            "split": _LLAMA3_SPLIT,
            "attrs": {
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|eot_id|>",
                "extra_special_tokens": [
                    "<|end_of_text|>",
                    "<|start_header_id|>",
                    "<|end_header_id|>",
                    *reserved,
                ],
            },
            "bos": "<|begin_of_text|>",
        }
    raise ValueError(f"style must be 'qwen3' or 'llama3', got {style!r}")


def build_chat_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    *,
    vocab_size: int = 1024,
    style: Style = "qwen3",
    generation_markers: bool = True,
) -> Any:
    """Train a byte-level BPE on `texts`, attach a chat template, save it to `out_dir`.

    Returns the `PreTrainedTokenizerFast` (transformers' fast tokenizer class). `vocab_size`
    counts everything: the 256 byte symbols, the special tokens and the learned merges; the
    result can be smaller when the texts hold fewer distinct merges. Deterministic for the same
    texts and settings. Takes about a second per few MB of text.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = _style_spec(style)
    minimum = 256 + len(spec["special"]) + len(spec["added"]) + 1
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE with the {style} special "
            f"tokens needs at least {minimum}"
        )
    corpus = _with_template_words(texts)
    if not corpus:
        raise ValueError("build_chat_tokenizer needs at least one non-empty text to train on")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(spec["split"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(spec["added"]),
        special_tokens=spec["special"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    if spec["added"]:
        bpe.add_tokens(spec["added"])
    if spec["bos"] is not None:
        # Like Llama 3: encoding with add_special_tokens=True prepends BOS. Chat templates write
        # BOS themselves, which is why chat text is encoded with add_special_tokens=False.
        bos = spec["bos"]
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, bpe.token_to_id(bos))],
        )

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **spec["attrs"])
    template = qwen3_chat_template if style == "qwen3" else llama3_chat_template
    tokenizer.chat_template = template(generation_markers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    return tokenizer


def _with_template_words(texts: Iterable[str]) -> list[str]:
    """The training texts plus the words chat templates write around them (role names, header
    newlines), so that headers become a few tokens instead of one per byte."""
    corpus = [t for t in texts if t]
    if corpus:
        template_words = "system\nuser\nassistant\n\n"
        corpus += [template_words] * max(8, len(corpus) // 50)
    return corpus
