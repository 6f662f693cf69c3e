"""DFlash 2's two modules: the grouped dynamic depthwise convolution and the candidate path
selector (architecture only; the selector's training loss is `objective.selector_loss`).

Grouped dynamic depthwise convolution (two per draft layer, on the block stream only; the target
context injected as keys/values is never convolved):

    r = x; h = input_norm(x); h, k = attention_conv.prepare(h); h = attention(h)
    h = attention_conv.finish(h, k); x = r + h        (the same around the MLP with mlp_conv)

One convolution holds `base_kernel` (2, T, D) (index 0 for prepare, 1 for finish) and
`kernel_projection`, a bias-free Linear(D -> 2 * T * G) (G = D / g groups of g channels).
`prepare(h)` computes delta = kernel_projection(h) viewed as (..., 2, T, G) and returns
    out[t, c] = sum_tau (base[0, tau, c] + delta[t, 0, tau, c // g]) * h[t - tau, c]
and delta[..., 1, :, :]; `finish(z, delta1)` applies the same form to the sublayer output z with
base[1] and that delta1 (computed from prepare's input, not from z). Tap tau reads position
t - tau of the SAME block: positions before the block's start read zero. At inference the draft
forward sees one block; in training many blocks sit side by side in one sequence of N * B
positions, so every convolution views it as (N, B) and shifts inside each block only.
Identity initialisation (base tap 0 = 1, other taps 0, projection 0) makes both convolutions the
identity, which lets a trained DFlash 1 drafter start a DFlash 2 one unchanged.

Candidate path selector: per draft position t, the K largest unary logits (values U_t, ids C_t),
a hidden projection H (Linear D -> r) and two codebooks of shape (V, r), predecessor A and
successor B (parameters named without `.weight`, as the checkpoint contract spells them). The
score of candidate b given predecessor a is
    S_t(b) = U_t(b) + < A[a] * (H h_t), B[b] >.
The walk feeds the verified anchor as the first predecessor and each chosen token as the next
one: greedy takes argmax S_t; sampled draws from q_t = softmax(S_t / T) over the K candidates.
The successor codebook starts at zero, so at step 0 the selector ranks exactly as the unary
logits do (and a warm-started drafter drafts exactly what its DFlash 1 parent did).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedDynamicConv(nn.Module):
    """One grouped dynamic depthwise convolution (a prepare / finish pair, see the module doc)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        assert hidden_size % group_size == 0, "checked by DFlashConfig"
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Base tap 0 = 1, every other tap 0, projection 0: prepare and finish return their
        input exactly."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0].fill_(1.0)
        self.kernel_projection.weight.zero_()

    def prepare(self, h: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h: (batch, L, D), L a multiple of `block_len` (whole blocks side by side) ->
        (the convolved h, the finish kernel (batch, L, T, G))."""
        delta = self.kernel_projection(h).view(*h.shape[:-1], 2, self.kernel_size, self.groups)
        out = self._convolve(h, self.base_kernel[0], delta[..., 0, :, :], block_len)
        return out, delta[..., 1, :, :]

    def finish(self, z: torch.Tensor, delta: torch.Tensor, block_len: int) -> torch.Tensor:
        """z: (batch, L, D) the sublayer's output; delta: prepare's finish kernel."""
        return self._convolve(z, self.base_kernel[1], delta, block_len)

    def _convolve(
        self, x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, block_len: int
    ) -> torch.Tensor:
        """x: (batch, L, D); base: (T, D); delta: (batch, L, T, G). Taps stay inside blocks."""
        batch, length, dim = x.shape
        assert length % block_len == 0, (length, block_len)
        g, groups = self.group_size, self.groups
        xs = x.view(batch, length // block_len, block_len, groups, g)  # (b, N, B, G, g)
        ds = delta.reshape(batch, length // block_len, block_len, self.kernel_size, groups, 1)
        base = base.to(x.dtype)
        out = torch.zeros_like(xs)
        for tau in range(min(self.kernel_size, block_len)):  # a tap past the block start reads 0
            # Position i of a block reads position i - tau of the same block (zeros before it).
            shifted = xs if tau == 0 else F.pad(xs[:, :, :-tau], (0, 0, 0, 0, tau, 0))
            out = out + base[tau].view(groups, g) * shifted
            out = out + ds[:, :, :, tau].to(x.dtype) * shifted
        return out.view(batch, length, dim)


class CandidateSelector(nn.Module):
    """The candidate path selector (see the module doc): scores the top-K unary candidates of
    each draft position given its predecessor token."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Projection and predecessor codebook N(0, std), successor codebook 0: the pair term is
        0, so the selector ranks exactly as the unary logits; the first step's gradient reaches
        the successor codebook, the next ones every part."""
        for w in (self.hidden_projection.weight, self.predecessor_codebook):
            w.copy_(torch.empty(w.shape).normal_(0.0, std, generator=generator))
        self.successor_codebook.zero_()

    def pair_scores(
        self, hidden: torch.Tensor, predecessors: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """< A[a] * (H h), B[b] > for every candidate b.

        hidden: (..., D) final-normed draft states; predecessors: (...,) token ids;
        candidates: (..., K) token ids -> (..., K).
        """
        query = self.hidden_projection(hidden) * self.predecessor_codebook[predecessors]  # (.., r)
        succ = self.successor_codebook[candidates]  # (..., K, r)
        return torch.einsum("...r,...kr->...k", query.to(succ.dtype), succ)

    @torch.no_grad()
    def walk(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The selector's path through one block's draft positions.

        hidden: (P, D) draft states of offsets 1 .. P; logits: (P, V) their unary logits;
        anchor: 0-dim id of the verified anchor (the first predecessor).
        Returns the drafted tokens (P,), the candidates (P, K) and, at T > 0, the distributions
        q (P, K) over the candidates they were drawn from (None at T = 0). No host sync.
        """
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)  # (P, K)
        query = self.hidden_projection(hidden)  # (P, r)
        succ = self.successor_codebook[candidates]  # (P, K, r)
        predecessor = anchor.reshape(())
        tokens, qs = [], []
        for t in range(hidden.shape[0]):
            pair = succ[t] @ (self.predecessor_codebook[predecessor] * query[t])  # (K,)
            scores = unary[t].float() + pair.float()
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[0]
                qs.append(q)
            else:
                index = scores.argmax()
            predecessor = candidates[t, index]  # the chosen token feeds the next position
            tokens.append(predecessor)
        q = torch.stack(qs) if qs else None
        return torch.stack(tokens), candidates, q

    @torch.no_grad()
    def walk_blocks(
        self,
        hidden: torch.Tensor,
        unary: torch.Tensor,
        candidates: torch.Tensor,
        anchors: torch.Tensor,
    ) -> torch.Tensor:
        """`walk` at T = 0 over many independent blocks at once (on-policy rounds).

        hidden: (N, P, D); unary, candidates: (N, P, K) the top-K unary logits of each position
        and their ids (`torch.topk` of its logits, taken by the caller chunk by chunk);
        anchors: (N,) each block's anchor id. Returns the drafted tokens (N, P): the same
        per-position scores as `walk`, each block's chosen token the predecessor of its next
        position. No host sync.
        """
        query = self.hidden_projection(hidden)  # (N, P, r)
        succ = self.successor_codebook[candidates]  # (N, P, K, r)
        predecessor = anchors
        tokens = []
        for t in range(hidden.shape[1]):
            mixed = self.predecessor_codebook[predecessor] * query[:, t]  # (N, r)
            pair = (succ[:, t] @ mixed[:, :, None])[..., 0]  # (N, K)
            index = (unary[:, t].float() + pair.float()).argmax(-1)
            predecessor = candidates[:, t].gather(1, index[:, None])[:, 0]
            tokens.append(predecessor)
        return torch.stack(tokens, 1)
