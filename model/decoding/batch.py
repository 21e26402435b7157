"""The running batch: inputs join, every step advances them all, finished inputs leave.

One driver for every caller: ``Translator`` feeds it a whole list of sentences (``decode``); the
service's executor feeds it what its scheduler lets in, drops what was cancelled, and returns what
finished after every step. Each step: the runner (eager or compiled, one signature) computes it
over the cache's views, the search chooses tokens, the cache is reordered for beams that changed
parents, and finished inputs leave (the last rows move into their places).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from model.decoding.constraints import ConstraintSet, beam_for
from model.decoding.options import DecodeOptions
from model.decoding.search import Beam, Hypothesis, Search
from model.layers import aligned
from model.runtime.step import StepChoice, StepRunner
from model.transformer import Transformer

K = TypeVar("K")  # what the caller knows an input by

# While a batch runs, waiting inputs join once they number at least JOIN_RATIO x the running ones,
# or after JOIN_WAIT_STEPS steps: newcomers are encoded as one batch, so joining in groups (as TGI's
# waiting_served_ratio) beats encoding one or two at every step.
JOIN_RATIO = 0.3
JOIN_WAIT_STEPS = 8


@dataclass
class Entry(Generic[K]):
    """One input in the batch: the caller's key, its search state, its cache rows, its n-best."""

    key: K
    beam: Beam
    rows: list[int]  # its beams' cache rows (wherever the cache keeps them: not always consecutive)
    n_best: int


@dataclass(frozen=True)
class Source(Generic[K]):
    """An input to decode: source ids (eos included), beam size and n-best; ``constraints``:
    target token sequences (no bos/eos) that every finished hypothesis contains (see
    ``model.decoding.constraints``; ``beam_size`` is already the beam they decode with,
    ``beam_for``)."""

    key: K
    ids: Sequence[int]
    beam_size: int = 1
    n_best: int = 1
    # Target token sequences (no bos/eos) each finished hypothesis must contain (terminology).
    constraints: tuple[tuple[int, ...], ...] = ()


