"""API keys and their limits, enforced in one place for every route that takes a key.

The key may come before the body: in a header (``Authorization: Bearer KEY``,
``Authorization: DeepL-Auth-Key KEY`` as DeepL's clients send it, or ``X-API-Key: KEY``) or the
``api_key`` query parameter. ``admit_given_key`` checks it then,
before a byte of the body is read (the routes call it first thing, ``app.http.endpoints.access``): 403
for an unknown key, 429 for one over a limit, so that a stranger cannot hold an upload's place or
memory with a key that would be refused anyway. The request counts as one request then; once the
body is read ``admit_key`` counts the rest (the texts of a list ``q`` beyond the first, the
characters) and answers 400 when the body's ``api_key`` field names another key.

Otherwise the key is the body's ``api_key`` field (LibreTranslate's clients send it there), and a
route calls ``admit_key`` once it has read the api_key and the texts: 403 for a missing or
unknown key, 400 for a text longer than the key's ``char_limit`` (LibreTranslate's answer, in its
words), 413 for a request that the key's budget could never hold (a list of more texts than its
requests per minute: waiting would not help), 429 with ``Retry-After`` and
``{"error": "Slowdown: ..."}`` (LibreTranslate's body) for one over a budget now. An admitted
request is counted (``app.keys.usage``; ``app.keys.usage_redis`` with ``NMT_REDIS_URL``), and holds one of
its key's concurrency slots until it ends, however it ends: ``release_key`` runs in
``app.http.entry.TranslationApp`` after the response, an error, a client gone or a cancellation alike.
/translate_file learns its characters only once the file is read: ``charge_key`` spends them then
(429 if they do not fit).

Without keys configured nothing here runs; a key without counted limits never touches the store.
Metrics per key (``nmt_key_*``, labelled with the keys' names) are recorded only with
``NMT_KEY_METRICS=true``: /metrics needs no key, and would otherwise tell anyone the keys' names
and how much each one uses.

Without keys, the stores that every client would share (stored glossaries, the translation
memory, the list of jobs) are off unless ``NMT_SHARED_STORES`` is true: ``stores_on`` says which,
``store_owner`` answers 403 for them.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fastapi import HTTPException, Request
from starlette.types import Scope

from app.config import Settings, stores_on
from app.keys.accepted import ApiKey, Keys, KeysError, load_keys
from app.keys.usage import Refusal, UsageStore
from app.keys.usage_redis import RedisError, RedisUnusable, RedisUsageStore
from app.monitoring.metrics import Metrics

logger = logging.getLogger("uvicorn.error").getChild("nmt")

LEASE_KEY = "nmt.key"  # in the scope: the admitted request's ``Lease``, until ``release_key``
STORE_BUSY_RETRY_S = "1"
STORES_OFF = (
    "stored glossaries, translation memories and the list of jobs need an API key; this server has "
    "none (its operator may share one set among all clients with NMT_SHARED_STORES=true)"
)
KEY_HEADER = "X-API-Key"
# The schemes of ``Authorization`` that carry one of our keys: OAuth's, and DeepL's (its clients
# send nothing else, so that DeepL's API on this service takes the same keys).
KEY_SCHEMES = frozenset({"bearer", "deepl-auth-key"})


class Count(Protocol):
    """A counter's child (prometheus_client's), or ``Uncounted``."""

    def inc(self, amount: float = 1) -> None: ...


class Level(Count, Protocol):
    """A gauge's child, or ``Uncounted``."""

    def dec(self, amount: float = 1) -> None: ...


class Uncounted:
    """What a key records when per-key metrics are off: nothing."""

    def inc(self, amount: float = 1) -> None:
        pass

    def dec(self, amount: float = 1) -> None:
        pass


@dataclass(frozen=True)
class KeyMetrics:
    """One key's metric children, made once: a request records without looking labels up."""

    admitted: Count
    characters: Count
    in_flight: Level


UNCOUNTED = KeyMetrics(Uncounted(), Uncounted(), Uncounted())


