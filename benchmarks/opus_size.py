"""Real-size speed: a model of OPUS-MT's size, our server against CTranslate2 at the same precision.

The model (``benchmarks.opus_model``; made once, kept in ``--work``): a ``transformers``
MarianMTModel of OPUS-MT's shape (6+6 layers, d_model 512, 8 heads, FFN 2048: ~74M parameters,
58,101 pieces, the output projection 512 x 58,101 as in OPUS-MT) with random weights (seed
``--seed``) and a MarianTokenizer trained on Multi30k's training text. ``final_logits_bias[eos]`` is
-1e4, so neither engine ever ends a sentence early: every output is exactly ``--length`` tokens in
both (CTranslate2 also gets min_decoding_length = max_decoding_length), and random weights cannot
make one engine's sentences shorter than the other's. Converted for us by ``model.convert.marian``
and for CTranslate2 by ``TransformersConverter`` (float32 and int8).

For each precision (float32: our NMT_QUANTIZATION=none against CTranslate2 compute_type float32;
int8: ours against CTranslate2's int8), ``--runs`` times per beam (greedy and beam 4):

1. CTranslate2 ``translate_batch`` over the first ``--limit`` test_2016 sentences, text to text,
   ``max_batch_size`` 64, ``max_decoding_length = min_decoding_length = --length`` (which does not
   count eos), in both thread layouts (2x1: two batches at a time on one thread each; 1x2: one batch
   on two threads), each in its own process (``benchmarks.opus_engines``), while the server sits
   idle; every hypothesis is checked to be ``--length`` tokens;
2. our server as deployed (``benchmarks.load.serve``: uvicorn, its default two workers of one
   thread) with NMT_MAX_OUTPUT_TOKENS = NMT_MAX_LENGTH_B = length + 1 (ours counts eos) and
   NMT_MAX_LENGTH_A = 0: ``wrk`` with ``--connections`` connections for ``--duration`` seconds after
   ``--warmup``, one sentence per request (``beam_size`` in the body).

Also: the server's start-up (to /health/ready; a cold start compiles the decoding step, a warm one
loads it from ``--work``/compile) against CTranslate2's ``Translator`` construction; the resident
memory of the server's processes after warm-up against each CTranslate2 process's; the weights'
size; and, in a process of its own on one thread (what a server worker has; also
``benchmarks.opus_engines``), where a decoding step's time goes at 64 rows (the server's running
batch: 64 greedy rows or 16 sentences x beam 4) and at 256 rows (CTranslate2's batch of 64 sentences
x beam 4): the output projection (512 x 58,101) alone, the token choice over 58,101 logits, the
other linear layers, and the whole step. Our library, loaded with the server's settings, checks that
our outputs are ``--length`` tokens and the same text as the server's for a few sentences.

This module runs the server (start-up, ``wrk``, latency, memory) and drives the engines' processes;
the model is ``benchmarks.opus_model``'s, the engines' own processes (CTranslate2's, and our
library's check and step profile) ``benchmarks.opus_engines``'s, what was measured and its tables
``benchmarks.opus_report``'s (printed, and ``--json``).

    .venv/bin/python -m benchmarks.opus_size --json benchmarks/results/opus_size.json
    .venv/bin/python -m benchmarks.opus_size --precisions float32 --profile-steps 0 --runs 3

The first took 20 min on a busy 2-vCPU AVX2 EPYC, two cold compiles of the step included (the
server's, ~70 s; the int8 step's for the profile); a second run, caches warm, takes less. A
precision left out of ``--server-precisions`` gets a rate estimated from the step's time
(``benchmarks.opus_engines.estimated_server``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from app.serving.worker.process import IDLE_RELEASE_S
from benchmarks.common import DATA, cpu_busy_seconds
from benchmarks.load import (
    Server,
    cpu_seconds,
    machine,
    process_tree,
    pss_mib,
    run_wrk,
    serve,
    wait_idle,
    write_bodies,
)
from benchmarks.opus_engines import (
    BATCH,
    CT2Worker,
    breakdown_table,
    estimated_server,
    run_ours,
    status_mib,
)
from benchmarks.opus_model import VOCAB, convert_ct2, convert_ours, make_hf_model, parameters, size_mib
from benchmarks.opus_report import Point, Report, markdown
from training.data import read_lines

PRECISIONS = {"float32": ("none", "float32"), "int8": ("int8", "int8")}  # ours, CTranslate2's
CHECK_SENTENCES = 4  # compared between the server and the library
REQUEST_TIMEOUT_S = 600.0


# -- memory -----------------------------------------------------------------------------------------
def server_memory(pid: int) -> dict[str, Any]:
    """Resident memory of the server's processes: each (its command line shortened), the sum, PSS."""
    processes = []
    for p in process_tree(pid):
        try:
            cmd = (
                Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            )
        except OSError:
            continue
        processes.append(
            {"pid": p, "cmd": cmd[:100], "rss_mib": status_mib(p, "VmRSS"), "hwm_mib": status_mib(p, "VmHWM")}
        )
    return {
        "processes": processes,
        "rss_mib_total": sum(p["rss_mib"] for p in processes),
        "hwm_mib_total": sum(p["hwm_mib"] for p in processes),  # each process's peak, summed
        "pss_mib_total": pss_mib(pid),
    }


