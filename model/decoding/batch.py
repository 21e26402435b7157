"""The running batch: inputs join, every step advances them all, finished inputs leave.

One driver for every caller: ``Translator`` feeds it a whole list of sentences (``decode``); the
service's executor feeds it what its scheduler lets in, drops what was cancelled, and returns what
finished. Each step: the runner (eager or compiled, one signature) computes it over the cache's
views, the search chooses tokens (on the device, ``Search.step_rows``; with constraints or the
repetition guard in Python, ``Search.step``), and the beams' rows take their parents' prefixes.
Every ``sync_every`` steps (``read``) the batch learns which inputs finished, and they leave (the
last rows move into their places).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

from model.decoding.beam import Beam
from model.decoding.constraints import ConstraintSet, beam_for
from model.decoding.device_search import Group, SearchRows, reorder_cache
from model.decoding.options import DecodeOptions
from model.decoding.prefix import check_prefix
from model.decoding.search import Hypothesis, Search
from model.layers import aligned
from model.runtime.step import StepChoice, StepOutputs, StepRunner
from model.transformer import Transformer

K = TypeVar("K")  # what the caller knows an input by

# While a batch runs, waiting inputs join once they number at least JOIN_RATIO x the running ones,
# or after JOIN_WAIT_STEPS steps: newcomers are encoded as one batch, so joining in groups (as TGI's
# waiting_served_ratio) beats encoding one or two at every step.
JOIN_RATIO = 0.3
JOIN_WAIT_STEPS = 8
# Steps between reads of which inputs finished, on an accelerator (``RunningBatch``'s sync_every).
SYNC_EVERY = 8


@dataclass
class Entry(Generic[K]):
    """One input in the batch: the caller's key, its cache rows, its n-best and length limit; its
    search state is on the device (``SearchRows``, at its rows) or, with constraints or the
    repetition guard, a ``Beam``."""

    key: K
    beam: Beam | None  # None: searched on the device
    rows: list[int]  # its beams' cache rows (wherever the cache keeps them: not always consecutive)
    n_best: int
    k: int = 1  # beam size
    # The batch's step count at which it reaches its length limit: every row advances one per step,
    # so the host knows when an input must have ended without a read.
    deadline: int = 1
    prefixed: bool = False  # it has an output prefix (``Source.prefix``)
    scored: bool = False  # its token log-probs asked for (``Source.scored``)


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
    # Target tokens every hypothesis starts with, forced (``model.decoding.prefix``; the model's
    # ``ModelInfo.output_prefix``); they are part of its tokens.
    prefix: tuple[int, ...] = ()
    # Keep each token's log-prob (``Hypothesis.token_log_probs``) even where the batch's greedy
    # rows are unscored (``RunningBatch``'s greedy_scores=False): such a greedy input then asks the
    # step for its candidates, the log-softmax of its row; beams and scored greedy rows keep them
    # anyway, at no extra cost.
    scored: bool = False


def pad_batch(sources: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> Tensor:
    """Right-padded (B, S) tensor of source ids, S a multiple of ``KEY_ALIGN``: a sentence's
    encoding must not depend on how long the others in its batch are."""
    src = torch.full((len(sources), aligned(max(map(len, sources)))), pad_id, dtype=torch.long)
    for i, ids in enumerate(sources):
        src[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return src.to(device)


class RunningBatch(Generic[K]):
    """Inputs being decoded together, in a cache of ``capacity`` rows (each beam a row).

    On an accelerator the search state of inputs without constraints lives on the model's device
    (``SearchRows``) and a step reads nothing back: every ``sync_every`` steps (and before an input
    could pass its length limit) one read tells which inputs finished, and they leave then. Until that read a
    finished input stays, frozen, its rows stepped and ignored: on a GPU a read waits for every
    kernel launched so far, and reading at every step kept the GPU idle while Python chose tokens.
    Inputs with constraints or under the repetition guard keep ``Beam`` (Python, a read per step);
    while the batch holds one, every step reads, and finished inputs leave at once. On the CPU every
    input keeps ``Beam`` (``device_search``, ``searches_on_device``)."""

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
        sync_every: int | None = None,
        device_search: bool | None = None,
    ) -> None:
        """``positions``: the cache's (the step's, when compiled for it); default ``options``'.
        ``word_continuations``: the target ids that may not follow a met constraint
        (``Tokenizer.word_continuations``, ``ConstraintSet``). ``sync_every``: steps between reads
        of which inputs finished (default ``sync_steps``: SYNC_EVERY on an accelerator, 1 on the
        CPU). ``device_search``: whether unconstrained inputs are searched with tensor operations
        (default ``searches_on_device``: on an accelerator, not on the CPU)."""
        self.model, self.runner, self.options = model, runner, options
        self.word_continuations = word_continuations
        cfg = model.cfg
        self.search = Search(
            eos=cfg.eos_id,
            length_penalty=options.length_penalty,
            no_repeat_ngram_size=options.no_repeat_ngram_size,
            greedy_scores=greedy_scores,
        )
        device = model.device
        # The runner's: a runner that replays captured graphs reads the same buffers every time.
        self.cache = runner.new_cache(
            capacity=capacity, positions=positions or options.positions(cfg.max_positions)
        )
        self.sync_every = sync_every if sync_every is not None else sync_steps(device)
        self.device_search = searches_on_device(device) if device_search is None else device_search
        self.state = SearchRows(capacity, self.cache.positions, device)
        self.entries: list[Entry[K]] = []
        self.steps_since_join = 0  # steps decoded since inputs last joined
        self.steps_since_read = 0  # steps decoded since finished inputs were last read
        self.steps_taken = 0  # steps decoded by this batch
        self.tokens = torch.zeros(0, dtype=torch.long, device=device)  # (R,) next token per row
        self.constrained = 0  # inputs with constraints: while 0, no step asks for forced tokens
        self._unforced: dict[int, Tensor] = {}  # beam rows -> the dummy ``forced`` (B, 2) of pad
        self._layout: _Layout | None = None  # the step's index tensors, made when the rows change

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

        Raises ValueError, before anything changes, for a constraint or prefix token the step
        cannot score (outside the vocabulary: it would fail the whole batch's step) or that cannot
        be generated inside an output (pad, bos, eos).

        Nothing is read here: finished inputs still in the batch leave at the next read (``step``
        returns them; ``add`` could not)."""
        if not sources:
            return
        cfg = self.model.cfg
        for s in sources:
            check_prefix(s.prefix, cfg.vocab_size, {cfg.pad_id, cfg.bos_id, cfg.eos_id})
            if not s.constraints:
                continue
            bad = {t for c in s.constraints for t in c if not 0 <= t < cfg.vocab_size}
            bad |= {t for c in s.constraints for t in c} & {cfg.pad_id, cfg.bos_id, cfg.eos_id}
            if bad:
                raise ValueError(f"constraint tokens {sorted(bad)} cannot be generated")
        self.steps_since_join = 0
        src = pad_batch([s.ids for s in sources], cfg.pad_id, self.tokens.device)
        kv, mask = self.runner.encode(src)  # (B, L, 2, H, S, Dh), (B, S)
        ks = [s.beam_size for s in sources]
        first = self.cache.rows
        self.cache.append(kv, mask, ks)  # k rows per input, reading its one source
        bos = torch.full((sum(ks),), cfg.bos_id, dtype=torch.long, device=src.device)
        self.tokens = torch.cat([self.tokens[:first], bos])
        limits = [self.options.output_limit(len(s.ids), cfg.max_positions) for s in sources]
        self.state.start(first, ks, limits, [s.prefix for s in sources])
        for s, limit in zip(sources, limits, strict=True):
            rows_of = list(range(first, first + s.beam_size))
            constraints = ConstraintSet(s.constraints, self.word_continuations) if s.constraints else None
            self.constrained += constraints is not None
            on_device = self.device_search and self.search.on_device(constraints)
            beam = None if on_device else Beam.start(s.beam_size, limit, constraints, s.prefix, s.scored)
            self.entries.append(
                Entry(
                    s.key,
                    beam,
                    rows_of,
                    s.n_best,
                    s.beam_size,
                    self.steps_taken + limit,
                    bool(s.prefix),
                    s.scored or self.search.wants_rows(s.beam_size),
                )
            )
            first += s.beam_size
        self._layout = self._lay_out()  # (uploads: a join reads already, a step need not)

    def step(self) -> list[tuple[K, list[Hypothesis]]]:
        """One token for every input; returns the inputs found finished (they have left), with their
        n-best hypotheses, best first: at a read (``read``), else none."""
        if not self.entries:
            return []
        layout = self._layout or self._lay_out()  # (made by add and keep: uploads wait for the device)
        hosted = layout.hosted
        forced = self._forced([e.beam for e in hosted if e.beam is not None], layout)
        out = self.runner(self.tokens, *self.cache.views(), layout.wanted, forced)
        self.cache.advance(out[4])
        self.steps_since_join += 1
        self.steps_since_read += 1
        self.steps_taken += 1
        n = layout.on_device
        scored = StepChoice(out[0], out[1][:n], out[2][:n], out[3][:n])
        moved = self.search.step_rows(self.state, layout.groups, scored, self.tokens)
        if moved is not None:
            reorder_cache(self.cache, *moved)
        if hosted:
            self._step_hosted(layout, out)
        due = self.steps_since_read >= self.sync_every or self.steps_taken >= layout.deadline
        return self.read() if due or hosted else []

    def read(self) -> list[tuple[K, list[Hypothesis]]]:
        """Which inputs finished (one read of the device's flags, one of their hypotheses); they
        leave, and are returned with their n-best, best first, in the batch's order."""
        self.steps_since_read = 0
        device = [e for e in self.entries if e.beam is None]
        flags = self.state.finished([e.rows[0] for e in device]) if device else []
        done = {id(e) for e, f in zip(device, flags, strict=True) if f}
        for e in device:  # (the host knows this much: an input at its limit has ended)
            assert id(e) in done or self.steps_taken < e.deadline, "an input passed its length limit"
        ended = [e for e in device if id(e) in done]
        found = dict(zip(map(id, ended), self.state.hypotheses([e.rows for e in ended]), strict=True))
        done |= {id(e) for e in self.entries if e.beam is not None and e.beam.done}
        finished = [
            (
                e.key,
                self.search.results(found[id(e)], e.n_best, e.scored)
                if e.beam is None
                else e.beam.best(e.n_best),
            )
            for e in self.entries
            if id(e) in done
        ]
        if done:  # only the rows that take the finished inputs' places are copied
            self.keep([i for i, e in enumerate(self.entries) if id(e) not in done])
        return finished

    def _step_hosted(self, layout: _Layout, out: StepOutputs) -> None:
        """``Search.step`` for the inputs that keep a ``Beam`` (constraints, the repetition guard):
        their rows' part of the step, as today, read at once; their beams' rows reordered."""
        hosted = layout.hosted
        beams = [e.beam for e in hosted if e.beam is not None]
        n = layout.on_device
        choice = out[0].index_select(0, layout.hosted_rows)
        scored = StepChoice(
            choice, out[1][n:], out[2][n:], out[3][n:], out[5][n:] if self.constrained else None
        )
        keep, tokens = self.search.step(beams, scored)
        rows = [r for e in hosted for r in e.rows]  # as ``keep``/``tokens`` index them
        if keep is None:  # nothing finished or moved: every row takes its new token in place
            self.tokens.index_copy_(0, layout.hosted_rows, tokens)
            return
        still = [rows[r] for r in keep.tolist()]  # old rows feeding the live inputs' new rows, in order
        targets = [r for e in hosted if e.beam is not None and not e.beam.done for r in e.rows]
        if not targets:
            return
        device = self.tokens.device
        self.tokens[torch.tensor(targets, device=device)] = tokens
        pairs = [(t, s) for t, s in zip(targets, still, strict=True) if t != s]
        if pairs:  # beams moved: their rows' self-attention prefixes are copied
            dst, src = (torch.tensor(x, device=device) for x in zip(*pairs, strict=True))
            reorder_cache(self.cache, dst, src)

    def _lay_out(self) -> _Layout:
        """The index tensors of the step (made once per change of rows, not per step): each beam
        size's inputs on the device and their rows; the rows whose candidates the step returns,
        theirs first, then the hosted inputs'. Made where the rows change (``add``, ``keep``), which
        read the device anyway: an upload from the host waits for the device too (CUDA copies
        pageable memory synchronously), and a step between reads must not."""
        device = self.tokens.device
        # (By beam size, and whether scored: greedy inputs that asked for log-probs in a batch whose
        # greedy rows are unscored are a group of their own, with candidates.)
        on_device: dict[tuple[int, bool], list[Entry[K]]] = {}
        for e in self.entries:
            if e.beam is None:
                on_device.setdefault((e.k, e.scored), []).append(e)
        groups: list[Group] = []
        wanted: list[int] = []
        for (k, scored), members in sorted(on_device.items()):
            rows = [e.rows for e in members]
            top = len(wanted) if scored else None
            if top is not None:
                wanted += [r for rs in rows for r in rs]
            prefixed = any(e.prefixed for e in members)
            groups.append(Group(k, torch.tensor(rows, dtype=torch.long, device=device), top, prefixed))
        n = len(wanted)
        hosted = [e for e in self.entries if e.beam is not None]
        hosted_rows = [r for e in hosted for r in e.rows]
        wanted += [
            r for e in hosted if e.beam is not None and self.search.wants_candidates(e.beam) for r in e.rows
        ]
        self._layout = _Layout(
            groups,
            torch.tensor(wanted or [0], dtype=torch.long, device=device),
            n,
            hosted,
            torch.tensor(hosted_rows, dtype=torch.long, device=device),
            min((e.deadline for e in self.entries if e.beam is None), default=math.inf),
        )
        return self._layout

    def _forced(self, beams: list[Beam], layout: _Layout) -> Tensor:
        """The step's ``forced`` (B, F): the tokens the constrained inputs need scored whatever their
        rank (after the rows of the inputs on the device, which need none); without constrained
        inputs two dummy columns (pad: ``Search.forced``'s least width), made once per number of
        rows."""
        device = self.tokens.device
        rows = layout.wanted.size(0)
        if self.constrained:
            hosted = self.search.forced(beams)
            width = len(hosted[0]) if hosted else 2
            return torch.tensor([[0] * width] * layout.on_device + hosted, dtype=torch.long, device=device)
        unforced = self._unforced.get(rows)
        if unforced is None:
            unforced = self._unforced[rows] = torch.zeros((rows, 2), dtype=torch.long, device=device)
        return unforced

    def drop(self, gone: Callable[[K], bool]) -> list[K]:
        """Remove the inputs whose key is ``gone`` (cancelled, expired); returns their keys (finished
        or not: those that finished since the last read are not read)."""
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
        """Only the inputs at positions ``keep`` stay; the others' rows are overwritten by the last
        (their search state on the device moves with them)."""
        kept = set(keep)
        leaving = [r for i, e in enumerate(self.entries) if i not in kept for r in e.rows]
        moves = self.cache.remove(leaving)
        if moves:
            dst = torch.tensor(list(moves.values()), device=self.tokens.device)
            src = torch.tensor(list(moves.keys()), device=self.tokens.device)
            self.tokens[dst] = self.tokens[src]
            self.state.move(moves)
        self.tokens = self.tokens[: self.cache.rows]
        for i in keep:
            e = self.entries[i]
            e.rows = [moves.get(r, r) for r in e.rows]
        # Inputs in the order of their rows: with one row per input (greedy), rows then follow
        # input order.
        self.entries = sorted((self.entries[i] for i in keep), key=lambda e: e.rows[0])
        if self.constrained:
            self.constrained = sum(
                e.beam is not None and e.beam.constraints is not None for e in self.entries
            )
        self._layout = self._lay_out()  # (uploads wait for the device: done where it was read)


