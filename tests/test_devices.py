"""The decoding path on every device this machine has: the CPU always, CUDA where torch sees a GPU.

The parametrization costs nothing without a GPU (the CPU cases are cheap and run everywhere); on a
GPU machine ``pytest tests/test_devices.py`` runs the CUDA path: weights and cache on the device,
the search's bookkeeping on it, reduced precision, and the step that the service compiles there
(CUDA graphs, model.runtime.graphs; the CPU's compiled package is covered by tests/test_runners.py).

References are independent of the device under test: the CPU's float32 translation of the same
weights, and the same translator decoding each sentence alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import compile_cache_dir

from model.decoding.translator import Translator

# Devices to run on: the list, not a skip, decides, so a machine without CUDA reports no skipped
# CUDA cases (CI has none) and a GPU machine runs them all.
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
GPUS = [d for d in DEVICES if d != "cpu"]

TEXTS = [
    "Ein Mann spielt.",
    "Zwei kleinen Kinder sitzen auf dem roten Ball vor einem großen Gebäude im Park mit Hut.",
    "Eine Katze",
    "Der Hund läuft im Wasser und schaut auf die Straße.",
    "Ein",
    "Eine Frau mit Hut steht vor dem Gebäude.",
]


def tokens(results: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [r.tokens[0] for r in results]


@pytest.fixture(scope="module")
def cpu_reference(model_dir: Path) -> dict[int, list[list[int]]]:
    """The CPU's float32 translations (greedy and beam 3), eager, without prepacking: the plainest
    arithmetic of the weights, to hold every device's translations to."""
    t = Translator.load(model_dir, device="cpu", prepack=False)
    return {beam: tokens(t.translate_batch(TEXTS, beam_size=beam)) for beam in (1, 3)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam", [1, 3], ids=["greedy", "beam3"])
def test_float32_translations_on_each_device_equal_the_cpus(
    model_dir: Path, cpu_reference: dict[int, list[list[int]]], device: str, beam: int
) -> None:
    """Same weights, float32 on every device: the same tokens (the test model's logits are sharp,
    so float rounding between devices never meets a near-tie; TF32 would, and is off by default)."""
    t = Translator.load(model_dir, device=device)
    assert t.model.device.type == device
    assert tokens(t.translate_batch(TEXTS, beam_size=beam)) == cpu_reference[beam]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_answer_per_input_on_each_device(model_dir: Path, device: str, dtype: str) -> None:
    """A sentence decoded among neighbours of other lengths gets the tokens it gets alone, on every
    device and precision the service offers there (what "one answer per input" promises users):
    batch shapes must not change the arithmetic a row sees."""
    t = Translator.load(model_dir, device=device, dtype=dtype)
    for beam in (1, 3):
        together = tokens(t.translate_batch(TEXTS, beam_size=beam))
        alone = [tokens(t.translate_batch([text], beam_size=beam))[0] for text in TEXTS]
        assert together == alone, f"beam {beam}"


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_logits_are_float32s_to_bfloat16_rounding(model_dir: Path, device: str) -> None:
    """Teacher-forced logits of the same weights in bfloat16 and float32 on the device: relative
    error of the whole logit matrix under 2e-2 (bfloat16 keeps 8 bits of mantissa; a layout or
    cast error would be off by far more), and no NaN."""
    full = Translator.load(model_dir, device=device, prepack=False).model
    half = Translator.load(model_dir, device=device, dtype="bfloat16").model
    g = torch.Generator().manual_seed(0)
    vocab = full.cfg.vocab_size
    src = torch.randint(4, vocab, (3, 11), generator=g).to(device)
    tgt = torch.randint(4, vocab, (3, 7), generator=g).to(device)
    tgt[:, 0] = full.cfg.bos_id
    with torch.inference_mode():
        want = full(src, tgt).double()
        got = half(src, tgt).double()
    assert torch.isfinite(got).all()
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.parametrize("device", GPUS or ["cpu"])
def test_the_compiled_step_translates_as_the_eager_one_on_each_device(
    model_dir: Path, device: str, cpu_reference: dict[int, list[list[int]]]
) -> None:
    """The step the service compiles on this device (CUDA graphs on a GPU, the AOT package on the
    CPU) gives the eager step's translations, in a batch and one sentence at a time (graphs of one
    row and of several); a second call replays the graphs the first captured."""
    t = Translator.load(model_dir, device=device, compile=True, cache_dir=compile_cache_dir())
    assert t.runner.kind == ("graphs" if device == "cuda" else "compiled")
    for beam in (1, 3):
        assert tokens(t.translate_batch(TEXTS, beam_size=beam)) == cpu_reference[beam], f"beam {beam}"
        alone = [tokens(t.translate_batch([text], beam_size=beam))[0] for text in TEXTS]
        assert alone == cpu_reference[beam], f"beam {beam}, one at a time"
