"""Training-time attention under the DFlash block mask, three interchangeable kernels.

Layout: each sequence carries N blocks of B tokens. Keys/values are [S context | N * B block
tokens]; queries are the N * B block tokens. A query at offset i of block j (anchor p_j, absolute
position q = p_j + i) may see
  - context positions s < p_j (STRICTLY: the anchor's own hidden state does not exist yet at
    inference time), and
  - the tokens of its own block j: all of them (bidirectional, full-attention layers by
    default) or, for a causal layer, offsets <= i,
and nothing else: no other block, no context at or after the anchor. A sliding-window layer
(window W) also drops every key at distance W or more: context keys with q - s >= W and, when it
is bidirectional inside the block, block keys with |offset difference| >= W. Distances are
between absolute positions, as in the reference client's `_attention_mask`, so the training mask
of a block is exactly what inference shows it. Padding blocks (no valid anchor) see only their
own block: that keeps their softmax finite (no NaN to poison gradients; every row sees at least
its own token) while they stay invisible to every real block and carry zero loss.

Kernels (all give the same numbers; tests hold them to 1e-5 in fp32):
- "dense": one SDPA call with an explicit boolean mask over [context | all blocks]. Simple and
  the reference, but its cost and memory grow with N * B * (S + N * B).
- "blockwise": never materialises the block-to-block part. Scores against the context and against
  the own block share ONE softmax (a common max and normaliser over both parts); blocks are
  processed in chunks (anchors sorted) so each chunk only touches the context its anchors can
  see: the prefix before its last anchor and, for a sliding layer, nothing before its first
  anchor - W + 1. Cost ~ N * B * (S / 2 + B). Plain contiguous matmuls and a hand-written
  backward (no copies of score-sized tensors). Works everywhere, with gradients. A chunk whose
  scores against its context would pass `context_tiles.CONTEXT_SCORES_BYTES` (long rows) reads
  the context in tiles instead (`context_tiles.py`): memory bounded, scores recomputed.
- "flex": `torch.nn.attention.flex_attention` with a block-sparse mask; skips masked tiles on GPU.
  No backward on CPU in torch 2.13.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dflash_train.model import flex
from dflash_train.model.context_tiles import (
    TiledContextChunk,
    block_major_grad,
    context_tile,
    stats_dtype,
)

ATTENTION_BACKENDS = ("auto", "dense", "blockwise", "flex")


@dataclass
class BlockLayout:
    """Where the N blocks of each row start, and which are real.

    anchors: (batch, N) long, ascending within a row for real blocks; padding blocks last.
    valid: (batch, N) bool.
    context_limits: (batch, N) long, the number of context positions block j may see
        (= anchor for real blocks, 0 for padding).
    chunks: host-side plan for the blockwise kernel, (first block, end block, context length).
    chunk_first_anchors: per chunk, its smallest real anchor (0 without one), host-side: where a
        sliding-window layer's visible context begins for that chunk. Empty: unknown (the
        kernel then reads the context from position 0).
    masks: the dense and blockwise kernels' masks of each layer kind (window, causal), made by
        its first layer and read by the others (`chunk_masks`); never copied with the layout.
    """

    anchors: torch.Tensor
    valid: torch.Tensor
    context_limits: torch.Tensor
    block_size: int
    chunks: list[tuple[int, int, int]]
    chunk_first_anchors: list[int] = field(default_factory=list)
    masks: dict[tuple, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

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
        chunks, firsts = [], []
        for lo, hi in itertools.pairwise(bounds):
            if hi > lo:
                chunks.append((lo, hi, int(limits[:, lo:hi].max().item()) if n else 0))
                real = anchors[:, lo:hi][valid[:, lo:hi]]
                firsts.append(int(real.min().item()) if real.numel() else 0)
        return cls(
            anchors=anchors.to(device, non_blocking=True),
            valid=valid.to(device, non_blocking=True),
            context_limits=limits.to(device, non_blocking=True),
            block_size=block_size,
            chunks=chunks,
            chunk_first_anchors=firsts,
        )

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    def chunk_views(
        self, context: list[tuple[torch.Tensor, torch.Tensor]], attention: str
    ) -> Iterator[tuple[int, int, BlockLayout, list[tuple[torch.Tensor, torch.Tensor]]]]:
        """Per anchor chunk: (lo, hi, its blocks' layout, the context keys/values (batch, heads,
        positions, dim) per layer that it can see). The context is cut to the chunk's furthest
        reach, except for flex, whose kernel skips masked tiles itself and keeps one compiled
        shape for every chunk when the context's is the same. Views only, made as iterated."""
        for lo, hi, ctx_len in self.chunks:
            seen = None if attention == "flex" else ctx_len
            kv = [(k[:, :, :seen], v[:, :, :seen]) for k, v in context]
            yield lo, hi, self.slice_blocks(lo, hi), kv

    def slice_blocks(self, lo: int, hi: int) -> BlockLayout:
        """Blocks lo..hi-1 as a layout of their own (one chunk, the same context prefix)."""
        limits = self.context_limits[:, lo:hi]
        at = next((i for i, (a, b, _) in enumerate(self.chunks) if a <= lo and hi <= b), None)
        ctx_len = self.chunks[at][2] if at is not None else 0
        # The containing chunk's first anchor is <= this sub-range's: a safe place to start.
        firsts = self.chunk_first_anchors[at : at + 1] if at is not None else []
        return BlockLayout(
            anchors=self.anchors[:, lo:hi],
            valid=self.valid[:, lo:hi],
            context_limits=limits,
            block_size=self.block_size,
            chunks=[(0, hi - lo, ctx_len)],
            chunk_first_anchors=firsts,
        )

    def query_positions(self) -> torch.Tensor:
        """(batch, N * B) absolute positions of the block tokens: p_j + 0 .. p_j + B - 1."""
        offs = torch.arange(self.block_size, device=self.anchors.device)
        return (self.anchors[..., None] + offs).flatten(1)

    def context_seen(
        self, lo: int, hi: int, positions: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """Which of the context `positions` (S',) the queries of blocks lo..hi-1 see:
        (batch, C, 1, S') without a window (one row serves the whole block), (batch, C, B, S')
        with one (each offset's window ends elsewhere)."""
        seen = (positions < self.context_limits[:, lo:hi, None])[:, :, None]
        if window is None:
            return seen
        offs = torch.arange(self.block_size, device=positions.device)
        q_pos = self.anchors[:, lo:hi, None] + offs  # (batch, C, B)
        # Context keys lie before every query of the block, so only q - k < W can hide them.
        return seen & (q_pos[..., None] - positions < window)

    def in_block_mask(self, window: int | None, causal: bool) -> torch.Tensor | None:
        """(B, B) visibility between the offsets of one block (query row, key column), or None
        when every block token sees the whole block."""
        b = self.block_size
        if not causal and (window is None or window >= b):
            return None
        offs = torch.arange(b, device=self.anchors.device)
        return visible(offs[:, None], offs[None, :], window, causal)

    def dense_mask(
        self, context_len: int, window: int | None = None, causal: bool = False
    ) -> torch.Tensor:
        """(batch, 1, N * B, S + N * B) boolean visibility, True = may attend."""
        n, b = self.num_blocks, self.block_size
        dev = self.anchors.device
        ctx = self.context_seen(0, n, torch.arange(context_len, device=dev), window)
        ctx = ctx.expand(-1, -1, b, -1).reshape(ctx.shape[0], n * b, context_len)
        block_id = torch.arange(n * b, device=dev) // b
        own = block_id[:, None] == block_id[None, :]
        rule = self.in_block_mask(window, causal)
        if rule is not None:
            own = own & rule.repeat(n, n)
        own = own.expand(ctx.shape[0], -1, -1)
        return torch.cat([ctx, own], dim=-1)[:, None]


def visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, causal: bool
) -> torch.Tensor:
    """The reference client's rule between query and key positions (broadcast): a causal layer
    sees keys k <= q; a sliding one keys with q - k < window and, unless causal, k - q < window.
    (Context keys are also limited to k < anchor, by the caller.)"""
    shape = torch.broadcast_shapes(q_pos.shape, k_pos.shape)
    seen = torch.ones(shape, dtype=torch.bool, device=q_pos.device)
    if causal:
        seen &= k_pos <= q_pos
    if window is not None:
        seen &= q_pos - k_pos < window
        if not causal:
            seen &= k_pos - q_pos < window
    return seen


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
    window: int | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of block queries over [context | own block].

    q: (batch, heads, N * B, d); k_ctx, v_ctx: (batch, kv_heads, S, d);
    k_blk, v_blk: (batch, kv_heads, N * B, d). Returns (batch, heads, N * B, d).
    window: a sliding-window layer's window (None: full attention); causal: causal inside the
    block (see the module docstring).
    """
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1, got {window}")
    if backend == "dense":
        return _dense(q, k_ctx, v_ctx, k_blk, v_blk, layout, window, causal)
    if backend == "blockwise":
        return _blockwise(q, k_ctx, v_ctx, k_blk, v_blk, layout, window, causal)
    if backend == "flex":
        return _flex(q, k_ctx, v_ctx, k_blk, v_blk, layout, window, causal)
    raise ValueError(f"unknown attention backend {backend!r} (resolve 'auto' first)")


def _dense(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout, window, causal) -> torch.Tensor:
    k = torch.cat([k_ctx, k_blk], dim=2)
    v = torch.cat([v_ctx, v_blk], dim=2)
    key = ("dense", k_ctx.shape[2], window, causal)  # one per layer kind, as `chunk_masks`
    if key not in layout.masks:
        layout.masks[key] = layout.dense_mask(k_ctx.shape[2], window, causal)
    mask = layout.masks[key]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _one_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every operand in one compute dtype: under autocast the norms hand back fp32 queries and
    keys next to low-precision values; the kernels' matmuls run in autocast's dtype, as SDPA's."""
    dev = tensors[0].device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else tensors[0].dtype
    return tuple(t.to(dtype) for t in tensors)


