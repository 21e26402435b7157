"""The word aligner behind the terminology benchmark (benchmarks.aligner), and the glossary test set
it builds (benchmarks.terminology): on a synthetic corpus whose word-for-word alignment is known."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import terminology
from benchmarks.aligner import Aligner, cached, tokenize, words
from benchmarks.terminology import Entry, TermSet, candidates, inside_words, measure, occurs, table

# A fixed bilingual dictionary: source word i translates to target word i, one for one.
SRC_WORDS = [f"s{i}x" for i in range(30)]
TGT_WORDS = [f"t{i}y" for i in range(30)]
WORD_FOR_WORD = dict(zip(SRC_WORDS, TGT_WORDS, strict=True))


def reorder(ws: list[str]) -> list[str]:
    """Swap each adjacent pair (a b c d e -> b a d c e) and move the last word first: the
    translation is word for word, but not in the same order."""
    out = list(ws)
    for k in range(0, len(out) - 1, 2):
        out[k], out[k + 1] = out[k + 1], out[k]
    return out[-1:] + out[:-1]


def corpus(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    sources, targets = [], []
    for _ in range(n):
        ws = rng.sample(SRC_WORDS, rng.randint(3, 8))  # distinct words: one right link each
        sources.append(" ".join(ws))
        targets.append(" ".join(WORD_FOR_WORD[w] for w in reorder(ws)))
    return sources, targets


@pytest.fixture(scope="module")
def aligner() -> Aligner:
    return Aligner.train(*corpus(400, seed=0), iterations=8)


@pytest.mark.parametrize("grow_diag", [False, True])
def test_aligner_recovers_a_known_word_for_word_alignment(aligner: Aligner, grow_diag: bool) -> None:
    sources, targets = corpus(50, seed=1)  # sentences it was not trained on, same dictionary
    found = total = 0
    for source, target in zip(sources, targets, strict=True):
        f, e = words(source), words(target)
        right = {(i, e.index(WORD_FOR_WORD[w])) for i, w in enumerate(f)}
        links = aligner.align(f, e, grow_diag=grow_diag)
        assert links <= right, (source, target, sorted(links - right))  # no wrong link
        found += len(links)
        total += len(right)
    assert found / total > 0.95  # and nearly every right one


def test_aligner_cache_round_trip(tmp_path: Path) -> None:
    sources, targets = corpus(60, seed=2)
    first = cached(sources, targets, iterations=3, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    again = cached(sources, targets, iterations=3, cache_dir=tmp_path)  # loaded, not retrained
    f, e = words(sources[0]), words(targets[0])
    assert first.align(f, e) == again.align(f, e)
    assert again.forward.diagonal == first.forward.diagonal


def test_tokenize_keeps_surface_forms_and_offsets() -> None:
    text = "Ein Boston Terrier läuft über saftig-grünes Gras."
    toks = tokenize(text)
    assert [t.surface for t in toks][-3:] == ["saftig", "grünes", "Gras"]
    assert all(text[t.start : t.end] == t.surface for t in toks)
    assert words("Mann, MANN!") == ["mann", "mann"]


def test_glossary_entries_come_from_the_source_and_the_reference(aligner: Aligner) -> None:
    sources, targets = corpus(50, seed=3)
    # Targets written with capitals here and there: the entry keeps the reference's surface form.
    refs = [" ".join(w.upper() if k % 3 == 0 else w for k, w in enumerate(t.split())) for t in targets]
    n = 0
    for source, ref in zip(sources, refs, strict=True):
        entries = candidates(aligner, source, ref, stop_src=frozenset(), stop_tgt=frozenset())
        for entry in entries:
            assert isinstance(entry, Entry)
            assert entry.source in {t.surface for t in tokenize(source)}
            assert entry.target in {t.surface for t in tokenize(ref)}
            assert occurs(entry.target, ref)
            assert WORD_FOR_WORD[entry.source.lower()] == entry.target.lower()
        n += len(entries)
    assert n > 100


def test_stopwords_short_words_and_the_first_reference_word_are_left_out(
    aligner: Aligner, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = "s1x s2x s3x s4x s5x"
    ref = " ".join(WORD_FOR_WORD[w] for w in reorder(source.split()))  # t5y t2y t1y t4y t3y
    none = frozenset[str]()
    # t5y begins the reference: its capital (in a real sentence) comes from the position.
    assert {e.source for e in candidates(aligner, source, ref, none, none)} == {"s1x", "s2x", "s3x", "s4x"}
    fewer = candidates(aligner, source, ref, frozenset({"s2x"}), frozenset({"t3y"}))
    assert {e.source for e in fewer} == {"s1x", "s4x"}
    # Words shorter than MIN_CHARS (3; every word here has 3): no entry.
    monkeypatch.setattr(terminology, "MIN_CHARS", 4)
    assert candidates(aligner, source, ref, none, none) == []


def test_occurs_is_case_sensitive_and_respects_word_boundaries() -> None:
    assert occurs("Hut", "Ein Mann mit Hut.")
    assert not occurs("hut", "Ein Mann mit Hut.")
    assert not occurs("Hut", "Ein Mann mit Huten.")
    assert occurs("{name}", "Hallo {name}, willkommen")
    assert occurs("%1$s", "Datei %1$s gelesen")
    assert not occurs("%s", "Datei %1$s gelesen")
    assert not occurs("%d", "Wert %dx")
    assert occurs("https://example.com/a?b=1", "siehe https://example.com/a?b=1.")
    assert not occurs("42", "1420 Leute")
    assert inside_words(["Home fangende Junge"], [["fangen", "Home"]]) == 1


@dataclass
class FakeResult:
    hypotheses: list[str]


class PlainTranslator:
    """Today's translate_batch: no ``terms`` parameter. Translates by looking words up."""

    def translate_batch(self, texts: list[str], *, beam_size: int = 5) -> list[FakeResult]:
        return [FakeResult([" ".join(WORD_FOR_WORD.get(w, "unk") for w in t.split())]) for t in texts]


