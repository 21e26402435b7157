"""A worker's running batch: how each decoding step runs (the scheduler decides what waits next).

Continuous (iteration-level) batching for the encoder-decoder: before every decoding step, waiting
sentences are encoded and join the running batch (their KV cache rows are written after its last
row), and after every step, sentences that finished leave it (the last rows move into their places)
and their results go back at once. ``mode="dynamic"`` instead collects sentences
for up to ``max_wait_ms`` into a batch and runs it to the end before taking more (kept to measure
the difference).

The executor owns the batch (how this step runs; the front end's scheduler chose the order in which
jobs arrive); the model owns arithmetic (``encode``,
``decode_step``); ``model.search`` owns token choice (``Beam``, ``search_step``); the KV cache
(``CacheSlots``, seen by each step as a ``KVCache``) is the data passed between them. Everything here
runs on one thread, the one that loaded the model (``app.serving.worker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from app.config import Settings
from app.metrics import Metrics
from app.serving.scheduler import Hypotheses
from model.cache import CacheSlots
from model.compiled_step import CompiledDecoder
from model.search import Beam, choose_step, initial_capacity, max_lengths, search_step
from model.static_slots import StaticSlots
from model.translator import Translator

log = logging.getLogger(__name__)

# While a batch runs, waiting sentences join it once they number at least JOIN_RATIO x the running
# ones, or after JOIN_WAIT_STEPS decoding steps: newcomers are encoded as one batch, so joining in
# groups (as TGI's waiting_served_ratio) beats encoding one or two at every step.
JOIN_RATIO = 0.3
JOIN_WAIT_STEPS = 8


class Job(Protocol):
    """One sentence to translate (``app.serving.worker.WorkerJob``)."""

    id: int
    src: list[int]  # source ids, eos included
    beam_size: int
    n_best: int
    enqueued: float  # time.monotonic() when the service admitted it

    def expired(self, now: float) -> bool: ...  # cancelled, or past its deadline


class JobSource(Protocol):
    """Where jobs wait to join the batch (``app.serving.worker.Inbox``)."""

    @property
    def waiting(self) -> int: ...

    def take(self, fits: Callable[[Job], bool]) -> list[Job]: ...

    def wait_for_more(self, rows: int, timeout: float) -> None: ...

    def release(self, job: Job) -> bool: ...  # the job left the batch; False if nobody waits for it


# What one iteration produced: finished jobs with their n-best, and jobs that failed.
Outcome = tuple[Job, Hypotheses | BaseException]


@dataclass
class Running:
    """The running batch: jobs, their search states, and the cache rows each job owns.

    A job's rows are wherever ``CacheSlots`` keeps them: when a job leaves, the last rows move into
    its places, so rows of a job need not be consecutive nor in job order.
    """

    jobs: list[Job] = field(default_factory=list)
    beams: list[Beam] = field(default_factory=list)
    job_rows: list[list[int]] = field(default_factory=list)  # per job, its beams' cache rows
    cache: CacheSlots | StaticSlots = field(default_factory=CacheSlots)
    tokens: torch.Tensor | None = None  # (R,) the next token of every row

    @property
    def rows(self) -> int:
        return self.cache.rows

    def row_index(self, jobs: list[int]) -> list[int]:
        """Cache rows of the jobs at positions ``jobs``, in that order."""
        return [r for i in jobs for r in self.job_rows[i]]

    def keep_jobs(self, keep: list[int]) -> None:
        """Only the jobs at positions ``keep`` stay; the others' rows are overwritten by the last rows."""
        assert self.tokens is not None
        kept = set(keep)
        moves = self.cache.remove(self.row_index([i for i in range(len(self.jobs)) if i not in kept]))
        if moves:
            dst = torch.tensor(list(moves.values()), device=self.tokens.device)
            src = torch.tensor(list(moves.keys()), device=self.tokens.device)
            self.tokens[dst] = self.tokens[src]
        self.tokens = self.tokens[: self.cache.rows]
        job_rows = {i: [moves.get(r, r) for r in self.job_rows[i]] for i in keep}
        # Jobs in the order of their rows: with one row per job (greedy), rows then follow job order
        # and a step's logits need no reordering for the search.
        order = sorted(keep, key=lambda i: job_rows[i][0])
        self.jobs = [self.jobs[i] for i in order]
        self.beams = [self.beams[i] for i in order]
        self.job_rows = [job_rows[i] for i in order]


