"""Which language identifier for /detect and ``source: "auto"``: accuracy and speed on Multi30k.

Each candidate library chooses among the same candidate languages (those of the test files: en,
de, fr, cs) for every sentence of test_2016_flickr in each language, and for the first three words
of each (what a person has typed when translate-as-you-type first asks). Reported per candidate:
accuracy per language and overall, sentences per second on one core (the median of ``--repeats``
passes over all sentences), the time to build the identifier, and how much resident memory that
took. Each candidate runs in a fresh process, so that memory and start-up are its own.

    .venv/bin/python -m benchmarks.langid                          # ~1 min on 2 cores
    .venv/bin/python -m benchmarks.langid --languages en de --json langid.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import DATA, OtherLoad, cpu_name
from training.data import read_lines

Identify = Callable[[str], str]


def lingua_identifier(languages: Sequence[str], low_accuracy: bool) -> Identify:
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

    builder = LanguageDetectorBuilder.from_languages(
        *[Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper())) for code in languages]
    ).with_preloaded_language_models()
    detector = (builder.with_low_accuracy_mode() if low_accuracy else builder).build()

    def identify(text: str) -> str:
        best = detector.compute_language_confidence_values(text)[0]
        return str(best.language.iso_code_639_1.name.lower())

    return identify


def py3langid_identifier(languages: Sequence[str]) -> Identify:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    identifier.set_languages(list(languages))

    def identify(text: str) -> str:
        return str(identifier.classify(text)[0])

    return identify


CANDIDATES: dict[str, Callable[[Sequence[str]], Identify]] = {
    "lingua (high accuracy)": lambda langs: lingua_identifier(langs, low_accuracy=False),
    "lingua (low accuracy)": lambda langs: lingua_identifier(langs, low_accuracy=True),
    "py3langid": py3langid_identifier,
}


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(name: str, data: dict[str, list[str]], repeats: int) -> dict[str, Any]:
    """One candidate, in this (fresh) process: build it, then accuracy and speed."""
    before = rss_mib()
    started = time.perf_counter()
    identify = CANDIDATES[name](list(data))
    build_s = time.perf_counter() - started
    texts = [(lang, text) for lang, lines in data.items() for text in lines]
    accuracy: dict[str, dict[str, float]] = {}
    for label, cut in (("sentence", None), ("3 words", 3)):
        per_lang = {}
        for lang, lines in data.items():
            inputs = [" ".join(line.split()[:cut]) if cut else line for line in lines]
            per_lang[lang] = sum(identify(t) == lang for t in inputs) / len(inputs)
        per_lang["all"] = statistics.fmean(per_lang.values())
        accuracy[label] = per_lang
    passes = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _, text in texts:
            identify(text)
        passes.append(time.perf_counter() - started)
    return {
        "name": name,
        "accuracy": accuracy,
        "sentences_per_s": len(texts) / statistics.median(passes),
        "build_s": build_s,
        "memory_mib": rss_mib() - before,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--languages", nargs="+", default=["en", "de", "fr", "cs"])
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    data = {lang: read_lines(args.data / f"{args.split}.{lang}.gz") for lang in args.languages}
    results = []
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter per candidate
    with OtherLoad() as load:
        for name in args.candidates:
            with spawn.Pool(1) as pool:
                results.append(pool.apply(measure, (name, data, args.repeats)))
    print(f"{cpu_name()}; {sum(map(len, data.values()))} sentences ({', '.join(data)})")
    header = ["candidate", *args.languages, "all", "3 words: all", "sentences/s", "build s", "memory MiB"]
    print(" | ".join(header))
    for r in results:
        row = [f"{100 * r['accuracy']['sentence'][lang]:.1f}%" for lang in [*args.languages, "all"]]
        print(
            " | ".join(
                [
                    r["name"],
                    *row,
                    f"{100 * r['accuracy']['3 words']['all']:.1f}%",
                    f"{r['sentences_per_s']:,.0f}",
                    f"{r['build_s']:.2f}",
                    f"{r['memory_mib']:.0f}",
                ]
            )
        )
    if load.fraction is not None:
        print(f"other processes used {100 * load.fraction:.0f}% of the machine's CPU meanwhile")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
