"""The frozen target model: loading, selected-layer features, the embedding and LM head.

`TargetFeatureExtractor` runs a frozen Hugging Face causal LM without autograd and returns ONLY
the selected layers' outputs (`hidden_states[id + 1]` in HF terms), concatenated. It never builds
the full-vocabulary logits nor keeps every layer's states: the decoder is cut after the last
selected layer (its later layers, the final norm and the LM head are dropped from the copy it
owns) and forward hooks capture the selected outputs. The target's last layer is never selected
(`draft.check_target_layer_ids`: readers disagree on whether its output is normed).

With the teacher's input requested (`TEACHER_INPUT_ID` last in the layer ids: the losses on
the target's distribution), the decoder keeps every layer and its final norm, and the features
end with the final-normed last hidden state (batch, L, hidden): the LM head's input, from which
the drafter's loss computes the target's next-token distribution chunk by chunk. That is exact
and costs one hidden-size slot per token (1 / K more than the features alone); top-k logits
would be smaller but drop the tail of the distribution that KL and the acceptance rate read
(README, Losses on the target's distribution).

Batches are RIGHT-padded, so real tokens never attend to padding under the causal mask and no
attention mask is passed (features at padded positions are never read: the block mask only shows
context before each anchor, and anchors lie inside the sequence).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_train.model.draft import (
    DFlashConfig,
    check_served_order,
    check_target_layer_ids,
    default_target_layer_ids,
    rope_settings,
    served_rope,
)
from dflash_train.model.families import (
    HEAD_PREFIXES,
    TEXT_PREFIXES,
    TargetLoadError,
    check_embedding_scale,
    input_embedding_scale,
    load_kwargs,
    match_dequantised_dtype,
    read_target_layout,
)

TEACHER_INPUT_ID = -1
"""In a list of feature layer ids, the teacher's input: the target's final-normed last hidden
state (its LM head's input). Always last; a feature store binds it like a layer."""


def feature_layer_ids(layer_ids: list[int], teacher: bool) -> list[int]:
    """What a run's features hold, in order: the drafter's target layers, then the teacher's
    input when the loss reads the target's distribution."""
    return [*layer_ids, TEACHER_INPUT_ID] if teacher else list(layer_ids)


def split_teacher_input(ids: list[int]) -> tuple[list[int], bool]:
    """(the target layer ids, whether the teacher's input follows them) of feature layer ids."""
    teacher = bool(ids) and ids[-1] == TEACHER_INPUT_ID
    layers = list(ids[:-1] if teacher else ids)
    if TEACHER_INPUT_ID in layers:
        raise ValueError(f"feature layer ids {list(ids)}: the teacher's input comes last, once")
    return layers, teacher


def final_logit_softcap(config: Any) -> float | None:
    """The target's final logit soft cap (Gemma 2's final_logit_softcapping), None without."""
    return getattr(config, "final_logit_softcapping", None) or None


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), what a soft-capped target does to its LM head's output."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def load_target_config(path: str | Path, trust_remote_code: bool = False):
    """The target's (text) transformers config, with a clear error for a missing directory or
    one that holds no causal language model (see `model.families`)."""
    return read_target_layout(path, trust_remote_code).text


def draft_config_from_target(
    target_config,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    num_features: int = 5,
    *,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    arch: str = "dflash",
    input_embedding_scale: float = 1.0,
    **dflash2_sizes: int,
) -> DFlashConfig:
    """A draft architecture at the target's width (`drafter_geometry`: heads, head dim, MLP;
    RoPE copied); the attention layout (`layer_types`, `sliding_window`, `is_causal`) and the
    architecture (`arch`, and for "dflash2" any of `DFLASH2_DEFAULTS`' sizes) are the
    drafter's own. `input_embedding_scale`: the target's (`families.input_embedding_scale`)."""
    c = target_config
    n_target = c.num_hidden_layers
    if target_layer_ids:
        check_served_order(target_layer_ids)
    ids = target_layer_ids or default_target_layer_ids(n_target, num_features)
    heads, kv_heads, head_dim, intermediate = drafter_geometry(c)
    # The drafter rotates its full head dimension at 1-D positions (Qwen3-Next's and Qwen3.5's
    # partial rotation and multimodal sections are left out), with settings every reader of
    # the export applies alike (`served_rope`: YaRN without its magnitude fields).
    rope = served_rope(
        rope_settings(
            getattr(c, "rope_parameters", None),
            getattr(c, "rope_scaling", None),
            getattr(c, "rope_theta", None),
            getattr(c, "partial_rotary_factor", None),
        )
    )[0]
    return DFlashConfig(
        hidden_size=c.hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=c.vocab_size,
        num_target_layers=n_target,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=getattr(c, "rms_norm_eps", None) or 1e-6,
        rope_parameters=rope,
        max_position_embeddings=getattr(c, "max_position_embeddings", 40960),
        layer_types=layer_types,
        sliding_window=sliding_window,
        is_causal=is_causal,
        arch=arch,
        input_embedding_scale=input_embedding_scale,
        **dflash2_sizes,
    )


