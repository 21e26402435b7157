"""A worker's running batch: when sentences join and leave it (the scheduler decided their order).

Continuous (iteration-level) batching for the encoder-decoder: before every decoding step, waiting
sentences are encoded and join the running batch, and after every step, sentences that finished
leave it and their results go back at once. The batch itself, how a step runs and which tokens it
chooses are ``model.decoding.batch.RunningBatch``'s, the same driver the library and the CLI use:
this module adds what a service needs around it (admission within the batch limits, cancellation
and deadlines, metrics, and a failed step failing only the running sentences). Everything here
runs on one thread, the one that loaded the model (``app.serving.worker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from app.config import Settings
from app.metrics import Metrics
from app.serving.scheduler import Hypotheses
from model.decoding.batch import JOIN_RATIO, JOIN_WAIT_STEPS, RunningBatch, Source
from model.decoding.search import Hypothesis
from model.decoding.translator import Translator

log = logging.getLogger(__name__)

__all__ = ["JOIN_RATIO", "JOIN_WAIT_STEPS", "Executor", "Job", "JobSource", "Outcome"]


class Job(Protocol):
    """One sentence to translate, as the worker's inbox holds it."""

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

    def release(self, job: Job) -> bool: ...  # the job left the batch; False if nobody waits for it


# What one iteration produced: finished jobs with their n-best, and jobs that failed.
Outcome = tuple[Job, Hypotheses | BaseException]


class Executor:
    def __init__(
        self,
        translator: Translator,
        source: JobSource,
        *,
        max_batch_size: int = 64,
        max_batch_tokens: int = 8192,
        metrics: Metrics | None = None,
    ) -> None:
        """
        Args:
            translator: the model, its decoding step (eager or compiled, chosen when it was loaded)
                and its ``DecodeOptions`` (a job's beam size and n-best are its own).
            max_batch_size: rows (sequences, each beam counted) in the running batch.
            max_batch_tokens: padded source tokens x rows in the running batch (bounds the
                cross-attention of a step).
        """
        self.translator = translator
        self.model = translator.model
        self.source = source
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self.running = self._empty()
        self._joining: list[Job] = []  # taken from the source, being encoded into the batch

    def _empty(self) -> RunningBatch[Job]:
        # Room for the largest batch, or for one input's beams; greedy hypotheses' scores are not
        # returned by the service, so greedy rows skip the normalisation.
        return RunningBatch(
            self.model,
            self.translator.runner,
            capacity=self.translator.capacity,
            options=self.translator.options,
            greedy_scores=False,
        )

    @classmethod
    def from_settings(
        cls, translator: Translator, source: JobSource, settings: Settings, *, metrics: Metrics | None
    ) -> Executor:
        return cls(
            translator,
            source,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            metrics=metrics,
        )

    @property
    def busy(self) -> bool:
        """A batch is running."""
        return len(self.running) > 0

    def iteration(self) -> list[Outcome]:
        """Admit, drop what nobody waits for, one decoding step, remove what finished. A failed step
        fails the running jobs (and only those) instead of raising."""
        try:
            return self._iteration()
        except Exception as e:  # a failed step must not take the worker down with it
            log.exception("decoding step failed; failing the running batch")
            failed = RuntimeError(f"translation failed: {e}")
            jobs = [e.key for e in self.running.entries]
            jobs += [j for j in self._joining if j not in jobs]
            self.running, self._joining = self._empty(), []
            self._gauge()
            return [(job, failed) for job in jobs]

    def _iteration(self) -> list[Outcome]:
        self._joining = self._take()
        self._admit(self._joining)
        self._joining = []
        self._drop_expired()
        run = self.running
        if not len(run):
            self._gauge()
            return []
        rows = run.rows
        outcomes: list[Outcome] = [(job, self._finish(hyps)) for job, hyps in run.step()]
        if self.metrics is not None:
            self.metrics.batch_size.observe(rows)
            self.metrics.decode_steps.inc()
        self._gauge()
        return outcomes

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.active_sequences.set(len(self.running))

    def _take(self) -> list[Job]:
        """Waiting jobs that fit beside the running batch, in the scheduler's order."""
        run = self.running
        # Newcomers are encoded as one batch, so while a batch runs they join in groups rather than
        # one or two at every step.
        if not run.joins_now(self.source.waiting):
            return []
        rows, width = run.rows, run.width
        capacity = min(self.max_batch_size, self.translator.capacity)

        def fits(job: Job) -> bool:
            nonlocal rows, width
            new_width = max(width, len(job.src))
            new_rows = rows + job.beam_size
            if rows and (new_rows > capacity or new_rows * new_width > self.max_batch_tokens):
                return False  # an empty batch takes any one job, however large
            rows, width = new_rows, new_width
            return True

        return self.source.take(fits)

    def _admit(self, jobs: list[Job]) -> None:
        """Encode ``jobs`` as one padded batch and add their rows to the running batch."""
        if not jobs:
            return
        if self.metrics is not None:
            now = time.monotonic()
            for job in jobs:
                self.metrics.queue_wait.observe(now - job.enqueued)
            self.metrics.input_tokens.inc(sum(len(j.src) for j in jobs))
        self.running.add([Source(job, job.src, job.beam_size, job.n_best) for job in jobs])

    def _drop_expired(self) -> None:
        """Remove jobs whose request was cancelled or whose deadline passed from the running batch."""
        now = time.monotonic()
        dropped = self.running.drop(lambda job: job.expired(now))
        for job in dropped:
            self.source.release(job)
        if dropped and self.metrics is not None:
            self.metrics.sentences.labels("abandoned").inc(len(dropped))

    def _finish(self, hyps: list[Hypothesis]) -> Hypotheses:
        if self.metrics is not None:
            self.metrics.generated_tokens.inc(len(hyps[0].tokens) + 1 if hyps else 0)
            self.metrics.sentences.labels("translated").inc()
        return [(h.tokens, h.score) for h in hyps]
