"""A mapped tokenizer (an imported model's pieces -> ids) makes its piece index on first use: a
worker, which never encodes, holds none; encoding then maps each SentencePiece piece through the
vocabulary as a plain dictionary lookup does (the reference, built here), unknown pieces to unk."""

from __future__ import annotations

import sentencepiece as spm

from benchmarks.common import DEFAULT_MODEL
from model.tokenizer import Tokenizer

SPM = DEFAULT_MODEL / "sentencepiece.model"


def test_a_mapped_tokenizer_makes_its_index_only_when_it_encodes_and_encodes_as_a_lookup() -> None:
    sp = spm.SentencePieceProcessor(model_file=str(SPM))
    pieces = [sp.IdToPiece(i) for i in range(sp.GetPieceSize())]
    vocab = ["<pad>", "<unk>", *reversed(pieces[4:]), "<filler>"]  # ids unlike SentencePiece's
    tokenizer = Tokenizer(SPM, source_vocab=vocab, unk_id=1, skip_ids={0, 1})
    tokenizer.word_continuations()
    tokenizer.decode([[5, 6, 7]])  # what a worker and a response need: no index
    assert tokenizer._source_index is None and tokenizer.target_vocab is tokenizer.source_vocab
    texts = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee ☃."]
    reference = {p: i for i, p in enumerate(vocab)}
    expected = [[reference.get(p, 1) for p in sp.Encode(t, out_type=str)] for t in texts]
    assert tokenizer.encode(texts) == expected
    assert tokenizer.source_index is tokenizer.target_index  # one vocabulary: one index
