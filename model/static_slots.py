"""The running batch in buffers of fixed capacity, for the compiled decoding step (``model.static_step``).

``StaticSlots`` is ``model.cache.CacheSlots`` for the compiled step: buffers allocated once at their
full capacity (rows: the largest batch; positions and source positions: the model's
``max_positions``, plus ``KEY_ALIGN`` so that a view never spans a whole axis), row-major
(R, L, 2, H, C, Dh), so that a step's view of the first R rows and first C positions has the same
strides whatever those counts are: one compiled graph, with R, C and S as symbols, serves every
batch size and length (``model.compiled_step``); no bucket wastes work on padding rows or
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from model.cache import KVCache
from model.layers import KEY_ALIGN
from model.static_step import StepOutputs
from model.transformer import Transformer


@dataclass
class StepChoice:
    """What a step chose (``StaticStep``'s outputs): for every row, and for the beam rows asked for."""

    choice: Tensor  # (R,) argmax of each row's logits
    top_tokens: Tensor  # (B, top) best next tokens of each beam row
    top_lprobs: Tensor  # (B, top) their log-probs
    eos_lprob: Tensor  # (B,) log-prob of eos of each beam row


class StepFn(Protocol):
    """What ``StaticSlots.decode`` calls: ``StaticStep`` run eagerly, or its compiled graph."""

    def __call__(
        self,
        tokens: Tensor,
        positions: Tensor,
        self_kv: Tensor,
        cross_kv: Tensor,
        src_bias: Tensor,
        beam_rows: Tensor,
        /,
    ) -> StepOutputs: ...


class StaticSlots:
    """Continuous batching's running cache, at fixed capacity, row-major. Same interface as
    ``CacheSlots`` (``rows``, ``width``, ``append``, ``remove``, ``reorder``) and ``decode``."""

    def __init__(self, model: Transformer, capacity: int, device: torch.device | None = None) -> None:
        cfg = model.cfg
        dtype = model.embed.weight.dtype
        device = device or model.embed.weight.device
        self.positions = cfg.max_positions  # the most a row reads: C, S <= positions
        # One KEY_ALIGN more than a view ever reads: a view spanning a whole axis would be contiguous
        # where the others are not, and the compiler would have to guard on that.
        shape = (capacity, cfg.decoder_layers, 2, cfg.n_heads, cfg.max_positions + KEY_ALIGN, cfg.head_dim)
        # Allocated, not written: memory is taken only for the positions the longest rows reach
        # (on CPU, ~50 instead of ~200 MB a worker for Multi30k's sentences). Those are zeroed
        # before anything reads or writes them (``_clean``): masked keys are multiplied by a weight
        # of 0, so they must be finite, never garbage.
        self.self_kv = torch.empty(shape, dtype=dtype, device=device)  # (Rcap, L, 2, H, Pcap, Dh)
        self.cross_kv = torch.empty(shape, dtype=dtype, device=device)  # (Rcap, L, 2, H, Pcap, Dh)
        self._clean = 0  # positions [0, _clean) of every row are finite; none beyond was written
        self.src_bias = torch.full(
            (capacity, 1, 1, shape[4]), float("-inf"), dtype=dtype, device=device
        )  # (Rcap, 1, 1, Pcap)
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=device)  # written positions
        # Where row r's new key/value of each (layer, k|v, head) goes when it has written nothing
        # yet, as rows of ``self_kv`` seen as (Rcap * L * 2 * H * Pcap, Dh): the step's writes are
        # one index_copy_ of R * L * 2 * H vectors (an indexed assignment over two axes cost ~10x).
        blocks = shape[1] * shape[2] * shape[3]
        self._first = (torch.arange(capacity * blocks, device=device) * shape[4]).view(capacity, blocks)
        self.capacity = capacity
        self.rows = 0
        self.source_lengths: list[int] = []  # per row, last real source position + 1
        self.max_length = 0

    @property
    def width(self) -> int:
        return max(self.source_lengths, default=0)

    def decode(self, step: StepFn, tokens: Tensor, beam_rows: Tensor) -> StepChoice:
        """Run ``step`` on the live rows (``beam_rows``: those that need their best candidates; at
        least one) and write their new keys/values into the cache."""
        n = self.rows
        # Exactly the positions some row has written, not KEY_ALIGN multiples as in the eager step:
        # a row's masked keys come after its real ones and add exact zeros to the step's sums
        # (weights of exp(-inf)), whatever their number, so no row's result depends on the others'
        # lengths; and fewer keys read is less memory traffic, what attention over the cache is
        # bound by.
        keys = max(self.max_length, 1)
        width = self.width
        self._zero_until(max(keys + 1, width))  # read, and written this step (the longest row: keys)
        positions = self.lengths[:n]
        choice, top_tokens, top_lprobs, eos_lprob, new = step(
            tokens,
            positions,
            self.self_kv[:n, :, :, :, :keys],
            self.cross_kv[:n, :, :, :, :width],
            self.src_bias[:n, :, :, :width],
            beam_rows,
        )
        where = (self._first[:n] + positions[:, None]).view(-1)  # (R * L * 2 * H,)
        self.self_kv.view(-1, self.self_kv.size(-1)).index_copy_(0, where, new.reshape(where.size(0), -1))
        self.lengths[:n] += 1
        self.max_length += 1
        return StepChoice(choice, top_tokens, top_lprobs, eos_lprob)

    def append(self, new: KVCache) -> None:
        """Add ``new``'s rows (a fresh ``Transformer.start_cache``, beams already repeated) after
        the last one: their cross-attention keys/values and source masks (nothing decoded yet)."""
        n, k = self.rows, new.batch_size
        if k == 0:
            return
        if n + k > self.capacity:
            raise ValueError(f"{n + k} rows exceed the running batch's capacity ({self.capacity})")
        assert new.max_length == 0, "rows join before their first step"
        s = new.cross_kv.size(4)
        self._zero_until(s)
        self.cross_kv[n : n + k, :, :, :, :s] = new.cross_kv.permute(2, 0, 1, 3, 4, 5)
        bias = self.src_bias[n : n + k, 0, 0]  # (k, Pcap)
        bias.fill_(float("-inf"))
        bias[:, :s].masked_fill_(new.src_mask, 0.0)
        self.lengths[n : n + k] = 0
        self.source_lengths += (new.src_mask.long().cumsum(1).argmax(1) + 1).tolist()
        self.rows = n + k

    def _zero_until(self, end: int) -> None:
        """Make positions up to ``end`` finite in every row, zeroing the ones never used, KEY_ALIGN
        positions at a time (what is beyond ``_clean`` was never written: nothing is lost)."""
        if end <= self._clean:
            return
        end = min(-(-end // KEY_ALIGN) * KEY_ALIGN, self.self_kv.size(4))
        for buffer in (self.self_kv, self.cross_kv):
            buffer[:, :, :, :, self._clean : end].zero_()
        self._clean = end

    def remove(self, leaving: list[int]) -> dict[int, int]:
        """Drop rows ``leaving``: the last remaining rows move into their places. Returns the moves,
        old row -> new row."""
        gone = set(leaving)
        n, m = self.rows, self.rows - len(gone)
        holes = sorted(r for r in gone if r < m)
        movers = [r for r in range(m, n) if r not in gone]
        if holes:
            self._copy_rows(holes, movers, sources=True)
        for hole, mover in zip(holes, movers, strict=True):
            self.source_lengths[hole] = self.source_lengths[mover]
        del self.source_lengths[m:]
        self.rows = m
        self.max_length = int(self.lengths[:m].max()) if m else 0
        return dict(zip(movers, holes, strict=True))

    def reorder(self, index: list[int]) -> None:
        """Row r takes the decoded prefix of row ``index[r]`` (beams of one input)."""
        changed = [r for r, source in enumerate(index) if r != source]
        if changed:
            self._copy_rows(changed, [index[r] for r in changed], sources=False)

    def _copy_rows(self, dst: list[int], src: list[int], *, sources: bool) -> None:
        d = torch.tensor(dst, device=self.lengths.device)
        s = torch.tensor(src, device=self.lengths.device)
        parts = [self.self_kv[:, :, :, :, : self.max_length], self.lengths]
        if sources:
            width = max(self.source_lengths[r] for r in src)
            parts += [self.cross_kv[:, :, :, :, :width], self.src_bias]
        for t in parts:  # gathered first, so rows both read and written are safe
            t.index_copy_(0, d, t.index_select(0, s))
