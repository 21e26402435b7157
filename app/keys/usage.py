"""What each API key has used, counted in one SQLite file that every front-end process shares
(``app.keys.usage_redis`` counts the same in a Redis that every replica shares, ``NMT_REDIS_URL``).

The front end may be several processes (``uvicorn --workers N``, or containers sharing a volume)
and is restarted now and then; a key's limits must hold across all of them, so its usage lives in
``<NMT_DATA_DIR>/usage.sqlite3`` (WAL mode), not in a process's memory. Each decision is one write
transaction: ``BEGIN IMMEDIATE`` takes the database's write lock before anything is read, so
checking a budget and spending it are one atomic step across processes (two processes never both
take the last unit). A decision costs tens of microseconds (docs/keys.md).

Windows move, as LibreTranslate's (flask-limiter's "moving-window"): at most ``limit`` units in any
``period``, not per calendar minute or day. Units are kept in buckets (a second for a minute's
window, a minute for a day's); a unit counts from its bucket's start until ``period`` after the
bucket's end, so a window never lets more than its limit through, and frees a unit at most one
bucket later than an exact log would. A refusal's ``retry_after_s`` is when this store will admit
the same request if the key sends nothing else meanwhile: not an estimate.

Concurrency: a row per (key, process) holds that process's requests in flight. A process that
dies leaves its row behind; the row is dropped as soon as the process is known to be dead. Each
process holds an exclusive ``flock`` on a file of its own in ``holders/`` for its whole life, which
the kernel lets go when the process ends however it ends: a holder whose lock can be taken is dead.
(Process ids are not used: a restarted container, or a later process, gets the same pid again.)
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import sqlite3
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Literal

logger = logging.getLogger("uvicorn.error").getChild("nmt")

MINUTE_S = 60
DAY_S = 86_400
# A bucket's width for each window's period: the most a refusal's Retry-After can exceed the
# exact one. Retry-After is a whole number of seconds anyway; a day is 1,440 buckets.
GRAIN_S = {MINUTE_S: 1, DAY_S: 60}
DATABASE = "usage.sqlite3"
HOLDERS = "holders"
OPENING = "open.lock"  # held while a process checks the database and creates its tables
WRITER = "write.lock"  # held by the process whose transaction writes (see UsageStore._transaction)

Unit = Literal["requests", "chars"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    key TEXT NOT NULL,
    grain INTEGER NOT NULL,
    bucket INTEGER NOT NULL,
    requests INTEGER NOT NULL,
    chars INTEGER NOT NULL,
    PRIMARY KEY (key, grain, bucket)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS in_flight (
    key TEXT NOT NULL,
    holder TEXT NOT NULL,
    requests INTEGER NOT NULL,
    PRIMARY KEY (key, holder)
) WITHOUT ROWID;
"""


@dataclass(frozen=True)
class Window:
    """At most ``limit`` ``unit`` in any ``period_s`` seconds; ``name`` is the limit's setting."""

    name: str
    unit: Unit
    period_s: int
    limit: int

    @property
    def grain_s(self) -> int:
        return GRAIN_S[self.period_s]

    def cost(self, requests: int, chars: int) -> int:
        return requests if self.unit == "requests" else chars

    def describe(self) -> str:
        """``60 requests per 1 minute``: flask-limiter's wording, which LibreTranslate's 429 quotes."""
        unit = ("request" if self.unit == "requests" else "character") + ("s" if self.limit != 1 else "")
        return f"{self.limit} {unit} per 1 {'minute' if self.period_s == MINUTE_S else 'day'}"


