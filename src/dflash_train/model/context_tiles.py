"""The blockwise kernel's context part for long rows: an anchor chunk's attention over a context
too long to score at once, read in tiles of keys with an online softmax (FlashAttention's
scheme), so a 32K-token row needs one tile of scores per chunk instead of chunk rows x 32K.

Used by `block_attention._blockwise` when a chunk's fp32 scores against its whole context would
pass `CONTEXT_SCORES_BYTES`; below that the one-pass kernel (probabilities saved, nothing
recomputed) stays the faster choice.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

CONTEXT_SCORES_BYTES = 64 * 2**20
"""The fp32 scores one anchor chunk may hold against its whole context (queries x context
keys x 4 bytes). Past it the context is tiled (`_TiledContextChunk`): a long row's attention
then needs about this much per chunk whatever its length, at the price of recomputing the
scores in backward."""


def context_tile(query_rows: int, context_len: int) -> int | None:
    """Context keys per tile for `query_rows` query rows (batch x heads x chunk rows) over
    `context_len` keys, or None when the whole context fits `CONTEXT_SCORES_BYTES` (one pass
    with the probabilities saved: nothing recomputed)."""
    if query_rows * context_len * 4 <= CONTEXT_SCORES_BYTES:
        return None
    return max(128, CONTEXT_SCORES_BYTES // (4 * max(1, query_rows)))


class TiledContextChunk(torch.autograd.Function):
    """`block_attention._BlockwiseChunk` over a context too long to score at once: the
    context is read in tiles of `tile` keys with an online softmax (a running max m,
    normaliser l and output per query row, rescaled by exp(m_old - m_new) at each tile),
    starting from the own block (every row sees its own token, so m is finite from the first
    step). Saved: the inputs, the output and the rows' log-sum-exp; backward recomputes each
    tile's probabilities from them (FlashAttention's scheme), so memory is one tile of scores
    per chunk, not the whole context. Same layouts as `_BlockwiseChunk`; softmax statistics
    and accumulators in `stats_dtype` (fp32 unless the inputs are fp64)."""

    @staticmethod
    def forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, seen, own, block_size, tile):
        batch, heads, rows, d = q.shape
        kv = k_blk.shape[1]
        g, b = heads // kv, block_size
        c, s = rows // b, k_ctx.shape[2]
        n, acc_dtype = c * g * b, stats_dtype(q.dtype)
        qb = (q.view(batch, kv, g, c, b, d).transpose(2, 3) * d**-0.5).contiguous()
        p_own = _own_scores(qb, k_blk, own, c, b)  # (batch * kv, n, B), masked
        m = p_own.amax(-1)
        p_own = p_own.sub_(m[..., None]).exp_()
        total = p_own.sum(-1)
        vb = v_blk.reshape(batch * kv * c, b, d)
        acc = torch.bmm(p_own.view(batch * kv * c, g * b, b).to(q.dtype), vb)
        acc = acc.view(batch * kv, n, d).to(acc_dtype)
        q_all = qb.view(batch * kv, n, d)
        vc = v_ctx.reshape(batch * kv, s, d)  # a copy only if v_ctx is not laid out so
        for t0, t1, scores in _context_tiles(q_all, k_ctx, seen, tile, (batch, kv, c, g, b)):
            m_new = torch.maximum(m, scores.amax(-1))
            alpha = (m - m_new).exp_()  # rescales what the earlier tiles summed
            scores.sub_(m_new[..., None]).exp_()
            total = total.mul_(alpha).add_(scores.sum(-1))
            pv = torch.bmm(scores.to(q.dtype), vc[:, t0:t1]).to(acc_dtype)
            acc = acc.mul_(alpha[..., None]).add_(pv)
            m = m_new
        out = acc.div_(total[..., None]).to(q.dtype)  # (batch * kv, n, d), block-major
        lse = m.add_(total.log_())
        ctx.save_for_backward(qb, k_ctx, v_ctx, k_blk, v_blk, out, lse, seen, own)
        ctx.shape, ctx.tile = (batch, kv, g, c, b, d, s), tile
        out = out.view(batch, kv, c, g, b, d).permute(0, 2, 4, 1, 3, 5).contiguous()
        return out.view(batch, rows, heads, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out):
        qb, k_ctx, v_ctx, k_blk, v_blk, out, lse, seen, own = ctx.saved_tensors
        batch, kv, g, c, b, d, s = ctx.shape
        heads, rows, n = kv * g, c * b, c * g * b
        dtype, acc_dtype = qb.dtype, lse.dtype
        do = block_major_grad(grad_out, (batch, kv, g, c, b, d)).to(dtype)
        delta = (do.to(acc_dtype) * out.to(acc_dtype)).sum(-1)  # rowsum(dO * O) = rowsum(P * dP)
        # Own block: its probabilities again, from the saved log-sum-exp.
        p_own = _own_scores(qb, k_blk, own, c, b).sub_(lse[..., None]).exp_()
        vb, kb = v_blk.reshape(batch * kv * c, b, d), k_blk.reshape(batch * kv * c, b, d)
        do_blk, q_blk = do.view(batch * kv * c, g * b, d), qb.view(batch * kv * c, g * b, d)
        d_own = torch.bmm(do_blk, vb.transpose(1, 2)).to(acc_dtype).view(batch * kv, n, b)
        d_own = d_own.sub_(delta[..., None]).mul_(p_own).to(dtype).view(batch * kv * c, g * b, b)
        dv_blk = torch.bmm(p_own.to(dtype).view(batch * kv * c, g * b, b).transpose(1, 2), do_blk)
        dk_blk = torch.bmm(d_own.transpose(1, 2), q_blk)
        dq = torch.bmm(d_own, kb).view(batch * kv, n, d).to(acc_dtype)
        # Context, tile by tile: P = exp(S - lse), dS = P (dP - delta).
        q_all = qb.view(batch * kv, n, d)
        kc, vc = k_ctx.reshape(batch * kv, s, d), v_ctx.reshape(batch * kv, s, d)
        # Fresh contiguous buffers, whatever the strides of the saved keys and values.
        dk_ctx = torch.empty(batch * kv, s, d, dtype=k_ctx.dtype, device=k_ctx.device)
        dv_ctx = torch.empty(batch * kv, s, d, dtype=v_ctx.dtype, device=v_ctx.device)
        for t0, t1, scores in _context_tiles(q_all, k_ctx, seen, ctx.tile, (batch, kv, c, g, b)):
            p = scores.sub_(lse[..., None]).exp_()
            dv_ctx[:, t0:t1] = torch.bmm(p.to(dtype).transpose(1, 2), do)
            ds = torch.bmm(do, vc[:, t0:t1].transpose(1, 2)).to(acc_dtype)
            ds = ds.sub_(delta[..., None]).mul_(p).to(dtype)
            dk_ctx[:, t0:t1] = torch.bmm(ds.transpose(1, 2), q_all)
            dq = dq.add_(torch.bmm(ds, kc[:, t0:t1]).to(acc_dtype))
        dq = (dq * d**-0.5).to(dtype)
        dq = dq.view(batch, kv, c, g, b, d).transpose(2, 3).reshape(batch, heads, rows, d)
        return (
            dq,
            dk_ctx.view(batch, kv, s, d),
            dv_ctx.view(batch, kv, s, d),
            dk_blk.view(batch, kv, rows, d),
            dv_blk.view(batch, kv, rows, d),
            None,
            None,
            None,
            None,
        )


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of softmax statistics and accumulators: fp32 for fp32 and lower precisions,
    fp64 for fp64 (so a float64 check against the dense kernel sees only fp64 rounding)."""
    return torch.promote_types(dtype, torch.float32)


