"""The model directory's contract for serving: ModelInfo.directions, source_prefix (the one place
that knows how a target is asked for), multilingual config.json, and the old directories
unchanged. Random weights and a tiny vocabulary: no training here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from model import translate as translate_cli
from model.checkpoint import (
    CONFIG_FILE,
    ModelDirError,
    ModelInfo,
    read_info,
    read_info_and_tokenizer,
    save_model_dir,
    source_prefix,
)
from model.tokenizer import EOS_ID, Tokenizer, target_token
from model.translator import Translator
from tests.conftest import random_model, synthetic_sentences

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "artifacts" / "multi30k-de-en"
DIRECTIONS = [("de", "en"), ("en", "de"), ("fr", "en")]


@pytest.fixture(scope="module")
def multi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A multilingual model directory: vocabulary with <2de>, <2en> control symbols, random weights."""
    tmp = tmp_path_factory.mktemp("multi")
    spm = Tokenizer.train(
        synthetic_sentences(400), tmp / "spm", vocab_size=120, control_symbols=["<2de>", "<2en>"]
    )
    tokenizer = Tokenizer(spm)
    model = random_model(seed=1, sharpen=2.0, eos_boost=1.5, vocab_size=tokenizer.vocab_size)
    prefix = {lang: [tokenizer.control_id(target_token(lang))] for lang in ("de", "en")}
    info = ModelInfo.multilingual(model.cfg, DIRECTIONS, prefix, {"note": "random weights"})  # type: ignore[arg-type]
    return save_model_dir(tmp / "model", model, info, spm)


def test_shipped_model_directory_reads_as_before_with_one_direction() -> None:
    info, _ = read_info_and_tokenizer(SHIPPED)
    assert not info.is_multilingual
    assert info.directions == [("de", "en")]
    assert source_prefix(info, None) == source_prefix(info, "en") == []
    with pytest.raises(ValueError, match="translates into 'en' only, not 'fr'"):
        source_prefix(info, "fr")
    # written back, a bilingual directory's config.json is what it was: no new keys, format 1
    assert info.to_json() == json.loads((SHIPPED / CONFIG_FILE).read_text())


def test_multilingual_config_json_lists_directions_and_target_prefix(multi_dir: Path) -> None:
    data = json.loads((multi_dir / CONFIG_FILE).read_text())
    assert data["format"] == 2
    assert data["directions"] == ["de-en", "en-de", "fr-en"]
    assert (data["source_lang"], data["target_lang"]) == ("mul", "mul")
    info, tokenizer = read_info_and_tokenizer(multi_dir)
    assert info.is_multilingual and info.directions == DIRECTIONS
    assert data["target_prefix"] == {"de": [4], "en": [5]}  # control symbols right after the specials
    assert tokenizer.pieces([4, 5]) == ["<2de>", "<2en>"]
    assert source_prefix(info, "en") == [5]
    for bad, message in ((None, "needs a target language"), ("fr", "not one this model translates into")):
        with pytest.raises(ValueError, match=message):
            source_prefix(info, bad)


def test_translator_puts_the_target_token_first_and_needs_a_target(multi_dir: Path) -> None:
    translator = Translator.load(multi_dir, device="cpu")
    ids = translator.source_ids(["Ein Hund läuft."], target="de")
    assert ids[0][0] == 4 and ids[0][-1] == EOS_ID
    assert ids[0][1:] == translator.source_ids(["Ein Hund läuft."], target="en")[0][1:]
    # typed text never becomes a control symbol: a user cannot switch the target from the input
    assert 4 not in translator.tokenizer.encode(["<2de> Ein Hund"])[0]
    with pytest.raises(ValueError, match="needs a target language"):
        translator.translate_batch(["Ein Hund läuft."])
    with pytest.raises(ValueError, match="needs a target language"):
        translator.translate_batch([""])  # even when there is nothing to translate
    de = translator.translate_batch(["Ein Hund läuft.", "Zwei Kinder spielen."], target="de", beam_size=2)
    en = translator.translate_batch(["Ein Hund läuft.", "Zwei Kinder spielen."], target="en", beam_size=2)
    assert [r.scores for r in de] != [r.scores for r in en]  # the token reaches the model


def test_config_and_vocabulary_must_agree_on_the_target_tokens(multi_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(multi_dir, tmp_path / "m"))
    data = json.loads((broken / CONFIG_FILE).read_text())
    data["target_prefix"] = {"de": [5], "en": [4]}  # swapped
    (broken / CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(ModelDirError, match="target_prefix of 'de'"):
        read_info_and_tokenizer(broken)
    data["target_prefix"] = {"de": [4]}  # en-de has no way to ask for en
    (broken / CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(ModelDirError, match="no target_prefix for 'en'"):
        read_info(broken)
    data["format"] = 3
    (broken / CONFIG_FILE).write_text(json.dumps(data))
    with pytest.raises(ModelDirError, match="format 3 is newer"):
        read_info(broken)


def test_translate_cli_takes_a_target_for_a_multilingual_model(
    multi_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("Ein Hund läuft.\n\nZwei Kinder.\n")
    assert translate_cli.main(["--model", str(multi_dir), "--input", str(src), "--no-progress"]) == 2
    assert "--target: a multilingual model needs a target language" in capsys.readouterr().err
    out = tmp_path / "out.txt"
    args = ["--model", str(multi_dir), "--input", str(src), "--output", str(out), "--no-progress"]
    assert translate_cli.main([*args, "--target", "en", "--beam-size", "1"]) == 0
    lines = out.read_text().split("\n")
    assert len(lines) == 4 and lines[1] == ""  # three lines in, three out (the blank one blank)
    assert translate_cli.main([*args, "--target", "cs"]) == 2
    assert "not one this model translates into" in capsys.readouterr().err
