"""One answer per input: how many sentences translate differently alone than among neighbours?

Every sentence of the test set is translated alone (``Translator.translate_batch`` of one, the
eager step), then all of them in one ``translate_batch`` call in a shuffled order (eager, a running
batch of ``--batch-size`` x beam rows: sentences join as others finish, so each one's neighbours are
whatever the running batch holds), and all of them through the serving executor with the compiled
decoding step (``Translator(compile=True)``, as the workers run it: arrivals spread over the steps
in a shuffled order, joining and leaving the running batch), with the service's default model
settings (``--quantization auto``: int8 on CPU) or another. Every run keeps the service's
``2 x NMT_MAX_BEAM_SIZE`` candidates per beam row. Reported per search (greedy, beam 5): sentences
whose best translation differs from the one alone, and BLEU of each run against the references.
With ``--threads 1 --other-threads 2``, the served run is made again on 2 threads and compared with
the served run on 1 (a lone worker runs on its idle neighbours' cores, ``app.serving.cores``).
Not a timing: it counts, so it is stable on a busy machine.

    .venv/bin/python -m benchmarks.determinism                     # ~4 min on 2 cores
    .venv/bin/python -m benchmarks.determinism --quantization none --limit 300
    .venv/bin/python -m benchmarks.determinism --threads 1 --other-threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import sacrebleu
import torch

from app.serving.protocol import Sentence
from app.serving.worker.executor import Executor
from app.serving.worker.inbox import Inbox
from app.serving.worker.models import ModelTable
from benchmarks.common import DATA, DEFAULT_MODEL
from model.decoding.translator import Translator
from training.data import read_lines

MAX_BEAM = 8  # the service's NMT_MAX_BEAM_SIZE: its step keeps 2x that many candidates per row


def sized(translator: Translator, *, capacity: int, compile: bool = False) -> Translator:
    """``translator``'s model (shared, not loaded again) with a running batch of ``capacity`` rows,
    its step compiled or eager."""
    return Translator(
        translator.model,
        translator.tokenizer,
        translator.info,
        translator.device,
        translator.quantization,
        options=translator.options,
        capacity=max(capacity, translator.max_beam_size),
        max_beam_size=translator.max_beam_size,
        compile=compile,
        cache_dir=translator.cache_dir,
    )


def served(translator: Translator, sentences: list[str], beams: list[int], seed: int = 5) -> list[list[int]]:
    """Best tokens of each sentence through a worker's executor: arrivals of 0-6 sentences before
    each step, in a shuffled order, greedy and beam rows side by side (the step: ``translator``'s
    runner, compiled or eager as it was made)."""
    inbox = Inbox()
    executor = Executor(ModelTable.single(translator), inbox, max_batch_size=64)
    sources = translator.source_ids(sentences)
    rng = random.Random(seed)
    pending = [
        Sentence(i, i, src, beam, 1, None, time.monotonic())
        for i, (src, beam) in enumerate(zip(sources, beams, strict=True))
    ]
    rng.shuffle(pending)
    results: dict[int, list[int]] = {}
    with torch.inference_mode():
        while pending or executor.busy or inbox.waiting:
            if pending:
                k = rng.randint(0, 6)
                inbox.add(pending[:k])
                pending = pending[k:]
            for job, result in executor.iteration():
                if isinstance(result, BaseException):
                    raise result
                inbox.release(job)
                results[job.id] = result.hypotheses[0].tokens
    return [results[i] for i in range(len(sentences))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--ref", type=Path, default=DATA / "test_2016_flickr.en.gz")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8"])
    p.add_argument("--batch-size", type=int, default=64, help="sentences in the running batch (x beam rows)")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--other-threads", type=int, default=None, help="the served run again on this many")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    src, ref = read_lines(args.src)[: args.limit], read_lines(args.ref)[: args.limit]
    max_beam = max(MAX_BEAM, *args.beams)
    translator = Translator.load(
        args.model, device="cpu", quantization=args.quantization, max_beam_size=max_beam
    )
    compiled = sized(translator, capacity=64, compile=True)  # as a worker: NMT_MAX_BATCH_SIZE=64
    runner = compiled.runner  # compiled (or loaded) and warmed up now, not inside the first run
    print(f"served step: {runner.kind}, ready in {runner.compile_seconds:.1f} s", flush=True)
    order = list(range(len(src)))
    random.Random(0).shuffle(order)
    report = {
        "quantization": translator.quantization,
        "sentences": len(src),
        "served_step": runner.kind,
        "results": [],
    }
    for beam in args.beams:
        alone = [translator.translate_batch([s], beam_size=beam)[0].hypotheses[0] for s in src]
        batching = sized(translator, capacity=args.batch_size * beam)
        shuffled = batching.translate_batch([src[i] for i in order], beam_size=beam)
        batched = [""] * len(src)
        for i, result in zip(order, shuffled, strict=True):
            batched[i] = result.hypotheses[0]
        through = translator.tokenizer.decode(served(compiled, src, [beam] * len(src)))
        differ = sum(a != b for a, b in zip(alone, batched, strict=True))
        differ_compiled = sum(a != b for a, b in zip(alone, through, strict=True))
        row = {
            "beam": beam,
            "differ": differ,
            "differ_compiled": differ_compiled,
            "threads": torch.get_num_threads(),
            "bleu_alone": sacrebleu.corpus_bleu(alone, [ref]).score,
            "bleu_batched": sacrebleu.corpus_bleu(batched, [ref]).score,
            "bleu_compiled": sacrebleu.corpus_bleu(through, [ref]).score,
        }
        if args.other_threads:
            threads = torch.get_num_threads()
            torch.set_num_threads(args.other_threads)
            other = translator.tokenizer.decode(served(compiled, src, [beam] * len(src)))
            torch.set_num_threads(threads)
            row["other_threads"] = args.other_threads
            row["differ_other_threads"] = sum(a != b for a, b in zip(through, other, strict=True))
            print(
                f"{translator.quantization} beam {beam}: {row['differ_other_threads']} of {len(src)} differ "
                f"served on {threads} thread(s) vs served on {args.other_threads}",
                flush=True,
            )
        report["results"].append(row)  # type: ignore[attr-defined]
        print(
            f"{translator.quantization} beam {beam}: {differ} of {len(src)} differ alone vs in batches of "
            f"{args.batch_size}, {differ_compiled} alone vs served with the {runner.kind} step; BLEU "
            f"{row['bleu_alone']:.2f} alone, {row['bleu_batched']:.2f} batched, "
            f"{row['bleu_compiled']:.2f} served",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
