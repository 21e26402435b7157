"""A worker process opens each model's weights once for all its workers (threads):
``app.serving.worker.shared.SharedModels``, with the worker's own ``open_translator``. Each
worker's Translator has its own decoding step (a step writes its outputs: two threads must not
share one) on the same tensors; two workers opening one model at once read its weights once; and
a model no worker holds any more is read again when it is next opened."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import torch
from test_api import make_settings

from app.serving.protocol import ModelSpec
from app.serving.worker.models import open_translator, weight_bytes
from app.serving.worker.shared import SharedModels
from model.decoding.translator import Translator


def counting_opener(model_dir: Path) -> tuple[SharedModels, list[bool]]:
    """The process's ``SharedModels`` as a worker process makes it; ``reads``: one entry per open,
    True where it read the weights from disk."""
    settings = make_settings(model_dir, warmup=False)
    reads: list[bool] = []

    def opener(spec: ModelSpec, like: Translator | None) -> Translator:
        reads.append(like is None)
        return open_translator(settings, spec.path, like=like)

    return SharedModels(opener), reads


def storages(translator: Translator) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in translator.model.state_dict().values()}


def test_two_workers_of_a_process_decode_on_one_copy_of_the_weights_with_steps_of_their_own(
    model_dir: Path,
) -> None:
    shared, reads = counting_opener(model_dir)
    spec = ModelSpec("m", model_dir)
    first, second = shared.open(spec), shared.open(spec)
    assert reads == [True, False]  # read once
    assert second.model is first.model and storages(second) == storages(first)
    assert second.runner is not first.runner
    # Decoding on the shared weights: the same translations as a Translator of its own.
    own = Translator.load(model_dir, device="cpu")
    texts = ["Ein Hund läuft.", "Zwei Männer stehen draußen."]
    for t in (first, second):
        assert [r.hypotheses[0] for r in t.translate_batch(texts, beam_size=2)] == [
            r.hypotheses[0] for r in own.translate_batch(texts, beam_size=2)
        ]
    assert weight_bytes(second.model) == weight_bytes(own.model)


def test_workers_opening_one_model_at_once_read_its_weights_once(model_dir: Path) -> None:
    shared, reads = counting_opener(model_dir)
    spec = ModelSpec("m", model_dir)
    opened: list[Translator] = []
    threads = [threading.Thread(target=lambda: opened.append(shared.open(spec))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(reads) == [False, False, True]
    assert len({id(t.model) for t in opened}) == 1


def test_a_model_no_worker_holds_is_read_again_when_next_opened(model_dir: Path) -> None:
    shared, reads = counting_opener(model_dir)
    spec = ModelSpec("m", model_dir)
    held = shared.open(spec)
    assert shared.holding("m") is held
    del held  # every worker evicted it: its weights leave memory
    gc.collect()
    assert shared.holding("m") is None
    again = shared.open(spec)
    assert reads == [True, True] and isinstance(again.model, torch.nn.Module)