@dataclass(frozen=True)
class KeyLimits:
    """A key's limits; 0 means none. Requests count as LibreTranslate counts them (a list ``q``:
    one per text), characters are summed over a request's texts."""

    requests_per_minute: int = 0
    requests_per_day: int = 0
    chars_per_minute: int = 0
    chars_per_day: int = 0
    max_concurrent: int = 0  # requests of the key in flight at once
    char_limit: int = 0  # characters of one text (LibreTranslate's char_limit; checked, not counted)

    @cached_property
    def windows(self) -> tuple[Window, ...]:
        periods: tuple[tuple[str, Unit, int], ...] = (
            ("requests_per_minute", "requests", MINUTE_S),
            ("requests_per_day", "requests", DAY_S),
            ("chars_per_minute", "chars", MINUTE_S),
            ("chars_per_day", "chars", DAY_S),
        )
        return tuple(
            Window(name, unit, period, getattr(self, name))
            for name, unit, period in periods
            if getattr(self, name) > 0
        )

    @property
    def counted(self) -> bool:
        """Whether anything of this key is counted in the store (``char_limit`` alone is not)."""
        return self.max_concurrent > 0 or bool(self.windows)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Spending:
    """What one request spends of its key's limits: the windows it counts in (those it costs
    something in), and whether it takes one of the key's concurrency slots."""

    windows: tuple[Window, ...]
    take_slot: bool

    @classmethod
    def of(cls, limits: KeyLimits, requests: int, chars: int, slot: bool) -> Spending | Refusal | None:
        """The request's spending; the refusal, for good, of one larger than a whole window; or
        None when it counts in nothing (the store is not asked)."""
        windows = tuple(w for w in limits.windows if w.cost(requests, chars) > 0)
        for window in windows:
            if window.cost(requests, chars) > window.limit:
                return Refusal(window.name, window.describe(), None)
        take_slot = slot and limits.max_concurrent > 0
        return cls(windows, take_slot) if windows or take_slot else None


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: the limit's name and wording, and when to come back
    (``retry_after_s`` None: never, the request alone is larger than the whole budget)."""

    limit: str
    description: str
    retry_after_s: int | None

    @classmethod
    def concurrency(cls, cap: int) -> Refusal:
        """The key's ``cap`` requests are in flight already: come back in a second."""
        return cls("max_concurrent", f"{cap} concurrent request{'s' if cap != 1 else ''}", 1)


