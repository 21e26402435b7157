"""A worker's running batches, one per model it is translating: when sentences join and leave
them (the scheduler decided their order), and which model steps next.

Continuous (iteration-level) batching for the encoder-decoder: before every decoding step, waiting
sentences are encoded and join the running batch, and after every step, sentences that finished
leave it and their results go back at once. The batch itself, how a step runs and which tokens it
chooses are ``model.decoding.batch.RunningBatch``'s, the same driver the library and the CLI use:
this module adds what a service needs around it (admission within the batch limits, cancellation
and deadlines, metrics, and a failed step failing only the running sentences). Everything here
runs on one thread, the one that loads the models (``app.serving.worker.process``).

Several models: each model with sentences in this worker has a running batch of its own (a
``Lane``), and the models step in turn, one step each, round-robin over those with rows running
or sentences waiting, so that every model progresses whatever the others' backlogs. A model not
held yet is loaded at its turn (``app.serving.worker.models.ModelTable``: the other models wait for the
load). A lane whose batch empties is kept for ``KEEP_EMPTY_S``, so that the next sentence for its
model decodes into a cache whose pages are mapped already (a new cache's page faults cost a lone
beam-5 sentence ~1 ms on our 2-vCPU AMD EPYC, avx512_vnni), then dropped with its cache, as every
empty one is when the worker goes idle (``drop_empty``): an idle model holds its weights, not a
cache. ``max_batch_size`` bounds the rows of all the running batches together (the memory of their
caches and the time of a round), except that a model with no rows running always takes one
sentence: no model waits for another model's batch to drain.

Document jobs (``HeldSentence.background``): a model's document sentences run in a batch of their own, a
second lane, which steps only when the model has no typed sentence running or waiting, or one step in
``BACKGROUND_EVERY`` when it has (a step of a full batch of documents costs several typed steps:
1 in 8 slowed a lone typed line 2.3x, 1 in 32 1.8x): a typed line never decodes beside a
document's rows, and a document still moves under a steady stream of them. Each kind's batches
hold ``max_batch_size`` rows at most (the documents' cache waits, held, while typed steps run).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from app.config import Settings
from app.monitoring.metrics import Metrics
from app.serving.protocol import SentenceResult
from app.serving.worker.held import HeldSentence
from app.serving.worker.models import LoadedModel, ModelTable
from model.decoding.batch import JOIN_RATIO, JOIN_WAIT_STEPS, RunningBatch, Source
from model.decoding.search import Hypothesis

# How long a lane whose batch emptied keeps its cache for the next sentence of its model.
KEEP_EMPTY_S = 1.0

log = logging.getLogger(__name__)

__all__ = [
    "BACKGROUND_EVERY",
    "JOIN_RATIO",
    "JOIN_WAIT_STEPS",
    "Executor",
    "SentenceSource",
    "Lane",
    "Outcome",
]

BACKGROUND_EVERY = 32  # with typed sentences running, a document's batch steps once in this many


class SentenceSource(Protocol):
    """Where sentences wait to join a batch, one queue per model (``app.serving.worker.inbox.Inbox``)."""

    @property
    def waiting(self) -> int: ...  # every model's

    def waiting_for(self, model: str, background: bool | None = None) -> int: ...  # None: both kinds

    def take(
        self, fits: Callable[[HeldSentence], bool], model: str = "", background: bool = False
    ) -> list[HeldSentence]: ...

    # The sentence left the batch; False if nobody waits for it.
    def release(self, sentence: HeldSentence) -> bool: ...

    @property
    def loads(self) -> bool: ...  # models asked to be loaded (``protocol.Load``) not taken yet

    def take_loads(self) -> list[str]: ...


# What one iteration produced: finished sentences with their result, and sentences that failed.
Outcome = tuple[HeldSentence, SentenceResult | BaseException]


class Lane:
    """One model's running batch in this worker, and its metrics."""

    def __init__(self, model: LoadedModel, metrics: Metrics | None, background: bool = False) -> None:
        translator = model.translator
        self.model = model
        self.metrics = metrics
        self.background = background  # document jobs' sentences
        # Room for the largest batch, or for one input's beams; greedy hypotheses' scores are not
        # returned by the service, so greedy rows skip the normalisation.
        self.running: RunningBatch[HeldSentence] = RunningBatch(
            translator.model,
            translator.runner,
            capacity=translator.capacity,
            options=translator.options,
            greedy_scores=False,
            # A completed term is never glued to the next piece ("fangen" + "de"), as in the library.
            word_continuations=translator.tokenizer.word_continuations(),
        )
        self.joining: list[HeldSentence] = []  # taken from the source, being encoded into the batch
        self.emptied: float | None = None  # time.monotonic() when its batch last emptied
        # Forced at the start of every output of this model (an Argos package's target_prefix).
        self.prefix = tuple(translator.info.output_prefix)

    @property
    def name(self) -> str:
        return self.model.name