class Executor:
    def __init__(
        self,
        translator: Translator,
        source: JobSource,
        *,
        max_batch_size: int = 64,
        max_batch_tokens: int = 8192,
        mode: Literal["continuous", "dynamic"] = "continuous",
        max_wait_ms: float = 5.0,
        length_penalty: float = 1.0,
        max_length_a: float = 1.5,
        max_length_b: int = 10,
        metrics: Metrics | None = None,
        decoder: CompiledDecoder | None = None,
    ) -> None:
        """
        Args:
            max_batch_size: rows (sequences, each beam counted) in the running batch.
            max_batch_tokens: padded source tokens x rows in the running batch (bounds the
                cross-attention of a step; the cache buffers keep the largest batch and input seen).
            mode: ``continuous`` joins and leaves at every step; ``dynamic`` runs batch by batch.
            max_wait_ms: ``dynamic`` only: how long to collect sentences before starting a batch.
            decoder: the compiled step (``model.compiled_step``; warmed up by the caller): the running
                batch then lives in ``StaticSlots`` and each step is one graph. None: the eager
                ``Transformer.decode_step`` over ``CacheSlots``.
        """
        self.translator = translator
        self.model = translator.model
        self.source = source
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.mode = mode
        self.max_wait_s = max_wait_ms / 1000.0
        self.length_penalty = length_penalty
        self.max_length_a, self.max_length_b = max_length_a, max_length_b
        self.metrics = metrics
        self.decoder = decoder
        self.running = self._empty()
        self._joining: list[Job] = []  # taken from the source, being encoded into the batch
        self._steps_since_join = 0  # decoding steps since newcomers last joined the running batch

    def _empty(self) -> Running:
        if self.decoder is None:
            return Running()
        # The rows the step was compiled for (room for the largest batch, or one input's beams).
        return Running(cache=StaticSlots(self.model, self.decoder.capacity))

    @classmethod
    def from_settings(
        cls,
        translator: Translator,
        source: JobSource,
        settings: Settings,
        *,
        metrics: Metrics | None,
        decoder: CompiledDecoder | None = None,
    ) -> Executor:
        return cls(
            translator,
            source,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            mode=settings.batching,
            max_wait_ms=settings.max_wait_ms,
            metrics=metrics,
            decoder=decoder,
        )

    @property
    def busy(self) -> bool:
        """A batch is running."""
        return bool(self.running.jobs)

    def iteration(self) -> list[Outcome]:
        """Admit, drop what nobody waits for, one decoding step, remove what finished. A failed step
        fails the running jobs (and only those) instead of raising."""
        try:
            return self._iteration()
        except Exception as e:  # a failed step must not take the worker down with it
            log.exception("decoding step failed; failing the running batch")
            failed = RuntimeError(f"translation failed: {e}")
            jobs = self.running.jobs + [j for j in self._joining if j not in self.running.jobs]
            self.running, self._joining = self._empty(), []
            self._gauge()
            return [(job, failed) for job in jobs]

    def _iteration(self) -> list[Outcome]:
        run = self.running
        if self.mode == "continuous" or not run.jobs:
            if self.mode == "dynamic" and not run.jobs:
                self.source.wait_for_more(self.max_batch_size, self.max_wait_s)
            self._joining = self._take()
            self._admit(self._joining)
            self._joining = []
        self._drop_expired()
        run = self.running
        if not run.jobs:
            self._gauge()
            return []
        assert run.tokens is not None
        self._steps_since_join += 1
        jobs = list(range(len(run.jobs)))
        rows = run.row_index(jobs)  # rows in job order, as the search reads them
        in_order = rows == list(range(len(rows)))
        index = None if in_order else torch.tensor(rows, device=run.tokens.device)
        if isinstance(run.cache, StaticSlots):
            assert self.decoder is not None
            # The rows whose best candidates the search needs, in job order (at least one row).
            beam_rows = run.row_index([i for i, b in enumerate(run.beams) if b.k > 1]) or [0]
            step = run.cache.decode(
                self.decoder, run.tokens, torch.tensor(beam_rows, device=run.tokens.device)
            )
            if index is not None:
                step.choice = step.choice.index_select(0, index)
            keep, tokens = choose_step(
                run.beams, step, eos=self.model.cfg.eos_id, length_penalty=self.length_penalty
            )
        else:
            logits, cache = self.model.decode_step(run.tokens, run.cache.view())
            run.cache.advance(cache)
            if index is not None:
                logits = logits.index_select(0, index)
            keep, tokens = search_step(
                run.beams,
                logits,
                eos=self.model.cfg.eos_id,
                length_penalty=self.length_penalty,
                greedy_scores=False,
            )
        self._place(rows, keep, tokens)
        done = [i for i in jobs if run.beams[i].done]
        outcomes: list[Outcome] = [
            (run.jobs[i], self._finish(run.beams[i], run.jobs[i].n_best)) for i in done
        ]
        if done:  # finished jobs leave at once: only the rows that take their places are copied
            run.keep_jobs([i for i in jobs if not run.beams[i].done])
        if self.metrics is not None:
            self.metrics.batch_size.observe(len(rows))
            self.metrics.decode_steps.inc()
        self._gauge()
        return outcomes

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.active_sequences.set(len(self.running.jobs))

    def _place(self, rows: list[int], keep: torch.Tensor | None, tokens: torch.Tensor) -> None:
        """Put ``search_step``'s result (``keep``/``tokens`` index ``rows``, every job's rows in job
        order) back into the running batch: beams reordered within their job's rows; finished jobs'
        rows are left alone (they leave right after)."""
        run = self.running
        assert run.tokens is not None
        if keep is None:  # nothing finished or moved: every row takes its new token in place
            if rows == list(range(len(run.tokens))):
                run.tokens = tokens
            else:
                run.tokens[torch.tensor(rows, device=tokens.device)] = tokens
            return
        index = list(range(run.rows))  # new row r reads old row index[r]
        still = [rows[r] for r in keep.tolist()]  # old rows feeding the live jobs' new rows, in order
        targets = run.row_index([i for i, b in enumerate(run.beams) if not b.done])
        for target, source in zip(targets, still, strict=True):
            index[target] = source
        if targets:
            run.tokens[torch.tensor(targets, device=tokens.device)] = tokens
        run.cache.reorder(index)  # beams moved: their rows' self-attention prefixes are copied

    def _take(self) -> list[Job]:
        """Waiting jobs that fit beside the running batch, in the scheduler's order."""
        run = self.running
        live = len(run.jobs)
        # Newcomers are encoded as one batch, so while a batch runs they join in groups rather than
        # one or two at every step: once enough of them wait or JOIN_WAIT_STEPS have passed.
        if live and self.source.waiting < JOIN_RATIO * live and self._steps_since_join < JOIN_WAIT_STEPS:
            return []
        rows, width = run.rows, run.cache.width

        def fits(job: Job) -> bool:
            nonlocal rows, width
            new_width = max(width, len(job.src))
            new_rows = rows + job.beam_size
            if rows and (new_rows > self.max_batch_size or new_rows * new_width > self.max_batch_tokens):
                return False  # an empty batch takes any one job, however large
            rows, width = new_rows, new_width
            return True

        taken = self.source.take(fits)
        if taken:
            self._steps_since_join = 0
        return taken

    def _admit(self, jobs: list[Job]) -> None:
        """Encode ``jobs`` as one padded batch and append their rows to the running batch."""
        if not jobs:
            return
        if self.metrics is not None:
            now = time.monotonic()
            for job in jobs:
                self.metrics.queue_wait.observe(now - job.enqueued)
            self.metrics.input_tokens.inc(sum(len(j.src) for j in jobs))
        src = self.translator.batch([j.src for j in jobs])
        enc = self.model.encode(src)
        limits = max_lengths(
            (src != self.model.cfg.pad_id).sum(1),
            self.max_length_a,
            self.max_length_b,
            self.model.cfg.max_positions,
        )
        ks = torch.tensor([j.beam_size for j in jobs], device=src.device)
        rows = torch.arange(len(jobs), device=src.device).repeat_interleave(ks)
        # The static slots hold every position already: the new rows' own buffer needs none.
        static = isinstance(self.running.cache, StaticSlots)
        cache = self.model.start_cache(enc, capacity=1 if static else initial_capacity(limits))
        if len(rows) > len(jobs):  # beams: k rows per job (with greedy only, no copy)
            cache = cache.index_select(rows)
        run = self.running
        first = run.rows
        run.cache.append(cache)
        bos = torch.full((len(rows),), self.model.cfg.bos_id, dtype=torch.long, device=src.device)
        run.tokens = bos if run.tokens is None or first == 0 else torch.cat([run.tokens, bos])
        for job, limit in zip(jobs, limits.tolist(), strict=True):
            run.jobs.append(job)
            run.beams.append(Beam.start(job.beam_size, int(limit)))
            run.job_rows.append(list(range(first, first + job.beam_size)))
            first += job.beam_size

    def _drop_expired(self) -> None:
        """Remove jobs whose request was cancelled or whose deadline passed from the running batch."""
        run = self.running
        now = time.monotonic()
        expired = [j.expired(now) for j in run.jobs]
        if not any(expired):
            return
        for job, gone in zip(run.jobs, expired, strict=True):
            if gone:
                self.source.release(job)
        if self.metrics is not None:
            self.metrics.sentences.labels("abandoned").inc(sum(expired))
        run.keep_jobs([i for i, e in enumerate(expired) if not e])

    def _finish(self, beam: Beam, n_best: int) -> Hypotheses:
        hyps = beam.best(n_best)
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(hyps[0].tokens) + 1 if hyps else 0)
            self.metrics.sentences.labels("translated").inc()
        return [(h.tokens, h.score) for h in hyps]