class KeyLimiter:
    """The accepted keys, the store that counts their usage (None when no key has a counted limit)
    and their metrics (``per_key``: recorded; else none, not even a series at 0)."""

    def __init__(
        self, keys: Keys, store: UsageStore | RedisUsageStore | None, metrics: Metrics, per_key: bool = False
    ) -> None:
        self.keys, self.store, self.metrics, self.per_key = keys, store, metrics, per_key
        self._of = {
            key.name: KeyMetrics(
                metrics.key_requests.labels(key.name),
                metrics.key_characters.labels(key.name),
                metrics.key_in_flight.labels(key.name),
            )
            if per_key
            else UNCOUNTED
            for key in keys
        }

    async def close(self) -> None:
        if isinstance(self.store, RedisUsageStore):
            await self.store.close()
        elif self.store is not None:
            self.store.close()

    def unavailable(self) -> str | None:
        """Why the keys' usage cannot be counted now (their Redis was unreachable at the last
        attempt), or None."""
        if isinstance(self.store, RedisUsageStore) and self.store.down is not None:
            return f"the keys' usage store (NMT_REDIS_URL) is unreachable: {self.store.down}"
        return None

    def authenticate(self, api_key: str | None) -> ApiKey:
        if not api_key:
            raise HTTPException(403, "an api_key is required")
        key = self.keys.find(api_key)
        if key is None:
            raise HTTPException(403, "invalid api_key")
        return key

    def check_texts(self, key: ApiKey, lengths: Sequence[int]) -> None:
        limit = key.limits.char_limit
        longest = max(lengths, default=0)
        if limit and longest > limit:
            self.limited(key, "char_limit")
            raise HTTPException(400, f"Invalid request: request ({longest}) exceeds text limit ({limit})")

    async def spend(self, key: ApiKey, requests: int, chars: int, slot: bool) -> None:
        """Count the request in its key's windows, taking a slot if ``slot`` (4xx if it does not fit)."""
        if self.store is None or not key.limits.counted:
            return
        try:
            if isinstance(self.store, RedisUsageStore):
                refusal = await self.store.admit(
                    key.name, key.limits, requests=requests, chars=chars, slot=slot
                )
            else:
                refusal = self.store.admit(key.name, key.limits, requests=requests, chars=chars, slot=slot)
        except (sqlite3.Error, RedisError) as e:
            logger.error("usage store: cannot count a request of %s: %s", key.name, e)
            raise HTTPException(
                503,
                "cannot count this request against its api_key's limits now; retry later",
                {"Retry-After": STORE_BUSY_RETRY_S},
            ) from e
        if refusal is not None:
            self.limited(key, refusal.limit)
            raise refusal_error(refusal)

    async def characters(self, key: ApiKey) -> tuple[int, int] | None:
        """What ``key`` has spent of its longest character window (a day's, else a minute's) and
        that window's limit; None when no window counts its characters. Spends nothing."""
        windows = [w for w in key.limits.windows if w.unit == "chars"]
        if self.store is None or not windows:
            return None
        window = max(windows, key=lambda w: w.period_s)
        try:
            if isinstance(self.store, RedisUsageStore):
                used = await self.store.used(key.name, window)
            else:
                used = self.store.used(key.name, window)
        except (sqlite3.Error, RedisError) as e:
            logger.error("usage store: cannot read the usage of %s: %s", key.name, e)
            raise HTTPException(
                503, "cannot read this API key's usage now; retry later", {"Retry-After": STORE_BUSY_RETRY_S}
            ) from e
        return used, window.limit

    def limited(self, key: ApiKey, limit: str) -> None:
        if self.per_key:
            self.metrics.key_limited.labels(key.name, limit).inc()

    def of(self, key: ApiKey) -> KeyMetrics:
        return self._of[key.name]


@dataclass(frozen=True)
class Lease:
    """An admitted request's key, and whether it holds one of the key's concurrency slots;
    ``given``: where the key came from when it was admitted before the body (a header, the query),
    else None."""

    limiter: KeyLimiter
    key: ApiKey
    slot: bool
    given: str | None = None


@dataclass(frozen=True)
class GivenKey:
    key: str
    where: str  # "the X-API-Key header", for messages