class UsageStore:
    """A key's usage in windows and its requests in flight, shared through ``directory``.

    One instance per process, used by one thread at a time (the event loop's). ``clock`` gives
    wall-clock seconds: counts outlive the process, so a monotonic clock, which restarts at boot,
    would not do.
    """

    def __init__(
        self, directory: Path, clock: Callable[[], float] = time.time, timeout_s: float = 2.0
    ) -> None:
        self.directory = directory
        self.clock = clock
        self.holders = directory / HOLDERS
        self.holders.mkdir(parents=True, exist_ok=True)
        self._db = self._open(directory / DATABASE, timeout_s)
        self._writer = os.open(directory / WRITER, os.O_RDWR | os.O_CREAT, 0o600)
        self.holder = uuid.uuid4().hex
        # Locked before any row names this holder: whoever sees one of its rows sees it locked.
        self._lock = os.open(self.holders / self.holder, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Releases that failed (the database was locked past the timeout): made at the next write,
        # so that a slot is never lost while this process lives.
        self._unreleased: Counter[str] = Counter()
        # (key, grain) -> the oldest bucket of its window when its older buckets were last deleted.
        self._forgotten: dict[tuple[str, int], int] = {}
        with self._transaction():
            holders = [row[0] for row in self._db.execute("SELECT DISTINCT holder FROM in_flight")]
            self._drop_dead(holders)

    def _open(self, path: Path, timeout_s: float) -> sqlite3.Connection:
        """The database, checked (one process at a time): a file that an OS crash or power cut
        damaged is moved aside and a new one begun."""
        opening = os.open(self.directory / OPENING, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(opening, fcntl.LOCK_EX)
            try:
                return self._connect(path, timeout_s)
            except sqlite3.OperationalError:  # locked, not allowed, ...: the file is not the problem
                raise
            except sqlite3.DatabaseError as e:
                damaged = path.with_name(f"{path.name}.damaged-{int(time.time())}")
                logger.warning(
                    "usage store: %s is damaged (%s); moved to %s, counting anew", path, e, damaged
                )
                path.rename(damaged)
                for suffix in ("-wal", "-shm"):
                    path.with_name(path.name + suffix).unlink(missing_ok=True)
                return self._connect(path, timeout_s)
        finally:
            os.close(opening)  # and its lock

    @staticmethod
    def _connect(path: Path, timeout_s: float) -> sqlite3.Connection:
        # isolation_level=None: transactions are begun and ended here, explicitly.
        db = sqlite3.connect(path, timeout=timeout_s, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # Never synced: a checkpoint's fsync held the deciding call, on the event loop, for up to
            # 14 ms every few hundred decisions, and these counts are soft state that expires within
            # a day. What that risks, a file damaged by an OS crash or power cut, ``_open`` repairs.
            db.execute("PRAGMA synchronous=OFF")
            (result,) = db.execute("PRAGMA quick_check").fetchone()
            if result != "ok":
                raise sqlite3.DatabaseError(result)
            db.executescript(_SCHEMA)
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        """Give back this process's slots and its holder file."""
        try:
            self._db.execute("DELETE FROM in_flight WHERE holder = ?", (self.holder,))
        finally:
            self._db.close()
            (self.holders / self.holder).unlink(missing_ok=True)
            os.close(self._lock)
            os.close(self._writer)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        # Writers take turns on a file lock first: SQLite's own wait for its write lock polls with
        # sleeps, and under contention one process could take the lock again and again while the
        # other slept, until its timeout ("database is locked", seen with two processes deciding
        # without pause); the kernel wakes a waiter of a file lock when it is released.
        fcntl.flock(self._writer, fcntl.LOCK_EX)
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        finally:
            fcntl.flock(self._writer, fcntl.LOCK_UN)

    def admit(
        self, key: str, limits: KeyLimits, *, requests: int = 1, chars: int = 0, slot: bool = True
    ) -> Refusal | None:
        """Spend ``requests`` and ``chars`` of ``key``'s windows, and take one of its concurrency
        slots if ``slot`` (give it back with ``release``); or spend nothing and say why not."""
        now = self.clock()
        spending = Spending.of(limits, requests, chars, slot)
        if not isinstance(spending, Spending):
            return spending
        windows, take_slot = spending.windows, spending.take_slot
        with self._transaction():
            self._release_pending()
            refusals = []
            # A period has one grain: one query sums both units of its windows.
            for grain in sorted({w.grain_s for w in windows}):
                mine = [w for w in windows if w.grain_s == grain]
                oldest = self._oldest_bucket(mine[0], now)
                self._forget(key, grain, oldest)
                used = self._db.execute(
                    "SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(chars), 0) FROM usage "
                    "WHERE key = ? AND grain = ? AND bucket >= ?",
                    (key, grain, oldest),
                ).fetchone()
                for window in mine:
                    needed = (used[0] if window.unit == "requests" else used[1]) + window.cost(
                        requests, chars
                    )
                    if needed > window.limit:
                        refusals.append(self._refusal(key, window, now, needed))
            if refusals:
                return max(refusals, key=lambda r: r.retry_after_s or 0)
            if take_slot and self._slots_taken(key, limits.max_concurrent) >= limits.max_concurrent:
                return Refusal.concurrency(limits.max_concurrent)
            for grain in sorted({w.grain_s for w in windows}):
                self._db.execute(
                    "INSERT INTO usage VALUES (?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
                    "requests = requests + excluded.requests, chars = chars + excluded.chars",
                    (key, grain, math.floor(now / grain), requests, chars),
                )
            if take_slot:
                self._db.execute(
                    "INSERT INTO in_flight VALUES (?, ?, 1) "
                    "ON CONFLICT DO UPDATE SET requests = requests + 1",
                    (key, self.holder),
                )
        return None

    def release(self, key: str) -> None:
        """Give back a slot that ``admit`` took for ``key``."""
        try:
            with self._transaction():
                self._release(key, 1)
        except sqlite3.Error as e:  # locked past the timeout, say: given back at the next write
            logger.error("usage store: a slot of %s is given back later: %s", key, e)
            self._unreleased[key] += 1

    def _release(self, key: str, count: int) -> None:
        self._db.execute(
            "UPDATE in_flight SET requests = MAX(requests - ?, 0) WHERE key = ? AND holder = ?",
            (count, key, self.holder),
        )

    def _release_pending(self) -> None:
        """Inside a transaction: forgotten only once it commits (a rollback undoes them too)."""
        for key, count in self._unreleased.items():
            self._release(key, count)
        self._unreleased.clear()

    def used(self, key: str, window: Window) -> int:
        """What ``key`` has spent of ``window`` now, in its unit; nothing is spent (a read: no
        transaction, no write lock)."""
        oldest = self._oldest_bucket(window, self.clock())
        query = (
            f"SELECT COALESCE(SUM({window.unit}), 0) FROM usage "  # (a column name: requests or chars)
            "WHERE key = ? AND grain = ? AND bucket >= ?"
        )
        (used,) = self._db.execute(query, (key, window.grain_s, oldest)).fetchone()
        return int(used)

    def in_flight(self, key: str) -> int:
        """``key``'s requests in flight in every live process."""
        with self._transaction():
            return self._slots_taken(key, None)

    def _forget(self, key: str, grain: int, oldest: int) -> None:
        """Delete ``key``'s buckets that have left the window (the table holds at most a window of
        each key), when the window has moved since this process last did."""
        if self._forgotten.get((key, grain)) == oldest:
            return
        self._db.execute("DELETE FROM usage WHERE key = ? AND grain = ? AND bucket < ?", (key, grain, oldest))
        self._forgotten[key, grain] = oldest

    def _refusal(self, key: str, window: Window, now: float, needed: int) -> Refusal:
        """``window`` would hold ``needed``, over its limit: the oldest buckets leave it first, so
        the request fits once enough of them have."""
        grain, oldest = window.grain_s, self._oldest_bucket(window, now)
        unit = window.unit  # a column name: "requests" or "chars"
        excess, freed = needed - window.limit, 0
        rows = self._db.execute(
            f"SELECT bucket, {unit} FROM usage WHERE key = ? AND grain = ? AND bucket >= ? ORDER BY bucket",
            (key, grain, oldest),
        )
        for bucket, amount in rows:
            freed += amount
            if freed >= excess:
                leaves = (bucket + 1) * grain + window.period_s
                return Refusal(window.name, window.describe(), max(1, math.ceil(leaves - now)))
        raise AssertionError("the window's buckets sum to less than its usage")  # pragma: no cover

    @staticmethod
    def _oldest_bucket(window: Window, now: float) -> int:
        """The oldest bucket still in ``window`` at ``now``: bucket b counts while
        ``(b + 1) * grain + period > now``."""
        return math.floor((now - window.period_s) / window.grain_s)

    def _slots_taken(self, key: str, cap: int | None) -> int:
        """Requests of ``key`` in flight; when they reach ``cap``, after dropping dead holders'."""
        query = "SELECT COALESCE(SUM(requests), 0) FROM in_flight WHERE key = ?"
        taken: int = self._db.execute(query, (key,)).fetchone()[0]
        if cap is not None and taken < cap:
            return taken
        rows = self._db.execute("SELECT holder FROM in_flight WHERE key = ? AND requests > 0", (key,))
        if self._drop_dead([row[0] for row in rows]):
            taken = self._db.execute(query, (key,)).fetchone()[0]
        return taken

    def _drop_dead(self, holders: list[str]) -> bool:
        """Delete the rows of every holder in ``holders`` whose process has ended; whether any."""
        dead = [h for h in holders if h != self.holder and not self._alive(h)]
        for holder in dead:
            self._db.execute("DELETE FROM in_flight WHERE holder = ?", (holder,))
            logger.info("usage store: dropped the slots of a front-end process that ended (%s)", holder)
        return bool(dead)

    def _alive(self, holder: str) -> bool:
        if not holder.isalnum():  # not one of ours: never a path outside holders/
            return False
        try:
            fd = os.open(self.holders / holder, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        else:
            (self.holders / holder).unlink(missing_ok=True)
            return False
        finally:
            os.close(fd)
