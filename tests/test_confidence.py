"""A sentence's confidence (``model.decoding.confidence``): the signal (forced tokens left out), the
calibration's map and its file, the shipped models' files; a text's confidence from its sentences
(``app.translation.confidence``); and the benchmark's statistics (``benchmarks.confidence_stats``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from app.formats import PlainText
from app.serving.protocol import Confidence, SentenceResult
from app.translation.confidence import below_threshold, text_confidence, withhold
from benchmarks.common import DEFAULT_MODEL
from benchmarks.confidence_stats import auroc, ece, isotonic_points, spearman
from model.decoding.confidence import CONFIDENCE_FILE, DEFAULT, Calibration, free_log_probs, signal_values
from model.decoding.hypothesis import Hypothesis
from model.translator import Translator

REPO = Path(__file__).resolve().parents[1]


def test_forced_tokens_are_left_out_of_the_signal_and_eos_kept() -> None:
    lprobs = (-0.1, -5.0, -6.0, -0.3, -0.2)  # tokens 1 and 2 a forced term, then a token, then eos
    hyp = Hypothesis([4, 5, 6, 7], -1.0, sum(lprobs), ((1, 3, 0),), token_log_probs=lprobs)
    assert free_log_probs(hyp.token_log_probs, hyp.spans) == [-0.1, -0.3, -0.2]
    values = signal_values(hyp)
    assert values["mean_log_prob"] == pytest.approx(-0.2)
    assert values["min_log_prob"] == -0.3
    assert "gap" not in values  # no runner-up
    assert signal_values(hyp, Hypothesis([4], -1.5))["gap"] == pytest.approx(0.5)


def test_a_hypothesis_without_token_log_probs_has_no_confidence() -> None:
    assert DEFAULT.of(Hypothesis([4, 5], 0.0)) is None


def test_default_mapping_is_the_geometric_mean_token_probability() -> None:
    hyp = Hypothesis([4, 5], -1.0, -1.5, token_log_probs=(-0.5, -0.25, -0.75))
    assert DEFAULT.of(hyp) == pytest.approx(math.exp(-0.5), abs=1e-4)
    assert not DEFAULT.calibrated


def test_calibration_reads_linearly_between_points_and_flat_beyond() -> None:
    c = Calibration("mean_log_prob", ((-2.0, 0.1), (-1.0, 0.1), (-0.5, 0.6), (0.0, 0.9)), calibrated=True)
    assert c(-3.0) == 0.1 and c(1.0) == 0.9
    assert c(-1.5) == pytest.approx(0.1)
    assert c(-0.75) == pytest.approx(0.35)
    values = [c(x) for x in np.linspace(-3, 1, 81)]
    assert values == sorted(values)  # monotone


def test_calibration_file_round_trips_and_bad_files_are_refused(tmp_path: Path) -> None:
    c = Calibration("mean_log_prob", ((-1.0, 0.2), (-0.2, 0.9)), 50.0, True, {"fitted_on": "x"})
    (tmp_path / CONFIDENCE_FILE).write_text(json.dumps(c.to_json()))
    assert Calibration.load(tmp_path) == c
    assert Calibration.load(tmp_path / "elsewhere") is DEFAULT  # no file: the default
    for bad in (
        {"signal": "gap", "points": [[0, 0.5]]},  # needs a runner-up: not served
        {"signal": "mean_log_prob", "points": [[0, 0.5], [-1, 0.6]]},  # not increasing
        {"signal": "mean_log_prob", "points": [[0, 1.5]]},  # not a probability
        {"signal": "mean_log_prob", "points": []},
    ):
        (tmp_path / CONFIDENCE_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=CONFIDENCE_FILE):
            Calibration.load(tmp_path)


@pytest.mark.parametrize("model", ["multi30k-de-en", "multi30k-en-de"])
def test_shipped_models_have_a_small_monotone_calibration(model: str) -> None:
    path = REPO / "artifacts" / model / CONFIDENCE_FILE
    assert path.stat().st_size < 4096
    c = Calibration.load(path.parent)
    assert c.calibrated and c.signal == "mean_log_prob" and c.threshold == 50.0
    assert "val" in c.provenance["fitted_on"] and c.provenance["model"] == model
    ys = [y for _, y in c.points]
    assert ys == sorted(ys) and ys[0] < 0.5 < ys[-1]


def result(*values: float, tokens: tuple[tuple[str, float], ...] = ()) -> SentenceResult:
    hyps = tuple(Hypothesis([], 0.0, text=f"t{v}") for v in values)
    return SentenceResult(hyps, confidence=tuple(Confidence(v, tokens) for v in values))


def test_text_confidence_is_its_lowest_sentence_and_unscored_sentences_do_not_count() -> None:
    layouts = [
        PlainText("Ein Mann läuft. Eine Frau sitzt. Zwei Hunde spielen.").split("de"),
        PlainText("Ein Kind lacht.").split("de"),
    ]
    assert [len(layout.sentences) for layout in layouts] == [3, 1]
    results = [
        result(0.9, 0.4, tokens=(("▁A", 0.9),)),
        SentenceResult.of_texts(["memory"], memory=True),  # no confidence: not counted
        result(0.7, 0.8, tokens=(("▁C", 0.5),)),
        SentenceResult.of_texts(["x"], memory=True),
    ]
    low = below_threshold(results, 0.8)
    assert low == [False, False, True, False]
    found = text_confidence(layouts, results, 2, pieces=True, low=low, threshold=0.8, withheld=False)
    assert found[0].values == [0.7, 0.4]
    assert found[0].tokens == [("▁A", 0.9), ("▁C", 0.5)]
    assert found[0].below == 1 and not found[0].withheld
    assert found[1].values == [None, None] and found[1].below == 0


def test_withheld_sentences_are_empty_with_their_confidence_kept() -> None:
    results = [result(0.2, 0.3), result(0.9)]
    out = withhold(results, below_threshold(results, 0.5))
    assert [h.text for h in out[0].hypotheses] == ["", ""]
    assert out[0].confidence == results[0].confidence
    assert out[1] == results[1]


def test_isotonic_points_pool_adjacent_violators() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    y = np.array([0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    # (2, 3) violate: pooled at 0.5; the rest already increasing.
    assert isotonic_points(x, y) == [(1.0, 0.0), (2.0, 0.5), (3.0, 0.5), (4.0, 1.0), (6.0, 1.0)]
    ties = isotonic_points(np.array([1.0, 1.0, 2.0]), np.array([1.0, 0.0, 1.0]))
    assert ties == [(1.0, 0.5), (2.0, 1.0)]


def test_rank_statistics_on_known_cases() -> None:
    a = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(a, a**3) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert auroc(np.array([0.9, 0.8, 0.1, 0.2]), np.array([True, True, False, False])) == 1.0
    assert auroc(np.array([0.5, 0.5]), np.array([True, False])) == 0.5
    conf = np.array([0.95, 0.95, 0.15, 0.15])
    assert ece(conf, np.array([1.0, 1.0, 0.0, 0.0])) == pytest.approx(0.1)


def test_the_library_answers_a_calibrated_confidence_per_hypothesis() -> None:
    t = Translator.load(DEFAULT_MODEL, device="cpu")
    assert t.calibration == Calibration.load(DEFAULT_MODEL) and t.calibration.calibrated
    text = "Zwei Hunde spielen im Schnee."
    (result, blank) = t.translate_batch([text, " "], beam_size=4, n_best=2)
    hyps = t.generate(t.source_ids([text]), beam_size=4, n_best=2)[0]
    assert result.confidence == [t.calibration.of(h) for h in hyps]
    assert all(c is not None and 0.0 <= c <= 1.0 for c in result.confidence)
    assert blank.confidence == [None, None]
