"""Terminology: does constrained decoding put the glossary's words in the output, and at what cost?

The glossary test set is built independently of our decoder, from the references: a word aligner
(``benchmarks.aligner``: IBM Model 1 with fast_align's diagonal prior, both directions, links where
they agree; trained on Multi30k train plus the test pairs themselves, unsupervised, as word aligners
are run) links the words of each test_2016_flickr source sentence to those of its reference. A
linked pair is a candidate entry (source word as written in the source, target word as written in
the reference) unless either word is a stopword (small hand lists below), shorter than 3
characters, or the reference's first word (its capital comes from its position, not the word). A
seeded share of the sentences (``--share``, default 0.7) gets up to ``--max-terms`` of its
candidates; the others get none, and check that a sentence without terms decodes exactly as it
would without constraints.

Measured per direction (de->en, en->de; models artifacts/multi30k-de-en, -en-de), beam 5, with
``Translator.translate_batch(texts, beam_size=5, terms=[[target, ...], ...])``:

- term success: the share of entries whose target appears in the output (as written: case-sensitive,
  at word boundaries); also for the unconstrained output, the baseline (what the model says anyway);
- BLEU (sacreBLEU, default signature) with the glossary against without;
- the share of sentences without entries whose constrained output is identical to the unconstrained;
- throughput: sentences/s with constraints and without, the same sentences, beam and process, each
  the median of ``--repeats`` timed runs (alternating; after one warm-up), and their ratio;
- placeholders: ``--placeholders`` source sentences (200) with one or two of ``{name}``,
  ``{{count}}``, ``%1$s``, ``%s``, ``%d``, a URL, an e-mail address, a number inserted at word
  boundaries, each passed as a term (as the service protects them): the share kept verbatim.

The issue's targets: term success >= 95 %, BLEU with >= without, 100 % identical, throughput ratio
>= 0.75, 100 % of placeholders kept. Where this checkout's ``translate_batch`` has no ``terms``
parameter yet, only the unconstrained side is measured (glossary statistics, baseline term success,
BLEU without, sentences/s without) and the constrained columns print "n/a".

    .venv/bin/python -m benchmarks.terminology --threads 1        # both directions: ~8 min without
    #   constrained decoding on one thread of a busy 2-core machine (the aligner trains in ~10 s once,
    #   then loads from the temp directory); --repeats 1 with constraints: ~4 min
    .venv/bin/python -m benchmarks.terminology --directions de-en --limit 200 --repeats 1  # quick
    .venv/bin/python -m benchmarks.terminology --json terminology.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import re
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.aligner import DIAGONAL, Aligner, cached, tokenize
from benchmarks.common import DATA, REPO, OtherLoad, cpu_name
from training.data import read_lines


def wordset(text: str) -> frozenset[str]:
    return frozenset(text.split())


STOPWORDS = {
    "de": wordset(
        """
        der die das des dem den ein eine einer eines einem einen und oder aber sowie in im ins an am
        auf aus bei beim mit nach von vom zu zum zur für über unter vor hinter neben zwischen durch
        gegen ohne um bis ist sind war waren wird werden wurde hat haben hatte sein seine seinem
        seinen seiner seines ihr ihre ihrem ihren ihrer ihres sich er sie es wir man nicht auch als
        wie dass während dabei daneben dort hier etwas einige eines anderen andere anderer anderes
        jemand jemandem jemanden dieser diese dieses diesem diesen welche welcher welches beide
        beiden viele vielen sehr noch schon gerade herum entlang darauf davor
        """
    ),
    "en": wordset(
        """
        the and but for from with into onto over under near next are was were been being has have
        had his her hers him their them they she its this that these those there here some while
        who whom which what whose where when each other another one ones very also not just about
        around along across through onto front top side behind between against without upon off out
        down than then something someone somebody while
        """
    ),
}
MIN_CHARS = 3
# Placeholders of software strings, as the service protects them by default (issue 31): each is a
# term whose target is its own text. One number as written, kept by the same rule.
PLACEHOLDERS = (
    "{name}",
    "{{count}}",
    "%1$s",
    "%s",
    "%d",
    "https://example.com/docs/setup?id=42",
    "anna.schmidt@example.org",
    "4711",
)


@dataclass(frozen=True)
class Entry:
    """A glossary entry: a source word of the sentence and the reference's word it aligns to."""

    source: str
    target: str


