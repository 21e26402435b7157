"""What per-key limits cost a request: ``admit_key`` and ``release_key`` (app/keys/limits.py), the
whole path a keyed request takes (the key found by its SHA-256, its limits checked and counted in
the usage store, its metrics, its slot given back), without HTTP or a model. The store is the SQLite
file, or with ``--redis-url`` the Redis that replicas share (``NMT_REDIS_URL``).

Reported per configuration: microseconds per request, the median of ``--repeats`` passes of
``--requests`` admissions each (limits high enough that all are admitted, the real clock), in one
process and in ``--processes`` processes sharing one store, all admitting without pause (each
decision takes the database's write lock, so there they wait for each other: the most decisions
per second the store makes, not what a request pays at a server's usual rate).

    .venv/bin/python -m benchmarks.key_limits            # ~20 s on 2 cores
    .venv/bin/python -m benchmarks.key_limits --redis-url redis://127.0.0.1:6399/0
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from fastapi import Request

from app.keys.accepted import ApiKey, Keys, sha256
from app.keys.limits import KeyLimiter, admit_key, release_key
from app.keys.usage import KeyLimits, UsageStore
from app.keys.usage_redis import RedisUsageStore
from app.monitoring.metrics import process_metrics

HIGH = 10**12
CONFIGURATIONS = {
    "keys without counted limits (no store)": KeyLimits(char_limit=HIGH),
    "requests_per_minute": KeyLimits(requests_per_minute=HIGH),
    "every limit (4 windows and max_concurrent)": KeyLimits(HIGH, HIGH, HIGH, HIGH, HIGH, HIGH),
}
SECRET = "benchmark-secret"


def per_request_us(
    directory: str, limits: KeyLimits, requests: int, repeats: int, start: Any = None, redis_url: str = ""
) -> float:
    """Microseconds per admitted and released request, the median of ``repeats`` passes."""
    return asyncio.run(_per_request_us(directory, limits, requests, repeats, start, redis_url))


async def _per_request_us(
    directory: str, limits: KeyLimits, requests: int, repeats: int, start: Any, redis_url: str
) -> float:
    keys = Keys({sha256(SECRET): ApiKey("bench", limits)})
    store: UsageStore | RedisUsageStore | None = None
    if limits.counted:
        store = await RedisUsageStore.connect(redis_url) if redis_url else UsageStore(Path(directory))
    limiter = KeyLimiter(keys, store, process_metrics())
    texts = [52]  # the characters of a typical sentence
    if start is not None:
        start.wait()
    passes = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(requests):
            request = cast(Request, SimpleNamespace(scope={}))
            await admit_key(request, limiter, SECRET, requests=1, text_lengths=texts)
            await release_key(request.scope)
        passes.append((time.perf_counter() - began) / requests * 1e6)
    await limiter.close()
    return statistics.median(passes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--redis-url", default="", help="count in this Redis instead of SQLite")
    args = parser.parse_args()
    print(f"usage store: {'Redis' if args.redis_url else 'SQLite'}")
    context = multiprocessing.get_context("spawn")
    for name, limits in CONFIGURATIONS.items():
        with tempfile.TemporaryDirectory() as directory:
            alone = per_request_us(directory, limits, args.requests, args.repeats, None, args.redis_url)
        with tempfile.TemporaryDirectory() as directory, context.Manager() as manager:
            start = manager.Barrier(args.processes)
            with context.Pool(args.processes) as pool:
                work = [
                    (directory, limits, args.requests, args.repeats, start, args.redis_url)
                ] * args.processes
                shared = pool.starmap(per_request_us, work)
        together = sum(1e6 / us for us in shared)
        print(
            f"{name}: {alone:.1f} us per request alone; {statistics.mean(shared):.1f} us in each of "
            f"{args.processes} processes at once ({together:,.0f} requests/s together)"
        )


if __name__ == "__main__":
    main()