def given_key(request: Request) -> GivenKey | None:
    """The key the request gives before its body: ``Authorization: Bearer KEY`` (or DeepL's
    ``DeepL-Auth-Key KEY``), ``X-API-Key: KEY`` or ``?api_key=KEY`` (400 if they name different
    keys; an empty one is none)."""
    found: list[GivenKey] = []
    scheme, _, credentials = request.headers.get("authorization", "").strip().partition(" ")
    if scheme.lower() in KEY_SCHEMES and credentials.strip():  # another scheme is some proxy's: not ours
        found.append(GivenKey(credentials.strip(), "the Authorization header"))
    for value in request.headers.getlist(KEY_HEADER):
        if value.strip():
            found.append(GivenKey(value.strip(), f"the {KEY_HEADER} header"))
    for value in request.query_params.getlist("api_key"):
        if value.strip():
            found.append(GivenKey(value.strip(), "the api_key query parameter"))
    for other in found[1:]:
        if other.key != found[0].key:
            raise HTTPException(400, f"{found[0].where} and {other.where} give different API keys")
    return found[0] if found else None


class LimitRefused(HTTPException):
    """A request over one of its key's limits: ``limit`` names it (``chars_per_day``...), so that
    an API with other words for it can tell a used-up quota from a rate (DeepL's 456 and 429:
    ``app.http.endpoints.deepl.errors``)."""

    def __init__(
        self, status_code: int, detail: str, limit: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(status_code, detail, headers)
        self.limit = limit


def refusal_error(refusal: Refusal) -> LimitRefused:
    if refusal.retry_after_s is None:
        return LimitRefused(
            413,
            f"request too large for this API key: it may use {refusal.description} ({refusal.limit}), "
            "fewer than this request alone",
            refusal.limit,
        )
    return LimitRefused(
        429,
        f"Slowdown: {refusal.description} ({refusal.limit})",
        refusal.limit,
        {"Retry-After": str(refusal.retry_after_s)},
    )


async def open_key_limiter(settings: Settings, metrics: Metrics) -> KeyLimiter:
    """The keys of ``settings`` and, if any has a counted limit, the store that counts them: the
    Redis of ``NMT_REDIS_URL``, else a SQLite file in ``NMT_DATA_DIR`` (``KeysError`` with a one-line
    reason for anything unusable)."""
    keys = load_keys(settings)
    store: UsageStore | RedisUsageStore | None = None
    if keys.counted and settings.redis_url:
        try:
            store = await RedisUsageStore.connect(settings.redis_url)
        except RedisUnusable as e:
            raise KeysError(f"NMT_REDIS_URL: cannot keep the keys' usage there: {e}") from e
        store.start()
    elif keys.counted:
        try:
            store = UsageStore(settings.data_dir)
        except (OSError, sqlite3.Error) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise KeysError(
                f"NMT_DATA_DIR ({settings.data_dir}): cannot keep the keys' usage there: {reason}"
            ) from e
    return KeyLimiter(keys, store, metrics, per_key=settings.key_metrics)


async def admit_given_key(request: Request, limiter: KeyLimiter, given: GivenKey | None = None) -> None:
    """Admit the request under the key of its headers or query (``given_key``; or ``given``, a
    form's field read before its file), before its body is read: 403 for an unknown key, 429
    (``Retry-After``) over a limit; it counts as one request and takes the key's concurrency slot.
    Nothing without keys configured, without such a key, or once admitted."""
    if not limiter.keys or LEASE_KEY in request.scope:
        return
    given = given or given_key(request)
    if given is None:
        return
    key = limiter.authenticate(given.key)
    slot = key.limits.max_concurrent > 0
    await limiter.spend(key, 1, 0, slot)
    request.scope[LEASE_KEY] = Lease(limiter, key, slot, given.where)
    metrics = limiter.of(key)
    metrics.in_flight.inc()
    metrics.admitted.inc()


async def admit_key(
    request: Request, limiter: KeyLimiter, api_key: str | None, *, requests: int, text_lengths: Sequence[int]
) -> None:
    """Let the request in under ``api_key``'s limits, or raise the answer that says why not.

    ``requests``: what the request counts as (LibreTranslate's cost: one per text of a list q);
    ``text_lengths``: the characters of each of its texts (none yet for a file: ``charge_key``).
    A request ``admit_given_key`` admitted spends the rest here (its first request was spent
    then); its body's ``api_key``, if any, must be the same key (else 400)."""
    if not limiter.keys:
        return
    chars = sum(text_lengths)
    lease: Lease | None = request.scope.get(LEASE_KEY)
    if lease is not None and lease.given is not None:
        if api_key and limiter.keys.find(api_key) != lease.key:
            raise HTTPException(400, f"the api_key field is not the key given in {lease.given}: send one key")
        limiter.check_texts(lease.key, text_lengths)
        await limiter.spend(lease.key, max(0, requests - 1), chars, slot=False)
        limiter.of(lease.key).characters.inc(chars)
        return
    key = limiter.authenticate(api_key)
    limiter.check_texts(key, text_lengths)
    slot = key.limits.max_concurrent > 0
    await limiter.spend(key, requests, chars, slot)
    request.scope[LEASE_KEY] = Lease(limiter, key, slot)
    metrics = limiter.of(key)
    metrics.in_flight.inc()
    metrics.admitted.inc()
    metrics.characters.inc(chars)


async def charge_key(request: Request, chars: int) -> None:
    """Spend ``chars`` more of the admitted request's key (a file's text, once read): 400 over the
    key's ``char_limit``, 413 or 429 as ``admit_key``."""
    lease: Lease | None = request.scope.get(LEASE_KEY)
    if lease is None:  # no keys configured
        return
    lease.limiter.check_texts(lease.key, [chars])
    await lease.limiter.spend(lease.key, 0, chars, slot=False)
    lease.limiter.of(lease.key).characters.inc(chars)


async def release_key(scope: Scope) -> None:
    """The request has ended: give back its key's slot. A second call does nothing."""
    lease: Lease | None = scope.pop(LEASE_KEY, None)
    if lease is None:
        return
    lease.limiter.of(lease.key).in_flight.dec()
    store = lease.limiter.store
    if lease.slot and isinstance(store, RedisUsageStore):
        # Shielded: a request cancelled while its slot goes back still gives it back.
        await asyncio.shield(store.release(lease.key.name))
    elif lease.slot and store is not None:
        store.release(lease.key.name)


def admitted_key(request: Request) -> ApiKey | None:
    """The key the request was admitted under (None without keys configured: ``admit_key`` has run)."""
    lease: Lease | None = request.scope.get(LEASE_KEY)
    return None if lease is None else lease.key


def min_confidence(request: Request, settings: Settings, asked: float | None) -> float | None:
    """The confidence threshold of an admitted request: the one it ``asked`` for, else its key's
    ``min_confidence``, else the service's (``NMT_MIN_CONFIDENCE``; None: no threshold)."""
    if asked is not None:
        return asked
    key = admitted_key(request)
    if key is not None and key.min_confidence is not None:
        return key.min_confidence
    return settings.min_confidence


def key_owner(request: Request) -> str:
    """Whose jobs, stored glossaries and memory the admitted request's are: its API key's name, or
    "" without keys configured (``admit_key`` has run)."""
    lease: Lease | None = request.scope.get(LEASE_KEY)
    return "" if lease is None else lease.key.name


def client_identity(request: Request) -> str:
    """Whose share of what the front end keeps for a while (translated files waiting for their
    download, recent translations in the segment cache) the request uses: its API key's
    (``key_owner``), or without keys its client's address. Without keys nothing else tells
    strangers apart, and one shared cache would let each learn from the time of an answer what
    another translated recently."""
    owner = key_owner(request)
    if owner:
        return key_identity(owner)
    return f"address {request.client.host if request.client else ''}"


def key_identity(owner: str) -> str:
    """``client_identity`` of what is done for the key named ``owner`` (a request, a job)."""
    return f"key {owner}"


def check_stores(limiter: KeyLimiter, settings: Settings) -> None:
    """403 before anything is read when the service has no keys and does not share its stores."""
    if not limiter.keys and not settings.shared_stores:
        raise HTTPException(403, STORES_OFF)


def store_owner(request: Request, settings: Settings) -> str:
    """``key_owner``, for a use of the stores: 403 where ``stores_on`` says they are off."""
    owner = key_owner(request)
    if not stores_on(settings, owner):
        raise HTTPException(403, STORES_OFF)
    return owner


async def charge_owner(limiter: KeyLimiter, owner: str, chars: int) -> None:
    """Spend ``chars`` of the key named ``owner`` (a document job's text, read after its request
    was answered): 400 over the key's ``char_limit``, 413 or 429 as ``admit_key``; nothing without
    keys, or for a key no longer configured."""
    key = next((k for k in limiter.keys if k.name == owner), None)
    if key is None:
        return
    limiter.check_texts(key, [chars])
    await limiter.spend(key, 0, chars, slot=False)
    limiter.of(key).characters.inc(chars)
