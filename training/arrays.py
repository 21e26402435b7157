"""One-dimensional arrays in files, read on demand: what a prepared corpus is made of.

A ``DiskArray`` reads only the slice asked for, with one positioned read (``os.pread``), into a
fresh numpy array; nothing of the file is kept by the process, and the kernel's page cache keeps
recently read pages for the next reader. Not a memory map: its pages count in the process's
resident memory once touched, and on current kernels a fault maps a whole large page-cache folio,
not a page: building one batch of a 5 M-pair corpus maps 60-85 MB of the files (~1.3 MB per pair
read), so the trainer's peak memory would depend on the corpus' size and on when mapped pages are
let go of. Positioned reads cost ~5 syscalls per pair (~1 ms a batch).
"""

from __future__ import annotations

import operator
import os
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Sliceable(Protocol):
    """What batching needs of a per-pair array: its length and contiguous slices."""

    def __len__(self) -> int: ...

    def __getitem__(self, key: slice) -> np.ndarray: ...


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """Token ids in 2 bytes where the vocabulary allows it."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


class DiskArray:
    """A read-only 1-D array of ``dtype`` stored raw in ``path``."""

    def __init__(self, path: str | Path, dtype: Any) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._len = os.fstat(self._fd).st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: slice) -> np.ndarray:
        start, stop, step = key.indices(self._len)
        if step != 1:
            raise ValueError("DiskArray reads contiguous slices only")
        n = max(0, stop - start) * self.dtype.itemsize
        data = os.pread(self._fd, n, start * self.dtype.itemsize)
        if len(data) != n:
            raise OSError(f"{self.path}: short read ({len(data)} of {n} bytes): truncated file?")
        return np.frombuffer(data, self.dtype)

    def item(self, i: int) -> int:
        i = operator.index(i)
        if not 0 <= i < self._len:
            raise IndexError(f"{self.path}: index {i} out of range ({self._len})")
        return int(self[i : i + 1][0])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()
