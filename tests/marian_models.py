"""Tiny OPUS-MT-like models for the converter tests, generated offline in seconds.

A joint SentencePiece model trained on a few thousand Multi30k lines (German and English), a
``transformers`` MarianMTModel whose vocabulary is that model's pieces (so one ``sentencepiece.model``
serves both sides, as in an Argos package), trained for a few steps so that it stops (emits eos)
after a sentence-like number of tokens and its greedy choices are not near-ties.

The Multi30k files are read where they are (never copied into the repository); ``multi30k()``
says where, or skips the test outside CI when they are missing.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import under_ci

REPO = Path(__file__).resolve().parents[1]
# Beside the checkout (../shared/data, as on the build machines and in CI), or the shared data folder.
_CANDIDATES = [REPO.parent / "shared" / "data" / "multi30k", Path("/work/shared/data/multi30k")]


def multi30k() -> Path:
    """The Multi30k folder (train.{de,en}.gz, test_2016_flickr.de.gz); a missing one skips the test,
    except under CI, which provides it."""
    for path in _CANDIDATES:
        if (path / "train.de.gz").is_file():
            return path
    if under_ci():
        pytest.fail(f"Multi30k is missing: looked in {', '.join(map(str, _CANDIDATES))}")
    pytest.skip("Multi30k not found (needed to train the tiny SentencePiece model)")


def read_gz(path: Path, n: int) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f, strict=False)]


def train_joint_spm(out_dir: Path, *, lines: int = 3000, vocab_size: int = 500) -> Path:
    """``out_dir/sentencepiece.model``: unk 0, eos 1, no bos and no pad (Marian's own vocabulary
    adds ``<pad>``), trained on the first ``lines`` German and English training sentences."""
    import sentencepiece as spm

    data = multi30k()
    text = out_dir / "spm-train.txt"
    text.write_text("\n".join(read_gz(data / "train.de.gz", lines) + read_gz(data / "train.en.gz", lines)), encoding="utf-8")
    prefix = out_dir / "sentencepiece"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        character_coverage=1.0,
        unk_id=0,
        eos_id=1,
        bos_id=-1,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    text.unlink()
    return prefix.with_suffix(".model")


def spm_pieces(model: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def make_marian(
    out_dir: Path,
    spm_model: Path,
    *,
    steps: int = 150,
    pairs: int = 2000,
    seed: int = 0,
    activation: str = "swish",
    max_positions: int = 256,
) -> Path:
    """A MarianMTModel (d_model 32, 2+2 layers, 4 heads, ffn 64, tied embeddings) saved with its
    MarianTokenizer in ``out_dir``: vocab.json is the SentencePiece pieces in id order then ``<pad>``
    (last, as in OPUS-MT), source.spm = target.spm = ``spm_model``. Trained ``steps`` steps on the first
    ``pairs`` Multi30k pairs; final_logits_bias is set to small random values (a bias to convert)."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = spm_pieces(spm_model)
    vocab = {p: i for i, p in enumerate([*pieces, "<pad>"])}
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    for name in ("source.spm", "target.spm"):
        shutil.copyfile(spm_model, out_dir / name)
    tokenizer = MarianTokenizer(
        str(out_dir / "source.spm"),
        str(out_dir / "target.spm"),
        str(out_dir / "vocab.json"),
        source_lang="de",
        target_lang="en",
    )
    pad = vocab["<pad>"]
    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=len(vocab),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=max_positions,
        activation_function=activation,
        pad_token_id=pad,
        eos_token_id=vocab["</s>"],
        decoder_start_token_id=pad,
        forced_eos_token_id=vocab["</s>"],
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = MarianMTModel(config)
    _train(model, tokenizer, steps=steps, pairs=pairs, seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        model.final_logits_bias.copy_(0.1 * torch.randn(model.final_logits_bias.shape, generator=g))
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _train(model: torch.nn.Module, tokenizer: object, *, steps: int, pairs: int, seed: int) -> None:
    """A few Adam steps on real pairs: enough for the model to end its outputs with eos."""
    data = multi30k()
    src, tgt = read_gz(data / "train.de.gz", pairs), read_gz(data / "train.en.gz", pairs)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(src), (32,), generator=g).tolist()
        batch = tokenizer(  # type: ignore[operator]
            [src[i] for i in idx], text_target=[tgt[i] for i in idx], padding=True, return_tensors="pt"
        )
        labels = batch["labels"].masked_fill(batch["labels"] == model.config.pad_token_id, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def convert_ct2(hf_dir: Path, out_dir: Path, quantization: str = "float32") -> Path:
    """CTranslate2's own conversion of ``hf_dir`` (the reference the converters are checked against)."""
    from ctranslate2.converters import TransformersConverter

    TransformersConverter(str(hf_dir)).convert(str(out_dir), quantization=quantization, force=True)
    return out_dir
