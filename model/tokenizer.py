"""SentencePiece wrapper: text to model ids and back.

In the models we train, the ids are SentencePiece's and part of the model directory format:

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
    """Text to model ids and back.

    Our trained models: one joint SentencePiece model whose ids are the model's (``path`` alone;
    the special ids above). Imported models (OPUS-MT, Argos): a SentencePiece model per side (or
    one for both) whose *pieces* are mapped to the model's ids through the toolkit's vocabulary
    lists (``source_vocab``, ``target_vocab``: the pieces in id order), as Marian and CTranslate2
    do; a piece the vocabulary lacks is ``unk_id``. ``skip_ids``: ids that decode to nothing
    (specials, language tokens) in that case; SentencePiece's own controls are skipped otherwise.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        target: str | Path | None = None,
        source_vocab: Sequence[str] | None = None,
        target_vocab: Sequence[str] | None = None,
        unk_id: int = UNK_ID,
        skip_ids: Iterable[int] = (),
    ) -> None:
        self.path = Path(path)
        self.sp = _load(self.path)
        self.target_sp = self.sp if target is None else _load(Path(target))
        self._continuations: frozenset[int] | None = None  # word_continuations(), made on first use
        self.mapped = source_vocab is not None
        if not self.mapped:
            if target is not None or target_vocab is not None:
                raise ValueError("separate source and target SentencePiece models need vocabulary lists")
            got = (self.sp.pad_id(), self.sp.unk_id(), self.sp.bos_id(), self.sp.eos_id())
            if got != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
                raise ValueError(f"{path}: special ids (pad, unk, bos, eos) are {got}, expected (0, 1, 2, 3)")
            return
        assert source_vocab is not None
        self.source_vocab = list(source_vocab)
        self.target_vocab = self.source_vocab if target_vocab is None else list(target_vocab)
        # Each piece's id, made on first use: a worker, which never encodes, never makes them
        # (~5 MiB for a 58,101-piece OPUS-MT vocabulary, per model).
        self._source_index: dict[str, int] | None = None
        self._target_index: dict[str, int] | None = None
        self.unk_id = unk_id
        self.skip = frozenset(skip_ids)

    @property
    def source_index(self) -> dict[str, int]:
        if self._source_index is None:  # (two threads may both make it: the same dict)
            self._source_index = {p: i for i, p in enumerate(self.source_vocab)}
        return self._source_index

    @property
    def target_index(self) -> dict[str, int]:
        if self.target_vocab is self.source_vocab:
            return self.source_index
        if self._target_index is None:
            self._target_index = {p: i for i, p in enumerate(self.target_vocab)}
        return self._target_index

    @property
    def vocab_size(self) -> int:
        """Of the target side (the output projection's rows)."""
        return len(self.target_vocab) if self.mapped else int(self.sp.GetPieceSize())

    @property
    def source_vocab_size(self) -> int:
        return len(self.source_vocab) if self.mapped else int(self.sp.GetPieceSize())

    # One call per text, not SentencePiece's list form: that one starts a thread pool per call,
    # ~300 us even for a single sentence (9 us for the text alone), holding the GIL meanwhile.
    def encode(self, texts: list[str], *, target: bool = False) -> list[list[int]]:
        """Token ids without bos/eos (the model adds those where it needs them); ``target``: with
        the target side's model and vocabulary (training data)."""
        sp = self.target_sp if target else self.sp
        if not self.mapped:
            return [list(sp.Encode(text)) for text in texts]
        index, unk = (self.target_index if target else self.source_index), self.unk_id
        return [[index.get(p, unk) for p in sp.Encode(text, out_type=str)] for text in texts]

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Target ids to text; special and control ids decode to nothing."""
        if not self.mapped:
            return [str(self.sp.Decode([i for i in seq if i > EOS_ID])) for seq in ids]
        vocab, skip = self.target_vocab, self.skip
        # Stripped as Marian's and argos-translate's detokenizers do: an output ending in a lone
        # "▁" piece would otherwise keep a trailing space.
        return [
            str(self.target_sp.DecodePieces([vocab[i] for i in seq if i not in skip])).strip() for seq in ids
        ]

    def decode_spans(
        self, ids: list[int], spans: Iterable[tuple[int, int, int]], terms: Sequence[str]
    ) -> str:
        """``decode([ids])`` with the tokens of each span (start, end, term index: token indices
        into ``ids``, end exclusive, as ``Hypothesis.spans``) replaced by ``terms[index]`` exactly,
        so that a term the vocabulary cannot spell (a character it lacks) still comes out as given."""
        return self.decode_spans_with_offsets(ids, spans, terms)[0]

    def decode_spans_with_offsets(
        self, ids: list[int], spans: Iterable[tuple[int, int, int]], terms: Sequence[str]
    ) -> tuple[str, list[tuple[int, int, int]]]:
        """``decode_spans``, and where each term is in the text: (start, end, term index) in
        characters, end exclusive, in text order.

        The text is put together segment by segment (the runs of tokens between spans decoded as
        ``decode`` does, each term as given), a space between two segments where the second one's
        first piece begins a word ("▁"), as SentencePiece's own decoding would put it; a term's
        tokens always begin a word (a term is encoded on its own, with SentencePiece's dummy
        prefix)."""
        segments: list[tuple[list[int], int]] = []  # (ids, term index; -1: the model's own text)
        at = 0
        for start, end, term in sorted(spans):
            if start < at or end <= start or end > len(ids):
                raise ValueError(
                    f"span {(start, end, term)} overlaps another or lies outside {len(ids)} tokens"
                )
            segments += [(ids[at:start], -1), (ids[start:end], term)]
            at = end
        segments.append((ids[at:], -1))
        text, offsets = "", []
        for seg_ids, term in segments:
            shown = self._shown(seg_ids)
            part = terms[term] if term >= 0 else self.decode([seg_ids])[0] if shown else ""
            if not part:
                continue
            if text and (not shown or self.pieces(shown[:1])[0].startswith("\u2581")):
                text += " "
            if term >= 0:
                offsets.append((len(text), len(text) + len(part), term))
            text += part
        return text, offsets

    def _shown(self, ids: list[int]) -> list[int]:
        """The ids of ``ids`` that decoding shows (not the specials, controls or skipped ids)."""
        if self.mapped:
            return [i for i in ids if i not in self.skip]
        return [i for i in ids if i > EOS_ID and not self.sp.IsControl(i)]

    def pieces(self, ids: list[int], *, source: bool = False) -> list[str]:
        """The pieces of target ids (of source ids with ``source``)."""
        if not self.mapped:
            return [str(p) for p in self.sp.IdToPiece(ids)]
        vocab = self.source_vocab if source else self.target_vocab
        return [vocab[i] for i in ids]

    def word_continuations(self) -> frozenset[int]:
        """The target ids whose piece continues the word before it: no leading "\u2581" and a
        letter or digit first ("ing", "7"). After a constrained term no such piece may follow: it
        would glue onto the term ("fangen" + "de"); punctuation ("." or ",") may. Computed once."""
        if self._continuations is None:
            specials = self._specials()
            self._continuations = frozenset(
                i
                for i, p in enumerate(self.vocabulary())
                if i not in specials and not p.startswith("\u2581") and p[:1].isalnum()
            )
        return self._continuations

    def _specials(self) -> frozenset[int]:
        """Ids that decode to nothing: specials, controls, skipped ids (never word pieces)."""
        if self.mapped:
            return self.skip
        return frozenset(i for i in range(self.vocab_size) if i <= EOS_ID or self.sp.IsControl(i))

    def vocabulary(self, *, source: bool = False) -> list[str]:
        """Every piece in id order (what CTranslate2 is given)."""
        if not self.mapped:
            return [str(self.sp.IdToPiece(i)) for i in range(self.vocab_size)]
        return list(self.source_vocab if source else self.target_vocab)

    def control_id(self, piece: str) -> int | None:
        """The source id of control symbol ``piece`` (``target_token("en")``, OPUS-MT's
        ``>>fra<<``), None if it has none."""
        if self.mapped:
            return self.source_index.get(piece)
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


def _load(path: Path) -> spm.SentencePieceProcessor:
    if not path.is_file():
        raise FileNotFoundError(f"SentencePiece model not found: {path}")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
    except (OSError, RuntimeError) as e:
        raise ValueError(f"{path}: not a valid SentencePiece model ({e})") from e
    return sp