def pad_batch(sources: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> Tensor:
    """Right-padded (B, S) tensor of source ids, S a multiple of ``KEY_ALIGN``: a sentence's
    encoding must not depend on how long the others in its batch are."""
    src = torch.full((len(sources), aligned(max(map(len, sources)))), pad_id, dtype=torch.long)
    for i, ids in enumerate(sources):
        src[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return src.to(device)


class RunningBatch(Generic[K]):
    """Inputs being decoded together, in a cache of ``capacity`` rows (each beam a row)."""

    def __init__(
        self,
        model: Transformer,
        runner: StepRunner,
        *,
        capacity: int,
        options: DecodeOptions,
        greedy_scores: bool = True,
        positions: int | None = None,
        word_continuations: frozenset[int] = frozenset(),
    ) -> None:
        """``positions``: the cache's (the step's, when compiled for it); default ``options``'.
        ``word_continuations``: the target ids that may not follow a met constraint
        (``Tokenizer.word_continuations``, ``ConstraintSet``)."""
        self.model, self.runner, self.options = model, runner, options
        self.word_continuations = word_continuations
        cfg = model.cfg
        self.search = Search(
            eos=cfg.eos_id,
            length_penalty=options.length_penalty,
            no_repeat_ngram_size=options.no_repeat_ngram_size,
            greedy_scores=greedy_scores,
        )
        weight = model.embed.weight
        # The runner's: a runner that replays captured graphs reads the same buffers every time.
        self.cache = runner.new_cache(
            capacity=capacity, positions=positions or options.positions(cfg.max_positions)
        )
        self.entries: list[Entry[K]] = []
        self.steps_since_join = 0  # steps decoded since inputs last joined
        self.tokens = torch.zeros(0, dtype=torch.long, device=weight.device)  # (R,) next token per row
        self.constrained = 0  # inputs with constraints: while 0, no step asks for forced tokens
        self._unforced: dict[int, Tensor] = {}  # beam rows -> the dummy ``forced`` (B, 2) of pad

    @property
    def rows(self) -> int:
        return self.cache.rows

    @property
    def width(self) -> int:
        return self.cache.width

    def __len__(self) -> int:
        return len(self.entries)

    def joins_now(self, newcomers: int) -> bool:
        """Whether ``newcomers`` waiting inputs should join before the next step: always into an
        empty batch; else once they number JOIN_RATIO x the running inputs, or JOIN_WAIT_STEPS steps
        after the last join."""
        live = len(self.entries)
        return not live or newcomers >= JOIN_RATIO * live or self.steps_since_join >= JOIN_WAIT_STEPS

    def add(self, sources: Sequence[Source[K]]) -> None:
        """Encode ``sources`` as one padded batch and add their rows after the last one.

        Raises ValueError, before anything changes, for a constraint token the step cannot score
        (outside the vocabulary: it would fail the whole batch's step) or that cannot be generated
        inside an output (pad, bos, eos)."""
        if not sources:
            return
        cfg = self.model.cfg
        for s in sources:
            if not s.constraints:
                continue
            bad = {t for c in s.constraints for t in c if not 0 <= t < cfg.vocab_size}
            bad |= {t for c in s.constraints for t in c} & {cfg.pad_id, cfg.bos_id, cfg.eos_id}
            if bad:
                raise ValueError(f"constraint tokens {sorted(bad)} cannot be generated")
        self.steps_since_join = 0
        src = pad_batch([s.ids for s in sources], cfg.pad_id, self.tokens.device)
        enc = self.model.encode(src)
        kv = self.model.source_kv(enc)  # (B, L, 2, H, S, Dh)
        ks = [s.beam_size for s in sources]
        mask = enc.src_mask
        if any(k > 1 for k in ks):  # k rows per input
            rows = torch.arange(len(sources), device=src.device).repeat_interleave(
                torch.tensor(ks, device=src.device)
            )
            kv, mask = kv.index_select(0, rows), mask.index_select(0, rows)
        first = self.cache.rows
        self.cache.append(kv, mask)
        bos = torch.full((sum(ks),), cfg.bos_id, dtype=torch.long, device=src.device)
        self.tokens = torch.cat([self.tokens[:first], bos])
        for s in sources:
            limit = self.options.output_limit(len(s.ids), cfg.max_positions)
            rows_of = list(range(first, first + s.beam_size))
            constraints = ConstraintSet(s.constraints, self.word_continuations) if s.constraints else None
            self.constrained += constraints is not None
            self.entries.append(Entry(s.key, Beam.start(s.beam_size, limit, constraints), rows_of, s.n_best))
            first += s.beam_size

    def step(self) -> list[tuple[K, list[Hypothesis]]]:
        """One token for every input; returns the inputs that finished (they have left), with their
        n-best hypotheses, best first."""
        entries = self.entries
        rows = [r for e in entries for r in e.rows]  # rows in input order, as the search reads them
        index = None if rows == list(range(len(rows))) else torch.tensor(rows, device=self.tokens.device)
        # The rows whose best candidates the search needs, in input order (at least one row).
        wanted = [r for e in entries if self.search.wants_candidates(e.beam) for r in e.rows] or [0]
        beams = [e.beam for e in entries]
        device = self.tokens.device
        forced = self._forced(beams, len(wanted))
        out = self.runner(self.tokens, *self.cache.views(), torch.tensor(wanted, device=device), forced)
        self.cache.advance(out[4])
        self.steps_since_join += 1
        choice = out[0] if index is None else out[0].index_select(0, index)
        scored = StepChoice(choice, *out[1:4], out[5] if self.constrained else None)
        keep, tokens = self.search.step(beams, scored)
        self._place(rows, keep, tokens)
        done = [i for i, e in enumerate(entries) if e.beam.done]
        finished = [(entries[i].key, entries[i].beam.best(entries[i].n_best)) for i in done]
        if done:  # finished inputs leave at once: only the rows that take their places are copied
            self.keep([i for i, e in enumerate(entries) if not e.beam.done])
        return finished

    def _forced(self, beams: list[Beam], rows: int) -> Tensor:
        """The step's ``forced`` (B, F): the tokens the constrained inputs need scored whatever their
        rank; without constrained inputs two dummy columns (pad: ``Search.forced``'s least width),
        made once per number of rows."""
        device = self.tokens.device
        if self.constrained:
            return torch.tensor(self.search.forced(beams), dtype=torch.long, device=device)
        unforced = self._unforced.get(rows)
        if unforced is None:
            unforced = self._unforced[rows] = torch.zeros((rows, 2), dtype=torch.long, device=device)
        return unforced

    def drop(self, gone: Callable[[K], bool]) -> list[K]:
        """Remove the inputs whose key is ``gone`` (cancelled, expired); returns their keys."""
        leaving = [gone(e.key) for e in self.entries]
        if any(leaving):
            dropped = [e.key for e, out in zip(self.entries, leaving, strict=True) if out]
            self.keep([i for i, out in enumerate(leaving) if not out])
            return dropped
        return []

    def clear(self) -> None:
        """Forget every input (a failed step: the cache's state is unknown)."""
        self.keep([])

    def keep(self, keep: list[int]) -> None:
        """Only the inputs at positions ``keep`` stay; the others' rows are overwritten by the last."""
        kept = set(keep)
        leaving = [r for i, e in enumerate(self.entries) if i not in kept for r in e.rows]
        moves = self.cache.remove(leaving)
        if moves:
            dst = torch.tensor(list(moves.values()), device=self.tokens.device)
            src = torch.tensor(list(moves.keys()), device=self.tokens.device)
            self.tokens[dst] = self.tokens[src]
        self.tokens = self.tokens[: self.cache.rows]
        for i in keep:
            e = self.entries[i]
            e.rows = [moves.get(r, r) for r in e.rows]
        # Inputs in the order of their rows: with one row per input (greedy), rows then follow
        # input order and a step's choice needs no reordering for the search.
        self.entries = sorted((self.entries[i] for i in keep), key=lambda e: e.rows[0])
        if self.constrained:
            self.constrained = sum(e.beam.constraints is not None for e in self.entries)

    def _place(self, rows: list[int], keep: Tensor | None, tokens: Tensor) -> None:
        """Put the search's result (``keep``/``tokens`` index ``rows``, every input's rows in input
        order) back into the batch: beams reordered within their input's rows; finished inputs'
        rows are left alone (they leave right after)."""
        if keep is None:  # nothing finished or moved: every row takes its new token in place
            if rows == list(range(len(self.tokens))):
                self.tokens = tokens
            else:
                self.tokens[torch.tensor(rows, device=tokens.device)] = tokens
            return
        index = list(range(self.rows))  # new row r reads old row index[r]
        still = [rows[r] for r in keep.tolist()]  # old rows feeding the live inputs' new rows, in order
        targets = [r for e in self.entries if not e.beam.done for r in e.rows]
        for target, source in zip(targets, still, strict=True):
            index[target] = source
        if targets:
            self.tokens[torch.tensor(targets, device=tokens.device)] = tokens
        self.cache.reorder(index)  # beams moved: their rows' self-attention prefixes are copied


def decode(
    model: Transformer,
    runner: StepRunner,
    sources: Sequence[Sequence[int]],
    options: DecodeOptions,
    *,
    capacity: int,
    positions: int | None = None,
    max_rows: int | None = None,
    max_batch_tokens: int | None = None,
    constraints: Sequence[Sequence[Sequence[int]]] | None = None,
    word_continuations: frozenset[int] = frozenset(),
) -> list[list[Hypothesis]]:
    """Decode every source (ids ending in eos) with ``options``; the n-best of each, in order.

    Sources join the running batch as rows free up (longest first: similar lengths share steps),
    in groups as the service's executor lets them in, and each input's result does not depend on
    which others share its steps. ``max_rows``: rows decoded together (default ``capacity``).
    ``constraints``: per source, target token sequences its hypotheses must contain; such a source
    decodes with ``beam_for(options.beam_size, its number of constraints)``, and no met constraint
    is followed by one of ``word_continuations`` (``RunningBatch``)."""
    batch: RunningBatch[int] = RunningBatch(
        model,
        runner,
        capacity=capacity,
        options=options,
        positions=positions,
        word_continuations=word_continuations,
    )
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]), reverse=True)
    results: dict[int, list[Hypothesis]] = {}
    wanted = [tuple(tuple(c) for c in cs) for cs in constraints] if constraints else [()] * len(sources)
    ks = [beam_for(options.beam_size, len(cs)) for cs in wanted]
    capacity = min(capacity, max_rows or capacity)
    if max(ks, default=1) > capacity:
        raise ValueError(f"a beam of {max(ks)} does not fit in {capacity} rows")
    while order or len(batch):
        taken, rows = [], batch.rows  # the longest waiting sources whose beams fit
        for i in order:
            if rows + ks[i] > capacity:
                break
            taken.append(i)
            rows += ks[i]
        # (When every waiting source fits, the free rows count: as many as could join.)
        could = len(taken) if len(taken) < len(order) else (capacity - batch.rows) // min(ks)
        if taken and batch.joins_now(could):
            if max_batch_tokens is not None:
                while (
                    len(taken) > 1
                    and (batch.rows + sum(ks[i] for i in taken)) * max(batch.width, len(sources[taken[0]]))
                    > max_batch_tokens
                ):
                    taken = taken[: len(taken) // 2]
            order = order[len(taken) :]
            batch.add([Source(i, sources[i], ks[i], options.n_best, wanted[i]) for i in taken])
        for key, hyps in batch.step():
            results[key] = hyps
    return [results[i] for i in range(len(sources))]
