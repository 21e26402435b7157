"""model.runtime.allocator: on glibc, large blocks come from the heap (not mmap) once the policy is set,
and what was freed goes back to the OS when released."""

from __future__ import annotations

import ctypes
import os
import platform
import threading

import pytest
import torch

from model.runtime.allocator import keep_freed_memory, release_freed_memory

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


def heap_free_bytes() -> int:
    """Bytes free inside glibc's heap (``mallinfo2().fordblks``): freed, kept, still resident."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    return int(libc.mallinfo2().fordblks)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_memory_kept_for_reuse_goes_back_to_the_os_when_released() -> None:
    assert keep_freed_memory()
    blocks = [torch.ones(256, 1024) for _ in range(200)]  # 200 MB in 1 MB blocks, from the heap
    del blocks
    kept = resident_bytes()
    assert heap_free_bytes() > 150 << 20  # freed, kept by the process for reuse
    assert release_freed_memory()
    assert resident_bytes() < kept - (150 << 20)  # given back
