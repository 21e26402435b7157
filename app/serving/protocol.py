"""What crosses the pipe between the front end and a model worker: one frozen class per message.

Both rooms import this module and a few torch-free shared ones (``errors``, ``cores``,
``fairqueue``, and the app's ``config`` and ``metrics``); the front end (``app.serving.frontend``)
runs no torch, the worker (``app.serving.worker``) runs nothing of HTTP, and neither imports the
other: the front end starts the worker's process by the name of its entry point
(``frontend.handle.WORKER_ENTRY``). Messages are pickled with ``pickle`` itself
(``send``) and read with ``Connection.recv``; each side dispatches on the class (``match``), so a
message the other side cannot send does not type-check. Times are ``time.monotonic()``: one clock
for every process of the machine.

front end -> worker (``ToWorker``):

- ``Translate``: sentences to add to the worker's inbox, in the order the scheduler chose;
- ``Cancel``: sentences nobody waits for any more (withdrawn, past their deadline);
- ``Stop``: finish, the front end is draining.

worker -> front end (``FromWorker``):

- ``Ready``: the models it loads at start are loaded and warm, and what they run on;
- ``StartFailed``: it could not start, and why (the front end's start-up fails with the reason);
- ``Answers``: after each decoding step that finished sentences, each one ``Done`` or ``Failed``;
- ``Loaded``: the models it holds now, after it loaded or evicted one (the scheduler prefers a
  worker that holds a sentence's model).

Every worker serves every model (``ModelSpec``s, given when it starts); a ``Sentence`` names its
model, and the worker loads it on demand when it does not hold it (``app.serving.worker.models``).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from model.decoding.hypothesis import Hypothesis

# Where the best text put each term: (term index, start, end) in characters, end exclusive, in
# text order (the response's terminology, ``app.terminology.terms.text_terminology``).
Placed = tuple[tuple[int, int, int], ...]
# A sentence's constraints: target token-id sequences (no bos/eos) its translation must contain.
Constraints = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class Confidence:
    """A hypothesis's confidence (``model.decoding.confidence``), written by the front end from the
    token log-probs the worker sent: ``value`` in [0, 1], the model's calibration of its mean
    token log-prob; ``tokens`` (when asked for) each shown piece of its translation with the
    probability the model gave it, in order (eos and an output prefix's tokens not listed)."""

    value: float
    tokens: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True, slots=True)
class SentenceResult:
    """A sentence's answer, from the worker to the response (as CTranslate2's
    ``TranslationResult``): its n-best, best first; where the best text put the sentence's terms;
    and whether the translation memory answered it instead of a model."""

    hypotheses: tuple[Hypothesis, ...]
    placed: Placed = ()
    memory: bool = False  # the memory's text (then the only hypothesis, with no tokens)
    # Each hypothesis's, written by the front end where the search kept token log-probs (every
    # beam; greedy when asked, ``Sentence.scored``): () for a memory's or a blank sentence.
    confidence: tuple[Confidence, ...] = ()

    @property
    def texts(self) -> list[str]:
        return [h.text for h in self.hypotheses]

    @classmethod
    def of_texts(cls, texts: Sequence[str], *, memory: bool = False) -> SentenceResult:
        """An answer no model decoded: a blank sentence's (``[""] * n_best``), the memory's."""
        return cls(tuple(Hypothesis([], 0.0, text=text) for text in texts), memory=memory)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model the workers serve: its directory, and its name for the scheduler, jobs and metrics."""

    name: str
    path: Path


@dataclass(frozen=True, slots=True)
class ModelDescription:
    """What a worker runs, as it reports it when ready (for /info and the model metric)."""

    device: str
    dtype: str
    quantization: str
    decoding: str = "eager"  # or "compiled": the step runner it chose (model.runtime.runners)
    compile_seconds: float = 0.0  # how long compiling the decoding step took at start-up
    # When a worker loads it: "at start" (before it is ready), "after start" (in the background,
    # once ready; a sentence that comes first waits for the load), or "on first request" (it did
    # not fit in the worker's budget beside those).
    loaded: str = "at start"
    load_seconds: float = 0.0  # loading it (weights, step, warm-up) in a worker, when measured
    weight_bytes: int = 0  # what its loaded weights take in a worker (packed copies included)


@dataclass(frozen=True, slots=True)
class Sentence:
    """One sentence for a worker to translate: the scheduler's unit of work, and the worker's."""

    id: int  # unique in the front end's scheduler: both sides' name for the sentence
    request: int  # the request it belongs to: the worker's inbox takes requests in turn
    src: list[int]  # source token ids, eos included
    beam_size: int
    n_best: int
    deadline: float | None  # past it, nobody waits for the answer
    enqueued: float  # when the front end admitted it (the queue-wait metric)
    model: str = ""  # the ``ModelSpec.name`` that translates it ("": a worker's only model)
    # Terminology (``app.terminology``): ``beam_size`` is already the beam they need
    # (``model.decoding.constraints.beam_for``).
    constraints: Constraints = ()
    # A document job's (``app.jobs``): it fills what typed requests leave of a worker's batch
    # (``app.serving.worker.inbox.Inbox``), never the other way round.
    background: bool = False
    # Its token log-probs asked for (a request's confidence): greedy rows then ask the step for
    # their candidates; beams keep them anyway (``model.decoding.batch.Source.scored``).
    scored: bool = False

    def past_deadline(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline


# -- front end -> worker ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Translate:
    sentences: tuple[Sentence, ...]


@dataclass(frozen=True, slots=True)
class Cancel:
    ids: tuple[int, ...]  # ``Sentence.id``s


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Load:
    """Load ``model`` now, before any of its sentences come: the front end spreads a hot model to
    this worker once it holds it (``Loaded``), so that no sentence waits for the load."""

    model: str


ToWorker = Translate | Cancel | Stop | Load


# -- worker -> front end ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ready:
    # Each model it loaded at start, by name (the first); the others load on demand.
    models: tuple[tuple[str, ModelDescription], ...]
    queued: tuple[str, ...] = ()  # those it loads next, in the background ("after start")


@dataclass(frozen=True, slots=True)
class StartFailed:
    reason: str  # the exception, "Type: message": it names the file or setting at fault


@dataclass(frozen=True, slots=True)
class Done:
    id: int
    result: SentenceResult  # its hypotheses' texts are the front end's to write


@dataclass(frozen=True, slots=True)
class Failed:
    id: int
    reason: str


@dataclass(frozen=True, slots=True)
class Answers:
    results: tuple[Done | Failed, ...]


@dataclass(frozen=True, slots=True)
class Loaded:
    models: tuple[str, ...]  # the models the worker holds now, least recently used first


FromWorker = Ready | StartFailed | Answers | Loaded


def send(conn: Connection, message: ToWorker | FromWorker) -> None:
    """Write ``message`` to the pipe, pickled with ``pickle`` itself rather than
    ``Connection.send``'s ForkingPickler: a third less CPU per message (no reducer table to copy);
    the other side's ``recv()`` reads either. Raises what the pipe raises (OSError, ValueError)."""
    conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
