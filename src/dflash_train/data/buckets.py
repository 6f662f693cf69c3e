"""Length buckets and the per-epoch batch plan.

A batch holds sequences of one bucket, right-padded to the bucket's fixed length: few distinct
shapes (good for torch.compile, CUDA graphs and the allocator) and little padding. Bucket lengths
are fitted to the data's length histogram by an exact dynamic programme that minimises the total
padding for the requested number of buckets.

The plan of an epoch is a pure function of (lengths, buckets, batch sizes, seed, epoch): every
prefetcher thread can compute it independently and a resumed run gets the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from dflash_train.objective import blocks_per_row


def fit_bucket_lengths(lengths: np.ndarray, num_buckets: int, multiple: int = 8) -> list[int]:
    """Padded lengths (multiples of `multiple`, ascending, the last >= max length) minimising the
    total padded tokens when each sequence goes to the smallest bucket that holds it."""
    return fit_bucket_options(lengths, num_buckets, multiple)[-1]


def fit_bucket_options(lengths: np.ndarray, max_buckets: int, multiple: int = 8) -> list[list[int]]:
    """`fit_bucket_lengths` for every count 1 .. max_buckets at once (one dynamic programme:
    the best k-bucket split extends the best (k-1)-bucket ones); item k - 1 holds k buckets, or
    fewer where the data has fewer distinct lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        raise ValueError("cannot fit buckets to an empty dataset")
    rounded = -(-lengths // multiple) * multiple
    values, counts = np.unique(rounded, return_counts=True)
    n = len(values)
    k_max = min(max_buckets, n)
    # Prefix sums: C[j] = rows with value index < j, S[j] = their summed TRUE lengths.
    true_sums = np.zeros(n)
    np.add.at(true_sums, np.searchsorted(values, rounded), lengths)
    c = np.concatenate([[0], np.cumsum(counts)])
    s = np.concatenate([[0.0], np.cumsum(true_sums)])
    # cost[i, j]: padding of values i..j-1 all padded to values[j - 1].
    i_idx, j_idx = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    valid = j_idx > i_idx
    cost = np.where(
        valid,
        values[np.clip(j_idx - 1, 0, n - 1)] * (c[j_idx] - c[i_idx]) - (s[j_idx] - s[i_idx]),
        np.inf,
    )
    best = cost[0].copy()  # best[j]: first j values with one bucket
    choice = [np.zeros(n + 1, dtype=np.int64)]
    for _ in range(1, k_max):
        total = best[:, None] + cost  # split after i, last bucket i..j-1
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(n + 1)]
        choice.append(arg)
    options = []
    for k in range(1, max_buckets + 1):
        # Walk back from j = n through the first min(k, k_max) layers.
        bounds, j = [], n
        for layer in reversed(range(min(k, k_max))):
            bounds.append(int(values[j - 1]))
            j = int(choice[layer][j]) if layer > 0 else 0
            if j == 0:
                break
        options.append(sorted(set(bounds)))
    return options


def assign_buckets(lengths: np.ndarray, bucket_lengths: list[int]) -> np.ndarray:
    """Index of the smallest bucket holding each length; a clear error if one does not fit."""
    lengths = np.asarray(lengths)
    idx = np.searchsorted(np.asarray(bucket_lengths), lengths, side="left")
    if (idx >= len(bucket_lengths)).any():
        longest = int(lengths.max())
        raise ValueError(
            f"a sequence of {longest} tokens exceeds the largest bucket ({bucket_lengths[-1]}); "
            "add a longer bucket or re-prepare the data with a smaller --max-length"
        )
    return idx


