"""API keys and their limits, enforced in one place for /translate, /detect and /translate_file.

A route calls ``admit_key`` once it has read the api_key and the texts: 403 for a missing or
unknown key, 400 for a text longer than the key's ``char_limit`` (LibreTranslate's answer, in its
words), 413 for a request that the key's budget could never hold (a list of more texts than its
requests per minute: waiting would not help), 429 with ``Retry-After`` and
``{"error": "Slowdown: ..."}`` (LibreTranslate's body) for one over a budget now. An admitted
request is counted (``app.usage``), and holds one of its key's concurrency slots until it ends,
however it ends: ``release_key`` runs in ``app.main.TranslationApp`` after the response, an
error, a client gone or a cancellation alike. /translate_file learns its characters only once the
file is read: ``charge_key`` spends them then (429 if they do not fit).

Without keys configured nothing here runs; a key without counted limits never touches the store.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import HTTPException, Request
from prometheus_client import Counter, Gauge
from starlette.types import Scope

from app.config import Settings
from app.deps import NOT_READY
from app.keys import ApiKey, Keys, KeysError, load_keys
from app.metrics import Metrics
from app.usage import Refusal, UsageStore

logger = logging.getLogger("uvicorn.error").getChild("nmt")

LEASE_KEY = "nmt.key"  # in the scope: the admitted request's ``Lease``, until ``release_key``
STORE_BUSY_RETRY_S = "1"


@dataclass(frozen=True)
class KeyMetrics:
    """One key's metric children, made once: a request records without looking labels up."""

    admitted: Counter
    characters: Counter
    in_flight: Gauge


class KeyLimiter:
    """The accepted keys, the store that counts their usage (None when no key has a counted limit)
    and their metrics."""

    def __init__(self, keys: Keys, store: UsageStore | None, metrics: Metrics) -> None:
        self.keys, self.store, self.metrics = keys, store, metrics
        self._of = {
            key.name: KeyMetrics(
                metrics.key_requests.labels(key.name),
                metrics.key_characters.labels(key.name),
                metrics.key_in_flight.labels(key.name),
            )
            for key in keys
        }

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

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

    def spend(self, key: ApiKey, requests: int, chars: int, slot: bool) -> None:
        """Count the request in its key's windows, taking a slot if ``slot`` (4xx if it does not fit)."""
        if self.store is None or not key.limits.counted:
            return
        try:
            refusal = self.store.admit(key.name, key.limits, requests=requests, chars=chars, slot=slot)
        except sqlite3.Error as e:
            logger.error("usage store: cannot count a request of %s: %s", key.name, e)
            raise HTTPException(
                503,
                "cannot count this request against its api_key's limits now; retry later",
                {"Retry-After": STORE_BUSY_RETRY_S},
            ) from e
        if refusal is not None:
            self.limited(key, refusal.limit)
            raise refusal_error(refusal)

    def limited(self, key: ApiKey, limit: str) -> None:
        self.metrics.key_limited.labels(key.name, limit).inc()

    def of(self, key: ApiKey) -> KeyMetrics:
        return self._of[key.name]


@dataclass(frozen=True)
class Lease:
    """An admitted request's key, and whether it holds one of the key's concurrency slots."""

    limiter: KeyLimiter
    key: ApiKey
    slot: bool


def refusal_error(refusal: Refusal) -> HTTPException:
    if refusal.retry_after_s is None:
        return HTTPException(
            413,
            f"request too large for this API key: it may use {refusal.description} ({refusal.limit}), "
            "fewer than this request alone",
        )
    return HTTPException(
        429,
        f"Slowdown: {refusal.description} ({refusal.limit})",
        {"Retry-After": str(refusal.retry_after_s)},
    )


def open_key_limiter(settings: Settings, metrics: Metrics) -> KeyLimiter:
    """The keys of ``settings`` and, if any has a counted limit, the store in ``NMT_DATA_DIR``
    (``KeysError`` with a one-line reason for anything unusable)."""
    keys = load_keys(settings)
    store = None
    if keys.counted:
        try:
            store = UsageStore(settings.data_dir)
        except (OSError, sqlite3.Error) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise KeysError(
                f"NMT_DATA_DIR ({settings.data_dir}): cannot keep the keys' usage there: {reason}"
            ) from e
    return KeyLimiter(keys, store, metrics)


def limiter_of(request: Request) -> KeyLimiter:
    limiter: KeyLimiter | None = request.app.state.keys
    if limiter is None:  # before the lifespan has read the keys
        raise HTTPException(503, NOT_READY)
    return limiter


def admit_key(request: Request, api_key: str | None, *, requests: int, text_lengths: Sequence[int]) -> None:
    """Let the request in under ``api_key``'s limits, or raise the answer that says why not.

    ``requests``: what the request counts as (LibreTranslate's cost: one per text of a list q);
    ``text_lengths``: the characters of each of its texts (none yet for a file: ``charge_key``)."""
    limiter = limiter_of(request)
    if not limiter.keys:
        return
    key = limiter.authenticate(api_key)
    limiter.check_texts(key, text_lengths)
    chars = sum(text_lengths)
    slot = key.limits.max_concurrent > 0
    limiter.spend(key, requests, chars, slot)
    request.scope[LEASE_KEY] = Lease(limiter, key, slot)
    metrics = limiter.of(key)
    metrics.in_flight.inc()
    metrics.admitted.inc()
    metrics.characters.inc(chars)


def charge_key(request: Request, chars: int) -> None:
    """Spend ``chars`` more of the admitted request's key (a file's text, once read): 400 over the
    key's ``char_limit``, 413 or 429 as ``admit_key``."""
    lease: Lease | None = request.scope.get(LEASE_KEY)
    if lease is None:  # no keys configured
        return
    lease.limiter.check_texts(lease.key, [chars])
    lease.limiter.spend(lease.key, 0, chars, slot=False)
    lease.limiter.of(lease.key).characters.inc(chars)


def release_key(scope: Scope) -> None:
    """The request has ended: give back its key's slot. A second call does nothing."""
    lease: Lease | None = scope.pop(LEASE_KEY, None)
    if lease is None:
        return
    lease.limiter.of(lease.key).in_flight.dec()
    if lease.slot and lease.limiter.store is not None:
        lease.limiter.store.release(lease.key.name)


def key_owner(request: Request) -> str:
    """Whose stored glossaries and memory the admitted request may use: its API key's name, or ""
    without keys configured (``admit_key`` has run)."""
    lease: Lease | None = request.scope.get(LEASE_KEY)
    return "" if lease is None else lease.key.name


def charge_owner(limiter: KeyLimiter, owner: str, chars: int) -> None:
    """Spend ``chars`` of the key named ``owner`` (a document job's text, read after its request
    was answered): 400 over the key's ``char_limit``, 413 or 429 as ``admit_key``; nothing without
    keys, or for a key no longer configured."""
    key = next((k for k in limiter.keys if k.name == owner), None)
    if key is None:
        return
    limiter.check_texts(key, [chars])
    limiter.spend(key, 0, chars, slot=False)
    limiter.of(key).characters.inc(chars)
