"""Small random Qwen3 targets built from a config (tests, benchmarks, the demo's scaffolding)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_qwen3(
    path: str | Path,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = 256,
    max_position_embeddings: int = 4096,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.02,
    seed: int = 0,
) -> Path:
    """Write a randomly initialised Qwen3ForCausalLM (fp32 safetensors) to `path`.

    `initializer_range` ~ 1.5 / sqrt(hidden) gives logits on the scale of a trained model's (the
    transformers default 0.02 makes a narrow model's logits nearly flat).
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    p = Path(path)
    model.save_pretrained(p)
    return p