def chunk_masks(
    layout: BlockLayout, window: int | None, causal: bool
) -> tuple[list[tuple[int, torch.Tensor]], torch.Tensor | None]:
    """The blockwise kernel's masks of one layer kind over `layout`: per chunk, the first
    context position it reads and the context it sees (`context_seen`), and the in-block mask.
    Built by the first layer of the kind and kept in `layout.masks` for the others (they do
    not depend on the layer)."""
    key = (window, causal)
    if key not in layout.masks:
        pos = torch.arange(max(c for _, _, c in layout.chunks), device=layout.anchors.device)
        seen = []
        for i, (lo, hi, ctx_len) in enumerate(layout.chunks):
            # A sliding layer's earliest visible key for this chunk is its first anchor - W + 1.
            start = 0
            if window is not None and layout.chunk_first_anchors:
                start = min(ctx_len, max(0, layout.chunk_first_anchors[i] - window + 1))
            seen.append((start, layout.context_seen(lo, hi, pos[start:ctx_len], window)))
        layout.masks[key] = (seen, layout.in_block_mask(window, causal))
    return layout.masks[key]


def _blockwise(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout, window, causal) -> torch.Tensor:
    q, k_ctx, v_ctx, k_blk, v_blk = _one_dtype(q, k_ctx, v_ctx, k_blk, v_blk)
    b = layout.block_size
    seen_by_chunk, own = chunk_masks(layout, window, causal)
    outs = []
    for (lo, hi, ctx_len), (start, seen) in zip(layout.chunks, seen_by_chunk, strict=True):
        rows = slice(lo * b, hi * b)
        chunk = (
            q[:, :, rows],
            k_ctx[:, :, start:ctx_len],
            v_ctx[:, :, start:ctx_len],
            k_blk[:, :, rows],
            v_blk[:, :, rows],
            seen,
            own,
            b,
        )
        tile = context_tile(q.shape[0] * q.shape[1] * (hi - lo) * b, ctx_len - start)
        if tile is None:
            outs.append(_BlockwiseChunk.apply(*chunk))
        else:
            outs.append(TiledContextChunk.apply(*chunk, tile))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


