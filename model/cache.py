"""The decoder's key/value cache: data passed into and out of `Transformer.decode_step`.

All layers live in two tensors so that reordering rows (beam search) or dropping finished rows is
one tensor operation, whatever the depth:

- ``self_kv``  (L, 2, B, H, C, Dh): self-attention keys/values, preallocated for C positions and
  filled one step at a time; row b holds ``lengths[b]`` valid positions.
- ``cross_kv`` (L, 2, B, H, S, Dh): cross-attention keys/values, computed once from the encoder
  output and never changed.
- ``src_mask`` (B, S): True on real source tokens (cross-attention key mask).

Rows may hold prefixes of different lengths (a row that joined a running batch later has fewer
steps); ``uniform`` records whether they are all equal, in which case no self-attention mask is needed.

``CacheSlots`` holds continuous batching's running batch: buffers with room for more rows, in which
rows join and leave without copying the others; each step decodes a ``KVCache`` view of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.layers import aligned


@dataclass
class KVCache:
    self_kv: Tensor  # (L, 2, B, H, C, Dh)
    cross_kv: Tensor  # (L, 2, B, H, S, Dh)
    src_mask: Tensor  # (B, S) bool
    lengths: Tensor  # (B,) long: decoded positions per row (also the position of the next token)
    max_length: int  # max(lengths), kept on the host to slice without a device sync
    uniform: bool  # all lengths equal

    @property
    def batch_size(self) -> int:
        return self.self_kv.size(2)

    @property
    def capacity(self) -> int:
        return self.self_kv.size(4)

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions, growing the preallocated buffer geometrically."""
        if length <= self.capacity:
            return
        new_cap = max(length, 2 * self.capacity)
        shape = list(self.self_kv.shape)
        shape[4] = new_cap
        grown = self.self_kv.new_zeros(shape)
        grown[..., : self.capacity, :] = self.self_kv
        self.self_kv = grown

    def index_select(self, index: Tensor, *, same_sources: bool = False) -> KVCache:
        """Rows ``index`` of the batch, in that order: beam reordering and dropping finished rows.

        ``same_sources``: every new row has the same source as the row it replaces (beams of one
        sentence reordered among themselves), so the cross-attention K/V and source mask, the
        larger part of the cache, are kept as they are instead of being copied.
        """
        lengths = self.lengths.index_select(0, index)
        max_length = self.max_length  # uniform rows: unchanged, and no device sync needed
        if not self.uniform:
            max_length = int(lengths.max().item()) if len(index) else 0
        cross_kv, src_mask = self.cross_kv, self.src_mask
        if not same_sources:
            src_mask = src_mask.index_select(0, index)
            # Source positions no remaining row attends to are cut off: once the longest input of a
            # batch has finished, the others' cross-attention stops paying for its padding.
            # (Aligned to KEY_ALIGN: a row's attention must not depend on its neighbours' lengths.)
            last = int(src_mask.any(0).nonzero().max().item()) + 1 if len(index) else src_mask.size(1)
            width = min(aligned(last), src_mask.size(1))
            cross_kv = cross_kv[..., :width, :].index_select(2, index)  # (L, 2, B', H, S', Dh)
            src_mask = src_mask[:, :width]
        return KVCache(
            # Same capacity, but only the written positions are copied: early in a search most of the
            # preallocated buffer is empty, and copying it all made dropping rows cost a whole step.
            self_kv=_with_capacity(
                self.self_kv[..., : self.max_length, :].index_select(2, index), self.capacity
            ),
            cross_kv=cross_kv,
            src_mask=src_mask,
            lengths=lengths,
            max_length=max_length,
            uniform=self.uniform,
        )


def _with_capacity(kv: Tensor, size: int) -> Tensor:
    """(L, 2, B, H, T, Dh) -> (L, 2, B, H, size, Dh): ``kv``'s positions, then zeros (never garbage:
    masked keys are still multiplied by 0)."""
    out = kv.new_empty(*kv.shape[:4], size, kv.size(5))
    out[..., : kv.size(4), :] = kv
    out[..., kv.size(4) :, :].zero_()
    return out


