"""What each API key has used, counted in one Redis that every replica shares (``NMT_REDIS_URL``).

``app.keys.usage.UsageStore`` counts in a SQLite file: the processes of one machine share it, the
replicas of a deployment (compose's ``--scale``, Kubernetes' pods) do not, and with N of them a key
got N times its limits. Here the same windows and the same concurrency count live in Redis, with
the same semantics, so that ``app.keys.usage``'s docstring holds for this store too:

* Windows move: at most ``limit`` units in any ``period``, kept in buckets (a second for a minute's
  window, a minute for a day's), and a refusal's ``retry_after_s`` is when the store will admit the
  same request if the key sends nothing else. A key's buckets of one grain and one unit are a hash
  (``<prefix>u:<key>:<grain>:<unit>``: bucket -> units), expiring a window after its last write.
* One decision is one Lua script, which Redis runs alone: checking every window, counting the slots
  and spending are one atomic step across replicas (two never both take the last unit).
* Concurrency: a hash per key (``<prefix>f:<key>``: holder -> requests in flight). Each process is
  a holder, alive while its key ``<prefix>h:<holder>`` exists: it sets it with a time to live of
  ``HOLDER_TTL_S`` and renews it every ``HOLDER_RENEW_S`` (``start``). A replica that dies, however
  it dies, stops renewing; its slots are dropped at the first decision that needs them after its
  key has expired.

The client is redis-py's asyncio one: a decision awaits Redis instead of holding the event loop,
and waits at most ``TIMEOUT_S`` for it (then the request gets 503 with Retry-After, as for a
locked SQLite file). The clock is the replica's wall clock (``time.time``), as the SQLite store's:
the replicas' clocks agree to well within a bucket where NTP runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from app.keys.usage import KeyLimits, Refusal, Spending, Window

logger = logging.getLogger("uvicorn.error").getChild("nmt")

PREFIX = "nmt:"
HOLDER_TTL_S = 15  # a dead replica's slots are free at most this long after its last renewal
HOLDER_RENEW_S = 5
TIMEOUT_S = 1.0  # the longest a decision waits for Redis (connecting included)

# KEYS: the in-flight hash, the holder key's prefix, then one usage hash per window.
# ARGV: now, take_slot (0/1), cap, holder, then per window: grain, period, limit, cost.
# Returns {} when admitted (and spent), {window index (1-based), retry_after} for a window's
# refusal, {0, 1} for the concurrency cap.
_ADMIT = """
local now = tonumber(ARGV[1])
local take_slot = ARGV[2] == '1'
local cap = tonumber(ARGV[3])
local holder = ARGV[4]
local windows = (#ARGV - 4) / 4
local refused, retry = nil, 0
for i = 1, windows do
  local grain = tonumber(ARGV[4 + 4 * i - 3])
  local period = tonumber(ARGV[4 + 4 * i - 2])
  local limit = tonumber(ARGV[4 + 4 * i - 1])
  local cost = tonumber(ARGV[4 + 4 * i])
  local oldest = math.floor((now - period) / grain)
  local flat = redis.call('HGETALL', KEYS[2 + i])
  local buckets, used = {}, 0
  for j = 1, #flat, 2 do
    local bucket = tonumber(flat[j])
    if bucket < oldest then
      redis.call('HDEL', KEYS[2 + i], flat[j])
    else
      local amount = tonumber(flat[j + 1])
      used = used + amount
      table.insert(buckets, {bucket, amount})
    end
  end
  local needed = used + cost
  if needed > limit then
    table.sort(buckets, function(a, b) return a[1] < b[1] end)
    local excess, freed = needed - limit, 0
    for _, entry in ipairs(buckets) do
      freed = freed + entry[2]
      if freed >= excess then
        local after = math.max(1, math.ceil((entry[1] + 1) * grain + period - now))
        if after > retry then refused, retry = i, after end
        break
      end
    end
  end
end
if refused then return {refused, retry} end
if take_slot then
  local flat = redis.call('HGETALL', KEYS[1])
  local taken = 0
  for j = 1, #flat, 2 do
    if flat[j] == holder or redis.call('EXISTS', KEYS[2] .. flat[j]) == 1 then
      taken = taken + tonumber(flat[j + 1])
    else
      redis.call('HDEL', KEYS[1], flat[j])
    end
  end
  if taken >= cap then return {0, 1} end
end
for i = 1, windows do
  local grain = tonumber(ARGV[4 + 4 * i - 3])
  local period = tonumber(ARGV[4 + 4 * i - 2])
  local cost = tonumber(ARGV[4 + 4 * i])
  redis.call('HINCRBY', KEYS[2 + i], tostring(math.floor(now / grain)), cost)
  redis.call('EXPIRE', KEYS[2 + i], period + grain + 1)
end
if take_slot then redis.call('HINCRBY', KEYS[1], holder, 1) end
return {}
"""

# KEYS: the in-flight hash. ARGV: holder, count. Never below 0.
_RELEASE = """
local left = (tonumber(redis.call('HGET', KEYS[1], ARGV[1])) or 0) - tonumber(ARGV[2])
if left > 0 then redis.call('HSET', KEYS[1], ARGV[1], left) else redis.call('HDEL', KEYS[1], ARGV[1]) end
return left
"""

# KEYS: the in-flight hash, the holder key's prefix. ARGV: holder. Live holders' requests.
_IN_FLIGHT = """
local flat = redis.call('HGETALL', KEYS[1])
local taken = 0
for j = 1, #flat, 2 do
  if flat[j] == ARGV[1] or redis.call('EXISTS', KEYS[2] .. flat[j]) == 1 then
    taken = taken + tonumber(flat[j + 1])
  end
end
return taken
"""


class RedisUnusable(Exception):
    """``NMT_REDIS_URL`` names no Redis this process can use: a one-line reason."""


class RedisUsageStore:
    """``app.keys.usage.UsageStore``'s decisions, in Redis: ``admit``, ``release``, ``in_flight``."""

    def __init__(self, client: aioredis.Redis, clock: Callable[[], float] = time.time) -> None:
        self.client = client
        self.clock = clock
        self.holder = uuid.uuid4().hex
        self._admit = client.register_script(_ADMIT)
        self._release = client.register_script(_RELEASE)
        self._in_flight = client.register_script(_IN_FLIGHT)
        self._keys: set[str] = set()  # keys this process has held slots of (given back at close)
        # Releases that failed (Redis unreachable): made before the next decision, so that a slot
        # is never lost while this process lives.
        self._unreleased: Counter[str] = Counter()
        self._renewal: asyncio.Task[None] | None = None
        # Why Redis could not be used at the last attempt (a decision or a renewal), or None: what
        # /health/ready says while it is so.
        self.down: str | None = None

    @classmethod
    async def connect(cls, url: str, clock: Callable[[], float] = time.time) -> RedisUsageStore:
        """A store on the Redis at ``url``, checked and this process's holder key set
        (``RedisUnusable`` with the reason otherwise)."""
        try:
            client = aioredis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)
        except ValueError as e:  # not a redis://, rediss:// or unix:// URL
            raise RedisUnusable(f"not a Redis URL: {e}") from None
        store = cls(client, clock)
        try:
            await store.renew()
        except RedisError as e:
            await client.aclose()
            raise RedisUnusable(f"cannot reach it: {e}") from None
        return store

    def start(self) -> None:
        """Renew this process's holder key every ``HOLDER_RENEW_S`` until ``close``."""
        self._renewal = asyncio.get_running_loop().create_task(self._renew_forever())

    async def renew(self) -> None:
        await self.client.set(self._holder_key(self.holder), 1, ex=HOLDER_TTL_S)

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(HOLDER_RENEW_S)
            try:
                await self.renew()
                self.down = None
            except RedisError as e:
                self.down = str(e)
                logger.error("usage store: cannot renew this replica's holder key in Redis: %s", e)

    async def close(self) -> None:
        """Give back this process's slots and its holder key."""
        if self._renewal is not None:
            self._renewal.cancel()
        try:
            for key in self._keys:
                await self.client.hdel(self._flight_key(key), self.holder)
            await self.client.delete(self._holder_key(self.holder))
        except RedisError as e:
            logger.error("usage store: this replica's slots expire with its holder key: %s", e)
        finally:
            await self.client.aclose()

    async def admit(
        self, key: str, limits: KeyLimits, *, requests: int = 1, chars: int = 0, slot: bool = True
    ) -> Refusal | None:
        """As ``UsageStore.admit``: spend ``requests`` and ``chars`` of ``key``'s windows and take one
        of its slots if ``slot``; or spend nothing and say why not. Raises ``RedisError``."""
        spending = Spending.of(limits, requests, chars, slot)
        if not isinstance(spending, Spending):
            return spending
        try:
            refusal = await self._decide(key, limits, spending, requests, chars)
        except RedisError as e:
            self.down = str(e)
            raise
        self.down = None
        return refusal

    async def _decide(
        self, key: str, limits: KeyLimits, spending: Spending, requests: int, chars: int
    ) -> Refusal | None:
        windows, take_slot = spending.windows, spending.take_slot
        await self._release_pending()
        args: list[Any] = [repr(self.clock()), int(take_slot), limits.max_concurrent, self.holder]
        for w in windows:
            args += [w.grain_s, w.period_s, w.limit, w.cost(requests, chars)]
        keys = [self._flight_key(key), self._holder_key("")]
        keys += [f"{PREFIX}u:{key}:{w.grain_s}:{w.unit}" for w in windows]
        answer = await self._admit(keys=keys, args=args)
        if answer:
            index, retry_after = int(answer[0]), int(answer[1])
            if index == 0:
                return Refusal.concurrency(limits.max_concurrent)
            window = windows[index - 1]
            return Refusal(window.name, window.describe(), retry_after)
        if take_slot:
            self._keys.add(key)
        return None

    async def release(self, key: str) -> None:
        """Give back a slot that ``admit`` took for ``key`` (later, if Redis cannot be reached now)."""
        try:
            await self._release(keys=[self._flight_key(key)], args=[self.holder, 1])
        except RedisError as e:
            logger.error("usage store: a slot of %s is given back later: %s", key, e)
            self._unreleased[key] += 1

    async def _release_pending(self) -> None:
        while self._unreleased:
            key, count = next(iter(self._unreleased.items()))
            await self._release(keys=[self._flight_key(key)], args=[self.holder, count])
            del self._unreleased[key]

    async def used(self, key: str, window: Window) -> int:
        """As ``UsageStore.used``: what ``key`` has spent of ``window`` now, spending nothing. Raises
        ``RedisError``."""
        oldest = math.floor((self.clock() - window.period_s) / window.grain_s)
        buckets = await self.client.hgetall(f"{PREFIX}u:{key}:{window.grain_s}:{window.unit}")
        return sum(int(amount) for bucket, amount in buckets.items() if int(bucket) >= oldest)

    async def in_flight(self, key: str) -> int:
        """``key``'s requests in flight in every live replica."""
        return int(
            await self._in_flight(keys=[self._flight_key(key), self._holder_key("")], args=[self.holder])
        )

    @staticmethod
    def _flight_key(key: str) -> str:
        return f"{PREFIX}f:{key}"

    @staticmethod
    def _holder_key(holder: str) -> str:
        return f"{PREFIX}h:{holder}"
