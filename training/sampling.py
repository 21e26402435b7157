"""Which pairs an epoch trains on, in which batches, on which rank: ``EpochPlan``.

An epoch is planned in memory that does not grow with the corpus:

1. **Draws per direction.** Direction d (n_d pairs) is drawn m_d = N * p_d times, N = sum n_d,
   p_d ~ n_d ** (1 / T) (temperature sampling): whole passes over its pairs, then a random part of
   one more. One direction (a bilingual model), or T = 1, is exactly one pass over the data.
2. **Pieces.** What is drawn is cut into pieces, runs of at most ``PIECE`` consecutive pairs of
   one direction; the pieces of all directions are shuffled together (a few thousand of them even
   for millions of pairs).
3. **Pools.** Consecutive pieces are gathered into pools of ``pool`` pairs; only one pool's pairs
   are ever in memory. A pool is sorted by length (random tie-breaks) and cut into batches whose
   padded size (rows x longest pair) stays within ``max_tokens``; its batches are shuffled. Batches
   thus mix directions, and hold pairs of similar length.
4. **Shards.** Every rank plans the same pools; rank r takes batches r, r + world, ... of each
   pool, the last ``len % world`` dropped, so every rank steps the same number of times.

Everything is a function of (seed, epoch) and each pool has its own random stream: a resumed run
recomputes the same batches and skips the ones it has trained on without replaying anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from training.arrays import Sliceable

PIECE = 1024  # the most consecutive pairs of a direction kept together through the shuffle


def temperature_probabilities(counts: Sequence[int], temperature: float) -> np.ndarray:
    """p_d ~ n_d ** (1 / T): T = 1 keeps the data's proportions, a larger T flattens them."""
    n = np.asarray(counts, dtype=np.float64)
    weights = np.where(n > 0, n / max(n.sum(), 1.0), 0.0) ** (1.0 / temperature)
    return weights / weights.sum()


def epoch_draws(counts: Sequence[int], temperature: float) -> list[int]:
    """How many pairs of each direction an epoch draws: as many in all as the directions hold."""
    if len(counts) == 1:
        return [int(counts[0])]
    p = temperature_probabilities(counts, temperature)
    return [int(round(x)) if n else 0 for x, n in zip(p * sum(counts), counts, strict=True)]


def piece_size(n: int) -> int:
    """At least ~256 pieces per direction, so that drawing part of a small one is still random."""
    return int(min(PIECE, max(1, n // 256)))


@dataclass
class PlannedBatch:
    directions: np.ndarray  # (B,) direction index of each pair
    indices: np.ndarray  # (B,) the pair's index within its direction


class EpochPlan:
    """The batches of one epoch for one rank. ``sizes[d][k]``: the padded size of pair k of
    direction d (an array, or a ``DiskArray``: only one pool's pieces are read at a time)."""

    def __init__(
        self,
        sizes: Sequence[Sliceable],
        *,
        max_tokens: int,
        pool: int,
        seed: int,
        epoch: int,
        temperature: float = 1.0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.sizes = sizes
        self.max_tokens, self.pool, self.seed, self.epoch = max_tokens, pool, seed, epoch
        self.rank, self.world = rank, world
        self.draws = epoch_draws([len(s) for s in sizes], temperature)
        self._pool_counts: list[int] | None = None

    def pieces(self) -> np.ndarray:
        """(P, 3) rows of (direction, start, stop), shuffled."""
        rng = np.random.default_rng([self.seed, self.epoch])
        rows: list[np.ndarray] = []
        for d, (sizes, m) in enumerate(zip(self.sizes, self.draws, strict=True)):
            n = len(sizes)
            if not n or not m:
                continue
            starts = np.arange(0, n, piece_size(n))
            stops = np.minimum(starts + piece_size(n), n)
            whole = np.stack([np.full_like(starts, d), starts, stops], axis=1)
            passes, rest = divmod(m, n)
            rows += [whole] * passes
            if rest:  # random pieces until `rest` pairs, the last one cut short
                part = whole[rng.permutation(len(whole))]
                lengths = np.cumsum(part[:, 2] - part[:, 1])
                k = int(np.searchsorted(lengths, rest)) + 1
                part = part[:k].copy()
                part[-1, 2] -= lengths[k - 1] - rest
                rows.append(part)
        pieces = np.concatenate(rows) if rows else np.zeros((0, 3), np.int64)
        return pieces[rng.permutation(len(pieces))]

    def pools(self) -> Iterator[np.ndarray]:
        """The pieces of each pool, in order."""
        pieces = self.pieces()
        before = np.cumsum(pieces[:, 2] - pieces[:, 1]) - (pieces[:, 2] - pieces[:, 1])
        pool_of = before // self.pool
        bounds = np.flatnonzero(np.diff(pool_of)) + 1
        yield from np.split(pieces, bounds) if len(pieces) else []

    def pool_batches(self, index: int, pieces: np.ndarray) -> list[PlannedBatch]:
        """This rank's batches of pool ``index``, in training order."""
        rng = np.random.default_rng([self.seed, self.epoch, index + 1])
        lengths = pieces[:, 2] - pieces[:, 1]
        total = int(lengths.sum())
        directions = np.repeat(pieces[:, 0], lengths)
        # each piece's pairs: start, start + 1, ..., stop - 1
        indices = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths - pieces[:, 1], lengths)
        sizes = np.concatenate([self.sizes[d][a:b] for d, a, b in pieces.tolist()]).astype(np.int64)
        order = np.lexsort((rng.random(total), sizes))  # by size; ties broken at random
        cuts = cut_batches(sizes[order], self.max_tokens)
        batches = [order[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        batches = [batches[i] for i in rng.permutation(len(batches))]
        usable = len(batches) - len(batches) % self.world
        return [PlannedBatch(directions[b], indices[b]) for b in batches[self.rank : usable : self.world]]

    def __len__(self) -> int:
        """This rank's batches in the epoch (computed once: it reads every pool's sizes)."""
        if self._pool_counts is None:
            self._pool_counts = [len(self.pool_batches(i, p)) for i, p in enumerate(self.pools())]
        return sum(self._pool_counts)

    def batches(self, start: int = 0) -> Iterator[PlannedBatch]:
        """This rank's batches from the ``start``-th on (a resumed run skips what it trained on)."""
        for i, pieces in enumerate(self.pools()):
            if self._pool_counts is not None and start >= self._pool_counts[i]:
                start -= self._pool_counts[i]  # a whole pool already trained on: not even planned
                continue
            planned = self.pool_batches(i, pieces)
            yield from planned[start:]
            start = max(0, start - len(planned))


def cut_batches(sorted_sizes: np.ndarray, max_tokens: int) -> list[int]:
    """Boundaries of greedy batches over ascending sizes: each batch as long as (its rows) x (its
    largest size) stays within ``max_tokens`` (a single over-large pair is a batch of its own)."""
    n = len(sorted_sizes)
    cuts, i = [0], 0
    while i < n:
        # rows * largest grows with the batch's end j: bisect for the last j that fits
        lo, hi = i + 1, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(sorted_sizes[mid - 1]) * (mid - i) <= max_tokens:
                lo = mid
            else:
                hi = mid - 1
        cuts.append(lo)
        i = lo
    return cuts
