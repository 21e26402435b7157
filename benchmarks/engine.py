"""Engine throughput: our ``Translator`` against CTranslate2 ``translate_batch`` on the same weights.

The model directory is converted with ``model.export_ctranslate2`` (float32), then both engines
translate the same sentences (test_2016_flickr, 1,000 German sentences by default) with the same
number of threads, for every (beam size, batch size) asked. Both are timed from text to text:
SentencePiece encoding, search, decoding; both sort the inputs by length before batching (ours in
``translate_batch``, CTranslate2's with ``max_batch_size``). Both decode with the same
``DecodeOptions`` (``model.decoding.options``: CTranslate2 gets them as ``ctranslate2_options``;
it has no a * source + b length budget, only the ``--max-length`` cap). A batch of N is N sentences
for CTranslate2 (``max_batch_size``, beams not counted) and N x beam rows of our running batch
(``Translator``'s ``capacity``). Each configuration is run once untimed (warm-up) and then
``--repeats`` times alternating the engines; the median is reported.

Reported: sentences/s, generated tokens/s (tokens of the best hypothesis, eos excluded, for both),
ms per sentence, our/CTranslate2 ratio, and the BLEU of both against the references (sacreBLEU,
default signature) as the check that both engines do the same work.

    .venv/bin/python -m benchmarks.engine                                    # ~6 min on 2 cores
    .venv/bin/python -m benchmarks.engine --batch-sizes 64 --beams 1 --limit 200 --repeats 1   # quick
    .venv/bin/python -m benchmarks.engine --device cuda --dtype bfloat16 --ct2-compute-type bfloat16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sacrebleu
import torch

from benchmarks.common import DATA, DEFAULT_MODEL, OtherLoad, cpu_name
from model.decoding.options import DecodeOptions, ctranslate2_options
from model.decoding.translator import Translator
from model.export_ctranslate2 import export
from model.tokenizer import Tokenizer
from training.data import read_lines

if TYPE_CHECKING:  # imported where used: a machine without CTranslate2 can still time our engine
    import ctranslate2


@dataclass
class Run:
    """One engine translating every input once: the outputs and how long it took."""

    texts: list[str]
    tokens: int  # generated tokens of the best hypotheses, eos excluded
    seconds: float
    cpu_seconds: float = 0.0  # CPU time of the engine's process during the run (all its threads)
    latencies: list[float] = field(default_factory=list)  # with batch 1: seconds per sentence


@dataclass
class Result:
    engine: str  # one of ENGINES
    beam: int
    batch_size: int
    sentences: int
    tokens: int
    seconds: float  # median over repeats
    sentences_per_s: float
    tokens_per_s: float
    ms_per_sentence: float
    bleu: float
    ratio: float = 1.0  # ours / ctranslate2 sentences per second (1.0 for ctranslate2 itself)


Engine = Callable[[list[str], int, int], Run]  # (texts, beam, batch size) -> Run


def ours(translator: Translator, max_length: int) -> Engine:
    """``translator``'s loaded model, decoding with a running batch of ``batch`` x ``beam`` rows
    (one ``Translator`` per configuration, all sharing the model; a compiled step is made on first
    use). Batch 1: one ``translate_batch`` call per sentence, each timed on its own."""
    sized: dict[tuple[int, int], Translator] = {}

    def run(texts: list[str], beam: int, batch: int) -> Run:
        if (beam, batch) not in sized:
            sized[beam, batch] = Translator(
                translator.model,
                translator.tokenizer,
                translator.info,
                translator.device,
                translator.quantization,
                options=DecodeOptions(beam_size=beam, max_output_tokens=max_length),
                # (at least 2: a step runner is warmed up on two rows)
                capacity=max(batch * beam, 2),
                compile=translator.compile,
                cache_dir=translator.cache_dir,
            )
        engine = sized[beam, batch]
        if batch == 1:
            runs = [timed(engine, [text]) for text in texts]
            return Run(
                [r.texts[0] for r in runs],
                sum(r.tokens for r in runs),
                sum(r.seconds for r in runs),
                latencies=[r.seconds for r in runs],
            )
        return timed(engine, texts)

    return run


def timed(translator: Translator, texts: list[str]) -> Run:
    t0 = time.perf_counter()
    results = translator.translate_batch(texts)
    seconds = time.perf_counter() - t0
    return Run([r.hypotheses[0] for r in results], sum(len(r.tokens[0]) for r in results), seconds)


def ctranslate2_engine(ct2: ctranslate2.Translator, tokenizer: Tokenizer, max_length: int) -> Engine:
    def run(texts: list[str], beam: int, batch: int) -> Run:
        if batch == 1:  # one request at a time: each sentence timed on its own
            runs = [run([text], beam, 0) for text in texts]
            return Run(
                [r.texts[0] for r in runs],
                sum(r.tokens for r in runs),
                sum(r.seconds for r in runs),
                latencies=[r.seconds for r in runs],
            )
        t0 = time.perf_counter()
        pieces = tokenizer.sp.encode(texts, out_type=str)
        results = ct2.translate_batch(
            pieces,
            max_batch_size=max(batch, 1),
            **ctranslate2_options(DecodeOptions(beam_size=beam, max_output_tokens=max_length)),
        )
        hyps = [r.hypotheses[0] for r in results]
        out = tokenizer.sp.decode(hyps)
        seconds = time.perf_counter() - t0
        return Run(out, sum(len(h) for h in hyps), seconds)

    return run


# -- one process per engine -------------------------------------------------------------------------
# Each engine runs in its own process. In one process the two OpenMP runtimes (PyTorch's libgomp,
# CTranslate2's Intel OpenMP) fight: threads that one runtime leaves spinning after its run steal the
# cores from the other's next run. Measured on 2 cores, the same-process numbers swung by 2x with
# OMP_WAIT_POLICY; separate processes measure each engine as a user would run it.
ENGINES = ["ours", "ours-compiled", "ours-unpacked", "ours-int8", "ctranslate2", "ctranslate2-int8"]
SETTLE_S = 0.5  # pause between runs: Intel OpenMP threads spin for 200 ms (KMP_BLOCKTIME) after work


def build_engine(name: str, spec: dict[str, Any]) -> Engine:
    torch.set_num_threads(spec["threads"])
    if name.startswith("ours"):  # ours-unpacked: the model.runtime.prepack lever switched off
        translator = Translator.load(
            spec["model"],
            device=spec["device"],
            dtype=spec["dtype"],
            prepack=name != "ours-unpacked",
            quantization="int8" if name == "ours-int8" else "none",
            compile=name == "ours-compiled",  # a step compiled per (beam, batch): minutes the first time
        )
        return ours(translator, spec["max_length"])
    import ctranslate2

    ct2 = ctranslate2.Translator(
        spec["ct2_dir"],
        device="cuda" if spec["device"].startswith("cuda") else "cpu",
        compute_type="int8" if name == "ctranslate2-int8" else spec["ct2_compute_type"],
        inter_threads=spec.get("inter_threads", 1),  # >1: that many batches translated at a time
        intra_threads=spec["threads"],
    )
    return ctranslate2_engine(
        ct2, Tokenizer(Path(spec["ct2_dir"]) / "sentencepiece.model"), spec["max_length"]
    )


def serve(conn: Connection, name: str, spec: dict[str, Any]) -> None:
    """Worker process: build the engine, then run each (texts, beam, batch) it is sent."""
    engine = build_engine(name, spec)
    conn.send("ready")
    with torch.inference_mode():
        while (job := conn.recv()) is not None:
            before = os.times()
            run = engine(*job)
            after = os.times()
            run.cpu_seconds = (after.user + after.system) - (before.user + before.system)
            conn.send(run)


class Worker:
    """An engine in a child process, called like an ``Engine``."""

    def __init__(self, name: str, spec: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no OpenMP state inherited
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=serve, args=(child, name, spec), daemon=True)
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError(f"{name}: worker failed to start")
        self.cpu_seconds = 0.0  # spent running jobs, summed (to tell it apart from other processes' load)

    def __call__(self, texts: list[str], beam: int, batch: int) -> Run:
        self.conn.send((texts, beam, batch))
        run: Run = self.conn.recv()
        self.cpu_seconds += run.cpu_seconds
        time.sleep(SETTLE_S)
        return run

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


def measure(
    engines: dict[str, Engine], texts: list[str], refs: list[str], beam: int, batch: int, repeats: int
) -> list[Result]:
    for run in engines.values():  # warm-up: allocator, thread pools, lazy initialisation
        run(texts[: max(batch, 8)], beam, batch)
    runs: dict[str, list[Run]] = {name: [] for name in engines}
    for _ in range(repeats):  # alternate, so that a slow phase of a shared machine hits both
        for name, run in engines.items():
            runs[name].append(run(texts, beam, batch))
    results = []
    for name, rs in runs.items():
        seconds = statistics.median(r.seconds for r in rs)
        bleu = sacrebleu.corpus_bleu(rs[0].texts, [refs]).score
        results.append(
            Result(
                engine=name,
                beam=beam,
                batch_size=batch,
                sentences=len(texts),
                tokens=rs[0].tokens,
                seconds=seconds,
                sentences_per_s=len(texts) / seconds,
                tokens_per_s=rs[0].tokens / seconds,
                ms_per_sentence=1000 * seconds / len(texts),
                bleu=bleu,
            )
        )
    reference = next((r for r in results if r.engine == "ctranslate2"), results[0])
    for r in results:
        r.ratio = r.sentences_per_s / reference.sentences_per_s
    return results


def run_all(
    workers: dict[str, Worker], texts: list[str], refs: list[str], args: argparse.Namespace
) -> tuple[list[Result], float | None]:
    """Every (beam, batch) configuration; returns the results and the share of the machine that
    processes other than the engines used meanwhile (None where that cannot be measured)."""
    results: list[Result] = []
    with OtherLoad() as other:
        start = time.perf_counter()
        for beam in args.beams:
            for batch in args.batch_sizes:
                rs = measure(dict(workers), texts, refs, beam, batch, args.repeats)
                results += rs
                print(markdown_table(rs).split("\n", 2)[2], flush=True)
        wall = time.perf_counter() - start
    if other.cpu_seconds is None:
        return results, None
    engines = sum(w.cpu_seconds for w in workers.values())  # children: OtherLoad counts them as others
    return results, max(0.0, other.cpu_seconds - engines) / (wall * (os.cpu_count() or 1))


# -- reporting --------------------------------------------------------------------------------------
def markdown_table(results: list[Result]) -> str:
    lines = [
        "| beam | batch | engine | sentences/s | tokens/s | ms/sentence | BLEU | ours / CT2 |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = "—" if r.engine == "ctranslate2" else f"**{r.ratio:.2f}×**"
        lines.append(
            f"| {r.beam} | {r.batch_size} | {r.engine} | {r.sentences_per_s:,.1f} | {r.tokens_per_s:,.0f} "
            f"| {r.ms_per_sentence:.1f} | {r.bleu:.2f} | {ratio} |"
        )
    return "\n".join(lines)


def plot(results: list[Result], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r.beam, r.batch_size) for r in results})
    labels = [f"{'greedy' if b == 1 else f'beam {b}'}\nbatch {n}" for b, n in configs]
    fig, ax = plt.subplots(figsize=(1.8 * len(configs) + 2, 4))
    engines = list(dict.fromkeys(r.engine for r in results))
    width = 0.8 / len(engines)
    for i, engine in enumerate(engines):
        values = [
            next(
                (r.sentences_per_s for r in results if (r.beam, r.batch_size) == c and r.engine == engine),
                0.0,
            )
            for c in configs
        ]
        xs = [j + (i - (len(engines) - 1) / 2) * width for j in range(len(configs))]
        bars = ax.bar(xs, values, width, label=engine)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(configs)), labels)
    ax.set_ylabel("sentences / s")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="our model directory")
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--ref", type=Path, default=DATA / "test_2016_flickr.en.gz")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5], help="1 = greedy search")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (median reported)")
    p.add_argument(
        "--engines",
        nargs="+",
        default=["ours", "ctranslate2"],
        choices=ENGINES,
        help="ours-compiled: the compiled decoding step (model.runtime); ours-unpacked: without "
        "model.runtime.prepack; -int8: int8 quantization (ours: the decoder's linear layers; "
        "CTranslate2: compute_type int8); ratios are to ctranslate2 (float32)",
    )
    p.add_argument("--threads", type=int, default=None, help="threads for both engines (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu or cuda, for both engines")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="ours")
    p.add_argument("--ct2-compute-type", default="float32", help="CTranslate2 compute_type (default float32)")
    p.add_argument("--max-length", type=int, default=256, help="output tokens per sentence, eos included")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--plot", type=Path, help="write a bar chart (PNG) here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import ctranslate2

    args = parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    texts, refs = read_lines(args.src)[: args.limit], read_lines(args.ref)[: args.limit]
    with tempfile.TemporaryDirectory() as tmp:
        ct2_dir = export(args.model, Path(tmp) / "ct2", quantization="float32")
        spec = {
            "model": str(args.model),
            "ct2_dir": str(ct2_dir),
            "threads": threads,
            "device": args.device,
            "dtype": args.dtype,
            "ct2_compute_type": args.ct2_compute_type,
            "max_length": args.max_length,
        }
        workers = {name: Worker(name, spec) for name in args.engines}
        try:
            results, other_fraction = run_all(workers, texts, refs, args)
        finally:
            for w in workers.values():
                w.close()
    env: dict[str, Any] = {
        "cpu": cpu_name(),
        "device": args.device,
        "threads": threads,
        "torch": torch.__version__,
        "ctranslate2": ctranslate2.__version__,
        "python": platform.python_version(),
        "ours_dtype": args.dtype,
        "ct2_compute_type": args.ct2_compute_type,
        "model": str(args.model),
        "sentences": len(texts),
        "other_cpu_fraction": other_fraction,
    }
    load = "unknown" if other_fraction is None else f"{other_fraction:.0%}"
    summary = (
        f"{env['cpu']}, {env['device']}, {threads} threads; torch {env['torch']} ({args.dtype}), "
        f"CTranslate2 {env['ctranslate2']} ({args.ct2_compute_type}); {len(texts)} sentences; "
        f"median of {args.repeats}; other processes used {load} of the CPUs"
    )
    print()
    print(summary)
    print()
    print(markdown_table(results))
    if args.json:
        args.json.write_text(
            json.dumps({"environment": env, "results": [asdict(r) for r in results]}, indent=2)
        )
    if args.plot:
        plot(results, args.plot, summary)


if __name__ == "__main__":
    main()
