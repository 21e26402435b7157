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
it is given and reuses it when it is there.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from training.data import read_lines

VOCAB = 58101  # OPUS-MT de-en's vocabulary (with <pad> last)
EOS, UNK, PAD = 0, 1, VOCAB - 1  # Marian's ids: </s> first, <unk> second, <pad> last
SPM_PIECES = 8000  # per side, at most


def train_spm(corpus: Path, prefix: Path) -> Path:
    """A SentencePiece model of ``SPM_PIECES`` pieces trained on ``corpus`` (gzipped, read in place)."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(read_lines(corpus)),
        model_prefix=str(prefix),
        vocab_size=SPM_PIECES,
        character_coverage=1.0,
        hard_vocab_limit=False,  # Multi30k's English has room for ~7,900
        num_threads=2,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def make_hf_model(out: Path, data: Path, seed: int) -> Path:
    """The MarianMTModel and MarianTokenizer of OPUS-MT's size in ``out`` (kept: made once)."""
    if (out / "config.json").is_file() and (out / "vocab.json").is_file():
        return out
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="opus-size-", dir=out.parent))
    models = {
        side: train_spm(data / f"train.{lang}.gz", tmp / side)
        for side, lang in (("source", "de"), ("target", "en"))
    }
    pieces = ["</s>", "<unk>"]
    for model in models.values():
        sp = spm.SentencePieceProcessor(model_file=str(model))
        pieces += [
            sp.id_to_piece(i)
            for i in range(sp.get_piece_size())
            if not sp.is_control(i) and not sp.is_unknown(i)
        ]
    pieces = list(dict.fromkeys(pieces))
    pieces += [f"▁zz{i:05d}" for i in range(VOCAB - 1 - len(pieces))]  # never produced by a text
    vocab = {piece: i for i, piece in enumerate([*pieces, "<pad>"])}
    assert len(vocab) == VOCAB and vocab["</s>"] == EOS and vocab["<unk>"] == UNK and vocab["<pad>"] == PAD
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = MarianTokenizer(
        str(models["source"]),
        str(models["target"]),
        str(tmp / "vocab.json"),
        source_lang="de",
        target_lang="en",
    )
    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=VOCAB,
        d_model=512,
        encoder_layers=6,
        decoder_layers=6,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=2048,
        decoder_ffn_dim=2048,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=512,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        eos_token_id=EOS,
        forced_eos_token_id=EOS,
        share_encoder_decoder_embeddings=True,
    )
    model = MarianMTModel(config).eval()
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
