"""The load benchmarks' server (benchmarks/load.py ``serve``) cannot be fooled by the segment cache:
off unless a benchmark turns it on, and a run whose server answered any sentence from it fails."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from benchmarks.load import CacheHit, Server, metric, serve

SENTENCE = "Ein Hund läuft im Park."


def translate(server: Server, text: str) -> None:
    body = json.dumps({"q": text, "source": "de", "target": "en", "beam_size": 1}).encode()
    request = urllib.request.Request(
        f"{server.url}/translate", body, {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def settings(model_dir: Path, **more: str) -> dict[str, str]:
    return {"NMT_MODEL_DIR": str(model_dir), "NMT_COMPILE": "false", "NMT_WARMUP": "false", **more}


def test_the_cache_is_off_and_a_sentence_sent_twice_is_decoded_twice(model_dir: Path, tmp_path: Path) -> None:
    with serve(settings(model_dir), tmp_path / "server.log") as server:
        translate(server, SENTENCE)
        translate(server, SENTENCE)
        assert metric(server, "nmt_segment_cache_hits_total") == 0
        assert metric(server, "nmt_sentences_total") == 2  # both decoded


def test_a_run_whose_server_answered_from_the_cache_fails(model_dir: Path, tmp_path: Path) -> None:
    cached = settings(model_dir, NMT_SEGMENT_CACHE_MB="16")
    with (
        pytest.raises(CacheHit, match="1 sentences from its segment cache"),
        serve(cached, tmp_path / "server.log") as server,
    ):
        translate(server, SENTENCE)
        translate(server, SENTENCE)  # answered from the cache
