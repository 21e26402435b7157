"""A worker's inbox: the sentences the front end gave it and the executor has not taken into a
batch yet. The pipe's reader thread adds and cancels (``app.serving.worker.process``); the model
thread's executor takes (``app.serving.worker.executor``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from app.monitoring.metrics import Metrics
from app.serving.fairqueue import FairQueue
from app.serving.protocol import Sentence
from app.serving.worker.held import HeldSentence


class Inbox:
    """The sentences given to this worker and not taken into a batch yet, a queue per model, each in
    the order the front end's scheduler uses (``app.serving.fairqueue``, round-robin over
    requests): the front end gives a worker up to two batches ahead, and a one-line request given
    after a document must still join before the rest of the document. The pipe's reader thread
    adds and cancels; the model thread takes. ``metrics``: the process's (each model's label).

    Document jobs' sentences (``Sentence.background``) wait in queues of their own, for the
    executor's batches of documents (``app.serving.worker.executor``: they step only when no typed
    sentence runs or waits, or one step in ``BACKGROUND_EVERY``)."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics
        self._queues: dict[str, FairQueue[HeldSentence]] = {}  # by model
        self._background: dict[str, FairQueue[HeldSentence]] = {}  # by model: document jobs'
        self._size = 0  # sentences in the queues
        self._rows = 0  # rows of the sentences in the queues
        self._by_id: dict[int, HeldSentence] = {}  # every sentence given and not finished
        self._loads: list[str] = []  # models the front end asked to load (``Load``), not begun yet
        self._cond = threading.Condition()
        self._stopping = False

    def add(self, sentences: Sequence[Sentence]) -> None:
        with self._cond:
            by_request: dict[tuple[str, int], list[HeldSentence]] = {}
            for sentence in sentences:
                held = self._by_id[sentence.id] = HeldSentence(sentence)
                by_request.setdefault((sentence.model, sentence.request), []).append(held)
            for (model, rid), mine in by_request.items():
                background = mine[0].background
                queues = self._background if background else self._queues
                queues.setdefault(model, FairQueue()).push(rid, mine)
            self._size += len(sentences)
            self._rows += sum(j.beam_size for j in sentences)
            self._cond.notify()

    def cancel(self, ids: Iterable[int]) -> None:
        """Drop these sentences: waiting ones when they come up, running ones at the executor's next step."""
        with self._cond:
            for sid in ids:
                sentence = self._by_id.pop(sid, None)
                if sentence is not None:
                    sentence.cancelled = True
            self._cond.notify()

    def release(self, sentence: HeldSentence) -> bool:
        """Forget a sentence that left the batch; False if it had been cancelled (nobody waits for it)."""
        with self._cond:
            return self._by_id.pop(sentence.id, None) is not None

    def load(self, model: str) -> None:
        """The front end asks for ``model`` to be loaded (``protocol.Load``)."""
        with self._cond:
            self._loads.append(model)
            self._cond.notify()

    def take_loads(self) -> list[str]:
        """The models asked for since the last call."""
        with self._cond:
            loads, self._loads = self._loads, []
            return loads

    @property
    def loads(self) -> bool:
        """Models were asked for and not taken yet."""
        return bool(self._loads)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- what the executor uses ------------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        """Sentences waiting, every model's."""
        return self._size

    def waiting_for(self, model: str, background: bool | None = None) -> int:
        """``model``'s sentences waiting: typed ones, documents' (``background``), or both (None)."""
        kinds = (False, True) if background is None else (background,)
        queues = [(self._background if kind else self._queues).get(model) for kind in kinds]
        return sum(len(q) for q in queues if q is not None)

    def wait(self, busy: Callable[[], bool]) -> bool:
        """Block until sentences wait or ``busy()`` (a batch is running); False once stopping."""
        return self.wait_until(lambda: self._size > 0 or busy())

    def wait_until(self, runnable: Callable[[], bool]) -> bool:
        """Block until ``runnable()`` (checked when sentences come, are cancelled, or ``wake`` is
        called: the executor's, which a model being loaded does not satisfy); False once stopping."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or runnable())
            return not self._stopping

    def wake(self) -> None:
        """Look again at what ``wait_until`` waits for (the loader finished a load)."""
        with self._cond:
            self._cond.notify_all()

    def quiet(self, seconds: float) -> bool:
        """Whether ``seconds`` pass with no sentence arriving and no stop (returns early otherwise)."""
        with self._cond:
            return not self._cond.wait_for(lambda: self._stopping or self._size > 0, seconds)

    def wait_for_more(self, rows: int, timeout: float) -> None:
        """Block until ``rows`` rows' worth of sentences wait, for at most ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._rows >= rows, timeout)

    def take(
        self, fits: Callable[[HeldSentence], bool], model: str = "", background: bool = False
    ) -> list[HeldSentence]:
        """``model``'s sentences (typed ones, or documents') in the queue's order for as long as
        ``fits(sentence)``; cancelled or expired ones are dropped on the way."""
        taken: list[HeldSentence] = []
        now = time.monotonic()
        with self._cond:
            queue = (self._background if background else self._queues).get(model)
            while queue is not None and (sentence := queue.peek()) is not None:
                if sentence.expired(now):
                    self._pop(queue)
                    self._by_id.pop(sentence.id, None)
                    if self.metrics is not None:
                        self.metrics.sentences.labels(sentence.model, "abandoned").inc()
                    continue
                if not fits(sentence):
                    break
                taken.append(self._pop(queue))
        return taken

    def _pop(self, queue: FairQueue[HeldSentence]) -> HeldSentence:
        sentence = queue.pop()
        self._size -= 1
        self._rows -= sentence.beam_size
        return sentence