def drafter_geometry(target_config: Any) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, head dim, MLP width) of a drafter for this target.

    The paper's drafter copies the target's attention shape and MLP width. Where the target has
    no such shape the drafter takes the nearest one it does have:
    - MLA targets (DeepSeek-V3, Kimi K2: `kv_lora_rank` set) have no per-head key width of
      their own (`head_dim` in their config is the rotary part only): the drafter takes the
      target's heads at `v_head_dim`, the width each head's attention output has;
    - MoE targets without a dense MLP width (Qwen3.5/3.6 MoE: only expert sizes) get 3 x hidden,
      the dense ratio of the Qwen3 family (SpecForge's Qwen3.5-35B-A3B drafter uses the same).
    The drafter's MLP is always SwiGLU with silu (the served Qwen3 layout), whatever the
    target's activation.
    """
    c = target_config
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    if getattr(c, "kv_lora_rank", None):
        head_dim = getattr(c, "v_head_dim", None) or c.hidden_size // heads
    else:
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    intermediate = getattr(c, "intermediate_size", None) or 3 * c.hidden_size
    return heads, kv_heads, head_dim, intermediate


def check_draft_fits_target(
    config: DFlashConfig, target_config: Any, embedding_scale: float | None = None
) -> None:
    """Raise one `ValueError` naming every way the drafter does not fit the target.

    `target_config` is the target's (text) transformers config. Checked: hidden size (the fused
    features and the shared embedding / LM head are at the target's width), layer count and
    layer ids (the features the drafter was trained on), vocabulary (embedding rows, mask id)
    and, when given, the target's input embedding scale (how the block tokens are embedded).
    """
    problems = []
    hidden = target_config.hidden_size
    if config.hidden_size != hidden:
        problems.append(f"hidden size {config.hidden_size} != target hidden size {hidden}")
    layers = target_config.num_hidden_layers
    if config.num_target_layers != layers:
        problems.append(
            f"trained for a target with {config.num_target_layers} layers, this target has {layers}"
        )
    bad_ids = [i for i in config.target_layer_ids if not 0 <= i < layers - 1]
    if bad_ids:
        problems.append(
            f"target layer ids {bad_ids} out of range for {layers} target layers (0..{layers - 2}:"
            " the last layer is never used)"
        )
    vocab = target_config.vocab_size
    if config.vocab_size != vocab:
        problems.append(f"vocab_size {config.vocab_size} != target vocab_size {vocab}")
    if not 0 <= config.mask_token_id < vocab:
        problems.append(
            f"mask_token_id {config.mask_token_id} is not a row of the target's "
            f"embedding ({vocab} rows)"
        )
    if embedding_scale is not None and not math.isclose(
        config.input_embedding_scale, embedding_scale, rel_tol=1e-6
    ):
        problems.append(
            f"input_embedding_scale {config.input_embedding_scale:g} != the target's "
            f"{embedding_scale:g}"
        )
    if problems:
        raise ValueError("the drafter does not fit the target: " + "; ".join(problems))


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (the module with `.layers`) of a causal LM."""
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    if dec is None or not hasattr(dec, "layers"):
        dec = getattr(model, "model", None)
    if dec is None or not hasattr(dec, "layers"):
        raise TargetLoadError(f"cannot find the decoder layers of {type(model).__name__}")
    return dec


def load_causal_lm(
    path: str | Path, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False
) -> nn.Module:
    """The target's causal LM (with LM head; for a multimodal checkpoint its text part only),
    frozen, in eval mode, on `device` (`model.families` says what differs per family)."""
    from transformers import AutoModelForCausalLM

    layout = read_target_layout(path, trust_remote_code)
    # The layout's config, not the file's: for a wrapper its text part, and every family's
    # adjustments (`model.families`) applied.
    kwargs = dict(load_kwargs(layout, dtype, device), config=layout.text)
    try:
        # A wrapper loads as its text-only class, from its renamed weights.
        loader = layout.model_class if layout.wrapper else AutoModelForCausalLM
        model, info = loader.from_pretrained(
            path,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
    except Exception as e:  # surface missing weights etc. as one clear message
        raise TargetLoadError(f"cannot load the target model from {path}: {e}") from e
    missing = sorted(info.get("missing_keys") or ())
    if missing:  # transformers would run them at their random initialisation
        raise TargetLoadError(
            f"the checkpoint in {path} lacks {len(missing)} of the model's weights "
            f"(e.g. {', '.join(missing[:3])})"
        )
    match_dequantised_dtype(model, layout, dtype)
    model.to(device).eval().requires_grad_(False)
    check_embedding_scale(model, decoder_of(model), input_embedding_scale(layout))
    return model


class TargetFeatureExtractor:
    """Selected-layer features of a frozen target, on one device.

    `__call__(input_ids)` -> (batch, L, K * hidden), the outputs of `layer_ids` concatenated in
    the given order, then with `TEACHER_INPUT_ID` last in `layer_ids` the teacher's input
    ((batch, L, (K + 1) * hidden) in all). Owns its model copy (hooks write to per-instance
    storage, so one extractor per worker thread).
    """

    def __init__(
        self,
        path: str | Path,
        layer_ids: list[int],
        device: torch.device,
        dtype: torch.dtype,
        trust_remote_code: bool = False,
        *,
        model: nn.Module | None = None,
    ) -> None:
        # `model`: an already loaded causal LM to use instead of `path` (the one-GPU check builds
        # random targets of real shapes); its decoder is cut in place.
        if model is None:
            model = load_causal_lm(path, torch.device("cpu"), dtype, trust_remote_code)
        decoder = decoder_of(model)
        n = len(decoder.layers)
        try:
            layer_ids, self.teacher = split_teacher_input(list(layer_ids))
            check_target_layer_ids(layer_ids, n)
        except ValueError as e:
            raise TargetLoadError(str(e)) from None
        if self.teacher:  # every layer and the final norm, checked against the LM head
            check_teacher_head(model.to(device), decoder)
        else:
            decoder.layers = decoder.layers[: max(layer_ids) + 1]
            decoder.norm = nn.Identity()  # never selected: the last layer is refused above
        self.decoder = decoder.to(device)
        del model  # drops the LM head (unless tied to the embedding, which the decoder keeps)
        self.layer_ids = layer_ids
        self.device, self.dtype = device, dtype
        self.hidden_size = decoder.config.hidden_size
        self._captured: dict[int, torch.Tensor] = {}
        for i in set(layer_ids):
            decoder.layers[i].register_forward_hook(self._hook(i))
        self._run = self.decoder  # the compiled decoder after `compile()`
        self._graphs: dict[int, _ShapeGraph] = {}  # bucket length -> its captured forward
        self.graph_misses = 0
        """Batches run eagerly although graphs were captured (more rows than captured)."""

    def _hook(self, idx: int):
        def hook(_module, _args, output):
            self._captured[idx] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        # no_grad rather than inference_mode: inference tensors cannot enter the drafter's
        # autograd graph without a copy, and the features are large.
        rows, length = input_ids.shape
        graph = self._graphs.get(length)
        if graph is not None and rows <= graph.rows:
            return graph(input_ids)
        if self._graphs:
            self.graph_misses += 1
        # Asynchronous: from pinned memory (the prefetchers pin on CUDA) it does not wait for
        # the previous forward; the host memory is kept until the copy ran.
        return self._forward(input_ids.to(self.device, non_blocking=True))

    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._captured.clear()
        out = self._run(input_ids=input_ids, use_cache=False)
        parts = [self._captured[i] for i in self.layer_ids]
        if self.teacher:
            parts.append(out.last_hidden_state)  # (batch, L, hidden), final-normed
        self._captured.clear()
        return torch.cat(parts, dim=-1)

    def compile(self, lengths: list[int], backend: str = "inductor") -> None:
        """torch.compile the decoder (dynamic shapes) and trace it on every bucket length, at
        one row and at two (torch specialises a size of 1), on the calling thread: call it for
        each device in turn before any worker thread starts. (`backend`: tests trace with
        "aot_eager", which skips inductor's code generation.)"""
        self._run = torch.compile(self.decoder, dynamic=True, backend=backend)
        with torch.no_grad():
            for length in lengths:
                for rows in (1, 2):
                    self._forward(torch.zeros(rows, length, dtype=torch.long, device=self.device))

    def capture_graphs(self, rows_by_length: dict[int, int], backend: str = "cuda") -> int:
        """One CUDA graph of the forward per bucket length L, for up to `rows_by_length[L]` rows
        (a batch with fewer rows is padded up: rows are independent in a causal LM without an
        attention mask, and the padded rows' features are cut off). Captured on the calling
        thread, one after the other, before any worker thread starts; every graph of this
        extractor shares one memory pool (replays never overlap: one thread, one stream, and
        each replay's output is copied out before the next). Returns the number captured.

        `backend="eager"` replays by running the forward on the static buffers (no CUDA): the
        same buffers, padding and copies, for tests on CPU."""
        pool = torch.cuda.graph_pool_handle() if backend == "cuda" else None
        try:
            for length, rows in sorted(rows_by_length.items()):
                self._graphs[length] = _ShapeGraph(self, rows, length, backend, pool)
        except BaseException:
            self._graphs.clear()  # all or none: the forward stays eager
            raise
        return len(self._graphs)

    @property
    def has_graphs(self) -> bool:
        """Whether the forward replays captured graphs (`capture_graphs`)."""
        return bool(self._graphs)

    def drop_graphs(self) -> None:
        """Back to the eager forward (the graphs' memory is freed with them)."""
        self._graphs.clear()
        self.graph_misses = 0


TEACHER_PROBE_TOKENS = 8


def check_teacher_head(model: nn.Module, decoder: nn.Module) -> None:
    """The teacher's logits as the drafter's loss computes them (the LM head, then the final
    logit soft cap, on the decoder's final-normed output) must be the target's own: measured on
    a short probe, like the embedding scale, so a family that transforms its logits otherwise
    (a scale, another cap) is refused here rather than distilled wrongly."""
    dev = next(decoder.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(1, TEACHER_PROBE_TOKENS + 1, device=dev) * 7919 % vocab)[None]
    head = FrozenHead.of_model(model)
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
        states = decoder(input_ids=ids, use_cache=False).last_hidden_state
        logits = nn.functional.linear(states, head.head, head.head_bias)
        got = soft_cap(logits, head.logit_softcap).float()
    err = float((got - want).abs().max())
    if err > 1e-2 * max(1.0, float(want.abs().max())):
        raise TargetLoadError(
            f"{type(model).__name__}: the target's logits differ from its LM head on its final "
            f"hidden state by up to {err:.3g} (its family transforms them in a way this trainer "
            "does not reproduce), so its distribution cannot be the teacher: use --loss ce"
        )


class _ShapeGraph:
    """The extractor's forward for (rows, length) input ids, captured once and replayed."""

    def __init__(self, ex: TargetFeatureExtractor, rows: int, length: int, backend, pool) -> None:
        self.ex, self.rows, self.backend = ex, rows, backend
        self.static_ids = torch.zeros(rows, length, dtype=torch.long, device=ex.device)
        self.graph = None
        with torch.no_grad():
            if backend == "cuda":
                run = lambda: ex._forward(self.static_ids)  # noqa: E731
                self.graph, self.static_out = capture_cuda_graph(run, ex.device, pool)
            else:
                self.static_out = ex._forward(self.static_ids)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = input_ids.shape[0]
        self.static_ids[:rows].copy_(input_ids, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:  # as a replay does: the static output overwritten in place
            self.static_out.copy_(self.ex._forward(self.static_ids))
        # A copy: the next replay overwrites the static output, and the batch outlives it.
        return self.static_out[:rows].clone()


def capture_cuda_graph(
    run: Callable[[], torch.Tensor], device: torch.device, pool: Any = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run()` captured as a CUDA graph on `device`, and its (static) output.

    Everything happens under `device` with streams of `device`, whatever the calling thread's
    current device is (the main thread's is cuda:0): `torch.cuda.graph` without a stream
    captures on a stream of the current device, so a target on cuda:1 would fail to capture or
    capture an empty graph that replays stale features. Warmed up twice on a side stream
    first (lazy initialisation must not be captured), as torch requires.
    """
    with torch.cuda.device(device):
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=torch.cuda.Stream(device)):
            out = run()
    return graph, out


@dataclass
class FrozenHead:
    """The target's input embedding and LM head, frozen, as plain tensors on one device.

    embed: (vocab, hidden) raw rows; head: (vocab, hidden); head_bias: (vocab,) or None;
    embed_scale: what the target's embedding module multiplies its rows by (Gemma:
    sqrt(hidden)), applied by `embed_tokens` so block tokens are embedded as the target embeds.
    """

    embed: torch.Tensor
    head: torch.Tensor
    head_bias: torch.Tensor | None = None
    embed_scale: float = 1.0
    logit_softcap: float | None = None
    """The target's final logit soft cap (`final_logit_softcap`): the teacher's logits take it;
    the drafter's own logits, as served, do not."""

    def to(self, device: torch.device, dtype: torch.dtype) -> FrozenHead:
        cast = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
        return FrozenHead(
            cast(self.embed),
            cast(self.head),
            cast(self.head_bias),
            self.embed_scale,
            self.logit_softcap,
        )

    @classmethod
    def of_model(cls, model: nn.Module) -> FrozenHead:
        """A loaded causal LM's own embedding and LM head tensors (shared, not copied)."""
        out = model.get_output_embeddings()
        emb = model.get_input_embeddings()
        scale = float(getattr(emb, "scalar_embed_scale", None) or 1.0)
        cap = final_logit_softcap(model.config.get_text_config())
        return cls(emb.weight, out.weight, getattr(out, "bias", None), scale, cap)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(ids, self.embed)
        return rows if self.embed_scale == 1.0 else rows * self.embed_scale


def load_frozen_head(path: str | Path, trust_remote_code: bool = False) -> FrozenHead:
    """Embedding and LM head of the target, read straight from its safetensors when possible
    (no need to build the whole model), else from the loaded model. On the CPU, stored dtype."""
    p = Path(path)
    layout = read_target_layout(p, trust_remote_code)
    tensors = _read_named_safetensors(p, ("embed_tokens.weight", "lm_head.weight", "lm_head.bias"))
    embed = tensors.get("embed_tokens.weight")
    if embed is None:
        model = load_causal_lm(p, torch.device("cpu"), torch.float32, trust_remote_code)
        return FrozenHead.of_model(model)  # the rest of the model is dropped on return
    quantized = _stored_names(p, QUANTIZED_HEAD_SUFFIXES)
    if quantized:
        # A GPTQ / compressed-tensors / fp8 head: its stored weight is packed, or scaled by a
        # tensor beside it; neither the embedding (the tied guess) nor a plain cast is the head.
        raise TargetLoadError(
            f"{p}: the target's LM head is stored quantized ({', '.join(quantized)}), and the "
            "drafter is trained and served against its unquantized weight: use a checkpoint of "
            "the target whose lm_head is not quantized"
        )
    tied = getattr(layout.text, "tie_word_embeddings", False) or "lm_head.weight" not in tensors
    head = embed if tied else tensors["lm_head.weight"]
    return FrozenHead(
        embed,
        head,
        tensors.get("lm_head.bias"),
        input_embedding_scale(layout),
        final_logit_softcap(layout.text),
    )


_LANGUAGE_MODEL_PREFIXES = ("model.", "lm_head.", *TEXT_PREFIXES, *HEAD_PREFIXES)


QUANTIZED_HEAD_SUFFIXES = (
    "lm_head.qweight",
    "lm_head.weight_packed",
    "lm_head.weight_scale",
    "lm_head.scales",
)
"""Tensors a quantized LM head is stored with (GPTQ / AWQ, compressed-tensors, fp8 scales)."""


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file of a model directory (empty without safetensors)."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", "pt") as f:
            return {k: "model.safetensors" for k in f.keys()}  # noqa: SIM118
    return {}


def _stored_names(path: Path, suffixes: tuple[str, ...]) -> list[str]:
    """The stored tensor names ending with one of `suffixes` (a wrapper's MTP heads left out)."""
    return sorted(k for k in _weight_map(path) if k.endswith(suffixes) and "mtp" not in k)


def _read_named_safetensors(path: Path, suffixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Tensors whose names end with one of `suffixes` (first match per suffix)."""
    from safetensors import safe_open

    weight_map = _weight_map(path)
    if not weight_map:
        return {}
    found: dict[str, torch.Tensor] = {}
    for suffix in suffixes:
        # A wrapper's language model first (its vision tower and MTP heads never match).
        names = sorted(
            (k for k in weight_map if k.endswith(suffix) and "mtp" not in k),
            key=lambda k: (not k.startswith(_LANGUAGE_MODEL_PREFIXES), k),
        )
        if names:
            with safe_open(path / weight_map[names[0]], "pt") as f:
                found[suffix] = f.get_tensor(names[0])
    return found
