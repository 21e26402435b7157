"""The front end's CPU per request, one checkout against another, in one command.

The front end (the uvicorn process: HTTP, parsing, sentence splitting, SentencePiece, the
scheduler, the pipes to the workers, metrics) shares the machine's cores with the model workers;
every CPU-microsecond it spends per request is one the workers do not decode with. This measures
it for the server of ``--before`` and of ``--after`` (default: this checkout), both started as
deployed (``benchmarks.load.serve``, the segment cache off so that every request is decoded),
both up at once, in alternating rounds of ``--duration`` seconds of ``wrk`` with ``--connections``
connections (one test_2016 sentence per request, beam ``--beam``): per round, the front-end
process's CPU time (user + system, /proc) over the requests answered.

On 2 cores the front end competes with its own workers, and how much CPU a request costs then
depends on how often it is preempted (caches, wake-ups): so the front end runs alone on core 0,
and its workers, wrk and this script on core 1 (``--no-pin``: as deployed, unpinned). Pinned, the
figure is the front end's own cost; the two servers' rounds alternate, so that a slow phase of a
shared machine hits both.

    .venv/bin/python -m benchmarks.front_end --before ../before --rounds 4       # ~4 min

Keyed requests, the same checkout counting in SQLite (before) and in Redis (after): every body
carries ``--api-key``, both servers read ``--keys-file``, and ``--after-env`` (or ``--before-env``)
sets a variable for one of them.

    .venv/bin/python -m benchmarks.front_end --before . --keys-file keys.toml --api-key SECRET \
        --after-env NMT_REDIS_URL=redis://127.0.0.1:6399/0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

from benchmarks.common import DATA, DEFAULT_MODEL, REPO
from benchmarks.load import CpuMeter, Server, process_tree, run_wrk, serve, wait_idle, write_bodies
from training.data import read_lines


def pin(server: Server) -> None:
    """The front end alone on core 0; its workers (every descendant) on core 1."""
    front = server.process.pid
    os.sched_setaffinity(front, {0})
    for pid in process_tree(front):
        if pid != front:
            for task in os.listdir(f"/proc/{pid}/task"):  # every thread (torch's are started already)
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task), {1})


def round_us(server: Server, bodies: Path, connections: int, duration_s: float) -> tuple[float, float]:
    """(front-end CPU-us per answered request, answered requests/s) over one wrk run."""
    meter = CpuMeter(server.process.pid)
    r = run_wrk(server.url, bodies, connections=connections, duration_s=duration_s)
    front_end_us, _ = meter.per_request_us(r.count(200))
    wait_idle(server)
    return front_end_us, r.answered_per_s


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, required=True, help="the reference checkout")
    p.add_argument("--after", type=Path, default=REPO)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--no-pin", action="store_true", help="leave every process on every core")
    p.add_argument("--log-dir", type=Path, default=Path(tempfile.gettempdir()) / "nmt-front-end")
    p.add_argument("--keys-file", type=Path, help="NMT_API_KEYS_FILE of both servers")
    p.add_argument("--api-key", help="the key every request body carries")
    for side in ("before", "after"):
        p.add_argument(f"--{side}-env", action="append", default=[], metavar="NAME=VALUE")
    args = p.parse_args(argv)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_pin:
        os.sched_setaffinity(0, {1})  # this script and the wrk it starts: beside the workers
    texts = read_lines(DATA / "test_2016_flickr.de.gz")
    env = {"NMT_MODEL_DIR": str(args.model.resolve())}  # (serve turns the segment cache off)
    if args.keys_file:
        env["NMT_API_KEYS_FILE"] = str(args.keys_file.resolve())
    results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        bodies = write_bodies(texts, Path(tmp) / "bodies.jsonl", beam=args.beam, api_key=args.api_key)
        servers = {}
        for name, repo in (("before", args.before), ("after", args.after)):
            own = dict(item.split("=", 1) for item in getattr(args, f"{name}_env"))
            own.setdefault("NMT_DATA_DIR", str(Path(tmp) / name))  # each its own usage store
            log = args.log_dir / f"{name}.log"
            servers[name] = stack.enter_context(serve({**env, **own}, log, repo=repo.resolve()))
        for server in servers.values():
            if not args.no_pin:
                pin(server)
            run_wrk(server.url, bodies, connections=args.connections, duration_s=args.warmup)
            wait_idle(server)
        for i in range(args.rounds):
            for name, server in servers.items():
                us, rate = round_us(server, bodies, args.connections, args.duration)
                results[name].append((us, rate))
                print(f"round {i + 1} {name}: {us:.0f} CPU-us/request ({rate:.1f} requests/s)", flush=True)
    med = {name: statistics.median(us for us, _ in rs) for name, rs in results.items()}
    print()
    print("| server | front-end CPU-us per request, per round | median | requests/s, per round |")
    print("|---|---|---:|---|")
    for name, rs in results.items():
        rounds = ", ".join(f"{us:.0f}" for us, _ in rs)
        rates = ", ".join(f"{rate:.1f}" for _, rate in rs)
        print(f"| {name} | {rounds} | {med[name]:.0f} | {rates} |")
    print(f"\nafter / before: {med['after'] / med['before']:.2f}x")


if __name__ == "__main__":
    main()
