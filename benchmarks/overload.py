"""Overload: does the server keep answering at capacity while it sheds the excess?

For each scenario a server is started as deployed (``uvicorn app.main:app``, ``benchmarks.load``)
and ``wrk`` posts one test_2016 sentence per request (greedy) from a closed loop of N connections,
each sending its next request as soon as its previous one is answered (503s included, without
honouring Retry-After: the worst client). Meanwhile two probes ask what a newcomer sees: ``GET
/health`` and one ``POST /translate``, each on a new connection every 0.25 s.

1. **capacity**: the default server at 64 and 256 connections, where nothing is refused; its
   saturated throughput is the best of those (successful translations per second).
2. **overload** points, each against its own server: the default settings at 2,048 connections,
   and ``NMT_MAX_QUEUE=128 NMT_REQUEST_TIMEOUT_S=10`` at 512 (by default; ``--overload``).

Reported per point: translations/s and the ratio to the capacity, answers by status (and 503s
without Retry-After), wrk's socket errors (``timeout`` counts answers slower than wrk's 60 s
limit), latency of all answers, the newcomer's /health and /translate latencies, and the CPU the
front end and the workers used (cores). The targets: at overload >= 0.9 x capacity, only 200s and
503s (with Retry-After), no socket error, /health < 1 s throughout.

    .venv/bin/python -m benchmarks.overload --json overload.json          # ~5 min on 2 cores
    .venv/bin/python -m benchmarks.overload --repo ../before --uvicorn-args=--no-access-log  # elsewhere
    .venv/bin/python -m benchmarks.overload --duration 5 --capacity 64 --overload 512:NMT_MAX_QUEUE=64
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import DATA, DEFAULT_MODEL, REPO
from benchmarks.load import (
    UVICORN,
    Probe,
    ProbeResult,
    Server,
    WrkResult,
    cpu_seconds,
    machine,
    peak_rss_mib,
    process_tree,
    run_wrk,
    serve,
    wait_idle,
    write_bodies,
)
from training.data import read_lines

PROBE_BODY = b'{"q": "Ein Hund rennt durch den Schnee.", "source": "de", "target": "en", "beam_size": 1}'


@dataclass
class Point:
    scenario: str
    settings: dict[str, str]
    wrk: WrkResult
    health: ProbeResult
    newcomer: ProbeResult  # POST /translate on a new connection
    frontend_cores: float
    worker_cores: float
    peak_rss_mib: float
    ratio: float | None = None  # translations/s over the capacity


def measure(
    server: Server,
    scenario: str,
    settings: dict[str, str],
    bodies: Path,
    args: argparse.Namespace,
    connections: int,
) -> Point:
    run_wrk(server.url, bodies, connections=connections, duration_s=args.warmup)  # not counted
    wait_idle(server)
    pids = process_tree(server.process.pid)
    before = {p: cpu_seconds(p) for p in pids}
    started = time.perf_counter()
    with Probe(server.url, "/health") as health, Probe(server.url, "/translate", PROBE_BODY) as newcomer:
        result = run_wrk(server.url, bodies, connections=connections, duration_s=args.duration)
    wall = time.perf_counter() - started
    used = {p: cpu_seconds(p) - before[p] for p in pids}
    front = used.pop(server.process.pid)
    point = Point(
        scenario=scenario,
        settings=settings,
        wrk=result,
        health=health.result(),
        newcomer=newcomer.result(),
        frontend_cores=front / wall,
        worker_cores=sum(used.values()) / wall,
        peak_rss_mib=peak_rss_mib(server.process.pid),
    )
    wait_idle(server)
    print(row(point), flush=True)
    return point


def parse_overload(spec: str) -> tuple[int, dict[str, str]]:
    """``"512:NMT_MAX_QUEUE=128,NMT_REQUEST_TIMEOUT_S=10"`` -> (512, {...})."""
    connections, _, env = spec.partition(":")
    settings = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    return int(connections), settings


def fmt_statuses(statuses: dict[int, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(statuses.items()))


def newcomer(probe: ProbeResult) -> str:
    """``200: 12 x, p50 / max ms; 503: ...``"""
    return "; ".join(
        f"{status}: {n} x {probe.latency_ms_by_status[status]['p50']:.0f} / "
        f"{probe.latency_ms_by_status[status]['max']:.0f}"
        for status, n in sorted(probe.statuses.items())
    ) + (f"; {probe.failures} unanswered" if probe.failures else "")


def row(p: Point) -> str:
    w = p.wrk
    errors = sum(w.socket_errors.values())
    other = sum(n for s, n in w.statuses.items() if s not in (200, 503))
    settings = " ".join(f"{k}={v}" for k, v in p.settings.items()) or "defaults"
    ratio = "" if p.ratio is None else f"{p.ratio:.2f}"
    return (
        f"| {p.scenario} | {settings} | {w.connections} | {w.answered_per_s:.1f} | {ratio} | "
        f"{w.count(200)} | {w.count(503)} | {other} | {w.busy_without_retry_after} | {errors} | "
        f"{w.latency_ms['p50']:.0f} / {w.latency_ms['p99']:.0f} | "
        f"{newcomer(p.newcomer)} | "
        f"{p.health.latency_ms.get('p99', 0):.0f} / {p.health.latency_ms.get('max', 0):.0f}"
        f"{'' if not p.health.failures else f' ({p.health.failures} failed)'} | "
        f"{p.frontend_cores:.2f} / {p.worker_cores:.2f} |"
    )


HEADER = (
    "| scenario | settings | connections | translations/s | x capacity | 200 | 503 | other | 503 without "
    "Retry-After | socket errors | latency p50 / p99 ms | newcomer /translate: status: n x p50 / max ms | "
    "/health p99 / max ms | CPU front end / workers (cores) |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--src", type=Path, default=DATA / "test_2016_flickr.de.gz")
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout whose server is measured")
    p.add_argument("--label", default="", help="a name for this run in the report")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured per point")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each point")
    p.add_argument("--capacity", type=int, nargs="+", default=[64, 256], help="connections, default server")
    p.add_argument(
        "--overload",
        nargs="*",
        default=["2048", "512:NMT_MAX_QUEUE=128,NMT_REQUEST_TIMEOUT_S=10"],
        help="CONNECTIONS[:VAR=VALUE,...] per overload point, each with its own server",
    )
    p.add_argument("--env", nargs="*", default=[], help="VAR=VALUE for every server (e.g. NMT_REPLICAS=1)")
    p.add_argument(
        "--uvicorn-args",
        default=None,
        help="uvicorn's options, one string (default: as deployed, app.http.connections.SERVE_OPTIONS)",
    )
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common = {"NMT_MODEL_DIR": str(args.model.resolve()), **dict(kv.split("=", 1) for kv in args.env)}
    uvicorn = (
        UVICORN
        if args.uvicorn_args is None
        else ["-m", "uvicorn", "app.main:app", *shlex.split(args.uvicorn_args)]
    )
    points: list[Point] = []
    with tempfile.TemporaryDirectory(prefix="nmt-overload-") as tmp:
        bodies = write_bodies(read_lines(args.src), Path(tmp) / "bodies.jsonl", beam=1)
        print(HEADER, flush=True)
        if args.capacity:
            with serve(common, Path(tmp) / "capacity.log", repo=args.repo, uvicorn=uvicorn) as server:
                points += [measure(server, "capacity", {}, bodies, args, c) for c in args.capacity]
        for spec in args.overload:
            connections, settings = parse_overload(spec)
            log = Path(tmp) / f"overload-{len(points)}.log"
            with serve({**common, **settings}, log, repo=args.repo, uvicorn=uvicorn) as server:
                points.append(measure(server, "overload", settings, bodies, args, connections))
    capacity = max((p.wrk.answered_per_s for p in points if p.scenario == "capacity"), default=None)
    for point in points:
        point.ratio = None if not capacity else point.wrk.answered_per_s / capacity
    print(f"\n{args.label} capacity: {capacity or 0:.1f} translations/s; {machine()}\n")
    print(HEADER)
    for point in points:
        print(row(point))
    if args.json:
        report: dict[str, Any] = {
            "label": args.label,
            "machine": machine(),
            "repo": str(args.repo),
            "uvicorn": uvicorn,
            "duration_s": args.duration,
            "capacity": capacity,
            "points": [asdict(p) for p in points],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
