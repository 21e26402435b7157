"""A bounded cache of recent sentence translations, in the front end's memory.

A page header, a footer, a boilerplate sentence come back request after request; each is decoded
once and then answered from here, costing a dictionary lookup instead of a worker's time. Keys are
whatever identifies one translation exactly (the contract: model route, beam size, n-best,
constraints, sentence), values what the caller needs back; neither is interpreted here.

Least recently used entries are evicted once the entries' bytes exceed ``max_bytes``
(``NMT_SEGMENT_CACHE_MB``; 0 turns the cache off: nothing stored, nothing counted). Bytes are
accounted as ``sys.getsizeof`` of the key's and value's parts plus a fixed overhead per entry
(the dictionary's slot and the list node): approximate, but proportional to what the entries
really hold, which is what a memory limit needs.

Used from the event loop (no await inside, so each call is atomic there); a lock makes it safe
from a thread too (``asyncio.to_thread``), for a few tens of nanoseconds a call.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

from app.monitoring.metrics import Metrics

V = TypeVar("V")
ENTRY_OVERHEAD_BYTES = 160  # an OrderedDict entry: hash table slot, linked-list node, the size int


def approximate_size(value: object) -> int:
    """Bytes of ``value`` and of what it holds (strings, numbers, tuples, lists, dicts, dataclass
    instances with ``__dict__`` or ``__slots__``): not shared objects' true cost, but a fair bound."""
    size = sys.getsizeof(value)
    if isinstance(value, str | bytes | int | float | bool) or value is None:
        return size
    if isinstance(value, tuple | list | frozenset | set):
        return size + sum(approximate_size(item) for item in value)
    if isinstance(value, dict):
        return size + sum(approximate_size(k) + approximate_size(v) for k, v in value.items())
    if hasattr(value, "__dict__"):
        return size + approximate_size(vars(value))
    slots = getattr(type(value), "__slots__", ())
    return size + sum(approximate_size(getattr(value, name, None)) for name in slots)


class SegmentCache(Generic[V]):
    """LRU of ``key -> value`` within ``max_bytes`` (module docstring)."""

    def __init__(self, max_bytes: int, metrics: Metrics | None = None) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = metrics.segment_cache_hits if metrics is not None else None
        self._misses = metrics.segment_cache_misses if metrics is not None else None
        self._bytes = metrics.segment_cache_bytes if metrics is not None else None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def get(self, key: Hashable) -> V | None:
        """The value stored under ``key`` (now the most recently used), or None; counted as a hit
        or a miss."""
        if not self.enabled:
            return None
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
        counter = self._hits if found is not None else self._misses
        if counter is not None:
            counter.inc()
        return None if found is None else found[0]

    def put(self, key: Hashable, value: V) -> None:
        """Store ``value`` under ``key``, evicting the least recently used entries past
        ``max_bytes``; an entry larger than the whole cache is not stored."""
        if not self.enabled:
            return
        size = ENTRY_OVERHEAD_BYTES + approximate_size(key) + approximate_size(value)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size <= self.max_bytes:
                self._entries[key] = (value, size)
                self.bytes += size
            while self.bytes > self.max_bytes:  # (also after max_bytes was lowered)
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
            current = self.bytes
        if self._bytes is not None:
            self._bytes.set(current)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
        if self._bytes is not None:
            self._bytes.set(0)
