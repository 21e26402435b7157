"""Jobs kept in PostgreSQL against the SQLite default: how fast a job is made and polled.

Two servers of this checkout run at once, as deployed (``benchmarks.load.serve``): the default, its
jobs in SQLite files of its own ``NMT_DATA_DIR``, and one with ``--database-url`` (and
``--redis-url``, when given), its jobs in that PostgreSQL. In alternating rounds of ``--duration``
seconds, each server is polled by ``--pollers`` wrk connections, each asking for one of
``--pollers`` jobs (``GET /jobs/{id}``, as a client waiting for its job does), while one client makes
a job every ``--every`` seconds (``POST /jobs``, a one-sentence text file: translated in a moment,
so that decoding barely competes with the stores). Reported: the polls' p50 / p99 and rate, the
creates' p50 / p99, per server, over every round.

    .venv/bin/python -m benchmarks.job_polls --database-url postgresql://... --redis-url redis://...
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import DEFAULT_MODEL, cpu_name
from benchmarks.load import Server, run_wrk, serve

FORM = {"source": "de", "target": "en"}


def make_job(client: httpx.Client, text: str) -> tuple[str, float]:
    """A new job's id, and how long its POST took (ms)."""
    started = time.perf_counter()
    response = client.post("/jobs", data=FORM, files={"file": ("a.txt", text.encode())})
    took = (time.perf_counter() - started) * 1000
    response.raise_for_status()
    return str(response.json()["id"]), took


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def creating(client: httpx.Client, every_s: float, stop: threading.Event, took: list[float]) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        took.append(make_job(client, f"Ein Hund Nummer {n} läuft {time.time_ns()}.")[1])
        stop.wait(every_s)


def one_round(server: Server, client: httpx.Client, paths: Path, args: argparse.Namespace) -> dict[str, Any]:
    stop, took = threading.Event(), list[float]()
    creator = threading.Thread(target=creating, args=(client, args.every, stop, took))
    creator.start()
    try:
        r = run_wrk(
            server.url,
            paths,
            connections=args.pollers,
            duration_s=args.duration,
            variable="WRK_PATHS",
        )
    finally:
        stop.set()
        creator.join()
    assert set(r.statuses) == {200}, r.statuses  # every poll found its job
    return {"polls_per_s": r.requests / r.duration_s, "poll_ms": r.latency_ms, "create_ms": took}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--database-url", required=True, help="the PostgreSQL of the second server")
    parser.add_argument("--redis-url", help="its Redis (NMT_REDIS_URL), as deployed with several replicas")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--pollers", type=int, default=64)
    parser.add_argument("--duration", type=float, default=15.0)
    parser.add_argument("--every", type=float, default=0.1, help="seconds between two jobs made")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    shared_env = {"NMT_DATABASE_URL": args.database_url}
    if args.redis_url:
        shared_env["NMT_REDIS_URL"] = args.redis_url
    arms = {"SQLite (NMT_DATA_DIR)": {}, "PostgreSQL (NMT_DATABASE_URL)": shared_env}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        servers: dict[str, tuple[Server, httpx.Client, Path]] = {}
        for i, (name, env) in enumerate(arms.items()):
            base = {
                "NMT_MODEL_DIR": str(args.model),
                "NMT_DATA_DIR": f"{tmp}/data-{i}",
                "NMT_MAX_JOBS_PER_KEY": "100000",  # (every job here is the same client's)
                "NMT_MAX_JOBS": "100000",
                **env,
            }
            server = stack.enter_context(serve(base, Path(tmp) / f"server-{i}.log"))
            client = stack.enter_context(httpx.Client(base_url=server.url, timeout=60))
            ids = [make_job(client, f"Ein Hund wartet {j}.")[0] for j in range(args.pollers)]
            paths = Path(tmp) / f"paths-{i}.txt"
            paths.write_text("".join(f"/jobs/{job_id}\n" for job_id in ids))
            servers[name] = (server, client, paths)
        for _ in range(args.rounds):
            for name, (server, client, paths) in servers.items():
                results[name].append(one_round(server, client, paths, args))
    report(results, args)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(f"{cpu_name()}; {args.pollers} pollers, a job made every {args.every:g} s, {args.rounds} rounds")
    summary = {}
    for name, rounds in results.items():
        creates = [t for r in rounds for t in r["create_ms"]]
        summary[name] = {
            "polls_per_s": [round(r["polls_per_s"], 1) for r in rounds],
            "poll_p50_ms": [r["poll_ms"]["p50"] for r in rounds],
            "poll_p99_ms": [r["poll_ms"]["p99"] for r in rounds],
            "creates": len(creates),
            "create_p50_ms": round(statistics.median(creates), 2),
            "create_p99_ms": round(percentile(creates, 0.99), 2),
        }
        print(f"{name}: {json.dumps(summary[name])}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "results": summary}, indent=2))


if __name__ == "__main__":
    main()
