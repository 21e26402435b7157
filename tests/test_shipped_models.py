"""Every model directory shipped in artifacts/ translates a known sentence over HTTP, in each of its
directions, with its real weights (int8 as served on CPU; the eager step, to keep the suite fast:
tests/test_determinism.py shows the compiled step gives the same translations). A model added to
artifacts/ is picked up here; one in a language this file has no sentence for fails until it gets
one. Then the whole folder, as ``NMT_MODEL_DIR=artifacts`` serves it, lists every direction."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from model.checkpoint import CONFIG_FILE, read_info
from tests.test_api import make_settings, serve

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
SHIPPED = sorted(d for d in ARTIFACTS.iterdir() if (d / CONFIG_FILE).is_file())
CASES = [(d, source, target) for d in SHIPPED for source, target in read_info(d).directions]

# One sentence per source language, and for each target the words its translation must hold (one
# of each group, ignoring case): the man and the bicycle.
KNOWN = {
    "de": "Ein Mann fährt Fahrrad.",
    "en": "A man is riding a bike.",
    "fr": "Un homme fait du vélo.",
    "cs": "Muž jede na kole.",
}
EXPECTED = {
    "en": [("man",), ("bike", "bicycle", "cycle")],
    "de": [("mann",), ("fahrrad", "rad")],
    "fr": [("homme",), ("vélo", "bicyclette")],
    "cs": [("muž",), ("kole", "kolo")],
}


@pytest.fixture(scope="module")
def clients() -> Iterator[dict[Path, TestClient]]:
    """A server per shipped model directory, started when a test first asks for it."""
    with ExitStack() as stack:

        class Lazy(dict[Path, TestClient]):
            def __missing__(self, model_dir: Path) -> TestClient:
                client = stack.enter_context(serve(make_settings(model_dir, quantization="auto")))
                self[model_dir] = client
                return client

        yield Lazy()


def test_there_is_a_shipped_model() -> None:
    assert (ARTIFACTS / "multi30k-de-en") in SHIPPED


@pytest.mark.parametrize(
    ("model_dir", "source", "target"), CASES, ids=[f"{d.name}:{s}-{t}" for d, s, t in CASES]
)
def test_each_shipped_direction_translates_a_known_sentence(
    clients: dict[Path, TestClient], model_dir: Path, source: str, target: str
) -> None:
    assert source in KNOWN and target in EXPECTED, f"add a known sentence for {source}->{target}"
    response = clients[model_dir].post(
        "/translate", json={"q": KNOWN[source], "source": source, "target": target}
    )
    assert response.status_code == 200, response.text
    translation = response.json()["translatedText"]
    for words in EXPECTED[target]:
        assert any(word in translation.lower() for word in words), (translation, words)


def test_the_artifacts_folder_serves_every_shipped_direction() -> None:
    with serve(make_settings(ARTIFACTS, quantization="auto", warmup=False)) as client:
        info = client.get("/info").json()
        assert [m["name"] for m in info["models"]] == [d.name for d in SHIPPED]
        served = {(e["code"], t) for e in client.get("/languages").json() for t in e["targets"]}
        assert {(s, t) for _, s, t in CASES} <= served