def occurs(term: str, text: str) -> bool:
    """Whether ``term`` appears in ``text`` as written (case-sensitive), not inside a longer word:
    no word character right before a term that starts with one, or right after one that ends with
    one (so "Hut" is not found in "Huten" nor "42" in "1420", but "{name}," counts)."""
    before = r"(?<!\w)" if re.match(r"\w", term) else ""
    after = r"(?!\w)" if re.search(r"\w$", term) else ""
    return re.search(before + re.escape(term) + after, text) is not None


def candidates(
    aligner: Aligner,
    source: str,
    reference: str,
    stop_src: frozenset[str],
    stop_tgt: frozenset[str],
    grow_diag: bool = False,
) -> list[Entry]:
    """The sentence's possible entries, in reference order, each target word once."""
    src, ref = tokenize(source), tokenize(reference)
    links = aligner.align([t.lower for t in src], [t.lower for t in ref], grow_diag=grow_diag)
    entries: list[Entry] = []
    seen: set[str] = set()
    for i, j in sorted(links, key=lambda link: (link[1], link[0])):
        s, r = src[i], ref[j]
        if j == 0 or s.lower in stop_src or r.lower in stop_tgt:
            continue
        if len(s.surface) < MIN_CHARS or len(r.surface) < MIN_CHARS or r.surface in seen:
            continue
        seen.add(r.surface)
        entries.append(Entry(s.surface, r.surface))
    return entries


def build_glossary(
    aligner: Aligner,
    sources: Sequence[str],
    references: Sequence[str],
    stop_src: frozenset[str],
    stop_tgt: frozenset[str],
    max_terms: int,
    share: float,
    seed: int = 0,
    grow_diag: bool = False,
) -> list[list[Entry]]:
    """Per sentence its entries: for a seeded ``share`` of the sentences up to ``max_terms`` of
    their candidates (drawn at random: which words the model gets right anyway is not chosen), for
    the others none."""
    rng = random.Random(seed)
    glossary: list[list[Entry]] = []
    for source, reference in zip(sources, references, strict=True):
        found = candidates(aligner, source, reference, stop_src, stop_tgt, grow_diag)
        # Drawn in sentence order from one stream: the first N sentences get the same entries
        # whatever --limit, so a quick run checks a prefix of the full one.
        chosen = rng.random() < share
        picked = sorted(rng.sample(range(len(found)), min(max_terms, len(found)))) if chosen else []
        glossary.append([found[k] for k in picked])
    return glossary


def with_placeholders(sources: Sequence[str], seed: int = 0) -> list[tuple[str, list[str]]]:
    """Each sentence with one or two different placeholders inserted between its words, and them."""
    rng = random.Random(seed)
    out = []
    for k, text in enumerate(sources):
        ws = text.split()
        chosen = [PLACEHOLDERS[k % len(PLACEHOLDERS)]]  # every kind equally often
        if rng.random() < 0.5:
            chosen.append(rng.choice([p for p in PLACEHOLDERS if p != chosen[0]]))
        for p in chosen:
            ws.insert(rng.randint(0, len(ws)), p)
        out.append((" ".join(ws), chosen))
    return out


def share_found(outputs: Sequence[str], terms: Sequence[Sequence[str]]) -> tuple[int, int]:
    """(terms found in their sentence's output, terms)."""
    found = sum(occurs(t, out) for out, ts in zip(outputs, terms, strict=True) for t in ts)
    return found, sum(len(ts) for ts in terms)


