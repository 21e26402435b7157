"""The decoder's key/value cache: data passed into and out of `Transformer.decode_step`.

All layers live in two tensors so that reordering rows (beam search), dropping finished rows and
appending newly encoded rows (continuous batching) is one tensor operation each, whatever the depth:

- ``self_kv``  (L, 2, B, H, C, Dh): self-attention keys/values, preallocated for C positions and
  filled one step at a time; row b holds ``lengths[b]`` valid positions.
- ``cross_kv`` (L, 2, B, H, S, Dh): cross-attention keys/values, computed once from the encoder
  output and never changed.
- ``src_mask`` (B, S): True on real source tokens (cross-attention key mask).

Rows may hold prefixes of different lengths (a row that joined a running batch later has fewer
steps); ``uniform`` records whether they are all equal, in which case no self-attention mask is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


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
            # Source positions no remaining row attends to are cut off: in continuous batching the
            # longest input that ever joined would otherwise pad everyone's cross-attention for good.
            width = int(src_mask.any(0).nonzero().max().item()) + 1 if len(index) else src_mask.size(1)
            cross_kv = cross_kv[..., :width, :].index_select(2, index)  # (L, 2, B', H, S', Dh)
            src_mask = src_mask[:, :width]
        return KVCache(
            # Same capacity, but only the written positions are copied: early in a search most of the
            # preallocated buffer is empty, and copying it all made dropping rows cost a whole step.
            self_kv=_stack_rows(
                [self.self_kv[..., : self.max_length, :].index_select(2, index)], self.capacity
            ),
            cross_kv=cross_kv,
            src_mask=src_mask,
            lengths=lengths,
            max_length=max_length,
            uniform=self.uniform,
        )

    @staticmethod
    def concat(caches: list[KVCache]) -> KVCache:
        """Stack the rows of several caches (e.g. a running batch and newly encoded inputs).

        Source and prefix lengths may differ: shorter ones are padded, and padding is masked out
        (``src_mask`` for the source, ``lengths`` for the prefix).
        """
        caches = [c for c in caches if c.batch_size > 0] or caches[:1]
        if len(caches) == 1:
            return caches[0]
        first = caches[0]
        used = max(c.max_length for c in caches)
        lengths = torch.cat([c.lengths for c in caches])
        return KVCache(
            # Only the written positions are copied; the rest of each buffer is zeroed, which is
            # cheaper than copying it and keeps masked keys finite (they are still multiplied by 0).
            self_kv=_stack_rows([c.self_kv for c in caches], max(c.capacity for c in caches), used),
            cross_kv=_stack_rows([c.cross_kv for c in caches], max(c.cross_kv.size(4) for c in caches)),
            src_mask=torch.cat(
                [
                    F.pad(c.src_mask, (0, max(m.src_mask.size(1) for m in caches) - c.src_mask.size(1)))
                    for c in caches
                ]
            ),
            lengths=lengths,
            max_length=used,
            uniform=all(c.uniform and c.max_length == first.max_length for c in caches),
        )


def _stack_rows(parts: list[Tensor], size: int, used: int | None = None) -> Tensor:
    """Concatenate (L, 2, B_i, H, T_i, Dh) tensors along B into one with T = ``size``: positions
    ``[:used]`` (all of each part by default) copied, the rest zero (never garbage: masked keys are
    still multiplied by 0)."""
    shape = list(parts[0].shape)
    shape[2], shape[4] = sum(p.size(2) for p in parts), size
    out = parts[0].new_empty(shape)
    row = 0
    for p in parts:
        n = p.size(4) if used is None else min(used, p.size(4))
        rows = slice(row, row + p.size(2))
        out[:, :, rows, :, :n] = p[:, :, :, :, :n]
        out[:, :, rows, :, n:].zero_()
        row += p.size(2)
    return out
