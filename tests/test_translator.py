"""Translator: text in, text out, through a model directory; batching must not change results."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from model.checkpoint import (
    CONFIG_FILE,
    SPM_FILE,
    WEIGHTS_FILE,
    ModelDirError,
    ModelInfo,
    load_model,
    read_info,
    save_model_dir,
)
from model.translator import TranslationResult, Translator
from tests.conftest import random_model


def translate_one_by_one(
    translator: Translator, texts: list[str], **kwargs: object
) -> list[TranslationResult]:
    return [translator.translate_batch([t], **kwargs)[0] for t in texts]  # type: ignore[arg-type]


def assert_same_results(a: list[TranslationResult], b: list[TranslationResult]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.tokens == y.tokens, f"input {i}"
        assert x.hypotheses == y.hypotheses, f"input {i}"
        assert x.scores == pytest.approx(y.scores, abs=1e-4), f"input {i}"


def with_capacity(translator: Translator, rows: int) -> Translator:
    t = translator
    return Translator(t.model, t.tokenizer, t.info, t.device, options=t.options, capacity=rows)


@pytest.mark.parametrize("rows", [64, 6], ids=["one-batch", "rows-of-6"])
@pytest.mark.parametrize("beam_size", [1, 3], ids=["greedy", "beam"])
def test_batch_translation_equals_one_by_one(
    sentences: list[str], translator: Translator, beam_size: int, rows: int
) -> None:
    """Sentences of very different lengths decoded together (all at once, or a few rows at a time
    as rows free up) translate exactly as they do alone, and come back in input order."""
    batched = with_capacity(translator, rows).translate_batch(sentences, beam_size=beam_size)
    alone = translate_one_by_one(translator, sentences, beam_size=beam_size)
    assert_same_results(batched, alone)
    # The test means something only if the outputs differ between inputs.
    assert len({tuple(r.tokens[0]) for r in alone}) == len(sentences)


def test_results_follow_input_order(sentences: list[str], translator: Translator) -> None:
    texts = sentences + sentences[::-1]
    results = with_capacity(translator, 6).translate_batch(texts, beam_size=2)
    forward, backward = results[: len(sentences)], results[len(sentences) :]
    assert_same_results(forward, backward[::-1])


def test_n_best(sentences: list[str], translator: Translator) -> None:
    results = translator.translate_batch([sentences[0], "", sentences[3]], beam_size=4, n_best=3)
    for r in results:
        assert len(r.hypotheses) == len(r.scores) == len(r.tokens) == 3
        assert r.scores == sorted(r.scores, reverse=True)
    assert len({tuple(t) for t in results[0].tokens}) == 3
    assert results[1].hypotheses == ["", "", ""]
    # The best of the n-best is the 1-best.
    assert results[0].tokens[0] == translator.translate_batch([sentences[0]], beam_size=4)[0].tokens[0]
    with pytest.raises(ValueError, match="n_best"):
        translator.translate_batch(["x"], beam_size=2, n_best=3)


def test_blank_input_needs_no_model_work(
    sentences: list[str], translator: Translator, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[list[int]]] = []
    generate = translator.generate

    def spy(sources: list[list[int]], *args: object, **kwargs: object) -> object:
        calls.append(sources)
        return generate(sources, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(translator, "generate", spy)
    results = translator.translate_batch(["", "   ", "\t"], beam_size=3)
    assert [r.hypotheses for r in results] == [[""], [""], [""]]
    assert [r.tokens for r in results] == [[[]], [[]], [[]]]
    assert calls == []
    assert translator.translate_batch([]) == []
    assert calls == []

    results = translator.translate_batch(["", sentences[0], " "], beam_size=3)
    assert len(calls) == 1 and len(calls[0]) == 1  # only the non-blank sentence reached the model
    assert results[0].hypotheses == results[2].hypotheses == [""]
    monkeypatch.undo()
    assert_same_results(results[1:2], translator.translate_batch([sentences[0]], beam_size=3))


def test_long_input_is_truncated_to_model_positions(sentences: list[str], translator: Translator) -> None:
    long_text = " ".join(sentences * 20)
    (ids,) = translator.source_ids([long_text])
    assert len(ids) == translator.model.cfg.max_positions and ids[-1] == 3
    short = translator.options.but(beam_size=1, max_output_tokens=8)
    assert len(translator.translate_batch([long_text], options=short)[0].tokens[0]) <= 7


def state_dicts_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_save_load_round_trip(
    sentences: list[str], translator: Translator, model_dir: Path, tmp_path: Path
) -> None:
    whole = Translator.load(model_dir, device="cpu", prepack=False)  # every weight as trained
    out = save_model_dir(tmp_path / "copy", whole.model, whole.info, whole.tokenizer.path)
    loaded = Translator.load(out, device="cpu")
    assert state_dicts_equal(Translator.load(out, device="cpu", prepack=False).model, whole.model)
    assert not any(isinstance(m, torch.nn.Dropout) for m in loaded.model.modules())  # inference only
    assert read_info(out) == translator.info
    for beam_size in (1, 3):
        assert_same_results(
            loaded.translate_batch(sentences, beam_size=beam_size),
            translator.translate_batch(sentences, beam_size=beam_size),
        )


@pytest.mark.parametrize(
    "overrides",
    [{}, {"positions": "learned"}, {"tie_output": False}],
    ids=["sinusoidal-tied", "learned-positions", "untied"],
)
def test_a_loaded_model_holds_every_saved_weight_and_its_own_position_table(
    spm_model: Path, tmp_path: Path, overrides: dict[str, object]
) -> None:
    """``load_model`` builds the model without drawing its weights: every parameter and buffer is the
    saved model's, bit for bit (the sinusoidal table, which the file does not hold, too), on the
    CPU, and trainable (fine-tuning starts from it)."""
    model = random_model(seed=7, **overrides)
    info = ModelInfo(model.cfg, "de", "en")
    out = save_model_dir(tmp_path / "m", model, info, spm_model)
    loaded = load_model(out, info)
    mine, theirs = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) and theirs[k].requires_grad for k in mine)
    mine_b, theirs_b = dict(model.named_buffers()), dict(loaded.named_buffers())
    assert mine_b.keys() == theirs_b.keys() and all(torch.equal(mine_b[k], theirs_b[k]) for k in mine_b)
    assert not any(t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])


def test_a_model_loaded_to_translate_refuses_to_be_saved(translator: Translator, tmp_path: Path) -> None:
    """Its linear layers keep their prepared weights only: saving it would write a partial model."""
    with pytest.raises(ValueError, match="prepared to translate"):
        save_model_dir(tmp_path / "partial", translator.model, translator.info, translator.tokenizer.path)
    assert not (tmp_path / "partial").exists()


def test_float16_weights_load_as_float32(
    sentences: list[str], translator: Translator, model_dir: Path, tmp_path: Path
) -> None:
    whole = Translator.load(model_dir, device="cpu", prepack=False)
    out = save_model_dir(
        tmp_path / "half", whole.model, whole.info, whole.tokenizer.path, dtype=torch.float16
    )
    with safe_open(str(out / WEIGHTS_FILE), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # noqa: SIM118 - not a dict
    assert (out / WEIGHTS_FILE).stat().st_size < 0.6 * (model_dir / WEIGHTS_FILE).stat().st_size

    loaded = Translator.load(out, device="cpu")
    assert loaded.dtype == torch.float32
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    original = whole.model.state_dict()
    for name, value in Translator.load(out, device="cpu", prepack=False).model.state_dict().items():
        assert torch.equal(value, original[name].half().float()), name
    assert len(loaded.translate_batch(sentences, beam_size=2)) == len(sentences)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_compute(sentences: list[str], model_dir: Path, dtype: str) -> None:
    loaded = Translator.load(model_dir, device="cpu", dtype=dtype)
    assert loaded.dtype == getattr(torch, dtype)
    results = loaded.translate_batch(["", *sentences[:3]], beam_size=2)
    assert len(results) == 4 and results[0].hypotheses == [""]
    assert all(len(r.tokens[0]) > 0 for r in results[1:])


# -- broken model directories ----------------------------------------------------------------------


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_config(**changes: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        data = json.loads((d / CONFIG_FILE).read_text())
        data["model"].update(changes)
        (d / CONFIG_FILE).write_text(json.dumps(data))

    return edit


BREAKAGES: dict[str, tuple[Callable[[Path], object], str]] = {
    "config-missing": (lambda d: (d / CONFIG_FILE).unlink(), CONFIG_FILE),
    "weights-missing": (lambda d: (d / WEIGHTS_FILE).unlink(), WEIGHTS_FILE),
    "spm-missing": (lambda d: (d / SPM_FILE).unlink(), SPM_FILE),
    "weights-truncated": (lambda d: _truncate(d / WEIGHTS_FILE), WEIGHTS_FILE),
    "weights-garbage": (lambda d: (d / WEIGHTS_FILE).write_bytes(b"\x00garbage\xff" * 1000), WEIGHTS_FILE),
    "weights-empty": (lambda d: (d / WEIGHTS_FILE).write_bytes(b""), WEIGHTS_FILE),
    "config-malformed-json": (lambda d: (d / CONFIG_FILE).write_text('{"model": {"d_model": 3'), CONFIG_FILE),
    "config-not-utf8": (lambda d: (d / CONFIG_FILE).write_bytes(b'{"model": "\xff\xfe"}'), CONFIG_FILE),
    "config-no-model-key": (lambda d: (d / CONFIG_FILE).write_text('{"source_lang": "de"}'), CONFIG_FILE),
    "config-unknown-key": (_edit_config(n_experts=8), CONFIG_FILE),
    "config-bad-heads": (_edit_config(n_heads=5), CONFIG_FILE),
    "config-shape-mismatch": (_edit_config(d_ff=128), WEIGHTS_FILE),
    "spm-garbage": (lambda d: (d / SPM_FILE).write_bytes(b"not a sentencepiece model"), SPM_FILE),
    "vocab-mismatch": (_edit_config(vocab_size=999), SPM_FILE),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_broken_model_dir_raises_model_dir_error_naming_the_file(model_dir_copy: Path, breakage: str) -> None:
    damage, file_name = BREAKAGES[breakage]
    damage(model_dir_copy)
    with pytest.raises(ModelDirError, match=re.escape(file_name)):
        Translator.load(model_dir_copy, device="cpu")


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match=CONFIG_FILE):
        Translator.load(tmp_path / "nope", device="cpu")


def test_intact_copy_loads(sentences: list[str], model_dir_copy: Path) -> None:
    """The control for the breakage tests: the undamaged copy loads."""
    assert Translator.load(model_dir_copy, device="cpu").translate_batch([sentences[0]], beam_size=1)


def constrained_lines() -> tuple[list[str], list[list[str]]]:
    """Lines with numbers, and each line's terms as the CLI and the service choose them (placeholders)."""
    from model.decoding.terms import sentence_terms

    lines = [f"Ein Hund mit {n} Bällen läuft {n + 7} Mal im Park" for n in range(2, 14)]
    lines += [f"Zwei Kinder spielen um {n} Uhr" for n in range(1, 9)]
    return lines, [[t.target for t in sentence_terms(line, None, protect=True, limit=8)] for line in lines]


def test_a_translator_made_for_beam_1_decodes_constrained_lines_as_the_service(model_dir: Path) -> None:
    """The CLI's translator for ``--beam-size 1`` and a worker's (``max_beam_size`` the service's
    NMT_MAX_BEAM_SIZE, app/serving/worker/process.py) keep as many candidates per row in their steps:
    greedy lines with placeholders (a beam of 2 each) come out the same. (With candidates for a
    beam of 1 only, the constrained search saw fewer and chose otherwise.)"""
    from model.decoding.options import DecodeOptions

    lines, terms = constrained_lines()
    assert all(terms)
    cli = Translator.load(model_dir, quantization="none", options=DecodeOptions(beam_size=1))
    worker = Translator.load(model_dir, quantization="none", max_beam_size=8, capacity=64)
    assert_same_results(
        cli.translate_batch(lines, terms=terms), worker.translate_batch(lines, beam_size=1, terms=terms)
    )
