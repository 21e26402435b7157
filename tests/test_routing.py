"""Routing without a server: which model serves a pair (the first listed), pivots through English,
what /languages and the error messages make of the routes, and the forms NMT_MODEL_DIR takes."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.models.served import find_model_dirs, model_names
from app.serving.frontend.router import Router
from app.translation.codes import languages, source_languages, supported_pairs, target_languages
from model.checkpoint import ModelDirError, ModelInfo
from tests.conftest import tiny_config


@dataclass(frozen=True, eq=False)
class Model:
    name: str
    info: ModelInfo


def bilingual(name: str, source: str, target: str) -> Model:
    return Model(name, ModelInfo(tiny_config(), source, target))


def multilingual(name: str, *directions: str) -> Model:
    pairs = [(d[:2], d[3:]) for d in directions]
    prefix = {t: [4 + i] for i, t in enumerate(dict.fromkeys(t for _, t in pairs))}
    return Model(name, ModelInfo.multilingual(tiny_config(), pairs, prefix))


def test_direct_routes_go_to_the_first_model_that_serves_the_pair() -> None:
    de_en, en_de = bilingual("de-en", "de", "en"), bilingual("en-de", "en", "de")
    multi = multilingual("multi", "de-en", "en-fr", "fr-en")
    router = Router([de_en, en_de, multi])
    assert router.pairs[:4] == [("de", "en"), ("en", "de"), ("en", "fr"), ("fr", "en")]
    route = router.route("de", "en")
    assert route is not None and [h.model for h in route.hops] == [de_en] and route.pivot is None
    route = router.route("EN", "Fr")  # codes without regard to case
    assert route is not None and [(h.model, h.target) for h in route.hops] == [(multi, "fr")]
    # The other order: the multilingual model listed first serves de-en.
    assert [h.model for h in Router([multi, de_en]).route("de", "en").hops] == [multi]  # type: ignore[union-attr]


def test_a_pair_without_a_model_goes_through_english() -> None:
    de_en, en_de = bilingual("de-en", "de", "en"), bilingual("en-de", "en", "de")
    fr_en, en_cs = bilingual("fr-en", "fr", "en"), bilingual("en-cs", "en", "cs")
    router = Router([de_en, en_de, fr_en, en_cs])
    route = router.route("fr", "de")
    assert route is not None and route.pivot == "en"
    assert [(h.model, h.source, h.target) for h in route.hops] == [(fr_en, "fr", "en"), (en_de, "en", "de")]
    assert route.describe() == "fr->de (via en)"
    assert {(r.source, r.target) for r in router.pivots} == {("de", "cs"), ("fr", "de"), ("fr", "cs")}
    assert router.route("de", "de") is None  # never a round trip
    assert router.route("cs", "en") is None  # nothing translates from Czech
    assert router.route("de", "xx") is None


def test_no_pivot_where_a_model_serves_the_pair_or_without_english() -> None:
    multi = multilingual("multi", "de-fr", "de-en", "en-fr")
    router = Router([multi, bilingual("fr-cs", "fr", "cs")])
    assert router.route("de", "fr").pivot is None  # type: ignore[union-attr]
    assert router.route("de", "cs") is None  # de->fr->cs would pivot through French: not done
    assert router.pivots == []


def test_languages_list_every_route_with_pivot_targets() -> None:
    router = Router(
        [bilingual("de-en", "de", "en"), bilingual("en-fr", "en", "fr"), bilingual("cs-en", "cs", "en")]
    )
    assert languages(router) == [
        {"code": "de", "name": "German", "targets": ["en", "fr"]},
        {"code": "en", "name": "English", "targets": ["fr"]},
        {"code": "fr", "name": "French", "targets": []},
        {"code": "cs", "name": "Czech", "targets": ["en", "fr"]},
    ]
    assert source_languages(router) == ["de", "en", "cs"]
    assert source_languages(router, "en") == ["de", "cs"]  # what "auto" chooses among for English
    assert source_languages(router, "fr") == ["en", "de", "cs"]
    assert target_languages(router) == ["en", "fr"]
    assert supported_pairs(router) == "de->en, en->fr, cs->en, de->fr (via en), cs->fr (via en)"


def test_model_dir_takes_a_list_in_the_environment_and_in_code(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NMT_")}
    with mock.patch.dict(os.environ, {**clean, "NMT_MODEL_DIR": "a/de-en, b/en-de,"}, clear=True):
        assert Settings().model_dir == (Path("a/de-en"), Path("b/en-de"))
    with mock.patch.dict(os.environ, clean, clear=True):
        assert Settings(model_dir=tmp_path).model_dir == (tmp_path,)  # type: ignore[arg-type]
        assert Settings().model_dir == (Path("artifacts"),)  # every shipped model
        with pytest.raises(ValidationError, match="no model directory given"):
            Settings(model_dir=" , ")  # type: ignore[arg-type]


def test_a_directory_of_model_directories_serves_each_of_them(model_dir: Path, tmp_path: Path) -> None:
    shelf = tmp_path / "artifacts"
    for name in ("b-model", "a-model"):
        shutil.copytree(model_dir, shelf / name)
    (shelf / "not-a-model").mkdir()  # no config.json: skipped
    (shelf / "README.md").write_text("models")
    assert find_model_dirs([shelf]) == [shelf / "a-model", shelf / "b-model"]
    # A list mixes both forms, keeps its order, and names a directory once.
    assert find_model_dirs([model_dir, shelf, shelf / "a-model"]) == [
        model_dir,
        shelf / "a-model",
        shelf / "b-model",
    ]
    assert find_model_dirs([tmp_path / "missing"]) == [tmp_path / "missing"]  # named by its config.json later
    with pytest.raises(ModelDirError, match="no model directory in it"):
        find_model_dirs([shelf / "not-a-model"])


def test_model_names_are_unique() -> None:
    dirs = [Path("artifacts/multi30k-de-en"), Path("runs/de-en/model"), Path("runs/en-de/model")]
    assert model_names(dirs) == ["multi30k-de-en", "de-en/model", "en-de/model"]
    assert model_names([Path("x/a/m"), Path("y/a/m")]) == ["a/m#0", "a/m#1"]
