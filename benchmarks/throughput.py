"""The server against CTranslate2 on the same weights, in one command: sentences/s and latency.

For each server configuration (``name:NMT_VAR=value,...``; default: the service's defaults) the
script starts the server as it is deployed (``benchmarks.load.serve``: uvicorn, loopback, ready on
``/health/ready``) and, ``--runs`` times in turn:

1. the reference: CTranslate2 ``translate_batch`` over the same sentences (test_2016_flickr, 1,000
   German sentences), text to text, ``max_batch_size=64``, float32 weights exported from our model
   (``model.export_ctranslate2``), run in float32 or int8 (``--ct2-compute-type``), in each thread
   configuration of ``--ct2-threads``
   (inter × intra; ``2x1``: two batches at a time on one thread each, ``1x2``: one batch on two
   threads), each in its own process, while the server sits idle;
2. the server: ``wrk`` (Debian package; ``benchmarks/wrk/translate.lua`` posts one sentence per
   request) with ``--connections`` keep-alive connections for ``--duration`` seconds after
   ``--warmup`` seconds not counted. wrk is C: its event loop takes a few percent of a core where a
   Python client took a third of one from the server it measured. Meanwhile the CPU time of the
   front end (the uvicorn process: HTTP, parsing, the scheduler, pipes) and of its model workers
   (its child processes), each divided by the requests answered: CPU-us per request.

The server runs with ``NMT_SEGMENT_CACHE_MB=0`` unless a configuration sets it (``load.serve``, which
also fails the run if any sentence was answered from the cache): wrk cycles over the same 1,000
sentences, which the segment cache would answer from memory after the first pass (CTranslate2
decodes every one).

Then, once per configuration, single-request latency: one wrk connection (each request waits for
the previous answer) for ``--latency-duration`` seconds, against CTranslate2 translating the same
sentences one at a time (``translate_batch`` of one, text to text), measured first, while the
server sits idle: float32 and int8 (what LibreTranslate serves), each in its better thread
configuration for a batch of one (1 x 2: 2 x 1 runs a batch of one on one thread). Ratios are
taken against the reference measured in the same run (these machines move by ±15% between runs);
the report gives each run's ratio and their median.

    .venv/bin/python -m benchmarks.throughput --json throughput.json           # ~12 min on 2 cores
    .venv/bin/python -m benchmarks.throughput --runs 1 --duration 10 --beams 1  # ~2 min
    .venv/bin/python -m benchmarks.throughput --configs default f32:NMT_QUANTIZATION=none \\
        eager:NMT_COMPILE=false --runs 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ctranslate2
import torch

from benchmarks.common import DATA, DEFAULT_MODEL, REPO
from benchmarks.engine import Worker
from benchmarks.load import (
    CpuMeter,
    Server,
    machine,
    run_wrk,
    serve,
    wait_idle,
    write_bodies,
)
from model.export_ctranslate2 import export
from training.data import read_lines

BATCH = 64  # CTranslate2's max_batch_size, and the server's default running batch


@dataclass
class Point:
    config: str
    beam: int
    run: int
    server: float  # translations/s (200 answers)
    errors: int  # non-200 answers and socket errors
    front_end_us: float  # CPU-us of the front-end process per answered request
    workers_us: float  # CPU-us of the model workers (all of them) per answered request
    latency_ms: dict[str, float]
    ct2: dict[str, float]  # thread configuration -> sentences/s, measured just before

    @property
    def ratio(self) -> float:
        """Against CTranslate2's better thread configuration in this run."""
        return self.server / max(self.ct2.values())


@dataclass
class Latency:
    config: str
    beam: int
    server_p50_ms: float
    server_p99_ms: float
    ct2_p50_ms: float  # float32, its better thread configuration
    ct2_threads: str
    ct2_int8_p50_ms: float  # int8 (LibreTranslate's), its better thread configuration
    ct2_int8_threads: str

    @property
    def ratio(self) -> float:
        return self.server_p50_ms / self.ct2_p50_ms

    @property
    def int8_ratio(self) -> float:
        return self.server_p50_ms / self.ct2_int8_p50_ms