class Others:
    """The share of the machine's CPUs that processes other than ours (this one, the server's and
    CTranslate2's; wrk counts as other) took meanwhile: on a shared machine they slow the engines."""

    def __init__(self, roots: list[int]) -> None:
        self.roots = roots
        self.fraction: float | None = None

    def ours(self) -> float:
        return sum(cpu_seconds(p) for root in self.roots for p in process_tree(root))

    def __enter__(self) -> Others:
        self.busy, self.own, self.wall = cpu_busy_seconds(), self.ours(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy, own = cpu_busy_seconds(), self.ours()
        if self.busy is not None and busy is not None:
            capacity = (time.perf_counter() - self.wall) * len(os.sched_getaffinity(0))
            self.fraction = max(0.0, (busy - self.busy) - (own - self.own)) / capacity


# -- the measurement --------------------------------------------------------------------------------
def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + "/translate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


@contextmanager
def started_server(
    env: dict[str, str], log: Path, cache_dir: Path, startup: dict[str, Any], precision: str
) -> Iterator[Server]:
    """``serve`` until ready, timed; a start that compiled the step (cold) is followed by a second,
    warm one (what a restart costs), which is the one measured."""
    for attempt in range(2):
        before = set(cache_dir.rglob("*.pt2")) if cache_dir.exists() else set()
        started = time.perf_counter()
        with serve(env, log) as server:
            ready = time.perf_counter() - started
            cold = bool(set(cache_dir.rglob("*.pt2")) - before)
            startup["server_cold_s" if cold else "server_warm_s"] = ready
            print(f"[{precision}] server ready in {ready:.1f} s ({'compiled' if cold else 'cached step'})")
            if cold and attempt == 0:
                continue
            yield server
            return


def measure_precision(
    precision: str, dirs: dict[str, Path], texts: list[str], args: argparse.Namespace, report: Report
) -> None:
    quantization, compute_type = PRECISIONS[precision]
    hf_dir = dirs["hf"]
    workers: dict[str, CT2Worker] = {}
    for layout in args.ct2_threads:
        inter, intra = (int(x) for x in layout.split("x"))
        spec = {
            "dir": str(dirs[f"ct2-{precision}"]),
            "compute_type": compute_type,
            "inter": inter,
            "intra": intra,
            "length": args.length,
            "max_input_length": 251,  # ours: 250 source tokens and eos (DecodeOptions' default)
            "source_spm": str(hf_dir / "source.spm"),
            "target_spm": str(hf_dir / "target.spm"),
        }
        workers[layout] = CT2Worker(spec)
        print(
            f"[{precision}] CTranslate2 {layout}: Translator in {workers[layout].started['load_s']:.2f} s",
            flush=True,
        )
    cache_dir = args.work / "compile"
    env = {
        "NMT_MODEL_DIR": str(dirs["ours"]),
        "NMT_QUANTIZATION": quantization,
        "NMT_MAX_OUTPUT_TOKENS": str(args.length + 1),  # ours counts eos, CTranslate2's max does not
        "NMT_MAX_LENGTH_A": "0",
        "NMT_MAX_LENGTH_B": str(args.length + 1),
        "NMT_COMPILE_CACHE_DIR": str(cache_dir),
        # A request waits for the 63 others before it at 64 connections: at this size that can
        # take longer than the default 30 s on 2 cores (int8 on AVX2 above all): no 504s.
        "NMT_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        **dict(kv.split("=", 1) for kv in args.server_env),
    }
    startup: dict[str, Any] = {"ct2_translator_s": {t: w.started["load_s"] for t, w in workers.items()}}
    memory: dict[str, Any] = {}
    server_texts: dict[str, list[str]] = {}
    with_server = precision in args.server_precisions
    try:
        started = started_server(env, args.log_dir / f"{precision}.log", cache_dir, startup, precision)
        with started if with_server else nullcontext(None) as server:
            for beam in args.beams:
                if server is not None:
                    server_texts[str(beam)] = post(
                        server.url,
                        {"q": texts[:CHECK_SENTENCES], "source": "de", "target": "en", "beam_size": beam},
                    )["translatedText"]
                bodies = write_bodies(texts, args.log_dir / f"bodies-{beam}.jsonl", beam=beam)
                for w in workers.values():  # warm-up
                    w(texts[:BATCH], beam)
                for run in range(args.runs):
                    roots = [os.getpid()]  # the server and CTranslate2 are its children
                    with Others(roots) as ct2_load:
                        ct2 = {t: w(texts, beam) for t, w in workers.items()}
                    point = Point(precision, beam, run, None, 0, {}, ct2, {"ct2": ct2_load.fraction})
                    if server is not None:
                        wrk = partial(
                            run_wrk,
                            server.url,
                            bodies,
                            connections=args.connections,
                            timeout_s=REQUEST_TIMEOUT_S,
                        )
                        wrk(duration_s=args.warmup)
                        if "server" not in memory:
                            memory["server"] = server_memory(server.process.pid)
                        with Others(roots) as server_load:
                            r = wrk(duration_s=args.duration)
                        wait_idle(server)
                        point.server = r.answered_per_s
                        point.errors = r.requests - r.count(200) + sum(r.socket_errors.values())
                        point.latency_ms = r.latency_ms
                        point.other_load["server"] = server_load.fraction
                    report.points.append(point)
                    print(
                        f"[{precision}] beam {beam} run {run + 1}: server "
                        + ("not run" if point.server is None else f"{point.server:.1f}/s")
                        + ", CT2 "
                        + ", ".join(f"{t} {v:.1f}" for t, v in ct2.items())
                        + ("" if point.ratio is None else f" -> {point.ratio:.2f}x (errors {point.errors})")
                        + "; other processes took "
                        + ", ".join(f"{k} {v:.0%}" for k, v in point.other_load.items() if v is not None),
                        flush=True,
                    )
                if server is not None and args.latency_sentences:
                    sample = texts[: args.latency_sentences]
                    ct2_p50 = {t: w.latency_ms(sample, beam) for t, w in workers.items()}
                    one = write_bodies(sample, args.log_dir / f"latency-{beam}.jsonl", beam=beam)
                    r = run_wrk(server.url, one, connections=1, threads=1, duration_s=args.latency_duration)
                    best = min(ct2_p50, key=lambda t: ct2_p50[t])
                    report.latency[f"{precision}/{beam}"] = {
                        "ours_p50_ms": r.latency_ms["p50"],
                        "ct2_p50_ms": ct2_p50[best],
                        "ct2_threads": best,
                    }
                    print(
                        f"[{precision}] beam {beam}: one request at a time, p50 ours "
                        f"{r.latency_ms['p50']:.1f} ms, CT2 {ct2_p50[best]:.1f} ms ({best})",
                        flush=True,
                    )
            if server is not None:
                memory["server_after"] = server_memory(server.process.pid)
                # Idle a while: the workers give back what the runs' peaks left in their heaps
                # (app.serving.worker.IDLE_RELEASE_S).
                time.sleep(IDLE_RELEASE_S + 2)
                memory["server_idle"] = server_memory(server.process.pid)
        memory["ct2"] = {
            t: {
                "rss_mib": w.last["rss_mib"],
                "hwm_mib": w.last["hwm_mib"],
                "rss_after_load_mib": w.started["rss_mib"],
            }
            for t, w in workers.items()
        }
    finally:
        for w in workers.values():
            w.close()
    report.startup[precision] = startup
    report.memory[precision] = memory
    if args.profile:
        print(f"[{precision}] profiling a decoding step (one thread)...", flush=True)
        result = run_ours(
            {
                "model": str(dirs["ours"]),
                "quantization": quantization,
                "length": args.length,
                "cache_dir": str(cache_dir),
                "beams": args.beams,
                "check": with_server,
                "check_texts": texts[:CHECK_SENTENCES],
                "texts": texts[: 4 * BATCH],
                "history": 12,
                "slow": False,
                "steps": args.profile_steps,
                "repeats": 5,
            }
        )
        for beam, got in result["check"].items():
            if got["lengths"] != [args.length]:
                raise AssertionError(
                    f"ours (beam {beam}) produced lengths {got['lengths']}, not {args.length}"
                )
            if got["texts"] != server_texts.get(beam, got["texts"]):
                raise AssertionError(f"the server's beam-{beam} translations differ from the library's")
        estimate = estimated_server(result, args)
        report.profile[precision] = {
            "breakdown": result["breakdown"],
            "encode_64_ms": result["encode_64_ms"],
            "estimated_server_sentences_per_s": estimate,
            "checked_sentences": {b: len(texts[:CHECK_SENTENCES]) for b in result["check"]},
        }
        print(breakdown_table(result["breakdown"]), flush=True)
        print(
            f"[{precision}] encoding 64 sentences: {result['encode_64_ms']:.0f} ms; the server's "
            f"sentences/s as the step's time implies: {estimate}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "nmt-opus-size",
        help="generated models, kept",
    )
    p.add_argument(
        "--data", type=Path, default=DATA, help="Multi30k (train.{de,en}.gz, test_2016_flickr.de.gz)"
    )
    p.add_argument("--limit", type=int, default=128, help="first N test_2016 sentences")
    p.add_argument("--length", type=int, default=24, help="output tokens per sentence, eos not counted")
    p.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    p.add_argument(
        "--server-precisions",
        nargs="+",
        choices=list(PRECISIONS),
        help="precisions at which our server is measured with wrk (default: all; the others' rates "
        "are estimated from the step's time)",
    )
    p.add_argument("--beams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per wrk point")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each point")
    p.add_argument(
        "--latency-sentences", type=int, default=32, help="single-request p50 over these (0: none)"
    )
    p.add_argument("--latency-duration", type=float, default=10.0, help="seconds of one wrk connection")
    p.add_argument("--ct2-threads", nargs="+", default=["2x1", "1x2"], help="inter x intra threads")
    p.add_argument(
        "--profile-steps", type=int, default=10, help="steps per timing in the breakdown (0: none)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--server-env",
        nargs="*",
        default=[],
        help="NMT_X=value settings of the server (e.g. NMT_WORKER_PROCESSES=1)",
    )
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-opus-size-logs")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.profile = args.profile_steps > 0
    if args.server_precisions is None:
        args.server_precisions = list(args.precisions)
    args.work.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    dirs = {"hf": make_hf_model(args.work / "hf", args.data, args.seed)}
    dirs["ours"] = convert_ours(dirs["hf"], args.work / "ours")
    for precision in args.precisions:
        dirs[f"ct2-{precision}"] = convert_ct2(
            dirs["hf"], args.work / f"ct2-{precision}", PRECISIONS[precision][1]
        )
    print(f"models ready in {time.perf_counter() - started:.0f} s", flush=True)
    texts = read_lines(args.data / "test_2016_flickr.de.gz")[: args.limit]
    report = Report(sizes={name: round(size_mib(d), 1) for name, d in dirs.items()})
    for precision in args.precisions:
        measure_precision(precision, dirs, texts, args, report)
    print()
    print(markdown(report, args.length))
    print(json.dumps({"startup": report.startup, "sizes_mib": report.sizes}, indent=1))
    if args.json:
        import ctranslate2
        import torch
        import transformers

        data = {
            "environment": {
                **machine(),
                "torch": torch.__version__,
                "ctranslate2": ctranslate2.__version__,
                "transformers": transformers.__version__,
            },
            "command": " ".join(
                ["python -m benchmarks.opus_size", *(argv if argv is not None else sys.argv[1:])]
            ),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "model": {"vocab": VOCAB, "parameters": parameters(dirs["hf"])},
            "points": [asdict(x) | {"ratio": x.ratio} for x in report.points],
            "startup": report.startup,
            "memory": report.memory,
            "latency": report.latency,
            "sizes_mib": report.sizes,
            "profile": report.profile,
            "wall_s": time.perf_counter() - started,
        }
        args.json.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
