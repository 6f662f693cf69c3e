"""The DFlash draft model and its config (architecture only; no training code).

A DFlash drafter is a short stack of Qwen3-style decoder layers at the target's width. It has no
embedding and no LM head of its own: block tokens are embedded with the target's frozen
`embed_tokens` and logits come from the target's frozen `lm_head` (both passed in by the caller).

Conditioning: the hidden states of K target layers are concatenated and fused once,
`ctx = hidden_norm(fc(concat_k h_k))`, then injected into EVERY layer as extra keys and values:
keys `[k_proj(ctx) ; k_proj(x)]`, values `[v_proj(ctx) ; v_proj(x)]` with the same projections,
`k_norm` on all keys. Queries come only from the block tokens `x`. Inside a block a full-attention
layer is bidirectional; a layer may also be a sliding-window one (causal inside the block unless
the config says `is_causal: false`), as recent official drafters use (`DFlashConfig.layer_types`,
`block_attention.py` for the mask).

Two entry points share every weight and every op up to the attention kernel:
- `forward(...)` for training: N blocks per sequence at once, against the full context, under the
  DFlash block mask (see `block_attention.py`);
- `forward_cached(...)` for inference: one block against a cache of context keys/values.
A test checks that both give the same logits for the same anchor.

DFlash 2 (`DFlashConfig.arch = "dflash2"`) is the same model plus two modules the checkpoint
carries (`dflash2.py`): per layer a grouped dynamic convolution around attention and one around
the MLP (block stream only, never across a block boundary), and the candidate path selector on
the final states.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_train.model.block_attention import BlockLayout, block_attention, visible
from dflash_train.model.dflash2 import CandidateSelector, GroupedDynamicConv

ARCHS = ("dflash", "dflash2")
"""Draft architectures: DFlash 1, and DFlash 2 (convolutions and the candidate path selector)."""
DFLASH2_DEFAULTS = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
}
"""The shipped DFlash 2 sizes (the four `dflash_config` fields of its checkpoint contract)."""


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> list[int]:
    """The paper's rule: K ids spread evenly over [1, L-3]; the middle layer when K == 1.

    36 layers -> [1, 9, 17, 25, 33]; 32 layers -> [1, 8, 15, 22, 29].
    """
    if num_features < 1:
        raise ValueError(f"num_target_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 5:
        raise ValueError(
            f"the default target layer rule needs a target with >= 5 layers (got "
            f"{num_target_layers}); pass --target-layer-ids explicitly"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


ROTATION_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")
"""RoPE fields that change WHICH dimensions rotate, or by which position: the drafter has none."""


def rope_settings(
    rope_parameters: dict[str, Any] | None,
    rope_scaling: dict[str, Any] | None = None,
    rope_theta: float | None = None,
    partial_rotary_factor: float | None = None,
) -> dict[str, Any]:
    """A config's RoPE settings in the transformers 5 form (`rope_type`, `rope_theta`, the
    type's own fields), from its 5.x `rope_parameters` or its 4.x `rope_theta` / `rope_scaling`
    (and a 4.x top-level `partial_rotary_factor`).

    Settings kept per layer type (Gemma 3: `{"sliding_attention": {...}, "full_attention":
    {...}}`) give the full-attention layers' ones: a drafter has one RoPE, and its context is
    the whole prefix, which the target's full-attention layers are the ones made to see."""
    if rope_parameters and all(isinstance(v, dict) for v in rope_parameters.values()):
        rope_parameters = rope_parameters.get(FULL_ATTENTION) or next(
            iter(rope_parameters.values())
        )
    if rope_parameters:
        params = dict(rope_parameters)
    else:
        params = dict(rope_scaling or {})
        params["rope_theta"] = 10000.0 if rope_theta is None else rope_theta
    if partial_rotary_factor is not None:
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def drafter_rope(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the RoPE settings a drafter rotates with, the fields of `params` left out).

    The drafter is a Qwen3 model of its own: it rotates the FULL head dimension of its own
    queries and keys at 1-D positions, whatever the target does (Qwen3-Next's
    `partial_rotary_factor` 0.25, a VL model's `mrope_*`). The reference client's Qwen3 RoPE
    ignores such fields, vLLM honours them, so a drafter config that kept them would be served
    with another rotation than it was trained with: they are dropped (`ROTATION_FIELDS`;
    a factor of 1.0 is no change). A transformers 4.x `mrope` type is plain RoPE here.
    """
    kept = {k: v for k, v in params.items() if k not in ROTATION_FIELDS}
    dropped = {k: v for k, v in params.items() if k in ROTATION_FIELDS}
    if dropped.get("partial_rotary_factor") in (1, 1.0):
        del dropped["partial_rotary_factor"]
    if kept.get("rope_type") == "mrope":
        kept["rope_type"] = "default"
    return kept, dropped


YARN_SHARED_FIELDS = (
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
)
"""The YaRN fields that transformers (so this trainer and the reference client), vLLM and SGLang
all apply, and apply alike. Left out: the attention-magnitude fields, which readers take
differently. `mscale` / `mscale_all_dim` (DeepSeek-V3/R1, Kimi K2: an attention factor of 1.0
in transformers) were ignored by vLLM up to at least 0.25 (vLLM issue 48621), which applied
1 + 0.1 ln(factor) instead (1.37 at factor 40); an explicit `attention_factor` is ignored by
SGLang's YaRN and was by earlier vLLM (vLLM 0.32.0 applies all three as transformers does);
vLLM's and SGLang's own `attn_factor` / `extrapolation_factor` are ignored by transformers."""

SEQUENCE_DEPENDENT_ROPE = ("longrope",)
"""RoPE types whose table each reader chooses differently: longrope (Phi-3/3.5, Phi-4-mini)
switches from its short to its long factors by the running sequence length in transformers, by
the engine's `max_model_len` in vLLM, and not at all in a table computed once."""


def served_rope(params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the RoPE settings a NEW drafter trains with, the target's fields left out).

    The drafter's queries and keys are its own, trained from scratch: its RoPE need not be the
    target's, only the same at training and at serving, in every reader of the export. On top
    of `drafter_rope` (the rotated dimensions):
    - YaRN keeps `YARN_SHARED_FIELDS` only: the frequencies stay the target's (long contexts
      rotate as the target's do) and every reader then applies the attention factor
      1 + 0.1 ln(factor) to cos and sin, so the drafter's logits carry its square, as
      DeepSeek-V3's own do through its softmax scale (the `mscale_all_dim` term squared).
    - `SEQUENCE_DEPENDENT_ROPE` types become plain RoPE at the target's theta.
    Other types (default, linear, llama3, dynamic) are read alike and kept. Checkpoints are not
    changed (`DFlashConfig` keeps what a drafter trained with), only new drafters."""
    kept, dropped = drafter_rope(params)
    rope_type = kept.get("rope_type", "default")
    if rope_type == "yarn":
        dropped.update({k: v for k, v in kept.items() if k not in YARN_SHARED_FIELDS})
        kept = {k: v for k, v in kept.items() if k in YARN_SHARED_FIELDS}
    elif rope_type in SEQUENCE_DEPENDENT_ROPE:
        dropped.update({k: v for k, v in kept.items() if k != "rope_theta"})
        kept = {"rope_type": "default", "rope_theta": kept["rope_theta"]}
    return kept, dropped


def yarn_magnitude_fields(params: dict[str, Any]) -> dict[str, Any]:
    """A YaRN setting's fields outside `YARN_SHARED_FIELDS` (empty for other types): what a
    drafter trained before `served_rope` may carry, and readers apply differently."""
    if params.get("rope_type") != "yarn":
        return {}
    return {k: v for k, v in params.items() if k not in YARN_SHARED_FIELDS}


def check_served_order(layer_ids: list[int], *, distinct: bool = True) -> None:
    """Refuse a drafter's ids out of order (and, with `distinct`, repeated).

    vLLM and SGLang gather the layers a drafter asks for in layer order, each once, whatever
    order its config lists them in; training and the reference client concatenate them in the
    listed order. So ids out of order would be served with `fc`'s inputs permuted, and a
    repeated id with fewer inputs than `fc` takes: only ascending, distinct ids train what is
    served. Every drafter config is checked for the order (`DFlashConfig`), the ids a user
    gives for repeats too; the paper's rule repeats ids only on targets of fewer than K + 3
    layers (test-sized), which export names as unservable by those engines (`served_repeats`).
    (A feature store may hold its layers in any order: its readers pick by id.)
    """
    if list(layer_ids) != sorted(layer_ids) or (distinct and len(set(layer_ids)) < len(layer_ids)):
        raise ValueError(
            f"target_layer_ids {list(layer_ids)} must be ascending"
            f"{' and distinct' if distinct else ''}: vLLM and SGLang gather the target's layers "
            "in layer order, each once, so a drafter trained on these would be served other "
            f"features; use {sorted(set(layer_ids) if distinct else layer_ids)}"
        )


def served_repeats(layer_ids: list[int]) -> list[int]:
    """The ids listed more than once (vLLM and SGLang cannot serve such a drafter)."""
    return sorted({i for i in layer_ids if layer_ids.count(i) > 1})


def check_target_layer_ids(layer_ids: list[int], num_target_layers: int) -> None:
    """Refuse ids that are out of range or that name the target's LAST layer.

    Id l means the output of decoder layer l. For the last layer readers disagree on what that
    is: transformers' `hidden_states[L]` (so this trainer and the reference client) is taken
    AFTER the final norm, vLLM's captured layer output BEFORE it. A drafter trained on one would
    be served the other, so the last layer is refused; the default rule never picks it.
    """
    last = num_target_layers - 1
    bad = [i for i in layer_ids if not 0 <= i <= last]
    if bad:
        raise ValueError(
            f"target_layer_ids {bad} out of range for a target with {num_target_layers} layers "
            f"(valid: 0..{last - 1})"
        )
    if last in layer_ids:
        raise ValueError(
            f"target layer id {last} is the target's last layer, which transformers (and so "
            "training and the reference client) reads after the final norm and vLLM before it: "
            f"the served drafter would see other features than it was trained on; use ids "
            f"0..{last - 1}"
        )


@dataclass
class DFlashConfig:
    """Architecture of a draft model. Saved in every checkpoint; rebuilds the model alone."""

    hidden_size: int
    """Width, copied from the target."""
    intermediate_size: int
    """MLP width, copied from the target."""
    num_hidden_layers: int
    """Number of draft decoder layers (the paper uses 5; 8 for a coder target)."""
    num_attention_heads: int
    """Query heads, copied from the target."""
    num_key_value_heads: int
    """Key/value heads, copied from the target."""
    head_dim: int
    """Per-head width, copied from the target."""
    vocab_size: int
    """The target's vocabulary (embedding rows)."""
    num_target_layers: int
    """Decoder layers of the target."""
    target_layer_ids: list[int]
    """Target layers whose OUTPUTS condition the drafter (hidden_states[id + 1] in HF terms);
    0 .. L-2: the last layer is refused (see `check_target_layer_ids`)."""
    mask_token_id: int
    """Embedding row used for the B-1 masked slots of a block; must be < vocab_size."""
    block_size: int = 16
    """Tokens per block: the anchor plus B-1 predicted tokens."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon, copied from the target."""
    rope_parameters: dict[str, Any] = field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0}
    )
    """RoPE settings (`rope_type`, `rope_theta` and the type's own fields): the target's, less
    the fields that would change which dimensions rotate (`drafter_rope`) and, for a new
    drafter, the ones serving engines read otherwise than transformers (`served_rope`)."""
    max_position_embeddings: int = 40960
    """Longest position the RoPE settings are meant for, copied from the target."""
    hidden_act: str = "silu"
    """MLP activation (SwiGLU with silu for Qwen3 and Llama)."""
    layer_types: list[str] | None = None
    """Attention of each draft layer, "full_attention" or "sliding_attention"; None (as in
    checkpoints from before sliding windows) means every layer full."""
    sliding_window: int | None = None
    """Window of the sliding layers: a block query at absolute position q sees keys k with
    q - k < window (and k - q < window where it is bidirectional inside the block)."""
    is_causal: bool | None = None
    """Causality inside the block for EVERY layer when set (True: a block token sees the block
    up to itself; False: the whole block); None: sliding layers causal, full layers
    bidirectional. The reference client's and vLLM's meaning of `is_causal`."""
    arch: str = "dflash"
    """"dflash" (DFlash 1) or "dflash2" (grouped dynamic convolutions and the candidate path
    selector); checkpoints from before DFlash 2 are "dflash"."""
    conv_kernel_size: int | None = None
    """DFlash 2: taps T of each convolution (current position and T - 1 earlier ones)."""
    conv_group_size: int | None = None
    """DFlash 2: channels g sharing one dynamic tap (hidden_size / g groups)."""
    selector_rank: int | None = None
    """DFlash 2: rank r of the selector's codebooks and hidden projection."""
    selector_top_k: int | None = None
    """DFlash 2: candidates K the selector scores per draft position."""
    input_embedding_scale: float = 1.0
    """Factor on the target's raw embedding rows when the block is embedded: the target's own
    (Gemma: sqrt(hidden)), so block tokens look as the target's tokens do; exported as
    `dflash_config.input_embedding_scale`."""
    chat_thinking: str | None = None
    """Not architecture but what the drafter was trained for: the chat mode of its training
    data ("on" / "off": enable_thinking given to the chat template by `prepare`; "default":
    the template's own), None when unknown (imported drafters, older checkpoints). `eval` and
    the in-training evaluation encode prompts in this mode."""

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        # Also what an older checkpoint that copied the target's factor trained with.
        self.rope_parameters = drafter_rope(self.rope_parameters)[0]
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must not be empty")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        check_served_order(self.target_layer_ids, distinct=False)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a row of the target's embedding "
                f"(vocab_size {self.vocab_size})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ValueError(f"only silu (SwiGLU) MLPs are supported, got {self.hidden_act!r}")
        self._check_layer_types()
        self._check_dflash2()
        if self.chat_thinking not in (None, "on", "off", "default"):
            raise ValueError(
                f"chat_thinking must be on, off, default or unset, got {self.chat_thinking!r}"
            )

    def _check_layer_types(self) -> None:
        n = self.num_hidden_layers
        self.layer_types = list(self.layer_types or [FULL_ATTENTION] * n)
        if len(self.layer_types) != n:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {n} draft layers: "
                f"{self.layer_types}"
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(
                f"unknown layer types {unknown}: each draft layer is {FULL_ATTENTION!r} or "
                f"{SLIDING_ATTENTION!r}"
            )
        sliding = SLIDING_ATTENTION in self.layer_types
        if sliding and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(
                f"sliding-window layers need sliding_window >= 1, got {self.sliding_window}"
            )
        if not sliding and self.sliding_window is not None:
            raise ValueError(
                f"sliding_window {self.sliding_window} is set but no draft layer is "
                f"{SLIDING_ATTENTION!r}"
            )

    def _check_dflash2(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {self.arch!r}")
        if not self.is_dflash2:
            given = [k for k in DFLASH2_DEFAULTS if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{given} are DFlash 2 fields; this config is arch 'dflash'")
            return
        for name, default in DFLASH2_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
            elif getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            setattr(self, name, int(getattr(self, name)))
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} does not divide hidden_size "
                f"{self.hidden_size}: the DFlash 2 convolution shares one dynamic tap per group "
                "of conv_group_size channels"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"selector_top_k {self.selector_top_k} is larger than the vocabulary "
                f"({self.vocab_size} tokens)"
            )

    @property
    def is_dflash2(self) -> bool:
        """Whether the drafter has DFlash 2's convolutions and candidate path selector."""
        return self.arch == "dflash2"

    def layer_window(self, i: int) -> int | None:
        """The window of draft layer i, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[i] == SLIDING_ATTENTION else None

    def layer_causal(self, i: int) -> bool:
        """Whether draft layer i is causal inside the block (see `is_causal`)."""
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == SLIDING_ATTENTION

    @property
    def num_features(self) -> int:
        """K: how many target layers are fused."""
        return len(self.target_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DFlashConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE tables from the target's rope settings (default RoPE computed here; scaled variants
    through transformers' own init functions so they match the target exactly)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        params = dict(config.rope_parameters)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            dim = config.head_dim
            inv_freq = 1.0 / (
                params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
            )
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](_as_hf_config(config), None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        """Moves follow the module; dtype casts (`.to(torch.bfloat16)`, as `eval` loads a
        drafter on CUDA) leave the frequencies in fp32. Training, vLLM and the reference client
        all compute RoPE from fp32 frequencies, and an angle is position x frequency: bf16's
        rounding is already ~1 rad at position 1,000."""
        before = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = before.to(device=self.inv_freq.device, dtype=torch.float32)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin of shape (*positions.shape, head_dim)."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (
            (emb.cos() * self.attention_scaling).to(dtype),
            (emb.sin() * self.attention_scaling).to(dtype),
        )


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch, seq, head_dim)."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class DraftAttention(nn.Module):
    """Attention with KV injection: queries from the block, keys/values from [context ; block]."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def queries(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """(batch, L, hidden) -> (batch, heads, L, head_dim), normed and rotated."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim))
        return apply_rope(q.transpose(1, 2), *rope)

    def keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch, L, hidden) -> keys, values of shape (batch, kv_heads, L, head_dim)."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), *rope), v.transpose(1, 2)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """(batch, heads, L, head_dim) -> (batch, L, hidden)."""
        b, _, n, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class DraftMLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; the context bypasses input_layernorm, q_proj, o_proj and MLP (and
    DFlash 2's convolutions, which see the block stream only)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if config.is_dflash2:
            conv = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.attention_conv = GroupedDynamicConv(*conv)
            self.mlp_conv = GroupedDynamicConv(*conv)

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(batch, L, hidden) block stream -> the attention input and, for DFlash 2, the
        attention convolution's finish kernel."""
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            return h, None
        return self.attention_conv.prepare(h, block_len)

    def finish(
        self, x: torch.Tensor, attn: torch.Tensor, kernel: torch.Tensor | None, block_len: int
    ) -> torch.Tensor:
        """Residual around attention (its output convolved by `kernel` for DFlash 2), then the
        MLP block (inside its own convolution pair for DFlash 2)."""
        z = self.self_attn.output(attn)
        if self.attention_conv is not None:
            z = self.attention_conv.finish(z, kernel, block_len)
        x = x + z
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return x + self.mlp(h)
        h, mlp_kernel = self.mlp_conv.prepare(h, block_len)
        return x + self.mlp_conv.finish(self.mlp(h), mlp_kernel, block_len)