@dataclass
class Report:
    points: list[Point] = field(default_factory=list)
    latencies: list[Latency] = field(default_factory=list)
    ct2_compute_type: str = "float32"  # CTranslate2's precision in the throughput reference


def parse_config(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return name, env


def ct2_workers(ct2_dir: Path, threads: list[str], compute_type: str = "float32") -> dict[str, Worker]:
    workers = {}
    for t in threads:
        inter, intra = (int(x) for x in t.split("x"))
        spec = {
            "ct2_dir": str(ct2_dir),
            "threads": intra,
            "inter_threads": inter,
            "device": "cpu",
            "ct2_compute_type": compute_type,
            "max_length": 256,
        }
        workers[t] = Worker("ctranslate2", spec)
    return workers


def ct2_latency(worker: Worker, texts: list[str], beam: int) -> float:
    """p50 ms of CTranslate2 translating each sentence alone."""
    return 1000 * statistics.median(worker(texts, beam, 1).latencies)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--repo", type=Path, default=REPO, help="run the server from this checkout (before/after)")
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--limit", type=int, default=None, help="first N sentences only")
    p.add_argument("--configs", nargs="+", default=["default"], help="name:NMT_VAR=value,... per server")
    p.add_argument("--beams", type=int, nargs="+", default=[1, 5])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per wrk point")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each point")
    p.add_argument("--ct2-threads", nargs="+", default=["2x1", "1x2"], help="inter x intra threads")
    p.add_argument(
        "--ct2-compute-type",
        choices=["float32", "int8"],
        default="float32",
        help="CTranslate2's precision for the throughput reference (latency: both)",
    )
    p.add_argument("--latency-sentences", type=int, default=200, help="0: no latency measurement")
    p.add_argument("--latency-duration", type=float, default=10.0)
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-throughput")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    texts = read_lines(args.src)[: args.limit]
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        ct2_dir = export(args.model, Path(tmp) / "ct2", quantization="float32")
        workers = ct2_workers(ct2_dir, args.ct2_threads)
        wanted_int8 = args.latency_sentences or args.ct2_compute_type == "int8"
        int8_workers = ct2_workers(ct2_dir, args.ct2_threads, "int8") if wanted_int8 else {}
        reference = int8_workers if args.ct2_compute_type == "int8" else workers
        report.ct2_compute_type = args.ct2_compute_type
        try:
            for spec in args.configs:
                name, env = parse_config(spec)
                env = {"NMT_MODEL_DIR": str(args.model), **env}
                started = time.perf_counter()
                with serve(env, args.log_dir / f"{name}.log", repo=args.repo.resolve()) as server:
                    print(f"[{name}] ready in {time.perf_counter() - started:.1f} s", flush=True)
                    for beam in args.beams:
                        bodies = write_bodies(texts, Path(tmp) / f"bodies-{beam}.jsonl", beam=beam)
                        for w in reference.values():  # warm-up
                            w(texts[:BATCH], beam, BATCH)
                        for run in range(args.runs):
                            ct2 = {
                                t: len(texts) / w(texts, beam, BATCH).seconds for t, w in reference.items()
                            }
                            run_wrk(server.url, bodies, connections=args.connections, duration_s=args.warmup)
                            meter = CpuMeter(server.process.pid)
                            r = run_wrk(
                                server.url, bodies, connections=args.connections, duration_s=args.duration
                            )
                            front_end_us, workers_us = meter.per_request_us(r.count(200))
                            wait_idle(server)
                            point = Point(
                                name,
                                beam,
                                run,
                                r.answered_per_s,
                                r.requests - r.count(200) + sum(r.socket_errors.values()),
                                front_end_us,
                                workers_us,
                                r.latency_ms,
                                ct2,
                            )
                            report.points.append(point)
                            print(
                                f"[{name}] beam {beam} run {run + 1}: server {point.server:.1f}/s, CT2 "
                                + ", ".join(f"{t} {v:.1f}" for t, v in ct2.items())
                                + f" -> {point.ratio:.2f}x (errors {point.errors}); CPU-us/request front end "
                                + f"{point.front_end_us:.0f}, workers {point.workers_us:.0f}",
                                flush=True,
                            )
                        if args.latency_sentences:
                            report.latencies.append(
                                latency(name, server, workers, int8_workers, texts, beam, args, Path(tmp))
                            )
                            print(f"[{name}] beam {beam}: {report.latencies[-1]}", flush=True)
        finally:
            for w in [*workers.values(), *int8_workers.values()]:
                w.close()
    print()
    print(markdown(report))
    if args.json:
        env_info = {**machine(), "torch": torch.__version__, "ctranslate2": ctranslate2.__version__}
        data = {
            "environment": env_info,
            "ct2_compute_type": report.ct2_compute_type,
            "points": [asdict(x) | {"ratio": x.ratio} for x in report.points],
            "latencies": [
                asdict(x) | {"ratio": x.ratio, "int8_ratio": x.int8_ratio} for x in report.latencies
            ],
        }
        args.json.write_text(json.dumps(data, indent=2))


