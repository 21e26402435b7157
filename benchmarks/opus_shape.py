"""Random models of OPUS-MT's kind, for the benchmarks and the tests alike: their shape, their
transformers ``MarianConfig`` and our ``ModelConfig``, their seeded weights, and Marian's
SentencePiece models and vocabulary layout, each written once here.

``OPUS_MT`` is opus-mt-de-en's size (6 + 6 layers, d_model 512, 8 heads, FFN 2048, 512 positions,
58,101 pieces: ~74M parameters with the embeddings shared and tied); the tests make tiny models of
the same kind. What is made depends on the arguments and the seed alone, so a model made twice is
the same to the bit: the tests compare it with transformers and CTranslate2, and the benchmarks'
figures depend on its shape. torch, transformers and sentencepiece are imported where they are
used, so that importing this module costs a benchmark nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import MarianMTModel

    from model.transformer import Transformer

OPUS_MT_VOCAB = 58_101  # opus-mt-de-en's vocabulary (with <pad> last)
EOS, UNK = 0, 1  # Marian's ids: </s> first, <unk> second; <pad> is transformers' addition
SPECIALS = ("</s>", "<unk>")


@dataclass(frozen=True)
class Shape:
    d_model: int
    layers: int  # on each side
    heads: int
    ffn: int
    positions: int


OPUS_MT = Shape(d_model=512, layers=6, heads=8, ffn=2048, positions=512)


def random_marian(
    shape: Shape,
    *,
    vocab_size: int,
    pad: int,
    seed: int,
    activation: str = "swish",
    scale_embedding: bool = True,
    **config: Any,
) -> MarianMTModel:
    """A transformers MarianMTModel of ``shape`` (as made: in training mode) with the weights
    ``seed`` draws. Marian's ids: eos 0, decoding starts from ``pad``; the defaults are OPUS-MT's;
    ``config``: any other MarianConfig field."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    marian = MarianConfig(
        vocab_size=vocab_size,
        d_model=shape.d_model,
        encoder_layers=shape.layers,
        decoder_layers=shape.layers,
        encoder_attention_heads=shape.heads,
        decoder_attention_heads=shape.heads,
        encoder_ffn_dim=shape.ffn,
        decoder_ffn_dim=shape.ffn,
        activation_function=activation,
        scale_embedding=scale_embedding,
        max_position_embeddings=shape.positions,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=EOS,
        forced_eos_token_id=EOS,
        **config,
    )
    torch.manual_seed(seed)
    return MarianMTModel(marian)


def random_ours(shape: Shape, *, vocab_size: int, seed: int, **config: Any) -> Transformer:
    """Our Transformer of ``shape`` (model.config's defaults otherwise, no dropout; ``config``: any
    other ModelConfig field), in eval mode, with the weights ``seed`` draws; its config is ``.cfg``."""
    import torch

    from model.config import ModelConfig
    from model.transformer import Transformer

    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=shape.d_model,
        n_heads=shape.heads,
        encoder_layers=shape.layers,
        decoder_layers=shape.layers,
        d_ff=shape.ffn,
        max_positions=shape.positions,
        dropout=0.0,
        **config,
    )
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def train_spm(texts: Iterable[str], prefix: Path, vocab_size: int, **trainer: Any) -> Path:
    """A SentencePiece model (unigram, SentencePiece's own special ids as Marian's models have them)
    of ``vocab_size`` pieces at most, trained on ``texts``; one already at ``prefix`` is kept (the
    tests share theirs between models). ``trainer``: more SentencePieceTrainer options, each written
    into the model's trainer_spec even where it is the default."""
    import sentencepiece as spm

    model = prefix.with_suffix(".model")
    if not model.is_file():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(texts),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            character_coverage=1.0,
            minloglevel=2,
            num_threads=2,
            hard_vocab_limit=False,  # small corpora; Multi30k's English has room for ~7,900 of 8,000
            **trainer,
        )
    return model


def spm_pieces(model: Path) -> list[str]:
    """The ordinary pieces of a SentencePiece model (no unk/control), in its id order."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model))
    normal = (i for i in range(sp.GetPieceSize()) if not (sp.IsControl(i) or sp.IsUnknown(i)))
    return [sp.IdToPiece(i) for i in normal]


def marian_vocab(*piece_lists: list[str], first: tuple[str, ...] = (), size: int = 0) -> dict[str, int]:
    """Marian's layout: </s> 0, <unk> 1, ``first`` (language tokens), the pieces (each once), with a
    ``size`` fillers no text produces ("▁zz00012") up to ``size`` entries, <pad> last (unless
    ``first`` places it)."""
    vocab: dict[str, int] = {}
    for piece in (*SPECIALS, *first, *(p for pieces in piece_lists for p in pieces)):
        vocab.setdefault(piece, len(vocab))
    for i in range(size - 1 - len(vocab) if size else 0):
        vocab.setdefault(f"▁zz{i:05d}", len(vocab))
    vocab.setdefault("<pad>", len(vocab))
    assert not size or len(vocab) == size, f"{len(vocab)} entries, not {size}: a filler is a piece"
    return vocab
