"""A key's limits across replicas (NMT_REDIS_URL, app/keys/usage_redis.py), against a real Redis
(tests/redis_server.py): replicas count in one place, so a key gets its limits once, not once per
replica; a replica that dies frees its slots; a Redis that cannot be used stops the start with one
line, and one lost while running answers 503 with Retry-After until it is back."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from app.keys.accepted import ApiKey, Keys
from app.keys.limits import LEASE_KEY, KeyLimiter, Lease, release_key
from app.keys.usage import KeyLimits
from app.keys.usage_redis import HOLDER_TTL_S, PREFIX, RedisUsageStore
from app.main import create_app, lifespan
from app.monitoring.metrics import process_metrics
from tests.redis_server import RedisServer, start_redis
from tests.test_api import assert_error, make_settings, serve
from tests.test_keys import write_keys
from tests.test_server import free_port, start_server, stop, wait_ready

KEYS_FILE = """
[[keys]]
name = "tight"
key = "tight-secret"
requests_per_minute = 5

[[keys]]
name = "solo"
key = "solo-secret"
max_concurrent = 1
"""


def replica(model_dir: Path, keys: Path, url: str) -> Any:
    return serve(make_settings(model_dir, api_keys_file=keys, redis_url=url, warmup=False))


def detect(client: TestClient, key: str) -> Any:
    return client.post("/detect", json={"q": "Ein Hund läuft über die Wiese.", "api_key": key})


def flush(url: str) -> None:
    async def run() -> None:
        store = await RedisUsageStore.connect(url)
        await store.client.flushdb()
        await store.close()

    asyncio.run(run())


@pytest.fixture
def replicas(model_dir: Path, tmp_path: Path, redis_server: RedisServer) -> Iterator[list[TestClient]]:
    """Two replicas of the service (each its own app, worker and usage store) and one Redis."""
    flush(redis_server.url)
    keys = write_keys(tmp_path, KEYS_FILE)
    with ExitStack() as stack:
        yield [stack.enter_context(replica(model_dir, keys, redis_server.url)) for _ in range(2)]


def test_a_keys_window_is_counted_once_across_replicas(replicas: list[TestClient]) -> None:
    answers = [detect(replicas[i % 2], "tight-secret") for i in range(7)]
    assert [a.status_code for a in answers] == [200] * 5 + [429] * 2
    assert answers[5].json() == {"error": "Slowdown: 5 requests per 1 minute (requests_per_minute)"}
    assert 1 <= int(answers[5].headers["Retry-After"]) <= 61


def test_the_concurrency_cap_holds_across_replicas(
    replicas: list[TestClient], redis_server: RedisServer
) -> None:
    async def hold() -> None:
        other = await RedisUsageStore.connect(redis_server.url)  # a third replica, holding the slot
        assert await other.admit("solo", KeyLimits(max_concurrent=1)) is None
        for client in replicas:
            limited = await asyncio.to_thread(detect, client, "solo-secret")
            assert limited.status_code == 429 and limited.headers["Retry-After"] == "1"
            assert limited.json() == {"error": "Slowdown: 1 concurrent request (max_concurrent)"}
        await other.release("solo")
        await other.close()

    asyncio.run(hold())
    assert [detect(c, "solo-secret").status_code for c in replicas] == [200, 200]


def test_a_replica_that_stops_renewing_frees_its_slots(redis_server: RedisServer) -> None:
    async def run() -> None:
        one, two = [await RedisUsageStore.connect(redis_server.url) for _ in range(2)]
        cap = KeyLimits(max_concurrent=1)
        assert await one.admit("k", cap) is None
        assert await two.admit("k", cap) is not None
        holder = f"{PREFIX}h:{one.holder}"
        assert 0 < await two.client.ttl(holder) <= HOLDER_TTL_S  # renewed while it lives
        await two.client.delete(holder)  # what HOLDER_TTL_S after its last renewal does
        assert await two.admit("k", cap) is None
        assert await two.in_flight("k") == 1
        for store in (one, two):
            await store.close()

    flush(redis_server.url)
    asyncio.run(run())


def admit_many(url: str, start: Any, results: Any) -> None:
    async def run() -> int:
        store = await RedisUsageStore.connect(url)
        start.wait()
        admitted = 0
        for _ in range(60):
            admitted += (
                await store.admit("k", KeyLimits(requests_per_minute=97, chars_per_minute=500), chars=3)
                is None
            )
        await store.close()
        return admitted

    results.put(asyncio.run(run()))


def test_concurrent_replicas_never_admit_more_than_the_limit(redis_server: RedisServer) -> None:
    """Four processes deciding without pause, 240 requests against 97 a minute: exactly 97 pass."""
    flush(redis_server.url)
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(4), context.Queue()
    processes = [
        context.Process(target=admit_many, args=(redis_server.url, start, results)) for _ in range(4)
    ]
    for p in processes:
        p.start()
    admitted = [results.get(timeout=60) for _ in processes]
    for p in processes:
        p.join(10)
    assert sum(admitted) == 97, admitted


# --- start, and Redis lost ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "reason"),
    [("http://127.0.0.1:1/0", "not a Redis URL"), ("redis://127.0.0.1:{port}/0", "cannot reach it")],
    ids=["not-redis", "unreachable"],
)
def test_a_redis_url_that_cannot_be_used_stops_the_start_with_one_line(
    tmp_path: Path, model_dir: Path, caplog: pytest.LogCaptureFixture, url: str, reason: str
) -> None:
    keys = write_keys(tmp_path, KEYS_FILE)
    settings = make_settings(model_dir, api_keys_file=keys, redis_url=url.format(port=free_port()))

    async def start() -> None:
        async with lifespan(create_app(settings)):
            pass

    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit):
        asyncio.run(start())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("invalid configuration")]
    assert len(lines) == 1 and "\n" not in lines[0], caplog.text
    assert lines[0].startswith("invalid configuration: NMT_REDIS_URL: cannot keep the keys' usage there")
    assert reason in lines[0]


def test_redis_lost_while_running_answers_503_with_retry_after_until_it_is_back(
    model_dir: Path, tmp_path: Path
) -> None:
    keys = write_keys(tmp_path, KEYS_FILE)
    server = start_redis(tmp_path / "redis")
    try:
        with replica(model_dir, keys, server.url) as client:
            assert detect(client, "tight-secret").status_code == 200
            server.stop()
            lost = detect(client, "tight-secret")
            assert_error(lost, 503, "retry later")
            assert lost.headers["Retry-After"] == "1"
            assert detect(client, "nope-secret").status_code == 403  # an unknown key: refused before
            unready = client.get("/health/ready")
            assert unready.status_code == 503
            assert "the keys' usage store (NMT_REDIS_URL) is unreachable" in unready.json()["error"]
            assert client.get("/health/live").status_code == 200
            server = start_redis(tmp_path / "redis", port=server.port)
            assert detect(client, "tight-secret").status_code == 200
            assert client.get("/health/ready").status_code == 200
    finally:
        server.stop()


# --- three replicas, as deployed -----------------------------------------------------------------------


def test_three_replicas_under_concurrent_load_admit_a_keys_limit_exactly(
    model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """Three ``uvicorn app.main:app`` processes (each its own NMT_DATA_DIR), one Redis, and 12
    clients sending 60 keyed requests round-robin at once against 20 a minute: 20 are answered."""
    flush(redis_server.url)
    keys = write_keys(
        tmp_path, '[[keys]]\nname = "shared"\nkey = "shared-secret"\nrequests_per_minute = 20\n'
    )
    servers = [
        start_server(
            tmp_path / f"replica-{i}.log",
            NMT_MODEL_DIR=str(model_dir),
            NMT_API_KEYS_FILE=str(keys),
            NMT_REDIS_URL=redis_server.url,
            NMT_DATA_DIR=str(tmp_path / f"data-{i}"),
        )
        for i in range(3)
    ]
    try:
        for server in servers:
            wait_ready(server)

        def send(i: int) -> int:
            body = {"q": "Ein Hund läuft über die Wiese.", "api_key": "shared-secret"}
            return httpx.post(f"{servers[i % 3].url}/detect", json=body, timeout=30).status_code

        with ThreadPoolExecutor(12) as pool:
            statuses = list(pool.map(send, range(60)))
    finally:
        for server in servers:
            stop(server)
    assert sorted(statuses) == [200] * 20 + [429] * 40, statuses


def test_a_request_cancelled_while_its_slot_goes_back_still_gives_it_back(redis_server: RedisServer) -> None:
    async def run() -> int:
        store = await RedisUsageStore.connect(redis_server.url)
        key = ApiKey("solo", KeyLimits(max_concurrent=1))
        limiter = KeyLimiter(Keys({"digest": key}), store, process_metrics())
        assert await store.admit("solo", key.limits) is None
        scope: dict[str, Any] = {LEASE_KEY: Lease(limiter, key, slot=True)}
        ending = asyncio.create_task(release_key(scope))
        await asyncio.sleep(0)  # the release has begun: its round trip to Redis is under way
        ending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ending
        await asyncio.sleep(0.5)
        left = await store.in_flight("solo")
        await store.close()
        return left

    flush(redis_server.url)
    assert asyncio.run(run()) == 0
