"""The decoder's key/value cache: data that ``Transformer.step`` reads and its caller writes.

One cache serves every way of decoding (a batch from start to end, the service's running batch
that inputs join and leave at any step, eager or compiled). It holds up to ``capacity`` rows (one
per beam of each input) in buffers allocated once at full size and laid out row-major:

- ``self_kv``  (Rcap, L, 2, H, P, Dh): self-attention keys/values, one position written per step;
  row r holds ``lengths[r]`` of them;
- ``cross_kv`` (Scap, L, 2, H, P, Dh): cross-attention keys/values, one slot per input, written
  once when it joins; its rows (its beams) read it through ``sources`` (Rcap,), each row's slot;
- ``src_bias`` (Scap, 1, 1, P): each slot's additive source mask, 0 on real tokens and -inf on
  padding.

A step reads the first R rows, the first N slots and the first C written / S source positions
(``views``): whatever R, N, C and S are, those views have the same strides, so one compiled graph
with them as symbols serves every batch and length, and no row or position is padded to a bucket.
Rows join after the last one (``append``), leaving rows are overwritten by the last rows
(``remove``), and beams that change parents copy their decoded prefix (``reorder``): only the rows
that move are copied. Slots are kept the same way: an input's last row to leave frees its slot,
and the last slots move into the freed ones.

One slot per input, not per beam: at beam 4 a step read each source's keys four times over, from
memory, as often as the weights (OPUS-MT size, 64 rows, a layer's cross-attention 1.5 against
0.6-0.8 ms with each source read once, caches cold; AMD EPYC avx512_vnni).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from model.config import ModelConfig
from model.layers import KEY_ALIGN

# ``advance`` copies row by row where a row writes at least this many vectors (L x 2 x H): below,
# the Python of a copy per row costs more than index_copy_'s element-wise writes (at 64 rows, AMD
# EPYC avx512_vnni: the shipped model's 24 vectors a row 0.06 ms with index_copy_ against 0.29 row
# by row, caches warm; OPUS-MT size's 96, 0.42 against 0.37 warm and 1.24 against 0.63 cold).
ROW_COPY_VECTORS = 64


def copies_on_host(device: torch.device) -> bool:
    """Whether rows are copied one at a time from host indices (``KVCache.advance``,
    ``take_prefixes``): on the CPU, where reading an index costs nothing and ATen's indexed copies
    write these strided rows an element at a time; elsewhere by index ops on the device, which
    never wait for it."""
    return device.type == "cpu"


class RowKernels(Protocol):
    """The CPU's row copies of ``self_kv`` in one call each (``model.runtime.kvrows``): the same
    bytes as the copies made here from Python, fewer calls."""

    def write_next(self, kv: Tensor, new: Tensor, lengths: Tensor) -> None: ...

    def take_prefixes(self, kv: Tensor, dst: list[int], src: list[int], lengths: Tensor) -> None: ...


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        capacity: int,
        positions: int,
        dtype: torch.dtype,
        device: torch.device,
        align: int = 1,
        kernels: RowKernels | None = None,
    ) -> None:
        """Room for ``capacity`` rows of up to ``positions`` source tokens and decoded tokens each.
        ``align``: views read positions in multiples of it (``StepRunner.align``). ``kernels``: on
        the CPU, row copies in one call (else one ``copy_`` per row, or ``index_copy_``)."""
        if positions > cfg.max_positions:
            raise ValueError(f"{positions} positions exceed the model's max_positions ({cfg.max_positions})")
        self.positions = positions
        self.align = align
        # One KEY_ALIGN more than a view ever reads: a view spanning a whole axis would be contiguous
        # where the others are not, and a compiled graph would have to guard on that.
        shape = (capacity, cfg.decoder_layers, 2, cfg.n_heads, positions + KEY_ALIGN, cfg.head_dim)
        # Allocated, not written: on CPU memory is taken only for the positions the longest rows
        # reach. Those are zeroed before anything reads or writes them (``_zero_until``): masked
        # keys are multiplied by a weight of 0, so they must be finite, never garbage.
        self.self_kv = torch.empty(shape, dtype=dtype, device=device)
        self.cross_kv = torch.empty(shape, dtype=dtype, device=device)
        # Positions [0, _clean) of rows [0, _clean_rows) are finite; nothing beyond was written.
        # Rows are zeroed when first used, not all at once: a cache of 64 rows (the largest batch)
        # costs the memory of the rows its batches reach. A worker keeps a running batch per busy
        # model: 10 of them with ~3 rows each held ~100 MB each at OPUS-MT's size when every row
        # was zeroed (6 layers x 2 x 8 heads x 64 rows x 32 positions x 64 x 4 bytes, twice).
        self._clean = 0
        self._clean_rows = 0
        self.src_bias = torch.full((capacity, 1, 1, shape[4]), float("-inf"), dtype=dtype, device=device)
        self.lengths = torch.zeros(capacity, dtype=torch.long, device=device)  # written positions
        self.sources = torch.zeros(capacity, dtype=torch.long, device=device)  # each row's slot
        # Where row r's new key/value of each (layer, k|v, head) goes when it has written nothing
        # yet, as rows of ``self_kv`` seen as (Rcap * L * 2 * H * Pcap, Dh): a step's writes are one
        # index_copy_ of R * L * 2 * H vectors (an indexed assignment over two axes cost ~10x).
        blocks = shape[1] * shape[2] * shape[3]
        self._first = (torch.arange(capacity * blocks, device=device) * shape[4]).view(capacity, blocks)
        self.capacity = capacity
        self.kernels = kernels if copies_on_host(device) else None
        self.clear()

    def clear(self) -> None:
        """No rows and no slots (the buffers are kept: what they hold is overwritten before it is
        read again)."""
        self.rows = 0
        self.max_length = 0  # the most positions a row has written (host side)
        self.source_lengths: list[int] = []  # per slot, last real source position + 1 (host side)
        self.row_slots: list[int] = []  # per row, its slot (host side; ``sources`` on the device)

    @property
    def slots(self) -> int:
        return len(self.source_lengths)

    @property
    def width(self) -> int:
        """Source positions the rows attend to: the longest of their sources."""
        return max(self.source_lengths, default=0)

    def views(self) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """What ``Transformer.step`` reads for the live rows: ``(positions, self_kv, cross_kv,
        src_bias, sources)``, views of the buffers (``sources``: each row's slot of ``cross_kv``
        and ``src_bias``).

        The positions some row has written (rounded up to ``align``): a row's masked keys come after
        its real ones and add exact zeros to the step's sums, so no row's result depends on the
        others' lengths, and fewer keys read is less memory traffic. The compiled step sums in an
        order that does not depend on how many keys it reads (``align`` 1); torch's eager kernels
        split a short axis differently from a long one, and are independent of its length only in
        whole multiples of 16 (``KEY_ALIGN``)."""
        n, m = self.rows, self.slots
        keys = _round_up(max(self.max_length, 1), self.align)
        width = _round_up(max(self.width, 1), self.align)
        self._zero_until(max(keys + 1, width))  # read, and written this step (the longest row: keys)
        return (
            self.lengths[:n],
            self.self_kv[:n, :, :, :, :keys],
            self.cross_kv[:m, :, :, :, :width],
            self.src_bias[:m, :, :, :width],
            self.sources[:n],
        )

    def advance(self, new_kv: Tensor) -> None:
        """Write the step's new keys/values (R, L, 2, H, Dh) at each row's next position."""
        n = self.rows
        if self.kernels is not None:
            self.kernels.write_next(self.self_kv, new_kv, self.lengths)
        elif copies_on_host(self.lengths.device) and self._first.size(1) >= ROW_COPY_VECTORS:
            # One copy per row: ATen's index_copy_ of the R * L * 2 * H vectors writes them an
            # element at a time, and each vector lies in a page of its own (OPUS-MT size, 64 rows,
            # after a step's weights went through the caches: 1.24 against 0.61 ms, AMD EPYC).
            rows = new_kv.reshape(n, *self.self_kv.shape[1:4], self.self_kv.size(5))
            for row, at in enumerate(self.lengths[:n].tolist()):
                self.self_kv[row, :, :, :, at].copy_(rows[row])
        else:  # (device indices: no wait for the device)
            where = (self._first[:n] + self.lengths[:n, None]).view(-1)  # (R * L * 2 * H,)
            flat = self.self_kv.view(-1, self.self_kv.size(-1))
            flat.index_copy_(0, where, new_kv.reshape(where.size(0), -1))
        self.lengths[:n] += 1
        self.max_length += 1
        if self.max_length > self.positions:
            raise ValueError(f"a row decoded more than the cache's {self.positions} positions")

    def append(self, source_kv: Tensor, src_mask: Tensor, beams: list[int] | None = None) -> None:
        """Add inputs: their cross-attention keys/values (k, L, 2, H, S, Dh)
        (``Transformer.source_kv``) and source masks (k, S), True on real tokens (the last real
        position + 1 is the first index where their running count peaks), each in a slot of its
        own, read by ``beams[i]`` rows (default 1), added after the last row. They have decoded
        nothing yet."""
        n, m, k, s = self.rows, self.slots, source_kv.size(0), source_kv.size(4)
        if k == 0:
            return
        beams = [1] * k if beams is None else beams
        if len(beams) != k or min(beams) < 1:
            raise ValueError(f"{k} inputs need a beam count of at least 1 each, not {beams}")
        rows = sum(beams)
        if n + rows > self.capacity:
            raise ValueError(f"{n + rows} rows exceed the cache's capacity ({self.capacity})")
        real = (src_mask.long().cumsum(1).argmax(1) + 1).tolist()  # last real position + 1, per input
        if max(real) > self.positions or s > self.self_kv.size(4):  # (padding may reach into the margin)
            raise ValueError(f"a source of {max(real)} positions exceeds the cache's {self.positions}")
        self._zero_until(s)
        self._zero_rows(n + rows)  # (slots are never more than rows)
        self.cross_kv[m : m + k, :, :, :, :s] = source_kv
        bias = self.src_bias[m : m + k, 0, 0]  # (k, Pcap)
        bias.fill_(float("-inf"))
        bias[:, :s].masked_fill_(src_mask, 0.0)
        self.lengths[n : n + rows] = 0
        self.row_slots += [m + i for i, b in enumerate(beams) for _ in range(b)]
        self.sources[n : n + rows] = self._slots_of(self.row_slots[n:])
        self.source_lengths += real
        self.rows = n + rows

    def remove(self, leaving: list[int]) -> dict[int, int]:
        """Drop rows ``leaving``: the last remaining rows move into their places, one copy per moved
        row, and a slot that no row reads any more is freed the same way (the last slots move).
        Returns the row moves, old row -> new row; the other rows keep their places."""
        gone = set(leaving)
        n, m = self.rows, self.rows - len(gone)
        holes = sorted(r for r in gone if r < m)
        movers = [r for r in range(m, n) if r not in gone]
        if holes:
            self._copy(self._row_parts(), holes, movers, prefixes=True)
        for hole, mover in zip(holes, movers, strict=True):
            self.row_slots[hole] = self.row_slots[mover]
        del self.row_slots[m:]
        self.rows = m
        self.max_length = int(self.lengths[:m].max()) if m else 0
        self._free_slots()
        return dict(zip(movers, holes, strict=True))

    def _free_slots(self) -> None:
        """Drop the slots no row reads (the last slots in use move into their places), and write
        each row's slot."""
        unread = set(range(self.slots)) - set(self.row_slots)
        n, m = self.slots, self.slots - len(unread)
        holes = sorted(j for j in unread if j < m)
        movers = [j for j in range(m, n) if j not in unread]
        if holes:
            width = max(self.source_lengths[j] for j in movers)
            self._copy([self.cross_kv[:, :, :, :, :width], self.src_bias], holes, movers)
        moved = dict(zip(movers, holes, strict=True))
        for mover, hole in moved.items():
            self.source_lengths[hole] = self.source_lengths[mover]
        del self.source_lengths[m:]
        if moved:
            self.row_slots = [moved.get(j, j) for j in self.row_slots]
        self.sources[: self.rows] = self._slots_of(self.row_slots)

    def _slots_of(self, slots: list[int]) -> Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.sources.device)

    def reorder(self, index: list[int]) -> None:
        """Row r takes the decoded prefix of row ``index[r]`` (beams of one input reordered among
        themselves: their sources are the same, so only the self-attention part is copied)."""
        self.take_prefixes(list(range(len(index))), index)

    def take_prefixes(self, dst: list[int], src: list[int]) -> None:
        """Row ``dst[i]`` takes the decoded prefix of row ``src[i]``, as it was before any of them
        is written (beams of one input: the same source and length)."""
        moved = [(d, s) for d, s in zip(dst, src, strict=True) if d != s]
        if moved:
            self._copy(self._row_parts(), [d for d, _ in moved], [s for _, s in moved], prefixes=True)

    def _row_parts(self) -> list[Tensor]:
        """What a row holds of its own: its decoded keys/values and their count (its slot is
        written from ``row_slots``)."""
        return [self.self_kv[:, :, :, :, : self.max_length], self.lengths]

    def _copy(self, parts: list[Tensor], dst: list[int], src: list[int], *, prefixes: bool = False) -> None:
        """Row ``dst[i]`` of each of ``parts`` takes row ``src[i]``'s, as it was before any of them
        is written. ``prefixes``: the first part is ``self_kv``'s, of which the CPU copies only the
        positions the source row has written (the rest of a row is masked, whatever it holds)."""
        if not copies_on_host(self.lengths.device):
            d = torch.tensor(dst, device=self.lengths.device)
            s = torch.tensor(src, device=self.lengths.device)
            for t in parts:  # gathered first, so rows both read and written are safe
                t.index_copy_(0, d, t.index_select(0, s))
            return
        # On the CPU one call for all of self_kv's rows (``kernels``), or one copy per row, only the
        # rows both read and written copied aside first:
        # gathering every moved row and writing it back read and wrote each prefix twice, the
        # write an element at a time (OPUS-MT size, beam 4, 43 of 64 rows moved, 25 positions:
        # 6.9 against 4.5 ms, AMD EPYC avx512_vnni).
        overwritten = set(dst)
        if prefixes and self.kernels is not None:  # (``lengths`` is read before it is copied)
            self.kernels.take_prefixes(self.self_kv, dst, src, self.lengths)
            parts = parts[1:]
        elif prefixes:  # a row's written positions only: its input's step, not the longest row's
            keys = self.lengths.tolist()  # (read before ``lengths`` is copied)
            kv, *parts = parts
            aside = {r: kv[r, :, :, :, : keys[r]].clone() for r in set(src) & overwritten}
            for row, parent in zip(dst, src, strict=True):
                n = keys[parent]
                kv[row, :, :, :, :n].copy_(aside.get(parent, kv[parent, :, :, :, :n]))
        for t in parts:
            aside = {r: t[r].clone() for r in set(src) & overwritten}
            for row, parent in zip(dst, src, strict=True):
                t[row].copy_(aside.get(parent, t[parent]))

    def zero_all(self) -> None:
        """Zero every row and position now, for a runner whose padding rows and positions are read
        (``model.runtime.graphs``): all of the cache's memory is then taken."""
        self._zero_rows(self.capacity)
        self._zero_until(self.self_kv.size(4))

    def _zero_until(self, end: int) -> None:
        """Make positions up to ``end`` finite in every row used so far, zeroing the ones never
        used, KEY_ALIGN positions at a time (what is beyond ``_clean`` was never written: nothing
        is lost)."""
        if end <= self._clean:
            return
        end = min(-(-end // KEY_ALIGN) * KEY_ALIGN, self.self_kv.size(4))
        for buffer in (self.self_kv, self.cross_kv):
            buffer[: self._clean_rows, :, :, :, self._clean : end].zero_()
        self._clean = end

    def _zero_rows(self, rows: int) -> None:
        """Make rows up to ``rows`` finite up to ``_clean``, zeroing the ones never used."""
        if rows <= self._clean_rows:
            return
        for buffer in (self.self_kv, self.cross_kv):
            buffer[self._clean_rows : rows, :, :, :, : self._clean].zero_()
        self._clean_rows = rows


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
