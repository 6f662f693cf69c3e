"""Training-time attention under the DFlash block mask, three interchangeable kernels.

Layout: each sequence carries N blocks of B tokens. Keys/values are [S context | N * B block
tokens]; queries are the N * B block tokens. A query in block j (anchor p_j) may see
  - context positions s < p_j (STRICTLY: the anchor's own hidden state does not exist yet at
    inference time), and
  - every token of its own block j (bidirectional inside the block),
and nothing else: no other block, no context at or after the anchor. Padding blocks (no valid
anchor) see only themselves: that keeps their softmax finite (no NaN to poison gradients) while
they stay invisible to every real block and carry zero loss.

Kernels (all give the same numbers; tests hold them to 1e-5 in fp32):
- "dense": one SDPA call with an explicit boolean mask over [context | all blocks]. Simple and
  the reference, but its cost and memory grow with N * B * (S + N * B).
- "blockwise": never materialises the block-to-block part. Scores against the context and against
  the own block are concatenated along the key axis and share ONE softmax; blocks are processed in
  chunks (anchors sorted) so each chunk only touches the context prefix its anchors can see.
  Cost ~ N * B * (S / 2 + B). Works everywhere, with gradients.
- "flex": `torch.nn.attention.flex_attention` with a block-sparse mask; skips masked tiles on GPU.
  No backward on CPU in torch 2.13.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "dense", "blockwise", "flex")


@dataclass
class BlockLayout:
    """Where the N blocks of each row start, and which are real.

    anchors: (batch, N) long, ascending within a row for real blocks; padding blocks last.
    valid: (batch, N) bool.
    context_limits: (batch, N) long, the number of context positions block j may see
        (= anchor for real blocks, 0 for padding).
    chunks: host-side plan for the blockwise kernel, (first block, end block, context length).
    """

    anchors: torch.Tensor
    valid: torch.Tensor
    context_limits: torch.Tensor
    block_size: int
    chunks: list[tuple[int, int, int]]

    @classmethod
    def build(
        cls,
        anchors: torch.Tensor,
        valid: torch.Tensor,
        block_size: int,
        device: torch.device | str | None = None,
        num_chunks: int = 8,
    ) -> BlockLayout:
        """From host tensors (so the chunk plan needs no device sync), moved to `device`."""
        assert anchors.shape == valid.shape and anchors.dim() == 2
        limits = torch.where(valid, anchors, torch.zeros_like(anchors))
        n = anchors.shape[1]
        num_chunks = max(1, min(num_chunks, n))
        bounds = [round(i * n / num_chunks) for i in range(num_chunks + 1)]
        chunks = []
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                chunks.append((lo, hi, int(limits[:, lo:hi].max().item()) if n else 0))
        return cls(
            anchors=anchors.to(device, non_blocking=True),
            valid=valid.to(device, non_blocking=True),
            context_limits=limits.to(device, non_blocking=True),
            block_size=block_size,
            chunks=chunks,
        )

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def slice_blocks(self, lo: int, hi: int) -> BlockLayout:
        """Blocks lo..hi-1 as a layout of their own (one chunk, the same context prefix)."""
        limits = self.context_limits[:, lo:hi]
        ctx_len = next(c for a, b, c in self.chunks if a <= lo and hi <= b) if self.chunks else 0
        return BlockLayout(
            anchors=self.anchors[:, lo:hi],
            valid=self.valid[:, lo:hi],
            context_limits=limits,
            block_size=self.block_size,
            chunks=[(0, hi - lo, ctx_len)],
        )

    def query_positions(self) -> torch.Tensor:
        """(batch, N * B) absolute positions of the block tokens: p_j + 0 .. p_j + B - 1."""
        offs = torch.arange(self.block_size, device=self.anchors.device)
        return (self.anchors[..., None] + offs).flatten(1)

    def dense_mask(self, context_len: int) -> torch.Tensor:
        """(batch, 1, N * B, S + N * B) boolean visibility, True = may attend."""
        n, b = self.num_blocks, self.block_size
        dev = self.anchors.device
        ctx = torch.arange(context_len, device=dev) < self.context_limits[..., None]
        ctx = ctx.repeat_interleave(b, dim=1)  # (batch, N * B, S)
        block_id = torch.arange(n * b, device=dev) // b
        own = (block_id[:, None] == block_id[None, :]).expand(ctx.shape[0], -1, -1)
        return torch.cat([ctx, own], dim=-1)[:, None]


def resolve_backend(name: str, device: torch.device, needs_grad: bool) -> str:
    """Pick a concrete kernel for `auto`; refuse `flex` where it cannot run."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "flex" if device.type == "cuda" and _flex_available() else "blockwise"
    if name == "flex" and device.type == "cpu" and needs_grad:
        raise ValueError(
            "attention 'flex' has no backward on CPU (torch flex_attention); use 'blockwise' or "
            "'dense' for CPU training"
        )
    return name