class DraftCache:
    """Per-layer keys/values of CONTEXT entries only (block entries are never cached).

    Shapes: keys/values (batch, kv_heads, context_len, head_dim) per layer.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


def _block_layer(
    layer: DraftLayer,
    x: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    q_rope: tuple[torch.Tensor, torch.Tensor],
    layout: BlockLayout,
    attention: str,
    window: int | None,
    causal: bool,
) -> torch.Tensor:
    """One decoder layer over the blocks of `layout` against precomputed context keys/values."""
    h, kernel = layer.prepare(x, layout.block_size)
    attn = layer.self_attn
    q = attn.queries(h, q_rope)
    k_blk, v_blk = attn.keys_values(h, q_rope)
    out = block_attention(q, k_ctx, v_ctx, k_blk, v_blk, layout, attention, window, causal)
    return layer.finish(x, out, kernel, layout.block_size)


class DFlashDraftModel(nn.Module):
    """The trainable part of a DFlash drafter: layers, `fc`, `hidden_norm`, final `norm`."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.candidate_selector: CandidateSelector | None = None
        if config.is_dflash2:
            self.candidate_selector = CandidateSelector(
                h, config.vocab_size, config.selector_rank, config.selector_top_k
            )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> None:
        """Normal(0, std) linears (std / sqrt(2 * layers) on residual outputs), unit norms; the
        DFlash 2 modules last, by their own rules (convolutions at the identity, the selector
        ranking as the unary logits), so no generic rule ever overwrites them."""
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                s = out_std if name.endswith(("o_proj", "down_proj")) else std
                w = torch.empty(module.weight.shape).normal_(0.0, s, generator=gen)
                module.weight.copy_(w)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for module in self.modules():
            if isinstance(module, GroupedDynamicConv):
                module.reset_to_identity()
            elif isinstance(module, CandidateSelector):
                module.reset_parameters(std, gen)

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """(batch, S, K * hidden) target features -> (batch, S, hidden) context."""
        expected = self.config.num_features * self.config.hidden_size
        if features.shape[-1] != expected:
            raise ValueError(
                f"target features have width {features.shape[-1]}, the drafter expects "
                f"{expected} (= {self.config.num_features} layers x hidden "
                f"{self.config.hidden_size})"
            )
        if not torch.is_autocast_enabled(features.device.type):
            features = features.to(self.fc.weight.dtype)
        # Under autocast fc casts the features to its dtype itself: a copy in the fp32 weights'
        # dtype first would be (batch, S, K * hidden) fp32 thrown away at once (~670 MB a batch
        # of an 8B target).
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(batch, S, K * hidden) target features -> each layer's context keys and values,
        (batch, kv_heads, S, head_dim) each. They do not depend on the blocks: computed once,
        shared by every block (and by every anchor chunk of a chunked training step)."""
        ctx = self.fuse_context(features)
        batch, seq = ctx.shape[:2]
        pos = torch.arange(seq, device=ctx.device).expand(batch, seq)
        rope = self.rotary(pos, ctx.dtype)
        return [self.context_keys_values(i, ctx, rope) for i in range(len(self.layers))]

    def context_keys_values(
        self, layer: int, ctx: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values of fused context `ctx` (batch, S, hidden): the one
        place context entries are made, in training and in inference (the engine check
        overrides it to reproduce an engine's known deviation, `bench/engine.py`)."""
        return self.layers[layer].self_attn.keys_values(ctx, rope)

    def blocks(
        self,
        block_embeds: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        layout: BlockLayout,
        attention: str = "dense",
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The blocks of `layout` through every layer against `context_kv` (any prefix of the
        context that covers what the blocks may see) -> final-normed hidden states.

        Blocks never see each other, so any subset of blocks (an anchor chunk, with
        `layout.slice_blocks`) gives exactly the rows the whole set would. `dtype`: the block
        stream's (default: the context keys'; a caller that casts the keys for the kernels
        passes the one they were made in).
        """
        x = block_embeds.to(dtype or context_kv[0][0].dtype)
        q_rope = self.rotary(layout.query_positions(), x.dtype)
        cfg = self.config
        for i, (layer, (k_ctx, v_ctx)) in enumerate(zip(self.layers, context_kv, strict=True)):
            window, causal = cfg.layer_window(i), cfg.layer_causal(i)
            x = _block_layer(layer, x, k_ctx, v_ctx, q_rope, layout, attention, window, causal)
        return self.norm(x)

    def forward(
        self,
        block_embeds: torch.Tensor,
        features: torch.Tensor,
        layout: BlockLayout,
        attention: str = "dense",
    ) -> torch.Tensor:
        """Training forward: all blocks of each sequence in one pass.

        block_embeds: (batch, N * B, hidden) embeddings of [anchor, MASK * (B-1)] per block.
        features: (batch, S, K * hidden) target features of the whole sequence.
        Returns the final-normed hidden states (batch, N * B, hidden).
        """
        return self.blocks(block_embeds, self.context_kv(features), layout, attention)

    def forward_cached(
        self,
        block_embeds: torch.Tensor,
        new_features: torch.Tensor | None,
        start: int,
        cache: DraftCache,
    ) -> torch.Tensor:
        """Inference forward: ONE block per row against cached context.

        block_embeds: (batch, B, hidden) embeddings of [anchor, MASK * (B-1)], anchor at `start`.
        new_features: (batch, S_new, K * hidden) features of the context positions not cached yet,
            i.e. positions [cache.length, start); they are appended to the cache.
        Returns the final-normed hidden states of the block (batch, B, hidden).
        """
        x = block_embeds
        batch, blk = x.shape[:2]
        dev = x.device
        ctx, ctx_rope = None, None
        if new_features is not None and new_features.shape[1] > 0:
            ctx = self.fuse_context(new_features)
            x = x.to(ctx.dtype)
            pos = torch.arange(cache.length, cache.length + ctx.shape[1], device=dev)
            ctx_rope = self.rotary(pos.expand(batch, -1), x.dtype)
        num_new = 0 if ctx is None else ctx.shape[1]
        if cache.length + num_new != start:
            raise ValueError(
                f"draft cache covers {cache.length} context positions plus {num_new} new ones, "
                f"but the block starts at {start}: the context must be exactly the positions "
                "before the anchor"
            )
        q_pos = torch.arange(start, start + blk, device=dev).expand(batch, -1)
        q_rope = self.rotary(q_pos, x.dtype)
        for i, layer in enumerate(self.layers):
            h, kernel = layer.prepare(x, blk)  # one block: the anchor's earlier taps read 0
            attn = layer.self_attn
            q = attn.queries(h, q_rope)
            if ctx is not None:
                k_ctx, v_ctx = cache.append(i, *self.context_keys_values(i, ctx, ctx_rope))
            else:
                k_ctx, v_ctx = cache.keys[i], cache.values[i]
            k_blk, v_blk = attn.keys_values(h, q_rope)
            window, causal = self.config.layer_window(i), self.config.layer_causal(i)
            first = 0  # a sliding layer sees no key at distance >= window from the anchor
            if window is not None:
                first = max(0, start - window + 1)
            if k_ctx is not None:
                k_ctx, v_ctx = k_ctx[:, :, first:], v_ctx[:, :, first:]
                k_blk, v_blk = torch.cat([k_ctx, k_blk], 2), torch.cat([v_ctx, v_blk], 2)
            mask = None
            if causal or window is not None:
                # Absolute positions, as the reference client's _attention_mask measures them.
                k_pos = torch.arange(first, start + blk, device=dev)
                mask = visible(q_pos[0, :, None], k_pos[None, :], window, causal)
            out = F.scaled_dot_product_attention(q, k_blk, v_blk, attn_mask=mask, enable_gqa=True)
            x = layer.finish(x, out, kernel, blk)
        return self.norm(x)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds, with serving-engine names (no prefix)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}


def _as_hf_config(config: DFlashConfig):
    """A transformers Qwen3Config equivalent to `config` (for RoPE init of scaled variants)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
    )
