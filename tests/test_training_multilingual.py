"""One model for several directions: a tiny multilingual model over de-en, en-de and de-fr of the
toy lexicon trains, is validated per direction, exports the serving contract (directions, target
tokens), and its target token decides the output language."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.checkpoint import read_info_and_tokenizer
from model.translator import Translator
from tests.corpora import LEXICON, REPO, tiny_config, write_corpus
from training import evaluate as evaluate_cli
from training.config import ConfigError, TrainConfig
from training.plot import plot_curve
from training.train import TrainResult, train

DIRECTIONS = ["de-en", "en-de", "de-fr"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), langs=("de", "en", "fr"))


@pytest.fixture(scope="module")
def multi(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainResult, Path]:
    out = tmp_path_factory.mktemp("run")
    cfg = tiny_config(corpus, epochs=8)
    cfg.data.directions = DIRECTIONS
    return train(cfg, out), out


def test_validation_is_logged_per_direction_and_plotted(multi: tuple[TrainResult, Path]) -> None:
    _, out = multi
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"]
    assert len(valid) == 8
    for r in valid:
        assert list(r["directions"]) == DIRECTIONS
        assert all({"valid_loss", "valid_bleu", "valid_chrf"} <= set(s) for s in r["directions"].values())
        mean = sum(s["valid_bleu"] for s in r["directions"].values()) / 3
        assert r["valid_bleu"] == pytest.approx(mean)
    for name in DIRECTIONS:  # every direction learns
        assert valid[-1]["directions"][name]["valid_loss"] < valid[0]["directions"][name]["valid_loss"] - 0.5
    labels = plot_curve(out / "train_log.jsonl", out / "curve.png")
    assert [f"valid BLEU {name}" for name in sorted(DIRECTIONS)] == [x for x in labels if "BLEU" in x]


def test_the_model_directory_carries_the_directions_and_target_tokens(
    multi: tuple[TrainResult, Path],
) -> None:
    result, out = multi
    info, tokenizer = read_info_and_tokenizer(out / "model")
    assert info.directions == [("de", "en"), ("en", "de"), ("de", "fr")]
    assert {lang: tokenizer.pieces(ids) for lang, ids in info.target_prefix.items()} == {
        "de": ["<2de>"],
        "en": ["<2en>"],
        "fr": ["<2fr>"],
    }
    assert info.training["train_pairs_per_direction"] == {name: 400 for name in DIRECTIONS}
    assert result.valid["directions"].keys() == set(DIRECTIONS)


def test_the_target_token_decides_the_output_language(multi: tuple[TrainResult, Path], corpus: Path) -> None:
    _, out = multi
    translator = Translator.load(out / "model", device="cpu")
    german = (corpus / "val.de").read_text().splitlines()[:10]
    english, french = {en for en, _ in LEXICON.values()}, {fr for _, fr in LEXICON.values()}
    for target, wanted, other in (("en", english, french), ("fr", french, english)):
        words = [
            w.strip(".").lower()
            for r in translator.translate_batch(german, target=target)
            for w in r.hypotheses[0].split()
        ]
        assert sum(w in wanted for w in words) > 3 * sum(w in other for w in words), (target, words)


def test_evaluate_cli_scores_each_direction(
    multi: tuple[TrainResult, Path], corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, out = multi
    model = ["--model", str(out / "model"), "--beam-size", "1"]
    assert evaluate_cli.main([*model, "--data-dir", str(corpus), "--split", "val", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert list(scores) == DIRECTIONS and all(s["sentences"] == 30 for s in scores.values())
    files = ["--src", str(corpus / "val.de"), "--ref", str(corpus / "val.fr")]
    assert evaluate_cli.main([*model, *files, "--direction", "de-fr", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bleu"] == pytest.approx(scores["de-fr"]["bleu"])
    assert evaluate_cli.main([*model, *files]) == 2
    assert "--direction says which of its directions" in capsys.readouterr().err
    assert evaluate_cli.main([*model, *files, "--direction", "fr-de"]) == 2
    assert "the model translates de-en, en-de, de-fr" in capsys.readouterr().err


def test_multi30k_multilingual_config_names_six_directions() -> None:
    cfg = TrainConfig.load(REPO / "training" / "configs" / "multi30k_multi.toml")
    assert cfg.data.multilingual and len(cfg.data.pairs) == 6
    assert {s for s, _ in cfg.data.pairs} == {"de", "en", "fr", "cs"}


@pytest.mark.parametrize(
    ("directions", "message"),
    [
        (["de-en", "de-en"], "listed twice"),
        (["de-de"], "two different languages"),
        (["deen"], "not 'source-target'"),
    ],
)
def test_bad_directions_are_refused(directions: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict({"data": {"directions": directions}})