def inside_words(outputs: Sequence[str], terms: Sequence[Sequence[str]]) -> int:
    """Terms that are in their output only as part of a longer word ("fangen" in "fangende"): the
    search forced the term's pieces, then continued the word."""
    return sum(t in out and not occurs(t, out) for out, ts in zip(outputs, terms, strict=True) for t in ts)


def word_count(texts: Sequence[str]) -> int:
    return sum(len(t.split()) for t in texts)


def percent(part: int, whole: int) -> float | None:
    return round(100.0 * part / whole, 2) if whole else None


@dataclass
class DirectionResult:
    direction: str
    model: str
    sentences: int
    sentences_with_terms: int
    sentences_without_terms: int
    entries: int
    candidates_per_sentence: float  # before the draw: how many entries the test set could give
    constraints_supported: bool
    term_success_unconstrained: float | None  # percent of entries
    term_success_constrained: float | None
    bleu_unconstrained: float
    bleu_constrained: float | None
    identical_without_terms: float | None  # percent of the sentences without entries
    sentences_per_s_unconstrained: float
    sentences_per_s_constrained: float | None
    throughput_ratio: float | None
    placeholder_sentences: int
    placeholders: int
    placeholders_kept_unconstrained: float | None  # percent
    placeholders_kept_constrained: float | None
    # Diagnostics of the constrained output: words against the unconstrained output's (a search
    # that stops once its constraints are met writes short translations: BLEU falls, speed rises),
    # and terms found only inside a longer word.
    length_ratio: float | None = None
    terms_inside_words: int | None = None
    examples: list[dict[str, Any]] = field(default_factory=list)


def supports_terms(translator: Any) -> bool:
    """Whether ``translate_batch`` takes ``terms`` (constrained decoding; issue 31). Checked on the
    signature rather than by catching TypeError, which a real bug could raise too."""
    return "terms" in inspect.signature(translator.translate_batch).parameters


def translate(
    translator: Any, texts: list[str], beam: int, terms: list[list[str]] | None
) -> tuple[list[str], float]:
    extra = {} if terms is None else {"terms": terms}
    start = time.perf_counter()
    results = translator.translate_batch(texts, beam_size=beam, **extra)
    return [r.hypotheses[0] for r in results], time.perf_counter() - start


@dataclass
class TermSet:
    """One direction's sentences, their glossary terms and the placeholder set."""

    direction: str
    sources: list[str]
    references: list[str]
    terms: list[list[str]]  # per sentence, the glossary's target words (may be empty)
    candidates: int  # entries the aligned pairs offered before the draw
    placeholder_texts: list[str]
    placeholder_terms: list[list[str]]


def term_set(src_lang: str, tgt_lang: str, args: argparse.Namespace) -> TermSet:
    sources = read_lines(args.data / f"test_2016_flickr.{src_lang}.gz")
    references = read_lines(args.data / f"test_2016_flickr.{tgt_lang}.gz")
    # One aligner per language pair, trained de-en and flipped for en-de (the intersection is
    # symmetric): the test pairs are part of its unsupervised training, as usual for aligners.
    pair = sorted((src_lang, tgt_lang))
    train = {
        lang: read_lines(args.data / f"train.{lang}.gz")
        + read_lines(args.data / f"test_2016_flickr.{lang}.gz")
        for lang in pair
    }
    started = time.perf_counter()
    aligner = cached(train[pair[0]], train[pair[1]], iterations=args.iterations, diagonal=args.diagonal)
    if pair[0] != src_lang:
        aligner = aligner.flipped()
    print(f"{src_lang}-{tgt_lang}: aligner ready in {time.perf_counter() - started:.1f} s", flush=True)
    if args.limit:
        sources, references = sources[: args.limit], references[: args.limit]
    stop_src, stop_tgt = STOPWORDS.get(src_lang, frozenset()), STOPWORDS.get(tgt_lang, frozenset())
    glossary = build_glossary(
        aligner,
        sources,
        references,
        stop_src,
        stop_tgt,
        args.max_terms,
        args.share,
        args.seed,
        args.grow_diag,
    )
    n_candidates = sum(
        len(candidates(aligner, s, r, stop_src, stop_tgt, args.grow_diag))
        for s, r in zip(sources, references, strict=True)
    )
    placeholder_set = with_placeholders(sources[: args.placeholders], args.seed)
    return TermSet(
        direction=f"{src_lang}-{tgt_lang}",
        sources=sources,
        references=references,
        terms=[[e.target for e in entries] for entries in glossary],
        candidates=n_candidates,
        placeholder_texts=[text for text, _ in placeholder_set],
        placeholder_terms=[ps for _, ps in placeholder_set],
    )


