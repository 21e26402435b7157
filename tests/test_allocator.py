"""model.runtime.allocator: on glibc, large blocks come from the heap (not mmap) once the policy is set."""

from __future__ import annotations

import ctypes
import platform
import threading

import pytest
import torch

from model.runtime.allocator import keep_freed_memory

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc policy; no-op elsewhere")


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def mmapped_bytes() -> int:
    """Bytes glibc currently holds in mmap'ed blocks (``mallinfo2().hblkhd``)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().hblkhd)


def test_large_tensors_come_from_the_heap_in_worker_threads() -> None:
    assert keep_freed_memory()
    assert keep_freed_memory()  # idempotent
    grew: list[int] = []

    def allocate() -> None:  # the engine decodes in its own thread
        before = mmapped_bytes()
        block = torch.zeros(3, 2, 48, 4, 128, 64)  # 38 MB: a 48-row cache of the shipped model
        grew.append(mmapped_bytes() - before)
        del block

    worker = threading.Thread(target=allocate)
    worker.start()
    worker.join()
    # With glibc's defaults this block is mmap'ed (and unmapped again when freed, so that the next
    # one page-faults all over); with the policy it is served from the heap and kept.
    assert grew == [0]
