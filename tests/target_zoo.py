"""A zoo of tiny random-weight targets, one per family users bring, built from transformers
configs (no downloads): plain causal LMs, MoE, MLA, sliding-window and hybrid linear-attention
models, and multimodal checkpoints whose text part is a causal LM.

`save_target(family, path, vocab_size=...)` writes a Hugging Face model directory; `FAMILIES`
names every family the trainer supports, `REFUSED` the ones it refuses on purpose (with the
message it gives). Shapes are tiny (hidden 64, 6 layers) so each family runs in seconds on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash_train.model.compat import family_supported

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 6, 4, 2, 16
# Logits on a trained model's scale (see `model.tiny.save_random_qwen3`), so greedy decoding
# does not collapse onto one token and drafts get accepted in part.
INIT = 1.5 / math.sqrt(HIDDEN)


def _dense(vocab: int) -> dict[str, Any]:
    return dict(
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=vocab,
        max_position_embeddings=4096,
        initializer_range=INIT,
        # Some families' defaults name ids beyond a tiny vocabulary; the tokenizer's count.
        bos_token_id=None,
        eos_token_id=None,
    )


def _linear_attention() -> dict[str, Any]:
    """Gated DeltaNet sizes of the hybrid Qwen models (every other layer linear here)."""
    return dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


def _moe(experts_key: str = "num_experts") -> dict[str, Any]:
    return {experts_key: 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _vision_qwen() -> dict[str, Any]:
    return dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN)


def _build(family: str, vocab: int, overrides: dict[str, Any]):
    """(model class, config) of one family; `overrides` replace or add (text) config fields."""
    import transformers as T

    d = {**_dense(vocab), **overrides}
    if family == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(**d)
    if family == "mistral":
        return T.MistralForCausalLM, T.MistralConfig(**d, head_dim=HEAD_DIM)
    if family == "qwen2":
        return T.Qwen2ForCausalLM, T.Qwen2Config(**d)
    if family == "olmo2":  # multi-head attention (one kv head per query head), as OLMo 2's
        return T.Olmo2ForCausalLM, T.Olmo2Config(**{**d, "num_key_value_heads": HEADS})
    if family == "phi3":
        return T.Phi3ForCausalLM, T.Phi3Config(**d, pad_token_id=0)
    if family == "qwen3_moe":
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(**d, head_dim=HEAD_DIM, **_moe())
    if family == "glm4_moe":
        cfg = T.Glm4MoeConfig(
            **d, head_dim=HEAD_DIM, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
        )  # fmt: skip
        return T.Glm4MoeForCausalLM, cfg
    if family == "qwen3_next":
        cfg = T.Qwen3NextConfig(
            **d, head_dim=HEAD_DIM, **_linear_attention(), **_moe(),
            shared_expert_intermediate_size=32, full_attention_interval=2,
        )  # fmt: skip
        return T.Qwen3NextForCausalLM, cfg
    if family == "qwen3_5":
        text = dict(d, head_dim=HEAD_DIM, **_linear_attention(), full_attention_interval=2)
        cfg = T.Qwen3_5Config(text_config=text, vision_config=_vision_qwen())
        return T.Qwen3_5ForConditionalGeneration, cfg
    if family == "qwen3_5_moe":
        text = dict(d, head_dim=HEAD_DIM, **_linear_attention(), **_moe())
        text.pop("intermediate_size")  # Qwen3.5 MoE configs have expert sizes only
        text.update(shared_expert_intermediate_size=32, full_attention_interval=2)
        cfg = T.Qwen3_5MoeConfig(text_config=text, vision_config=_vision_qwen())
        return T.Qwen3_5MoeForConditionalGeneration, cfg
    if family == "gemma3":
        text = dict(d, head_dim=HEAD_DIM, sliding_window=8, sliding_window_pattern=2)
        vision = dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            image_size=28, patch_size=14,
        )  # fmt: skip
        cfg = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        return T.Gemma3ForConditionalGeneration, cfg
    if family == "gemma3_text":
        cfg = T.Gemma3TextConfig(**d, head_dim=HEAD_DIM, sliding_window=8)
        return T.Gemma3ForCausalLM, cfg
    if family == "gpt_oss":
        cfg = T.GptOssConfig(**d, head_dim=HEAD_DIM, **_moe("num_local_experts"), sliding_window=8)
        return T.GptOssForCausalLM, cfg
    if family == "deepseek_v3":
        # kv heads below the query heads, as a tiny config may say: MLA ignores them.
        cfg = T.DeepseekV3Config(
            **d, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_group=1, topk_group=1,
        )  # fmt: skip
        return T.DeepseekV3ForCausalLM, cfg
    if family == "granite":  # not in FAMILIES: its logits are scaled after the head (a teacher
        # of the losses on the target's distribution is refused for it)
        return T.GraniteForCausalLM, T.GraniteConfig(**d, logits_scaling=4.0)
    raise KeyError(family)


FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "olmo2",
    "phi3",
    "qwen3_moe",
    "glm4_moe",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v3",
)
"""Every target family the trainer supports (`tests/unit/model/test_target_zoo.py`)."""

ROPE_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # DeepSeek-V3/R1's config.json: YaRN whose mscale pair makes transformers' factor 1.0.
    "deepseek_v3_yarn": ("deepseek_v3", dict(
        max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    )),
    # Kimi K2's (same MLA layout, model_type deepseek_v3).
    "kimi_k2_yarn": ("deepseek_v3", dict(
        max_position_embeddings=131072, rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    )),
    # Llama 3.1's.
    "llama3": ("llama", dict(
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    )),
    # Dynamic NTK (a rope_type some Llama fine-tunes use).
    "llama_dynamic": ("llama", dict(
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    )),
    # Gemma 3's (4B and up): per layer type, the full-attention layers' scaled linearly.
    "gemma3_linear": ("gemma3_text", dict(
        max_position_embeddings=131072,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    )),
    # gpt-oss's own default (YaRN with truncate false), at its real context length.
    "gpt_oss_yarn": ("gpt_oss", dict(max_position_embeddings=131072)),
    # Phi-3.5-mini's kind: longrope (short and long factors, one per rotated pair).
    "phi3_longrope": ("phi3", dict(
        max_position_embeddings=131072, original_max_position_embeddings=4096,
        rope_scaling={"type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3, 1.5, 2, 3, 4],
                      "long_factor": [1.0, 2, 4, 8, 12, 16, 24, 32]},
    )),
}  # fmt: skip
"""Targets whose RoPE is scaled as real checkpoints' is: (zoo family, `save_target` overrides)."""