def run_direction(src_lang: str, tgt_lang: str, args: argparse.Namespace) -> DirectionResult:
    from model.decoding.translator import Translator  # torch: only once a model is run

    data = term_set(src_lang, tgt_lang, args)
    model_dir = args.models / f"multi30k-{src_lang}-{tgt_lang}"
    translator = Translator.load(model_dir, device="cpu")
    return measure(translator, data, str(model_dir), beam=args.beam, repeats=args.repeats)


def measure(translator: Any, data: TermSet, model: str, beam: int, repeats: int) -> DirectionResult:
    """Translate ``data`` with ``translator`` without and (where it can) with the terms."""
    sources, references, terms = data.sources, data.references, data.terms
    ph_texts, ph_terms = data.placeholder_texts, data.placeholder_terms
    constrained = supports_terms(translator)
    translate(translator, sources[:16], beam, None)  # warm-up: first-use allocations, caches
    if constrained:
        translate(translator, sources[:16], beam, terms[:16])
    plain_times: list[float] = []
    forced_times: list[float] = []
    plain: list[str] = []
    forced: list[str] = []
    for _ in range(repeats):  # alternating, so a noisy neighbour slows both alike
        plain, seconds = translate(translator, sources, beam, None)
        plain_times.append(seconds)
        if constrained:
            forced, seconds = translate(translator, sources, beam, terms)
            forced_times.append(seconds)
    ph_plain, _ = translate(translator, ph_texts, beam, None)
    ph_forced = translate(translator, ph_texts, beam, ph_terms)[0] if constrained else None

    import sacrebleu

    def bleu(outputs: list[str]) -> float:
        return round(sacrebleu.corpus_bleu(outputs, [references]).score, 2)

    without = [k for k, ts in enumerate(terms) if not ts]
    sps_plain = len(sources) / statistics.median(plain_times)
    sps_forced = len(sources) / statistics.median(forced_times) if constrained else None
    examples = [
        {"source": sources[k], "reference": references[k], "terms": terms[k], "unconstrained": plain[k]}
        | ({"constrained": forced[k]} if constrained else {})
        for k in [k for k, ts in enumerate(terms) if ts][:5]
    ] + [
        {"source": ph_texts[k], "terms": ph_terms[k], "unconstrained": ph_plain[k]}
        | ({"constrained": ph_forced[k]} if ph_forced is not None else {})
        for k in range(min(3, len(ph_texts)))
    ]
    return DirectionResult(
        direction=data.direction,
        model=model,
        sentences=len(sources),
        sentences_with_terms=len(sources) - len(without),
        sentences_without_terms=len(without),
        entries=sum(len(ts) for ts in terms),
        candidates_per_sentence=round(data.candidates / max(1, len(sources)), 2),
        constraints_supported=constrained,
        term_success_unconstrained=percent(*share_found(plain, terms)),
        term_success_constrained=percent(*share_found(forced, terms)) if constrained else None,
        bleu_unconstrained=bleu(plain),
        bleu_constrained=bleu(forced) if constrained else None,
        identical_without_terms=percent(sum(forced[k] == plain[k] for k in without), len(without))
        if constrained
        else None,
        sentences_per_s_unconstrained=round(sps_plain, 2),
        sentences_per_s_constrained=round(sps_forced, 2) if sps_forced else None,
        throughput_ratio=round(sps_forced / sps_plain, 3) if sps_forced else None,
        placeholder_sentences=len(ph_texts),
        placeholders=sum(len(ps) for ps in ph_terms),
        placeholders_kept_unconstrained=percent(*share_found(ph_plain, ph_terms)),
        length_ratio=round(word_count(forced) / max(1, word_count(plain)), 3) if constrained else None,
        terms_inside_words=inside_words(forced, terms) if constrained else None,
        placeholders_kept_constrained=percent(*share_found(ph_forced, ph_terms))
        if ph_forced is not None
        else None,
        examples=examples,
    )


