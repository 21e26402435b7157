"""The batching engine: one queue of sentences from every client, one running batch on a worker.

Continuous (iteration-level) batching for the encoder-decoder: before every decoding step, waiting
sentences are encoded and join the running batch (their KV cache rows are written after its last
row), and after every step, sentences that finished leave it (the last rows move into their places)
and their requests resolve at once. ``mode="dynamic"`` instead collects sentences for up to
``max_wait_ms`` into a batch and runs it to the end before taking more (kept to measure the
difference).

The engine owns scheduling (what runs in the next step); the model owns arithmetic (``encode``,
``decode_step``); ``model.search`` owns token choice (``Beam``, ``search_step``); the KV cache
(``CacheSlots``, seen by each step as a ``KVCache``) is the data passed between them. The event
loop never runs the model: ``translate`` enqueues and awaits futures that the worker loop
resolves. The worker loop runs on the service's ``ModelThread``, the thread that also loaded the
model (see ``app.model_thread`` for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from app.config import Settings
from app.metrics import Metrics
from app.model_thread import ModelThread
from model.cache import CacheSlots
from model.search import Beam, Hypothesis, initial_capacity, max_lengths, search_step
from model.translator import Translator

log = logging.getLogger(__name__)

# Translated once before a service reports ready: the first request should not pay for lazy
# initialisation (allocator, kernels, thread pools).
WARMUP_SENTENCES = ["Hallo Welt."]

# Continuous batching: while a batch runs, waiting sentences join it once they number at least
# JOIN_RATIO x the running ones, or after JOIN_WAIT_STEPS decoding steps (see Engine._take).
JOIN_RATIO = 0.3
JOIN_WAIT_STEPS = 8


class EngineError(Exception):
    """A sentence the engine could not translate."""


class QueueFull(EngineError):
    """More sentences are waiting than ``max_queue``: the client should retry later."""


class DeadlineExceeded(EngineError):
    """The request's deadline passed before all its sentences were translated."""


class EngineStopped(EngineError):
    """The engine is not running (starting up, shutting down, or its worker failed)."""


@dataclass
class SentenceResult:
    hypotheses: list[str]  # n_best translations, best first
    # Their length-normalised log-probabilities; 0.0 for greedy search, where the engine skips the
    # log-softmax (the API returns no scores; at batch 64 it took ~0.3 ms of a ~10 ms step).
    scores: list[float]


def open_translator(settings: Settings) -> Translator:
    """The model of ``settings``, as the service runs it (in its own process or in a replica's)."""
    return Translator.load(
        settings.model_dir, device=settings.device, dtype=settings.dtype, quantization=settings.quantization
    )


class TranslationEngine(Protocol):
    """What the service needs of an engine: an ``Engine`` here, or an ``app.replicas.EnginePool``
    over several (``NMT_REPLICAS``)."""

    @property
    def queue_depth(self) -> int: ...

    @property
    def active_sequences(self) -> int: ...

    @property
    def alive(self) -> bool: ...

    async def translate(
        self, sentences: list[str], *, beam_size: int = 5, n_best: int = 1, timeout_s: float | None = None
    ) -> list[SentenceResult]: ...

    def stop(self) -> None: ...


@dataclass(eq=False)
class Job:
    """One sentence of one request, from the queue to the end of its search."""

    src: list[int]  # source ids, eos included
    beam_size: int
    n_best: int
    future: asyncio.Future[list[Hypothesis]]  # the n-best, as token ids: text is made by the caller
    loop: asyncio.AbstractEventLoop
    deadline: float | None  # time.monotonic() after which nobody waits for it
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False  # set from the event loop when the client is gone

    def expired(self, now: float) -> bool:
        return self.cancelled or (self.deadline is not None and now > self.deadline)

    def settle(self, result: list[Hypothesis] | BaseException) -> None:
        """Set the future; on the event loop's thread only (futures are not thread-safe)."""
        if self.future.done():
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


Outcome = tuple[Job, list[Hypothesis] | BaseException]