SUPPORTED = tuple(f for f in FAMILIES if family_supported(f))
"""The families the installed transformers builds correctly (`model.compat`); the others are
refused in one line naming the release they need."""

WRAPPERS = {"qwen3_5", "qwen3_5_moe", "gemma3"}
"""Multimodal checkpoints whose text part is the causal LM."""
HYBRID = {"qwen3_next", "qwen3_5", "qwen3_5_moe"}
"""Targets with linear-attention layers (a recurrent state in the cache)."""


class Zoo:
    """Targets of the zoo under `root`, each written the first time it is asked for."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        if family not in self._paths:
            self._paths[family] = save_target(family, self.root / family)
        return self._paths[family]


def save_target(
    family: str, path: str | Path, *, vocab_size: int = 256, seed: int = 0, **overrides: Any
) -> Path:
    """Write a random `family` target to `path` (fp32 safetensors and config.json); `overrides`
    are (text) config fields, e.g. `max_position_embeddings` or `rope_scaling`."""
    cls, cfg = _build(family, vocab_size, overrides)
    torch.manual_seed(seed)
    model = cls(cfg)
    p = Path(path)
    model.save_pretrained(p)
    return p


def _save_config(make: Callable[[], Any], path: Path) -> Path:
    make().save_pretrained(path)
    return path


def save_refused(kind: str, path: str | Path) -> Path:
    """A model directory of a kind the trainer refuses on purpose (config only)."""
    import transformers as T

    makers = {
        "bert": lambda: T.BertConfig(num_hidden_layers=2, architectures=["BertModel"]),
        "t5": lambda: T.T5Config(num_layers=2, architectures=["T5ForConditionalGeneration"]),
        "clip": lambda: T.CLIPConfig(architectures=["CLIPModel"]),
    }
    return _save_config(makers[kind], Path(path))


REFUSED = {
    "bert": "not a causal language model",
    "t5": "not a causal language model",
    "clip": "not a causal language model",
}
"""Kinds refused on purpose, with the words of their one-line error: encoder-only,
encoder-decoder and vision models have no causal LM whose hidden states a drafter could use."""


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an MXFP4 nibble (OCP microscaling spec)."""


def save_mxfp4_gpt_oss(path: str | Path, *, vocab_size: int = 256, seed: int = 0) -> dict:
    """A gpt-oss target whose experts are stored as real gpt-oss checkpoints store them: MXFP4
    (`*_blocks`: two 4-bit E2M1 codes per byte, low nibble first; `*_scales`: one E8M0 exponent,
    bias 127, per 32 values along the input axis) with `quantization_config.quant_method`
    "mxfp4". Returns the dense expert weights those blocks decode to, by parameter name."""
    import json

    from safetensors.torch import load_file, save_file

    p = save_target("gpt_oss", path, vocab_size=vocab_size, seed=seed)
    tensors = load_file(p / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    lut = torch.tensor(FP4_E2M1)
    dense = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, fan_in, fan_out = tensors.pop(name).shape  # parameter layout (E, in, out)
        groups = fan_in // 32
        codes = torch.randint(0, 16, (experts, fan_out, groups, 32), generator=gen)
        exps = torch.randint(120, 128, (experts, fan_out, groups), generator=gen)
        values = lut[codes] * torch.exp2(exps.float() - 127)[..., None]
        dense[name] = values.reshape(experts, fan_out, fan_in).transpose(1, 2).contiguous()
        tensors[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
        tensors[name + "_scales"] = exps.to(torch.uint8)
    save_file(tensors, p / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((p / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (p / "config.json").write_text(json.dumps(config, indent=2))
    return dense
