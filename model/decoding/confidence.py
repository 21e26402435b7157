"""A translation's confidence: a number in [0, 1] from the log-probs the search gave its tokens
(``Hypothesis.token_log_probs``), mapped through a calibration fitted per model on held-out parallel
data so that it estimates a stated probability: that the sentence's chrF against a reference
translation is at least ``Calibration.threshold`` (50).

The signal is the sentence's mean token log-prob (eos included; tokens a glossary forced left out:
the model did not choose them, and a forced term it finds unlikely says little about the rest),
chosen by ``benchmarks.confidence`` among the mean, the minimum and the gap to the runner-up
hypothesis: it ranks sentences by chrF best on both shipped models and needs no second hypothesis.
The mapping is isotonic regression's (monotone: a higher signal never lowers the confidence),
kept as its steps' points in the model directory's ``confidence.json`` and read linearly between
them. A model without the file gets ``DEFAULT``: the geometric-mean token probability
(exp of the mean log-prob), a number in [0, 1] that ranks as well but is not calibrated
(``calibrated`` is False; BENCHMARKS.md measures how far it is off on the shipped models).

Torch-free and numpy-free: the front end computes it from what the worker sends."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.decoding.hypothesis import Hypothesis, Spans

CONFIDENCE_FILE = "confidence.json"
SIGNALS = ("mean_log_prob", "min_log_prob", "gap")


def free_log_probs(token_log_probs: Sequence[float], spans: Spans = ()) -> list[float]:
    """The log-probs of the tokens the model chose: those inside a met constraint's span (a
    glossary's term, forced) left out; eos, the last, always kept. Empty without log-probs."""
    if not spans:
        return list(token_log_probs)
    forced = {i for start, end, _ in spans for i in range(start, end)}
    return [lp for i, lp in enumerate(token_log_probs) if i not in forced]


def signal_values(hyp: Hypothesis, runner_up: Hypothesis | None = None) -> dict[str, float]:
    """Every candidate signal of ``hyp`` (``SIGNALS``; ``gap`` only with a runner-up: the
    difference of their length-normalized scores). Empty without token log-probs."""
    free = free_log_probs(hyp.token_log_probs, hyp.spans)
    if not free:
        return {}
    values = {"mean_log_prob": sum(free) / len(free), "min_log_prob": min(free)}
    if runner_up is not None:
        values["gap"] = hyp.score - runner_up.score
    return values


@dataclass(frozen=True)
class Calibration:
    """A monotone map from a signal to a probability: ``points`` (signal, probability), signal
    increasing, read linearly between them and flat beyond; ``calibrated`` False for ``DEFAULT``,
    which maps the mean log-prob to exp(mean), the geometric-mean token probability."""

    signal: str = "mean_log_prob"
    points: tuple[tuple[float, float], ...] = ()
    threshold: float = 50.0  # what it estimates: P(sentence chrF >= threshold)
    calibrated: bool = False
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)

    def __call__(self, value: float) -> float:
        if not self.points:  # DEFAULT: the geometric-mean token probability
            return min(1.0, max(0.0, math.exp(value)))
        xs = [x for x, _ in self.points]
        at = bisect.bisect_right(xs, value)
        if at == 0:
            return self.points[0][1]
        if at == len(xs):
            return self.points[-1][1]
        (x0, y0), (x1, y1) = self.points[at - 1], self.points[at]
        return y0 if x1 == x0 else y0 + (y1 - y0) * (value - x0) / (x1 - x0)

    def of(self, hyp: Hypothesis, runner_up: Hypothesis | None = None) -> float | None:
        """``hyp``'s confidence; None where it has no token log-probs (or no runner-up for a
        ``gap`` calibration)."""
        value = signal_values(hyp, runner_up).get(self.signal)
        return None if value is None else round(self(value), 4)

    def to_json(self) -> dict[str, Any]:
        return {
            "signal": self.signal,
            "estimates": f"P(sentence chrF >= {self.threshold:g})",
            "threshold": self.threshold,
            "method": "isotonic regression, read linearly between its steps",
            "points": [[round(x, 5), round(y, 5)] for x, y in self.points],
            "provenance": self.provenance,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        """Raises ValueError for a file that is not one (an unknown signal, unordered points,
        probabilities outside [0, 1])."""
        signal = data.get("signal")
        if signal not in ("mean_log_prob", "min_log_prob"):  # (gap needs n-best 2: not served)
            raise ValueError(f"unknown confidence signal {signal!r}")
        points = tuple((float(x), float(y)) for x, y in data["points"])
        if not points or any(b[0] < a[0] for a, b in zip(points, points[1:], strict=False)):
            raise ValueError("calibration points must be given in increasing order of the signal")
        if any(not 0.0 <= y <= 1.0 for _, y in points):
            raise ValueError("calibration probabilities must lie in [0, 1]")
        return cls(signal, points, float(data.get("threshold", 50.0)), True, dict(data.get("provenance", {})))

    @classmethod
    def load(cls, model_dir: str | Path) -> Calibration:
        """The model directory's ``confidence.json``, else ``DEFAULT``."""
        path = Path(model_dir) / CONFIDENCE_FILE
        if not path.is_file():
            return DEFAULT
        try:
            return cls.from_json(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from exc


DEFAULT = Calibration()
