"""A sentence in a worker's hands: the inbox holds it until a batch takes it, the executor runs
it. One class for both, so that a sentence has one name in the worker."""

from __future__ import annotations

from app.serving.protocol import Sentence


class HeldSentence:
    """A ``Sentence`` in this worker's hands: as the inbox holds it, and the executor runs it. The
    message is frozen, and ``cancelled`` is set here when the front end withdraws it, so that the
    executor drops it at its next step even while it runs."""

    __slots__ = (
        "message",
        "id",
        "model",
        "src",
        "beam_size",
        "n_best",
        "enqueued",
        "constraints",
        "cancelled",
        "background",
        "scored",
    )

    def __init__(self, sentence: Sentence) -> None:
        self.message = sentence
        self.id, self.model, self.src, self.beam_size = (
            sentence.id,
            sentence.model,
            sentence.src,
            sentence.beam_size,
        )
        self.n_best, self.enqueued, self.constraints = (
            sentence.n_best,
            sentence.enqueued,
            sentence.constraints,
        )
        self.cancelled = False
        self.background = sentence.background
        self.scored = sentence.scored

    def expired(self, now: float) -> bool:
        return self.cancelled or self.message.past_deadline(now)
