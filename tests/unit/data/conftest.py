"""Chat tokenizers trained on the synthetic corpus (about a second each, once per session)."""

from __future__ import annotations

import pytest

from dflash_train.data.synthetic import corpus_texts, synthetic_conversations
from dflash_train.data.tokenizer import build_chat_tokenizer


@pytest.fixture(scope="session")
def corpus():
    """Synthetic conversations: the tokenizers' training text and the tests' inputs."""
    return synthetic_conversations(300, seed=1)


@pytest.fixture(scope="session")
def make_tokenizer(tmp_path_factory, corpus):
    """Build (once) and load a tokenizer of a style, with or without generation markers."""
    from transformers import AutoTokenizer

    built = {}

    def make(style: str = "qwen3", markers: bool = True):
        key = (style, markers)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tok_{style}_{int(markers)}")
            build_chat_tokenizer(
                list(corpus_texts(corpus)),
                out,
                vocab_size=600,
                style=style,
                generation_markers=markers,
            )
            built[key] = out
        return AutoTokenizer.from_pretrained(built[key])

    return make