class ConstrainedTranslator(PlainTranslator):
    """Honours ``terms`` by appending the missing ones, as a constrained search would put them in."""

    def translate_batch(
        self, texts: list[str], *, beam_size: int = 5, terms: list[list[str]] | None = None
    ) -> list[FakeResult]:
        plain = super().translate_batch(texts, beam_size=beam_size)
        out = []
        for result, ts in zip(plain, terms or [[] for _ in texts], strict=True):
            text = result.hypotheses[0]
            out.append(FakeResult([" ".join([text, *[t for t in ts if not occurs(t, text)]])]))
        return out


def fake_set() -> TermSet:
    sources = ["s1x s2x", "s3x zzz", "s4x s5x"]
    return TermSet(
        direction="xx-yy",
        sources=sources,
        references=["t1y t2y", "t3y Qqq", "t4y t5y"],
        terms=[["t2y"], ["Qqq"], []],  # "Qqq": a term the plain translation misses
        candidates=4,
        placeholder_texts=["s1x {name} s2x", "s3x %1$s"],
        placeholder_terms=[["{name}"], ["%1$s"]],
    )


def test_measure_without_terms_support_reports_the_unconstrained_side_only() -> None:
    r = measure(PlainTranslator(), fake_set(), "fake", beam=5, repeats=2)
    assert not r.constraints_supported
    assert (r.entries, r.sentences_with_terms, r.sentences_without_terms) == (2, 2, 1)
    assert r.term_success_unconstrained == 50.0
    assert r.term_success_constrained is None and r.bleu_constrained is None
    assert r.identical_without_terms is None and r.throughput_ratio is None
    assert r.length_ratio is None and r.terms_inside_words is None
    assert r.placeholders_kept_unconstrained == 0.0 and r.placeholders_kept_constrained is None
    assert r.sentences_per_s_unconstrained > 0
    assert "n/a" in table([r])


def test_measure_with_terms_support() -> None:
    r = measure(ConstrainedTranslator(), fake_set(), "fake", beam=5, repeats=1)
    assert r.constraints_supported
    assert r.term_success_unconstrained == 50.0 and r.term_success_constrained == 100.0
    assert r.bleu_constrained is not None and r.bleu_constrained >= r.bleu_unconstrained
    assert r.identical_without_terms == 100.0
    assert r.placeholders_kept_constrained == 100.0
    assert r.throughput_ratio is not None and r.throughput_ratio > 0
    assert r.length_ratio is not None and r.length_ratio > 1  # "Qqq" appended
    assert r.terms_inside_words == 0
    assert "found only inside a longer word" in table([r])