def latency(
    name: str,
    server: Server,
    workers: dict[str, Worker],
    int8_workers: dict[str, Worker],
    texts: list[str],
    beam: int,
    args: Any,
    tmp: Path,
) -> Latency:
    """The server's p50/p99 on one connection; CTranslate2's batch-1 p50 measured just before,
    while the server sits idle (so that neither shares the cores with the other)."""
    sample = texts[: args.latency_sentences]
    wait_idle(server)
    best = {t: ct2_latency(w, sample, beam) for t, w in workers.items()}
    best_int8 = {t: ct2_latency(w, sample, beam) for t, w in int8_workers.items()}
    bodies = write_bodies(sample, tmp / f"latency-{beam}.jsonl", beam=beam)
    r = run_wrk(server.url, bodies, connections=1, threads=1, duration_s=args.latency_duration)
    threads = min(best, key=lambda t: best[t])
    int8 = min(best_int8, key=lambda t: best_int8[t])
    return Latency(
        name, beam, r.latency_ms["p50"], r.latency_ms["p99"], best[threads], threads, best_int8[int8], int8
    )


def markdown(report: Report) -> str:
    lines = [
        "| config | beam | server sentences/s (median, min–max) "
        f"| CT2 {report.ct2_compute_type} best (median) | server / CT2 per run | median ratio "
        "| CPU-us/request: front end, workers (median) |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    keys = list(dict.fromkeys((p.config, p.beam) for p in report.points))
    for config, beam in keys:
        ps = [p for p in report.points if (p.config, p.beam) == (config, beam)]
        server = [p.server for p in ps]
        best = [max(p.ct2.values()) for p in ps]
        lines.append(
            f"| {config} | {beam} | {statistics.median(server):.1f} ({min(server):.1f}–{max(server):.1f}) "
            f"| {statistics.median(best):.1f} | {', '.join(f'{p.ratio:.2f}' for p in ps)} "
            f"| **{statistics.median(p.ratio for p in ps):.2f}×** "
            f"| {statistics.median(p.front_end_us for p in ps):.0f}, "
            f"{statistics.median(p.workers_us for p in ps):.0f} |"
        )
    if report.latencies:
        lines += [
            "",
            "| config | beam | server p50 / p99 ms (1 connection) | CT2 float32 batch-1 p50 ms | ratio "
            "| CT2 int8 batch-1 p50 ms | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for lat in report.latencies:
            lines.append(
                f"| {lat.config} | {lat.beam} | {lat.server_p50_ms:.1f} / {lat.server_p99_ms:.1f} "
                f"| {lat.ct2_p50_ms:.1f} ({lat.ct2_threads}) | {lat.ratio:.2f}× "
                f"| {lat.ct2_int8_p50_ms:.1f} ({lat.ct2_int8_threads}) | {lat.int8_ratio:.2f}× |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