class Executor:
    def __init__(
        self,
        models: ModelTable,
        source: SentenceSource,
        *,
        max_batch_size: int = 64,
        max_batch_tokens: int = 8192,
        metrics: Metrics | None = None,
    ) -> None:
        """
        Args:
            models: the models, loaded or loaded on demand, each with its decoding step (eager or
                compiled, chosen when it was loaded) and its ``DecodeOptions`` (a sentence's beam size
                and n-best are its own).
            max_batch_size: rows (sequences, each beam counted) in the running batches, all models
                together (a model with none running takes one sentence however many rows).
            max_batch_tokens: padded source tokens x rows in a model's running batch (bounds the
                cross-attention of a step).
            metrics: the process's metrics; each model records with its ``model`` label.
        """
        self.models = models
        self.source = source
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        self.lanes: dict[tuple[str, bool], Lane] = {}  # (model, background): the running batches
        self._turns = deque(models.names)  # round-robin: the model at the left steps next
        self._shared = 0  # steps taken while both kinds had work (one in BACKGROUND_EVERY: a sentence's)

    @classmethod
    def from_settings(
        cls, models: ModelTable, source: SentenceSource, settings: Settings, *, metrics: Metrics | None
    ) -> Executor:
        return cls(
            models,
            source,
            max_batch_size=settings.max_batch_size,
            max_batch_tokens=settings.max_batch_tokens,
            metrics=metrics,
        )

    @property
    def busy(self) -> bool:
        """Some batch is running."""
        return any(len(lane.running) for lane in self.lanes.values())

    def runnable(self) -> bool:
        """An iteration has something to do: a batch is running, sentences wait for a model that
        is not being loaded (one whose model loads waits for the load, not for a step), or the
        loader finished a load (the worker then holds it, and tells the front end)."""
        loader = self.models.loader
        return (
            self.busy
            or self.source.loads
            or (loader is not None and loader.finished)
            or any(self.source.waiting_for(n) and not self.models.loading(n) for n in self.models.names)
        )

    def rows(self, background: bool = False) -> int:
        """Rows running, every model's typed (or document) ones."""
        return sum(lane.running.rows for lane in self.lanes.values() if lane.background == background)

    @property
    def running(self) -> RunningBatch[HeldSentence]:
        """The running batch of a worker's only model (tests, benchmarks)."""
        [name] = self.models.names
        lane = self.lane(name)
        assert lane is not None, "its model is loading"
        return lane.running

    def lane(self, name: str, background: bool = False) -> Lane | None:
        """``name``'s lane (of typed sentences, or of documents'), made if it has none; None while
        its model loads (``ModelTable.begin``: on the worker's loader, or here without one)."""
        lane = self.lanes.get((name, background))
        if lane is None:
            model = self._begin(name)
            if model is None:
                return None
            bound = self.metrics.of_model(name) if self.metrics is not None else None
            lane = self.lanes[name, background] = Lane(model, bound, background)
        else:
            self.models.get(name)  # (most recently used)
        return lane

    def _begin(self, name: str, *, waited: bool = True) -> LoadedModel | None:
        """``ModelTable.begin`` with the models of the lanes as busy; a model to be loaded first
        drops the emptied lanes (a model kept for its emptied batch only may make room)."""
        if name not in self.models.loaded:
            self.drop_empty()
        return self.models.begin(name, busy={n for n, _ in self.lanes}, waited=waited)

    def _has_work(self, name: str, background: bool) -> bool:
        lane = self.lanes.get((name, background))
        return (lane is not None and len(lane.running) > 0) or self.source.waiting_for(name, background) > 0

    def _kind(self, name: str) -> bool:
        """Which of ``name``'s batches steps now: the documents' only without typed work, or at
        its turn of ``BACKGROUND_EVERY``."""
        typed, background = self._has_work(name, False), self._has_work(name, True)
        if typed and background:
            self._shared += 1
            return self._shared % BACKGROUND_EVERY == 0
        return background

    def _next(self) -> str | None:
        """The next model in turn with rows running or sentences waiting; None when there is none.
        (One being loaded takes its turn too: its load is asked for again, before those loaded
        ahead of need.)"""
        for _ in range(len(self._turns)):
            name = self._turns[0]
            self._turns.rotate(-1)
            if self._has_work(name, False) or self._has_work(name, True):
                return name
        return None

    def _fail_waiting(self, name: str, error: BaseException) -> list[Outcome]:
        """Every sentence waiting for ``name`` fails with ``error`` (its model could not be loaded;
        the table or its loader logged why, once per try)."""
        failed = RuntimeError(f"cannot load model {name}: {type(error).__name__}: {error}")
        sentences = [s for kind in (False, True) for s in self.source.take(lambda sentence: True, name, kind)]
        return [(sentence, failed) for sentence in sentences]

    def iteration(self) -> list[Outcome]:
        """One step of the next model in turn: admit its newcomers, drop what nobody waits for, one
        decoding step, remove what finished. A failed step fails that model's running sentences (and
        only those) instead of raising; a model that cannot be loaded fails its waiting sentences."""
        # Loads the front end asked for (no sentence waits for them: ``protocol.Load``), begun at
        # once; loads the worker's loader finished: the models join, or their sentences fail.
        for asked in self.source.take_loads():
            if asked in self.models.names:
                self._begin(asked, waited=False)
        failures = [o for name, error in self.models.collect() for o in self._fail_waiting(name, error)]
        name = self._next()
        if name is None:
            return failures
        background = self._kind(name)
        key = (name, background)
        if key not in self.lanes:
            try:
                if self.lane(name, background) is None:
                    return failures  # loading: the other models step meanwhile
            except Exception as e:  # its weights, its step: every sentence for it fails with the reason
                return failures + self._fail_waiting(name, e)  # (logged by the table, once per try)
        lane = self.lanes[key]
        try:
            outcomes = failures + self._iteration(lane)
        except Exception as e:  # a failed step must not take the worker down with it
            log.exception("decoding step failed; failing the running batch of %s", name)
            failed = RuntimeError(f"translation failed: {e}")
            sentences = [e.key for e in lane.running.entries]
            sentences += [j for j in lane.joining if j not in sentences]
            self.lanes.pop(key)
            self._gauge(lane, 0)
            return failures + [(sentence, failed) for sentence in sentences]
        now = time.monotonic()
        if len(lane.running) or self.source.waiting_for(name, background):
            lane.emptied = None
        elif lane.emptied is None:
            lane.emptied = now
        self.drop_empty(now - KEEP_EMPTY_S)
        return outcomes

    def drop_empty(self, emptied_by: float = float("inf")) -> None:
        """Drop the lanes whose batch emptied by ``emptied_by`` (``time.monotonic()``; by default
        every empty one: the worker is idle) and nobody waits for: their caches go, their models'
        weights stay (until ``ModelTable.trim``)."""
        gone = [
            key
            for key, lane in self.lanes.items()
            if lane.emptied is not None and lane.emptied <= emptied_by and not self.source.waiting_for(*key)
        ]
        for key in gone:
            del self.lanes[key]
        if gone:
            self.models.trim(busy={n for n, _ in self.lanes})

    def _iteration(self, lane: Lane) -> list[Outcome]:
        lane.joining = self._take(lane)
        self._admit(lane.joining, lane)
        lane.joining = []
        self._drop_expired(lane)
        run = lane.running
        if not len(run):
            self._gauge(lane)
            return []
        rows = run.rows
        outcomes: list[Outcome] = [
            (sentence, self._finish(sentence, hyps, lane)) for sentence, hyps in run.step()
        ]
        if lane.metrics is not None:
            lane.metrics.batch_size.observe(rows)
            lane.metrics.decode_steps.inc()
        self._gauge(lane)
        return outcomes

    def _gauge(self, lane: Lane, value: int | None = None) -> None:
        if lane.metrics is not None:
            lane.metrics.active_sequences.set(len(lane.running) if value is None else value)

    def _take(self, lane: Lane) -> list[HeldSentence]:
        """Waiting sentences of the lane's model that fit beside the running batches, in the scheduler's
        order."""
        run = lane.running
        # Newcomers are encoded as one batch, so while a batch runs they join in groups rather than
        # one or two at every step.
        if not run.joins_now(self.source.waiting_for(lane.name, lane.background)):
            return []
        others = self.rows(lane.background) - run.rows  # the other models' rows (of this kind)
        rows, width = run.rows, run.width
        capacity = lane.model.translator.capacity

        def fits(sentence: HeldSentence) -> bool:
            nonlocal rows, width
            new_width = max(width, len(sentence.src))
            new_rows = rows + sentence.beam_size
            if rows and (
                new_rows > capacity
                or others + new_rows > self.max_batch_size
                or new_rows * new_width > self.max_batch_tokens
            ):
                return False  # an empty batch takes any one sentence, however large
            rows, width = new_rows, new_width
            return True

        return self.source.take(fits, lane.name, lane.background)

    def _admit(self, sentences: list[HeldSentence], lane: Lane) -> None:
        """Encode ``sentences`` as one padded batch and add their rows to the lane's running batch."""
        if not sentences:
            return
        if lane.metrics is not None:
            now = time.monotonic()
            for sentence in sentences:
                lane.metrics.queue_wait.observe(now - sentence.enqueued)
            lane.metrics.input_tokens.inc(sum(len(j.src) for j in sentences))
        lane.running.add(
            [
                Source(
                    sentence,
                    sentence.src,
                    sentence.beam_size,
                    sentence.n_best,
                    sentence.constraints,
                    lane.prefix,
                    scored=sentence.scored,
                )
                for sentence in sentences
            ]
        )

    def _drop_expired(self, lane: Lane) -> None:
        """Remove sentences whose request was cancelled or whose deadline passed from the running batch."""
        now = time.monotonic()
        dropped = lane.running.drop(lambda sentence: sentence.expired(now))
        for sentence in dropped:
            self.source.release(sentence)
        if dropped and lane.metrics is not None:
            lane.metrics.sentences.labels("abandoned").inc(len(dropped))

    def _finish(self, sentence: HeldSentence, hyps: list[Hypothesis], lane: Lane) -> SentenceResult:
        if lane.metrics is not None:
            lane.metrics.generated_tokens.inc(len(hyps[0].tokens) + 1 if hyps else 0)
            lane.metrics.sentences.labels("translated").inc()
        return SentenceResult(tuple(hyps))
