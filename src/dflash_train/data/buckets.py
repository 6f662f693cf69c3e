"""Length buckets and the per-epoch batch plan.

A batch holds sequences of one bucket, right-padded to the bucket's fixed length: few distinct
shapes (good for torch.compile, CUDA graphs and the allocator) and little padding. Bucket lengths
are fitted to the data's length histogram by an exact dynamic programme that minimises the total
padding for the requested number of buckets.

The plan of an epoch is a pure function of (lengths, buckets, batch sizes, seed, epoch): every
prefetcher thread can compute it independently and a resumed run gets the same batches. It is
computed over arrays of rows (a million rows plan in about a second); how many batches each
bucket gets does not depend on the seed or the epoch, so choosing buckets and counting the
schedule's steps need no plan at all (`batch_counts`, `RowKinds`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Literal

import numpy as np

from dflash_train.objective import blocks_per_rows


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
        rows = np.asarray(rows)
        if self.mode == "fixed":
            size = batch_size_for(bucket_len, self.batch_size, self.batch_tokens)
            return split_rows(rows, np.arange(0, len(rows), size))
        blocks = self.row_blocks(rows)
        order = np.argsort(blocks, kind="stable")  # by blocks per row, shuffled within
        widths, counts = np.unique(blocks[order], return_counts=True)
        return split_rows(rows[order], self._work_starts(widths, counts, bucket_len, longest))

    def count(self, widths: np.ndarray, rows: np.ndarray, bucket_len: int, longest: int) -> int:
        """How many batches `cut` makes of a bucket whose rows are `rows[k]` rows of
        `widths[k]` blocks per row (widths ascending; ignored by fixed batching). The number
        depends on these counts only, not on the rows' order: any seed, any epoch."""
        if self.mode == "fixed":
            size = batch_size_for(bucket_len, self.batch_size, self.batch_tokens)
            return -(-int(np.sum(rows)) // size)
        return len(self._work_starts(widths, rows, bucket_len, longest))

    def row_blocks(self, rows: np.ndarray) -> np.ndarray:
        """Blocks per row of each of `rows` (ids) alone: `blocks_per_row` of its anchors."""
        assert self.anchors is not None
        return blocks_per_rows(self.anchors[rows], self.num_anchors)

    def _work_starts(
        self, widths: np.ndarray, counts: np.ndarray, bucket_len: int, longest: int
    ) -> np.ndarray:
        """Where work batches start in a bucket's rows sorted by blocks per row (`counts[k]`
        rows of `widths[k]` blocks, widths ascending). The rows fill batches greedily: a row
        joins the open batch while the batch, then as wide as this row, still fits
        (`_rows_fitting`), else starts the next one. A width's rows all fit alike, so each
        width's stretch is the open batch's end, then whole batches, the last left open."""
        max_rows = max(1, (self.batch_tokens or self.batch_size * longest) // bucket_len)
        starts = [np.zeros(1 if np.sum(counts) else 0, dtype=np.int64)]
        pos, open_rows = 0, 0  # rows placed so far; rows in the open batch
        for wide, n in zip(widths.tolist(), counts.tolist(), strict=True):
            fits = self._rows_fitting(wide, bucket_len, longest, max_rows)
            join = min(n, max(0, fits - open_rows))  # rows that still fit the open batch
            rest = n - join
            if rest:
                starts.append(np.arange(pos + join, pos + n, fits, dtype=np.int64))
                open_rows = rest - fits * ((rest - 1) // fits)
            else:
                open_rows += join
            pos += n
        return np.concatenate(starts)

    def _rows_fitting(self, wide: int, bucket_len: int, longest: int, max_rows: int) -> int:
        """Rows one work batch of rows `wide` blocks wide holds (`rows_within` the budget of
        `batch_size`). A row is (1 - s) x wide / num_anchors + s x bucket_len / longest units:
        its blocks and its padded tokens, in units of a fully anchored row (s: token_share)."""
        s = self.token_share
        tokens_unit = s * bucket_len / longest
        unit = (1.0 - s) * wide / self.num_anchors + tokens_unit
        return rows_within(unit, self.batch_size * (1 + 1e-9), max_rows)


def rows_within(unit: float, budget: float, max_rows: int) -> int:
    """The most rows of `unit` each whose total m x unit stays within `budget`, at most
    `max_rows` and at least one (a row alone is planned whatever it costs). The float product
    decides, as a row-by-row check would; the division only estimates it."""
    if unit <= 0:
        return max_rows
    fits = min(max_rows, int(budget / unit))
    while fits < max_rows and (fits + 1) * unit <= budget:
        fits += 1
    while fits > 1 and fits * unit > budget:
        fits -= 1
    return max(1, fits)


def split_rows(rows: np.ndarray, starts: np.ndarray) -> list[tuple[int, ...]]:
    """`rows` cut before each of `starts` (ascending, the first 0), as tuples of ints."""
    ids = rows.tolist()
    return [tuple(ids[a:b]) for a, b in pairwise([*starts.tolist(), len(ids)])]


def batch_counts(
    bucket_of: np.ndarray,
    bucket_lengths: list[int],
    batching: Batching,
    weight: np.ndarray | None = None,
) -> list[int]:
    """Batches per bucket in the plan of every epoch (`plan_epoch`, any seed), without
    planning one: a bucket's batches depend on how many of its rows have each blocks per row,
    not on their order. `weight[i]`: how many rows entry i stands for (default one each)."""
    n = len(bucket_lengths)
    blocks = np.zeros(len(bucket_of), dtype=np.int64)
    if batching.mode == "work":
        blocks = batching.row_blocks(np.arange(len(bucket_of)))
    widths, width_of = np.unique(blocks, return_inverse=True)
    key = np.asarray(bucket_of, dtype=np.int64) * len(widths) + width_of.reshape(-1)
    hist = np.bincount(key, weights=weight, minlength=n * len(widths))
    hist = np.rint(hist).astype(np.int64).reshape(n, len(widths))
    return [
        batching.count(widths[h > 0], h[h > 0], blen, bucket_lengths[-1])
        for h, blen in zip(hist, bucket_lengths, strict=True)
    ]


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
    keys = np.asarray(bucket_of)[order]
    grouped = np.argsort(keys, kind="stable")
    by_bucket = order[grouped]  # each bucket's rows together, in shuffled order
    edges = np.searchsorted(keys[grouped], np.arange(len(bucket_lengths) + 1))
    per_bucket = [
        batching.cut(by_bucket[edges[b] : edges[b + 1]], blen, bucket_lengths[-1])
        for b, blen in enumerate(bucket_lengths)
    ]
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
    times, buckets, picks = [np.zeros(0)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for b, n in enumerate(counts):
        picks.append(rng.permutation(n))  # within a bucket, e.g. narrow and wide batches mixed
        times.append((np.arange(n) + rng.random(n)) / max(1, n))
        buckets.append(np.full(n, b, dtype=np.int64))
    t, b, j = (np.concatenate(x) for x in (times, buckets, picks))
    by_due = np.lexsort((j, b, t))  # by due time, ties by bucket then item
    return list(zip(b[by_due].tolist(), j[by_due].tolist(), strict=True))


def bucket_weights(plan: list[BatchSpec]) -> dict[int, float]:
    """Share of an epoch's batches per bucket: the mix drafters should see."""
    counts: dict[int, int] = {}
    for spec in plan:
        counts[spec.bucket] = counts.get(spec.bucket, 0) + 1
    total = sum(counts.values()) or 1
    return {b: n / total for b, n in sorted(counts.items())}


def count_weights(counts: list[int]) -> dict[int, float]:
    """`bucket_weights` from the batches per bucket (`batch_counts`), without a plan."""
    total = sum(counts) or 1
    return {b: n / total for b, n in enumerate(counts) if n}


@dataclass(frozen=True)
class RowKinds:
    """A dataset's rows by kind, for choosing buckets: `rows[k]` rows of length `lengths[k]`
    and `blocks[k]` blocks per row under work batching (0 under fixed). Padding and batches
    per bucket need only these, so a million rows cost what a few thousand kinds do."""

    lengths: np.ndarray
    blocks: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray, batching: Batching) -> RowKinds:
        lengths = np.asarray(lengths, dtype=np.int64)
        blocks = np.zeros(len(lengths), dtype=np.int64)
        if batching.mode == "work":
            blocks = batching.row_blocks(np.arange(len(lengths)))
        wide = int(blocks.max(initial=0)) + 1
        kinds, rows = np.unique(lengths * wide + blocks, return_counts=True)
        return cls(kinds // wide, kinds % wide, rows)

    def padding(self, bucket_lengths: list[int]) -> float:
        """`padding_fraction` of the rows, each padded to its bucket of `bucket_lengths`."""
        padded = np.asarray(bucket_lengths)[assign_buckets(self.lengths, bucket_lengths)]
        return padding_fraction(self.lengths * self.rows, padded * self.rows)

    def batch_counts(self, bucket_lengths: list[int], batching: Batching) -> list[int]:
        """`batch_counts` of the rows in `bucket_lengths`. A kind's blocks per row stand for
        its anchors (a power of two >= 16, or `num_anchors`, is its own blocks per row)."""
        if batching.mode == "work":
            batching = replace(batching, anchors=self.blocks)
        bucket_of = assign_buckets(self.lengths, bucket_lengths)
        return batch_counts(bucket_of, bucket_lengths, batching, self.rows)


def padding_fraction(lengths: np.ndarray, padded_lengths: np.ndarray) -> float:
    """Padded tokens / all tokens of a set of batches (rows given with their padded length)."""
    real = float(np.sum(lengths))
    total = float(np.sum(padded_lengths))
    return 0.0 if total == 0 else 1.0 - real / total