def batch_size_for(bucket_len: int, batch_size: int, batch_tokens: int | None) -> int:
    """Rows per batch of a bucket: fixed, or a token budget split by the padded length."""
    if batch_tokens is None:
        return batch_size
    return max(1, batch_tokens // bucket_len)


BatchingMode = Literal["work", "fixed"]


@dataclass(frozen=True)
class Batching:
    """How a bucket's rows are cut into batches.

    fixed: `batch_size` rows (or, with `batch_tokens`, batch_tokens // bucket length).
    work: as many rows as fit a budget of the drafter's work, its block positions (rows x
      blocks per row x block size, blocks per row being the batch's largest anchor count
      rounded up to a power of two), of `batch_size` fully anchored rows (`batch_size` x
      `num_anchors` x `block_size`); and at most `batch_tokens` padded tokens (default
      `batch_size` x the longest bucket), which bounds the target's work and the hidden states.
      Rows are grouped by their blocks per row first, so a batch pads few blocks. The batches of
      one lockstep step then cost the drafters about the same, whatever their lengths.
    `anchors[i]`: the anchors row i will get (its valid anchor positions, at most num_anchors).
    """

    batch_size: int = 4
    batch_tokens: int | None = None
    mode: BatchingMode = "fixed"
    anchors: np.ndarray | None = None
    block_size: int = 16
    num_anchors: int = 512
    token_share: float = 0.0

    def __post_init__(self) -> None:
        if self.mode == "work" and self.anchors is None:
            raise ValueError("work batching needs each row's anchor count")
        if not 0.0 <= self.token_share <= 1.0:
            raise ValueError(f"token_share must be in [0, 1], got {self.token_share}")

    def cut(self, rows: np.ndarray, bucket_len: int, longest: int) -> list[tuple[int, ...]]:
        """`rows` (one bucket's row ids, in shuffled order) as batches."""
        if self.mode == "fixed":
            size = batch_size_for(bucket_len, self.batch_size, self.batch_tokens)
            return [tuple(int(r) for r in rows[i : i + size]) for i in range(0, len(rows), size)]
        return self._cut_by_work(rows, bucket_len, longest)

    def _cut_by_work(
        self, rows: np.ndarray, bucket_len: int, longest: int
    ) -> list[tuple[int, ...]]:
        assert self.anchors is not None
        anchors = self.anchors[rows]
        blocks = np.array([blocks_per_row(int(a), self.num_anchors) for a in anchors])
        order = np.argsort(blocks, kind="stable")  # by blocks per row, shuffled within
        s = self.token_share
        tokens_unit = s * bucket_len / longest  # a row's padded tokens, in budget units

        def row_units(wide: int) -> float:
            """One row of a batch `wide` blocks wide, in units of a fully anchored row."""
            return (1.0 - s) * wide / self.num_anchors + tokens_unit

        max_rows = max(1, (self.batch_tokens or self.batch_size * longest) // bucket_len)
        out: list[tuple[int, ...]] = []
        batch: list[int] = []
        widest = 0
        for i in order:
            wide = max(widest, int(blocks[i]))
            if batch and (
                (len(batch) + 1) * row_units(wide) > self.batch_size * (1 + 1e-9)
                or len(batch) + 1 > max_rows
            ):
                out.append(tuple(batch))
                batch, wide = [], int(blocks[i])
            batch.append(int(rows[i]))
            widest = wide
        if batch:
            out.append(tuple(batch))
        return out


@dataclass(frozen=True)
class BatchSpec:
    """One planned batch: which sequences (stable dataset row ids) go together.

    (epoch, index) identifies the batch; index is its position in the epoch's shuffled order.
    """

    epoch: int
    index: int
    bucket: int
    seq_ids: tuple[int, ...]


def plan_epoch(
    bucket_of: np.ndarray,
    bucket_lengths: list[int],
    batching: Batching,
    seed: int,
    epoch: int,
) -> list[BatchSpec]:
    """Shuffle rows, group by bucket, cut into batches (`batching`), then order the batches so
    that every stretch of the epoch follows the bucket shares (`interleave`): producers emit
    the length mix, so a small buffer holds it too and no bucket piles up in the queue."""
    rng = np.random.default_rng([seed, epoch, 0x5EED])
    order = rng.permutation(len(bucket_of))
    per_bucket: list[list[tuple[int, ...]]] = []
    for b, blen in enumerate(bucket_lengths):
        rows = order[bucket_of[order] == b]
        per_bucket.append(batching.cut(rows, blen, bucket_lengths[-1]))
    return [
        BatchSpec(epoch, i, b, per_bucket[b][j])
        for i, (b, j) in enumerate(interleave([len(x) for x in per_bucket], rng))
    ]


def interleave(counts: list[int], rng: np.random.Generator) -> list[tuple[int, int]]:
    """An order of sum(counts) slots, (bucket, j) for j < counts[bucket]: bucket b's j-th item
    (taken in a shuffled order) is due at time (j + u) / counts[b], u uniform in [0, 1), and
    the slots go by due time. Any span of due times holds its share of every bucket's items
    +- 1, so a stretch of L slots holds L x share(b) within a couple of items (a shuffle strays
    by +- sqrt(L x share(b)): a 50-batch stretch of 16 buckets then strays from the mix as far
    as a random pull), while the order stays random."""
    due: list[tuple[float, int, int]] = []
    for b, n in enumerate(counts):
        picks = rng.permutation(n)  # within a bucket, e.g. narrow and wide batches mixed
        times = (np.arange(n) + rng.random(n)) / max(1, n)
        due += [(float(t), b, int(j)) for t, j in zip(times, picks, strict=True)]
    due.sort()
    return [(b, j) for _, b, j in due]


def bucket_weights(plan: list[BatchSpec]) -> dict[int, float]:
    """Share of an epoch's batches per bucket: the mix drafters should see."""
    counts: dict[int, int] = {}
    for spec in plan:
        counts[spec.bucket] = counts.get(spec.bucket, 0) + 1
    total = sum(counts.values()) or 1
    return {b: n / total for b, n in sorted(counts.items())}


def padding_fraction(lengths: np.ndarray, padded_lengths: np.ndarray) -> float:
    """Padded tokens / all tokens of a set of batches (rows given with their padded length)."""
    real = float(np.sum(lengths))
    total = float(np.sum(padded_lengths))
    return 0.0 if total == 0 else 1.0 - real / total