class CacheSlots:
    """Continuous batching's running cache: room for more rows than it holds, so that rows join and
    leave without copying the rows that stay.

    Concatenating caches and ``KVCache.index_select`` build a new cache and copy every row (~2.5 ms
    each at 30 rows on one CPU thread), and a busy batch gains and loses rows every few steps. Here
    newcomers are written after the last row (``append``), leaving rows are overwritten by the last
    rows (``remove``), and each decoding step runs on ``view()``: the first ``rows`` rows, their
    sources cut to the longest among them. Buffers grow as needed and never shrink.
    """

    def __init__(self) -> None:
        self.rows = 0
        self.self_kv: Tensor | None = None  # (L, 2, R, H, C, Dh), R >= rows
        self.cross_kv: Tensor | None = None  # (L, 2, R, H, S, Dh)
        self.src_mask: Tensor | None = None  # (R, S) bool
        self.lengths: Tensor | None = None  # (rows,) long
        self.source_lengths: list[int] = []  # per row, last real source position + 1 (host side)
        self.max_length = 0
        self.uniform = True

    @property
    def width(self) -> int:
        """Source positions the rows attend to: the longest of their sources."""
        return max(self.source_lengths, default=0)

    def view(self) -> KVCache:
        """The rows as a ``KVCache`` for ``Transformer.decode_step``: views of the buffers, so the
        step writes its keys and values in place (room for that position is made here first)."""
        self._reserve(positions=aligned(self.max_length + 1))  # decode_step attends to aligned keys
        assert self.self_kv is not None and self.cross_kv is not None and self.src_mask is not None
        assert self.lengths is not None
        n, width = self.rows, min(aligned(self.width), self.src_mask.size(1))  # KEY_ALIGN
        return KVCache(
            self_kv=self.self_kv[:, :, :n],  # (L, 2, n, H, C, Dh)
            cross_kv=self.cross_kv[:, :, :n, :, :width],  # (L, 2, n, H, S', Dh)
            src_mask=self.src_mask[:n, :width],  # (n, S')
            lengths=self.lengths,
            max_length=self.max_length,
            uniform=self.uniform,
        )

    def advance(self, cache: KVCache) -> None:
        """Take back the state of the view that ``decode_step`` returned."""
        assert self.self_kv is not None and cache.self_kv.data_ptr() == self.self_kv.data_ptr(), (
            "the decoding step did not write into the slots (its view must not have grown)"
        )
        self.lengths, self.max_length = cache.lengths, cache.max_length

    def append(self, new: KVCache) -> None:
        """Add ``new``'s rows after the last one (only they are copied)."""
        n, k = self.rows, new.batch_size
        if k == 0:
            return
        # Positions: the newcomers' own capacity, which search chose to fit their longest output.
        self._reserve(rows=n + k, source=new.cross_kv.size(4), positions=new.capacity, like=new)
        assert self.self_kv is not None and self.cross_kv is not None and self.src_mask is not None
        rows = slice(n, n + k)
        self.self_kv[:, :, rows, :, : new.max_length] = new.self_kv[..., : new.max_length, :]
        self.cross_kv[:, :, rows, :, : new.cross_kv.size(4)] = new.cross_kv
        self.src_mask[rows] = False
        self.src_mask[rows, : new.src_mask.size(1)] = new.src_mask
        # Last real position + 1: the first index where the running count of real tokens peaks.
        self.source_lengths += (new.src_mask.long().cumsum(1).argmax(1) + 1).tolist()
        if n == 0 or self.lengths is None:
            self.lengths, self.max_length, self.uniform = new.lengths, new.max_length, new.uniform
        else:
            self.lengths = torch.cat([self.lengths, new.lengths])
            self.uniform = self.uniform and new.uniform and new.max_length == self.max_length
            self.max_length = max(self.max_length, new.max_length)
        self.rows = n + k

    def remove(self, leaving: list[int]) -> dict[int, int]:
        """Drop rows ``leaving``: the last remaining rows move into their places, one copy per moved
        row. Returns the moves, old row -> new row; the other rows keep their places."""
        gone = set(leaving)
        n, m = self.rows, self.rows - len(gone)
        holes = sorted(r for r in gone if r < m)
        movers = [r for r in range(m, n) if r not in gone]
        if holes:
            self._copy_rows(holes, movers, sources=True)
        for hole, mover in zip(holes, movers, strict=True):
            self.source_lengths[hole] = self.source_lengths[mover]
        del self.source_lengths[m:]
        assert self.lengths is not None
        self.rows, self.lengths = m, self.lengths[:m]
        if m == 0:
            self.max_length, self.uniform = 0, True
        elif not self.uniform:
            self.max_length = int(self.lengths.max().item())
        return dict(zip(movers, holes, strict=True))

    def reorder(self, index: list[int]) -> None:
        """Row r takes the decoded prefix of row ``index[r]`` (beams of one input reordered among
        themselves: their sources are the same, so only the self-attention part is copied)."""
        changed = [r for r, source in enumerate(index) if r != source]
        if changed:
            self._copy_rows(changed, [index[r] for r in changed], sources=False)

    def _copy_rows(self, dst: list[int], src: list[int], *, sources: bool) -> None:
        """Row ``dst[i]`` becomes a copy of row ``src[i]``: its decoded positions, and with
        ``sources`` its source positions too."""
        assert self.self_kv is not None and self.cross_kv is not None and self.src_mask is not None
        assert self.lengths is not None
        parts = [(self.self_kv[..., : self.max_length, :], 2), (self.lengths, 0)]  # (tensor, row dim)
        if sources:
            width = max(self.source_lengths[r] for r in src)
            parts += [(self.cross_kv[..., :width, :], 2), (self.src_mask, 0)]
        if len(dst) <= 4 and not set(dst) & set(src):
            # A step's few finished rows: one slice copy each, no gather into a temporary
            # (index_select + index_copy_ cost more than the copy itself for a row or two).
            for d, s in zip(dst, src, strict=True):
                for t, dim in parts:
                    t.select(dim, d).copy_(t.select(dim, s))
            return
        d_ = torch.tensor(dst, device=self.self_kv.device)
        s_ = torch.tensor(src, device=self.self_kv.device)
        for t, dim in parts:  # gathered first, so rows that are both read and written are safe
            t.index_copy_(dim, d_, t.index_select(dim, s_))

    def _reserve(
        self, *, rows: int = 0, source: int = 0, positions: int = 0, like: KVCache | None = None
    ) -> None:
        """Grow the buffers to hold ``rows`` rows, ``source`` source positions and ``positions``
        decoded positions. Rows and source positions grow only when newcomers join, to what they
        need (the buffers then hold at most the largest batch times the longest input seen);
        decoded positions grow during decoding, geometrically. New space is zeroed: masked keys are
        multiplied by 0, so they must be finite (stale rows left behind by ``remove`` are)."""
        if self.self_kv is None or self.cross_kv is None or self.src_mask is None:
            assert like is not None, "the first rows come from append"
            n_layers, _, _, heads, _, dh = like.self_kv.shape
            self.self_kv = like.self_kv.new_zeros(n_layers, 2, rows, heads, max(positions, 1), dh)
            self.cross_kv = like.cross_kv.new_zeros(n_layers, 2, rows, heads, source, dh)
            self.src_mask = like.src_mask.new_zeros(rows, source)
            return
        n = self.rows
        r, s = max(self.self_kv.size(2), rows), max(self.cross_kv.size(4), source)
        c = _grown(self.self_kv.size(4), positions)
        if (r, c) != (self.self_kv.size(2), self.self_kv.size(4)):
            kv = self.self_kv.new_zeros(
                *self.self_kv.shape[:2], r, self.self_kv.size(3), c, self.self_kv.size(5)
            )
            kv[:, :, :n, :, : self.max_length] = self.self_kv[:, :, :n, :, : self.max_length]
            self.self_kv = kv
        if (r, s) != tuple(self.src_mask.shape):
            old = self.src_mask.size(1)
            kv = self.cross_kv.new_zeros(
                *self.cross_kv.shape[:2], r, self.cross_kv.size(3), s, self.cross_kv.size(5)
            )
            kv[:, :, :n, :, :old] = self.cross_kv[:, :, :n]
            mask = self.src_mask.new_zeros(r, s)
            mask[:n, :old] = self.src_mask[:n]
            self.cross_kv, self.src_mask = kv, mask


def _grown(size: int, needed: int) -> int:
    """``size``, or if ``needed`` exceeds it, at least double (so that growing is rare)."""
    return size if needed <= size else max(needed, 2 * size)