def _flex_available() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def block_attention(
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_blk: torch.Tensor,
    v_blk: torch.Tensor,
    layout: BlockLayout,
    backend: str,
) -> torch.Tensor:
    """Attention of block queries over [context | own block].

    q: (batch, heads, N * B, d); k_ctx, v_ctx: (batch, kv_heads, S, d);
    k_blk, v_blk: (batch, kv_heads, N * B, d). Returns (batch, heads, N * B, d).
    """
    if backend == "dense":
        return _dense(q, k_ctx, v_ctx, k_blk, v_blk, layout)
    if backend == "blockwise":
        return _blockwise(q, k_ctx, v_ctx, k_blk, v_blk, layout)
    if backend == "flex":
        return _flex(q, k_ctx, v_ctx, k_blk, v_blk, layout)
    raise ValueError(f"unknown attention backend {backend!r} (resolve 'auto' first)")


def _dense(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout) -> torch.Tensor:
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    mask = layout.dense_mask(k_ctx.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _blockwise(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout) -> torch.Tensor:
    batch, heads, _, d = q.shape
    kv_heads = k_ctx.shape[1]
    g, b = heads // kv_heads, layout.block_size
    scale = d**-0.5
    # Queries grouped under their kv head: (batch, kv_heads, g, N, B, d).
    qg = q.view(batch, kv_heads, g, layout.num_blocks, b, d)
    kb = k_blk.view(batch, kv_heads, 1, layout.num_blocks, b, d)
    vb = v_blk.view(batch, kv_heads, 1, layout.num_blocks, b, d)
    outs = []
    for lo, hi, ctx_len in layout.chunks:
        c = hi - lo
        qc = qg[:, :, :, lo:hi]  # (batch, kv, g, C, B, d)
        s_own = qc @ kb[:, :, :, lo:hi].transpose(-1, -2)  # (batch, kv, g, C, B, B)
        if ctx_len > 0:
            flat = qc.reshape(batch, kv_heads, g * c * b, d)
            s_ctx = (flat @ k_ctx[:, :, :ctx_len].transpose(-1, -2)).view(
                batch, kv_heads, g, c, b, ctx_len
            )
            pos = torch.arange(ctx_len, device=q.device)
            seen = pos < layout.context_limits[:, lo:hi, None]  # (batch, C, ctx_len)
            s_ctx = s_ctx.masked_fill(~seen[:, None, None, :, None, :], float("-inf"))
            scores = torch.cat([s_ctx, s_own], dim=-1)
        else:
            scores = s_own
        probs = torch.softmax(scores * scale, dim=-1, dtype=torch.float32).to(q.dtype)
        out = probs[..., ctx_len:] @ vb[:, :, :, lo:hi]  # (batch, kv, g, C, B, d)
        if ctx_len > 0:
            p_ctx = probs[..., :ctx_len].reshape(batch, kv_heads, g * c * b, ctx_len)
            out = out + (p_ctx @ v_ctx[:, :, :ctx_len]).view(batch, kv_heads, g, c, b, d)
        outs.append(out)
    out = torch.cat(outs, dim=3) if len(outs) > 1 else outs[0]
    return out.reshape(batch, heads, layout.num_blocks * b, d)


_COMPILED_FLEX = None


def _flex(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout) -> torch.Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = k_ctx.shape[2]
    b = layout.block_size
    limits = layout.context_limits

    def mask_mod(bi, hi, q_idx, kv_idx):
        j = q_idx // b
        ctx_ok = (kv_idx < s) & (kv_idx < limits[bi, j])
        own_ok = (kv_idx >= s) & ((kv_idx - s) // b == j)
        return ctx_ok | own_ok

    n_q = q.shape[2]
    mask = create_block_mask(
        mask_mod, q.shape[0], None, n_q, s + n_q, device=q.device, _compile=q.is_cuda
    )
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    fn = flex_attention
    if q.is_cuda:
        global _COMPILED_FLEX
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        fn = _COMPILED_FLEX
    return fn(q, k, v, block_mask=mask, enable_gqa=True)


def layout_to(layout: BlockLayout, device: torch.device | str) -> BlockLayout:
    """The same layout with its tensors on `device` (the chunk plan stays on the host)."""
    return BlockLayout(
        anchors=layout.anchors.to(device, non_blocking=True),
        valid=layout.valid.to(device, non_blocking=True),
        context_limits=layout.context_limits.to(device, non_blocking=True),
        block_size=layout.block_size,
        chunks=layout.chunks,
    )
