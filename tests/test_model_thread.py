"""All of the service's torch work runs on one thread: the model is loaded where it decodes, and the
event loop never runs an operator (OpenMP slows down once two threads start parallel work:
app/model_thread.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from fastapi.testclient import TestClient
from test_api import make_settings

import app.main
from app.main import create_app
from app.model_thread import ModelThread
from model.translator import Translator


def test_everything_submitted_runs_on_one_thread_in_order() -> None:
    model_thread = ModelThread(threads=1)
    try:
        seen: list[tuple[int, int]] = []
        record = [lambda i=i: seen.append((i, threading.get_ident())) for i in range(20)]
        futures = [model_thread.submit(f) for f in record]
        for f in futures:
            f.result(timeout=10)
        assert [i for i, _ in seen] == list(range(20))
        assert len({ident for _, ident in seen}) == 1
        assert seen[0][1] != threading.get_ident()
        assert model_thread.submit(torch.get_num_threads).result(timeout=10) == 1
    finally:
        model_thread.shutdown()


def test_the_service_loads_and_decodes_the_model_on_one_thread_not_the_event_loops(
    model_dir: Path,
) -> None:
    loaded_on: list[int] = []
    decoded_on: set[int] = set()
    load = app.main.load_translator

    def recording_load(settings: Any) -> Translator:
        loaded_on.append(threading.get_ident())
        translator = load(settings)
        step = translator.model.decode_step

        def recording_step(*args: Any, **kwargs: Any) -> Any:
            decoded_on.add(threading.get_ident())
            return step(*args, **kwargs)

        translator.model.decode_step = recording_step  # type: ignore[method-assign]
        return translator

    with (
        mock.patch.object(app.main, "load_translator", recording_load),
        TestClient(create_app(make_settings(model_dir))) as client,
    ):
        loop_thread = client.portal.call(threading.get_ident)  # type: ignore[union-attr]
        r = client.post("/translate", json={"q": "Ein Hund läuft.", "source": "de", "target": "en"})
        assert r.status_code == 200
    assert len(loaded_on) == 1
    assert decoded_on == set(loaded_on)  # warm-up and the request alike
    assert loop_thread not in decoded_on
