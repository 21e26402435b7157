"""The routes' calls to the stores (SQLite, the jobs' files): on a thread, so that the disk never
holds the event loop, and a store that cannot be used now answered 503 with Retry-After, naming
the store but not the file or the database's words, which are logged for the operator
(``app.stores.database.errors.unavailable``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, TypeVarTuple

from app.http.errors import unavailable
from app.stores.database.errors import StoreUnavailable

R = TypeVar("R")
Ts = TypeVarTuple("Ts")


@dataclass(frozen=True)
class StoreCalls:
    """Calls to one store: ``await calls(store.get, owner, id)`` is ``store.get(owner, id)``."""

    what: str  # the store, as the 503 names it ("the job store")
    retry_after_s: str

    async def __call__(self, call: Callable[[*Ts], R], *args: *Ts) -> R:
        try:
            return await asyncio.to_thread(call, *args)
        except StoreUnavailable as e:
            raise unavailable(e, self.what, self.retry_after_s) from e
