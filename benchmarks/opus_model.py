"""The model ``benchmarks.opus_size`` measures: OPUS-MT's size with random weights, made once and
converted for both engines.

A ``transformers`` MarianMTModel of OPUS-MT's shape (6+6 layers, d_model 512, 8 heads, FFN 2048,
swish, scaled embeddings, 58,101 pieces: ~74M parameters with the embeddings shared and tied) with
random weights (a seed) and a MarianTokenizer whose SentencePiece models are trained on Multi30k's
training text (8,000 pieces per side, read where they lie), its vocab.json filled up to 58,101
entries with pieces no text produces ("▁zz12345": the output projection is 512 x 58,101 as in
OPUS-MT). ``final_logits_bias[eos]`` is -1e4, so neither engine ever ends a sentence early: every
output runs to the length limit in both, and random weights cannot make one engine's sentences
shorter than the other's. Converted for us by ``model.convert.marian`` and for CTranslate2 by
``TransformersConverter`` (at a given quantization). Each step keeps what it made in the directory
it is given and reuses it when it is there. Its shape, weights, SentencePiece models and
vocabulary are made as ``benchmarks.opus_shape`` makes them for every such model.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from benchmarks.opus_shape import (
    EOS,
    OPUS_MT,
    OPUS_MT_VOCAB,
    UNK,
    marian_vocab,
    random_marian,
    spm_pieces,
    train_spm,
)
from training.data import read_lines

VOCAB = OPUS_MT_VOCAB
PAD = VOCAB - 1  # <pad> last, where transformers' conversion of OPUS-MT puts it
SPM_PIECES = 8000  # per side, at most


def make_hf_model(out: Path, data: Path, seed: int) -> Path:
    """The MarianMTModel and MarianTokenizer of OPUS-MT's size in ``out`` (kept: made once)."""
    if (out / "config.json").is_file() and (out / "vocab.json").is_file():
        return out
    import torch
    from transformers import MarianTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="opus-size-", dir=out.parent))
    models = {
        side: train_spm(read_lines(data / f"train.{lang}.gz"), tmp / side, SPM_PIECES)
        for side, lang in (("source", "de"), ("target", "en"))
    }
    vocab = marian_vocab(*map(spm_pieces, models.values()), size=VOCAB)
    assert vocab["</s>"] == EOS and vocab["<unk>"] == UNK and vocab["<pad>"] == PAD
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = MarianTokenizer(
        str(models["source"]),
        str(models["target"]),
        str(tmp / "vocab.json"),
        source_lang="de",
        target_lang="en",
    )
    model = random_marian(
        OPUS_MT, vocab_size=VOCAB, pad=PAD, seed=seed, share_encoder_decoder_embeddings=True
    ).eval()
    with torch.no_grad():  # a weight: no engine ever ends a sentence before its length limit
        model.final_logits_bias[0, EOS] = -1e4
    hf = tmp / "hf"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    hf.rename(out)
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    return out


def parameters(hf_dir: Path) -> int:
    """Weights of the model, each shared one once (sinusoidal positions not counted)."""
    from safetensors import safe_open

    total = 0
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safe_open has no __iter__)
            if "embed_tokens" in name or "lm_head" in name or "embed_positions" in name:
                continue
            n = 1
            for s in f.get_slice(name).get_shape():
                n *= s
            total += n
    return total


def convert_ours(hf_dir: Path, out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    from model.convert.marian import convert

    # The command recorded in the model's config.json: the one a person runs to make it.
    return convert(hf_dir, out, source="de", target="en", command="benchmarks.opus_size")


def convert_ct2(hf_dir: Path, out: Path, quantization: str) -> Path:
    if (out / "model.bin").is_file():
        return out
    import ctranslate2

    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(
        str(out), quantization=quantization, force=True
    )
    return out


def size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**20
