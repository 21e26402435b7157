"""SentencePiece wrapper with fixed special ids.

The ids are part of the model directory format and never change:

======  ====  ==========================================
piece   id    use
======  ====  ==========================================
<pad>   0     padding (masked out of attention and loss)
<unk>   1     unknown piece
<s>     2     begin of sentence: first decoder input
</s>    3     end of sentence: ends every source and every target
======  ====  ==========================================

A multilingual model's vocabulary also holds one control symbol per target language,
``target_token(lang)`` = ``<2en>``, ``<2de>``, ...: put before the source ids, it says which
language to translate into (``model.checkpoint.source_prefix``). Control symbols are never produced
by encoding text (a user typing "<2de>" gets ordinary pieces) and decode to nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3


def target_token(lang: str) -> str:
    """The control symbol that asks a multilingual model for ``lang``: ``<2en>``."""
    return f"<2{lang}>"


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {path}")
        self.path = path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"{path}: not a valid SentencePiece model ({e})") from e
        got = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
        if got != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise ValueError(f"{path}: special ids (pad, unk, bos, eos) are {got}, expected (0, 1, 2, 3)")

    @property
    def vocab_size(self) -> int:
        return int(self.sp.GetPieceSize())

    # One call per text, not SentencePiece's list form: that one starts a thread pool per call,
    # ~300 us even for a single sentence (9 us for the text alone), holding the GIL meanwhile.
    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids without bos/eos (the model adds those where it needs them)."""
        return [list(self.sp.Encode(text)) for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return [str(self.sp.Decode([i for i in seq if i > EOS_ID])) for seq in ids]

    def pieces(self, ids: list[int]) -> list[str]:
        return [str(p) for p in self.sp.IdToPiece(ids)]

    def control_id(self, piece: str) -> int | None:
        """The id of control symbol ``piece`` (e.g. ``target_token("en")``), None if it has none."""
        i = int(self.sp.PieceToId(piece))
        return i if self.sp.IdToPiece(i) == piece and self.sp.IsControl(i) else None

    @staticmethod
    def train(
        texts: Iterable[str],
        model_prefix: str | Path,
        vocab_size: int,
        *,
        seed_sentences: int = 0,
        control_symbols: Sequence[str] = (),
    ) -> Path:
        """Train a joint unigram SentencePiece model on ``texts``; returns the .model path.

        ``seed_sentences``: train on a random sample of this many of ``texts`` (0: all of them).
        ``control_symbols`` get the ids right after the fixed specials (4, 5, ...), in order.
        """
        model_prefix = Path(model_prefix)
        model_prefix.parent.mkdir(parents=True, exist_ok=True)
        spm.SentencePieceTrainer.Train(
            sentence_iterator=iter(texts),
            model_prefix=str(model_prefix),
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=1.0,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            input_sentence_size=seed_sentences,
            control_symbols=list(control_symbols),
            shuffle_input_sentence=True,
            # Keep the training log quiet: it is thousands of lines on stderr.
            minloglevel=2,
            num_threads=2,
            # Tiny corpora (tests, small custom data) may not support the requested size exactly.
            hard_vocab_limit=False,
        )
        return model_prefix.with_suffix(".model")
