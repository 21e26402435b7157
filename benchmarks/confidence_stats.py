"""The statistics of ``benchmarks.confidence``, in numpy (no scipy or scikit-learn in the locked
set): isotonic regression by pool-adjacent-violators, rank correlation, AUROC, calibration error."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]


def isotonic_points(x: Array, y: Array) -> list[tuple[float, float]]:
    """Isotonic (non-decreasing) regression of ``y`` on ``x`` by pool-adjacent-violators: its
    steps as (signal, probability) points, each block's first and last signal at the block's mean
    (``model.decoding.confidence.Calibration`` reads linearly between them). Ties in ``x`` pool
    first, so that equal signals get one value."""
    order = np.argsort(x, kind="stable")
    xs, ys = x[order], y[order]
    # One block per distinct x: [x_first, x_last, sum of y, count].
    blocks: list[list[float]] = []
    for xv, yv in zip(xs.tolist(), ys.tolist(), strict=True):
        if blocks and blocks[-1][1] == xv:
            blocks[-1][2] += yv
            blocks[-1][3] += 1
        else:
            blocks.append([xv, xv, yv, 1.0])
        while len(blocks) > 1 and blocks[-2][2] / blocks[-2][3] >= blocks[-1][2] / blocks[-1][3]:
            merged = blocks.pop()
            blocks[-1][1] = merged[1]
            blocks[-1][2] += merged[2]
            blocks[-1][3] += merged[3]
    points: list[tuple[float, float]] = []
    for first, last, total, count in blocks:
        mean = total / count
        points.append((first, mean))
        if last != first:
            points.append((last, mean))
    return points


def ranks(a: Array) -> Array:
    """Ranks from 1, ties given their mean rank."""
    order = np.argsort(a, kind="stable")
    sorted_a = a[order]
    r = np.empty(len(a), dtype=np.float64)
    i = 0
    while i < len(a):
        j = i
        while j + 1 < len(a) and sorted_a[j + 1] == sorted_a[i]:
            j += 1
        r[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return r


def spearman(a: Array, b: Array) -> float:
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def auroc(scores: Array, positive: NDArray[np.bool_]) -> float:
    """The probability that a positive scores above a negative (ties half): Mann-Whitney's U."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if not n_pos or not n_neg:
        return float("nan")
    r = ranks(scores)
    return float((r[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def ece(confidence: Array, outcome: Array, bins: int = 10) -> float:
    """Expected calibration error: over ``bins`` equal-width bins of confidence, the mean of
    |mean confidence - observed frequency|, weighted by the bins' shares of the sentences."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(confidence, edges[1:-1]), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += mask.mean() * abs(confidence[mask].mean() - outcome[mask].mean())
    return float(total)