class _BlockwiseChunk(torch.autograd.Function):
    """One anchor chunk: C blocks of B queries over [visible context | own block], one softmax
    across both parts, with a hand-written backward. `seen` (batch, C, 1 or B, S) marks the
    context each block (or each block row) sees; `own` (B, B) the block keys each row sees, or
    None for all. Masked scores are -inf, so their probabilities are exactly 0 and backward,
    which only reads the saved probabilities, needs no mask of its own.

    Internally queries are block-major, (batch * kv_heads, C * g * B, d) for the context part
    (a few large matmuls) and (batch * kv_heads * C, g * B, d) for the own-block part, so every
    matmul is a plain contiguous bmm. The softmax scale is folded into the queries, the mask is
    applied in place, and the probabilities are normalised in place and saved (one chunk's worth
    under the chunked step): backward needs no recompute and no copies of score-sized tensors.
    Softmax statistics are fp32 whatever the input dtype (fp64 for fp64 inputs: `stats_dtype`).
    """

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, seen, own, block_size):
        batch, heads, rows, d = q.shape
        kv = k_blk.shape[1]
        g, b = heads // kv, block_size
        c, s = rows // b, k_ctx.shape[2]
        acc_dtype = stats_dtype(q.dtype)
        # (batch, kv, C, g, B, d): block-major queries, pre-scaled.
        qb = (q.view(batch, kv, g, c, b, d).transpose(2, 3) * d**-0.5).contiguous()
        kb = k_blk.reshape(batch * kv * c, b, d)
        vb = v_blk.reshape(batch * kv * c, b, d)
        p_own = torch.bmm(qb.view(batch * kv * c, g * b, d), kb.transpose(1, 2)).to(acc_dtype)
        if own is not None:  # every row keeps its own token: the max stays finite
            p_own.view(batch * kv * c, g, b, b).masked_fill_(~own, float("-inf"))
        m = p_own.amax(-1).view(batch * kv, c * g * b)
        if s:
            kc, vc = k_ctx.reshape(batch * kv, s, d), v_ctx.reshape(batch * kv, s, d)
            p_ctx = torch.bmm(qb.view(batch * kv, c * g * b, d), kc.transpose(1, 2)).to(acc_dtype)
            hidden = ~seen[:, None, :, None]  # (batch, 1, C, 1, 1 or B, s)
            p_ctx.view(batch, kv, c, g, b, s).masked_fill_(hidden, float("-inf"))
            m = torch.maximum(m, p_ctx.amax(-1))
            p_ctx.sub_(m[..., None]).exp_()
        p_own.view(batch * kv, c * g * b, b).sub_(m[..., None]).exp_()
        total = p_own.sum(-1).view(batch * kv, c * g * b)
        if s:
            total += p_ctx.sum(-1)
        inv = total.reciprocal_()
        p_own.view(batch * kv, c * g * b, b).mul_(inv[..., None])
        p_own = p_own.to(q.dtype)
        out = torch.bmm(p_own, vb).view(batch * kv, c * g * b, d)
        if s:
            p_ctx = p_ctx.mul_(inv[..., None]).to(q.dtype)
            out = out.baddbmm_(p_ctx, vc)
            ctx.save_for_backward(qb, k_ctx, v_ctx, k_blk, v_blk, p_own, p_ctx, out)
        else:
            ctx.save_for_backward(qb, k_ctx, v_ctx, k_blk, v_blk, p_own, None, out)
        ctx.shape = (batch, kv, g, c, b, d, s)
        # Back to (batch, heads, C * B, d), laid out as (batch, C * B, heads, d) so the output
        # projection's transpose + reshape is free.
        out = out.view(batch, kv, c, g, b, d).permute(0, 2, 4, 1, 3, 5).contiguous()
        return out.view(batch, rows, heads, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        qb, k_ctx, v_ctx, k_blk, v_blk, p_own, p_ctx, out = ctx.saved_tensors
        batch, kv, g, c, b, d, s = ctx.shape
        heads, rows, n = kv * g, c * b, c * g * b
        scale = d**-0.5
        acc_dtype = stats_dtype(qb.dtype)
        do = block_major_grad(grad_out, (batch, kv, g, c, b, d)).to(out.dtype)
        delta = (do.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # rowsum(dO * O) = rowsum(P * dP)
        kb = k_blk.reshape(batch * kv * c, b, d)
        vb = v_blk.reshape(batch * kv * c, b, d)
        do_blk = do.view(batch * kv * c, g * b, d)
        q_blk = qb.view(batch * kv * c, g * b, d)
        d_own = torch.bmm(do_blk, vb.transpose(1, 2)).to(acc_dtype).view(batch * kv, n, b)
        d_own = d_own.sub_(delta[..., None]).mul_(p_own.view(batch * kv, n, b).to(acc_dtype))
        d_own = d_own.to(qb.dtype).view(batch * kv * c, g * b, b)
        dv_blk = torch.bmm(p_own.transpose(1, 2), do_blk)
        dk_blk = torch.bmm(d_own.transpose(1, 2), q_blk)
        dq = torch.bmm(d_own, kb).view(batch * kv, n, d)
        dk_ctx = dv_ctx = None
        if s:
            kc, vc = k_ctx.reshape(batch * kv, s, d), v_ctx.reshape(batch * kv, s, d)
            q_all = qb.view(batch * kv, n, d)
            d_ctx = torch.bmm(do, vc.transpose(1, 2)).to(acc_dtype)
            d_ctx = d_ctx.sub_(delta[..., None]).mul_(p_ctx.to(acc_dtype)).to(qb.dtype)
            dv_ctx = torch.bmm(p_ctx.transpose(1, 2), do).view_as(v_ctx)
            dk_ctx = torch.bmm(d_ctx.transpose(1, 2), q_all).view_as(k_ctx)
            dq = dq.baddbmm_(d_ctx, kc)
        # dS = scale * d(scaled scores): the scale is in qb for dK, applied here for dQ.
        dq = (dq * scale).view(batch, kv, c, g, b, d).transpose(2, 3).reshape(batch, heads, rows, d)
        dk_blk = dk_blk.view(batch, kv, rows, d)
        dv_blk = dv_blk.view(batch, kv, rows, d)
        return dq, dk_ctx, dv_ctx, dk_blk, dv_blk, None, None, None


def _flex(q, k_ctx, v_ctx, k_blk, v_blk, layout: BlockLayout, window, causal) -> torch.Tensor:
    # Compiled on CUDA, with the rules of threads and shapes of `model.flex`.
    q, k_ctx, v_ctx, k_blk, v_blk = _one_dtype(q, k_ctx, v_ctx, k_blk, v_blk)
    k = torch.cat([k_ctx, k_blk], dim=2)  # (batch, kv_heads, S + N * B, d)
    v = torch.cat([v_ctx, v_blk], dim=2)
    limits, anchors = layout.context_limits, layout.anchors
    return flex.FLEX(q, k, v, limits, anchors, layout.block_size, window, causal)


def layout_to(layout: BlockLayout, device: torch.device | str) -> BlockLayout:
    """The same layout with its tensors on `device` (the chunk plan stays on the host)."""
    return BlockLayout(
        anchors=layout.anchors.to(device, non_blocking=True),
        valid=layout.valid.to(device, non_blocking=True),
        context_limits=layout.context_limits.to(device, non_blocking=True),
        block_size=layout.block_size,
        chunks=layout.chunks,
        chunk_first_anchors=layout.chunk_first_anchors,
    )
