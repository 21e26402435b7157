"""model.export_ctranslate2: the converted model translates exactly as ours does."""

from __future__ import annotations

import json
from pathlib import Path

import ctranslate2
import pytest
import torch

from model.checkpoint import ModelInfo, save_model_dir
from model.convert.ctranslate2 import OPTIONS_FILE
from model.decoding.options import DecodeOptions
from model.export_ctranslate2 import export, main
from model.tokenizer import Tokenizer
from model.translator import Translator
from tests.conftest import SENTENCES, random_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "artifacts" / "multi30k-de-en"


def _compare(
    model_dir: Path, out: Path, texts: list[str], beam_size: int, no_repeat_ngram_size: int = 0
) -> None:
    # No a * source + b budget in CTranslate2: only the cap (which counts eos in ours, not in its).
    options = DecodeOptions(
        beam_size=beam_size,
        max_length_a=0,
        max_length_b=41,
        max_output_tokens=41,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    ours = Translator.load(model_dir, device="cpu", options=options)
    export(model_dir, out, options=options)
    assert (out / "model.bin").is_file() and (out / "sentencepiece.model").is_file()
    ct2 = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    pieces = ours.tokenizer.sp.encode(texts, out_type=str)
    # Our options as the exporter wrote them for CTranslate2, read back.
    theirs = ct2.translate_batch(pieces, **json.loads((out / OPTIONS_FILE).read_text()))
    expected = ours.translate_batch(texts)
    for text, mine, other in zip(texts, expected, theirs, strict=True):
        # Compare token ids, not text: SentencePiece decoding could hide a differing piece.
        assert ours.tokenizer.sp.piece_to_id(other.hypotheses[0]) == mine.tokens[0], text


ARCHITECTURES = {
    # Post-LN with tied embeddings is the shipped architecture; pre-LN adds the final LayerNorms.
    "post-norm, tied": {},
    "pre-norm, untied": {"pre_norm": True, "share_embeddings": False, "tie_output": False},
    # What imported models use (model.convert): Marian's swish, [sin | cos] positions and output
    # bias; a learned position table, GELU, unscaled embeddings.
    "swish, sin|cos halves, output bias": {
        "activation": "swish",
        "positions": "sinusoidal_halves",
        "output_bias": True,
    },
    "gelu, learned positions, unscaled": {  # and sources without eos (OpenNMT-py's, Argos)
        "source_eos": False,
        "activation": "gelu",
        "positions": "learned",
        "scale_embeddings": False,
        "pre_norm": True,
    },
}


@pytest.mark.parametrize(
    ("architecture", "beam_size"),
    # Beam 4 on the shipped architecture only: on these random weights outputs run to the length
    # cap, where the engines differ by design: ours ends every hypothesis with eos at the cap and
    # scores it (fairseq's rule), CTranslate2 cuts it there, so near-ties rank differently.
    # tests/test_convert_marian.py compares beams on trained models that end by themselves.
    [(name, 1) for name in ARCHITECTURES] + [("post-norm, tied", 4)],
)
def test_random_model_translates_the_same(
    spm_model: Path, tokenizer: Tokenizer, tmp_path: Path, architecture: str, beam_size: int
) -> None:
    # (No eos boost: CTranslate2 never ends at step 0, ours may.)
    model = random_model(seed=3, sharpen=2.0, vocab_size=tokenizer.vocab_size, **ARCHITECTURES[architecture])
    if model.output_bias is not None:  # random, so that dropping it would change the translations
        with torch.no_grad():
            model.output_bias.normal_(std=2.0)
    model_dir = save_model_dir(tmp_path / "model", model, ModelInfo(model.cfg, "de", "en"), spm_model)
    _compare(model_dir, tmp_path / "ct2", SENTENCES, beam_size)


def test_the_greedy_repetition_guard_blocks_what_ctranslate2_blocks(
    spm_model: Path, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """``no_repeat_ngram_size=2`` against CTranslate2's own, greedy, on a random model that repeats
    itself (long outputs that revisit tokens). (With beams, CTranslate2 ranks and stops hypotheses
    by rules of its own, so outputs can differ with or without the guard; tests/test_search.py
    checks the guard's beams against a brute-force reference.)"""
    beam_size = 1
    model = random_model(seed=5, sharpen=2.0, vocab_size=tokenizer.vocab_size)
    model_dir = save_model_dir(tmp_path / "model", model, ModelInfo(model.cfg, "de", "en"), spm_model)
    plain = Translator.load(model_dir, device="cpu").translate_batch(SENTENCES, beam_size=beam_size)

    def repeats(tokens: list[int]) -> bool:
        pairs = list(zip(tokens, tokens[1:], strict=False))
        return len(set(pairs)) < len(pairs)

    assert any(repeats(r.tokens[0]) for r in plain)  # without the guard, bigrams repeat
    _compare(model_dir, tmp_path / "ct2", SENTENCES, beam_size, no_repeat_ngram_size=2)


def test_shipped_model_translates_the_same(tmp_path: Path) -> None:
    texts = SENTENCES + [
        "Zwei junge Männer spielen Fußball auf einer Wiese.",
        "Eine Frau mit rotem Hut sitzt auf einer Bank und liest ein Buch.",
        "Kinder spielen im Schnee.",
    ]
    _compare(SHIPPED, tmp_path / "ct2", texts, beam_size=1)


def test_cli_refuses_a_non_empty_output_and_a_bad_model(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ct2"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["--model", str(model_dir), "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").read_text() == "mine"
    assert main(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["--model", str(model_dir), "--out", str(out), "--force"]) == 0
    assert (out / "model.bin").is_file()
