"""The per-key usage store (app/keys/usage.py): moving windows, Retry-After, the concurrency cap, and
counts shared by processes. Time is an injected clock: no assertion depends on how long anything
takes."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from app.keys.usage import DAY_S, KeyLimits, Refusal, UsageStore
from app.keys.usage_redis import PREFIX, RedisUsageStore

T0 = 1_700_000_000.25  # a wall-clock time, not on a bucket boundary


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


class InRedis:
    """A ``RedisUsageStore`` driven as the SQLite store is (its coroutines run to completion here),
    so that every test of the ``store`` fixture holds for both stores."""

    def __init__(self, url: str, clock: Clock) -> None:
        self.runner = asyncio.Runner()
        self.redis = self.runner.run(RedisUsageStore.connect(url, clock=clock))
        self.runner.run(self.redis.client.flushdb())

    def admit(self, key: str, limits: KeyLimits, **counts: Any) -> Refusal | None:
        return self.runner.run(self.redis.admit(key, limits, **counts))

    def release(self, key: str) -> None:
        self.runner.run(self.redis.release(key))

    def in_flight(self, key: str) -> int:
        return self.runner.run(self.redis.in_flight(key))

    def buckets(self) -> int:
        async def count() -> int:
            names = [name async for name in self.redis.client.scan_iter(f"{PREFIX}u:*")]
            return sum([await self.redis.client.hlen(name) for name in names])

        return self.runner.run(count())

    def close(self) -> None:
        self.runner.run(self.redis.close())
        self.runner.close()


@pytest.fixture(params=["sqlite", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path, clock: Clock) -> Iterator[UsageStore]:
    """The SQLite store (NMT_DATA_DIR) and the Redis one (NMT_REDIS_URL): the same decisions."""
    if request.param == "sqlite":
        yield UsageStore(tmp_path, clock=clock)
        return
    redis = InRedis(request.getfixturevalue("redis_server").url, clock)
    yield cast(UsageStore, redis)
    redis.close()


def test_requests_per_minute_is_a_moving_window(store: UsageStore, clock: Clock) -> None:
    limits = KeyLimits(requests_per_minute=3)
    for offset in (0, 20, 40):
        clock.now = T0 + offset
        assert store.admit("k", limits) is None
    clock.now = T0 + 50
    refusal = store.admit("k", limits)
    assert refusal == Refusal("requests_per_minute", "3 requests per 1 minute", 11)
    # The first request's second (T0 is in bucket 1_700_000_000) leaves the window 60 s after its end.
    clock.now = math.floor(T0) + 61 - 0.01
    assert store.admit("k", limits) is not None
    clock.now = math.floor(T0) + 61
    assert store.admit("k", limits) is None
    # Not a fixed minute: the requests at +20 and +40 still count.
    refusal = store.admit("k", limits)
    assert refusal is not None and refusal.retry_after_s == math.ceil(math.floor(T0) + 21 + 60 - clock.now)


def test_keys_are_counted_apart(store: UsageStore) -> None:
    limits = KeyLimits(requests_per_minute=1)
    assert store.admit("a", limits) is None
    assert store.admit("a", limits) is not None
    assert store.admit("b", limits) is None


def test_chars_per_minute_counts_characters(store: UsageStore, clock: Clock) -> None:
    limits = KeyLimits(chars_per_minute=100)
    assert store.admit("k", limits, chars=60) is None
    clock.now = T0 + 10
    refusal = store.admit("k", limits, chars=50)
    assert refusal == Refusal("chars_per_minute", "100 characters per 1 minute", 51)
    assert store.admit("k", limits, chars=40) is None  # exactly the limit
    assert store.admit("k", limits, chars=1) is not None


def test_chars_per_day_is_a_moving_24_hours(store: UsageStore, clock: Clock) -> None:
    limits = KeyLimits(chars_per_day=1000)
    assert store.admit("k", limits, chars=600) is None
    clock.now = T0 + 3600
    assert store.admit("k", limits, chars=400) is None
    clock.now = T0 + 7200
    refusal = store.admit("k", limits, chars=1)
    # Day buckets are minutes: the 600 leave with the end of T0's minute, plus 24 hours.
    first_leaves = (math.floor(T0 / 60) + 1) * 60 + DAY_S
    assert refusal == Refusal(
        "chars_per_day", "1000 characters per 1 day", math.ceil(first_leaves - clock.now)
    )
    clock.now = first_leaves
    assert store.admit("k", limits, chars=600) is None
    assert store.admit("k", limits, chars=1) is not None  # the 400 of T0 + 3600 still count


def test_requests_per_day(store: UsageStore, clock: Clock) -> None:
    limits = KeyLimits(requests_per_minute=10, requests_per_day=2)
    assert store.admit("k", limits) is None
    clock.now = T0 + 600
    assert store.admit("k", limits) is None
    first_leaves = (math.floor(T0 / 60) + 1) * 60 + DAY_S
    assert store.admit("k", limits) == Refusal(
        "requests_per_day", "2 requests per 1 day", math.ceil(first_leaves - clock.now)
    )


def test_a_list_counts_as_several_requests(store: UsageStore) -> None:
    limits = KeyLimits(requests_per_minute=5)
    assert store.admit("k", limits, requests=4) is None
    refusal = store.admit("k", limits, requests=2)
    assert refusal is not None and refusal.limit == "requests_per_minute"
    assert store.admit("k", limits, requests=1) is None


def test_a_request_larger_than_the_whole_budget_is_refused_for_good(store: UsageStore) -> None:
    limits = KeyLimits(requests_per_minute=5, chars_per_day=100)
    assert store.admit("k", limits, requests=6) == Refusal(
        "requests_per_minute", "5 requests per 1 minute", None
    )
    assert store.admit("k", limits, chars=101) == Refusal("chars_per_day", "100 characters per 1 day", None)
    assert store.admit("k", limits, requests=5, chars=100) is None  # nothing was spent by those


def test_a_refused_request_spends_nothing(store: UsageStore, clock: Clock) -> None:
    limits = KeyLimits(requests_per_minute=1, chars_per_minute=10)
    assert store.admit("k", limits, chars=5) is None
    for _ in range(20):  # a client retrying at once does not push its own wait further
        refusal = store.admit("k", limits, chars=5)
        assert refusal is not None and refusal.retry_after_s == 61
    clock.now = math.floor(T0) + 61
    assert store.admit("k", limits, chars=10) is None


def test_the_limit_that_waits_longest_is_named(store: UsageStore, clock: Clock) -> None:
    limits = KeyLimits(requests_per_minute=1, chars_per_day=10)
    assert store.admit("k", limits, chars=10) is None
    clock.now = T0 + 5
    refusal = store.admit("k", limits, chars=1)
    assert refusal is not None and refusal.limit == "chars_per_day"
    assert refusal.retry_after_s is not None and refusal.retry_after_s > 86_000
    clock.now = math.floor(T0) + 61  # the minute has passed; the day has not
    refusal = store.admit("k", limits, chars=1)
    assert refusal is not None and refusal.limit == "chars_per_day"
    assert store.admit("k", limits, chars=0) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retry_after_is_the_first_whole_second_the_request_is_admitted(
    store: UsageStore, clock: Clock, seed: int
) -> None:
    """Random traffic: every refusal's Retry-After is correct to the second: a second earlier the
    same request is still refused, at it the request is admitted."""
    rng = random.Random(seed)
    limits = KeyLimits(requests_per_minute=7, chars_per_minute=300, chars_per_day=4000)
    refusals = 0
    for _ in range(300):
        clock.now += rng.choice([0.0, 0.3, 1.7, 4.0, 11.5])
        chars = rng.randint(1, 120)
        refusal = store.admit("k", limits, chars=chars)
        if refusal is None:
            continue
        refusals += 1
        assert refusal.retry_after_s is not None and refusal.retry_after_s >= 1
        start = clock.now
        if refusal.retry_after_s > 1:
            clock.now = start + refusal.retry_after_s - 1
            assert store.admit("k", limits, chars=chars) is not None, refusal
        clock.now = start + refusal.retry_after_s
        assert store.admit("k", limits, chars=chars) is None, refusal
    assert refusals > 30  # the traffic did meet every limit
    # Old buckets go: at most a window of each (Redis keeps the two units in a hash each).
    if isinstance(store, UsageStore):
        assert store._db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] <= 61 + 1441
    else:
        assert cast(InRedis, store).buckets() <= 2 * (61 + 1441)


def test_the_concurrency_cap(store: UsageStore) -> None:
    limits = KeyLimits(max_concurrent=2)
    assert store.admit("k", limits) is None
    assert store.admit("k", limits) is None
    assert store.admit("k", limits) == Refusal("max_concurrent", "2 concurrent requests", 1)
    assert store.admit("other", limits) is None
    assert store.in_flight("k") == 2
    store.release("k")
    assert store.in_flight("k") == 1
    assert store.admit("k", limits) is None
    # A second charge of an admitted request (a file's characters) takes no slot.
    assert store.admit("k", KeyLimits(max_concurrent=2, chars_per_minute=9), chars=3, slot=False) is None


def test_a_refusal_by_the_cap_spends_nothing(store: UsageStore) -> None:
    limits = KeyLimits(max_concurrent=1, requests_per_minute=2)
    assert store.admit("k", limits) is None
    assert store.admit("k", limits) is not None  # the cap
    store.release("k")
    assert store.admit("k", limits) is None  # the second of two per minute


def test_processes_share_counts_through_the_directory(tmp_path: Path, clock: Clock) -> None:
    one, two = UsageStore(tmp_path, clock=clock), UsageStore(tmp_path, clock=clock)
    limits = KeyLimits(requests_per_minute=5, max_concurrent=3)
    for store in (one, two, one, two, one):
        assert store.admit("k", limits, slot=False) is None
    assert two.admit("k", limits, slot=False) is not None
    assert one.admit("j", limits) is None
    assert two.admit("j", limits) is None
    assert one.in_flight("j") == two.in_flight("j") == 2
    two.close()  # gives back its slot
    assert one.in_flight("j") == 1


def _admit_many(directory: str, attempts: int, limits: KeyLimits, start: object) -> int:
    """In a child process: how many of ``attempts`` admissions (each taking a slot, none given
    back) its own store let through, all at one instant."""
    store = UsageStore(Path(directory), clock=lambda: T0)
    start.wait()  # type: ignore[attr-defined]
    return sum(store.admit("k", limits) is None for _ in range(attempts))


@pytest.mark.parametrize(
    ("limits", "admitted"),
    [(KeyLimits(requests_per_minute=500), 500), (KeyLimits(max_concurrent=500), 500)],
)
def test_concurrent_processes_never_admit_more_than_the_limit(
    tmp_path: Path, limits: KeyLimits, admitted: int
) -> None:
    processes = 4
    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    start = manager.Barrier(processes)
    with context.Pool(processes) as pool:
        counts = pool.starmap(_admit_many, [(str(tmp_path), 250, limits, start)] * processes)
    manager.shutdown()
    assert sum(counts) == admitted, counts


def _take_slots_and_die(directory: str, slots: int) -> None:
    store = UsageStore(Path(directory), clock=lambda: T0)
    for _ in range(slots):
        assert store.admit("k", KeyLimits(max_concurrent=100)) is None
    os._exit(0)  # no close, no release: as a process that is killed


def test_slots_of_a_process_that_died_are_ignored(tmp_path: Path, clock: Clock) -> None:
    live = UsageStore(tmp_path, clock=clock)
    limits = KeyLimits(max_concurrent=3)
    assert live.admit("k", limits) is None
    child = multiprocessing.get_context("spawn").Process(target=_take_slots_and_die, args=(str(tmp_path), 2))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    holders = {row[0] for row in live._db.execute("SELECT holder FROM in_flight")}
    assert len(holders) == 2  # the dead process's row is still there...
    assert live.admit("k", limits) is None  # ...but at the cap it is found dead and dropped
    assert live.in_flight("k") == 2
    assert sorted(p.name for p in live.holders.iterdir()) == [live.holder]
    # A process starting later drops what dead processes left at once.
    child = multiprocessing.get_context("spawn").Process(target=_take_slots_and_die, args=(str(tmp_path), 1))
    child.start()
    child.join(timeout=60)
    assert live._db.execute("SELECT COUNT(DISTINCT holder) FROM in_flight").fetchone()[0] == 2
    UsageStore(tmp_path, clock=clock).close()
    assert live._db.execute("SELECT COUNT(DISTINCT holder) FROM in_flight").fetchone()[0] == 1
    assert live.in_flight("k") == 2


def test_a_release_that_finds_the_database_locked_is_made_at_the_next_write(tmp_path: Path) -> None:
    store = UsageStore(tmp_path, clock=Clock(), timeout_s=0.01)
    limits = KeyLimits(max_concurrent=1)
    assert store.admit("k", limits) is None
    other = sqlite3.connect(tmp_path / "usage.sqlite3", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    store.release("k")
    other.execute("COMMIT")
    assert store.admit("k", limits) is None  # the slot was given back first
    assert store.in_flight("k") == 1


def test_limits_without_counted_ones_touch_nothing(store: UsageStore) -> None:
    assert not KeyLimits(char_limit=10).counted
    assert store.admit("k", KeyLimits(char_limit=10)) is None
    if isinstance(store, UsageStore):
        assert store._db.execute("SELECT COUNT(*) FROM usage").fetchone()[0] == 0
    else:
        assert cast(InRedis, store).buckets() == 0


def test_a_damaged_database_is_moved_aside_and_counting_begins_anew(tmp_path: Path, clock: Clock) -> None:
    (tmp_path / "usage.sqlite3").write_bytes(b"a power cut left this" * 1000)
    store = UsageStore(tmp_path, clock=clock)
    assert store.admit("k", KeyLimits(requests_per_minute=1)) is None
    assert store.admit("k", KeyLimits(requests_per_minute=1)) is not None
    assert [p.name.split("-")[0] for p in tmp_path.glob("usage.sqlite3.damaged-*")] == [
        "usage.sqlite3.damaged"
    ]
