"""The KV cache's row copies in C (``model.runtime.kvrows``) against the same copies from Python.

One ``Translator`` (the compiled int8 step on one thread, a running batch of ``--capacity`` rows)
translates the first ``--sentences`` test_2016 sentences once per round with each way of copying,
the order switched every round (a slow phase of a shared machine hits both), and reports this
thread's CPU time (``time.thread_time``) per run: the decoding loop's whole cost (encoder, steps,
search, cache), of which the copies are the part that differs. The two ways must give the same
translations, tokens and scores (checked). The first run of each way (caches and pages warming) is
left out.

    .venv/bin/python -m benchmarks.kv_rows --beams 1 5                          # ~2 min
    .venv/bin/python -m benchmarks.kv_rows --model OPUS_DIR --beams 1 4 --sentences 128 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import DATA, DEFAULT_MODEL, cpu_name
from model.decoding.translator import Translator
from model.runtime import DEFAULT_CACHE_DIR, kvrows
from training.data import read_lines

WAYS = ("python", "native")


def run(translator: Translator, texts: list[str], beam: int, rounds: int) -> dict[str, list[float]]:
    """CPU seconds of this thread per round and way (the first round of each left out)."""
    native = kvrows.kernels()
    seconds: dict[str, list[float]] = {way: [] for way in WAYS}
    outputs: dict[str, list[tuple[list[list[int]], list[float]]]] = {}
    for r in range(rounds + 1):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            kvrows._kernels = native if way == "native" else None  # the caches made from now on
            started = time.thread_time()
            results = translator.translate_batch(texts, beam_size=beam)
            took = time.thread_time() - started
            if r:
                seconds[way].append(took)
            found = [(result.tokens, result.scores) for result in results]
            if outputs.setdefault(way, found) != found:
                raise AssertionError(f"the {way} copies translated differently from one round to the next")
    kvrows._kernels = native
    if outputs["python"] != outputs["native"]:
        raise AssertionError("the two ways of copying rows translated differently")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--sentences", type=int, nargs="+", default=[600, 300], help="per beam size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--capacity", type=int, default=64, help="the running batch's rows")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    if len(args.sentences) != len(args.beams):
        parser.error("give one --sentences per --beams")
    torch.set_num_threads(1)
    if not kvrows.ensure(args.cache_dir):
        raise SystemExit("the native row copies could not be built here")
    translator = Translator.load(
        args.model,
        device="cpu",
        quantization="int8",
        compile=True,
        cache_dir=args.cache_dir,
        capacity=args.capacity,
    )
    print(f"{cpu_name()}, one thread, {translator.runner.kind} int8 step, {args.capacity} rows\n")
    print("| beam | sentences | Python copies, CPU s per run | native | median, Python → native |")
    print("|---:|---:|---|---|---|")
    lines = read_lines(DATA / "test_2016_flickr.de.gz")
    for beam, count in zip(args.beams, args.sentences, strict=True):
        seconds = run(translator, lines[:count], beam, args.rounds)
        before, after = (statistics.median(seconds[way]) for way in WAYS)
        print(
            f"| {beam} | {count} | {', '.join(f'{s:.2f}' for s in seconds['python'])} "
            f"| {', '.join(f'{s:.2f}' for s in seconds['native'])} "
            f"| {before:.2f} → {after:.2f} ({after / before:.2f}×) |",
            flush=True,
        )


if __name__ == "__main__":
    main()
