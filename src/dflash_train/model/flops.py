"""The drafter's model FLOPs for one training micro-step, by part.

Two readers: `bench step` divides them by the step's time (its MFU), and work batching's
default budget (`--batch-cost flops`) takes from them the share of a full batch's cost that
grows with its padded tokens, the rest growing with its block positions (`token_share`): a
number that follows from the drafter's shape and the data alone, so every launch, node and
resume plans the same batches.
"""

from __future__ import annotations

from dflash_train.model.draft import DFlashConfig

SHARE_STEP = 0.05
"""A token share is rounded to this step (as a measured one is), so small changes of the
count do not move the plan."""


def drafter_flop_parts(
    cfg: DFlashConfig, rows: int, seq: int, anchors: int, supervised: float
) -> dict[str, float]:
    """Model FLOPs of one micro-step of `rows` rows of `seq` tokens, `anchors` blocks per row
    and `supervised` supervised positions in all, by part:

    - queries: the draft layers' matmuls over the block queries (3x the forward: forward,
      input and weight gradients);
    - context: the draft layers' key/value projections of the context (3x);
    - attention: scores and values (3x the forward: its backward is two products per forward
      one), useful work only: each block query sees about half the context (at most its
      layer's window) plus its block;
    - fc: the fusion of the target's features into the context (2x: its input needs no
      gradient);
    - head: the frozen LM head on the supervised positions (2x: only the hidden states'
      gradient).
    """
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q_dim = cfg.num_attention_heads * cfg.head_dim
    layers = cfg.num_hidden_layers
    queries = rows * anchors * cfg.block_size
    ctx = rows * seq
    per_query = 2 * (h * q_dim + 2 * h * kv + q_dim * h + 3 * h * cfg.intermediate_size)
    reach = sum(min(seq / 2, cfg.layer_window(i) or seq) + cfg.block_size for i in range(layers))
    return {
        "queries": 3.0 * layers * queries * per_query,
        "context": 3.0 * layers * ctx * 2 * 2 * h * kv,
        "attention": 3.0 * 2 * 2 * queries * reach * q_dim,
        "fc": 2.0 * 2 * ctx * cfg.num_features * h * h,
        "head": 2.0 * 2 * supervised * h * cfg.vocab_size,
    }


TOKEN_PARTS = ("context", "fc")
"""The parts that grow with a batch's padded tokens; the others grow with its block positions."""


def token_share(cfg: DFlashConfig, longest: int, num_anchors: int) -> float:
    """The share of a fully anchored row of the longest bucket's FLOPs that grows with its
    tokens (`TOKEN_PARTS`), rounded to SHARE_STEP: work batching's budget by FLOPs."""
    parts = drafter_flop_parts(cfg, 1, longest, num_anchors, num_anchors * (cfg.block_size - 1))
    return rounded_share(sum(parts[k] for k in TOKEN_PARTS) / sum(parts.values()))


def rounded_share(share: float) -> float:
    """`share` to the nearest multiple of SHARE_STEP."""
    return round(round(share / SHARE_STEP) * SHARE_STEP, 4)
