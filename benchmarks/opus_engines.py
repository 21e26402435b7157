"""The engines' own processes for ``benchmarks.opus_size``: CTranslate2 translating, and our library
checked and its decoding step profiled, each in a process of its own, spawned (a fresh interpreter:
no OpenMP runtime shared with torch).

CTranslate2 (``CT2Worker``, running ``ct2_process``): a ``Translator`` for one precision and one
thread layout (inter x intra threads), its construction timed, then each (texts, beam) it is sent
translated text to text (``max_batch_size`` ``BATCH``, ``max_decoding_length`` =
``min_decoding_length``), every output checked to be that many tokens; it reports the seconds and
its resident memory (``status_mib``, which ``benchmarks.opus_size`` reads the server's with too).

Our library (``run_ours``, running ``ours_process``) on one thread, loaded with the server's
settings: our outputs for a few sentences (their lengths and texts, which ``benchmarks.opus_size``
checks and compares with the server's), then where a decoding step's time goes, greedy and beam:
the whole step (``step_ms``) and its pieces alone (``parts``: the output projection, the token
choice, the other linear layers), for the server's compiled step at ``BATCH`` rows and an eager one
at ``BATCH`` and ``4 * BATCH`` rows (with ``slow``, the server's step only). ``estimated_server``
what the step's time implies for the server's sentences/s,
``breakdown_table`` writes the breakdown as a table.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

BATCH = 64  # CTranslate2's max_batch_size and the server's running batch (rows)
SETTLE_S = 0.5  # Intel OpenMP threads spin for 200 ms after work: let them sleep between runs


def status_mib(pid: int, field_name: str) -> float:
    """A kB field of /proc/PID/status (VmRSS, VmHWM), MiB; 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# -- CTranslate2, one process per thread layout -----------------------------------------------------
def ct2_process(conn: Connection, spec: dict[str, Any]) -> None:
    """Worker: build the Translator (timed), then translate each (texts, beam) it is sent."""
    import ctranslate2
    import sentencepiece as spm

    started = time.perf_counter()
    translator = ctranslate2.Translator(
        spec["dir"],
        device="cpu",
        compute_type=spec["compute_type"],
        inter_threads=spec["inter"],
        intra_threads=spec["intra"],
    )
    load_s = time.perf_counter() - started
    source = spm.SentencePieceProcessor(model_file=spec["source_spm"])
    target = spm.SentencePieceProcessor(model_file=spec["target_spm"])
    conn.send({"load_s": load_s, "rss_mib": status_mib(os.getpid(), "VmRSS")})
    length = spec["length"]
    while (job := conn.recv()) is not None:
        texts, beam, alone = job
        if alone:  # each sentence on its own, timed: batch-1 latency
            times = []
            for text in texts:
                started = time.perf_counter()
                [r] = translator.translate_batch(
                    [source.encode(text, out_type=str) + ["</s>"]],
                    beam_size=beam,
                    max_input_length=spec["max_input_length"],
                    max_decoding_length=length,
                    min_decoding_length=length,
                )
                target.decode_pieces(r.hypotheses[0])
                times.append(time.perf_counter() - started)
            conn.send({"p50_ms": 1000 * statistics.median(times)})
            continue
        started = time.perf_counter()
        pieces = [p + ["</s>"] for p in source.encode(texts, out_type=str)]  # as MarianTokenizer does
        results = translator.translate_batch(
            pieces,
            max_batch_size=BATCH,
            beam_size=beam,
            max_input_length=spec["max_input_length"],
            max_decoding_length=length,
            min_decoding_length=length,
        )
        hyps = [r.hypotheses[0] for r in results]
        out = [target.decode_pieces(h) for h in hyps]
        seconds = time.perf_counter() - started
        conn.send(
            {
                "seconds": seconds,
                "lengths": sorted({len(h) for h in hyps}),
                "outputs": len(out),
                "rss_mib": status_mib(os.getpid(), "VmRSS"),
                "hwm_mib": status_mib(os.getpid(), "VmHWM"),
            }
        )