def resolve(outcomes: list[Outcome]) -> None:
    """Hand outcomes to the event loops that wait for them, one wake-up per loop: a wake-up is a
    write to the loop's self-pipe, and one per finished sentence took ~4% of a replica (py-spy)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}
    for job, result in outcomes:
        by_loop.setdefault(job.loop, []).append((job, result))
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(_settle, batch)


def _settle(outcomes: list[Outcome]) -> None:
    for job, result in outcomes:
        job.settle(result)


@dataclass
class Running:
    """The running batch: jobs, their search states, and the cache rows each job owns.

    A job's rows are wherever ``CacheSlots`` keeps them: when a job leaves, the last rows move into
    its places, so rows of a job need not be consecutive nor in job order.
    """

    jobs: list[Job] = field(default_factory=list)
    beams: list[Beam] = field(default_factory=list)
    job_rows: list[list[int]] = field(default_factory=list)  # per job, its beams' cache rows
    cache: CacheSlots = field(default_factory=CacheSlots)
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


class Engine:
    def __init__(
        self,
        translator: Translator,
        *,
        max_batch_size: int = 64,
        max_batch_tokens: int = 8192,
        max_queue: int = 1024,
        mode: Literal["continuous", "dynamic"] = "continuous",
        max_wait_ms: float = 5.0,
        max_input_tokens: int = 250,
        length_penalty: float = 1.0,
        max_length_a: float = 1.5,
        max_length_b: int = 10,
        model_thread: ModelThread | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """
        Args:
            max_batch_size: rows (sequences, each beam counted) in the running batch.
            max_batch_tokens: padded source tokens x rows in the running batch (bounds the
                cross-attention of a step; the cache buffers keep the largest batch and input seen).
            max_queue: sentences waiting to join; more are refused with ``QueueFull``.
            mode: ``continuous`` joins and leaves at every step; ``dynamic`` runs batch by batch.
            max_wait_ms: ``dynamic`` only: how long to collect sentences before starting a batch.
            max_input_tokens: longer sources are truncated (the model's positions are finite).
            model_thread: where the worker loop runs; give the thread that loaded the model
                (None: a thread of the engine's own, with torch's default thread count).
        """
        self.translator = translator
        self.model = translator.model
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.mode = mode
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_input_tokens = min(max_input_tokens, translator.max_input_tokens)
        self.length_penalty = length_penalty
        self.max_length_a, self.max_length_b = max_length_a, max_length_b
        self._own_thread = model_thread is None
        self.model_thread = model_thread or ModelThread()
        self.metrics = metrics or Metrics()
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running = Running()
        self._worker: Future[None] | None = None  # the worker loop, while it runs
        self._steps_since_join = 0  # decoding steps since newcomers last joined the running batch
        self._stop = False
        self.failed: BaseException | None = None  # set if the worker loop itself died

    @classmethod
    def from_settings(
        cls, translator: Translator, settings: Settings, *, metrics: Metrics, model_thread: ModelThread
    ) -> Engine:
        return cls(
            translator,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            max_queue=settings.max_queue,
            mode=settings.batching,
            max_wait_ms=settings.max_wait_ms,
            model_thread=model_thread,
            metrics=metrics,
        )

    # -- the event-loop side -----------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_sequences(self) -> int:
        return len(self._running.jobs)

    @property
    def alive(self) -> bool:
        return self._worker is not None and not self._worker.done() and not self._stop

    def start(self) -> None:
        if self._worker is not None:
            return
        self._stop = False
        self._worker = self.model_thread.submit(self._work)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._worker is not None:
            with contextlib.suppress(TimeoutError):
                self._worker.result(timeout=30)
            self._worker = None
        if self._own_thread:  # end the thread; a fresh executor starts one only if started again
            self.model_thread.shutdown()
            self.model_thread = ModelThread()

    async def translate(
        self, sentences: list[str], *, beam_size: int = 5, n_best: int = 1, timeout_s: float | None = None
    ) -> list[SentenceResult]:
        """Translate ``sentences`` (one result each, in order) in the shared batch.

        Blank sentences give "" without model work. Raises ``QueueFull``, ``DeadlineExceeded`` or
        ``EngineStopped``. If the awaiting task is cancelled (the client went away), its sentences
        are dropped from the queue and from the running batch.
        """
        if not 1 <= n_best <= beam_size:
            raise ValueError(f"n_best must be between 1 and beam_size ({beam_size}), got {n_best}")
        results: list[SentenceResult | None] = [None] * len(sentences)
        todo = [i for i, s in enumerate(sentences) if s.strip()]
        for i in set(range(len(sentences))) - set(todo):
            results[i] = SentenceResult([""] * n_best, [0.0] * n_best)
        if todo:
            loop = asyncio.get_running_loop()
            deadline = time.monotonic() + timeout_s if timeout_s is not None else None
            ids = self.translator.tokenizer.encode([sentences[i] for i in todo])
            jobs = [
                Job(
                    s[: self.max_input_tokens] + [self.model.cfg.eos_id],
                    beam_size,
                    n_best,
                    loop.create_future(),
                    loop,
                    deadline,
                )
                for s in ids
            ]
            self._submit(jobs)
            try:
                async with asyncio.timeout(timeout_s):
                    done = [await j.future for j in jobs]
            except TimeoutError as e:
                self._withdraw(jobs)
                raise DeadlineExceeded(f"not translated within {timeout_s:g} s") from e
            except BaseException:  # cancelled (client gone) or failed: free the model for others
                self._withdraw(jobs)
                raise
            # Detokenized here, not on the model thread: that thread is the service's bottleneck.
            texts = self.translator.tokenizer.decode([h.tokens for hyps in done for h in hyps])
            start = 0
            for i, hyps in zip(todo, done, strict=True):
                results[i] = SentenceResult(texts[start : start + len(hyps)], [h.score for h in hyps])
                start += len(hyps)
        return [r for r in results if r is not None]

    def _submit(self, jobs: list[Job]) -> None:
        with self._cond:
            if not self.alive:
                raise EngineStopped("the translation engine is not running")
            if len(self._queue) + len(jobs) > self.max_queue:
                raise QueueFull(f"{len(self._queue)} sentences are waiting (limit {self.max_queue})")
            self._queue.extend(jobs)
            self.metrics.queue_depth.set(len(self._queue))
            self._cond.notify()

    def _withdraw(self, jobs: list[Job]) -> None:
        """Mark ``jobs`` as abandoned: the worker drops them at its next step."""
        for j in jobs:
            j.cancelled = True
            if not j.future.done():
                j.future.cancel()  # the worker's late answer, if any, is then ignored
            elif not j.future.cancelled():
                j.future.exception()  # mark an error nobody will await as seen (no asyncio warning)
        with self._cond:
            self._cond.notify()

    # -- the worker side ---------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        while not self._stop and not self._queue and not self._running.jobs:
                            self._cond.wait()
                        if self._stop:
                            break
                    try:
                        self._iteration()
                    except Exception as e:  # a failed step must not take the other requests down with it
                        log.exception("decoding step failed; failing the running batch")
                        failed = EngineError(f"translation failed: {e}")
                        resolve([(job, failed) for job in self._running.jobs])
                        self._running = Running()
        except BaseException as e:  # pragma: no cover - the loop itself broke
            self.failed = e
            log.exception("engine worker died")
        finally:
            stopped = EngineStopped("the translation engine stopped")
            resolve([(job, stopped) for job in [*self._running.jobs, *self._queue]])
            self._running = Running()
            self._queue.clear()

    def _iteration(self) -> None:
        """Admit, drop what nobody waits for, one decoding step, remove what finished."""
        run = self._running
        if self.mode == "continuous" or not run.jobs:
            if self.mode == "dynamic" and not run.jobs:
                self._collect()
            self._admit(self._take())
        self._drop_expired()
        run = self._running
        if not run.jobs:
            return
        assert run.tokens is not None
        self.metrics.batch_size.observe(run.rows)
        self.metrics.decode_steps.inc()
        self._steps_since_join += 1
        logits, cache = self.model.decode_step(run.tokens, run.cache.view())
        run.cache.advance(cache)
        jobs = list(range(len(run.jobs)))
        rows = run.row_index(jobs)  # logits rows in job order, as search_step reads them
        if rows != list(range(len(rows))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        keep, tokens = search_step(
            run.beams,
            logits,
            eos=self.model.cfg.eos_id,
            length_penalty=self.length_penalty,
            greedy_scores=False,
        )
        self._place(rows, keep, tokens)
        done = [i for i in jobs if run.beams[i].done]
        resolve([(run.jobs[i], self._finish(run.jobs[i], run.beams[i])) for i in done])
        if done:  # finished jobs leave at once: only the rows that take their places are copied
            run.keep_jobs([i for i in jobs if not run.beams[i].done])
        self.metrics.active_sequences.set(len(run.jobs))

    def _place(self, rows: list[int], keep: torch.Tensor | None, tokens: torch.Tensor) -> None:
        """Put ``search_step``'s result (``keep``/``tokens`` index ``rows``, every job's rows in job
        order) back into the running batch: beams reordered within their job's rows; finished jobs'
        rows are left alone (they leave right after)."""
        run = self._running
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

    def _collect(self) -> None:
        """Dynamic batching: wait up to ``max_wait_s`` for the queue to fill a batch."""
        end = time.monotonic() + self.max_wait_s
        with self._cond:
            while not self._stop and sum(j.beam_size for j in self._queue) < self.max_batch_size:
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    def _take(self) -> list[Job]:
        """Jobs from the head of the queue that fit beside the running batch (FIFO: a job that does
        not fit stops admission, so large requests are not starved by small ones)."""
        run = self._running
        rows = run.rows
        src_len = run.cache.width
        taken: list[Job] = []
        now = time.monotonic()
        with self._cond:
            # Newcomers are encoded as one batch, so while a batch runs they join in groups rather
            # than one or two at every step: once enough of them wait (JOIN_RATIO of the running
            # sentences, as TGI's waiting_served_ratio) or JOIN_WAIT_STEPS have passed.
            live = len(run.jobs)
            if live and len(self._queue) < JOIN_RATIO * live and self._steps_since_join < JOIN_WAIT_STEPS:
                return taken
            while self._queue:
                job = self._queue[0]
                if job.expired(now):
                    self._queue.popleft()
                    self.metrics.sentences.labels("abandoned").inc()
                    continue
                new_len = max(src_len, len(job.src))
                fits_rows = rows + job.beam_size <= self.max_batch_size
                fits_tokens = (rows + job.beam_size) * new_len <= self.max_batch_tokens
                if (taken or rows) and not (fits_rows and fits_tokens):
                    break
                self._queue.popleft()
                taken.append(job)
                rows, src_len = rows + job.beam_size, new_len
            self.metrics.queue_depth.set(len(self._queue))
        if taken:
            self._steps_since_join = 0
        return taken

    def _admit(self, jobs: list[Job]) -> None:
        """Encode ``jobs`` as one padded batch and append their rows to the running batch."""
        if not jobs:
            return
        now = time.monotonic()
        for job in jobs:
            self.metrics.queue_wait.observe(now - job.enqueued)
            self.metrics.input_tokens.inc(len(job.src))
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
        cache = self.model.start_cache(enc, capacity=initial_capacity(limits))
        if len(rows) > len(jobs):  # beams: k rows per job (with greedy only, no copy)
            cache = cache.index_select(rows)
        run = self._running
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
        """Remove jobs whose client is gone or whose deadline passed from the running batch."""
        run = self._running
        now = time.monotonic()
        expired = [j.expired(now) for j in run.jobs]
        if not any(expired):
            return
        gone = [j for j, e in zip(run.jobs, expired, strict=True) if e]
        resolve(
            [
                (j, EngineError("cancelled") if j.cancelled else DeadlineExceeded("deadline passed"))
                for j in gone
            ]
        )
        self.metrics.sentences.labels("abandoned").inc(len(gone))
        run.keep_jobs([i for i, e in enumerate(expired) if not e])

    def _finish(self, job: Job, beam: Beam) -> list[Hypothesis]:
        hyps = beam.best(job.n_best)
        self.metrics.generated_tokens.inc(len(hyps[0].tokens) + 1 if hyps else 0)
        self.metrics.sentences.labels("translated").inc()
        return hyps
