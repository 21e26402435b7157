"""One translation of a sentence, from the search to the caller: what the search found (its tokens,
score and log-probability, each token's log-probability, where it realised the sentence's
constraints) and, once written, its text. The library's ``Translator``, the service's worker (it
sends these to the front end: ``app.serving.protocol.SentenceResult``) and the front end
(``app.models.served.ServedModel.render`` writes the text, and the confidence, and drops the
tokens) use this one class. Torch-free: the front end imports it."""

from __future__ import annotations

from dataclasses import dataclass

# (start, end, constraint index) where each constraint was realised in ``tokens``, end exclusive, in
# the order they were met; empty without constraints.
Spans = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class Hypothesis:
    tokens: list[int]  # generated ids, without bos and eos (the front end drops them once written)
    score: float  # sum of token log-probs (eos included) / length**length_penalty
    log_prob: float = 0.0  # sum of token log-probs, eos included
    spans: Spans = ()
    text: str = ""  # written by the front end (``ServedModel.render``); "" before
    # The log-prob the search gave each token of ``tokens`` (an output prefix's: 0.0, as the score
    # counts nothing for it), then eos's (0.0 where the hypothesis ended without one: every
    # candidate banned), from the step's own values, no second pass: len(tokens) + 1 values whose
    # sum is ``log_prob`` (to float rounding). Empty where the search kept no log-probs (the
    # service's unscored greedy rows, ``Search.greedy_scores``, for a sentence that asked none).
    token_log_probs: tuple[float, ...] = ()