@dataclass(frozen=True)
class _Layout:
    """What a step needs of the batch's rows, as index tensors (``RunningBatch._lay_out``)."""

    groups: list[Group]  # the inputs on the device, by beam size
    wanted: Tensor  # (B,) the step's ``beam_rows``: the groups' (in order), then the hosted inputs'
    on_device: int  # the first of them that are the hosted inputs'
    hosted: list[Any]  # the entries that keep a ``Beam``
    hosted_rows: Tensor  # their rows, in their order
    deadline: float  # the first step at which an input on the device reaches its limit (inf: none)


def searches_on_device(device: torch.device) -> bool:
    """Whether unconstrained inputs are searched with tensor operations (``device_search``): on an
    accelerator, where ``Beam``'s reads of every step kept the GPU idle (H200: 100k generated tokens/s
    against 36k at 256 rows, BENCHMARKS.md); not on the CPU, where a read costs nothing and the ~60
    small tensor operations of a step cost more than ``Beam``'s Python (the service, beam 5, 64
    connections, AVX-512 VNNI: 178 against 207 sentences/s; greedy 654 against 685)."""
    return device.type != "cpu"


def sync_steps(device: torch.device) -> int:
    """Steps between reads of which inputs finished: SYNC_EVERY on an accelerator, where a read
    waits for the queue of launched kernels; 1 on the CPU, where a read costs nothing and a
    finished input's rows stepped on would cost a step's arithmetic."""
    return 1 if device.type == "cpu" else SYNC_EVERY


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
    sync_every: int | None = None,
    prefix: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """Decode every source (ids ending in eos) with ``options``; the n-best of each, in order.

    Sources join the running batch as rows free up (longest first: similar lengths share steps),
    in groups as the service's executor lets them in, and each input's result does not depend on
    which others share its steps. ``max_rows``: rows decoded together (default ``capacity``).
    ``constraints``: per source, target token sequences its hypotheses must contain; such a source
    decodes with ``beam_for(options.beam_size, its number of constraints)``, and no met constraint
    is followed by one of ``word_continuations``; ``sync_every``: ``RunningBatch``'s; ``prefix``:
    target tokens every hypothesis starts with (``Source.prefix``)."""
    batch: RunningBatch[int] = RunningBatch(
        model,
        runner,
        capacity=capacity,
        options=options,
        positions=positions,
        word_continuations=word_continuations,
        sync_every=sync_every,
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
            batch.add([Source(i, sources[i], ks[i], options.n_best, wanted[i], tuple(prefix)) for i in taken])
        for key, hyps in batch.step():
            results[key] = hyps
    return [results[i] for i in range(len(sources))]