class CT2Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no OpenMP runtime shared with torch
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=ct2_process, args=(child, spec), daemon=True)
        self.process.start()
        self.started: dict[str, float] = self.conn.recv()
        self.length = spec["length"]
        self.last: dict[str, Any] = {}

    def __call__(self, texts: list[str], beam: int) -> float:
        """Sentences per second over ``texts``; every output checked to be ``length`` tokens."""
        self.conn.send((texts, beam, False))
        self.last = self.conn.recv()
        if self.last["lengths"] != [self.length]:
            raise AssertionError(f"CTranslate2 produced lengths {self.last['lengths']}, not {self.length}")
        time.sleep(SETTLE_S)
        return float(len(texts) / self.last["seconds"])

    def latency_ms(self, texts: list[str], beam: int) -> float:
        """p50 milliseconds of translating each of ``texts`` alone (a batch of one)."""
        self.conn.send((texts, beam, True))
        p50 = float(self.conn.recv()["p50_ms"])
        time.sleep(SETTLE_S)
        return p50

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=30)


# -- our library: the length check and where a step's time goes -------------------------------------
def ours_process(conn: Connection, spec: dict[str, Any]) -> None:
    """Worker on one thread: our outputs for the check sentences, then the step's breakdown."""
    import torch

    torch.set_num_threads(1)
    from benchmarks.step import filled_cache, thread_ms
    from model.decoding.options import DecodeOptions
    from model.decoding.translator import Translator
    from model.runtime.runners import load_runner
    from model.runtime.step import argmax_rows, topk_rows

    length = spec["length"]
    options = DecodeOptions(max_output_tokens=length + 1, max_length_a=0, max_length_b=length + 1)
    translator = Translator.load(
        spec["model"],
        device="cpu",
        quantization=spec["quantization"],
        options=options,
        capacity=BATCH,
        max_beam_size=8,  # NMT_MAX_BEAM_SIZE's default: the server's step keeps 16 candidates per row
        compile=True,
        cache_dir=Path(spec["cache_dir"]),
    )
    check: dict[str, Any] = {}
    for beam in spec["beams"] if spec["check"] else []:
        results = translator.translate_batch(spec["check_texts"], beam_size=beam)
        check[str(beam)] = {
            "lengths": sorted({len(r.tokens[0]) for r in results}),
            "texts": [r.hypotheses[0] for r in results],
        }
    model = translator.model
    positions = options.positions(model.cfg.max_positions)
    sources = translator.source_ids(spec["texts"])
    breakdown = []
    # Where int8 is slow (no VNNI) only the server's own step, at its own batch, is timed.
    configs = [(BATCH, True)] if spec["slow"] else [(BATCH, True), (BATCH, False), (4 * BATCH, False)]
    with torch.inference_mode():
        batch = translator.batch(sources[:BATCH])
        encode_ms = thread_ms(lambda: model.source_kv(model.encode(batch)), 1, spec["repeats"])
        for rows, compiled in configs:
            ns = argparse.Namespace(capacity=rows, positions=positions, history=spec["history"])
            runner = (
                translator.runner
                if compiled
                else load_runner(model, top=16, capacity=rows, positions=positions, compile=False)
            )
            srcs = (sources * (rows // len(sources) + 1))[:rows]
            for beam in (False, True):
                entry = {
                    "rows": rows,
                    "runner": runner.kind,
                    "candidates_for": "every row (beam)" if beam else "none (greedy)",
                    "step_ms": step_ms(translator, runner, srcs, beam, ns, spec, thread_ms, filled_cache),
                }
                chosen = torch.arange(rows) if beam else torch.zeros(1, dtype=torch.long)
                entry.update(parts(model, rows, chosen, spec, thread_ms, argmax_rows, topk_rows))
                breakdown.append(entry)
    conn.send(
        {
            "check": check,
            "breakdown": breakdown,
            "encode_64_ms": encode_ms,
            "quantization": translator.quantization,
        }
    )


def step_ms(
    translator: Any,
    runner: Any,
    sources: list[list[int]],
    beam: bool,
    ns: argparse.Namespace,
    spec: dict[str, Any],
    thread_ms: Callable[..., float],
    filled_cache: Callable[..., Any],
) -> float:
    """A whole step (the runner, then the cache's advance) at ``len(sources)`` rows, ms; ``beam``:
    the candidates of every row asked for (beam search), else none (greedy)."""
    import torch

    rows = len(sources)
    cache = filled_cache(translator, runner, sources, ns)
    tokens = torch.full((rows,), 5, dtype=torch.long)
    chosen = torch.arange(rows) if beam else torch.zeros(1, dtype=torch.long)
    unforced = torch.zeros((len(chosen), 2), dtype=torch.long)  # no constraints: dummy columns (as decoding)

    def step() -> None:
        cache.advance(runner(tokens, *cache.views(), chosen, unforced)[4])
        cache.lengths[:rows] -= 1  # the same history at every call
        cache.max_length -= 1

    return thread_ms(step, spec["steps"], spec["repeats"])


def parts(
    model: Any,
    rows: int,
    chosen: Any,
    spec: dict[str, Any],
    thread_ms: Callable[..., float],
    argmax_rows: Callable[..., Any],
    topk_rows: Callable[..., Any],
) -> dict[str, float]:
    """The step's pieces timed alone at ``rows`` rows (ms)."""
    import torch

    d = model.cfg.d_model
    x, wide = torch.randn(rows, 1, d), torch.randn(rows, 1, model.cfg.d_ff)
    logits = model._logits(x)[:, 0].contiguous()
    linears = [
        (m, wide if m is layer.ff.fc2 else x)
        for layer in model.decoder
        for m in (layer.self_attn.qkv, layer.self_attn.out, layer.cross_attn.q, layer.cross_attn.out)
        + (layer.ff.fc1, layer.ff.fc2)
    ]

    def choice() -> None:  # DecodeStep's tail: every row's argmax, the candidates of the beam rows
        argmax_rows(logits, min_rows=0)
        r = logits.index_select(0, chosen)
        topk_rows(r, 16)
        most = r.amax(-1, keepdim=True)
        torch.log(torch.exp(r - most).sum(-1, keepdim=True))

    def other_linears() -> None:
        for m, inp in linears:
            m(inp)

    n, k = spec["steps"], spec["repeats"]
    return {
        "output_projection_ms": thread_ms(lambda: model._logits(x), n, k),
        "choice_ms": thread_ms(choice, n, k),
        "other_linears_ms": thread_ms(other_linears, n, k),
    }


def run_ours(spec: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=ours_process, args=(child, spec), daemon=True)
    process.start()
    try:
        result: dict[str, Any] = conn.recv()
    except EOFError:
        raise RuntimeError("the profiling process died") from None
    process.join(timeout=30)
    return result


def estimated_server(result: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    """Sentences/s of the server's workers (one per core, one thread each, 64 rows) if decoding took
    only what the step and the encoder take alone: length + 1 steps per sentence (ours also runs the
    step whose only allowed token is eos), all sentences the same length."""
    workers = len(os.sched_getaffinity(0))
    steps = {}  # beam -> ms of the server's step (compiled, 64 rows)
    for e in result["breakdown"]:
        if e["rows"] == BATCH and e["runner"] != "eager":
            greedy = e["candidates_for"].startswith("none")
            steps.update({b: e["step_ms"] for b in args.beams if (b == 1) == greedy})
    out = {}
    for beam, ms in steps.items():
        sentences = BATCH // beam
        seconds = (result["encode_64_ms"] * sentences / BATCH + (args.length + 1) * ms) / 1000
        out[str(beam)] = round(workers * sentences / seconds, 2)
    return out


def breakdown_table(entries: list[dict[str, Any]]) -> str:
    lines = [
        "| rows | runner | candidates | step ms | output projection ms (share) | choice ms "
        "| other linears ms | rest ms |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for e in entries:
        proj, choice, lin, step = (
            e["output_projection_ms"],
            e["choice_ms"],
            e["other_linears_ms"],
            e["step_ms"],
        )
        lines.append(
            f"| {e['rows']} | {e['runner']} | {e['candidates_for']} | {step:.1f} "
            f"| {proj:.1f} ({proj / step:.0%}) "
            f"| {choice:.1f} | {lin:.1f} | {max(0.0, step - proj - choice - lin):.1f} |"
        )
    return "\n".join(lines)