def fmt(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:g}{unit}"


def table(results: Sequence[DirectionResult]) -> str:
    head = (
        "| direction | sentences with / without terms | entries | term success: unconstrained / constrained "
        "| BLEU: without / with glossary | identical without terms | sentences/s: without / with (ratio) "
        "| placeholders kept: unconstrained / constrained |"
    )
    rows = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in results:
        rows.append(
            f"| {r.direction} | {r.sentences_with_terms} / {r.sentences_without_terms} | {r.entries} "
            f"| {fmt(r.term_success_unconstrained, ' %')} / {fmt(r.term_success_constrained, ' %')} "
            f"| {fmt(r.bleu_unconstrained)} / {fmt(r.bleu_constrained)} "
            f"| {fmt(r.identical_without_terms, ' %')} "
            f"| {fmt(r.sentences_per_s_unconstrained)} / {fmt(r.sentences_per_s_constrained)} "
            f"({fmt(r.throughput_ratio, 'x')}) "
            f"| {fmt(r.placeholders_kept_unconstrained, ' %')} "
            f"/ {fmt(r.placeholders_kept_constrained, ' %')} "
            f"({r.placeholders} in {r.placeholder_sentences} sentences) |"
        )
    for r in results:
        if r.constraints_supported:
            rows.append(
                f"\n{r.direction}: constrained output {fmt(r.length_ratio, 'x')} the unconstrained one's "
                f"words; {r.terms_inside_words} of {r.entries} terms found only inside a longer word"
            )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--directions", nargs="+", default=["de-en", "en-de"], help="SRC-TGT, e.g. de-en")
    p.add_argument("--models", type=Path, default=REPO / "artifacts", help="holds multi30k-SRC-TGT")
    p.add_argument("--data", type=Path, default=DATA, help="Multi30k: train.* and test_2016_flickr.*")
    p.add_argument("--limit", type=int, default=None, help="first N test sentences only")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="timed runs each way (median reported)")
    p.add_argument("--max-terms", type=int, default=2, help="entries per sentence at most")
    p.add_argument("--share", type=float, default=0.7, help="share of the sentences drawn to get entries")
    p.add_argument("--placeholders", type=int, default=200, help="sentences of the placeholder set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=5, help="EM iterations of the aligner")
    p.add_argument("--diagonal", type=float, default=DIAGONAL, help="aligner's diagonal tension (0: Model 1)")
    p.add_argument(
        "--grow-diag",
        action="store_true",
        help="aligner links: grow-diag (more, less precise), not intersection",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = []
    with OtherLoad() as load:
        for direction in args.directions:
            src_lang, tgt_lang = direction.split("-")
            results.append(run_direction(src_lang, tgt_lang, args))
            print(table(results[-1:]), flush=True)
    if args.json:
        machine = {"cpu": cpu_name(), "python": platform.python_version(), "threads": args.threads}
        other = {"other_cpu_seconds": load.cpu_seconds, "other_load_fraction": load.fraction}
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        payload = {"machine": machine | other, "settings": settings, "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
    print()
    print(table(results))
    if load.fraction is not None:
        print(f"\nother processes used {100 * load.fraction:.0f} % of the machine's CPU during the run")


if __name__ == "__main__":
    main()