def block_major_grad(grad_out: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The output gradient (batch, heads, C * B, d), any strides, in the kernels' block-major
    order: a CONTIGUOUS (batch * kv, C * g * B, d).

    `reshape` alone is not enough: with one query head per kv head (g = 1: the MHA drafters of
    MLA and OLMo targets) the transpose moves a size-1 axis, and for a gradient the output
    projection hands back strided ((batch, rows, heads, d) transposed; one row per batch) or a
    chunk's slice of a contiguous one, `reshape` returns a strided view whose per-block
    `view(batch * kv * C, g * B, d)` does not exist."""
    batch, kv, g, c, b, d = dims
    do = grad_out.view(batch, kv, g, c, b, d).transpose(2, 3)
    return do.reshape(batch * kv, c * g * b, d).contiguous()


def _own_scores(qb, k_blk, own, c: int, b: int) -> torch.Tensor:
    """Scores of block-major queries `qb` (batch, kv, C, g, B, d) against their own block's keys,
    masked by `own`: (batch * kv, C * g * B, B), in `stats_dtype`."""
    batch, kv, _, g, _, d = qb.shape
    kb = k_blk.reshape(batch * kv * c, b, d)
    scores = torch.bmm(qb.reshape(batch * kv * c, g * b, d), kb.transpose(1, 2))
    scores = scores.to(stats_dtype(qb.dtype))
    if own is not None:  # every row keeps its own token: the max stays finite
        scores.view(batch * kv * c, g, b, b).masked_fill_(~own, float("-inf"))
    return scores.view(batch * kv, c * g * b, b)


def _context_tiles(
    q_all: torch.Tensor,
    k_ctx: torch.Tensor,
    seen: torch.Tensor,
    tile: int,
    dims: tuple[int, int, int, int, int],
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(t0, t1, masked scores (batch * kv, n, t1 - t0) in `stats_dtype`) for each tile of
    context keys."""
    batch, kv, c, g, b = dims
    s, d = k_ctx.shape[2], k_ctx.shape[3]
    kc = k_ctx.reshape(batch * kv, s, d)
    for t0 in range(0, s, tile):
        t1 = min(s, t0 + tile)
        scores = torch.bmm(q_all, kc[:, t0:t1].transpose(1, 2)).to(stats_dtype(q_all.dtype))
        hidden = ~seen[..., t0:t1][:, None, :, None]  # (batch, 1, C, 1, 1 or B, T)
        scores.view(batch, kv, c, g, b, t1 - t0).masked_fill_(hidden, float("-inf"))
        yield t0, t1, scores
