"""The KV cache's row copies on the CPU in C (``csrc/kvrows.cpp``): a step's new keys/values
written at each row's next position (``KVCache.advance``) and rows taking other rows' decoded
prefixes (beam reorders, rows moving into the places of rows that left: ``KVCache._copy``).

From Python each was a strided ``copy_`` per row, or ATen's ``index_copy_``, which writes the
cache's vectors an element at a time; here one call copies them all, releasing the GIL for it as
torch's copies do (ctypes). The same bytes land in the same places either way (tested:
``tests/test_model.py``).
On a 64-row cache (2-vCPU AMD EPYC, avx512_vnni, one thread, warm / caches flushed): a step's
writes 0.10 / 0.27 -> 0.034 / 0.11 ms for the shipped model, 0.55 / 1.07 -> 0.11 / 0.28 ms at
OPUS-MT size; a beam-5 reorder with 52 rows taking another parent 0.72 / 1.07 -> 0.32 / 0.71 ms
(shipped), 2.43 / 3.16 -> 1.29 / 1.99 ms (OPUS-MT size). The decoding loop's CPU time:
``benchmarks.kv_rows``, BENCHMARKS.md.

Built once per source into ``cache_dir`` without torch's headers (``shims.build``; ~0.5 s), on a
thread of its own at a runner's first load (``ensure_beside``); a cache made before it is loaded,
or where it cannot be built (no compiler, an unwritable cache), copies from Python as before.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from torch import Tensor

from model.runtime import shims

SOURCE = Path(__file__).parent / "csrc" / "kvrows.cpp"

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_kernels: NativeRows | None = None


class NativeRows:
    """``model.cache.RowKernels`` over the library's two functions."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._write = library.nmt_kv_write_next
        self._write.restype = None
        self._write.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr]
        self._take = library.nmt_kv_take_prefixes
        self._take.restype = None
        self._take.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]

    @staticmethod
    def _layout(kv: Tensor) -> tuple[int, int, int, int]:
        """(row, block, blocks, vector) of ``kv`` (R, L, 2, H, P, Dh), contiguous: row and block
        strides and the vector's size in bytes, and the blocks (L x 2 x H) a row holds."""
        if not kv.is_contiguous() or kv.device.type != "cpu":
            raise ValueError("the native row copies take a contiguous cache on the CPU")
        size = kv.element_size()
        return (
            kv.stride(0) * size,
            kv.stride(3) * size,
            kv.size(1) * kv.size(2) * kv.size(3),
            kv.size(5) * size,
        )

    def write_next(self, kv: Tensor, new: Tensor, lengths: Tensor) -> None:
        """Row r of ``new`` (R, L, 2, H, Dh) written into ``kv`` at position ``lengths[r]``."""
        row, block, blocks, vector = self._layout(kv)
        new = new.contiguous()
        assert new.dtype == kv.dtype and new.numel() * new.element_size() == new.size(0) * blocks * vector
        assert lengths.is_contiguous() and lengths.numel() >= new.size(0)
        self._write(
            kv.data_ptr(), row, block, blocks, vector, new.size(0), new.data_ptr(), lengths.data_ptr()
        )

    def take_prefixes(self, kv: Tensor, dst: list[int], src: list[int], lengths: Tensor) -> None:
        """Row ``dst[i]`` of ``kv`` takes the first ``lengths[src[i]]`` positions of row
        ``src[i]``, as they were before any of the copies."""
        if not dst:
            return
        row, block, blocks, vector = self._layout(kv)
        assert lengths.is_contiguous() and lengths.numel() > max(*dst, *src)
        pairs = len(dst)
        self._take(
            kv.data_ptr(),
            row,
            block,
            blocks,
            vector,
            pairs,
            (_i64 * pairs)(*dst),
            (_i64 * pairs)(*src),
            lengths.data_ptr(),
        )


def _declare(library: ctypes.CDLL) -> None:
    global _kernels
    _kernels = NativeRows(library)


_LIBRARY = shims.Standalone(
    "kvrows", SOURCE, what="the cache's row-copy library", instead="copying from Python", loaded=_declare
)


def ensure(cache_dir: Path) -> bool:
    """Build the library into ``cache_dir`` unless it is there, and load it (once per process);
    whether that worked. Where it did not, says why once: caches copy from Python."""
    return _LIBRARY.ensure(cache_dir)


def ensure_beside(cache_dir: Path) -> threading.Thread:
    """``ensure`` on a thread of its own, started."""
    return _LIBRARY.ensure_beside(cache_dir)


def kernels() -> NativeRows | None:
    """The loaded row copies, or None (not built yet, or not buildable here)."""
    return _kernels
